"""Quantized weight formats for dgemma (NVFP4, INT8, FP8/INT8 W8A8).

This package is independent of `dgemma_cli` and never imports it. The engine's seam for it is
`dgemma_cli.model`: every projection is a module with `forward(x)` and the routed experts a module whose packed
weights `dequantize(dtype)` (or run through a fused kernel), so a quantized module can replace either one.

- `nvfp4`, `int8`: the formats (pack and unpack, quantize with absmax or searched scales, dequantize);
- `w8a8`: 8-bit channel weights with 8-bit per-token activations (compressed-tensors FP8 / INT8): the math, torch's
  FP8 and INT8 matmuls and their float32 emulation;
- `formats`: one module per published checkpoint layout (which checkpoints, tensor names, ignore lists, modules);
- `modules`: quantized linear layers and expert stacks, with a plain PyTorch reference forward;
- `convert`: the streaming, resumable, verified checkpoint writer the converter uses;
- `kernels`: Triton kernels for the same functions, chosen by DGEMMA_KERNELS.
"""

from . import probes  # noqa: E402, F401 - registers each kernel family's first-use problem (quant/kernels/probe.py)
