"""Quantized weight formats for dgemma (NVFP4, INT8).

This package is independent of `dgemma_cli` and never imports it. The engine's seam for it is
`dgemma_cli.model`: every projection is a module with `forward(x)` and the routed experts are a module
with `forward(x, top_k_index, top_k_weights)`, so a quantized module can replace either one.
The formats, quantized modules and kernels land here with the quantization issues.
"""
