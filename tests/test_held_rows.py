"""A row held to a structure beside free rows in the server's batch loop (dgemma_cli/server/batching.py): its search
runs on a helper thread while the others step, so a slow search holds up no one, and every row's answer is still the
one it gets alone."""

from __future__ import annotations

import json
import threading
import time

import pytest

from dgemma_cli.server.batching import BatchLoop, Job, RowCanvas, RowDone, RowFailed
from dgemma_cli.structured.constrain import Structure, compile_structure

SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 6}}, "required": ["a"]}


@pytest.fixture(scope="module")
def engine():
    from dgemma_cli.engine import load

    return load("demo", device="cpu")


class Slow:
    """An automaton whose rows' searches each take `delay` seconds longer (a search at the real vocabulary)."""

    def __init__(self, auto, delay: float):
        self.auto, self.delay = auto, delay
        self.searches = 0

    def row(self, *args, **kw):
        row = self.auto.row(*args, **kw)
        step = row.step

        def slow_step(*a, **k):
            time.sleep(self.delay)
            self.searches += 1
            return step(*a, **k)

        row.step = slow_step
        return row


def run(engine, jobs: list[Job], max_batch: int = 4) -> tuple[list[list], list[float], BatchLoop]:
    """Submit the jobs at once; returns each one's events, the seconds each took, and the loop."""
    loop = BatchLoop(engine.model, max_batch=max_batch)
    events: list[list] = [[] for _ in jobs]
    took: list[float] = [0.0] * len(jobs)
    done = [threading.Event() for _ in jobs]
    t0 = time.perf_counter()

    def deliver(k):
        def f(ev):
            events[k].append(ev)
            if isinstance(ev, (RowDone, RowFailed)):
                took[k] = time.perf_counter() - t0
                done[k].set()
        return f

    for k, job in enumerate(jobs):
        loop.submit(job, deliver(k))
    for d in done:
        assert d.wait(120)
    loop.close()
    return events, took, loop


def job(engine, seed: int, automaton=None) -> Job:
    settings = engine.settings.override(max_new_tokens=32, max_denoising_steps=6)
    prompt = engine.tokenizer.encode_text("upper: json")
    return Job(prompt, settings, seed, engine.check_context(len(prompt), settings, held=0), automaton=automaton)


def tokens(events) -> list[list[int]]:
    return [e.tokens for e in events if isinstance(e, RowCanvas)] + [e.token_ids for e in events if isinstance(e, RowDone)]


def test_a_slow_search_holds_up_no_free_row_and_changes_no_answer(engine):
    auto = compile_structure(Structure("json_schema", json.dumps(SCHEMA)), engine.tokenizer,
                             engine.config.text.vocab_size)
    alone_held, _, _ = run(engine, [job(engine, 7, auto)])
    alone_free, free_alone_took, _ = run(engine, [job(engine, 3)])
    slow = Slow(auto, delay=0.4)
    events, took, loop = run(engine, [job(engine, 7, slow), job(engine, 3)])
    assert isinstance(events[0][-1], RowDone) and isinstance(events[1][-1], RowDone)
    assert events[0][-1].satisfied
    assert tokens(events[0]) == tokens(alone_held[0]) and tokens(events[1]) == tokens(alone_free[0])
    # the free row's steps went on while the held row searched: it finished long before the held row's searches
    # could have run one after another between its steps
    assert slow.searches >= 4
    assert took[1] < free_alone_took[0] + 0.5 * slow.searches * slow.delay, (took, slow.searches)
    assert took[1] < took[0]
