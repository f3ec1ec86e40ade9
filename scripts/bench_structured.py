"""What holding an answer to a structure costs (BENCHMARKS.md, "Structured answers"), on this CPU.

1. The bundled demo model, the same prompts with and without a constraint: tokens per forward and seconds.
2. The search alone at the real model's sizes: a canvas of 256 positions over a vocabulary of 262,144 tokens (a
   synthetic byte vocabulary: every printable ASCII string of one to three characters, then four-character ones,
   as many as a real vocabulary has ids), for a JSON Schema and a grammar: compile time, and per step the argmax
   and the sample search (dgemma_cli/structured/constrain.py), from random log-probabilities.
3. The same search in the kernel report's terms (what a CUDA device would run; no GPU needed): every torch op the
   step launches, metered as the whole-step trace meters them (dgemma_cli.step_trace's meter: bytes each op reads
   and writes), each at its bytes at the GPU's peak bandwidth, summed; and the kernels launched and host round
   trips (a Python int() or bool() of a device tensor) the step makes, each of which serialises the GPU.

    .venv/bin/python scripts/bench_structured.py
"""

from __future__ import annotations

import itertools
import json
import statistics
import string
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dgemma_cli.structured.constrain import Structure, compile_structure  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                     "maxItems": 4}},
          "required": ["name", "age"]}
GRAMMAR = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/\n'
DEMO_PROMPTS = ["upper: hello diffusions", "upper: abc def 12 ghijk", "upper: the quick brown ",
                "upper: lorem ipsum dolo"]


class SyntheticVocab:
    """A stand-in tokenizer: ids 0..9 control tokens, then printable ASCII strings by length."""

    def __init__(self, size: int):
        chars = string.ascii_letters + string.digits + string.punctuation + " "
        words: list[bytes | None] = [None] * 10
        for n in itertools.count(1):
            for combo in itertools.product(chars, repeat=n):
                words.append("".join(combo).encode())
                if len(words) == size:
                    break
            if len(words) == size:
                break
        self.words = words
        self.eos_id, self.bos_id = 1, 2

    def token_bytes(self):
        return self.words

    def encode_text(self, text: str) -> list[int]:
        index = {w: i for i, w in enumerate(self.words) if w}
        return [index[c.encode()] for c in text if c.encode() in index]


def search_cost(structure: Structure, tok, vocab: int, canvas: int = 256, steps: int = 5) -> dict:
    t0 = time.perf_counter()
    auto = compile_structure(structure, tok, vocab)
    compile_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        logp = torch.log_softmax(torch.randn(canvas, vocab, generator=g) * 3, dim=-1)
        row = auto.row(max_new_tokens=4096, end_ids=[1], pad_id=0, generator=g)
        sample, argmax = torch.zeros(canvas, dtype=torch.long), torch.zeros(canvas, dtype=torch.long)
        t0 = time.perf_counter()
        row.step(logp, sample, argmax, greedy=False)
        times.append(time.perf_counter() - t0)
    return dict(compile_s=compile_s, step_ms=1e3 * statistics.median(times),
                edges=getattr(auto, "edges", 0), states=getattr(auto, "S", None))


SYNCS = ("aten::_local_scalar_dense", "aten::is_nonzero", "aten::item", "aten::nonzero")  # the host waits


def metered(step) -> dict:
    """`step()` (a row's search) with every torch op on the device metered: kernels launched, bytes read and
    written, host round trips (a nonzero's size, an int() or bool()). The dynamic programme and the classes'
    reductions run on the host (numpy, structured/host_search.py): they are no kernels."""
    from dgemma_cli.step_trace import _Meter

    ops: list = []
    with _Meter(ops, persistent=set()):
        step()
    syncs = sum(o.name in SYNCS for o in ops)
    kernels = [o for o in ops if o.name not in SYNCS]
    return dict(kernels=len(kernels), syncs=syncs, bytes=sum(o.bytes for o in kernels))


def search_ops(structure: Structure, tok, vocab: int, canvas: int = 256) -> dict:
    """One step's search (argmax and draw) on random log-probabilities, metered (`metered`)."""
    auto = compile_structure(structure, tok, vocab)
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(canvas, vocab, generator=g) * 3, dim=-1)
    row = auto.row(max_new_tokens=4096, end_ids=[1], pad_id=0, generator=g)
    sample, argmax = torch.zeros(canvas, dtype=torch.long), torch.zeros(canvas, dtype=torch.long)
    return metered(lambda: row.step(logp, sample, argmax, greedy=False))


def demo_rows() -> list[dict]:
    from dgemma_cli.engine import load

    engine = load("demo", device="cpu")
    structure = Structure("regex", "[A-Z0-9 ]{16}")
    rows = []
    for name, kw in (("free", {}), ("regex [A-Z0-9 ]{16}", {"structure": structure})):
        tpf, secs, forwards = [], 0.0, 0
        for seed in range(8):
            for prompt in DEMO_PROMPTS:
                t0 = time.perf_counter()
                r = engine.generate(prompt, seed=seed, **kw)
                secs += time.perf_counter() - t0
                tpf.append(r.tokens_per_forward[0])
                forwards += sum(r.steps_per_canvas[0])
        rows.append(dict(name=name, tokens_per_forward=statistics.mean(tpf), seconds=secs, forwards=forwards,
                         ms_per_forward=1e3 * secs / forwards))
    return rows


def main() -> None:
    torch.set_num_threads(2)
    print("demo model, 32 answers each (4 prompts x 8 seeds):")
    print("| constraint | tokens per forward | forwards | seconds | ms per forward |")
    print("|---|---:|---:|---:|---:|")
    for r in demo_rows():
        print(f"| {r['name']} | {r['tokens_per_forward']:.2f} | {r['forwards']} | {r['seconds']:.2f} | "
              f"{r['ms_per_forward']:.1f} |")
    vocab = 262_144
    tok = SyntheticVocab(vocab)
    print(f"\nsearch per step, canvas 256, vocabulary {vocab:,} (synthetic), median of 5 steps:")
    print("| structure | compile s | automaton token edges | step ms (argmax + sample) |")
    print("|---|---:|---:|---:|")
    for name, st in (("JSON Schema (object, string, ranged integer, enum array)",
                      Structure("json_schema", json.dumps(SCHEMA))),
                     ("Lark grammar (sums)", Structure("grammar", GRAMMAR))):
        c = search_cost(st, tok, vocab)
        print(f"| {name} | {c['compile_s']:.2f} | {c['edges']:,} | {c['step_ms']:.0f} |")
    from quant.kernels.roofline import GPUS, dram_us

    print("\nthe same step in the kernel report's terms (torch ops as a CUDA device would launch them):")
    print("| structure | kernels | host round trips | GB read + written | " +
          " | ".join(f"{GPUS[cc].name} bytes at peak (ms)" for cc in (89, 90, 120)) + " |")
    print("|---|---:|---:|---:|" + "---:|" * 3)
    st = Structure("json_schema", json.dumps(SCHEMA))
    c = search_ops(st, tok, vocab)
    print(f"| JSON Schema | {c['kernels']:,} | {c['syncs']:,} | {c['bytes'] / 1e9:.3f} | " +
          " | ".join(f"{dram_us(GPUS[cc], c['bytes']) / 1e3:.2f}" for cc in (89, 90, 120)) + " |")


if __name__ == "__main__":
    main()
