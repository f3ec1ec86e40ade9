"""What every handler shares with the client: the request limits, the error shape (ApiError: {"error": {...}} with
an HTTP status), reading a body and its fields, a client leaving, and server-sent events."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any, AsyncIterator, Awaitable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse

from .batching import Ticket
from .body import BodyError, Counts, trim_heap
from .body import parse_async as parse_body

MAX_BODY = 20 << 20  # bytes of one request body: room for a few photos as base64 data: URLs
TRIM_AFTER = 1 << 20  # bytes of a body after which the heap's free memory is handed back to the system
MAX_STOP = 8  # stop strings per request
MAX_STOP_CHARS = 256
MAX_STEPS = 1024  # the `steps` extra field's ceiling
MAX_MESSAGES = 4096  # messages per chat request: rendering the template is linear in them, on this server's CPU


class ApiError(Exception):
    """An error answered as {"error": {...}} with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# ----------------------------------------------------------------------------- reading a request


async def read_json(request: Request) -> dict:
    """The body as a JSON object; 413 past MAX_BODY (checked while reading, whatever Content-Length says)."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > MAX_BODY:
        raise ApiError(413, f"request body over {MAX_BODY} bytes", code="request_too_large")
    chunks, total, counts = [], 0, Counts()
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > MAX_BODY:
                raise ApiError(413, f"request body over {MAX_BODY} bytes", code="request_too_large")
            counts.add(chunk)  # what the body may cost to parse, known before it is parsed (body.py)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected while sending the body", code="client_disconnected") from None
    # Counted exactly in a helper process when it may hold many values, parsed in a thread of body.py's own, checked.
    data = b"".join(chunks)
    del chunks
    try:
        body = await parse_body(data, counts)
    except BodyError as e:
        raise ApiError(e.status, e.message, code=e.code) from None
    finally:
        del data
        if total > TRIM_AFTER:
            trim_heap()
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return body


def type_error(key: str, what: str, value: Any) -> ApiError:
    return ApiError(400, f"'{key}' must be {what} (got {json.dumps(value)[:80]})", param=key, code="invalid_type")


def get_int(body: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise type_error(key, "an integer", v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise ApiError(400, f"'{key}' must be {span} (got {v})", param=key, code="invalid_value")
    return v


def get_float(body: dict, key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise type_error(key, "a number", v)
    return float(v)


def get_bool(body: dict, key: str) -> bool | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise type_error(key, "true or false", v)
    return v


def refuse(key: str, why: str) -> ApiError:
    return ApiError(400, f"'{key}' is not supported: {why}", param=key, code="unsupported_parameter")


# ----------------------------------------------------------------------------- the client


async def unless_gone(request: Request | None, work: Awaitable) -> tuple[bool, Any]:
    """Await `work` unless the client leaves first: (True, its result), or (False, None) once it is cancelled and its
    cleanup has run (a row's ticket cancelled in its finally). request None: nobody to watch."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_disconnect(request)) if request is not None else None
    try:
        await asyncio.wait({task} | ({gone} if gone else set()), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if gone is not None:
            gone.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        await asyncio.wait({task})
        return False, None
    return True, task.result()


async def wait_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body is already read, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """Server-Sent Events; the row is cancelled when the response ends for any reason (a client that drops the
    connection included: the loop frees its slot at its next step)."""

    def __init__(self, content: AsyncIterator[str], ticket: Ticket):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.ticket = ticket

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ticket.cancel()
