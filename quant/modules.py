"""Quantized modules: packed weights in memory, a plain PyTorch reference forward that dequantizes just before use.

Buffers carry the names they have in a checkpoint, so a loader maps them one to one:
- `NVFP4Linear`: weight uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_scale_2 float32 [] (ModelOpt),
  and, where the checkpoint has one, input_scale float32 [] (the calibrated activation scale W4A4 uses).
- `Int8Linear`: weight int8 [N, K], weight_scale float32 [N] (dgemma's INT8).
- `W8A8Linear`: weight float8_e4m3fn or int8 [N, K], weight_scale float32 [N, 1] (compressed-tensors' channel
  layout), with dynamic per-token 8-bit activations where the GPU has the tensor cores (w8a8.py).
- `NVFP4Stack` / `Int8Stack` / `W8A8Stack`: E matrices [E, N, K] stacked (routed experts), same packing per
  matrix; NVFP4 keeps one global scale per expert per row segment, weight_scale_2 [E, S], so an expert's gate and up
  halves may carry their own (ModelOpt stores them per projection), and input_scale [E, S] likewise where the
  checkpoint has them. `dequantize(dtype)` gives [E, N, K], a few
  experts at a time so the float32 temporaries stay small.
The Triton kernels (quant/kernels/) implement the same functions behind the same modules: `forward` and
`fused_experts` call them when `DGEMMA_KERNELS` selects Triton for the input's device and the kernel passed its
first-use check on that GPU (kernels/probe.py), and the reference otherwise.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import int8, nvfp4, w8a8
from .kernels import use_triton
from .kernels.probe import family_ok


def w4a4(device: torch.device) -> bool:
    """NVFP4 linears and experts multiply FP4 activations (W4A4, quantized on the fly with the checkpoint's
    calibrated `input_scale`, or per token where it has none) where the GPU has
    FP4 tensor cores, sm_100 and sm_120, unless DGEMMA_W4A4=0; elsewhere (and on the CPU) 16-bit activations. W4A4
    trades accuracy for math throughput: see docs/speed.md and BENCHMARKS.md."""
    import os

    from .kernels.nvfp4_w4a4 import supported

    return os.environ.get("DGEMMA_W4A4", "1").strip() not in ("0", "off", "false", "no") and supported(device)


DEQUANT_CHUNK = 8  # experts dequantized per pass: bounds the float32 temporaries to 8 experts' worth


class NVFP4Linear(nn.Module):
    format = "nvfp4"

    def __init__(self, in_features: int, out_features: int, device=None):
        super().__init__()
        if in_features % nvfp4.BLOCK:
            raise ValueError(f"NVFP4 needs in_features to be a multiple of {nvfp4.BLOCK} (got {in_features})")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, in_features // nvfp4.BLOCK,
                                                         dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale_2", torch.empty((), dtype=torch.float32, device=device))
        self.register_buffer("input_scale", None)  # a buffer once `expect_input_scale` says the checkpoint has one

    def expect_input_scale(self) -> None:
        """The checkpoint stores this module's calibrated activation scale: load it (W4A4 then uses it)."""
        self.register_buffer("input_scale", torch.empty((), dtype=torch.float32, device=self.weight.device))

    @classmethod
    def from_weight(cls, q: nvfp4.NVFP4Weight) -> NVFP4Linear:
        N, K = q.shape
        m = cls(K, N)
        m.weight, m.weight_scale, m.weight_scale_2 = q.weight, q.weight_scale, q.weight_scale_2.float().reshape(())
        return m

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in dtype."""
        return nvfp4.dequantize_packed(self.weight, self.weight_scale, self.weight_scale_2.expand(self.out_features),
                                       dtype)

    def forward(self, x: torch.Tensor, lora=None, quantized: tuple | None = None) -> torch.Tensor:
        """lora: adapters' terms (kernels/lora.LinearAdapters) for the kernel's epilogue, only where `takes_lora`
        said so. quantized: x already quantized as this linear's W4A4 kernel takes it (`quantize_input`, shared with
        the linears that read the same x: `joint`)."""
        if self._w4a4(x):
            from .kernels.nvfp4_w4a4 import nvfp4_w4a4

            return nvfp4_w4a4(x, self.weight, self.weight_scale, self.row_scale_2(), self.input_scale, lora,
                              quantized=quantized)
        if quantized is not None:
            raise RuntimeError("NVFP4Linear: a quantized input given where its kernel takes 16-bit activations")
        if use_triton(x.device) and family_ok("nvfp4_linear", x.device, x.dtype):
            from .kernels.nvfp4_linear import nvfp4_linear

            return nvfp4_linear(x, self.weight, self.weight_scale, self.row_scale_2(), lora=lora)
        if lora is not None:
            raise RuntimeError("NVFP4Linear: adapters' terms given where no kernel takes them (ask takes_lora)")
        return F.linear(x, self.dequantize(x.dtype))

    def _w4a4(self, x: torch.Tensor) -> bool:
        return (use_triton(x.device) and self.in_features % 32 == 0 and w4a4(x.device)
                and family_ok("nvfp4_w4a4", x.device, x.dtype))

    def joint_key(self, x: torch.Tensor) -> tuple | None:
        """Which linears of the same x this one can run with in one launch (`joint`, through `project`): those of
        an equal key, the NVFP4 linears of its kernel (W4A4: quantizing x alike); None: it runs alone."""
        if self._w4a4(x):
            return ("nvfp4 w4a4", self.in_features, "static" if self.input_scale is not None else "per token")
        if use_triton(x.device) and family_ok("nvfp4_linear", x.device, x.dtype):
            return ("nvfp4", self.in_features)
        return None

    def norm_quantization(self, x: torch.Tensor, peers: tuple) -> tuple[str, torch.Tensor | None] | None:
        """`quant.modules.norm_quantization` for this linear and peers of its `joint_key`."""
        return ("nvfp4", shared_input_scale((self, *peers))) if self._w4a4(x) else None

    def joint(self, x: torch.Tensor, peers: tuple, quantized: tuple | None = None) -> list[torch.Tensor]:
        """[self(x), *(p(x) for p in peers)] for peers of this linear's `joint_key`, up to three linears a launch
        (W4A4: x quantized once for all of them, or `quantized` made already)."""
        from .kernels.nvfp4_linear import nvfp4_linear
        from .kernels.nvfp4_w4a4 import nvfp4_w4a4

        if self._w4a4(x) and quantized is None:
            quantized = self.quantize_input(x, peers)

        def launch(first: NVFP4Linear, rest: tuple) -> list[torch.Tensor]:
            args = (x, first.weight, first.weight_scale, first.row_scale_2())
            more = [(m.weight, m.weight_scale, m.row_scale_2()) for m in rest]
            return nvfp4_w4a4(*args, quantized=quantized, more=more) if quantized is not None \
                else nvfp4_linear(*args, more=more)

        return _in_threes(x, (self, *peers), quantized, launch)

    def quantize_input(self, x: torch.Tensor, peers: tuple = ()) -> tuple:
        """x quantized once for this linear and `peers` (W4A4 linears of the same `joint_key`): NVFP4 codes,
        block scales and a global scale per row (kernels/nvfp4_act.py), with the largest of their calibrated input
        scales where the checkpoint has them (as vLLM's fused QKV and gate-up layers take them), per token
        otherwise."""
        from .kernels.nvfp4_act import quantize_act

        return quantize_act(x.reshape(-1, self.in_features), global_scale=shared_input_scale((self, *peers)))

    def takes_lora(self, x: torch.Tensor) -> bool:
        """Whether adapters' terms on this linear run in its kernel's epilogue for x (`forward(x, lora)`): where
        either NVFP4 kernel runs (W4A4 included: the terms' rank products are taken from the 16-bit x)."""
        return (use_triton(x.device) and (self._w4a4(x) or family_ok("nvfp4_linear", x.device, x.dtype))
                and family_ok("lora_epilogue", x.device, x.dtype))

    def gated(self, x: torch.Tensor, up: nn.Module, lora=None, lora_up=None,
              quantized: tuple | None = None) -> torch.Tensor | None:
        """gelu_tanh(self(x)) * up(x) in one kernel where an NVFP4 kernel runs and `up` is an NVFP4Linear of the
        same shape (on the W4A4 path: x quantized once for both, without adapters, or `quantized` made already);
        None elsewhere (the caller runs the three ops). lora, lora_up: adapters' terms on both halves
        (`takes_lora`), in the epilogue."""
        if (type(up) is not NVFP4Linear or up.weight.shape != self.weight.shape or not use_triton(x.device)):
            return None
        halves = (up.weight, up.weight_scale, up.row_scale_2())
        if self._w4a4(x):
            if (lora is not None or lora_up is not None or up.joint_key(x) != self.joint_key(x)
                    or not family_ok("nvfp4_w4a4_gated", x.device, x.dtype)):
                return None
            from .kernels.nvfp4_w4a4 import nvfp4_w4a4

            return nvfp4_w4a4(x, self.weight, self.weight_scale, self.row_scale_2(),
                              quantized=quantized or self.quantize_input(x, (up,)), up=halves)
        if (self.in_features % 32 == 0 and w4a4(x.device)) or not family_ok("nvfp4_linear", x.device, x.dtype):
            return None
        from .kernels.nvfp4_linear import nvfp4_linear

        return nvfp4_linear(x, self.weight, self.weight_scale, self.row_scale_2(), up=halves, lora=lora,
                            lora_up=lora_up)

    def row_scale_2(self) -> torch.Tensor:
        """The global scale once per output row, float32 [N] contiguous, as the kernels read it: made at the first
        call and again only when weight_scale_2 changes (not a copy per call)."""
        s2 = self.weight_scale_2
        key = (s2.data_ptr(), s2._version, s2.device, s2.shape)
        if self.__dict__.get("_row_scale_2_key") != key:
            self.__dict__["_row_scale_2"] = s2.float().expand(self.out_features).contiguous()
            self.__dict__["_row_scale_2_key"] = key
        return self.__dict__["_row_scale_2"]


def shared_input_scale(linears: tuple) -> torch.Tensor | None:
    """The calibrated input scale several NVFP4 linears reading the same x quantize it with: the largest of theirs
    (equal in practice: calibration saw the same activations), made once and kept while theirs are unchanged; None
    when they have none (per-token scales)."""
    scales = [m.input_scale for m in linears]
    if scales[0] is None:
        return None
    if len(scales) == 1:
        return scales[0]
    key = tuple((s.data_ptr(), s._version, s.device) for s in scales)
    kept = linears[0].__dict__
    if kept.get("_shared_scale_key") != key:
        kept["_shared_scale"] = torch.stack([s.float().reshape(()) for s in scales]).amax()
        kept["_shared_scale_key"] = key
    return kept["_shared_scale"]


def _in_threes(x: torch.Tensor, linears: tuple, quantized: tuple | None, launch) -> list[torch.Tensor]:
    """Each linear's output on x, up to three linears a launch (`launch(first, rest)`: the kernels take one or two
    more linears beside the first); a linear left alone runs its own forward."""
    out = []
    for i in range(0, len(linears), 3):
        first, rest = linears[i], linears[i + 1:i + 3]
        out += launch(first, rest) if rest else [first(x, quantized=quantized)]
    return out


def project(x: torch.Tensor, linears: list, quantized: tuple | None = None) -> list:
    """[linear(x) for linear in linears] (None for None), the linears that can run together (`joint_key`) run
    together (`joint`): q, k and v read the same x, as do the dense MLP's gate and up. NVFP4 and W8A8 (where our
    kernel runs): up to three linears a launch, x quantized once for them where they quantize it (W4A4, W8A8; on
    torch's 8-bit matmul: quantized once, a matmul each).
    quantized: x's quantization for all of them, made already (`norm_quantization` said how: by x's norm)."""
    keys = [m.joint_key(x) if hasattr(m, "joint_key") else None for m in linears]
    groups: dict = {}
    for m, key in zip(linears, keys):
        if key is not None:
            groups.setdefault(key, []).append(m)
    if quantized is not None and (len(groups) != 1 or any(m is not None and k is None for m, k in zip(linears, keys))):
        raise ValueError("a quantization made for linears that do not all quantize alike")
    done = {}
    for group in groups.values():
        if len(group) > 1 or quantized is not None:
            done.update(zip(map(id, group), group[0].joint(x, tuple(group[1:]), quantized)))
    return [None if m is None else done[id(m)] if id(m) in done else m(x) for m in linears]


def norm_quantization(x: torch.Tensor, linears: list) -> tuple[str, torch.Tensor | None] | None:
    """How the norm that makes x should quantize it for `linears` (None entries skipped), all reading x: (format,
    calibrated scale or None) for kernels/rmsnorm.rms_norm's `quantize` and `input_scale`, where they all
    quantize x alike (W4A4 NVFP4, W8A8 on our kernel); None otherwise (each quantizes it itself, or none does)."""
    mine = [m for m in linears if m is not None]
    keys = {m.joint_key(x) if hasattr(m, "joint_key") else None for m in mine}
    if len(keys) != 1 or None in keys:
        return None
    return mine[0].norm_quantization(x, tuple(mine[1:]))


class Int8Linear(nn.Module):
    format = "int8"

    def __init__(self, in_features: int, out_features: int, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device=device))

    @classmethod
    def from_weight(cls, q: int8.Int8Weight) -> Int8Linear:
        N, K = q.weight.shape
        m = cls(K, N)
        m.weight, m.weight_scale = q.weight, q.weight_scale.float()
        return m

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return int8.dequantize_packed(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x.device) and family_ok("int8_linear", x.device, x.dtype):
            from .kernels.int8_linear import int8_linear

            return int8_linear(x, self.weight, self.weight_scale)
        return F.linear(x, self.dequantize(x.dtype))


def takes_pair_order(gate_up: nn.Module, down: nn.Module, x: torch.Tensor) -> bool:
    """Whether `fused_experts` would run the NVFP4 W16A4 kernels for x, which read x in the decode's pair order
    (kernels/moe_gate_up.pair_ordered): the caller may then hand x in that order (`ordered`), saving the copy."""
    return (gate_up.format == "nvfp4" and use_triton(x.device)
            and not (gate_up.shape[2] % 64 == 0 and down.shape[2] % 64 == 0 and w4a4(x.device))
            and family_ok("moe_nvfp4", x.device, x.dtype))


def pair_unordered(x: torch.Tensor) -> torch.Tensor:
    """The inverse of kernels/moe_gate_up.pair_ordered: [T, H] in the pair order -> in K order."""
    T, H = x.shape
    return x.reshape(T, H // 8, 4, 2).transpose(-1, -2).reshape(T, H)


def fused_experts(gate_up: nn.Module, down: nn.Module, x: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor, ordered: bool = False, lora=None) -> torch.Tensor | None:
    """The routed experts through the fused Triton kernels (x [T, H] -> [T, H]), or None when DGEMMA_KERNELS selects
    the reference for x's device (the caller then dequantizes and runs its grouped matmuls). NVFP4 experts take W4A4
    where `w4a4` says so. The launch settings, rows per block among them, come from the kernels' candidates, tuned
    on first use per GPU (kernels/tuning.py). ordered: x is already in the NVFP4 decode's pair order (only where
    `takes_pair_order` said so; None is returned otherwise, the caller then restores K order). lora: adapters'
    low-rank terms (kernels/moe_lora.ExpertAdapters), added in the kernels' epilogues."""
    if ordered and not takes_pair_order(gate_up, down, x):
        return None
    if not use_triton(x.device) or lora is not None and not family_ok("moe_lora", x.device, x.dtype):
        return None
    if (gate_up.format == "nvfp4" and gate_up.shape[2] % 64 == 0 and down.shape[2] % 64 == 0 and w4a4(x.device)
            and family_ok("moe_nvfp4_w4a4", x.device, x.dtype)):
        return fused_experts_w4a4(gate_up, down, x, top_k_index, top_k_weights, lora)
    if not family_ok("moe_" + gate_up.format, x.device, x.dtype):
        return None
    from .kernels import m_bucket, tuning
    from .kernels.moe_down import moe_down
    from .kernels.moe_gate_up import candidates, moe_gate_up, pair_ordered

    T, K = top_k_index.shape
    E, two_i, H = gate_up.shape
    s2_gu = getattr(gate_up, "weight_scale_2", None)
    s2_dn = getattr(down, "weight_scale_2", None)
    weights = top_k_weights.reshape(-1)
    x_in = pair_ordered(x) if gate_up.format == "nvfp4" and not ordered else x

    gu_lora, dn_lora, slots = lora if lora is not None else (None, None, None)

    def launch(cfg: dict) -> torch.Tensor:
        ids, block_expert = block_plan(top_k_index, E, cfg["BLOCK_M"])
        h = moe_gate_up(x_in, ids, block_expert, gate_up.format, gate_up.weight, gate_up.weight_scale, s2_gu, K, cfg,
                        gu_lora, slots)
        return moe_down(h, ids, block_expert, down.format, down.weight, down.weight_scale, s2_dn, weights, T, K, cfg,
                        dn_lora, slots)

    ranks = tuple(0 if f is None else f.A.shape[1] for f in (gu_lora, dn_lora))  # LoRA: its own tuned settings
    cfg = tuning.choose("moe_" + gate_up.format, (m_bucket(T * K), E, H, two_i // 2, str(x.dtype))
                        + ((ranks,) if lora is not None else ()),
                        candidates(T * K / E, H, two_i // 2, x.device), launch, x.device)
    return launch(cfg)


def fused_experts_w4a4(gate_up: nn.Module, down: nn.Module, x: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor, lora=None) -> torch.Tensor:
    """NVFP4 experts with NVFP4 activations (W4A4, kernels/moe_w4a4.py): where `w4a4` says so. lora: adapters'
    terms (fused_experts')."""
    from .kernels.moe_w4a4 import block_w4a4, moe_w4a4

    T, K = top_k_index.shape
    E, two_i, H = gate_up.shape
    block_m, warps = block_w4a4(T * K / E, H, two_i // 2, x.device)
    ids, block_expert = block_plan(top_k_index, E, block_m)
    return moe_w4a4(x, ids, block_expert, gate_up, down, top_k_weights.reshape(-1), T, K, block_m, warps,
                    gate_up.activation_scale(), down.activation_scale(), lora)


class _Stack(nn.Module):
    """E packed matrices [N, K] (routed experts): dequantized a few experts at a time, or used by the fused kernels.
    Subclasses say how experts lo..hi dequantize."""

    shape: tuple[int, int, int]

    def fused_experts(self, down: nn.Module, x, top_k_index, top_k_weights, ordered: bool = False, lora=None):
        return fused_experts(self, down, x, top_k_index, top_k_weights, ordered, lora)

    def takes_pair_order(self, down: nn.Module, x: torch.Tensor) -> bool:
        return takes_pair_order(self, down, x)

    def dequantize_experts(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        E, N, K = self.shape
        out = torch.empty(E, N, K, dtype=dtype, device=self.weight.device)
        for lo in range(0, E, DEQUANT_CHUNK):
            hi = min(E, lo + DEQUANT_CHUNK)
            out[lo:hi] = self.dequantize_experts(lo, hi, dtype)
        return out


class NVFP4Stack(_Stack):
    """E NVFP4 matrices [N, K]; rows split into `segments` equal parts, each with its own global scale."""

    format = "nvfp4"

    def __init__(self, num: int, out_features: int, in_features: int, segments: int = 1, device=None):
        super().__init__()
        if in_features % nvfp4.BLOCK or out_features % segments:
            raise ValueError(f"NVFP4 stack: bad shape [{num}, {out_features}, {in_features}] / {segments}")
        self.shape = (num, out_features, in_features)
        self.segments = segments
        self.register_buffer("weight", torch.empty(num, out_features, in_features // 2, dtype=torch.uint8,
                                                   device=device))
        self.register_buffer("weight_scale", torch.empty(num, out_features, in_features // nvfp4.BLOCK,
                                                         dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale_2", torch.empty(num, segments, dtype=torch.float32, device=device))
        self.register_buffer("input_scale", None)  # [E, S] once `expect_input_scale` says the checkpoint has them
        self._activation_scale = None

    def expect_input_scale(self) -> None:
        """The checkpoint stores a calibrated activation scale per expert projection: load them (W4A4 uses them)."""
        self.register_buffer("input_scale", torch.empty_like(self.weight_scale_2))

    def activation_scale(self) -> torch.Tensor | None:
        """One static scale for the activations of all the experts (float32 [1]), the largest of their calibrated
        ones: a token's activations are quantized once for every expert it is routed to. None without them."""
        if self.input_scale is None:
            return None
        if self._activation_scale is None or self._activation_scale.device != self.input_scale.device:
            self._activation_scale = self.input_scale.amax().float().reshape(1)
        return self._activation_scale

    @classmethod
    def from_weights(cls, w: torch.Tensor, segments: int = 1, search: bool = False) -> NVFP4Stack:
        """Quantize float weights [E, N, K]: each expert's row segments with their own global scale (ModelOpt
        keeps gate and up apart), block scales by absmax or, with `search`, the best of a few (nvfp4.quantize)."""
        E, N, K = w.shape
        stack, seg = cls(E, N, K, segments=segments), N // segments
        for e in range(E):
            for j in range(segments):
                rows = slice(j * seg, (j + 1) * seg)
                q = nvfp4.quantize(w[e, rows], search=search)
                stack.weight[e, rows], stack.weight_scale[e, rows], stack.weight_scale_2[e, j] = (
                    q.weight, q.weight_scale, q.weight_scale_2)
        return stack

    def row_scale_2(self, lo: int, hi: int) -> torch.Tensor:
        """[hi-lo, N] global scale of every row of experts lo..hi."""
        return self.weight_scale_2[lo:hi].repeat_interleave(self.shape[1] // self.segments, dim=1)

    def dequantize_experts(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        return nvfp4.dequantize_packed(self.weight[lo:hi], self.weight_scale[lo:hi], self.row_scale_2(lo, hi), dtype)


class Int8Stack(_Stack):
    """E INT8 matrices [N, K] with per-row scales [E, N]."""

    format = "int8"

    def __init__(self, num: int, out_features: int, in_features: int, device=None):
        super().__init__()
        self.shape = (num, out_features, in_features)
        self.register_buffer("weight", torch.empty(num, out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.empty(num, out_features, dtype=torch.float32, device=device))

    @classmethod
    def from_weights(cls, w: torch.Tensor) -> Int8Stack:
        """Quantize float weights [E, N, K], one scale per row (int8.quantize)."""
        E, N, K = w.shape
        stack = cls(E, N, K)
        for e in range(E):
            q = int8.quantize(w[e])
            stack.weight[e], stack.weight_scale[e] = q.weight, q.weight_scale
        return stack

    def dequantize_experts(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        return int8.dequantize_packed(self.weight[lo:hi], self.weight_scale[lo:hi], dtype)


def block_plan(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused experts' block plan (quant/kernels/routing.py moe_blocks): one Triton launch where its first-use
    check passed (quant/kernels/moe_plan.py, the same values), the torch ops otherwise."""
    if family_ok("moe_plan", top_k_index.device, torch.int32):
        from .kernels.moe_plan import moe_blocks_fused

        return moe_blocks_fused(top_k_index, num_experts, block_m)
    from .kernels.routing import moe_blocks

    return moe_blocks(top_k_index, num_experts, block_m)


def quantize_tokens_fused(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w8a8.quantize_tokens for x [M, K] in one Triton kernel where DGEMMA_KERNELS selects Triton and the W8A8
    experts' activation quantizer (quant/kernels/moe_w8a8.py quantize_rows: the same codes and scales) passed its
    first-use check there; the torch ops otherwise (five kernels a linear on a GPU)."""
    if use_triton(x.device) and family_ok(f"moe_w8a8_{kind}", x.device, x.dtype):
        from .kernels.moe_w8a8 import quantize_rows

        q, s = quantize_rows(x, kind)
        return (q.view(torch.float8_e4m3fn) if kind == "fp8" else q), s[:, None]
    return w8a8.quantize_tokens(x, kind)


class W8A8Linear(nn.Module):
    """8-bit weights per output channel, compressed-tensors' layout: weight float8_e4m3fn or int8 [N, K], weight_scale
    float32 [N, 1] (bfloat16 on disk, widened exactly). With `act` (the checkpoint's activations are dynamic per
    token) the product runs W8A8 where `w8a8.mode` says so; otherwise weight-only (dequantize, 16-bit activations)."""

    def __init__(self, in_features: int, out_features: int, kind: str, act: bool = True, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.format, self.act = kind, act
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=w8a8.DTYPE[kind], device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, 1, dtype=torch.float32, device=device))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in dtype."""
        return w8a8.dequantize(self.weight, self.weight_scale, dtype)

    def mode(self, device: torch.device) -> str:
        return w8a8.mode(self.format, device) if self.act else "weights"

    def forward(self, x: torch.Tensor, quantized: tuple | None = None) -> torch.Tensor:
        """quantized: x's 8-bit codes and per-token scales already made (`quantize_input`, shared with the linears
        that read the same x: `joint`), only where `joint_key(x)` names one."""
        how = self.mode(x.device)
        if self._kernel(x):
            from .kernels.w8a8_linear import w8a8_linear

            return w8a8_linear(x, quantized or self.quantize_input(x), self.weight, self.weight_scale)
        if quantized is not None:
            if self.joint_key(x) is None:
                raise RuntimeError("W8A8Linear: a quantized input given where it does not quantize activations")
            return w8a8.matmul(x, self.weight, self.weight_scale, self.format, how, lambda *_: quantized)
        if (how == "weights" and self.format == "int8" and use_triton(x.device)
                and family_ok("int8_linear", x.device, x.dtype)):
            from .kernels.int8_linear import int8_linear

            return int8_linear(x, self.weight, self.weight_scale.view(-1))  # [N, 1] is [N] in memory
        return w8a8.matmul(x, self.weight, self.weight_scale, self.format, how, quantize_tokens_fused)

    def joint_key(self, x: torch.Tensor) -> tuple | None:
        """Which linears of the same x this one runs with (`joint`, through `project`): where torch's 8-bit matmul
        takes x, those quantizing it alike (per token, 8-bit codes of `format`); None where it does not quantize x
        (weight-only, the emulation, or shapes the matmul does not take)."""
        if self.mode(x.device) != "hw" or not w8a8.hw_fits(x, self.weight):
            return None
        return ("w8a8", self.format, self.in_features)

    def _kernel(self, x: torch.Tensor) -> bool:
        """Whether our W8A8 linear kernel (kernels/w8a8_linear.py) multiplies x here, where torch's 8-bit matmul
        would: the linears of one x then share a launch (`joint`) and the MLP's gate and up take one (`gated`)."""
        return (self.joint_key(x) is not None and use_triton(x.device)
                and family_ok(f"w8a8_linear_{self.format}", x.device, x.dtype))

    def norm_quantization(self, x: torch.Tensor, peers: tuple) -> tuple[str, None] | None:
        """`quant.modules.norm_quantization` for this linear and peers of its `joint_key`: where our kernel runs."""
        return (self.format, None) if self._kernel(x) else None

    def joint(self, x: torch.Tensor, peers: tuple, quantized: tuple | None = None) -> list[torch.Tensor]:
        """[self(x), *(p(x) for p in peers)] with x quantized once for all (peers of this linear's `joint_key`; or
        `quantized` made already), up to three linears a launch where our kernel runs, one torch matmul each
        elsewhere."""
        quantized = quantized or self.quantize_input(x)
        if not self._kernel(x):
            return [m(x, quantized=quantized) for m in (self, *peers)]
        from .kernels.w8a8_linear import w8a8_linear

        def launch(first: W8A8Linear, rest: tuple) -> list[torch.Tensor]:
            return w8a8_linear(x, quantized, first.weight, first.weight_scale,
                               more=[(m.weight, m.weight_scale) for m in rest])

        return _in_threes(x, (self, *peers), quantized, launch)

    def quantize_input(self, x: torch.Tensor, peers: tuple = ()) -> tuple:
        """x [..., K] -> (codes [M, K], scales float32 [M, 1]) for this linear and `peers`: per token, the same for
        every linear (w8a8.quantize_tokens)."""
        return quantize_tokens_fused(x.reshape(-1, self.in_features), self.format)

    def gated(self, x: torch.Tensor, up: nn.Module, quantized: tuple | None = None) -> torch.Tensor | None:
        """gelu_tanh(self(x)) * up(x) with x quantized once for both products: both products, the activation and
        the product in one launch where our W8A8 kernel runs (kernels/w8a8_linear.py GATED); torch's two 8-bit
        matmuls and one kernel for the rest (kernels/gelu_mul.py) where only Triton does; None elsewhere (the
        caller runs the ops). quantized: x's quantization made already (by its norm)."""
        key = self.joint_key(x)
        if (key is None or type(up) is not W8A8Linear or up.joint_key(x) != key
                or up.weight.shape != self.weight.shape or not use_triton(x.device)):
            return None
        fused = self._kernel(x)
        if not fused and not family_ok("gelu_mul", x.device, x.dtype):
            return None  # before quantizing: the caller's ops quantize x themselves
        quantized = quantized or self.quantize_input(x, (up,))
        if fused:
            from .kernels.w8a8_linear import w8a8_linear

            return w8a8_linear(x, quantized, self.weight, self.weight_scale, up=(up.weight, up.weight_scale))
        from .kernels.gelu_mul import gelu_mul

        return gelu_mul(self(x, quantized=quantized), up(x, quantized=quantized))


class W8A8Stack(_Stack):
    """E matrices [N, K] in W8A8Linear's layout: weight [E, N, K], weight_scale float32 [E, N, 1].

    The routed experts run W8A8 through the fused 8-bit kernels (kernels/moe_w8a8.py) where `w8a8_experts` says so
    (INT8 on sm_80+, FP8 on sm_89+, unless DGEMMA_W8A8=off); elsewhere DGEMMA_W8A8=on runs the float32 emulation of
    the same activation quantization (`experts_emulated`), and otherwise they are weight-only (INT8 through the fused
    weight-only INT8 kernels on a GPU, FP8 dequantized per layer)."""

    def __init__(self, num: int, out_features: int, in_features: int, kind: str, act: bool = True, device=None):
        super().__init__()
        self.shape = (num, out_features, in_features)
        self.format, self.act = kind, act
        self.register_buffer("weight", torch.empty(num, out_features, in_features, dtype=w8a8.DTYPE[kind],
                                                   device=device))
        self.register_buffer("weight_scale", torch.empty(num, out_features, 1, dtype=torch.float32, device=device))

    @classmethod
    def from_weights(cls, w: torch.Tensor, kind: str) -> W8A8Stack:
        """Quantize float weights [E, N, K] as compressed-tensors stores them: per output channel, the scale rounded
        up to bfloat16 (quant/w8a8.quantize)."""
        E, N, K = w.shape
        stack = cls(E, N, K, kind)
        for e in range(E):
            q, scale = w8a8.quantize(w[e], kind)
            stack.weight[e], stack.weight_scale[e] = q, scale.float()
        return stack

    def dequantize_experts(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        return w8a8.dequantize(self.weight[lo:hi], self.weight_scale[lo:hi], dtype)

    def fused_experts(self, down: nn.Module, x, top_k_index, top_k_weights, lora=None):
        """lora: adapters' terms (fused_experts'), which only the weight-only INT8 kernels take: with them INT8
        experts run weight-only, FP8 ones the caller's reference path (None)."""
        if (lora is None and self.act and w8a8_experts(self.format, x.device)
                and family_ok("moe_w8a8_" + self.format, x.device, x.dtype)):
            return fused_experts_w8a8(self, down, x, top_k_index, top_k_weights)
        if lora is None and self.act and w8a8.requested() == "on":
            return experts_emulated(self, down, x, top_k_index, top_k_weights)
        if self.format == "int8":  # weight-only: the fused INT8 kernels read [E, N] scales, the same memory
            from types import SimpleNamespace

            def view(stack):
                E, N, _ = stack.shape
                return SimpleNamespace(format="int8", shape=stack.shape, weight=stack.weight,
                                       weight_scale=stack.weight_scale.view(E, N))

            return fused_experts(view(self), view(down), x, top_k_index, top_k_weights, lora=lora)
        return None


def w8a8_experts(kind: str, device: torch.device) -> bool:
    """Whether W8A8 experts of `kind` multiply 8-bit activations in the fused kernels on `device`: DGEMMA_KERNELS
    selects Triton there, DGEMMA_W8A8 is not off, and the GPU has the tensor cores (INT8 sm_80+, FP8 sm_89+)."""
    from .kernels.moe_w8a8 import supported

    return use_triton(device) and w8a8.requested() != "off" and supported(kind, device)


def fused_experts_w8a8(gate_up: W8A8Stack, down: W8A8Stack, x: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """W8A8 experts with 8-bit activations quantized per token (kernels/moe_w8a8.py); launch settings, rows per
    block among them, tuned on first use per GPU like the other fused experts."""
    from .kernels import m_bucket, tuning
    from .kernels.moe_w8a8 import candidates, moe_w8a8

    T, K = top_k_index.shape
    E, two_i, H = gate_up.shape
    weights = top_k_weights.reshape(-1)

    def launch(cfg: dict) -> torch.Tensor:
        ids, block_expert = block_plan(top_k_index, E, cfg["BLOCK_M"])
        return moe_w8a8(x, ids, block_expert, gate_up, down, weights, T, K, cfg)

    cfg = tuning.choose("moe_w8a8_" + gate_up.format, (m_bucket(T * K), E, H, two_i // 2, str(x.dtype)),
                        candidates(T * K / E, H, two_i // 2, x.device), launch, x.device)
    return launch(cfg)


def experts_emulated(gate_up: W8A8Stack, down: W8A8Stack, x: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """The routed experts with W8A8 activations, in float32 PyTorch (x [T, H] -> [T, H] in x's dtype).

    Each token's input is quantized once per token (every expert it visits multiplies the same codes), the gated
    activation gelu_tanh(gate) * up once per (token, expert) row before the down projection; weights are the exact
    dequantization. Rows are grouped by expert with one sort, each expert's rows are one matmul, and each token's K
    weighted outputs are summed in float32 in slot order."""
    T, K = top_k_index.shape
    E = gate_up.shape[0]
    kind = gate_up.format
    flat = top_k_index.reshape(-1)  # [T*K], entry t*K + k
    order = torch.sort(flat).indices
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    xs = w8a8.fake_quantize_tokens(x, kind)[order // K]  # [T*K, H] float32, grouped by expert
    ys = torch.empty(T * K, down.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            rows = slice(start, start + n)
            gate, up = F.linear(xs[rows], gate_up.dequantize_experts(e, e + 1, torch.float32)[0]).chunk(2, dim=-1)
            h = w8a8.fake_quantize_tokens(F.gelu(gate, approximate="tanh") * up, kind)  # [n, I]
            ys[rows] = F.linear(h, down.dequantize_experts(e, e + 1, torch.float32)[0])
        start += n
    y = torch.empty_like(ys)
    y[order] = ys  # back to (token, slot) order
    return (y * top_k_weights.reshape(-1, 1).float()).view(T, K, -1).sum(dim=1).to(x.dtype)


LINEAR = {"nvfp4": NVFP4Linear, "int8": Int8Linear}


def make_linear(fmt: str, in_features: int, out_features: int, device=None) -> nn.Module:
    """An empty quantized linear of `fmt` (nvfp4, int8: dgemma's weight-only; fp8: compressed-tensors' W8A8)."""
    if fmt == "fp8":
        return W8A8Linear(in_features, out_features, "fp8", device=device)
    return LINEAR[fmt](in_features, out_features, device=device)


def make_stack(fmt: str, num: int, out_features: int, in_features: int, segments: int = 1, device=None) -> nn.Module:
    """An empty expert stack of `fmt`, as make_linear."""
    if fmt == "nvfp4":
        return NVFP4Stack(num, out_features, in_features, segments, device=device)
    if fmt == "fp8":
        return W8A8Stack(num, out_features, in_features, "fp8", device=device)
    return Int8Stack(num, out_features, in_features, device=device)
