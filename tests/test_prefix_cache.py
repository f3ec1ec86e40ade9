"""The server's prompt cache (dgemma_cli/server/prefix_cache.py): a prompt that begins with one already encoded reuses its
keys and values, exactly; the server reports the reused tokens as OpenAI does (usage.prompt_tokens_details)."""

from __future__ import annotations

import time

import pytest
import torch

from dgemma_cli.server.batching import BatchLoop, Job, RowDone
from dgemma_cli.engine import load
from dgemma_cli.server.prefix_cache import PrefixCache


def _run(loop: BatchLoop, job: Job) -> RowDone:
    got = []
    loop.submit(job, got.append)
    end = time.monotonic() + 120
    while not any(isinstance(e, RowDone) for e in got):
        assert time.monotonic() < end and not any(type(e).__name__ == "RowFailed" for e in got), got
        time.sleep(0.01)
    return next(e for e in got if isinstance(e, RowDone))


def test_lookup_takes_the_longest_prefix_and_evicts_the_oldest():
    engine = load("demo", device="cpu")
    model = engine.model
    sliding = [s.is_sliding for s in model.cfg.text.layers]
    caches = {}
    pc = PrefixCache(10**9, sliding)
    for ids in ([2, 5, 6], [2, 5, 6, 7, 8], [2, 9]):
        cache = model.new_cache(1, 64)
        model.encode(torch.tensor([ids]), cache)
        pc.store(ids, cache)
        caches[tuple(ids)] = cache
    assert pc.lookup([2, 5, 6, 7, 8, 9]).ids == (2, 5, 6, 7, 8)
    assert pc.lookup([2, 5, 6, 7]).ids == (2, 5, 6)
    assert pc.lookup([2, 5]) is None and pc.lookup([3, 5, 6]) is None
    assert pc.lookup([2, 5, 6, 7], space=1) is None  # another adapter's prompts: keys and values differ
    one = pc.entries[(0, (2, 9))].nbytes
    small = PrefixCache(2 * one + 1, sliding)  # room for two entries of this size
    for ids in ([2, 5, 6], [2, 9], [2, 8]):
        small.store(ids, caches.get(tuple(ids)) or caches[(2, 9)])
    assert list(small.entries) == [(0, (2, 9)), (0, (2, 8))] and small.bytes <= small.max_bytes


@pytest.mark.slow
def test_a_resent_conversation_answers_as_encoded_whole(checkpoints):
    """A random checkpoint whose sliding window (8) is shorter than the prompts: turn 2 reuses turn 1's prompt,
    and its tokens equal a loop without the cache; the restored cache equals the whole prompt's encoding."""
    engine = load(str(checkpoints["five_to_one"]), device="cpu")
    model, tok = engine.model, engine.tokenizer
    turn1 = tok.encode_chat([{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}])
    turn2 = tok.encode_chat([{"role": "user", "content": "The quick brown fox jumps over the lazy dog."},
                             {"role": "assistant", "content": "A diffusion model."},
                             {"role": "user", "content": "Why is the sky blue?"}])
    assert turn2[: len(turn1)] == turn1 and len(turn1) > 8
    settings = engine.settings.override(max_new_tokens=32, max_denoising_steps=6)
    cap = engine.check_context(len(turn2), settings)
    with_cache = BatchLoop(model, max_batch=2, prefix_cache_bytes=2**26)
    plain = BatchLoop(model, max_batch=2)
    try:
        first = _run(with_cache, Job(turn1, settings, 1, cap))
        assert first.cached_tokens == 0
        second = _run(with_cache, Job(turn2, settings, 7, cap))
        alone = _run(plain, Job(turn2, settings, 7, cap))
        assert second.cached_tokens == len(turn1) and alone.cached_tokens == 0
        assert second.token_ids == alone.token_ids
    finally:
        with_cache.close()
        plain.close()
    # the restored state is the whole prompt's, layer by layer (sliding windows included)
    whole = model.new_cache(1, cap)
    model.encode(torch.tensor([turn2]), whole)
    pc = PrefixCache(2**26, [s.is_sliding for s in model.cfg.text.layers])
    part = model.new_cache(1, cap)
    model.encode(torch.tensor([turn1]), part)
    pc.store(turn1, part)
    resumed = model.new_cache(1, cap)
    pc.restore(pc.lookup(turn2), resumed)
    model.encode(torch.tensor([turn2[len(turn1):]]), resumed)
    assert resumed.length == whole.length
    for a, b in zip(resumed.k + resumed.v, whole.k + whole.v):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.slow
def test_server_reports_cached_tokens(tmp_path):
    from test_serve import ServerProcess

    engine = load("demo", device="cpu", dtype="float32")
    s = ServerProcess(tmp_path)
    try:
        client = s.client()
        msgs = [{"role": "user", "content": "upper: hello diffusions"}]
        r1 = client.chat.completions.create(model="demo", messages=msgs, seed=0)
        msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": "upper: abc def 12 ghijk"}]
        r2 = client.chat.completions.create(model="demo", messages=msgs, seed=5, max_tokens=32)  # engine's default
        assert r1.usage.prompt_tokens_details.cached_tokens == 0
        assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens
        ids = engine.tokenizer.encode_chat(msgs)
        assert r2.choices[0].message.content == engine.generate(ids, seed=5).texts[0]
        assert s.health()["prefix_cache"]["hits"] == 1
    finally:
        assert s.stop() == 0


def _stored(pc: PrefixCache, model, prompts) -> None:
    for ids in prompts:
        cache = model.new_cache(1, 64)
        model.encode(torch.tensor([ids]), cache)
        pc.store(ids, cache)


def test_the_least_recently_used_entry_goes_first():
    """Over budget, the entry out is the one least recently used: a conversation that keeps coming back keeps its
    entry however long ago it was first stored; one stored once and never used again goes."""
    model = load("demo", device="cpu").model
    sliding = [s.is_sliding for s in model.cfg.text.layers]
    probe = PrefixCache(10**9, sliding)
    _stored(probe, model, [[2, 9, 9]])
    size = probe.bytes  # every prompt below has 3 tokens: entries of one size
    pc = PrefixCache(2 * size, sliding)  # room for two
    _stored(pc, model, [[2, 5, 6], [2, 7, 8]])
    assert pc.lookup([2, 5, 6, 1, 1]).ids == (2, 5, 6)  # the older one is used again...
    _stored(pc, model, [[2, 3, 4]])  # ...so the newer, unused one goes
    assert pc.lookup([2, 5, 6, 1]) is not None and pc.lookup([2, 7, 8, 1]) is None
    assert pc.lookup([2, 3, 4, 1]) is not None and pc.bytes <= pc.max_bytes
    _stored(pc, model, [[2, 1, 1]])  # now [2, 5, 6] was used before [2, 3, 4]: it goes
    assert pc.lookup([2, 5, 6]) is None and pc.lookup([2, 3, 4]) is not None and pc.lookup([2, 1, 1]) is not None


def test_an_exact_resend_reuses_the_whole_prompt():
    """A prompt sent again as it was (a client retrying, or regenerating with another seed) is a hit on all of its
    tokens, and answers as a loop without the cache does."""
    engine = load("demo", device="cpu")
    ids = engine.prompt_ids("upper: hello diffusions")
    pc = PrefixCache(10**9, [s.is_sliding for s in engine.model.cfg.text.layers])
    _stored(pc, engine.model, [ids])
    assert pc.lookup(list(ids)).ids == tuple(ids)
    settings = engine.settings
    cap = engine.check_context(len(ids), settings)
    cached, plain = BatchLoop(engine.model, max_batch=1, prefix_cache_bytes=2**24), BatchLoop(engine.model, max_batch=1)
    try:
        first = _run(cached, Job(ids, settings, 3, cap))
        again = _run(cached, Job(ids, settings, 4, cap))
        alone = _run(plain, Job(ids, settings, 4, cap))
    finally:
        cached.close()
        plain.close()
    assert first.cached_tokens == 0 and again.cached_tokens == len(ids) and cached.prefixes.hits == 1
    assert again.token_ids == alone.token_ids and engine.tokenizer.decode(again.token_ids) == "HELLO DIFFUSIONS"


def test_prompts_with_pictures_are_neither_stored_nor_served():
    """Two pictures of the same size give the same prompt ids (the image tokens are placeholders): a prompt with a
    picture is never stored, so the second picture's answer is about it, as a loop without the cache gives it, and
    not about the first picture."""
    import dataclasses
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from eval_shapes import held_out
    from train_shapes import QUESTION, draw, parse_answer

    engine = load("demo-shapes", device="cpu", dtype="float32")
    first = held_out(1)[0]
    other = next(s for s in ("circle", "square", "triangle") if s != first.shape)
    specs = [first, dataclasses.replace(first, shape=other)]
    prompts = []
    for spec in specs:
        patches = engine.image_patches([draw(spec)])
        prompts.append((engine.prompt_ids(QUESTION, images=patches), engine.image_features(patches)))
    assert prompts[0][0] == prompts[1][0]
    ids = prompts[0][0]
    settings = engine.settings
    cap = engine.check_context(len(ids), settings)
    cached, plain = BatchLoop(engine.model, max_batch=1, prefix_cache_bytes=2**26), BatchLoop(engine.model, max_batch=1)
    try:
        got = [_run(cached, Job(ids, settings, 0, cap, image_features=f)) for _, f in prompts]
        alone = _run(plain, Job(ids, settings, 0, cap, image_features=prompts[1][1]))
        text = _run(cached, Job(ids[:5], settings, 0, engine.check_context(5, settings)))  # text is still stored
    finally:
        cached.close()
        plain.close()
    assert [r.cached_tokens for r in got] == [0, 0] and text.cached_tokens == 0
    assert list(cached.prefixes.entries) == [(0, tuple(ids[:5]))]
    assert got[1].token_ids == alone.token_ids
    answers = [parse_answer(engine.tokenizer.decode(r.token_ids)) for r in got]
    assert answers == [(s.colour, s.shape) for s in specs], answers
