"""LoRA adapters in PEFT's format, applied unmerged to a loaded DiffusionGemma (any base format).

An adapter directory is what `peft`'s save_pretrained writes: adapter_config.json (r, lora_alpha, rank_pattern,
alpha_pattern, use_rslora, target_modules, target_parameters, trainable_token_indices) and
adapter_model.safetensors. Its tensor names follow the reference model (transformers' DiffusionGemma), where the
causal encoder and the bidirectional decoder are two module trees over the same weights, so an adapter may hold a
different low-rank delta for each pass:

    base_model.model.model.encoder.language_model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]  (encoder)
    base_model.model.model.decoder.layers.{i}.mlp.down_proj.lora_B.weight                      [out, r] (decoder)
    base_model.model.model.decoder.self_conditioning.gate_proj.lora_A.weight                   (decoder only)
    ...layers.{i}.experts[.base_layer].lora_A.weight  [r*E, in], lora_B.weight [out, r*E]   (target_parameters:
        the routed experts' gate_up_proj [E, 2I, H] and down_proj [E, H, I], told apart by their shapes; expert e's
        delta is B[:, e::E]-ordered: peft's ParamWrapper reshapes A to [E, r, in] and B to [out, r, E])
    ...embed_tokens.token_adapter.trainable_tokens_delta   [n, H]: new rows for the config's token indices

dgemma's model (model.py) has one module per weight, used by both passes; each adapted projection is wrapped in a
`LoRALinear` that adds scale x (x A^T) B^T for the pass that runs (`DiffusionGemma.phase`), the routed experts get a
per-expert low-rank term through `Experts.low_rank` (`ExpertLowRank`: folded into the layer's weights on the CPU, in
the fused MoE kernels' epilogues on a GPU, torch's grouped matmuls elsewhere), and replaced token rows are applied
where the reference applies them. Nothing is merged into the base weights: a quantized base stays quantized, several
adapters add up, each with its own scale (`--adapter DIR:0.5`), and the base is unchanged when the adapters are
taken off.

Scale per module: lora_alpha / r (or / sqrt(r) with use_rslora), with alpha_pattern and rank_pattern's keys matched
as peft matches them (a key matches a module name that ends with it, as a regular expression), times the user's
scale.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ModelError
from ..checkpoint.names import ADAPTER_CONFIG, ADAPTER_WEIGHTS

CONFIG, WEIGHTS = ADAPTER_CONFIG, ADAPTER_WEIGHTS
PREFIX = "base_model.model."
ENCODER, DECODER = "encoder", "decoder"
# reference module prefixes -> (pass, dgemma module prefix)
_TREES = (("model.encoder.language_model.", ENCODER), ("model.decoder.", DECODER))
_TREE_OF = {side: prefix for prefix, side in _TREES}
_LINEARS = re.compile(r"^(layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|router\.proj)"
                      r"|self_conditioning\.(gate|up|down)_proj)$")
_EXPERTS = re.compile(r"^layers\.(\d+)\.experts(\.base_layer)?$")
_UNSUPPORTED = ("use_dora", "lora_bias", "fan_in_fan_out")
KERNEL_RANK = 64  # the fused kernels' epilogues take the adapters' ranks up to this sum per projection


class AdapterError(ModelError):
    """An adapter that cannot be read or does not fit the model: one line for the user."""


@dataclass
class LowRank:
    """One adapter's delta on one projection: y += scale * (x @ A^T) @ B^T. A [r, in], B [out, r]. slot: the
    adapter's number when rows choose their adapter (the server: `Phase.row_slots`)."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float
    slot: int = 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # in peft's order (B(A(x)) * scale, added to the base's output): on the CPU in float32, peft's very bits
        return F.linear(F.linear(x, self.A.to(x.dtype)), self.B.to(x.dtype)) * self.scale

    def factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A and B in `dtype`, contiguous, made once (the fused kernel reads them as they are)."""
        kept = self.__dict__.setdefault("_kept", {})
        key = (dtype, self.A._version, self.B._version)
        if key not in kept:
            kept.clear()
            kept[key] = (self.A.to(dtype).contiguous(), self.B.to(dtype).contiguous())
        return kept[key]


@dataclass
class Adapter:
    """A PEFT LoRA adapter read from disk: its config and its deltas by (pass, dgemma module name)."""

    path: Path
    config: dict
    linears: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)
    experts: dict[tuple[str, int], list[tuple[torch.Tensor, torch.Tensor, float]]] = field(default_factory=dict)
    tokens: dict[str, tuple[list[int], torch.Tensor]] = field(default_factory=dict)  # pass -> (ids, rows [n, H])

    @property
    def base(self) -> str:
        return str(self.config.get("base_model_name_or_path") or "")

    @property
    def name(self) -> str:
        return self.path.name


def _pattern_value(patterns: dict, module: str, default):
    """peft's rule: the first key that, as a regular expression, matches the module name's end (after a dot)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _scale(cfg: dict, module: str, r: int) -> float:
    alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module, cfg.get("lora_alpha", 8))
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _expert_scale(cfg: dict, module: str, rows: int, experts: int) -> float:
    """The experts' factors hold r rows per expert (A is [r * E, in])."""
    return _scale(cfg, module, rows // experts)


def _where(name: str) -> tuple[str, str]:
    """A reference module name (without base_model.model.) -> (pass, dgemma module name)."""
    for prefix, side in _TREES:
        if name.startswith(prefix):
            return side, name[len(prefix):]
    raise AdapterError(f"adapts {name!r}, which dgemma does not run (only the text layers, the self-conditioning "
                       "MLP and the token embedding)")


def read_adapter(path: str | Path) -> Adapter:
    """Read and check an adapter directory's files (not yet against a model: `attach` does that)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / CONFIG).is_file():
        raise AdapterError(f"{path}: no {CONFIG} (not a PEFT adapter directory)")
    try:
        cfg = json.loads((path / CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path / CONFIG}: cannot read it ({e})") from None
    if not isinstance(cfg, dict) or str(cfg.get("peft_type", "")).upper() != "LORA":
        kind = cfg.get("peft_type") if isinstance(cfg, dict) else None
        raise AdapterError(f"{path / CONFIG}: peft_type is {kind!r}, dgemma runs LORA adapters")
    for key in _UNSUPPORTED:
        if cfg.get(key):
            raise AdapterError(f"{path / CONFIG}: {key} is set; dgemma runs plain LoRA (no {key})")
    if not (path / WEIGHTS).is_file():
        raise AdapterError(f"{path}: no {WEIGHTS}")
    try:
        tensors = load_file(str(path / WEIGHTS))
    except (OSError, SafetensorError) as e:
        raise AdapterError(f"{path / WEIGHTS}: cannot read it ({e})") from None
    ad = Adapter(path, cfg)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        m = re.match(r"^(.*)\.lora_([AB])\.weight$", name)
        if m:
            pairs.setdefault(m.group(1), {})[m.group(2)] = t.float()
            continue
        m = re.match(r"^(.*)\.token_adapter\.trainable_tokens_delta$", name)
        if m:
            side, module = _where(m.group(1))
            if module != "embed_tokens":
                raise AdapterError(f"{path.name}: trainable tokens on {m.group(1)!r} (dgemma takes them on "
                                   "embed_tokens)")
            ids = _token_indices(cfg)
            if len(ids) != t.shape[0]:
                raise AdapterError(f"{path.name}: {key} has {t.shape[0]} rows for {len(ids)} token indices")
            ad.tokens[side] = (ids, t.float())
            continue
        raise AdapterError(f"{path.name}: tensor {key!r} is not a LoRA A/B matrix or trainable token rows")
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path.name}: {module} has lora_{'A' if 'A' in ab else 'B'} without its pair")
        A, B = ab["A"], ab["B"]
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1]:
            raise AdapterError(f"{path.name}: {module}: lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} do not "
                               "make a low-rank product")
        side, local = _where(module)
        m = _EXPERTS.match(local)
        if m:
            ad.experts.setdefault((side, int(m.group(1))), []).append((A, B, 0.0))
            continue
        if not _LINEARS.match(local):
            raise AdapterError(f"{path.name}: adapts {module!r}, which dgemma does not run")
        ad.linears[(side, local)] = (A, B, _scale(cfg, module, A.shape[0]))
    if not ad.linears and not ad.experts and not ad.tokens:
        raise AdapterError(f"{path / WEIGHTS}: holds no LoRA weights")
    return ad


def _token_indices(cfg: dict) -> list[int]:
    spec = cfg.get("trainable_token_indices")
    if isinstance(spec, dict):
        spec = spec.get("embed_tokens", next(iter(spec.values()), None))
    if not isinstance(spec, list) or not all(isinstance(i, int) for i in spec):
        raise AdapterError("adapter_config.json: trainable_token_indices must list token ids for embed_tokens")
    return spec


# ---------------------------------------------------------------------------------------------- attaching


class LoRALinear(nn.Module):
    """A projection (nn.Linear or a quantized module) plus low-rank deltas per pass: base(x) + sum of deltas."""

    def __init__(self, base: nn.Module, phase):
        super().__init__()
        self.base = base
        self.phase = phase  # the model's Phase (not a module): which pass runs
        self.deltas: dict[str, list[LowRank]] = {ENCODER: [], DECODER: []}

    @property
    def in_features(self) -> int:
        return _features(self.base)[0]

    @property
    def out_features(self) -> int:
        return _features(self.base)[1]

    def kernel_terms(self, x: torch.Tensor):
        """This pass's adapters as the linear kernels take them in their epilogue (quant/kernels/lora.LinearAdapters:
        stacked along the rank, scales folded into B, in x's dtype; made once and kept while the factors are
        unchanged), with the batch rows' slots; None when this pass has none or they cannot run fused (`_fused`, or
        a stacked rank above KERNEL_RANK)."""
        from quant.kernels.lora import LinearAdapters, LinearFactors

        deltas = self.deltas[self.phase.side]
        if not deltas or not _fused(x, deltas) or sum(d.A.shape[0] for d in deltas) > KERNEL_RANK:
            return None
        key = (self.phase.side, x.dtype)
        versions = tuple((id(d.A), d.A._version, id(d.B), d.B._version) for d in deltas)
        kept = self.__dict__.setdefault("_stacked", {})
        if kept.get(key, (None,))[0] != versions:
            kept[key] = (versions, LinearFactors(*_stack([(d.A, d.B, d.scale, d.slot) for d in deltas], x.dtype)))
        slots = self.phase.row_slots
        return LinearAdapters(kept[key][1], None if slots is None else slots.to(torch.int32))

    def gated(self, x: torch.Tensor, up: nn.Module) -> torch.Tensor | None:
        """The dense MLP's gelu_tanh(gate(x)) * up(x) in one kernel (the base's `gated`) with both halves' adapters'
        terms in its epilogue, before the activation; None where that does not run (the caller runs the three ops)."""
        base_gated = getattr(self.base, "gated", None)
        if base_gated is None:
            return None
        up_base = up.base if isinstance(up, LoRALinear) else up
        mine = self.deltas[self.phase.side]
        theirs = up.deltas[self.phase.side] if isinstance(up, LoRALinear) else []
        if not mine and not theirs:
            return base_gated(x, up_base)
        takes = getattr(self.base, "takes_lora", None)
        if not mine or not theirs or takes is None or not takes(x):
            return None
        lora, lora_up = self.kernel_terms(x), up.kernel_terms(x)
        if lora is None or lora_up is None or lora.factors.A.shape != lora_up.factors.A.shape:
            return None
        return base_gated(x, up_base, lora=lora, lora_up=lora_up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        takes = getattr(self.base, "takes_lora", None)
        if takes is not None and takes(x) and (terms := self.kernel_terms(x)) is not None:
            return self.base(x, lora=terms)  # the terms in the base kernel's epilogue (quant/kernels/nvfp4_linear.py)
        y = self.base(x)
        slots = self.phase.row_slots  # None: every adapter on every row; else [B], each row's adapter (0: none)
        deltas = self.deltas[self.phase.side]
        if deltas and _fused(x, deltas) and y.is_contiguous():  # one kernel per adapter (quant/kernels/lora.py)
            from quant.kernels.lora import lora_add_

            for d in deltas:
                mask = None
                if slots is not None:
                    mask = (slots == d.slot).float().repeat_interleave(x[..., 0].numel() // slots.numel())
                lora_add_(y, x, *d.factors(x.dtype), d.scale, mask)
            return y
        for d in deltas:
            if slots is None:
                y = y + d(x)
            else:  # every row computes it, the others' share multiplied by zero: no host sync, one shape
                y = y + d(x) * _token_mask(slots, d.slot, x)
        return y


def _token_mask(slots: torch.Tensor, slot: int, x: torch.Tensor) -> torch.Tensor:
    """1 where a token of x [..., in] belongs to a batch row with adapter `slot`, else 0, shaped [..., 1]: x holds
    the rows' tokens in order, as [B, T, in] or flattened (the router's [B*T, in]); slots [B], one per row."""
    tokens = x[..., 0].numel()
    return (slots == slot).to(x.dtype).repeat_interleave(tokens // slots.numel()).view(*x.shape[:-1], 1)


def _fused(x: torch.Tensor, deltas: list[LowRank]) -> bool:
    """Whether the adapters' terms run as the fused Triton kernel: where DGEMMA_KERNELS selects Triton for x's
    device and its first-use check passed, no gradient is taken through them (dgemma tune uses the torch ops), the
    activations are 16-bit and every rank fits the kernel."""
    if x.dtype not in (torch.bfloat16, torch.float16) or torch.is_grad_enabled() and (
            x.requires_grad or any(d.A.requires_grad or d.B.requires_grad for d in deltas)):
        return False
    from quant.kernels import use_triton

    if not use_triton(x.device):
        return False
    from quant.kernels.lora import MAX_RANK
    from quant.kernels.probe import family_ok

    return all(d.A.shape[0] <= MAX_RANK for d in deltas) and family_ok("lora", x.device, x.dtype)


def _stack(parts: list, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adapters' factors (A [..., r, in], B [..., out, r], scale, slot) -> one stack for the fused kernels: A [..., R,
    in] and B [..., out, R] (each scale folded into its B) in dtype, R the ranks' sum rounded up to a power of two of
    at least 16 (zero-padded), and each rank column's slot (int32 [R], -1 on the padding)."""
    slot = [s for a, _, _, s in parts for _ in range(a.shape[-2])]
    R = max(16, 1 << (len(slot) - 1).bit_length())
    pad = R - len(slot)
    A = F.pad(torch.cat([a.float() for a, _, _, _ in parts], -2), (0, 0, 0, pad)).to(dtype).contiguous()
    B = F.pad(torch.cat([b.float() * scale for _, b, scale, _ in parts], -1), (0, pad)).to(dtype).contiguous()
    return A, B, torch.tensor(slot + [-1] * pad, dtype=torch.int32, device=A.device)


def _features(module: nn.Module) -> tuple[int, int]:
    if hasattr(module, "in_features"):
        return module.in_features, module.out_features
    w = module.weight
    return w.shape[1], w.shape[0]


class ExpertLowRank:
    """The routed experts' low-rank terms for one layer, per pass: gate_up and down lists of (A, B, scale) in peft's
    layout (A [r * E, in], B [out, r * E]; `_per_expert` views them as [E, r, in] and [E, out, r] at each use, so a
    trained A and B get their gradients). Three ways to run them: folded into the call's weights on the CPU (`fold`,
    peft's bits), in the fused MoE kernels (`kernel_terms`: quantized experts where the Triton kernels run), or as
    grouped low-rank matmuls beside the base's (`__call__`: training, a 16-bit base off the CPU)."""

    def __init__(self, phase, experts: int):
        self.phase = phase
        self._experts = experts
        self.parts: dict[str, dict[str, list]] = {ENCODER: {"gate_up": [], "down": []},
                                                  DECODER: {"gate_up": [], "down": []}}
        self._kept: dict = {}  # (id(A), id(B)) -> (versions, a, b): contiguous per-expert factors (`_contiguous`);
        # (pass, which, dtype) -> (versions, LoRAFactors): the stacked factors of the fused kernels (`_stacked`)

    def active(self) -> bool:
        p = self.parts[self.phase.side]
        return bool(p["gate_up"] or p["down"])

    def folds(self, x: torch.Tensor) -> bool:
        """On the CPU the deltas are folded into the layer's weights for the call, as peft folds them (the same
        bits as peft); elsewhere they run as low-rank terms beside the base's matmuls."""
        return x.device.type == "cpu"

    def fold(self, which: str, w: torch.Tensor, slot: int | None = None) -> torch.Tensor:
        """w [E, out, in] -> w + scale * B @ A per adapter (peft's baddbmm), a new tensor: the base is untouched.
        slot: only that adapter's (None: all)."""
        for A, B, scale, s in self.parts[self.phase.side][which]:
            if slot is not None and s != slot:
                continue
            a, b = _per_expert(A, B, w.shape[0])
            w = torch.baddbmm(w, b.to(w.dtype), a.to(w.dtype), alpha=scale)
        return w

    def _contiguous(self, A: torch.Tensor, B: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-expert factors, contiguous (what a grouped matmul takes; a view would fall back to a loop over
        experts with a host sync): made once and kept while A and B are unchanged; views while training them."""
        if torch.is_grad_enabled() and (A.requires_grad or B.requires_grad):
            return _per_expert(A, B, E)
        key = (id(A), id(B))
        hit = self._kept.get(key)
        if hit is None or hit[0] != (A._version, B._version):
            a, b = _per_expert(A, B, E)
            hit = self._kept[key] = ((A._version, B._version), a.contiguous(), b.contiguous())
        return hit[1], hit[2]

    def fusable(self, x: torch.Tensor) -> bool:
        """Whether the terms can run in the fused expert kernels' epilogues for x: where DGEMMA_KERNELS selects Triton,
        no gradient is taken through them (dgemma tune trains through the reference path), and the adapters' ranks
        together are at most KERNEL_RANK."""
        from quant.kernels import use_triton

        parts = self.parts[self.phase.side]
        if not use_triton(x.device) or torch.is_grad_enabled() and any(
                t.requires_grad for p in parts.values() for A, B, _, _ in p for t in (A, B)):
            return False
        E = self._experts
        return all(sum(A.shape[0] // E for A, *_ in p) <= KERNEL_RANK for p in parts.values())

    def kernel_terms(self, x: torch.Tensor, tokens: int, row: int | None = None):
        """The terms as the fused expert kernels take them (quant/kernels/moe_lora.ExpertAdapters: each
        projection's adapters stacked along the rank, scales folded into B, in x's dtype; made once and kept while
        the factors are unchanged) for a call on `tokens` tokens (`slots`), or None where they cannot run there
        (`fusable`)."""
        from quant.kernels.moe_lora import ExpertAdapters

        if not self.fusable(x):
            return None
        slots = self.slots(tokens, row)
        return ExpertAdapters(self._stacked("gate_up", x.dtype), self._stacked("down", x.dtype),
                              None if slots is None else slots.to(torch.int32))

    def _stacked(self, which: str, dtype: torch.dtype):
        from quant.kernels.moe_lora import LoRAFactors

        parts = self.parts[self.phase.side][which]
        if not parts:
            return None
        key = (self.phase.side, which, dtype)
        versions = tuple((id(A), A._version, id(B), B._version) for A, B, _, _ in parts)
        hit = self._kept.get(key)
        if hit is None or hit[0] != versions:
            E = self._experts
            per = [(*_per_expert(A, B, E), scale, s) for A, B, scale, s in parts]  # [E, r, in], [E, out, r]
            hit = self._kept[key] = (versions, LoRAFactors(*_stack(per, dtype)))
        return hit[1]

    def slots(self, tokens: int, row: int | None = None) -> torch.Tensor | None:
        """Each token's adapter slot [tokens] for a call on `tokens` tokens of the batch's rows (row: the call is that
        row's alone), or None when every adapter applies to every token."""
        rs = self.phase.row_slots
        if rs is None:
            return None
        if row is not None:
            rs = rs[row : row + 1]
        return rs.repeat_interleave(tokens // rs.numel())

    def __call__(self, which: str, x: torch.Tensor, offsets: torch.Tensor,
                 slots: torch.Tensor | None = None) -> torch.Tensor | None:
        """x [S, in] grouped by expert (group e ends at offsets[e]) -> the sum of the low-rank terms [S, out].
        slots [S]: each assignment's adapter slot (None: all adapters on all)."""
        from ..model import grouped_linear

        out = None
        for A, B, scale, s in self.parts[self.phase.side][which]:
            a, b = self._contiguous(A, B, offsets.numel())
            t = grouped_linear(grouped_linear(x, a.to(x.dtype), offsets), b.to(x.dtype), offsets) * scale
            if slots is not None:
                t = t * (slots == s).to(t.dtype)[:, None]
            out = t if out is None else out + t
        return out


class TokenRows:
    """Embedding rows an adapter replaces (peft's trainable tokens) for one pass: ids [n] -> rows [n, H]."""

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor, vocab: int):
        self.ids, self.rows = ids, rows
        self.slot = torch.full((vocab,), -1, dtype=torch.long, device=ids.device)  # id -> its row, or -1
        self.slot[ids] = torch.arange(ids.numel(), device=ids.device)

    def lookup(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [..., H]: the base embedding of ids [...] -> the same with the replaced ids' rows (no vocab-size copy)."""
        s = self.slot[ids]
        return torch.where((s >= 0)[..., None], self.rows.to(x.dtype)[s.clamp(min=0)], x)


def attach(model, adapters: list[tuple[Adapter, float]], slots: list[int] | None = None) -> None:
    """Wrap `model`'s adapted projections and experts with the adapters' deltas (each times its scale). Checks every
    adapter against the model first and raises AdapterError naming the first mismatch, changing nothing then.

    slots: each adapter's number (from 1) when each row of a batch chooses one (`Phase.row_slots`, set by the server
    around its forwards; 0 is the base alone); None: all of them apply together (run, chat)."""
    if not adapters:
        return
    slots = slots or [1] * len(adapters)
    if sum(bool(ad.tokens) for ad, _ in adapters) > 1:
        raise AdapterError("two adapters replace embedding rows (trainable tokens); only one of them can be used")
    for ad, scale in adapters:
        check_fits(model, ad)
        if ad.tokens and scale != 1:
            raise AdapterError(f"adapter {ad.name} replaces embedding rows (trainable tokens), which a scale cannot "
                               "weigh; use it at scale 1")
        if ad.tokens and len(set(slots)) > 1:
            raise AdapterError(f"adapter {ad.name} replaces embedding rows (trainable tokens), which rows of one "
                               "batch cannot choose apart; serve it alone")
    phase = model.phase
    modules = dict(model.named_modules())
    dev = model.device
    for (ad, user_scale), slot in zip(adapters, slots):
        for (side, name), (A, B, scale) in ad.linears.items():
            parent, attr = name.rsplit(".", 1)
            owner = modules[parent]
            cur = getattr(owner, attr)
            if not isinstance(cur, LoRALinear):
                cur = LoRALinear(cur, phase)
                setattr(owner, attr, cur)
            cur.deltas[side].append(LowRank(A.to(dev), B.to(dev), scale * user_scale, slot))
        for (side, i), parts in ad.experts.items():
            experts = model.layers[i].experts
            E, H, I = _expert_shape(experts)
            if getattr(experts, "low_rank", None) is None:
                experts.low_rank = ExpertLowRank(phase, E)
            for A, B, _ in parts:
                which = _expert_which(experts, A, B)
                # peft matches patterns against the parameter's name: ...experts.gate_up_proj / ...experts.down_proj
                scale = _expert_scale(ad.config, _TREE_OF[side] + f"layers.{i}.experts.{which}_proj", A.shape[0], E)
                experts.low_rank.parts[side][which].append((A.to(dev), B.to(dev), scale * user_scale, slot))
        for side, (ids, rows) in ad.tokens.items():
            model.token_rows[side] = TokenRows(torch.tensor(ids, device=dev), rows.to(dev),
                                               model.embed_tokens.weight.shape[0])
    model.adapters = [(ad.name, s) for ad, s in adapters]


def _expert_shape(experts) -> tuple[int, int, int]:
    """(E, H, I) of a layer's routed experts, quantized or not."""
    gu = experts.gate_up_proj
    shape = tuple(gu.shape)  # nn.Parameter [E, 2I, H] or a stack's .shape
    return shape[0], shape[2], shape[1] // 2


def _expert_which(experts, A: torch.Tensor, B: torch.Tensor) -> str:
    """Which expert weight a pair of peft ParamWrapper factors adapts, from its shapes: gate_up_proj takes H in and
    gives 2I, down_proj takes I in and gives H (their names are not in the tensor names)."""
    E, H, I = _expert_shape(experts)
    return "gate_up" if (A.shape[1], B.shape[0]) == (H, 2 * I) else "down"


def _per_expert(A: torch.Tensor, B: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's ParamWrapper factors A [r * E, in], B [out, r * E] -> views [E, r, in] and [E, out, r] (rows of A are
    expert-major, columns of B rank-major, as peft reshapes them)."""
    r = A.shape[0] // E
    return A.view(E, r, A.shape[1]), B.view(B.shape[0], r, E).permute(2, 0, 1)


def check_fits(model, ad: Adapter) -> None:
    """Raise AdapterError naming the first module whose shape, or whose presence, the adapter does not match."""
    modules = dict(model.named_modules())
    for (side, name), (A, B, _) in sorted(ad.linears.items()):
        mod = modules.get(name)
        if isinstance(mod, LoRALinear):
            mod = mod.base
        if mod is None:
            raise AdapterError(f"adapter {ad.name} does not fit this model: it adapts {side} {name}, which this "
                               "model does not have")
        fin, fout = _features(mod)
        if (A.shape[1], B.shape[0]) != (fin, fout):
            raise AdapterError(f"adapter {ad.name} does not fit this model: {name} is {fin} -> {fout}, the adapter's "
                               f"is {A.shape[1]} -> {B.shape[0]}")
        if A.shape[0] > min(fin, fout):
            raise AdapterError(f"adapter {ad.name}: rank {A.shape[0]} on {name} is above the layer's size "
                               f"({fin} -> {fout})")
    L = len(model.layers)
    for (side, i), parts in sorted(ad.experts.items()):
        if i >= L:
            raise AdapterError(f"adapter {ad.name} does not fit this model: it adapts layer {i}'s experts, the model "
                               f"has {L} layers")
        E, H, I = _expert_shape(model.layers[i].experts)
        for A, B, _ in parts:
            if A.shape[0] % E or B.shape[1] != A.shape[0] or (A.shape[1], B.shape[0]) not in ((H, 2 * I), (I, H)):
                raise AdapterError(f"adapter {ad.name} does not fit this model: layers.{i}.experts are {E} x "
                                   f"({H} -> {2 * I}, {I} -> {H}), the adapter's factors are {tuple(A.shape)} and "
                                   f"{tuple(B.shape)}")
    V, H = model.cfg.text.vocab_size, model.cfg.text.hidden_size  # (a GGUF embedding is held as its blocks)
    for side, (ids, rows) in ad.tokens.items():
        if rows.shape[1] != H or max(ids) >= V or min(ids) < 0:
            raise AdapterError(f"adapter {ad.name} does not fit this model: token rows {tuple(rows.shape)} for ids "
                               f"up to {max(ids)}, the embedding is {V} x {H}")


# ---------------------------------------------------------------------------------------------- making adapters


LINEAR_KINDS = {  # dgemma's names for the projections an adapter may target (`new_adapter`'s targets)
    "attention": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "mlp": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    "self_conditioning": ("gate_proj", "up_proj", "down_proj"),
}


def new_adapter(model, rank: int, alpha: float, targets=("attention", "mlp"), expert_rank: int = 0,
                generator: torch.Generator | None = None, base: str = "") -> Adapter:
    """A fresh adapter for `model` as peft initialises one (A Kaiming-uniform, B zero: the model is unchanged until
    trained), the same factors for both passes (tied: one set of weights to train, saved under both of the
    reference's trees). targets: kinds of LINEAR_KINDS; expert_rank > 0 adds the routed experts' gate_up and down
    (peft's target_parameters). Raises AdapterError for a rank above a targeted layer's size."""
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "base_model_name_or_path": base,
           "use_rslora": False, "bias": "none", "lora_dropout": 0.0, "fan_in_fan_out": False}
    ad = Adapter(Path("new"), cfg)
    modules = dict(model.named_modules())
    names = []
    for i in range(len(model.layers)):
        for kind in targets:
            if kind in ("attention", "mlp"):
                names += [f"layers.{i}.{n}" for n in LINEAR_KINDS[kind] if modules.get(f"layers.{i}.{n}") is not None]
    if "self_conditioning" in targets:
        names += [f"self_conditioning.{n}" for n in LINEAR_KINDS["self_conditioning"]]
    dev = model.device
    for name in names:
        fin, fout = _features(modules[name].base if isinstance(modules[name], LoRALinear) else modules[name])
        if rank > min(fin, fout):
            raise AdapterError(f"rank {rank} is above {name}'s size ({fin} -> {fout})")
        A = torch.empty(rank, fin, device=dev)
        nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)
        pair = (A, torch.zeros(fout, rank, device=dev), alpha / rank)
        for side in (ENCODER, DECODER) if name.startswith("layers.") else (DECODER,):  # self-conditioning: decoder
            ad.linears[(side, name)] = pair
    if expert_rank:
        for i, layer in enumerate(model.layers):
            E, H, I = _expert_shape(layer.experts)
            if expert_rank > min(H, I):
                raise AdapterError(f"expert rank {expert_rank} is above layers.{i}.experts' size ({H}, {I})")
            parts = []
            for fin, fout in ((H, 2 * I), (I, H)):  # gate_up, then down: peft's nesting order (save_adapter)
                A = torch.empty(expert_rank * E, fin, device=dev)
                nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)
                parts.append((A, torch.zeros(fout, expert_rank * E, device=dev), 0.0))
            for side in (ENCODER, DECODER):
                ad.experts[(side, i)] = parts
        cfg["rank_pattern"] = {r"experts\.(gate_up_proj|down_proj)": expert_rank}  # peft: parameter names
    cfg["target_modules"] = _target_regex(names)
    cfg["target_parameters"] = ["experts.gate_up_proj", "experts.down_proj"] if expert_rank else None
    return ad


def trainable(ad: Adapter) -> list[torch.Tensor]:
    """The adapter's factors, each once (both passes share them), set to require gradients."""
    seen, out = set(), []
    for A, B, _ in list(ad.linears.values()) + [p for parts in ad.experts.values() for p in parts]:
        for t in (A, B):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t.requires_grad_(True))
    return out


def _target_regex(names: list[str]) -> str:
    """peft's target_modules as one regular expression (peft full-matches it against module names) for dgemma's
    module names, in both of the reference's trees."""
    local = "|".join(sorted({re.escape(n.split(".", 2)[2]) if n.startswith("layers.") else re.escape(n)
                             for n in names}))
    return rf"model\.(encoder\.language_model|decoder)\.(layers\.\d+\.)?({local})"


def save_adapter(ad: Adapter, out: str | Path) -> None:
    """Write `ad` in PEFT's format (adapter_config.json, adapter_model.safetensors), atomically: the files appear
    whole or not at all, and an older adapter there stays until the new one is complete."""
    import os
    import tempfile

    from safetensors.torch import save_file

    out = Path(out)
    tensors: dict[str, torch.Tensor] = {}
    for (side, name), (A, B, _) in ad.linears.items():
        key = PREFIX + _TREE_OF[side] + name
        tensors[f"{key}.lora_A.weight"] = A.detach().float().cpu().clone()  # each pass its own copy (tied here)
        tensors[f"{key}.lora_B.weight"] = B.detach().float().cpu().clone()
    for (side, i), parts in ad.experts.items():
        key = PREFIX + _TREE_OF[side] + f"layers.{i}.experts"
        # peft nests one wrapper per target parameter: the first (gate_up_proj) innermost, as base_layer
        inner = [".base_layer", ""] if len(parts) == 2 else [""]
        for (A, B, _), at in zip(parts, inner):
            tensors[f"{key}{at}.lora_A.weight"] = A.detach().float().cpu().clone()
            tensors[f"{key}{at}.lora_B.weight"] = B.detach().float().cpu().clone()
    if ad.tokens:
        raise AdapterError("saving trainable token rows is not supported yet")
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=".saving-"))
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(ad.config, indent=2, sort_keys=True) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        for f in (WEIGHTS, CONFIG):
            with open(tmp / f, "rb") as fh:
                os.fsync(fh.fileno())
            os.chmod(tmp / f, 0o666 & ~umask)  # as any file the user writes (mkdtemp's directory is private)
        os.replace(tmp / WEIGHTS, out / WEIGHTS)
        os.replace(tmp / CONFIG, out / CONFIG)
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
