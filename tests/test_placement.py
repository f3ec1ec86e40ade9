"""Placement (dgemma_cli/placement): the planner on the real config and the cards people own, `dgemma plan`, and
streamed experts at run time: `--gpu-memory` on the CPU takes the path a card of that size would (the streamed
layers' experts in host memory, copied into two layer buffers before each use), with tokens identical to the
resident run in every format and with an adapter on the experts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import SPECS, build_checkpoint
from cli_helpers import run_main
from plan_sizes import card_size

from dgemma_cli.config import DIFFUSIONGEMMA_26B_A4B, ModelConfig
from dgemma_cli.engine import load
from dgemma_cli.placement.cards import GB, GIB, Card, card, parse_size, sized
from dgemma_cli.placement.plan import choose, plan, planned_context
from dgemma_cli.placement.streaming import Copier

ROOT = Path(__file__).resolve().parent.parent
REAL = ModelConfig.from_dict(DIFFUSIONGEMMA_26B_A4B)
FIXTURES = Path(__file__).resolve().parent / "fixtures"
SIXTEEN = ["RTX 4060 Ti 16GB", "RTX 4080", "RTX 5060 Ti 16GB", "RTX 5070 Ti", "RTX 5080"]


def run_cli(args, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = run_main(args)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# ----------------------------------------------------------------------------- the planner, on the real config


@pytest.mark.parametrize("name", ["RTX 3060 12GB", "RTX 4060", "RTX 4070", *SIXTEEN, "RTX 4090", "RTX 5090"])
def test_the_published_nvfp4_fits_every_listed_card_at_an_8k_context(name):
    p = plan(REAL, "nvfp4", [card(name)], context=8192, batch=1)
    assert p.fits, p.refusal
    c = p.cards[0]
    assert c.resident_bytes <= c.card.memory
    assert len(c.layers) == 30 and p.host_bytes == len(p.streamed) * p.expert_bytes
    if c.card.memory >= 24 * GIB:
        assert p.streamed == [] and c.buffer_bytes == 0  # a 24 GB card holds it all: nothing streams
    else:
        assert p.streamed and c.buffer_bytes == 2 * p.expert_bytes
    if name in SIXTEEN:
        assert 0 < len(p.streamed) < 15  # a few layers stream, spread through the stack
        gaps = [b - a for a, b in zip(p.streamed, p.streamed[1:])]
        assert max(gaps) - min(gaps) <= 1


def test_a_card_streams_fewer_layers_the_more_memory_it_has():
    streamed = [len(plan(REAL, "nvfp4", [card(f"{g}GB")]).streamed) for g in (10, 12, 14, 16, 18, 20, 22)]
    assert streamed == sorted(streamed, reverse=True) and streamed[0] > streamed[-1]


def test_a_card_too_small_even_streaming_is_refused_in_one_line():
    p = plan(REAL, "nvfp4", [card("6GB")], context=8192)
    assert not p.fits and "\n" not in p.refusal and "even with every layer's experts streamed" in p.refusal
    need = p.cards[0].fixed_bytes + 2 * p.expert_bytes  # the fixed part and the two layer buffers: the least
    assert f"needs {need / GB:.2f} GB on the card" in p.refusal
    assert plan(REAL, "nvfp4", [card(f"{need / GB + 0.01:.2f}GB")], context=8192).fits


def test_too_little_host_memory_is_refused_in_one_line():
    p = plan(REAL, "nvfp4", [card("RTX 4060")], host_free=4 * GB)
    assert not p.fits and "\n" not in p.refusal and "host memory" in p.refusal
    assert plan(REAL, "nvfp4", [card("RTX 4060")], host_free=64 * GB).fits


def test_two_cards_split_the_layers_when_one_cannot_hold_them():
    p = plan(REAL, "int8", [card("RTX 3090"), card("RTX 3090")])
    assert p.fits and p.streamed == [] and len(p.cards) == 2
    first, second = p.cards
    assert first.layers + second.layers == list(range(30)) and first.layers and second.layers
    assert all(c.resident_bytes <= c.card.memory for c in p.cards)
    assert len(plan(REAL, "nvfp4", [card("RTX 3090"), card("RTX 3090")]).cards) == 1  # one card holds NVFP4


def test_auto_takes_the_least_lossy_format_that_needs_no_streaming():
    assert choose(REAL, [card("H100")]) == "bf16"
    assert choose(REAL, [card("RTX 5090")]) == "int8" or choose(REAL, [card("RTX 5090")]) == "fp8"
    assert choose(REAL, [card("RTX 3090")]) == "nvfp4"  # no FP8 there, INT8 does not fit
    assert choose(REAL, [card("RTX 4080")]) == "nvfp4"  # nothing fits whole: NVFP4 streams


def test_sizes_and_card_names_as_people_write_them():
    assert parse_size("16GB") == 16 * GB and parse_size("12.5GiB") == int(12.5 * GIB)
    assert parse_size("8000MB") == 8 * GB and parse_size("16") == 16 * GB
    assert card("rtx4060ti").name == card("4060 Ti 16GB").name == "RTX 4060 Ti 16GB"
    assert card("RTX 4060").pcie_lanes == 8 and card("RTX 5080").link_gb_per_s > 60
    assert card("16GB").memory == 16 * GB
    for bad in ("sixteen", "16TBs", "0.1GB"):
        with pytest.raises(Exception) as e:
            parse_size(bad)
        assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- dgemma plan


def test_plan_json_for_the_real_config(capsys):
    rc, out, err = run_cli(["plan", "--gpu", "RTX 4080", "--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    for key in ("fits", "format", "devices", "resident_bytes", "streamed_bytes_per_step", "host_bytes",
                "link_gb_per_s"):
        assert key in d, key
    assert d["fits"] and d["format"] == "nvfp4" and d["devices"][0]["card"] == "RTX 4080"
    assert d["streamed_bytes_per_step"] == len(d["streamed_layers"]) * d["expert_bytes_per_layer"] > 0
    assert d["link_gb_per_s"] == pytest.approx(31.51, abs=0.01)


def test_plan_of_two_cards_and_a_refusal(capsys):
    rc, out, err = run_cli(["plan", "--gpu", "RTX 3090", "--gpu", "RTX 3090", "--quant", "int8"], capsys)
    assert rc == 0, err
    assert out.count("RTX 3090") == 2 and "fits" in out
    rc, out, err = run_cli(["plan", "--gpu", "6GB"], capsys)
    assert rc == 1 and err.count("\n") == 1 and "does not fit" in err and "Traceback" not in err
    rc, out, err = run_cli(["plan", "--gpu", "Voodoo 5"], capsys)
    assert rc == 2 and "not a card dgemma knows" in err


def test_a_size_under_the_floor_is_refused_in_mib(capsys):
    rc, out, err = run_cli(["plan", "--gpu", "257MB"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "at least 256 MiB" in err, err  # 257 MB is under 256 MiB
    assert run_cli(["plan", "--gpu", "256MiB", "--json"], capsys)[0] == 1  # the floor itself is a size


@pytest.mark.parametrize("args, named, not_named", [
    (["plan", "--model", "demo", "--gpu", "300MB", "--batch", "2"], ["--context", "--batch", "--quant", "--gpu"], []),
    (["plan", "--model", "demo", "--gpu", "300MB"], ["--context", "--quant", "--gpu"], ["--batch"]),
    (["run", "--gpu-memory", "300MB", "upper: hello diffusions"], ["--gpu-memory"], ["context", "--batch"]),
    (["run", "--gpu-memory", "300MB", "--each-line", "--batch-size", "4"], ["--batch-size", "--gpu-memory"],
     ["context"]),
    (["chat", "--gpu-memory", "300MB", "--context", "64"], ["--gpu-memory"], ["context", "batch"]),
    (["serve", "--port", "0", "--gpu-memory", "300MB"], ["--max-batch", "--gpu-memory"], ["context"]),
])
def test_a_card_too_small_names_the_commands_own_remedies(capsys, monkeypatch, args, named, not_named):
    """What a refusal suggests is what that command can change: its batch flag, never a --context it lacks (or,
    chat's, one its plan does not read)."""
    import io

    class Stdin(io.StringIO):
        def isatty(self):
            return args[0] == "chat"  # chat needs a terminal

    monkeypatch.setattr(sys, "stdin", Stdin("upper: hello diffusions\n"))
    if args[0] != "plan":
        args = [args[0], "--model", "demo", "--device", "cpu", *args[1:]]
    rc, out, err = run_cli(args, capsys)
    assert rc == 1 and err.count("\n") == 1 and "does not fit" in err, err
    assert out == "" or args[0] == "plan"  # plan's table says what does not fit
    remedies = err.split("on the card (", 1)[1]
    for flag in named:
        assert flag in remedies, (flag, err)
    for word in not_named:
        assert word not in remedies, (word, err)


def test_plan_plans_the_format_run_runs(capsys):
    """A bf16 model on a card that FP8 would fit whole: run runs it bf16 (streaming), and so plan plans it."""
    rc, out, err = run_cli(["plan", "--model", "demo-sudoku", "--gpu", "542.7MB", "--json"], capsys)
    assert rc == 0, err
    planned = json.loads(out)
    ran = load("demo-sudoku", device="cpu", gpu_memory=parse_size("542.7MB")).model.placement
    assert (planned["format"], planned["policy"], planned["streamed_layers"]) == (ran.fmt, ran.policy, ran.streamed)
    assert planned["format"] == "bf16"


def test_a_policy_that_does_not_apply_is_not_dropped_silently(capsys):
    for extra in (["--quant", "bf16"], []):  # bf16 asked for, or the model's own format (bf16)
        rc, out, err = run_cli(["plan", "--model", "demo-sudoku", "--gpu", "542.7MB", *extra, "--policy", "all"],
                               capsys)
        assert rc == 2 and out == "" and err.count("\n") == 1 and "--policy" in err and "bf16" in err, err
    rc, out, err = run_cli(["plan", "--gpu", "H100", "--policy", "all"], capsys)  # --quant auto takes bf16 there
    assert rc == 0 and out.startswith("format bf16") and err.count("\n") == 1 and "--policy all" in err, err


def test_plan_with_named_cards_never_imports_torch():
    code = ("import sys\nfrom dgemma_cli.cli import main\ntry:\n    main(['plan', '--gpu', 'RTX 4080'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules, file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stderr.strip().splitlines()[-1] == "False", p.stderr


# ----------------------------------------------------------------------------- streamed experts, exactly


def streaming_memory(path: Path, resident: int = 1) -> int:
    """The --gpu-memory at which `path` keeps `resident` layers' experts on the card and streams the rest, planned as
    the CPU runs it (the CPU's path unpacks a quantized layer at a time)."""
    from dgemma_cli.checkpoint.layout import stored_policy
    from dgemma_cli.checkpoint.weights import read_quant_format
    from dgemma_cli.placement.plan import streaming_memory as at

    cfg = ModelConfig.from_dir(path)
    fmt = read_quant_format(path, cfg.raw) or "bf16"
    return at(cfg, fmt, stored_policy(path) if fmt != "bf16" else None, resident)


PROMPTS = [[2, 200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211], [2, 300, 301, 302]]


def tokens(engine):
    C = engine.config.canvas_length
    return engine.generate(PROMPTS, raw=True, max_new_tokens=3 * C, max_denoising_steps=6, seed=5).token_ids


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """The five_to_one checkpoint in bf16 (as written by the reference) and quantized to NVFP4, INT8 and FP8 W8A8 by
    dgemma, and ModelOpt's own NVFP4 export (per-expert tensors)."""
    from dgemma_cli.store.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("placement")
    src = build_checkpoint(root / "bf16", SPECS["five_to_one"], seed=0)
    out = {"bf16": src, "modelopt": FIXTURES / "modelopt_nvfp4"}
    for fmt in ("nvfp4", "int8", "fp8"):
        quantize_checkpoint(src, root / fmt, fmt)
        out[fmt] = root / fmt
    # a 64-token context: the KV cache no longer outweighs the experts, so a split over two cards streams some
    short = build_checkpoint(root / "bf16_short", SPECS["five_to_one"], seed=0, max_position_embeddings=64)
    quantize_checkpoint(short, root / "nvfp4_short", "nvfp4")
    out["nvfp4_short"] = root / "nvfp4_short"
    return out


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "int8", "fp8", "modelopt"])
def test_streamed_experts_give_the_resident_runs_tokens(formats, fmt):
    path = formats[fmt]
    resident = load(path, device="cpu", dtype="float32")
    streamed = load(path, device="cpu", dtype="float32", gpu_memory=streaming_memory(path))
    layers = streamed.model.placement.streamed
    L = streamed.config.text.num_hidden_layers
    assert len(layers) == max(L - 1, 3) and streamed.model.expert_streams[0].layers == layers
    for i in layers:  # the module holds a buffer, not its own layer's weights; the layer's are in host memory
        mod = dict(streamed.model.layers[i].experts.named_buffers()) or dict(
            streamed.model.layers[i].experts.named_parameters())
        host = streamed.model.expert_streams[0].host[i]
        assert set(host) == set(mod) and all(mod[n].data_ptr() != host[n].data_ptr() for n in host)
    before = streamed.model.expert_streams[0].copies
    assert tokens(streamed) == tokens(resident)
    assert streamed.model.expert_streams[0].copies - before >= 2 * len(layers)  # every streamed layer, every step


def test_an_adapter_on_streamed_experts_gives_the_resident_runs_tokens(tmp_path):
    from test_lora import demo_adapters

    from dgemma_cli.checkpoint.names import DEMO_MODEL

    ad = demo_adapters(tmp_path, n=1)[0]
    resident = load("demo", device="cpu", adapters=[(ad, 1.0)])
    streamed = load("demo", device="cpu", adapters=[(ad, 1.0)], gpu_memory=streaming_memory(DEMO_MODEL))
    assert streamed.model.placement.streamed and streamed.model.layers[0].experts.low_rank is not None
    plain = load("demo", device="cpu").generate("sudoku: ..4./..../.2.1/3...", seed=0).token_ids
    got = streamed.generate("sudoku: ..4./..../.2.1/3...", seed=0).token_ids
    assert got == resident.generate("sudoku: ..4./..../.2.1/3...", seed=0).token_ids and got != plain


def test_run_with_gpu_memory_answers_as_without(capsys):
    from dgemma_cli.checkpoint.names import DEMO_MODEL

    size = f"{streaming_memory(DEMO_MODEL) / 1e6:.6f}MB"
    rc, plain, err = run_cli(["run", "--seed", "0", "-q", "upper: hello diffusions"], capsys)
    assert rc == 0, err
    rc, out, err = run_cli(["run", "--seed", "0", "-q", "--gpu-memory", size, "upper: hello diffusions"], capsys)
    assert rc == 0 and out == plain == "HELLO DIFFUSIONS\n", err
    rc, out, err = run_cli(["run", "--seed", "0", "--gpu-memory", size, "upper: hello diffusions"], capsys)
    assert rc == 0 and "layers' experts stream from host memory (" in err, err  # said, unless -q


@pytest.mark.parametrize("size, says", [("300MB", "does not fit"), ("lots", "give a size")])
def test_run_refuses_a_card_too_small_or_a_bad_size_in_one_line(capsys, size, says):
    rc, out, err = run_cli(["run", "-q", "--gpu-memory", size, "upper: hello diffusions"], capsys)
    assert rc != 0 and out == "" and err.count("\n") == 1 and says in err, err


# Copiers that overlap, as a CUDA copy stream would, on the CPU: a copy queued by copy_later lands as late as the
# ordering allows (only when the compute stream waits for it, the copy stream in order), as early as it allows (at
# once: on the CPU everything queued before it has run), or at random points between. A schedule that reads a buffer
# before waiting for its copy, or copies into a buffer a layer still needs, gives other tokens under one of them.


class LateCopier(Copier):
    overlaps = True

    def __init__(self):
        self.queue, self.ahead = [], 0

    def copy_later(self, pairs):
        self.ahead += 1
        token = object()
        self.queue.append((token, pairs))
        return token

    def land(self, upto=None, count=None):
        while self.queue and (count is None or count > 0):
            token, pairs = self.queue.pop(0)
            Copier.copy_now(self, pairs)
            count = None if count is None else count - 1
            if token is upto:
                return

    def wait(self, token):
        self.land(upto=token)


class EarlyCopier(LateCopier):
    def copy_later(self, pairs):
        token = super().copy_later(pairs)
        self.land()
        return token


class RandomCopier(LateCopier):
    def __init__(self, seed):
        super().__init__()
        self.rng = __import__("random").Random(seed)

    def copy_later(self, pairs):
        self.land(count=self.rng.randint(0, len(self.queue)))
        return super().copy_later(pairs)

    def wait(self, token):
        self.land(count=self.rng.randint(0, len(self.queue)))
        super().wait(token)


class ForgetfulCopier(LateCopier):
    """A broken copy stream: waiting for a copy does not make it land first (it lands at the next copy queued)."""

    def copy_later(self, pairs):
        self.land()
        return super().copy_later(pairs)

    def wait(self, token):
        pass


COPIERS = {"late": LateCopier, "early": EarlyCopier, "random": lambda: RandomCopier(3)}


@pytest.fixture(scope="module")
def resident_and_streamed(formats):
    path = formats["nvfp4"]
    return load(path, device="cpu", dtype="float32"), load(path, device="cpu", dtype="float32",
                                                             gpu_memory=streaming_memory(path))


@pytest.mark.parametrize("name", sorted(COPIERS))
def test_copies_ahead_of_their_layer_give_the_resident_runs_tokens(resident_and_streamed, name):
    resident, streamed = resident_and_streamed
    stream = streamed.model.expert_streams[0]
    stream.copier = copier = COPIERS[name]()
    try:
        before = stream.copies
        assert tokens(streamed) == tokens(resident)
        n = len(stream.layers)
        assert copier.ahead == stream.copies - before >= 2 * n  # every copy was made ahead, none waited on the spot
        assert stream.holds == stream.first[:2] and stream.pending == [None, None]  # as every pass leaves them
        # a pass copies each streamed layer once: s0 and s1 were copied ahead by the pass before
        with torch.inference_mode():
            d = __import__("dgemma_cli.engine", fromlist=["ModelDenoiser"]).ModelDenoiser(streamed.model, 1, 40)
            d.encode(torch.tensor([PROMPTS[0]]), None)
            d.start_canvas()
            canvas = torch.randint(0, streamed.config.text.vocab_size, (1, streamed.config.canvas_length))
            before = stream.copies
            streamed.model.denoise(canvas, d.cache, d.ctx)
            assert stream.copies - before == n
    finally:
        stream.copier = Copier()


@pytest.mark.parametrize("name", sorted(COPIERS))
def test_rows_run_apart_through_streamed_layers_copied_ahead(resident_and_streamed, name):
    """The server's batch on the CPU runs each row's experts apart (experts_per_row): one layer's experts are called
    once per row, and its buffer takes the next layer only after the last of them."""
    from dgemma_cli.engine import ModelDenoiser

    resident, streamed = resident_and_streamed
    stream = streamed.model.expert_streams[0]
    cfg = streamed.config
    canvas = torch.randint(0, cfg.text.vocab_size, (2, cfg.canvas_length), generator=torch.Generator().manual_seed(0))
    prompts = torch.tensor([PROMPTS[0][:4], PROMPTS[1]])
    logits = []
    for engine, copier in ((resident, None), (streamed, COPIERS[name]())):
        if copier is not None:
            stream.copier = copier
        try:
            with torch.inference_mode():
                d = ModelDenoiser(engine.model, 2, 40)
                d.encode(prompts, None)
                d.start_canvas()
                before = stream.copies
                logits.append(engine.model.denoise(canvas, d.cache, d.ctx, experts_per_row=True))
        finally:
            stream.copier = Copier()
    assert torch.equal(logits[0], logits[1])
    assert stream.copies - before == len(stream.layers)  # each layer once, not again for the second row


def test_a_broken_copy_stream_gives_other_tokens_and_the_first_use_check_finds_it(resident_and_streamed, capsys):
    resident, streamed = resident_and_streamed
    stream = streamed.model.expert_streams[0]
    stream.copier = ForgetfulCopier()
    try:
        assert tokens(streamed) != tokens(resident)  # what the copiers above would catch
        capsys.readouterr()
        reason = stream.check(streamed.model)
        err = capsys.readouterr().err
        assert reason and "differ" in reason and err.count("\n") == 1 and err.startswith("dgemma: "), err
        assert type(stream.copier) is Copier  # falls back to copies that wait for their layer
        assert tokens(streamed) == tokens(resident)
        stream.copier = EarlyCopier()
        assert stream.check(streamed.model) is None and type(stream.copier) is EarlyCopier  # a sound one passes
    finally:
        stream.copier = Copier()


def test_the_bound_schedules_the_copies_as_the_stream_makes_them(resident_and_streamed):
    """placement/bounds.py's Timeline and placement/streaming.py copy the same layers in the same order (five streamed
    layers: an odd count, where s4 and s0 follow each other in buffer 0)."""
    from dgemma_cli.placement.bounds import Timeline
    from dgemma_cli.placement.plan import buffer_order

    assert buffer_order([0, 1, 3, 4, 5]) == ({0: 0, 1: 1, 3: 0, 4: 1, 5: 0}, {0: 3, 1: 4, 3: 5, 4: 1, 5: 0})
    assert buffer_order([2, 6, 7, 9])[1] == {2: 7, 6: 9, 7: 2, 9: 6}
    _, streamed = resident_and_streamed
    stream = streamed.model.expert_streams[0]
    order = []

    class Recording(EarlyCopier):
        def copy_later(self, pairs):
            order.append(next(i for i, h in stream.host.items() if h[next(iter(h))] is pairs[0][1]))
            return super().copy_later(pairs)

    stream.copier = Recording()
    lead = sum(h != f for h, f in zip(stream.holds, stream.first))  # s0 or s1 not in place: the first pass copies them
    try:
        tokens(streamed)
    finally:
        stream.copier = Copier()
    L = streamed.config.text.num_hidden_layers
    line = Timeline(1.0)
    for _ in range(3):
        line.run([1.0] * L, list(range(L)), stream.layers)
        line.join()
    n = len(stream.layers)
    order = order[lead:]
    assert len(order) > 2 * n and line.issued[2 : 2 + 2 * n] == order[: 2 * n]  # the Timeline's first two: s0, s1


def test_after_a_reset_the_next_pass_copies_its_first_layers_afresh(resident_and_streamed):
    """What a failed CUDA graph capture leaves (engine.GraphedDenoiser resets the stream): copies recorded, not run."""
    resident, streamed = resident_and_streamed
    stream = streamed.model.expert_streams[0]
    stream.copier = copier = LateCopier()
    try:
        tokens(streamed)
        for b, layer in enumerate(stream.first):  # the buffers hold garbage, as if their copies never ran
            for t in stream.buffers[b].values():
                t.zero_() if t.is_floating_point() else t.fill_(1)
        stream.reset()
        assert tokens(streamed) == tokens(resident) and stream.holds == stream.first and copier.ahead > 0
    finally:
        stream.copier = Copier()


def test_training_waits_for_each_copy_whatever_the_copier(resident_and_streamed):
    """With gradients on, a layer's experts are read again by the backward pass after its hooks ran: no copy is made
    ahead then, each waits for its layer."""
    resident, streamed = resident_and_streamed
    stream = streamed.model.expert_streams[0]
    stream.copier = copier = LateCopier()
    try:
        with torch.enable_grad():
            assert not stream.overlapping()
        with torch.no_grad():
            assert stream.overlapping()
        assert copier.ahead == 0
    finally:
        stream.copier = Copier()


# ----------------------------------------------------------------------------- layers split over several cards


def split_memory(path: Path, streamed: bool | None, batch: int = 1) -> int:
    """A --gpu-memory at which two cards of that size split `path`'s layers (streaming some if `streamed`, none if
    not, either if None), for `batch` rows."""
    from dgemma_cli.checkpoint.layout import stored_policy
    from dgemma_cli.checkpoint.weights import read_quant_format

    cfg = ModelConfig.from_dir(path)
    fmt = read_quant_format(path, cfg.raw) or "bf16"
    return card_size(cfg, fmt, lambda p: len(p.cards) == 2 and streamed in (None, any(c.streamed for c in p.cards)),
                     context=planned_context(cfg), cards=2, batch=batch,
                     policy=stored_policy(path) if fmt != "bf16" else None)


@pytest.mark.parametrize("fmt, streamed", [("bf16", False), ("nvfp4", False), ("nvfp4_short", True)])
def test_layers_split_over_two_cards_give_the_resident_runs_tokens(formats, fmt, streamed):
    path = formats[fmt]
    resident = load(path, device="cpu", dtype="float32")
    split = load(path, dtype="float32", devices="cpu,cpu", gpu_memory=split_memory(path, streamed))
    cards = split.model.placement.cards
    assert len(cards) == 2 and cards[0].layers and cards[1].layers
    L = split.config.text.num_hidden_layers
    assert split.model.layer_devices == [torch.device("cpu")] * L
    assert [s.layers for s in split.model.expert_streams] == [c.streamed for c in cards if c.streamed]
    assert bool(split.model.expert_streams) == streamed
    assert tokens(split) == tokens(resident)


def test_a_split_pass_moves_everything_a_layer_reads_onto_its_card(formats, monkeypatch):
    """The second card's layers on the meta device: any tensor a layer reads from the first card (the hidden state,
    RoPE tables, masks, layer scalars, the KV cache) that was not moved there makes the op fail, as it would on two
    GPUs. The hidden state's way back cannot be read from meta, so it comes back as zeros here."""
    from dgemma_cli.engine import ModelDenoiser
    from dgemma_cli.model import LayerSplit

    engine = load(formats["bf16"], device="cpu", dtype="bfloat16")  # meta's grouped matmul is the GPU's: bf16
    model = engine.model
    L = len(model.layers)
    meta, cpu = torch.device("meta"), torch.device("cpu")
    for i in range(L // 2, L):
        model.layers[i].to(meta)
    model.layer_devices = [cpu] * (L // 2) + [meta] * (L - L // 2)
    back = []

    def leave(self, x):
        back.append(x.device)
        self._switch(self.first)
        return torch.zeros(x.shape, dtype=x.dtype, device=self.first)

    monkeypatch.setattr(LayerSplit, "leave", leave)
    with torch.inference_mode():
        d = ModelDenoiser(model, 2, 40)
        assert d.cache.k[0].device == cpu and d.cache.k[L - 1].device == meta  # each layer's cache on its card
        d.encode(torch.tensor([PROMPTS[0][:4], PROMPTS[1]]), None)
        d.start_canvas()
        canvas = torch.randint(0, engine.config.text.vocab_size, (2, engine.config.canvas_length))
        logits = model.denoise(canvas, d.cache, d.ctx)
    assert back == [meta, meta] and logits.device == cpu and logits.shape[0] == 2


@pytest.mark.slow  # make test's time (CI runs it in make test-slow)
def test_a_server_on_a_split_answers_concurrent_requests_as_one_card_does(tmp_path):
    """`dgemma serve --devices cpu,cpu --gpu-memory SIZE` through a real socket: four requests at once, batched (each
    row's experts run apart on the CPU), answered as the demo answers them on one card."""
    from test_serve import ServerProcess

    from dgemma_cli.checkpoint.names import DEMO_MODEL

    from concurrent.futures import ThreadPoolExecutor

    words = ["hello diffusions", "abc def 12 ghijk", "the quick brown ", "lorem ipsum dolo"]
    size = f"{split_memory(DEMO_MODEL, None, batch=4) / 1e6:.6f}MB"
    answers = {}
    for name, args in (("one card", ()), ("split", ("--devices", "cpu,cpu", "--gpu-memory", size))):
        server = ServerProcess(tmp_path / name.replace(" ", "_"), *args, "--max-batch", "4")
        try:
            client = server.client()

            def ask(word):
                return client.completions.create(model="demo", prompt=f"upper: {word}", max_tokens=16,
                                                 seed=0).choices[0].text

            with ThreadPoolExecutor(4) as pool:
                answers[name] = list(pool.map(ask, words))
            assert server.health()["peak_batch"] > 1
            said = [line for line in server.lines if "layers split" in line]
            assert bool(said) == bool(args), server.lines  # the split said once, at the start
        finally:
            assert server.stop() == 0, "".join(server.lines)
    assert answers["split"] == answers["one card"] and answers["one card"][0].startswith("HELLO")


@pytest.mark.parametrize("devices, says", [("0,x", "takes auto or a list"), ("0,0", "named twice"),
                                           ("cpu,0", "not both"), ("3", "no cuda:3"),
                                           ("cpu,cpu --device cuda", "no CUDA device")])
def test_devices_refused_in_one_line(capsys, devices, says):
    devices, *more = devices.split()
    rc, out, err = run_cli(["run", "-q", "--devices", devices, *more, "upper: hello diffusions"], capsys)
    assert rc != 0 and out == "" and err.count("\n") == 1 and says in err, err


def test_run_on_a_split_answers_as_without(capsys):
    from dgemma_cli.checkpoint.names import DEMO_MODEL

    size = f"{split_memory(DEMO_MODEL, False) / 1e6:.6f}MB"
    rc, out, err = run_cli(["run", "--seed", "0", "-q", "--devices", "cpu,cpu", "--gpu-memory", size,
                            "upper: hello diffusions"], capsys)
    assert rc == 0 and out == "HELLO DIFFUSIONS\n", err
    rc, out, err = run_cli(["run", "--seed", "0", "--devices", "cpu,cpu", "--gpu-memory", size,
                            "upper: hello diffusions"], capsys)
    assert rc == 0 and "dgemma: layers split: 0-2 on cpu #0, 3 on cpu #1\n" in err, err
    rc, out, err = run_cli(["run", "-q", "--devices", "cpu,cpu", "upper: hello diffusions"], capsys)
    assert rc != 0 and err.count("\n") == 1 and "--gpu-memory" in err, err


@pytest.mark.gpu
def test_on_a_gpu_streamed_experts_are_pinned_host_memory_and_the_tokens_the_resident_runs():
    from dgemma_cli.checkpoint.names import DEMO_MODEL

    resident = load("demo", device="cuda")
    streamed = load("demo", device="cuda", gpu_memory=streaming_memory(DEMO_MODEL))
    stream = streamed.model.expert_streams[0]
    assert all(t.device.type == "cpu" and t.is_pinned() for h in stream.host.values() for t in h.values())
    assert all(t.device.type == "cuda" for b in stream.buffers for t in b.values())
    # copies on their own stream, and the first-use check (run by load) found them equal to copies that wait
    assert stream.copier.overlaps and stream.check(streamed.model) is None
    prompt = "upper: hello diffusions"
    done = streamed.generate(prompt, seed=0)
    assert done.token_ids == resident.generate(prompt, seed=0).token_ids
    assert done.stats.get("graph_replays", 0) > 0, done.stats  # the streamed step captured and replayed


# ----------------------------------------------------------------------------- the step's bound with streamed experts


def test_copies_hide_behind_compute_or_compute_behind_copies():
    from dgemma_cli.placement.bounds import Timeline

    def streamed_ms(start, layer_ms, layers, streamed, copy_ms, overlap=True):  # one step from the step's start
        line = Timeline(copy_ms, overlap)
        line.t = start
        line.run(layer_ms, layers, streamed)
        return line.t

    layers, ms = list(range(8)), [1.0] * 8
    assert streamed_ms(0.0, ms, layers, [], 5.0) == 8.0  # nothing streams: the layers' sum
    # cheap copies, spread: only the first waits for its copy (it starts with the step)
    assert streamed_ms(0.0, ms, layers, [2, 5], 0.5) == 8.0
    assert streamed_ms(0.0, ms, layers, [0, 4], 0.5) == 8.5
    # copies that wait for their layer add their whole time
    assert streamed_ms(0.0, ms, layers, [2, 5], 0.5, overlap=False) == 9.0
    # dear copies: the link sets the pace, and a buffer is reused only once the layer two before has run
    every = streamed_ms(0.0, ms, layers, layers, 3.0)
    assert every == pytest.approx(8 * 3.0 + 1.0)  # back-to-back copies, the last layer after the last copy
    assert streamed_ms(0.0, ms, layers, layers, 3.0, overlap=False) == 8 * 4.0


def test_the_bound_of_a_plan_from_tables():
    from dgemma_cli.placement.bounds import step_bounds

    p = plan(REAL, "nvfp4", [sized(card("RTX 4080"), 14 * GB)], policy="all")
    assert p.streamed
    L = len(p.cards[0].layers)
    tables = {"canvas": 256, "hidden": 2816,
              "cards": {"RTX 4080": {"nvfp4": {"1": {"pre_ms": 0.5, "layer_ms": [2.0] * L, "post_ms": 1.5}}}}}
    b = step_bounds(p, tables)
    copy = p.expert_bytes / (card("RTX 4080").copy_gb_per_s * 1e9) * 1e3
    assert b["resident_step_bound_ms"] == pytest.approx(0.5 + 2.0 * L + 1.5, abs=1e-3)
    assert b["serial_copy_step_bound_ms"] == pytest.approx(b["resident_step_bound_ms"] + len(p.streamed) * copy,
                                                           abs=1e-3)
    assert b["resident_step_bound_ms"] <= b["step_bound_ms"] <= b["serial_copy_step_bound_ms"]
    assert b["canvas_tokens_per_s"] == pytest.approx(256 / (12 * b["step_bound_ms"] / 1e3), rel=1e-3)
    missing = step_bounds(plan(REAL, "nvfp4", [card("RTX 4060")], policy="all"), tables)
    assert missing["step_bound_ms"] is None and "RTX 4060" in missing["bound_note"]


TABLED = ["RTX 3060 12GB", "RTX 4060", "RTX 4060 Ti 16GB", "RTX 4080", "RTX 5080", "RTX 3090", "RTX 4090", "RTX 5090"]


def test_the_shipped_step_tables_cover_the_cards():
    """dgemma_cli/placement/step_tables.json, as `make kernel-report` writes it: every listed card, NVFP4 (and INT8
    W8A8 on the RTX 3090), batch 1 and 4, a bound for each of the 30 layers, more for a larger batch."""
    from dgemma_cli.placement.bounds import load_tables

    tables = load_tables()
    assert tables is not None and tables["context"] == 8192
    for name in TABLED:
        fmts = ("nvfp4", "w8a8-int8") if name == "RTX 3090" else ("nvfp4",)
        for fmt in fmts:
            one, four = (tables["cards"][name][fmt][b] for b in ("1", "4"))
            assert len(one["layer_ms"]) == 30 and min(one["layer_ms"]) > 0 and one["post_ms"] > 0
            assert sum(four["layer_ms"]) > sum(one["layer_ms"])
    # a smaller card of the same architecture is slower layer by layer
    assert sum(tables["cards"]["RTX 4060"]["nvfp4"]["1"]["layer_ms"]) > \
        sum(tables["cards"]["RTX 4090"]["nvfp4"]["1"]["layer_ms"])


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("policy", ["all", "experts"])  # experts: NVIDIA's published release as it is
def test_on_16_gb_cards_the_copies_hide_behind_compute_or_compute_behind_copies(batch, policy):
    from dgemma_cli.placement.bounds import step_bounds

    for name in ("RTX 4060 Ti 16GB", "RTX 4080", "RTX 5080"):
        p = plan(REAL, "nvfp4", [card(name)], context=8192, batch=batch, policy=policy)
        assert p.streamed or policy == "all"  # the published release streams a few layers even at batch 1
        b = step_bounds(p)
        copies = p.streamed_bytes_per_step / (card(name).copy_gb_per_s * 1e9) * 1e3
        assert p.fits and b["step_bound_ms"] <= 1.25 * max(b["resident_step_bound_ms"], copies), (name, b)


def test_an_rtx_4060_denoises_a_canvas_in_under_ten_seconds():
    """At the checkpoint's typical ~12 steps a canvas (the seed figure): the bound of a 256-token canvas."""
    from dgemma_cli.placement.bounds import STEPS_PER_CANVAS, step_bounds

    p = plan(REAL, "nvfp4", [card("RTX 4060")], context=8192, batch=1, policy="all")
    assert p.fits and p.streamed
    assert STEPS_PER_CANVAS * step_bounds(p)["step_bound_ms"] < 10_000


def test_plan_json_carries_the_steps_bound(capsys):
    rc, out, err = run_cli(["plan", "--gpu", "RTX 4080", "--policy", "all", "--batch", "4", "--json"], capsys)
    d = json.loads(out)
    assert rc == 0 and d["step_bound_ms"] >= d["resident_step_bound_ms"] > 0 and d["canvas_tokens_per_s"] > 0
    rc, out, err = run_cli(["plan", "--gpu", "RTX 4080", "--json"], capsys)  # the published NVFP4: bf16 dense
    d = json.loads(out)
    assert d["policy"] == "experts" and d["streamed_layers"] and d["step_bound_ms"] > d["resident_step_bound_ms"] > 0
    rc, out, err = run_cli(["plan", "--gpu", "RTX 4080", "--quant", "int8", "--policy", "experts", "--json"], capsys)
    d = json.loads(out)
    assert rc == 0 and d["step_bound_ms"] is None and "int8 with policy experts" in d["bound_note"]


def test_info_and_plan_find_this_machines_card_through_nvidia_smi(tmp_path, monkeypatch, capsys):
    """Without torch: the driver's nvidia-smi names the card; none found, `dgemma plan` asks for --gpu in one line."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "NVIDIA GeForce RTX 4080, 16376"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    rc, out, err = run_cli(["plan", "--json"], capsys)
    d = json.loads(out)
    assert rc == 0 and d["devices"][0]["card"] == "RTX 4080" and d["devices"][0]["memory"] == 16376 * 2**20
    rc, out, err = run_cli(["info", "demo", "--json"], capsys)
    assert rc == 0 and json.loads(out)["placement"]["summary"].startswith("RTX 4080")
    code = ("import sys\nfrom dgemma_cli.cli import main\ntry:\n    main(['info', 'demo'])\nexcept SystemExit:\n"
            "    pass\nprint('torch' in sys.modules, file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "on this machine's card: RTX 4080" in p.stdout and p.stderr.strip().splitlines()[-1] == "False", p.stderr
    smi.unlink()
    rc, out, err = run_cli(["plan"], capsys)
    assert rc == 2 and "--gpu" in err and err.count("\n") == 1
    rc, out, err = run_cli(["info", "demo", "--json"], capsys)
    assert rc == 0 and json.loads(out)["placement"] is None


def test_tuning_with_streamed_experts_makes_the_resident_runs_adapter(tmp_path, capsys):
    """`dgemma tune --gpu-memory`: the streamed experts are copied in again when the backward pass recomputes their
    layer (gradient checkpointing), so the adapter, experts adapted too, is bit for bit the resident run's."""
    from test_tune import UPPER, adapter_tensors, tune_args, write_jsonl

    from dgemma_cli.checkpoint.names import DEMO_MODEL

    data = write_jsonl(tmp_path / "d.jsonl", UPPER)
    extra = ("--targets", "attention,mlp", "--expert-rank", "2")
    size = f"{streaming_memory(DEMO_MODEL) / 1e6:.6f}MB"
    assert run_main([*tune_args(data, tmp_path / "a"), *extra]) == 0
    assert run_main([*tune_args(data, tmp_path / "b"), *extra, "--gpu-memory", size]) == 0
    a, b = adapter_tensors(tmp_path / "a"), adapter_tensors(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    capsys.readouterr()
    rc = run_main([*tune_args(data, tmp_path / "c"), *extra, "--gpu-memory", size, "--no-gradient-checkpointing"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--no-gradient-checkpointing" in err


def test_streamed_layers_compute_on_weights_aligned_as_the_resident_ones():
    """The resident load views the mapped file, whose tensors start wherever its header put them; each streamed
    layer's copy sits in its buffer at the same offset modulo 64 bytes (checkpoint/weights.py ALIGN), its host copy
    too. A BLAS kernel's path, and so its bits, can depend on where its operands start (MKL's SSE4.2 kernels do), and
    so does grouped_linear's (torch's grouped matmul takes 16-byte-aligned operands only)."""
    from dgemma_cli.checkpoint.names import DEMO_MODEL

    ALIGN = 64
    resident = load("demo", device="cpu")
    streamed = load("demo", device="cpu", gpu_memory=streaming_memory(DEMO_MODEL, resident=0))
    stream = streamed.model.expert_streams[0]
    assert stream.layers == list(range(streamed.config.text.num_hidden_layers))
    offsets = set()
    for i in stream.layers:
        ours = dict(streamed.model.layers[i].experts.named_parameters())
        for name, t in resident.model.layers[i].experts.named_parameters():
            at = t.data_ptr() % ALIGN
            offsets.add(at)
            assert (ours[name].data_ptr() % ALIGN, stream.host[i][name].data_ptr() % ALIGN) == (at, at), (i, name)
    assert len(offsets) > 1  # the demo's experts start at several offsets (0 alone would check nothing)
    prompt = "upper: hello diffusions"
    assert streamed.generate(prompt, seed=0).token_ids == resident.generate(prompt, seed=0).token_ids


@pytest.mark.slow
def test_tuning_the_default_targets_with_every_layer_streamed_makes_the_resident_runs_adapter(tmp_path):
    """No adapter on the experts: they compute on their weights as stored (not on a fold, a new tensor), and the
    adapter is bit for bit the resident run's all the same, also with MKL's SSE4.2 kernels, whose sums depend on
    their operands' alignment (in a process of its own: MKL reads MKL_ENABLE_INSTRUCTIONS once). With the streamed
    copies at offsets of their own every tensor differed there, by an ulp or so."""
    from test_tune import UPPER, adapter_tensors, tune_args, write_jsonl

    from dgemma_cli.checkpoint.names import DEMO_MODEL

    data = write_jsonl(tmp_path / "d.jsonl", UPPER)
    size = f"{streaming_memory(DEMO_MODEL, resident=0) / 1e6:.6f}MB"
    runs = [tune_args(data, tmp_path / "a", "--seed", "3"),
            tune_args(data, tmp_path / "b", "--seed", "3", "--gpu-memory", size)]
    code = (f"from dgemma_cli.cli import main\nfor args in {runs!r}:\n    try:\n        main(args)\n"
            "    except SystemExit as e:\n        assert not e.code, e\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"})
    assert p.returncode == 0, p.stderr
    a, b = adapter_tensors(tmp_path / "a"), adapter_tensors(tmp_path / "b")
    assert len(a) == 108 and a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.gpu
def test_on_two_gpus_a_split_gives_the_resident_runs_tokens():
    """Two real cards: the layers split (each card's share on it, with its own streamed layers), the tokens of one
    card holding everything."""
    from dgemma_cli.checkpoint.names import DEMO_MODEL

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    resident = load("demo", device="cuda:0")
    split = load("demo", devices="0,1", gpu_memory=split_memory(DEMO_MODEL, False))
    assert {d.index for d in split.model.layer_devices} == {0, 1}
    assert split.model.layers[-1].experts.gate_up_proj.device.index == 1
    prompt = "upper: hello diffusions"
    assert split.generate(prompt, seed=0).token_ids == resident.generate(prompt, seed=0).token_ids
