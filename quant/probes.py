"""The problem each Triton kernel family is checked on at its first use on a GPU (quant/kernels/probe.py keeps the
verdicts): a small seeded problem with partial tiles, built from the quantized modules and the formats' own
quantization, run through the family's kernel and compared with the torch path. Importing the quant package
registers them (quant/__init__.py), so the kernels never import the modules above them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels.probe import TOL, measured, register

# Each builds its problem on the CPU from its own seeded generator (torch's global generator is left alone: it
# drives the sampler's reproducible draws), moves it to the device, and returns None or a short mismatch reason.


def _rel_error(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> str | None:
    if got.shape != ref.shape or not torch.isfinite(got).all():
        return f"shape {tuple(got.shape)} or non-finite values"
    err = ((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1e-30)).item()
    measured.append(err / TOL[dtype])  # what `dgemma doctor` reports: the error as a fraction of its tolerance
    return None if err <= TOL[dtype] else f"relative error {err:.1e} > {TOL[dtype]:.0e} in {str(dtype)[6:]}"


def weight_dtype(fmt: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the reference's dequantized weights: NVFP4 kernels multiply exact a * scale products and apply
    the global scale to the float32 sum (kernels/common.py), so their reference is the float32 weight; INT8 kernels
    round each weight to the compute dtype, as the torch path does."""
    return torch.float32 if fmt == "nvfp4" else dtype


def _linear(fmt: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """33 rows x K 96 -> N 80: partial tiles in M, N and K. The reference is x @ dequantized W (float64 products,
    so a TF32 setting of torch's own matmul cannot shift it)."""
    from . import int8, nvfp4
    from .modules import Int8Linear, NVFP4Linear

    g = torch.Generator().manual_seed(0)
    M, N, K = 33, 80, 96
    w = torch.randn(N, K, generator=g)
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    if fmt == "nvfp4":
        from .kernels.nvfp4_linear import nvfp4_linear

        m = NVFP4Linear.from_weight(nvfp4.quantize(w)).to(device)
        got = nvfp4_linear(x, m.weight, m.weight_scale, m.weight_scale_2.expand(N))
    else:
        from .kernels.int8_linear import int8_linear

        m = Int8Linear.from_weight(int8.quantize(w)).to(device)
        got = int8_linear(x, m.weight, m.weight_scale)
    return _rel_error(got, x.double() @ m.dequantize(weight_dtype(fmt, dtype)).double().T, dtype)


def _moe(fmt: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """33 tokens, 6 experts (one never routed to), top-2, hidden 64, width 48 (a partial tile) through
    `fused_experts`, against the reference expert math on the dequantized stacks: gate/up product rounded to the
    compute dtype, gelu_tanh(gate) * up, down product rounded, float32 weighted sum over the slots."""
    from .modules import Int8Stack, NVFP4Stack, fused_experts

    g = torch.Generator().manual_seed(0)
    T, E, H, I, top = 33, 6, 64, 48, 2
    gu_w, dn_w = torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1
    if fmt == "nvfp4":  # gate and up with their own global scales
        gu, dn = NVFP4Stack.from_weights(gu_w, segments=2), NVFP4Stack.from_weights(dn_w)
    else:
        gu, dn = Int8Stack.from_weights(gu_w), Int8Stack.from_weights(dn_w)
    gu, dn = gu.to(device), dn.to(device)
    x = torch.randn(T, H, generator=g).to(dtype).to(device)
    index = torch.stack([torch.randperm(E - 1, generator=g)[:top] for _ in range(T)]).to(device)  # [T, top]
    weights = torch.rand(T, top, generator=g).to(device)  # float32, as the router's
    got = fused_experts(gu, dn, x, index, weights)
    if got is None:
        return "the fused path was not selected"
    ref = expert_math(gu.dequantize(weight_dtype(fmt, dtype)), dn.dequantize(weight_dtype(fmt, dtype)), x, index,
                      weights)
    return _rel_error(got, ref, dtype)


def expert_math(w_gu: torch.Tensor, w_dn: torch.Tensor, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                lora=None) -> torch.Tensor:
    """The routed experts as the fused kernels compute them, in float64 with the compute dtype's roundings: gate/up
    product (+ the adapters' term) rounded, gelu_tanh(gate) * up, down product (+ term) rounded, float32 weighted
    sum over the slots. w_gu [E, 2I, H], w_dn [E, H, I]; lora: kernels/moe_lora.ExpertAdapters, whose term is
    (x A_e^T masked to each token's adapter, rounded) B_e^T, added to the product before its rounding."""
    dtype = x.dtype

    def product(inp, w, factors):  # inp [T, top, K], w [E, N, K] -> [T, top, N] rounded to the compute dtype
        out = torch.einsum("tkc,tknc->tkn", inp.double(), w.double()[index])
        if factors is not None:
            t = torch.einsum("tkc,tkrc->tkr", inp.double(), factors.A.double()[index])
            if lora.token_slots is not None:
                t = t * (lora.token_slots[:, None, None] == factors.slot[None, None, :]).double()
            t = t.to(dtype).double()
            out = out + torch.einsum("tkr,tknr->tkn", t, factors.B.double()[index])
        return out.to(dtype)

    top = index.shape[1]
    h = product(x[:, None, :].expand(-1, top, -1), w_gu, lora and lora.gate_up)  # [T, top, 2I]
    gate, up = h.chunk(2, dim=-1)
    a = F.gelu(gate, approximate="tanh") * up  # [T, top, I] in the compute dtype
    y = product(a, w_dn, lora and lora.down)  # [T, top, H]
    return (y.float() * weights[..., None]).sum(dim=1).to(dtype)


def _moe_lora(device: torch.device, dtype: torch.dtype) -> str | None:
    """`_moe`'s NVFP4 problem (17 tokens) with two adapters' terms on gate-up and down (ranks 8 and 4, stacked and
    padded to 16), each token choosing adapter 0 (none), 1 or 2, against `expert_math`."""
    from .kernels.moe_lora import ExpertAdapters, LoRAFactors
    from .modules import NVFP4Stack, fused_experts

    g = torch.Generator().manual_seed(1)
    T, E, H, I, top = 17, 6, 64, 48, 2
    gu = NVFP4Stack.from_weights(torch.randn(E, 2 * I, H, generator=g) * 0.1, segments=2).to(device)
    dn = NVFP4Stack.from_weights(torch.randn(E, H, I, generator=g) * 0.1).to(device)
    slot = torch.tensor([1] * 8 + [2] * 4 + [-1] * 4, dtype=torch.int32)
    live = (slot >= 0).float()

    def factors(n: int, k: int) -> LoRAFactors:
        A = torch.randn(E, 16, k, generator=g) * 0.3 * live[None, :, None]
        B = torch.randn(E, n, 16, generator=g) * 0.3 * live[None, None, :]
        return LoRAFactors(A.to(dtype).to(device), B.to(dtype).to(device), slot.to(device))

    lora = ExpertAdapters(factors(2 * I, H), factors(H, I), torch.randint(0, 3, (T,), generator=g).to(device))
    x = torch.randn(T, H, generator=g).to(dtype).to(device)
    index = torch.stack([torch.randperm(E - 1, generator=g)[:top] for _ in range(T)]).to(device)
    weights = torch.rand(T, top, generator=g).to(device)
    got = fused_experts(gu, dn, x, index, weights, lora=lora)
    if got is None:
        return "the fused path was not selected"
    ref = expert_math(gu.dequantize(torch.float32), dn.dequantize(torch.float32), x, index, weights, lora)
    err = _rel_error(got, ref, dtype)
    from .kernels.nvfp4_w4a4 import supported

    if err is not None or not supported(device):
        return err
    # where the experts run W4A4 (FP4 tensor cores), its kernels with the terms too: widths of 64, its emulation
    from .kernels import moe_w4a4
    from .kernels.routing import moe_blocks

    I = 64
    gu = NVFP4Stack.from_weights(torch.randn(E, 2 * I, H, generator=g) * 0.1, segments=2)
    dn = NVFP4Stack.from_weights(torch.randn(E, H, I, generator=g) * 0.1)
    lora = ExpertAdapters(factors(2 * I, H), factors(H, I), lora.token_slots)
    ids, block_expert = moe_blocks(index, E, 16)
    got = moe_w4a4.moe_w4a4(x, ids, block_expert, gu.to(device), dn.to(device), weights.reshape(-1), T, top, 16,
                            lora=lora)
    cpu = ExpertAdapters(*(LoRAFactors(f.A.cpu(), f.B.cpu(), f.slot.cpu()) for f in lora[:2]),
                         lora.token_slots.cpu())
    return _rel_error(got.cpu(), moe_w4a4.reference(x.cpu(), gu, dn, index.cpu(), weights.cpu(), lora=cpu), dtype)


def _head(device: torch.device, dtype: torch.dtype) -> str | None:
    """37 rows x hidden 96 x vocab 1,000 (two chunks of 512, a partial tile of 256 at the end, a partial row tile):
    the fused head's draws, argmax, entropy and soft embedding against the same head in float32 torch ops from the
    same uniforms (head.head_reference)."""
    from .kernels.head import HeadBuffers, fused_head, head_reference

    g = torch.Generator().manual_seed(0)
    R, H, V = 37, 96, 1000
    h = torch.randn(R, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    t = torch.rand(R, generator=g) * 0.6 + 0.3
    u = torch.rand(R, 2, generator=g)
    buf = HeadBuffers(R, V, H, dtype, device, chunk=512, tile=256)
    fused_head(h.to(device), w.to(device), 30.0, H**0.5, t.to(device), u.to(device), buf)
    sample, argmax, entropy, soft = head_reference(h, w, 30.0, H**0.5, t, u, tile=256)
    if not ((buf.sample.cpu() >= 0) & (buf.sample.cpu() < V)).all():
        return "a sample out of range"
    if (buf.sample.cpu() != sample).sum() > 1:  # a uniform within rounding of a boundary may pick the neighbour
        return f"{int((buf.sample.cpu() != sample).sum())} of {R} draws differ"
    if (buf.argmax.cpu() != argmax).any():
        return "argmax differs"
    err = (buf.entropy.cpu() - entropy).abs().max().item()
    if err > 1e-4:
        return f"entropy differs by {err:.1e}"
    return _rel_error(buf.soft.cpu(), soft, torch.bfloat16)


def _w4a4(device: torch.device, dtype: torch.dtype) -> str | None:
    """33 rows x K 256 -> N 130 (partial tiles in M and N), x quantized per token on the GPU and multiplied in FP4,
    against the PyTorch emulation of the same quantization (nvfp4_w4a4.reference): the activation codes and scales
    equal, the product within the kernel tests' tolerance."""
    from . import nvfp4
    from .kernels.nvfp4_act import quantize_act, quantize_act_reference
    from .kernels.nvfp4_w4a4 import nvfp4_w4a4, reference

    g = torch.Generator().manual_seed(0)
    M, N, K = 33, 130, 256
    q = nvfp4.quantize(torch.randn(N, K, generator=g))
    x = torch.randn(M, K, generator=g).to(dtype)
    codes, scales, _ = quantize_act(x.to(device))
    ref_codes, ref_scales, _ = quantize_act_reference(x)
    if not (torch.equal(codes.cpu(), ref_codes) and torch.equal(scales.cpu(), ref_scales)):
        return "activation codes or scales differ"
    args = (q.weight, q.weight_scale, q.weight_scale_2.expand(N))
    got = nvfp4_w4a4(x.to(device), *(a.to(device) for a in args))
    return _rel_error(got.cpu(), reference(x, *args), dtype)


def _w4a4_gated(device: torch.device, dtype: torch.dtype) -> str | None:
    """The gated MLP's first half in W4A4 (a second weight, x quantized once for both, the two weight tiles as one
    product) on 33 rows x K 256 -> N 130, against the emulation of the three ops."""
    from . import nvfp4
    from .kernels.nvfp4_w4a4 import nvfp4_w4a4, reference

    g = torch.Generator().manual_seed(0)
    M, N, K = 33, 130, 256
    q = nvfp4.quantize(torch.randn(N, K, generator=g))
    x = torch.randn(M, K, generator=g).to(dtype)
    args = (q.weight, q.weight_scale, q.weight_scale_2.expand(N))
    u = nvfp4.quantize(torch.randn(N, K, generator=g))
    up = (u.weight, u.weight_scale, u.weight_scale_2.expand(N))
    got = nvfp4_w4a4(x.to(device), *(a.to(device) for a in args), up=tuple(a.to(device) for a in up))
    want = torch.nn.functional.gelu(reference(x, *args), approximate="tanh") * reference(x, *up)
    return _rel_error(got.cpu(), want, dtype)


def _w8a8_linear(kind: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """33 rows x K 256 -> q, k, v of 130, 64 and 40 columns in one launch, and a gated pair of 130, against the
    float32 emulation of the same 8-bit products (w8a8.matmul_emulated, torch's gelu)."""
    from . import w8a8
    from .kernels.w8a8_linear import w8a8_linear

    g = torch.Generator().manual_seed(0)
    K = 256
    x = torch.randn(33, K, generator=g).to(dtype)
    ws = [w8a8.quantize(torch.randn(n, K, generator=g), kind) for n in (130, 64, 40, 130)]
    ws = [(q, s.float()) for q, s in ws]
    quantized = w8a8.quantize_tokens(x, kind)
    on = [tuple(t.to(device) for t in w) for w in ws]
    xd, qd = x.to(device), tuple(t.to(device) for t in quantized)
    got = w8a8_linear(xd, qd, *on[0], more=on[1:3])
    for y, w in zip(got, ws[:3]):
        err = _rel_error(y.cpu(), w8a8.matmul_emulated(x, *w, kind), dtype)
        if err is not None:
            return err
    gated = w8a8_linear(xd, qd, *on[0], up=on[3])
    want = (torch.nn.functional.gelu(w8a8.matmul_emulated(x, *ws[0], kind), approximate="tanh")
            * w8a8.matmul_emulated(x, *ws[3], kind))
    return _rel_error(gated.cpu(), want, dtype)


def _gelu_mul(device: torch.device, dtype: torch.dtype) -> str | None:
    """gelu_tanh(gate) * up over 3 x 1,037 values (a partial block) against torch's two ops."""
    from .kernels.gelu_mul import gelu_mul, reference

    g = torch.Generator().manual_seed(0)
    gate, up = ((torch.randn(3, 1037, generator=g) * 3).to(dtype) for _ in range(2))
    return _rel_error(gelu_mul(gate.to(device), up.to(device)).cpu(), reference(gate, up), dtype)


def _moe_w4a4(device: torch.device, dtype: torch.dtype) -> str | None:
    """17 tokens, 6 experts (one never routed to), top-2, hidden 64, width 64, through the W4A4 expert kernels,
    against their PyTorch emulation (moe_w4a4.reference)."""
    from .modules import NVFP4Stack
    from .kernels.moe_w4a4 import moe_w4a4, reference
    from .kernels.routing import moe_blocks

    g = torch.Generator().manual_seed(0)
    T, E, H, I, top = 17, 6, 64, 64, 2
    gu = NVFP4Stack.from_weights(torch.randn(E, 2 * I, H, generator=g) * 0.1, segments=2)
    dn = NVFP4Stack.from_weights(torch.randn(E, H, I, generator=g) * 0.1)
    x = torch.randn(T, H, generator=g).to(dtype)
    index = torch.stack([torch.randperm(E - 1, generator=g)[:top] for _ in range(T)])
    weights = torch.rand(T, top, generator=g)
    ids, block_expert = moe_blocks(index.to(device), E, 16)
    got = moe_w4a4(x.to(device), ids, block_expert, gu.to(device), dn.to(device), weights.reshape(-1).to(device), T,
                   top, 16)
    return _rel_error(got.cpu(), reference(x, gu, dn, index, weights), dtype)


def _moe_w8a8(kind: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """17 tokens, 6 experts (one never routed to), top-2, hidden 64, width 48 (partial tiles), W8A8 experts with
    8-bit activations, against the PyTorch emulation of the same quantization (moe_w8a8.reference_*), stage by stage
    so that one activation code flipped by a last-bit difference in gelu cannot fail it: the token codes and scales
    equal; h within float32 rounding; the down outputs from the kernel's own h, and the whole path's output with the
    same launch settings, within the kernel tests' tolerance."""
    from .modules import W8A8Stack
    from . import w8a8
    from .kernels.moe_w8a8 import (candidates, down_w8a8, gate_up_w8a8, moe_w8a8, quantize_rows, reference_down,
                           reference_gate_up)
    from .kernels.routing import moe_blocks

    g = torch.Generator().manual_seed(0)
    T, E, H, I, top = 17, 6, 64, 48, 2
    gu = W8A8Stack.from_weights(torch.randn(E, 2 * I, H, generator=g) * 0.1, kind)
    dn = W8A8Stack.from_weights(torch.randn(E, H, I, generator=g) * 0.1, kind)
    x = torch.randn(T, H, generator=g).to(dtype)
    index = torch.stack([torch.randperm(E - 1, generator=g)[:top] for _ in range(T)])
    weights = torch.rand(T, top, generator=g)
    gu_d, dn_d = gu.to(device), dn.to(device)
    xq, xs = quantize_rows(x.to(device), kind)
    ref_q, ref_s = w8a8.quantize_tokens(x, kind)
    if not (torch.equal(xq.cpu(), ref_q.view(xq.dtype)) and torch.equal(xs.cpu(), ref_s[:, 0])):
        return "activation codes or scales differ"
    cfg = candidates(T * top / E, H, I, device)[0]
    ids, block_expert = moe_blocks(index.to(device), E, cfg["BLOCK_M"])
    h = gate_up_w8a8(xq, xs, ids, block_expert, gu_d, top, cfg)
    live = (ids >= 0).cpu()
    h_tk = torch.empty(T * top, I)
    h_tk[ids.cpu()[live].long()] = h.cpu()[live]  # back to assignment order
    err = _rel_error(h_tk, reference_gate_up(x, gu, index).reshape(T * top, I), torch.float32)
    if err is not None:
        return f"gate-up: {err}"
    hq, hs = quantize_rows(h, kind, ids)
    ys = down_w8a8(hq, hs, ids, block_expert, dn_d, T, top, cfg)
    ref_ys, ref_y = reference_down(h_tk.view(T, top, I), dn, index, weights, dtype)
    err = _rel_error(ys.cpu(), ref_ys.reshape(T * top, H), torch.float32)
    if err is not None:
        return f"down: {err}"
    got = moe_w8a8(x.to(device), ids, block_expert, gu_d, dn_d, weights.reshape(-1).to(device), T, top, cfg)
    return _rel_error(got.cpu(), ref_y, dtype)


def _rms_norm(device: torch.device, dtype: torch.dtype) -> str | None:
    """5 x 2 tokens of 3 rows of width 96 (a partial block) through the pre-add, the weight, the residual and the
    scale; then heads of 64 with RoPE at per-batch angles: against the torch ops the model runs."""
    from .kernels.rmsnorm import rms_norm

    g = torch.Generator().manual_seed(0)
    a, a2, r = (torch.randn(2, 5, 3, 96, generator=g).to(dtype) for _ in range(3))
    w, s = torch.rand(96, generator=g).to(dtype) + 0.5, torch.tensor(0.75, dtype=dtype)
    x = (a + a2).float()
    n = (x * torch.pow(x.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5) * w.float()).to(dtype)
    got = rms_norm(*(t.to(device) for t in (a, w)), 1e-6, a2=a2.to(device), residual=r.to(device),
                   scale=s.to(device))
    err = _rel_error(got.cpu(), (r + n) * s, dtype)
    if err is not None:
        return err
    q, w = torch.randn(2, 5, 3, 64, generator=g).to(dtype), torch.rand(64, generator=g).to(dtype) + 0.5
    cos, sin = (torch.rand(2, 5, 1, 64, generator=g).to(dtype) for _ in range(2))
    xf = q.float()
    n = (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5) * w.float()).to(dtype)
    ref = (n * cos) + (torch.cat((-n[..., 32:], n[..., :32]), dim=-1) * sin)
    got = rms_norm(q.to(device), w.to(device), 1e-6, cos=cos.to(device), sin=sin.to(device))
    return _rel_error(got.cpu(), ref, dtype)


def _softcap(device: torch.device, dtype: torch.dtype) -> str | None:
    """5,003 bfloat16 logits (a partial block) converted and capped at 30 against torch's tanh."""
    from .kernels.softcap import softcap_into

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5003, generator=g) * 40).to(torch.bfloat16)
    ref = torch.tanh(x.float() / 30.0) * 30.0
    got = softcap_into(torch.empty(5003, device=device), x.to(device), 30.0)
    return _rel_error(got.cpu(), ref, torch.float32)


def _lora(device: torch.device, dtype: torch.dtype) -> str | None:
    """A rank-12 adapter's term on 70 rows (every third masked out), 200 x 96, added to y, against torch's ops."""
    from .kernels.lora import lora_add_

    g = torch.Generator().manual_seed(0)
    x, A, B = (torch.randn(70, 96, generator=g), torch.randn(12, 96, generator=g) * 0.3,
               torch.randn(200, 12, generator=g) * 0.3)
    y = torch.randn(70, 200, generator=g)
    mask = (torch.arange(70) % 3 != 0).float()
    ref = y.to(dtype).float() + (x.to(dtype).float() @ A.to(dtype).float().T @ B.to(dtype).float().T) * 0.5 * mask[:, None]
    got = lora_add_(y.to(dtype).to(device), x.to(dtype).to(device), A.to(dtype).to(device), B.to(dtype).to(device),
                    0.5, mask.to(device))
    return _rel_error(got.cpu().float(), ref, dtype)


def linear_lora_math(x: torch.Tensor, w: torch.Tensor, adapters) -> torch.Tensor:
    """x @ W^T plus the adapters' term (kernels/lora.LinearAdapters: (x A^T masked to each row's adapter, rounded)
    B^T), in float64 before one rounding to x's dtype, as the NVFP4 linear kernel's epilogue adds it. x [B, T, K]."""
    out = x.double() @ w.double().T
    if adapters is not None:
        f = adapters.factors
        t = x.double() @ f.A.double().T  # [B, T, R]
        if adapters.row_slots is not None:
            t = t * (adapters.row_slots[:, None, None] == f.slot[None, None, :]).double()
        out = out + t.to(x.dtype).double() @ f.B.double().T
    return out.to(x.dtype)


def _lora_epilogue(device: torch.device, dtype: torch.dtype) -> str | None:
    """NVFP4 linears 96 -> 80 on 3 rows of 11 tokens (partial tiles) with two adapters' terms (ranks 8 and 4, stacked
    to 16) in the kernel's epilogue, rows choosing adapter 0, 1 or 2: the plain linear and the gated pair (gate and
    up each with their terms, before the activation), against `linear_lora_math`."""
    from . import nvfp4
    from .kernels.lora import LinearAdapters, LinearFactors
    from .kernels.nvfp4_linear import nvfp4_linear
    from .modules import NVFP4Linear

    g = torch.Generator().manual_seed(2)
    N, K = 80, 96
    slot = torch.tensor([1] * 8 + [2] * 4 + [-1] * 4, dtype=torch.int32)
    rows = torch.tensor([0, 1, 2], dtype=torch.int32)

    def adapters() -> LinearAdapters:
        A = torch.randn(16, K, generator=g) * 0.3 * (slot >= 0)[:, None]
        B = torch.randn(N, 16, generator=g) * 0.3 * (slot >= 0)[None, :]
        return LinearAdapters(LinearFactors(A.to(dtype).to(device), B.to(dtype).to(device), slot.to(device)),
                              rows.to(device))

    gate, up = (NVFP4Linear.from_weight(nvfp4.quantize(torch.randn(N, K, generator=g))).to(device) for _ in "gu")
    lg, lu = adapters(), adapters()
    x = torch.randn(3, 11, K, generator=g).to(dtype).to(device)
    wg, wu = gate.dequantize(torch.float32), up.dequantize(torch.float32)
    s2g, s2u = gate.weight_scale_2.expand(N), up.weight_scale_2.expand(N)  # (no kept copy: inference tensors here)
    got = nvfp4_linear(x, gate.weight, gate.weight_scale, s2g, lora=lg)
    err = _rel_error(got, linear_lora_math(x, wg, lg), dtype)
    if err is not None:
        return err
    got = nvfp4_linear(x, gate.weight, gate.weight_scale, s2g, up=(up.weight, up.weight_scale, s2u), lora=lg,
                       lora_up=lu)
    ref = F.gelu(linear_lora_math(x, wg, lg), approximate="tanh") * linear_lora_math(x, wu, lu)
    err = _rel_error(got, ref, dtype)
    from .kernels.nvfp4_w4a4 import nvfp4_w4a4, reference, supported

    if err is not None or not supported(device):
        return err
    # where linears run W4A4 (FP4 tensor cores), its kernel with the terms too, against its emulation
    got = nvfp4_w4a4(x, gate.weight, gate.weight_scale, s2g, lora=lg)
    cpu = LinearAdapters(LinearFactors(*(t.cpu() for t in (lg.factors.A, lg.factors.B, lg.factors.slot))),
                         lg.row_slots.cpu())
    return _rel_error(got.cpu(), reference(x.cpu(), *(t.cpu() for t in (gate.weight, gate.weight_scale, s2g)),
                                           lora=cpu), dtype)


def _moe_plan(device: torch.device, dtype: torch.dtype) -> str | None:
    """70 tokens, top-8 of 128 experts with one expert taking most (a block of several), 16 rows a block: the plan
    equal to the torch one's, bit for bit."""
    from .kernels.moe_plan import moe_blocks_fused
    from .kernels.routing import moe_blocks

    g = torch.Generator().manual_seed(0)
    index = torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(70)])
    index[:40, 0] = 5
    want = moe_blocks(index, 128, 16)
    got = moe_blocks_fused(index.to(device), 128, 16)
    same = all(torch.equal(a, b.cpu()) for a, b in zip(want, got))
    return None if same else "a different block plan"


def _router(device: torch.device, dtype: torch.dtype) -> str | None:
    """37 tokens (a partial block), hidden 200 (a partial tile), top-8 of 128: the experts chosen as the torch ops
    choose them for at least 35 tokens (a near-tie may swap), the weights within the dtype's tolerance where equal."""
    from .kernels.router import route, route_reference

    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 200, generator=g).to(dtype)
    scale = (torch.rand(200, generator=g) + 0.5).to(dtype)
    w = (torch.randn(128, 200, generator=g) * 0.2).to(dtype)
    pes = (torch.rand(128, generator=g) + 0.5).to(dtype)
    want_w, want_i = route_reference(x, scale, w, pes, 8, 1e-6)
    got_w, got_i = (t.cpu() for t in route(*(t.to(device) for t in (x, scale, w, pes)), 8, 1e-6))
    # compared as sets (bfloat16 logits tie often; the order of equal values is torch.topk's own)
    (got_w, got_i), (want_w, want_i) = ((w_.gather(1, i_.argsort(1)), i_.sort(1).values)
                                        for w_, i_ in ((got_w, got_i), (want_w, want_i)))
    same = (got_i == want_i).all(dim=1)
    if int(same.sum()) < 35:
        return f"{int((~same).sum())} of 37 tokens routed to other experts"
    return _rel_error(got_w[same], want_w[same], dtype)


PROBLEMS = {
    "router": _router,
    "moe_plan": _moe_plan,
    "softcap": _softcap,
    "gelu_mul": _gelu_mul,
    "w8a8_linear_fp8": lambda device, dtype: _w8a8_linear("fp8", device, dtype),
    "w8a8_linear_int8": lambda device, dtype: _w8a8_linear("int8", device, dtype),
    "lora": _lora,
    "rms_norm": _rms_norm,
    "nvfp4_linear": lambda device, dtype: _linear("nvfp4", device, dtype),
    "moe_nvfp4_w4a4": _moe_w4a4,
    "nvfp4_w4a4": _w4a4,
    "nvfp4_w4a4_gated": _w4a4_gated,
    "int8_linear": lambda device, dtype: _linear("int8", device, dtype),
    "moe_nvfp4": lambda device, dtype: _moe("nvfp4", device, dtype),
    "moe_int8": lambda device, dtype: _moe("int8", device, dtype),
    "moe_lora": _moe_lora,
    "lora_epilogue": _lora_epilogue,
    "moe_w8a8_int8": lambda device, dtype: _moe_w8a8("int8", device, dtype),
    "moe_w8a8_fp8": lambda device, dtype: _moe_w8a8("fp8", device, dtype),
    "head": _head,
}

register(PROBLEMS)
