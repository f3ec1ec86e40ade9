"""The DiffusionGemma text network: one set of weights, two modes.

- `encode(ids)`: causal; appends the prompt (or a finished canvas) to a preallocated static KV cache. Images
  come in here only: their soft tokens (vision.py) replace the image-token embeddings.
- `denoise(canvas, sc_logits)`: bidirectional over cached prefix + canvas; never advances the cache.

Rules this file keeps: it knows tensors, not tokens or text; every projection is a module called as
`proj(x)` and the routed experts a module called as `experts(x, top_k_index, top_k_weights)`, so a quantized
implementation can replace either (the seam for `quant/`). The denoise step's inputs are fixed-shape tensors
prepared once per canvas (`DenoiseContext`) and it makes no host round trip (expert counts by scatter-add, the
embedding scale made once), so engine.py can capture it in a CUDA graph; only the fallback without torch's grouped
matmul (CPU float16, old GPUs) syncs once per MoE layer.
Numerics follow the reference implementation op for op (float32 norms, router and logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import FULL, SLIDING, LayerSpec, ModelConfig, TextConfig
from .errors import ModelError


# ----------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """x * (mean(x^2) + eps)^-0.5 [* weight], computed in float32. Gemma 4 scales by `weight`, not 1 + weight."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused_norms(x):
            return _rms_norm_kernel()(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
             ) -> torch.Tensor:
        """apply_rope(self(x), cos, sin) for x [B, T, heads, D], written into `out` (x's shape, any strides: a KV
        cache's slots) when given."""
        D = x.shape[-1]
        if D & (D - 1) == 0 and _fused_norms(x):  # the kernel rotates power-of-two heads (the model's: 256, 512)
            return _rms_norm_kernel()(x, self.weight, self.eps, cos=cos, sin=sin, out=out)
        y = apply_rope(self(x), cos, sin)
        return y if out is None else out.copy_(y)

    def into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """self(x) written into `out` (x's shape, any strides)."""
        if _fused_norms(x):
            return _rms_norm_kernel()(x, self.weight, self.eps, out=out)
        return out.copy_(self(x))

    def add_to(self, residual: torch.Tensor, x: torch.Tensor, x2: torch.Tensor | None = None,
               scale: torch.Tensor | None = None, norm_x: RMSNorm | None = None,
               norm_x2: RMSNorm | None = None) -> torch.Tensor:
        """(residual + self(x + x2)) * scale, x2 and scale optional: a layer's residual update. norm_x, norm_x2:
        norms (with weights, this norm's eps) applied to x and x2 first, in the same kernel."""
        pre = [n for n in (norm_x, norm_x2) if n is not None]
        if _fused_norms(x) and all(n.weight is not None and n.eps == self.eps for n in pre):
            return _rms_norm_kernel()(x, self.weight, self.eps, a2=x2, residual=residual, scale=scale,
                                      a_weight=None if norm_x is None else norm_x.weight,
                                      a2_weight=None if norm_x2 is None else norm_x2.weight)
        x = x if norm_x is None else norm_x(x)
        x2 = x2 if norm_x2 is None or x2 is None else norm_x2(x2)
        out = residual + self(x if x2 is None else x + x2)
        return out if scale is None else out * scale

    def add_then_pair(self, residual: torch.Tensor, x: torch.Tensor, first: RMSNorm, second: RMSNorm,
                      pair_order: bool = False, quantize: tuple | None = None) -> tuple | None:
        """(y, first(y), second(y), quantized) for y = residual + self(x), in one kernel (the post-attention
        residual update and the two pre-feed-forward norms of its result; the second's columns in pair order with
        `pair_order`, as `pair` gives them); quantized: first(y) quantized as `quantize` says
        (quant.modules.norm_quantization: for the dense MLP), else None. None where the norms do not run fused (the
        caller runs add_to, then pair)."""
        norms = (self, first, second)
        if not (_fused_norms(x) and all(n.weight is not None and n.eps == self.eps for n in norms)):
            return None
        out = _rms_norm_kernel()(x, self.weight, self.eps, residual=residual, then_pair=(first.weight, second.weight),
                                 pair_order_y2=pair_order, quantize=None if quantize is None else quantize[0],
                                 input_scale=None if quantize is None else quantize[1])
        return out if quantize is not None else (*out, None)

    def quantizing(self, x: torch.Tensor, quantize: tuple) -> tuple[torch.Tensor, tuple] | None:
        """(self(x), its quantization as `quantize` says: quant.modules.norm_quantization) from one kernel; None
        where the norm does not run fused."""
        if not (_fused_norms(x) and self.weight is not None):
            return None
        return _rms_norm_kernel()(x, self.weight, self.eps, quantize=quantize[0], input_scale=quantize[1])

    def pair(self, x: torch.Tensor, other: RMSNorm, pair_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x), other(x)): two norms of the same input (same eps), in one kernel; the second's columns in the
        NVFP4 decode's pair order with `pair_order` (groups of 8 as k0 k4 k1 k5 k2 k6 k3 k7)."""
        if (_fused_norms(x) and self.weight is not None and other.weight is not None and other.eps == self.eps):
            return _rms_norm_kernel()(x, self.weight, self.eps, weight2=other.weight, pair_order_y2=pair_order)
        y2 = other(x)
        if pair_order:
            from quant.kernels.moe_gate_up import pair_ordered

            y2 = pair_ordered(y2.reshape(-1, y2.shape[-1])).view(y2.shape)
        return self(x), y2


def _fused_norms(x: torch.Tensor) -> bool:
    """Whether the norms run as one Triton kernel each (quant/kernels/rmsnorm.py: the norm with the add, RoPE,
    residual and scale around it) rather than the torch ops above: where DGEMMA_KERNELS selects Triton for x's
    device (a CUDA GPU by default) and the kernel passed its first-use check there, outside autograd. The same
    roundings as the torch ops, float32 summation order aside."""
    if x.requires_grad:
        return False
    from quant.kernels import use_triton
    from quant.kernels.probe import family_ok

    return use_triton(x.device) and family_ok("rms_norm", x.device, x.dtype)


def _fused_router(router: Router, x: torch.Tensor) -> bool:
    """Whether the router runs as one Triton kernel: a 16-bit float projection and scales in x's dtype, outside
    autograd, where DGEMMA_KERNELS selects Triton and its first-use check passed."""
    proj = router.proj
    if x.requires_grad or type(proj) is not nn.Linear or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not (proj.weight.dtype == router.scale.dtype == x.dtype) or proj.weight.shape[0] > 256:
        return False
    from quant.kernels import use_triton
    from quant.kernels.probe import family_ok

    return use_triton(x.device) and family_ok("router", x.device, x.dtype)


def _fused_softcap(out: torch.Tensor) -> bool:
    """Whether the logits' conversion and soft-capping run as one Triton kernel: where DGEMMA_KERNELS selects
    Triton for the device and its first-use check passed."""
    from quant.kernels import use_triton
    from quant.kernels.probe import family_ok

    return use_triton(out.device) and family_ok("softcap", out.device, torch.float32)


def _rms_norm_kernel():
    from quant.kernels.rmsnorm import rms_norm

    return rms_norm


def host_index(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints as an int64 tensor on `device`, without waiting: on CUDA copied from pinned memory without blocking
    (after a copy from pageable host memory torch waits for the stream to drain, which would make a step wait for
    the work queued before it)."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=torch.long, device=device)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def rope_inv_freq(params: dict, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32) for one layer type.

    default:      1 / theta^(2i / d), d = head_dim * partial_rotary_factor.
    proportional: the first `partial * head_dim // 2` angles are 1 / theta^(2i / head_dim), the rest are 0,
                  so those dims pass through unrotated while the output keeps the full head_dim.
    """
    # Always on the CPU (the model may be under construction on the meta device); moved on use.
    rope_type = params.get("rope_type", "default")
    theta = float(params["rope_theta"])
    partial = float(params.get("partial_rotary_factor", 1.0))
    if rope_type == "default":
        dim = int(head_dim * partial)
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
    if rope_type == "proportional":
        angles = int(partial * head_dim // 2)
        rotated = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64, device="cpu").float() / head_dim))
        inv = torch.cat([rotated, torch.zeros(head_dim // 2 - angles, dtype=torch.float32, device="cpu")])
        return inv / float(params.get("factor", 1.0))
    raise ModelError(f"config.json: unsupported rope_type {rope_type!r}")


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """positions [B or 1, T] -> cos, sin [B or 1, T, 1, D] for x laid out as [B, T, heads, D]."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, :, None, :], emb.sin().to(dtype)[:, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * n, S, D]: kv head j serves query heads j*n .. j*n + n - 1."""
    if n == 1:
        return x
    B, H, S, D = x.shape
    return x[:, :, None].expand(B, H, n, S, D).reshape(B, H * n, S, D)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           causal: bool = False) -> torch.Tensor:
    """Grouped-query attention with scale 1.0.

    q [B, Hq, T, D], k/v [B, Hkv, S, D], mask bool [B, 1, T or 1, S] (True = attend) or None; `causal` (with no
    mask) means the keys are exactly the queries' own positions. The kernel call is the reference's: without a
    mask, SDPA's own grouped-query path (head dim <= 256); with one, K/V repeated per query head. Same inputs,
    same kernel, same bits, so long runs do not drift apart from the reference. Returns [B, T, Hq * D].
    """
    B, Hq, T, D = q.shape
    G = Hq // k.shape[1]
    extra = {}
    if G > 1:
        if mask is None and D <= 256:
            extra["enable_gqa"] = True
        else:
            k, v = repeat_kv(k, G), repeat_kv(v, G)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0,
                                         is_causal=causal and mask is None and T > 1, **extra)
    return out.transpose(1, 2).reshape(B, T, Hq * D)


# ----------------------------------------------------------------------------- layer modules


class Attention(nn.Module):
    """Gemma 4 attention. Full-attention layers have no v_proj: V = v_norm(k_proj(x)), taken before k_norm/RoPE."""

    def __init__(self, cfg: TextConfig, spec: LayerSpec):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        H = cfg.hidden_size
        self.q_proj = nn.Linear(H, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=False) if spec.is_sliding else None
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.v_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, with_scale=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            kv_out: tuple[torch.Tensor, torch.Tensor] | None = None, quantized: tuple | None = None):
        """x [B, T, H] -> q [B, Hq, T, D], k, v [B, Hkv, T, D] (normed; q and k rotated). kv_out: where k and v go
        ([B, Hkv, T, D] views of a KV cache's slots: the norms write them there, no copy after); returned as k, v.
        quantized: x's quantization for the three projections, made by its norm (Layer.attention_input)."""
        from quant.modules import project

        B, T, _ = x.shape
        # the three projections together: one launch, one activation quantization (or x's norm's)
        q_raw, k_raw, v_raw = project(x, [self.q_proj, self.k_proj, self.v_proj], quantized)
        q_raw, k_raw = q_raw.view(B, T, -1, self.head_dim), k_raw.view(B, T, -1, self.head_dim)
        v_raw = v_raw.view(B, T, -1, self.head_dim) if v_raw is not None else k_raw
        D = self.head_dim
        if (D & (D - 1) == 0 and _fused_norms(q_raw)
                and self.q_norm.eps == self.k_norm.eps == self.v_norm.eps):  # q's, k's and v's in one launch
            from quant.kernels.rmsnorm import rms_norm_rope_pair

            k_out, v_out = kv_out if kv_out is not None else (None, None)
            q, k, v = rms_norm_rope_pair(q_raw, self.q_norm.weight, k_raw, self.k_norm.weight, self.q_norm.eps,
                                         cos, sin, out_b=None if k_out is None else k_out.transpose(1, 2),
                                         c=v_raw, out_c=None if v_out is None else v_out.transpose(1, 2))
            if v_out is not None:
                return q.transpose(1, 2), k_out, v_out
            return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = self.q_norm.rope(q_raw, cos, sin).transpose(1, 2)
        if kv_out is not None:
            k_out, v_out = kv_out
            self.k_norm.rope(k_raw, cos, sin, out=k_out.transpose(1, 2))
            self.v_norm.into(v_raw, v_out.transpose(1, 2))
            return q, k_out, v_out
        k = self.k_norm.rope(k_raw, cos, sin).transpose(1, 2)
        v = self.v_norm(v_raw).transpose(1, 2)
        return q, k, v


class MLP(nn.Module):
    """Gated MLP: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, quantized: tuple | None = None) -> torch.Tensor:
        """quantized: x's quantization for gate and up, made by its norm (Layer.post_attention)."""
        from quant.modules import project

        gated = getattr(self.gate_proj, "gated", None)  # a quantized linear that fuses the gate (quant/modules.py)
        h = None
        if gated is not None and not x.requires_grad:
            h = gated(x, self.up_proj) if quantized is None else gated(x, self.up_proj, quantized=quantized)
        if h is None:
            gate, up = project(x, [self.gate_proj, self.up_proj], quantized)  # one activation quantization for both
            h = gelu_tanh(gate) * up
        return self.down_proj(h)


class Router(nn.Module):
    """Top-k routing on the un-normed residual: weightless RMSNorm * scale * H^-0.5 -> linear -> fp32 softmax."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        H = cfg.hidden_size
        self.top_k = cfg.top_k_experts
        self.root_size = H**-0.5
        self.norm = RMSNorm(H, cfg.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(H, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(H))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))

    def forward(self, x: torch.Tensor):
        """x [N, H] -> weights [N, K] (renormalised, times per-expert scale), index [N, K]."""
        if _fused_router(self, x):  # the same steps in one kernel (quant/kernels/router.py)
            from quant.kernels.router import route

            return route(x, self.scale, self.proj.weight, self.per_expert_scale, self.top_k, self.norm.eps)
        h = self.norm(x) * self.scale * self.root_size
        probs = F.softmax(self.proj(h), dim=-1, dtype=torch.float32)  # [N, E]
        w, idx = torch.topk(probs, k=self.top_k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        return w * self.per_expert_scale[idx], idx


def _grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch's grouped matmul exists here and accepts these operands (16-byte aligned rows and pointers;
    on CUDA only bfloat16 on sm80+)."""
    if not hasattr(F, "grouped_mm") or x.dtype != w.dtype:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False  # no CPU backward for it (training runs the per-group loop)
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0):
            return False
    elif x.device.type not in ("cpu", "meta"):  # meta: a traced step (step_trace.py) takes the CUDA path's op
        return False
    size = x.element_size()
    strides = (*x.stride()[:-1], *w.stride()[:-1])
    return (all(s * size % 16 == 0 for s in strides) and x.stride(-1) == 1 and w.stride(-1) == 1
            and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)


def expert_counts(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert [E] (int64). A scatter-add, not torch.bincount: on CUDA bincount reads its input's
    maximum back to the host, which a CUDA graph cannot capture."""
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x [S, K] grouped by expert (group e ends at offsets[e]) times each group's w[e] [N, K]^T -> [S, N].

    One grouped matmul where torch has it (no Python loop, no host sync, graph-capturable); otherwise one matmul
    per non-empty group. Both give the bits of per-group F.linear.
    """
    if _grouped_mm_fits(x, w):
        return F.grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = F.linear(x[start:end], w[e])
        start = end
    return out


class Experts(nn.Module):
    """Routed experts as fused 3-D weights: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].

    Token-expert assignments are grouped by expert with one sort, each projection is one grouped matmul, and each
    token's K weighted outputs are summed in float32 in slot order, as the reference's grouped path does (same
    sums, same bits). `QuantizedExperts` only overrides `weights()`.
    """

    low_rank = None  # adapters' per-expert low-rank terms (lora.ExpertLowRank), added to each projection

    def __init__(self, cfg: TextConfig):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) in the compute dtype (the parameters' own)."""
        return self.gate_up_proj, self.down_proj

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                row: int | None = None) -> torch.Tensor:
        """x [N, H], top_k_index / top_k_weights [N, K] -> [N, H]. x holds the batch's rows' tokens, or row `row`'s
        alone (Layer.feed_forward's experts_per_row): which adapter each token takes when rows choose
        (tuner/lora.py)."""
        N, K = top_k_index.shape
        flat = top_k_index.reshape(-1)  # [N*K], entry t*K + k
        # Group by expert with the reference's own sort call: BLAS results depend on where a row sits in its block,
        # so the same permutation is what keeps the bits identical.
        order = torch.sort(flat).indices
        offsets = torch.cumsum(expert_counts(flat, self.num_experts), 0).to(torch.int32)
        gate_up, down = self.weights(x.dtype)
        lr = self.low_rank if self.low_rank is not None and self.low_rank.active() else None
        slots = None
        if lr is not None:
            token_slots = lr.slots(N, row)  # [N] each token's adapter, or None (all apply)
            if lr.folds(x) and (token_slots is None or bool((token_slots == token_slots[0]).all())):
                # one adapter (or all) for the whole call: its deltas folded into this call's weights (tuner/lora.py)
                one = None if token_slots is None else int(token_slots[0])
                gate_up, down, lr = lr.fold("gate_up", gate_up, one), lr.fold("down", down, one), None
            elif token_slots is not None:
                slots = token_slots[order // K]  # each assignment's adapter, in expert order
        xs = x[order // K]
        gu = grouped_linear(xs, gate_up, offsets)
        if lr is not None and (extra := lr("gate_up", xs, offsets, slots)) is not None:
            gu = gu + extra
        gate, up = gu.chunk(2, dim=-1)  # [N*K, I] each
        hs = gelu_tanh(gate) * up
        ys = grouped_linear(hs, down, offsets)  # [N*K, H], grouped by expert
        if lr is not None and (extra := lr("down", hs, offsets, slots)) is not None:
            ys = ys + extra
        y = torch.empty_like(ys)
        y[order] = ys  # back to (token, slot) order
        weighted = y * top_k_weights.reshape(-1, 1)  # float32 (router weights are float32)
        return weighted.view(N, K, -1).sum(dim=1).to(x.dtype)


class QuantizedExperts(Experts):
    """Routed experts held packed: `gate_up_proj` and `down_proj` are modules with `dequantize(dtype)` giving
    [E, 2I, H] and [E, H, I] (e.g. `quant.modules.NVFP4Stack`), and optionally `fused_experts(down, x, index,
    weights)` (a fused kernel; None when it does not apply). Otherwise this layer's experts are dequantized just
    before use and dropped after, so only one layer's worth is ever unpacked."""

    def __init__(self, num_experts: int, gate_up_proj: nn.Module, down_proj: nn.Module):
        nn.Module.__init__(self)
        self.num_experts = num_experts
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj.dequantize(dtype), self.down_proj.dequantize(dtype)

    def takes_pair_order(self, x: torch.Tensor) -> bool:
        """Whether the fused kernels would read x in the NVFP4 decode's pair order (quant.modules.takes_pair_order):
        the layer then has its norm write x in that order and says so (`ordered`)."""
        takes = getattr(self.gate_up_proj, "takes_pair_order", None)
        if takes is None:
            return False
        if self.low_rank is not None and self.low_rank.active():  # adapters: only where their terms are fused
            return self.low_rank.fusable(x) and takes(self.down_proj, x)
        return bool(takes(self.down_proj, x))

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                ordered: bool = False, row: int | None = None) -> torch.Tensor:
        """The fused kernels when the packed modules provide them for x's device, else the reference path. ordered:
        x's columns are in the NVFP4 decode's pair order (`takes_pair_order`)."""
        fused = getattr(self.gate_up_proj, "fused_experts", None)
        kw = {}
        if fused is not None and self.low_rank is not None and self.low_rank.active():
            # adapters: their terms in the fused kernels' epilogues (lora.ExpertLowRank.kernel_terms), or, where
            # those do not run (training, ranks above the kernels'), the reference path, layer by layer dequantized
            kw["lora"] = self.low_rank.kernel_terms(x, top_k_index.shape[0], row)
            fused = fused if kw["lora"] is not None else None
        extra = (True,) if ordered else ()  # only stacks that take the pair order are ever handed it
        y = fused(self.down_proj, x, top_k_index, top_k_weights, *extra, **kw) if fused is not None else None
        if y is None and ordered:  # not the kernels that read that order after all: K order again
            from quant.modules import pair_unordered

            x = pair_unordered(x)
        return super().forward(x, top_k_index, top_k_weights, row) if y is None else y


class Layer(nn.Module):
    """Attention, then a dense MLP and the MoE in parallel on the same residual; output times layer_scalar."""

    def __init__(self, cfg: TextConfig, spec: LayerSpec):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.spec = spec
        self.self_attn = Attention(cfg, spec)
        self.mlp = MLP(H, cfg.intermediate_size)
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        self.post_feedforward_layernorm_1 = RMSNorm(H, eps)
        self.pre_feedforward_layernorm_2 = RMSNorm(H, eps)
        self.post_feedforward_layernorm_2 = RMSNorm(H, eps)

    def experts_pair_order(self, x: torch.Tensor) -> bool:
        """Whether the experts take their input in the order their NVFP4 kernels read (no copy in between)."""
        takes = getattr(self.experts, "takes_pair_order", None)
        return bool(takes is not None and not x.requires_grad and takes(x))

    def attention_input(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
        """The attention's input norm of the residual x, and where q, k and v quantize their input alike (W4A4, W8A8)
        its quantization from the same launch (Attention.qkv's `quantized`), else None."""
        from quant.modules import norm_quantization

        attn, norm = self.self_attn, self.input_layernorm
        # (not where a hook watches the norm's call: streamed experts schedule their copies by it)
        hooked = bool(norm._forward_pre_hooks or norm._forward_hooks)
        how = None if x.requires_grad or hooked else norm_quantization(x, [attn.q_proj, attn.k_proj, attn.v_proj])
        made = self.input_layernorm.quantizing(x, how) if how is not None else None
        return made if made is not None else (self.input_layernorm(x), None)

    def post_attention(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
        """x + norm(h), the attention's residual update, and where the norms run fused the feed-forward stage's two
        input norms of it from the same launch, with the dense MLP's quantization of the first where its gate and
        up quantize it alike (`feed_forward`'s `normed`), else None."""
        from quant.modules import norm_quantization

        ordered = self.experts_pair_order(x)
        how = None if x.requires_grad else norm_quantization(x, [self.mlp.gate_proj, self.mlp.up_proj])
        made = self.post_attention_layernorm.add_then_pair(x, h, self.pre_feedforward_layernorm,
                                                           self.pre_feedforward_layernorm_2, ordered, how)
        if made is None:
            return self.post_attention_layernorm.add_to(x, h), None
        return made[0], (made[1], made[2], ordered, made[3])

    def feed_forward(self, x: torch.Tensor, layer_scalar: torch.Tensor, experts_per_row: bool = False,
                     normed: tuple | None = None) -> torch.Tensor:
        """x is the post-attention residual [B, T, H]. experts_per_row: the routed experts run on each row's T
        tokens apart (the server's exactness on the CPU: dgemma_cli/server/batching.py), not on all B x T at once.
        normed: (pre, pre2, pair order, pre's quantization or None) as `post_attention` made them, the two input
        norms of x already taken."""
        # the experts' input straight in the order their NVFP4 kernels read, where they run (no copy in between)
        if normed is not None:  # (post_attention decided the order for this x)
            pre, pre2, ordered, quantized = normed
        else:
            ordered, quantized = self.experts_pair_order(x), None
            pre, pre2 = self.pre_feedforward_layernorm.pair(x, self.pre_feedforward_layernorm_2, pair_order=ordered)
        dense = self.mlp(pre) if quantized is None else self.mlp(pre, quantized)  # its post-norm: with the sum's
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        weights, index = self.router(flat)  # routed on the un-normed residual
        normed = pre2.reshape(-1, H)
        kw = {"ordered": True} if ordered else {}
        adapted = getattr(self.experts, "low_rank", None) is not None  # adapters: say which row a call holds
        if experts_per_row and B > 1:
            moe = torch.cat([self.experts(normed[b * T : (b + 1) * T], index[b * T : (b + 1) * T],
                                          weights[b * T : (b + 1) * T], **kw, **({"row": b} if adapted else {}))
                             for b in range(B)]).reshape(x.shape)
        else:
            moe = self.experts(normed, index, weights, **kw).reshape(x.shape)
        # (x + norm(norm_1(dense) + norm_2(moe))) * s
        return self.post_feedforward_layernorm.add_to(x, dense, moe, layer_scalar,
                                                      norm_x=self.post_feedforward_layernorm_1,
                                                      norm_x2=self.post_feedforward_layernorm_2)


class SelfConditioning(nn.Module):
    """post_norm(canvas_embeds + MLP(pre_norm(soft_embeds))); the post-norm has no weight."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        H = cfg.hidden_size
        self.pre_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(H, cfg.rms_norm_eps, with_scale=False)
        self.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
        if soft is None:  # first step: the signal is exactly zero, so skip the MLP
            return self.post_norm(embeds)
        h = self.pre_norm(soft)
        return self.post_norm(embeds + self.down_proj(gelu_tanh(self.gate_proj(h)) * self.up_proj(h)))


# ----------------------------------------------------------------------------- the static KV cache


class KVCache:
    """Preallocated keys/values for every layer, plus a canvas-sized scratch tail the decoder writes into.

    full layer:    k, v [B, Hkv, capacity + C, D]; positions [0, length) are cached, [length, length + C) is
                   the decoder's scratch for the current canvas (never counted as cached).
    sliding layer: k, v [B, Hkv, W - 1 + C, D]; slots [0, W - 1) hold the last W - 1 cached positions,
                   right-aligned (the reference keeps exactly these); the last C slots are scratch.
    valid [B, capacity]: False at left-padding positions of a batch.
    """

    def __init__(self, model: DiffusionGemma, batch: int, capacity: int, device, dtype):
        cfg = model.cfg.text
        self.batch, self.capacity, self.length = batch, capacity, 0
        self.window = cfg.sliding_window - 1  # cached positions a sliding layer keeps
        C = model.cfg.canvas_length
        self.k, self.v = [], []
        for i, spec in enumerate(cfg.layers):
            slots = (self.window if spec.is_sliding else capacity) + C
            shape = (batch, spec.num_kv_heads, slots, spec.head_dim)
            on = model.layer_devices[i] if model.layer_devices is not None else device  # a split: the layer's card
            self.k.append(torch.zeros(shape, device=on, dtype=dtype))
            self.v.append(torch.zeros(shape, device=on, dtype=dtype))
        self.valid = torch.ones(batch, capacity, dtype=torch.bool, device=device)

    @property
    def window_filled(self) -> int:
        """How many sliding slots hold cached positions: min(length, W - 1), the last ones of [0, W - 1)."""
        return min(self.length, self.window)

    def window_positions(self, device) -> torch.Tensor:
        """Absolute positions [window_filled] of the filled sliding slots, oldest first."""
        return torch.arange(self.length - self.window_filled, self.length, device=device)

    def clone(self) -> KVCache:
        """An independent copy (training differentiates through a cache that several passes write into)."""
        other = object.__new__(KVCache)
        other.__dict__.update(self.__dict__)
        other.k, other.v = [t.clone() for t in self.k], [t.clone() for t in self.v]
        other.valid = self.valid.clone()
        return other

    def window_valid(self) -> torch.Tensor:
        """[B, window_filled]: slot holds a real (non-padding) token."""
        return self.valid[:, self.length - self.window_filled : self.length]


@dataclass
class DenoiseContext:
    """Everything the denoise step needs besides the canvas: fixed for one canvas, so graph-capturable."""

    cos: dict[str, torch.Tensor]
    sin: dict[str, torch.Tensor]
    mask: dict[str, torch.Tensor | None]  # bool [B, 1, 1, S] over cached + canvas keys, None if all valid
    keys: dict[str, tuple[int, int]]  # per layer kind: the buffer slots [start, end) read; the canvas fills the last C


# ----------------------------------------------------------------------------- the network


class Phase:
    """Which of the model's two passes is running: the causal encoder (`encode`) or the decoder (`denoise`); and,
    when rows of a batch choose their adapter (the server), each row's adapter slot (tuner/lora.py)."""

    encoding = False
    row_slots: torch.Tensor | None = None  # [B] int64, 0: the base alone; None: every attached adapter

    @property
    def side(self) -> str:
        """"encoder" or "decoder": the pass running, as adapters (tuner/lora.py) and token rows name it."""
        return "encoder" if self.encoding else "decoder"


class LayerSplit:
    """One pass over layers split across several devices (`DiffusionGemma.layer_devices`, the placement plan's split):
    the hidden state moves to each layer's device as it enters it (the CUDA device made current there, which Triton
    launches on) and back to the first for the head; tensors made once on the first device for the whole pass (RoPE
    tables, masks, layer scalars) are copied once to each other device, on first use there."""

    def __init__(self, devices: list[torch.device], first: torch.device):
        self.devices, self.first, self.dev = devices, first, first
        self.copies: dict = {}  # (id, device) -> (the tensor, kept alive so the id stays its own; its copy)

    def enter(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        self._switch(self.devices[layer])
        return x if x.device == self.dev else x.to(self.dev)

    def here(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """t on the current layer's device."""
        if t is None or t.device == self.dev:
            return t
        key = (id(t), self.dev)
        if key not in self.copies:
            self.copies[key] = (t, t.to(self.dev))
        return self.copies[key][1]

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """x back on the first device (for the final norm and the head)."""
        self._switch(self.first)
        return x if x.device == self.first else x.to(self.first)

    def _switch(self, dev: torch.device) -> None:
        if dev != self.dev:
            self.dev = dev
            if dev.type == "cuda":
                torch.cuda.set_device(dev)


class DiffusionGemma(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        t = cfg.text
        if t.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ModelError(f"config.json: unsupported hidden_activation {t.hidden_activation!r}")
        if t.sliding_window < 2:
            raise ModelError("config.json: sliding_window must be at least 2")
        self.cfg = cfg
        # On the meta device (loading), `_weight` skips nn.Embedding's random init: there it runs through torch's
        # reference ops, which import the compiler stack (and Triton, where installed): seconds and ~100 MB for
        # nothing. Elsewhere (training) the usual init runs, so seeded runs draw the same numbers as before.
        on_meta = torch.empty(0).device.type == "meta"
        self.embed_tokens = nn.Embedding(t.vocab_size, t.hidden_size,
                                         _weight=torch.empty(t.vocab_size, t.hidden_size) if on_meta else None)
        self.layers = nn.ModuleList(Layer(t, spec) for spec in t.layers)
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.self_conditioning = SelfConditioning(t)
        # layer_scalar is stored once per mode in the checkpoint: [L] each.
        self.encoder_layer_scalar = nn.Parameter(torch.ones(t.num_hidden_layers))
        self.decoder_layer_scalar = nn.Parameter(torch.ones(t.num_hidden_layers))
        # which pass runs: adapters (tuner/lora.py) hold a delta per pass, as the reference's two trees
        self.phase = Phase()
        self.token_rows: dict = {}  # "encoder"/"decoder" -> embedding rows an adapter replaces (lora.TokenRows)
        self.adapters: list = []  # (name, scale) of the adapters attached (lora.attach)
        self.checkpointing = False  # recompute each feed-forward stage in the backward pass (`_feed_forward`)
        # objects with start_pass() and end_pass(), called around each `encode` and `denoise` (streamed experts'
        # copies: placement/streaming.py, which joins its copy stream at a pass's end)
        self.pass_hooks: list = []
        # each layer's device when the layers are split over several (the placement plan's split, engine.load); None:
        # every layer on `device`. The embedding, self-conditioning, final norm and head stay on the first.
        self.layer_devices: list[torch.device] | None = None
        # RoPE tables are derived from the config, never loaded: plain tensors, moved on use.
        self.inv_freq = {k: rope_inv_freq(t.rope_parameters[k], t.head_dim_of(k)) for k in set(t.layer_types)}

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: the embedding's, or where it is held as GGUF blocks (uint8) the final norm's."""
        w = self.embed_tokens.weight
        return w.dtype if w.is_floating_point() else self.norm.weight.dtype

    @property
    def packed_embedding(self) -> bool:
        """Whether the tied embedding is held as GGUF blocks (quant/ggml_modules.GGUFEmbedding): every read of it
        goes through that module (lookup, head, soft) or the fused head's block-reading kernels."""
        return getattr(self.embed_tokens, "format", None) == "gguf"

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def embed_scale(self, as_float: bool = False) -> torch.Tensor | float:
        """sqrt(hidden) rounded to the weight dtype, as the reference's scaled embedding holds it: a 0-dim tensor on
        the weight's device, or with `as_float` the same value as a Python float (for a kernel's argument). Made
        once per device and dtype (neither a host-to-device copy nor a device read can happen inside a captured CUDA
        graph)."""
        key = (self.device, self.dtype)
        cached = self.__dict__.get("_embed_scale")
        if cached is None or cached[0] != key:
            value = torch.tensor(self.cfg.text.hidden_size**0.5, dtype=torch.float32).to(self.dtype)
            self.__dict__["_embed_scale"] = cached = (key, value.to(self.device), value.item())
        return cached[2] if as_float else cached[1]

    def _feed_forward(self, layer: Layer, x: torch.Tensor, scalar: torch.Tensor, experts_per_row: bool = False,
                      normed: tuple | None = None) -> torch.Tensor:
        """A layer's feed-forward stage; under `checkpointing` while gradients are taken (dgemma tune), recomputed in
        the backward pass instead of kept: a quantized layer's dequantized experts then live one layer at a time, not
        all layers at once. The recomputation runs in the pass it was made in (adapters keep a delta per pass).
        normed: its input norms already taken (Layer.post_attention), where they ran fused."""
        if not (self.checkpointing and torch.is_grad_enabled()):
            return layer.feed_forward(x, scalar, experts_per_row, normed)
        from torch.utils.checkpoint import checkpoint

        encoding = self.phase.encoding

        def stage(x: torch.Tensor, scalar: torch.Tensor) -> torch.Tensor:
            was, self.phase.encoding = self.phase.encoding, encoding
            try:
                return layer.feed_forward(x, scalar, experts_per_row)
            finally:
                self.phase.encoding = was

        return checkpoint(stage, x, scalar, use_reentrant=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed_embedding:
            x = self.embed_tokens.lookup(ids, self.dtype)
        else:
            x = F.embedding(ids, self.embed_tokens.weight)
        rows = self.token_rows.get(self.phase.side)
        if rows is not None:  # an adapter's replaced rows (peft's trainable tokens), this pass's lookups
            x = rows.lookup(ids, x)
        return x * self.embed_scale()

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden [B, T, H] -> soft-capped float32 logits [B, T, V] (tied embedding).

        With `out` (float32 [B*T, V]) the logits are written there and capped in place: no canvas x vocab
        allocation per step (on the CPU a fresh 32 MB buffer costs as much as the op that fills it).
        """
        B, T, H = hidden.shape
        w = self.embed_tokens.weight
        cap = self.cfg.text.final_logit_softcapping
        rows = self.token_rows.get("encoder")  # the tied head takes the encoder's embedding rows, as peft ties them
        if self.packed_embedding:  # the blocks' product (GGUF), then as below
            logits = self.embed_tokens.head(hidden.reshape(B * T, H)).view(B, T, -1).float()
            if rows is not None:
                logits = logits.index_copy(-1, rows.ids, F.linear(hidden, rows.rows.to(hidden.dtype)).float())
            if cap:
                logits = torch.tanh(logits / cap) * cap
            if out is None:
                return logits
            out.copy_(logits.view(B * T, -1))
            return out.view(B, T, -1)
        if out is None or rows is not None:  # out of place (differentiable): the same values
            logits = F.linear(hidden, w).float()
            if rows is not None:
                logits = logits.index_copy(-1, rows.ids, F.linear(hidden, rows.rows.to(hidden.dtype)).float())
            logits = torch.tanh(logits / cap) * cap if cap else logits
            if out is None:
                return logits
            out.copy_(logits.view(B * T, -1))
            return out.view(B, T, -1)
        if w.dtype == torch.float32:
            torch.matmul(hidden.reshape(B * T, H), w.t(), out=out)
        elif cap and _fused_softcap(out):  # the conversion and the cap in one pass (quant/kernels/softcap.py)
            from quant.kernels.softcap import softcap_into

            softcap_into(out, torch.matmul(hidden.reshape(B * T, H), w.t()), cap)
            return out.view(B, T, -1)
        else:
            out.copy_(torch.matmul(hidden.reshape(B * T, H), w.t()))
        if cap:
            out.div_(cap).tanh_().mul_(cap)
        return out.view(B, T, -1)

    def fused_head(self, hidden: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor, buffers):
        """Final-normed hidden [B, T, H] -> the sampler's draws, argmax, entropy and the next step's soft embedding,
        written into `buffers` (quant.kernels.head.HeadBuffers) by the fused head: no logits tensor. temperature
        float32 [B*T], uniforms float32 [B*T, 2] (the sampler's, quant/kernels/head.py says how they are used)."""
        from quant.kernels.head import fused_head

        B, T, H = hidden.shape
        return fused_head(hidden.reshape(B * T, H), self.embed_tokens.weight, self.cfg.text.final_logit_softcapping,
                          self.embed_scale(as_float=True), temperature, uniforms, buffers,
                          kind=self.embed_tokens.kind if self.packed_embedding else None)

    @property
    def head_family(self) -> str | None:
        """The doctor's kernel family the fused head runs as (quant/kernels/probe.py): the GGUF blocks' own; None
        where its kernels cannot read this embedding's blocks (a hidden size not in whole tiles of theirs: the
        sampler's torch path then)."""
        if not self.packed_embedding:
            return "head"
        from quant.ggml_modules import fused_head_fits

        return "head_gguf" if fused_head_fits(self.embed_tokens.kind, self.embed_tokens.embedding_dim) else None

    def split(self) -> LayerSplit | None:
        """A pass's LayerSplit when the layers span several devices, else None."""
        if self.layer_devices is None or all(d == self.device for d in self.layer_devices):
            return None
        return LayerSplit(self.layer_devices, self.device)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return KVCache(self, batch, capacity, self.device, self.dtype)

    # ------------------------------------------------------------------ encoder (causal, writes the cache)

    def encode(self, ids: torch.Tensor, cache: KVCache, valid: torch.Tensor | None = None,
               return_hidden: bool = False, image_features: torch.Tensor | None = None) -> torch.Tensor | None:
        """Append ids [B, T] to the cache (positions length .. length+T-1).

        valid [B, T] marks real tokens (False = left padding, masked as a key everywhere).
        image_features [N, H] (the vision tower's soft tokens, row after row) replace the embeddings of the N image
        tokens in ids; when the config says `use_bidirectional_attention: vision`, each run of image tokens (one
        image) also attends to itself in both directions, in every layer.
        Returns the final-normed hidden states [B, T, H] only if asked (the sampler never needs them).
        """
        self.phase.encoding = True
        for hook in self.pass_hooks:
            hook.start_pass()
        try:
            return self._encode(ids, cache, valid, return_hidden, image_features)
        finally:
            self.phase.encoding = False
            for hook in self.pass_hooks:
                hook.end_pass()

    def _encode(self, ids: torch.Tensor, cache: KVCache, valid: torch.Tensor | None,
                return_hidden: bool, image_features: torch.Tensor | None) -> torch.Tensor | None:
        B, T = ids.shape
        L0, W = cache.length, self.cfg.text.sliding_window
        if L0 + T > cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} positions; cannot append {T} to {L0}")
        dev = ids.device
        if valid is None:
            valid = torch.ones(B, T, dtype=torch.bool, device=dev)
        cache.valid[:, L0 : L0 + T] = valid
        qpos = torch.arange(L0, L0 + T, device=dev)
        n_win = cache.window_filled
        padded = not bool(valid.all()) or not bool(cache.valid[:, :L0].all())
        self_key = torch.eye(T, dtype=torch.bool, device=dev)  # a padding query still sees itself (no NaN rows)

        x = self.embed(ids)
        blocks = None  # bool [B, T, T]: query and key in the same image
        if image_features is not None:
            x, blocks = self.place_images(ids, x, image_features)

        def mask_for(kpos: torch.Tensor, kvalid: torch.Tensor, window: int | None) -> torch.Tensor | None:
            """bool [B, 1, T, S] over keys at absolute positions kpos [S]; None when plain causal suffices."""
            if L0 == 0 and not padded and blocks is None and (window is None or T < window):
                return None  # keys are exactly the queries: SDPA's causal flag (as the reference does)
            ok = kpos[None, :] <= qpos[:, None]
            if window is not None:
                ok = ok & (qpos[:, None] - kpos[None, :] < window)
            m = ok[None] & kvalid[:, None, :]
            m[:, :, -T:] |= self_key
            if blocks is not None:  # the last T keys are this chunk's own tokens
                m[:, :, -T:] |= blocks
            return m[:, None]

        masks = {
            FULL: mask_for(torch.arange(L0 + T, device=dev), cache.valid[:, : L0 + T], None),
            SLIDING: mask_for(torch.cat([cache.window_positions(dev), qpos]),
                              torch.cat([cache.window_valid(), valid], dim=1), W),
        }

        rope = {k: rope_cos_sin(f, qpos[None], x.dtype) for k, f in self.inv_freq.items()}
        last = len(self.layers) - 1
        split = self.split()
        for i, layer in enumerate(self.layers):
            kind = layer.spec.kind
            cos, sin = rope[kind]
            mask, scalar = masks[kind], self.encoder_layer_scalar[i]
            if split is not None:  # onto the layer's device
                x = split.enter(i, x)
                cos, sin, mask, scalar = split.here(cos), split.here(sin), split.here(mask), split.here(scalar)
            h, quantized = layer.attention_input(x)
            q, k, v = layer.self_attn.qkv(h, cos, sin, quantized=quantized)
            if kind == FULL:
                cache.k[i][:, :, L0 : L0 + T] = k
                cache.v[i][:, :, L0 : L0 + T] = v
                keys, values = cache.k[i][:, :, : L0 + T], cache.v[i][:, :, : L0 + T]
            else:  # the filled window slots, then the new tokens; keep the last W - 1 of them
                win = slice(cache.window - n_win, cache.window)
                keys = torch.cat([cache.k[i][:, :, win], k], dim=2)
                values = torch.cat([cache.v[i][:, :, win], v], dim=2)
                keep = min(cache.window, keys.shape[2])
                cache.k[i][:, :, cache.window - keep : cache.window] = keys[:, :, -keep:]
                cache.v[i][:, :, cache.window - keep : cache.window] = values[:, :, -keep:]
            if i == last and not return_hidden:
                break  # the last layer's output feeds nothing the cache needs
            h = layer.self_attn.o_proj(attend(q, keys, values, mask, causal=True))
            x, normed = layer.post_attention(x, h)
            x = self._feed_forward(layer, x, scalar, normed=normed)
        if split is not None:
            x = split.leave(x)
        cache.length = L0 + T
        return self.norm(x) if return_hidden else None

    def place_images(self, ids: torch.Tensor, x: torch.Tensor, features: torch.Tensor):
        """Put soft tokens features [N, H] at the N image tokens of ids [B, T] in the embeddings x [B, T, H].

        Returns (x, blocks): blocks bool [B, T, T] is True where query and key lie in the same run of image tokens
        (None when the config keeps image tokens causal).
        """
        vision = self.cfg.vision
        if vision is None:
            raise ModelError("this checkpoint has no vision tower: it cannot read images")
        at = ids == vision.image_token_id  # [B, T]
        if int(at.sum()) != features.shape[0]:
            raise ValueError(f"{int(at.sum())} image tokens for {features.shape[0]} image soft tokens")
        x = x.masked_scatter(at[..., None], features.to(x.dtype))
        if self.cfg.text.use_bidirectional_attention != "vision":
            return x, None
        starts = at & ~F.pad(at[:, :-1], (1, 0), value=False)  # first token of each run
        run = torch.where(at, torch.cumsum(starts.int(), dim=1), 0)  # [B, T]: 1, 2, ... per image; 0 for text
        return x, (run[:, :, None] == run[:, None, :]) & at[:, :, None]

    # ------------------------------------------------------------------ decoder (bidirectional, read-only)

    def denoise_context(self, cache: KVCache, batch: int) -> DenoiseContext:
        """Masks, RoPE and buffer offsets for a canvas placed right after the cached positions."""
        C, L, dev = self.cfg.canvas_length, cache.length, self.device
        pos = torch.arange(L, L + C, device=dev)[None]
        rope = {k: rope_cos_sin(f, pos, self.dtype) for k, f in self.inv_freq.items()}
        canvas_valid = torch.ones(batch, C, dtype=torch.bool, device=dev)
        full_valid = torch.cat([cache.valid[:, :L], canvas_valid], dim=1)
        slide_valid = torch.cat([cache.window_valid(), canvas_valid], dim=1)
        mask = {FULL: None if bool(full_valid.all()) else full_valid[:, None, None, :].expand(-1, 1, C, -1),
                SLIDING: None if bool(slide_valid.all()) else slide_valid[:, None, None, :].expand(-1, 1, C, -1)}
        # keys each layer kind reads: [start, end) of its buffer; the canvas goes at end - C
        keys = {FULL: (0, L + C), SLIDING: (cache.window - cache.window_filled, cache.window + C)}
        return DenoiseContext(cos={k: c for k, (c, _) in rope.items()}, sin={k: s for k, (_, s) in rope.items()},
                              mask=mask, keys=keys)

    def soft_embedding(self, probs: torch.Tensor, rows_at_once: int = 64) -> torch.Tensor:
        """Self-conditioning input: probs [R, V] (float32) @ embedding [V, H] * sqrt(H) -> [R, H].

        When the weights are in another dtype the probabilities are converted `rows_at_once` rows at a time, so no
        second canvas x vocab tensor is made (the sampler may hold only one: the buffer `probs` lives in).
        """
        if self.packed_embedding:
            return self.embed_tokens.soft(probs, self.dtype) * self.embed_scale()
        w = self.embed_tokens.weight
        if probs.dtype == w.dtype:
            return torch.matmul(probs, w) * self.embed_scale()
        out = torch.empty(probs.shape[0], w.shape[1], dtype=w.dtype, device=w.device)
        for lo in range(0, probs.shape[0], rows_at_once):
            torch.matmul(probs[lo : lo + rows_at_once].to(w.dtype), w, out=out[lo : lo + rows_at_once])
        return out * self.embed_scale()

    def _soft_of_rows(self, probs: torch.Tensor, rows: list[int], C: int) -> torch.Tensor:
        """The soft embeddings [S, C, H] of the canvas rows `rows` (sorted) from their softmax in probs [>= B*C, V]:
        one soft-embedding matmul per run of consecutive rows."""
        soft = torch.empty(len(rows), C, self.cfg.text.hidden_size, dtype=self.dtype, device=probs.device)
        k = 0
        while k < len(rows):
            j = k
            while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
                j += 1
            lo, hi = rows[k], rows[j] + 1
            soft[k : j + 1] = self.soft_embedding(probs[lo * C : hi * C]).view(hi - lo, C, -1)
            k = j + 1
        return soft

    def _self_condition_rows(self, x: torch.Tensor, soft: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Self-conditioning for the canvas rows `rows` of x [B, C, H] (sorted) from their soft embeddings soft
        [len(rows), C, H]; the other rows get the first step's (no soft signal). The MLP runs on those rows only,
        so the rows' adapter slots (`Phase.row_slots`, [B]) are narrowed to them for it: an adapted projection
        masks its term by the rows it is given."""
        sc = self.self_conditioning
        h = sc.pre_norm(soft)
        idx = host_index(rows, x.device)
        every = self.phase.row_slots
        if every is not None:
            self.phase.row_slots = every[idx]  # [len(rows)]
        try:
            signal = sc.down_proj(gelu_tanh(sc.gate_proj(h)) * sc.up_proj(h))
        finally:
            self.phase.row_slots = every
        x = x.index_put((idx,), x[idx] + signal)
        return sc.post_norm(x)

    def denoise(self, canvas: torch.Tensor, cache: KVCache | list[KVCache], ctx: DenoiseContext | list[DenoiseContext],
                sc_logits: torch.Tensor | None = None, sc_probs: torch.Tensor | None = None,
                sc_soft: torch.Tensor | None = None, out: torch.Tensor | None = None, return_hidden: bool = False, sc_rows: list[int] | None = None,
                experts_per_row: bool = False) -> torch.Tensor:
        """One denoising forward pass over the canvas: the one path for a single generation and the server's batch.

        canvas [B, C] ids. cache, ctx: one KVCache of batch B and its context (a generation of B rows), or lists of
        caches and contexts that cover the rows in order (the server: one request of batch 1 per row, each with its
        own cache and canvas position); attention runs per cache, everything else on all rows at once.
        Self-conditioning from the previous step, given either as its processed logits sc_logits [B, C, V] or
        directly as their softmax sc_probs [B*C, V] float32 (the sampler already has it), or as the soft embedding of
        that softmax sc_soft [B*C, H] (the fused head made it: `fused_head`); none at the first step.
        sc_rows: only these rows have a previous step (the others' probs are not read; None: all rows).
        experts_per_row: the routed experts on each row apart (Layer.feed_forward). Returns float32 soft-capped
        logits [B, C, V], written into `out` [B*C, V] when given.
        """
        for hook in self.pass_hooks:
            hook.start_pass()
        try:
            return self._denoise(canvas, cache, ctx, sc_logits, sc_probs, sc_soft, out, return_hidden, sc_rows,
                                 experts_per_row)
        finally:
            for hook in self.pass_hooks:
                hook.end_pass()

    def _denoise(self, canvas: torch.Tensor, cache, ctx, sc_logits, sc_probs, sc_soft, out, return_hidden: bool,
                 sc_rows, experts_per_row: bool) -> torch.Tensor:
        B, C = canvas.shape
        caches, ctxs = ([cache], [ctx]) if isinstance(cache, KVCache) else (list(cache), list(ctx))
        x = self.embed(canvas)
        if sc_logits is not None:
            sc_probs = sc_logits.softmax(dim=-1, dtype=torch.float32)
        if sc_soft is not None and sc_rows is None:
            x = self.self_conditioning(x, sc_soft.view(B, C, -1))
        elif sc_soft is not None and sc_rows:
            x = self._self_condition_rows(x, sc_soft.view(B, C, -1)[host_index(sc_rows, x.device)], sc_rows)
        elif sc_probs is not None and sc_rows is None:
            x = self.self_conditioning(x, self.soft_embedding(sc_probs.view(B * C, -1)).view(B, C, -1))
        elif sc_probs is not None and sc_rows:
            x = self._self_condition_rows(x, self._soft_of_rows(sc_probs, sc_rows, C), sc_rows)
        else:
            x = self.self_conditioning(x, None)
        split = self.split()
        for i, layer in enumerate(self.layers):
            kind = layer.spec.kind
            cos = ctxs[0].cos[kind] if len(ctxs) == 1 else torch.cat([c.cos[kind] for c in ctxs])  # [B, C, 1, D]
            sin = ctxs[0].sin[kind] if len(ctxs) == 1 else torch.cat([c.sin[kind] for c in ctxs])
            scalar = self.decoder_layer_scalar[i]
            if split is not None:  # onto the layer's device
                x = split.enter(i, x)
                cos, sin, scalar = split.here(cos), split.here(sin), split.here(scalar)
            # the canvas's k and v go to scratch slots past the cached prefix (the cache is not advanced): written
            # there by their norms when there is one cache, copied into each row's cache when there are several
            slots = None
            if len(caches) == 1:
                end = ctxs[0].keys[kind][1]
                slots = (caches[0].k[i][:, :, end - C : end], caches[0].v[i][:, :, end - C : end])
            h, quantized = layer.attention_input(x)
            q, k, v = layer.self_attn.qkv(h, cos, sin, kv_out=slots, quantized=quantized)
            heads, row = [], 0
            for part, pctx in zip(caches, ctxs):
                rows = slice(row, row + part.batch)
                start, end = pctx.keys[kind]
                if slots is None:
                    part.k[i][:, :, end - C : end] = k[rows]
                    part.v[i][:, :, end - C : end] = v[rows]
                heads.append(attend(q[rows], part.k[i][:, :, start:end], part.v[i][:, :, start:end],
                                    pctx.mask[kind] if split is None else split.here(pctx.mask[kind])))
                row += part.batch
            if row != B:
                raise ValueError(f"the caches cover {row} rows, the canvas has {B}")
            h = layer.self_attn.o_proj(heads[0] if len(heads) == 1 else torch.cat(heads))
            x, normed = layer.post_attention(x, h)
            x = self._feed_forward(layer, x, scalar, experts_per_row, normed)
        if split is not None:
            x = split.leave(x)
        x = self.norm(x)
        return x if return_hidden else self.logits(x, out)
