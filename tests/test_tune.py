"""`dgemma tune` (dgemma_cli/tune.py): the objective trains the adapter, runs repeat and resume exactly, bad input
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
    import dgemma_cli.tune as tune_mod

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

    import dgemma_cli.tune as tune_mod

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
    from dgemma_cli.names import DEMO_MODEL
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
    from dgemma_cli.footprint import adapter_parameters, tune_bytes, weight_bytes

    cfg = ModelConfig.from_dict(DIFFUSIONGEMMA_26B_A4B)
    with_ck = tune_bytes(cfg, "nvfp4", 1, 512, 16)
    without = tune_bytes(cfg, "nvfp4", 1, 512, 16, checkpointing=False)
    assert with_ck["total"] < 24e9 < without["total"]
    assert with_ck["weights"] > sum(weight_bytes(cfg, "nvfp4").values())  # one layer's experts dequantized besides
    assert with_ck["adapter"] == 16 * adapter_parameters(cfg, 16)
