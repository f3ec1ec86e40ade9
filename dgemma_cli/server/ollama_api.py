"""Ollama's API on `dgemma serve`'s engine and batch loop (docs/serve.md, Ollama's API).

Desktop clients that speak only Ollama reach dgemma through these routes: /api/chat, /api/generate (with `suffix`:
infill), /api/tags, /api/show, /api/ps, /api/version, and GET / ("Ollama is running"). A request is translated into
the OpenAI-shaped body `requests.prepare` checks, so both APIs share every limit, refusal and the batch; answers
stream as Ollama streams them (newline-delimited JSON objects, the last with "done": true and its counts and
durations in nanoseconds; /api/generate's also with `context`, the conversation's token ids, which a client may
send back). Errors are Ollama's `{"error": "..."}` with the same status codes (the guard's refusals on these paths
too: guard.error_body). `options.stop` takes up to MAX_STOP strings here, where /v1 takes 8: Ollama has no cap and
editors send long lists.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from datetime import datetime, timezone
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from . import answering, protocol, requests

VERSION = "0.12.0"  # the Ollama API version these routes follow (clients check it for features)
MAX_STOP = 64  # stop strings per request (Ollama has none; /v1 takes protocol.MAX_STOP)
MAX_STOP_CHARS = 4096  # their characters together: each finished canvas's answer is searched for every one


class OllamaError(Exception):
    """A request this API refuses: answered {"error": message} with the status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _model_name(server, value: Any) -> str:
    """Ollama names carry a tag ("demo:latest"); the served model answers to its id with or without ":latest"."""
    if value is not None and not isinstance(value, str):
        raise OllamaError(400, f"model must be a string (got {json.dumps(value)[:80]})")
    if not value:
        raise OllamaError(400, "model is required")
    name = value[: -len(":latest")] if value.endswith(":latest") else value
    if server.slot_of(name) is None:
        raise OllamaError(404, f"model '{value[:100]}' not found; this server serves "
                          f"{', '.join(repr(m) for m in server.model_ids)}")
    return name


def _stream(body: dict) -> bool:
    """Ollama's `stream`: true (its default, also when null) or false; anything else is refused, as Ollama's JSON
    decoding refuses it, rather than read as one or the other."""
    stream = body.get("stream")
    if stream is None:
        return True
    if not isinstance(stream, bool):
        raise OllamaError(400, f"stream must be true or false (got {json.dumps(stream)[:80]})")
    return stream


THINK_LEVELS = ("high", "medium", "low")  # `think` as a string: thinking on, at a level (Ollama's, for some models)
# Go's time.ParseDuration, which Ollama reads a keep_alive string with: "0", or numbers each with its unit ("1h30m")
DURATION = re.compile(r"[+-]?(?:0|(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:ns|us|\u00b5s|\u03bcs|ms|s|m|h))+)")


def _typed(body: dict, *keys: str) -> None:
    """Ollama's typed fields among `keys` (think, raw, keep_alive), each null or of its type: anything else is
    refused naming the field, as `_stream` refuses a `stream` that is no boolean, rather than read as something."""
    for key in keys:
        v = body.get(key)
        if v is None or isinstance(v, bool) and key in ("think", "raw"):
            continue
        if key == "think" and v not in THINK_LEVELS:
            raise OllamaError(400, f"think must be true, false, \"high\", \"medium\" or \"low\" "
                              f"(got {json.dumps(v)[:80]})")
        if key == "raw":
            raise OllamaError(400, f"raw must be true or false (got {json.dumps(v)[:80]})")
        if key == "keep_alive" and not (isinstance(v, (int, float)) and not isinstance(v, bool) or
                                        isinstance(v, str) and len(v) <= 64 and DURATION.fullmatch(v)):
            raise OllamaError(400, f"keep_alive must be a number of seconds or a duration such as \"5m\" (got "
                              f"{json.dumps(v)[:80]})")


def _unloads(body: dict) -> bool:
    """Whether `keep_alive` is zero (Ollama's way to unload a model): 0, or a duration such as "0", "0s", "0m"."""
    keep = body.get("keep_alive")
    if isinstance(keep, str):
        # one zero duration after another ("0h0m0s"), each with its unit but the last: no nested repeat that could
        # backtrack (this runs on the event loop), and a length cap
        return len(keep) <= 64 and re.fullmatch(r"\s*[+-]?(?:0+(?:\.0*)?(?:ns|us|µs|ms|h|m|s))*(?:0+(?:\.0*)?)?\s*",
                                                keep) is not None and any(c == "0" for c in keep)
    return isinstance(keep, (int, float)) and not isinstance(keep, bool) and keep == 0


def _loaded(name: str, body: dict, shape: str) -> JSONResponse:
    """The answer to a request with nothing to generate (no messages, no prompt): Ollama's idiom to load a model,
    or with `keep_alive` 0 to unload it. The model stays loaded either way here: the server holds it until it
    stops."""
    reason = "unload" if _unloads(body) else "load"
    if shape == "chat":
        return JSONResponse({"model": f"{name}:latest", "created_at": _now(),
                             "message": {"role": "assistant", "content": ""}, "done_reason": reason, "done": True})
    return JSONResponse({"model": f"{name}:latest", "created_at": _now(), "response": "", "done": True,
                         "done_reason": reason})


def _option_values(body: dict) -> dict:
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise OllamaError(400, "options must be an object")
    return options


def _options(body: dict) -> dict:
    """Ollama's options -> the OpenAI body's fields: temperature, seed, num_predict (max_tokens; negative, as -1 or
    -2: until the model ends, within its context). `stop` is `stops`'. Others (top_k, top_p, num_ctx, ...) are
    accepted and ignored, as Ollama ignores what a model does not use."""
    options = _option_values(body)
    out: dict[str, Any] = {}
    for key in ("temperature", "seed"):
        if options.get(key) is not None:
            out[key] = options[key]
    n = options.get("num_predict")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or n == 0:
            raise OllamaError(400, f"options.num_predict must be a positive integer, or -1: until the model ends "
                              f"(got {json.dumps(n)[:80]})")
        if n > 0:
            out["max_tokens"] = n
    return out


def stops(body: dict) -> list[str]:
    """options.stop: a list of non-empty strings (or one string), at most MAX_STOP of them, MAX_STOP_CHARS
    characters together; each is cut out of the answer, which ends at the first found."""
    stop = _option_values(body).get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise OllamaError(400, f"options.stop must be a list of non-empty strings (got {json.dumps(stop)[:80]})")
    if len(stop) > MAX_STOP or sum(len(s) for s in stop) > MAX_STOP_CHARS:
        raise OllamaError(400, f"options.stop takes at most {MAX_STOP} strings of {MAX_STOP_CHARS} characters "
                          f"together (got {len(stop)} of {sum(len(s) for s in stop)})")
    return list(dict.fromkeys(stop))


def context(server, body: dict) -> list[int]:
    """/api/generate's `context`: the token ids of a conversation so far, as an earlier answer's `context` gave
    them; they come before this request's prompt."""
    ids = body.get("context")
    if ids is None or ids == []:
        return []
    cfg = server.engine.config
    V, most = cfg.text.vocab_size, cfg.text.max_position_embeddings
    if not isinstance(ids, list):
        raise OllamaError(400, "context must be a list of token ids, as an earlier answer's context")
    if len(ids) >= most:  # before looking at each: a body may hold millions
        raise OllamaError(400, f"context holds {len(ids)} tokens; the model's context is {most}")
    if not all(type(t) is int and 0 <= t < V for t in ids):
        raise OllamaError(400, f"context must be a list of token ids (0 to {V - 1}), as an earlier answer's context")
    if cfg.vision is not None and cfg.vision.image_token_id in ids:
        raise OllamaError(400, "context holds an image's tokens, which cannot be sent back: send the images again")
    return ids


def _format(body: dict) -> dict:
    """Ollama's format: "json", or a JSON schema, as the OpenAI body's response_format."""
    fmt = body.get("format")
    if fmt in (None, ""):
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}}
    raise OllamaError(400, "format must be \"json\" or a JSON schema object")


def _images(server, images: Any, where: str) -> list[dict]:
    if images is None or images == []:
        return []
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        raise OllamaError(400, f"{where}.images must be a list of base64 strings")
    if server.engine.config.vision is None:
        raise OllamaError(400, f"{where}.images: the model '{server.model_id}' has no vision tower, so it reads no "
                          "images (/api/show lists no 'vision' capability)")
    return [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{i}"}} for i in images]


def chat_body(server, body: dict) -> dict:
    """/api/chat -> an OpenAI chat body."""
    name = _model_name(server, body.get("model"))
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise OllamaError(400, "messages must be a list")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise OllamaError(400, f"messages[{k}] must be an object")
        pictures = _images(server, m.get("images"), f"messages[{k}]")
        content = m.get("content", "")
        if pictures:  # before the text, as Ollama lays a message's images out (and dgemma's engine does)
            content = [*pictures, {"type": "text", "text": content if isinstance(content, str) else ""}]
        message = {"role": m.get("role"), "content": content}
        if m.get("role") == "tool":  # Ollama names the tool, OpenAI refers to the call
            message["name"] = m.get("tool_name") or m.get("name") or "tool"
        if isinstance(m.get("tool_calls"), list):  # Ollama's arguments are an object, OpenAI's a JSON string
            calls = [c.get("function") if isinstance(c, dict) else None for c in m["tool_calls"]]
            if not all(isinstance(f, dict) for f in calls):
                raise OllamaError(400, f"messages[{k}].tool_calls must be a list of {{\"function\": {{\"name\": ..., "
                                  "\"arguments\": {...}}}")
            message["tool_calls"] = [
                {"id": f"call_{k}_{i}", "type": "function",
                 "function": {"name": f.get("name", ""),
                              "arguments": _arguments(f.get("arguments"), f"messages[{k}].tool_calls[{i}]")}}
                for i, f in enumerate(calls)]
        out.append(message)
    tools = {"tools": body["tools"]} if body.get("tools") else {}
    return {"model": name, "messages": out, "thinking": bool(body.get("think")),
            **tools, **_options(body), **_format(body)}


def _arguments(value: Any, where: str) -> str:
    """A call's arguments: an object (Ollama's shape), or its JSON text (OpenAI's), which the chat path reads and
    refuses unless it is an object's (messages.call_arguments) -> the JSON text."""
    if value is None or value == "":
        return "{}"
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value)
    raise OllamaError(400, f"{where}.function.arguments must be an object, or its JSON text (got "
                      f"{json.dumps(value)[:80]})")


def generate_body(server, body: dict) -> tuple[dict, str]:
    """/api/generate -> (an OpenAI body, its kind): with `suffix` an infill completion, with `raw` the text exactly
    as given, else the prompt (and `system`) through the chat template."""
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise OllamaError(400, "prompt must be a string")
    name = _model_name(server, body.get("model"))
    common = {"model": name, **_options(body), **_format(body)}
    if body.get("suffix") is not None:
        return {**common, "prompt": prompt, "suffix": body["suffix"]}, "completion"
    if body.get("raw"):
        return {**common, "prompt": prompt}, "completion"
    messages = []
    if isinstance(body.get("system"), str) and body["system"]:
        messages.append({"role": "system", "content": body["system"]})
    pictures = _images(server, body.get("images"), "request")
    messages.append({"role": "user", "content": [*pictures, {"type": "text", "text": prompt}] if pictures
                     else prompt})
    return {**common, "messages": messages, "thinking": bool(body.get("think"))}, "chat"


async def _answer(server, prep) -> AsyncIterator[tuple[str, str, Any]]:
    """(answer delta, thought delta, None) per settled piece, then ("", "", final) with the row's RowDone (or None
    when a stop string ended it). The row is cancelled when the consumer stops."""
    from .batching import RowCanvas, RowDone

    events, ticket = answering.submit(server, prep)
    text = answering.AnswerText(server.engine.tokenizer, prep)
    try:
        while True:
            ev = await answering.next_event(events)
            if isinstance(ev, RowCanvas):
                delta, thought = text.add(ev.tokens)
                if delta or thought:
                    yield delta, thought, None
                if text.stopped:
                    yield "", "", (None, text)
                    return
            elif isinstance(ev, RowDone):
                server.finished(ev.seconds)
                text.ids = ev.token_ids
                delta, thought = text.finish(ev.token_ids)
                if delta or thought:
                    yield delta, thought, None
                yield "", "", (ev, text)
                return
    finally:
        ticket.cancel()


def _final(server, prep, done, text, started: float) -> dict:
    calls = text.tool_calls(text.ids) if done is not None else []
    total = int((time.perf_counter() - started) * 1e9)
    generated = int((done.seconds if done is not None else time.perf_counter() - started) * 1e9)
    out = {"done": True, "done_reason": answering.finish_reason(text, done), "total_duration": total, "load_duration": 0,
           "prompt_eval_count": len(prep.job.prompt), "prompt_eval_duration": max(0, total - generated),
           "eval_count": text.returned_tokens(), "eval_duration": generated}
    if calls:  # Ollama's shape: the arguments as an object
        out["tool_calls"] = [{"function": {"name": c["function"]["name"],
                                           "arguments": json.loads(c["function"]["arguments"])}} for c in calls]
    return out


def _piece(server, kind: str, delta: str, thought: str, model: str = "") -> dict:
    """One object of an answer; model: the id the request named (the base's or an adapter's)."""
    obj: dict[str, Any] = {"model": f"{model or server.model_id}:latest", "created_at": _now(), "done": False}
    if kind == "chat":
        obj["message"] = {"role": "assistant", "content": delta, **({"thinking": thought} if thought else {})}
    else:
        obj["response"] = delta
        if thought:
            obj["thinking"] = thought
    return obj


def _prepend(server, prep, ids: list[int], sized: bool) -> None:
    """A `context` before the request's prompt (its own <bos> dropped where the context has one); the answer's
    length (unless `sized` by num_predict) and KV cache reservation made again for the longer prompt."""
    from ..errors import UsageError

    engine, job = server.engine, prep.job
    bos = engine.tokenizer.bos_id
    prompt = job.prompt[1:] if bos is not None and job.prompt[:1] == [bos] and ids[:1] == [bos] else job.prompt
    prompt = list(ids) + list(prompt)
    settings = job.settings
    if not sized:
        settings = settings.override(max_new_tokens=requests.default_max_tokens(engine, len(prompt), len(job.held)))
    try:
        capacity = engine.check_context(len(prompt), settings, held=len(job.held))
    except UsageError as e:
        raise OllamaError(400, f"with its context, {e}".replace("new tokens", "new tokens (num_predict)")) from None
    prep.job = dataclasses.replace(job, prompt=prompt, settings=settings, capacity=capacity)


def _context_out(server, prep, done, text) -> list[int]:
    """/api/generate's `context`: the prompt's ids (a sent context's included) and the answer's returned ones, and
    for a chat-templated answer that ended its turn, the turn's end as the template writes it."""
    tok = server.engine.tokenizer
    ids = prep.job.prompt + text.cut(text.ids)[: text.returned_tokens()]
    if prep.kind == "chat" and done is not None and done.ended and tok.end_of_turn_id is not None:
        ids += [tok.end_of_turn_id, *tok.encode_text("\n")]
    return ids


async def respond(server, openai_body: dict, kind: str, shape: str, stream: bool,
                  request: Request | None = None, stop: list[str] = (), ctx: list[int] = ()) -> Response:
    """Run the translated request and answer as Ollama does: NDJSON when streaming (its default), else one object.
    shape: "chat" (a message) or "generate" (a response, its last object with `context`); stop: options.stop
    (`stops`); ctx: token ids before the prompt (`context`)."""
    started = time.perf_counter()
    if stop and openai_body.get("response_format"):
        raise OllamaError(400, "options.stop cannot be used with format: a stop string would cut the structured "
                          "answer short of it")
    try:
        prep = await requests.prepared(server, openai_body, kind, request)  # a client leaving stops its compile
    except protocol.ApiError as e:  # named as this API names the field
        e.message = e.message.replace("max_tokens", "num_predict")
        raise
    prep.stops = list(stop)  # checked here (MAX_STOP), not by requests.prepare's /v1 limit
    if ctx:
        _prepend(server, prep, ctx, "max_tokens" in openai_body)

    def last(done, text, answer: str = "", thought: str = "") -> dict:
        """The last object: the answer's counts and durations (and the whole answer, when not streamed)."""
        obj = {**_piece(server, shape, answer, thought, prep.model), **_final(server, prep, done, text, started)}
        if shape == "generate":
            obj["context"] = _context_out(server, prep, done, text)
        return _with_calls(shape, obj)

    if not stream:
        async def collect() -> tuple[str, str, Any]:
            answer, thought, final = "", "", None
            async for delta, th, end in _answer(server, prep):
                answer, thought = answer + delta, thought + th
                final = end or final
            return answer, thought, final

        # A client that leaves stops its row (cancelling `collect` closes _answer, which cancels the ticket), as on
        # /v1: else every request sent and dropped would run to its num_predict.
        finished, result = await protocol.unless_gone(request, collect())
        if not finished:
            return Response(status_code=499)  # nobody is listening
        answer, thought, final = result
        return JSONResponse(last(*final, answer, thought))

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for delta, th, end in _answer(server, prep):
                if end is None:
                    yield (json.dumps(_piece(server, shape, delta, th, prep.model), ensure_ascii=False) + "\n").encode()
                else:
                    yield (json.dumps(last(*end), ensure_ascii=False) + "\n").encode()
        except protocol.ApiError as e:
            yield (json.dumps({"error": e.message}) + "\n").encode()

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _capabilities(engine) -> list[str]:
    """What /api/show says the model does, in Ollama's words: completion; vision with a vision tower; tools where
    the vocabulary has the tool-call tokens the answers' calls are read by (tools.py; the chat template renders the
    tools, or dgemma writes Gemma 4's format); thinking where the template takes `enable_thinking` and the
    vocabulary has the thought channel's tokens; insert (infill: `suffix`), which every checkpoint serves."""
    from ..tokenizer import CHANNEL_END, CHANNEL_START
    from ..tools import CALL_END, CALL_START

    tok = engine.tokenizer
    has = lambda *tokens: tok is not None and all(tok.token_id(t) is not None for t in tokens)
    out = ["completion"]
    if engine.config.vision is not None:
        out.append("vision")
    if has(CALL_START, CALL_END):
        out.append("tools")
    if has(CHANNEL_START, CHANNEL_END) and "enable_thinking" in (tok.chat_template or ""):
        out.append("thinking")
    return out + ["insert"]


def _details(server) -> dict:
    cfg = server.engine.config
    params = sum(p.numel() for p in server.engine.model.parameters()) if hasattr(server.engine.model,
                                                                                   "parameters") else 0
    fmt = getattr(server.engine, "weight_format", None) or str(server.engine.model.dtype).replace("torch.", "")
    return {"parent_model": "", "format": "safetensors", "family": "diffusiongemma", "families": ["diffusiongemma"],
            "parameter_size": f"{params / 1e9:.1f}B" if params >= 1e8 else f"{params / 1e6:.1f}M",
            "quantization_level": fmt.upper(), "canvas_length": cfg.canvas_length}


def routes(server) -> list[Route]:
    """The routes, for app.build_app."""

    async def guarded(request: Request, work) -> Response:
        try:
            server.authorize(request)
            return await work()
        except (protocol.ApiError, OllamaError) as e:
            return _error(e.status, e.message)

    async def chat(request: Request) -> Response:
        async def work():
            body = await protocol.read_json(request)
            stream = _stream(body)
            _typed(body, "think", "keep_alive")
            if body.get("messages") in (None, []):  # Ollama's way to load (or unload) a model
                return _loaded(_model_name(server, body.get("model")), body, "chat")
            return await respond(server, chat_body(server, body), "chat", "chat", stream, request, stops(body))
        return await guarded(request, work)

    async def generate(request: Request) -> Response:
        async def work():
            body = await protocol.read_json(request)
            stream = _stream(body)
            _typed(body, "think", "raw", "keep_alive")
            if body.get("prompt") in (None, "") and body.get("suffix") is None and not body.get("images"):
                return _loaded(_model_name(server, body.get("model")), body, "generate")  # Ollama's load idiom
            openai_body, kind = generate_body(server, body)
            return await respond(server, openai_body, kind, "generate", stream, request, stops(body),
                                 context(server, body))
        return await guarded(request, work)

    def entry(model_id: str) -> dict:
        """The base model's entry, or a LoRA adapter's served beside it (`serve --adapter`: the base's details)."""
        name = f"{model_id}:latest"
        digest = hashlib.sha256(f"{server.engine.path or server.model_id}:{model_id}".encode()).hexdigest() \
            if model_id != server.model_id else hashlib.sha256(str(server.engine.path or model_id).encode()).hexdigest()
        modified = datetime.fromtimestamp(server.created, timezone.utc).isoformat().replace("+00:00", "Z")
        return {"name": name, "model": name, "modified_at": modified, "size": _weight_bytes(server),
                "digest": digest, "details": _details(server)}

    async def tags(request: Request) -> Response:
        return await guarded(request, lambda: _json({"models": [entry(m) for m in server.model_ids]}))

    async def ps(request: Request) -> Response:
        return await guarded(request, lambda: _json({"models": [{**entry(m), "expires_at": "2999-01-01T00:00:00Z",
                                                                 "size_vram": 0} for m in server.model_ids]}))

    async def show(request: Request) -> Response:
        async def work():
            body = await protocol.read_json(request)
            name = _model_name(server, body.get("model") or body.get("name"))
            engine = server.engine
            s = engine.settings
            params = (f"temperature {s.t_max}\nnum_predict {requests.default_max_tokens(engine)}\n"  # a request without one
                      + "".join(f"stop {engine.tokenizer.decode([i], skip_special_tokens=False)}\n"
                                for i in s.eos_token_ids if engine.tokenizer is not None))
            capabilities = _capabilities(engine)
            cfg = engine.config.text
            return JSONResponse({
                # The model's id, not its directory: where the server keeps its files is none of a client's business
                "modelfile": f"# dgemma serves {name}\nFROM {name}\n",
                "parameters": params, "template": engine.tokenizer.chat_template if engine.tokenizer else "",
                "details": _details(server), "capabilities": capabilities,
                "model_info": {"general.architecture": "diffusiongemma", "diffusiongemma.context_length":
                               cfg.max_position_embeddings, "diffusiongemma.embedding_length": cfg.hidden_size,
                               "diffusiongemma.block_count": cfg.num_hidden_layers,
                               "diffusiongemma.canvas_length": engine.config.canvas_length,
                               "general.parameter_count": sum(p.numel() for p in engine.model.parameters())}})
        return await guarded(request, work)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    async def root(request: Request) -> Response:
        return PlainTextResponse("Ollama is running")

    return [Route("/api/chat", chat, methods=["POST"]), Route("/api/generate", generate, methods=["POST"]),
            Route("/api/tags", tags, methods=["GET"]), Route("/api/ps", ps, methods=["GET"]),
            Route("/api/show", show, methods=["POST"]), Route("/api/version", version, methods=["GET"]),
            Route("/", root, methods=["GET", "HEAD"])]


def _with_calls(shape: str, obj: dict) -> dict:
    """A chat answer's tool calls go in its message, as Ollama sends them."""
    calls = obj.pop("tool_calls", None)
    if calls and shape == "chat":
        obj["message"]["tool_calls"] = calls
    return obj


async def _json(obj: dict) -> Response:
    return JSONResponse(obj)


def _weight_bytes(server) -> int:
    path = server.engine.path
    try:
        from pathlib import Path

        return sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) if path else 0
    except OSError:
        return 0
