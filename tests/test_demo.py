"""The bundled demo model: a real DiffusionGemma checkpoint that means something.

Held-out accuracy through dgemma with the checkpoint's default sampler settings, the same checkpoint through
the reference implementation scoring within 2 points of it, and adaptive stopping firing.
"""

import json
import sys
from pathlib import Path

import pytest

from dgemma_cli.engine import DEMO_MODEL

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

N = 100


@pytest.fixture(scope="module")
def scores():
    from eval_demo import eval_dgemma, eval_reference, held_out

    texts = held_out(N)
    return eval_dgemma("demo", texts), eval_reference("demo", texts)


def test_demo_checkpoint_is_small_and_in_the_real_format():
    names = {p.name for p in DEMO_MODEL.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "chat_template.jinja"} <= names
    assert sum(p.stat().st_size for p in DEMO_MODEL.iterdir()) < 20 * 2**20
    cfg = json.loads((DEMO_MODEL / "config.json").read_text())
    assert cfg["model_type"] == "diffusion_gemma" and cfg["architectures"] == ["DiffusionGemmaForBlockDiffusion"]


def test_held_out_accuracy_and_reference_agreement(scores):
    ours, ref = scores
    assert ours["accuracy"] >= 0.95, ours
    assert abs(ours["accuracy"] - ref["accuracy"]) <= 0.02, (ours, ref)


def test_adaptive_stopping_fires(scores):
    ours, _ = scores
    assert ours["mean_steps_per_canvas"] < ours["max_steps"] / 4, ours
    assert ours["tokens_per_forward"] > 4, ours


def test_run_with_no_model_uses_the_demo(capsys):
    from dgemma_cli.cli import main

    try:
        main(["run", "upper: hello diffusions", "--seed", "0", "--device", "cpu"])
    except SystemExit as e:
        assert (e.code or 0) == 0
    captured = capsys.readouterr()
    assert captured.out == "HELLO DIFFUSIONS\n"
    assert "demo model" in captured.err


def test_the_demo_notice_says_what_the_demo_does(capsys):
    """`dgemma run "hello"` on the default model: the one-line notice says the demo only upper-cases and shows a
    prompt it answers, so an answer that is not English is explained."""
    from cli_helpers import run_main

    assert run_main(["run", "hello", "--seed", "0", "--device", "cpu", "--max-new-tokens", "4"]) == 0
    notice = [line for line in capsys.readouterr().err.splitlines() if "demo model" in line]
    assert len(notice) == 1, notice
    assert "upper-cases" in notice[0] and '"upper: ' in notice[0] and "--model" in notice[0], notice[0]
    example = notice[0].split('"')[1]  # the example it gives is one the demo answers
    assert run_main(["run", example, "--seed", "0", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == example[len("upper: "):].upper() + "\n"


def test_tokens_per_forward_counts_only_what_the_answer_keeps():
    from dgemma_cli.engine import load

    engine = load("demo", device="cpu", dtype="float32")
    r = engine.generate("upper: hello diffusions", seed=0, max_new_tokens=3)
    assert engine.tokenizer.decode(r.token_ids[0]) == "HEL"
    assert r.tokens_per_forward[0] == 3 / sum(r.steps_per_canvas[0])


def test_events_do_not_leave_inference_mode_on_in_the_caller():
    import torch

    from dgemma_cli.engine import load

    engine = load("demo", device="cpu", dtype="float32")
    events = engine.events("upper: hello diffusions", seed=0)
    next(events)
    assert not torch.is_inference_mode_enabled()
    x = torch.ones(2, requires_grad=True)
    assert (x * 2).requires_grad
    events.close()
