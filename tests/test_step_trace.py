"""dgemma_cli.step_trace: one real-shape denoise step traced on the meta device, as a CUDA device runs it.

The trace records Triton launches, which needs triton imported without TRITON_INTERPRET=1 (the tests set it): it
runs in a subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import json, sys
import torch
from dgemma_cli.step_trace import TorchOp, floor_of, trace_step
out = {}
for fmt, target in (("nvfp4", int(sys.argv[1])), ("w8a8-fp8", int(sys.argv[1])), ("nvfp4@120", 120),
                    ("gguf-q4_k_m@89", 89)):
    t = trace_step(batch=1, prompt=256, target=target, fmt=fmt.split("@")[0])
    f = floor_of(t)
    mms = [o for o in t.torch_ops if o.name == "aten::mm"]
    out[fmt] = dict(kernels=t.kernels, ops=len(t.ops), torch=len(t.torch_ops), launches=sorted({l.kernel for l in t.launches}),
                    n_launches=len(t.launches), names=sorted({o.name for o in t.torch_ops}),
                    mm_flops=sorted({o.flops for o in mms}), sdpa=sum(o.name == "sdpa" for o in t.torch_ops),
                    transient=t.transient_bytes, weights=t.persistent_bytes, vocab_f32=[list(s) for s in t.vocab_f32],
                    quantized=f.quantized_params, dense=f.dense_params, rows=f.rows,
                    negative=[o.name for o in t.torch_ops if o.read < 0 or o.written < 0 or o.persistent > o.read],
                    decoded=[l.named()["R"] for l in t.launches if l.kernel == "ggml_decode_kernel"],
                    eager=t.eager_kernels, outside=sorted({getattr(o, "name", "triton") for i, o in enumerate(t.ops)
                                                           if not t.graphed[0] <= i < t.graphed[1]}),
                    formats=sorted({(l.kernel, l.named().get("FORMAT"), l.named().get("KIND")) for l in t.launches
                                    if l.kernel.startswith(("moe_gate_up", "moe_down", "ggml", "head_"))}))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def traced():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", PROBE, "90"], env=env, capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


H, V, C, LAYERS = 2816, 262144, 256, 30


@pytest.mark.slow
def test_the_step_is_the_cuda_path(traced):
    nv = traced["nvfp4"]
    # NVFP4: the fused linears and experts (Triton), the fused head; attention as one kernel per layer
    assert set(nv["launches"]) >= {"nvfp4_linear_kernel", "moe_gate_up_kernel", "moe_down_kernel",
                                   "head_logits_kernel", "head_soft_kernel", "head_finish_kernel"}
    assert nv["sdpa"] == LAYERS
    assert nv["kernels"] == nv["ops"] == nv["torch"] + nv["n_launches"]
    assert not nv["negative"]
    # FP8 W8A8 (as on an H200): the linears on our W8A8 kernel, not torch's FP8 matmul; the fused W8A8 experts
    fp8 = traced["w8a8-fp8"]
    assert "aten::_scaled_mm" not in fp8["names"]
    assert {"w8a8_linear_kernel", "moe_gate_up_w8a8_kernel"} <= set(fp8["launches"])
    # W4A4 (an RTX 5090): FP4 activations, quantized by the norms and the quantizer kernel only where no norm
    # makes the input (the attention's output, the dense MLP's hidden activation, the experts')
    w4a4 = traced["nvfp4@120"]
    assert {"nvfp4_w4a4_kernel", "moe_gate_up_w4a4_kernel"} <= set(w4a4["launches"])
    # a GGUF Q4_K_M (as on an RTX 4090): every quantized matmul reads the file's blocks in its tiles, no matrix is
    # decoded whole (no 16-bit matmul of a projection; the one block decode is the canvas's C embedding rows): the
    # experts in FORMAT gguf with Q4_K gate-up and Q5_0 / Q8_0 down projections (llama.cpp's mix), the dense linears
    # on the GGUF linear kernel
    gguf = traced["gguf-q4_k_m@89"]
    assert gguf["decoded"] == [C] and "ggml_linear_kernel" in gguf["launches"]
    kinds = {(k, f, kind) for k, f, kind in map(tuple, gguf["formats"])}
    assert {("moe_gate_up_kernel", 2, 4), ("moe_down_kernel", 2, 1), ("moe_down_kernel", 2, 0)} <= kinds
    assert all(f == 2 for k, f, _ in kinds if k.startswith("moe"))
    assert 16e9 < gguf["weights"] < 16.8e9  # the file's 16.8 GB of blocks (its norms held in 16 bits)
    # the fused head reads the Q6_K embedding as its blocks (KINDS index 6), the logits and the soft embedding both
    assert {("head_logits_kernel", None, 6), ("head_soft_kernel", None, 6)} <= kinds
    assert gguf["mm_flops"] == [] and not gguf["negative"]  # self-conditioning too reads its blocks


@pytest.mark.slow
def test_at_most_640_kernels_a_step_on_every_path(traced):
    """The issue-36 budget: NVFP4 with 16-bit activations, W4A4, FP8 W8A8, a GGUF Q4_K_M; and what the sampler and the engine add
    to the forward pass is counted (the step's record for its event, the stop test and its copy to the host, the
    generator's seed and offset written before the replay)."""
    for fmt in ("nvfp4", "w8a8-fp8", "nvfp4@120", "gguf-q4_k_m@89"):
        assert traced[fmt]["kernels"] <= 640, (fmt, traced[fmt]["kernels"])
        assert {"aten::copy_", "aten::index_copy_", "aten::all", "aten::fill_"} <= set(traced[fmt]["names"])


@pytest.mark.slow
def test_the_kernels_outside_the_graph(traced):
    """The whole step is one graph (sampler.whole_step: its inputs, random draws, forward pass, the sampler's
    acceptance, renoising and stop test): what CUDA launches one by one around its replay is the generator's seed
    and offset (two fills) and the verdict's copy to the host, nothing else (the whole-step table charges each a
    launch)."""
    for fmt in ("nvfp4", "w8a8-fp8", "nvfp4@120", "gguf-q4_k_m@89"):
        t = traced[fmt]
        assert t["eager"] == 3 and t["outside"] == ["aten::copy_", "aten::fill_"], (fmt, t["eager"], t["outside"])


@pytest.mark.slow
def test_matmul_flops_and_the_floor(traced):
    nv = traced["nvfp4"]
    # the tied logits projection and the soft embedding are the fused head's (no canvas x vocab matmul in torch)
    assert all(f < 2 * C * H * V for f in nv["mm_flops"])
    assert {"head_logits_kernel", "head_soft_kernel"} <= set(nv["launches"])
    assert nv["rows"] == C
    # active per row: ~3.1 B quantized (attention, dense MLP, 8 of 128 experts), the 16-bit embedding twice (logits
    # and the soft embedding) and the small routers and self-conditioning MLP
    assert 3.0e9 < nv["quantized"] < 3.2e9
    assert 2 * V * H < nv["dense"] < 2 * V * H + 0.05e9
    assert 14e9 < nv["weights"] < 16e9  # NVFP4 weights and scales, the 16-bit embedding: every byte the step reads


@pytest.mark.slow
def test_transient_memory_and_the_vocab_tensor(traced):
    nv = traced["nvfp4"]
    # issue 21's budget: 64 MB a request beyond its KV cache; at least the fused head's probabilities chunk (bfloat16
    # [canvas, 32768]) and the MoE's padded activations are in it
    assert C * 32768 * 2 < nv["transient"] <= 64 * 2**20
    assert nv["vocab_f32"] == []  # no canvas x vocab float32 tensor anywhere in the step
    # the footprint model's count from the shapes agrees with the trace's (dgemma_cli/checkpoint/footprint.py request_bytes)
    from dgemma_cli.checkpoint import footprint
    from dgemma_cli.config import DIFFUSIONGEMMA_26B_A4B, ModelConfig

    cfg = ModelConfig.from_dict(DIFFUSIONGEMMA_26B_A4B)
    assert abs(footprint.request_bytes(cfg, splits=3) - nv["transient"]) <= 0.15 * nv["transient"]  # the H200's 3
    # what docs/serve.md says: --max-batch 8, NVFP4, an 8k context fit an RTX 4090's 24 GiB
    assert footprint.runtime_bytes(cfg, "nvfp4", context=8192, batch=8) < 24 * 2**30
