"""What an NVFP4 expert tile costs in issued instructions on sm_90 with the tokens as wgmma's M (the MoE kernels'
orientation) against the tokens as its N (swap-AB: the decoded weights as the A operand), from compiled SASS.

    .venv/bin/python scripts/swap_ab_sass.py

No GPU: each variant is compiled for sm_90 with Triton's bundled ptxas (quant/kernels/aot.py's tools) and its loop
counted. Each loop step decodes a weight tile of ROWS x 128 inputs with the project's decode (common.load_nvfp4_tile)
and multiplies it with a tile of tokens. Printed per variant: the loop's warp-instructions an iteration, the
instructions per decoded weight (x warps / (ROWS x 128)), the tensor-core instruction. "tokens as N, 4 x 16 if"
keeps four accumulators of 16 tokens and runs the second to fourth product only when the expert has that many
tokens (a token granularity of 16 with one decode per expert: the only way Triton's power-of-two tiles give one);
its token loads are left unmasked, which if anything counts in its favour.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from quant.kernels import aot  # noqa: E402
from quant.kernels.common import load_nvfp4_tile  # noqa: E402

BLOCK_K = 128


@triton.jit
def expert_tile(x_ptr, w_ptr, s_ptr, out_ptr, n_tok, H, NT: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_K: tl.constexpr, TOKENS_AS_N: tl.constexpr):
    """One loop over H: decode a ROWS x BLOCK_K weight tile, multiply it with NT tokens, the tokens as the product's
    M (acc [NT, ROWS], the MoE kernels' order) or, TOKENS_AS_N, as its N (acc [ROWS, NT], swap-AB)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    t = tl.arange(0, NT)
    if TOKENS_AS_N:
        acc = tl.zeros((ROWS, NT), dtype=tl.float32)
    else:
        acc = tl.zeros((NT, ROWS), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = load_nvfp4_tile(w_ptr, s_ptr, rows.to(tl.int64), k0, H, 0, ROWS, BLOCK_K, False, False, False)
        x = tl.load(x_ptr + t[:, None] * H + rk[None, :], mask=(t < n_tok)[:, None], other=0.0)
        if TOKENS_AS_N:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if TOKENS_AS_N:
        tl.store(out_ptr + rows[:, None] * NT + t[None, :], acc)
    else:
        tl.store(out_ptr + t[:, None] * ROWS + rows[None, :], acc)


@triton.jit
def tokens_as_n_4x16(x_ptr, w_ptr, s_ptr, out_ptr, n_tok, H, NT: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    t = tl.arange(0, NT)
    acc0 = tl.zeros((ROWS, NT), dtype=tl.float32)
    acc1 = tl.zeros((ROWS, NT), dtype=tl.float32)
    acc2 = tl.zeros((ROWS, NT), dtype=tl.float32)
    acc3 = tl.zeros((ROWS, NT), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = load_nvfp4_tile(w_ptr, s_ptr, rows.to(tl.int64), k0, H, 0, ROWS, BLOCK_K, False, False, False)
        acc0 = tl.dot(w, tl.trans(tl.load(x_ptr + t[:, None] * H + rk[None, :])), acc0)
        if n_tok > NT:
            acc1 = tl.dot(w, tl.trans(tl.load(x_ptr + (t + NT)[:, None] * H + rk[None, :])), acc1)
        if n_tok > 2 * NT:
            acc2 = tl.dot(w, tl.trans(tl.load(x_ptr + (t + 2 * NT)[:, None] * H + rk[None, :])), acc2)
        if n_tok > 3 * NT:
            acc3 = tl.dot(w, tl.trans(tl.load(x_ptr + (t + 3 * NT)[:, None] * H + rk[None, :])), acc3)
    at = out_ptr + rows[:, None] * (4 * NT) + t[None, :]
    tl.store(at, acc0)
    tl.store(at + NT, acc1)
    tl.store(at + 2 * NT, acc2)
    tl.store(at + 3 * NT, acc3)


def loop_count(fn, tokens: int, rows: int, warps: int, **flags) -> tuple[int, list[str]]:
    """(warp-instructions of the kernel's one loop an iteration, its tensor-core instructions) on sm_90, specialised
    as a launch at the real shapes would be (aot.specialise: 16-byte aligned pointers, H = 2816 divisible by 16).
    flags: the kernel's own constexprs by name."""
    import torch

    meta = dict(device="meta")
    args = (torch.empty(tokens * 4 * 2816, dtype=torch.bfloat16, **meta), torch.empty(16, dtype=torch.int32, **meta),
            torch.empty(16, dtype=torch.uint8, **meta), torch.empty(16, dtype=torch.float32, **meta), 50, 2816,
            tokens, rows, BLOCK_K)
    job = aot.specialise(aot.Launch(fn=fn, args=args, kwargs=dict(flags, num_warps=warps, num_stages=3),
                                    grid=(1,)), 90)
    k = triton.compile(ASTSource(job.fn, job.signature, job.constexprs, job.attrs), target=GPUTarget("cuda", 90, 32),
                       options=job.options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(k.asm["cubin"])
        instrs = aot.parse_sass(aot._run(aot.tool_dir() / "cuobjdump", "-sass", str(cubin)))
    loops = aot.find_loops(instrs)
    if len(loops) != 1:
        raise SystemExit(f"{fn.__name__}: expected one loop in the SASS, found {len(loops)}")
    return loops[0]["instrs"], sorted({op for _, op, _ in instrs if "MMA" in op})


def main() -> int:
    if (why := aot.missing_tools()) is not None:
        print(f"swap_ab_sass: {why}", file=sys.stderr)
        return 1
    print("| variant | tokens | weight rows | warps | loop instructions | per weight | tensor-core instruction |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, fn, tokens, rows, warps, flags in (
            ("tokens as M (the MoE kernels' order)", expert_tile, 64, 128, 4, dict(TOKENS_AS_N=False)),
            ("tokens as N", expert_tile, 64, 128, 4, dict(TOKENS_AS_N=True)),
            ("tokens as N", expert_tile, 64, 128, 8, dict(TOKENS_AS_N=True)),
            ("tokens as N", expert_tile, 16, 128, 4, dict(TOKENS_AS_N=True)),
            ("tokens as N", expert_tile, 16, 64, 4, dict(TOKENS_AS_N=True)),
            ("tokens as N, 4 x 16 if", tokens_as_n_4x16, 16, 128, 4, {}),
            ("tokens as N, 4 x 16 if", tokens_as_n_4x16, 16, 64, 4, {})):
        n, tc = loop_count(fn, tokens, rows, warps, **flags)
        shown = f"{tokens} (4 x 16)" if fn is tokens_as_n_4x16 else str(tokens)
        print(f"| {name} | {shown} | {rows} | {warps} | {n} | {n * warps / (rows * BLOCK_K):.3f} | "
              f"{', '.join(tc)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
