"""A deadline for a request's headers on `dgemma serve`'s connections: the rule is that a connection which has not
sent a complete request line and headers within `seconds` is closed, so that clients trickling headers (or
sending nothing) cannot hold the server's sockets for ever.

uvicorn has no such timeout: its HTTP/1.1 protocols (h11's, or httptools' when installed) arm a keep-alive timer
only after a response, and cancel it at the first byte that arrives, so a connection that sends part of a request,
or nothing at all, is held as long as the client likes. `protocol(seconds)` makes a subclass of the protocol
uvicorn would pick itself (`uvicorn.Config(http=...)` takes it) that adds the deadline, counted from:

- the connection's opening, for its first request;
- the first byte of each later request on a keep-alive connection. Between requests an idle connection is
  uvicorn's, closed after its keep-alive timeout as before; the deadline starts when the next request does.

A request whose headers are complete is no longer timed here (its body and its answer take what they take). A
connection closed with part of a request received gets a 408 first (a client can tell why), in the error shape of
the API its path belongs to (guard.error_body: Ollama's on /api/*); one that sent nothing is just closed, as uvicorn
closes an idle keep-alive connection.
"""

from __future__ import annotations

import asyncio
import json

from .guard import error_body

DEFAULT_SECONDS = 10.0


def protocol(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's own choice of HTTP/1.1 protocol class, with the header deadline."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderDeadlineProtocol(AutoHTTPProtocol):  # type: ignore[valid-type, misc]
        header_seconds = seconds

        # Both of uvicorn's protocols set `self.cycle` to a new RequestResponseCycle once a request's headers are
        # parsed, and mark it `response_complete` when its answer has gone: that is what "waiting for headers"
        # is read from, whichever protocol this is.
        _header_timer: asyncio.TimerHandle | None = None
        _header_bytes = False  # bytes of the awaited request have arrived
        _header_start = b""  # its first bytes, up to its path: which API's shape a 408 takes

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self._waiting_for_headers():
                self._arm_header_timer()  # a later request on a keep-alive connection has begun
            if self._header_timer is not None:
                self._header_bytes = True
                if len(self._header_start) < START_BYTES:
                    self._header_start += data[:START_BYTES]
            super().data_received(data)
            if not self._waiting_for_headers() or self.transport.get_protocol() is not self:
                self._disarm_header_timer()  # headers complete, the connection closing, or handed on (upgrade)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _waiting_for_headers(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return not self.transport.is_closing() and (cycle is None or cycle.response_complete)

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_bytes = False
            self._header_start = b""
            self._header_timer = self.loop.call_later(self.header_seconds, self._header_deadline)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_deadline(self) -> None:
            self._header_timer = None
            if not self._waiting_for_headers():
                return
            if self._header_bytes:
                self.transport.write(_timeout_answer(self.header_seconds, _path(self._header_start)))
            self.transport.close()

    return HeaderDeadlineProtocol


START_BYTES = 256  # of a request kept while its headers are awaited: its request line's method and path


def _path(start: bytes) -> str:
    """The path in a request line's first bytes ("POST /api/chat HTTP/1.1..." -> "/api/chat"), "" if none yet."""
    parts = start.split(b"\r\n", 1)[0].split(b" ")
    return parts[1].split(b"?")[0].decode("latin-1") if len(parts) > 1 else ""


def _timeout_answer(seconds: float, path: str = "") -> bytes:
    """A 408 in the error shape of the API `path` belongs to; written raw, as the request it answers was never
    parsed."""
    body = json.dumps(error_body(path, 408, f"the request's headers did not arrive within {seconds:g} s",
                                 "request_timeout")).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)) + body
