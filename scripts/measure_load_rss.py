"""Peak resident memory of `load_model` on a synthetic multi-GB checkpoint (the "S + 1 GB" requirement).

Requirement: loading a checkpoint of S GB keeps peak RSS under S + 1 GB. Measured as the growth of the loading
process's peak RSS over its baseline (RSS once torch and dgemma_cli are imported), so the interpreter and
torch's own ~0.2 GB do not count against the weights.

Each measurement runs in a fresh subprocess (`--child`), so the peak belongs to one load and nothing else:
1. import torch and dgemma_cli; record RSS (baseline);
2. `load_model(dir, device="cpu", dtype=...)`;
3. touch every parameter (sum it), so pages that are only mapped become resident and count;
4. record peak RSS (ru_maxrss of RUSAGE_SELF, and VmHWM from /proc/self/status), the anonymous and file-backed
   parts of the current RSS, which parameters lie inside a mapping of a checkpoint file, and how many pages of
   the vision tensor (which must never be read) are mapped into the process (from /proc/self/pagemap).

Two loads are measured:
- dtype=None (keep the checkpoint's dtype): tensors are views of the memory-mapped files, so the weights are
  file-backed pages. Bound: peak - baseline < S + 1 GB.
- a converting load (bfloat16 from a float32 checkpoint; float32 from a bfloat16 one, which is what the CLI's
  `--dtype auto` does on the CPU): every tensor is read through a small bounce buffer into new (anonymous)
  memory of S_converted bytes (S/2 or 2S); nothing stays mapped. Bound: peak - baseline < S_converted + 1 GB,
  with S_converted the bytes of the converted parameters.

Sizes are decimal (1 GB = 1e9 bytes); S is the total size of the checkpoint's files.

    python scripts/measure_load_rss.py --gb 3            # builds a 3 GB checkpoint in a temp dir, measures, cleans up
    python scripts/measure_load_rss.py --gb 3 --dtype bfloat16   # a bfloat16 checkpoint (converted to float32)
    python scripts/measure_load_rss.py --dir CKPT        # measures an existing checkpoint
    options: --keep (keep the temp checkpoint), --json FILE (write the figures), --slack-gb (default 1),
             --no-convert (skip the bfloat16 load)
Exit status 1 when a bound fails.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GB = 1_000_000_000
PAGE = os.sysconf("SC_PAGE_SIZE")


# ----------------------------------------------------------------------------- inside the loading process


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem from /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def file_mappings(paths: set[str]) -> list[tuple[int, int, str, int]]:
    """(start, end, path, file offset) of every mapping in this process of one of `paths`."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() in paths:
                a, b = (int(x, 16) for x in parts[0].split("-"))
                out.append((a, b, parts[5].strip(), int(parts[2], 16)))
    return out


def present_pages(start: int, end: int) -> int:
    """How many pages of the virtual range [start, end) are mapped in this process (pagemap bit 63).

    The present bit is readable without privileges (only frame numbers are hidden).
    """
    first, last = start // PAGE, (end + PAGE - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first) * 8)
    return sum(1 for i in range(7, len(raw), 8) if raw[i] & 0x80)


def child(directory: str, dtype_name: str, gpu_memory: int | None = None) -> dict:
    """Load the checkpoint in this process and return the figures (see the module docstring). With `gpu_memory`,
    the load follows the placement plan for a card of that size, as `--gpu-memory` makes it on the CPU: the streamed
    layers' experts read into the host store and the two layer buffers made (dgemma_cli/placement/streaming.py)."""
    import torch

    from dgemma_cli.checkpoint.weights import index_checkpoint, load_model

    dtype = None if dtype_name == "none" else getattr(torch, dtype_name)
    records = index_checkpoint(Path(directory))
    files = {str(r.file) for r in records.values()}
    checkpoint_bytes = sum(os.path.getsize(f) for f in files)
    placement = None
    if gpu_memory is not None:
        from dgemma_cli.engine import plan_placement

        placement = plan_placement(Path(directory), torch.device("cpu"), gpu_memory)
    streamed = placement.streamed if placement is not None else []
    baseline = proc_status()

    t0 = time.perf_counter()
    model, cfg = load_model(directory, device="cpu", dtype=dtype, host_layers=frozenset(streamed))
    stream = None
    if streamed:
        from dgemma_cli.placement.streaming import ExpertStream

        stream = ExpertStream(model, streamed, torch.device("cpu"))
    load_s = time.perf_counter() - t0
    after_load = proc_status()

    t0 = time.perf_counter()
    checksum = 0.0
    for p in model.parameters():
        checksum += float(p.sum())  # reads every element: mapped pages become resident
    touch_s = time.perf_counter() - t0
    after_touch = proc_status()
    ru_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    # Which parameters are views of a checkpoint file's mapping (zero copy) and which own memory.
    maps = file_mappings(files)
    params = dict(model.named_parameters())
    not_mapped = [n for n, p in params.items() if not any(a <= p.data_ptr() < b for a, b, _, _ in maps)]
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())

    # Pages of tensors the loader must not read (the vision tower) that were mapped into the process anyway.
    skipped = {n: r for n, r in records.items() if ".vision_tower." in n}
    skipped_pages = skipped_total = 0
    for r in skipped.values():
        skipped_total += (r.end - r.start + PAGE - 1) // PAGE
        for a, b, path, off in maps:
            if path == str(r.file):
                lo, hi = max(a, a - off + r.start), min(b, a - off + r.end)
                if lo < hi:
                    skipped_pages += present_pages(lo, hi)

    store = [t for host in (stream.host.values() if stream else []) for t in host.values()]
    return {
        "dtype": dtype_name,
        "streamed_layers": streamed,
        "plan_host_bytes": placement.host_bytes if placement is not None else 0,
        "store_bytes": sum(t.numel() * t.element_size() for t in store),
        "buffer_bytes": stream.buffer_bytes if stream else 0,
        "store_file_backed": sum(any(a <= t.data_ptr() < b for a, b, _, _ in maps) for t in store),
        "model_dtype": str(model.dtype).replace("torch.", ""),
        "checkpoint_bytes": checkpoint_bytes,
        "param_bytes": param_bytes,
        "baseline_rss": baseline["VmRSS"],
        "baseline_hwm": baseline["VmHWM"],
        "after_load_rss": after_load["VmRSS"],
        "after_touch_rss": after_touch["VmRSS"],
        "anon_growth": after_touch["RssAnon"] - baseline["RssAnon"],
        "file_growth": after_touch["RssFile"] - baseline["RssFile"],
        "peak_ru_maxrss": ru_maxrss,
        "peak_vmhwm": after_touch["VmHWM"],
        "params": len(params),
        "params_not_file_backed": not_mapped,
        "file_mappings": len(maps),
        "skipped_pages_present": skipped_pages,
        "skipped_pages_total": skipped_total,
        "load_s": round(load_s, 3),
        "touch_s": round(touch_s, 3),
        "checksum": checksum,
    }


# ----------------------------------------------------------------------------- the parent


def measure(directory: Path, dtype_name: str = "none", timeout: float = 1800, gpu_memory: int | None = None) -> dict:
    """Run `child` in a fresh interpreter and return its figures, plus peak growth over the baseline."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(directory), dtype_name,
           *([str(gpu_memory)] if gpu_memory is not None else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"loading subprocess failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    # VmHWM belongs to this process's own address space. ru_maxrss does not always: Linux carries it across
    # exec, so a child forked from a large parent (a long pytest run) reports the parent's peak.
    figures["peak"] = figures["peak_vmhwm"]
    figures["peak_growth"] = figures["peak"] - figures["baseline_rss"]
    return figures


def checkpoint_dtype(directory: Path) -> str:
    from dgemma_cli.checkpoint.weights import index_checkpoint, text_prefix

    records = index_checkpoint(directory)
    return str(records[text_prefix(records) + "embed_tokens.weight"].dtype).replace("torch.", "")


def gb(n: float) -> str:
    return f"{n / GB:.3f}"


def print_table(rows: list[dict], slack: float) -> None:
    head = ["checkpoint", "dtype arg", "model", "S GB", "baseline GB", "peak ru_maxrss GB", "peak VmHWM GB", "peak-baseline GB",
            "bound GB", "anon +GB", "file +GB", "not file-backed", "vision pages", "load s", "result"]
    lines = []
    for r in rows:
        lines.append([
            r["checkpoint_dtype"], "None" if r["dtype"] == "none" else r["dtype"], r["model_dtype"],
            gb(r["checkpoint_bytes"]), gb(r["baseline_rss"]),
            gb(r["peak_ru_maxrss"]), gb(r["peak_vmhwm"]), gb(r["peak_growth"]), gb(r["bound"]),
            gb(r["anon_growth"]), gb(r["file_growth"]), f"{len(r['params_not_file_backed'])}/{r['params']}",
            f"{r['skipped_pages_present']}/{r['skipped_pages_total']}", f"{r['load_s']:.2f}",
            "PASS" if r["ok"] else "FAIL",
        ])
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    print(" | ".join(h.rjust(w) for h, w in zip(head, widths)))
    print("-+-".join("-" * w for w in widths))
    for x in lines:
        print(" | ".join(v.rjust(w) for v, w in zip(x, widths)))
    print(f"\nbaseline: RSS after importing torch and dgemma_cli, before loading. peak: the loading process's "
          f"high-water mark\n(ru_maxrss and VmHWM, after every parameter was summed). bound: S + {slack / GB:g} GB "
          f"when the dtype is kept;\nconverted bytes + {slack / GB:g} GB when load_model converts (read through a "
          f"bounce buffer). anon/file: growth of\nRssAnon/RssFile from baseline to after the touch. "
          f"not file-backed: parameters outside the checkpoint mappings\n(the two stacked [L] layer scalars are "
          f"expected). vision pages: mapped pages of the never-read vision tensor.")


def run(directory: Path, slack: float, convert: bool) -> list[dict]:
    """Measure the kept-dtype load and, if `convert`, a converting one; add each row's bound and verdict."""
    rows = []
    src = checkpoint_dtype(directory)
    dtypes = ["none"]
    if convert:
        dtypes.append("bfloat16" if src != "bfloat16" else "float32")
    for dtype_name in dtypes:
        r = measure(directory, dtype_name)
        r["checkpoint_dtype"] = src
        converted = r["model_dtype"] != src
        r["bound"] = (r["param_bytes"] if converted else r["checkpoint_bytes"]) + slack
        r["ok"] = r["peak_growth"] < r["bound"]
        rows.append(r)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        print(json.dumps(child(argv[1], argv[2], int(argv[3]) if len(argv) > 3 else None)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=3.0, help="size of the synthetic checkpoint in GB (1e9 bytes)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="dtype of the synthetic checkpoint (default float32)")
    ap.add_argument("--dir", type=Path, help="measure this checkpoint directory instead of building one")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint (its path is printed)")
    ap.add_argument("--slack-gb", type=float, default=1.0, help="allowed growth beyond S (default 1 GB)")
    ap.add_argument("--no-convert", action="store_true", help="skip the bfloat16-conversion load")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    args = ap.parse_args(argv)

    tmp = None
    directory = args.dir
    if directory is None:
        from synth_checkpoint import DTYPES, write_checkpoint

        tmp = Path(tempfile.mkdtemp(prefix="dgemma-rss-"))
        directory = tmp / "checkpoint"
        t0 = time.perf_counter()
        info = write_checkpoint(directory, args.gb, DTYPES[args.dtype])
        print(f"wrote {gb(info['file_bytes'])} GB synthetic checkpoint ({info['layers']} layers, {info['experts']} "
              f"experts, {info['shards']} shards, {info['dtype']}) to {directory} in "
              f"{time.perf_counter() - t0:.1f} s")
    try:
        rows = run(directory, args.slack_gb * GB, not args.no_convert)
    finally:
        if tmp is not None and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp is not None:
            print(f"kept {directory}")
    print()
    print_table(rows, args.slack_gb * GB)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    failed = [r["dtype"] for r in rows if not r["ok"]]
    if failed:
        print(f"\nFAIL: peak RSS growth over the bound for load dtype {', '.join(failed)}")
        return 1
    print("\nPASS: every load stayed within its bound")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
