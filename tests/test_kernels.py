"""Triton kernels against the PyTorch reference on dequantized weights, over awkward shapes.

On this CPU they run in Triton's interpreter (conftest sets TRITON_INTERPRET=1 when there is no CUDA device), at
small sizes; on a CUDA machine the same tests compile and run the real kernels. Tolerances: float32 inputs differ
from the reference only by summation order (relative 1e-5); bfloat16 products are exact, so the rounded outputs
match to one bfloat16 step at most.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from quant import int8, nvfp4  # noqa: E402
from quant.kernels import use_triton  # noqa: E402
from quant.modules import Int8Stack, NVFP4Stack, fused_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = (1, 17, 33, 255, 256)
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    monkeypatch.setenv("DGEMMA_KERNELS", "triton")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_linear_kernels_match_reference(rows, dtype):
    from quant.kernels.int8_linear import int8_linear
    from quant.kernels.nvfp4_linear import nvfp4_linear

    g = torch.Generator().manual_seed(rows)
    N, K = 80, 96  # N not a multiple of the 64-wide tile, K not of the 64-deep one
    w = torch.randn(N, K, generator=g)
    x = torch.randn(rows, K, generator=g).to(dtype).to(DEVICE)
    q = nvfp4.quantize(w, search=True)
    ref = x @ nvfp4.dequantize(q, dtype).to(DEVICE).T
    got = nvfp4_linear(x, q.weight.to(DEVICE), q.weight_scale.to(DEVICE), q.weight_scale_2.expand(N).to(DEVICE))
    assert got.dtype == dtype and got.shape == (rows, N)
    assert rel(got, ref) <= TOL[dtype]
    qi = int8.quantize(w)
    ref = x @ int8.dequantize(qi, dtype).to(DEVICE).T
    got = int8_linear(x, qi.weight.to(DEVICE), qi.weight_scale.to(DEVICE))
    assert rel(got, ref) <= TOL[dtype]


def build_stacks(fmt: str, E: int, H: int, I: int, g: torch.Generator):
    """Quantized expert stacks and their dequantized float32 weights (gate/up with separate global scales)."""
    gu_w, dn_w = torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1
    if fmt == "nvfp4":
        gu, dn = NVFP4Stack(E, 2 * I, H, segments=2), NVFP4Stack(E, H, I)
        for e in range(E):
            for j in range(2):
                q = nvfp4.quantize(gu_w[e, j * I:(j + 1) * I], search=True)
                sl = slice(j * I, (j + 1) * I)
                gu.weight[e, sl], gu.weight_scale[e, sl], gu.weight_scale_2[e, j] = (
                    q.weight, q.weight_scale, q.weight_scale_2)
            q = nvfp4.quantize(dn_w[e])
            dn.weight[e], dn.weight_scale[e], dn.weight_scale_2[e, 0] = q.weight, q.weight_scale, q.weight_scale_2
    else:
        gu, dn = Int8Stack(E, 2 * I, H), Int8Stack(E, H, I)
        for e in range(E):
            q = int8.quantize(gu_w[e])
            gu.weight[e], gu.weight_scale[e] = q.weight, q.weight_scale
            q = int8.quantize(dn_w[e])
            dn.weight[e], dn.weight_scale[e] = q.weight, q.weight_scale
    return gu.to(DEVICE), dn.to(DEVICE)


def reference_experts(gu, dn, x, index, weights):
    from dgemma_cli.model import Experts

    E, two_i, H = gu.shape
    ref = Experts.__new__(Experts)
    torch.nn.Module.__init__(ref)
    ref.num_experts = E
    ref.gate_up_proj = torch.nn.Parameter(gu.dequantize(x.dtype), requires_grad=False)
    ref.down_proj = torch.nn.Parameter(dn.dequantize(x.dtype), requires_grad=False)
    return Experts.forward(ref, x, index, weights)


LOADS = {
    "uniform": lambda T, E, K, g: torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]),
    "one_hot_expert": lambda T, E, K, g: torch.stack([torch.tensor([0] + [1 + i for i in range(K - 1)])] * T),
    "empty_experts": lambda T, E, K, g: torch.stack([torch.randperm(E // 2, generator=g)[:K] for _ in range(T)]),
}


# every row count with a uniform load; the skewed loads at the small counts (interpreter time)
MOE_CASES = [(t, "uniform") for t in ROWS] + [(t, load) for t in ROWS if t <= 33 for load in LOADS if load != "uniform"]


@pytest.mark.parametrize("fmt", ["nvfp4", "int8"])
@pytest.mark.parametrize("tokens,load", MOE_CASES)
def test_fused_moe_matches_reference(fmt, tokens, load):
    g = torch.Generator().manual_seed(tokens)
    E, H, I, K = 6, 64, 48, 2  # I not a multiple of the 64-wide tile
    gu, dn = build_stacks(fmt, E, H, I, g)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(tokens, H, generator=g).to(dtype).to(DEVICE)
        index = LOADS[load](tokens, E, K, g).to(DEVICE)
        weights = torch.rand(tokens, K, generator=g).to(DEVICE)
        got = fused_experts(gu, dn, x, index, weights)
        ref = reference_experts(gu, dn, x, index, weights)
        assert got is not None and got.dtype == dtype and got.shape == (tokens, H)
        assert rel(got, ref) <= TOL[dtype], (dtype, rel(got, ref))


@pytest.mark.parametrize("fmt", ["nvfp4", "int8"])
def test_fused_moe_masked_tiles(fmt):
    """Hidden 48 and width 80: partial K tiles in both kernels (32-deep tiles, 16 left over)."""
    g = torch.Generator().manual_seed(5)
    E, H, I, K = 5, 48, 80, 3
    gu, dn = build_stacks(fmt, E, H, I, g)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(17, H, generator=g).to(dtype).to(DEVICE)
        index = LOADS["uniform"](17, E, K, g).to(DEVICE)
        weights = torch.rand(17, K, generator=g).to(DEVICE)
        got = fused_experts(gu, dn, x, index, weights)
        assert rel(got, reference_experts(gu, dn, x, index, weights)) <= TOL[dtype]


def test_block_plan_covers_every_assignment_once():
    from quant.kernels.routing import moe_blocks

    g = torch.Generator().manual_seed(0)
    index = torch.randint(0, 5, (37, 3), generator=g)
    ids, block_expert = moe_blocks(index, 7, 16)  # experts 5 and 6 get nothing
    live = ids[ids >= 0]
    assert sorted(live.tolist()) == list(range(37 * 3))
    flat = index.reshape(-1)
    for b, e in enumerate(block_expert.tolist()):
        rows = ids[b * 16:(b + 1) * 16]
        rows = rows[rows >= 0]
        if e >= 7:
            assert rows.numel() == 0
        else:
            assert (flat[rows.long()] == e).all()


def test_sampler_epilogue_statistics_and_distribution():
    from quant.kernels.sampler_epilogue import sampler_epilogue

    g = torch.Generator().manual_seed(0)
    R, V = 6, 1000  # V not a power of two
    logits = (torch.randn(R, V, generator=g) * 3).to(DEVICE)
    t = torch.tensor(0.7, device=DEVICE)
    z = logits / t
    buf = logits.clone()
    sample, argmax, entropy = sampler_epilogue(buf, t, torch.tensor([5], device=DEVICE))
    p = torch.softmax(z, -1)
    assert (buf - p).abs().max() < 1e-6  # probabilities left in place of the logits
    assert torch.equal(argmax, z.argmax(-1))
    assert (entropy - (-(p * torch.log_softmax(z, -1)).sum(-1))).abs().max() < 1e-4
    assert ((sample >= 0) & (sample < V)).all()
    # the sample follows softmax(z): 400 rows (independent draws) over 4 outcomes, each within 4 standard errors
    n = 300
    small = torch.tensor([[0.0, 1.0, 2.0, -1.0]] * n, device=DEVICE)
    s, _, _ = sampler_epilogue(small.clone(), torch.tensor(1.0, device=DEVICE), torch.tensor([7], device=DEVICE))
    freq = torch.bincount(s.cpu(), minlength=4) / n
    q = torch.softmax(small[0].cpu(), -1)
    assert ((freq - q).abs() <= 4 * (q * (1 - q) / n).sqrt()).all()
    again, _, _ = sampler_epilogue(logits.clone(), t, torch.tensor([5], device=DEVICE))
    assert torch.equal(sample, again)  # the same seed draws the same samples


def test_switch_semantics(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")
    assert not use_triton(cpu)
    monkeypatch.setenv("DGEMMA_KERNELS", "auto")
    assert not use_triton(cpu)  # auto: Triton on CUDA only
    monkeypatch.setenv("DGEMMA_KERNELS", "bogus")
    with pytest.raises(ValueError):
        use_triton(cpu)
    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if DEVICE == "cpu":
        with pytest.raises(RuntimeError):
            use_triton(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))


@pytest.mark.slow
@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the Triton path also samples with its own random stream")
@pytest.mark.parametrize("fmt", ["nvfp4", "int8"])
def test_triton_and_torch_give_the_same_tokens(checkpoints, tmp_path, monkeypatch, fmt):
    from dgemma_cli.engine import load
    from dgemma_cli.quantize import quantize_checkpoint

    out = tmp_path / fmt
    quantize_checkpoint(checkpoints["five_to_one"], out, fmt, "all")
    engine = load(out, device=DEVICE, dtype="float32")
    prompts = [[2, 200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211], [2, 300, 301, 302]]
    kw = dict(raw=True, max_new_tokens=16, max_denoising_steps=3, seed=5)
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")
    reference = engine.generate(prompts, **kw).token_ids
    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    assert engine.generate(prompts, **kw).token_ids == reference
