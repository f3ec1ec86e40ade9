"""Streamed experts at run time: each streamed layer's experts live in host memory (pinned on a CUDA machine) and are
copied into one of two on-card layer buffers before that layer's experts run.

The streamed layers s0, s1, ... s(n-1) alternate between the two buffers (s0, s2, ... in buffer 0; s1, s3, ... in
buffer 1: with n odd, s(n-1) and s0 follow each other in buffer 0; placement/plan.py buffer_order). The experts'
modules hold the buffers themselves (their parameters and packed buffers are the buffer's tensors), so every path
that reads them (the reference grouped matmuls, the fused MoE kernels, adapters' folds) reads the streamed layer's
weights without knowing it; a packed module that caches something derived from its tensors keys the cache by the
tensor's version, which a copy advances (quant/modules.py row_scale_2).

Two ways to copy (a `Copier`):
- overlapped (CUDA): copies run on a stream of their own. When layer s(k) has run (the next layer's first norm, or
  the final norm, is about to start), s(k+2)'s experts are copied into the buffer s(k) used, ordered after
  everything the compute stream has queued so far (an event), and s(k+2)'s experts wait for that copy (another
  event). The last copies fill the buffers with s0 and s1 for the next pass; every pass (`encode`,
  `denoise`: the model's pass hooks) starts with s0 and s1 in the buffers and ends by joining the copy stream, so a
  pass captured in a CUDA graph has no work left outside it and a replay starts from the state it was captured in.
- waiting (the CPU, training, and a GPU whose first-use check failed): the copy is issued on the compute stream right
  before the layer's experts, so the experts wait for it; nothing overlaps. Training (gradients on) always waits: the
  backward pass reads a layer's experts after its forward hooks have run, and recomputes them in reverse order.

Either way the tokens are the resident run's, bit for bit (tests/test_placement.py: every format, an adapter on the
experts, and copiers that land copies as late or as early as the ordering allows), and so is a tune's adapter. Each
layer's copy lands in its buffer at its host tensor's offset modulo ALIGN, which on the CPU is the resident load's
(`_offset`): where an operand starts can choose a BLAS kernel's path, and so its bits. The first-use check on CUDA runs
two streamed layers that share a buffer both ways and compares; if they differ it says so in one line and waits.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from ..checkpoint.weights import ALIGN
from .plan import buffer_order

Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (destination in a layer buffer, source in host memory)


def _owner(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    parent, _, leaf = name.rpartition(".")
    return (module.get_submodule(parent) if parent else module), leaf


def _at(buffer: torch.Tensor, like: torch.Tensor, offset: int) -> torch.Tensor:
    """A view of flat `buffer` shaped and strided as `empty_like(like)` would be, starting `offset` bytes past a
    multiple of ALIGN (the buffer holds ALIGN bytes more than `like`)."""
    skip = (offset - buffer.data_ptr()) % ALIGN // buffer.element_size()
    strides = torch.empty_like(like, device="meta").stride()
    return buffer.as_strided(like.shape, strides, buffer.storage_offset() + skip)


class Copier:
    """Copies on the compute stream (the waiting path): `overlaps` False, so ExpertStream copies just before use."""

    overlaps = False

    def copy_now(self, pairs: Pairs) -> None:
        """On the compute stream: what runs after it sees the copy."""
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)

    def copy_later(self, pairs: Pairs):
        """Queue the copy after everything queued so far (on the copy stream); returns what `wait` takes."""
        self.copy_now(pairs)

    def wait(self, token) -> None:
        """The compute stream waits for a copy `copy_later` queued."""


class CudaCopier(Copier):
    """Copies on a CUDA stream of their own, ordered by events (each can be captured in a CUDA graph: the copy stream
    forks from the compute stream at an event recorded on it, and joins back when the compute stream waits)."""

    overlaps = True

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy_later(self, pairs: Pairs) -> torch.cuda.Event:
        queued = torch.cuda.Event()
        # on this card's compute stream (with layers split over cards, another card may be current): the buffer's
        # readers so far are before this point
        queued.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(queued)
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.stream)
        return done

    def wait(self, token: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(token)


class ExpertStream:
    """The streamed layers of `model` (indices into model.layers), their host copies and the two layer buffers on
    `device`. Built after the weights are loaded, with the streamed layers' expert tensors in host memory. `copier`:
    how copies are made (None: CudaCopier on CUDA, else the waiting Copier)."""

    def __init__(self, model: torch.nn.Module, layers: list[int], device: torch.device, copier: Copier | None = None):
        self.layers = sorted(layers)
        n = len(self.layers)
        # streamed layers alternate the buffers; after[i]: the layer i's buffer takes once i has run (plan.py)
        self.buffer_of, self.after = buffer_order(self.layers)
        self.first = [self.layers[b] if b < n else None for b in (0, 1)]  # what each buffer holds between passes
        self.device = torch.device(device)
        self.copier = copier or (CudaCopier(self.device) if self.device.type == "cuda" else Copier())
        self.host: dict[int, dict[str, torch.Tensor]] = {}  # layer -> tensor name (in its experts module) -> host copy
        self.buffers: list[dict[str, torch.Tensor]] = [{}, {}]  # name -> the buffer's storage (flat, ALIGN bytes spare)
        self.views: dict[int, dict[str, torch.Tensor]] = {}  # layer -> name -> where its copy goes in its buffer
        self.holds: list[int | None] = [None, None]  # the layer each buffer holds, or will once its copy lands
        self.pending: list = [None, None]  # the copy into each buffer not yet waited for (copy_later's token)
        self.copies = 0  # layers copied in so far (what the tests count)
        self._hooks = []
        pin = self.device.type == "cuda"
        for i in self.layers:
            experts = model.layers[i].experts
            # every name a tensor is held under (a tensor two projections share is repointed under both)
            tensors = {**dict(experts.named_parameters(remove_duplicate=False)),
                       **dict(experts.named_buffers(remove_duplicate=False))}
            first = self.host.get(self.first[self.buffer_of[i]])  # the host tensors of the buffer's first layer
            host = {}
            for name, t in tensors.items():
                src = t.detach()
                if src.device.type != "cpu":
                    raise ValueError(f"layer {i}'s experts were loaded onto {src.device}, not host memory")
                if first is not None and (name not in first or first[name].dtype != src.dtype):
                    raise ValueError(f"layer {i}'s experts differ in kind from the other streamed layers' ({name})")
                host[name] = src.pin_memory() if pin and not src.is_pinned() else src
            self.host[i] = host
        # a buffer holds the largest of its layers' copies of each tensor: a GGUF's layers may differ in block type
        # (llama.cpp gives some layers more bits), so in size; each layer's view is shaped as its own tensor
        largest: list[dict[str, int]] = [{}, {}]
        for i in self.layers:
            sizes = largest[self.buffer_of[i]]
            for name, src in self.host[i].items():
                sizes[name] = max(sizes.get(name, 0), src.numel())
        for i in self.layers:
            buffer, self.views[i] = self.buffers[self.buffer_of[i]], {}
            for name, src in self.host[i].items():
                if name not in buffer:
                    buffer[name] = torch.empty(largest[self.buffer_of[i]][name] + ALIGN // src.element_size(),
                                               dtype=src.dtype, device=self.device)
                view = self.views[i][name] = _at(buffer[name], src, self._offset(src))
                owner, leaf = _owner(model.layers[i].experts, name)
                if leaf in owner._parameters:
                    owner._parameters[leaf] = torch.nn.Parameter(view, requires_grad=False)
                else:
                    owner._buffers[leaf] = view
            experts = model.layers[i].experts
            self._hooks.append(experts.register_forward_pre_hook(lambda module, args, i=i: self.before_experts(i)))
            # layer i has run when the next layer's first norm starts (the final norm after the last layer)
            following = model.layers[i + 1].input_layernorm if i + 1 < len(model.layers) else model.norm
            self._hooks.append(following.register_forward_pre_hook(lambda module, args, i=i: self.after_layer(i)))
        model.pass_hooks.append(self)

    def _offset(self, src: torch.Tensor) -> int:
        """Where a layer's copy of `src` starts in its buffer, modulo ALIGN: on the CPU where its host tensor starts,
        which the loader placed where the resident load's view of the mapped file starts (checkpoint/weights.py
        load_model); on a card at the start, as a resident layer's tensors are fresh allocations there. So the
        experts' matmuls get operands aligned as the resident run's: a BLAS kernel's path can depend on it (and so
        its bits), and so does grouped_linear's (model.py)."""
        return src.data_ptr() % ALIGN if self.device.type == "cpu" else 0

    # ------------------------------------------------------------------ the schedule

    def overlapping(self) -> bool:
        """Copies ahead of their layer: a copier that overlaps, and no gradients (module docstring)."""
        return self.copier.overlaps and not torch.is_grad_enabled()

    def _pairs(self, layer: int) -> Pairs:
        views = self.views[layer]
        return [(views[name], src) for name, src in self.host[layer].items()]

    def _copy_ahead(self, layer: int) -> None:
        b = self.buffer_of[layer]
        self.pending[b] = self.copier.copy_later(self._pairs(layer))
        self.holds[b] = layer
        self.copies += 1

    def _wait(self, b: int) -> None:
        if self.pending[b] is not None:
            self.copier.wait(self.pending[b])
            self.pending[b] = None

    def before_experts(self, layer: int) -> None:
        """Layer `layer`'s experts are about to run: its weights in its buffer, copied now or waited for."""
        b = self.buffer_of[layer]
        if not self.overlapping():  # copies that wait, after any copy into this buffer still in flight
            self._wait(b)
            self.copier.copy_now(self._pairs(layer))
            self.holds[b] = layer
            self.copies += 1
            return
        if self.holds[b] != layer:  # not copied ahead (the first pass, or a pass that ran out of order)
            self._copy_ahead(layer)
        self._wait(b)

    def after_layer(self, layer: int) -> None:
        """Layer `layer` has run (all its experts' calls): its buffer takes the streamed layer two on."""
        if not self.overlapping():
            return
        b, nxt = self.buffer_of[layer], self.after[layer]
        if self.holds[b] == layer and nxt != layer:
            self._copy_ahead(nxt)

    def start_pass(self) -> None:
        """A pass begins: s0 and s1 in their buffers (already, after a pass that ended as it should)."""
        if self.overlapping():
            for b, layer in enumerate(self.first):
                if layer is not None and self.holds[b] != layer:
                    self._copy_ahead(layer)

    def end_pass(self) -> None:
        """A pass ends: s0 and s1 copied (a pass may skip layers: the encoder's last layer needs no experts) and the
        copy stream joined, so that no copy is left outside a captured graph."""
        if self.overlapping():
            self.start_pass()
        for b in (0, 1):
            self._wait(b)

    def reset(self) -> None:
        """Forget what the buffers hold and the copies in flight (a CUDA graph capture that failed recorded them
        without running them): the next pass copies s0 and s1 afresh."""
        self.holds, self.pending = [None, None], [None, None]

    # ------------------------------------------------------------------ the first-use check

    def check(self, model: torch.nn.Module, rows: int = 64, seed: int = 0) -> str | None:
        """Run two streamed layers that share a buffer (s0 then s2; s0 alone when fewer stream) on a random input,
        with copies overlapped and with copies that wait, and compare bit for bit. None when they agree (or nothing
        overlaps here), else what differed: then this stream waits from now on, and that is said in one line."""
        if not self.copier.overlaps:
            return None
        probe = [self.layers[0]] + self.layers[2:3]
        cfg = model.cfg.text
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(rows, cfg.hidden_size, generator=g).to(self.device, model.dtype)
        index = torch.stack([torch.randperm(cfg.num_experts, generator=g)[: cfg.top_k_experts] for _ in range(rows)])
        weights = torch.rand(rows, cfg.top_k_experts, generator=g).softmax(-1)
        index, weights = index.to(self.device), weights.to(self.device)

        def run() -> list[torch.Tensor]:
            self.start_pass()
            out = []
            for i in probe:
                out.append(model.layers[i].experts(x, index, weights).clone())
                self.after_layer(i)
            self.end_pass()
            return out

        copier = self.copier
        on_card = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with torch.no_grad(), on_card:  # this stream's card current (with a split it may not be the first)
            overlapped = run()
            self.copier = Copier()
            try:
                waited = run()
            finally:
                self.copier = copier
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        differ = [i for i, a, b in zip(probe, overlapped, waited) if not torch.equal(a, b)]
        if not differ:
            return None
        self.copier = Copier()
        reason = (f"streamed layer {differ[0]}'s experts differ when their copy overlaps the compute "
                  f"({len(differ)} of {len(probe)} layers checked)")
        print(f"dgemma: {reason}; copying each streamed layer just before it runs instead", file=sys.stderr)
        return reason

    # ------------------------------------------------------------------ sizes

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for h in self.host.values() for t in h.values())

    @property
    def buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self.buffers for t in b.values())
