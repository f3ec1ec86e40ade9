"""Launch settings tuned on the user's GPU the first time a problem is seen, then remembered.

A kernel's wrapper offers candidate launch settings as data (plain dicts: block sizes, num_warps, num_stages) and a
`launch(cfg)` that runs the kernel once with them, writing only its output (so it can run many times):

    cfg = tuning.choose("nvfp4_linear", (m_bucket, N, K, str(x.dtype)), CANDIDATES, lambda c: _launch(c, ...))

The first time a (kernel, key) is seen on a CUDA device, `choose` runs each candidate once (compile, warm-up),
times a few more runs with CUDA events, skips any candidate that raises, and keeps the fastest; later calls, and
later processes, read it from memory or from the cache file. The key must hold everything the best settings
depend on (shape buckets, dtype). On the CPU (Triton's interpreter: tests) it returns candidates[0], timing and
writing nothing; during a CUDA-graph capture it never times (an untuned key gets candidates[0], not remembered).

The cache is one JSON file per GPU model and dgemma version, `<home>/kernels/<gpu model>-<version>.json` (see
`cache_path`), written atomically: {"device": ..., "dgemma": ..., "configs": {kernel: {json(key): cfg}}}. An
unreadable file is ignored (tuning again) and a home that cannot be written only means nothing is saved: one line
on stderr each, never an error. A cached setting that is no longer among the candidates is tuned again.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import torch

from . import interpreting

REPS = 5  # timed runs per candidate, after one untimed (compile and warm-up)

_memory: dict[tuple[str, str, tuple], dict] = {}  # (gpu model, kernel, key) -> chosen cfg
_names: dict[int, str] = {}  # CUDA device index -> GPU model
_files: dict[Path, dict] = {}  # cache files read this process: path -> {kernel: {json key: cfg}}
_warned: set[str] = set()  # stderr lines already printed (one per cause and file)


def home() -> Path:
    """dgemma's home for caches: `$DGEMMA_HOME`, else `$XDG_CACHE_HOME/dgemma`, else `~/.cache/dgemma`. The same
    rule as the model store (dgemma_cli/store/models.py), repeated here because quant/ never imports dgemma_cli."""
    if os.environ.get("DGEMMA_HOME"):
        return Path(os.environ["DGEMMA_HOME"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "dgemma"


def version() -> str:
    try:
        from importlib.metadata import version as dist_version

        return dist_version("dgemma")
    except Exception:  # a checkout run without installing it
        return "dev"


def cache_path(gpu: str) -> Path:
    """`<home>/kernels/<gpu model>-<dgemma version>.json`, the model name reduced to [A-Za-z0-9._-]."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", gpu).strip("_") or "gpu"
    return home() / "kernels" / f"{name}-{version()}.json"


# ----------------------------------------------------------------------------- hooks (tests replace these)


def device_name(device: torch.device | None) -> str | None:
    """The GPU model whose settings apply, or None where nothing is tuned (the CPU, Triton's interpreter)."""
    if (device is not None and device.type != "cuda") or interpreting() or not torch.cuda.is_available():
        return None
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    if index not in _names:  # asked on every kernel call: the driver is asked once
        _names[index] = torch.cuda.get_device_name(index)
    return _names[index]


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def timer(run: Callable[[], object], device: torch.device | None) -> float:
    """Milliseconds per call of `run` on `device`'s current stream: one untimed call (compile, warm-up), then REPS
    timed with CUDA events."""
    with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
        run()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPS):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / REPS


# ----------------------------------------------------------------------------- choosing


def choose(kernel: str, key: tuple, candidates: Sequence[dict], launch: Callable[[dict], object],
           device: torch.device | None = None) -> dict:
    """The launch settings for `kernel` on problem `key` (see the module docstring). `device` is the tensors'
    device (default: the current CUDA device)."""
    gpu = device_name(device)
    if gpu is None:
        return candidates[0]
    mem = (gpu, kernel, key)
    if mem in _memory:  # every call after the first: one lookup
        return _memory[mem]
    jkey = json.dumps(list(key))  # the key's elements must be JSON values (ints, strings: pass str(dtype))
    saved = _load(cache_path(gpu)).get(kernel, {}).get(jkey)
    for cfg in candidates:  # a setting from an older candidate list is tuned again
        if cfg == saved:
            _memory[mem] = cfg
            return cfg
    if capturing():  # timing would be recorded into the graph, not run
        return candidates[0]
    best, best_ms = None, float("inf")
    for cfg in candidates:
        try:
            ms = timer(functools.partial(launch, cfg), device)
        except Exception:  # does not compile, or needs more resources than this GPU has: not a candidate here
            continue
        if ms < best_ms:  # ties keep the earlier candidate
            best, best_ms = cfg, ms
    if best is None:  # nothing ran: leave the error to the caller's own launch, remember nothing
        return candidates[0]
    _memory[mem] = best
    _save(cache_path(gpu), gpu, kernel, jkey, best)
    return best


def _warn_once(tag: str, line: str) -> None:
    if tag not in _warned:
        _warned.add(tag)
        print(line, file=sys.stderr)


def _read(path: Path) -> dict:
    """{kernel: {json key: cfg}} from a cache file; {} when there is none; raises ValueError/OSError if damaged."""
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):  # nothing saved yet (or a home that is not a folder)
        return {}
    data = json.loads(text)
    configs = data.get("configs") if isinstance(data, dict) else None
    if not isinstance(configs, dict) or not all(isinstance(v, dict) for v in configs.values()):
        raise ValueError("not a kernel settings file")
    return configs


def _load(path: Path) -> dict:
    if path not in _files:
        try:
            _files[path] = _read(path)
        except (OSError, ValueError) as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            _warn_once(f"read {path}", f"dgemma: ignoring the unreadable kernel settings cache {path} "
                                       f"({type(e).__name__}: {e}); tuning again")
            _files[path] = {}
    return _files[path]


def _save(path: Path, gpu: str, kernel: str, jkey: str, cfg: dict) -> None:
    """Merge one entry into the file (re-read first: another process may have added its own) and replace it
    atomically. A read-only or full home only means the setting is tuned again next run."""
    try:
        configs = _read(path)
    except (OSError, ValueError):
        configs = {}  # damaged: already reported by _load; rewritten whole
    configs.setdefault(kernel, {})[jkey] = cfg
    _files[path] = configs
    try:
        write_json(path, {"device": gpu, "dgemma": version(), "configs": configs})
    except OSError as e:
        _warn_once(f"write {path}", f"dgemma: cannot save tuned kernel settings to {path} "
                                    f"({type(e).__name__}: {e}); they will be tuned again next run")


def write_json(path: Path, data) -> None:
    """`data` as JSON at `path`, whole or not at all (a temporary file beside it, renamed over it); its folder made.
    OSError when it cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def reset() -> None:
    """Forget everything this process chose or read (a fresh process, for tests)."""
    _memory.clear()
    _names.clear()
    _files.clear()
    _warned.clear()
