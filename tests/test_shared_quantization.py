"""Linears of one input run together (quant.modules.project): NVFP4's q, k and v in one launch, W4A4 and W8A8
activations quantized once per distinct input; the W4A4 gated MLP in one launch and the W8A8 MLP's activation and
product in one (quant/kernels/gelu_mul.py); all against the per-linear paths they replace.

On this CPU the kernels run in Triton's interpreter; the W4A4 path is chosen by standing in an RTX 50's compute
capability (kernels.arch = 120), torch's FP8 / INT8 matmul by answering that the hardware has it (torch's CPU build
runs `_scaled_mm` and `_int_mm`)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from quant import nvfp4, w8a8  # noqa: E402
from quant.modules import NVFP4Linear, W8A8Linear, project  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 2e-3}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


@pytest.fixture
def rtx50(monkeypatch):
    """Triton kernels, and the FP4 tensor cores of sm_120 (W4A4)."""
    import quant.kernels as kernels

    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    monkeypatch.setattr(kernels, "arch", lambda device: 120)


@pytest.fixture
def counted_act(monkeypatch):
    """Counts NVFP4 activation quantizations (kernels/nvfp4_act.quantize_act launches)."""
    from quant.kernels import nvfp4_act

    calls = []
    real = nvfp4_act.quantize_act
    monkeypatch.setattr(nvfp4_act, "quantize_act", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    return calls


def nvfp4_linears(n: int, N: int, K: int, g: torch.Generator, scales=None) -> list[NVFP4Linear]:
    out = []
    for i in range(n):
        m = NVFP4Linear.from_weight(nvfp4.quantize(torch.randn(N, K, generator=g)))
        if scales is not None:
            m.expect_input_scale()
            m.input_scale.fill_(scales[i])
        out.append(m)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a4_projections_share_one_quantization_per_token(dtype, rtx50, counted_act):
    """q, k and v (different widths) of one x through `project`: x quantized once, each output equal to the
    linear's own call, which quantizes x itself (per-token scales: the same codes)."""
    g = torch.Generator().manual_seed(0)
    K = 96
    x = torch.randn(2, 5, K, generator=g).to(dtype)
    lins = nvfp4_linears(1, 64, K, g) + nvfp4_linears(2, 32, K, g)
    got = project(x, [*lins, None])
    assert len(counted_act) == 1 and got[3] is None
    alone = [m(x) for m in lins]
    assert len(counted_act) == 4
    for a, b in zip(got, alone):
        assert a.shape == b.shape and torch.equal(a, b)


def test_w4a4_calibrated_scales_are_shared_as_their_largest(rtx50, counted_act):
    """With the checkpoint's calibrated input scales the shared quantization takes the largest of them (what vLLM's
    fused QKV layer does); equal scales give exactly each linear's own result, and the kept maximum follows a
    changed scale."""
    g = torch.Generator().manual_seed(1)
    K = 64
    x = torch.randn(7, K, generator=g).to(torch.bfloat16)
    amax = x.float().abs().max().item() / 2688
    lins = nvfp4_linears(3, 32, K, g, scales=[amax, amax, amax])
    assert all(torch.equal(a, m(x)) for a, m in zip(project(x, lins), lins))
    lins[1].input_scale.fill_(2 * amax)  # one larger: all three quantize with it
    got = project(x, lins)
    for m in lins:
        m.input_scale.fill_(2 * amax)
    assert all(torch.equal(a, m(x)) for a, m in zip(got, lins))
    lins[0].input_scale.fill_(amax / 2)
    assert not torch.equal(project(x, lins)[0], lins[0](x))  # per-linear with its own (smaller) scale differs


def test_only_alike_quantizations_are_shared(rtx50, counted_act):
    """A 16-bit linear, a per-token and a calibrated NVFP4 linear on one x: each as it would run alone."""
    g = torch.Generator().manual_seed(2)
    K = 64
    x = torch.randn(4, K, generator=g)
    plain = torch.nn.Linear(K, 16, bias=False)
    token, = nvfp4_linears(1, 32, K, g)
    static, = nvfp4_linears(1, 32, K, g, scales=[x.abs().max().item() / 2688])
    got = project(x, [plain, token, static])
    assert len(counted_act) == 2  # one each: they quantize differently
    assert torch.equal(got[0], plain(x)) and torch.equal(got[1], token(x)) and torch.equal(got[2], static(x))


@pytest.mark.parametrize("rows,dtype,static", [(3, torch.float32, False), (3, torch.bfloat16, True),
                                               pytest.param(130, torch.bfloat16, False, marks=pytest.mark.slow)])
def test_w4a4_gated_mlp_in_one_launch(rows, dtype, static, rtx50, counted_act):
    """The dense MLP's gelu_tanh(gate(x)) * up(x) on the W4A4 path: one quantization, one product launch, against
    the emulation of the three ops (each product, the activation and the product rounded as torch rounds them)."""
    from quant.kernels import nvfp4_w4a4 as kern

    g = torch.Generator().manual_seed(rows)
    N, K = 80, 96  # N not a multiple of the 64-wide gated tile
    x = torch.randn(rows, K, generator=g).to(dtype)
    scale = [x.float().abs().max().item() / 2688 / 2] * 2 if static else None
    gate, up = nvfp4_linears(2, N, K, g, scales=scale)
    launches = []
    real = kern.nvfp4_w4a4_kernel
    monkeypatch_kernel = pytest.MonkeyPatch()
    monkeypatch_kernel.setattr(kern, "nvfp4_w4a4_kernel", type("K", (), {
        "__getitem__": lambda self, grid: (lambda *a, **k: launches.append(grid) or real[grid](*a, **k))})())
    try:
        got = gate.gated(x, up)
    finally:
        monkeypatch_kernel.undo()
    assert len(counted_act) == 1 and len(launches) == 1
    ins = (gate.input_scale, up.input_scale)
    want = (F.gelu(kern.reference(x, gate.weight, gate.weight_scale, gate.row_scale_2(), ins[0]), approximate="tanh")
            * kern.reference(x, up.weight, up.weight_scale, up.row_scale_2(), ins[1]))
    assert got.dtype == dtype and got.shape == (rows, N)
    assert rel(got, want) <= TOL[dtype]
    # and the MLP module takes it: its output is down(that)
    from dgemma_cli.model import MLP

    mlp = MLP(K, N)
    mlp.gate_proj, mlp.up_proj = gate, up
    mlp.down_proj, = nvfp4_linears(1, K, N, g, scales=scale[:1] if static else None)
    assert torch.equal(mlp(x), mlp.down_proj(got))


def test_w4a4_gated_declines_what_it_cannot_fuse(rtx50):
    """Adapters' terms, or an up projection that quantizes x differently: None (the caller's ops)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g)
    gate, = nvfp4_linears(1, 32, 64, g)
    up, = nvfp4_linears(1, 32, 64, g, scales=[0.01])
    assert gate.gated(x, up) is None
    assert gate.gated(x, gate, lora=object()) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gelu_mul_matches_torchs_two_ops(dtype, monkeypatch):
    from quant.kernels.gelu_mul import gelu_mul, reference

    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    g = torch.Generator().manual_seed(4)
    gate, up = ((torch.randn(3, 1037, generator=g) * 3).to(dtype) for _ in range(2))  # a partial block
    got = gelu_mul(gate, up)
    assert got.dtype == dtype and got.shape == gate.shape
    assert rel(got, reference(gate, up)) <= TOL[dtype]
    with pytest.raises(ValueError):
        gelu_mul(gate, up[:2])


@pytest.fixture
def w8a8_hw(monkeypatch):
    """torch's FP8 / INT8 matmul as on a GPU that has the units (it runs on the CPU too), the Triton quantizer."""
    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    monkeypatch.setattr(w8a8, "hardware", lambda kind, device: True)
    from quant.kernels import moe_w8a8

    calls = []
    real = moe_w8a8.quantize_rows
    monkeypatch.setattr(moe_w8a8, "quantize_rows", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    return calls


def w8a8_linear(kind: str, N: int, K: int, g: torch.Generator) -> W8A8Linear:
    m = W8A8Linear(K, N, kind)
    q, s = w8a8.quantize(torch.randn(N, K, generator=g), kind)
    m.weight.copy_(q)
    m.weight_scale.copy_(s.float())
    return m


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_w8a8_projections_share_one_quantization(kind, w8a8_hw):
    """Three W8A8 linears on one bfloat16 x: one per-token quantization, each output equal to its own call."""
    g = torch.Generator().manual_seed(5)
    K = 64
    x = torch.randn(2, 9, K, generator=g).to(torch.bfloat16)
    lins = [w8a8_linear(kind, n, K, g) for n in (64, 32, 32)]
    got = project(x, lins)
    assert len(w8a8_hw) == 1
    for a, m in zip(got, lins):
        assert torch.equal(a, m(x))
    assert len(w8a8_hw) == 4


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_w8a8_mlp_quantizes_once_and_fuses_the_activation(kind, w8a8_hw):
    """The dense MLP on torch's 8-bit matmul: gate and up from one quantization of x, gelu_tanh(gate) * up in one
    kernel, equal to the separate ops up to one rounding of the activation (the kernel's tanh against torch's)."""
    from dgemma_cli.model import MLP

    g = torch.Generator().manual_seed(6)
    K, N = 64, 96
    x = torch.randn(11, K, generator=g).to(torch.bfloat16)
    mlp = MLP(K, N)
    mlp.gate_proj, mlp.up_proj, mlp.down_proj = (w8a8_linear(kind, n, k, g) for n, k in ((N, K), (N, K), (K, N)))
    h = mlp.gate_proj.gated(x, mlp.up_proj)
    assert len(w8a8_hw) == 1
    want = F.gelu(mlp.gate_proj(x), approximate="tanh") * mlp.up_proj(x)
    assert rel(h, want) <= TOL[torch.bfloat16]
    w8a8_hw.clear()
    out = mlp(x)
    assert len(w8a8_hw) == 2  # x once, h once
    assert torch.equal(out, mlp.down_proj(h))
    # weight-only (DGEMMA_W8A8=off): no quantization, the module's plain ops
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DGEMMA_W8A8", "off")
        assert mlp.gate_proj.gated(x, mlp.up_proj) is None
        assert mlp.gate_proj.joint_key(x) is None


class Launches:
    """Counts a Triton kernel's launches (kernel[grid](...)) while the test runs."""

    def __init__(self, module, name: str, monkeypatch):
        self.grids = []
        real = getattr(module, name)
        grids = self.grids

        class Counted:
            def __getitem__(self, grid):
                grids.append(grid)
                return real[grid]

        monkeypatch.setattr(module, name, Counted())


@pytest.mark.parametrize("w4a4", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_q_k_v_in_one_launch(dtype, w4a4, monkeypatch, counted_act):
    """NVFP4 q, k and v (widths 96, 64, 40: the last tiles partial) through `project`: one launch (16-bit
    activations: nvfp4_linear; W4A4 on an RTX 50 stand-in: one quantization and one launch), each output equal to
    the linear's own call; four linears of one x take two launches."""
    import quant.kernels as kernels
    from quant.kernels import nvfp4_linear, nvfp4_w4a4

    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    monkeypatch.setattr(kernels, "arch", lambda device: 120 if w4a4 else 0)
    module, name = (nvfp4_w4a4, "nvfp4_w4a4_kernel") if w4a4 else (nvfp4_linear, "nvfp4_linear_kernel")
    g = torch.Generator().manual_seed(7)
    K = 64
    x = torch.randn(3, 7, K, generator=g).to(dtype)
    lins = nvfp4_linears(1, 96, K, g) + nvfp4_linears(1, 64, K, g) + nvfp4_linears(1, 40, K, g)
    launches = Launches(module, name, monkeypatch)
    got = project(x, lins)
    assert len(launches.grids) == 1 and len(counted_act) == int(w4a4)
    alone = [m(x) for m in lins]
    assert len(launches.grids) == 4
    for a, b in zip(got, alone):
        assert a.shape == b.shape and torch.equal(a, b)
    four = lins + nvfp4_linears(1, 32, K, g)
    launches.grids.clear()
    got = project(x, four)
    assert len(launches.grids) == 2
    assert all(torch.equal(a, m(x)) for a, m in zip(got, four))


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_w8a8_kernel_against_torchs_8bit_matmul(kind, w8a8_hw, monkeypatch):
    """Our W8A8 linear kernel (kernels/w8a8_linear.py) where torch's `_scaled_mm` / `_int_mm` ran: the same codes
    and scales, INT8's integer sums exact, so equal to torch's product up to one rounding; q, k and v in one
    launch; and where the kernel's first-use check refused it, torch's matmuls with the MLP's activation in the
    gelu_mul kernel."""
    import quant.modules as modules
    from quant.kernels import w8a8_linear as kern

    g = torch.Generator().manual_seed(8)
    K = 128
    x = torch.randn(2, 19, K, generator=g).to(torch.bfloat16)
    lins = [w8a8_linear(kind, n, K, g) for n in (96, 64, 64)]
    launches = Launches(kern, "w8a8_linear_kernel", monkeypatch)
    ours = project(x, lins)
    assert len(launches.grids) == 1 and len(w8a8_hw) == 1
    real_ok = modules.family_ok
    monkeypatch.setattr(modules, "family_ok", lambda family, *a: not family.startswith("w8a8_linear") and
                        real_ok(family, *a))
    torchs = project(x, lins)  # torch's matmul, x still quantized once
    assert len(launches.grids) == 1 and len(w8a8_hw) == 2
    for a, b in zip(ours, torchs):
        assert a.shape == b.shape and rel(a, b) <= TOL[torch.bfloat16]
    gate, up = lins[1], lins[2]
    h = gate.gated(x, up)  # torch's two matmuls and the gelu_mul kernel
    want = F.gelu(gate(x), approximate="tanh") * up(x)
    assert rel(h, want) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("rows", [5, 70])
def test_w8a8_kernel_matches_the_emulation(rows, kind, monkeypatch):
    """The kernel on its own (N and K not multiples of its tiles) against w8a8.matmul_emulated: the same products
    in float32, to the output's rounding; gated against torch's gelu of the emulated products."""
    from quant.kernels.w8a8_linear import w8a8_linear

    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    g = torch.Generator().manual_seed(rows)
    K = 96
    x = torch.randn(rows, K, generator=g).to(torch.bfloat16)
    (wg, sg), (wu, su) = (w8a8.quantize(torch.randn(80, K, generator=g), kind) for _ in range(2))
    sg, su = sg.float(), su.float()
    quantized = w8a8.quantize_tokens(x, kind)
    got = w8a8_linear(x, quantized, wg, sg)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 80)
    assert rel(got, w8a8.matmul_emulated(x, wg, sg, kind)) <= TOL[torch.bfloat16]
    gated = w8a8_linear(x, quantized, wg, sg, up=(wu, su))
    want = F.gelu(w8a8.matmul_emulated(x, wg, sg, kind), approximate="tanh") * w8a8.matmul_emulated(x, wu, su, kind)
    assert rel(gated, want) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("how", ["fp8", "int8", "nvfp4", "nvfp4-static"])
@pytest.mark.parametrize("then_pair", [False, True])
def test_a_norm_quantizes_its_output_as_the_linears_would(how, then_pair, monkeypatch):
    """kernels/rmsnorm.rms_norm(quantize=...): the norm's output (or, with then_pair, the first of the two norms
    after the residual update) quantized in the same launch, code for code and scale for scale what the linears'
    own quantizers make of it (moe_w8a8.quantize_rows, nvfp4_act.quantize_act); D not a multiple of the block."""
    from quant.kernels.moe_w8a8 import quantize_rows
    from quant.kernels.nvfp4_act import quantize_act
    from quant.kernels.rmsnorm import rms_norm

    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    g = torch.Generator().manual_seed(9)
    D = 176  # 11 blocks of 16
    x, h = ((torch.randn(3, 5, D, generator=g) * 3).to(torch.bfloat16) for _ in range(2))
    w, w1, w2 = ((torch.rand(D, generator=g) + 0.5).to(torch.bfloat16) for _ in range(3))
    fmt = how.split("-")[0]
    scale = torch.tensor(0.002) if how.endswith("static") else None
    if then_pair:
        y, pre, pre2, quantized = rms_norm(h, w, 1e-6, residual=x, then_pair=(w1, w2), quantize=fmt,
                                           input_scale=scale)
        assert torch.equal((y, pre, pre2)[0], rms_norm(h, w, 1e-6, residual=x))
        target = pre
    else:
        y, quantized = rms_norm(x, w, 1e-6, quantize=fmt, input_scale=scale)
        assert torch.equal(y, rms_norm(x, w, 1e-6))
        target = y
    flat = target.reshape(-1, D)
    if fmt == "nvfp4":
        want = quantize_act(flat, global_scale=scale)
    else:
        codes, scales = quantize_rows(flat, fmt)
        want = ((codes.view(torch.float8_e4m3fn) if fmt == "fp8" else codes), scales[:, None])
    assert len(quantized) == len(want)
    for a, b in zip(quantized, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


@pytest.mark.parametrize("path", ["w4a4", "w8a8-fp8"])
def test_the_layer_takes_its_norms_quantization(path, monkeypatch):
    """A layer whose q, k, v and dense MLP quantize their input alike (W4A4 on an RTX 50 stand-in, FP8 W8A8 on our
    kernel) takes that quantization from the norms (Layer.attention_input, Layer.post_attention): no quantizer
    launch for those inputs, and the same q, k, v and MLP output as when each group quantizes it itself."""
    import quant.kernels as kernels
    from dgemma_cli.config import ModelConfig
    from dgemma_cli.model import Layer
    from quant.kernels import moe_w8a8, nvfp4_act

    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    if path == "w4a4":
        monkeypatch.setattr(kernels, "arch", lambda device: 120)
    else:
        monkeypatch.setattr(w8a8, "hardware", lambda kind, device: True)
    cfg = ModelConfig.from_dict(json_config()).text
    torch.manual_seed(0)
    layer = Layer(cfg, cfg.layers[0]).to(torch.bfloat16)  # a sliding layer: q, k and v
    g = torch.Generator().manual_seed(10)
    for parent in (layer.self_attn, layer.mlp):
        for name, mod in list(parent.named_children()):
            if isinstance(mod, torch.nn.Linear):
                n, k = mod.out_features, mod.in_features
                setattr(parent, name, nvfp4_linears(1, n, k, g)[0] if path == "w4a4" else w8a8_linear("fp8", n, k, g))
    for norm in (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                 layer.pre_feedforward_layernorm_2):
        norm.weight.data = (torch.rand(cfg.hidden_size, generator=g) + 0.5).to(torch.bfloat16)
    x, h = ((torch.randn(1, 6, cfg.hidden_size, generator=g) * 2).to(torch.bfloat16) for _ in range(2))
    quantizers = []
    for module, name in ((nvfp4_act, "quantize_act"), (moe_w8a8, "quantize_rows")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, **k: quantizers.append(a[0].shape) or real(*a, **k))
    with torch.no_grad():
        normed, quantized = layer.attention_input(x)
        assert quantized is not None and not quantizers
        attn = layer.self_attn
        got = project(normed, [attn.q_proj, attn.k_proj, attn.v_proj], quantized)
        assert not quantizers
        want = project(normed, [attn.q_proj, attn.k_proj, attn.v_proj])
        assert len(quantizers) == 1 and all(torch.equal(a, b) for a, b in zip(got, want) if a is not None)
        quantizers.clear()
        y, made = layer.post_attention(x, h)
        pre, pre2, _, quantized = made
        assert quantized is not None and not quantizers
        dense = layer.mlp(pre, quantized)
        assert len(quantizers) == 1  # the down projection's own input only
        assert torch.equal(dense, layer.mlp(pre))


def json_config() -> dict:
    """A small DiffusionGemma config whose widths the W4A4 and W8A8 kernels take (multiples of 32)."""
    from dgemma_cli.config import DIFFUSIONGEMMA_26B_A4B

    cfg = json.loads(json.dumps(DIFFUSIONGEMMA_26B_A4B))
    text = cfg.get("text_config", cfg)
    text.update(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4, top_k_experts=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64,
                num_global_key_value_heads=1, num_hidden_layers=2, vocab_size=300)
    return cfg
