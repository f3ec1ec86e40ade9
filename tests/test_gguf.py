"""GGUF files (dgemma_cli/checkpoint/gguf_file.py) and their block types (quant/ggml.py), against the llama.cpp
project's own `gguf` library: its writer makes the fixtures, its `dequantize` is the reference for every type (its
quantizer writes the types it has one for; random blocks with sane scales stand for the K and IQ types, which it
only reads)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from dgemma_cli.checkpoint.gguf_file import ARCH, GGUFFile  # noqa: E402
from dgemma_cli.errors import ModelError  # noqa: E402
from quant import ggml  # noqa: E402
from quant.kernels.ggml_tile import ggml_tile, tile_order  # noqa: E402, F401  (the tile test's kernel uses them)

import triton.language as tl  # noqa: E402

T = gguf.GGMLQuantizationType
HALVES = ggml.HALVES  # where each type keeps its f16 scales (byte offsets in a block)


def blocks(kind: str, rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row bytes]: random blocks of `kind` whose halves are scales in [-1, 1]."""
    rng = np.random.default_rng(seed)
    n = rows * columns // ggml.ELEMENTS[kind]
    raw = rng.integers(0, 256, size=(n, ggml.BYTES[kind]), dtype=np.uint8)
    for at in HALVES[kind]:
        raw[:, at : at + 2] = rng.uniform(-1, 1, size=n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(HALVES))
def test_each_block_type_decodes_as_the_gguf_library_does(kind):
    """Bit for bit: quant/ggml.py's torch decode against gguf.dequantize, on random blocks."""
    raw = blocks(kind, 3, 2 * ggml.ELEMENTS[kind] if ggml.ELEMENTS[kind] == 256 else 256)
    want = gguf.dequantize(raw, getattr(T, kind))
    got = ggml.decode(torch.from_numpy(raw), kind, want.shape)
    assert got.shape == want.shape and np.array_equal(got.numpy(), want.astype(np.float32))


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q5_1"])
def test_the_librarys_own_quantization_reads_back(kind):
    """Weights quantized by gguf.quantize decode to what gguf.dequantize gives, near the weights themselves."""
    w = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    raw = gguf.quantize(w, getattr(T, kind))
    got = ggml.decode(torch.from_numpy(raw), kind, w.shape).numpy()
    assert np.array_equal(got, gguf.dequantize(raw, getattr(T, kind)).astype(np.float32))
    assert np.abs(got - w).max() < 0.1


def write(path, arch: str = ARCH, tensors=None, extra=None):
    """A GGUF file by the library's writer: `tensors` name -> (kind, array: floats for F32, blocks otherwise)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_uint32("diffusion.canvas_length", 256)
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    for name, (kind, array) in (tensors or {}).items():
        if kind == "F32":
            w.add_tensor(name, array)
        else:
            w.add_tensor(name, array, raw_dtype=getattr(T, kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def mixed() -> dict:
    """One tensor of each type dgemma reads, as a real file mixes them, and an F32 norm."""
    out = {f"blk.0.t_{k.lower()}": (k, blocks(k, 2, 256, seed=i)) for i, k in enumerate(sorted(HALVES))}
    out["output_norm.weight"] = ("F32", np.linspace(0.5, 1.5, 256, dtype=np.float32))
    return out


def test_a_file_reads_back_its_metadata_shapes_and_blocks(tmp_path):
    tensors = mixed()
    f = GGUFFile(write(tmp_path / "m.gguf", tensors=tensors))
    assert f.get("block_count") == 2 and f.get("diffusion.canvas_length") == 256
    assert set(f.tensors) == set(tensors)
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    for t in reader.tensors:
        ours = f.tensors[t.name]
        assert ours.kind == t.tensor_type.name and ours.shape == tuple(reversed(t.shape.tolist()))
        want = gguf.dequantize(t.data, t.tensor_type).reshape(ours.shape)
        got = ggml.decode(torch.from_numpy(np.array(ours.data)), ours.kind, ours.shape)
        assert np.array_equal(got.numpy(), want.astype(np.float32)), t.name


def test_a_split_file_is_read_from_its_first_part(tmp_path):
    tensors = list(mixed().items())
    write(tmp_path / "m-00001-of-00002.gguf", tensors=dict(tensors[:4]))
    write(tmp_path / "m-00002-of-00002.gguf", tensors=dict(tensors[4:]))
    f = GGUFFile(tmp_path / "m-00001-of-00002.gguf")
    assert set(f.tensors) == {n for n, _ in tensors}
    (tmp_path / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(ModelError, match="m-00002-of-00002.gguf is not beside it"):
        GGUFFile(tmp_path / "m-00001-of-00002.gguf")


def test_what_cannot_run_is_refused_in_one_line(tmp_path):
    """Another architecture, a file cut short, a tensor of a type dgemma does not read, a file that is no GGUF:
    each a ModelError of one line, naming what is wrong."""
    tensors = mixed()
    with pytest.raises(ModelError, match="architecture 'llama', not DiffusionGemma") as e:
        GGUFFile(write(tmp_path / "llama.gguf", arch="llama", tensors=tensors))
    lines = [str(e.value)]
    whole = write(tmp_path / "whole.gguf", tensors=tensors).read_bytes()
    for cut in (len(whole) - 100, 40):
        (tmp_path / "cut.gguf").write_bytes(whole[:cut])
        with pytest.raises(ModelError, match="not a whole GGUF file") as e:
            GGUFFile(tmp_path / "cut.gguf")
        lines.append(str(e.value))
    q2 = np.random.default_rng(0).integers(0, 256, size=(2, 84), dtype=np.uint8)  # Q2_K: 84 bytes a block
    with pytest.raises(ModelError, match="tensor blk.0.ffn_down_exps.weight is Q2_K, a type dgemma does not read") \
            as e:
        GGUFFile(write(tmp_path / "q2.gguf", tensors={"blk.0.ffn_down_exps.weight": ("Q2_K", q2)}))
    lines.append(str(e.value))
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(ModelError, match="not a GGUF file") as e:
        GGUFFile(tmp_path / "text.gguf")
    lines.append(str(e.value))
    assert all("\n" not in line for line in lines)


def test_the_real_models_keys_give_its_config(tmp_path):
    """A file with the real model's `diffusion-gemma.*` keys (as llama.cpp's converter writes them: per-layer kv
    heads, a sliding pattern a bool per layer) reads as the published config.json: the same layers, heads, experts
    and sizes (the vocabulary the file's token list: a short one here, its 262,144 strings take seconds to write)."""
    from dgemma_cli.config import DIFFUSIONGEMMA_26B_A4B, ModelConfig

    sliding = [(i + 1) % 6 != 0 for i in range(30)]
    w = gguf.GGUFWriter(str(tmp_path / "real.gguf"), ARCH)
    w.add_block_count(30)
    w.add_embedding_length(2816)
    w.add_feed_forward_length(2112)
    w.add_head_count(16)
    w.add_head_count_kv([8 if s else 2 for s in sliding])
    w.add_key_length(512)
    w.add_uint32(f"{ARCH}.attention.key_length_swa", 256)
    w.add_expert_count(128)
    w.add_expert_used_count(8)
    w.add_expert_feed_forward_length(704)
    w.add_sliding_window(1024)
    w.add_array(f"{ARCH}.attention.sliding_window_pattern", sliding)
    w.add_float32(f"{ARCH}.final_logit_softcapping", 30.0)
    w.add_context_length(262144)
    w.add_uint32("diffusion.canvas_length", 256)
    w.add_token_list([f"t{i}" for i in range(512)])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = ModelConfig.from_dict(GGUFFile(tmp_path / "real.gguf").config_dict(), source="real.gguf")
    want = ModelConfig.from_dict(DIFFUSIONGEMMA_26B_A4B)
    assert ours.text.layers == want.text.layers and ours.canvas_length == want.canvas_length
    assert ours.text.vocab_size == 512
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_experts",
                "top_k_experts", "num_hidden_layers", "num_attention_heads", "sliding_window",
                "final_logit_softcapping", "layer_types", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours.text, key) == getattr(want.text, key), key


def test_a_key_the_config_needs_is_named_when_missing(tmp_path):
    f = GGUFFile(write(tmp_path / "m.gguf", tensors=mixed()))
    with pytest.raises(ModelError, match=f"without {ARCH}.attention.head_count_kv"):
        f.config_dict()


@pytest.mark.parametrize("kind", sorted(HALVES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_pass_decode_kernel_equals_the_torch_decode(kind, dtype):
    """kernels/ggml_decode.py in Triton's interpreter: bit for bit quant/ggml.py's decode (which is gguf's), on rows
    whose tiles are partial, in float32 and rounded to bfloat16; and the packed modules take it where Triton runs."""
    from quant.kernels.ggml_decode import ggml_decode

    K = 768 if ggml.ELEMENTS[kind] == 256 else 288
    raw = ggml.random_blocks(kind, 19, K, torch.Generator().manual_seed(3))
    want = ggml.decode(raw, kind, (19, K), dtype)
    assert torch.equal(ggml_decode(raw, kind, (19, K), dtype), want)
    if dtype == torch.float32:  # and the torch decode is gguf's own
        assert np.array_equal(want.numpy(), gguf.dequantize(raw.numpy(), getattr(T, kind)).astype(np.float32))


def test_the_packed_stacks_decode_with_the_kernel_where_triton_runs(monkeypatch):
    import quant.kernels.ggml_decode as kernel
    from quant.ggml_modules import GGUFLinear, GGUFStack

    calls = []
    real = kernel.ggml_decode
    monkeypatch.setattr(kernel, "ggml_decode", lambda *a: calls.append(a[1]) or real(*a))
    stack = GGUFStack(3, 64, 256, "Q4_K")
    stack.weight.copy_(ggml.random_blocks("Q4_K", 3 * 64, 256, torch.Generator().manual_seed(0)).reshape(3, 64, -1))
    linear = GGUFLinear(256, 32, "Q6_K")
    linear.weight.copy_(ggml.random_blocks("Q6_K", 32, 256, torch.Generator().manual_seed(1)))
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")
    plain = stack.dequantize_experts(1, 3, torch.float32), linear.dequantize(torch.float32)
    assert calls == []
    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    fused = stack.dequantize_experts(1, 3, torch.float32), linear.dequantize(torch.float32)
    assert calls == ["Q4_K", "Q6_K"] and all(torch.equal(a, b) for a, b in zip(plain, fused))


@pytest.mark.parametrize("pair", ["Q4_K/Q5_0", "Q6_K/Q8_0", "Q5_K/Q5_1", "IQ4_XS/IQ4_NL"])
def test_gguf_experts_read_their_blocks_in_the_kernels_where_triton_runs(pair, monkeypatch):
    """QuantizedExperts over GGUF stacks: with Triton (here its interpreter) the MoE kernels read the blocks in their
    own tiles (no layer decoded), within the kernel tests' float32 tolerance of the reference path, which decodes;
    the published files' pairs (Q4_K_M's Q4_K / Q5_0 and Q6_K / Q8_0) and the slow path's types."""
    import quant.ggml_modules as modules
    from quant.ggml_modules import GGUFStack

    from dgemma_cli.model import QuantizedExperts

    g = torch.Generator().manual_seed(5)
    E, H, I, T = 3, 256, 64, 5
    gu_kind, dn_kind = pair.split("/")
    gu, dn = GGUFStack(E, 2 * I, H, gu_kind), GGUFStack(E, H, I, dn_kind)
    gu.weight.copy_(ggml.random_blocks(gu_kind, E * 2 * I, H, g, 0.002).reshape(gu.weight.shape))
    dn.weight.copy_(ggml.random_blocks(dn_kind, E * H, I, g, 0.002).reshape(dn.weight.shape))
    experts = QuantizedExperts(E, gu, dn)
    x = torch.randn(T, H, generator=g)
    index = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]])
    weights = torch.rand(T, 2, generator=g)
    calls = []
    real = modules.gguf_experts
    monkeypatch.setattr(modules, "gguf_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")
    want = experts(x, index, weights)
    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    got = experts(x, index, weights)
    assert calls == [1]
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def _tile_kernel():
    """A kernel that writes ggml_tile's tiles where tile_order says they belong: the matrix in K order (its names are
    the module's globals, which a jitted function resolves)."""
    import triton

    @triton.jit
    def tile_to_matrix(w_ptr, out_ptr, R, K, row_bytes, KIND: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        safe = tl.where(rows < R, rows, 0).to(tl.int64)
        w_t = ggml_tile(w_ptr, safe, k0, K, row_bytes, KIND, BLOCK_N, BLOCK_K)  # [BLOCK_K, BLOCK_N]
        ks = k0 + tile_order(BLOCK_K, KIND)
        tl.store(out_ptr + rows[None, :] * K + ks[:, None], w_t, mask=(ks[:, None] < K) & (rows[None, :] < R))

    return tile_to_matrix


# the super-block types' tiles are 128 or 256 inputs (ggml_linear.block_k, moe_gate_up.gguf_block_k)
TILES = [(kind, bk) for kind in sorted(HALVES) for bk in (64, 128, 256) if bk >= 128 or ggml.ELEMENTS[kind] == 32]


@pytest.mark.parametrize("kind,block_k", TILES)
def test_the_matmul_tile_reads_each_block_type_exactly_in_its_own_order(kind, block_k):
    """kernels/ggml_tile.py in Triton's interpreter: every weight of the tiles the GGUF matmuls multiply by, put back
    where tile_order says it belongs, is bit for bit the torch decode (gguf's), on 19 rows (a partial row tile) and,
    for the 32-weight types, a K that ends inside a tile (its missing blocks read as 0, never read)."""
    import triton

    from quant.kernels.ggml_decode import KINDS

    K = 768 if ggml.ELEMENTS[kind] == 256 else 288
    raw = ggml.random_blocks(kind, 19, K, torch.Generator().manual_seed(block_k))
    out = torch.full((19, K), float("nan"))
    _tile_kernel()[(2, triton.cdiv(K, block_k))](raw, out, 19, K, ggml.row_bytes(kind, K), KINDS.index(kind), 16,
                                                 block_k)
    assert torch.equal(out, ggml.decode(raw, kind, (19, K)))


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_K", "Q6_K", "IQ4_XS"])
def test_gguf_linears_multiply_by_their_blocks_where_triton_runs(kind, monkeypatch):
    """GGUFLinear through kernels/ggml_linear.py (no decoded matrix): against x @ the torch decode, float32, with
    partial tiles in M, N and K; bfloat16 within its tolerance."""
    import quant.kernels.ggml_decode as decode_kernel
    from quant.ggml_modules import GGUFLinear

    g = torch.Generator().manual_seed(7)
    K = 512 if ggml.ELEMENTS[kind] == 256 else 160
    linear = GGUFLinear(K, 72, kind)
    linear.weight.copy_(ggml.random_blocks(kind, 72, K, g, 0.02))
    x = torch.randn(2, 9, K, generator=g)
    want = x.double() @ ggml.decode(linear.weight, kind, (72, K)).double().T
    monkeypatch.setattr(decode_kernel, "ggml_decode", lambda *a: pytest.fail("a GGUF linear decoded its matrix"))
    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    got = linear(x)
    assert got.shape == (2, 9, 72)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-6
    got16 = linear(x.bfloat16()).double()
    assert ((got16 - want).abs().max() / want.abs().max()).item() < 8e-3


def test_the_lean_header_reads_what_the_gguf_library_reads(tmp_path):
    """checkpoint/gguf_header.py against gguf.GGUFReader on a file with every metadata value type, small and long
    arrays of numbers and of strings (a tokenizer's), and a tensor of each type: the same values, the same tensors at
    the same offsets; a long string array is left in the map (its length at once, its strings when read)."""
    from dgemma_cli.checkpoint.gguf_header import SMALL, StringArray, read_header

    path = tmp_path / "h.gguf"
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_uint8("t.u8", 7), w.add_int8("t.i8", -7), w.add_uint16("t.u16", 65535), w.add_int16("t.i16", -3)
    w.add_uint32("t.u32", 4_000_000_000), w.add_int32("t.i32", -5), w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**40), w.add_int64("t.i64", -(2**40)), w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True), w.add_string("t.str", "héllo ▁world")
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.ints", [3, 1, 4, 1, 5])
    long_tokens = [f"▁t{i}" + "é" * (i % 3) for i in range(SMALL + 5)]
    w.add_token_list(long_tokens)
    w.add_token_scores([float(i) / 7 for i in range(SMALL + 5)])
    w.add_array("t.short_strings", ["a", "", "ü"])
    for name, (kind, array) in mixed().items():
        w.add_tensor(name, array, raw_dtype=None if kind == "F32" else getattr(T, kind))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()

    h = read_header(path)
    reader = gguf.GGUFReader(str(path))
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        want, got = field.contents(), h.metadata[name]
        if isinstance(got, StringArray):
            assert len(got) == len(want) and list(got) == want, name
        elif isinstance(got, np.ndarray):
            assert np.array_equal(got, np.array(want, dtype=got.dtype)), name
        else:
            assert got == want, name
    assert isinstance(h.metadata["tokenizer.ggml.tokens"], StringArray)
    assert h.metadata["tokenizer.ggml.tokens"][SMALL + 4] == long_tokens[-1]
    assert [(t.name, tuple(reversed(t.dims))) for t in h.tensors] == \
        [(t.name, tuple(reversed(t.shape.tolist()))) for t in reader.tensors]
    assert [t.offset for t in h.tensors] == [int(t.data_offset) for t in reader.tensors]


@pytest.mark.parametrize("kinds", ["Q4_K/Q4_K", "Q4_K/Q6_K", "Q5_0/Q8_0"])
def test_a_gguf_dense_mlp_runs_its_gate_and_up_in_one_launch(kinds, monkeypatch):
    """dgemma_cli.model.MLP over GGUF linears: with Triton the gate and up projections run as one GATED launch of
    kernels/ggml_linear.py (both block types read in their tiles, the activation in its epilogue), equal to the three
    ops of the torch path within float32's tolerance."""
    import quant.kernels.ggml_linear as kernel
    from quant.ggml_modules import GGUFLinear

    from dgemma_cli.model import MLP

    gk, uk = kinds.split("/")
    H, I = (256, 96) if gk != "Q5_0" else (96, 64)
    g = torch.Generator().manual_seed(11)
    mlp = MLP(H, I)
    mlp.gate_proj, mlp.up_proj = GGUFLinear(H, I, gk), GGUFLinear(H, I, uk)
    mlp.down_proj = GGUFLinear(I, H, "Q8_0")
    for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        m.weight.copy_(ggml.random_blocks(m.kind, m.out_features, m.in_features, g, 0.05))
    x = torch.randn(2, 7, H, generator=g)
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")
    want = mlp(x)
    calls = []
    real = kernel.ggml_linear
    monkeypatch.setattr(kernel, "ggml_linear", lambda *a, **k: calls.append("up" in k) or real(*a, **k))
    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    got = mlp(x)
    assert calls == [True, False]  # gate and up together, then the down projection
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
