"""The W8A8 expert kernels (quant/kernels/moe_w8a8.py) against the PyTorch emulation of the same activation
quantization, and the choice of them in W8A8Stack.

On this CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), which runs int8 x int8 dots
in int32 and e4m3 x e4m3 dots as exact products summed in float32, so no separate emulation branch is involved:
- activation codes and scales equal w8a8.quantize_tokens' bit for bit (INT8 and FP8);
- gate-up: h = gelu_tanh(gate) * up within float32 rounding of the emulation's (the same formula; exp's last bit
  may differ between numpy and torch, and on a GPU the compiler may fuse multiply-adds);
- down, from the kernel's own h: INT8 exactly (integer products summed in int32, then the row's and the channel's
  scale, the slot-order float32 sum); FP8 within float32 summation-order rounding (the kernel sums exact e4m3
  products in float32 tile by tile, the emulation in float64 once).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from quant import w8a8  # noqa: E402
from quant.kernels import moe_w8a8 as kern  # noqa: E402
from quant.kernels.routing import moe_blocks  # noqa: E402
from quant.modules import W8A8Stack, experts_emulated  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = ("int8", "fp8")


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    monkeypatch.setenv("DGEMMA_KERNELS", "triton")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def stacks(kind: str, E: int, H: int, I: int, g: torch.Generator) -> tuple[W8A8Stack, W8A8Stack]:
    return (W8A8Stack.from_weights(torch.randn(E, 2 * I, H, generator=g) * 0.1, kind),
            W8A8Stack.from_weights(torch.randn(E, H, I, generator=g) * 0.1, kind))


LOADS = {  # top-2 of E experts per token
    "uniform": lambda T, E, g: torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)]),
    "many_to_one": lambda T, E, g: torch.tensor([[0, 1 + t % (E - 1)] for t in range(T)]),  # expert 0: every row
    "empty_experts": lambda T, E, g: torch.stack([torch.randperm(E // 2, generator=g)[:2] for _ in range(T)]),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_codes_equal_quantize_tokens(kind, dtype):
    """Over seven decades (e4m3 subnormal codes), an all-zero row, a negative maximum, exact halves (INT8 ties to
    even), -0.0, and a row longer than one 1024-wide sweep."""
    g = torch.Generator().manual_seed(3)
    for M, K in ((6, 80), (3, 1100)):
        x = torch.randn(M, K, generator=g) * torch.logspace(-5, 2, K)
        x[0] = 0
        x[1, 7] = -x[1].abs().max() * 3
        x[2, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, -0.0])  # scale 1 (INT8): halves round to even
        x[2, 6:] = x[2, 6:].clamp(-1, 1)
        x = x.to(dtype)
        q, s = kern.quantize_rows(x.to(DEVICE), kind)
        ref_q, ref_s = w8a8.quantize_tokens(x, kind)
        assert torch.equal(q.cpu(), ref_q.view(q.dtype)) and torch.equal(s.cpu(), ref_s[:, 0])
        if kind == "int8":
            assert ref_q[2, :5].tolist() == [127, 0, 2, 2, -2]
        else:
            bits = ref_q.view(torch.uint8)
            assert ((bits & 0x78) == 0).logical_and((bits & 7) != 0).any()  # a subnormal code was exercised
            assert bits[2, 5] == 0x80  # -0.0 keeps its sign, as torch's cast
    # rows whose plan id is negative are skipped, the others quantized
    x = torch.randn(4, 64, generator=g)
    ids = torch.tensor([3, -1, 0, -1], dtype=torch.int32)
    q, s = kern.quantize_rows(x.to(DEVICE), kind, ids.to(DEVICE))
    ref_q, ref_s = w8a8.quantize_tokens(x, kind)
    for r in (0, 2):
        assert torch.equal(q[r].cpu(), ref_q[r].view(q.dtype)) and s[r].item() == ref_s[r, 0].item()


def run_stages(kind: str, x, gu, dn, index, weights, cfg):
    """The kernels stage by stage -> (h float32 [T*K, I] in assignment order, ys [T*K, H], y [T, H])."""
    T, K = index.shape
    E, two_i, _ = gu.shape
    I = two_i // 2
    ids, block_expert = moe_blocks(index.to(DEVICE), E, cfg["BLOCK_M"])
    xq, xs = kern.quantize_rows(x.to(DEVICE), kind)
    h = kern.gate_up_w8a8(xq, xs, ids, block_expert, gu, K, cfg)
    live = ids >= 0
    h_tk = torch.empty(T * K, I, device=h.device)
    h_tk[ids[live].long()] = h[live]  # every assignment has exactly one row of the plan
    hq, hs = kern.quantize_rows(h, kind, ids)
    ys = kern.down_w8a8(hq, hs, ids, block_expert, dn, T, K, cfg)
    y = kern.moe_w8a8(x.to(DEVICE), ids, block_expert, gu, dn, weights.reshape(-1).to(DEVICE), T, K, cfg)
    return h_tk.cpu(), ys.cpu(), y.cpu()


CASES = [(1, "uniform"), pytest.param(17, "uniform", marks=pytest.mark.slow), (33, "many_to_one"),
         pytest.param(33, "empty_experts", marks=pytest.mark.slow)]  # (make test's time: the variants in test-slow)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tokens,load", CASES)
def test_kernels_equal_the_emulation(kind, tokens, load):
    """6 experts, top-2, hidden 64, width 48: gate-up tiles of 16 columns (whole), the down kernel's 128-wide tile
    over hidden 64 masked; 33 tokens on expert 0 span three blocks of 16 rows, and `empty_experts` leaves half the
    experts without a row."""
    g = torch.Generator().manual_seed(tokens)
    E, H, I = 6, 64, 48
    gu, dn = stacks(kind, E, H, I, g)
    index = LOADS[load](tokens, E, g)
    weights = torch.rand(tokens, 2, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(tokens, H, generator=g).to(dtype)
        cfg = kern.candidates(tokens * 2 / E, H, I, torch.device(DEVICE))[0]
        h, ys, y = run_stages(kind, x, gu.to(DEVICE), dn.to(DEVICE), index, weights, cfg)
        ref_h = kern.reference_gate_up(x, gu, index).reshape(-1, I)
        assert ref_h.abs().max() > 0
        torch.testing.assert_close(h, ref_h, rtol=2e-6, atol=2e-6 * ref_h.abs().max().item())
        ref_ys, ref_y = kern.reference_down(h.view(tokens, 2, I), dn, index, weights, dtype)
        ref_ys = ref_ys.reshape(-1, H)
        if kind == "int8":
            assert torch.equal(ys, ref_ys)
        else:
            assert rel(ys, ref_ys) <= 1e-6
        assert y.dtype == dtype and y.shape == (tokens, H)
        if kind == "int8" and DEVICE == "cpu":
            assert torch.equal(y, ref_y)
        else:  # FP8 sums, or a GPU's fused multiply-adds in the slot-order sum: one rounding of the output
            assert rel(y, ref_y) <= (1e-6 if dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_partial_tiles(kind):
    """Hidden 80 and width 40: no 32-deep tile divides them, so every load is masked in K and N."""
    g = torch.Generator().manual_seed(7)
    E, H, I, T = 5, 80, 40, 9
    gu, dn = stacks(kind, E, H, I, g)
    index = LOADS["uniform"](T, E, g)
    weights = torch.rand(T, 2, generator=g)
    x = torch.randn(T, H, generator=g)
    cfg = kern.candidates(T * 2 / E, H, I, torch.device(DEVICE))[0]
    assert H % cfg["GU_K"] and I % cfg["DN_K"]
    h, ys, y = run_stages(kind, x, gu.to(DEVICE), dn.to(DEVICE), index, weights, cfg)
    ref_h = kern.reference_gate_up(x, gu, index).reshape(-1, I)
    torch.testing.assert_close(h, ref_h, rtol=2e-6, atol=2e-6 * ref_h.abs().max().item())
    ref_ys, ref_y = kern.reference_down(h.view(T, 2, I), dn, index, weights, torch.float32)
    assert rel(ys, ref_ys.reshape(-1, H)) <= (0 if kind == "int8" else 1e-6)
    assert rel(y, ref_y) <= 1e-6


@pytest.mark.parametrize("kind,cc,mode,path", [
    ("int8", 80, "auto", "kernels"), ("int8", 75, "auto", "weights"), ("fp8", 89, "auto", "kernels"),
    ("fp8", 86, "auto", "weights"), ("fp8", 86, "on", "emulated"), ("int8", 90, "on", "kernels"),
    ("fp8", 120, "off", "weights")])
def test_w8a8_stack_chooses_the_kernels_where_the_gpu_has_the_units(kind, cc, mode, path, monkeypatch):
    """W8A8Stack takes the 8-bit kernels when DGEMMA_W8A8 is auto or on and the GPU has the tensor cores (arch
    stands in for the GPU), the float32 emulation when forced on elsewhere, weight-only otherwise (None for FP8 and
    the weight-only INT8 kernels, stubbed here). The kernels' output is close to the emulation's."""
    import quant.kernels as kernels
    import quant.modules as modules

    monkeypatch.setattr(kernels, "arch", lambda device: cc)
    monkeypatch.setenv("DGEMMA_W8A8", mode)
    calls = []
    real = kern.moe_w8a8
    monkeypatch.setattr(kern, "moe_w8a8", lambda *a, **k: calls.append("kernels") or real(*a, **k))
    monkeypatch.setattr(modules, "fused_experts", lambda *a, **k: calls.append("weights") and None)  # weight-only INT8
    g = torch.Generator().manual_seed(cc)
    T, E, H, I = 9, 4, 64, 32
    gu, dn = stacks(kind, E, H, I, g)
    x = torch.randn(T, H, generator=g)
    index = LOADS["uniform"](T, E, g)
    weights = torch.rand(T, 2, generator=g)
    got = gu.to(DEVICE).fused_experts(dn.to(DEVICE), x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE))
    emulated = experts_emulated(gu, dn, x, index, weights)
    if path == "kernels":
        assert calls == ["kernels"]
        # the emulation multiplies the fake-quantized floats (rounded products) and uses torch's gelu: a rounding
        # apart, unless an activation code lands on the other side of a rounding boundary (rare; then one step)
        assert rel(got.cpu(), emulated) <= 1e-3
    elif path == "emulated":
        assert calls == [] and torch.equal(got, emulated)
    else:
        assert got is None and calls == (["weights"] if kind == "int8" else [])


def test_probe_passes_and_catches_a_wrong_quantizer(monkeypatch, capsys):
    """The first-use check runs the W8A8 expert kernels against the emulation: it passes as they are, and a
    quantizer with the wrong range is reported in one line on stderr, the family then refused."""
    from quant.kernels import probe

    cpu = torch.device(DEVICE)
    assert probe.check("moe_w8a8_int8", cpu, torch.bfloat16) is None
    monkeypatch.setattr(probe, "needs_probe", lambda device: True)
    monkeypatch.setattr(kern, "QMAX", {"int8": 126.0, "fp8": 448.0})
    probe.reset()
    try:
        assert not probe.family_ok("moe_w8a8_int8", cpu, torch.float32)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "moe_w8a8_int8" in err[0] and "activation codes" in err[0]
    finally:
        probe.reset()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_fused_token_quantizer_is_quantize_tokens(monkeypatch, kind):
    """The W8A8 linears' activation quantization through the Triton kernel (one launch) gives quantize_tokens' codes
    and scales bit for bit (the interpreter here)."""
    from quant.modules import quantize_tokens_fused

    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 200, generator=g) * 4).to(torch.bfloat16)
    x[5] = 0  # a zero row: the tiny scale
    q, s = quantize_tokens_fused(x, kind)
    rq, rs = w8a8.quantize_tokens(x, kind)
    assert q.dtype == rq.dtype and s.shape == rs.shape
    assert torch.equal(q.view(torch.uint8) if kind == "fp8" else q, rq.view(torch.uint8) if kind == "fp8" else rq)
    assert torch.equal(s, rs)
