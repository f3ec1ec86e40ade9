"""A GGUF shaped like a real DiffusionGemma file, without its weights: the real model's keys, tensor names, shapes and
block types (a llama.cpp quantization's mix), written by the `gguf` library's writer, with the data section left as a
sparse file of zeros (it takes no disk). What reads only a file's header (`dgemma plan`, `info`, `show`) sees the
published file; a run would decode zeros.

    .venv/bin/python scripts/make_gguf_shaped.py OUT.gguf [--mix q4_k_m|q8_0]

The mixes (which block type each tensor gets) are dgemma_cli/checkpoint/gguf_mixes.py's; the sizes come within a
few percent of the published files' (16.79 GB against the Q4_K_M's 16.8; Q8_0 26.86 against 26.9).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dgemma_cli.checkpoint.gguf_mixes import MIXES, kind_of  # noqa: E402

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
