"""`dgemma serve`: an OpenAI-compatible HTTP server over one batching engine loop (batching.py).

The rule: this module knows HTTP, JSON and text; generation is the loop's. A request is parsed and checked here
(every field the API defines is honoured, ignored as other local servers ignore it, or refused with a 400 where
ignoring it would mislead), turned into a `batching.Job`, and the loop's events are turned into the API's
responses: one chunk per finished canvas when streaming, and with `"stream_steps": true` one more chunk per
denoising step carrying the canvas (`dgemma_step`), for pages that draw it sharpening.

Routes: POST /v1/chat/completions, POST /v1/completions (`suffix`: infill with the held suffix, as `dgemma fim`),
POST /v1/responses (responses_api.py, through the chat path), GET /v1/models, GET /v1/models/{id}, GET /health;
Ollama's (ollama_api.py). Token log-probabilities: logprobs.py. Errors are JSON in the API's shape:
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import gc
import hmac
import json
import math
import secrets
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import answer
from . import ollama_api, responses_api
from .batching import BatchLoop, Closed, Job, QueueFull, RowCanvas, RowDone, RowFailed, RowStep, Ticket
from .body import BodyError
from .body import parse as parse_body
from ..config import IMAGE_TOKEN_BUDGETS
from ..errors import DgemmaError, ModelError, UsageError
from .guard import INTERNAL, Guard, allowed_hosts, error_body, is_ollama
from .header_timeout import DEFAULT_SECONDS as HEADER_TIMEOUT
from .header_timeout import protocol as header_deadline_protocol
from .logprobs import AnswerLogprobs
from ..checkpoint.layout import check_images
from ..structured.worker import Busy, Cancelled, Stopped
from ..tokenizer import Control

MAX_BODY = 20 << 20  # bytes of one request body: room for a few photos as base64 data: URLs
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


# ----------------------------------------------------------------------------- state shared by the handlers


@dataclass
class Server:
    engine: Any  # engine.Engine
    loop: BatchLoop
    model_id: str
    api_key: str | None = None
    adapters: dict[str, int] = field(default_factory=dict)  # model id -> LoRA adapter slot (lora.attach), beside
    # the base (slot 0)

    def slot_of(self, model: str) -> int | None:
        """The adapter slot a request's `model` names (0: the base), None: no such model here."""
        return 0 if model == self.model_id else self.adapters.get(model)

    @property
    def model_ids(self) -> list[str]:
        return [self.model_id, *self.adapters]
    created: int = field(default_factory=lambda: int(time.time()))
    picture_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "dgemma-picture"))
    # compiles run one at a time in the compile worker; these threads wait for it (at most MAX_WAITING of them: past
    # it, a 429) or find the cache, so a cached structure always finds a thread
    structure_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(16, "dgemma-structure"))
    seconds_per_request: float = 1.0  # moving average, for Retry-After

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        ok = hmac.compare_digest(token.strip().encode(), self.api_key.encode()) and scheme.lower() == "bearer"
        if not ok:
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")

    def retry_after(self) -> int:
        active, queued = self.loop.load()
        wait = self.seconds_per_request * (queued / self.loop.max_batch + 1)
        return int(min(60, max(1, math.ceil(wait))))

    def finished(self, seconds: float) -> None:
        self.seconds_per_request = 0.8 * self.seconds_per_request + 0.2 * seconds


# ----------------------------------------------------------------------------- reading a request


async def read_json(request: Request) -> dict:
    """The body as a JSON object; 413 past MAX_BODY (checked while reading, whatever Content-Length says)."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > MAX_BODY:
        raise ApiError(413, f"request body over {MAX_BODY} bytes", code="request_too_large")
    chunks, total = [], 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > MAX_BODY:
                raise ApiError(413, f"request body over {MAX_BODY} bytes", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected while sending the body", code="client_disconnected") from None
    # Parsed in a worker thread (20 MiB of JSON takes a while, and the event loop answers other clients meanwhile),
    # and checked (body.py).
    try:
        body = await asyncio.to_thread(parse_body, b"".join(chunks))
    except BodyError as e:
        raise ApiError(e.status, e.message, code=e.code) from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return body


def _type_error(key: str, what: str, value: Any) -> ApiError:
    return ApiError(400, f"'{key}' must be {what} (got {json.dumps(value)[:80]})", param=key, code="invalid_type")


def get_int(body: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _type_error(key, "an integer", v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise ApiError(400, f"'{key}' must be {span} (got {v})", param=key, code="invalid_value")
    return v


def get_float(body: dict, key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _type_error(key, "a number", v)
    return float(v)


def get_bool(body: dict, key: str) -> bool | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise _type_error(key, "true or false", v)
    return v


def refuse(key: str, why: str) -> ApiError:
    return ApiError(400, f"'{key}' is not supported: {why}", param=key, code="unsupported_parameter")


@dataclass
class Prepared:
    """A checked request: the job for the loop and how to answer."""

    kind: str  # "chat" or "completion"
    job: Job
    stream: bool
    stream_steps: bool
    include_usage: bool
    stops: list[str]
    infill: bool
    structured: bool = False  # held to a response_format: the answer is its bytes (nothing stripped)
    tools: bool = False  # tools offered: the answer's tool calls are read out of it (tools.py)
    model: str = ""  # the model id the request named (the base's or an adapter's): answers name it back


def structured(body: dict) -> bool:
    """Whether a request asks for a structure (its compile may take the compile worker's whole budget)."""
    return any(body.get(k) is not None for k in GUIDED) or body.get("structured_outputs") not in (None, {}) or \
        body.get("response_format") not in (None, {}) or \
        body.get("tool_choice") not in (None, "none", "auto")


async def prepared(server: Server, body: dict, kind: str, request: Request | None = None) -> Prepared:
    """`prepare` in a worker thread: tokenizing, a picture's decoding and vision tower, a structure's compile. Requests
    with pictures queue for one thread of their own, requests with a structure for threads of theirs (a compile may
    take its whole budget), so that however many arrive, plain text requests keep the other workers. A client that
    leaves while its structure compiles stops the compile (`request`: watched for its disconnect)."""
    pool = server.picture_pool if has_images(body) else server.structure_pool if structured(body) else None
    gone = threading.Event()
    work = asyncio.get_running_loop().run_in_executor(pool, prepare, server, body, kind, gone.is_set)
    if request is None or pool is not server.structure_pool:
        return await work
    watch = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            gone.set()  # the compile is killed within the worker's poll; its Cancelled ends the handler
        return await work
    finally:
        watch.cancel()


def prepare(server: Server, body: dict, kind: str, cancelled=None) -> Prepared:
    """A request's body -> what the loop runs, checked. cancelled: polled while its structure compiles."""
    engine = server.engine
    tok = engine.tokenizer
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _type_error("model", "a string", model)
    if not model:
        raise ApiError(400, "'model' is required (GET /v1/models lists it)", param="model", code="invalid_type")
    slot = server.slot_of(model)
    if slot is None:
        raise ApiError(404, f"the model '{model[:100]}' does not exist; this server serves "
                       f"{', '.join(repr(m) for m in server.model_ids)}", param="model", code="model_not_found")

    # Fields dgemma cannot honour, where ignoring them would give the client something other than it asked for.
    if get_int(body, "n", 1) not in (None, 1):
        raise refuse("n", "one choice per request (send several requests; they are batched)")
    if body.get("echo") not in (None, False):  # first: lm-eval's loglikelihood requests also send max_tokens 0
        raise refuse("echo", "the prompt's tokens are not returned, nor their log-probabilities, which a canvas "
                     "decoder does not define (it scores a canvas of answer tokens, never the prompt's): "
                     "loglikelihood tasks cannot run here; generation tasks can")
    logprobs = request_logprobs(body, kind)
    if logprobs is not None:
        tok.token_bytes()  # read once per server (the vocabulary's bytes), here in a worker, not in the event loop
    if body.get("logit_bias") not in (None, {}):
        raise refuse("logit_bias", "not applied by the diffusion sampler")
    if body.get("functions") not in (None, []) or body.get("function_call") is not None:
        raise refuse("functions", "the legacy functions field; send 'tools'")
    functions, call_structure = request_tools(tok, body, kind)
    structure = response_structure(body.get("response_format"), body)
    if call_structure is not None:
        if structure is not None:
            raise ApiError(400, "a tool_choice that requires a call cannot also have a response_format",
                           param="tool_choice", code="invalid_value")
        structure = call_structure
    if get_int(body, "best_of", 1) not in (None, 1):
        raise refuse("best_of", "one candidate per request")
    # Accepted and ignored, as other local servers do: top_p, presence_penalty, frequency_penalty, user, metadata,
    # store, parallel_tool_calls, service_tier, and any unknown field.

    overrides: dict[str, Any] = {}
    max_tokens = get_int(body, "max_completion_tokens", 1)
    max_tokens = get_int(body, "max_tokens", 1) if max_tokens is None else max_tokens
    overrides["max_new_tokens"] = max_tokens
    overrides["max_denoising_steps"] = get_int(body, "steps", 1, MAX_STEPS)
    bound = get_float(body, "entropy_bound")
    if bound is not None and not bound > 0:
        raise ApiError(400, "'entropy_bound' must be > 0", param="entropy_bound", code="invalid_value")
    overrides["entropy_bound"] = bound
    temperature = get_float(body, "temperature")
    base = engine.settings
    if temperature is not None:
        # The sampler's temperature falls from t_max to t_min over a canvas's steps: the API's temperature scales
        # that schedule (1, the API's default, keeps the checkpoint's). 0 is greedy: every draw is the argmax (the
        # schedule still paces which positions a step accepts) and, with no seed sent, the starting noise is seed
        # 0's, so the same request gives the same answer.
        if not 0 <= temperature <= 2:
            raise ApiError(400, "'temperature' must be in [0, 2]: it scales the sampler's schedule (1 keeps the "
                           "checkpoint's, 0 is greedy)", param="temperature", code="invalid_value")
        overrides["temperature"] = temperature  # GenerationSettings.override scales the schedule
    seed = get_int(body, "seed", -(2**63), 2**64 - 1)
    if seed is None and temperature == 0:
        seed = 0
    stream = bool(get_bool(body, "stream"))
    stream_steps = bool(get_bool(body, "stream_steps"))
    if stream_steps and not stream:
        raise ApiError(400, "'stream_steps' needs 'stream': true", param="stream_steps", code="invalid_value")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    include_usage = bool(get_bool(options or {}, "include_usage"))
    stops = body.get("stop")
    stops = [stops] if isinstance(stops, str) else (stops or [])
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _type_error("stop", "a string or a list of non-empty strings", body.get("stop"))
    if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"'stop' takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters",
                       param="stop", code="invalid_value")

    try:
        settings = base.override(**overrides)
    except UsageError as e:
        raise ApiError(400, str(e).replace("--", "")) from None

    held: list[int] = []
    infill = False
    image_features = None
    if kind == "chat":
        thinking = get_bool(body, "thinking")
        kwargs = body.get("chat_template_kwargs")
        if isinstance(kwargs, dict) and thinking is None:
            thinking = get_bool(kwargs, "enable_thinking")
        # the placeholder only where a picture is sent: a checkpoint whose tokenizer lacks the image token still
        # answers text
        vision = engine.config.vision is not None and has_images(body)
        prompt, images = tok_chat(tok, body.get("messages"), bool(thinking),
                                  engine.image_placeholder() if vision else None, max_chars=max_chars(engine),
                                  tools=functions)
        if images:  # the tower runs here, in the request's worker thread, not in the batch loop
            budget = get_int(body, "image_tokens")
            if budget is not None and budget not in IMAGE_TOKEN_BUDGETS:
                raise ApiError(400, f"'image_tokens' must be one of {', '.join(map(str, IMAGE_TOKEN_BUDGETS))} "
                               f"(got {budget})", param="image_tokens", code="invalid_value")
            try:
                if engine.path is not None:
                    check_images(engine.path)  # a store entry holding only the text model: how to re-pull it
                patches = engine.image_patches(images, budget)
                prompt = engine.with_images(prompt, patches)
                image_features = engine.image_features(patches)
            except DgemmaError as e:
                raise ApiError(400, str(e), param="messages", code="invalid_image") from None
    else:
        prompt_field = body.get("prompt")
        suffix = body.get("suffix")
        if suffix is not None and not isinstance(suffix, str):
            raise _type_error("suffix", "a string", suffix)
        text, ids = completion_prompt(prompt_field)
        chars = len(text or "") + len(suffix or "")
        if chars > max_chars(engine):
            raise ApiError(400, f"the prompt's {chars} characters cannot fit the model's context", param="prompt",
                           code="context_length_exceeded")
        if suffix is not None:  # infill: <bos> + prefix through the encoder, the suffix's first tokens held
            if text is None:
                raise ApiError(400, "'suffix' needs a text prompt", param="suffix", code="invalid_value")
            infill = True
            C = engine.config.canvas_length
            n_held = get_int(body, "held_tokens", 0, C - 1)
            held = tok.encode_text(suffix)[: 8 if n_held is None else n_held]
            prompt = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode_text(text)
        else:  # as `dgemma run --raw`: the text exactly as given, no special tokens added
            prompt = tok.encode(text) if text is not None else ids
            if not prompt:
                raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
    V = engine.config.text.vocab_size
    if min(prompt) < 0 or max(prompt) >= V:
        raise ApiError(400, f"the prompt has a token id outside the vocabulary of {V}", param="prompt",
                       code="invalid_value")
    if max_tokens is None:  # none sent: the context the prompt leaves, at most DEFAULT_CANVASES canvases
        settings = settings.override(max_new_tokens=default_max_tokens(engine, len(prompt), len(held)))
    try:
        capacity = engine.check_context(len(prompt), settings, held=len(held))
    except UsageError as e:
        raise ApiError(400, str(e).replace("new tokens", "new tokens (max_tokens)"),
                       param="messages" if kind == "chat" else "prompt", code="context_length_exceeded") from None
    if call_structure is not None:  # now that max_tokens is known: a call bounded to fit it (tools.call_grammar)
        structure = call_structure = request_tools(tok, body, kind, settings.max_new_tokens)[1]
    if seed is None:
        seed = secrets.randbits(63)
    automaton = None
    if structure is not None:
        if infill:
            raise refuse("suffix", "an infill's middle cannot also be held to a response_format")
        if stops:
            raise refuse("stop", "a stop string would cut a structured answer short of its response_format")
        try:
            automaton = engine.automaton(structure, cancelled)
        except Cancelled:
            raise ApiError(499, "the client left while its structure compiled", code="client_disconnected") from None
        except Busy as e:
            raise ApiError(429, f"the server is busy compiling structures ({e}); retry later", kind="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "5"}) from None
        except Stopped:
            raise ApiError(503, "the server is shutting down", code="shutting_down") from None
        except UsageError as e:
            where = "tool_choice" if call_structure is not None else next(iter(guided_fields(body)),
                                                                          "response_format")
            message = str(e).replace("--regex: ", "the regex: ", 1)  # the CLI's flag is not this API's field
            raise ApiError(400, message, param=where, code="invalid_value") from None
    job = Job(prompt, settings, seed, capacity, held, want_steps=stream_steps, image_features=image_features,
              automaton=automaton, adapter=slot, logprobs=logprobs)
    return Prepared(kind, job, stream, stream_steps, include_usage, stops, infill,
                    structure is not None and call_structure is None, functions is not None, model)


DEFAULT_CANVASES = 16  # a request without max_tokens: at most this many canvases (4096 tokens on the published
# checkpoint), or the checkpoint's max_new_tokens where that is more, and never more than its context leaves


def default_max_tokens(engine, prompt_len: int = 0, held: int = 0) -> int:
    """The max_tokens of a request that sends none: what the context leaves after the prompt, in whole canvases
    (`held` tokens of each held by an infill), at most DEFAULT_CANVASES canvases or the checkpoint's max_new_tokens
    (its generation_config.json: one canvas, 256 tokens, on the published checkpoint) where that is more. An answer
    then ends where the model ends it, as the API's default does, up to a bound that keeps a request's KV cache
    reservation (prompt + max_tokens positions) to what a batch of them can hold."""
    C = engine.config.canvas_length
    free = C - held
    cap = max(engine.settings.max_new_tokens, DEFAULT_CANVASES * free)
    room = (engine.config.text.max_position_embeddings - prompt_len) // C * free
    return min(cap, room) if room >= 1 else engine.settings.max_new_tokens  # no room: the context error says so


MAX_TOP_LOGPROBS = 20  # alternatives per token, as vLLM's default --max-logprobs


def request_logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives each answer token's log-probability comes with (logprobs.py), None: none asked.
    Chat: `logprobs` true and `top_logprobs` 0-20; completions: `logprobs` an integer 0-20 (OpenAI's limit is 5,
    vLLM's 20)."""
    if kind == "chat":
        wanted = get_bool(body, "logprobs")
        top = get_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top and not wanted:  # top_logprobs 0 alone asks for nothing
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
        return (top or 0) if wanted else None
    return get_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)


def request_tools(tok, body: dict, kind: str, max_tokens: int | None = None):
    """`tools` and `tool_choice` -> (the offered functions or None, the structure a required call holds the answer
    to or None). tool_choice: "auto" (the default with tools: the model may call), "none" (tools not offered),
    "required" (a call, of any of them), or {"type": "function", "function": {"name": ...}} (that one). max_tokens:
    the answer's, which the call's strings and arrays are bounded to fit (tools.call_grammar); None: checked only."""
    from ..structured.constrain import Structure
    from ..tools import call_grammar, check_call_parameters, check_tools

    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice", code="invalid_value")
        return None, None
    if kind != "chat":
        raise refuse("tools", "tools are for chat completions")
    if choice == "none":
        return None, None
    try:
        functions = check_tools(tools)
    except UsageError as e:
        raise ApiError(400, str(e), param="tools", code="invalid_value") from None
    if choice in (None, "auto"):
        return functions, None
    if choice == "required":
        wanted = functions
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        wanted = [f for f in functions if f["name"] == name]
        if not wanted:
            raise ApiError(400, f"'tool_choice' names {json.dumps(name)[:60]}, which is not in 'tools'",
                           param="tool_choice", code="invalid_value")
    else:
        raise ApiError(400, "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                       "'function': {'name': ...}}", param="tool_choice", code="invalid_value")
    start, end = tok.token_id("<|tool_call>"), tok.token_id("<tool_call|>")
    if start is None or end is None:
        raise ApiError(400, "this model's vocabulary has no tool-call tokens", param="tool_choice",
                       code="invalid_value")
    parallel = choice == "required" and body.get("parallel_tool_calls") is not False
    try:
        if max_tokens is None:  # checked only: the grammar, whose bounds search builds it many times over (seconds
            for fn in wanted:  # of Python for a schema of thousands of nodes), is built once max_tokens is known
                check_call_parameters(fn["name"], fn["parameters"])
            return functions, Structure("grammar")
        grammar = call_grammar(wanted, start, end, tok.token_id('<|"|>'), most=4 if parallel else 1,
                               max_tokens=max_tokens)
    except UsageError as e:
        raise ApiError(400, str(e), param="tools", code="invalid_value") from None
    return functions, Structure("grammar", grammar)


GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar",
          "guided_choice": "choice"}
# vLLM's newer form, `structured_outputs: {"json": ...}`: each key -> the guided_* field it stands for
STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "grammar": "guided_grammar",
                      "choice": "guided_choice", "json_object": "json_object"}
MAX_CHOICES = 1024


def guided_fields(body: dict | None) -> dict[str, Any]:
    """vLLM's structure fields a request sends, {the field's name: its value}: guided_json, guided_regex,
    guided_grammar, guided_choice, and the keys of structured_outputs (named "structured_outputs.KEY"). What cannot
    be honoured is refused: another guided_* field (guided_whitespace_pattern, ...), another structured_outputs key
    set to anything but null or false (structural_tag, whitespace_pattern, disable_any_whitespace: true, ...).
    guided_decoding_backend (which library compiles it: dgemma has its own) is accepted and ignored."""
    out: dict[str, Any] = {}
    for key, value in (body or {}).items():
        if not key.startswith("guided_") or value is None or key == "guided_decoding_backend":
            continue
        if key not in GUIDED:
            raise refuse(key, f"dgemma takes {', '.join(GUIDED)} and structured_outputs")
        out[key] = value
    so = (body or {}).get("structured_outputs")
    if so is None:
        return out
    if not isinstance(so, dict):
        raise _type_error("structured_outputs", "an object", so)
    for key, value in so.items():
        name = f"structured_outputs.{key}"
        if key == "json_object":
            if value is not None and not isinstance(value, bool):
                raise _type_error(name, "true or false", value)
            if value:
                out[name] = True
        elif key in STRUCTURED_OUTPUTS:
            if value is not None:
                out[name] = value
        elif value not in (None, False):  # an option left at its default asks for nothing
            raise ApiError(400, f"'{name}' is not supported: structured_outputs takes "
                           f"{', '.join(STRUCTURED_OUTPUTS)}", param=name, code="unsupported_parameter")
    return out


def choice_regex(choices: Any, key: str) -> str:
    """guided_choice's strings -> the expression that is exactly one of them."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise _type_error(key, "a non-empty list of strings", choices)
    if len(choices) > MAX_CHOICES:
        raise ApiError(400, f"'{key}' holds {len(choices)} choices; at most {MAX_CHOICES}", param=key,
                       code="invalid_value")
    import re

    return "(" + "|".join(re.escape(c) for c in dict.fromkeys(choices)) + ")"


def response_structure(fmt: Any, body: dict | None = None):
    """OpenAI's response_format -> a constrain.Structure, or None for free text: {"type": "text"},
    {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}; or vLLM's
    fields guided_json (a schema), guided_regex, guided_grammar (Lark or GBNF), guided_choice (exactly one of its
    strings), and structured_outputs' json, regex, grammar, choice, json_object, so requests written for vLLM
    work."""
    from ..structured.constrain import Structure

    guided = guided_fields(body)
    if guided:
        key = next(iter(guided))
        if len(guided) > 1 or fmt not in (None, {}, {"type": "text"}):
            raise ApiError(400, "give one of response_format, guided_json, guided_regex, guided_grammar, "
                           "guided_choice, structured_outputs (with one key)", param=key, code="invalid_value")
        value = guided[key]
        field = STRUCTURED_OUTPUTS.get(key.removeprefix("structured_outputs."), key)
        if field == "json_object":
            return Structure("json_object")
        if field == "guided_choice":
            return Structure("regex", choice_regex(value, key))
        if field == "guided_json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except (ValueError, RecursionError):  # not JSON, an integer of thousands of digits, deep nesting
                    raise ApiError(400, f"'{key}' is not JSON (or nests too deeply)", param=key,
                                   code="invalid_value") from None
            if not isinstance(value, (dict, bool)):
                raise _type_error(key, "a JSON schema", value)
            return Structure("json_schema", json.dumps(value))
        if not isinstance(value, str) or not value:
            raise _type_error(key, "a non-empty string", value)
        return Structure(GUIDED[field], value)
    if fmt in (None, {}):
        return None
    if not isinstance(fmt, dict):
        raise _type_error("response_format", "an object", fmt)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structure("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise ApiError(400, "'response_format.json_schema' must be an object with a 'schema' object",
                           param="response_format", code="invalid_value")
        schema = spec.get("schema", {})
        return Structure("json_schema", json.dumps(schema))
    raise ApiError(400, "'response_format.type' must be 'text', 'json_object' or 'json_schema'",
                   param="response_format", code="invalid_value")


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def has_images(body: dict) -> bool:
    messages = body.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"]) for m in messages)


def image_bytes(part: dict, where: str) -> bytes:
    """An `image_url` content part's image: a data: URL (`data:image/png;base64,...`), as OpenAI's clients send a
    local file. The server fetches nothing from the network, so any other URL is refused."""
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str):
        raise _type_error(f"{where}.image_url", "an object with a 'url' string", ref)
    head, comma, data = url.partition(",")
    if not (url.startswith("data:") and comma and head.endswith(";base64")):
        raise ApiError(400, f"{where}.image_url: only base64 data: URLs are read (the server fetches nothing); got "
                       f"{url[:40]!r}", param=f"{where}.image_url", code="invalid_image_url")
    try:
        return base64.b64decode(data, validate=True)
    except (ValueError, binascii.Error):
        raise ApiError(400, f"{where}.image_url: the data: URL is not valid base64", param=f"{where}.image_url",
                       code="invalid_image_url") from None


def max_chars(engine) -> int:
    """The most characters a prompt can have and still fit the context: no token spans more characters than the
    vocabulary's longest. Longer text is refused before it is tokenized (which would hold a CPU and memory)."""
    return engine.config.text.max_position_embeddings * engine.tokenizer.max_token_chars


def tok_chat(tok, messages: Any, thinking: bool, placeholder: str | None = None,
             max_chars: int | None = None, tools: list[dict] | None = None) -> tuple[list[int], list[bytes]]:
    """(the conversation's ids through the chat template, the images of its `image_url` parts in order). Each image
    stands in its message as `placeholder` (the tokenizer's image token, expanded later to the image's soft tokens);
    None: the model reads no images. A conversation of more than `max_chars` characters of text is refused before
    anything is tokenized."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages", code="invalid_type")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(400, f"'messages' holds {len(messages)} messages; at most {MAX_MESSAGES} are read",
                       param="messages", code="invalid_value")
    out, images, chars = [], [], 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(where, "an object", m)
        role = m.get("role")
        if not isinstance(role, str) or (role not in ROLES and role != "tool"):  # a list or object: unhashable
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, tool (got {json.dumps(role)[:40]})",
                           param=f"{where}.role", code="invalid_value")
        content = m.get("content")
        extra: dict[str, Any] = {}
        if role == "tool":  # a tool's result, answering the call with this id
            extra["tool_call_id"] = str(m.get("tool_call_id") or "")
            if isinstance(m.get("name"), str):
                extra["name"] = m["name"]
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls is not None:
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                      for c in calls):
                raise _type_error(f"{where}.tool_calls", "a list of calls", calls)
            extra["tool_calls"] = [{"id": str(c.get("id") or ""), "type": "function",
                                    "function": {"name": str(c["function"].get("name") or ""),
                                                 "arguments": call_arguments(c["function"].get("arguments"),
                                                                             f"{where}.tool_calls[{k}]")}}
                                   for k, c in enumerate(calls)]
            if content is None:
                content = ""
        if isinstance(content, list):  # content parts: text, and images as data: URLs
            texts = []
            for k, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif kind == "image_url":
                    if placeholder is None:
                        raise ApiError(400, f"{where}.content[{k}]: this model has no vision tower, so it reads no "
                                       "images", param=f"{where}.content", code="unsupported_parameter")
                    images.append(image_bytes(part, f"{where}.content[{k}]"))
                    texts.append(Control(placeholder))
                else:
                    raise ApiError(400, f"{where}.content[{k}]: only text and image_url parts are supported",
                                   param=f"{where}.content", code="unsupported_parameter")
            content = texts
        elif not isinstance(content, str):
            raise _type_error(f"{where}.content", "a string or a list of text and image_url parts", content)
        chars += sum(len(t) for t in ([content] if isinstance(content, str) else content) if not isinstance(t, Control))
        out.append({"role": ROLES.get(role, role), "content": content, **extra})  # text, or text and images
    if max_chars is not None and chars > max_chars:
        raise ApiError(400, f"the messages' {chars} characters cannot fit the model's context", param="messages",
                       code="context_length_exceeded")  # known before tokenizing: no token holds more characters
    try:
        return tok.encode_chat(out, enable_thinking=thinking,
                               tools=[{"type": "function", "function": f} for f in tools] if tools else None), images
    except UsageError as e:
        raise ApiError(400, str(e), param="messages", code="invalid_value") from None


def call_arguments(value: Any, where: str) -> dict:
    """A call's arguments as the API sends them (a JSON string, or an object) -> the object, the string parsed as a
    body is (body.py: nesting and size limits, a helper process for a huge one): never a bare json.loads here."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = parse_body(value.encode("utf-8", "surrogatepass"))
        except BodyError as e:
            raise ApiError(400, f"{where}.function.arguments: {e.message}", param=f"{where}.function.arguments",
                           code="invalid_value") from None
    if not isinstance(value, dict):
        raise _type_error(f"{where}.function.arguments", "a JSON object (or its text)", value)
    return value


def completion_prompt(value: Any) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids): a string, a list of token ids, or a one-element list of either."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
        return value, None
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return None, list(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise ApiError(400, "one prompt per request (send several requests; they are batched)", param="prompt",
                       code="unsupported_parameter")
    raise _type_error("prompt", "a string or a list of token ids", value)


# ----------------------------------------------------------------------------- text as the canvases finish


class AnswerText(answer.AnswerText):
    """A request's answer text (answer.AnswerText) as its Prepared says: chat answers as `dgemma run` decodes them,
    completions and structured answers as their bytes, its stop strings, an infill's middle ending at pad too."""

    def __init__(self, tok, prep: Prepared):
        s = prep.job.settings
        super().__init__(tok, limit=s.max_new_tokens,
                         ends=set(s.eos_token_ids) | ({s.pad_token_id} if prep.job.held else set()),
                         chat=prep.kind == "chat" and not prep.structured, tools=prep.tools, stops=prep.stops)


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
    base = {"id": new_id(prep), "created": int(time.time()), "model": prep.model or server.model_id}
    if prep.kind == "chat":
        message = {"role": "assistant", "content": answer, "refusal": None}
        if calls:  # cut at max_tokens, the calls completed before the cut, with "length" (as the API does)
            message.update(content=answer or None, tool_calls=calls)
            reason = "length" if reason == "length" else "tool_calls"
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


def new_id(prep: Prepared) -> str:
    return ("chatcmpl-" if prep.kind == "chat" else "cmpl-") + secrets.token_hex(12)


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
        yield chunk(reason="tool_calls" if calls and reason != "length" else reason)
        if prep.include_usage:
            yield {**base, "choices": [], "usage": usage(prep, text.returned_tokens(), done)}

    return body(), ticket


# ----------------------------------------------------------------------------- routes


def build_app(server: Server, hosts: set[str] | None = None, origins: tuple[str, ...] = ()) -> Guard:
    """The routes, behind the Host / Origin / Content-Type checks (guard.py). hosts: the Host names answered
    (None: any); origins: the web page origins allowed to call it ("*": any)."""

    async def generate(request: Request, kind: str) -> Response:
        server.authorize(request)
        body = await read_json(request)
        prep = await prepared(server, body, kind, request)
        if prep.stream:
            return await answer_stream(server, prep)
        return await answer_whole(server, request, prep)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    def model_card(name: str) -> dict:
        cfg = server.engine.config
        card = {"id": name, "object": "model", "created": server.created, "owned_by": "dgemma",
                "max_model_len": cfg.text.max_position_embeddings, "canvas_length": cfg.canvas_length,
                "default_max_tokens": default_max_tokens(server.engine)}  # a request without max_tokens
        if name != server.model_id:  # a LoRA adapter on the base (vLLM's cards say the same with root/parent)
            card.update(root=name, parent=server.model_id)
        return card

    async def models(request: Request) -> Response:
        server.authorize(request)
        return JSONResponse({"object": "list", "data": [model_card(m) for m in server.model_ids]})

    async def model(request: Request) -> Response:
        server.authorize(request)
        if server.slot_of(request.path_params["name"]) is None:
            raise ApiError(404, f"the model '{request.path_params['name'][:100]}' does not exist", param="model",
                           code="model_not_found")
        return JSONResponse(model_card(request.path_params["name"]))

    async def health(request: Request) -> Response:
        loop = server.loop
        active, queued = loop.load()
        return JSONResponse({
            "status": "draining" if loop.closing else "ok", "model": server.model_id,
            "adapters": list(server.adapters), "active": active,
            "queued": queued, "max_batch": loop.max_batch, "max_queue": loop.max_queue, "completed": loop.completed,
            "failed": loop.failed, "forwards": loop.forwards, "row_forwards": loop.row_forwards,
            "peak_batch": loop.peak_batch, "sampler_buffer_bytes": loop.buffer_bytes,
            "prefix_cache": None if loop.prefixes is None else {
                "entries": len(loop.prefixes.entries), "bytes": loop.prefixes.bytes, "hits": loop.prefixes.hits,
                "reused_tokens": loop.prefixes.reused_tokens}})

    async def api_error(request: Request, exc: ApiError) -> Response:
        if is_ollama(request.url.path):  # Ollama's shape on its paths: {"error": "..."}
            return JSONResponse(error_body(request.url.path, exc.status, exc.message), status_code=exc.status,
                                headers=exc.headers)
        return exc.response()

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return await api_error(request, ApiError(exc.status_code, f"{request.method} {request.url.path}: "
                                                 f"{exc.detail}", code=code))

    async def internal_error(request: Request, exc: Exception) -> Response:
        line = (str(exc).strip().splitlines() or [""])[0][:300]
        sys.stderr.write(f"dgemma: internal error on {request.method} {request.url.path}: "
                         f"{type(exc).__name__}: {line}\n")
        return await api_error(request, ApiError(500, INTERNAL, code="internal_error"))

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        *responses_api.routes(server, sys.modules[__name__]),  # the Responses API, through the chat path
        *ollama_api.routes(server, sys.modules[__name__]),  # Ollama's API on the same engine and batch
    ]
    # An escaping exception reaches internal_error (one line, a 500), then Starlette raises it again: the guard
    # takes it there, so the HTTP server never sees it (it would log a traceback and close the connection).
    app = Starlette(routes=routes, exception_handlers={ApiError: api_error, HTTPException: http_error,
                                                      Exception: internal_error})
    return Guard(app, hosts, set(origins))


# ----------------------------------------------------------------------------- running


def listen(host: str, port: int) -> socket.socket:
    """A listening socket, bound before the model loads so that a taken port fails at once."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except (OSError, UnicodeError) as e:
        raise DgemmaError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}") from None
    sock.setblocking(False)
    return sock


def model_id(model: str) -> str:
    """The name clients send: a bundled model's ('demo', 'demo-sudoku'), a store name as given, or a directory's own
    name."""
    from pathlib import Path

    from ..checkpoint.names import BUNDLED, resolve_model

    path = resolve_model(model)
    return model if model in BUNDLED or not Path(model).expanduser().is_dir() else path.resolve().name


def serve(model: str, *, host: str, port: int, api_key: str | None, max_batch: int, max_queue: int,
          device: str, dtype: str, note, allow_hosts: tuple[str, ...] = (), allow_origins: tuple[str, ...] = (),
          prefix_cache_bytes: int = 0, adapters=(), header_timeout: float = HEADER_TIMEOUT,
          compile_budget: tuple[float | None, int | None] = (None, None)) -> int:
    """Bind, load, serve until SIGTERM or Ctrl-C, then finish every request in flight and return 0.

    adapters: (model id, directory, scale) of LoRA adapters served beside the base, each chosen per request;
    header_timeout: seconds a connection has to send a request's headers (header_timeout.py); compile_budget:
    (seconds, bytes) of each structure's compile (structured/worker.py; None: the default)."""
    import signal

    import uvicorn

    from ..engine import load

    sock = listen(host, port)
    names = [a[0] for a in adapters]
    if model_id(model) in names:
        raise UsageError(f"--adapter {model_id(model)}: the base model answers to that name already")
    engine = load(model, device=device, dtype=dtype, adapters=[(d, s) for _, d, s in adapters],
                  adapter_slots=list(range(1, len(adapters) + 1)) or None)
    if engine.tokenizer is None:
        raise ModelError(f"{engine.path}: no tokenizer.json: the server needs one to read text")
    engine.set_compile_budget(*compile_budget)  # each structure a client sends: structured/worker.py
    if engine.model.device.type == "cuda" and prefix_cache_bytes:  # the stored prompts live on the GPU: never more
        import torch

        free, _ = torch.cuda.mem_get_info(engine.model.device)  # than a quarter of what loading left free
        prefix_cache_bytes = min(prefix_cache_bytes, free // 4)
    loop = BatchLoop(engine.model, max_batch=max_batch, max_queue=max_queue, prefix_cache_bytes=prefix_cache_bytes)
    server = Server(engine, loop, model_id(model), api_key, adapters={n: i + 1 for i, n in enumerate(names)})
    # The objects loading made (modules, the model's) live as long as the server: out of the garbage collector's
    # sight, so that a full collection, which a request's many small objects can set off, does not walk them all
    # while holding the GIL (seen: 150 ms without an answer from /health).
    gc.collect()
    gc.freeze()
    app = build_app(server, allowed_hosts(host, allow_hosts), allow_origins)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=None, server_header=False,
                            http=header_deadline_protocol(header_timeout))
    class Http(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # a structure compiling in the worker would hold its request (and the drain) for its whole budget:
            # stopped now, that request gets its 503 and the drain goes on
            engine.close_compiler()
            super().handle_exit(sig, frame)

    http = Http(config)
    # uvicorn catches SIGINT/SIGTERM itself, drains, restores these handlers and raises the signal again: these
    # handlers make that a no-op, so a drained server exits 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    also = f"; adapters {', '.join(server.adapters)}" if server.adapters else ""
    note(f"serving {server.model_id} at http://{shown}:{bound[1]}/v1 (batch {max_batch}, queue {max_queue}{also}"
         f"{', API key required' if api_key else ''}); SIGTERM or Ctrl-C stops after the requests in flight")
    try:
        asyncio.run(http.serve(sockets=[sock]))
    finally:
        loop.close(drain=False, timeout=30)
        engine.close_compiler()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    note(f"stopped after {loop.completed} requests")
    return 0
