"""The MoE router in one Triton kernel: norm, scales, projection, softmax, top-k, renormalisation, expert scales.

The model's router (dgemma_cli/model.py Router) on the un-normed residual x [T, H]:

    h = round(round(rmsnorm(x)) * scale) * H^-1/2 (rounded)   each product rounded to x's dtype, as torch does
    logits = round(h @ W^T)                                    W [E, H] in x's dtype, float32 sums
    p = softmax(float32(logits))
    w, index = top-k of p (the k largest; the lower index first among equal values)
    weights = w / sum(w) * float32(per_expert_scale[index])

Outputs: weights float32 [T, k], index int64 [T, k]. One program per BLOCK_T tokens: a sweep over H for the
norm's sum of squares, a sweep multiplying the normed, scaled rows by W's tiles (tensor cores), then the softmax and
the top-k on the [BLOCK_T, E] logits in registers (E <= 256). Under Triton's interpreter (EMULATE) the product
is taken in float32 (its 16-bit dot is not IEEE): the same exact products of 16-bit values, summed in float32. The sums' order differs from the torch path's (cuBLAS
or the CPU's BLAS), so a logit may differ by one rounding, and two experts whose probabilities tie that closely may
swap: tests/test_routing_kernels.py measures how often.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .rmsnorm import _round


@triton.jit
def router_kernel(x_ptr, scale_ptr, w_ptr, pes_ptr, out_w_ptr, out_i_ptr, T, H, E, root, eps,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, TOPK: tl.constexpr,
                  KP: tl.constexpr, EMULATE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = rows < T
    rows64 = rows.to(tl.int64)
    dt: tl.constexpr = x_ptr.dtype.element_ty
    ss = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows64[:, None] * H + ks[None, :], mask=live[:, None] & (ks[None, :] < H),
                    other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    rstd = 1.0 / tl.sqrt(ss / H + eps)
    es = tl.arange(0, BLOCK_E)
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < H
        x = tl.load(x_ptr + rows64[:, None] * H + ks[None, :], mask=live[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        s = tl.load(scale_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
        h = _round(_round(_round(x * rstd[:, None], dt, EMULATE) * s[None, :], dt, EMULATE) * root, dt, EMULATE)
        w = tl.load(w_ptr + es[:, None] * H + ks[None, :], mask=(es[:, None] < E) & kmask[None, :], other=0.0)
        if EMULATE:  # the interpreter's 16-bit dot is not IEEE: the same exact products, summed in float32
            acc = tl.dot(h, tl.trans(w.to(tl.float32)), acc)
        else:
            acc = tl.dot(h.to(dt), tl.trans(w), acc)
    logits = tl.where(es[None, :] < E, _round(acc, dt, EMULATE), -float("inf"))
    m = tl.max(logits, axis=1)
    p = tl.exp(logits - m[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    slots = tl.arange(0, KP)
    vals = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
    idxs = tl.zeros([BLOCK_T, KP], dtype=tl.int32)
    for j in tl.static_range(TOPK):
        v = tl.max(p, axis=1)
        i = tl.min(tl.where(p == v[:, None], es[None, :], BLOCK_E), axis=1)
        vals = tl.where(slots[None, :] == j, v[:, None], vals)
        idxs = tl.where(slots[None, :] == j, i[:, None], idxs)
        p = tl.where(es[None, :] == i[:, None], -1.0, p)
    total = tl.sum(vals, axis=1)
    keep = live[:, None] & (slots[None, :] < TOPK)
    pes = tl.load(pes_ptr + idxs, mask=keep, other=0.0).to(tl.float32)
    out = rows64[:, None] * TOPK + slots[None, :]
    tl.store(out_w_ptr + out, vals / total[:, None] * pes, mask=keep)
    tl.store(out_i_ptr + out, idxs.to(tl.int64), mask=keep)


def route(x: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int,
          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (weights float32 [T, top_k], index int64 [T, top_k]) as the module docstring says."""
    T, H = x.shape
    E = weight.shape[0]
    if E > 256 or top_k > E:
        raise ValueError(f"the fused router takes at most 256 experts and top-k <= experts (got {E}, {top_k})")
    out_w = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    out_i = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    if T:
        block_t = 16
        router_kernel[(triton.cdiv(T, block_t),)](
            x.contiguous(), scale, weight.contiguous(), per_expert_scale, out_w, out_i, T, H, E, float(H ** -0.5),
            float(eps), block_t, max(16, triton.next_power_of_2(E)), 128, top_k, triton.next_power_of_2(top_k),
            interpreting(), num_warps=4)
    return out_w, out_i


def route_reference(x: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, per_expert_scale: torch.Tensor,
                    top_k: int, eps: float, with_probs: bool = False):
    """The router's torch ops (dgemma_cli/model.py Router.forward), for the checks: (weights, index), and with
    `with_probs` the softmax over every expert as a third value."""
    xf = x.float()
    h = (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)
    h = h * scale * x.shape[-1] ** -0.5
    probs = torch.softmax(torch.nn.functional.linear(h, weight), dim=-1, dtype=torch.float32)
    w, idx = torch.topk(probs, k=top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    return (w * per_expert_scale[idx], idx) + ((probs,) if with_probs else ())
