"""Time to the first denoise step of each turn of an agent-like conversation (each turn resends the whole history),
with `dgemma serve`'s prompt cache (the default) and without it (`--prefix-cache 0`), in one run on this machine.

A server process per setting, on the bundled demo model (4,096 positions, one token per character), CPU. Each turn
sends the conversation so far plus a new user message of about 300 characters, streaming with `stream_steps`; the
time to first step is from sending the request to the first step's chunk (the prompt encoded and one decoder
forward done). Answers are capped at 32 tokens so ten turns fit the context.

    .venv/bin/python scripts/bench_prefix_cache.py
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TURNS = 10
MESSAGE = ("upper: the quick brown fox jumps over the lazy dog while the diffusion model denoises every position "
           "of its canvas at once, step by step, accepting what it is sure of and renoising the rest, until the "
           "canvas is stable and the next one starts; tool output and file contents make agent prompts long. ")


def start(args: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "dgemma_cli", "serve", "--model", "demo", "--device", "cpu",
                             "--port", "0", *args], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    for line in proc.stderr:
        if "serving demo at" in line:
            url = line.split(" at ")[1].split("/v1")[0]
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, url
    raise SystemExit("the server did not start")


def conversation(url: str, tag: str) -> list[tuple[int, int, float]]:
    """[(prompt tokens, cached tokens, seconds to the first step)] per turn; `tag` starts every message (a warm-up
    conversation shares no prefix with the measured one)."""
    out, messages = [], []
    with httpx.Client(base_url=url, timeout=300) as http:
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"{tag} {turn}: {MESSAGE}"})
            body = {"model": "demo", "messages": messages, "seed": turn, "max_tokens": 32, "stream": True,
                    "stream_steps": True, "stream_options": {"include_usage": True}}
            t0, first, text, use = time.perf_counter(), None, "", None
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "dgemma_step" in chunk and first is None:
                        first = time.perf_counter() - t0
                    for c in chunk.get("choices", []):
                        text += c.get("delta", {}).get("content") or ""
                    use = chunk.get("usage") or use
            out.append((use["prompt_tokens"], use["prompt_tokens_details"]["cached_tokens"], first))
            messages.append({"role": "assistant", "content": text})
    return out


def main() -> None:
    results = {}
    for name, args in (("cache", []), ("no cache", ["--prefix-cache", "0"])):
        proc, url = start(args)
        try:
            conversation(url, "warm-up")  # the first requests pay for imports and allocation
            results[name] = conversation(url, "measured")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    print("| turn | prompt tokens | cached (with cache) | first step, cache (ms) | first step, no cache (ms) |")
    print("|---:|---:|---:|---:|---:|")
    for turn, (a, b) in enumerate(zip(results["cache"], results["no cache"]), 1):
        print(f"| {turn} | {a[0]:,} | {a[1]:,} | {1e3 * a[2]:.0f} | {1e3 * b[2]:.0f} |")
    late = slice(5, None)
    ca = statistics.median(x[2] for x in results["cache"][late])
    no = statistics.median(x[2] for x in results["no cache"][late])
    print(f"\nturns 6-10, median time to first step: {1e3 * ca:.0f} ms with the cache, {1e3 * no:.0f} ms without "
          f"({no / ca:.1f}x)")


if __name__ == "__main__":
    main()
