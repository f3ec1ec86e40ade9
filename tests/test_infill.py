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
            last = ev.tokens[0].tolist()
        elif isinstance(ev, Done):
            middle = ev.token_ids[0]
    assert steps >= 1
    assert len(middle) < C - len(held)
    assert last[len(middle)] == engine.tokenizer.pad_id  # the middle ended at <pad>, before the held suffix


def test_infill_without_a_suffix_is_plain_generation_of_raw_text():
    engine = load("demo", device="cpu", dtype="float32")
    text = "upper: hello diffusions\n"
    out = engine.infill(text, "", seed=0)
    ids = engine.generate([[engine.tokenizer.bos_id] + engine.tokenizer.encode(text)], seed=0).token_ids[0]
    assert out == engine.tokenizer.decode(ids)


def test_a_hole_longer_than_a_canvas_continues_over_several_canvases(checkpoints):
    engine = load(checkpoints["five_to_one"], device="cpu", dtype="float32")
    C = engine.config.canvas_length
    kept = []
    for ev in engine.infill_events("def add(a, b):\n", "\nprint(add(1, 2))\n", seed=3, held_tokens=4,
                                   max_new_tokens=3 * C, max_denoising_steps=4, eos_token_ids=(1,),
                                   pad_token_id=-1):  # random weights: no end token, so every canvas is used
        if isinstance(ev, CanvasDone):
            kept.append(ev.tokens.shape[1])
        elif isinstance(ev, Done):
            middle = ev.token_ids[0]
    assert kept == [C - 4] * len(kept) and len(kept) >= 2
    assert len(middle) == sum(kept)


def test_a_prefix_longer_than_the_context_keeps_its_end(checkpoints):
    from dgemma_cli.cli.fim import DEFAULT_MARKER, fill_holes, marker_holes

    engine = load(checkpoints["short_context"], device="cpu", dtype="float32")  # 64 positions
    text = "word " * 200 + DEFAULT_MARKER + " tail text here and more\n"
    notes = []
    out = fill_holes(engine, text, marker_holes(text, DEFAULT_MARKER, "f"), name="f", warn=notes.append,
                     seed=0, max_new_tokens=16, max_denoising_steps=2)
    assert len(notes) == 1 and "kept the last" in notes[0]
    assert out.startswith("word " * 200) and out.endswith(" tail text here and more\n")
