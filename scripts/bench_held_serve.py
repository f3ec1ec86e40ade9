"""The stall a held row puts on the other rows of `dgemma serve`'s batch, through a real socket, at the real vocabulary
(BENCHMARKS.md, "Structured answers at the real vocabulary").

A random checkpoint of the tests' tiny shape (tests/checkpoints.py "five_to_one") with the real model's vocabulary,
262,144 tokens, and a canvas of 256: its tokenizer is the tests' Gemma-4-style one (control tokens at their real ids,
byte fallback, a BPE trained on a few lines), its placeholder ids made text tokens (printable ASCII strings, as
scripts/bench_structured.py's synthetic vocabulary), so a structure's search meets a vocabulary of real size. One
server, `--max-batch 2`; a free chat request (A: one canvas, a fixed seed and step count, which a random model's
canvas always runs to) is timed alone, beside another free request, beside a required tool call and beside a JSON
schema, of the same parameters and the 50-property form with bounded strings (one canvas each, a step more than A's,
started just before it, so that they are beside A at every step). A's time per step (the server's own, from A's
admission into the batch to its last step: `"dgemma": {"seconds"}`) beside each, less alone, is what the other row
adds to every step of A; the difference between the two is the stall a held row adds,
in passes: a `max` over [256 x 262,144] float32 values, timed in this process on the same machine. The conditions
run in interleaved rounds and each one's median is taken (a step of two rows here is seconds long, and its spread
from run to run is hundreds of milliseconds: each round's figure is printed beside it).

    .venv/bin/python scripts/bench_held_serve.py [--steps 6] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

V, CANVAS = 262_144, 256
WEATHER = {"type": "object", "properties": {"location": {"type": "string"},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}


def build(directory: Path) -> Path:
    """The real-vocabulary checkpoint (random weights) with its synthetic tokenizer: the tests' tokenizer of 512 ids,
    then ids 512 to 262,143 as text tokens (adding a quarter million special placeholders, as the tests' fixture
    pads a vocabulary, would take the tokenizers library minutes)."""
    import checkpoints
    import tokenizer_fixture
    from bench_structured import SyntheticVocab

    small = 512
    checkpoints.build_tokenizer_files = lambda d, vocab_size: tokenizer_fixture.build_tokenizer_files(d, small)
    spec = dict(checkpoints.SPECS["five_to_one"], canvas_length=CANVAS)
    spec["text"] = dict(spec["text"], vocab_size=V)
    checkpoints.build_checkpoint(directory, spec, seed=0)
    tj = json.loads((directory / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in tj["added_tokens"]}
    words = (w.decode() for w in SyntheticVocab(2 * V).words[10:] if w)
    for i in range(small, V):
        w = next(words)
        while w in taken or " " in w:  # SentencePiece writes a space as the "▁" piece
            w = next(words)
        vocab[w] = i
        taken.add(w)
    (directory / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    import httpx

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="denoising steps of each request's canvas")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of the conditions, interleaved (medians taken)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model = build(Path(tmp) / "real_vocab")
        print(f"checkpoint built in {time.perf_counter() - t0:.0f} s", flush=True)
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "dgemma_cli", "serve", "--model", str(model), "--port",
                                   str(port), "--max-batch", "2", "--device", "cpu"], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            with httpx.Client(timeout=900) as http:
                for _ in range(600):
                    try:
                        if http.get(url + "/health").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.5)
                run(http, url, args.steps, args.rounds)
        finally:
            server.terminate()
            out, _ = server.communicate(timeout=60)
            errors = [line for line in out.splitlines() if "Traceback" in line or "error" in line.lower()]
            if errors:
                print("server said:", *errors[:5], sep="\n  ")


def run(http, url: str, steps: int, rounds: int) -> None:
    model = http.get(url + "/v1/models").json()["data"][0]["id"]
    free = {"model": model, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": CANVAS,
            "seed": 1, "steps": steps}
    other = {**free, "seed": 2, "steps": steps + 1}  # one canvas, a step more than A's: beside it at every step
    call = {**other, "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
            "tool_choice": "required"}
    schema = {**other, "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}}
    from bench_structure_compile import form

    bounded = {**other, "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": form(True)}}}

    def ask(body) -> tuple[float, int, dict]:
        t0 = time.perf_counter()
        r = http.post(url + "/v1/chat/completions", json=body)
        if r.status_code != 200:
            raise SystemExit(f"{r.status_code}: {r.text[:300]}")
        j = r.json()
        extra = j.get("dgemma", {})
        # the server's own time for the answer, from its admission into the batch (not its wait for the step under
        # way when it came, which the sub-second order of two requests' arrival would make part of it)
        seconds = extra.get("seconds", time.perf_counter() - t0)
        return seconds, sum(extra.get("steps_per_canvas", [steps])), j

    ask(free)  # warm: the first step's allocations, the compile worker
    ask(call)
    ask(schema)
    ask(bounded)
    from bench_held import one_pass  # the unit: a max over [256 x 262,144] float32 log-probabilities

    unit = one_pass()
    print(f"one pass, the server idle beside it: {unit * 1e3:.1f} ms", flush=True)
    conditions = (("alone", None), ("beside a free request", other), ("beside a required tool call", call),
                  ("beside a JSON schema (the same parameters)", schema),
                  ("beside a 50-property form, strings of at most 32", bounded))
    per_step: dict[str, list[float]] = {name: [] for name, _ in conditions}
    for _ in range(rounds):  # the conditions interleaved, so that the machine's drift falls on each alike
        for name, beside in conditions:
            out: dict = {}
            thread = None
            if beside is not None:
                thread = threading.Thread(target=lambda: out.update(b=ask(beside)))
                thread.start()
                time.sleep(0.3)  # in the batch first: A joins it
            seconds, n, _ = ask(free)
            if thread is not None:
                thread.join()
                assert out["b"][2]["choices"], out
            per_step[name].append(seconds / n)
    print("| the free request's step | median ms | each round, ms |")
    print("|---|---:|---|")
    for name, times in per_step.items():
        print(f"| {name} | {statistics.median(times) * 1e3:,.0f} | {', '.join(f'{t * 1e3:,.0f}' for t in times)} |")
    base = statistics.median(per_step["beside a free request"])
    for name, _ in conditions[2:]:
        s = statistics.median(per_step[name])
        print(f"{name}: {s - base:+.3f} s a step over beside a free request = {(s - base) / unit:+.1f} passes")


if __name__ == "__main__":
    main()
