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
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    monkeypatch.setenv("DGEMMA_KERNELS", "triton")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", ROWS)
def test_linear_kernels_match_reference(rows, dtype):
    from quant.kernels.int8_linear import int8_linear
    from quant.kernels.nvfp4_linear import nvfp4_linear

    g = torch.Generator().manual_seed(rows)
    N, K = 80, 96  # N not a multiple of the 64-wide tile (a masked one); K = 96 runs as three whole 32-deep tiles
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 70])
def test_gated_nvfp4_linear_matches_the_three_ops(rows, dtype):
    """The dense MLP's first half in one kernel: gelu_tanh(x W_gate^T) * (x W_up^T), each product and the
    activation rounded to the compute dtype as the torch ops round them; and the module's entry point."""
    import torch.nn.functional as F

    from quant.kernels.nvfp4_linear import nvfp4_linear
    from quant.modules import NVFP4Linear

    g = torch.Generator().manual_seed(rows)
    N, K = 80, 96
    qg, qu = (nvfp4.quantize(torch.randn(N, K, generator=g), search=True) for _ in range(2))
    x = torch.randn(rows, K, generator=g).to(dtype).to(DEVICE)
    gate = x @ nvfp4.dequantize(qg, dtype).to(DEVICE).T
    up = x @ nvfp4.dequantize(qu, dtype).to(DEVICE).T
    ref = F.gelu(gate, approximate="tanh") * up
    got = nvfp4_linear(x, qg.weight.to(DEVICE), qg.weight_scale.to(DEVICE), qg.weight_scale_2.expand(N).to(DEVICE),
                       up=(qu.weight.to(DEVICE), qu.weight_scale.to(DEVICE), qu.weight_scale_2.expand(N).to(DEVICE)))
    assert got.dtype == dtype and got.shape == (rows, N)
    assert rel(got, ref) <= TOL[dtype]
    mg, mu = NVFP4Linear.from_weight(qg).to(DEVICE), NVFP4Linear.from_weight(qu).to(DEVICE)
    assert torch.equal(mg.gated(x, mu), got)
    assert mg.gated(x, torch.nn.Linear(K, N)) is None  # not two NVFP4 linears: the caller's three ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_linear_split_over_k_gives_the_unsplit_result(dtype):
    """K split over 2, 3 or 4 programs a tile (the last to finish adds their float32 sums in the programs' order and
    finishes the tile; 4 ways over 5 steps leaves one program no steps), over masked rows and columns, with and
    without adapters: the unsplit launch's values to one rounding (float32: the sums' order), the reference's
    within the kernels' tolerance, the same bits on a second launch (the counters are back at 0 after each)."""
    from quant import kernels
    from quant.kernels.lora import LinearAdapters, LinearFactors
    from quant.kernels.nvfp4_linear import nvfp4_linear

    g = torch.Generator().manual_seed(7)
    N, K, rows = 80, 320, 33  # 5 steps of 64 inputs
    q = nvfp4.quantize(torch.randn(N, K, generator=g), search=True)
    operands = (q.weight.to(DEVICE), q.weight_scale.to(DEVICE), q.weight_scale_2.expand(N).to(DEVICE))
    x = torch.randn(rows, K, generator=g).to(dtype).to(DEVICE)
    ref = x @ nvfp4.dequantize(q, dtype).to(DEVICE).T
    one = nvfp4_linear(x, *operands, splits=1)
    for splits in (2, 3, 4):
        got = nvfp4_linear(x, *operands, splits=splits)
        assert not kernels._counters[("nvfp4_linear", x.device)].any()
        assert torch.equal(nvfp4_linear(x, *operands, splits=splits), got)
        assert rel(got, one) <= (1e-6 if dtype == torch.float32 else 4e-3), splits
        assert rel(got, ref) <= TOL[dtype]
    lora = LinearAdapters(LinearFactors(*lora_stack(None, N, K, dtype, g)), None)
    plain = nvfp4_linear(x, *operands, lora=lora, splits=1)
    assert rel(plain, one) > 1e-2  # the adapters' terms matter
    assert rel(nvfp4_linear(x, *operands, lora=lora, splits=3), plain) <= (1e-6 if dtype == torch.float32 else 4e-3)
    with pytest.raises(ValueError, match="splits"):
        nvfp4_linear(x, *operands, up=operands, splits=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_matches_emulation(dtype):
    """The on-the-fly NVFP4 quantization of activations (W4A4) gives the same codes, e4m3 scale bits and per-token
    global scales as quant/nvfp4.quantize row by row: over twelve decades (subnormal e4m3 scales included), an
    all-zero block, and a row length that leaves a partial 256-wide chunk."""
    from quant.kernels.nvfp4_act import quantize_act, quantize_act_reference

    g = torch.Generator().manual_seed(1)
    for M, K in ((3, 48), (5, 272)):
        x = (torch.randn(M, K, generator=g) * torch.logspace(-9, 3, K)).to(dtype)
        x[0, :16] = 0
        x[1, 5] = -x[1].abs().max() * 2  # a negative maximum
        got = quantize_act(x.to(DEVICE))
        ref = quantize_act_reference(x)
        for a, b in zip(got, ref):
            assert torch.equal(a.cpu(), b)
        assert (ref[1] < 8).any()  # a subnormal e4m3 scale was exercised


def test_activation_quantization_with_a_static_scale_matches_emulation():
    """With a checkpoint's calibrated scale (ModelOpt's input_scale) every row takes that global scale; rows whose
    blocks exceed what it allows saturate (block scale 448, codes 6) exactly as nvfp4.quantize does with the same
    scale_2, and a scale larger than needed leaves small values on subnormal block scales, also code for code."""
    from quant.kernels.nvfp4_act import quantize_act, quantize_act_reference

    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 80, generator=g) * torch.tensor([1.0, 10.0, 100.0, 1e-3])[:, None]
    for saturates, scale in ((True, x[1].abs().max() / 2688), (False, x.abs().max() / 2688 * 4)):
        scale = scale.reshape(1)
        got = quantize_act(x.to(DEVICE), global_scale=scale.to(DEVICE))
        ref = quantize_act_reference(x, scale)
        for a, b in zip(got, ref):
            assert torch.equal(a.cpu(), b)
        assert torch.equal(got[2].cpu(), scale.expand(4))  # every row reports the static scale
        row2 = nvfp4.dequantize_packed(ref[0][2:3], ref[1][2:3].view(torch.float8_e4m3fn), torch.ones(1))
        assert bool(row2.abs().max() == 6 * 448) is saturates  # row 2 (100x row 1) clipped at the largest value


@pytest.mark.parametrize("rows", [1, 17, pytest.param(130, marks=pytest.mark.slow)])
def test_w4a4_matches_emulation(rows):
    """FP4 x FP4 (W4A4) against the PyTorch emulation of the same quantization: float32 to summation order,
    bfloat16 to one rounding of the output; N not a multiple of the 128-wide tile."""
    from quant.kernels.nvfp4_w4a4 import nvfp4_w4a4, reference

    g = torch.Generator().manual_seed(rows)
    N, K = 80, 96
    q = nvfp4.quantize(torch.randn(N, K, generator=g), search=True)
    args = (q.weight, q.weight_scale, q.weight_scale_2.expand(N))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, K, generator=g).to(dtype)
        got = nvfp4_w4a4(x.to(DEVICE), *(a.to(DEVICE) for a in args))
        assert got.dtype == dtype and got.shape == (rows, N)
        assert rel(got.cpu(), reference(x, *args)) <= TOL[dtype]
        # with a calibrated input scale (half the batch's amax: the largest blocks saturate)
        static = (x.float().abs().max() / 2688 / 2).reshape(1)
        got = nvfp4_w4a4(x.to(DEVICE), *(a.to(DEVICE) for a in args), static.to(DEVICE))
        want = reference(x, *args, static)
        assert rel(got.cpu(), want) <= TOL[dtype]
        assert rows == 1 or rel(want, reference(x, *args)) > TOL[dtype]  # the scale changed the result


def test_w4a4_is_chosen_on_fp4_gpus_only(monkeypatch):
    """NVFP4 linears take W4A4 on sm_100 and sm_120, 16-bit activations elsewhere, and DGEMMA_W4A4=0 turns it off."""
    import quant.kernels as kernels
    from quant.modules import w4a4

    cpu = torch.device("cpu")
    for cc, expected in ((80, False), (89, False), (90, False), (100, True), (120, True)):
        monkeypatch.setattr(kernels, "arch", lambda device, cc=cc: cc)
        assert w4a4(cpu) is expected
    monkeypatch.setenv("DGEMMA_W4A4", "0")
    assert not w4a4(cpu)


@pytest.mark.parametrize("tokens,load", [(1, "uniform"), pytest.param(17, "uniform", marks=pytest.mark.slow),
                                         (33, "one_hot_expert"),
                                         pytest.param(33, "empty_experts", marks=pytest.mark.slow)])
def test_w4a4_experts_match_emulation(tokens, load, monkeypatch):
    """The routed experts in W4A4 (as fused_experts runs them on an RTX 50: arch 120) against their PyTorch
    emulation (moe_w4a4.reference): float32 to summation order, bfloat16 to a rounding or two of the outputs."""
    import quant.kernels as kernels
    from quant.kernels.moe_w4a4 import reference

    monkeypatch.setattr(kernels, "arch", lambda device: 120)
    g = torch.Generator().manual_seed(tokens)
    E, H, I, K = 6, 64, 64, 2  # W4A4 takes widths that are multiples of 64
    gu, dn = build_stacks("nvfp4", E, H, I, g)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(tokens, H, generator=g).to(dtype)
        index = LOADS[load](tokens, E, K, g)
        weights = torch.rand(tokens, K, generator=g)
        got = fused_experts(gu, dn, x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE))
        assert got is not None and got.dtype == dtype and got.shape == (tokens, H)
        assert rel(got.cpu(), reference(x, gu.cpu(), dn.cpu(), index, weights)) <= moe_tolerance("nvfp4", dtype)


def test_experts_take_their_input_already_in_pair_order(monkeypatch):
    """The NVFP4 experts' input handed in the decode's pair order (the layer's norm writes it so): the same output
    as from K order through the fused kernels, and through the reference path too (it restores K order)."""
    from quant.kernels.moe_gate_up import pair_ordered
    from quant.modules import takes_pair_order

    from dgemma_cli.model import QuantizedExperts

    g = torch.Generator().manual_seed(5)
    E, H, I, K, tokens = 6, 64, 64, 2, 9
    gu, dn = (s.to(DEVICE) for s in build_stacks("nvfp4", E, H, I, g))
    experts = QuantizedExperts(E, gu, dn)
    x = torch.randn(tokens, H, generator=g).to(DEVICE)
    index, weights = LOADS["uniform"](tokens, E, K, g).to(DEVICE), torch.rand(tokens, K, generator=g).to(DEVICE)
    assert takes_pair_order(gu, dn, x) and experts.takes_pair_order(x)
    want = experts(x, index, weights)
    assert torch.equal(experts(pair_ordered(x), index, weights, ordered=True), want)
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")  # the reference path, which reads K order
    assert not takes_pair_order(gu, dn, x)
    ref = experts(x, index, weights)
    assert torch.equal(experts(pair_ordered(x), index, weights, ordered=True), ref)


@pytest.mark.parametrize("tokens", [1, 17])
def test_w4a4_experts_use_the_calibrated_input_scales(tokens, monkeypatch):
    """Stacks loaded with ModelOpt's input_scale per expert projection: the W4A4 experts quantize x with the largest
    gate/up scale of the layer and h with the largest down scale (as serving engines read these checkpoints), equal
    to the emulation given those two scales, and different from per-token scales."""
    import quant.kernels as kernels
    from quant.kernels.moe_w4a4 import reference

    monkeypatch.setattr(kernels, "arch", lambda device: 120)
    g = torch.Generator().manual_seed(tokens)
    E, H, I, K = 6, 64, 64, 2
    gu, dn = build_stacks("nvfp4", E, H, I, g)
    for stack, amax in ((gu, 1.5), (dn, 0.05)):  # h is small here (weights * 0.1)
        stack.expect_input_scale()
        stack.input_scale.copy_(torch.rand(stack.input_scale.shape, generator=g) * amax / 2688)
    x_scale, h_scale = gu.input_scale.amax().reshape(1), dn.input_scale.amax().reshape(1)
    assert torch.equal(gu.activation_scale().cpu(), x_scale.cpu()) and dn.activation_scale().item() == h_scale.item()
    x = torch.randn(tokens, H, generator=g)
    index, weights = LOADS["uniform"](tokens, E, K, g), torch.rand(tokens, K, generator=g)
    got = fused_experts(gu, dn, x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE)).cpu()
    want = reference(x, gu.cpu(), dn.cpu(), index, weights, x_scale.cpu(), h_scale.cpu())
    assert rel(got, want) <= TOL[torch.float32]
    assert rel(want, reference(x, gu.cpu(), dn.cpu(), index, weights)) > 1e-3


def build_stacks(fmt: str, E: int, H: int, I: int, g: torch.Generator):
    """Quantized expert stacks from random weights (NVFP4: gate and up with their own global scales, searched block
    scales for them)."""
    gu_w, dn_w = torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1
    if fmt == "nvfp4":
        gu, dn = NVFP4Stack.from_weights(gu_w, segments=2, search=True), NVFP4Stack.from_weights(dn_w)
    elif fmt == "w8a8-int8":  # compressed-tensors' layout (quant/modules.py W8A8Stack)
        from quant.modules import W8A8Stack

        gu, dn = W8A8Stack.from_weights(gu_w, "int8"), W8A8Stack.from_weights(dn_w, "int8")
    else:
        gu, dn = Int8Stack.from_weights(gu_w), Int8Stack.from_weights(dn_w)
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


def moe_tolerance(fmt: str, dtype: torch.dtype) -> float:
    """NVFP4 in bfloat16: the reference's per-weight rounding of (a * s) * scale_2 is one bfloat16 step away from
    the kernel's exact a * s with scale_2 applied after the sum, and the activation in between can double that."""
    return 2 * TOL[dtype] if fmt == "nvfp4" and dtype == torch.bfloat16 else TOL[dtype]


LOADS = {
    "uniform": lambda T, E, K, g: torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]),
    "one_hot_expert": lambda T, E, K, g: torch.stack([torch.tensor([0] + [1 + i for i in range(K - 1)])] * T),
    "empty_experts": lambda T, E, K, g: torch.stack([torch.randperm(E // 2, generator=g)[:K] for _ in range(T)]),
}


# every row count with a uniform load; the skewed loads at the small counts (interpreter time)
MOE_CASES = [(t, "uniform") if t < 255 else pytest.param(t, "uniform", marks=pytest.mark.slow)  # make test's time
             for t in ROWS] + [(t, load) for t in ROWS if t <= 33 for load in LOADS if load != "uniform"]


@pytest.mark.parametrize("fmt", ["nvfp4", "int8"])
@pytest.mark.parametrize("tokens,load", MOE_CASES)
def test_fused_moe_matches_reference(fmt, tokens, load):
    g = torch.Generator().manual_seed(tokens)
    E, H, I, K = 6, 64, 48, 2  # I = 48: gate-up tiles shrink to 16 wide (whole); down's 128-wide tile over H is masked
    gu, dn = build_stacks(fmt, E, H, I, g)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(tokens, H, generator=g).to(dtype).to(DEVICE)
        index = LOADS[load](tokens, E, K, g).to(DEVICE)
        weights = torch.rand(tokens, K, generator=g).to(DEVICE)
        got = fused_experts(gu, dn, x, index, weights)
        ref = reference_experts(gu, dn, x, index, weights)
        assert got is not None and got.dtype == dtype and got.shape == (tokens, H)
        assert rel(got, ref) <= moe_tolerance(fmt, dtype), (dtype, rel(got, ref))
        if fmt == "nvfp4" and dtype == torch.bfloat16:
            # the kernel keeps a * s exact and applies the global scale to the float32 sum; the reference rounds
            # every weight (a * s) * scale_2 to bfloat16 first. Against float32 math on the same inputs, the kernel
            # must be at least as close as the reference is.
            exact = reference_experts(gu, dn, x.float(), index, weights)
            assert rel(got, exact) <= rel(ref, exact) * 1.25 + 1e-3, (rel(got, exact), rel(ref, exact))


def test_fused_moe_with_the_hopper_launch_settings(monkeypatch):
    """The launch settings of GPUs whose tensor cores read the weights from shared memory (arch 90: 64-row blocks,
    gate-up tiles 64 wide and 128 deep, the down tile 256 wide, 64 deep, 8 warps), here in the interpreter: hidden 256
    makes the down tile whole, 40 tokens over 4 experts put more than one block on some."""
    import quant.kernels as kernels
    import quant.kernels.moe_gate_up as moe_gate_up

    for module in (kernels, moe_gate_up):
        monkeypatch.setattr(module, "arch", lambda device: 90)
    candidates = moe_gate_up.candidates
    g = torch.Generator().manual_seed(9)
    E, H, I, K, T = 4, 256, 64, 2, 40
    cfg = candidates(T * K / E, H, I, torch.device(DEVICE))[0]
    assert (cfg["BLOCK_M"], cfg["DN_N"], cfg["DN_K"], cfg["DN_W"]) == (64, 256, 64, 8)
    gu, dn = build_stacks("nvfp4", E, H, I, g)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
        index = LOADS["uniform"](T, E, K, g).to(DEVICE)
        weights = torch.rand(T, K, generator=g).to(DEVICE)
        got = fused_experts(gu, dn, x, index, weights)
        assert got is not None
        assert rel(got, reference_experts(gu, dn, x, index, weights)) <= moe_tolerance("nvfp4", dtype)


@pytest.mark.slow  # make test's time (CI runs it in make test-slow)
@pytest.mark.parametrize("fmt", ["nvfp4", "int8"])
def test_fused_moe_masked_tiles(fmt):
    """Hidden 48 and width 80: the tiles shrink to 16 to fit whole (moe_gate_up.candidates), so the gate-up kernel runs
    unmasked; the down kernel masks its 128-wide tile over hidden 48."""
    g = torch.Generator().manual_seed(5)
    E, H, I, K = 5, 48, 80, 3
    gu, dn = build_stacks(fmt, E, H, I, g)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(17, H, generator=g).to(dtype).to(DEVICE)
        index = LOADS["uniform"](17, E, K, g).to(DEVICE)
        weights = torch.rand(17, K, generator=g).to(DEVICE)
        got = fused_experts(gu, dn, x, index, weights)
        assert rel(got, reference_experts(gu, dn, x, index, weights)) <= moe_tolerance(fmt, dtype)


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
    from dgemma_cli.store.quantize import quantize_checkpoint

    out = tmp_path / fmt
    quantize_checkpoint(checkpoints["five_to_one"], out, fmt, "all")
    engine = load(out, device=DEVICE, dtype="float32")
    prompts = [[2, 200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211], [2, 300, 301, 302]]
    kw = dict(raw=True, max_new_tokens=16, max_denoising_steps=3, seed=5)
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")
    reference = engine.generate(prompts, **kw).token_ids
    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    assert engine.generate(prompts, **kw).token_ids == reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,rank,masked", [(1, 4, False), (37, 16, False), (70, 20, True)])
def test_lora_kernel_adds_the_low_rank_term(rows, rank, masked, dtype):
    """y += scale * mask * (x A^T) B^T in one kernel against the torch path's ops (quant/kernels/lora.py): N not a
    multiple of the tile, a rank that is not a power of two, rows masked as the server's adapter slots mask them."""
    from quant.kernels.lora import lora_add_

    g = torch.Generator().manual_seed(rows + rank)
    N, K = 200, 96
    x = torch.randn(rows, K, generator=g).to(dtype).to(DEVICE)
    A = (torch.randn(rank, K, generator=g) * 0.3).to(dtype).to(DEVICE)
    B = (torch.randn(N, rank, generator=g) * 0.3).to(dtype).to(DEVICE)
    y0 = torch.randn(rows, N, generator=g).to(dtype).to(DEVICE)
    mask = (torch.arange(rows) % 3 != 0).float().to(DEVICE) if masked else None
    t = torch.nn.functional.linear(torch.nn.functional.linear(x, A), B) * 0.75
    ref = y0 + (t if mask is None else t * mask[:, None].to(dtype))
    got = lora_add_(y0.clone(), x, A, B, 0.75, mask)
    assert got.dtype == dtype and rel(got, ref) <= 2 * TOL[dtype]
    if masked:  # masked rows untouched, bit for bit
        keep = mask == 0
        assert torch.equal(got[keep], y0[keep])


def test_lora_linear_takes_the_fused_kernel_with_row_slots(monkeypatch):
    """lora.LoRALinear in 16-bit where the kernels run: one lora_kernel launch per adapter, the base's rows of the
    server's other adapters untouched, the same values as the torch ops (DGEMMA_KERNELS=torch) to bfloat16
    rounding."""
    from dgemma_cli.tuner.lora import LoRALinear, LowRank
    from dgemma_cli.model import Phase
    import quant.kernels.lora as kernel

    g = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(64, 96, bias=False).to(torch.bfloat16).to(DEVICE)
    phase = Phase()
    lin = LoRALinear(base, phase)
    for slot in (1, 2):
        lin.deltas["decoder"].append(LowRank((torch.randn(8, 64, generator=g) * 0.2).to(DEVICE),
                                             (torch.randn(96, 8, generator=g) * 0.2).to(DEVICE), 0.5, slot))
    x = torch.randn(3, 5, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    phase.row_slots = torch.tensor([0, 2, 1], device=DEVICE)
    calls = []
    real = kernel.lora_add_
    monkeypatch.setattr(kernel, "lora_add_", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        fused = lin(x)
        monkeypatch.setenv("DGEMMA_KERNELS", "torch")
        plain = lin(x)
    assert len(calls) == 2
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[0], base(x[0]))  # slot 0: the base alone
    assert rel(fused, plain) <= 2 * TOL[torch.bfloat16]


@pytest.mark.parametrize("fmt", ["nvfp4", "int8", "w8a8-int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapted_experts_run_the_fused_kernels(fmt, dtype, monkeypatch):
    """Quantized experts with two adapters' expert deltas (peft's ParamWrapper layout, ranks 8 and 4 on gate-up, 8
    on down) and three rows choosing the base, adapter 1 or adapter 2 (the server's slots), or every adapter on every
    row (run): the fused kernels, with the terms in their epilogues, against the reference path (DGEMMA_KERNELS=torch:
    the dequantized experts and torch's grouped low-rank terms). No expert weight is dequantized on the fused path
    (compressed-tensors' INT8 experts: the weight-only INT8 kernels, which take the terms)."""
    from dgemma_cli.tuner.lora import ExpertLowRank
    from dgemma_cli.model import Phase, QuantizedExperts
    import quant.kernels.moe_gate_up as gate_up_kernel

    g = torch.Generator().manual_seed(3)
    E, H, I, K, T = 6, 64, 48, 2, 9  # three rows of 3 tokens
    gu, dn = build_stacks(fmt, E, H, I, g)
    experts = QuantizedExperts(E, gu, dn)
    phase = Phase()
    experts.low_rank = lr = ExpertLowRank(phase, E)
    for (fin, fout), which in (((H, 2 * I), "gate_up"), ((I, H), "down")):
        for r, scale, slot in ((8, 0.5, 1), (4, 1.0, 2)) if which == "gate_up" else ((8, 0.75, 2),):
            A = (torch.randn(r * E, fin, generator=g) * 0.3).to(DEVICE)
            B = (torch.randn(fout, r * E, generator=g) * 0.3).to(DEVICE)
            lr.parts["decoder"][which].append((A, B, scale, slot))
    x = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
    index = LOADS["uniform"](T, E, K, g).to(DEVICE)
    weights = torch.rand(T, K, generator=g).to(DEVICE)
    choices = (torch.tensor([0, 1, 2]), None)

    def outputs() -> list[torch.Tensor]:
        out = []
        for slots in choices:
            phase.row_slots = None if slots is None else slots.to(DEVICE)
            with torch.no_grad():
                out.append(experts(x, index, weights))
        return out

    launches = []
    real = gate_up_kernel.moe_gate_up
    monkeypatch.setattr(gate_up_kernel, "moe_gate_up", lambda *a, **k: launches.append(a[-2:]) or real(*a, **k))
    monkeypatch.setattr(type(gu), "dequantize", lambda *a: pytest.fail("an expert stack was dequantized"))
    fused = outputs()
    monkeypatch.undo()
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")
    ref = outputs()
    with torch.no_grad():
        base = QuantizedExperts(E, gu, dn)(x, index, weights)
    assert len(launches) == 2 and all(lo is not None for lo, _ in launches)
    for slots, f, r in zip(choices, fused, ref):
        assert rel(f, r) <= 2 * moe_tolerance(fmt, dtype), (slots, rel(f, r))
        assert rel(r, base) > 0.1  # the adapters change the output
    assert rel(fused[0][:3], base[:3]) <= moe_tolerance(fmt, dtype)  # the row that chose no adapter: the base's


def test_adapted_nvfp4_linears_take_the_terms_in_their_epilogue(monkeypatch):
    """lora.LoRALinear on NVFP4 linears where the kernels run: the adapters' terms in the NVFP4 kernel's epilogue
    (no separate lora_add_ launch), the dense MLP's gate and up still one gated launch with both halves' terms before
    the activation; rows of the server's slots 0 (base alone), 1 and 2; the torch path's values (DGEMMA_KERNELS=torch)
    to bfloat16 rounding."""
    from dgemma_cli.tuner.lora import LoRALinear, LowRank
    from dgemma_cli.model import MLP, Phase
    import quant.kernels.lora as lora_kernels
    import quant.kernels.nvfp4_linear as linear_kernel
    from quant.modules import NVFP4Linear

    g = torch.Generator().manual_seed(1)
    H, I = 64, 96
    phase = Phase()
    mlp = MLP(H, I)
    for name, (fin, fout) in (("gate_proj", (H, I)), ("up_proj", (H, I)), ("down_proj", (I, H))):
        base = NVFP4Linear.from_weight(nvfp4.quantize(torch.randn(fout, fin, generator=g) * 0.2)).to(DEVICE)
        wrapped = LoRALinear(base, phase)
        for slot, rank in ((1, 8), (2, 4)):
            wrapped.deltas["decoder"].append(LowRank((torch.randn(rank, fin, generator=g) * 0.3).to(DEVICE),
                                                     (torch.randn(fout, rank, generator=g) * 0.3).to(DEVICE),
                                                     0.5 * slot, slot))
        setattr(mlp, name, wrapped)
    x = torch.randn(3, 5, H, generator=g).to(torch.bfloat16).to(DEVICE)
    phase.row_slots = torch.tensor([0, 2, 1], device=DEVICE)
    calls = []
    real = linear_kernel.nvfp4_linear
    monkeypatch.setattr(linear_kernel, "nvfp4_linear", lambda *a, **k: calls.append(
        ("gated" if k.get("up") is not None else "plain", k.get("lora") is not None)) or real(*a, **k))
    monkeypatch.setattr(lora_kernels, "lora_add_", lambda *a, **k: pytest.fail("a separate LoRA launch"))
    with torch.no_grad():
        fused = mlp(x)
        monkeypatch.undo()
        monkeypatch.setenv("DGEMMA_KERNELS", "torch")
        plain = mlp(x)
        phase.row_slots = None
        bare = MLP(H, I)
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(bare, name, getattr(mlp, name).base)
        base = bare(x)
    assert calls == [("gated", True), ("plain", True)]
    assert rel(fused, plain) <= 2 * TOL[torch.bfloat16]
    assert rel(fused[0], base[0]) <= 2 * TOL[torch.bfloat16]  # slot 0: the base alone
    assert rel(plain[1:], base[1:]) > 0.1  # the terms matter


def lora_stack(E: int | None, N: int, K: int, dtype: torch.dtype, g: torch.Generator):
    """Two adapters' factors stacked as the kernels take them (ranks 8 and 4, padded to 16; slots 1 and 2), per
    expert when E is given."""
    slot = torch.tensor([1] * 8 + [2] * 4 + [-1] * 4, dtype=torch.int32)
    lead = () if E is None else (E,)
    A = torch.randn(*lead, 16, K, generator=g) * 0.3 * (slot >= 0)[:, None]
    B = torch.randn(*lead, N, 16, generator=g) * 0.3 * (slot >= 0)
    return A.to(dtype).to(DEVICE), B.to(dtype).to(DEVICE), slot.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a4_kernels_add_the_adapters_terms(dtype, monkeypatch):
    """W4A4 (as an RTX 50 runs it: arch 120) with adapters' terms in the epilogues, the rank products taken from the
    16-bit activations: the linear on 3 batch rows choosing adapter 0, 1 or 2, and the routed experts with tokens
    choosing theirs, against the emulations (nvfp4_w4a4.reference, moe_w4a4.reference) with the same terms."""
    import quant.kernels as kernels
    from quant.kernels import moe_w4a4, nvfp4_w4a4
    from quant.kernels.lora import LinearAdapters, LinearFactors
    from quant.kernels.moe_lora import ExpertAdapters, LoRAFactors

    monkeypatch.setattr(kernels, "arch", lambda device: 120)
    g = torch.Generator().manual_seed(7)
    N, K = 80, 96
    q = nvfp4.quantize(torch.randn(N, K, generator=g), search=True)
    args = (q.weight, q.weight_scale, q.weight_scale_2.expand(N))
    lora = LinearAdapters(LinearFactors(*lora_stack(None, N, K, dtype, g)), torch.tensor([0, 1, 2], dtype=torch.int32))
    x = torch.randn(3, 11, K, generator=g).to(dtype)
    got = nvfp4_w4a4.nvfp4_w4a4(x.to(DEVICE), *(a.to(DEVICE) for a in args), lora=lora)
    want = nvfp4_w4a4.reference(x, *args, lora=lora)
    assert rel(got.cpu(), want) <= 2 * TOL[dtype]
    assert rel(want, nvfp4_w4a4.reference(x, *args)) > 0.1  # the terms matter
    assert rel(got[0].cpu(), nvfp4_w4a4.reference(x, *args)[0]) <= TOL[dtype]  # slot 0: the base alone

    E, H, I, top, T = 6, 64, 64, 2, 17
    gu, dn = build_stacks("nvfp4", E, H, I, g)
    experts = ExpertAdapters(LoRAFactors(*lora_stack(E, 2 * I, H, dtype, g)),
                             LoRAFactors(*lora_stack(E, H, I, dtype, g)),
                             torch.randint(0, 3, (T,), generator=g, dtype=torch.int32).to(DEVICE))
    x = torch.randn(T, H, generator=g).to(dtype)
    index = LOADS["uniform"](T, E, top, g)
    weights = torch.rand(T, top, generator=g)
    got = fused_experts(gu, dn, x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE), lora=experts)
    want = moe_w4a4.reference(x, gu.cpu(), dn.cpu(), index, weights, lora=experts)
    assert rel(got.cpu(), want) <= 2 * moe_tolerance("nvfp4", dtype)
    assert rel(want, moe_w4a4.reference(x, gu.cpu(), dn.cpu(), index, weights)) > 0.1
