"""A held row's search on the device (dgemma_cli/structured/device_search.py, quant/kernels/class_pass.py and
automaton_dp.py) in Triton's interpreter: each kernel equal to its torch path (the class pass's keys, its noise
included; the dynamic programme's paths against the host's programme on the reference's scores), the argmax path the
host search's (the same optimum), answers valid, and a step that reads nothing on the host."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dgemma_cli.structured.classes import class_tables
from dgemma_cli.structured.constrain import TokenAutomaton, best_path
from dgemma_cli.structured.device_search import DeviceSearch, device_tables
from dgemma_cli.structured.structure import SPECIAL_BASE, Structure
from quant.kernels.class_pass import KEY_MIN, class_pass, class_pass_reference, indices_of, values_of
from test_token_classes import SCHEMAS, WORDS, V

END, PAD = 1, 2


def automaton(name: str) -> TokenAutomaton:
    return TokenAutomaton(class_tables(Structure("json_schema", json.dumps(SCHEMAS[name])).regex(), WORDS, V))


def call_automaton() -> TokenAutomaton:
    """A tool call spelled with special tokens (ids 0-2 stand for the call's start, end and quote)."""
    q = f"\\U{SPECIAL_BASE:08X}"
    regex = f"\\U{SPECIAL_BASE + 1:08X}call:f\\{{x:{q}[^<\\U00100000-\\U0010FFFF]{{0,3}}{q}\\}}\\U{SPECIAL_BASE + 2:08X}"
    return TokenAutomaton(class_tables(regex, WORDS, V, (0, 1, 2)))


class NoHostReads(TorchDispatchMode):
    """Fails on any op that makes the host wait for the device (a value read, a data-dependent size)."""

    READS = ("aten::_local_scalar_dense", "aten::is_nonzero", "aten::item", "aten::nonzero", "aten::equal")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        assert func._schema.name not in self.READS, f"{func._schema.name}: a host round trip in the step"
        return func(*args, **(kwargs or {}))


def reference_step(tables, score: torch.Tensor, state: int, room: int, after: int, pad_id: int,
                   seed: int | None) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """The device search's two kernels in torch and numpy, for the checks: the class pass's reference
    (class_pass.class_pass_reference: the same noise from the same seed), each set's best over its classes, and the
    host's dynamic programme (constrain.host_path) over the edges. Returns (argmax path [C], drawn path [C] or None
    without a seed, ok)."""
    from quant.kernels.class_pass import class_pass_reference, indices_of, values_of

    from dgemma_cli.structured.constrain import host_path

    C = score.shape[0]
    keys = class_pass_reference(score[:room], torch.from_numpy(tables.perm), torch.from_numpy(tables.blk),
                                tables.classes, seed)  # [2, room, classes]
    sets = torch.full((2, room, tables.sets), -(1 << 63), dtype=torch.int64)
    pair_set = torch.from_numpy(tables.pair_set).long()
    sets.scatter_reduce_(2, pair_set.expand(2, room, -1), keys[:, :, torch.from_numpy(tables.pair_blk).long()], "amax")
    e_set = torch.from_numpy(tables.e_set).long()
    src, dst = torch.from_numpy(tables.e_src).long(), torch.from_numpy(tables.e_dst).long()
    dist = torch.from_numpy(tables.dist).long()
    paths, ok = [], False
    for which in range(1 if seed is None else 2):
        k = sets[which][:, e_set]  # [room, E]
        path, found = host_path(values_of(k), indices_of(k), src, dst, dist, state, after)
        out = torch.full((C,), pad_id, dtype=torch.long)
        if path is not None:
            out[:room] = path
        paths.append(out)
        ok = found if which == 0 else ok
    return paths[0], paths[1] if seed is not None else None, ok


def test_the_class_pass_is_its_torch_path():
    """Each class's best key per position equals the reference's bit for bit; under noise (philox, repeated in
    numpy) the same tokens, the values within the log's rounding."""
    g = torch.Generator().manual_seed(0)
    P, Vs, NB = 3, 300, 9
    score = torch.log_softmax(torch.randn(P, Vs, generator=g) * 3, dim=1)
    score[1, 7] = -float("inf")  # a token the row cannot take
    cls = torch.randint(0, NB, (Vs,), generator=g)
    cls[::5] = -1  # tokens no class holds: not read
    keep = torch.nonzero(cls >= 0).flatten()
    perm = keep[torch.argsort(cls[keep], stable=True)].int()
    blk = cls[perm.long()].int()
    out = torch.empty(2, P, NB, dtype=torch.int64)
    class_pass(score, perm, blk, NB, torch.tensor([987654321]), out)
    ref = class_pass_reference(score, perm, blk, NB, 987654321)
    assert torch.equal(out[0], ref[0]) and (out != KEY_MIN).all()
    assert torch.equal(indices_of(out[1]), indices_of(ref[1]))
    assert torch.allclose(values_of(out[1]), values_of(ref[1]), atol=1e-5, rtol=0)
    for c in range(NB):  # and the reference is what it says
        toks = torch.nonzero(cls == c).flatten()
        v, i = score[:, toks].max(dim=1)
        assert torch.equal(values_of(ref[0, :, c]), v) and torch.equal(indices_of(ref[0, :, c]), toks[i])


@pytest.mark.slow  # make test's time (CI runs it in make test-slow)
def test_the_programme_is_its_torch_path():
    """The dynamic programme's kernel on made-up tables whose runs cross its chunks of lanes (a set of 100 classes,
    a target with 100 edges into it): both paths and ok equal the host's programme (constrain.host_path) on the same
    sets' keys."""
    from dgemma_cli.structured.constrain import host_path
    from quant.kernels.automaton_dp import automaton_dp
    from quant.kernels.class_pass import keys_of

    g = torch.Generator().manual_seed(5)
    P, NB, S, E = 6, 120, 7, 300
    sizes = [3, 2, 100, 4, 1, 2, 3, 2, 1, 3, 2, 4, 1, 2, 3, 2, 1, 3, 2, 4]  # set 2: a run across the lanes' chunks
    NS = len(sizes)
    pair_set = torch.arange(NS).repeat_interleave(torch.tensor(sizes)).int()
    pair_blk = torch.cat([torch.randperm(NB, generator=g)[:n] for n in sizes]).int()
    e_dst = torch.sort(torch.cat([torch.full((100,), 2), torch.randint(0, S, (E - 100,), generator=g)])).values.int()
    e_src = torch.randint(0, S, (E,), generator=g).int()
    e_set = torch.randint(0, NS, (E,), generator=g).int()
    into = torch.nonzero(e_dst == 2).flatten()  # each (source, set) at most once: the best edge is one of them
    combos = torch.randperm(S * NS, generator=g)[: into.numel()]
    e_src[into], e_set[into] = (combos // NS).int(), (combos % NS).int()
    dist = torch.tensor([2, 1, 0, 3, 1, 0, 2], dtype=torch.int32)
    keys = keys_of(torch.randn(2, P, NB, generator=g), torch.randint(0, 1000, (2, P, NB), generator=g))
    for state, room, after in [(0, 6, 0), (4, 4, 1), (3, 1, 0)]:
        meta = torch.tensor([state, room, after], dtype=torch.int32)
        scratch = (torch.empty(2, P, NS, dtype=torch.int64), torch.empty(2, 3, S, dtype=torch.float32),
                   torch.empty(2, P, S, dtype=torch.int32))
        out0, out1 = torch.zeros(P, dtype=torch.long), torch.zeros(P, dtype=torch.long)
        ok = torch.zeros(2, dtype=torch.int32)
        automaton_dp(keys, pair_set, pair_blk, NS, e_src, e_set, e_dst, dist, meta, scratch, out0, out1, ok, PAD, 2)
        sets = torch.full((2, P, NS), KEY_MIN, dtype=torch.int64)
        sets.scatter_reduce_(2, pair_set.long().expand(2, P, -1), keys[:, :, pair_blk.long()], "amax")
        for which, out in ((0, out0), (1, out1)):
            k = sets[which, :room][:, e_set.long()]
            path, found = host_path(values_of(k), indices_of(k), e_src.long(), e_dst.long(), dist.long(), state,
                                    after)
            want = torch.full((P,), PAD, dtype=torch.long)
            want[:room] = path
            assert torch.equal(out, want) and bool(ok[which]) == found, (which, state, room, after)


def _step(auto: TokenAutomaton, C: int, room: int, after: int, seed: int, state: int = 0):
    t = device_tables(auto, [END], PAD)
    gen = torch.Generator().manual_seed(seed)
    search = DeviceSearch(t, C, PAD, "cpu", gen)
    logp = torch.log_softmax(torch.randn(C, V, generator=torch.Generator().manual_seed(seed + 1)) * 3, dim=1)
    noise_seed = int(torch.randint(0, 1 << 62, (1,), generator=torch.Generator().set_state(gen.get_state())))
    sample, argmax = torch.zeros(C, dtype=torch.long), torch.zeros(C, dtype=torch.long)
    search.set_canvas(state, room, after)
    with NoHostReads():
        search.step(logp, sample, argmax, greedy=False)
    return t, search, logp, noise_seed, sample, argmax


def test_the_device_search_is_the_host_search():
    """One step of the function schema: the argmax path is the host search's (constrain.best_path, the same
    optimum), both paths are the reference's (the kernels' torch path with the same noise), with no host read."""
    auto = automaton("function")
    C = 10
    t, search, logp, noise_seed, sample, argmax = _step(auto, C, C, 40, seed=3)
    want, ok = best_path(auto, logp, 0, C, 40, [END], PAD)
    assert torch.equal(argmax, want) and search.path_found() == ok
    ref_argmax, ref_drawn, ref_ok = reference_step(t, logp, 0, C, 40, PAD, noise_seed)
    assert torch.equal(argmax, ref_argmax) and torch.equal(sample, ref_drawn) and ref_ok == ok
    assert auto.advance(0, [x for x in sample.tolist() if x not in (END, PAD)]) is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMAS) + ["call"])
def test_every_structure_and_a_cut_short_canvas(name):
    """The schemas and a call with special tokens, from the start and from a state inside, with room to end and
    without (ok False: the best path that ignores the limit, as the host's)."""
    auto = call_automaton() if name == "call" else automaton(name)
    for seed, (room, after, state) in enumerate([(10, 40, 0), (6, 1, 0), (10, 40, 3)]):
        C = 10
        t, search, logp, noise_seed, sample, argmax = _step(auto, C, room, after, seed=10 * seed, state=state)
        want, ok = best_path(auto, logp, state, room, after, [END], PAD)
        assert torch.equal(argmax, want) and search.path_found() == ok, (room, after, state)
        ref_argmax, ref_drawn, _ = reference_step(t, logp, state, room, after, PAD, noise_seed)
        assert torch.equal(sample, ref_drawn)


@pytest.mark.slow
def test_answers_through_the_row_are_valid():
    """RowConstraint with the device search forced (the interpreter stands in for a GPU): answers made canvas by
    canvas validate against the schema, and its `ok` is read when the canvas ends."""
    schema = SCHEMAS["function"]
    auto = automaton("function")
    valid = 0
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        row = auto.row(40, [END], PAD, generator=g, device_search=True)
        assert row.on_device("cpu", 10)
        ids: list[int] = []
        while row.produced < 40 and not row.ended:
            logp = torch.log_softmax(torch.randn(10, V, generator=g) * 2, dim=1)
            sample, argmax = torch.zeros(10, dtype=torch.long), torch.zeros(10, dtype=torch.long)
            row.step(logp, sample, argmax, greedy=False)
            row.end_canvas(sample.tolist())
            ids += sample.tolist()
        if row.satisfied:
            cut = ids.index(END) if END in ids else len(ids)
            jsonschema.validate(json.loads(b"".join(WORDS[t] for t in ids[:cut] if t != PAD).decode()), schema)
            valid += 1
    assert valid >= 2


def test_classes_partition_every_set():
    """Every token set of the automaton (small groups, masks, the end ids, the end ids and pad) is exactly the union
    of its classes, and tokens no set holds are in no class."""
    auto = automaton("bounded")
    t = device_tables(auto, [END], PAD)
    class_of = np.full(V, -1)
    class_of[t.perm] = t.blk
    assert np.all(np.diff(t.blk) >= 0) and len(set(t.perm.tolist())) == t.perm.size
    members = {int(k): set(np.flatnonzero(class_of == k).tolist()) for k in range(t.classes)}
    sets: dict[int, set] = {}
    for s, b in zip(t.pair_set.tolist(), t.pair_blk.tolist()):
        sets.setdefault(s, set()).update(members[b])
    assert sets[t.sets - 2] == {END} and sets[t.sets - 1] == {END, PAD}
    for g in range(auto.G):
        k = int(auto.set_of[g])
        if k >= 0:
            want = set(auto.tokens[auto.offsets[g] : auto.offsets[g + 1]].tolist())
            assert sets[k] == want
    union = set().union(*sets.values())
    assert union == set(t.perm.tolist())


class _CanvasModel:
    """A stand-in denoiser over the test vocabulary: each position's hidden state from its token and place, and the
    head over a random embedding: the fused head (buf.fused) or the torch path's logits (buf.logits)."""

    def __init__(self, C: int, H: int = 64):
        g = torch.Generator().manual_seed(0)
        self.vocab_size, self.canvas_length, self.hidden_size, self.dtype = V, C, H, torch.bfloat16
        self.emb = (torch.randn(V, H, generator=g) * 0.3).to(torch.bfloat16)
        self.place = torch.randn(C, H, generator=g)

    def encode(self, ids, valid) -> None:
        pass

    def start_canvas(self) -> None:
        pass

    def denoise(self, canvas, buf, self_conditioned: bool) -> None:
        from quant.kernels.head import fused_head

        B, C = canvas.shape
        h = (self.emb[canvas].float() * 0.5 + self.place).reshape(B * C, -1).to(torch.bfloat16)
        self.last_h = h
        if buf.fused is not None:
            self.last_t = buf.temperature[0]
            fused_head(h, self.emb, 30.0, self.hidden_size**0.5, buf.temperature, buf.uniforms, buf.fused)
        else:
            logits = h.float() @ self.emb.float().t()
            buf.logits.copy_(torch.tanh(logits / 30.0) * 30.0)


@pytest.mark.slow
def test_held_rows_search_the_heads_class_keys(monkeypatch):
    """The sampler with the fused head (forced: the interpreter stands in for a GPU): the held row's class pass runs
    in the head and its programme on the keys, reading nothing on the host; at every step its argmax path is the host
    search's on the same step's log-probabilities (the reference's logits from the head's input), and the answer,
    greedy or drawn, is a word of the schema."""
    from torch.utils._python_dispatch import _disable_current_modes

    from dgemma_cli import sampler
    from dgemma_cli.config import GenerationSettings
    from dgemma_cli.sampler import Done, generate_events
    from dgemma_cli.structured.constrain import RowConstraint

    auto = automaton("function")
    model = _CanvasModel(8)
    monkeypatch.setattr(sampler, "use_fused_head", lambda device, dtype, family="head": True)
    steps = []
    real_keys = RowConstraint.step_keys

    def step_keys(self, keys, sample, argmax, greedy):
        real_keys(self, keys, sample, argmax, greedy)
        with _disable_current_modes():
            steps.append((argmax.clone(), model.last_h.clone(), float(model.last_t), self.state, self.produced))

    monkeypatch.setattr(RowConstraint, "step_keys", step_keys)
    real_settle = sampler.settle_step

    def settle(*args, **kw):
        with NoHostReads():
            return real_settle(*args, **kw)

    monkeypatch.setattr(sampler, "settle_step", settle)
    for greedy in (True, False):
        settings = GenerationSettings(max_new_tokens=16, max_denoising_steps=3, greedy=greedy, eos_token_ids=(END,),
                                      pad_token_id=PAD)
        row = auto.row(16, [END], PAD, device_search=True)
        done = list(generate_events(model, torch.tensor([[5, 6, 7]]), settings, constraints=[row]))[-1]
        assert isinstance(done, Done) and done.satisfied[0]
        ids = done.token_ids[0]
        assert auto.advance(0, [t for t in ids if t != PAD]) is not None
    assert len(steps) >= 4
    for argmax, h, t, state, produced in steps:
        logits = torch.tanh(h.float() @ model.emb.float().t() / 30.0) * 30.0
        logp = torch.log_softmax(logits / t, dim=-1)
        room = min(8, 16 - produced)
        want, _ = best_path(auto, logp, state, room, 16 - produced - room, [END], PAD)
        assert torch.equal(argmax, want)


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.slow
def test_the_held_kernels_compile_for_real_targets():
    """The class pass, the programme and the head's held-rows epilogue compile for sm_89, sm_90 and sm_120 at the
    real sizes (scripts/compile_held.py: Triton's bundled ptxas, in a process without the interpreter)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from quant.kernels.aot import missing_tools

    why = missing_tools()
    if why:
        pytest.skip(why)
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(root / "scripts" / "compile_held.py")], capture_output=True, text=True,
                         env=env, cwd=root, timeout=900)
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    kernels = {(r["kernel"], r["cc"]) for r in rows if r["ok"]}
    for cc in (89, 90, 120):
        for k in ("class_pass_kernel", "automaton_dp_kernel", "head_logits_kernel"):
            assert (k, cc) in kernels
