"""Quantize throughput and peak memory of `dgemma quantize` on a synthetic multi-GB checkpoint, and a real kill.

    python scripts/measure_quantize.py [--gb 3] [--keep]

1. Writes a synthetic bf16 checkpoint of about --gb GB (scripts/synth_checkpoint.py: the published layout, 128
   experts, fused expert tensors) in a temporary directory.
2. For INT8 (absmax scales), NVFP4 (absmax) and NVFP4 (searched scales), policy `experts`: runs the converter in a
   fresh process and reports seconds, source GB per second, and that process's peak RSS (VmHWM) against the bound
   "2 GB plus the largest single tensor".
3. Kill test: starts an NVFP4 conversion, SIGKILLs it once `progress.json` records a finished shard, runs it
   again, and checks that the result is byte-identical (sha256 of every shard) to the uninterrupted run's.
Exit status 1 when a bound or the kill test fails. Sizes are decimal (1 GB = 1e9 bytes).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GB = 1_000_000_000

CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
from dgemma_cli.store.quantize import quantize_checkpoint
def status():
    with open('/proc/self/status') as f:
        return {{l.split(':')[0]: int(l.split()[1]) * 1024 for l in f if l.startswith(('VmRSS', 'VmHWM'))}}
base = status()['VmRSS']
t = time.perf_counter()
m = quantize_checkpoint({src!r}, {out!r}, {fmt!r}, 'experts', {search!r}, 'cpu')
print(json.dumps({{'seconds': time.perf_counter() - t, 'peak': status()['VmHWM'], 'baseline': base,
                  'out_bytes': m['total_bytes'], 'files': {{k: v['sha256'] for k, v in m['files'].items()}}}}))
"""


def child(src: Path, out: Path, fmt: str, search: bool) -> list[str]:
    code = CHILD.format(root=str(ROOT), src=str(src), out=str(out), fmt=fmt, search=search)
    return [sys.executable, "-c", code]


def run(src: Path, out: Path, fmt: str, search: bool) -> dict:
    p = subprocess.run(child(src, out, fmt, search), capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"conversion failed:\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def kill_test(src: Path, work: Path, reference: dict) -> tuple[bool, str]:
    out = work / "killed"
    partial = out.with_name(out.name + ".partial")
    proc = subprocess.Popen(child(src, out, "nvfp4", False), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    recorded = 0
    while proc.poll() is None:
        try:
            recorded = len(json.loads((partial / "progress.json").read_text())["done"])
        except (OSError, ValueError, KeyError):
            recorded = 0
        if recorded >= 1:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.05)
    else:
        return False, "the conversion finished before it could be killed"
    leftovers = sorted(p.name for p in partial.iterdir())
    second = run(src, out, "nvfp4", False)
    same = second["files"] == reference["files"]
    return same, (f"killed with {recorded} shard(s) recorded (left: {len(leftovers)} files incl. "
                  f"{sum(n.endswith('.tmp') for n in leftovers)} .tmp); rerun took {second['seconds']:.1f} s; "
                  f"output {'identical to' if same else 'DIFFERENT from'} the uninterrupted run")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=3.0)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dgemma-quant-"))
    ok = True
    try:
        src = work / "src"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "synth_checkpoint.py"), str(src), "--gb", str(args.gb),
                        "--dtype", "bfloat16"], check=True, stdout=subprocess.DEVNULL)
        index = json.loads((src / "model.safetensors.index.json").read_text())
        size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        sys.path.insert(0, str(ROOT))
        from dgemma_cli.checkpoint.weights import index_checkpoint

        largest = max(r.end - r.start for r in index_checkpoint(src).values())
        bound = 2 * GB + largest
        print(f"source: {size / GB:.2f} GB bf16, {len(set(index['weight_map'].values()))} shards, largest tensor "
              f"{largest / GB:.3f} GB; RSS bound 2 GB + largest = {bound / GB:.2f} GB\n")
        print("| format | scales | seconds | source GB/s | output GB | peak RSS | within bound |")
        print("|---|---|---|---|---|---|---|")
        reference = None
        for fmt, search in (("int8", False), ("nvfp4", False), ("nvfp4", True)):
            out = work / f"{fmt}-{search}"
            r = run(src, out, fmt, search)
            within = r["peak"] < bound
            ok &= within
            print(f"| {fmt} | {'search' if search else 'absmax'} | {r['seconds']:.1f} | {size / GB / r['seconds']:.3f} "
                  f"| {r['out_bytes'] / GB:.2f} | {r['peak'] / GB:.2f} GB | {'yes' if within else 'NO'} |", flush=True)
            if fmt == "nvfp4" and not search:
                reference = r
            shutil.rmtree(out)
        same, text = kill_test(src, work, reference)
        ok &= same
        print(f"\nkill test: {text}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
