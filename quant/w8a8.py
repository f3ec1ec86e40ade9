"""8-bit weights per output channel with 8-bit activations per token (W8A8), FP8 e4m3 or INT8: the math.

Weights (compressed-tensors' channel layout): `weight` float8_e4m3fn or int8 [N, K] and `weight_scale` [N, 1];
value = float32(weight) * float32(weight_scale), one rounding (exact: the scales are bfloat16 on disk).

Activations are quantized at run time, per token (row) of x [T, K], symmetric, as the serving runtimes do:
scale [T, 1] = amax|x[t, :]| / QMAX (448 for e4m3, 127 for int8, in float32), then
FP8: e4m3(clamp(x / scale, -448, 448)) (round to nearest even); INT8: clamp(round(x / scale), -127, 127).
The product is then sum_k xq[t, k] * wq[n, k], accumulated in float32 (FP8) or int32 (INT8), times scale[t] times
weight_scale[n].

Two implementations of the same function:
- `matmul_hw`: torch's FP8 and INT8 matmuls (`torch._scaled_mm`, sm_89+; `torch._int_mm`, sm_80+), on CUDA;
- `matmul_emulated`: plain float32 PyTorch: the fake-quantized activations (xq * scale, one float32 rounding: exact
  for FP8 codes, not always for INT8 ones, whose 7 bits times a 24-bit scale can need more) times the
  exactly dequantized weights, i.e. a float model fed both. The reference, run on the CPU and wherever the GPU lacks
  the units; it equals the hardware product up to float32 rounding (the hardware scales after summing: INT8's
  integer sums are exact, FP8's are float32 sums in the hardware's order).
Which one runs, and whether activations are quantized at all, is `mode(...)`'s answer (DGEMMA_W8A8).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

QMAX = {"fp8": 448.0, "int8": 127.0}
DTYPE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
MIN_CAPABILITY = {"fp8": (8, 9), "int8": (8, 0)}  # FP8 tensor cores from Ada (sm_89), INT8 from Ampere (sm_80)
CHOICES = ("auto", "off", "on")


def requested() -> str:
    """DGEMMA_W8A8: `auto` (default) W8A8 where the GPU has the tensor cores, weight-only elsewhere; `off` weight-only
    everywhere; `on` W8A8 everywhere, emulated in PyTorch where the hardware path cannot run (the CPU included)."""
    value = os.environ.get("DGEMMA_W8A8", "auto").strip().lower() or "auto"
    value = {"0": "off", "false": "off", "no": "off", "1": "on", "true": "on", "yes": "on"}.get(value, value)
    if value not in CHOICES:
        raise ValueError(f"DGEMMA_W8A8 must be one of {', '.join(CHOICES)} (got {value!r})")
    return value


_checked: dict[tuple[str, int], bool] = {}


def hardware(kind: str, device: torch.device) -> bool:
    """Whether `device` has `kind`'s tensor cores and torch's matmul for them runs right there (`probe`, once per
    GPU and kind, at the first eager use; never inside a CUDA graph capture, which then takes the other path)."""
    if device.type != "cuda":
        return False
    if kind == "fp8" and not hasattr(torch, "_scaled_mm"):
        return False
    if torch.cuda.get_device_capability(device) < MIN_CAPABILITY[kind]:
        return False
    key = (kind, device.index if device.index is not None else torch.cuda.current_device())
    if key not in _checked:
        if torch.cuda.is_current_stream_capturing():
            return False
        _checked[key] = probe(kind, device)
    return _checked[key]


def probe(kind: str, device: torch.device) -> bool:
    """One small product through torch's FP8/INT8 matmul against the emulation on `device`; False, with one line on
    stderr, when the op fails there (a torch build without that GPU's kernels) or disagrees."""
    import sys

    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g)
    scale = w.abs().amax(-1, keepdim=True) / QMAX[kind]
    q = (w / scale).clamp(-QMAX[kind], QMAX[kind])
    q = (torch.round(q) if kind == "int8" else q).to(DTYPE[kind]).to(device)
    x = torch.randn(20, 64, generator=g).to(device, torch.bfloat16)
    scale = scale.to(device)
    try:
        got = matmul_hw(x, q, scale, kind).float()
    except RuntimeError as e:
        reason = f"failed to run ({(str(e).strip().splitlines() or [type(e).__name__])[0][:120]})"
    else:
        want = matmul_emulated(x, q, scale, kind).float()
        if (got - want).abs().max() <= 2e-2 * want.abs().max():
            return True
        reason = "disagrees with the emulation"
    print(f"dgemma: torch's {kind} matmul {reason} on this device; not using it", file=sys.stderr)
    return False


def mode(kind: str, device: torch.device) -> str:
    """How a W8A8 layer of `kind` runs on `device`: 'hw' (torch's FP8/INT8 matmul), 'emulate' (the float32
    reference of the same activation quantization) or 'weights' (weight-only: dequantize, 16-bit activations)."""
    choice = requested()
    if choice == "off":
        return "weights"
    if hardware(kind, device):
        return "hw"
    return "emulate" if choice == "on" else "weights"


def quantize_tokens(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (any float dtype) -> (xq [..., K] in kind's dtype, scale float32 [..., 1]): one scale per row."""
    xf = x.float()
    qmax = QMAX[kind]
    scale = (xf.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=torch.finfo(torch.float32).tiny)
    q = (xf / scale).clamp(-qmax, qmax)
    if kind == "int8":
        q = torch.round(q)  # half to even
    return q.to(DTYPE[kind]), scale


def fake_quantize_tokens(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x [..., K] -> float32 [..., K]: each row quantized as the hardware path does, then dequantized (exact)."""
    xq, scale = quantize_tokens(x, kind)
    return xq.float() * scale


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [..., N, K] (e4m3 or int8), weight_scale [..., N, 1] -> [..., N, K] in dtype (float32 product, cast)."""
    return (weight.float() * weight_scale.float()).to(dtype)


def matmul_emulated(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, kind: str) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: fake-quantized activations times the dequantized weights, in float32."""
    return F.linear(fake_quantize_tokens(x, kind), dequantize(weight, weight_scale)).to(x.dtype)


def hw_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Shapes and dtypes torch's FP8/INT8 matmuls take: bfloat16 activations (row-wise FP8 scaling writes bf16) and
    K, N multiples of 16."""
    N, K = weight.shape
    return x.dtype == torch.bfloat16 and K % 16 == 0 and N % 16 == 0


INT_MM_MIN_ROWS = 17  # cuBLASLt's INT8 matmul wants more than 16 rows: fewer are padded with zeros


def matmul_hw(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, kind: str,
              quantize=None) -> torch.Tensor:
    """x [T, K] -> [T, N] in x's dtype through torch's FP8 (`_scaled_mm`) or INT8 (`_int_mm`) matmul.

    weight [N, K] row-major is passed transposed, i.e. column-major [K, N], the layout both want; weight_scale
    [N, 1] float32. No host round trip (graph-capturable)."""
    xq, scale = (quantize or quantize_tokens)(x, kind)
    if kind == "fp8":
        return torch._scaled_mm(xq, weight.t(), scale_a=scale, scale_b=weight_scale.float().t(),
                                out_dtype=x.dtype)
    T = xq.shape[0]
    if T < INT_MM_MIN_ROWS:
        xq = F.pad(xq, (0, 0, 0, INT_MM_MIN_ROWS - T))
    acc = torch._int_mm(xq, weight.t())[:T]  # int32 [T, N]
    return (acc.float() * scale * weight_scale.float().t()).to(x.dtype)


def matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, kind: str, how: str,
           quantize=None) -> torch.Tensor:
    """x [..., K] -> [..., N]: `how` as `mode` answers ('hw' falls back to the emulation for shapes it cannot take).
    The float paths keep x's shape as nn.Linear does, so they give the bits of a float model's F.linear.
    quantize: the 'hw' path's activation quantizer (default quantize_tokens; the modules pass a fused one)."""
    if how == "weights":
        return F.linear(x, dequantize(weight, weight_scale, x.dtype))
    if how == "hw" and hw_fits(x, weight):
        x2 = x.reshape(-1, x.shape[-1])
        return matmul_hw(x2, weight, weight_scale, kind, quantize).reshape(*x.shape[:-1], weight.shape[0])
    return matmul_emulated(x, weight, weight_scale, kind)


# ----------------------------------------------------------------------------- weights, as compressed-tensors stores them

# Row-scale candidates of the search, as fractions of the absmax scale (1.0 first: ties keep absmax).
SEARCH_FACTORS = (1.0, 0.95, 0.9, 0.85, 0.8)


def _bf16_at_least(x: torch.Tensor) -> torch.Tensor:
    """x float32 (positive) -> the smallest bfloat16 >= x: a row's largest weight then still fits in the codes."""
    b = x.bfloat16()
    up = (b.view(torch.int16) + 1).view(torch.bfloat16)  # the next bfloat16 up (x > 0)
    return torch.where(b.float() < x, up, b)


def _codes(w: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """w float32 [N, K], scale float32 [N, 1] -> codes [N, K]: int8 rounds half to even, e4m3 to the nearest even."""
    qmax = QMAX[kind]
    q = (w / scale).clamp(-qmax, qmax)
    return torch.round(q).to(torch.int8) if kind == "int8" else q.to(torch.float8_e4m3fn)


def quantize(w: torch.Tensor, kind: str, search: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (weight [N, K] e4m3 or int8, weight_scale bfloat16 [N, 1]): symmetric, one scale per output
    channel, value = float32(weight) * float32(weight_scale).

    Absmax: the scale is amax|W[n, :]| / qmax (127 or 448) rounded *up* to bfloat16, the dtype it is stored in, and the
    codes are computed with that stored scale, so the file holds exactly what is dequantized (nothing clips). With
    `search` each row also tries scales a little below (SEARCH_FACTORS, rounded to bfloat16) and keeps the one with
    the smallest squared error; absmax is a candidate, so the search never does worse, row by row."""
    w = w.float()
    tiny = torch.finfo(torch.bfloat16).tiny
    absmax = (w.abs().amax(dim=1, keepdim=True) / QMAX[kind]).clamp(min=tiny)  # [N, 1] float32
    scale = _bf16_at_least(absmax)
    q = _codes(w, scale.float(), kind)
    if not search:
        return q, scale
    err = (q.float() * scale.float() - w).pow(2).sum(1, keepdim=True)
    for f in SEARCH_FACTORS[1:]:
        cand = (absmax * f).clamp(min=tiny).bfloat16()
        cq = _codes(w, cand.float(), kind)
        cerr = (cq.float() * cand.float() - w).pow(2).sum(1, keepdim=True)
        better = cerr < err
        q, scale, err = torch.where(better, cq, q), torch.where(better, cand, scale), torch.where(better, cerr, err)
    return q, scale
