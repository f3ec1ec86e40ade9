"""`dgemma bench` on the CPU at a tiny config, and (on CUDA only) the graphed denoise step against the eager one."""

import json

import pytest
import torch

from cli_helpers import run_main
from dgemma_cli.bench import TINY, random_model, step_bytes
from dgemma_cli.config import ModelConfig
from dgemma_cli.footprint import weight_bytes


@pytest.mark.parametrize("fmt,policy", [("bf16", "experts"), ("int8", "experts"), ("nvfp4", "all")])
def test_bench_reports_consistent_figures(capsys, fmt, policy):
    args = ["bench", "--config", "tiny", "--format", fmt, "--policy", policy, "--prompt", "20", "--steps", "5",
            "--device", "cpu", "--json"]
    assert run_main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ms_per_step"] > 0 and r["prefill_ms"] >= 0
    C = TINY["canvas_length"]
    assert r["tokens_per_s"] == pytest.approx(r["batch"] * C * 1000 / (r["ms_per_step"] * r["steps"]))
    assert r["floor_ms"] == pytest.approx(1000 * r["step_bytes"] / (r["bandwidth_gbs"] * 1e9))
    assert r["floor_ratio"] == pytest.approx(r["ms_per_step"] / r["floor_ms"])
    assert r["peak_memory_gb"] is None  # CPU


def test_step_bytes_counts_weights_embedding_twice_and_canvas_traffic():
    cfg = ModelConfig.from_dict(TINY)
    w = weight_bytes(cfg, "nvfp4", "experts")
    b1 = step_bytes(cfg, "nvfp4", "experts", batch=1, context=64)
    assert b1 > sum(w.values()) + w["embedding"]  # the embedding is read twice (LM head, self-conditioning)
    assert step_bytes(cfg, "nvfp4", "experts", batch=4, context=64) > b1


def test_random_model_keeps_packed_dtypes():
    cfg = ModelConfig.from_dict(TINY)
    m = random_model(cfg, "nvfp4", "all", torch.device("cpu"), torch.bfloat16)
    stack = m.layers[0].experts.gate_up_proj
    assert stack.weight.dtype == torch.uint8 and stack.weight_scale.dtype == torch.float8_e4m3fn
    assert stack.weight_scale_2.dtype == torch.float32
    assert m.embed_tokens.weight.dtype == torch.bfloat16 and m.layers[0].self_attn.q_proj.weight.dtype == torch.uint8
    assert torch.isfinite(m.layers[0].experts.weights(torch.float32)[0]).all()


def test_bench_usage_errors(capsys):
    for args in (["--format", "fp8"], ["--steps", "2"], ["--config", "nowhere"], ["--compare", "something-else"]):
        assert run_main(["bench", "--device", "cpu", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("dgemma: error:")


@pytest.mark.gpu
def test_graphed_denoise_step_equals_eager():
    from dgemma_cli.engine import GraphedDenoiser, ModelDenoiser

    cfg = ModelConfig.from_dict(TINY)
    model = random_model(cfg, "nvfp4", "experts", torch.device("cuda"), torch.bfloat16)
    V, C = cfg.text.vocab_size, cfg.canvas_length
    prompt = torch.randint(0, V, (2, 40), device="cuda")
    outs = []
    for cls in (ModelDenoiser, GraphedDenoiser):
        d = cls(model, 2, 40 + C)
        d.encode(prompt, None)
        d.start_canvas()
        out = torch.empty(2 * C, V, device="cuda")
        probs = torch.softmax(torch.randn(2 * C, V, device="cuda", generator=torch.Generator("cuda").manual_seed(0)), -1)
        logits = []
        for step in range(3):
            canvas = torch.randint(0, V, (2, C), device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            d.denoise(canvas, None if step == 0 else probs, out)
            logits.append(out.clone())
        outs.append(logits)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
