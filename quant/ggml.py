"""GGUF's block types (llama.cpp's ggml quantizations) as dgemma reads them: each type's block, and its decode in
torch (the CPU path, and the reference its kernels are checked against).

A tensor of a block type is rows of blocks; a block holds `ELEMENTS[type]` consecutive weights of a row in
`BYTES[type]` bytes, little-endian, as ggml-common.h lays them out:

- Q8_0 (32 weights): f16 d, int8 q[32]; w = d q.
- Q5_0 (32): f16 d, qh[4] (bit j: the fifth bit of weight j), qs[16] (weight j in the low nibble of qs[j], weight
  j + 16 in its high nibble); w = d (q - 16). Q5_1 adds f16 m after d: w = d q + m.
- IQ4_NL (32): f16 d, qs[16] as Q5_0's; w = d IQ4_VALUES[q] (a non-linear grid of 16 values).
- Q4_K (256, eight sub-blocks of 32): f16 d, f16 dmin, 12 bytes of six-bit scales and mins (`_k_scales`), qs[128]
  (each 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high); w = d sc q - dmin mn.
- Q5_K (256): Q4_K's then qh[32] (bit i of qh[j]: the fifth bit of sub-block i's weight j) before qs[128].
- Q6_K (256, sixteen sub-blocks of 16): ql[128], qh[64], int8 scales[16], f16 d; w = d sc (q - 32).
- Q3_K (256, sixteen of 16): hmask[32], qs[64] (two bits each), 12 bytes of six-bit scales, f16 d;
  w = d (sc - 32) (q - 4 [the high bit clear]).
- IQ4_XS (256, eight of 32): f16 d, u16 scales_h, scales_l[4], qs[128]; w = d (sc - 32) IQ4_VALUES[q].

Other types (IQ3_S, IQ2_*, Q2_K, ...) are not read: `decode` refuses them by name.
"""

from __future__ import annotations

import torch

QK_K = 256
ELEMENTS = {"F32": 1, "F16": 1, "BF16": 1, "Q8_0": 32, "Q5_0": 32, "Q5_1": 32, "IQ4_NL": 32, "Q4_K": QK_K,
            "Q5_K": QK_K, "Q6_K": QK_K, "Q3_K": QK_K, "IQ4_XS": QK_K}
BYTES = {"F32": 4, "F16": 2, "BF16": 2, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24, "IQ4_NL": 18, "Q4_K": 144,
         "Q5_K": 176, "Q6_K": 210, "Q3_K": 110, "IQ4_XS": 136}
SUPPORTED = tuple(ELEMENTS)
BLOCK_KINDS = tuple(k for k in SUPPORTED if ELEMENTS[k] > 1)  # the quantized ones (not F32 / F16 / BF16)
# where each block type keeps its f16 halves (byte offsets in a block): d, and dmin / m where it has one
HALVES = {"Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
          "Q3_K": (108,), "IQ4_XS": (0,)}
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


class UnsupportedType(ValueError):
    """A block type dgemma does not read."""


def bits_per_weight(kind: str) -> float:
    return 8.0 * BYTES[kind] / ELEMENTS[kind]


def row_bytes(kind: str, columns: int) -> int:
    """Bytes of one row of `columns` weights in this type (columns a whole number of blocks)."""
    if kind not in ELEMENTS:
        raise UnsupportedType(kind)
    if columns % ELEMENTS[kind]:
        raise ValueError(f"a row of {columns} weights is not a whole number of {kind} blocks of {ELEMENTS[kind]}")
    return columns // ELEMENTS[kind] * BYTES[kind]


def decode(raw: torch.Tensor, kind: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """raw uint8 (the tensor's bytes, rows of blocks) -> the weights, shape `shape` (rows..., columns: the last
    dimension runs along the blocks), in `dtype`."""
    if kind not in ELEMENTS:
        raise UnsupportedType(kind)
    raw = raw.reshape(-1)
    if kind in ("F32", "F16", "BF16"):
        plain = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind]
        return raw.view(plain).reshape(shape).to(dtype)
    blocks = raw.reshape(-1, BYTES[kind])
    w = _DECODERS[kind](blocks)  # [blocks, ELEMENTS] float32
    return w.reshape(shape).to(dtype)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n, 1] float32: a little-endian half."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., k] uint8 -> [..., 2k]: the low nibbles, then the high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """[n, k] uint8 -> [n, k, count] uint8: bit i of each byte (i < count)."""
    shifts = torch.arange(count, dtype=torch.uint8, device=b.device)
    return (b[..., None] >> shifts) & 1


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _q5(b: torch.Tensor, offset: int) -> torch.Tensor:
    qh = _bits(b[:, offset : offset + 4], 8).reshape(-1, 32)  # byte k bit i: weight 8k + i
    q = _nibbles(b[:, offset + 4 :]) | (qh << 4)
    return q.float()


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_q5(b, 2) - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _q5(b, 4) + _f16(b[:, 2:4])


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=b.device)
    return _f16(b[:, :2]) * grid[_nibbles(b[:, 2:]).long()]


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> (scales [n, 8], mins [n, 8]), six bits each: bytes 0-3 hold scales 0-3 (low six
    bits) and the top two bits of scales 4-7; bytes 4-7 the same for the mins; bytes 8-11 the low four bits of
    scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    s = s.int()
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=1)
    return sc.float(), mn.float()


def _k_low(qs: torch.Tensor) -> torch.Tensor:
    """qs [n, 128] -> [n, 8, 32]: each 32 bytes give two sub-blocks, the low nibbles then the high."""
    q = qs.reshape(-1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).reshape(1, 1, 2, 1)
    return (q & 15).reshape(-1, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    q = _k_low(b[:, 16:144]).float()
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(-1, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    high = _bits(b[:, 16:48], 8).transpose(1, 2)  # [n, 8, 32]: bit i of qh[j] -> sub-block i, weight j
    q = (_k_low(b[:, 48:176]) | (high << 4)).float()
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(-1, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    dev = b.device
    ql = b[:, 0:128].reshape(-1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8, device=dev).reshape(1, 1, 2, 1)
    ql = (ql & 15).reshape(-1, 8, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8,
                                                              device=dev).reshape(1, 1, 4, 1)
    qh = (qh & 3).reshape(-1, 8, 32)
    q = ((ql | (qh << 4)).int() - 32).float().reshape(-1, 16, 16)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    return ((d * scales)[:, :, None] * q).reshape(-1, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    dev = b.device
    hmask, qs, s, d = b[:, 0:32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = (s[:, :8].reshape(-1, 1, 8) >> torch.tensor([0, 4], dtype=torch.uint8, device=dev).reshape(1, 2, 1))
    high = (s[:, 8:12].reshape(-1, 1, 4) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8,
                                                          device=dev).reshape(1, 4, 1))
    sc = ((low.reshape(-1, 16) & 15) | ((high.reshape(-1, 16) & 3) << 4)).int() - 32
    ql = qs.reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=dev).reshape(1, 1, 4, 1)
    ql = (ql & 3).reshape(-1, 16, 16).int()
    qh = _bits(hmask, 8).transpose(1, 2).reshape(-1, 16, 16).int()  # bit i of hmask[j]: block i / 2's weight
    q = ql - ((qh ^ 1) << 2)  # the high bit clear subtracts 4
    return ((d * sc.float())[:, :, None] * q.float()).reshape(-1, QK_K)


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    dev = b.device
    d = _f16(b[:, 0:2])
    high = b[:, 2:4].int()
    high = (high[:, 0] | (high[:, 1] << 8))[:, None] >> (2 * torch.arange(8, device=dev))[None]  # [n, 8]
    low = _nibbles_interleaved(b[:, 4:8])  # [n, 8]: sub-block 2k low nibble, 2k + 1 high
    sc = (low.int() | ((high & 3) << 4)) - 32
    q = b[:, 8:136].reshape(-1, 8, 1, 16) >> torch.tensor([0, 4], dtype=torch.uint8, device=dev).reshape(1, 1, 2, 1)
    q = (q & 15).reshape(-1, 8, 32).long()
    grid = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=dev)
    return ((d * sc.float())[:, :, None] * grid[q]).reshape(-1, QK_K)


def _nibbles_interleaved(b: torch.Tensor) -> torch.Tensor:
    """[n, k] -> [n, 2k]: byte j's low nibble at 2j, its high nibble at 2j + 1."""
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(b.shape[0], -1)


_DECODERS = {"Q8_0": _q8_0, "Q5_0": _q5_0, "Q5_1": _q5_1, "IQ4_NL": _iq4_nl, "Q4_K": _q4_k, "Q5_K": _q5_k,
             "Q6_K": _q6_k, "Q3_K": _q3_k, "IQ4_XS": _iq4_xs}


def randomize_blocks_(raw: torch.Tensor, kind: str, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Fill uint8 `raw` (whole blocks of `kind`, any shape, on any device) in place with random blocks as
    `random_blocks` makes them: random bytes, each f16 half in [-scale, scale]. For random models at real shapes
    (dgemma bench's GGUF formats), made where they live."""
    blocks = raw.view(-1, BYTES[kind])
    blocks.copy_(torch.randint(0, 256, blocks.shape, generator=generator, device=raw.device, dtype=torch.int32))
    for at in HALVES[kind]:
        halves = ((torch.rand(blocks.shape[0], generator=generator, device=raw.device) * 2 - 1) * scale)
        blocks[:, at : at + 2] = halves.to(torch.float16).view(torch.uint8).view(-1, 2)
    return raw


def random_blocks(kind: str, rows: int, columns: int, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """uint8 [rows, row bytes]: random blocks of a block type whose f16 halves are in [-scale, scale] (random bytes
    there would be NaN or huge): the doctor's probe, and tests."""
    n = rows * columns // ELEMENTS[kind]
    raw = torch.randint(0, 256, (n, BYTES[kind]), generator=generator, dtype=torch.uint8)
    for at in HALVES[kind]:
        halves = ((torch.rand(n, generator=generator) * 2 - 1) * scale).to(torch.float16)
        raw[:, at : at + 2] = halves.view(torch.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)
