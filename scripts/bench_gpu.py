"""The prepared GPU check (`make bench-gpu`): `dgemma doctor`, then the timed steps, in at most 8 minutes on one H100.

    PYTHONPATH=. python3 scripts/bench_gpu.py [--out DIR] [--quick] [--dry-run] [--no-benchmarks]
    python3 scripts/bench_gpu.py --plan                              # the parts and their budgets; no GPU touched
    python3 scripts/bench_gpu.py --write-benchmarks DIR/bench-gpu.json  # a fetched run's rows into BENCHMARKS.md

Runs under the machine's own python3 (torch with CUDA and Triton, Python 3.12); what dgemma needs beside them travels
as wheels in a `.whl` folder, which `make bench-gpu` installs into /tmp/site first when it is there (nothing is
fetched). The parts, in the order of PARTS (one table: each part's budget, or why it is not timed), each printed as
soon as it is done and saved to DIR/bench-gpu.json (DIR: $OUT, else the current folder):
1. `dgemma doctor --json DIR/doctor.json` in a subprocess: every kernel family against the torch path on this card
   (exit 0: every check passed or did not apply; 1: a family was turned off). Where the command is not there yet
   it is recorded as "not available" and the run goes on;
2. the timed steps: `dgemma bench` on the real 26B-A4B shapes (random weights made on the GPU), canvas 256, 16 fixed
   steps, each row in a subprocess of its own (the same script with --row) stopped at its budget: NVFP4 (every
   projection, as the kernel report's NVFP4 rows) at batch 1 and 4 after 256 prompt tokens (the kernel report's
   context, so each is timed beside its static bound), the same planned for a 12 GB card (--gpu-memory: the experts
   that do not fit stream from pinned host memory), a GGUF of the published Q4_K_M's mix at batch 1 (its blocks
   read by its own kernels; beside its bound and the NVFP4 step), INT8 and bf16 at batch 1, NVIDIA's NVFP4 release
   (experts only) at an 8k prompt (peak memory). What the issue names and `dgemma bench` cannot time (FP8 W8A8, the server
   batched, a held answer at the real vocabulary, the transformers reference) is listed as "not timed" with why;
3. the targets, each met, not met or not measured; the measured rows written into BENCHMARKS.md's GPU check section
   beside the kernel report's static bounds (`write_benchmarks`: only rows that were measured; nothing is written
   where nothing was measured; --no-benchmarks: none), and the same block saved to DIR/bench-gpu.md.

The budget: TOTAL_S seconds from the start of `make bench-gpu` (BENCH_GPU_START, its wheels' install included), else
from this script's start. A part whose budget the time left (less the report's reserve) cannot hold is recorded as
"skipped: budget"; a part that runs is stopped at its budget ("timed out"), so the run ends within TOTAL_S. The
budgets are allowances, not measurements. The kernel tests and the gpu-marked tests are not part of this run
(`python3 -m pytest -m gpu` runs them); the doctor is the kernel check here. --dry-run: the same script on the CPU
at the tiny config (the Triton kernels in Triton's interpreter, dgemma's home in DIR/dgemma-home, the rows written
into a copy, DIR/BENCHMARKS.md): a check of this script, no figures. The commit recorded is git's, else
$BENCH_GPU_COMMIT (a checkout copied without its .git), else "unknown".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOTAL_S = 480  # the whole run on one H100, from a fresh checkout: a run and a rerun fit in 15 minutes of GPU time
ROW_PREFIX = "bench-gpu row: "  # a --row subprocess's result, one JSON object on the last line of its stdout
BENCH_BEGIN, BENCH_END = "<!-- bench-gpu:begin -->", "<!-- bench-gpu:end -->"
NOT_YET = "No GPU run has been measured yet"  # the GPU check section's paragraph until a run's rows replace it


@dataclass(frozen=True)
class Part:
    label: str
    budget: int | None  # seconds on one H100, the part stopped there (an allowance, not a measurement); None: not timed
    kind: str  # setup, doctor, bench, not timed, report
    what: str = ""  # what the part is, or why it is not timed
    bench: dict | None = None  # run_bench's arguments (kind bench)
    bound: tuple[str, int] | None = None  # the kernel report's (format, batch) row it is timed beside


NVFP4_ALL = dict(fmt="nvfp4", policy="all", prompt=256)
PARTS = [
    Part("setup", 15, "setup", "wheels installed from .whl when present; python, torch and the device"),
    Part("doctor", 135, "doctor", "`dgemma doctor --json DIR/doctor.json`: every kernel family on this card, small "
         "and at the real model's sizes (each call timed against its bound), the graph, copy stream and split"),
    Part("nvfp4 (all) b1 p256", 70, "bench", "the first row at the real shapes: Triton compiles what the doctor "
         "did not (its cache is shared)",
         dict(NVFP4_ALL, batch=1), ("nvfp4", 1)),
    Part("nvfp4 (all) b4 p256", 40, "bench", "batch 4", dict(NVFP4_ALL, batch=4), ("nvfp4", 4)),
    Part("nvfp4 (all) b1 p256 in 12 GB", 50, "bench", "planned for a 12 GB card: experts streamed from host memory",
         dict(NVFP4_ALL, batch=1, gpu_memory=12 * 10**9)),
    Part("fp8 w8a8 (all) b1 p256", 40, "bench", "FP8 weights and activations (W8A8, the FP8 tensor cores): its "
         "kernels compile", dict(fmt="fp8", policy="all", batch=1, prompt=256), ("w8a8-fp8", 1)),
    Part("gguf q4_k_m b1 p256", 35, "bench", "a GGUF of the published Q4_K_M's mix, held as dgemma holds the file "
         "(random blocks): its block-reading kernels compile and run", dict(fmt="gguf-q4_k_m", batch=1, prompt=256),
         ("gguf-q4_k_m", 1)),
    Part("fp8 w8a8 (all) b4 p256", 30, "bench", "batch 4", dict(fmt="fp8", policy="all", batch=4, prompt=256),
         ("w8a8-fp8", 4)),
    Part("bf16 b1 p256", 25, "bench", "16-bit weights (50.5 GB)", dict(fmt="bf16", batch=1, prompt=256)),
    Part("nvfp4 (experts) b1 p8192", 35, "bench", "NVIDIA's release as published, an 8k prompt: peak memory",
         dict(fmt="nvfp4", policy="experts", batch=1, prompt=8192)),
    Part("int8 (all) b1 p256", None, "not timed",
         "outside the 8-minute plan, which times the issue's rows first (NVFP4, FP8 W8A8): `dgemma bench --config "
         "real --format int8 --policy all` times it alone"),
    Part("server batched", None, "not timed",
         "`dgemma bench` times the denoise step alone; scripts/bench_serve.py serves a model from disk (a real "
         "checkpoint cannot be fetched there, random weights cannot be served) through the openai client"),
    Part("held answer at the real vocabulary", None, "not timed",
         "`dgemma bench` has no structure option; scripts/bench_structured.py times the search on the CPU, "
         "on random log-probabilities"),
    Part("bf16 vs transformers", None, "not timed",
         "outside the 8-minute plan: the reference builds a second 26B model and compiles it "
         "(`dgemma bench --config real --format bf16 --compare transformers` times it alone)"),
    Part("report", 5, "report", "targets, DIR/bench-gpu.json, the measured rows into BENCHMARKS.md"),
]
PART_BY_LABEL = {p.label: p for p in PARTS}


def planned_seconds(parts: list[Part] = PARTS) -> int:
    return sum(p.budget for p in parts if p.budget is not None)


def plan_text(parts: list[Part] = PARTS, total: int = TOTAL_S) -> str:
    """Each part with its budget in seconds (or why it is not timed) and the total against the limit."""
    width = max(len(p.label) for p in parts)
    lines = [f"make bench-gpu on one H100: {len(parts)} parts, budgets in seconds (allowances each part is stopped "
             "at, not measurements)"]
    for p in parts:
        what = p.what if p.budget is not None else f"not timed: {p.what}"
        text = textwrap.wrap(what, 116 - width, subsequent_indent="  ") or [""]
        lines.append(f"  {p.label:<{width}}  {'-' if p.budget is None else p.budget:>3}  {text[0]}")
        lines += [" " * (width + 9) + more for more in text[1:]]
    lines.append(f"  {'total':<{width}}  {planned_seconds(parts):>3}  of {total} s (8 minutes)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the runner and its budget


def run_parts(parts: list[Part], run: Callable[[Part], dict], clock: Callable[[], float] = time.monotonic,
              start: float | None = None, total: int = TOTAL_S,
              record: Callable[[str, dict], None] | None = None) -> dict:
    """Each part in order, by `run(part)` (a dict; the part's budget is its limit), timed on `clock` from `start`
    (default: now). A part is skipped ({"skipped": "budget"}) when the time left, less the report's reserve, is less
    than its budget; a part not timed is recorded with why; setup is the time taken before the first part. `record`
    hears each part's result as it is done."""
    start = clock() if start is None else start
    reserve = sum(p.budget for p in parts if p.kind == "report")
    results: dict = {}

    def done(label: str, r: dict) -> None:
        results[label] = r
        if record:
            record(label, r)

    for p in parts:
        elapsed = clock() - start
        if p.kind == "setup":
            done(p.label, {"seconds": round(elapsed, 1), "budget_s": p.budget})
        elif p.kind == "report":
            continue
        elif p.budget is None:
            done(p.label, {"not timed": p.what})
        elif total - reserve - elapsed < p.budget:
            done(p.label, {"skipped": "budget", "elapsed_s": round(elapsed, 1), "budget_s": p.budget})
        else:
            t = clock()
            r = dict(run(p))
            r.update(seconds=round(clock() - t, 1), budget_s=p.budget)
            done(p.label, r)
    return results


def run_limited(argv: list[str], env: dict, timeout: float, stderr_to=subprocess.PIPE) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr) of a subprocess in a process group of its own, killed with its children at
    `timeout` seconds (exit code None)."""
    p = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr_to, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err or ""
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = p.communicate()
        return None, out or "", err or ""


def doctor_command(json_path: Path, quick: bool = False) -> list[str]:
    return [sys.executable, "-m", "dgemma_cli", "doctor", *(["--quick"] if quick else []), "--json", str(json_path)]


def run_doctor(json_path: Path, env: dict, timeout: float, command: list[str] | None = None) -> dict:
    """`dgemma doctor --json FILE` in a subprocess: its status (passed, a kernel family turned off, not available,
    timed out, failed), exit code, the last lines of its output and its JSON report (None when it wrote none)."""
    json_path.unlink(missing_ok=True)
    rc, out, err = run_limited(command or doctor_command(json_path), env, timeout)
    text = out + err
    if rc == 2 and "No such command" in text:
        status = "not available"
    elif rc is None:
        status = f"timed out after {timeout:.0f} s"
    elif rc == 0:
        status = "passed"
    elif rc == 1:
        status = "a kernel family turned off or a check failed"  # the report's turned_off and failed say which
    else:
        status = f"failed (exit {rc})"
    try:
        report = json.loads(json_path.read_text())
    except (OSError, ValueError):
        report = None
    return {"status": status, "returncode": rc, "passed": rc == 0, "report": report,
            "tail": text.strip().splitlines()[-15:]}


def run_row(part: Part, out: Path, env: dict, timeout: float, dry_run: bool) -> dict:
    """One bench row in a subprocess of its own (this script with --row), stopped at `timeout` seconds: its result
    (as_dict), or {"error": ...}. The row's phases and table go to this process's stderr as they come."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--row", part.label, "--out", str(out)]
    rc, stdout, _ = run_limited(argv + (["--dry-run"] if dry_run else []), env, timeout, stderr_to=None)
    if rc is None:
        return {"error": f"timed out after {timeout:.0f} s (its budget)"}
    for line in reversed(stdout.splitlines()):
        if line.startswith(ROW_PREFIX):
            return json.loads(line[len(ROW_PREFIX):])
    return {"error": f"exit {rc} without a result"}


def row_main(label: str, dry_run: bool) -> int:
    """--row: time one part's bench row here and print its result on the last line of stdout."""
    part = PART_BY_LABEL[label]
    config, device = ("tiny", "cpu") if dry_run else ("real", "cuda")
    try:
        from dgemma_cli.bench import as_dict, run_bench

        r = run_bench(config, steps=16, device=device, note=lambda m: print(f"  {label}: {m}", file=sys.stderr,
                                                                            flush=True), **part.bench)
        print(r.table(), file=sys.stderr, flush=True)
        result = as_dict(r)
    except Exception as e:  # the other rows are still worth having
        result = {"error": f"{type(e).__name__}: {e}"}
    print(ROW_PREFIX + json.dumps(result), flush=True)
    return 0 if "error" not in result else 1


# ----------------------------------------------------------------------------- targets


def streamed_ratio(parts: dict) -> float | None:
    """The streamed run's ms a step over max(the resident run's, its copies over the measured host link)."""
    streamed, resident = parts.get("nvfp4 (all) b1 p256 in 12 GB", {}), parts.get("nvfp4 (all) b1 p256", {})
    if not streamed.get("host_to_device_gbs") or not resident.get("ms_per_step") or not streamed.get("ms_per_step"):
        return None
    copies = 1000 * streamed["streamed_bytes_per_step"] / (streamed["host_to_device_gbs"] * 1e9)
    return streamed["ms_per_step"] / max(resident["ms_per_step"], copies)


def targets(results: dict) -> dict:
    """The issue's targets: each {"value", "met"}; value None: not measured in this run."""
    parts = results.get("parts", {})

    def get(label, key):
        r = parts.get(label)
        return r.get(key) if isinstance(r, dict) else None

    b1, b4 = get("nvfp4 (all) b1 p256", "tokens_per_s"), get("nvfp4 (all) b4 p256", "tokens_per_s")
    gguf, nvfp4 = get("gguf q4_k_m b1 p256", "ms_per_step"), get("nvfp4 (all) b1 p256", "ms_per_step")
    doctor = (results.get("doctor") or {}).get("status")
    table = [
        ("doctor: every kernel family passed or did not apply", None if doctor in (None, "not available") else doctor,
         lambda v: v == "passed"),
        ("CUDA graph replayed in the bf16 row", get("bf16 b1 p256", "graph_replays"), lambda v: v > 0),
        ("NVFP4 step within 1.3x of its floor", get("nvfp4 (all) b1 p256", "floor_ratio"), lambda v: v <= 1.3),
        ("INT8 step within 1.3x of its floor", get("int8 (all) b1 p256", "floor_ratio"), lambda v: v <= 1.3),
        ("bf16 step within 1.2x of its floor", get("bf16 b1 p256", "floor_ratio"), lambda v: v <= 1.2),
        (">= 3000 tok/s in the canvas, NVFP4", b1, lambda v: v >= 3000),
        ("batch 4 >= 2.5x batch 1 tok/s", b4 / b1 if b1 and b4 else None, lambda v: v >= 2.5),
        ("GGUF Q4_K_M step within 1.15x of the NVFP4 (all) step", gguf / nvfp4 if gguf and nvfp4 else None,
         lambda v: v <= 1.15),
        ("NVFP4 peak memory at 8k < 20 GB", get("nvfp4 (experts) b1 p8192", "peak_memory_gb"), lambda v: v < 20),
        ("streamed step (12 GB plan) within 1.25x of max(resident step, its copies at the measured link)",
         streamed_ratio(parts), lambda v: v <= 1.25),
        (">= 5x transformers (bf16)", get("bf16 vs transformers", "speedup_vs_reference"), lambda v: v >= 5),
    ]
    return {name: {"value": value, "met": None if value is None else bool(ok(value))} for name, value, ok in table}


# ----------------------------------------------------------------------------- BENCHMARKS.md


def static_bounds(text: str) -> dict[tuple[str, str, int], float]:
    """The kernel report's step bounds in BENCHMARKS.md (its sections between the kernel-report and the gguf-steps
    markers, the tables whose header has "step bound ms"): (GPU, format, batch) -> ms."""
    sections = [m.group(1) for name in ("kernel-report", "gguf-steps")
                if (m := re.search(rf"<!-- {name}:begin -->(.*?)<!-- {name}:end -->", text, re.S))]
    bounds: dict[tuple[str, str, int], float] = {}
    column = None
    for line in "\n".join(sections).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            column = None
        elif "step bound ms" in cells:
            column = cells.index("step bound ms")
        elif column is not None and len(cells) > column and cells[2].isdigit():
            try:
                bounds[cells[0], cells[1], int(cells[2])] = float(cells[column])
            except ValueError:
                pass
    return bounds


def card_of(device_name: str | None) -> str | None:
    """The kernel report's name for a CUDA device's (None: the report has no rows for it)."""
    name = device_name or ""
    if "H100" in name and "PCIe" not in name and "NVL" not in name:
        return "H100 SXM"
    if "H200" in name:
        return "H200"
    return None


def measured_rows(results: dict) -> list[tuple[Part, dict]]:
    """The bench rows this run measured (a timing, not an error, a skip or a timeout), in PARTS' order."""
    parts = results.get("parts", {})
    return [(p, parts[p.label]) for p in PARTS if p.kind == "bench" and isinstance(parts.get(p.label), dict)
            and isinstance(parts[p.label].get("ms_per_step"), (int, float))]


def doctor_calls(results: dict) -> list[tuple[str, dict]]:
    """(family, timing) for each kernel call the doctor timed at a model's sizes (dgemma_cli/doctor/sizes.py)."""
    report = (results.get("doctor") or {}).get("report") or {}
    return [(k["name"], t) for k in report.get("at_sizes", []) for t in k.get("timings") or ()
            if isinstance(t.get("ms"), (int, float))]


def benchmarks_block(results: dict, text: str) -> str | None:
    """The dated table of a run's measured rows beside the kernel report's static bounds (read from `text`); None
    when nothing was measured."""
    rows = measured_rows(results)
    calls = doctor_calls(results)
    if not rows and not calls:
        return None
    dev = results.get("device", {})
    card = card_of(dev.get("name"))
    bounds = static_bounds(text)
    doctor = (results.get("doctor") or {}).get("status", "not run")
    intro = (f"{results.get('date', '?')} · {dev.get('name', '?')} · torch {dev.get('torch')} · triton "
             f"{dev.get('triton')} · commit {results.get('commit', 'unknown')} · `make bench-gpu` "
             f"({results.get('seconds', '?')} s of its {results.get('budget_s', TOTAL_S)} s budget) · doctor: "
             f"{doctor}. `dgemma bench` rows, canvas 256, 16 fixed steps; ms per step is the median step-to-step "
             "interval. Static bound: the kernel report's step bound for this card, format and batch (a canvas of "
             "256 after 256 prompt tokens: the same shapes; a card runs no faster than it), \"-\" where it has none.")
    lines = [f"#### {results.get('date', '?')}, {dev.get('name', '?')}, commit {results.get('commit', 'unknown')}",
             "", *textwrap.wrap(intro, 118), "",
             "| row | ms per step | tokens/s in the canvas | peak memory GB | graph replays | weight-read floor ms "
             "(step / floor) | static bound ms (step / bound) | notes |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for p, r in rows:
        ms = r["ms_per_step"]
        bound = bounds.get((card, *p.bound)) if card and p.bound else None
        floor = f"{r['floor_ms']:.3f} ({r['floor_ratio']:.2f}x)" if r.get("floor_ms") else "-"
        peak = f"{r['peak_memory_gb']:.2f}" if r.get("peak_memory_gb") is not None else "-"
        notes = []
        if r.get("gpu_memory_gb") is not None:
            notes.append(f"planned for {r['gpu_memory_gb']:.0f} GB: {r.get('streamed_layers', 0)} layers' experts "
                         f"streamed, {r.get('streamed_bytes_per_step', 0) / 1e9:.2f} GB a step"
                         + (f" at {r['host_to_device_gbs']:.1f} GB/s (measured)" if r.get("host_to_device_gbs")
                            else ""))
        lines.append(f"| {p.label} | {ms:.2f} | {r.get('tokens_per_s', 0):,.0f} | {peak} | "
                     f"{r.get('graph_replays', '-')} | {floor} | "
                     f"{f'{bound:.2f} ({ms / bound:.2f}x)' if bound else '-'} | {'; '.join(notes)} |")
    parts = results.get("parts", {})
    missing = []
    for p in PARTS:
        r = parts.get(p.label)
        if p.kind not in ("bench", "not timed") or any(q is p for q, _ in rows):
            continue
        if not isinstance(r, dict):
            missing.append(f"{p.label} (not reached)")
        elif "not timed" in r:
            missing.append(f"{p.label} (not timed: the plan says why)")
        elif "skipped" in r:
            missing.append(f"{p.label} (skipped: {r['skipped']})")
        elif "error" in r:
            missing.append(f"{p.label} ({r['error']})")
    if missing:
        lines += ["", *textwrap.wrap("Not measured in this run: " + "; ".join(missing) + ".", 118)]
    if calls:
        lines += ["", *textwrap.wrap("The doctor's kernel calls at the real model's sizes (a 256-token canvas), "
                                     "each the median of 20 after 3 warm calls, against its bound on this card: "
                                     "the call's least DRAM bytes at the card's peak bandwidth or its FLOPs at the "
                                     "tensor peak, the longer (quant/kernels/roofline.py).", 118), "",
                  "| family | call | ms | bound ms | bound by | x bound |", "|---|---|---:|---:|---|---:|"]
        for family, t in calls:
            bound = "-" if t["bound_ms"] is None else f"{t['bound_ms']:.4f}"
            lines.append(f"| {family} | {t['call']} | {t['ms']:.4f} | {bound} | {t['bound_by'] or '-'} | "
                         f"{'-' if t['x_bound'] is None else t['x_bound']} |")
    met = {True: [], False: [], None: []}
    for name, t in (results.get("targets") or {}).items():
        met[t.get("met")].append(name)
    if met[True] or met[False]:
        said = [f"{what}: {'; '.join(met[k])}." for what, k in (("Targets met", True), ("Not met", False),
                                                                  ("Not measured", None)) if met[k]]
        lines += ["", *textwrap.wrap(" ".join(said), 118)]
    return "\n".join(lines) + "\n"


def write_benchmarks(results: dict, path: Path) -> bool:
    """Write a run's measured rows (benchmarks_block) into `path` between its bench-gpu markers, after the runs
    already there, in place of the paragraph saying that none was measured. Returns whether anything was written:
    nothing is, where nothing was measured. ValueError when the markers are missing."""
    text = path.read_text()
    block = benchmarks_block(results, text)
    if block is None:
        return False
    begin, end = text.find(BENCH_BEGIN), text.find(BENCH_END)
    if begin < 0 or end < begin:
        raise ValueError(f"{path} has no {BENCH_BEGIN} ... {BENCH_END} section to write the rows into")
    inner, placeholder = [], False
    for line in text[begin + len(BENCH_BEGIN):end].strip("\n").splitlines():  # the paragraph saying none was
        placeholder = line.startswith(NOT_YET) or (placeholder and bool(line.strip()))  # measured is left out
        if not placeholder:
            inner.append(line)
    while inner and not inner[-1].strip():
        inner.pop()
    body = "\n".join(inner + ([""] if inner else []) + [block.rstrip("\n")])
    path.write_text(text[:begin + len(BENCH_BEGIN)] + "\n" + body + "\n" + text[end:])
    return True


# ----------------------------------------------------------------------------- the run


def commit() -> str:
    try:
        p = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                           timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
        if p.returncode == 0 and p.stdout.strip():
            return p.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("BENCH_GPU_COMMIT", "unknown")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--quick", action="store_true", help="the doctor's quick checks (dgemma doctor --quick)")
    ap.add_argument("--dry-run", action="store_true", help="the same script on the CPU at the tiny config (a check "
                    "of this script, no figures)")
    ap.add_argument("--plan", action="store_true", help="print the parts and their budgets, touch no GPU")
    ap.add_argument("--no-benchmarks", action="store_true", help="leave BENCHMARKS.md as it is")
    ap.add_argument("--write-benchmarks", type=Path, metavar="RESULTS",
                    help="write a run's measured rows (its bench-gpu.json) into BENCHMARKS.md, and nothing else")
    ap.add_argument("--row", help=argparse.SUPPRESS)  # one bench row, in the subprocess run_row starts
    args = ap.parse_args()

    if args.plan:
        print(plan_text())
        return 0
    if args.row:
        return row_main(args.row, args.dry_run)
    if args.write_benchmarks:
        results = json.loads(args.write_benchmarks.read_text())
        if results.get("dry_run"):
            print("a dry run's figures are no measurement: BENCHMARKS.md left as it is")
            return 1
        wrote = write_benchmarks(results, ROOT / "BENCHMARKS.md")
        print("BENCHMARKS.md: " + ("rows written" if wrote else "nothing measured, nothing written"))
        return 0

    start = time.monotonic() - max(0.0, time.time() - float(os.environ.get("BENCH_GPU_START") or time.time()))
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "bench-gpu.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", DGEMMA_KERNELS="auto")
    if args.dry_run:  # the Triton kernels on the CPU: the interpreter; dgemma's verdicts kept apart from the user's
        env.update(TRITON_INTERPRET="1", DGEMMA_HOME=str(args.out / "dgemma-home"))
    else:
        env.pop("TRITON_INTERPRET", None)
    results: dict = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "commit": commit(),
                     "dry_run": args.dry_run, "budget_s": TOTAL_S, "plan_s": planned_seconds(), "parts": {}}

    def save():
        log.write_text(json.dumps(results, indent=1))

    import torch

    if not torch.cuda.is_available() and not args.dry_run:
        print("no CUDA device: nothing to do")
        return 1
    results["device"] = {"name": torch.cuda.get_device_name(0) if not args.dry_run else "cpu (dry run)",
                         "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for module in ("triton", "transformers", "huggingface_hub"):
        try:
            results["device"][module] = __import__(module).__version__
        except ImportError:
            results["device"][module] = None
    print(json.dumps(results["device"]), flush=True)
    print(plan_text(), flush=True)

    def run(p: Part) -> dict:
        print(f"\n== {p.label} (budget {p.budget} s)", flush=True)
        if p.kind == "doctor":
            r = run_doctor(args.out / "doctor.json", env, p.budget,
                           doctor_command(args.out / "doctor.json", args.quick))
            print("\n".join(r["tail"]) + f"\ndoctor: {r['status']}", flush=True)
            results["doctor"] = r
            return {k: r[k] for k in ("status", "returncode", "passed")}
        r = run_row(p, args.out, env, p.budget, args.dry_run)
        if "error" in r:
            print(f"{p.label}: {r['error']}", flush=True)
        return r

    def record(label: str, r: dict) -> None:
        results["parts"][label] = r
        if "skipped" in r or "not timed" in r:
            print(f"\n== {label}: " + (f"skipped: budget ({r['elapsed_s']:.0f} s gone, {r['budget_s']} s needed)"
                                        if "skipped" in r else f"not timed: {r['not timed']}"), flush=True)
        elif label != "setup":
            print(f"== {label}: {r['seconds']:.0f} s", flush=True)
        save()

    run_parts(PARTS, run, start=start, record=record)
    results["targets"] = targets(results)
    results["seconds"] = round(time.monotonic() - start, 1)
    save()
    print("\n== targets")
    for name, t in results["targets"].items():
        print(f"{'n/a ' if t['met'] is None else 'met ' if t['met'] else 'NOT '} {name}: {t['value']}")

    block = benchmarks_block(results, (ROOT / "BENCHMARKS.md").read_text())
    if block:
        (args.out / "bench-gpu.md").write_text(block)
    if args.dry_run:  # CPU figures at the tiny config are no measurement: the writer runs on a copy
        copy = args.out / "BENCHMARKS.md"
        shutil.copyfile(ROOT / "BENCHMARKS.md", copy)
        print(f"\ndry run: rows {'written' if write_benchmarks(results, copy) else 'not written'} into {copy}")
    elif not args.no_benchmarks:
        wrote = write_benchmarks(results, ROOT / "BENCHMARKS.md")
        print("\nBENCHMARKS.md: " + ("the measured rows written" if wrote else "nothing measured, nothing written"))
    print(f"{results['seconds']:.0f} s of {TOTAL_S}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
