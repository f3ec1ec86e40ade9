"""Write the compressed-tensors test fixtures (tests/fixtures/ct_*) with the real producer, llmcompressor.

A tiny random DiffusionGemma is built by transformers' own `DiffusionGemmaForBlockDiffusion.save_pretrained` (the
published layout: fused experts `experts.gate_up_proj [E, 2I, H]` / `experts.down_proj [E, H, I]`, a vision tower
beside the text stack), cast to bfloat16 as the published checkpoint is, and quantized by llmcompressor's
`model_free_ptq` on the CPU, which splits the fused experts into `experts.E.{gate,up,down}_proj` itself:

- ct_fp8_dynamic: scheme FP8_DYNAMIC (format float-quantized): e4m3 weights per output channel, bfloat16
  `weight_scale [N, 1]`, activations FP8 per token at run time; one `model.safetensors`.
- ct_int8_dynamic: scheme W8A8 (format int-quantized): int8 weights per output channel, the same scales and
  activations INT8 per token; the source is split into two shards first, so the output is sharded too
  (`model.safetensors.index.json`).

Both use the ignore list of the published releases (routers, vision tower, embed_vision, self-conditioning,
lm_head, and the embedding, which `model_free_ptq` would otherwise take for a linear weight by its name).

The producer does not run in the project's environment (llmcompressor pins an older transformers), so run it from
a throwaway one. Fixtures in the repository were written with torch 2.13.0 (CPU), transformers 5.17.0,
llmcompressor 0.14.0.1 and compressed-tensors 0.19.0:

    python3 -m venv /tmp/ctvenv
    /tmp/ctvenv/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    /tmp/ctvenv/bin/python scripts/make_ct_fixtures.py [--out tests/fixtures]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import checkpoints  # noqa: E402

# Small enough that each fixture is tens of KB, with both attention kinds (S F S), several kv geometries and
# dimensions that are multiples of 16 (what FP8 and INT8 tensor-core matmuls need on a GPU).
SPEC = dict(
    text=dict(vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32,
              num_global_key_value_heads=1, sliding_window=6, num_experts=4, top_k_experts=2,
              moe_intermediate_size=16,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    canvas_length=8,
)
# The tests' tiny vision tower with a short position table (the default, 10240 x 16 x 2, would be most of the file);
# dgemma never reads it, but it is there as in the published checkpoints.
VISION = dict(checkpoints.TINY_VISION, position_embedding_size=64)

# The published releases' ignore list, in compressed-tensors' syntax: exact module names or `re:` + a regex
# matched at the start of the module name. `model_free_ptq` picks tensors by name alone (any `*.weight` whose module
# name does not end in "norm"), so the embedding and the numbered norms (`post_feedforward_layernorm_1`, ...) must be
# named too, or it would try to quantize them.
IGNORE = ["lm_head", "re:.*embed_tokens$", "re:.*router.*", "re:.*vision_tower.*", "re:.*embed_vision.*",
          "re:.*self_conditioning.*", "re:.*layernorm_[0-9]+$"]

FIXTURES = {"ct_fp8_dynamic": ("FP8_DYNAMIC", 1, 11), "ct_int8_dynamic": ("W8A8", 2, 12)}  # scheme, shards, seed
KEEP = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
        "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def to_bfloat16(model) -> None:
    model.to(dtype=__import__("torch").bfloat16)


def reshard(directory: Path, shards: int) -> None:
    """Split model.safetensors into `shards` files with an index (tensors in file order, cut by count)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per:(i + 1) * per]}
        save_file(part, directory / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    (directory / "model.safetensors").unlink()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def make(out: Path, name: str, scheme: str, shards: int, seed: int, work: Path) -> None:
    import compressed_tensors
    import llmcompressor
    import torch
    import transformers
    from llmcompressor import model_free_ptq

    checkpoints.TINY_VISION = VISION  # read by build_checkpoint
    src = checkpoints.build_checkpoint(work / f"{name}-src", SPEC, seed=seed, tweak=to_bfloat16)
    if shards > 1:
        reshard(src, shards)
    tmp = work / name
    model_free_ptq(src, tmp, scheme=scheme, ignore=IGNORE, device="cpu")
    dest = out / name
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in sorted(tmp.iterdir()):
        if f.name in KEEP or (f.suffix == ".safetensors" and f.name.startswith("model-")):
            shutil.copyfile(f, dest / f.name)
    (dest / "PRODUCER.json").write_text(json.dumps({
        "script": "scripts/make_ct_fixtures.py", "scheme": scheme, "ignore": IGNORE, "seed": seed,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "llmcompressor": llmcompressor.__version__, "compressed-tensors": compressed_tensors.__version__},
    }, indent=2) + "\n")
    size = sum(f.stat().st_size for f in dest.iterdir())
    print(f"{dest}: {size / 1024:.0f} KB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        for name, (scheme, shards, seed) in FIXTURES.items():
            make(args.out, name, scheme, shards, seed, Path(work))


if __name__ == "__main__":
    main()
