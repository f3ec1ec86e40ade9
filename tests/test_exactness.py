"""dgemma against the reference implementation on tiny random checkpoints in the real layout.

Logits of both modes agree to 1e-5 relative; generation gives exactly the reference's token ids for the
same seed (single prompts over several canvases with prompts longer than the sliding window, raw and chat
mode, left-padded batches, adaptive stopping).
"""

import json

import pytest
import torch

from cli_helpers import run_main
from dgemma_cli.engine import load
from dgemma_cli.checkpoint.weights import load_model

SHAPES = ["five_to_one", "alternating"]


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def ref_generate(ref, prompts, seed, **kw):
    """Reference generate (left-padded batch), cut each row before its first end-of-sequence id."""
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    extra = {"attention_mask": mask} if any(len(p) != T for p in prompts) else {}
    out = ref.generate(ids, **extra, **kw)
    eos = set(ref.generation_config.eos_token_id)
    rows = []
    for row in out.sequences[:, T:].tolist():
        cut = next((i for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[: min(cut, kw.get("max_new_tokens", 256))])
    return rows, out


def answer_tokens_per_forward(ref, out, T, steps_per_canvas):
    """The reference's tokens per forward pass as dgemma counts them: the answer's tokens only (the reference also
    counts the end-of-sequence id that ends a row)."""
    eos = set(ref.generation_config.eos_token_id)
    ended = [any(t in eos for t in row) for row in out.sequences[:, T:].tolist()]
    return [float(tpf) - e / sum(steps) for tpf, e, steps in zip(out.tokens_per_forward.tolist(), ended,
                                                                   steps_per_canvas)]


def random_prompt(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(107, vocab, (n,), generator=g).tolist()  # above the control tokens


@pytest.mark.parametrize("shape", SHAPES)
def test_encoder_and_decoder_logits_match(checkpoints, reference, shape):
    from transformers.cache_utils import DynamicCache

    path = checkpoints[shape]
    ref = reference(path)
    model, cfg = load_model(path, dtype=torch.float32)
    V, C, W = cfg.text.vocab_size, cfg.canvas_length, cfg.text.sliding_window
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (2, 3 * W + 1), generator=g)  # longer than the sliding window
    canvas = torch.randint(0, V, (2, C), generator=g)
    cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
    kv = model.new_cache(2, prompt.shape[1] + 2 * C)
    with torch.no_grad():
        for chunk in (prompt, canvas):  # prompt, then a finished canvas appended to the cache
            enc = ref.model.encoder(input_ids=chunk, cache=cache).last_hidden_state
            ref_logits = torch.tanh(ref.lm_head(enc).float() / 30) * 30
            ours = model.logits(model.encode(chunk, kv, return_hidden=True))
            assert rel_err(ours, ref_logits) < 1e-5
            ctx = model.denoise_context(kv, 2)
            first = ref(decoder_input_ids=canvas, cache=cache).logits
            assert rel_err(model.denoise(canvas, kv, ctx), first) < 1e-5
            sc = first / 0.6  # self-conditioning on processed logits
            second = ref(decoder_input_ids=canvas, cache=cache, self_conditioning_logits=sc).logits
            assert rel_err(model.denoise(canvas, kv, ctx, sc), second) < 1e-5
    assert kv.length == prompt.shape[1] + C


@pytest.mark.parametrize("shape", SHAPES)
def test_generate_matches_reference_over_several_canvases(checkpoints, reference, shape):
    path = checkpoints[shape]
    ref = reference(path)
    engine = load(path, device="cpu", dtype="float32")
    C, W, V = engine.config.canvas_length, engine.config.text.sliding_window, engine.config.text.vocab_size
    kw = dict(max_new_tokens=4 * C, max_denoising_steps=10)
    lengths_seen = set()
    for seed in range(3):
        prompt = random_prompt(2 * W + 5 + seed, V, seed)
        expected, _ = ref_generate(ref, [prompt], seed, **kw)
        ours = engine.generate([prompt], seed=seed, **kw)
        assert ours.token_ids == expected
        lengths_seen.add(len(ours.token_ids[0]))
        assert len(ours.steps_per_canvas[0]) >= 1
    assert max(lengths_seen) > C  # at least one run went past the first canvas


def test_batch_of_prompts_matches_reference(checkpoints, reference):
    path = checkpoints["five_to_one"]
    ref = reference(path)
    engine = load(path, device="cpu", dtype="float32")
    V, C = engine.config.text.vocab_size, engine.config.canvas_length
    prompts = [random_prompt(n, V, 10 + n) for n in (21, 6, 13)]  # different lengths: left padding
    kw = dict(max_new_tokens=3 * C, max_denoising_steps=8)
    expected, out = ref_generate(ref, prompts, 5, **kw)
    ours = engine.generate(prompts, seed=5, **kw)
    assert ours.token_ids == expected
    T = max(map(len, prompts))
    assert ours.tokens_per_forward == pytest.approx(answer_tokens_per_forward(ref, out, T, ours.steps_per_canvas),
                                                    rel=1e-6, abs=1e-6)  # the reference's is float32


def test_adaptive_stopping_matches_reference(checkpoints, reference):
    path = checkpoints["confident"]
    ref = reference(path)
    engine = load(path, device="cpu", dtype="float32")
    V, C = engine.config.text.vocab_size, engine.config.canvas_length
    for seed in range(2):
        prompt = random_prompt(20, V, seed)
        expected, out = ref_generate(ref, [prompt], seed, max_new_tokens=2 * C)
        ours = engine.generate([prompt], seed=seed, max_new_tokens=2 * C)
        assert ours.token_ids == expected
        assert max(ours.steps_per_canvas[0]) < engine.settings.max_denoising_steps  # stopped early
        expected_tpf = answer_tokens_per_forward(ref, out, len(prompt), ours.steps_per_canvas)
        assert ours.tokens_per_forward[0] == pytest.approx(expected_tpf[0], rel=1e-6, abs=1e-6)


def test_stop_test_read_a_step_late_changes_nothing(checkpoints, reference, monkeypatch):
    """The stop test read one step late (sampler.LaggedStop, what a CUDA device runs: no device-to-host wait in a
    step) against reading it at once and against the reference, with adaptive stopping and a batch: the same
    tokens, the same events step by step, the same counts; the step queued after a canvas converged is run and
    discarded, at most one a canvas, and the random draws go on as if it had not run (the next canvas, and the
    generator after the run)."""
    import dgemma_cli.engine as engine_mod
    from dgemma_cli.sampler import CanvasDone, Done, Step, generate_events

    path = checkpoints["confident"]
    ref = reference(path)
    engine = load(path, device="cpu", dtype="float32")
    V, C = engine.config.text.vocab_size, engine.config.canvas_length
    prompts = [random_prompt(20, V, 3), random_prompt(11, V, 4)]

    def run(lagged: bool, **kw) -> tuple[list, list, torch.Tensor]:
        forwards = []

        def patched(denoiser, *a, **k):
            real = denoiser.denoise
            denoiser.denoise = lambda *x, **y: forwards.append(1) or real(*x, **y)
            return generate_events(denoiser, *a, **k, lagged_stop=lagged)

        monkeypatch.setattr(engine_mod, "generate_events", patched)
        events = list(engine.events(prompts, seed=7, max_new_tokens=2 * C, **kw))
        return events, forwards, torch.get_rng_state()

    # no end-of-sequence id the model can write: both canvases run, each stopping early
    for kw in ({}, {"eos_token_ids": (V + 1,)}):
        (at_once, n_once, rng_once), (late, n_late, rng_late) = run(False, **kw), run(True, **kw)
        assert [type(e) for e in at_once] == [type(e) for e in late]
        for a, b in zip(at_once, late):
            if isinstance(a, Step):
                assert (a.canvas_index, a.step) == (b.canvas_index, b.step)
                assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("canvas", "argmax", "accepted",
                                                                                  "entropy", "finished"))
            elif isinstance(a, CanvasDone):
                assert torch.equal(a.tokens, b.tokens) and a.steps == b.steps and a.kept == b.kept
            elif isinstance(a, Done):
                assert (a.token_ids, a.steps_per_canvas, a.tokens_per_forward, a.forward_passes) == (
                    b.token_ids, b.steps_per_canvas, b.tokens_per_forward, b.forward_passes)
        assert torch.equal(rng_once, rng_late)
        done = at_once[-1]
        canvases = sum(isinstance(e, CanvasDone) for e in at_once)
        assert canvases == (2 if kw else 1)
        assert max(max(s) for s in done.steps_per_canvas) < engine.settings.max_denoising_steps  # stopped early
        assert len(n_once) == done.forward_passes
        assert len(n_once) < len(n_late) <= len(n_once) + canvases  # the discarded steps
        if not kw:
            expected, _ = ref_generate(ref, prompts, 7, max_new_tokens=2 * C)
            assert late[-1].token_ids == expected


@pytest.mark.parametrize("raw", [True, False])
def test_cli_run_matches_reference(checkpoints, reference, capsys, raw):
    from dgemma_cli.tokenizer import Tokenizer

    path = checkpoints["five_to_one"]
    ref = reference(path)
    tok = Tokenizer.from_dir(path)
    text = "Write a function that adds two numbers, then explain it line by line."
    ids = tok.encode(text) if raw else tok.encode_chat([{"role": "user", "content": text}])
    W = json.loads((path / "config.json").read_text())["text_config"]["sliding_window"]
    assert len(ids) > W
    C = 16
    expected, _ = ref_generate(ref, [ids], 11, max_new_tokens=3 * C, max_denoising_steps=12)
    args = ["run", text, "--model", str(path), "--seed", "11", "--max-new-tokens", str(3 * C),
            "--steps", "12", "--json", "--device", "cpu", "--dtype", "float32"] + (["--raw"] if raw else [])
    assert run_main(args) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["prompt_token_ids"] == ids
    assert obj["token_ids"] == expected[0]
    for key in ("text", "canvases", "tokens_per_forward", "seconds"):
        assert key in obj
