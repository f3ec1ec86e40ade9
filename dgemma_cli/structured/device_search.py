"""A held row's search on the device: one class pass over the row's log-probabilities and the dynamic programme, two
Triton kernels and a fill, no host round trip (docs/design.md, Constrained canvases: the search on the device).

`DeviceTables` (once per automaton, end ids and pad id; cached on the automaton; the host's search reads it too)
partitions the vocabulary into classes: the tokens that belong to the same token sets of the automaton (each small group's token list, each big
group's mask, the end ids, the end ids and pad) share a class; tokens no edge takes belong to none and are not read.
Every set is then a union of classes (`pair_set`, `pair_blk`), and an edge's best token at a position is the best
of its set's classes' bests. The real vocabulary falls into a few hundred classes for the structures agents send
(BENCHMARKS.md, "Structured answers at the real vocabulary": 51 to 191).

`DeviceSearch` (per row) holds the scratch and runs a step: quant/kernels/class_pass.py (each class's best and
noisy best per position, one read of the row's scores) then quant/kernels/automaton_dp.py (both paths, written into
the sampler's argmax and sample rows). The noise's seed is drawn on the device from the row's generator; the row's
state, room and `after` are written to the device at a canvas's start; whether a path was found within the length
limit (`ok`) stays on the device until the canvas ends, when the host reads the kept tokens anyway.

The argmax path is the host search's (host_search.py: the same optimum over the same scores); the drawn path is
exact in distribution as the host's is (per-token Gumbel noise here, a class's log-mass plus one Gumbel draw there).
"""

from __future__ import annotations

import numpy as np
import torch

from quant.kernels.automaton_dp import automaton_dp
from quant.kernels.class_pass import class_pass

MAX_BACK = 1 << 26  # back-pointer entries (positions x states) a row's search may hold on the device: 256 MB


class NotOnDevice(Exception):
    """The automaton is searched on the host (too many states for the device's back-pointers)."""


class DeviceTables:
    """The automaton's sets, classes and edges as the kernels read them (module docstring), on the host (numpy
    int32); `to(device)` copies them once."""

    def __init__(self, auto, end_ids: list[int], pad_id: int):
        V = auto.vocab_size
        sets: list[np.ndarray] = []  # each set's tokens
        n_small = int(auto.set_of_token[-1]) + 1 if auto.set_tokens.numel() else 0
        set_tokens, set_of_token = auto.set_tokens.numpy(), auto.set_of_token.numpy()
        order = np.argsort(set_of_token, kind="stable")
        bounds = np.searchsorted(set_of_token[order], np.arange(n_small + 1))
        for k in range(n_small):
            sets.append(np.unique(set_tokens[order[bounds[k] : bounds[k + 1]]]))
        first_mask = len(sets)
        for mask in auto.masks:
            sets.append(np.flatnonzero(mask.numpy()))
        ends = np.array(sorted(set(end_ids)), dtype=np.int64)
        stops = np.array(sorted(set(end_ids) | {pad_id}), dtype=np.int64)
        end_set, stop_set = len(sets), len(sets) + 1
        sets += [ends, stops]
        # classes: tokens in the same sets. A random 64-bit sum per token over its sets names its signature; the
        # partition is then checked exactly (each set's classes hold exactly its tokens), so a collision cannot pass
        rng = np.random.default_rng(0x5EED)
        tag = rng.integers(1, 1 << 63, size=len(sets), dtype=np.uint64)
        sig = np.zeros(V, dtype=np.uint64)
        member = np.zeros(V, dtype=bool)
        for k, toks in enumerate(sets):  # each set's tokens are distinct (masks' by construction)
            sig[toks] += tag[k]
            member[toks] = True
        tokens = np.flatnonzero(member)
        _, cls = np.unique(sig[tokens], return_inverse=True)
        order = np.argsort(cls, kind="stable")
        self.perm = tokens[order].astype(np.int32)
        self.blk = cls[order].astype(np.int32)
        self.classes = int(cls.max()) + 1 if cls.size else 0
        class_of = np.full(V, -1, dtype=np.int64)
        class_of[tokens] = cls
        self.class_of = class_of.astype(np.int32)  # [V]: each token's class, -1 where no set holds it (the head's)
        size = np.bincount(cls, minlength=self.classes)
        pair_set, pair_blk = [], []
        for k, toks in enumerate(sets):
            count = np.bincount(class_of[toks], minlength=self.classes)
            blocks = np.flatnonzero(count)
            if not np.array_equal(count[blocks], size[blocks]):  # a class only partly in the set: a collision
                raise NotOnDevice("token classes do not partition the sets")
            pair_set.append(np.full(blocks.size, k))
            pair_blk.append(blocks)
        self.sets = len(sets)
        self.pair_set = np.concatenate(pair_set).astype(np.int32)
        self.pair_blk = np.concatenate(pair_blk).astype(np.int32)
        # edges: the automaton's groups (a small one's set, a big one's mask), then an end id from each accepting
        # state to END (state S), and END to END on the end ids and pad
        S = auto.S
        src, dst = auto.src.numpy(), auto.dst.numpy()
        set_of = auto.set_of.numpy().copy()
        for g, k in auto.big:
            set_of[g] = first_mask + k
        live = set_of >= 0  # a group with no token (none is made) takes no edge
        finals = np.flatnonzero(auto.final.numpy())
        e_src = np.concatenate([src[live], finals, [S]])
        e_dst = np.concatenate([dst[live], np.full(finals.size, S), [S]])
        e_set = np.concatenate([set_of[live], np.full(finals.size, end_set), [stop_set]])
        order = np.argsort(e_dst, kind="stable")
        self.e_src, self.e_dst, self.e_set = (a[order].astype(np.int32) for a in (e_src, e_dst, e_set))
        self.dist = np.append(auto.dist.numpy(), 0).astype(np.int32)
        self.states = S + 1
        self._on: dict = {}

    def tile_runs(self, tile: int) -> tuple[np.ndarray, np.ndarray]:
        return tile_runs(self.class_of, tile)

    def to(self, device) -> dict:
        device = torch.device(device)
        if device not in self._on:
            self._on[device] = {k: torch.from_numpy(getattr(self, k)).to(device)
                                for k in ("perm", "blk", "pair_set", "pair_blk", "e_src", "e_set", "e_dst", "dist",
                                          "class_of")}
        return self._on[device]


def tile_runs(class_of: np.ndarray, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """The fused head's tables for tiles of `tile` tokens (quant/kernels/head.py `_held_classes`) from each token's
    class (-1: none), int32 [tiles x tile] each: order, each tile's lanes in class order (tokens no class holds
    first); run, at each place of that order, class x 2, plus 1 where the class's run in the tile ends (-2: no
    class)."""
    V = class_of.size
    n = -(-V // tile) * tile
    cls = np.full(n, -1, dtype=np.int64)
    cls[:V] = class_of
    tiles = cls.reshape(-1, tile)
    order = np.argsort(tiles, axis=1, kind="stable")
    ordered = np.take_along_axis(tiles, order, axis=1)
    ends = np.ones_like(ordered, dtype=bool)
    ends[:, :-1] = ordered[:, :-1] != ordered[:, 1:]
    run = np.where(ordered >= 0, ordered * 2 + ends, -2)
    return order.astype(np.int32).ravel(), run.astype(np.int32).ravel()


def device_tables(auto, end_ids, pad_id: int) -> DeviceTables:
    """The automaton's tables for these end ids and pad, made once (cached on the automaton)."""
    key = (tuple(sorted(set(int(i) for i in end_ids))), int(pad_id))
    cache = auto.__dict__.setdefault("_device_tables", {})
    if key not in cache:
        cache[key] = DeviceTables(auto, list(key[0]), key[1])
    return cache[key]


class DeviceSearch:
    """One row's search on `device` over canvases of C positions: the scratch, made once, and a step (module
    docstring)."""

    def __init__(self, tables: DeviceTables, canvas: int, pad_id: int, device,
                 generator: torch.Generator | None = None):
        if canvas * tables.states > MAX_BACK:
            raise NotOnDevice(f"{tables.states} states x {canvas} positions")
        self.t, self.C, self.device = tables, canvas, torch.device(device)
        self.on = tables.to(self.device)
        self.gen, self.pad_id = generator, pad_id
        P = canvas
        self.keys = torch.empty(2, P, tables.classes, dtype=torch.int64, device=self.device)
        self.scratch = (torch.empty(2, P, tables.sets, dtype=torch.int64, device=self.device),
                        torch.empty(2, 3, tables.states, dtype=torch.float32, device=self.device),
                        torch.empty(2, P, tables.states, dtype=torch.int32, device=self.device))
        self.meta = torch.zeros(3, dtype=torch.int32, device=self.device)
        self.ok = torch.ones(2, dtype=torch.int32, device=self.device)
        self._meta: tuple | None = None

    def tile_runs(self, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
        """DeviceTables.tile_runs on this search's device, made once per tile size."""
        key = ("tile_runs", tile)
        if key not in self.on:
            self.on[key] = tuple(torch.from_numpy(a).to(self.device) for a in self.t.tile_runs(tile))
        return self.on[key]

    def set_canvas(self, state: int, room: int, after: int) -> None:
        """Where the row stands at a canvas's start (host values, known then): copied to the device once."""
        meta = (state, room, after)
        if meta != self._meta:
            after = min(after, (1 << 31) - 1)
            self.meta.copy_(torch.tensor([state, room, after], dtype=torch.int32), non_blocking=True)
            self._meta = meta

    def step(self, score: torch.Tensor, sample: torch.Tensor, argmax: torch.Tensor, greedy: bool) -> None:
        """score float32 [C, V] (the row's log-probabilities); argmax, sample int64 [C] overwritten with the paths."""
        room = self._meta[1] if self._meta else self.C
        rows = score[: max(room, 1)]
        seed = None
        if not greedy:
            seed = torch.randint(0, 1 << 62, (1,), generator=self.gen, device=self.device)
        keys = self.keys[:, : rows.shape[0]]
        class_pass(rows, self.on["perm"], self.on["blk"], self.t.classes, seed, keys)
        self._programme(keys, sample, argmax, greedy, reset=False)

    def search_keys(self, keys: torch.Tensor, sample: torch.Tensor, argmax: torch.Tensor, greedy: bool) -> None:
        """The step's paths from class keys the fused head made (quant/kernels/head.py `HeldRows`: keys [2, C,
        width] of this row's positions), which the programme sets back to KEY_MIN as it goes: one kernel."""
        self._programme(keys, sample, argmax, greedy, reset=True)

    def _programme(self, keys: torch.Tensor, sample: torch.Tensor, argmax: torch.Tensor, greedy: bool,
                   reset: bool) -> None:
        """quant/kernels/automaton_dp.py on this row's tables: the argmax path, and the drawn one unless greedy
        (then the sample is the argmax path)."""
        on = self.on
        automaton_dp(keys, on["pair_set"], on["pair_blk"], self.t.sets, on["e_src"], on["e_set"], on["e_dst"],
                     on["dist"], self.meta, self.scratch, argmax, sample, self.ok, self.pad_id, 1 if greedy else 2,
                     reset=reset)
        if greedy:
            sample.copy_(argmax)

    def path_found(self) -> bool:
        """Whether the last step's argmax path kept within the length limit (a host read: at a canvas's end)."""
        return bool(self.ok[0])

