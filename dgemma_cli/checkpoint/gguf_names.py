"""Where each of dgemma's parameters lies in a DiffusionGemma GGUF: the `diffusion-gemma` converter's tensor names
(llama.cpp's gemma4 names plus the diffusion decoder's own), the only place that knows them.

Our names are the network's (dgemma_cli/model.py, as checkpoint/weights.py expected_tensors lists them):
`layers.N.self_attn.q_proj.weight`, `layers.N.experts.gate_up_proj`, the per-layer scalars `decoder_layer_scalar.N` and
`encoder_layer_scalar.N`. The GGUF stores every matrix in ggml order ([in, out]), which its reader gives back in
torch order (gguf_file.py), so a name is all that maps: the experts' fused gate-up stack [E, 2I, H] is gate then up
as ours, norms hold the plain multiplicative weight (DiffusionGemma's RMSNorm multiplies by it; no +1 as some
llama.cpp converters store for Gemma), and the full-attention layers have no `attn_v` (they use K as V, as ours have
no v_proj there). `rope_freqs` (the full layers' proportional RoPE factors) is not read: the config gives the same.
"""

from __future__ import annotations

import re

TOP = {
    "embed_tokens.weight": "token_embd.weight",  # the tied head as well: no output.weight
    "norm.weight": "output_norm.weight",
    "self_conditioning.pre_norm.weight": "self_cond_pre_norm.weight",
    "self_conditioning.gate_proj.weight": "self_cond_gate.weight",
    "self_conditioning.up_proj.weight": "self_cond_up.weight",
    "self_conditioning.down_proj.weight": "self_cond_down.weight",
}
LAYER = {  # in layers.N. -> in blk.N.
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
}
SCALARS = {"decoder_layer_scalar": "layer_output_scale", "encoder_layer_scalar": "enc_layer_output_scale"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def gguf_name(ours: str) -> str:
    """The GGUF tensor name of one of our parameter names; KeyError for a name the layout does not have."""
    if ours in TOP:
        return TOP[ours]
    kind, _, index = ours.partition(".")
    if kind in SCALARS and index.isdigit():
        return f"blk.{index}.{SCALARS[kind]}"
    m = _LAYER.match(ours)
    if m and m[2] in LAYER:
        return f"blk.{m[1]}.{LAYER[m[2]]}"
    raise KeyError(ours)


def find(tensors: dict, ours: str):
    """The file's tensor for one of our names, or None: by its converter name, else with its `.weight` suffix
    toggled (the transformers names without one, the scalars and the expert stacks, may be written either way)."""
    name = gguf_name(ours)
    other = name.removesuffix(".weight") if name.endswith(".weight") else name + ".weight"
    return tensors.get(name, tensors.get(other))


PACKED_LINEARS = ("self_attn", "mlp", "self_conditioning")  # projections kept as their blocks (not the router's)
FLOAT_KINDS = ("F32", "F16", "BF16")


def kept_packed(ours: str, kind: str) -> bool:
    """Whether one of our tensors is held as the file's bytes (quant/ggml_modules.py) rather than decoded at load:
    every routed expert stack, and the tied embedding and the attention, dense MLP and self-conditioning projections
    of a block type. Everything else (the router, norms, scalars) is decoded."""
    if ours.startswith("layers.") and ours.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return True
    if ours == "embed_tokens.weight":
        return kind not in FLOAT_KINDS
    parts = ours.split(".")
    return kind not in FLOAT_KINDS and ours.endswith(".weight") and len(parts) >= 3 and parts[-3] in PACKED_LINEARS
