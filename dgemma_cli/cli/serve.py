"""`dgemma serve`: its flags checked before torch is imported; the server itself is dgemma_cli/server."""

from __future__ import annotations

from typing import List, Optional

import typer

from ..errors import UsageError
from ..server.guard import is_loopback
from .options import (
    COMPILE_MEMORY_OPTION,
    COMPILE_TIMEOUT_OPTION,
    DEVICES_OPTION,
    GPU_MEMORY_OPTION,
    MODEL_HELP,
    QUIET_OPTION,
    be_quiet,
    check_device_dtype,
    compile_budget,
    devices_arg,
    gpu_memory_arg,
    model_arg,
    note,
)


def serve(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; one other than loopback needs "
                             "--api-key."),
    port: int = typer.Option(8000, "--port", help="TCP port (0: any free port, said on stderr)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="DGEMMA_API_KEY", show_envvar=True,
                                          help="Require 'Authorization: Bearer KEY' on /v1 routes."),
    max_batch: int = typer.Option(8, "--max-batch", help="Requests generated together."),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests waiting for a slot; past it, 429."),
    prefix_cache: int = typer.Option(1024, "--prefix-cache", metavar="MB",
                                     help="Memory for encoded prompts a later request may start with (a resent "
                                     "conversation encodes only what is new); 0: off."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    dtype: str = typer.Option("auto", "--dtype", help="float32, bfloat16, float16 or auto."),
    allow_origin: Optional[List[str]] = typer.Option(
        None, "--allow-origin", metavar="ORIGIN", help="A web page origin (scheme://host[:port]) whose pages may "
        "call the server (CORS); repeatable; '*' for any. Default: none."),
    allow_host: Optional[List[str]] = typer.Option(
        None, "--allow-host", metavar="NAME", help="A name clients may reach the server by (its Host header), "
        "besides the --host address and localhost; repeatable; '*' for any."),
    adapter: Optional[List[str]] = typer.Option(
        None, "--adapter", metavar="NAME=DIR[:SCALE]", help="Serve a LoRA adapter (PEFT's format) as the model id "
        "NAME beside the base; repeatable. Requests choose by 'model'; requests for different adapters share a "
        "batch."),
    header_timeout: float = typer.Option(10.0, "--header-timeout", metavar="SECONDS",
                                         help="Close a connection that has not sent a whole request line and "
                                         "headers within this time."),
    gpu_memory: Optional[str] = GPU_MEMORY_OPTION,
    devices: Optional[str] = DEVICES_OPTION,
    compile_timeout: float = COMPILE_TIMEOUT_OPTION,
    compile_memory: float = COMPILE_MEMORY_OPTION,
    compile_workers: int = typer.Option(2, "--compile-workers", metavar="N",
                                        help="Processes that compile requests' structures, each within "
                                        "--compile-memory: a structure that takes its whole --compile-timeout "
                                        "holds one, and the others go on compiling other clients' structures."),
    quiet: bool = QUIET_OPTION,
) -> None:
    """An OpenAI-compatible HTTP server (chat, completions with suffix infill, models), batching requests."""
    be_quiet(quiet)
    named = []
    for a in adapter or []:
        name, sep, where = a.partition("=")
        if not sep or not name or not where:
            raise UsageError(f"--adapter {a}: give it as NAME=DIR (the model id clients send, then the adapter)")
        if not all(c.isalnum() or c in "-_.:/" for c in name) or len(name) > 128:
            raise UsageError(f"--adapter {a}: NAME may hold letters, digits and - _ . : / only")
        if name in (n for n, _, _ in named):
            raise UsageError(f"--adapter {name}: named twice")
        from ..checkpoint.names import resolve_adapter

        named.append((name, *resolve_adapter(where)))
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535 (got {port})")
    if max_batch < 1:
        raise UsageError("--max-batch must be at least 1")
    if max_queue < 0:
        raise UsageError("--max-queue must be at least 0")
    if prefix_cache < 0:
        raise UsageError("--prefix-cache must be at least 0 (MB; 0 turns it off)")
    if not 0 < header_timeout <= 3600:  # NaN too
        raise UsageError(f"--header-timeout must be between 0 and 3600 seconds (got {header_timeout:g})")
    budget = compile_budget(compile_timeout, compile_memory)
    if not 1 <= compile_workers <= 64:
        raise UsageError(f"--compile-workers must be between 1 and 64 (got {compile_workers})")
    card_bytes = gpu_memory_arg(gpu_memory)
    cards = devices_arg(devices)
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key must not be empty")
    if not is_loopback(host) and not api_key:
        raise UsageError(f"--host {host} can be reached from other machines: pass --api-key KEY (or set "
                         "DGEMMA_API_KEY)")
    check_device_dtype(device, dtype)
    model = model_arg(model, quiet)  # before torch is imported
    from ..server.app import serve as run_server  # heavy: torch, starlette, uvicorn

    raise typer.Exit(run_server(model, host=host, port=port, api_key=api_key, max_batch=max_batch,
                                max_queue=max_queue, device=device, dtype=dtype, note=note,
                                prefix_cache_bytes=prefix_cache * 2**20, adapters=named,
                                allow_hosts=tuple(allow_host or ()), allow_origins=tuple(allow_origin or ()),
                                header_timeout=header_timeout, compile_budget=(*budget, compile_workers),
                                gpu_memory=card_bytes, devices=cards))
