"""Quantized formats against hand-computed values (E2M1 table, ties, nibble order, scale rounding)."""

import pytest
import torch

from quant import int8, nvfp4


def test_e2m1_table_and_rounding_ties_to_even():
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -6.0, 7.5, 0.2, 0.3])
    assert nvfp4.encode_e2m1(values).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9, 15, 7, 0, 1]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert nvfp4.decode_e2m1(nvfp4.encode_e2m1(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert nvfp4.decode_e2m1(torch.arange(16, dtype=torch.uint8)).tolist() == [
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_nibble_order_low_first():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = nvfp4.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(nvfp4.unpack_nibbles(packed), codes)


def test_nvfp4_quantize_by_hand():
    # one row of 16: amax 6 -> weight_scale_2 = 6 / (6 * 448) = 1/448; block scale = 6 / 6 * 448 = 448 (exact in e4m3)
    row = torch.tensor([[6.0, -3.0, 1.0, 0.5, 0.0, 2.0, -4.0, 1.5] + [0.0] * 8])
    q = nvfp4.quantize(row)
    assert q.weight_scale_2.item() == torch.tensor(1 / 448, dtype=torch.float32).item()
    assert q.weight_scale.float().tolist() == [[448.0]]
    assert nvfp4.unpack_nibbles(q.weight)[0, :8].tolist() == [7, 13, 2, 1, 0, 4, 14, 3]
    torch.testing.assert_close(nvfp4.dequantize(q), row)


def test_nvfp4_block_scale_rounds_to_e4m3():
    # block amax 5 against a global amax of 6: scale = 5/6 * 448 = 373.33 -> nearest e4m3 is 384
    row = torch.tensor([[6.0] + [0.0] * 15 + [5.0] + [0.0] * 15])
    q = nvfp4.quantize(row)
    assert q.weight_scale.float().tolist() == [[448.0, 384.0]]
    # 5 / (384/448) = 5.83 rounds to the E2M1 value 6, so 5 comes back as 6 * 384/448
    assert nvfp4.dequantize(q)[0, 16].item() == pytest.approx(6.0 * 384 / 448, rel=1e-6)


def test_nvfp4_round_trip_error_is_bounded():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    err = (nvfp4.dequantize(nvfp4.quantize(w)) - w).norm() / w.norm()
    assert 0.05 < err < 0.15  # 4-bit: about 9-10% relative RMS error on Gaussian weights


def test_int8_by_hand_and_round_trip():
    w = torch.tensor([[127.0, -63.5, 0.4, 1.0], [0.0, 0.0, 0.0, 0.0]])
    q = int8.quantize(w)
    assert q.weight.tolist()[0] == [127, -64, 0, 1]  # -63.5 rounds half to even
    assert q.weight_scale[0].item() == 1.0
    assert q.weight.tolist()[1] == [0, 0, 0, 0]
    r = torch.randn(32, 128, generator=torch.Generator().manual_seed(1))
    err = (int8.dequantize(int8.quantize(r)) - r).norm() / r.norm()
    assert err < 0.01


def test_nvfp4_value_is_code_times_block_scale_then_global_scale():
    # the format's order of products: (e2m1 * fp32(block scale)) * global scale, one rounding at the end
    q = nvfp4.NVFP4Weight(weight=torch.tensor([[0x53] + [0] * 7], dtype=torch.uint8),  # codes 3 (1.5), 5 (3.0)
                          weight_scale=torch.tensor([[1.125]], dtype=torch.float8_e4m3fn),
                          weight_scale_2=torch.tensor(0.1, dtype=torch.float32))
    got = nvfp4.dequantize(q)[0, :2]
    s2 = torch.tensor(0.1, dtype=torch.float32)
    want = torch.stack([torch.tensor(1.5 * 1.125) * s2, torch.tensor(3.0 * 1.125) * s2])
    assert torch.equal(got, want)


def test_nvfp4_scale_search_by_hand():
    # block [6, 4.5 x 15], global scale 1/448: absmax gives block scale 448 (unit step), 4.5 rounds to 4, error
    # 15 * 0.5^2 = 3.75. Block scale 352 (three e4m3 steps down, 0.786 per unit): 4.5 -> 5.73 -> 6 -> 4.71 (error
    # 0.21 each) and 6 -> 7.6, clipped to 6 -> 4.71 (error 1.29): 15 * 0.044 + 1.66 = 2.32, the best candidate.
    row = torch.tensor([[6.0] + [4.5] * 15])
    scale_2 = torch.tensor(1 / 448)
    plain = nvfp4.quantize(row, scale_2)
    best = nvfp4.quantize(row, scale_2, search=True)
    err = lambda q: (nvfp4.dequantize(q) - row).pow(2).sum().item()  # noqa: E731
    assert plain.weight_scale.float().item() == 448.0
    assert err(plain) == pytest.approx(3.75)
    assert best.weight_scale.float().item() == 352.0
    assert err(best) == pytest.approx(15 * (4.5 - 6 * 352 / 448) ** 2 + (6 - 6 * 352 / 448) ** 2, rel=1e-5)


def test_nvfp4_search_is_never_worse_per_block():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 256, generator=g) * torch.rand(32, 1, generator=g) * 3
    a, b = nvfp4.quantize(w), nvfp4.quantize(w, search=True)
    blocks = w.view(32, 16, 16)
    ea = (nvfp4.dequantize(a).view(32, 16, 16) - blocks).pow(2).sum(-1)
    eb = (nvfp4.dequantize(b).view(32, 16, 16) - blocks).pow(2).sum(-1)
    assert (eb <= ea).all() and eb.sum() < 0.95 * ea.sum()
    assert torch.equal(a.weight_scale_2, b.weight_scale_2)


def test_nvfp4_shared_global_scale_and_zero_blocks():
    g = torch.Generator().manual_seed(5)
    gate, up = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g) * 10
    shared = nvfp4.global_scale(torch.cat([gate, up]))
    assert shared.item() == pytest.approx(torch.cat([gate, up]).abs().max().item() / (6 * 448))
    qg = nvfp4.quantize(gate, shared, search=True)
    assert qg.weight_scale_2.item() == shared.item()
    zero = nvfp4.quantize(torch.zeros(2, 16), search=True)
    assert torch.equal(nvfp4.dequantize(zero), torch.zeros(2, 16))


def test_int8_search_is_never_worse():
    with torch.random.fork_rng(devices=[]):  # a seeded sample that leaves the global generator as it was
        torch.manual_seed(6)
        w = torch.distributions.StudentT(2.0).sample((16, 512))
    a, b = int8.quantize(w), int8.quantize(w, search=True)
    ea = (int8.dequantize(a) - w).pow(2).sum(1)
    eb = (int8.dequantize(b) - w).pow(2).sum(1)
    assert (eb <= ea).all()


def test_stacked_modules_dequantize_like_the_reference():
    from quant.modules import Int8Stack, NVFP4Linear, NVFP4Stack

    g = torch.Generator().manual_seed(4)
    E, N, K = 3, 32, 48
    w = torch.randn(E, N, K, generator=g)
    stack = NVFP4Stack(E, N, K, segments=2)
    for e in range(E):
        half = N // 2
        for j in range(2):
            q = nvfp4.quantize(w[e, j * half:(j + 1) * half])
            stack.weight[e, j * half:(j + 1) * half] = q.weight
            stack.weight_scale[e, j * half:(j + 1) * half] = q.weight_scale
            stack.weight_scale_2[e, j] = q.weight_scale_2
            assert torch.equal(stack.dequantize(torch.float32)[e, j * half:(j + 1) * half], nvfp4.dequantize(q))
    lin = NVFP4Linear.from_weight(nvfp4.quantize(w[0]))
    x = torch.randn(5, K, generator=g)
    assert torch.equal(lin(x), x @ nvfp4.dequantize(nvfp4.quantize(w[0])).T)
    istack = Int8Stack(E, N, K)
    for e in range(E):
        q = int8.quantize(w[e])
        istack.weight[e], istack.weight_scale[e] = q.weight, q.weight_scale
    assert torch.equal(istack.dequantize(torch.bfloat16)[1], int8.dequantize(int8.quantize(w[1])).bfloat16())
