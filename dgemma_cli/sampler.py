"""The block-diffusion loop (DESIGN.md section 3) as a generator of typed events.

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
    sc_dtype: torch.dtype  # dtype the self-conditioning logits are carried in (the embedding's)

    def encode(self, ids: torch.Tensor, valid: torch.Tensor | None) -> None: ...

    def start_canvas(self) -> None: ...

    def denoise(self, canvas: torch.Tensor, sc_logits: torch.Tensor | None) -> torch.Tensor: ...


@dataclass
class Step:
    """One denoising step of one canvas. Tensors are [B, C] on the model's device; do not modify them."""

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


@dataclass
class Done:
    token_ids: list[list[int]]  # per row: generated ids, ending before the first end-of-sequence id
    steps_per_canvas: list[list[int]]  # per row
    tokens_per_forward: list[float]  # per row: non-pad generated tokens / decoder forward passes
    seconds: float
    forward_passes: int = 0  # batched decoder calls
    stats: dict = field(default_factory=dict)


Event = Step | CanvasDone | Done


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, computed as a Categorical distribution computes it."""
    norm = logits - logits.logsumexp(dim=-1, keepdim=True)
    probs = torch.softmax(norm, dim=-1)
    return -(norm.clamp(min=torch.finfo(norm.dtype).min) * probs).sum(-1)


def entropy_bound_accept(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """Accept the lowest-entropy positions while sum(entropy) - max(entropy) <= bound (at least one per row)."""
    sorted_h, order = torch.sort(entropy, dim=-1, descending=False)
    keep = torch.cumsum(sorted_h, dim=-1) - sorted_h <= bound
    return torch.scatter(torch.zeros_like(keep), dim=-1, index=order, src=keep)


def generate_events(denoiser: Denoiser, prompt: torch.Tensor, settings: GenerationSettings,
                    prompt_valid: torch.Tensor | None = None) -> Iterator[Event]:
    """Run the block loop for a batch of prompts.

    prompt [B, T] ids (left-padded when lengths differ, with prompt_valid [B, T] False at padding).
    Canvases continue until every row has produced an end-of-sequence token or `max_new_tokens` is covered.
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
    batched_calls = 0
    chunk, chunk_valid = prompt, prompt_valid

    for ci in range(settings.canvases_for(C)):
        denoiser.encode(chunk, chunk_valid)
        denoiser.start_canvas()
        canvas = torch.randint(0, V, (B, C), device=dev)
        argmax = canvas
        sc_logits = None
        done = torch.zeros(B, dtype=torch.bool, device=dev)  # adaptive stop per row
        prev_argmax = None  # stability history (threshold 1 keeps one canvas; longer thresholds keep more)
        history: list[torch.Tensor] = []
        row_steps = torch.zeros(B, dtype=torch.int64, device=dev)

        for n in range(N, 0, -1):
            active = ~(done | finished_rows)
            forward_passes += active
            row_steps += ~done
            logits = denoiser.denoise(canvas, sc_logits)  # [B, C, V] float32
            batched_calls += 1
            # Temperature falls linearly from t_max to t_min; computed as a float32 tensor like the reference.
            frac = torch.tensor(n, dtype=torch.int32, device=dev) / N
            temperature = settings.t_min + (settings.t_max - settings.t_min) * frac
            logits = logits.div_(temperature)  # processed logits, in place to hold one [B, C, V] buffer less
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            sample = torch.multinomial(probs.view(-1, V), num_samples=1).view(B, C)
            del probs
            new_argmax = logits.argmax(dim=-1)
            entropy = token_entropy(logits)
            accepted = entropy_bound_accept(entropy, settings.entropy_bound)
            kept = torch.where(accepted, sample, canvas)
            noise = torch.randint(0, V, (B, C), device=dev)
            new_canvas = torch.where(accepted, kept, noise)

            # Rows that already converged keep their canvas and self-conditioning; their entropy no longer
            # matters because `done` only grows.
            if done.any():
                new_argmax = torch.where(done[:, None], argmax, new_argmax)
                new_canvas = torch.where(done[:, None], canvas, new_canvas)
                logits = torch.where(done[:, None, None], sc_logits.float(), logits)
            stable = _stable(history, new_argmax, settings.stability_threshold)
            confident = entropy.mean(dim=-1) < settings.confidence_threshold
            done = done | (stable & confident)

            canvas, argmax = new_canvas, new_argmax
            sc_logits = logits.to(denoiser.sc_dtype)
            yield Step(ci, N - n + 1, N, canvas, argmax, accepted, entropy, done.clone())
            if bool(done.all()):
                break

        # Keep the argmax canvas; rows that ended earlier get pad; after a first EOS everything is pad.
        tokens = argmax.clone()
        tokens[finished_rows] = pad
        is_eos = torch.isin(tokens, eos)
        ended_here = is_eos.any(dim=-1)
        run = is_eos.cumsum(dim=-1)
        tokens[(run > 0) & ~((run == 1) & is_eos)] = pad
        finished_rows = finished_rows | ended_here
        canvases.append(tokens)
        steps = row_steps.tolist()
        for b in range(B):
            steps_per_canvas[b].append(int(steps[b]))
        yield CanvasDone(ci, tokens, steps, finished_rows.clone())
        if bool(finished_rows.all()):
            break
        chunk, chunk_valid = tokens, None

    generated = torch.cat(canvases, dim=1)
    token_ids = []
    tpf = []
    passes = forward_passes.tolist()
    for b, row in enumerate(generated.tolist()):
        cut = next((i for i, t in enumerate(row) if t in settings.eos_token_ids), len(row))
        token_ids.append(row[: min(cut, settings.max_new_tokens)])
        valid = sum(1 for t in row if t != pad)
        tpf.append(valid / passes[b] if passes[b] else 0.0)
    yield Done(token_ids, steps_per_canvas, tpf, time.perf_counter() - t0, batched_calls)


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
