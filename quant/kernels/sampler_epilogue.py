"""The sampler's per-step epilogue fused into one kernel over the logits, in place: temperature, softmax, entropy,
argmax and a sample, leaving the probabilities where the logits were (they feed the next step's
self-conditioning). The only canvas x vocab buffer is the logits one.

Operands: logits float32 [R, V] (R = batch x canvas rows, contiguous), temperature float32 [1], seed int64 [1]
(device tensors, so a captured graph replays with new values). Outputs: argmax int64 [R], sample int64 [R],
entropy float32 [R]; logits[r] is overwritten with softmax(logits[r] / temperature). The same seed draws the same
samples.

One program per row, two sweeps over V in BLOCK_V chunks (full chunks unmasked, the last partial one masked), so
the loops cost little more than reading the logits twice and writing them once: with c = log2(e) / t (one division
per row), z = l / t is handled in base 2 as x = l * c - m * c, one fused multiply-add per element.
1. Read: the running max m of the raw logits and s = sum 2^(l c - m c) (rescaled by 2^(m_old c - m_new c), per
   chunk, when m grows); the first chunk holding the max is remembered and read again once after the sweep for the
   argmax (the first index of the largest logit, which is torch's argmax of l / t unless the division rounds two
   different logits to the same value).
2. Read and write: p = 2^x / s over the logits, with the chunk sums of p and of p x (x clamped at -1000, so a -inf
   logit adds 0, not nan). Entropy = -sum p ln p = ln s * sum p - ln 2 * sum p x. The sample is drawn by inverse CDF
   with one uniform u per row (Philox keyed by (seed, row)): the sweep keeps the running sum of the chunk sums and
   notes the chunk where it first exceeds u; after the sweep that chunk is read back (its probabilities, just
   written) and the sample is the first index where the running sum within it, tl.cumsum, passes u minus the mass
   before it. This draws index v with probability p_v, up to the float32 rounding of the running sums.
   Rounding can leave the total a few ulps short of u, or the chunk's scan short of its tree sum: then the sample is
   the last entry with p > 0 of that chunk (or of the last chunk holding mass), so it is always a valid index with
   p > 0, never a zero-probability entry (a -inf or underflowed logit).
Compiled for sm_89/90/120 the loops issue about 6 (sweep 1) and 9 (sweep 2) instructions per logit, against about
146 and 14 for the Gumbel-max version this replaced (a Philox draw and two logs per logit): far below what reading
the logits costs (scripts/kernel_report.py).
A row needs one logit above -1e30 (the running max starts there, which keeps an all -inf chunk from making nan).
The sample is a different random stream from the torch path's (an exponential race with torch's generator): the
same distribution, not the same draws, which is why DGEMMA_KERNELS=triton uses this epilogue only on CUDA.
"""

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _max_chunk(base, v0, V, c, m, s, best_v0, offs, MASKED: tl.constexpr):
    """Sweep 1 over logits[v0 : v0 + BLOCK_V]: running max, rescaled sum of 2^(l c - m c), chunk of the max."""
    if MASKED:
        l = tl.load(base + v0 + offs, mask=v0 + offs < V, other=-float("inf"))
    else:
        l = tl.load(base + v0 + offs)
    cmax = tl.max(l, axis=0)
    best_v0 = tl.where(cmax > m, v0, best_v0)
    m_new = tl.maximum(m, cmax)
    mc = m_new * c
    s = s * tl.exp2(m * c - mc) + tl.sum(tl.exp2(l * c - mc), axis=0)
    return m_new, s, best_v0


@triton.jit
def _prob_chunk(base, v0, V, c, mc, inv_s, u, run, w, hit, before, last_nz, offs, MASKED: tl.constexpr):
    """Sweep 2 over logits[v0 : v0 + BLOCK_V]: write p, sum p and p x, note where the running sum passes u."""
    if MASKED:
        live = v0 + offs < V
        l = tl.load(base + v0 + offs, mask=live, other=-float("inf"))
    else:
        l = tl.load(base + v0 + offs)
    x = tl.maximum(l * c - mc, -1000.0)  # 2^-1000 is 0: a -inf logit gives p = 0 and p x = 0
    p = tl.exp2(x) * inv_s
    if MASKED:
        tl.store(base + v0 + offs, p, mask=live)
    else:
        tl.store(base + v0 + offs, p)
    cs = tl.sum(p, axis=0)
    w += tl.sum(p * x, axis=0)
    crossed = (run + cs > u) & (hit < 0)
    hit = tl.where(crossed, v0, hit)
    before = tl.where(crossed, run, before)
    last_nz = tl.where(cs > 0, v0, last_nz)
    return run + cs, w, hit, before, last_nz


@triton.jit
def sampler_epilogue_kernel(logits_ptr, temp_ptr, seed_ptr, argmax_ptr, sample_ptr, entropy_ptr, V,
                            BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * V
    c = LOG2E / tl.load(temp_ptr)
    offs = tl.arange(0, BLOCK_V)
    V_full = V - V % BLOCK_V
    # sweep 1: max, sum, the chunk holding the first max
    m = -1e30
    s = 0.0
    best_v0 = 0
    for v0 in range(0, V_full, BLOCK_V):
        m, s, best_v0 = _max_chunk(base, v0, V, c, m, s, best_v0, offs, False)
    if V_full < V:
        m, s, best_v0 = _max_chunk(base, V_full, V, c, m, s, best_v0, offs, True)
    l = tl.load(base + best_v0 + offs, mask=best_v0 + offs < V, other=-float("inf"))
    best = best_v0 + tl.argmax(l, axis=0)  # first index of the max (argmax breaks ties to the left)
    tl.store(argmax_ptr + row, best.to(tl.int64))
    # sweep 2: probabilities in place, entropy sums, the chunk where the CDF passes u
    mc = m * c
    inv_s = 1.0 / s
    u = tl.rand(tl.load(seed_ptr), row)  # [0, 1)
    run = 0.0  # sum of p so far
    w = 0.0  # sum of p x so far
    hit = -1  # first chunk where run passes u
    before = 0.0  # run before that chunk
    last_nz = 0  # last chunk with mass
    for v0 in range(0, V_full, BLOCK_V):
        run, w, hit, before, last_nz = _prob_chunk(base, v0, V, c, mc, inv_s, u, run, w, hit, before, last_nz, offs,
                                                   False)
    if V_full < V:
        run, w, hit, before, last_nz = _prob_chunk(base, V_full, V, c, mc, inv_s, u, run, w, hit, before, last_nz,
                                                   offs, True)
    tl.store(entropy_ptr + row, tl.log(s) * run - LN2 * w)
    # the sample: inverse CDF inside the chosen chunk, read back from the probabilities just written
    found = hit >= 0
    v0 = tl.where(found, hit, last_nz)
    target = tl.where(found, u - before, float("inf"))
    tl.debug_barrier()  # other threads of this program wrote the chunk
    cols = v0 + offs
    p = tl.load(base + cols, mask=cols < V, other=0.0)
    pos = p > 0
    first = tl.min(tl.where((tl.cumsum(p, axis=0) > target) & pos, cols, V), axis=0)
    last = tl.max(tl.where(pos, cols, -1), axis=0)
    pick = tl.where(first < V, first, tl.where(last >= 0, last, best))  # best: only for a row without mass
    tl.store(sample_ptr + row, pick.to(tl.int64))


def sampler_epilogue(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, *, block_v: int = 4096):
    """logits float32 [R, V] (overwritten with probabilities) -> (sample, argmax, entropy), each [R].

    block_v (a power of two) is the chunk width; the default suits the real vocabulary, tests shrink it to cover
    several chunks and a partial one at small V."""
    R, V = logits.shape
    argmax = torch.empty(R, dtype=torch.int64, device=logits.device)
    sample = torch.empty_like(argmax)
    entropy = torch.empty(R, dtype=torch.float32, device=logits.device)
    temp = temperature.reshape(1).float()
    sampler_epilogue_kernel[(R,)](logits, temp, seed.reshape(1), argmax, sample, entropy, V,
                                  BLOCK_V=min(block_v, triton.next_power_of_2(V)), num_warps=4)
    return sample, argmax, entropy
