"""Which block type each tensor of a GGUF gets in a llama.cpp quantization recipe ("mix"), approximated: what the
header-only file shaped like a published one is written with (scripts/make_gguf_shaped.py) and what the kernel
report's GGUF step installs (dgemma_cli/step_trace.py).

The Q4_K_M mix approximates llama.cpp's recipe: most matrices Q4_K, the embedding Q6_K, V and the down projections
Q6_K on the layers llama.cpp gives more bits (the first and last eighth, every third between), rows that are not
whole 256-weight blocks (the experts' down projections: 704 columns; the dense down: 2112) in llama.cpp's fallback
type (Q4_K -> Q5_0, Q6_K -> Q8_0), the router, every `.scale` and the norms F32. Q8_0: every matrix Q8_0. The real
files' per-layer choices differ in detail; the sizes come within a few percent (16.79 GB against the published
16.8; Q8_0 26.86 against 26.9).
"""

from __future__ import annotations

MIXES = {
    "q4_k_m": {"default": "Q4_K", "token_embd.weight": "Q6_K", "layers": 30,
               "more_bits": ("attn_v.weight", "ffn_down_exps.weight", "ffn_down.weight")},
    "q8_0": {"default": "Q8_0"},
}
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q3_K": "IQ4_NL", "IQ4_XS": "IQ4_NL"}
F32 = ("norm.weight", "ffn_gate_inp.weight", ".scale", "layer_output_scale", "rope_freqs")


def kind_of(name: str, mix: dict, columns: int) -> str:
    """The block type of the tensor GGUF calls `name` (rows of `columns` weights) in `mix` (a MIXES value)."""
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
