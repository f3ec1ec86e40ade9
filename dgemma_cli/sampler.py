"""The block-diffusion loop (docs/design.md, The sampler) as a generator of typed events.

The sampler knows nothing about tokens as text, terminals or checkpoints: it drives a `Denoiser` (encode a chunk
into the cache, denoise a canvas) and yields `Step`, `CanvasDone` and `Done` events. The view, chat and JSON output
consume these events; none of them reaches into the loop.

Random numbers are drawn from torch's global generator in exactly the reference's order and shapes (canvas
init, one multinomial per step, one renoise draw per step), so a run after `torch.manual_seed(S)` reproduces
the reference's tokens on the same device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch

from .config import GenerationSettings


class Denoiser(Protocol):
    """What the sampler needs from a model; `engine.ModelDenoiser` implements it over `model.DiffusionGemma`."""

    vocab_size: int
    canvas_length: int
    hidden_size: int
    dtype: torch.dtype

    def encode(self, ids: torch.Tensor, valid: torch.Tensor | None) -> None: ...

    def start_canvas(self) -> None: ...

    def denoise(self, canvas: torch.Tensor, buf: SamplerBuffers, self_conditioned: bool) -> None:
        """One forward pass over canvas [B, C] that leaves its results in `buf`: the torch path's float32 soft-capped
        logits [B*C, V] in buf.logits, self-conditioned on buf.probs (the previous step's softmax); the fused head's
        draws in buf.fused, self-conditioned on buf.fused.soft (the previous step's soft embedding). The first step
        of a canvas is not self-conditioned."""

    # Optional: `run_step(step, graphable)` runs `step()`, one whole step (`whole_step`), and may replay it as a CUDA
    # graph when `graphable` (engine.GraphedDenoiser); a denoiser without it has its steps run as they are.


@dataclass
class Step:
    """One denoising step of one canvas. Tensors are [B, C] on the model's device, views of the step's own slot in
    its canvas's records (`CanvasState`: no later step writes them); do not modify them."""

    canvas_index: int
    step: int  # 1-based count of steps taken on this canvas
    max_steps: int
    canvas: torch.Tensor  # the noisy canvas fed to the next step (accepted tokens + fresh noise)
    argmax: torch.Tensor  # the model's current best guess for every position
    accepted: torch.Tensor  # bool: positions accepted this step
    entropy: torch.Tensor  # float32 per-position entropy of the temperature-scaled distribution
    finished: torch.Tensor  # bool [B]: rows whose canvas has converged (adaptive stop)


@dataclass
class CanvasDone:
    canvas_index: int
    tokens: torch.Tensor  # [B, C] the kept (argmax) canvas, pad after the first end-of-sequence token
    steps: list[int]  # per row: forward passes this canvas took before the row stopped
    finished: torch.Tensor  # bool [B]: rows that have ended (end-of-sequence seen or length reached)
    kept: list[int] = field(default_factory=list)  # per row: tokens of this canvas the answer keeps (neither pad nor
    # the end-of-sequence id, within max_new_tokens), what `tokens_per_forward` counts


@dataclass
class Done:
    token_ids: list[list[int]]  # per row: generated ids, ending before the first end-of-sequence id
    steps_per_canvas: list[list[int]]  # per row
    tokens_per_forward: list[float]  # per row: the answer's tokens (no pad, no end id) / decoder forward passes
    seconds: float
    forward_passes: int = 0  # batched decoder calls
    stats: dict = field(default_factory=dict)
    satisfied: list[bool] | None = None  # per row, with constraints: the answer is a whole word of its language


Event = Step | CanvasDone | Done


def tokens_per_forward(kept: int, forwards: int) -> float:
    """The one definition of tokens per forward pass, for Done, the view, progress lines and --json: tokens the answer
    keeps (generated ids within max_new_tokens that are neither pad nor the end-of-sequence id ending the answer;
    `CanvasDone.kept` summed) over the decoder forward passes its row took (`CanvasDone.steps` summed). 0 before
    the first forward pass. (transformers' reference counts the end id too: its figure is 1/forwards higher for an
    answer that ended.)"""
    return kept / forwards if forwards else 0.0


class SamplerBuffers:
    """What a step's sampling needs, allocated once per generation (or per server batch) for `rows` rows.

    The torch path (the reference's ops and random draws; the CPU, and CUDA with DGEMMA_SAMPLER=torch), three
    canvas x vocab float32 buffers:
    logits: the model's output, then the processed (temperature-scaled) logits, then scratch for the entropy.
    probs:  softmax of the processed logits: the sampling distribution, and the next step's self-conditioning.
    noise:  the exponential race that draws the sample, then scratch.
    The fused head (`head` = (hidden, dtype); Triton on CUDA, quant/kernels/head.py): no canvas x vocab float32
    buffer. The forward pass ends in the head, which writes the step's draws, argmax, entropy and the next step's
    soft embedding into `fused` (HeadBuffers); it reads the step's temperature [rows] and two uniforms per row
    [rows, 2] from here, written in place by `prepare_step` before the forward (so a captured graph sees them).
    """

    def __init__(self, rows: int, vocab: int, device, head: tuple[int, torch.dtype] | None = None):
        self.vocab, self.fused = vocab, None
        self.logits = self.probs = self.noise = self.temperature = self.uniforms = None
        if head is None:
            self.logits = torch.empty(rows, vocab, dtype=torch.float32, device=device)
            self.probs = torch.empty_like(self.logits)
            self.noise = torch.empty_like(self.logits)
        else:
            from quant.kernels.head import HeadBuffers

            hidden, dtype = head
            self.fused = HeadBuffers(rows, vocab, hidden, dtype, device)
            self.temperature = torch.empty(rows, dtype=torch.float32, device=device)
            self.uniforms = torch.empty(rows, 2, dtype=torch.float32, device=device)

    def first(self, rows: int) -> SamplerBuffers:
        """The first `rows` rows of every buffer (views: no copy), for a batch that uses only part of them."""
        return self.span(0, rows)

    def span(self, lo: int, n: int) -> SamplerBuffers:
        """Rows [lo, lo + n) of every buffer (views: no copy): a range of a server batch's rows (one request's
        canvas, when a step runs that request alone)."""
        view = object.__new__(SamplerBuffers)
        for k, v in self.__dict__.items():
            setattr(view, k, v[lo : lo + n] if isinstance(v, torch.Tensor) else v)
        view.fused = None if self.fused is None else self.fused.span(lo, n)
        return view

    @property
    def nbytes(self) -> int:
        tensors = [v for v in self.__dict__.values() if isinstance(v, torch.Tensor)]
        return sum(t.untyped_storage().nbytes() for t in tensors) + (self.fused.nbytes if self.fused else 0)

    def move_rows(self, src: int, dst: int, n: int) -> None:
        """Copy rows [src, src + n) over rows [dst, dst + n): what the next step's self-conditioning reads."""
        if self.fused is None:
            self.probs[dst : dst + n].copy_(self.probs[src : src + n])
        else:
            self.fused.soft[dst : dst + n].copy_(self.fused.soft[src : src + n])

    def swap_rows(self, a: int, b: int, n: int, chunk: int = 16) -> None:
        """Exchange rows [a, a + n) and [b, b + n) of what the next step's self-conditioning reads, `chunk` rows at a
        time (a temporary of chunk x vocab, not of a canvas)."""
        held = self.probs if self.fused is None else self.fused.soft
        for k in range(0, n, chunk):
            m = min(chunk, n - k)
            tmp = held[a + k : a + k + m].clone()
            held[a + k : a + k + m].copy_(held[b + k : b + k + m])
            held[b + k : b + k + m].copy_(tmp)


def prepare_step(buf: SamplerBuffers, temperature: torch.Tensor, generators: list[torch.Generator] | None = None):
    """Before a step's forward pass, for the fused head: its temperature (0-dim, or one per row [N] / [N, 1]) and two
    uniforms per row, written in place into buf (N rows). generators as `sample_step` takes them: one per block of
    N / len(generators) consecutive rows, each block drawing its uniforms from its own (what it draws alone).
    Nothing to do for the torch path, which samples after the forward."""
    if buf.fused is None:
        return
    N = buf.temperature.shape[0]
    buf.temperature.copy_(temperature.reshape(-1).expand(N) if temperature.numel() == 1 else temperature.reshape(N))
    if generators is None:
        buf.uniforms.uniform_()
        return
    if N % len(generators):
        raise ValueError(f"{N} rows do not split into {len(generators)} equal blocks")
    R = N // len(generators)
    for b, g in enumerate(generators):
        buf.uniforms[b * R : (b + 1) * R].uniform_(generator=g)


def sample_step(buf: SamplerBuffers, temperature: torch.Tensor, generators: list[torch.Generator] | None = None,
                copy_entropy: bool = True):
    """Temperature, sample, argmax and entropy from the logits in `buf.logits` [N, V]; returns [N] tensors. With the
    fused head, the draws its forward pass made (`prepare_step`, `Denoiser.denoise`).

    Every value equals the reference's bit for bit and the random draws are the same, in the same order:
    `torch.multinomial(probs, 1)` is `argmax(probs / q)` with q ~ Exp(1) drawn over the whole [N, V] (spelled
    out here to reuse a buffer), and the entropy is computed as a Categorical distribution computes it.

    temperature: float32, 0-dim (every row) or [N, 1] (per row). generators (None: torch's global generator): one per
    block of N / len(generators) consecutive rows (a request's canvas), each block drawing from its own, so a block's
    draws are those it would get alone after seeding torch with its generator's seed, whatever else is in the batch.
    copy_entropy False: the fused head's entropy as it lies in its buffer (the next step overwrites it), for a caller
    that copies it anyway.
    """
    if buf.fused is not None:  # the forward's head drew them (prepare_step gave it the temperature and uniforms)
        entropy = buf.fused.entropy
        return buf.fused.sample, buf.fused.argmax, entropy.clone() if copy_entropy else entropy
    N = buf.logits.shape[0]
    if generators is not None and N % len(generators):
        raise ValueError(f"{N} rows do not split into {len(generators)} equal blocks")
    logits, probs, scratch = buf.logits, buf.probs, buf.noise
    logits.div_(temperature)  # processed logits
    torch.ops.aten._softmax.out(logits, -1, False, out=probs)  # = torch.softmax(logits, -1)
    if generators is None:
        scratch.exponential_()
    else:
        R = N // len(generators)
        for b, g in enumerate(generators):
            scratch[b * R : (b + 1) * R].exponential_(generator=g)
    torch.div(probs, scratch, out=scratch)
    sample = scratch.argmax(dim=-1)
    argmax = logits.argmax(dim=-1)
    # entropy: normalise by logsumexp (max, exp, sum, log as torch.logsumexp does), softmax, -sum(p log p)
    peak = logits.amax(dim=-1, keepdim=True)
    peak.masked_fill_(peak.abs() == float("inf"), 0)
    torch.sub(logits, peak, out=scratch)
    lse = scratch.exp_().sum(dim=-1, keepdim=True).log_().add_(peak)
    logits.sub_(lse)
    torch.ops.aten._softmax.out(logits, -1, False, out=scratch)
    # p log p into the scratch buffer: the log-probabilities stay in buf.logits for a constrained row's search
    entropy = -torch.mul(logits.clamp_(min=torch.finfo(logits.dtype).min), scratch, out=scratch).sum(dim=-1)
    return sample, argmax, entropy


def use_fused_head(device: torch.device, dtype: torch.dtype, family: str | None = "head") -> bool:
    """The fused head (quant/kernels/head.py) runs where DGEMMA_KERNELS selects Triton on a CUDA device, the model
    is 16-bit and its kernel family (`family`: the model's `head_family`, "head_gguf" where the embedding is GGUF
    blocks, None where no fused head reads it) passed its check. Not on the CPU, even under the interpreter: there the torch path keeps the reference's random draws,
    so tokens stay comparable. DGEMMA_SAMPLER=torch keeps the torch path on CUDA too (the reference's draws: runs
    then compare token for token); auto (the default) decides as above."""
    import os

    choice = os.environ.get("DGEMMA_SAMPLER", "auto").strip().lower() or "auto"
    if choice not in ("auto", "torch"):
        raise ValueError(f"DGEMMA_SAMPLER must be auto or torch (got {choice!r})")
    if choice == "torch" or family is None or device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    from quant.kernels import use_triton
    from quant.kernels.probe import family_ok

    return use_triton(device) and family_ok(family, device, dtype)


def new_buffers(rows: int, denoiser: Denoiser, device: torch.device, logits: bool = False) -> SamplerBuffers:
    """The buffers for `rows` rows of `denoiser`'s model: the fused head's where it runs, else the torch path's
    (always with `logits`: constrained canvases search the step's log-probabilities)."""
    logits = logits or not getattr(denoiser, "plain_head", True)  # an adapter's head rows: the torch path's logits
    head = (denoiser.hidden_size, denoiser.dtype) if not logits and use_fused_head(
        device, denoiser.dtype, getattr(denoiser, "head_family", "head")) else None
    return SamplerBuffers(rows, denoiser.vocab_size, device, head)


def held_tables(constraints: list, canvas: int, tile: int, device) -> tuple[list[int], torch.Tensor, torch.Tensor, int]:
    """What the fused head's class pass reads of rows held to structures (quant/kernels/head.py `HeldRows`), for
    canvases of `canvas` rows each held to constraints[b] (None: a free canvas): each row's slot (-1: free), the held
    canvases' tile tables stacked by slot (order, run), and the widest class count among them."""
    slot, tables = [], []
    for rc in constraints:
        slot += [len(tables) if rc is not None else -1] * canvas
        if rc is not None:
            tables.append(rc.tile_runs(device, canvas, tile))
    width = max(rc.classes for rc in constraints if rc is not None)
    return slot, torch.stack([t[0] for t in tables]), torch.stack([t[1] for t in tables]), width


def hold_rows(buf: SamplerBuffers, constraints: list, canvas: int) -> None:
    """The fused head runs the class pass of the rows held to structures (`held_tables`); the keys start at
    KEY_MIN."""
    from quant.kernels.class_pass import KEY_MIN
    from quant.kernels.head import HeldRows

    dev, rows = buf.fused.soft.device, buf.fused.rows
    slot, order, run, width = held_tables(constraints, canvas, buf.fused.tile, dev)
    slot += [-1] * (rows - len(slot))
    buf.fused.held = HeldRows(torch.tensor(slot, dtype=torch.int32, device=dev), order, run,
                              torch.full((2, rows, width), KEY_MIN, dtype=torch.int64, device=dev))


def held_in_head(buf: SamplerBuffers) -> bool:
    """Whether the fused head makes the held rows' class keys this step (`hold_rows`)."""
    return buf.fused is not None and buf.fused.held is not None


def step_temperature(n: int, settings: GenerationSettings, device) -> torch.Tensor:
    """The temperature of the step with n steps left (N .. 1): it falls linearly from t_max to t_min; a float32
    0-dim tensor, computed as the reference does. n is filled in on the device (a kernel with n as its argument):
    `torch.tensor(n, device=cuda)` would copy it from pageable host memory, and torch waits for the stream to drain
    after such a copy, which would make every step wait for the one queued before it."""
    return _temperature_left(torch.full((), n, dtype=torch.int32, device=device), settings)


def _temperature_left(left: torch.Tensor, settings: GenerationSettings) -> torch.Tensor:
    """The reference's schedule for int32 steps left (any shape): float32 t_min + (t_max - t_min) * left / N."""
    return settings.t_min + (settings.t_max - settings.t_min) * (left / settings.max_denoising_steps)


def entropy_bound_accept(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """Accept the lowest-entropy positions while sum(entropy) - max(entropy) <= bound (at least one per row)."""
    sorted_h, order = torch.sort(entropy, dim=-1, descending=False)
    keep = torch.cumsum(sorted_h, dim=-1) - sorted_h <= bound
    return torch.scatter(torch.zeros_like(keep), dim=-1, index=order, src=keep)


def step_temperatures(settings: GenerationSettings, device) -> torch.Tensor:
    """[N] float32: the temperature of step k = 0 .. N - 1 (n = N - k steps left), each `step_temperature(n)`'s value,
    made once per generation so that a step reads its own from the device (`CanvasState.index`)."""
    return _temperature_left(torch.arange(settings.max_denoising_steps, 0, -1, dtype=torch.int32, device=device),
                             settings)


class CanvasState:
    """What one canvas's steps carry from each to the next, in tensors that keep their addresses for the canvas, so
    that one CUDA graph of a whole step (`whole_step`, engine.GraphedDenoiser.run_step) reads and writes them in
    place; and every step's results, one slot per step, which its `Step` event views (a step writes slot `index`,
    which it advances itself: the host never tells the device which step it is).

    canvas [B, C] (the canvas fed to the next step), argmax [B, C], done [B] (rows converged), all_done (0-dim: the
    stop test), finished [B] (rows that ended in an earlier canvas), idle [B] (steps a row sat out), index [1] (the
    step running, 0-based), temperature [1] (its temperature, from `step_temperatures`), history [T, B, C] (the last
    T = stability_threshold argmax canvases, -1 until a step writes one: no row is stable before T steps, as
    `_stable` requires) with `slot` [1] where the next goes. Per step k: canvases, argmaxes, accepted, entropies
    [N, B, C] and finished_at [N, B], what `Step` k + 1 holds.
    """

    def __init__(self, canvas: torch.Tensor, finished: torch.Tensor, settings: GenerationSettings,
                 temperatures: torch.Tensor):
        B, C = canvas.shape
        dev, N, T = canvas.device, settings.max_denoising_steps, settings.stability_threshold
        self.canvas, self.argmax, self.finished = canvas, canvas.clone(), finished.clone()
        self.done = torch.zeros(B, dtype=torch.bool, device=dev)
        self.all_done = torch.zeros((), dtype=torch.bool, device=dev)
        self.idle = torch.zeros(B, dtype=torch.int64, device=dev)
        self.index = torch.zeros(1, dtype=torch.int64, device=dev)
        self.temperatures = temperatures
        self.temperature = torch.empty(1, dtype=torch.float32, device=dev)
        self.history = torch.full((T, B, C), -1, dtype=canvas.dtype, device=dev)
        self.slot = torch.zeros(1, dtype=torch.int64, device=dev)
        self.canvases = torch.empty(N, B, C, dtype=canvas.dtype, device=dev)
        self.argmaxes = torch.empty_like(self.canvases)
        self.accepted = torch.empty(N, B, C, dtype=torch.bool, device=dev)
        self.entropies = torch.empty(N, B, C, dtype=torch.float32, device=dev)
        self.finished_at = torch.empty(N, B, dtype=torch.bool, device=dev)

    def stable(self, argmax: torch.Tensor) -> torch.Tensor:
        """[B] bool: rows whose argmax canvas equals each of the last T; then records it (`_stable`, on the device)."""
        T = self.history.shape[0]
        same = (self.history == argmax).all(dim=-1)  # [T, B]; T = 0: every row stable
        stable = same[0] if T == 1 else same.all(dim=0)
        if T == 1:
            self.history[0].copy_(argmax)
        elif T > 1:  # a ring: the test compares with every entry, in any order
            self.history.index_copy_(0, self.slot, argmax[None])
            self.slot.add_(1).remainder_(T)
        return stable

    def record(self, accepted: torch.Tensor, entropy: torch.Tensor) -> None:
        """This step's results into its slot; the next step's index."""
        k = self.index
        self.canvases.index_copy_(0, k, self.canvas[None])
        self.argmaxes.index_copy_(0, k, self.argmax[None])
        self.accepted.index_copy_(0, k, accepted[None])
        self.entropies.index_copy_(0, k, entropy[None])
        self.finished_at.index_copy_(0, k, self.done[None])
        k.add_(1)

    def step_event(self, canvas_index: int, k: int, N: int) -> Step:
        """Step k + 1's event: views of its slot (no copy; a later step writes other slots)."""
        return Step(canvas_index, k + 1, N, self.canvases[k], self.argmaxes[k], self.accepted[k], self.entropies[k],
                    self.finished_at[k])


def whole_step(denoiser: Denoiser, state: CanvasState, buf: SamplerBuffers, settings: GenerationSettings,
               self_conditioned: bool, held: torch.Tensor | None = None, constraints: list | None = None) -> None:
    """One step of the canvas in `state`, in place: count the rows that sit it out, take the step's temperature, its
    random draws (`prepare_step`), the forward pass (`Denoiser.denoise`), then `settle_step`. Without constraints it
    reads no host value and writes none, so a CUDA graph holds it whole (engine.GraphedDenoiser.run_step)."""
    state.idle += state.done | state.finished
    torch.index_select(state.temperatures, 0, state.index, out=state.temperature)
    prepare_step(buf, state.temperature)
    denoiser.denoise(state.canvas, buf, self_conditioned)
    settle_step(buf, state, settings, held, constraints)


def settle_step(buf: SamplerBuffers, state: CanvasState, settings: GenerationSettings,
                held: torch.Tensor | None = None, constraints: list | None = None) -> None:
    """What a step does after its forward pass wrote `buf` (the torch path's logits [B*C, V], or the fused head's
    draws): sample at the step's temperature, accept the lowest-entropy positions, renoise the rest, test each row
    for convergence, and record the step (`CanvasState.record`), all in `state`, in place. No host round trip.

    held [B, h] and constraints as in `generate_events`.
    """
    canvas, argmax, done = state.canvas, state.argmax, state.done
    B, C = canvas.shape
    dev, V = canvas.device, buf.vocab
    free = C - (0 if held is None else held.shape[1])
    sample, new_argmax, entropy = (t.view(B, C) for t in sample_step(buf, state.temperature, copy_entropy=False))
    if settings.greedy:
        sample = new_argmax.clone()
    if held is not None:  # held tokens: certain by definition
        entropy[:, free:] = 0
        sample[:, free:] = held
        new_argmax[:, free:] = held
    if constraints is not None and held_in_head(buf):  # the head made the held rows' class keys: the programme
        keys = buf.fused.held.keys
        for b, rc in enumerate(constraints):
            if rc is not None:
                rc.step_keys(keys[:, b * C : (b + 1) * C], sample[b], new_argmax[b], settings.greedy)
    elif constraints is not None:  # the rows' best paths through their automata replace the draws and the argmax
        logp = buf.logits.view(B, C, V)  # sample_step leaves the log-probabilities there (the torch path)
        for b, rc in enumerate(constraints):
            if rc is not None:
                rc.step(logp[b], sample[b], new_argmax[b], settings.greedy, drawn=True)
    accepted = entropy_bound_accept(entropy, settings.entropy_bound)
    noise = torch.randint(0, V, (B, C), device=dev)
    # Accepted positions take the draw, the rest fresh noise. Rows that already converged keep their canvas and
    # argmax (a select, not a test: no host round trip). Their self-conditioning and entropy keep changing, which
    # only affects their own discarded outputs: rows never mix.
    torch.where(done[:, None], canvas, torch.where(accepted, sample, noise), out=canvas)
    torch.where(done[:, None], argmax, new_argmax, out=argmax)
    stable = state.stable(argmax)
    confident = entropy[:, :free].mean(dim=-1) < settings.confidence_threshold
    torch.logical_or(done, stable & confident, out=done)
    torch.all(done, out=state.all_done)
    state.record(accepted, entropy)


class LaggedStop:
    """The canvas's stop test (every row converged: `done.all()`) read one step late, so that the host never waits
    for the step it has just queued. Each step's verdict is copied to host memory (pinned, on CUDA, behind an
    event); the host queues the next step, then waits for the previous step's event only, which the GPU has then
    usually passed: the GPU always has the next step queued, and no step waits on a device-to-host round trip.

    The cost: when the verdict says stop, the step queued after it was not needed. It changes nothing: converged
    rows keep their canvas and argmax (settle_step), take no step in the counts (`idle`), and the caller restores
    the random generator's state from before it (`rng_state`), so the next canvas draws what it would have."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        host = device if device.type == "meta" else "cpu"  # meta: dgemma_cli.step_trace counts the copies
        self.verdicts = [torch.zeros((), dtype=torch.bool, device=host, pin_memory=self.cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(2)]
        self.count = 0

    def push(self, done: torch.Tensor) -> None:
        """This step's verdict, copied without waiting (two slots: the previous one is read before it is reused).
        done: the rows' [B], or the verdict itself (0-dim: `CanvasState.all_done`, which the step computed)."""
        i = self.count % 2
        self.verdicts[i].copy_(done if done.dim() == 0 else done.all(), non_blocking=self.cuda)
        if self.cuda:
            self.events[i].record()
        self.count += 1

    def previous(self) -> bool | None:
        """The verdict of the step before the last pushed one (None before two pushes): waits for that step only."""
        if self.count < 2:
            return None
        i = self.count % 2  # the older of the two slots
        if self.cuda:
            self.events[i].synchronize()
        return bool(self.verdicts[i])


def rng_state(device: torch.device) -> torch.Tensor:
    """The default generator's state on `device` (host side: no device round trip on CUDA)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def generate_events(denoiser: Denoiser, prompt: torch.Tensor, settings: GenerationSettings,
                    prompt_valid: torch.Tensor | None = None, held: torch.Tensor | None = None,
                    constraints: list | None = None, lagged_stop: bool | None = None) -> Iterator[Event]:
    """Run the block loop for a batch of prompts.

    prompt [B, T] ids (left-padded when lengths differ, with prompt_valid [B, T] False at padding).
    Canvases continue until every row has produced an end-of-sequence token or `max_new_tokens` is covered.

    held [B, h] (infill): token ids fixed in the last h positions of every canvas: set before the first step,
    accepted at every step, never renoised, excluded from the entropy budget and the confidence test. The
    free part before them ends at an end-of-sequence token or at `<pad>`; only the free part is kept, appended
    to the cache, and returned.

    constraints (one per row, or None for a free row): `constrain.RowConstraint`s whose `step` replaces a row's
    draws and argmax each step by its best paths through the row's automaton (from the step's log-probabilities:
    the torch path's buffers), and whose `end_canvas` follows each kept canvas. Not with held tokens.

    lagged_stop (default: on CUDA, unless a row's search reads the step on the host: a grammar's walk, an automaton
    searched on the host, `RowConstraint.on_device`): the stop test read one step late (`LaggedStop`), so no step
    waits for the host; the events and tokens are the same.
    """
    t0 = time.perf_counter()
    B = prompt.shape[0]
    dev = prompt.device
    C, V = denoiser.canvas_length, denoiser.vocab_size
    N = settings.max_denoising_steps
    eos = torch.tensor(settings.eos_token_ids, device=dev)
    pad = settings.pad_token_id

    finished_rows = torch.zeros(B, dtype=torch.bool, device=dev)
    forward_passes = torch.zeros(B, dtype=torch.int64, device=dev)
    canvases: list[torch.Tensor] = []
    steps_per_canvas: list[list[int]] = [[] for _ in range(B)]
    kept_per_row = [0] * B  # tokens the answer keeps, summed over canvases
    batched_calls = 0
    chunk, chunk_valid = prompt, prompt_valid
    if constraints is not None and held is not None:
        raise ValueError("constrained canvases cannot hold tokens")
    # rows held to structures whose search runs on the device take their class pass in the fused head (no
    # log-probabilities kept); other constraints search the torch path's log-probabilities
    on_device = constraints is not None and all(
        c is None or (hasattr(c, "on_device") and c.on_device(dev, C)) for c in constraints)
    buf = new_buffers(B * C, denoiser, dev, logits=constraints is not None and not on_device)
    if on_device and buf.fused is not None:
        hold_rows(buf, constraints, C)
    h = 0 if held is None else held.shape[1]
    free = C - h
    if h:
        if free < 1:
            raise ValueError(f"{h} held tokens leave no free position in a canvas of {C}")
        eos = torch.cat([eos, torch.tensor([pad], device=dev)])  # an infill's middle may also end at <pad>

    if lagged_stop is None:  # a held row's search on the device reads nothing on the host either
        lagged_stop = dev.type == "cuda" and (constraints is None or on_device)
    temperatures = step_temperatures(settings, dev)
    run_step = getattr(denoiser, "run_step", None) or (lambda step, graphable: step())
    for ci in range(settings.canvases_for(free)):
        denoiser.encode(chunk, chunk_valid)
        denoiser.start_canvas()
        canvas = torch.randint(0, V, (B, C), device=dev)
        if h:
            canvas[:, free:] = held
        # the canvas, its argmax, the rows' stop tests and the steps a row sat out (converged, or ended in an earlier
        # canvas: one add a step, where counting its steps and its forwards took four kernels; its steps are the
        # canvas's steps less these, made at the canvas's end), kept in place from step to step
        state = CanvasState(canvas, finished_rows, settings, temperatures)
        ran = 0  # steps run on this canvas (a lagged stop's undone step included: every row sat it out)
        # the constraints of rows still generating (a row that ended keeps padding its canvases)
        live = None if constraints is None else [None if f else c for c, f in zip(constraints, finished_rows.tolist())]

        stop = LaggedStop(dev) if lagged_stop else None
        queued: list[Step] = []  # lagged: the step whose verdict is not read yet
        for k in range(N):
            before = rng_state(dev) if stop is not None else None
            ran += 1
            conditioned = k > 0  # a canvas's first step is not self-conditioned
            # the steps after the first are one CUDA graph where the denoiser has them (their host work: none)
            # (held rows too where the head makes their class keys: their step is kernels with fixed operands)
            run_step(lambda: whole_step(denoiser, state, buf, settings, conditioned, held, live),
                     conditioned and (live is None or held_in_head(buf)))
            batched_calls += 1
            step = state.step_event(ci, k, N)
            if stop is None:
                yield step
                if bool(state.all_done):
                    break
                continue
            stop.push(state.all_done)
            verdict = stop.previous()  # the step before this one's, which the GPU has finished or nearly
            if verdict is not None:
                yield queued.pop()
            if verdict:  # every row had converged: this step was not needed (it changed none of them)
                set_rng_state(dev, before)
                batched_calls -= 1
                break
            queued.append(step)
        yield from queued  # the canvas's last step, when it ran them all
        argmax = state.argmax

        # Keep the argmax canvas; rows that ended earlier get pad; after a first EOS everything is pad.
        tokens = argmax[:, :free].clone()
        tokens[finished_rows] = pad
        is_eos = torch.isin(tokens, eos)
        ended_here = is_eos.any(dim=-1)
        run = is_eos.cumsum(dim=-1)
        tokens[(run > 0) & ~((run == 1) & is_eos)] = pad
        finished_rows = finished_rows | ended_here
        canvases.append(tokens)
        if live is not None:
            for rc, row in zip(live, tokens.tolist()):
                if rc is not None:
                    rc.end_canvas(row)
        room = max(0, min(free, settings.max_new_tokens - ci * free))  # positions of this canvas within the limit
        # the answer's tokens: neither pad nor the end-of-sequence id that ends it (pads after it already)
        answer = (tokens[:, :room] != pad) & ~is_eos[:, :room]
        row_steps = ran - state.idle
        forward_passes += row_steps
        steps, kept = torch.stack([row_steps, answer.sum(dim=-1)]).tolist()  # one transfer
        for b in range(B):
            kept_per_row[b] += kept[b]
            if steps[b]:  # rows that ended in an earlier canvas took no steps on this one
                steps_per_canvas[b].append(int(steps[b]))
        yield CanvasDone(ci, tokens, steps, finished_rows.clone(), kept)
        if bool(finished_rows.all()):
            break
        chunk, chunk_valid = tokens, None

    generated = torch.cat(canvases, dim=1)
    token_ids = []
    passes = forward_passes.tolist()
    ends = set(eos.tolist())
    for row in generated.tolist():
        cut = next((i for i, t in enumerate(row) if t in ends), len(row))
        token_ids.append(row[: min(cut, settings.max_new_tokens)])
    tpf = [tokens_per_forward(k, f) for k, f in zip(kept_per_row, passes)]
    satisfied = None if constraints is None else [c is None or c.satisfied for c in constraints]
    yield Done(token_ids, steps_per_canvas, tpf, time.perf_counter() - t0, batched_calls, satisfied=satisfied)


def _stable(history: list[torch.Tensor], argmax: torch.Tensor, threshold: int) -> torch.Tensor:
    """True per row when the argmax canvas equals each of the last `threshold` ones; updates history in place."""
    if threshold == 0:
        return torch.ones(argmax.shape[0], dtype=torch.bool, device=argmax.device)
    stable = torch.ones(argmax.shape[0], dtype=torch.bool, device=argmax.device)
    if len(history) < threshold:
        stable = torch.zeros_like(stable)
    for past in history:
        stable &= (past == argmax).all(dim=-1)
    history.append(argmax)
    del history[:-threshold]
    return stable
