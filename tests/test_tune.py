"""`dgemma tune` (dgemma_cli/tuner/tune.py): the objective trains the adapter, runs repeat and resume exactly, bad input
stops before any training with one line, a failed checkpoint keeps the previous one, and the result loads in peft."""

import json

import pytest
import torch

from cli_helpers import run_main

UPPER = [{"prompt": f"upper: {w}", "completion": w.upper()} for w in
         ("hello diffusions", "abc def 12 ghijk", "the quick brown ", "lorem ipsum dolo", "tiny models lear",
          "canvas sharpenss", "one two three fo", "zebra yak xerus ")]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def tune_args(data, out, *extra):
    return ["tune", str(data), "--out", str(out), "--steps", "4", "--batch-size", "4", "--rank", "4",
            "--eval-every", "2", "--checkpoint-every", "2", "--held-out", "2", "--eval-examples", "2",
            "--eval-steps", "4", "--lr", "0.01", "--warmup", "1", "--device", "cpu", "--model", "demo", *extra]


def adapter_tensors(out):
    from safetensors.torch import load_file

    return load_file(str(out / "adapter_model.safetensors"))


def test_tune_trains_repeats_and_resumes_exactly(tmp_path, capsys, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", UPPER)
    assert run_main(tune_args(data, tmp_path / "a")) == 0
    err = capsys.readouterr().err
    assert "memory (estimate):" in err and "step 2: loss" in err and "held-out loss" in err and "step 4:" in err
    a = adapter_tensors(tmp_path / "a")
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in a.items())  # B left zero: trained
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4
    # the same seed: the same adapter, bit for bit
    assert run_main(tune_args(data, tmp_path / "b")) == 0
    b = adapter_tensors(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # stopped after its first checkpoint (Ctrl-C at step 3), then run again: it resumes and ends equal
    import dgemma_cli.tuner.tune as tune_mod

    real = tune_mod.Tuner.train_step

    def stop_at_3(self):
        if self.step == 2:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(tune_mod.Tuner, "train_step", stop_at_3)
    assert run_main(tune_args(data, tmp_path / "c")) == 130
    monkeypatch.setattr(tune_mod.Tuner, "train_step", real)
    capsys.readouterr()
    assert run_main(tune_args(data, tmp_path / "c")) == 0
    assert "resuming" in capsys.readouterr().err
    c = adapter_tensors(tmp_path / "c")
    assert all(torch.equal(a[k], c[k]) for k in a)
    # another base (or other settings) over that state: refused in one line, naming what differs
    assert run_main(tune_args(data, tmp_path / "c", "--rank", "8")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another rank" in err[0]
    assert run_main(tune_args(data, tmp_path / "c", "--model", "demo-sudoku")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another base ('demo', now 'demo-sudoku')" in err[0], err


def test_an_out_holding_another_adapter_is_refused_unless_restart(tmp_path, capsys):
    """An --out that holds files but no stopped tune (an adapter another run made) is refused in one line, before
    anything loads, and nothing in it is touched; --restart writes the adapter there, an empty directory is written
    into, and a directory a tune left resumes."""
    data = write_jsonl(tmp_path / "d.jsonl", UPPER)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes(b"an adapter tuned for days")
    (out / "adapter_config.json").write_text("{}")
    (out / "README.md").write_text("notes")
    kept = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
    capsys.readouterr()
    assert run_main(tune_args(data, out)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and f"--out {out}" in err, err
    assert "README.md, adapter_config.json, adapter_model.safetensors" in err and "--restart" in err, err
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == kept  # no .tune either
    assert run_main(tune_args(data, out, "--steps", "1", "--restart")) == 0
    assert adapter_tensors(out) and (out / "README.md").read_text() == "notes"
    capsys.readouterr()
    assert run_main(tune_args(data, out, "--steps", "2")) == 0  # its own state now: resumed, not refused
    assert "resuming" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_main(tune_args(data, empty, "--steps", "1")) == 0 and adapter_tensors(empty)


def test_bad_jsonl_lines_are_named_and_nothing_is_trained(tmp_path, capsys):
    cases = {"not json": (["{oops"], ":2: not JSON"),
             "no answer": ([{"prompt": "x"}], ':2: "completion" must be a string'),
             "unknown shape": ([{"text": "x"}], ":2: expected"),
             "messages": ([{"messages": [{"role": "user", "content": "hi"}]}], ":2: \"messages\" must list"),
             "fim too long": ([{"prefix": "a", "middle": "x" * 40, "suffix": "b"}], ":2: \"middle\" is 40 tokens")}
    for name, (rows, words) in cases.items():
        data = write_jsonl(tmp_path / f"{name}.jsonl", [UPPER[0], *rows, UPPER[1]])
        out = tmp_path / name
        assert run_main(tune_args(data, out)) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0] and "Traceback" not in err[0], (name, err)
        assert not out.exists(), name  # nothing written: the file was read whole before training
    assert run_main(tune_args(tmp_path / "missing.jsonl", tmp_path / "m")) == 2
    assert "no such file" in capsys.readouterr().err


def test_rank_above_a_layer_is_one_line(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", UPPER)
    assert run_main([*tune_args(data, tmp_path / "a"), "--rank", "100000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "above" in err[0] and "size" in err[0]


def test_a_full_disk_while_checkpointing_keeps_the_previous_state(tmp_path, capsys, monkeypatch):
    import errno

    import dgemma_cli.tuner.tune as tune_mod

    data = write_jsonl(tmp_path / "d.jsonl", UPPER)
    real = torch.save
    calls = []

    def full_disk(obj, f, *a, **kw):
        calls.append(1)
        if len(calls) == 2:  # the second checkpoint: the disk is full midway
            f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(tune_mod.torch, "save", full_disk)
    out = tmp_path / "a"
    assert run_main(tune_args(data, out)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "No space left on device" in err[-1] and "step 2 is kept" in err[-1]
    state = tune_mod.load_state(out)
    assert state["step"] == 2  # the first checkpoint, whole
    assert sorted(p.name for p in (out / ".tune").iterdir()) == ["state.pt"]  # no partial file left
    monkeypatch.setattr(tune_mod.torch, "save", real)
    assert run_main(tune_args(data, out)) == 0  # and the run resumes from it
    assert "resuming" in capsys.readouterr().err


def test_a_tuned_adapter_gives_the_same_tokens_in_peft(tmp_path, capsys):
    from peft import PeftModel
    from transformers import DiffusionGemmaForBlockDiffusion

    from dgemma_cli.engine import load
    from dgemma_cli.checkpoint.names import DEMO_MODEL
    from test_exactness import ref_generate

    data = write_jsonl(tmp_path / "d.jsonl", UPPER)
    out = tmp_path / "a"
    assert run_main([*tune_args(data, out), "--targets", "attention,mlp,self_conditioning",
                     "--expert-rank", "2"]) == 0
    engine = load("demo", device="cpu", dtype="float32", adapters=[(out, 1.0)])
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "upper: hello diffusions"}])
    ours = engine.generate([ids], seed=2).token_ids
    ref = PeftModel.from_pretrained(DiffusionGemmaForBlockDiffusion.from_pretrained(DEMO_MODEL, dtype="float32"),
                                    out).eval()
    with torch.no_grad():
        expected, _ = ref_generate(ref.base_model.model, [ids], 2, max_new_tokens=engine.settings.max_new_tokens,
                                   max_denoising_steps=engine.settings.max_denoising_steps)
    assert ours == expected


@pytest.mark.parametrize("shape", ["messages", "fim"])
def test_every_data_shape_trains(tmp_path, capsys, shape):
    rows = [{"messages": [{"role": "system", "content": "be loud"}, {"role": "user", "content": r["prompt"]},
                          {"role": "assistant", "content": r["completion"]}]} if shape == "messages" else
            {"prefix": r["prompt"] + "\n", "middle": r["completion"][:6], "suffix": r["completion"][6:] + "\n"}
            for r in UPPER]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    assert run_main(tune_args(data, tmp_path / "a")) == 0
    assert "step 4:" in capsys.readouterr().err


def test_gradient_checkpointing_gives_the_same_adapter(tmp_path, capsys):
    """Recomputing each feed-forward stage in the backward pass (the default) changes memory, not the result: the
    adapter is bit for bit the one a run without it makes (experts adapted too: the recomputation runs in its pass)."""
    data = write_jsonl(tmp_path / "d.jsonl", UPPER)
    extra = ("--targets", "attention,mlp,self_conditioning", "--expert-rank", "2")
    assert run_main([*tune_args(data, tmp_path / "a"), *extra]) == 0
    assert run_main([*tune_args(data, tmp_path / "b"), *extra, "--no-gradient-checkpointing"]) == 0
    a, b = adapter_tensors(tmp_path / "a"), adapter_tensors(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_26b_nvfp4_estimate_fits_a_24_gb_card_at_batch_1():
    """The footprint model's count for tuning the real 26B-A4B in NVFP4 (docs/adapters.md quotes it): a rank-16
    adapter on attention and the dense MLP, batch 1, 512 tokens of prompt, fits 24 GB with gradient checkpointing
    and not without (every layer's dequantized experts kept for the backward pass)."""
    from dgemma_cli.config import DIFFUSIONGEMMA_26B_A4B, ModelConfig
    from dgemma_cli.checkpoint.footprint import adapter_parameters, tune_bytes, weight_bytes

    cfg = ModelConfig.from_dict(DIFFUSIONGEMMA_26B_A4B)
    with_ck = tune_bytes(cfg, "nvfp4", 1, 512, 16)
    without = tune_bytes(cfg, "nvfp4", 1, 512, 16, checkpointing=False)
    assert with_ck["total"] < 24e9 < without["total"]
    assert with_ck["weights"] > sum(weight_bytes(cfg, "nvfp4").values())  # one layer's experts dequantized besides
    assert with_ck["adapter"] == 16 * adapter_parameters(cfg, 16)


# ------------------------------------------------------------------------------------------ the objective's effects

WORDS = ("alpha", "bravo", "delta", "gamma", "kilo", "lima", "mike", "oscar", "papa", "romeo", "sierra", "tango",
         "victor", "xray", "yankee", "zulu", "echo", "golf", "hotel", "india", "juliet", "quebec", "whisky", "foxtrot")


def _demo():
    from dgemma_cli.engine import load

    return load("demo", device="cpu", dtype="float32")


def _chat_example(tok, prompt: str, answer: str):
    from dgemma_cli.tuner.tune import Example

    prompt_ids = tok.encode_chat([{"role": "user", "content": prompt}])
    return Example(prompt_ids, tok.encode_text(answer) + [tok.end_of_turn_id], text=answer)


def _ok_examples(tok, n: int, seed: int = 0):
    """`ok: <two words>` -> `OK`: a reply the upper-casing demo never gives (it answers `OK: ...`)."""
    import random

    rng = random.Random(seed)
    seen, out = set(), []
    while len(out) < n:
        words = " ".join(rng.sample(WORDS, 2))[:16]
        if words not in seen:
            seen.add(words)
            out.append(_chat_example(tok, f"ok: {words}", "OK"))
    return out


def _settings(**kw):
    from dgemma_cli.tuner.tune import TuneSettings

    base = {"rank": 4, "alpha": 8, "steps": 4, "batch_size": 4, "lr": 0.01, "warmup": 1, "held_out": 0,
            "eval_every": 10**6, "eval_examples": 4, "checkpoint_every": 10**6, "max_denoising_steps": 4}
    return TuneSettings(**{**base, **kw})


def test_the_loss_is_scored_against_the_clean_canvas(monkeypatch):
    """The objective: the decoder, given a noised canvas, is scored on predicting the clean one. A predictor that
    answers the clean canvas scores (nearly) zero; one that copies back its noised input does not."""
    from dgemma_cli.tuner.tune import batch_of, diffusion_loss

    engine = _demo()
    model = engine.model
    examples = _ok_examples(engine.tokenizer, 8)
    prompt, valid, clean, held = batch_of(examples, model.cfg.canvas_length, 0, __import__("random").Random(0))
    V = model.cfg.text.vocab_size

    def one_hot(ids):
        return torch.nn.functional.one_hot(ids, V).float() * 50.0

    for name, predict in (("clean", lambda noisy: one_hot(clean)), ("copy", one_hot)):
        monkeypatch.setattr(model, "denoise", lambda canvas, *a, predict=predict, **kw: predict(canvas))
        losses = [float(diffusion_loss(model, prompt, valid, clean, held, torch.Generator().manual_seed(s), sc))
                  for s, sc in ((0, False), (1, True))]
        if name == "clean":
            assert max(losses) < 1e-6, losses
        else:
            assert min(losses) > 1.0, losses  # t ~ U(0, 1): about half the positions noised on average


def test_held_positions_are_never_noised(tmp_path, monkeypatch):
    """Fill in the middle: the suffix's tokens held at the canvas's end reach the decoder as they are in every
    training and evaluation forward (only the middle is noised), and the middle is noised."""
    import dgemma_cli.tuner.tune as tune_mod
    from dgemma_cli.tuner.tune import Example, Tuner

    engine = _demo()
    tok = engine.tokenizer
    examples = [Example([tok.bos_id] + tok.encode_text(f"upper: {w} "), tok.encode_text(w.upper()[:4]),
                        tok.encode_text(w.upper()[4:] + " end")[:8], text=w.upper()[:4]) for w in WORDS[:12]]
    batches, seen = [], []
    real_batch_of = tune_mod.batch_of
    monkeypatch.setattr(tune_mod, "batch_of", lambda *a, **kw: batches.append(real_batch_of(*a, **kw)) or batches[-1])
    real_denoise = engine.model.denoise

    def denoise(canvas, *a, **kw):
        seen.append((len(batches), canvas.clone()))
        return real_denoise(canvas, *a, **kw)

    monkeypatch.setattr(engine.model, "denoise", denoise)
    tuner = Tuner(engine, examples, tmp_path, _settings(steps=4), "demo", held=examples[:4])
    for _ in range(4):
        tuner.train_step()
    tuner.evaluate(0.0)
    assert len(seen) >= 8
    noised = 0
    for k, canvas in seen:
        _, _, clean, held = batches[k - 1]
        assert held.any(dim=1).all()  # every row holds its suffix's tokens
        assert torch.equal(canvas[held], clean[held]), "a held position was noised"
        noised += int((canvas[~held] != clean[~held]).sum())
    assert noised > 0


def test_the_learning_rate_warms_up_then_decays_by_cosine_to_zero(tmp_path, monkeypatch):
    """--lr is the peak: the rate the optimiser steps with rises linearly over --warmup steps, then follows a cosine
    down to zero at the last step (docs/adapters.md)."""
    import math

    import dgemma_cli.tuner.tune as tune_mod
    from dgemma_cli.tuner.tune import Tuner

    monkeypatch.setattr(tune_mod, "diffusion_loss", lambda *a, **kw: torch.zeros((), requires_grad=True))  # no forward
    engine = _demo()
    steps, warmup, peak = 12, 3, 0.02
    tuner = Tuner(engine, _ok_examples(engine.tokenizer, 6), tmp_path, _settings(steps=steps, warmup=warmup, lr=peak,
                                                                                 batch_size=1), "demo")
    lrs = []
    tuner.opt.register_step_pre_hook(lambda opt, args, kwargs: lrs.append(opt.param_groups[0]["lr"]))
    tuner.run()
    assert len(lrs) == steps
    want = [peak * min(1, k / warmup) * 0.5 * (1 + math.cos(math.pi * k / steps)) for k in range(1, steps + 1)]
    assert lrs == pytest.approx(want, abs=1e-9)
    assert lrs[0] < lrs[1] < lrs[2] and all(lrs[k] > lrs[k + 1] for k in range(2, steps - 1))  # up, then down
    assert lrs[-1] < 1e-9 and lrs[steps // 2 + 1] < 0.5 * peak


def test_held_out_examples_are_never_trained_on(tmp_path, monkeypatch):
    """--held-out N: N examples (a fifth of the data at most) kept apart by seed; no training batch ever holds one
    (the batches draw from all the others), and the held-out loss is computed on them alone."""
    import dgemma_cli.tuner.tune as tune_mod
    from dgemma_cli.tuner.tune import Tuner

    engine = _demo()
    examples = _ok_examples(engine.tokenizer, 40)

    def key(ex):
        return tuple(ex.prompt)  # every example's prompt differs

    assert len({key(ex) for ex in examples}) == 40
    phase, used = ["train"], {"train": [], "eval": []}
    real_batch_of = tune_mod.batch_of

    def batch_of(exs, *a, **kw):
        used[phase[0]] += [key(ex) for ex in exs]
        return real_batch_of(exs, *a, **kw)

    monkeypatch.setattr(tune_mod, "batch_of", batch_of)
    tuner = Tuner(engine, examples, tmp_path, _settings(steps=10, batch_size=8, held_out=8, eval_examples=2,
                                                        max_denoising_steps=2), "demo")
    held = {key(ex) for ex in tuner.held}
    train = {key(ex) for ex in tuner.train}
    assert len(held) == 8 and not held & train and held | train == {key(ex) for ex in examples}
    with monkeypatch.context() as m:  # the batches drawn are the point here, not the forward
        m.setattr(tune_mod, "diffusion_loss", lambda *a, **kw: torch.zeros((), requires_grad=True))
        for _ in range(10):
            tuner.train_step()
    phase[0] = "eval"
    tuner.evaluate(0.0)
    assert len(used["train"]) == 80 and not set(used["train"]) & held
    assert len(set(used["train"])) > 20  # the draws range over the training examples
    assert set(used["eval"]) == held
    # asked for more than a fifth of the data: a fifth
    assert len(Tuner(_demo(), examples, tmp_path / "b", _settings(held_out=30), "demo").held) == 8


def test_the_exact_answer_rate_counts_the_answers_generated(tmp_path):
    """The exact-answer rate is the share of held-out examples whose generated answer is theirs: before any
    training (the adapter starts as the base), the demo upper-cases the two `upper:` examples and cannot answer the
    two `ok:` ones, so the rate is one half."""
    from dgemma_cli.tuner.tune import Tuner

    engine = _demo()
    tok = engine.tokenizer
    held = [_chat_example(tok, f"upper: {w}", w.upper()) for w in ("hello diffusions", "abc def 12 ghijk")]
    held += _ok_examples(tok, 2)
    tuner = Tuner(engine, _ok_examples(tok, 4, seed=1), tmp_path, _settings(eval_examples=4), "demo", held=held)
    ev = tuner.evaluate(0.0)
    assert ev.exact == 0.5 and ev.held_loss > 0
    tuner.s.eval_examples = 2  # the first two alone: both right
    assert tuner.evaluate(0.0).exact == 1.0


@pytest.mark.slow
def test_tuning_teaches_the_demo_a_reply_it_never_gives(tmp_path):
    """The objective's effect: the upper-casing demo answers `ok: <words>` with `OK: <WORDS>`, never `OK`. 80 steps
    of tuning on 64 such examples (about 15 s on one core) make it answer `OK` to held-out prompts it never saw:
    the held-out loss falls by far and the exact-answer rate rises from none to most."""
    from dgemma_cli.tuner.tune import Tuner

    engine = _demo()
    examples = _ok_examples(engine.tokenizer, 80)
    settings = _settings(rank=8, alpha=16, steps=80, batch_size=8, lr=0.01, warmup=5, eval_every=80,
                         eval_examples=16, max_denoising_steps=8)
    tuner = Tuner(engine, examples[:64], tmp_path, settings, "demo", held=examples[64:])
    before = tuner.evaluate(0.0)
    assert before.exact == 0.0
    history = tuner.run()
    after = history[-1]
    assert after.step == 80
    assert after.held_loss < before.held_loss / 10, (before, after)
    assert after.exact >= 0.75, (before, after)
    res = engine.generate([ex.prompt for ex in examples[64:68]], seed=1, max_new_tokens=8)
    assert sum(t == "OK" for t in res.texts) >= 3, res.texts  # another seed, the model's own steps


def test_held_out_says_what_it_keeps_and_is_not_taken_with_eval(tmp_path, capsys):
    """--held-out N beyond a fifth of DATA holds out a fifth: said in one line. --eval FILE brings the held-out
    examples, so --held-out with it is refused in one line before anything loads, not ignored."""
    data = write_jsonl(tmp_path / "d.jsonl", UPPER)  # 8 examples: a fifth is 1
    held = write_jsonl(tmp_path / "e.jsonl", UPPER[:2])
    assert run_main(tune_args(data, tmp_path / "a", "--steps", "1", "--held-out", "5")) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "--held-out 5" in line]
    assert len(said) == 1 and "1 of DATA's 8 examples" in said[0] and "a fifth" in said[0], err
    assert run_main(tune_args(data, tmp_path / "b", "--eval", str(held))) == 2  # tune_args has --held-out 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--held-out" in err[0] and "--eval" in err[0], err
    assert not (tmp_path / "b").exists()
    args = tune_args(data, tmp_path / "c", "--steps", "1", "--eval", str(held))
    i = args.index("--held-out")
    assert run_main(args[:i] + args[i + 2:]) == 0
    err = capsys.readouterr().err
    assert "8 training examples, 2 held out" in err and "--held-out" not in err, err
