"""Tiny random DiffusionGemma checkpoints in the real layout, written by the reference implementation.

Each spec is a small config; `build_checkpoint` saves it with transformers' `save_pretrained` (the same
layout as the published checkpoint: text stack under `model.decoder.*`, a vision tower beside it), adds a
generation_config.json with the published sampler defaults and a real tokenizer.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizer_fixture import build_tokenizer_files

# The published generation_config.json's values (docs/design.md, The sampler).
GENERATION_CONFIG = {
    "max_new_tokens": 256,
    "max_denoising_steps": 48,
    "sampler_config": {"entropy_bound": 0.1, "_cls_name": "EntropyBoundSamplerConfig"},
    "t_min": 0.4,
    "t_max": 0.8,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
    "eos_token_id": [1, 106, 50],
    "pad_token_id": 0,
    "bos_token_id": 2,
}

TINY_VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=8)

SPECS = {
    # The real 5:1 pattern (full attention at 5 and 11), prompt-sized window, several kv geometries.
    "five_to_one": dict(
        text=dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                  num_global_key_value_heads=1, sliding_window=8, num_experts=8, top_k_experts=2,
                  moe_intermediate_size=32),
        canvas_length=16,
    ),
    # Another pattern (S F S F), multi-query sliding layers, a larger top-k.
    "alternating": dict(
        text=dict(vocab_size=512, hidden_size=48, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=6, num_key_value_heads=1, head_dim=8, global_head_dim=16,
                  num_global_key_value_heads=3, sliding_window=6, num_experts=6, top_k_experts=3,
                  moe_intermediate_size=24,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
        canvas_length=8,
    ),
}


# A checkpoint that reads images: the real vision layout at a tiny size (grouped kv heads, standardized output, a
# position table big enough for a 3:1 image at 280 soft tokens), image tokens bidirectional in the encoder as in
# the published config, and the image token ids moved into the tiny vocabulary (onto unused placeholders).
VISION_SPEC = dict(
    text=dict(SPECS["five_to_one"]["text"], use_bidirectional_attention="vision"),
    canvas_length=16,
    vision=dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, position_embedding_size=1024,
                standardize=True),
    top=dict(boi_token_id=70, image_token_id=71, eoi_token_id=72),
)


def build_checkpoint(directory: Path, spec: dict, seed: int = 0, max_position_embeddings: int | None = None,
                     tweak=None) -> Path:
    """Write a random checkpoint. `tweak(model)` may edit weights before saving (e.g. to make it confident).

    A spec with a "vision" entry gets that vision tower, with its position table and standardization randomized
    (the reference initializes them to constants, which would hide a wrong wiring); "top" holds top-level config
    keys (the image token ids)."""
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    directory = Path(directory)
    text = dict(spec["text"])
    if max_position_embeddings is not None:
        text["max_position_embeddings"] = max_position_embeddings
    cfg = DiffusionGemmaConfig(text_config=text, vision_config=spec.get("vision", TINY_VISION),
                               canvas_length=spec["canvas_length"], **spec.get("top", {}))
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    with torch.no_grad():
        # Random init leaves the norms at 1 and the scalars at 1: perturb them so a wrong wiring shows.
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.add_(torch.randn_like(p) * 0.1)
        for i, layer in enumerate(model.model.decoder.layers):
            layer.layer_scalar.fill_(1.0 - 0.05 * i)
        for i, layer in enumerate(model.model.encoder.language_model.layers):
            layer.layer_scalar.fill_(1.0 - 0.03 * i)  # differs from the decoder's: each mode reads its own
        if "vision" in spec:
            tower = model.model.encoder.vision_tower
            table = tower.patch_embedder.position_embedding_table
            table.copy_(torch.randn_like(table) * 0.5)
            tower.std_bias.copy_(torch.randn_like(tower.std_bias) * 0.1)
            tower.std_scale.copy_(1.0 + torch.randn_like(tower.std_scale) * 0.1)
        if tweak is not None:
            tweak(model)
    model.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    build_tokenizer_files(directory, vocab_size=text["vocab_size"])
    return directory


def make_confident(model) -> None:
    """Make every position near-certain: the final norm keeps only hidden dim 0, and only two tokens have a
    non-zero embedding there (`<eos>` and one word), so each position predicts one of them with a logit at
    the soft cap. Canvases converge in a few steps (adaptive stopping fires) and end with `<eos>`."""
    dec = model.model.decoder
    dec.norm.weight.zero_()
    dec.norm.weight[0] = 1000.0
    emb = dec.embed_tokens.weight
    emb[:, 0] = 0.0
    emb[1, 0] = 1.0  # <eos>
    emb[300, 0] = -1.0


# ----------------------------------------------------------------------------- quantized checkpoints as float ones


def checkpoint_tensors(directory: Path) -> dict:
    """Every tensor of a checkpoint's weight files (model*.safetensors), by name."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(directory).glob("model*.safetensors")):
        out.update(load_file(f))
    return out


def write_float_copy(src: Path, out: Path, deq: dict, drop=(".input_scale",)) -> None:
    """`src` (a quantized checkpoint) rewritten as a plain float32 one: each quantized weight replaced by its
    dequantization `deq[name]`, scales dropped, per-expert projections (`experts.E.{gate,up,down}_proj`) stacked back
    into the fused layout (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), no quantization
    description. The engine loading it computes what the format's dequantization, evaluated exactly, gives."""
    import shutil

    import torch
    from safetensors.torch import save_file

    plain, experts = {}, {}
    for name, t in checkpoint_tensors(src).items():
        if name.endswith((".weight_scale", ".weight_scale_2") + tuple(drop)):
            continue
        value = deq.get(name, t.float() if t.is_floating_point() else t)
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            experts.setdefault(".".join(parts[: i + 1]), {})[(int(parts[i + 1]), parts[i + 2])] = value
            continue
        plain[name] = value
    for base, by in experts.items():
        E = 1 + max(e for e, _ in by)
        plain[base + ".gate_up_proj"] = torch.stack([torch.cat([by[(e, "gate_proj")], by[(e, "up_proj")]])
                                                     for e in range(E)])
        plain[base + ".down_proj"] = torch.stack([by[(e, "down_proj")] for e in range(E)])
    out.mkdir()
    save_file({k: v.contiguous() for k, v in plain.items()}, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    shutil.copyfile(src / "generation_config.json", out / "generation_config.json")


def first_step_logits(model, ids: list[int]):
    """The decoder's first-step logits [1, C, V] for one prompt's ids on a fixed random canvas (seed 1): what the
    format tests compare between a quantized checkpoint and its float twin."""
    import torch

    C = model.cfg.canvas_length
    with torch.no_grad():
        cache = model.new_cache(1, len(ids) + C)
        model.encode(torch.tensor([ids]), cache)
        canvas = torch.randint(0, model.cfg.text.vocab_size, (1, C), generator=torch.Generator().manual_seed(1))
        return model.denoise(canvas, cache, model.denoise_context(cache, 1))
