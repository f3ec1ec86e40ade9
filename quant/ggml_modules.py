"""GGUF weights held as their blocks: a linear and an expert stack that keep a tensor's bytes as the file has them
(rows of ggml blocks, quant/ggml.py) and decode them where they are used, so a GGUF model takes its file's size in
memory, not its 16-bit size.

Where Triton runs, the routed experts go through the MoE kernels reading the blocks in their own tiles (FORMAT gguf:
kernels/moe_gate_up.weight_tile) and a linear through kernels/ggml_linear.py, which does the same (kernels/ggml_tile.py);
a matrix asked for whole (`dequantize`: LoRA merges, the embedding at load) is decoded in one kernel pass
(kernels/ggml_decode.py). Elsewhere torch decodes (quant/ggml.py): a linear its matrix each call, an expert stack a few experts at a
time as the other packed stacks do (dgemma_cli/model.py QuantizedExperts: one layer's experts unpacked at most).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ggml
from .modules import _Stack


def decode(raw: torch.Tensor, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The blocks' weights: one Triton kernel where it runs (kernels/ggml_decode.py, checked on first use), else
    quant/ggml.py's torch decode."""
    from .kernels import use_triton
    from .kernels.probe import family_ok

    if kind in ggml.BLOCK_KINDS and use_triton(raw.device) and family_ok("ggml_decode", raw.device, dtype):
        from .kernels.ggml_decode import ggml_decode  # (imports triton: only where it runs)

        return ggml_decode(raw, kind, shape, dtype)
    return ggml.decode(raw, kind, shape, dtype)


class GGUFLinear(nn.Module):
    """y = x W^T with W [out, in] held as ggml blocks of `kind` (uint8 [out, row bytes])."""

    format = "gguf"

    def __init__(self, in_features: int, out_features: int, kind: str, device=None):
        super().__init__()
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        self.register_buffer("weight", torch.empty(out_features, ggml.row_bytes(kind, in_features), dtype=torch.uint8,
                                                   device=device))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return decode(self.weight, self.kind, (self.out_features, self.in_features), dtype)

    def gated(self, x: torch.Tensor, up: nn.Module) -> torch.Tensor | None:
        """The dense MLP's gelu_tanh(x W_gate^T) * (x W_up^T) in one launch (kernels/ggml_linear.py, GATED), this
        module the gate and `up` another GGUF linear of its shape; None where that does not run (the caller runs
        the three ops)."""
        from .kernels import use_triton
        from .kernels.probe import family_ok

        if (not isinstance(up, GGUFLinear) or (up.in_features, up.out_features) != (self.in_features,
                                                                                   self.out_features)
                or self.kind not in ggml.BLOCK_KINDS or up.kind not in ggml.BLOCK_KINDS
                or not use_triton(x.device) or not family_ok("ggml_linear", x.device, x.dtype)):
            return None
        from .kernels.ggml_linear import ggml_linear

        return ggml_linear(x, self.weight, self.kind, self.in_features, up=(up.weight, up.kind))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .kernels import use_triton
        from .kernels.probe import family_ok

        if self.kind in ggml.BLOCK_KINDS and use_triton(x.device) and family_ok("ggml_linear", x.device, x.dtype):
            from .kernels.ggml_linear import ggml_linear  # (imports triton: only where it runs)

            return ggml_linear(x, self.weight, self.kind, self.in_features)
        return F.linear(x, self.dequantize(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


def fused_head_fits(kind: str, hidden: int) -> bool:
    """Whether the fused head's kernels (kernels/head.py) read an embedding of `kind` blocks at this hidden size: a
    block type, the hidden size in whole tiles of theirs (256 inputs for the 256-weight types, else 128)."""
    return kind in ggml.BLOCK_KINDS and hidden % (256 if ggml.ELEMENTS[kind] == 256 else 128) == 0


class GGUFEmbedding(nn.Module):
    """The tied embedding [V, H] held as ggml blocks of `kind` (uint8 [V, row bytes]: the file's token_embd, Q6_K in
    the published files, 0.6 GB at the real shapes against 1.5 GB decoded). It is read three ways, none of which
    decodes the whole matrix at once: `lookup` decodes the rows of the ids asked for (the prompt, the canvas); `head`
    gives h W^T (the logits; on a GPU through kernels/ggml_linear.py, else a vocabulary chunk decoded at a time);
    `soft` gives p W (the soft embedding, a chunk at a time). The fused head (kernels/head.py, `kind` set) reads the
    blocks in its own kernels."""

    format = "gguf"
    CHUNK = 16384  # vocabulary rows decoded at a time by the torch paths: [CHUNK, H] in the compute dtype (92 MB)

    def __init__(self, num_embeddings: int, embedding_dim: int, kind: str, device=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.kind = num_embeddings, embedding_dim, kind
        self.register_buffer("weight", torch.empty(num_embeddings, ggml.row_bytes(kind, embedding_dim),
                                                   dtype=torch.uint8, device=device))

    def rows(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [lo, hi) decoded: [hi - lo, H] in dtype."""
        return decode(self.weight[lo:hi], self.kind, (hi - lo, self.embedding_dim), dtype)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """F.embedding(ids, W): [*ids.shape, H] in dtype, decoding only the rows asked for."""
        flat = ids.reshape(-1)
        return decode(self.weight[flat], self.kind, (flat.numel(), self.embedding_dim), dtype).view(
            *ids.shape, self.embedding_dim)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """h [M, H] -> h W^T [M, V] in h's dtype (float32 sums)."""
        from .kernels import use_triton
        from .kernels.probe import family_ok

        if self.kind in ggml.BLOCK_KINDS and use_triton(h.device) and family_ok("ggml_linear", h.device, h.dtype):
            from .kernels.ggml_linear import ggml_linear

            return ggml_linear(h.contiguous(), self.weight, self.kind, self.embedding_dim)
        return torch.cat([F.linear(h, self.rows(lo, min(lo + self.CHUNK, self.num_embeddings), h.dtype))
                          for lo in range(0, self.num_embeddings, self.CHUNK)], dim=-1)

    def soft(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """p [R, V] -> p W [R, H] in dtype: the chunks' products summed in float32 (one chunk: the plain product)."""
        V = self.num_embeddings
        if V <= self.CHUNK:
            return torch.matmul(p.to(dtype), self.rows(0, V, dtype))
        acc = torch.zeros(p.shape[0], self.embedding_dim, dtype=torch.float32, device=p.device)
        for lo in range(0, V, self.CHUNK):
            hi = min(lo + self.CHUNK, V)
            acc += torch.matmul(p[:, lo:hi].to(dtype), self.rows(lo, hi, dtype)).float()
        return acc.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, kind={self.kind}"


class GGUFStack(_Stack):
    """E matrices [N, K] held as ggml blocks of `kind` (uint8 [E, N, row bytes]): the routed experts' gate-up (gate
    rows, then up) or down stack as the file stores it."""

    format = "gguf"

    def __init__(self, num: int, out_features: int, in_features: int, kind: str, device=None):
        super().__init__()
        self.shape, self.kind = (num, out_features, in_features), kind
        self.register_buffer("weight", torch.empty(num, out_features, ggml.row_bytes(kind, in_features),
                                                   dtype=torch.uint8, device=device))

    def dequantize_experts(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        _, N, K = self.shape
        return decode(self.weight[lo:hi], self.kind, (hi - lo, N, K), dtype)

    def fused_experts(self, down, x, top_k_index, top_k_weights, ordered: bool = False, lora=None):
        """The routed experts through the MoE kernels reading the blocks in their own tiles (FORMAT gguf: no layer
        decoded), or None (the reference path, a layer unpacked at a time): adapters, a float stack, or no Triton."""
        from .kernels import use_triton
        from .kernels.probe import family_ok

        kinds = ggml.BLOCK_KINDS
        if (ordered or lora is not None or self.kind not in kinds or getattr(down, "kind", None) not in kinds
                or not use_triton(x.device) or not family_ok("moe_gguf", x.device, x.dtype)):
            return None
        return gguf_experts(self, down, x, top_k_index, top_k_weights)

    def takes_pair_order(self, down, x) -> bool:
        return False


def gguf_experts(gate_up: GGUFStack, down: GGUFStack, x: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """x [T, H] -> [T, H] through moe_gate_up and moe_down on GGUF blocks (their first launch candidate, or `cfg`)."""
    from .kernels.moe_down import moe_down
    from .kernels.moe_gate_up import candidates, moe_gate_up
    from .modules import block_plan

    T, K = top_k_index.shape
    E, two_i, H = gate_up.shape
    cfg = cfg or candidates(T * K / E, H, two_i // 2, x.device)[0]
    ids, block_expert = block_plan(top_k_index, E, cfg["BLOCK_M"])
    h = moe_gate_up(x, ids, block_expert, "gguf", gate_up.weight, None, None, K, cfg, kind=gate_up.kind)
    return moe_down(h, ids, block_expert, "gguf", down.weight, None, None, top_k_weights.reshape(-1), T, K, cfg,
                    kind=down.kind)
