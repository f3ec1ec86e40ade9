"""What holding one row to a structure adds to a denoise step at the real vocabulary (BENCHMARKS.md, "Structured
answers at the real vocabulary"), on this CPU.

A synthetic vocabulary of 262,144 tokens (scripts/bench_structured.py's: printable ASCII strings by length, ids 0-9
special, with 3, 4 and 5 standing for the call tokens and the quote), one row, a canvas of 256, random
log-probabilities. For each structure an agent sends: how it is searched (the automaton's dynamic programme, or the
grammar's walk), its compile in the worker's code with the vocabulary already made (structured/worker.py `Compile`),
and one step's search (the argmax and the sample path, as the sampler asks) split into the vocabulary-wide pass (each
edge group's best token per position, and the end scores) and the rest (the dynamic programme and its back-trace).
The unit is one pass: a `max` over the step's [256 x 262,144] float32 log-probabilities, timed in the same run.

    .venv/bin/python scripts/bench_held.py [--walk]   # --walk: the forced calls also as the grammar walk (before)
    .venv/bin/python scripts/bench_held.py --ops     # the held step in the kernel report's terms (no GPU needed)
    .venv/bin/python scripts/bench_held.py --device  # the same, searched on the device (a GPU's launches recorded)
    .venv/bin/python scripts/bench_held.py --in-head # the same with the class pass in the fused head
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_structure_compile import SCHEMAS  # noqa: E402  (the schemas of BENCHMARKS "Structure compiles")
from bench_structured import SyntheticVocab  # noqa: E402

from dgemma_cli.structured import constrain  # noqa: E402
from dgemma_cli.structured.structure import Structure  # noqa: E402

V, CANVAS = 262_144, 256
CALL_START, CALL_END, QUOTE = 3, 4, 5

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}
SEARCH = {"name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}
BOOKING = {"name": "book", "parameters": {"type": "object", "properties": {
    "guest": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}},
    "nights": {"type": "array", "items": {"type": "string", "format": "date"}},
    "rooms": {"type": "integer", "minimum": 1, "maximum": 9}}}}
class CallTokenizer:
    """What constraints.call_structure reads of a tokenizer: the quote's id and the vocabulary's size."""

    vocab_size = V

    def token_id(self, text: str) -> int | None:
        return QUOTE if text == '<|"|>' else None


def structures() -> list[tuple[str, Structure, int]]:
    try:
        from dgemma_cli.server.constraints import call_structure
    except ImportError:  # a checkout from before the calls' expression (the before of BENCHMARKS): the walk
        def call_structure(tok, functions, start, end, most, max_tokens):
            return walked(functions, max_tokens)

    tok = CallTokenizer()

    def call(functions, max_tokens):
        return call_structure(tok, functions, CALL_START, CALL_END, most=1, max_tokens=max_tokens)

    return [("forced call get_weather(location: str, unit: enum), max_tokens 64", call([WEATHER], 64), 64),
            ("the same, max_tokens 256", call([WEATHER], 256), 256),
            ("forced call search(query: str), max_tokens 4,096", call([SEARCH], 4096), 4096),
            ("named tool book(guest: object, nights: array, rooms)", call([BOOKING], 256), 256),
            *[(name, Structure("json_schema", json.dumps(schema)), 1024)
              for name, schema in SCHEMAS]]


def walked(functions, max_tokens: int) -> Structure:
    from dgemma_cli.tools import call_grammar

    return Structure("grammar", call_grammar(functions, CALL_START, CALL_END, QUOTE, most=1, max_tokens=max_tokens))


def held_step(auto, max_tokens: int, steps: int = 3) -> dict:
    """Median seconds of what holding adds to one step: the search (argmax and sample paths) given what the free
    step made already (its draw and argmax per position), and the vocabulary-wide part of it."""
    g = torch.Generator().manual_seed(0)
    totals, passes = [], []
    for _ in range(steps):
        logp = torch.log_softmax(torch.randn(CANVAS, V, generator=g) * 3, dim=-1)
        row = auto.row(max_new_tokens=max_tokens, end_ids=[1], pad_id=0, generator=g)
        # what the free step has made already (sampler.sample_step): a draw per position and the argmax
        sample = (logp.exp() / torch.empty_like(logp).exponential_(generator=g)).argmax(dim=1)
        argmax = logp.argmax(dim=1)
        spent = [0.0]
        from dgemma_cli.structured import host_search

        real = host_search.values

        def timed(*args, **kw):
            t0 = time.perf_counter()
            out = real(*args, **kw)
            spent[0] += time.perf_counter() - t0
            return out

        host_search.values = timed
        try:
            t0 = time.perf_counter()
            try:
                row.step(logp, sample, argmax, greedy=False, drawn=True)
            except TypeError:  # a checkout whose search makes its own draws (the before of BENCHMARKS)
                row.step(logp, sample, argmax, greedy=False)
            totals.append(time.perf_counter() - t0)
        finally:
            host_search.values = real
        passes.append(spent[0])
    return dict(step=statistics.median(totals), vocab=statistics.median(passes))


def held_ops(auto, max_tokens: int) -> dict:
    """One held step (given the free step's draw and argmax) in the kernel report's terms: every torch op that would
    run on the device, metered as the whole-step trace meters ops (scripts/bench_structured.py `metered`): kernels,
    host round trips, bytes read and written (the dynamic programme's host work not counted as kernels)."""
    from bench_structured import metered

    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(CANVAS, V, generator=g) * 3, dim=-1)
    sample = (logp.exp() / torch.empty_like(logp).exponential_(generator=g)).argmax(dim=1)
    argmax = logp.argmax(dim=1)
    row = auto.row(max_new_tokens=max_tokens, end_ids=[1], pad_id=0, generator=g)
    return metered(lambda: row.step(logp, sample, argmax, greedy=False, drawn=True))


def launch_bytes(launch) -> int:
    """A recorded Triton launch's bytes as the kernel report's meter counts a torch op's: each tensor operand once,
    whole, except the class pass's scores, of which it reads the gathered columns (positions x the classes' tokens:
    tokens no class holds are not read)."""
    named = launch.named()
    seen, total = set(), 0
    for k, v in named.items():
        if not isinstance(v, torch.Tensor) or v.untyped_storage().data_ptr() in seen:
            continue
        seen.add(v.untyped_storage().data_ptr())
        if launch.kernel == "class_pass_kernel" and k == "score_ptr":
            total += named["P"] * named["T"] * v.element_size()
        else:
            total += v.numel() * v.element_size()
    return total


def held_device_ops(auto, max_tokens: int, repeats: int = 20) -> dict:
    """One held step searched on the device (structured/device_search.py), recorded as a GPU of compute capability
    9.0 would launch it (quant.kernels.aot's recorder: Triton launches kept, not run) with every torch op metered, a
    canvas's second step (its first also copies where the row stands to the device: one more kernel): kernels, host
    round trips, bytes (`launch_bytes`), and the host's own time for the step (median of `repeats`:
    the launches' Python, the fill's and the seed's ops on this CPU's small tensors). The tables are made before
    (once per automaton and end ids, at the request's first step)."""
    from bench_structured import SYNCS

    from dgemma_cli.step_trace import _Meter
    from quant.kernels import aot

    g = torch.Generator().manual_seed(0)
    logp = torch.zeros(CANVAS, V)
    sample, argmax = torch.zeros(CANVAS, dtype=torch.long), torch.zeros(CANVAS, dtype=torch.long)
    row = auto.row(max_tokens, [1], 0, generator=g, device_search=True)
    t0 = time.perf_counter()
    searcher = row._searcher(torch.device("cpu"), CANVAS)
    tables_s = time.perf_counter() - t0
    if searcher is None:
        return dict(on_device=False)
    events: list = []
    ops: list = []
    with aot._recording([], 90):  # a canvas's first step: where the row stands is copied to the device
        row.step(logp, sample, argmax, greedy=False)
    with aot._recording(events, 90), _Meter(ops, persistent=set()):  # a step after it
        row.step(logp, sample, argmax, greedy=False)
    launches = [e for e in events if isinstance(e, aot.Launch)]
    torch_ops = [o for o in ops if o.name not in SYNCS]
    times = []
    with aot._recording([], 90):
        for _ in range(repeats):
            t0 = time.perf_counter()
            row.step(logp, sample, argmax, greedy=False)
            times.append(time.perf_counter() - t0)
    t = searcher.t
    return dict(on_device=True, classes=t.classes, edges=int(t.e_src.size), states=t.states,
                kernels=len(launches) + len(torch_ops), triton=[f"{x.kernel} {x.grid}" for x in launches],
                syncs=sum(o.name in SYNCS for o in ops),
                bytes=sum(launch_bytes(x) for x in launches) + sum(o.bytes for o in torch_ops),
                host_ms=1e3 * statistics.median(times), tables_s=tables_s)


def held_in_head_ops(auto, max_tokens: int, tile: int = 128) -> dict:
    """One held step where the fused head makes the row's class keys (quant/kernels/head.py `_held_classes`) and the
    programme reads them (`RowConstraint.step_keys`), in the same terms, as what holding adds to the row's step:
    the programme's launch and torch ops (recorded for a GPU of compute capability 9.0, metered; a canvas's second
    step, its first also copies where the row stands to the device), and in the head's
    logits kernel the structure's tile tables (each read once) and the keys' atomics (an atomic max at each class run's
    end in each tile, per position and plane: 8 bytes read and 8 written)."""
    from bench_structured import SYNCS

    from dgemma_cli.step_trace import _Meter
    from quant.kernels import aot
    from quant.kernels.class_pass import KEY_MIN

    row = auto.row(max_tokens, [1], 0, generator=torch.Generator().manual_seed(0), device_search=True)
    searcher = row._searcher(torch.device("cpu"), CANVAS)
    if searcher is None:
        return dict(on_device=False)
    order, run = searcher.t.tile_runs(tile)
    P = min(CANVAS, max_tokens)
    keys = torch.full((2, CANVAS, searcher.t.classes), KEY_MIN, dtype=torch.int64)
    sample, argmax = torch.zeros(CANVAS, dtype=torch.long), torch.zeros(CANVAS, dtype=torch.long)
    events: list = []
    ops: list = []
    with aot._recording([], 90):  # a canvas's first step: where the row stands is copied to the device
        row.step_keys(keys, sample, argmax, greedy=False)
    with aot._recording(events, 90), _Meter(ops, persistent=set()):  # a step after it
        row.step_keys(keys, sample, argmax, greedy=False)
    launches = [e for e in events if isinstance(e, aot.Launch)]
    torch_ops = [o for o in ops if o.name not in SYNCS]
    ends = int((run & 1).sum())
    head = order.nbytes + run.nbytes + P * ends * 2 * 16
    return dict(on_device=True, kernels=len(launches) + len(torch_ops), syncs=sum(o.name in SYNCS for o in ops),
                head_bytes=head, bytes=head + sum(launch_bytes(x) for x in launches) + sum(o.bytes for o in torch_ops),
                runs_per_tile=ends / (order.size // tile), logits=P * V * 4)


def one_pass() -> float:
    logp = torch.log_softmax(torch.randn(CANVAS, V, generator=torch.Generator().manual_seed(1)), dim=-1)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        logp.max(dim=1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    from dgemma_cli.structured.worker import Compile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--walk", action="store_true", help="the forced calls also as the grammar walk (the before)")
    ap.add_argument("--only", default="", help="rows whose name holds this text")
    ap.add_argument("--ops", action="store_true", help="the held step in the kernel report's terms instead of timed")
    ap.add_argument("--device", action="store_true",
                    help="the held step searched on the device (a GPU's launches recorded, not run), in those terms")
    ap.add_argument("--in-head", action="store_true",
                    help="the same with the class pass in the fused head: what holding adds to the row's step")
    args = ap.parse_args()
    words = SyntheticVocab(V).words
    for i in (CALL_START, CALL_END, QUOTE):
        words[i] = None
    unit = one_pass()
    compiler = Compile(words, V, None)
    t0 = time.perf_counter()
    compiler.warm()  # the vocabulary read and walked once, as a started worker has it (worker.py `Compile.warm`)
    print(f"one pass: {unit * 1e3:.1f} ms; the worker's vocabulary: {time.perf_counter() - t0:.1f} s", flush=True)
    unit = statistics.median([unit, one_pass()])

    rows = structures()
    if args.walk:
        rows += [("walk: " + rows[0][0], walked([WEATHER], 64), 64), ("walk: " + rows[1][0], walked([WEATHER], 256), 256),
                 ("walk: " + rows[2][0], walked([SEARCH], 4096), 4096)]
    if args.in_head:
        print("| structure | kernels added | host round trips | MB read + written added | x one read of the logits "
              "| class runs per 128-token tile |")
        print("|---|---:|---:|---:|---:|---:|")
    elif args.device:
        print("| structure | classes | edges | states | kernels | host round trips | GB read + written | "
              "x one read of the logits | host ms a step | tables (once) s |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    elif args.ops:
        print("| structure | kernels | host round trips | GB read + written | x one read of the logits |")
        print("|---|---:|---:|---:|---:|")
    else:
        print("| structure | searched by | compile | held step | its vocabulary pass | the rest | in passes |")
        print("|---|---|---:|---:|---:|---:|---:|")
    for name, structure, max_tokens in rows:
        if args.only not in name:
            continue
        t0 = time.perf_counter()
        try:
            kind, result, _ = compiler(structure.kind, structure.source, max_tokens)
        except Exception as e:  # noqa: BLE001 (a row that cannot compile is said, not fatal)
            print(f"| {name} | refused: {str(e)[:80]} | | | | | |", flush=True)
            continue
        compile_s = time.perf_counter() - t0
        if kind == "tables":
            auto, how = constrain.TokenAutomaton(result), f"automaton ({result['edges'] / 1e6:.1f} M edges)"
        else:
            auto, how = constrain.LarkGrammar(result, _LLWords(words), V), "grammar walk"
        if args.in_head:
            if kind != "tables":
                print(f"| {name} | (grammar walk: on the host) | | | | |", flush=True)
                continue
            m = held_in_head_ops(auto, max_tokens)
            if not m["on_device"]:
                print(f"| {name} | (searched on the host: too many states) | | | | |", flush=True)
                continue
            print(f"| {name} | {m['kernels']} | {m['syncs']} | {m['bytes'] / 1e6:.1f} | "
                  f"{m['bytes'] / m['logits']:.3f} | {m['runs_per_tile']:.2f} |", flush=True)
            continue
        if args.device:
            if kind != "tables":
                print(f"| {name} | (grammar walk: on the host) | | | | | | | | |", flush=True)
                continue
            m = held_device_ops(auto, max_tokens)
            if not m["on_device"]:
                print(f"| {name} | (searched on the host: too many states) | | | | | | | | |", flush=True)
                continue
            print(f"| {name} | {m['classes']} | {m['edges']:,} | {m['states']:,} | {m['kernels']} | {m['syncs']} | "
                  f"{m['bytes'] / 1e9:.3f} | {m['bytes'] / (CANVAS * V * 4):.2f} | {m['host_ms']:.2f} | "
                  f"{m['tables_s']:.2f} |", flush=True)
            continue
        if args.ops:
            if kind != "tables":
                print(f"| {name} | (grammar walk: not metered) | | | |", flush=True)
                continue
            m = held_ops(auto, max_tokens)
            print(f"| {name} | {m['kernels']:,} | {m['syncs']} | {m['bytes'] / 1e9:.3f} | "
                  f"{m['bytes'] / (CANVAS * V * 4):.1f} |", flush=True)
            continue
        cost = held_step(auto, max_tokens)
        print(f"| {name} | {how} | {compile_s:.2f} s | {cost['step']:.2f} s | {cost['vocab']:.2f} s | "
              f"{cost['step'] - cost['vocab']:.2f} s | {cost['step'] / unit:.0f} |", flush=True)


class _LLWords:
    """What constrain.ll_tokenizer reads of a tokenizer, for the walk's rows."""

    def __init__(self, words):
        self.words, self.eos_id, self.bos_id = words, 1, 2
        self._index = {w: i for i, w in enumerate(words) if w}

    def token_bytes(self):
        return self.words

    def encode_text(self, text: str) -> list[int]:
        return [self._index[c.encode()] for c in text if c.encode() in self._index]


if __name__ == "__main__":
    main()
