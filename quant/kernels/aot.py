"""Ahead-of-time compilation of dgemma's Triton kernels for real NVIDIA targets, on a machine without a GPU.

1. Capture (`record`, `real_shape_work`): the public entry points, `NVFP4Linear` / `Int8Linear` `.forward`,
   the expert stacks' `fused_experts` (W8A8 ones with 8-bit activations) and the fused head, are called at the
   real 26B-A4B shapes on CPU tensors whose data the kernels never read, with `JITFunction.run` replaced by a
   recorder and the kernels' `arch` answering the target's compute capability: every launch a call makes is kept
   with the arguments, grid, block sizes, warps and stages its wrapper would choose on that GPU (the first of its
   launch candidates: what runs before any tuning). The torch ops between launches run on the CPU and are metered
   (bytes read and written), so a call's estimated traffic includes its glue.
2. Specialise (`specialise`): per target, the launcher's own binder and `_pack_args` (pointers and ints divisible
   by 16, ints equal to 1 become constexprs), so each job is what a launch on that GPU would compile.
3. Compile (`compile_all`): `triton.compile(ASTSource, target=GPUTarget("cuda", cc, 32))` with Triton's bundled
   ptxas and a fresh cache (so ptxas runs and logs), in forked workers (a crashing compiler takes down its worker,
   not the report).
4. Inspect: ptxas -v (registers, spill bytes, stack), shared memory, and the SASS (`parse_sass`, `find_loops`):
   tensor-core opcodes and each top-level loop's instruction count and mix.

With TRITON_INTERPRET=1 set when triton is imported every @triton.jit becomes an interpreted function, so steps 1-3
need a process that imported triton without it: scripts/kernel_report.py drops it before importing anything, and
the tests start that script in a subprocess. Importing this module does not import triton.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import multiprocessing
import multiprocessing.connection
import os
import pkgutil
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# --------------------------------------------------------------------------------------- the real shapes

# docs/design.md, The model: hidden size, dense MLP width, expert width, experts, top-k, vocabulary, canvas
HIDDEN, DENSE, EXPERT, EXPERTS, TOP_K, VOCAB, CANVAS = 2816, 2112, 704, 128, 8, 262144, 256
BATCHES = (1, 4)  # canvases per denoise step
DTYPES = (torch.bfloat16, torch.float16)  # compute dtypes
# The linears a quantized checkpoint may hold, per denoise step over 25 sliding and 5 full layers:
# name -> (N out, K in, launches per step). Sliding: 16 heads x 256, 8 kv heads; full: 16 heads x 512, 2 kv heads,
# no v_proj (V comes from k_proj); the dense MLP's gate and up are separate linears.
LINEARS = {
    "q (sliding)": (16 * 256, HIDDEN, 25), "q (full)": (16 * 512, HIDDEN, 5),
    "k, v (sliding)": (8 * 256, HIDDEN, 50), "k (full)": (2 * 512, HIDDEN, 5),
    "o (sliding)": (HIDDEN, 16 * 256, 25), "o (full)": (HIDDEN, 16 * 512, 5),
    "mlp gate, up": (DENSE, HIDDEN, 60), "mlp down": (HIDDEN, DENSE, 30),
}
LAYERS = 30


class CaptureError(RuntimeError):
    pass


@dataclass
class Launch:
    """One recorded kernel launch."""

    fn: Any  # the JITFunction
    args: tuple
    kwargs: dict  # constexprs passed by name, launch options (num_warps, num_stages)
    grid: tuple[int, ...]
    torch_bytes: int = 0  # bytes the call's torch ops move, attributed to this launch

    @property
    def kernel(self) -> str:
        return self.fn.__name__

    def named(self) -> dict:
        """Arguments by parameter name (defaults applied), then the launch options."""
        names = set(self.fn.arg_names)
        bound = self.fn.signature.bind(*self.args, **{k: v for k, v in self.kwargs.items() if k in names})
        bound.apply_defaults()
        return {**bound.arguments, **{k: v for k, v in self.kwargs.items() if k not in names}}


@dataclass
class Work:
    """What one entry-point call does for one kernel family, with the call's floors."""

    family: str  # e.g. "NVFP4 linear", "MoE down (INT8)"
    label: str  # which layer, e.g. "q (sliding)"
    batch: int  # canvases
    dtype: str  # compute dtype
    count: int  # such calls per denoise step
    floor_bytes: int  # each weight and scale byte once, activations read once, outputs written once
    flops: int  # 2 x rows x N x K over the real (routed) rows
    launches: list[Launch] = field(default_factory=list)


# --------------------------------------------------------------------------------------- 1. capture


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor spans (a broadcast view spans its storage only)."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Meter(TorchDispatchMode):
    """Appends the bytes each torch op reads and writes to `events`: allocations and views move nothing."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        stores = {_storage(t) for t in ins}
        if func._schema.name.startswith("aten::empty"):
            moved = 0
        elif not func._schema.is_mutable and outs and all(_storage(t) in stores for t in outs):
            moved = 0  # a view
        else:
            seen, moved = set(), 0
            for t in ins:
                if _storage(t) not in seen:
                    seen.add(_storage(t))
                    moved += _nbytes(t)
            moved += sum(_nbytes(t) for t in outs)
        self.events.append(moved)
        return out


@contextlib.contextmanager
def _recording(events: list, cc: int):
    """JITFunction.run records instead of compiling. For the wrappers the device is a GPU of compute capability
    `cc`: `use_triton` answers True (DGEMMA_KERNELS=triton on the CPU would ask for the interpreter) and `arch` cc,
    so they choose the launch settings they would choose there."""
    from triton.runtime.jit import JITFunction

    import quant
    from quant import kernels

    for info in pkgutil.walk_packages(quant.__path__, "quant."):  # imported now, they bind the real functions
        importlib.import_module(info.name)

    def run(self, *args, grid, warmup, **kwargs):
        launch = Launch(self, args, kwargs, ())
        if callable(grid):
            grid = grid(launch.named())
        launch.grid = tuple(int(g) for g in grid)
        events.append(launch)
        if self.__name__ == "moe_place_kernel":
            _plan_as_the_kernel_would(launch.named())

    originals = {"use_triton": kernels.use_triton, "arch": getattr(kernels, "arch", None)}
    stand_ins = {"use_triton": lambda device: True, "arch": lambda device: cc}
    patched = [(m, name, original) for mod, m in list(sys.modules.items()) if mod.split(".")[0] == "quant"
               for name, original in originals.items() if original and getattr(m, name, None) is original]
    run_original, env = JITFunction.run, os.environ.get("DGEMMA_KERNELS")
    JITFunction.run = run
    for m, name, _ in patched:
        setattr(m, name, stand_ins[name])
    os.environ["DGEMMA_KERNELS"] = "triton"
    try:
        yield
    finally:
        JITFunction.run = run_original
        for m, name, original in patched:
            setattr(m, name, original)
        for mod, m in list(sys.modules.items()):  # a module imported meanwhile bound a stand-in: undo that too
            for name, stand_in in stand_ins.items():
                if mod.split(".")[0] == "quant" and getattr(m, name, None) is stand_in:
                    setattr(m, name, originals[name])
        if env is None:
            os.environ.pop("DGEMMA_KERNELS", None)
        else:
            os.environ["DGEMMA_KERNELS"] = env


def _plan_as_the_kernel_would(a: dict) -> None:
    """A recorded launch does not run, but the MoE kernels after the block plan are sized by its values (their live
    CTAs): write the plan the kernel would write (quant/kernels/moe_plan.py makes routing.moe_blocks' values) into
    its outputs. Not on the meta device (a traced step), where the report substitutes a plan itself (`routed`)."""
    from quant.kernels.routing import moe_blocks

    idx = a["idx_ptr"]
    if idx.is_meta:
        return
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # not metered: the kernel's own traffic is its launch's
        ids, block_expert = moe_blocks(idx[: a["N"]], a["E"], a["BLOCK_M"])
        a["ids_ptr"].copy_(ids)
        a["be_ptr"].copy_(block_expert)


def record(call: Callable[[], object], what: str, cc: int) -> list[Launch]:
    """Every launch `call()` makes, in order, as on a GPU of compute capability `cc`. Each torch op's bytes go to
    the next launch (the ops that prepare it), those after the last launch to the last one (those that finish)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise CaptureError("TRITON_INTERPRET=1 is set: the kernels are interpreted functions, nothing to compile "
                           "(run in a process that imported triton without it)")
    events: list = []
    with _recording(events, cc), _Meter(events):
        call()
    launches = [e for e in events if isinstance(e, Launch)]
    if not launches:
        raise CaptureError(f"{what} launched no Triton kernel (did it take its torch path?)")
    pending = 0
    for e in events:
        if isinstance(e, Launch):
            e.torch_bytes, pending = pending, 0
        else:
            pending += e
    launches[-1].torch_bytes += pending
    return launches


def _module_bytes(m: torch.nn.Module) -> int:
    return sum(_nbytes(b) for b in m.buffers())


def _linear_work(cc: int, batch: int, dtype: torch.dtype) -> list[Work]:
    from quant.modules import Int8Linear, NVFP4Linear

    rows, es, out = batch * CANVAS, dtype.itemsize, []
    for label, (n, k, count) in LINEARS.items():
        x = torch.empty(rows, k, dtype=dtype)
        for family, cls in (("NVFP4 linear", NVFP4Linear), ("INT8 linear", Int8Linear)):
            m = cls(k, n)
            if cls is NVFP4Linear:  # as NVIDIA's release stores it: a calibrated activation scale (W4A4 reads it)
                m.expect_input_scale()
            launches = record(lambda: m.forward(x), f"{cls.__name__}.forward", cc)
            out.append(Work(family, label, batch, str(dtype)[6:], count,
                            floor_bytes=_module_bytes(m) + es * rows * (k + n), flops=2 * rows * n * k,
                            launches=launches))
    # the W8A8 dense linears (kernels/w8a8_linear.py) where the target has the 8-bit tensor cores: q, k and v of a
    # sliding layer in one launch, the MLP's gate and up in one gated launch (the activations quantized before)
    from quant.kernels.moe_w8a8 import MIN_ARCH
    from quant.kernels.w8a8_linear import w8a8_linear

    for kind in ("int8", "fp8"):
        if cc < MIN_ARCH[kind] or dtype != torch.bfloat16:
            continue
        x = torch.empty(rows, HIDDEN, dtype=dtype)
        codes = (torch.empty(rows, HIDDEN, dtype=torch.int8 if kind == "int8" else torch.float8_e4m3fn),
                 torch.empty(rows, 1))

        def weights(n: int, k: int = HIDDEN):
            return (torch.empty(n, k, dtype=codes[0].dtype), torch.empty(n, 1))

        (q, k), (g, u) = (weights(16 * 256), weights(8 * 256)), (weights(DENSE), weights(DENSE))
        launches = record(lambda: w8a8_linear(x, codes, *q, more=[k, k]), f"w8a8_linear ({kind})", cc)
        out.append(Work(f"W8A8 linear ({kind.upper()})", "q, k, v (sliding)", batch, "bfloat16", 25,
                        floor_bytes=q[0].numel() + 2 * k[0].numel() + rows * HIDDEN + es * rows * 8192,
                        flops=2 * rows * 8192 * HIDDEN, launches=launches))
        launches = record(lambda: w8a8_linear(x, codes, *g, up=u), f"w8a8_linear gated ({kind})", cc)
        out.append(Work(f"W8A8 linear ({kind.upper()})", "mlp gate + up (gated)", batch, "bfloat16", LAYERS,
                        floor_bytes=2 * g[0].numel() + rows * HIDDEN + es * rows * DENSE,
                        flops=2 * 2 * rows * DENSE * HIDDEN, launches=launches))
    # the dense MLP's gate and up as the model runs them: one gated launch (W4A4: after one quantization of x)
    gate, up = NVFP4Linear(HIDDEN, DENSE), NVFP4Linear(HIDDEN, DENSE)
    for m in (gate, up):
        m.expect_input_scale()
    x = torch.empty(rows, HIDDEN, dtype=dtype)
    launches = record(lambda: gate.gated(x, up), "NVFP4Linear.gated", cc)
    out.append(Work("NVFP4 linear", "mlp gate + up (gated)", batch, str(dtype)[6:], LAYERS,
                    floor_bytes=2 * _module_bytes(gate) + es * rows * (HIDDEN + DENSE),
                    flops=2 * 2 * rows * DENSE * HIDDEN, launches=launches))
    return out


def _expert_work(cc: int, batch: int, dtype: torch.dtype, stacks: dict, top_i: torch.Tensor,
                 top_w: torch.Tensor) -> list[Work]:
    """The stacks' fused_experts launches in two stages: up to and including the kernel named *gate_up*, the gate-up
    stage; the launches after it (the down product, the sum over the top-k), the down stage. W8A8 stacks: the 8-bit
    activation kernels (a quantizer before each product, in its stage)."""

    rows, es = batch * CANVAS, dtype.itemsize
    assigned = rows * TOP_K
    touched = int(top_i.unique().numel())  # experts read at least once
    x = torch.empty(rows, HIDDEN, dtype=dtype)
    out = []
    for fmt, (gate_up, down) in stacks.items():
        what = f"fused_experts ({fmt})"
        launches = record(lambda: gate_up.fused_experts(down, x, top_i, top_w), what, cc)
        split = [i for i, launch in enumerate(launches) if "gate_up" in launch.kernel]
        if len(split) != 1 or split[0] == len(launches) - 1:
            raise CaptureError(f"{what} launched {[launch.kernel for launch in launches]}: expected one *gate_up* "
                               "kernel and the down stage after it (update aot._expert_work)")
        h = es * assigned * EXPERT  # the activation between the stages, real rows only
        stages = {  # (floor bytes, FLOPs, launches): weights of the touched experts; x read once, h written once;
            # h and the routing weights read once, the output written once
            "gate-up": (_module_bytes(gate_up) * touched // EXPERTS + es * rows * HIDDEN + h,
                        2 * assigned * 2 * EXPERT * HIDDEN, launches[:split[0] + 1]),
            "down": (_module_bytes(down) * touched // EXPERTS + h + 4 * assigned + es * rows * HIDDEN,
                     2 * assigned * HIDDEN * EXPERT, launches[split[0] + 1:]),
        }
        for stage, (floor, flops, group) in stages.items():
            out.append(Work(f"MoE {stage} ({fmt.upper()})", "experts", batch, str(dtype)[6:], LAYERS,
                            floor, flops, group))
    return out


def _head_work(cc: int, batch: int) -> Work:
    """The fused head at the real shapes (quant/kernels/head.py): the embedding on the meta device (1.5 GB: never
    made), the rest too."""
    from quant.kernels.head import HeadBuffers, fused_head

    rows, bf, meta = batch * CANVAS, torch.bfloat16, dict(device="meta")
    h, w = torch.empty(rows, HIDDEN, dtype=bf, **meta), torch.empty(VOCAB, HIDDEN, dtype=bf, **meta)
    t, u = torch.empty(rows, **meta), torch.empty(rows, 2, **meta)
    buf = HeadBuffers(rows, VOCAB, HIDDEN, bf, "meta")
    launches = record(lambda: fused_head(h, w, 30.0, HIDDEN**0.5, t, u, buf), "head", cc)
    # the embedding read once, the hidden rows read and the soft embedding written once, the draws out; the logits
    # and the soft embedding's matmuls
    return Work("fused head", "logits", batch, "bfloat16", 1,
                2 * VOCAB * HIDDEN + 2 * 2 * rows * HIDDEN + rows * (8 + 8 + 4), 2 * 2 * 2 * rows * VOCAB * HIDDEN,
                launches)


def _layer_glue_work(cc: int, batch: int) -> list[Work]:
    """The layer's fused glue at the real shapes: a norm with everything around it (pre-add, weight, residual,
    layer scale), the same with the two post-feed-forward norms before the add, the two pre-feed-forward norms of
    one input, a head norm with RoPE (sliding layers: 16 heads of 256), the router, the W8A8 MLP's gelu_tanh(gate) *
    up, and the logits' cap. Counts
    per step: 25 sliding layers' q and k norms; 30 layers' full residual updates and routers; one cap."""
    from quant.kernels.rmsnorm import rms_norm
    from quant.kernels.router import route
    from quant.kernels.softcap import softcap_into

    rows, bf = batch * CANVAS, torch.bfloat16
    x = torch.empty(rows, HIDDEN, dtype=bf)
    w, s = torch.empty(HIDDEN, dtype=bf), torch.empty((), dtype=bf)
    q = torch.empty(batch, CANVAS, 16, 256, dtype=bf)
    cos = torch.empty(batch, CANVAS, 1, 256, dtype=bf)
    out = []
    launches = record(lambda: rms_norm(x, w, 1e-6, a2=x, residual=x, scale=s), "rms_norm", cc)
    out.append(Work("norm + residual + scale", "residual", batch, "bfloat16", LAYERS, 4 * 2 * rows * HIDDEN, 0,
                    launches))
    launches = record(lambda: rms_norm(x, w, 1e-6, a2=x, residual=x, scale=s, a_weight=w, a2_weight=w),
                      "rms_norm (post-feed-forward)", cc)
    out.append(Work("3 norms + residual + scale", "residual", batch, "bfloat16", LAYERS, 4 * 2 * rows * HIDDEN, 0,
                    launches))
    launches = record(lambda: rms_norm(x, w, 1e-6, weight2=w), "rms_norm (two weights)", cc)
    out.append(Work("2 norms of one input", "residual", batch, "bfloat16", LAYERS, 3 * 2 * rows * HIDDEN, 0,
                    launches))
    launches = record(lambda: rms_norm(q, w[:256], 1e-6, cos=cos, sin=cos), "rms_norm (rope)", cc)
    out.append(Work("head norm + RoPE", "q", batch, "bfloat16", 50, 2 * 2 * q.numel(), 0, launches))
    router_w, pes = torch.empty(EXPERTS, HIDDEN, dtype=bf), torch.empty(EXPERTS, dtype=bf)
    launches = record(lambda: route(x, w, router_w, pes, TOP_K, 1e-6), "router", cc)
    out.append(Work("router", "router", batch, "bfloat16", LAYERS, 2 * rows * HIDDEN + 2 * EXPERTS * HIDDEN
                    + rows * TOP_K * 12, 2 * rows * EXPERTS * HIDDEN, launches))
    from quant.kernels.gelu_mul import gelu_mul

    h = torch.empty(rows, DENSE, dtype=bf)
    launches = record(lambda: gelu_mul(h, h), "gelu_mul", cc)
    out.append(Work("gated activation (W8A8 MLP)", "mlp", batch, "bfloat16", LAYERS, 3 * 2 * rows * DENSE, 0,
                    launches))
    logits = torch.empty(rows, VOCAB, dtype=bf, device="meta")  # canvas x vocab: no memory for it (never read)
    launches = record(lambda: softcap_into(torch.empty(rows, VOCAB, device="meta"), logits, 30.0), "softcap", cc)
    out.append(Work("logits cap", "logits", batch, "bfloat16", 1, (2 + 4) * rows * VOCAB, 0, launches))
    return out


@functools.lru_cache(maxsize=1)
def _expert_stacks() -> dict:
    """The expert stacks at the real shapes (about 3 GB, never written: the kernels' data is not read), made once and
    shared by every target, whose recorded launches keep them alive until the report is written."""
    from quant.modules import Int8Stack, NVFP4Stack, W8A8Stack

    stacks = {"nvfp4": (NVFP4Stack(EXPERTS, 2 * EXPERT, HIDDEN, segments=2), NVFP4Stack(EXPERTS, HIDDEN, EXPERT)),
              "int8": (Int8Stack(EXPERTS, 2 * EXPERT, HIDDEN), Int8Stack(EXPERTS, HIDDEN, EXPERT))}
    for stack in stacks["nvfp4"]:  # calibrated activation scales, as NVIDIA's release stores them
        stack.expect_input_scale()
        stack.input_scale.fill_(1.0)
    for kind in ("int8", "fp8"):
        stacks[f"w8a8-{kind}"] = (W8A8Stack(EXPERTS, 2 * EXPERT, HIDDEN, kind),
                                  W8A8Stack(EXPERTS, HIDDEN, EXPERT, kind))
    return stacks


def random_routing(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids) [rows, TOP_K] of a seeded random top-k of EXPERTS: about uniform load, the routing
    the report assumes (a trained router's load is its own)."""
    gen = torch.Generator().manual_seed(seed)
    top_w, top_i = torch.rand(rows, EXPERTS, generator=gen).softmax(-1).topk(TOP_K, dim=-1)
    return top_w / top_w.sum(-1, keepdim=True), top_i


def routed(args: dict, rows: int, seed: int) -> dict:
    """A launch's arguments with a MoE block plan that exists only on the meta device (a traced step: no routing
    ran) replaced by the plan of `random_routing(rows, seed)`, built by the same code (quant.kernels.routing), for the
    kernels' live-CTA counts."""
    from quant.kernels.routing import moe_blocks

    ids = args.get("ids_ptr")
    planned = "block_expert_ptr" in args or args.get("SKIP")  # a MoE kernel, or a quantizer skipping padding rows
    if not planned or not isinstance(ids, torch.Tensor) or not ids.is_meta:
        return args
    _, top_i = random_routing(rows, seed)
    n = top_i.numel()
    block = args.get("BLOCK_M") or next(m for m in (16, 32, 64, 128, 256)
                                        if (-(-n // m) + EXPERTS) * m == ids.numel())
    sorted_ids, block_expert = moe_blocks(top_i, EXPERTS, block)
    out = dict(args, ids_ptr=sorted_ids)
    if "block_expert_ptr" in args:
        out["block_expert_ptr"] = block_expert
    return out


def real_shape_work(cc: int, dtypes: tuple = DTYPES) -> list[Work]:
    """Every entry point at the real shapes, batch 1 and 4, in each compute dtype (bf16 and fp16), as launched on a
    GPU of compute capability `cc`; routing is a seeded random top-8 of 128 per token (about uniform load, as a
    trained router's is on average)."""
    from quant.kernels.moe_w8a8 import MIN_ARCH

    # compressed-tensors W8A8 experts where the target has the 8-bit tensor cores
    stacks = {fmt: pair for fmt, pair in _expert_stacks().items()
              if not fmt.startswith("w8a8-") or cc >= MIN_ARCH[fmt[5:]]}
    work = []
    for batch in BATCHES:
        rows = batch * CANVAS
        top_w, top_i = random_routing(rows, batch)
        for dtype in dtypes:
            work += _linear_work(cc, batch, dtype)
            work += _expert_work(cc, batch, dtype, stacks, top_i, top_w)
        work.append(_head_work(cc, batch))
        work += _layer_glue_work(cc, batch)
    return work


# --------------------------------------------------------------------------------------- 2. specialise


@dataclass
class Job:
    """One compilation: a kernel specialised for one target, as its launcher would compile it."""

    fn: Any
    cc: int
    signature: dict  # parameter name -> Triton type ("*bf16", "i32", "constexpr")
    constexprs: dict  # argument path -> value
    attrs: dict
    options: dict
    key: str = ""  # what makes two jobs the same compilation
    tag: str = ""  # a folder name: kernel, config, target

    @property
    def kernel(self) -> str:
        return self.fn.__name__

    @property
    def named_constexprs(self) -> dict:
        return {self.fn.arg_names[path[0]]: v for path, v in self.constexprs.items()}

    @property
    def config(self) -> str:
        """Constexprs (true flags by name; false ones and pointers passed as None, e.g. an unsplit launch's scratch,
        left out), the compute dtype (a 16-bit pointer's, else the first pointer's type), warps and stages."""
        parts = [k if v is True else f"{k}={v}" for k, v in self.named_constexprs.items()
                 if v is not False and v is not None]
        ptrs = [str(t)[1:] for t in self.signature.values() if str(t).startswith("*")]
        dtype = next((t for t in ptrs if t in ("bf16", "fp16")), ptrs[0] if ptrs else "")
        return " ".join(parts + [dtype, f"w{self.options['num_warps']} s{self.options['num_stages']}"])



_BACKENDS: dict[int, Any] = {}


def specialise(launch: Launch, cc: int) -> Job:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    backend = _BACKENDS.setdefault(cc, make_backend(GPUTarget("cuda", cc, 32)))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, spec, opts)
    job = Job(fn, cc, signature, constexprs, attrs, dict(options.__dict__))
    job.key = repr((fn.__module__, fn.__name__, cc, sorted(signature.items()), sorted(constexprs.items()),
                    sorted(attrs.items()), sorted(job.options.items())))
    job.tag = re.sub(r"[^A-Za-z0-9_.=-]", "", f"{job.kernel}__{job.config.replace(' ', '_')}__sm{cc}")
    return job


# --------------------------------------------------------------------------------------- 3. compile


def tool_dir() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def missing_tools() -> str | None:
    """Why nothing can be compiled here (triton or its bundled ptxas / cuobjdump absent), or None."""
    try:
        bin_dir = tool_dir()
    except ImportError:
        return "triton is not installed"
    absent = [t for t in ("ptxas", "cuobjdump") if not (bin_dir / t).exists()]
    return f"triton's bundled {', '.join(absent)} missing in {bin_dir}" if absent else None


def _ptxas_for(cc: int) -> Path:
    blackwell = tool_dir() / "ptxas-blackwell"  # Triton's ptxas for sm_100+ where it bundles two
    return blackwell if cc >= 100 and blackwell.exists() else tool_dir() / "ptxas"


def compile_job(job: Job, folder: Path) -> dict:
    """Compile one job (in this process) and inspect the result; artifacts go to `folder`."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # Triton prints ptxas -v's log to stdout
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    folder.mkdir(parents=True, exist_ok=True)
    src = ASTSource(job.fn, job.signature, job.constexprs, job.attrs)
    log, t0 = io.StringIO(), time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            k = triton.compile(src, target=GPUTarget("cuda", job.cc, 32), options=job.options)
    except Exception as e:  # noqa: BLE001 - the compiler's own error is the result
        (folder / "error.txt").write_text(traceback.format_exc() + "\n--- stdout ---\n" + log.getvalue())
        root = e
        while root.__cause__ is not None:  # a CompilationError wraps the error that stopped it
            root = root.__cause__
        lines = str(root).strip().splitlines() or [""]
        return dict(ok=False, error=f"{type(root).__name__}: {lines[-1]}"[:500], seconds=time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    cubin = folder / "kernel.cubin"
    cubin.write_bytes(k.asm["cubin"])
    for ext in ("ttgir", "ptx"):
        (folder / f"kernel.{ext}").write_text(k.asm[ext])
    ptxas_log = log.getvalue()
    if "Used" not in ptxas_log:  # a Triton that does not print it: run ptxas -v on the same PTX ourselves
        ptxas_log = _run(_ptxas_for(job.cc), "-v", f"--gpu-name=sm_{job.cc}{'a' if job.cc >= 90 else ''}",
                         str(folder / "kernel.ptx"), "-o", os.devnull, stderr=True)
    (folder / "ptxas.log").write_text(ptxas_log)
    sass = _run(tool_dir() / "cuobjdump", "-sass", str(cubin)) or _run(tool_dir() / "nvdisasm", "-c", str(cubin))
    (folder / "kernel.sass").write_text(sass)
    instrs = parse_sass(sass)
    usage = parse_ptxas(ptxas_log)
    return dict(ok=True, seconds=seconds, num_warps=k.metadata.num_warps, num_stages=k.metadata.num_stages,
                smem=k.metadata.shared + usage["static_smem"], **usage,
                tc_ops=sorted({op for _, op, _ in instrs if op.split(".")[0] in TC_OPS}),
                loops=find_loops(instrs), straight=straight_line(instrs), first_exit=first_exit(instrs))


def _run(*cmd, stderr: bool = False) -> str:
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    return res.stderr + res.stdout if stderr else res.stdout


def _serve(items: list[tuple[str, Job]], root: Path, conn) -> None:
    """A forked worker: compiles the jobs whose index it is sent (the list came with the fork) until None."""
    while (i := conn.recv()) is not None:
        job = items[i][1]
        try:
            conn.send(compile_job(job, root / job.tag))
        except Exception:  # noqa: BLE001 - reported, not raised: the parent goes on with the other jobs
            conn.send(dict(ok=False, error=traceback.format_exc()[-2000:]))


def compile_all(jobs: dict[str, Job], workers: int, root: Path, progress: Callable[[str], None] = print) -> dict:
    """key -> compile_job's result. `workers` forked processes take one job at a time (each keeps Triton's and
    LLVM's set-up from one job to the next); a job that kills its worker is reported as failed and a new worker
    takes over."""
    ctx = multiprocessing.get_context("fork")
    items = list(jobs.items())
    pending, busy, results = list(range(len(items))), {}, {}

    def start():
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(items, root, child), daemon=True)
        proc.start()
        child.close()
        return conn, proc

    idle = [start() for _ in range(min(workers, len(items)))]
    while pending or busy:
        while pending and idle:
            conn, proc = idle.pop()
            i = pending.pop(0)
            conn.send(i)
            busy[conn] = (i, proc)
        for conn in multiprocessing.connection.wait(list(busy)):
            i, proc = busy.pop(conn)
            key, job = items[i]
            try:
                results[key] = conn.recv()
                idle.append((conn, proc))
            except EOFError:
                proc.join()
                results[key] = dict(ok=False, error=f"the compiler process died (exit code {proc.exitcode})")
                conn.close()
                if pending:
                    idle.append(start())
            res = results[key]
            progress(f"  [{len(results)}/{len(jobs)}] {job.tag}: "
                     f"{'ok' if res['ok'] else 'FAILED'} ({res.get('seconds', 0):.1f} s)")
    for conn, proc in idle:
        conn.send(None)
        proc.join()
    return results


# --------------------------------------------------------------------------------------- 4. inspect

TC_OPS = {"HMMA", "HGMMA", "IMMA", "IGMMA", "QMMA", "QGMMA", "OMMA", "DMMA", "BMMA", "UTCHMMA", "UTCQMMA",
          "UTCOMMA", "UTCIMMA", "UTCMMA"}  # tensor-core instructions, sm_80 to sm_120
_MIX = (  # loop-mix categories by base opcode, first match wins
    ("tc", lambda b: b in TC_OPS),
    ("gmem", lambda b: b in ("LDG", "LDGSTS", "STG", "UTMALDG", "ATOMG", "RED", "LDGDEPBAR")),
    ("smem", lambda b: b in ("LDS", "STS", "LDSM", "STSM", "LDTM", "STTM")),
    ("sfu", lambda b: b == "MUFU"),
    ("conv", lambda b: b in ("I2F", "I2FP", "F2F", "F2FP", "F2I", "I2I", "F2IP")),
    ("other", lambda b: b in ("BRA", "BAR", "DEPBAR", "WARPGROUP", "SYNCS", "NOP", "MEMBAR", "WARPSYNC", "BSSY",
                              "BSYNC", "EXIT", "FENCE", "ELECT", "VOTE", "VOTEU") or b[0] == "U"),  # control, uniform
    ("fp", lambda b: b[0] == "F" or b[:2] == "HF" or b in ("HADD2", "HMUL2", "HSETP2", "HMNMX2")),
    ("int", lambda b: True),  # integer ALU, moves, selects, shuffles: here, mostly the dequantization
)
_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def parse_sass(sass: str) -> list[tuple[int, str, str]]:
    """cuobjdump -sass text -> [(address, opcode with modifiers, instruction text)], predicates dropped."""
    out = []
    for line in sass.splitlines():
        m = _SASS_LINE.match(line)
        if m:
            text = re.sub(r"^@!?U?P[T0-9]+\s+", "", m.group(2).strip())
            out.append((int(m.group(1), 16), text.split()[0], text))
    return out


def find_loops(instrs: list[tuple[int, str, str]]) -> list[dict]:
    """The top-level loops, in address order: {start, end, instrs, inner (loops nested in it), mix}.

    A loop is a backward branch with no EXIT between its target and itself (a cold block placed after the EXIT that
    jumps back into the kernel is not a loop); branches to one target are one loop. Spin-waits (a NANOSLEEP
    retry, or a barrier try-wait on its own) are not loops: they issue while waiting, not per weight."""
    exits = [a for a, op, _ in instrs if op.split(".")[0] == "EXIT"]
    ends: dict[int, int] = {}
    for addr, op, text in instrs:
        t = re.search(r"0x([0-9a-f]+)", text) if op.split(".")[0] == "BRA" else None
        if t and int(t.group(1), 16) < addr:
            start = int(t.group(1), 16)
            if not any(start <= x <= addr for x in exits):
                ends[start] = max(addr, ends.get(start, 0))
    loops = []
    for start, end in sorted(ends.items()):
        body = [op.split(".")[0] for a, op, _ in instrs if start <= a <= end]
        work = [b for b in body if b not in ("BRA", "NOP", "SYNCS")]
        if "NANOSLEEP" in body or not work:
            continue
        mix = {name: 0 for name, _ in _MIX}
        for b in body:
            mix[next(name for name, test in _MIX if test(b))] += 1
        loops.append(dict(start=start, end=end, instrs=len(body), mix=mix))
    inside = lambda a, b: a is not b and b["start"] <= a["start"] and a["end"] <= b["end"]  # noqa: E731
    top = [lp for lp in loops if not any(inside(lp, o) for o in loops)]
    for lp in top:
        lp["inner"] = sum(inside(o, lp) for o in loops)
    return top


def straight_line(instrs: list[tuple[int, str, str]]) -> int:
    """Instructions up to the kernel's last EXIT (what follows it is cold code or padding): a loop-free kernel's
    count per warp."""
    exits = [a for a, op, _ in instrs if op.split(".")[0] == "EXIT"]
    return sum(a <= exits[-1] for a, _, _ in instrs) if exits else len(instrs)


def first_exit(instrs: list[tuple[int, str, str]]) -> int:
    """Instructions up to and including the first EXIT: the most a CTA that leaves at once (a MoE block of no
    expert) issues per warp."""
    for i, (_, op, _) in enumerate(instrs):
        if op.split(".")[0] == "EXIT":
            return i + 1
    return len(instrs)


def parse_ptxas(log: str) -> dict:
    """ptxas -v's log -> registers, spill bytes (summed over the functions), stack and static shared memory."""
    out = dict(regs=None, spill_stores=None, spill_loads=None, stack=None, static_smem=0)
    m = re.search(r"Used (\d+) registers", log)
    if m:
        out["regs"] = int(m.group(1))
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if frames:
        out["stack"] = max(int(f[0]) for f in frames)
        out["spill_stores"] = sum(int(f[1]) for f in frames)
        out["spill_loads"] = sum(int(f[2]) for f in frames)
    m = re.search(r"(\d+) bytes smem", log)
    if m:
        out["static_smem"] = int(m.group(1))
    return out
