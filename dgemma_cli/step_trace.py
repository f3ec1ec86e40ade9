"""One denoise step of a real-shape DiffusionGemma, traced kernel by kernel on a machine without a GPU.

    from dgemma_cli.step_trace import trace_step
    trace = trace_step(batch=1, prompt=256, target=90, fmt="nvfp4")
    trace.ops                # every kernel of the step, in launch order (TorchOp and Triton launches)
    trace.kernels            # how many
    trace.transient_bytes    # memory a request needs besides the weights and its KV cache, at most, per request

This is the entry point of the whole-step table in `make kernel-report` (scripts/kernel_report.py), and of any
other tool that wants to cost a step: it needs no GPU, only the model's code.

What is traced is the code a CUDA device runs for one step of a canvas after its first (self-conditioning on):
`sampler.whole_step` (the rows that sit the step out counted, its temperature and random draws, the engine's
denoiser, which runs `DiffusionGemma.denoise` on the previous step's soft embedding and ends in the fused head,
quant/kernels/head.py, then `sampler.settle_step`: acceptance, renoising, the convergence test, the step's record),
which CUDA replays as one graph (`engine.GraphedDenoiser.run_step`), and what is launched outside it: the two
kernels with which torch's replay writes the generator's seed and offset, and the verdict's copy to the host, read a
step later (`sampler.LaggedStop`: no device-to-host wait in a step). The model
is built on the meta device (no memory, no data) at the real shapes of `config` (DiffusionGemma 26B-A4B by default)
with the format's quantized modules where its published release has them; the Triton wrappers answer as on a GPU
of compute capability `target` (quant.kernels.aot's recorder: each launch is kept with its arguments, grid and
launch settings, never run), and every torch op is metered by the tensors it reads and writes.

Costing, by the caller: a TorchOp by its bytes (`read + written`, `persistent` of them weights or KV cache) and FLOPs;
a Triton launch by compiling it for the target (quant.kernels.aot.specialise / compile_all) and bounding it there.
Scaled-dot-product attention is one TorchOp (CUDA runs it as one fused kernel; on the meta device torch would
decompose it), costed as reading Q, K, V and the mask and writing the output, 4 x B x heads x queries x keys x head
dim FLOPs.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# NVIDIA's ModelOpt NVFP4 release; compressed-tensors FP8 and INT8 W8A8 releases
# "nvfp4-experts": the routed experts alone in NVFP4, attention and the dense MLP 16-bit (NVIDIA's published release)
# "gguf-q4_k_m", "gguf-q8_0": a GGUF of that llama.cpp mix (checkpoint/gguf_mixes.py) as dgemma holds one
# (checkpoint/gguf_load.py): the experts and the block-typed projections as their blocks, the rest decoded
FORMATS = ("nvfp4", "w8a8-fp8", "w8a8-int8", "nvfp4-experts", "gguf-q4_k_m", "gguf-q8_0")


@dataclass
class TorchOp:
    """One torch op that launches a kernel: what it reads and writes (bytes), and its matmul FLOPs."""

    name: str  # aten name, or "sdpa" for attention
    read: int  # bytes read: each input tensor once (a view spans its own elements, at most its storage)
    written: int  # bytes written
    persistent: int  # of `read`, bytes of weights and KV cache (what no cache can keep between steps)
    flops: int = 0  # 2 x M x N x K for matmuls, attention's 4 x B x H x T x S x D; 0 for the rest
    layer: int | None = None  # the layer whose weights or KV cache it reads; -1: other weights; None: neither

    @property
    def bytes(self) -> int:
        return self.read + self.written


@dataclass
class StepTrace:
    config: dict
    fmt: str
    batch: int
    prompt: int
    target: int
    ops: list = field(default_factory=list)  # TorchOp or quant.kernels.aot.Launch, in order
    transient_bytes: int = 0  # per request: the sampler's buffers + the step's largest live activations
    persistent_bytes: int = 0  # weights the step reads (of the model's parameters and buffers), each once
    cache_bytes: int = 0  # the KV cache of the whole batch
    vocab_f32: list = field(default_factory=list)  # shapes of float32 tensors of at least canvas x vocab elements
    op_layers: list = field(default_factory=list)  # per op: its layer (what it reads, else the layer it runs in),
    # None before the first layer and after the last (embedding, self-conditioning, head, sampler)
    graphed: tuple[int, int] = (0, 0)  # ops[lo:hi]: the whole step (sampler.whole_step), which CUDA runs as one
    # graph's replay (engine.GraphedDenoiser.run_step); the rest (the generator's seed and offset written before the
    # replay, the verdict's copy to the host) are launched one by one

    @property
    def kernels(self) -> int:
        return len(self.ops)

    @property
    def eager_kernels(self) -> int:
        """Kernels launched one by one, outside the step's CUDA graph (each pays a launch: roofline.LAUNCH_US)."""
        lo, hi = self.graphed
        return self.kernels - (hi - lo)

    @property
    def torch_ops(self) -> list[TorchOp]:
        return [o for o in self.ops if isinstance(o, TorchOp)]

    @property
    def launches(self) -> list:
        return [o for o in self.ops if not isinstance(o, TorchOp)]


# aten ops that allocate or view: no kernel runs
_NO_KERNEL = ("aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
              "aten::_unsafe_view", "aten::view", "aten::reshape", "aten::expand", "aten::lift_fresh", "aten::detach",
              "aten::alias", "aten::_reshape_alias", "aten::slice", "aten::select", "aten::unsqueeze",
              "aten::squeeze", "aten::permute", "aten::transpose", "aten::t", "aten::as_strided", "aten::split",
              "aten::split_with_sizes", "aten::chunk", "aten::unbind", "aten::narrow", "aten::view_as_real",
              "aten::view_as_complex", "aten::unflatten", "aten::flatten", "aten::_unsafe_split")
# ops that overwrite their output without reading it
_OVERWRITE = ("aten::copy_", "aten::fill_", "aten::zero_", "aten::zeros", "aten::ones", "aten::full",
              "aten::zeros_like", "aten::ones_like", "aten::full_like", "aten::arange", "aten::randint",
              "aten::rand", "aten::random_", "aten::scalar_tensor")
# ops that read only the indexed rows of their source
_GATHER = ("aten::embedding", "aten::index_select", "aten::index", "aten::gather")
_MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::_scaled_mm",
           "aten::_int_mm")


def _sid(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _span(t: torch.Tensor) -> int:
    """Bytes a tensor's elements span (a broadcast view: at most its storage)."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


class _Meter(TorchDispatchMode):
    """Records a TorchOp for each kernel-launching torch op, and the live bytes of the tensors the step made."""

    def __init__(self, ops: list, persistent: set[int], untracked: set[int] = frozenset(),
                 layer_of: dict[int, int] | None = None):
        super().__init__()
        self.ops, self.persistent = ops, persistent
        self.layer_of = layer_of or {}  # persistent storage -> its layer (-1: weights of no layer)
        self.untracked = persistent | untracked  # storages that exist before the step: not its transient memory
        self.live: dict[int, list[int]] = {}  # storage -> [bytes, tensors alive that use it]
        self.live_bytes = self.peak = 0
        self.touched: set[int] = set()  # persistent storages read
        self.shapes: list[tuple[tuple[int, ...], torch.dtype]] = []  # every tensor the step made

    def _track(self, t: torch.Tensor) -> None:
        sid = _sid(t)
        if sid in self.untracked:
            return
        entry = self.live.get(sid)
        if entry is None:
            self.shapes.append((tuple(t.shape), t.dtype))
            entry = self.live[sid] = [t.untyped_storage().nbytes(), 0]
            self.live_bytes += entry[0]
            self.peak = max(self.peak, self.live_bytes)
        entry[1] += 1
        weakref.finalize(t, self._release, sid)

    def _release(self, sid: int) -> None:
        entry = self.live.get(sid)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.live_bytes -= entry[0]
                del self.live[sid]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t in outs:
            self._track(t)
        name = func._schema.name
        schema_args = func._schema.arguments
        rets = func._schema.returns
        if name in _NO_KERNEL or (rets and all(r.alias_info is not None and not r.alias_info.is_write
                                               for r in rets)):
            return out
        flat = list(args) + [kwargs.get(a.name) for a in schema_args[len(args):]]
        read = persistent = written = 0
        layer = None
        seen: set[int] = set()
        for a, v in zip(schema_args, flat):
            tensors = [v] if isinstance(v, torch.Tensor) else [y for y in v if isinstance(y, torch.Tensor)] \
                if isinstance(v, (list, tuple)) else []
            mutated = a.alias_info is not None and a.alias_info.is_write
            for t in tensors:
                if mutated and (name in _OVERWRITE or a.name == "out"):
                    continue  # written, not read (counted with the outputs)
                if name in _GATHER and a.name in ("weight", "self"):
                    continue  # only the gathered rows are read: the output's size, below
                if _sid(t) in seen and not mutated:
                    continue
                seen.add(_sid(t))
                n = _span(t)
                read += n
                if _sid(t) in self.persistent:
                    persistent += n
                    self.touched.add(_sid(t))
                    layer = self.layer_of.get(_sid(t), layer)
        if name in _GATHER:
            read += sum(_span(t) for t in outs)
        written = sum(_span(t) for t in outs)
        flops = 0
        if name in _MATMUL:  # the two operands by name (not a bias, a scale or the output)
            by_name = {a.name: t for a, t in zip(schema_args, flat)}
            a = by_name.get("mat1", by_name.get("batch1", by_name.get("self")))
            b = by_name.get("mat2", by_name.get("batch2"))
            flops = 2 * math.prod(a.shape) * b.shape[-1]
        self.ops.append(TorchOp(name, read, written, persistent, flops, layer))
        return out


class _Dropped(list):
    """An event list that keeps nothing (a launch recorded into it does not keep its tensors alive)."""

    def append(self, item) -> None:
        pass


@contextlib.contextmanager
def _w8a8_hardware_of(target: int):
    """quant.w8a8 answering as on the target: torch's FP8 / INT8 matmuls where its tensor cores have them."""
    from quant import w8a8

    original = w8a8.hardware
    w8a8.hardware = lambda kind, device: target >= 10 * w8a8.MIN_CAPABILITY[kind][0] + w8a8.MIN_CAPABILITY[kind][1]
    try:
        yield
    finally:
        w8a8.hardware = original


@contextlib.contextmanager
def _attention_as_one_op(meter: _Meter):
    """F.scaled_dot_product_attention as one TorchOp (CUDA's fused kernel), its output a fresh tensor."""
    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        B, H, T, D = q.shape
        S = k.shape[-2]
        with torch._C._DisableTorchDispatch():  # CUDA's fused kernels write the output in q's memory layout
            o = torch.empty_like(q) if v.shape[-1] == D else q.new_empty(B, H, T, v.shape[-1])
        meter._track(o)
        ins = [q, k, v] + ([attn_mask] if attn_mask is not None else [])
        read = sum(_span(t) for t in ins)
        meter.ops.append(TorchOp("sdpa", read, _span(o), sum(_span(t) for t in ins if _sid(t) in meter.persistent),
                                 4 * B * H * T * S * D))
        return o

    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def _install_format(model, fmt: str) -> None:
    """The published release's quantized modules in place of the float ones: attention and dense-MLP linears and
    the routed experts (NVFP4 with calibrated activation scales, per-expert layout as NVIDIA stores it; FP8 W8A8
    with per-token activation scales); the embedding (tied logits), router, self-conditioning MLP and norms stay
    16-bit. "nvfp4-experts" quantizes the routed experts alone, as NVIDIA's published NVFP4 release does."""
    from quant.formats.compressed_tensors import CompressedTensorsW8A8
    from quant.formats.modelopt import ModelOptNVFP4

    from .model import Experts, QuantizedExperts

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)} (got {fmt!r})")
    if fmt.startswith("gguf-"):
        _install_gguf(model, fmt.split("-", 1)[1])
        return
    form = ModelOptNVFP4() if fmt.startswith("nvfp4") else CompressedTensorsW8A8(fmt.split("-")[1], ["Linear"], [])
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp) if fmt != "nvfp4-experts" else ():
            for name, mod in list(parent.named_children()):
                if isinstance(mod, torch.nn.Linear):
                    new = form.make_linear(mod.in_features, mod.out_features, "meta")
                    if form.input_scales:
                        new.expect_input_scale()
                    setattr(parent, name, new)
        if isinstance(layer.experts, Experts):
            E, two_i, H = layer.experts.gate_up_proj.shape
            gate_up, down = form.make_experts(E, H, two_i // 2, "per_expert", device="meta")
            if form.input_scales:
                gate_up.expect_input_scale()
                down.expect_input_scale()
            layer.experts = QuantizedExperts(E, gate_up, down)


def _install_gguf(model, mix_name: str) -> None:
    """A GGUF of llama.cpp's `mix_name` as checkpoint/gguf_load.py holds one (gguf_load.hold_as_blocks): the routed
    expert stacks, the embedding and the projections of attention, the dense MLP and self-conditioning as their
    blocks, each in the block type the mix gives its tensor; the router and norms decoded to the compute dtype."""
    from .checkpoint.gguf_load import hold_as_blocks
    from .checkpoint.gguf_mixes import MIXES, kind_of
    from .checkpoint.gguf_names import gguf_name

    mix, text = MIXES[mix_name], model.cfg.text

    def kind(name: str) -> str:  # the row length sets the fallback of a type whose blocks do not fit it
        if name.endswith("experts.down_proj"):
            width = text.moe_intermediate_size
        elif name.endswith(".weight") and name != "embed_tokens.weight":
            width = model.get_submodule(name.removesuffix(".weight")).in_features
        else:
            width = text.hidden_size
        return kind_of(gguf_name(name), mix, width)

    hold_as_blocks(model, kind)


def trace_step(batch: int = 1, prompt: int = 256, target: int = 90, fmt: str = "nvfp4", config: dict | None = None,
               adapter: dict | None = None,
               dtype: torch.dtype = torch.bfloat16) -> StepTrace:
    """Trace one denoise step (self-conditioning on) of `batch` canvases after `prompt` cached tokens, as it runs on
    a GPU of compute capability `target` (89 RTX 4090, 90 H200, 120 RTX 5090, ...). `config`: a config.json dict
    (default: DiffusionGemma 26B-A4B's). `adapter`: lora.new_adapter's arguments (rank, alpha, targets,
    expert_rank) for a LoRA adapter attached as dgemma runs one. Needs triton importable without TRITON_INTERPRET=1
    (the launches are recorded, not run)."""
    from quant.kernels import aot

    from .config import DIFFUSIONGEMMA_26B_A4B, FULL, SLIDING, GenerationSettings, ModelConfig
    from .model import DenoiseContext, DiffusionGemma, rope_cos_sin
    from .engine import ModelDenoiser
    from .sampler import CanvasState, LaggedStop, SamplerBuffers, step_temperatures, whole_step

    config = config or DIFFUSIONGEMMA_26B_A4B
    cfg = ModelConfig.from_dict(config)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = DiffusionGemma(cfg)
    finally:
        torch.set_default_dtype(default)
    _install_format(model, fmt)
    model.eval()
    adapter_tensors = []
    if adapter is not None:  # a LoRA adapter (lora.new_adapter's shapes) on the meta model, unmerged as dgemma runs it
        from .tuner.lora import attach, new_adapter, trainable

        ad = new_adapter(model, **adapter)
        attach(model, [(ad, 1.0)])
        adapter_tensors = [t.detach() for t in trainable(ad)]
    C, V = cfg.canvas_length, cfg.text.vocab_size
    trace = StepTrace(config=config, fmt=fmt, batch=batch, prompt=prompt, target=target)
    denoiser = ModelDenoiser(model, batch, prompt)  # the engine's (its CUDA graph replays the same kernels)
    cache = denoiser.cache
    cache.length = prompt
    # the context of a canvas after `prompt` valid tokens (DiffusionGemma.denoise_context, without its host-side
    # check of the padding, which has none here)
    pos = torch.arange(prompt, prompt + C, device="meta")[None]
    rope = {k: rope_cos_sin(f, pos, model.dtype) for k, f in model.inv_freq.items()}
    keys = {FULL: (0, prompt + C), SLIDING: (cache.window - min(prompt, cache.window), cache.window + C)}
    denoiser.ctx = DenoiseContext(cos={k: c for k, (c, _) in rope.items()}, sin={k: s for k, (_, s) in rope.items()},
                                  mask={FULL: None, SLIDING: None}, keys=keys)
    buf = SamplerBuffers(batch * C, V, "meta", head=(cfg.text.hidden_size, model.dtype))
    settings = GenerationSettings()
    canvas = torch.zeros(batch, C, dtype=torch.long, device="meta")
    finished = torch.zeros(batch, dtype=torch.bool, device="meta")  # rows that ended in an earlier canvas
    # the canvas's state from step to step (sampler.generate_events: made once per canvas)
    state = CanvasState(canvas, finished, settings, step_temperatures(settings, "meta"))
    # torch's replay of a graph that draws random numbers first writes its generator's seed and offset into the
    # graph's inputs: two small kernels, launched before each replay (torch's CUDAGraph.replay)
    generator = [torch.zeros((), dtype=torch.int64, device="meta") for _ in range(2)]

    weights = {_sid(t): t for t in list(model.parameters()) + list(model.buffers()) + adapter_tensors}
    trace.cache_bytes = sum(t.untyped_storage().nbytes() for t in cache.k + cache.v)
    persistent = set(weights) | {_sid(t) for t in cache.k + cache.v}
    # made once per generation or canvas: per-request memory, not per-step traffic
    request = tuple(v for v in list(vars(buf).values()) + list(vars(buf.fused).values()) + list(vars(state).values())
                    if isinstance(v, torch.Tensor))

    stop = LaggedStop(torch.device("meta"))

    def step(events: list, meter: _Meter) -> None:
        with aot._recording(events, target), _w8a8_hardware_of(target), torch.no_grad(), meter, \
                _attention_as_one_op(meter):
            for t in generator:
                t.fill_(0)
            lo = len(events)
            whole_step(denoiser, state, buf, settings, True)  # the graph's replay (engine.GraphedDenoiser.run_step)
            if not isinstance(events, _Dropped):
                trace.graphed = (lo, len(events))
            stop.push(state.all_done)  # the stop test's verdict to the host, read a step later (sampler.LaggedStop)

    step(_Dropped(), _Meter([], persistent))  # a first step, as the engine's eager steps before its graph: what
    # the modules make once (a per-row scale) is made here, not counted in the step
    events: list = []  # torch ops and launches in order; a recorded launch keeps its tensors alive
    layer_of = {sid: -1 for sid in weights}
    for i, layer in enumerate(model.layers):
        layer_of.update({_sid(t): i for t in list(layer.parameters()) + list(layer.buffers())})
    for i, (k, v) in enumerate(zip(cache.k, cache.v)):
        layer_of.update({_sid(k): i, _sid(v): i})
    meter = _Meter(events, persistent, {_sid(t) for t in request}, layer_of)
    step(events, meter)
    trace.ops = events
    trace.op_layers = _layers_of(events, layer_of)
    touched = meter.touched | {_sid(v) for op in trace.launches for v in op.named().values()
                               if isinstance(v, torch.Tensor)}
    trace.persistent_bytes = sum(weights[s].untyped_storage().nbytes() for s in touched if s in weights)
    meter = _Meter([], persistent, {_sid(t) for t in request})
    step(_Dropped(), meter)  # again, launches not kept, for the live bytes
    trace.transient_bytes = (sum(t.untyped_storage().nbytes() for t in request) + meter.peak) // batch
    made = [(tuple(t.shape), t.dtype) for t in request] + meter.shapes
    trace.vocab_f32 = [shape for shape, dt in made if dt == torch.float32 and math.prod(shape) >= C * V]
    return trace


def _layers_of(ops: list, layer_of: dict[int, int]) -> list[int | None]:
    """Each op's layer: the layer whose weights or cache it reads; an op that reads none runs in the layer of the op
    before it (a residual add, an activation), and one that reads weights of no layer (the final norm, the head, the
    self-conditioning MLP) ends the layers."""
    out, current = [], None
    for op in ops:
        if isinstance(op, TorchOp):
            mine = op.layer
        else:  # a Triton launch: its tensor arguments
            mine = next((layer_of[_sid(v)] for v in op.named().values()
                         if isinstance(v, torch.Tensor) and layer_of.get(_sid(v), -1) >= 0), None)
            if mine is None and any(isinstance(v, torch.Tensor) and _sid(v) in layer_of for v in op.named().values()):
                mine = -1
        if mine is not None:
            current = None if mine < 0 else mine
        out.append(current)
    return out


@dataclass
class Floor:
    """The physical floor of a step: every stored weight byte read once; 2 x (active parameters + the soft
    embedding's vocab x hidden) x rows FLOPs, the quantized layers' at the fastest dense rate the format allows."""

    weight_bytes: int  # what the checkpoint holds in memory: packed weights, scales, 16-bit tensors
    quantized_params: int  # per row: the format's linears and the top-k routed experts
    dense_params: int  # per row: 16-bit matmuls (logits = the tied embedding, router, self-conditioning MLP) + the
    # soft embedding's vocab x hidden
    rows: int  # batch x canvas


def floor_of(trace: StepTrace) -> Floor:
    """The step's physical floor (the report compares its bound with it)."""
    from .config import ModelConfig

    cfg = ModelConfig.from_dict(trace.config)
    t = cfg.text
    H, V = t.hidden_size, t.vocab_size
    quantized = dense = 0
    from .model import DiffusionGemma

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = DiffusionGemma(cfg)
    finally:
        torch.set_default_dtype(default)
    for name, p in model.named_parameters():
        leaf = name.split(".")
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            quantized += p.numel() * t.top_k_experts // t.num_experts
        elif p.dim() == 2 and ("self_attn" in leaf or "mlp" in leaf):
            quantized += p.numel()
        elif p.dim() == 2:  # the embedding (as the logits projection), router, self-conditioning MLP
            dense += p.numel()
    return Floor(weight_bytes=trace.persistent_bytes, quantized_params=quantized, dense_params=dense + V * H,
                 rows=trace.batch * cfg.canvas_length)
