"""Streamed experts at run time: each streamed layer's experts live in host memory (pinned on a CUDA machine) and are
copied into one of two on-card layer buffers just before that layer's experts run.

The streamed layers alternate between the two buffers, so a layer's copy never overwrites the experts of the layer
just before it. The experts' modules hold the buffers themselves (their parameters and packed buffers are the
buffer's tensors), so every path that reads them (the reference grouped matmuls, the fused MoE kernels, adapters'
folds) reads the streamed layer's weights without knowing it; a packed module that caches something derived from
its tensors keys the cache by the tensor's version, which a copy advances (quant/modules.py row_scale_2).

This is the path whose copies wait for their layer: the copy is issued on the compute stream right before the
layer's experts, so it is exact everywhere and overlaps nothing. The tokens are the resident run's, bit for bit
(tests/test_placement.py, every format, with an adapter on the experts).
"""

from __future__ import annotations

import torch


def _owner(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    parent, _, leaf = name.rpartition(".")
    return (module.get_submodule(parent) if parent else module), leaf


class ExpertStream:
    """The streamed layers of `model` (indices into model.layers), their host copies and the two layer buffers on
    `device`. Built after the weights are loaded, with the streamed layers' expert tensors in host memory."""

    def __init__(self, model: torch.nn.Module, layers: list[int], device: torch.device):
        self.layers = sorted(layers)
        self.buffer_of = {i: k % 2 for k, i in enumerate(self.layers)}  # streamed layers alternate the buffers
        self.device = torch.device(device)
        self.host: dict[int, dict[str, torch.Tensor]] = {}  # layer -> tensor name (in its experts module) -> host copy
        self.buffers: list[dict[str, torch.Tensor]] = [{}, {}]
        self.copies = 0  # layers copied in so far (what the tests count)
        self._hooks = []
        pin = self.device.type == "cuda"
        for i in self.layers:
            experts = model.layers[i].experts
            # every name a tensor is held under (a tensor two projections share is repointed under both)
            tensors = {**dict(experts.named_parameters(remove_duplicate=False)),
                       **dict(experts.named_buffers(remove_duplicate=False))}
            buffer = self.buffers[self.buffer_of[i]]
            host = {}
            for name, t in tensors.items():
                src = t.detach()
                if src.device.type != "cpu":
                    raise ValueError(f"layer {i}'s experts were loaded onto {src.device}, not host memory")
                host[name] = src.pin_memory() if pin and not src.is_pinned() else src
                if name not in buffer:
                    buffer[name] = torch.empty_like(src, device=self.device)
                elif buffer[name].shape != src.shape or buffer[name].dtype != src.dtype:
                    raise ValueError(f"layer {i}'s experts differ in shape from the other streamed layers' ({name})")
                owner, leaf = _owner(experts, name)
                if leaf in owner._parameters:
                    owner._parameters[leaf] = torch.nn.Parameter(buffer[name], requires_grad=False)
                else:
                    owner._buffers[leaf] = buffer[name]
            self.host[i] = host
            self._hooks.append(experts.register_forward_pre_hook(lambda module, args, i=i: self.fetch(i)))

    def fetch(self, layer: int) -> None:
        """Copy `layer`'s experts into its buffer (on the current stream: the experts' kernels wait for it)."""
        buffer = self.buffers[self.buffer_of[layer]]
        for name, src in self.host[layer].items():
            buffer[name].copy_(src, non_blocking=True)
        self.copies += 1

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for h in self.host.values() for t in h.values())

    @property
    def buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self.buffers for t in b.values())
