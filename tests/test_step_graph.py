"""The sampler's whole step as one CUDA graph (sampler.whole_step, engine.GraphedDenoiser.run_step), on the CPU.

A CUDA graph replays the kernels a step launched when it was captured, with the arguments they had then: a step
may read no value the host hands it afresh each time (its index, its temperature, a Python number), only tensors
that keep their addresses. `Replaying` stands in for the graph: it records the aten ops of the second step of a
canvas (each with the arguments it was called with) and, for the steps after it, runs that record again instead of
the step, on the same state tensors, drawing random numbers from the same generator. Were any input of a step not
on the device, the replayed steps would repeat the recorded step's value and the events would differ from the
steps run as they are.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from dgemma_cli.config import GenerationSettings
from dgemma_cli.sampler import (CanvasDone, CanvasState, Done, Step, _stable, generate_events, step_temperature,
                                step_temperatures)

V, C, D = 40, 12, 6


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class Toy:
    """A denoiser with no host round trip: logits from each position's bias, the canvas's tokens and, when
    self-conditioned, the previous step's probabilities (sharp enough that canvases converge in a few steps)."""

    vocab_size, canvas_length, hidden_size, dtype = V, C, D, torch.float32

    def __init__(self, batch: int):
        g = torch.Generator().manual_seed(3)
        self.bias = torch.randn(C, V, generator=g) * 2  # one token well ahead at each position
        self.bias[torch.arange(C), torch.randint(0, V, (C,), generator=g)] += 10
        self.emb = torch.randn(V, D, generator=g)
        self.out = torch.randn(D, V, generator=g) * 0.3
        self.sc = torch.randn(V, V, generator=g) * 0.05
        self.batch, self.replays = batch, 0

    def encode(self, ids, valid):
        pass

    def start_canvas(self):
        pass

    def denoise(self, canvas, buf, self_conditioned):
        logits = (self.emb[canvas] @ self.out + self.bias).view(-1, V)
        if self_conditioned:
            logits = logits + buf.probs @ self.sc
        buf.logits.copy_(logits)


class Replaying(Toy):
    """Toy whose steps after a canvas's second replay the second's recorded ops (a CUDA graph's replay)."""

    def start_canvas(self):
        self.graph = None

    def run_step(self, step, graphable):
        if not graphable:
            return step()
        if self.graph is None:
            with _Recorder() as rec:
                step()
            self.graph = rec.ops
            return
        made = {}  # tensors the recorded step made -> the replay's

        def swap(x):
            return made.get(id(x), x) if isinstance(x, torch.Tensor) else x

        for func, args, kwargs, out in self.graph:
            new = func(*tree_map(swap, args), **tree_map(swap, kwargs))
            for o, n in zip(*(x if isinstance(x, (tuple, list)) else (x,) for x in (out, new))):
                if isinstance(o, torch.Tensor):
                    made[id(o)] = n
        self.replays += 1


def events(denoiser, prompt, settings, **kw):
    torch.manual_seed(11)
    return list(generate_events(denoiser, prompt, settings, **kw))


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, Step):
        return (a.canvas_index, a.step) == (b.canvas_index, b.step) and all(
            torch.equal(getattr(a, f), getattr(b, f)) for f in ("canvas", "argmax", "accepted", "entropy", "finished"))
    if isinstance(a, CanvasDone):
        return torch.equal(a.tokens, b.tokens) and (a.steps, a.kept) == (b.steps, b.kept)
    return (a.token_ids, a.steps_per_canvas, a.forward_passes) == (b.token_ids, b.steps_per_canvas, b.forward_passes)


@pytest.mark.parametrize("lagged", [False, True])
@pytest.mark.parametrize("threshold", [1, 2])
def test_a_replayed_whole_step_gives_the_steps_run_as_they_are(lagged, threshold):
    settings = GenerationSettings(max_new_tokens=3 * C, max_denoising_steps=10, stability_threshold=threshold,
                                  confidence_threshold=0.05, eos_token_ids=(V + 1,), pad_token_id=0)
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(0))
    eager = events(Toy(2), prompt, settings, lagged_stop=lagged)
    graphed_denoiser = Replaying(2)
    graphed = events(graphed_denoiser, prompt, settings, lagged_stop=lagged)
    assert graphed_denoiser.replays > 0
    assert len(eager) == len(graphed) and all(same(a, b) for a, b in zip(eager, graphed))
    steps = [e for e in eager if isinstance(e, Step)]
    # the canvases stopped early, each after more than two steps (so that some steps were replays), and every Step
    # keeps its own tensors after the generation (each canvas's steps have their own records)
    assert sum(isinstance(e, CanvasDone) for e in eager) == 3
    assert 2 < max(max(s) for s in eager[-1].steps_per_canvas) < settings.max_denoising_steps
    assert len({s.canvas.data_ptr() for s in steps}) == len(steps)
    assert isinstance(eager[-1], Done)


def test_held_tokens_in_a_replayed_step():
    settings = GenerationSettings(max_new_tokens=C, max_denoising_steps=10, confidence_threshold=0.05,
                                  eos_token_ids=(V + 1,), pad_token_id=0)
    prompt = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(1))
    held = torch.tensor([[5, 6, 7]])
    eager = events(Toy(1), prompt, settings, held=held, lagged_stop=True)
    graphed = events(Replaying(1), prompt, settings, held=held, lagged_stop=True)
    assert all(same(a, b) for a, b in zip(eager, graphed)) and len(eager) == len(graphed)
    assert all(s.canvas[0, -3:].tolist() == [5, 6, 7] for s in eager if isinstance(s, Step))


def test_the_temperatures_made_at_once_are_each_steps_own():
    s = GenerationSettings(max_denoising_steps=37, t_min=0.3, t_max=0.9)
    made = step_temperatures(s, "cpu")
    assert made.dtype == torch.float32 and made.shape == (37,)
    for k in range(37):
        assert torch.equal(made[k], step_temperature(37 - k, s, "cpu")), k


@pytest.mark.parametrize("threshold", [0, 1, 2, 3])
def test_the_stability_test_on_the_device_is_the_lists(threshold):
    """CanvasState.stable (a ring of the last T argmax canvases, -1 until written) against `_stable` (a list)."""
    settings = GenerationSettings(stability_threshold=threshold)
    gen = torch.Generator().manual_seed(threshold)
    canvas = torch.zeros(3, 4, dtype=torch.long)
    state = CanvasState(canvas, torch.zeros(3, dtype=torch.bool), settings, step_temperatures(settings, "cpu"))
    history, seen = [], []
    argmax = torch.randint(0, 3, (3, 4), generator=gen)
    for _ in range(12):  # rows that change now and then, and rows that stay put
        argmax = torch.where(torch.rand(3, 1, generator=gen) < 0.4, torch.randint(0, 3, (3, 4), generator=gen),
                             argmax)
        want = _stable(history, argmax.clone(), threshold)
        got = state.stable(argmax.clone())
        assert torch.equal(got, want)
        seen.append(want)
    assert threshold == 0 or any(bool(w.any()) for w in seen) and not all(bool(w.all()) for w in seen)


@pytest.mark.gpu
@pytest.mark.parametrize("sampler", ["auto", "torch"])
def test_the_whole_step_graph_on_a_gpu_gives_the_eager_steps(monkeypatch, sampler):
    """CUDA: a generation whose steps after the first replay one graph of the whole step (its random draws inside it)
    against the same generation run eagerly (DGEMMA_EAGER's denoiser): the same events, bit for bit, with the fused
    head's sampler (auto) and the torch path's."""
    from dgemma_cli import engine as engine_mod
    from dgemma_cli.bench import TINY, random_model
    from dgemma_cli.config import ModelConfig

    monkeypatch.setenv("DGEMMA_SAMPLER", sampler)
    cfg = ModelConfig.from_dict(TINY)
    model = random_model(cfg, "bf16", "experts", torch.device("cuda"), torch.bfloat16)
    runs = []
    for make in (engine_mod.ModelDenoiser, engine_mod.GraphedDenoiser):
        monkeypatch.setattr(engine_mod, "make_denoiser", make)
        engine = engine_mod.Engine(model, None, GenerationSettings(eos_token_ids=(-1,), confidence_threshold=0.05))
        runs.append(list(engine.events([[5, 6, 7], [8, 9, 10, 11]], seed=0, max_new_tokens=2 * cfg.canvas_length,
                                       max_denoising_steps=8)))
    eager, graphed = runs
    assert graphed[-1].stats["graph_replays"] > 0 and graphed[-1].stats["graph_fallback"] is None
    assert len(eager) == len(graphed) and all(same(a, b) for a, b in zip(eager[:-1], graphed[:-1]))
    assert same(eager[-1], graphed[-1])
