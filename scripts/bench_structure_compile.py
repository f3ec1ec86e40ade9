"""What compiling a structure costs at the real model's vocabulary size (BENCHMARKS.md, "Structure compiles").

Realistic JSON Schemas (an OpenAI function-calling schema, a nested pydantic model, 50-property forms) compiled by
`dgemma_cli.structured.worker.StructureCompiler`, exactly as `dgemma serve` and `dgemma run` compile a client's
schema: the cheap checks in this process, the automaton in the worker process under its time and memory budget.
The vocabulary is 262,144 tokens (scripts/bench_structured.py's synthetic byte vocabulary: printable ASCII strings of
one to three characters). Per schema: cold (a fresh worker: its start and the vocabulary sent included), the worker's
peak resident memory, the automaton's token edges (or the llguidance grammar a schema too large for an automaton
becomes), cold in a worker started before it came (as `dgemma serve` starts one: the vocabulary read and walked),
the same schema again (from the cache), and one step's search for a row on random log-probabilities.

    .venv/bin/python scripts/bench_structure_compile.py [--seconds 30] [--memory-gb 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_structured import SyntheticVocab  # noqa: E402

from dgemma_cli.errors import UsageError  # noqa: E402
from dgemma_cli.structured.structure import Structure  # noqa: E402
from dgemma_cli.structured.worker import StructureCompiler  # noqa: E402

V = 262_144

FUNCTION = {"type": "object", "properties": {
    "location": {"type": "string", "description": "City and country, e.g. Paris, France"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["location", "unit"], "additionalProperties": False}
PYDANTIC = {  # what pydantic 2 writes for Person(name: str, age: int, address: Address, tags: list[str],
    # nickname: Optional[str] = None), Address(street: str, city: str, zip: Optional[str] = None)
    "$defs": {"Address": {"properties": {"street": {"title": "Street", "type": "string"},
                                         "city": {"title": "City", "type": "string"},
                                         "zip": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None,
                                                 "title": "Zip"}},
                          "required": ["street", "city"], "title": "Address", "type": "object"}},
    "properties": {"name": {"title": "Name", "type": "string"}, "age": {"title": "Age", "type": "integer"},
                   "address": {"$ref": "#/$defs/Address"},
                   "tags": {"items": {"type": "string"}, "title": "Tags", "type": "array"},
                   "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None,
                                "title": "Nickname"}},
    "required": ["name", "age", "address", "tags"], "title": "Person", "type": "object"}


def form(bounded: bool) -> dict:
    """50 fields, a third strings (of at most 32 characters when `bounded`), a third integers, a third booleans;
    every other one required."""
    def field(i: int) -> dict:
        if i % 3 == 0:
            return {"type": "string", "maxLength": 32} if bounded else {"type": "string"}
        return {"type": "integer"} if i % 3 == 1 else {"type": "boolean"}

    return {"type": "object", "properties": {f"field_{i}": field(i) for i in range(50)},
            "required": [f"field_{i}" for i in range(0, 50, 2)]}


SCHEMAS = [("OpenAI function-calling parameters (3 properties)", FUNCTION),
           ("nested pydantic model ($ref, Optional fields)", PYDANTIC),
           ("50-property form, strings unbounded", form(False)),
           ("50-property form, strings of at most 32", form(True))]


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def search_step(auto, canvas: int = 256) -> float:
    """Seconds of one denoising step's search for one row (the argmax and the draw) on random log-probabilities
    over a canvas: the automaton's dynamic programme, or the grammar's left-to-right walks."""
    import torch

    torch.manual_seed(0)
    logp = torch.log_softmax(torch.randn(canvas, V), dim=-1)
    row = auto.row(1024, [1], 0, torch.Generator().manual_seed(0))
    sample, argmax = torch.zeros(canvas, dtype=torch.long), torch.zeros(canvas, dtype=torch.long)
    t = time.perf_counter()
    row.step(logp, sample, argmax, greedy=False)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--memory-gb", type=float, default=4.0)
    args = ap.parse_args()
    vocab = SyntheticVocab(V)
    print(f"vocabulary {V:,} tokens; budget {args.seconds:g} s, {args.memory_gb:g} GB\n")
    print("| schema | cold, a fresh worker (s) | cold, a started worker (s) | worker peak memory | token edges | "
          "cached (ms) | a step's search, argmax + draw (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, schema in SCHEMAS:
        st = Structure("json_schema", json.dumps(schema))
        # a started worker (as `dgemma serve` starts one: StructureCompiler.start): the vocabulary read and walked
        # before the structure comes (a throwaway expression waited for first)
        started = StructureCompiler(vocab, V, args.seconds, int(args.memory_gb * (1 << 30)), workers=1)
        started.start()
        started.compile(Structure("regex", "b"))
        t = time.perf_counter()
        try:
            started.compile(st)
            warm = f"{time.perf_counter() - t:.2f}"
        except UsageError:
            warm = "-"
        started.close()
        compiler = StructureCompiler(vocab, V, args.seconds, int(args.memory_gb * (1 << 30)))
        t = time.perf_counter()
        try:
            auto = compiler.compile(st)
            cold, error = time.perf_counter() - t, None
            # a schema whose automaton would be too large runs as llguidance's JSON Schema grammar instead
            edges = f"{auto.edges:,}" if hasattr(auto, "edges") else "- (llguidance grammar)"
        except UsageError as e:
            cold, edges, error = time.perf_counter() - t, "-", str(e)
        pids = compiler.pids  # the one worker that compiled it (each compiler here compiles one structure)
        peak = f"{peak_rss(pids[0]) / 2**20:,.0f} MB" if pids else \
            f"over {args.memory_gb:g} GB (killed)" if error and "memory" in error else "-"
        t = time.perf_counter()
        try:
            compiler.compile(st)
        except UsageError:
            pass
        cached = (time.perf_counter() - t) * 1000
        step = "-" if error else f"{search_step(auto) * 1000:,.0f}"
        print(f"| {name} | {cold:.2f} | {warm} | {peak} | {edges} | {cached:.3f} | {step} |" +
              (f" refused: {error}" if error else ""))
        compiler.close()


if __name__ == "__main__":
    main()
