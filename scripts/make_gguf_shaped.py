"""A GGUF shaped like a real DiffusionGemma file, without its weights: the real model's keys, tensor names, shapes and
block types (a llama.cpp quantization's mix), written by the `gguf` library's writer, with the data section left as a
sparse file of zeros (it takes no disk). What reads only a file's header (`dgemma plan`, `info`, `show`) sees the
published file; a run would decode zeros.

    .venv/bin/python scripts/make_gguf_shaped.py OUT.gguf [--mix q4_k_m|q8_0]

The Q4_K_M mix approximates llama.cpp's recipe: most matrices Q4_K, the embedding Q6_K, V and the down projections
Q6_K on the layers llama.cpp gives more bits (the first and last eighth, every third between), rows that are not
whole 256-weight blocks (the experts' down projections: 704 columns; the dense down: 2112) in llama.cpp's fallback
type (Q4_K -> Q5_0, Q6_K -> Q8_0), the router, every `.scale` and the norms F32. Q8_0: every matrix Q8_0. The real
files' per-layer choices differ in detail; the sizes come within a few percent (16.79 GB against the published
16.8; Q8_0 26.86 against 26.9).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MIXES = {
    "q4_k_m": {"default": "Q4_K", "token_embd.weight": "Q6_K", "layers": 30,
               "more_bits": ("attn_v.weight", "ffn_down_exps.weight", "ffn_down.weight")},
    "q8_0": {"default": "Q8_0"},
}
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q3_K": "IQ4_NL", "IQ4_XS": "IQ4_NL"}
F32 = ("norm.weight", "ffn_gate_inp.weight", ".scale", "layer_output_scale", "rope_freqs")


def kind_of(name: str, mix: dict, columns: int) -> str:
    from quant import ggml

    if name.endswith(F32) or name.rsplit(".", 1)[0].endswith(("_norm", "norm_1", "norm_2")):
        return "F32"
    short = name.split(".", 2)[-1] if name.startswith("blk.") else name
    kind = mix.get(short, mix["default"])
    if name.startswith("blk.") and short in mix.get("more_bits", ()):  # Q6_K on llama.cpp's use_more_bits layers
        i, n = int(name.split(".")[1]), mix["layers"]
        kind = "Q6_K" if i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2 else mix["default"]
    if columns % ggml.ELEMENTS[kind]:  # rows not whole K blocks (704, 2112 columns): llama.cpp's fallback type
        kind = FALLBACK[kind]
    return kind


def write_metadata(w, cfg, arch: str = "diffusion-gemma") -> None:
    """A ModelConfig's keys as the `diffusion-gemma` converter writes them (GGUFWriter `w`): what
    dgemma_cli/checkpoint/gguf_file.py config_dict reads back. tests/gguf_fixture.py writes its files with it too."""
    t, a = cfg.text, arch + "."
    sliding = [lt == "sliding_attention" for lt in t.layer_types]
    w.add_uint32(a + "block_count", t.num_hidden_layers)
    w.add_uint32(a + "context_length", t.max_position_embeddings)
    w.add_uint32(a + "embedding_length", t.hidden_size)
    w.add_uint32(a + "feed_forward_length", t.intermediate_size)
    w.add_uint32(a + "attention.head_count", t.num_attention_heads)
    w.add_array(a + "attention.head_count_kv", [s.num_kv_heads for s in t.layers])
    w.add_array(a + "attention.sliding_window_pattern", sliding)
    w.add_uint32(a + "attention.sliding_window", t.sliding_window)
    w.add_uint32(a + "attention.key_length", next(s.head_dim for s, sl in zip(t.layers, sliding) if not sl))
    w.add_uint32(a + "attention.key_length_swa", next(s.head_dim for s, sl in zip(t.layers, sliding) if sl))
    w.add_uint32(a + "expert_count", t.num_experts)
    w.add_uint32(a + "expert_used_count", t.top_k_experts)
    w.add_uint32(a + "expert_feed_forward_length", t.moe_intermediate_size)
    w.add_float32(a + "final_logit_softcapping", t.final_logit_softcapping)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", t.rms_norm_eps)
    w.add_uint32("diffusion.canvas_length", cfg.canvas_length)


def write(out: Path, mix_name: str) -> int:
    import gguf
    import torch

    from dgemma_cli.checkpoint.gguf_names import gguf_name
    from dgemma_cli.checkpoint.weights import expected_tensors
    from dgemma_cli.config import DIFFUSIONGEMMA_26B_A4B, ModelConfig
    from dgemma_cli.model import DiffusionGemma
    from quant import ggml

    cfg = ModelConfig.from_dict(DIFFUSIONGEMMA_26B_A4B)
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    mix, arch = MIXES[mix_name], "diffusion-gemma"
    w = gguf.GGUFWriter(str(out), arch)
    write_metadata(w, cfg, arch)
    data = 0
    for name, meta in expected_tensors(model).items():
        g = gguf_name(name)
        shape = tuple(meta.shape)
        kind = kind_of(g, mix, shape[-1])
        nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * ggml.row_bytes(kind, shape[-1]) if len(shape) > 1 \
            else shape[0] * 4
        byte_shape = (*shape[:-1], nbytes // max(1, int(np.prod(shape[:-1], dtype=np.int64)))) if len(shape) > 1 \
            else shape
        raw = None if kind == "F32" else getattr(gguf.GGMLQuantizationType, kind)
        w.add_tensor_info(g, byte_shape if raw is not None else shape, np.dtype(np.uint8 if raw else np.float32),
                          nbytes, raw_dtype=raw)
        data += -(-nbytes // 32) * 32  # each tensor's data aligned to 32 bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    start = -(-fout.tell() // 32) * 32
    w.close()
    with open(out, "r+b") as f:
        f.truncate(start + data)  # the data section: zeros, sparse
    return start + data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--mix", choices=sorted(MIXES), default="q4_k_m")
    args = ap.parse_args()
    size = write(args.out, args.mix)
    print(f"{args.out}: {size / 1e9:.2f} GB ({args.mix}, sparse: {args.out.stat().st_blocks * 512 / 1e6:.1f} MB "
          "on disk)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
