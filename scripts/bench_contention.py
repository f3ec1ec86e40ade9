"""dgemma on a CPU shared with busy processes: `dgemma run --model demo --device cpu` with 0, 1 and 2 competing
Python busy loops, wall time and generation time (`--json`'s seconds), median of RUNS per setting.

Each TREE is a source tree to run (`python -m dgemma_cli` with it first on the path), e.g. this checkout and an
export of an older commit (`git archive COMMIT | tar -x -C /tmp/old`), given as NAME=PATH[:ENV=VALUE,...]; their
runs are interleaved so that a change in the machine's other load falls on all of them. Environment variables that
choose OpenMP's behaviour (OMP_*, GOMP_*, KMP_*, MKL_NUM_THREADS) are cleared unless a tree sets them.

    python scripts/bench_contention.py new=. old=/tmp/old old-1-thread=/tmp/old:OMP_NUM_THREADS=1 --runs 5
    python scripts/bench_contention.py new=. --long   # 64 tokens from raw "hello" (the test's run)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = ["upper: hello diffusions"]
LONG = ["--raw", "--seed", "0", "--max-new-tokens", "64", "hello"]
CHOICES = ("OMP_", "GOMP_", "KMP_", "MKL_NUM_THREADS")


def parse_tree(spec: str) -> tuple[str, Path, dict[str, str]]:
    name, _, rest = spec.partition("=")
    path, _, env = rest.partition(":")
    return name, Path(path).resolve(), dict(kv.split("=", 1) for kv in env.split(",") if kv)


def run_once(tree: Path, env: dict[str, str], args: list[str]) -> tuple[float, float]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(CHOICES)}
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "dgemma_cli", "run", "--model", "demo", "--device", "cpu", "--json",
                          *args], cwd=tree, env={**base, "PYTHONPATH": str(tree), **env}, capture_output=True,
                         text=True, timeout=600)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"{tree}: exit {out.returncode}: {out.stderr.strip()}")
    return wall, json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+", help="NAME=PATH[:ENV=VALUE,...]")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2], help="competing busy processes per setting")
    ap.add_argument("--long", action="store_true", help='64 tokens from raw "hello" instead of the demo prompt')
    a = ap.parse_args()
    trees = [parse_tree(s) for s in a.trees]
    args = LONG if a.long else PROMPT
    print("| busy processes | tree | wall s (median) | generation s (median) | wall s, each run "
          "| generation s, each run |")
    print("|---|---|---|---|---|---|")
    for busy in a.busy:
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            time.sleep(0.3)
            res: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in trees}
            for _ in range(a.runs):
                for name, path, env in trees:
                    res[name].append(run_once(path, env, args))
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        for name, runs in res.items():
            walls, gens = [w for w, _ in runs], [g for _, g in runs]
            print(f"| {busy} | {name} | {statistics.median(walls):.2f} | {statistics.median(gens):.3f} | "
                  f"{' '.join(f'{x:.2f}' for x in walls)} | {' '.join(f'{x:.3f}' for x in gens)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
