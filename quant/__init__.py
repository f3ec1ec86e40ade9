"""Quantized weight formats for dgemma (NVFP4, INT8).

This package is independent of `dgemma_cli` and never imports it. The engine's seam for it is
`dgemma_cli.model`: every projection is a module with `forward(x)` and the routed experts are a module
with `forward(x, top_k_index, top_k_weights)`, so a quantized module can replace either one.
Here now: `nvfp4` (NVIDIA ModelOpt's layout: pack/unpack, reference quantize/dequantize) and `int8` (dgemma's
per-output-channel symmetric format), tested against hand-computed values. Still to come with the quantization
issues: the quantized modules, checkpoint reading/writing, the converter, better-than-absmax scales, and kernels.
"""
