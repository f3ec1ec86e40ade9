"""`dgemma serve`: an OpenAI-compatible HTTP server over one batching engine loop (batching.py); this module holds its
routes and runs it (serve).

The rule: the server knows HTTP, JSON and text; generation is the loop's. A request is parsed and checked
(requests.py, with messages.py and constraints.py; every field the API defines is honoured, ignored as other local
servers ignore it, or refused with a 400 where ignoring it would mislead), turned into a `batching.Job`, and the
loop's events are turned into the API's responses (answering.py): one chunk per finished canvas when streaming, and
with `"stream_steps": true` one more chunk per denoising step carrying the canvas (`dgemma_step`), for pages that
draw it sharpening.

Routes: POST /v1/chat/completions, POST /v1/completions (`suffix`: infill with the held suffix, as `dgemma fim`),
POST /v1/responses (responses_api.py, through the chat path), GET /v1/models, GET /v1/models/{id}, GET /health;
Ollama's (ollama_api.py). Token log-probabilities: logprobs.py. Errors are JSON in the API's shape:
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import sys

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import DgemmaError, ModelError, UsageError
from . import ollama_api, responses_api
from .answering import answer_stream, answer_whole
from .batching import BatchLoop
from .guard import INTERNAL, Guard, allowed_hosts, error_body, is_ollama
from .header_timeout import DEFAULT_SECONDS as HEADER_TIMEOUT
from .header_timeout import protocol as header_deadline_protocol
from .protocol import ApiError, read_json
from .requests import default_max_tokens, prepared
from .state import Server

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
        *responses_api.routes(server),  # the Responses API, through the chat path
        *ollama_api.routes(server),  # Ollama's API on the same engine and batch
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
          compile_budget: tuple[float | None, int | None, int | None] = (None, None, None),
          gpu_memory: int | None = None, devices=None) -> int:
    """Bind, load, serve until SIGTERM or Ctrl-C, then finish every request in flight and return 0.
    gpu_memory: the card memory the placement plans for (--gpu-memory; engine.load), for max_batch rows. devices:
    the cards the layers may be split over (--devices; engine.load).

    adapters: (model id, directory, scale) of LoRA adapters served beside the base, each chosen per request;
    header_timeout: seconds a connection has to send a request's headers (header_timeout.py); compile_budget:
    (seconds, bytes, workers) of the structures' compiles (structured/worker.py; None: the default)."""
    import signal

    import uvicorn

    from ..engine import load

    sock = listen(host, port)
    names = [a[0] for a in adapters]
    if model_id(model) in names:
        raise UsageError(f"--adapter {model_id(model)}: the base model answers to that name already")
    engine = load(model, device=device, dtype=dtype, adapters=[(d, s) for _, d, s in adapters],
                  adapter_slots=list(range(1, len(adapters) + 1)) or None, gpu_memory=gpu_memory, devices=devices,
                  batch=max_batch, batch_flag="--max-batch")
    if engine.tokenizer is None:
        raise ModelError(f"{engine.path}: no tokenizer.json: the server needs one to read text")
    from ..placement.plan import loaded_summary

    if said := loaded_summary(engine.model):  # experts streamed, layers split: said once, at the start
        note(said)
    if getattr(engine.model, "kernel_note", None):  # the kernels checked on a card met for the first time
        note(engine.model.kernel_note)
    if getattr(engine.model, "tokenizer_note", None):  # a GGUF read with its own tokenizer
        note(engine.model.tokenizer_note)
    engine.set_compile_budget(*compile_budget)  # each structure a client sends: structured/worker.py
    engine.start_compiler()  # its worker reads and walks the vocabulary while the server starts
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
