"""What lives where: the placement planner, from a checkpoint's config and format, the cards, the context and batch.

A canvas decoder touches every expert of every layer at every step (256 rows x top-8 of 128 experts leave an expert
idle with probability (1 - 8/128)^256, about 7e-8), so experts that do not fit are not computed on the CPU but
streamed: kept in pinned host memory and copied, layer by layer, into two on-card layer buffers. The plan:

- on each card, fixed: its share of the layers' attention, dense MLP, norms and KV cache; on the first card also the
  embedding (the tied head), the self-conditioning block, a request's step memory per row of the batch and
  RUNTIME_SLACK (and, where no fused MoE kernel reads quantized experts packed, one layer unpacked);
- each layer's experts resident on its card, or streamed (then the card holds two layer buffers);
- layers split over several cards, contiguously, only when one card cannot hold them all resident.

Streamed layers are spread evenly through the stack, so that each copy has the compute of the layers before it to
hide behind. Everything is arithmetic on the config's shapes (checkpoint/footprint.py): no torch, no weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..checkpoint.footprint import (
    DEFAULT_POLICY,
    FORMATS,
    RUNTIME_SLACK,
    dequantized_layer_bytes,
    layer_bytes,
    layer_cache_bytes,
    request_bytes,
    weight_bytes,
)
from ..config import ModelConfig
from .cards import GB, Card

DEFAULT_CONTEXT = 8192  # tokens a plan leaves KV-cache room for unless told (the step tables' context too)
HOST_MARGIN = 2 * 2**30  # host memory the plan leaves to everything else (the OS, the process, its libraries)


@dataclass
class CardPlan:
    card: Card
    layers: list[int]  # the layers on this card, in order
    streamed: list[int]  # of those, the ones whose experts stream from host memory
    fixed_bytes: int  # what stays whatever streams: shared weights, the layers' dense parts and KV cache, slack
    expert_bytes: int  # one layer's experts
    buffer_bytes: int  # the two layer buffers streamed experts are copied into (0: none stream here)

    @property
    def resident_bytes(self) -> int:
        """Bytes this card holds: the fixed part, the resident experts, the buffers."""
        return self.fixed_bytes + (len(self.layers) - len(self.streamed)) * self.expert_bytes + self.buffer_bytes


@dataclass
class Plan:
    fmt: str
    policy: str
    context: int
    batch: int
    cards: list[CardPlan]
    host_bytes: int  # pinned host memory the streamed experts take
    host_free: int | None  # available host memory when it was asked (None: not checked)
    refusal: str | None = None  # one line: why it does not fit
    layers: int = 0
    expert_bytes: int = 0  # one layer's experts
    totals: dict = field(default_factory=dict)  # weight_bytes(): the whole model by part

    @property
    def fits(self) -> bool:
        return self.refusal is None

    @property
    def streamed(self) -> list[int]:
        return sorted(i for c in self.cards for i in c.streamed)

    @property
    def resident_bytes(self) -> int:
        return sum(c.resident_bytes for c in self.cards)

    @property
    def streamed_bytes_per_step(self) -> int:
        """Bytes copied over the host links at every step (each streamed layer once, in each pass)."""
        return len(self.streamed) * self.expert_bytes

    @property
    def link_gb_per_s(self) -> float:
        """The slowest host link among the cards that stream (the first card's when none does), GB/s (coded rate)."""
        streaming = [c.card for c in self.cards if c.streamed] or [self.cards[0].card]
        return min(c.link_gb_per_s for c in streaming)

    def summary(self, devices: list | None = None) -> str | None:
        """One line for a person when the plan streams or splits (None when everything sits on one card): which
        layers' experts stream and how much a step copies; which layers are on which card (`devices`: their names)."""
        parts = []
        if self.streamed:
            parts.append(f"{len(self.streamed)} of {self.layers} layers' experts stream from host memory "
                         f"({_gb(self.streamed_bytes_per_step)} copied a step)")
        if len(self.cards) > 1:
            names = devices or [c.card.name for c in self.cards]
            spans = [f"{c.layers[0]}-{c.layers[-1]}" if len(c.layers) > 1 else str(c.layers[0])
                     for c in self.cards if c.layers]
            parts.append("layers split: " + ", ".join(f"{span} on {name}" for span, name in zip(spans, names)))
        return "; ".join(parts) or None

    def as_dict(self) -> dict:
        return {"fits": self.fits, "refusal": self.refusal, "format": self.fmt, "policy": self.policy,
                "context": self.context, "batch": self.batch,
                "devices": [{"card": c.card.name, "memory": c.card.memory, "layers": c.layers, "streamed": c.streamed,
                             "resident_bytes": c.resident_bytes, "buffer_bytes": c.buffer_bytes,
                             "link_gb_per_s": round(c.card.link_gb_per_s, 2)} for c in self.cards],
                "layers": self.layers, "streamed_layers": self.streamed, "expert_bytes_per_layer": self.expert_bytes,
                "resident_bytes": self.resident_bytes, "streamed_bytes_per_step": self.streamed_bytes_per_step,
                "host_bytes": self.host_bytes, "host_free": self.host_free,
                "link_gb_per_s": round(self.link_gb_per_s, 2)}


def loaded_summary(model) -> str | None:
    """Plan.summary for a loaded model (engine.load sets `placement` and `layer_devices`), each card named by its
    device (numbered when they repeat: the CPU's split); None when nothing streams or splits."""
    plan = getattr(model, "placement", None)
    if plan is None:
        return None
    devices, names = getattr(model, "layer_devices", None), None
    if devices is not None:
        names = [str(devices[c.layers[0]]) for c in plan.cards if c.layers]
        if len(set(names)) < len(names):
            names = [f"{name} #{k}" for k, name in enumerate(names)]
    return plan.summary(names)


def planned_context(cfg: ModelConfig) -> int:
    """The context planned for when none is given: DEFAULT_CONTEXT, or the model's own if shorter."""
    return min(DEFAULT_CONTEXT, cfg.text.max_position_embeddings)


def streaming_memory(cfg: ModelConfig, fmt: str, policy: str | None = None, resident: int = 1,
                     fused_experts: bool = False) -> int:
    """The card memory at which `cfg` keeps `resident` layers' experts on the card and streams the rest (a stack of
    three layers or fewer streams them all: two buffers and one resident layer would hold them all). The doctor's
    copy-stream check and the tests plan with it."""
    whole = plan(cfg, fmt, [Card("any", 10**15, 0.0, 4, 16)], context=planned_context(cfg), policy=policy,
                 fused_experts=fused_experts)
    c = whole.cards[0]
    return c.fixed_bytes + (2 + min(resident, len(c.layers) - 3)) * c.expert_bytes


def largest_memory(cfg: ModelConfig, fmt: str, wanted, *, context: int, cards: int = 1, batch: int = 1,
                   policy: str | None = None, fused_experts: bool = False) -> int:
    """The largest card memory (searched down from a card that holds everything, a quarter of a layer's experts at a
    time) at which `cards` cards of it give a plan that fits and satisfies `wanted(plan)`; ValueError if none does."""
    kw = dict(context=context, batch=batch, policy=policy, fused_experts=fused_experts)
    size = plan(cfg, fmt, [Card("any", 10**15, 0.0, 4, 16)], **kw).resident_bytes
    while size > 0:
        p = plan(cfg, fmt, [Card("card", size, 0.0, 4, 16)] * cards, **kw)
        if p.fits and wanted(p):
            return size
        size -= max(1, p.expert_bytes // 4)
    raise ValueError("no card size gives such a plan")


def _spread(n: int, among: list[int]) -> list[int]:
    """n of `among` (in order), evenly spaced: the layers that stream."""
    if n <= 0:
        return []
    L = len(among)
    return sorted({among[min(L - 1, int((k + 0.5) * L / n))] for k in range(n)})


def buffer_order(streamed: list[int]) -> tuple[dict[int, int], dict[int, int]]:
    """The two layer buffers' schedule for the streamed layers s0 < s1 < ... (placement/streaming.py runs it,
    placement/bounds.py bounds it): (buffer_of: layer -> 0 or 1, alternating; after: layer -> the streamed layer its
    buffer takes once it has run, the next one cyclically that uses the same buffer: s(k+2), and at the end of the
    stack s0 and s1 for the next pass; with an odd count s(n-1) -> s0, both in buffer 0)."""
    layers = sorted(streamed)
    buffer_of = {i: k % 2 for k, i in enumerate(layers)}
    after = {i: next(j for j in layers[k + 1 :] + layers[: k + 1] if buffer_of[j] == buffer_of[i])
             for k, i in enumerate(layers)}
    return buffer_of, after


def _gb(n: int) -> str:
    return f"{n / GB:.1f} GB" if n >= 10 * GB else f"{n / GB:.2f} GB" if n >= GB else f"{n / 1e6:.1f} MB"


def plan(cfg: ModelConfig, fmt: str, cards: list[Card], context: int = 8192, batch: int = 1,
         policy: str | None = None, host_free: int | None = None, fused_experts: bool = True,
         remedies: Sequence[str] = (), footprint: dict | None = None) -> Plan:
    """The placement of `cfg` in format `fmt` on `cards` (in order) at `context` tokens and `batch` rows.

    host_free: available host memory, bytes (None: not checked). fused_experts: the GPU's fused MoE kernels read
    quantized experts packed (False: one layer is unpacked at a time, as on the CPU). A plan that cannot hold says
    so in `refusal`, one line, before anything loads; a card too small ends it with `remedies`, what the caller can
    change (its own flags: "a smaller --batch"), when there are any. footprint: the bytes a model holds by layer and
    part where they are not the format's arithmetic on shapes (a GGUF's, gguf_file.GGUFFile.footprint: its tensors'
    own types; no fused kernel reads them, so a layer is unpacked at a time)."""
    policy = policy or DEFAULT_POLICY.get(fmt, "all")
    t = cfg.text
    L = t.num_hidden_layers
    layers = footprint["layers"] if footprint else layer_bytes(cfg, fmt, policy)
    cache = layer_cache_bytes(cfg, context, batch)
    totals = footprint["totals"] if footprint else weight_bytes(cfg, fmt, policy)
    expert = max(lb["experts"] for lb in layers)  # a format's layers are alike; a GGUF's may mix types by layer
    fused_experts = fused_experts and footprint is None
    per_layer = [lb["dense"] + lb["other"] + kv for lb, kv in zip(layers, cache)]  # what never streams
    shared = totals["embedding"] + (totals["other"] - sum(lb["other"] for lb in layers))
    # a request's step memory per row, and the slack; a quantized format's experts unpacked one layer at a time only
    # where no fused MoE kernel reads them packed (the CPU's path: fused_experts=False)
    unpacked = 0 if fmt == "bf16" or fused_experts else dequantized_layer_bytes(cfg)
    scratch = batch * request_bytes(cfg) + unpacked + RUNTIME_SLACK
    fixed_of = [shared + scratch if i == 0 else scratch for i in range(len(cards))]

    def make(card_layers: list[list[int]]) -> list[CardPlan]:
        out = []
        for c, mine in enumerate(card_layers):
            fixed = fixed_of[c] + sum(per_layer[i] for i in mine)
            room = cards[c].memory - fixed
            if room >= len(mine) * expert:
                out.append(CardPlan(cards[c], mine, [], fixed, expert, 0))
                continue
            resident = max(0, min(len(mine), (room - 2 * expert) // expert))
            out.append(CardPlan(cards[c], mine, _spread(len(mine) - resident, mine), fixed, expert, 2 * expert))
        return out

    # One card holds all it can resident; the next cards take the rest, contiguously; what no card holds resident
    # is shared out by what each card has left after its fixed part, and streams there.
    split, start = [], 0
    for c, card in enumerate(cards):
        mine, used = [], fixed_of[c]
        while start < L and used + per_layer[start] + expert <= card.memory:
            used += per_layer[start] + expert
            mine.append(start)
            start += 1
        split.append(mine)
    if start < L:  # streaming: layers by each card's room for their fixed parts
        rooms = [max(0, card.memory - fixed_of[c] - 2 * expert) for c, card in enumerate(cards)]
        total = sum(rooms) or 1
        split, start = [], 0
        for c in range(len(cards)):
            n = L - start if c == len(cards) - 1 else round(L * rooms[c] / total)
            split.append(list(range(start, start + n)))
            start += n
    while len(split) > 1 and not split[-1]:  # a card the layers did not reach is not used
        split.pop()
    placed = make(split)
    host = sum(len(c.streamed) for c in placed) * expert
    p = Plan(fmt, policy, context, batch, placed, host, host_free, None, L, expert, totals)
    for c in placed:
        if c.fixed_bytes + c.buffer_bytes > c.card.memory or (c.streamed and len(c.streamed) == len(c.layers)
                                                               and c.resident_bytes > c.card.memory):
            need = c.fixed_bytes + 2 * expert
            p.refusal = (f"{fmt} at a {context:,}-token context does not fit on the {c.card.name} "
                         f"({_gb(c.card.memory)}) even with every layer's experts streamed: its share needs "
                         f"{_gb(need)} on the card" + (f" ({either(remedies)})" if remedies else ""))
            return p
    if host_free is not None and host + HOST_MARGIN > host_free:
        p.refusal = (f"{fmt} on the {' + '.join(c.card.name for c in placed)} streams {len(p.streamed)} layers' "
                     f"experts from host memory: {_gb(host)} pinned, but only {_gb(host_free)} is available "
                     f"({_gb(HOST_MARGIN)} is left to the rest); free memory, or plan for a larger card")
    return p


def either(options: Sequence[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return " or ".join(filter(None, (", ".join(options[:-1]), options[-1]))) if options else ""


def choose(cfg: ModelConfig, cards: list[Card], context: int = 8192, batch: int = 1) -> str:
    """`--quant auto`: the least lossy format whose plan holds everything on the cards (FP8 only where every card has
    FP8 tensor cores), else NVFP4, which streams what does not fit."""
    for fmt in FORMATS:
        if fmt == "fp8" and not all(c.fp8 for c in cards):
            continue
        p = plan(cfg, fmt, cards, context, batch)
        if p.fits and not p.streamed:
            return fmt
    return "nvfp4"
