"""Tiny DiffusionGemma GGUFs in the `diffusion-gemma` converter's layout, written by the llama.cpp project's own `gguf`
library from a checkpoint the reference wrote, and their twins: the same checkpoint with every weight replaced by
what `gguf.dequantize` reads from the file (the reference runs the twin; dgemma runs the GGUF).

Types are spread over the tensors as real files mix them: the embedding Q6_K, the matrices in turn each block type
dgemma reads and F16 / BF16, norms, scalars and the router's scales F32. `gguf.quantize` writes the types it has a
quantizer for (Q8_0, Q5_0, Q5_1, BF16); the K and IQ types get random blocks whose f16 scales are set so the
weights have the tensor's own spread (every weight of those types is linear in its block's halves).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

# A spec whose matrices' rows are whole K-type blocks (256 columns): every type dgemma reads fits somewhere; four
# layers, so that experts can stream (two buffers and a resident layer).
GGUF_SPEC = dict(
    text=dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
              num_key_value_heads=1, head_dim=128, global_head_dim=256, num_global_key_value_heads=1,
              sliding_window=8, num_experts=4, top_k_experts=2, moe_intermediate_size=256,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]),
    canvas_length=16,
)
MATRIX_TYPES = ("Q8_0", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "IQ4_XS", "F16", "BF16")


def random_blocks(kind: str, value: np.ndarray, seed: int) -> np.ndarray:
    """uint8 [..., row bytes]: random blocks of `kind` for a tensor shaped like `value`, its weights scaled to
    `value`'s standard deviation."""
    import gguf
    from quant import ggml
    from quant.ggml import HALVES

    rng = np.random.default_rng(seed)
    n = value.size // ggml.ELEMENTS[kind]
    raw = rng.integers(0, 256, size=(n, ggml.BYTES[kind]), dtype=np.uint8)
    halves = rng.uniform(-1, 1, size=(n, len(HALVES[kind])))

    def put(h: np.ndarray) -> None:
        for j, at in enumerate(HALVES[kind]):
            raw[:, at : at + 2] = h[:, j].astype(np.float16).view(np.uint8).reshape(n, 2)

    put(halves)
    spread = float(gguf.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).std())
    put(halves * (float(value.std()) / max(spread, 1e-12)))
    return raw.reshape(*value.shape[:-1], -1)


def encode(kind: str, value: np.ndarray, seed: int) -> tuple[np.ndarray, object]:
    """(array for GGUFWriter.add_tensor, raw_dtype or None) for float32 `value` in `kind`."""
    import gguf

    T = gguf.GGMLQuantizationType
    if kind == "F32":
        return value.astype(np.float32), None
    if kind == "F16":
        return value.astype(np.float16), None
    if kind in ("Q8_0", "Q5_0", "Q5_1", "BF16"):
        return gguf.quantize(value.astype(np.float32), getattr(T, kind)), getattr(T, kind)
    return random_blocks(kind, value, seed), getattr(T, kind)


# The converter's names (llama.cpp's `diffusion-gemma` converter), from transformers' names: written here apart from
# dgemma's own table (dgemma_cli/checkpoint/gguf_names.py), so that a wrong entry there shows as other tokens.
CONVERTER_TOP = {
    "model.decoder.embed_tokens.weight": "token_embd.weight",
    "model.decoder.norm.weight": "output_norm.weight",
    "model.decoder.self_conditioning.pre_norm.weight": "self_cond_pre_norm.weight",
    "model.decoder.self_conditioning.gate_proj.weight": "self_cond_gate.weight",
    "model.decoder.self_conditioning.up_proj.weight": "self_cond_up.weight",
    "model.decoder.self_conditioning.down_proj.weight": "self_cond_down.weight",
}
CONVERTER_LAYER = {  # model.decoder.layers.N.<key> -> blk.N.<value>
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight", "experts.down_proj": "ffn_down_exps.weight",
    "layer_scalar": "layer_output_scale",
}


def converter_name(hf: str) -> str | None:
    """The GGUF name of a transformers tensor of the text stack, None for what a GGUF does not hold (vision)."""
    if hf in CONVERTER_TOP:
        return CONVERTER_TOP[hf]
    for prefix, table in (("model.decoder.layers.", CONVERTER_LAYER),
                          ("model.encoder.language_model.layers.", {"layer_scalar": "enc_layer_output_scale"})):
        if hf.startswith(prefix):
            n, _, rest = hf[len(prefix):].partition(".")
            return f"blk.{n}.{table[rest]}" if rest in table else None
    return None


def write_metadata(w, cfg, arch: str) -> None:
    """The config's keys, as scripts/make_gguf_shaped.py writes them (the converter's)."""
    import sys

    scripts = str(Path(__file__).resolve().parent.parent / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    from make_gguf_shaped import write_metadata as write

    write(w, cfg, arch)


def write_tokenizer(w, src: Path) -> None:
    """`src`'s tokenizer.json and chat template as the `diffusion-gemma` converter writes Gemma 4's (model `gemma4`:
    every token by id, its type, the merges, the control ids, no space prefix, the template)."""
    import json

    spec = json.loads((Path(src) / "tokenizer.json").read_text())
    tokens = dict(spec["model"]["vocab"])
    special = set()
    for t in spec["added_tokens"]:
        tokens[t["content"]] = t["id"]
        if t.get("special"):
            special.add(t["id"])
    by_id = sorted(tokens.items(), key=lambda kv: kv[1])
    assert [i for _, i in by_id] == list(range(len(by_id)))
    w.add_tokenizer_model("gemma4")
    w.add_token_list([t for t, _ in by_id])
    w.add_token_scores([0.0] * len(by_id))
    w.add_token_types([3 if i in special else 6 if t.startswith("<0x") and len(t) == 6 else 1 for t, i in by_id])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    for name, value in (("bos", "<bos>"), ("eos", "<eos>"), ("unk", "<unk>"), ("pad", "<pad>")):
        getattr(w, {"bos": "add_bos_token_id", "eos": "add_eos_token_id", "unk": "add_unk_token_id",
                    "pad": "add_pad_token_id"}[name])(tokens[value])
    w.add_uint32("tokenizer.ggml.mask_token_id", tokens["<mask>"])
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    template = Path(src) / "chat_template.jinja"
    if template.is_file():
        w.add_chat_template(template.read_text())


def write_gguf(src: Path, out: Path, *, types: dict[str, str] | None = None, drop=(), metadata: bool = True,
               arch: str = "diffusion-gemma", tokenizer: bool = False) -> dict[str, np.ndarray]:
    """`src` (a checkpoint directory, transformers' names) as a DiffusionGemma GGUF at `out`, named as the converter
    names its tensors; returns transformers' name -> the float32 weights the file holds (gguf.dequantize of what was
    written). types: GGUF name -> type, overriding the spread above; drop: GGUF names left out of the file;
    tokenizer: the tokenizer in the file's metadata too (write_tokenizer)."""
    import gguf
    from safetensors.torch import load_file

    from dgemma_cli.config import ModelConfig

    cfg = ModelConfig.from_dir(src)
    tensors = {}
    for f in sorted(Path(src).glob("model*.safetensors")):
        tensors.update(load_file(f))
    w = gguf.GGUFWriter(str(out), arch)
    if metadata:
        write_metadata(w, cfg, arch)
    if tokenizer:
        write_tokenizer(w, src)
    held, turn = {}, 0
    for hf, tensor in tensors.items():
        name = converter_name(hf)
        if name is None or name in drop:
            continue
        value = tensor.float().numpy().reshape(-1) if tensor.dim() == 0 else tensor.float().numpy()
        kind = (types or {}).get(name)
        if kind is None:
            if name == "token_embd.weight":
                kind = "Q6_K"
            elif value.ndim >= 2 and value.shape[-1] % 256 == 0 and "ffn_gate_inp" not in name:
                kind, turn = MATRIX_TYPES[turn % len(MATRIX_TYPES)], turn + 1
            else:
                kind = "F32"
        array, raw_dtype = encode(kind, value, seed=len(held))
        if raw_dtype is None:
            w.add_tensor(name, array)
        else:
            w.add_tensor(name, array, raw_dtype=raw_dtype)
        back = (gguf.dequantize(array, raw_dtype) if raw_dtype is not None else array).astype(np.float32)
        held[hf] = back.reshape(tensor.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def write_twin(src: Path, out: Path, held: dict[str, np.ndarray]) -> Path:
    """`src` rewritten with the GGUF's weights (`held`, transformers' names): every tensor of the text stack replaced
    by what the file holds, in float32, the rest (the vision tower) as it was. The reference loads it."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for f in sorted(Path(src).glob("model*.safetensors")):
        tensors.update(load_file(f))
    for name, value in held.items():
        tensors[name] = torch.from_numpy(value).reshape(tensors[name].shape).float()
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    for extra in Path(src).iterdir():
        if extra.suffix != ".safetensors" and extra.name != "model.safetensors.index.json" and extra.is_file():
            shutil.copyfile(extra, out / extra.name)
    config = json.loads((out / "config.json").read_text())
    config.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(config))
    return out
