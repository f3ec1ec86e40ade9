"""One engine loop for many requests: rows join the batch at their first canvas and leave when they are done.

The rule: this module knows token ids, the network and the sampler; nothing of HTTP or text. `requests.py` turns
requests into `Job`s and `answering.py` the events delivered here into the API's chunks.

How a row is what it would be alone (`Engine.events(prompt, seed=S)` on the CPU, token for token):
- Each request has its own KV cache (`KVCache` of batch 1) and its own place in its canvases (prompt length, canvas
  index, step, self-conditioning), so a request can start while others are mid-canvas. Its prompt and each of its
  finished canvases are encoded alone, exactly as a single run encodes them.
- The decoder forward of one step stacks the active rows' canvases [A, C] for everything that works token by token
  (embeddings, norms, RoPE, the q/k/v/o and dense MLP projections, the router, the LM head); attention runs per row
  over that row's own cache. On the CPU the routed experts run per row too: a grouped matmul's bits depend on which
  other tokens share an expert's group (BLAS takes another path for groups of 1 to 3 rows), so mixing requests there
  would change the result. On a GPU, where a single run's bits already depend on the batch shape (cuBLAS picks its
  kernels by size), the experts take all rows at once: they are most of the weights a step reads.
- Every random draw of a row (canvas init, the sample's exponential race, renoise) comes from the row's own
  `torch.Generator` seeded with the request's seed; a generator seeded with S draws what torch's global generator
  draws after `torch.manual_seed(S)`.
- Each row runs with its own adapter or the base (`rows_choose_adapters`: `Phase.row_slots`, one slot per row of
  the forward); a part of the forward that runs on some of the rows only takes their slots only (the
  self-conditioning MLP on the rows that have a previous step, the routed experts row by row).
That the stacked projections give each row the bits it gets alone is a property of the BLAS (on this CPU: float32
matmuls with at least 4 rows); `tests/test_serve.py` checks the whole answer against the single run.

Memory: the sampler's buffers (on a GPU the fused head's, on the CPU the torch path's canvas x vocab float32 ones)
are allocated once, for `max_batch` rows, whatever the queue holds; a queued request holds only its token ids. Rows stay packed at the front of the buffers (a row that leaves
is replaced by the last one), so a step works on the first A canvases.

No wait in a step (on a GPU): a row's stop test (its canvas stable and confident) is read one step late, as the
single run reads it (`sampler.LaggedStop`): each step's verdict is copied to the host behind an event, and the loop
reads the previous step's after queuing this one, so the host never waits for the step it has just queued. When the
verdict says the canvas ended, the step queued after it changed nothing (a row whose canvas ended keeps its canvas
and argmax: a select on the device), and the row's generator is put back to where it stood before that step, so its
next canvas draws what it would have; the step is not counted. Rows whose step the host reads anyway keep the
immediate test: a structured answer's (its automaton steps on the host), one that streams its steps, one that asks
for log-probabilities (read from the canvas's last step).

A held row (a structured answer) searches its step's paths through its automaton on the host (structured/
constrain.py) before it can settle its step. With other rows in the batch that search runs on a helper thread
(`_Row.search`), and the row sits the next steps out until it is done: the rows still searching are kept at the back
of the batch and of the buffers (`_stepping_first` swaps a row's self-conditioning softmax with its slot), the others
step without them. Before a step the loop waits for the searches at most a quarter of the last step's time
(SEARCH_WAIT), so a search shorter than that costs its row no step and the others at most that. A row's own draws
come in the same order either way, so its answer is the one it gets alone; only
when every row is searching does the loop wait, for the first search to finish.

Failures: one request's failure is that request's. A job that cannot be admitted, or a row whose own step fails,
gets `RowFailed` and leaves; the others go on. When a step's batched forward raises, each row runs that step alone
on its own rows of the buffers (`SamplerBuffers.span`), as it would have run in the batch: its generator is put
back first, so it draws again what it drew for the batch, and a forward only reads the previous step's
self-conditioning input (the fused head overwrites it last, at the forward's end). A row that fails alone fails;
the others get the step they get alone. Each failure writes one line on stderr (`dgemma: internal error in ...`),
which is where its exception is told: the client's error names none. A batched failure that no row has alone (a
fault of mixing rows) writes one line the first time it is seen, not at every step it comes back.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..config import GenerationSettings
from ..model import DiffusionGemma, host_index
from .prefix_cache import PrefixCache
from ..sampler import (LaggedStop, SamplerBuffers, _stable, entropy_bound_accept, held_tables, prepare_step,
                      sample_step, step_temperature, use_fused_head)


# ----------------------------------------------------------------------------- what goes in and comes out


@dataclass
class Job:
    """One request as the loop sees it."""

    prompt: list[int]  # ids encoded before the first canvas (an infill's prefix, after <bos>)
    settings: GenerationSettings
    seed: int
    capacity: int  # KV cache positions (Engine.check_context)
    held: list[int] = field(default_factory=list)  # infill: ids held at the end of every canvas
    want_steps: bool = False  # deliver a RowStep per denoising step
    image_features: Any = None  # soft tokens [N, H] of the prompt's images, placed at its image tokens (or None)
    automaton: Any = None  # constrain.TokenAutomaton the answer is held to (or None): a structured answer
    adapter: int = 0  # the LoRA adapter this request runs with (its slot, lora.attach; 0: the base alone)
    logprobs: int | None = None  # None: none kept; k: each kept token's log-probability and the k most likely
    # alternatives, from the distribution of the step that settled its canvas (RowCanvas.logprobs)


@dataclass
class RowStep:
    canvas_index: int
    step: int  # 1-based
    max_steps: int
    canvas: list[int]  # [C] accepted tokens and fresh noise: what the next step sees
    accepted: list[bool]  # [C] accepted at this step
    entropy: list[float]  # [C] of the temperature-scaled distribution


@dataclass
class RowCanvas:
    canvas_index: int
    tokens: list[int]  # the kept (argmax) canvas's free part, pad after the first end-of-sequence id
    steps: int  # forward passes it took
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # with Job.logprobs: per position of
    # `tokens`, (the kept token's log-probability, [(id, log-probability)] of the k most likely), from the
    # temperature-scaled distribution of the canvas's last step, the one whose argmax the canvas keeps


@dataclass
class RowDone:
    token_ids: list[int]  # generated ids, ending before the first end-of-sequence id (as sampler.Done's)
    steps_per_canvas: list[int]
    ended: bool  # an end-of-sequence id was generated (False: the length limit ended it)
    seconds: float  # from admission to the end
    satisfied: bool | None = None  # a structured answer: complete (True) or cut short by the length limit
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not encoded


@dataclass
class RowFailed:
    message: str


RowEvent = RowStep | RowCanvas | RowDone | RowFailed


class QueueFull(Exception):
    pass


class Closed(Exception):
    pass


class Ticket:
    """The submitter's handle on a job: `cancel()` frees its slot at the next step (or drops it from the queue)."""

    def __init__(self, job: Job, deliver: Callable[[RowEvent], None]):
        self.job = job
        self.deliver = deliver
        self.cancelled = False
        self.queued_at = time.monotonic()

    def cancel(self) -> None:
        self.cancelled = True  # read by the loop thread at its next step; a plain attribute write is atomic


# ----------------------------------------------------------------------------- the batched decoder forward


def denoise_rows(model: DiffusionGemma, rows: list[_Row], canvas: torch.Tensor, buf: SamplerBuffers,
                 experts_per_row: bool = True) -> torch.Tensor | None:
    """One decoder forward for rows that each have their own cache and canvas position: `DiffusionGemma.denoise`
    with one cache per row, its results in the sampler's buffers `buf` (engine.denoise_into). canvas [A, C] ids (row
    a is rows[a]); the rows that have a previous step (`row.sc`) are self-conditioned on it, read from `buf`.
    `experts_per_row`: see the module docstring."""
    from ..engine import denoise_into

    with rows_choose_adapters(model, [r.job.adapter for r in rows]):
        return denoise_into(model, canvas, [r.cache for r in rows], [r.ctx for r in rows], buf, True,
                            sc_rows=[a for a, r in enumerate(rows) if r.sc], experts_per_row=experts_per_row)


@contextlib.contextmanager
def rows_choose_adapters(model: DiffusionGemma, slots: list[int]):
    """Around a forward of the server's: row b runs with adapter slots[b] (0: the base alone), when adapters are
    attached (lora.attach); otherwise nothing to choose."""
    if not model.adapters:
        yield
        return
    model.phase.row_slots = host_index(slots, model.device)
    try:
        yield
    finally:
        model.phase.row_slots = None


# ----------------------------------------------------------------------------- one request's state


_ROW_SERIALS = itertools.count()


class _Row:
    """A request being generated: its cache, its generator and where it is in its current canvas. The per-step
    bookkeeping is `sampler.generate_events`' for a batch of one."""

    def __init__(self, ticket: Ticket, model: DiffusionGemma, prefixes: PrefixCache | None = None,
                 lagged: bool = False):
        job = ticket.job
        self.ticket, self.job, self.model = ticket, job, model
        s = self.settings = job.settings
        dev = model.device
        self.C, self.V = model.cfg.canvas_length, model.cfg.text.vocab_size
        self.h = len(job.held)
        self.free = self.C - self.h
        self.held = torch.tensor([job.held], dtype=torch.long, device=dev) if self.h else None
        ends = list(s.eos_token_ids) + ([s.pad_token_id] if self.h else [])  # an infill's middle may end at <pad>
        self.eos = torch.tensor(ends, device=dev)
        self.canvases_max = s.canvases_for(self.free)
        self.gen = torch.Generator(device=dev)
        self.gen.manual_seed(job.seed)
        self.constraint = None
        if job.automaton is not None:
            self.constraint = job.automaton.row(s.max_new_tokens, s.eos_token_ids, s.pad_token_id, self.gen)
        # the stop test read a step late (module docstring), where the host does not read the step anyway (a held
        # row's search on the device reads nothing there)
        self.on_device = self.constraint is not None and self.constraint.on_device(dev, self.C)
        self.serial = next(_ROW_SERIALS)  # names this row for as long as the process runs (an id() may be reused)
        self.lagged = lagged and (self.constraint is None or self.on_device) and not job.want_steps and \
            job.logprobs is None
        self.before_step = None  # the generator's state before this step's draws (BatchLoop._step)
        self.searching = None  # a Future: this step's held search, on a helper thread (BatchLoop._after)
        self.settling: tuple | None = None  # what settling the step after it takes
        self.undone = 0  # steps run after its canvas had ended, undone
        self.t0 = time.perf_counter()
        self.cache = model.new_cache(1, job.capacity)
        self.canvases: list[list[int]] = []
        self.steps_per_canvas: list[int] = []
        self.logprobs: list | None = None  # the finishing canvas's (token_logprobs), with Job.logprobs
        self.ended = False
        self.ci = -1
        # a prompt that begins with one already encoded takes its keys and values (prefix_cache.py); pictures never
        # (keys and values depend on the adapter: each adapter's prompts are cached apart)
        shareable = prefixes is not None and job.image_features is None
        entry = prefixes.lookup(job.prompt, job.adapter) if shareable else None
        self.cached = prefixes.restore(entry, self.cache) if entry is not None else 0
        rest = job.prompt[self.cached :]
        if rest:
            with rows_choose_adapters(model, [job.adapter]):
                model.encode(torch.tensor([rest], dtype=torch.long, device=dev), self.cache,
                             image_features=job.image_features)
        if shareable:
            prefixes.store(job.prompt, self.cache, job.adapter)
        self.start_canvas()

    def start_canvas(self) -> None:
        self.ci += 1
        self.ctx = self.model.denoise_context(self.cache, 1)
        canvas = torch.randint(0, self.V, (1, self.C), device=self.model.device, generator=self.gen)
        if self.h:
            canvas[:, self.free :] = self.held
        self.canvas = self.argmax = canvas
        self.sc = False  # the buffer holds no softmax of this row's yet
        self.n = self.settings.max_denoising_steps  # counts down to 1
        self.history: list[torch.Tensor] = []
        self.steps = 0
        if self.lagged:
            self.done = torch.zeros(1, dtype=torch.bool, device=self.model.device)  # the canvas ended (device)
            self.stop = LaggedStop(self.model.device)

    def temperature(self) -> torch.Tensor:
        """This step's temperature, computed as the single run computes it (a float32 tensor)."""
        return step_temperature(self.n, self.settings, self.model.device)

    def after_step(self, sample: torch.Tensor, argmax: torch.Tensor, entropy: torch.Tensor,
                   logp: torch.Tensor | None = None) -> bool:
        """Accept, renoise and test for the canvas's end, from this row's [1, C] slices of the step's results (and
        its log-probabilities [C, V], which a structured answer's search reads); returns True when the canvas is
        finished."""
        self.search(sample, argmax, entropy, logp)
        return self.settle(sample, argmax, entropy)

    def search(self, sample: torch.Tensor, argmax: torch.Tensor, entropy: torch.Tensor,
               logp: torch.Tensor | None = None, keys: torch.Tensor | None = None) -> None:
        """The part of after_step that a held answer's search makes long: held ids written in, and the automaton's
        best paths in place of the draws and the argmax. Touches only this row's own tensors and generator, so the
        loop may run it on a helper thread while the other rows step (BatchLoop._after)."""
        s, free = self.settings, self.free
        if self.h:  # held tokens: certain by definition
            entropy[:, free:] = 0
            sample[:, free:] = self.held
            argmax[:, free:] = self.held
        if self.constraint is not None and keys is not None:  # the head made its class keys: the programme alone
            self.constraint.step_keys(keys, sample[0], argmax[0], s.greedy)
        elif self.constraint is not None:  # the best paths through the automaton replace the draws and the argmax
            self.constraint.step(logp, sample[0], argmax[0], s.greedy, drawn=True)  # the step's own draws

    def settle(self, sample: torch.Tensor, argmax: torch.Tensor, entropy: torch.Tensor) -> bool:
        """The rest of after_step, once `search` has run."""
        s, free = self.settings, self.free
        self.steps += 1
        accepted = entropy_bound_accept(entropy, s.entropy_bound)
        kept = torch.where(accepted, sample, self.canvas)
        noise = torch.randint(0, self.V, (1, self.C), device=self.model.device, generator=self.gen)
        canvas = torch.where(accepted, kept, noise)
        stable = _stable(self.history, argmax, s.stability_threshold)
        confident = entropy[:, :free].mean(dim=-1) < s.confidence_threshold
        self.sc = True
        self.n -= 1
        if self.lagged:  # a canvas that ended keeps its canvas and argmax (a select: no host round trip)
            self.canvas = torch.where(self.done[:, None], self.canvas, canvas)
            self.argmax = torch.where(self.done[:, None], self.argmax, argmax)
            self.done = self.done | (stable & confident)
            self.stop.push(self.done)
            if self.stop.previous():  # the step before this one ended the canvas: this one was not needed
                self.gen.set_state(self.before_step)
                self.steps -= 1
                self.undone += 1
                return True
            return self.n == 0
        self.canvas, self.argmax = canvas, argmax
        if self.job.want_steps:
            self.deliver(RowStep(self.ci, self.steps, s.max_denoising_steps, self.canvas[0].tolist(),
                                 accepted[0].tolist(), entropy[0].tolist()))
        return bool(stable & confident) or self.n == 0

    def finish_canvas(self) -> bool:
        """Keep the argmax canvas (pad after a first end id), report it; returns True when the row is done."""
        s = self.settings
        tokens = self.argmax[:, : self.free].clone()
        is_eos = torch.isin(tokens, self.eos)
        ended_here = bool(is_eos.any())
        run = is_eos.cumsum(dim=-1)
        tokens[(run > 0) & ~((run == 1) & is_eos)] = s.pad_token_id
        ids = tokens[0].tolist()
        if self.constraint is not None:
            self.constraint.end_canvas(ids)
        self.canvases.append(ids)
        self.steps_per_canvas.append(self.steps)
        self.deliver(RowCanvas(self.ci, ids, self.steps, self.logprobs))
        self.logprobs = None
        if ended_here or self.ci + 1 >= self.canvases_max:
            self.ended = ended_here
            return True
        with rows_choose_adapters(self.model, [self.job.adapter]):
            self.model.encode(tokens, self.cache)
        self.start_canvas()
        return False

    def done_event(self) -> RowDone:
        row = [t for c in self.canvases for t in c]
        ends = set(self.eos.tolist())
        cut = next((i for i, t in enumerate(row) if t in ends), len(row))
        ids = row[: min(cut, self.settings.max_new_tokens)]
        ended = self.ended and cut < self.settings.max_new_tokens
        satisfied = None if self.constraint is None else self.constraint.satisfied
        return RowDone(ids, self.steps_per_canvas, ended, time.perf_counter() - self.t0, satisfied, self.cached)

    def deliver(self, event: RowEvent) -> None:
        _deliver(self.ticket, event)


def _deliver(ticket: Ticket, event: RowEvent) -> None:
    try:
        ticket.deliver(event)
    except Exception:  # a receiver that is gone (its event loop closed) must not stop the loop
        ticket.cancelled = True


# ----------------------------------------------------------------------------- the loop

SEARCH_WAIT = 0.25  # of a step's time, what the loop waits for held rows' searches before stepping without them


class BatchLoop:
    """Runs every admitted request's steps in one thread, batching the active rows' decoder forwards.

    `submit` queues a job (QueueFull past `max_batch + max_queue` requests in the system); the loop admits queued
    jobs, oldest first, whenever a row is free, before each step. `close` stops admitting and, with drain=True,
    returns once every admitted and queued job is done.
    """

    def __init__(self, model: DiffusionGemma, max_batch: int = 8, max_queue: int = 64,
                 prefix_cache_bytes: int = 0, lagged: bool | None = None):
        """prefix_cache_bytes: the budget of the prompt cache (prefix_cache.py); 0: none. lagged: read the rows'
        stop tests a step late (the module docstring); None: on a GPU (on the CPU the host waits for each op
        anyway)."""
        if max_batch < 1 or max_queue < 0:
            raise ValueError("max_batch must be >= 1 and max_queue >= 0")
        self.model = model
        self.prefixes = (PrefixCache(prefix_cache_bytes, [spec.is_sliding for spec in model.cfg.text.layers])
                         if prefix_cache_bytes > 0 else None)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.C, self.V = model.cfg.canvas_length, model.cfg.text.vocab_size
        self.experts_per_row = model.device.type == "cpu"  # exactly the single run's bits (module docstring)
        self.lagged = model.device.type == "cuda" if lagged is None else lagged
        self.discarded = 0  # steps run after a row's canvas had ended, undone (lagged stop tests)
        head = (model.cfg.text.hidden_size, model.dtype) \
            if use_fused_head(model.device, model.dtype, model.head_family) and not model.token_rows else None
        self.buf = SamplerBuffers(max_batch * self.C, self.V, model.device, head)
        self.pending: deque[Ticket] = deque()
        self.rows: list[_Row] = []
        self.cond = threading.Condition()
        self.closing = False
        self.stopped = False
        # Counters (read without the lock: ints, for /health and the tests).
        self.forwards = 0  # batched decoder forwards
        self.row_forwards = 0  # rows in them, summed: row_forwards / forwards is the mean batch
        self.peak_batch = 0
        self.completed = 0
        self.failed = 0
        self.batch_errors: set[str] = set()  # batched forwards' failures already said (`_note_batch_error`)
        self.search_pool = None  # helper threads for held rows' searches (`_searcher`)
        self._held_maps: tuple | None = None  # (the step's rows, their slots, tile tables, width): `_held_rows`
        self._held_keys: torch.Tensor | None = None  # their class keys, [2, rows, width]
        self.step_seconds = 0.0  # the last step's forward and sampling, wall time (`_settle_searched`)
        self.thread = threading.Thread(target=self._run, name="dgemma-batch-loop", daemon=True)
        self.thread.start()

    def _held_rows(self, lo: int, rows: list[_Row]):
        """What the fused head needs to run the class pass of the rows held to structures searched on the device
        (sampler.held_tables: slots and tile tables, made again only when the step's rows change), and the batch's
        keys (KEY_MIN between steps: each row's programme sets back what it read)."""
        from quant.kernels.class_pass import KEY_MIN
        from quant.kernels.head import HeldRows

        C, dev = self.C, self.model.device
        ids = tuple((r.serial, r.on_device) for r in rows)
        if self._held_maps is None or self._held_maps[0] != ids:
            slot, order, run, width = held_tables([r.constraint if r.on_device else None for r in rows], C,
                                                  self.buf.fused.tile, dev)
            self._held_maps = (ids, torch.tensor(slot, dtype=torch.int32, device=dev), order, run, width)
        _, slot, order, run, width = self._held_maps
        if self._held_keys is None or self._held_keys.shape[2] < width:
            self._held_keys = torch.full((2, self.max_batch * C, width), KEY_MIN, dtype=torch.int64, device=dev)
        return HeldRows(slot, order, run, self._held_keys[:, lo * C : (lo + len(rows)) * C])

    def _log_probs(self, hidden: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """One row's log-probabilities [C, V] of the step's temperature-scaled distribution, from its final hidden
        states [1, C, H]: what the torch path leaves in its buffer, made here only for a row whose answer is held to a
        structure, since the fused head keeps none (one canvas x vocab float32 tensor, for that row, that step)."""
        logits = self.model.logits(hidden)[0]  # [C, V] float32, capped
        return torch.log_softmax(logits / temperature, dim=-1)

    @property
    def buffer_bytes(self) -> int:
        return self.buf.nbytes

    def load(self) -> tuple[int, int]:
        """(active rows, queued requests)."""
        return len(self.rows), len(self.pending)

    def submit(self, job: Job, deliver: Callable[[RowEvent], None]) -> Ticket:
        ticket = Ticket(job, deliver)
        with self.cond:
            if self.closing:
                raise Closed("the server is shutting down")
            live = sum(1 for r in self.rows if not r.ticket.cancelled) + len(self.pending)
            if live >= self.max_batch + self.max_queue:
                raise QueueFull(f"{live} requests are running or queued (--max-batch {self.max_batch}, "
                                f"--max-queue {self.max_queue})")
            self.pending.append(ticket)
            self.cond.notify()
        return ticket

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        with self.cond:
            self.closing = True
            if not drain:
                for t in self.pending:
                    t.cancelled = True
                for r in self.rows:
                    r.ticket.cancelled = True
            self.cond.notify()
        self.thread.join(timeout)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                admit: list[Ticket] = []
                with self.cond:
                    while not self.pending and not self.rows and not self.closing:
                        self.cond.wait()
                    while self.pending and self.pending[0].cancelled:
                        self.pending.popleft()
                    if self.closing and not self.rows and not self.pending:
                        self.stopped = True
                        return
                    while self.pending and len(self.rows) + len(admit) < self.max_batch:
                        t = self.pending.popleft()
                        if not t.cancelled:
                            admit.append(t)
                for t in admit:
                    try:
                        self.rows.append(_Row(t, self.model, self.prefixes, self.lagged))
                    except Exception as e:  # noqa: BLE001 (one request's failure is that request's)
                        self._fail(t, e)
                if self.rows:
                    try:
                        self._step()
                    except Exception as e:  # noqa: BLE001 (outside any row's own work: fail them all, keep serving)
                        for r in self.rows:
                            self._fail(r.ticket, e)
                        self.rows = []
                        self._reset_head()

    def _leave(self, gone: set[int]) -> None:
        """Remove rows by index, packing the rest to the front of the buffers (their softmax moves with them)."""
        if not gone:
            return
        C = self.C
        kept = [a for a in range(len(self.rows)) if a not in gone]
        for j, a in enumerate(kept):
            moved = self.rows[a]  # a row searching holds its step's softmax, though it says so (sc) once settled
            if a != j and (moved.sc or moved.searching is not None):  # a > j: it moves forward, over a freed slot
                self.buf.move_rows(a * C, j * C, C)
        self.rows = [self.rows[a] for a in kept]

    def _step(self) -> None:
        """One denoising step of every active row: one forward for them all. When that forward raises, each row
        runs the step alone on its own rows of the buffers (the batch's failure may be no row's own); a row whose
        forward, sampling or bookkeeping fails alone fails, the others go on."""
        self._leave({a for a, r in enumerate(self.rows) if r.ticket.cancelled})
        self._settle_searched()
        rows = self.rows[: self._stepping_first()]  # those searching sit this step out, at the back
        if not rows:
            return
        gone: set[int] = set()
        states = [r.gen.get_state() for r in rows]  # the fused head's uniforms are drawn before the forward
        for r, state in zip(rows, states):  # where a row's stop test lags, what its draws go back to
            r.before_step = state
        t0 = time.perf_counter()
        try:
            ran = self._forward(0, rows)
        except Exception as e:  # noqa: BLE001 (tried again row by row, below)
            ran, batch_error = None, e
            self._reset_head()
        if ran is not None:
            self._after(0, rows, *ran, gone)
            self.step_seconds = time.perf_counter() - t0
        elif len(rows) == 1:
            self._fail(rows[0].ticket, batch_error)
            gone.add(0)
        else:
            for r, state in zip(rows, states):  # each row draws again what it drew for the failed forward
                r.gen.set_state(state)
            failed_alone = False
            for a, r in enumerate(rows):
                try:
                    ran = self._forward(a, [r])
                except Exception as e:  # noqa: BLE001 (this row's own failure)
                    self._fail(r.ticket, e)
                    self._reset_head()
                    gone.add(a)
                    failed_alone = True
                    continue
                self._after(a, [r], *ran, gone)
            if not failed_alone:  # no row's own: the batch's, said once per kind (it may come back every step)
                self._note_batch_error(batch_error, len(rows))
        self._leave(gone)

    def _forward(self, lo: int, rows: list[_Row]) -> tuple[SamplerBuffers, torch.Tensor, torch.Tensor | None]:
        """The decoder forward of one step for rows = self.rows[lo : lo + len(rows)], on their rows of the buffers:
        returns (those buffers' view, the step's temperatures [n*C, 1], the fused head's hidden states or None)."""
        n, C = len(rows), self.C
        buf = self.buf.span(lo * C, n * C)
        if buf.fused is not None and any(r.on_device for r in rows):
            buf.fused.held = self._held_rows(lo, rows)
        canvas = torch.cat([r.canvas for r in rows])  # [n, C]
        temperature = torch.stack([r.temperature() for r in rows]).repeat_interleave(C)[:, None]  # [n*C, 1]
        prepare_step(buf, temperature, [r.gen for r in rows])
        hidden = denoise_rows(self.model, rows, canvas, buf, self.experts_per_row)
        self.forwards += 1
        self.row_forwards += n
        self.peak_batch = max(self.peak_batch, n)
        return buf, temperature, hidden

    def _after(self, lo: int, rows: list[_Row], buf: SamplerBuffers, temperature: torch.Tensor,
               hidden: torch.Tensor | None, gone: set[int]) -> None:
        """Sample, accept and renoise for rows = self.rows[lo : lo + len(rows)] after their forward (`_forward`'s
        results); adds to `gone` the indices of the rows that finished or failed."""
        n, C = len(rows), self.C
        try:
            sample, argmax, entropy = (t.view(n, C) for t in sample_step(buf, temperature, [r.gen for r in rows]))
        except Exception as e:  # noqa: BLE001 (the buffers hold these rows' results no more: they fail)
            for k, r in enumerate(rows):
                self._fail(r.ticket, e)
                gone.add(lo + k)
            return
        if buf.fused is not None:  # the head's buffers are overwritten next step; a row keeps its argmax (history)
            sample, argmax = sample.clone(), argmax.clone()
        aside = len(self.rows) > 1  # others to hold up: a held row's search goes to a helper thread
        for a, r in enumerate(rows):
            try:
                drawn = argmax if r.job.settings.greedy else sample
                logp = None
                if hidden is not None and r.on_device:  # the head made its class keys: its search reads those
                    step = (drawn[a : a + 1], argmax[a : a + 1], entropy[a : a + 1], None)
                    r.search(*step, keys=buf.fused.held.keys[:, a * C : (a + 1) * C])
                    self._settle(lo + a, r, step, gone, lambda a=a: self._log_probs(hidden[a : a + 1],
                                                                                    temperature[a * C]))
                    continue
                if r.constraint is not None:  # the step's log-probabilities, which its search reads
                    logp = buf.logits[a * C : (a + 1) * C] if hidden is None else \
                        self._log_probs(hidden[a : a + 1], temperature[a * C])
                step = (drawn[a : a + 1], argmax[a : a + 1], entropy[a : a + 1], logp)
                if r.constraint is not None and aside and not r.on_device:  # (on the device: its kernels queue)
                    if hidden is None:  # the buffer's rows are the next step's: the search reads its own copy
                        logp = logp.clone()
                    step = (step[0].clone(), step[1].clone(), step[2].clone(), logp)
                    r.settling = step
                    r.searching = self._searcher().submit(_in_inference_mode, r.search, *step)
                    continue
                r.search(*step)
                self._settle(lo + a, r, step, gone, lambda a=a: buf.logits[a * C : (a + 1) * C] if hidden is None
                             else self._log_probs(hidden[a : a + 1], temperature[a * C]))
            except Exception as e:  # noqa: BLE001 (this row's own failure)
                self._fail(r.ticket, e)
                gone.add(lo + a)
                if hidden is not None and r.on_device:  # class keys its programme may not have read
                    self._clear_held_keys(lo + a)

    def _settle(self, index: int, r: _Row, step: tuple, gone: set[int], log_probs: Callable[[], torch.Tensor]):
        """The rest of a row's step once its search has run (`_Row.settle`), and its canvas's end: adds `index` to
        `gone` when the row is done. log_probs: the step's log-probabilities, made where a row without a search
        asks for them (Job.logprobs)."""
        sample, argmax, entropy, logp = step
        undone = r.undone
        finished = r.settle(sample, argmax, entropy)
        self.discarded += r.undone - undone
        if not finished:
            return
        if r.job.logprobs is not None:  # the canvas's last step: its argmax is what the canvas keeps
            if logp is None:
                logp = log_probs()
            r.logprobs = token_logprobs(logp[: r.free], r.argmax[0, : r.free], r.job.logprobs)
        if r.finish_canvas():
            gone.add(index)
            self.completed += 1
            r.deliver(r.done_event())

    def _searcher(self):
        """The helper threads that held rows' searches run on (made at the first)."""
        if self.search_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self.search_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dgemma-search")
        return self.search_pool

    def _settle_searched(self) -> None:
        """Rows whose search has finished settle their step and step again (moved ahead of the rows still
        searching); with no row left to step, wait for the first search to finish."""
        searching = [r for r in self.rows if r.searching is not None]
        if not searching:
            return
        from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, wait

        if len(searching) == len(self.rows):
            wait([r.searching for r in searching], return_when=FIRST_COMPLETED)
        else:  # a search shorter than a fraction of a step is waited for: the row then misses no step
            wait([r.searching for r in searching], timeout=SEARCH_WAIT * self.step_seconds,
                 return_when=ALL_COMPLETED)
        gone: set[int] = set()
        for a, r in enumerate(self.rows):
            if r.searching is None or not r.searching.done():
                continue
            future, step = r.searching, r.settling
            r.searching = r.settling = None
            try:
                future.result()
                self._settle(a, r, step, gone, lambda: step[3])
            except Exception as e:  # noqa: BLE001 (this row's own failure)
                self._fail(r.ticket, e)
                gone.add(a)
        self._leave(gone)

    def _stepping_first(self) -> int:
        """Reorder the rows (and their buffers' self-conditioning) so that those not searching come first; returns
        how many they are. The rows searching keep their buffers apart from the step's (which writes the first)."""
        rows, C = self.rows, self.C
        i, j = 0, len(rows) - 1
        while True:
            while i < len(rows) and rows[i].searching is None:
                i += 1
            while j >= 0 and rows[j].searching is not None:
                j -= 1
            if i >= j:
                return i
            self.buf.swap_rows(i * C, j * C, C)
            rows[i], rows[j] = rows[j], rows[i]

    def _fail(self, ticket: Ticket, e: BaseException) -> None:
        """A request that cannot go on: one line on stderr (what the client's error does not say), RowFailed to it."""
        self.failed += 1
        _internal_error("a generation", e)
        _deliver(ticket, RowFailed(_describe(e)))

    def _note_batch_error(self, e: BaseException, rows: int) -> None:
        """A batched forward that failed where each of its rows ran alone: one line the first time it is seen."""
        said = _describe(e)
        if said not in self.batch_errors and len(self.batch_errors) < 64:
            self.batch_errors.add(said)
            _internal_error(f"a step of {rows} rows together (each ran alone instead)", e)

    def _reset_head(self) -> None:
        if self.buf.fused is not None:  # a head stopped midway leaves its chunk maxima set
            self.buf.fused.reset()
        self._clear_held_keys()  # and held rows' class keys that no programme read

    def _clear_held_keys(self, row: int | None = None) -> None:
        """The held rows' class keys back to KEY_MIN (all, or batch row `row`'s), where no programme read them."""
        if self._held_keys is None:
            return
        from quant.kernels.class_pass import KEY_MIN

        keys = self._held_keys if row is None else self._held_keys[:, row * self.C : (row + 1) * self.C]
        keys.fill_(KEY_MIN)


def token_logprobs(logp: torch.Tensor, tokens: torch.Tensor, k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per position of a canvas: (tokens' log-probability under logp [P, V], the k most likely [(id, logprob)]).
    Computed for a row that asked (Job.logprobs), once per canvas; two small host transfers."""
    chosen = logp.gather(1, tokens[:, None].to(logp.device))[:, 0].tolist()
    if k == 0:
        return [(c, []) for c in chosen]
    values, ids = logp.topk(k, dim=-1)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]


def _in_inference_mode(fn: Callable, *args) -> Any:
    """fn(*args) as the loop's own thread runs its work (a helper thread's mode is its own)."""
    with torch.inference_mode():
        return fn(*args)


def _internal_error(where: str, e: BaseException) -> None:
    """The one line an internal error writes on stderr (docs/serve.md): the client's error names no internals."""
    try:
        sys.stderr.write(f"dgemma: internal error in {where}: {_describe(e)}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # no stderr left (closed): the loop goes on
        pass


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__
