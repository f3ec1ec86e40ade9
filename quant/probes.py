"""The problem each Triton kernel family is checked on at its first use on a GPU (quant/kernels/probe.py keeps the
verdicts): a small seeded problem with partial tiles, built from the quantized modules and the formats' own
quantization, run through the family's kernel and compared with the torch path. Importing the quant package
registers them (quant/__init__.py), so the kernels never import the modules above them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dataclasses import dataclass

from .kernels.probe import TOL, Timed, measured, register, timed

# Each builds its problem on the CPU from its own seeded generator (torch's global generator is left alone: it
# drives the sampler's reproducible draws), moves it to the device, and returns None or a short mismatch reason.
# Those in AT_SIZES also take a model's sizes (`Sizes`): then the problem is made on the device itself (a real
# expert stack is 2 GB in float32) and its kernel call is left in probe.timed, with its bytes and FLOPs, to be timed.


@dataclass(frozen=True)
class Sizes:
    """A model's sizes as the probes use them: the rows a step sends through each op (batch x canvas), the widths of
    its linears, experts, heads and vocabulary."""
    rows: int
    hidden: int
    intermediate: int  # the dense MLP's width
    expert_width: int
    experts: int
    top_k: int
    head_dim: int
    q_width: int  # heads x head_dim of the sliding layers' attention
    kv_width: int
    vocab: int

    @classmethod
    def of(cls, cfg, batch: int = 1) -> Sizes:
        """The sizes of a ModelConfig's step at `batch` rows."""
        t = cfg.text
        return cls(batch * cfg.canvas_length, t.hidden_size, t.intermediate_size, t.moe_intermediate_size,
                   t.num_experts, t.top_k_experts, t.head_dim, t.num_attention_heads * t.head_dim,
                   t.num_key_value_heads * t.head_dim, t.vocab_size)


def _generator(device: torch.device, sizes: Sizes | None) -> torch.Generator:
    """The problem's seeded generator: on the CPU for the small problems (the values the tests know), on the device
    for a model's sizes."""
    return torch.Generator(device if sizes is not None else "cpu").manual_seed(0)


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, device=g.device)


def _rand(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=g, device=g.device)


def _time(name: str, fn, nbytes: float, flops: float = 0.0, fp4: bool = False) -> None:
    """Leave a kernel call to be timed (a model's sizes only): `nbytes` the call's least DRAM traffic (weights and
    scales once, activations in once, results out once), `flops` its useful multiply-adds x 2."""
    timed.append(Timed(name, fn, float(nbytes), float(flops), fp4))


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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


def _linear(fmt: str, device: torch.device, dtype: torch.dtype, sizes: Sizes | None = None) -> str | None:
    """33 rows x K 96 -> N 80: partial tiles in M, N and K (a model's sizes: its step's rows through the dense MLP's
    gate, hidden -> intermediate). The reference is x @ dequantized W (float64 products, so a TF32 setting of torch's
    own matmul cannot shift it)."""
    from . import int8, nvfp4
    from .modules import Int8Linear, NVFP4Linear

    g = _generator(device, sizes)
    M, N, K = (33, 80, 96) if sizes is None else (sizes.rows, sizes.intermediate, sizes.hidden)
    w = _randn(g, N, K)
    x = _randn(g, M, K).to(dtype).to(device)
    if fmt == "nvfp4":
        from .kernels.nvfp4_linear import nvfp4_linear

        m = NVFP4Linear.from_weight(nvfp4.quantize(w)).to(device)
        s2 = m.weight_scale_2.expand(N)
        call = lambda: nvfp4_linear(x, m.weight, m.weight_scale, s2)  # noqa: E731
    else:
        from .kernels.int8_linear import int8_linear

        m = Int8Linear.from_weight(int8.quantize(w)).to(device)
        call = lambda: int8_linear(x, m.weight, m.weight_scale)  # noqa: E731
    got = call()
    if sizes is not None:
        _time(f"{fmt}_linear {M}x{K}->{N}", call, _nbytes(m.weight, m.weight_scale, x, got), 2 * M * N * K)
    return _rel_error(got, x.double() @ m.dequantize(weight_dtype(fmt, dtype)).double().T, dtype)


def _routing(g: torch.Generator, T: int, E: int, top: int) -> torch.Tensor:
    """[T, top] distinct experts per token among the first E - 1 (the last is never routed to)."""
    return torch.rand(T, E - 1, generator=g, device=g.device).argsort(dim=1)[:, :top]


def _moe(fmt: str, device: torch.device, dtype: torch.dtype, sizes: Sizes | None = None) -> str | None:
    """33 tokens, 6 experts (one never routed to), top-2, hidden 64, width 48 (a partial tile) through
    `fused_experts` (a model's sizes: its step's tokens, experts, top-k and widths), against the reference expert math
    on the dequantized stacks: gate/up product rounded to the compute dtype, gelu_tanh(gate) * up, down product
    rounded, float32 weighted sum over the slots."""
    from .modules import Int8Stack, NVFP4Stack, fused_experts

    g = _generator(device, sizes)
    T, E, H, I, top = ((33, 6, 64, 48, 2) if sizes is None else
                       (sizes.rows, sizes.experts, sizes.hidden, sizes.expert_width, sizes.top_k))
    gu_w, dn_w = _randn(g, E, 2 * I, H) * 0.1, _randn(g, E, H, I) * 0.1
    if fmt == "nvfp4":  # gate and up with their own global scales
        gu, dn = NVFP4Stack.from_weights(gu_w, segments=2), NVFP4Stack.from_weights(dn_w)
    else:
        gu, dn = Int8Stack.from_weights(gu_w), Int8Stack.from_weights(dn_w)
    del gu_w, dn_w
    gu, dn = gu.to(device), dn.to(device)
    x = _randn(g, T, H).to(dtype).to(device)
    index = _routing(g, T, E, top).to(device)  # [T, top]
    weights = _rand(g, T, top).to(device)  # float32, as the router's
    call = lambda: fused_experts(gu, dn, x, index, weights)  # noqa: E731
    got = call()
    if got is None:
        return "the fused path was not selected"
    if sizes is not None:  # the experts the step reaches, each read once
        hit = int(index.unique().numel())
        stacks = sum(_nbytes(*(b for b in s_.buffers())) for s_ in (gu, dn)) * hit / E
        _time(f"moe_{fmt} {T} tokens, top {top} of {E}, {H}->{I}", call, stacks + _nbytes(x, got),
              2 * T * top * 3 * H * I)
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
        out = torch.zeros(*index.shape, w.shape[1], dtype=torch.float64, device=inp.device)
        for e in index.unique().tolist():  # expert by expert: a gather of w per slot is T x top x N x K
            sel = index == e  # [T, top]
            rows = inp[sel].double()  # [n, K]
            o = rows @ w[e].double().T
            if factors is not None:
                t = rows @ factors.A[e].double().T  # [n, R]
                if lora.token_slots is not None:
                    slots = lora.token_slots[:, None].expand(index.shape)[sel]
                    t = t * (slots[:, None] == factors.slot[None, :]).double()
                o = o + t.to(dtype).double() @ factors.B[e].double().T
            out[sel] = o
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


def _head(device: torch.device, dtype: torch.dtype, sizes: Sizes | None = None, kind: str | None = None
          ) -> str | None:
    """37 rows x hidden 96 x vocab 1,000 (two chunks of 512, a partial tile of 256 at the end, a partial row tile;
    a model's sizes: its step's rows, hidden and vocabulary, the head's own chunks and tiles): the fused head's draws,
    argmax, entropy and soft embedding against the same head in float32 torch ops from the same uniforms
    (head.head_reference). kind: the embedding as GGUF blocks of that type (a GGUF file's token_embd), hidden 256
    small, against the reference on the blocks decoded to the compute dtype."""
    from .kernels.head import CHUNK, TILE, HeadBuffers, fused_head, head_reference

    from .ggml_modules import fused_head_fits

    g = _generator(device, sizes)
    R, H, V = (37, 96 if kind is None else 256, 1000) if sizes is None else (sizes.rows, sizes.hidden, sizes.vocab)
    if kind is not None and not fused_head_fits(kind, H):  # a model of these sizes reads its GGUF head in torch
        return None
    chunk, tile = (512, 256) if sizes is None else (CHUNK, TILE)
    h = _randn(g, R, H).to(dtype)
    if kind is None:
        w = (_randn(g, V, H) * 0.3).to(dtype)
        held = w
    else:  # codes times scales of rms ~0.05, as the 16-bit case's
        from . import ggml

        held = ggml.random_blocks(kind, V, H, torch.Generator().manual_seed(0), 1e-4 if kind == "Q6_K" else 1e-3)
        w = ggml.decode(held, kind, (V, H), dtype)
    t = _rand(g, R) * 0.6 + 0.3
    u = _rand(g, R, 2)
    buf = HeadBuffers(R, V, H, dtype, device, chunk=chunk, tile=tile)
    args = (h.to(device), held.to(device), 30.0, H**0.5, t.to(device), u.to(device), buf)
    fused_head(*args, kind=kind)
    if sizes is not None:  # the tied embedding read once, the rows in, the soft embedding out
        _time(f"head {R} rows, vocab {V}{'' if kind is None else ', ' + kind}", lambda: fused_head(*args, kind=kind),
              _nbytes(held, h, buf.soft), 4 * R * V * H)
    sample, argmax, entropy, soft = head_reference(h, w, 30.0, H**0.5, t, u, tile=tile)
    sample, argmax, entropy, soft = (r.cpu() for r in (sample, argmax, entropy, soft))
    if not ((buf.sample.cpu() >= 0) & (buf.sample.cpu() < V)).all():
        return "a sample out of range"
    near = 1 if sizes is None else max(1, R // 64)  # a uniform within rounding of a boundary may pick the neighbour
    if (buf.sample.cpu() != sample).sum() > near:
        return f"{int((buf.sample.cpu() != sample).sum())} of {R} draws differ"
    if (buf.argmax.cpu() != argmax).sum() > (0 if sizes is None else near):  # near-ties among 262,144 logits
        return "argmax differs"
    err = (buf.entropy.cpu() - entropy).abs().max().item()
    if err > 1e-4 * (1 if sizes is None else max(1.0, entropy.abs().max().item())):  # float32 sums over V terms
        return f"entropy differs by {err:.1e}"
    return _rel_error(buf.soft.cpu(), soft, torch.bfloat16)


def _w4a4(device: torch.device, dtype: torch.dtype, sizes: Sizes | None = None) -> str | None:
    """33 rows x K 256 -> N 130 (partial tiles in M and N; a model's sizes: the dense MLP's gate), x quantized per
    token on the GPU and multiplied in FP4, against the PyTorch emulation of the same quantization
    (nvfp4_w4a4.reference, on the CPU): the activation codes and scales equal, the product within the kernel tests'
    tolerance."""
    from . import nvfp4
    from .kernels.nvfp4_act import quantize_act, quantize_act_reference
    from .kernels.nvfp4_w4a4 import nvfp4_w4a4, reference

    g = _generator(device, sizes)
    M, N, K = (33, 130, 256) if sizes is None else (sizes.rows, sizes.intermediate, sizes.hidden)
    q = nvfp4.quantize(_randn(g, N, K))
    x = _randn(g, M, K).to(dtype)
    codes, scales, _ = quantize_act(x.to(device))
    ref_codes, ref_scales, _ = quantize_act_reference(x.cpu())
    if not (torch.equal(codes.cpu(), ref_codes) and torch.equal(scales.cpu(), ref_scales)):
        return "activation codes or scales differ"
    args = tuple(a.to(device) for a in (q.weight, q.weight_scale, q.weight_scale_2.expand(N)))
    xd = x.to(device)
    got = nvfp4_w4a4(xd, *args)
    if sizes is not None:
        _time(f"nvfp4_w4a4 {M}x{K}->{N}", lambda: nvfp4_w4a4(xd, *args), _nbytes(*args[:2], x, got), 2 * M * N * K,
              fp4=True)
    return _rel_error(got.cpu(), reference(x.cpu(), *(a.cpu() for a in args)), dtype)


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


def _w8a8_linear(kind: str, device: torch.device, dtype: torch.dtype, sizes: Sizes | None = None) -> str | None:
    """33 rows x K 256 -> q, k, v of 130, 64 and 40 columns in one launch, and a gated pair of 130 (a model's sizes:
    its step's rows through the sliding layers' q, k, v and the dense MLP's gate and up), against the float32
    emulation of the same 8-bit products (w8a8.matmul_emulated, torch's gelu)."""
    from . import w8a8
    from .kernels.w8a8_linear import w8a8_linear

    g = _generator(device, sizes)
    M, K = (33, 256) if sizes is None else (sizes.rows, sizes.hidden)
    widths = (130, 64, 40, 130) if sizes is None else (sizes.q_width, sizes.kv_width, sizes.kv_width,
                                                         sizes.intermediate, sizes.intermediate)
    gate = 0 if sizes is None else 3  # the gated pair: gate and up of one shape (the small problem reuses q)
    x = _randn(g, M, K).to(dtype)
    ws = [w8a8.quantize(_randn(g, n, K), kind) for n in widths]
    ws = [(q, s.float()) for q, s in ws]
    quantized = w8a8.quantize_tokens(x, kind)
    on = [tuple(t.to(device) for t in w) for w in ws]
    xd, qd = x.to(device), tuple(t.to(device) for t in quantized)
    got = w8a8_linear(xd, qd, *on[0], more=on[1:3])
    if sizes is not None:
        n = sum(widths[:3])
        _time(f"w8a8_linear_{kind} {M}x{K}->q,k,v {n}", lambda: w8a8_linear(xd, qd, *on[0], more=on[1:3]),
              _nbytes(*(t for w in on[:3] for t in w), *qd, *got), 2 * M * n * K)
    for y, w in zip(got, ws[:3]):
        err = _rel_error(y.cpu(), w8a8.matmul_emulated(x, *w, kind).cpu(), dtype)
        if err is not None:
            return err
    gated = w8a8_linear(xd, qd, *on[gate], up=on[-1])
    if sizes is not None:
        _time(f"w8a8_linear_{kind} {M}x{K}->gate,up {2 * widths[-1]}", lambda: w8a8_linear(xd, qd, *on[gate],
              up=on[-1]), _nbytes(*on[gate], *on[-1], *qd, gated), 4 * M * widths[-1] * K)
    want = (torch.nn.functional.gelu(w8a8.matmul_emulated(x, *ws[gate], kind), approximate="tanh")
            * w8a8.matmul_emulated(x, *ws[-1], kind))
    return _rel_error(gated.cpu(), want.cpu(), dtype)


def _gelu_mul(device: torch.device, dtype: torch.dtype, sizes: Sizes | None = None) -> str | None:
    """gelu_tanh(gate) * up over 3 x 1,037 values (a partial block; a model's sizes: its step's rows x the dense
    MLP's width) against torch's two ops."""
    from .kernels.gelu_mul import gelu_mul, reference

    g = _generator(device, sizes)
    shape = (3, 1037) if sizes is None else (sizes.rows, sizes.intermediate)
    gate, up = ((_randn(g, *shape) * 3).to(dtype).to(device) for _ in range(2))
    got = gelu_mul(gate, up)
    if sizes is not None:
        _time(f"gelu_mul {shape[0]}x{shape[1]}", lambda: gelu_mul(gate, up), 3 * _nbytes(got))
    return _rel_error(got.cpu(), reference(gate, up).cpu(), dtype)


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


def _rms_norm(device: torch.device, dtype: torch.dtype, sizes: Sizes | None = None) -> str | None:
    """5 x 2 tokens of 3 rows of width 96 (a partial block) through the pre-add, the weight, the residual and the
    scale; then heads of 64 with RoPE at per-batch angles (a model's sizes: its step's rows of the hidden width, and
    of its query heads): against the torch ops the model runs."""
    from .kernels.rmsnorm import rms_norm

    g = _generator(device, sizes)
    B, T, heads, width, hd = ((2, 5, 3, 96, 64) if sizes is None else
                              (1, sizes.rows, 1, sizes.hidden, sizes.head_dim))
    a, a2, r = (_randn(g, B, T, heads, width).to(dtype) for _ in range(3))
    w, s = _rand(g, width).to(dtype) + 0.5, torch.tensor(0.75, dtype=dtype, device=g.device)
    x = (a + a2).float()
    n = (x * torch.pow(x.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5) * w.float()).to(dtype)
    args = [t.to(device) for t in (a, w, a2, r, s)]
    call = lambda: rms_norm(args[0], args[1], 1e-6, a2=args[2], residual=args[3], scale=args[4])  # noqa: E731
    got = call()
    if sizes is not None:
        _time(f"rms_norm {T}x{width} (add, residual, scale)", call, 4 * _nbytes(got))
    err = _rel_error(got.cpu(), ((r + n) * s).cpu(), dtype)
    if err is not None:
        return err
    heads = 3 if sizes is None else sizes.q_width // hd
    q, w = _randn(g, B, T, heads, hd).to(dtype), _rand(g, hd).to(dtype) + 0.5
    cos, sin = (_rand(g, B, T, 1, hd).to(dtype) for _ in range(2))
    xf = q.float()
    n = (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5) * w.float()).to(dtype)
    ref = (n * cos) + (torch.cat((-n[..., hd // 2:], n[..., :hd // 2]), dim=-1) * sin)
    args = [t.to(device) for t in (q, w, cos, sin)]
    call = lambda: rms_norm(args[0], args[1], 1e-6, cos=args[2], sin=args[3])  # noqa: E731
    got = call()
    if sizes is not None:
        _time(f"rms_norm {T}x{heads}x{hd} (RoPE)", call, 2 * _nbytes(got))
    return _rel_error(got.cpu(), ref.cpu(), dtype)


def _softcap(device: torch.device, dtype: torch.dtype, sizes: Sizes | None = None) -> str | None:
    """5,003 bfloat16 logits (a partial block; a model's sizes: a step's rows x its vocabulary) converted and capped
    at 30 against torch's tanh."""
    from .kernels.softcap import softcap_into

    g = _generator(device, sizes)
    n = 5003 if sizes is None else sizes.rows * sizes.vocab
    x = (_randn(g, n) * 40).to(torch.bfloat16).to(device)
    ref = torch.tanh(x.float() / 30.0) * 30.0
    out = torch.empty(n, device=device)
    got = softcap_into(out, x, 30.0)
    if sizes is not None:
        _time(f"softcap {n} logits", lambda: softcap_into(out, x, 30.0), _nbytes(x, out))
    return _rel_error(got, ref, torch.float32)


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


def _moe_plan(device: torch.device, dtype: torch.dtype, sizes: Sizes | None = None) -> str | None:
    """70 tokens, top-8 of 128 experts with one expert taking most (a block of several), 16 rows a block (a model's
    sizes: its step's tokens, top-k and experts): the plan equal to the torch one's, bit for bit."""
    from .kernels.moe_plan import moe_blocks_fused
    from .kernels.routing import moe_blocks

    g = torch.Generator().manual_seed(0)
    T, E, top = (70, 128, 8) if sizes is None else (sizes.rows, sizes.experts, sizes.top_k)
    index = torch.rand(T, E, generator=g).argsort(dim=1)[:, :top]
    index[: T * 4 // 7, 0] = min(5, E - 1)  # one expert takes most tokens
    want = moe_blocks(index, E, 16)
    on = index.to(device)
    got = moe_blocks_fused(on, E, 16)
    if sizes is not None:
        _time(f"moe_plan {T} tokens, top {top} of {E}", lambda: moe_blocks_fused(on, E, 16),
              _nbytes(on, *got))
    same = all(torch.equal(a, b.cpu()) for a, b in zip(want, got))
    return None if same else "a different block plan"


def _router(device: torch.device, dtype: torch.dtype, sizes: Sizes | None = None) -> str | None:
    """37 tokens (a partial block), hidden 200 (a partial tile), top-8 of 128 (a model's sizes: its step's tokens,
    hidden, experts and top-k): the experts chosen as the torch ops choose them for at least 35 of 37 tokens (a
    near-tie may swap), the weights within the dtype's tolerance where equal."""
    from .kernels.router import route, route_reference

    g = _generator(device, sizes)
    T, H, E, top = (37, 200, 128, 8) if sizes is None else (sizes.rows, sizes.hidden, sizes.experts, sizes.top_k)
    x = _randn(g, T, H).to(dtype)
    scale = (_rand(g, H) + 0.5).to(dtype)
    w = (_randn(g, E, H) * 0.2).to(dtype)
    pes = (_rand(g, E) + 0.5).to(dtype)
    want_w, want_i = (t.cpu() for t in route_reference(x, scale, w, pes, top, 1e-6))
    args = [t.to(device) for t in (x, scale, w, pes)]
    got_w, got_i = (t.cpu() for t in route(*args, top, 1e-6))
    if sizes is not None:
        _time(f"router {T} tokens, {E} experts", lambda: route(*args, top, 1e-6), _nbytes(x, w, got_w, got_i),
              2 * T * E * H)
    # compared as sets (bfloat16 logits tie often; the order of equal values is torch.topk's own)
    (got_w, got_i), (want_w, want_i) = ((w_.gather(1, i_.argsort(1)), i_.sort(1).values)
                                        for w_, i_ in ((got_w, got_i), (want_w, want_i)))
    same = (got_i == want_i).all(dim=1)
    if int(same.sum()) < T - max(2, T // 18):
        return f"{int((~same).sum())} of {T} tokens routed to other experts"
    return _rel_error(got_w[same], want_w[same], dtype)


def _ggml_decode(device: torch.device, dtype: torch.dtype) -> str | None:
    """3 rows of each GGUF block type dgemma reads, 512 weights a row (288 for the 32-weight types: a partial tile),
    random blocks with sane scales, through the one-pass decode kernel against quant/ggml.py's torch decode."""
    from . import ggml
    from .kernels.ggml_decode import KINDS, ggml_decode

    g = torch.Generator().manual_seed(0)
    for kind in KINDS:
        K = 512 if ggml.ELEMENTS[kind] == 256 else 288
        raw = ggml.random_blocks(kind, 3, K, g)
        err = _rel_error(ggml_decode(raw.to(device), kind, (3, K), dtype).cpu().float(),
                         ggml.decode(raw, kind, (3, K), dtype).float(), dtype)
        if err is not None:
            return f"{kind}: {err}"
    return None


def _ggml_linear(device: torch.device, dtype: torch.dtype, sizes: Sizes | None = None) -> str | None:
    """33 rows through a GGUF linear of each block type, K 256 (192 for the 32-weight types) -> N 48 (partial tiles
    in M and N), against x @ the torch decode (float64 products), and a gate and up of two types in one launch. A
    model's sizes: its step's rows through the dense MLP's gate in Q4_K (hidden -> intermediate) and its down
    projection in Q5_0 (no whole K block)."""
    from . import ggml
    from .kernels.ggml_decode import KINDS
    from .kernels.ggml_linear import ggml_linear

    g = torch.Generator().manual_seed(0)
    M = 33 if sizes is None else sizes.rows
    shapes = ([(kind, 48, 256 if ggml.ELEMENTS[kind] == 256 else 192) for kind in KINDS] if sizes is None else
              [("Q4_K" if sizes.hidden % 256 == 0 else "Q8_0", sizes.intermediate, sizes.hidden),
               ("Q5_0", sizes.hidden, sizes.intermediate)])
    for kind, N, K in shapes:
        raw = ggml.random_blocks(kind, N, K, g, 0.02)
        x = torch.randn(M, K, generator=g).to(dtype)
        w, xd = raw.to(device), x.to(device)
        call = lambda: ggml_linear(xd, w, kind, K)  # noqa: E731
        got = call()
        if sizes is not None:
            _time(f"ggml_linear {kind} {M}x{K}->{N}", call, _nbytes(w, xd, got), 2 * M * N * K)
        want = x.double() @ ggml.decode(raw, kind, (N, K), dtype).double().T
        err = _rel_error(got.cpu(), want, dtype)
        if err is not None:
            return f"{kind}: {err}"
    # the dense MLP's gate and up in one launch (GATED), of two types: gelu_tanh(x G^T) * (x U^T), each product and
    # the activation rounded to the compute dtype as the reference's three ops round them
    N, K = (48, 256) if sizes is None else (sizes.intermediate, sizes.hidden)
    kinds = ("Q4_K", "Q6_K") if K % 256 == 0 else ("Q8_0", "Q5_0")
    raws = [ggml.random_blocks(k, N, K, g, 0.02) for k in kinds]
    x = torch.randn(M, K, generator=g).to(dtype)
    xd = x.to(device)
    got = ggml_linear(xd, raws[0].to(device), kinds[0], K, up=(raws[1].to(device), kinds[1]))
    gate, up = ((x.double() @ ggml.decode(r, k, (N, K), dtype).double().T).to(dtype) for r, k in zip(raws, kinds))
    want = torch.nn.functional.gelu(gate, approximate="tanh").double() * up.double()
    err = _rel_error(got.cpu(), want, dtype)
    return None if err is None else f"{'/'.join(kinds)} gated: {err}"


def _moe_gguf(device: torch.device, dtype: torch.dtype, sizes: Sizes | None = None) -> str | None:
    """9 tokens, 4 experts (one never routed to), top-2, hidden 256, width 96 (partial tiles) through the MoE kernels
    reading GGUF blocks in their tiles, gate-up and down of different block types (Q4_K / Q5_0, Q6_K / Q8_0, IQ4_XS /
    IQ4_NL), against the reference expert math on the stacks decoded to the compute dtype. A model's sizes: its step's
    tokens, experts, top-k and widths in Q4_K_M's pair (Q4_K gate-up, Q5_0 down: 704 is no whole K block)."""
    from . import ggml
    from .ggml_modules import GGUFStack, gguf_experts

    g = torch.Generator().manual_seed(0)
    T, E, H, I, top = ((9, 4, 256, 96, 2) if sizes is None else
                       (sizes.rows, sizes.experts, sizes.hidden, sizes.expert_width, sizes.top_k))
    x = torch.randn(T, H, generator=g).to(dtype).to(device)
    index = torch.rand(T, E - 1, generator=g).argsort(dim=1)[:, :top].to(device)
    weights = torch.rand(T, top, generator=g).to(device)
    pairs = ((("Q4_K", "Q5_0"), ("Q6_K", "Q8_0"), ("IQ4_XS", "IQ4_NL")) if sizes is None else
             (("Q4_K" if H % 256 == 0 else "Q8_0", "Q5_0"),))  # a small config's rows may be no whole K block
    for gu_kind, dn_kind in pairs:
        gu, dn = GGUFStack(E, 2 * I, H, gu_kind), GGUFStack(E, H, I, dn_kind)
        gu.weight.copy_(ggml.random_blocks(gu_kind, E * 2 * I, H, g, 0.002).reshape(gu.weight.shape))
        dn.weight.copy_(ggml.random_blocks(dn_kind, E * H, I, g, 0.002).reshape(dn.weight.shape))
        gu, dn = gu.to(device), dn.to(device)
        call = lambda: gguf_experts(gu, dn, x, index, weights)  # noqa: E731
        got = call()
        if sizes is not None:  # the experts the step reaches, each read once
            hit = int(index.unique().numel())
            _time(f"moe_gguf {gu_kind}/{dn_kind} {T} tokens, top {top} of {E}, {H}->{I}", call,
                  (gu.weight.numel() + dn.weight.numel()) * hit / E + _nbytes(x, got), 2 * T * top * 3 * H * I)
        ref = expert_math(gu.dequantize(dtype), dn.dequantize(dtype), x, index, weights)
        err = _rel_error(got, ref, dtype)
        if err is not None:
            return f"{gu_kind} / {dn_kind}: {err}"
    return None


PROBLEMS = {
    "router": _router,
    "moe_plan": _moe_plan,
    "softcap": _softcap,
    "gelu_mul": _gelu_mul,
    "w8a8_linear_fp8": lambda device, dtype, sizes=None: _w8a8_linear("fp8", device, dtype, sizes),
    "w8a8_linear_int8": lambda device, dtype, sizes=None: _w8a8_linear("int8", device, dtype, sizes),
    "lora": _lora,
    "rms_norm": _rms_norm,
    "nvfp4_linear": lambda device, dtype, sizes=None: _linear("nvfp4", device, dtype, sizes),
    "moe_nvfp4_w4a4": _moe_w4a4,
    "nvfp4_w4a4": _w4a4,
    "nvfp4_w4a4_gated": _w4a4_gated,
    "int8_linear": lambda device, dtype, sizes=None: _linear("int8", device, dtype, sizes),
    "moe_nvfp4": lambda device, dtype, sizes=None: _moe("nvfp4", device, dtype, sizes),
    "moe_int8": lambda device, dtype, sizes=None: _moe("int8", device, dtype, sizes),
    "moe_lora": _moe_lora,
    "lora_epilogue": _lora_epilogue,
    "moe_w8a8_int8": lambda device, dtype: _moe_w8a8("int8", device, dtype),
    "moe_w8a8_fp8": lambda device, dtype: _moe_w8a8("fp8", device, dtype),
    "head": _head,
    # the published files' embedding type where the hidden size is whole super-blocks (the real 2,816: 11), else Q8_0
    "head_gguf": lambda device, dtype, sizes=None: _head(device, dtype, sizes, "Q6_K" if sizes is None or
                                                         sizes.hidden % 256 == 0 else "Q8_0"),
    "ggml_decode": _ggml_decode,
    "moe_gguf": lambda device, dtype, sizes=None: _moe_gguf(device, dtype, sizes),
    "ggml_linear": _ggml_linear,
}

# Those whose problem also runs at a model's sizes (`dgemma doctor` on a card). The others (the W8A8 and W4A4
# experts, whose references loop over every token and slot in Python, and the three LoRA families) run small only.
AT_SIZES = ("router", "moe_plan", "softcap", "gelu_mul", "w8a8_linear_fp8", "w8a8_linear_int8", "rms_norm",
            "nvfp4_linear", "nvfp4_w4a4", "int8_linear", "moe_nvfp4", "moe_int8", "head", "moe_gguf",
            "ggml_linear", "head_gguf")

register(PROBLEMS, AT_SIZES)
