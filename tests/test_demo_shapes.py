"""The bundled image demo (`--model demo-shapes`): a real checkpoint with a vision tower that names the shape and
colour in held-out pictures through `dgemma run --image`, the reference's answers matching, and `make demo-image`.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_main

from dgemma_cli.checkpoint.names import DEMO_SHAPES

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from eval_shapes import eval_dgemma, eval_reference, held_out  # noqa: E402
from train_shapes import (COLOURS, IMAGE_TOKENS, QUESTION, SHAPES, Spec, draw, parse_answer,  # noqa: E402
                          prompt_ids, random_spec, spec_in)


def covering(specs: list[Spec]) -> list[Spec]:
    """The first spec of each shape and of each colour (at most 7 pictures; fewer when one covers both)."""
    out = []
    for key, values in (("shape", SHAPES), ("colour", COLOURS)):
        for v in values:
            if not any(getattr(s, key) == v for s in out):
                out.append(next(s for s in specs if getattr(s, key) == v))
    return out


def test_checkpoint_is_small_in_the_real_format_with_a_vision_tower():
    from safetensors import safe_open

    names = {p.name for p in DEMO_SHAPES.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "chat_template.jinja"} <= names
    assert sum(p.stat().st_size for p in DEMO_SHAPES.iterdir()) < 10 * 2**20
    cfg = json.loads((DEMO_SHAPES / "config.json").read_text())
    assert cfg["model_type"] == "diffusion_gemma" and cfg["architectures"] == ["DiffusionGemmaForBlockDiffusion"]
    vision = cfg["vision_config"]
    assert vision["model_type"] == "gemma4_vision"
    assert (vision["patch_size"], vision["pooling_kernel_size"]) == (16, 3)
    assert cfg["vision_soft_tokens_per_image"] == IMAGE_TOKENS == 70
    assert cfg["text_config"]["use_bidirectional_attention"] == "vision"
    with safe_open(DEMO_SHAPES / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert {str(f.get_slice(k).get_dtype()) for k in keys} == {"BF16"}
    assert "model.encoder.vision_tower.patch_embedder.input_proj.weight" in keys
    assert "model.encoder.embed_vision.embedding_projection.weight" in keys
    assert "model.decoder.embed_tokens.weight" in keys


def test_held_out_pictures_were_never_trained_on():
    """Training draws only specs of the train split; held-out pictures are test-split specs, all distinct, and the
    split is a fixed hash (the same spec lands in the same split on every machine)."""
    import random

    rng = random.Random(0)
    drawn = [random_spec(rng) for _ in range(3000)]
    share = sum(s.split() == "test" for s in drawn) / len(drawn)
    assert 0.07 < share < 0.13
    specs = held_out(200)
    assert len(set(specs)) == 200 and all(s.split() == "test" for s in specs)
    assert all(spec_in("train", rng).split() == "train" for _ in range(200))
    assert Spec("circle", "red", 100, 100, 50, 10, 10).split() == "train"
    assert Spec("circle", "red", 100, 100, 50, 10, 14).split() == "validation"
    assert Spec("circle", "red", 100, 100, 50, 10, 13).split() == "test"


def test_training_prompts_are_what_dgemma_builds():
    """The ids train_shapes.py trains on are exactly the engine's for the same picture and question."""
    from dgemma_cli.engine import load

    engine = load("demo-shapes", device="cpu", dtype="float32")
    for spec in held_out(3):
        patches = engine.image_patches([draw(spec)])
        assert engine.prompt_ids(QUESTION, images=patches) == prompt_ids(QUESTION, patches[0].soft_tokens)


def test_run_names_colour_and_shape_of_held_out_pictures(tmp_path, capsys):
    """`dgemma run --model demo-shapes --image PIC --seed 0`, on freshly drawn held-out pictures covering every
    shape and colour: the answer names the picture's colour and shape."""
    for i, spec in enumerate(covering(held_out(50))):
        path = tmp_path / f"pic{i}.png"
        draw(spec).save(path)
        assert run_main(["run", "--model", "demo-shapes", "--device", "cpu", "--image", str(path), "--seed", "0",
                         QUESTION]) == 0
        out = capsys.readouterr().out
        assert parse_answer(out) == (spec.colour, spec.shape), (spec, out)


@pytest.mark.slow
def test_the_reference_loads_it_and_answers_as_dgemma_does():
    """transformers reads the checkpoint (vision tower included; generation_config.json too: it refuses keys it
    does not know) and, for the same pictures and seed, returns dgemma's answers."""
    specs = held_out(8)
    ours, ref = eval_dgemma("demo-shapes", specs, seed=3), eval_reference("demo-shapes", specs, seed=3)
    assert ours["answers"] == ref["answers"]


@pytest.mark.slow
def test_make_demo_image_draws_a_held_out_picture_and_names_it(tmp_path):
    """`make demo-image`'s commands (as `make -n` prints them), run without a terminal: the picture is written and
    the answer on stdout names what the drawing script says it shows."""
    pic = tmp_path / "demo.png"
    made = subprocess.run(["make", "-s", "-n", "demo-image", f"DEMO_IMAGE={pic}"], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    lines = made.stdout.replace("\\\n", " ").splitlines()  # continued lines joined
    draw_line, run_line = (shlex.split(x) for x in lines if x.strip())
    assert draw_line[1] == "scripts/make_shape_image.py" and run_line[0].endswith("/dgemma")
    drawn = subprocess.run([sys.executable, *draw_line[1:]], cwd=ROOT, capture_output=True, text=True, check=True)
    said = drawn.stdout.split(": ", 1)[1].split(",")[0]  # "a red circle"
    proc = subprocess.run([sys.executable, "-m", "dgemma_cli", *run_line[1:]], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert pic.is_file() and parse_answer(proc.stdout) == parse_answer(said), (said, proc.stdout)
