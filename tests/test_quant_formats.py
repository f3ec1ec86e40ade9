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
