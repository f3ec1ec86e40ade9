"""A request's body checked and turned into what the batch loop runs (Prepared: the job and how to answer): the
sampler's fields, stops, the default max_tokens, log-probabilities; the messages and prompts are messages.py's,
tools and structures constraints.py's. Every field the API defines is honoured, ignored as other local servers
ignore it, or refused with a 400 where ignoring it would mislead."""

from __future__ import annotations

import asyncio
import secrets
import threading
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from ..checkpoint.layout import check_images
from ..config import IMAGE_TOKEN_BUDGETS
from ..errors import DgemmaError, UsageError
from ..structured.worker import Busy, Cancelled, Stopped
from .batching import Job
from .constraints import GUIDED, guided_fields, request_tools, response_structure
from .messages import completion_prompt, has_images, max_chars, tok_chat
from .protocol import (
    MAX_STEPS,
    MAX_STOP,
    MAX_STOP_CHARS,
    ApiError,
    get_bool,
    get_float,
    get_int,
    refuse,
    type_error,
    wait_disconnect,
)
from .state import Server


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
        raise type_error("model", "a string", model)
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
        raise type_error("stream_options", "an object", options)
    include_usage = bool(get_bool(options or {}, "include_usage"))
    stops = body.get("stop")
    stops = [stops] if isinstance(stops, str) else (stops or [])
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise type_error("stop", "a string or a list of non-empty strings", body.get("stop"))
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
            raise type_error("suffix", "a string", suffix)
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
            automaton = engine.automaton(structure, cancelled, max_tokens=settings.max_new_tokens)
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
