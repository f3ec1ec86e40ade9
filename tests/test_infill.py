"""Infill in the sampler: tokens held at the end of the canvas, a free middle in front of them."""

from dgemma_cli.engine import load
from dgemma_cli.sampler import CanvasDone, Done, Step


def test_held_suffix_tokens_never_change_during_denoising():
    engine = load("demo", device="cpu", dtype="float32")
    text = "abc def 12 ghijk"
    prefix, suffix = f"upper: {text}\nABC D", "EF 12 GHIJK\n"
    held = engine.tokenizer.encode(suffix)[:8]
    C = engine.config.canvas_length
    steps = 0
    for ev in engine.infill_events(prefix, suffix, seed=0, max_denoising_steps=12):
        if isinstance(ev, Step):
            steps += 1
            assert ev.canvas[0, C - len(held):].tolist() == held
            assert ev.argmax[0, C - len(held):].tolist() == held
            assert bool(ev.accepted[0, C - len(held):].all())
            assert float(ev.entropy[0, C - len(held):].abs().sum()) == 0.0
        elif isinstance(ev, CanvasDone):
            assert ev.tokens.shape[1] == C - len(held)  # only the free part is kept
        elif isinstance(ev, Done):
            middle = ev.token_ids[0]
    assert steps >= 1
    assert 0 not in middle and len(middle) < C - len(held)  # ended at <pad>, before the held suffix


def test_infill_without_a_suffix_is_plain_generation_of_raw_text():
    engine = load("demo", device="cpu", dtype="float32")
    text = "upper: hello diffusions\n"
    out = engine.infill(text, "", seed=0)
    ids = engine.generate([[engine.tokenizer.bos_id] + engine.tokenizer.encode(text)], seed=0).token_ids[0]
    assert out == engine.tokenizer.decode(ids)
