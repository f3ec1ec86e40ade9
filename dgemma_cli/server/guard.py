"""Who may talk to `dgemma serve`, checked before a request reaches a route: an ASGI wrapper around the app.

The rule: this module knows HTTP headers, nothing of the model or the API's fields. Its threat is a web page the
user has open: a loopback server with no key is otherwise driven by any page the browser shows.

- Host: a page that rebinds its own DNS name to 127.0.0.1 reaches the server as a same-origin site and reads every
  answer; its requests carry its own name in `Host`. Only the names of the address the server is bound to (and
  `--allow-host` names) are answered; a server bound to every interface (which needs an API key) answers any.
- Origin: a browser names the page behind every cross-origin request (and every POST, cross-site form posts
  included). Only `--allow-origin` origins are answered, with the CORS headers that let their pages read the
  answer; a preflight (OPTIONS) is answered for them only. No origin is allowed by default: the server serves no
  pages of its own.
- Content-Type, OpenAI's routes (/v1/*): a POST must say `application/json`. A page can send `text/plain` (or a
  typeless body) without a preflight; requiring JSON's type makes every cross-origin POST ask first, and be refused.
  Every OpenAI client sends the type, so this second wall (for a browser that would leave Origin off) costs nothing.
- Content-Type, Ollama's routes (/api/*, and /): any type, or none, and the body is read as JSON, as Ollama reads
  it. Ollama asks for no type, so its clients (litellm's `ollama/` and `ollama_chat/`) and the `curl -d` of its
  docs (form-encoded) send none: a 415 would break them all. A page is kept out by the two checks above: a browser
  sends Origin on every cross-site POST, refused unless allowed, and a rebinding page's Host is refused. A
  request that carries no Origin but says (Sec-Fetch-Site) that another site's page made it is refused as well.
- Shapes: a refusal on Ollama's paths is Ollama's `{"error": "..."}`, elsewhere OpenAI's
  `{"error": {"message", "type", "param", "code"}}` (`error_body`, also used by the app's own error handlers).
- Faults: an exception that escapes a route becomes one line on stderr and a 500 in the API's shape, whose message
  names no internals (`INTERNAL`); the connection stays usable (nothing reaches the HTTP server, which would log a
  traceback and close it).
- A trailing slash on a path is served as the path without it, not redirected (a redirected POST loses its body
  in some clients).
"""

from __future__ import annotations

import ipaddress
import json
import sys
from dataclasses import dataclass, field

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
PREFLIGHT_MAX_AGE = "600"
INTERNAL = "internal error (logged by the server)"  # a 500's message: the exception is in the server's one line


def host_name(value: str) -> str:
    """The name in a Host header, without its port, lower-cased: "[::1]:8000" -> "::1", "Example:80" -> "example"."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        return value.split(":")[0]
    return value


def is_wildcard(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.strip("[]")).is_unspecified
    except ValueError:
        return False


def is_loopback(address: str) -> bool:
    if address.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


CROSS_SITE = ("cross-site", "same-site")  # Sec-Fetch-Site of a request another site's page made (not same-origin,
# not none: a user's own navigation or a program, which sends no Fetch Metadata at all)


def is_ollama(path: str) -> bool:
    """Whether a path is one of Ollama's (its errors are {"error": "..."}, its POSTs need no Content-Type)."""
    return path in ("/", "/api") or path.startswith("/api/")


def error_body(path: str, status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    """An error in the shape of the API the path belongs to: Ollama's {"error": message}, or OpenAI's."""
    if is_ollama(path):
        return {"error": message}
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def allowed_hosts(bound: str, extra: list[str] | tuple[str, ...] = ()) -> set[str] | None:
    """The Host names answered by a server bound to `bound` (the --host given), plus `extra`; None: any.

    Bound to every interface, or with "*" among `extra`: any name (such a server needs an API key). Bound to a
    loopback address: that address and the loopback names. Bound to another address or a name: that, plus the
    loopback names (the same machine may still use them)."""
    if "*" in extra or is_wildcard(bound):
        return None
    return {host_name(bound), *LOOPBACK_NAMES, *(host_name(h) for h in extra)}


@dataclass
class Guard:
    """ASGI middleware: Host, Origin and Content-Type checks, CORS for allowed origins, and the last catch."""

    app: object
    hosts: set[str] | None = None  # None: any Host
    origins: set[str] = field(default_factory=set)  # "*" allows every origin

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.origins or origin.rstrip("/") in self.origins

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        method = scope["method"]
        path = scope["path"]
        host = headers.get("host")
        if self.hosts is not None and host is not None and host_name(host) not in self.hosts:
            await answer(send, 403, f"the Host header '{host[:100]}' is not a name of this server (a page using "
                         "DNS rebinding sends its own); start the server with --allow-host NAME to answer it",
                         "host_not_allowed", path=path)
            return
        origin = headers.get("origin")
        if origin is None and method not in ("GET", "HEAD") and headers.get("sec-fetch-site") in CROSS_SITE:
            # a browser that left Origin off still says where the request comes from (Fetch Metadata): refused
            await answer(send, 403, "requests from another site's web page are refused; start the server with "
                         "--allow-origin ORIGIN to let its pages use it", "origin_not_allowed", path=path)
            return
        cors: list[tuple[bytes, bytes]] = []
        if origin is not None:
            if not self.origin_allowed(origin):
                await answer(send, 403, f"requests from the web page origin '{origin[:100]}' are refused; start the "
                             "server with --allow-origin ORIGIN to let its pages use it", "origin_not_allowed",
                             path=path)
                return
            cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
                    (b"access-control-expose-headers", b"Retry-After")]
            if method == "OPTIONS" and "access-control-request-method" in headers:
                asked = headers.get("access-control-request-headers", "")
                await send({"type": "http.response.start", "status": 204, "headers": cors + [
                    (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                    (b"access-control-allow-headers", asked.encode("latin-1")),
                    (b"access-control-max-age", PREFLIGHT_MAX_AGE.encode())]})
                await send({"type": "http.response.body", "body": b""})
                return
        if method == "POST" and not is_ollama(path):  # Ollama's routes read any body as JSON (the docstring)
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                await answer(send, 415, "send the body as JSON with 'Content-Type: application/json' (got "
                             f"{media[:60] or 'no Content-Type'})", "unsupported_media_type", cors, path=path)
                return
        if len(path) > 1 and path.endswith("/"):
            path = path.rstrip("/") or "/"
            raw = (scope.get("raw_path") or path.encode()).rstrip(b"/") or b"/"  # still percent-encoded
            scope = {**scope, "path": path, "raw_path": raw}
        started = False

        async def send_with_cors(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if cors:
                    message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_cors)
        except Exception as e:  # the app answered it already (its handler) or could not; the client gets an end
            if not started:
                line = (str(e).strip().splitlines() or [""])[0][:300]
                sys.stderr.write(f"dgemma: internal error on {method} {path}: {type(e).__name__}: {line}\n")
                await answer(send, 500, INTERNAL, "internal_error", cors, path=path)


async def answer(send, status: int, message: str, code: str, extra: list | None = None, *, path: str = "") -> None:
    """A JSON error in the shape of the API `path` belongs to, sent straight to the ASGI server."""
    body = json.dumps(error_body(path, status, message, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(extra or [])]})
    await send({"type": "http.response.body", "body": body})
