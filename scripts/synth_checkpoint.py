"""Write a synthetic DiffusionGemma checkpoint of a requested size, in the published layout, with little memory.

The checkpoint is what `dgemma_cli.checkpoint.weights.load_model` reads: a `config.json` (model_type diffusion_gemma,
a `text_config`), safetensors shards of about `shard_gb` each listed by `model.safetensors.index.json`, the text
stack under `model.decoder.*`, experts as fused 3-D tensors (`experts.gate_up_proj [E, 2I, H]`,
`experts.down_proj [E, H, I]`), layer scalars `[1]` under `model.decoder.layers.N.layer_scalar` and
`model.encoder.language_model.layers.N.layer_scalar`, plus one vision tensor (`VISION_DUMMY`) that a loader must
never read. Tensor names and shapes come from building `dgemma_cli.model.DiffusionGemma` on the meta device and
mapping its parameters with `expected_tensors` / `checkpoint_name`, so they match the loader by construction.

Memory: each shard's header is written by hand and every tensor is streamed in chunks cut from one pool of random
values (`POOL_ELEMENTS`, at a random offset per chunk), so the writer holds the pool and nothing else, whatever
the checkpoint size, and writes at disk speed instead of random-number speed. No transformers needed.

Size: hidden 1024, moe_intermediate 512, vocab 16384 are fixed; the layer count (at least 2, so there is one
sliding and one full-attention layer) is chosen with 128 experts, then the expert count is fitted so the files
total about the requested size. Sizes are decimal: 1 GB = 1e9 bytes.

    python scripts/synth_checkpoint.py OUT_DIR --gb 3 [--dtype float32|bfloat16|float16] [--shard-gb 1]
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dgemma_cli.config import ModelConfig  # noqa: E402
from dgemma_cli.checkpoint.weights import INDEX_FILE, checkpoint_name, expected_tensors  # noqa: E402

GB = 1_000_000_000
PREFIX = "model.decoder."
VISION_DUMMY = "model.encoder.vision_tower.dummy"
VISION_DUMMY_SHAPE = (4096, 1024)  # 16 MB in float32: big enough that reading it would show in the page counts
CHUNK_ELEMENTS = 1 << 22  # values written at a time (16 MB in float32)
POOL_ELEMENTS = 2 * CHUNK_ELEMENTS  # random values drawn once; each chunk is a slice of them

SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Everything but the layer and expert counts, which `text_config_for` chooses.
BASE_TEXT = dict(vocab_size=16384, hidden_size=1024, intermediate_size=2048, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=128, global_head_dim=256, num_global_key_value_heads=1,
                 sliding_window=512, top_k_experts=8, moe_intermediate_size=512)
VISION_CONFIG = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2, head_dim=8)


def make_config(num_layers: int, num_experts: int, dtype: torch.dtype = torch.float32) -> dict:
    """A DiffusionGemma config.json as a dict (text stack sized by the two counts)."""
    text = dict(BASE_TEXT, num_hidden_layers=num_layers, num_experts=num_experts)
    dtype_name = next(k for k, v in DTYPES.items() if v == dtype)
    return {
        "model_type": "diffusion_gemma",
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "text_config": dict(text, model_type="diffusion_gemma_text", dtype=dtype_name),
        "vision_config": VISION_CONFIG,
        "canvas_length": 256,
        "dtype": dtype_name,
    }


def checkpoint_tensors(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every text tensor the loader expects, in the model's parameter order.

    Built on the meta device (no memory). The `[L]` layer-scalar parameters come out as one `[1]` tensor per
    layer and per mode, under the names `checkpoint_name` gives them.
    """
    from dgemma_cli.model import DiffusionGemma

    cfg = ModelConfig.from_dict(config)
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    L = cfg.text.num_hidden_layers
    return [(checkpoint_name(name, PREFIX), tuple(meta.shape)) for name, meta in expected_tensors(model).items()]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def text_bytes(config: dict, dtype: torch.dtype) -> int:
    """Bytes of the text tensors (what the loader reads) for a config."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return sum(_numel(s) for _, s in checkpoint_tensors(config)) * itemsize


def text_config_for(target_bytes: int, dtype: torch.dtype) -> dict:
    """Choose layers and experts so the whole checkpoint (text + vision dummy) is about `target_bytes`.

    Layers: the count that gets closest with 128 experts, at least 2. Experts: the size is linear in the expert
    count at a fixed layer count, so two probes give the slope; the count is rounded, at least top_k.
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    budget = target_bytes - _numel(VISION_DUMMY_SHAPE) * itemsize
    top_k = BASE_TEXT["top_k_experts"]
    one = text_bytes(make_config(1, 128, dtype), dtype)
    two = text_bytes(make_config(2, 128, dtype), dtype)
    per_layer, fixed = two - one, 2 * one - two
    layers = max(2, round((budget - fixed) / per_layer))
    lo = text_bytes(make_config(layers, top_k, dtype), dtype)
    hi = text_bytes(make_config(layers, top_k + 8, dtype), dtype)
    per_expert = (hi - lo) / 8
    experts = max(top_k, round(top_k + (budget - lo) / per_expert))
    return make_config(layers, experts, dtype)


def plan_shards(tensors: list[tuple[str, tuple[int, ...]]], itemsize: int,
                shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Split tensors, in order, into shards of at most `shard_bytes` (a larger tensor gets a shard of its own)."""
    shards: list[list] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = _numel(shape) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def random_pool(dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """POOL_ELEMENTS values drawn from N(0, 0.02^2), already in `dtype`."""
    return (torch.randn(POOL_ELEMENTS, generator=generator) * 0.02).to(dtype)


def write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], pool: torch.Tensor,
                generator: torch.Generator) -> int:
    """Write one safetensors file, streaming each tensor's values in chunks. Returns the file size.

    Layout: 8-byte little-endian header length, JSON header padded with spaces to a multiple of 8 (so every
    tensor's data stays aligned to its element size), then the tensors back to back in header order.
    Each chunk is a slice of `pool` (1-D, the checkpoint's dtype) at a random offset: the values' meaning does
    not matter, only that every byte is real data on disk.
    """
    dtype = pool.dtype
    itemsize = torch.empty(0, dtype=dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        nbytes = _numel(shape) * itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, shape in tensors:
            left = _numel(shape)
            while left:
                n = min(left, CHUNK_ELEMENTS)
                at = int(torch.randint(0, POOL_ELEMENTS - n + 1, (1,), generator=generator))
                chunk = pool[at : at + n]
                f.write(chunk.view(torch.uint8).numpy().data)
                left -= n
    return 8 + len(raw) + offset


def write_checkpoint(directory: Path, gb: float, dtype: torch.dtype = torch.float32, shard_gb: float = 1.0,
                     seed: int = 0, layers: int | None = None, experts: int | None = None) -> dict:
    """Write a synthetic checkpoint of about `gb` GB into `directory` (created if needed); with `layers` and
    `experts`, of exactly that many instead (`gb` is then not used).

    Returns a summary: total file bytes, text bytes (what a loader reads), shard count, layers, experts.
    The vision dummy is placed right after the embedding, inside a shard among text tensors, as in a real
    export where vision and text weights share files.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = make_config(layers, experts, dtype) if layers else text_config_for(int(gb * GB), dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    tensors = checkpoint_tensors(config)
    tensors.insert(1, (VISION_DUMMY, VISION_DUMMY_SHAPE))
    shards = plan_shards(tensors, itemsize, int(shard_gb * GB))
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    generator = torch.Generator().manual_seed(seed)
    pool = random_pool(dtype, generator)
    total = 0
    weight_map = {}
    for fname, shard in zip(names, shards):
        total += write_shard(directory / fname, shard, pool, generator)
        weight_map.update({name: fname for name, _ in shard})
    tensor_bytes = sum(_numel(s) for _, s in tensors) * itemsize
    index = {"metadata": {"total_size": tensor_bytes}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    text = config["text_config"]
    return {
        "directory": str(directory),
        "file_bytes": total,
        "text_bytes": tensor_bytes - _numel(VISION_DUMMY_SHAPE) * itemsize,
        "shards": len(shards),
        "layers": text["num_hidden_layers"],
        "experts": text["num_experts"],
        "dtype": str(dtype).replace("torch.", ""),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", type=Path, help="output directory (created if needed)")
    ap.add_argument("--gb", type=float, default=3.0, help="approximate checkpoint size in GB (1e9 bytes)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--shard-gb", type=float, default=1.0, help="approximate size of each shard in GB")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    info = write_checkpoint(args.directory, args.gb, DTYPES[args.dtype], args.shard_gb, args.seed)
    info["seconds"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
