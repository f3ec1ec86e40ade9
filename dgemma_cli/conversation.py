"""A multi-turn conversation that keeps the encoder's KV cache between turns (what `dgemma chat` runs on).

The conversation is one growing token stream, encoded once. A turn encodes only what is new since the last one: the
end of the previous answer (its last canvas is never encoded during generation, and its pad tokens are dropped),
then the user's turn rendered by the chat template, then the model's generation prompt. When the stream would outgrow
the context, the oldest turns are dropped and the rest is encoded again (said in a notice); the dropped turns stay in
the transcript /save writes (`Conversation.dropped`). Cancelling a turn, /retry, /system and /think rebuild the cache
from the kept turns on the next turn (the sliding layers' windows cannot be rolled back). Images attached with /image
go with the next message; their soft tokens are kept with the turn, so a rebuild encodes them again without the
vision tower. The terminal around it is dgemma_cli/cli/chat.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .errors import UsageError
from .sampler import CanvasDone, Done, Event, Step
from .tokenizer import Control


@dataclass
class Turn:
    user: str
    user_ids: list[int]  # the user turn as encoded: template text after the previous answer
    answer: str = ""
    thought: str = ""
    answer_ids: list[int] = field(default_factory=list)  # generated, through the end-of-turn token, no pads
    images: list = field(default_factory=list)  # image.Patches sent with the message
    features: torch.Tensor | None = None  # their soft tokens [N, H], kept to encode the turn again on a rebuild


@dataclass
class TurnStats:
    encoded: int  # tokens encoded for this turn (new ones only, or everything after a rebuild)
    rebuilt: bool
    seconds_to_first_step: float
    dropped_turns: int = 0


class Conversation:
    """One conversation's token stream in one KV cache (batch 1)."""

    def __init__(self, engine, context: int, system: str | None = None, enable_thinking: bool = False):
        if engine.tokenizer is None:
            raise UsageError(f"{engine.path}: no tokenizer.json, so there is nothing to chat with")
        self.engine = engine
        self.tok = engine.tokenizer
        self.context = min(context, engine.config.text.max_position_embeddings)
        self.system = system
        self.enable_thinking = enable_thinking
        self.structure = None  # constrain.Structure the answers are held to (/set json-schema, regex, grammar)
        self.turns: list[Turn] = []
        # Turns the context dropped (the oldest, when the conversation outgrew it): the model no longer sees them,
        # but they are still the conversation the user had, and /save writes them before the others.
        self.dropped: list[Turn] = []
        self.denoiser = None
        self.cached: list[int] = []  # ids in the cache, in order
        self.pending: list[int] = []  # generated ids of the last answer not yet in the cache
        self.stale = True  # the cache must be rebuilt from the turns before the next one
        self.notices: list[str] = []
        self.cancelled: str | None = None  # the message of a cancelled turn, for /retry
        self.attached: list = []  # image.Patches for the next message (/image)
        self.cancelled_images: list = []  # the cancelled message's images, for /retry
        self.image_tokens: int | None = None  # soft tokens per image (None: the model's default)

    # -- token stream -----------------------------------------------------------------------------------

    def head_ids(self) -> list[int]:
        """<bos>, the system turn (and the thinking switch), as the template renders an empty conversation."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        return self.tok.encode_chat(messages, add_generation_prompt=False, enable_thinking=self.enable_thinking)

    def attach_image(self, source) -> int:
        """Attach an image (a path or the file's bytes) to the next message; returns its soft-token count."""
        from .checkpoint.layout import check_images

        if self.engine.path is not None:
            check_images(self.engine.path)  # a store entry holding only the text model: the line naming a re-pull
        patches = self.engine.image_patches([source], self.image_tokens)[0]
        self.attached.append(patches)
        return patches.soft_tokens

    def user_turn_ids(self, text: str, first: bool, images: list = ()) -> list[int]:
        """The template's rendering of one user turn and the generation prompt, without <bos> (the stream has
        it); after an answer, the newline the template puts after every turn comes first. Images go before the
        text, each as begin-of-image, its image tokens, end-of-image."""
        content = [Control(self.engine.image_placeholder())] * len(images) + [text] if images else text
        ids = self.tok.encode_chat([{"role": "user", "content": content}], add_generation_prompt=True)
        if images:
            ids = self.engine.with_images(ids, images)
        if ids and ids[0] == self.tok.bos_id:
            ids = ids[1:]
        return ids if first else self.tok.encode("\n") + ids

    def full_ids(self, turns: list[Turn]) -> list[int]:
        out = self.head_ids()
        for t in turns:
            out += t.user_ids + t.answer_ids
        return out

    # -- turns --------------------------------------------------------------------------------------------

    def reset(self) -> None:
        self.turns.clear()
        self.dropped.clear()
        self.stale = True

    def _reserve(self, settings) -> int:
        C = self.engine.config.canvas_length
        return settings.canvases_for(C) * C

    def _rebuild(self, text: str, settings, images: list = ()) -> tuple[list[int], list[int], int]:
        """(ids to encode from an empty cache, the new user turn's ids, turns dropped): the oldest turns go while
        the stream and a full answer do not fit the context."""
        kept = list(self.turns)  # worked out on a copy: a message that cannot fit leaves the conversation alone
        first_ids = None
        while True:
            user_ids = self.user_turn_ids(text, first=not kept, images=images)
            stream = self.head_ids()
            for i, t in enumerate(kept):
                stream += (first_ids if i == 0 and first_ids is not None else t.user_ids) + t.answer_ids
            ids = stream + user_ids
            if len(ids) + self._reserve(settings) <= self.context or not kept:
                break
            kept.pop(0)
            if kept:  # the first kept turn now follows the head directly
                first_ids = self.user_turn_ids(kept[0].user, first=True, images=kept[0].images)
        if len(ids) + self._reserve(settings) > self.context:
            raise UsageError(f"this message needs {len(ids) + self._reserve(settings)} positions with a full answer; "
                             f"the chat context is {self.context}" +
                             (" (--context)" if self.context < self.engine.config.text.max_position_embeddings
                              else ", the model's most"))
        dropped = len(self.turns) - len(kept)
        if dropped:
            # kept for the transcript only: their text (ids, images and soft tokens are not needed any more)
            self.dropped += [Turn(t.user, [], t.answer, t.thought) for t in self.turns[:dropped]]
            if first_ids is not None:
                kept[0].user_ids = first_ids
            self.turns[:] = kept
        return ids, user_ids, dropped

    def turn_events(self, text: str, settings, seed: int | None = None) -> tuple[Iterator[Event], TurnStats]:
        """Start a turn: returns its events (consume them all, or call `cancel`) and the encoding stats."""
        from .engine import _in_inference_mode, make_denoiser
        from .sampler import generate_events

        t0 = time.perf_counter()
        images = self.attached
        features = self.engine.image_features(images) if images else None
        reuse = not self.stale and self.denoiser is not None and self.turns
        if reuse:
            user_ids = self.user_turn_ids(text, first=False, images=images)
            new = self.pending + user_ids
            reuse = len(self.cached) + len(new) + self._reserve(settings) <= self.context
        dropped = 0
        if not reuse:
            new, user_ids, dropped = self._rebuild(text, settings, images)
            if dropped:
                self.notices.append(f"the conversation outgrew the {self.context}-token context: dropped the "
                                    f"oldest {dropped} turn{'s' if dropped > 1 else ''}")
            self.denoiser = make_denoiser(self.engine.model, 1, self.context)
            self.cached = []
        self.pending = []
        self.stale = True  # until the answer is complete
        self.cancelled = None
        self.attached = []
        self.turns.append(Turn(text, user_ids, images=images, features=features))
        # The images in the encoded ids: this turn's, or after a rebuild every kept turn's, in order.
        sent = [features] if reuse else [t.features for t in self.turns]
        sent = [f for f in sent if f is not None]
        self.denoiser.image_features = torch.cat(sent) if sent else None
        if seed is not None:
            torch.manual_seed(seed)
        prompt = torch.tensor([new], dtype=torch.long, device=self.engine.model.device)
        stats = TurnStats(len(new), not reuse, 0.0, dropped)
        constraints = None  # /set json-schema, regex, grammar: the answer held to it
        if self.structure is not None:
            auto = self.engine.automaton(self.structure)
            constraints = [auto.row(settings.max_new_tokens, settings.eos_token_ids, settings.pad_token_id)]
        events = _in_inference_mode(generate_events(self.denoiser, prompt, settings, constraints=constraints))
        return self._track(events, new, stats, t0), stats

    def _track(self, events: Iterator[Event], new: list[int], stats: TurnStats, t0: float) -> Iterator[Event]:
        """Pass events through; keep the cached stream in step with what the sampler encodes."""
        eot = self.tok.end_of_turn_id
        pad = self.engine.settings.pad_token_id
        self.cached += new
        canvases: list[list[int]] = []
        for ev in events:
            if isinstance(ev, Step) and stats.seconds_to_first_step == 0.0:
                stats.seconds_to_first_step = time.perf_counter() - t0
            if isinstance(ev, CanvasDone):
                canvases.append(ev.tokens[0].tolist())
            if isinstance(ev, Done):
                for c in canvases[:-1]:  # every canvas but the last was encoded as the next one started
                    self.cached += c
                answer = ev.token_ids[0]
                last = canvases[-1] if canvases else []
                # the last canvas's kept part (pads after the end of turn dropped), ending with the end of turn
                keep = [t for t in last if t != pad]
                if eot in keep:
                    keep = keep[: keep.index(eot) + 1]
                else:
                    keep = keep + [eot]
                self.pending = keep
                turn = self.turns[-1]
                turn.answer_ids = [t for c in canvases[:-1] for t in c] + keep
                turn.thought, turn.answer = self.tok.decode_answer(answer)
                self.stale = False
            yield ev

    def cancel(self) -> None:
        """Forget the turn in progress (its tokens may be half in the cache: rebuild next time)."""
        if self.turns and self.stale:
            turn = self.turns.pop()
            self.cancelled, self.cancelled_images = turn.user, turn.images
        self.pending = []
        self.stale = True

    def retry(self) -> str | None:
        """The message to send again: a cancelled one, else the last turn's (that turn is dropped)."""
        if self.cancelled is not None:
            text, self.cancelled = self.cancelled, None
            self.attached = list(self.cancelled_images)
            return text
        if not self.turns:
            return None
        last = self.turns.pop()
        self.pending = []
        self.stale = True
        self.attached = list(last.images)  # the images go again with the message
        return last.user

    def markdown(self) -> str:
        lines = ["# dgemma chat", ""]
        if self.system:
            lines += [f"**System:** {self.system}", ""]
        for i, t in enumerate(self.dropped + self.turns):
            if i == len(self.dropped) and self.dropped:
                lines += [self._dropped_note(), ""]
            lines += ["## User", "", t.user, "", "## Model", ""]
            if t.thought:
                lines += ["> " + line for line in t.thought.splitlines()] + [""]
            lines += [t.answer, ""]
        if self.dropped and not self.turns:
            lines += [self._dropped_note(), ""]
        return "\n".join(lines)

    def _dropped_note(self) -> str:
        n = len(self.dropped)
        return (f"*({'The turn' if n == 1 else f'The {n} turns'} above fell out of the model's {self.context}-token "
                f"context: the model no longer saw {'it' if n == 1 else 'them'} when it answered what follows.)*")
