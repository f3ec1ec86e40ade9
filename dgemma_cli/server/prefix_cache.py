"""The server's prompt cache: a request whose prompt starts with a prompt the server has already encoded reuses
that prompt's keys and values instead of encoding it again (docs/serve.md, Shared prefixes).

Agents and chat clients resend the whole conversation every turn: turn n's prompt is turn n - 1's prompt, its answer
and the next message. The encoder is causal, so the keys and values of a prompt's first L tokens depend on those
tokens only: reusing them is exact (up to the float summation order of encoding in two pieces instead of one, as
`dgemma chat`'s reused cache between turns). An entry is one encoded prompt: its ids and a copy of its cache
(full-attention layers: all L positions; sliding layers: the window they keep). A new prompt takes the longest entry
that is a prefix of it, copies it into its own cache and encodes only the rest. Sliding layers keep only their last
W - 1 positions, so an entry is reused whole or not at all, which is what a resent conversation needs.

Entries live under a byte budget, least recently used first out. Prompts with images are neither stored nor served
(their image tokens are the same ids whatever the picture). Only the batch loop's thread touches the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class _Entry:
    ids: tuple[int, ...]
    space: int  # prompts of one space share entries (the server: one space per adapter, whose keys differ)
    k: list[torch.Tensor]  # per layer: [Hkv, L or W - 1, D]
    v: list[torch.Tensor]
    nbytes: int


class PrefixCache:
    def __init__(self, max_bytes: int, sliding: list[bool]):
        """sliding: per layer, whether it keeps only a window (model.cfg.text.layers' is_sliding)."""
        self.max_bytes = max_bytes
        self.sliding = sliding
        self.entries: OrderedDict[tuple[int, tuple[int, ...]], _Entry] = OrderedDict()  # (space, ids) -> entry
        self.bytes = 0
        self.hits = 0  # requests that reused an entry
        self.reused_tokens = 0  # prompt tokens not encoded thanks to it

    def lookup(self, prompt: list[int], space: int = 0) -> _Entry | None:
        """The longest entry of `space` whose ids begin `prompt` (None: no entry does); it becomes the most recently
        used."""
        best = None
        for (sp, ids), entry in self.entries.items():
            if sp == space and len(ids) <= len(prompt) and (best is None or len(ids) > len(best.ids)) and \
                    tuple(prompt[: len(ids)]) == ids:
                best = entry
        if best is not None:
            self.entries.move_to_end((space, best.ids))
        return best

    def restore(self, entry: _Entry, cache) -> int:
        """Copy an entry into an empty one-row model.KVCache; returns the positions it holds."""
        n = len(entry.ids)
        for layer, (k, v) in enumerate(zip(entry.k, entry.v)):
            cache.k[layer][0, :, : k.shape[1]].copy_(k)
            cache.v[layer][0, :, : v.shape[1]].copy_(v)
        cache.valid[0, :n] = True
        cache.length = n
        self.hits += 1
        self.reused_tokens += n
        return n

    def store(self, prompt: list[int], cache, space: int = 0) -> None:
        """Keep a copy of one-row `cache` right after `prompt` was encoded into it (cache.length == len(prompt))."""
        key = (space, tuple(prompt))
        if not prompt or key in self.entries or self.max_bytes <= 0:
            return
        n = cache.length
        ks, vs = [], []
        for layer, is_sliding in enumerate(self.sliding):
            slots = cache.window if is_sliding else n
            ks.append(cache.k[layer][0, :, :slots].clone())
            vs.append(cache.v[layer][0, :, :slots].clone())
        nbytes = sum(t.numel() * t.element_size() for t in ks + vs)
        if nbytes > self.max_bytes:
            return
        while self.entries and self.bytes + nbytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
        self.entries[key] = _Entry(key[1], space, ks, vs, nbytes)
        self.bytes += nbytes
