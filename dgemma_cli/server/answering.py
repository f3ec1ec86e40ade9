"""The loop's events into the API's answers: a whole answer, or one chunk per finished canvas when streaming (and with
`"stream_steps": true` one per denoising step carrying the canvas, `dgemma_step`); usage, finish reasons,
log-probabilities; a client that leaves stops its row."""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .. import answer
from .batching import Closed, QueueFull, RowCanvas, RowDone, RowFailed, RowStep, Ticket
from .guard import INTERNAL
from .logprobs import AnswerLogprobs
from .protocol import ApiError, EventStream, sse, unless_gone
from .requests import Prepared
from .state import Server

# ----------------------------------------------------------------------------- text as the canvases finish


class AnswerText(answer.AnswerText):
    """A request's answer text (answer.AnswerText) as its Prepared says: chat answers as `dgemma run` decodes them,
    completions and structured answers as their bytes, its stop strings, an infill's middle ending at pad too."""

    def __init__(self, tok, prep: Prepared):
        s = prep.job.settings
        super().__init__(tok, limit=s.max_new_tokens,
                         ends=set(s.eos_token_ids) | ({s.pad_token_id} if prep.job.held else set()),
                         chat=prep.kind == "chat" and not prep.structured, stops=prep.stops,
                         tools=prep.tools and not prep.structured)  # a structure wins: its word is the answer


# ----------------------------------------------------------------------------- answering


def submit(server: Server, prep: Prepared) -> tuple[asyncio.Queue, Ticket]:
    aloop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def deliver(ev) -> None:  # called in the loop's thread
        aloop.call_soon_threadsafe(events.put_nowait, ev)

    try:
        ticket = server.loop.submit(prep.job, deliver)
    except QueueFull as e:
        raise ApiError(429, f"the server is busy: {e}; retry later", kind="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(server.retry_after())}) from None
    except Closed as e:
        raise ApiError(503, str(e), code="shutting_down") from None
    return events, ticket


async def next_event(events: asyncio.Queue):
    ev = await events.get()
    if isinstance(ev, RowFailed):  # the loop wrote its one line on stderr; the client learns no internals
        raise ApiError(500, f"generation failed: {INTERNAL}", code="generation_failed")
    return ev


def usage(prep: Prepared, completion: int, done: RowDone | None = None) -> dict:
    p = len(prep.job.prompt)
    return {"prompt_tokens": p, "completion_tokens": completion, "total_tokens": p + completion,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens if done is not None else 0}}


def finish_reason(text: AnswerText, done: RowDone | None) -> str:
    """"stop" at an end token or a stop string; "length" at the token limit, and for a structured answer the
    limit cut short (its text is then not a whole answer of the schema)."""
    if done is not None and done.satisfied is False:
        return "length"
    return "stop" if text.stopped or (done is not None and done.ended) else "length"


def calls_reason(reason: str, done: RowDone | None) -> str:
    """The finish reason of an answer with tool calls: "tool_calls", unless max_tokens cut the block (the calls
    completed before the cut are returned with "length", as the API does). A required call whose block closed
    exactly at max_tokens (the search writes the longest values that still finish) is whole: "tool_calls"."""
    return "tool_calls" if reason != "length" or (done is not None and done.satisfied is True) else "length"


async def answer_whole(server: Server, request: Request, prep: Prepared) -> Response:
    body = await whole(server, request, prep)
    return Response(status_code=499) if body is None else JSONResponse(body)  # 499: nobody is listening


def answer_logprobs(server: Server, prep: Prepared, text: AnswerText) -> AnswerLogprobs | None:
    """The answer's token log-probabilities, for a request that asked (logprobs.py)."""
    return None if prep.job.logprobs is None else AnswerLogprobs(server.engine.tokenizer, text)


def logprobs_field(prep: Prepared, lp: AnswerLogprobs | None, entries: list) -> Any:
    """A choice's `logprobs`: null unless asked; chat's {"content": [...]}, completions' lists."""
    if lp is None:
        return None
    return {"content": lp.chat(entries), "refusal": None} if prep.kind == "chat" else lp.completion(entries)


async def whole(server: Server, request: Request, prep: Prepared) -> dict | None:
    """The answer in one piece, as the API's chat.completion or text_completion object; None when the client left
    before it was done."""
    events, ticket = submit(server, prep)
    text = AnswerText(server.engine.tokenizer, prep)
    lp = answer_logprobs(server, prep, text)

    async def collect() -> tuple[RowDone | None, list[int]]:
        while True:
            ev = await next_event(events)
            if isinstance(ev, RowCanvas):
                if lp is not None:
                    lp.add(ev.logprobs)
                text.add(ev.tokens)
                if text.stopped:  # a stop string: the rest is not needed, the row leaves at the next step
                    ticket.cancel()
                    return None, text.ids
            elif isinstance(ev, RowDone):
                return ev, ev.token_ids

    try:
        finished, result = await unless_gone(request, collect())
    finally:
        ticket.cancel()  # no-op for a finished row; frees the slot of a client that left
    if not finished:
        return None
    done, ids = result
    if done is not None:
        server.finished(done.seconds)
    if not text.stopped:
        text.ids = ids
        text.finish(ids)
    answer, thought = text.sent, text.sent_thought  # what a stream would have sent, in one piece
    logprobs = logprobs_field(prep, lp, lp.take(final=True) if lp is not None else [])
    reason = finish_reason(text, done)
    calls = text.tool_calls(ids) if done is not None else []
    completion = text.returned_tokens()
    extra = {"seed": prep.job.seed, "steps_per_canvas": done.steps_per_canvas if done else []}
    if done is not None:  # from its admission into the batch to its last step: not its wait in the queue
        extra["seconds"] = round(done.seconds, 4)
    base = {"id": new_id(prep), "created": int(time.time()), "model": prep.model or server.model_id}
    if prep.kind == "chat":
        message = {"role": "assistant", "content": answer, "refusal": None}
        if calls:  # cut at max_tokens, the calls completed before the cut, with "length" (as the API does)
            message.update(content=answer or None, tool_calls=calls)
            reason = calls_reason(reason, done)
        if thought:
            message["reasoning_content"] = thought
        body = {**base, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": logprobs}]}
    else:
        body = {**base, "object": "text_completion",
                "choices": [{"index": 0, "text": answer, "finish_reason": reason, "logprobs": logprobs}]}
    body["usage"] = usage(prep, completion, done)
    body["dgemma"] = extra
    return body


def new_id(prep: Prepared) -> str:
    return ("chatcmpl-" if prep.kind == "chat" else "cmpl-") + secrets.token_hex(12)


async def answer_stream(server: Server, prep: Prepared) -> Response:
    chunks, ticket = stream_chunks(server, prep)

    async def body() -> AsyncIterator[str]:
        async for c in chunks:
            yield sse(c)
        yield "data: [DONE]\n\n"

    return EventStream(body(), ticket)


def stream_chunks(server: Server, prep: Prepared) -> tuple[AsyncIterator[dict], Ticket]:
    """The streamed answer as the API's chunk objects (an error's body, if one comes, last), and its ticket:
    submitted now, so that a full queue is a 429 before anything is sent."""
    events, ticket = submit(server, prep)
    tok = server.engine.tokenizer
    text = AnswerText(tok, prep)
    lp = answer_logprobs(server, prep, text)
    chat = prep.kind == "chat"
    base = {"id": new_id(prep), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": prep.model or server.model_id}

    def chunk(delta: str = "", thought: str = "", reason: str | None = None, first: bool = False,
              entries: list | None = None) -> dict:
        logprobs = logprobs_field(prep, lp, entries or []) if entries is not None else None
        if chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if delta:
                d["content"] = delta
            if thought:
                d["reasoning_content"] = thought
            choice = {"index": 0, "delta": d, "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": delta, "finish_reason": reason, "logprobs": logprobs}
        # With include_usage, every chunk but the last carries "usage": null, as the API sends it.
        return {**base, "choices": [choice], **({"usage": None} if prep.include_usage else {})}

    def step_chunk(ev: RowStep) -> dict:
        return {**base, "choices": [], "dgemma_step": {
            "canvas": ev.canvas_index, "step": ev.step, "max_steps": ev.max_steps, "tokens": ev.canvas,
            "pieces": [tok.decode([t], skip_special_tokens=False) for t in ev.canvas],
            "accepted": ev.accepted, "confidence": [round(math.exp(-h), 4) for h in ev.entropy]}}

    async def body() -> AsyncIterator[dict]:
        if chat:
            yield chunk(first=True)
        done = None
        try:
            while True:
                ev = await next_event(events)
                if isinstance(ev, RowStep):
                    yield step_chunk(ev)
                elif isinstance(ev, RowCanvas):
                    if lp is not None:
                        lp.add(ev.logprobs)
                    delta, thought = text.add(ev.tokens)
                    entries = lp.take(final=text.stopped) if lp is not None else None
                    if delta or thought or entries:
                        yield chunk(delta, thought, entries=entries)
                    if text.stopped:
                        ticket.cancel()
                        break
                elif isinstance(ev, RowDone):
                    done = ev
                    server.finished(ev.seconds)
                    text.ids = ev.token_ids
                    delta, thought = text.finish(ev.token_ids)
                    entries = lp.take(final=True) if lp is not None else None
                    if delta or thought or entries:
                        yield chunk(delta, thought, entries=entries)
                    break
        except ApiError as e:
            yield e.body()
            return
        calls = text.tool_calls(text.ids) if done is not None and chat else []
        if calls:  # each call whole in one delta, as the API allows
            yield ({**base, "choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": i, **c} for i, c in enumerate(calls)]}, "finish_reason": None, "logprobs": None}],
                **({"usage": None} if prep.include_usage else {})})
        reason = finish_reason(text, done)  # cut at max_tokens: "length", with the calls completed before the cut
        yield chunk(reason=calls_reason(reason, done) if calls else reason)
        if prep.include_usage:
            yield {**base, "choices": [], "usage": usage(prep, text.returned_tokens(), done)}

    return body(), ticket
