"""Throughput of `dgemma serve` with batching against one request at a time, on this machine.

    .venv/bin/python scripts/bench_serve.py [--model demo] [--requests 64] [--clients 16] [--batches 1 8 16]

For each --max-batch value a fresh server process is started on a loopback port and the same requests (fixed seeds,
so the same answers) are sent by --clients concurrent clients through the `openai` client; --max-batch 1 is one at a
time. Prints a Markdown table (requests/s, generated tokens/s, mean rows per decoder forward, latency) and checks
that every configuration returned the same answers.

--in-process times the engine loop without HTTP instead: the same requests submitted at once to a `BatchLoop` in this
process, against `Engine.generate` run on each request alone, one after another (and checks the answers are equal).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["hello diffusions", "abc def 12 ghijk", "the quick brown ", "lorem ipsum dolo", "zz top rocks 123",
         "a b c d e f g hi", "seven 7 eight 88", "mixed case words"]


def workload(n: int) -> list[dict]:
    """Half chat (the demo's task: one canvas, a few steps), half raw text of two canvases (about 80 forwards)."""
    rnd = random.Random(0)
    out = []
    for i in range(n):
        if i % 2:
            out.append({"kind": "raw", "prompt": "hello", "seed": rnd.randrange(10**6), "max_tokens": 64})
        else:
            out.append({"kind": "chat", "prompt": f"upper: {rnd.choice(WORDS)}", "seed": rnd.randrange(10**6)})
    return out


def start(model: str, max_batch: int, device: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "dgemma_cli", "serve", "--model", model, "--device", device, "--port", "0",
           "--max-batch", str(max_batch), "--max-queue", "1024"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    url = None
    for line in proc.stderr:
        if " at http://" in line:
            url = line.split(" at ")[1].split("/v1")[0]
            break
    if url is None:
        raise SystemExit(f"the server did not start (exit {proc.wait()})")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
    return proc, url


def ask(client: openai.OpenAI, model: str, req: dict) -> tuple[str, int, float]:
    t0 = time.perf_counter()
    if req["kind"] == "chat":
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": req["prompt"]}],
                                           seed=req["seed"])
        text = r.choices[0].message.content
    else:
        r = client.completions.create(model=model, prompt=req["prompt"], seed=req["seed"],
                                      max_tokens=req["max_tokens"])
        text = r.choices[0].text
    return text, r.usage.completion_tokens, time.perf_counter() - t0


def run(model: str, max_batch: int, requests: list[dict], clients: int, device: str) -> dict:
    proc, url = start(model, max_batch, device)
    try:
        served = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        pool_clients = [openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
                        for _ in range(clients)]
        ask(pool_clients[0], served, requests[0])  # warm-up, not counted
        h0 = httpx.get(url + "/health").json()

        def worker(k: int):
            return [(i, ask(pool_clients[k], served, requests[i])) for i in range(k, len(requests), clients)]

        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            results = dict(pair for part in pool.map(worker, range(clients)) for pair in part)
        seconds = time.perf_counter() - t0
        h1 = httpx.get(url + "/health").json()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    latencies = sorted(r[2] for r in results.values())
    forwards = h1["forwards"] - h0["forwards"]
    return {"max_batch": max_batch, "seconds": seconds, "answers": [results[i][0] for i in range(len(requests))],
            "tokens": sum(r[1] for r in results.values()), "rows": (h1["row_forwards"] - h0["row_forwards"]) / forwards,
            "forwards": forwards, "p50": latencies[len(latencies) // 2], "p95": latencies[int(len(latencies) * 0.95)]}


def in_process(model: str, device: str, requests: list[dict], batches: list[int]) -> None:
    from dgemma_cli.server.batching import BatchLoop, Job, RowDone
    from dgemma_cli.engine import load

    engine = load(model, device=device)
    tok = engine.tokenizer

    def job(req: dict) -> Job:
        chat = req["kind"] == "chat"
        ids = engine.prompt_ids(req["prompt"], raw=not chat)
        settings = engine.settings.override(max_new_tokens=req.get("max_tokens"))
        return Job(ids, settings, req["seed"], engine.check_context(len(ids), settings))

    t0 = time.perf_counter()
    alone = [engine.generate(r["prompt"], raw=r["kind"] != "chat", seed=r["seed"],
                             max_new_tokens=r.get("max_tokens")).token_ids[0] for r in requests]
    base = time.perf_counter() - t0
    tokens = sum(len(x) for x in alone)
    print("| engine loop | seconds | requests/s | generated tokens/s | mean rows per forward | vs alone |")
    print("|---|---|---|---|---|---|")
    print(f"| each request alone (Engine.generate) | {base:.2f} | {len(requests) / base:.1f} | {tokens / base:.0f} | 1.00 "
          f"| 1.00x |")
    for b in batches:
        loop = BatchLoop(engine.model, max_batch=b, max_queue=len(requests))
        done: dict[int, list[int]] = {}
        finished = threading.Event()

        def sink(i: int):
            def deliver(ev) -> None:
                if isinstance(ev, RowDone):
                    done[i] = ev.token_ids
                    if len(done) == len(requests):
                        finished.set()
            return deliver

        t0 = time.perf_counter()
        for i, r in enumerate(requests):
            loop.submit(job(r), sink(i))
        finished.wait()
        seconds = time.perf_counter() - t0
        loop.close()
        if [done[i] for i in range(len(requests))] != alone:
            raise SystemExit(f"--max-batch {b}: answers differ from the single runs")
        print(f"| BatchLoop --max-batch {b} | {seconds:.2f} | {len(requests) / seconds:.1f} | {tokens / seconds:.0f} | "
              f"{loop.row_forwards / loop.forwards:.2f} | {base / seconds:.2f}x |")
    print(f"\n{len(requests)} requests; every answer equal to its single run ({tok.decode(alone[0])!r}, ...)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--in-process", action="store_true", help="time the engine loop without HTTP")
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    requests = workload(args.requests)
    if args.in_process:
        return in_process(args.model, args.device, requests, args.batches)
    rows = [run(args.model, b, requests, args.clients, args.device) for b in args.batches]
    base = rows[0]
    print(f"| --max-batch | seconds | requests/s | generated tokens/s | mean rows per forward | forwards | "
          f"latency p50 / p95 s | vs --max-batch {base['max_batch']} |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['max_batch']} | {r['seconds']:.2f} | {args.requests / r['seconds']:.1f} | "
              f"{r['tokens'] / r['seconds']:.0f} | {r['rows']:.2f} | {r['forwards']} | {r['p50']:.2f} / "
              f"{r['p95']:.2f} | {base['seconds'] / r['seconds']:.2f}x |")
    same = all(r["answers"] == base["answers"] for r in rows)
    print(f"\n{args.requests} requests from {args.clients} clients; answers identical across configurations: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
