"""The sampler's per-step epilogue fused into one pass over the logits, in place: temperature, softmax, entropy,
argmax and a sample, leaving the probabilities where the logits were (they feed the next step's
self-conditioning). The only canvas x vocab buffer is the logits one.

Operands: logits float32 [R, V] (R = batch x canvas rows, contiguous), temperature float32 [1], seed int64 [1]
(device tensors, so a captured graph replays with new values). Outputs: argmax int64 [R], sample int64 [R],
entropy float32 [R]; logits[r] is overwritten with softmax(logits[r] / temperature).

One program per row, two sweeps over V in BLOCK_V chunks:
1. z = l / t; running max m, sum s = sum exp(z - m) and w = sum exp(z - m) z (rescaled when m grows); the first
   index of the largest z (argmax); and a Gumbel-max sample: the index of the largest z + g, g = -log(-log u), u
   uniform from Philox keyed by (seed, r * V + v), which draws index v with probability softmax(z)_v.
   Entropy = log s + m - w / s.
2. p = exp(z - m) / s written over the logits.
The sample is a different random stream from the torch path's (an exponential race with torch's generator): the
same distribution, not the same draws, which is why DGEMMA_KERNELS=triton uses this epilogue only on CUDA.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def sampler_epilogue_kernel(logits_ptr, temp_ptr, seed_ptr, argmax_ptr, sample_ptr, entropy_ptr, V,
                            BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * V
    t = tl.load(temp_ptr)
    seed = tl.load(seed_ptr)
    m = -float("inf")
    s = 0.0
    w = 0.0
    best = -float("inf")
    best_i = 0
    draw = -float("inf")
    draw_i = 0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        live = cols < V
        z = tl.load(base + cols, mask=live, other=-float("inf")) / t
        cmax = tl.max(z, axis=0)
        m_new = tl.maximum(m, cmax)
        alpha = tl.exp(m - m_new)
        e = tl.where(live, tl.exp(z - m_new), 0.0)
        s = s * alpha + tl.sum(e, axis=0)
        w = w * alpha + tl.sum(e * tl.where(live, z, 0.0), axis=0)
        m = m_new
        i = tl.argmax(z, axis=0)  # first index of the chunk's max
        better = cmax > best
        best_i = tl.where(better, v0 + i, best_i)
        best = tl.where(better, cmax, best)
        u = tl.rand(seed, row.to(tl.int64) * V + cols)
        u = tl.minimum(tl.maximum(u, 1e-10), 1.0 - 1e-7)
        g = tl.where(live, z - tl.log(-tl.log(u)), -float("inf"))
        gmax = tl.max(g, axis=0)
        j = tl.argmax(g, axis=0)
        take = gmax > draw
        draw_i = tl.where(take, v0 + j, draw_i)
        draw = tl.where(take, gmax, draw)
    tl.store(entropy_ptr + row, tl.log(s) + m - w / s)
    tl.store(argmax_ptr + row, best_i.to(tl.int64))
    tl.store(sample_ptr + row, draw_i.to(tl.int64))
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        live = cols < V
        z = tl.load(base + cols, mask=live, other=0.0) / t
        tl.store(base + cols, tl.exp(z - m) / s, mask=live)


def sampler_epilogue(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor):
    """logits float32 [R, V] (overwritten with probabilities) -> (sample, argmax, entropy), each [R]."""
    R, V = logits.shape
    argmax = torch.empty(R, dtype=torch.int64, device=logits.device)
    sample = torch.empty_like(argmax)
    entropy = torch.empty(R, dtype=torch.float32, device=logits.device)
    temp = temperature.reshape(1).float()
    sampler_epilogue_kernel[(R,)](logits, temp, seed.reshape(1), argmax, sample, entropy, V,
                                  BLOCK_V=min(4096, triton.next_power_of_2(V)))
    return sample, argmax, entropy
