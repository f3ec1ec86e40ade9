"""The server's prompt cache (dgemma_cli/prefix_cache.py): a prompt that begins with one already encoded reuses its
keys and values, exactly; the server reports the reused tokens as OpenAI does (usage.prompt_tokens_details)."""

from __future__ import annotations

import time

import pytest
import torch

from dgemma_cli.batching import BatchLoop, Job, RowDone
from dgemma_cli.engine import load
from dgemma_cli.prefix_cache import PrefixCache


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
        r2 = client.chat.completions.create(model="demo", messages=msgs, seed=5)
        assert r1.usage.prompt_tokens_details.cached_tokens == 0
        assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens
        ids = engine.tokenizer.encode_chat(msgs)
        assert r2.choices[0].message.content == engine.generate(ids, seed=5).texts[0]
        assert s.health()["prefix_cache"]["hits"] == 1
    finally:
        assert s.stop() == 0
