"""The MoE router in one Triton kernel: norm, scales, projection, softmax, top-k, renormalisation, expert scales.

The model's router (dgemma_cli/model.py Router) on the un-normed residual x [T, H]:

    h = round(round(rmsnorm(x)) * scale) * H^-1/2 (rounded)   each product rounded to x's dtype, as torch does
    logits = round(h @ W^T)                                    W [E, H] in x's dtype, float32 sums
    p = softmax(float32(logits))
    w, index = top-k of p (the k largest; the lower index first among equal values)
    weights = w / sum(w) * float32(per_expert_scale[index])

Outputs: weights float32 [T, k], index int64 [T, k]. Programs of BLOCK_T tokens: a sweep over H for the norm's sum
of squares, a sweep multiplying the normed, scaled rows by W's tiles (tensor cores), then the softmax and the top-k
on the [BLOCK_T, E] logits in registers (E <= 256). Where a canvas's 16 token blocks would leave most SMs idle,
SPLITS programs share a block's inputs (each its part of H: of the rows to scale and of W), and the last to finish
adds their float32 partial sums in order and takes the softmax and top-k (a counter per block, which it sets back to
0). A split sums each logit in another order than one program does: a logit may differ by one rounding, as against
the torch path. Under Triton's interpreter (EMULATE) the product is taken in float32 (its 16-bit
dot is not IEEE): the same exact products of 16-bit values, summed in float32. The sums' order differs from the
torch path's (cuBLAS or the CPU's BLAS), so a logit may differ by one rounding, and two experts whose probabilities
tie that closely may swap: tests/test_routing_kernels.py measures how often.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fewest_waves, interpreting, tile_counters
from .rmsnorm import _round


@triton.jit
def _top_k(logits, es, rows64, live, pes_ptr, out_w_ptr, out_i_ptr, TOPK: tl.constexpr, KP: tl.constexpr,
           BLOCK_E: tl.constexpr):
    """Softmax over the [BLOCK_T, BLOCK_E] rounded logits (-inf past E), the top-k, renormalised, times the experts'
    scales; stores weights and indices."""
    m = tl.max(logits, axis=1)
    p = tl.exp(logits - m[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    slots = tl.arange(0, KP)
    vals = tl.zeros([logits.shape[0], KP], dtype=tl.float32)
    idxs = tl.zeros([logits.shape[0], KP], dtype=tl.int32)
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


@triton.jit
def router_kernel(x_ptr, scale_ptr, w_ptr, pes_ptr, out_w_ptr, out_i_ptr, part_ptr, count_ptr, T, H, E, KS, root, eps,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, TOPK: tl.constexpr,
                  KP: tl.constexpr, EMULATE: tl.constexpr, SPLITS: tl.constexpr = 1):
    pid_t = tl.program_id(0)
    part = tl.program_id(1)  # this program's inputs: [part * KS, (part + 1) * KS) of H (KS = H unsplit)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    live = rows < T
    rows64 = rows.to(tl.int64)
    dt: tl.constexpr = x_ptr.dtype.element_ty
    ss = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):  # the whole row: every split needs the norm
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows64[:, None] * H + ks[None, :], mask=live[:, None] & (ks[None, :] < H),
                    other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    rstd = 1.0 / tl.sqrt(ss / H + eps)
    es = tl.arange(0, BLOCK_E)
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    k_hi = tl.minimum(H, (part + 1) * KS)
    for k0 in range(part * KS, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < k_hi
        x = tl.load(x_ptr + rows64[:, None] * H + ks[None, :], mask=live[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        s = tl.load(scale_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
        h = _round(_round(_round(x * rstd[:, None], dt, EMULATE) * s[None, :], dt, EMULATE) * root, dt, EMULATE)
        w = tl.load(w_ptr + es[:, None] * H + ks[None, :], mask=(es[:, None] < E) & kmask[None, :], other=0.0)
        if EMULATE:  # the interpreter's 16-bit dot is not IEEE: the same exact products, summed in float32
            acc = tl.dot(h, tl.trans(w.to(tl.float32)), acc)
        else:
            acc = tl.dot(h.to(dt), tl.trans(w), acc)
    if SPLITS == 1:
        logits = tl.where(es[None, :] < E, _round(acc, dt, EMULATE), -float("inf"))
        _top_k(logits, es, rows64, live, pes_ptr, out_w_ptr, out_i_ptr, TOPK, KP, BLOCK_E)
    else:
        # H split over SPLITS programs (a canvas is 16 token blocks, too few programs to fill a GPU when each scales
        # and multiplies whole rows): each writes its float32 partial sums, and the last of the token block's
        # programs to finish (the counter it increments) adds them in order, rounds, and takes the softmax and top-k,
        # then sets the counter back to 0 for the next launch
        at = part_ptr + rows64[:, None] * BLOCK_E + es[None, :]  # [SPLITS, T, BLOCK_E]: this program's slice
        tl.store(at + part.to(tl.int64) * T * BLOCK_E, acc, mask=live[:, None])
        tl.debug_barrier()  # every thread's sums stored before the counter says so (its release is the CTA's)
        done = tl.atomic_add(count_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
        if done == SPLITS - 1:
            total = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
            for q in tl.static_range(SPLITS):  # from L2: other SMs wrote them
                total += tl.load(at + q * T * BLOCK_E, mask=live[:, None], other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + pid_t, 0)
            logits = tl.where(es[None, :] < E, _round(total, dt, EMULATE), -float("inf"))
            _top_k(logits, es, rows64, live, pes_ptr, out_w_ptr, out_i_ptr, TOPK, KP, BLOCK_E)


BLOCK_T = 16  # tokens a program
BLOCK_K = 128  # inputs a step
def route(x: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int,
          eps: float, splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (weights float32 [T, top_k], index int64 [T, top_k]) as the module docstring says. splits: how
    many programs share a token block's inputs, each whole steps of BLOCK_K of H (1, 2, 4 or 8, at most the steps;
    None: the fewest waves for the GPU's SMs, `kernels.fewest_waves`)."""
    T, H = x.shape
    E = weight.shape[0]
    if E > 256 or top_k > E:
        raise ValueError(f"the fused router takes at most 256 experts and top-k <= experts (got {E}, {top_k})")
    out_w = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    out_i = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    if T:
        block_e = max(16, triton.next_power_of_2(E))
        blocks = triton.cdiv(T, BLOCK_T)
        steps = triton.cdiv(H, BLOCK_K)
        S = splits or fewest_waves(x.device, blocks, [s for s in (1, 2, 4, 8) if s <= steps])
        if S not in (1, 2, 4, 8) or S > steps:
            raise ValueError(f"the router splits its {steps} steps of {BLOCK_K} inputs 1, 2, 4 or 8 ways (got {S})")
        KS = triton.cdiv(steps, S) * BLOCK_K  # each program's inputs: whole steps
        parts = torch.empty(S, T, block_e, dtype=torch.float32, device=x.device) if S > 1 else out_w  # unused at 1
        count = tile_counters("router", x.device, blocks) if S > 1 else out_i
        router_kernel[(blocks, S)](
            x.contiguous(), scale, weight.contiguous(), per_expert_scale, out_w, out_i, parts, count, T, H, E, KS,
            float(H ** -0.5), float(eps), BLOCK_T, block_e, BLOCK_K, top_k, triton.next_power_of_2(top_k),
            interpreting(), S, num_warps=4)
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
