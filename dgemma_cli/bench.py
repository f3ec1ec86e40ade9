"""`dgemma bench`: the denoise step's speed on random weights at any config's shapes, against its physical floor.

Random weights time the engine faithfully (speed does not depend on the values), so no download is needed: the
network is built on the meta device and its tensors are made directly on the target device, in the chosen format
(packed random codes and scales for NVFP4 and INT8). A run: one random prompt of `prompt` tokens per row, encoded
once, then `canvases` canvases of exactly `steps` steps (adaptive stopping off, end tokens ignored).

Reported: ms per denoise step (forward + sampler; the statistic, for dgemma and the reference alike: the median of
the step-to-step intervals within each canvas, steps 2..`steps`, the device synchronised at every step, so the step
that captures a canvas's CUDA graph does not count), tokens per second inside the canvas (batch x canvas tokens
per `steps` steps of that median), peak device memory, how many timed steps replayed a CUDA graph, and the floor:
the bytes of the weights one step must read (every tensor the decoder step touches, in the format it is held in,
read once; of the routed experts those the canvas can reach, which at a 256-token canvas is all of them) over the
device's peak bandwidth (the fastest of several large device-to-device copies). Beside the floor, not in it, the
traffic a step moves besides the weights: the self-conditioning soft embedding reading the embedding a second
time, the canvas x vocab float32 passes (the LM head writes the logits, the sampler reads them and writes the
probabilities, the next step's soft embedding reads them), and the KV cache read. The ratio is step / floor.
With `compare="transformers"` the reference implementation runs the same shapes in the same process (bf16, random
init) through its compiled static-cache path (`cache_implementation="static"`: torch.compile of its decoder and
sampler) when the installed transformers has one, else eagerly (said in `reference_mode`); "transformers-eager"
asks for the eager path. `compare_kernel_paths` is the check that the Triton path gives the torch path's tokens.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from .config import DIFFUSIONGEMMA_26B_A4B, GenerationSettings, ModelConfig
from .errors import UsageError

# The CPU benchmark's config (scripts/bench_cpu.py): mid-size, quick on a CPU.
MID = {"model_type": "diffusion_gemma", "canvas_length": 256, "text_config": dict(
    vocab_size=32768, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, global_head_dim=128, num_global_key_value_heads=1, sliding_window=128,
    num_experts=16, top_k_experts=4, moe_intermediate_size=128)}
TINY = {"model_type": "diffusion_gemma", "canvas_length": 32, "text_config": dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=16,
    num_experts=8, top_k_experts=2, moe_intermediate_size=32)}
CONFIGS = {"real": DIFFUSIONGEMMA_26B_A4B, "mid": MID, "tiny": TINY}
# fp8: W8A8 (FP8 weights and activations, sm_89+; elsewhere emulated); gguf-*: a GGUF of llama.cpp's mix
# (checkpoint/gguf_mixes.py), held as dgemma holds a GGUF file (checkpoint/gguf_load.hold_as_blocks)
FORMATS = ("bf16", "int8", "nvfp4", "fp8", "gguf-q4_k_m", "gguf-q8_0")
COMPARE = ("transformers", "transformers-eager")


@dataclass
class BenchResult:
    config: str
    format: str
    device: str
    batch: int
    prompt: int
    steps: int
    ms_per_step: float
    tokens_per_s: float
    peak_memory_gb: float | None
    floor_ms: float
    floor_ratio: float
    floor_bytes: int  # weights one step reads, each once (the floor's numerator)
    bandwidth_gbs: float  # the device's peak: the fastest large device-to-device copy
    soft_embedding_bytes: int  # beside the floor: the embedding read a second time (self-conditioning)
    canvas_vocab_bytes: int  # beside the floor: canvas x vocab float32 passes
    kv_cache_bytes: int  # beside the floor: the KV cache read
    prefill_ms: float
    statistic: str
    graph_replays: int  # timed steps served by replaying a CUDA graph
    streamed_layers: int = 0  # layers whose experts stream from host memory (--gpu-memory), 0: all resident
    gpu_memory_gb: float | None = None  # the card memory planned for (--gpu-memory)
    streamed_bytes_per_step: int = 0  # their bytes, copied over the host link at every step
    host_to_device_gbs: float | None = None  # measured: the fastest of several pinned host-to-device copies (CUDA)
    reference_ms_per_step: float | None = None
    reference_mode: str | None = None
    speedup_vs_reference: float | None = None

    def ms_at_peak(self, nbytes: int) -> float:
        return 1000 * nbytes / (self.bandwidth_gbs * 1e9)

    def table(self) -> str:
        rows = [("config / format", f"{self.config} / {self.format}, batch {self.batch}, prompt {self.prompt}, "
                                    f"{self.steps} steps, {self.device}"),
                ("ms per denoise step", f"{self.ms_per_step:.2f}"),
                ("statistic", self.statistic),
                ("tokens/s in the canvas", f"{self.tokens_per_s:,.0f}"),
                ("prefill (ms)", f"{self.prefill_ms:.1f}"),
                ("peak memory", "n/a (CPU)" if self.peak_memory_gb is None else f"{self.peak_memory_gb:.2f} GB"),
                ("CUDA graph", f"replayed for {self.graph_replays} of the timed steps"),
                ("weight-read floor", f"{self.floor_ms:.3f} ms ({self.floor_bytes / 1e9:.3f} GB of weights at "
                                      f"{self.bandwidth_gbs:.0f} GB/s peak copy bandwidth)"),
                ("step / floor", f"{self.floor_ratio:.2f}x")]
        if self.gpu_memory_gb is not None:
            rows += [("planned for", f"{self.gpu_memory_gb:.2f} GB of card memory: {self.streamed_layers} layers' "
                                     f"experts stream from host memory ({self.streamed_bytes_per_step / 1e9:.3f} GB "
                                     f"a step)")]
            if self.host_to_device_gbs:
                ms = 1000 * self.streamed_bytes_per_step / (self.host_to_device_gbs * 1e9)
                rows += [("  their copies", f"{ms:.3f} ms a step at {self.host_to_device_gbs:.1f} GB/s (measured "
                                            "pinned host-to-device copies)")]
        rows += [(f"  + {what}", f"{self.ms_at_peak(n):.3f} ms ({n / 1e9:.3f} GB), not in the floor")
                 for what, n in (("2nd embedding read", self.soft_embedding_bytes),
                                 ("canvas x vocab fp32", self.canvas_vocab_bytes),
                                 ("KV cache read", self.kv_cache_bytes))]
        if self.reference_ms_per_step is not None:
            rows += [("reference ms per step", f"{self.reference_ms_per_step:.2f} (the same statistic)"),
                     ("reference path", self.reference_mode),
                     ("speed-up vs reference", f"{self.speedup_vs_reference:.2f}x")]
        return "\n".join(f"{k + ':':<28}{v}" for k, v in rows)


def config_for(name: str) -> tuple[str, dict]:
    """A named config (real, mid, tiny), a bundled model's or store entry's name, or a model directory's
    config.json."""
    from pathlib import Path

    from .config import read_json_object
    from .errors import DgemmaError, ModelError
    from .checkpoint.names import BUNDLED, resolve_model

    if name in CONFIGS:
        return name, CONFIGS[name]
    path = Path(name).expanduser()
    if name in BUNDLED or not path.exists():
        try:
            path = resolve_model(name)  # 'demo', or a store name
        except DgemmaError:
            pass
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise UsageError(f"--config must be one of {', '.join(CONFIGS)}, a bundled model (demo, ...), a store name "
                         f"or a model directory (got {name!r})")
    try:
        return str(path.parent), read_json_object(path)
    except ModelError as e:  # a bad --config value is a usage error here
        raise UsageError(str(e)) from None


def random_model(cfg: ModelConfig, fmt: str, policy: str, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 host_layers=frozenset()):
    """The network with random weights made on `device`, quantized modules filled with random packed values.
    host_layers: layers whose routed experts are made in host memory instead (streamed: placement/streaming.py)."""
    from quant import modules as q

    from .model import DiffusionGemma, Experts, QuantizedExperts, RMSNorm

    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    if fmt.startswith("gguf-"):
        _hold_gguf(model, fmt)
    elif fmt != "bf16":
        for path, mod in list(model.named_modules()):
            parent, _, leaf = path.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            if isinstance(mod, Experts):
                E, two_i, H = mod.gate_up_proj.shape
                segments = 2 if fmt == "nvfp4" else 1
                new = QuantizedExperts(E, q.make_stack(fmt, E, two_i, H, segments, "meta"),
                                       q.make_stack(fmt, E, H, two_i // 2, 1, "meta"))
                setattr(owner, leaf, new)
            elif policy == "all" and isinstance(mod, torch.nn.Linear) and path.split(".")[-2] in ("self_attn", "mlp"):
                setattr(owner, leaf, q.make_linear(fmt, mod.in_features, mod.out_features, "meta"))
    for mod in model.modules():  # float parameters in the compute dtype; packed buffers keep theirs
        for key, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[key] = torch.nn.Parameter(torch.empty_like(p, dtype=dtype), requires_grad=False)
    held = {i: model.layers[i].experts for i in host_layers}  # made apart, in host memory, never on the device
    for i in held:
        model.layers[i].experts = torch.nn.Module()
    model = model.to_empty(device=device)
    for i, experts in held.items():
        model.layers[i].experts = experts.to_empty(device="cpu")
    g = torch.Generator(device=device).manual_seed(seed)
    g_host = g if torch.device(device).type == "cpu" else torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layer_scalar") or name.endswith(("router.scale", "per_expert_scale")):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g if p.device.type == torch.device(device).type else g_host)
        for mod in model.modules():
            if isinstance(mod, RMSNorm) and mod.weight is not None:
                mod.weight.fill_(1.0)
        for mod in model.modules():  # GGUF blocks: random codes, f16 scales small (random halves are NaN or huge)
            if getattr(mod, "format", None) == "gguf":
                from quant.ggml import randomize_blocks_

                randomize_blocks_(mod.weight, mod.kind, g if mod.weight.device.type == torch.device(device).type
                                  else g_host, scale=1e-3)
        for name, b in model.named_buffers():
            if b.dtype == torch.uint8 and getattr(model.get_submodule(name.rpartition(".")[0]) if "." in name else
                                                  model, "format", None) == "gguf":
                continue  # made above
            if b.dtype == torch.uint8:
                b.copy_(torch.randint(0, 256, b.shape, generator=g, device=device, dtype=torch.int32))
            elif b.dtype == torch.int8:
                b.copy_(torch.randint(-127, 128, b.shape, generator=g, device=device, dtype=torch.int32))
            elif b.dtype == torch.float8_e4m3fn:  # block scales near 1 (e4m3 bit patterns 0x30..0x40)
                bits = torch.randint(0x30, 0x41, b.shape, generator=g, device=device, dtype=torch.int32)
                b.view(torch.uint8).copy_(bits)
            elif name.endswith("weight_scale_2"):
                b.fill_(0.02 / 6)
            else:  # INT8 row scales
                b.fill_(0.06 / 127)
    return model.eval().requires_grad_(False)


def _hold_gguf(model, fmt: str) -> None:
    """`model` (on the meta device) as dgemma holds a GGUF of the mix `fmt` names (gguf-q4_k_m: llama.cpp's
    Q4_K_M): the step trace's installation (dgemma_cli/step_trace.py), whose types are the published files'."""
    from .step_trace import _install_gguf

    _install_gguf(model, fmt.removeprefix("gguf-"))


def _gguf_bytes(cfg: ModelConfig, fmt: str, dtype: torch.dtype) -> int:
    """What a GGUF of `fmt`'s mix holds in memory: its blocks, the rest in `dtype` (counted on the meta device)."""
    from .model import DiffusionGemma

    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    _hold_gguf(model, fmt)
    return (sum(b.numel() * b.element_size() for b in model.buffers())
            + sum(p.numel() for p in model.parameters()) * dtype.itemsize)


def copy_bandwidth(device: torch.device) -> float:
    """The device's peak bandwidth in bytes per second: the fastest of several large device-to-device copies
    (read + write counted)."""
    n = (1 << 30) if device.type == "cuda" else (256 << 20)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    best = float("inf")
    for _ in range(10 if device.type == "cuda" else 3):
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best


def host_to_device_bandwidth(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Bytes per second of the fastest of several copies of a pinned host buffer to the device (the link streamed
    experts cross)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def experts_hit(cfg: ModelConfig, batch: int) -> float:
    """Expected fraction of the experts that a step's batch x canvas tokens route to (top-k of E each)."""
    t = cfg.text
    return 1 - (1 - t.top_k_experts / t.num_experts) ** (batch * cfg.canvas_length)


def floor_bytes(model, batch: int) -> int:
    """Bytes of the weights one denoise step reads: every tensor the decoder step touches, in the format it is held
    in (packed codes and scales for quantized ones), read once; the routed experts times the fraction the canvas
    reaches. Not counted: the encoder's layer scalars (the encoder does not run in a step)."""
    from .model import Experts

    experts, rest = 0, 0
    in_experts = set()
    for path, mod in model.named_modules():
        if isinstance(mod, Experts):
            for name, t in [*mod.named_parameters(), *mod.named_buffers()]:
                experts += t.numel() * t.element_size()
                in_experts.add(f"{path}.{name}")
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name not in in_experts and name != "encoder_layer_scalar":
            rest += t.numel() * t.element_size()
    return int(rest + experts * experts_hit(model.cfg, batch))


def beside_floor_bytes(model, batch: int, context: int) -> dict[str, int]:
    """What a step moves besides the weights read once (reported beside the floor, not in it); `context`: the
    tokens in the cache before the canvas."""
    from .checkpoint.footprint import kv_cache_bytes

    cfg, w = model.cfg, model.embed_tokens.weight
    rows = batch * cfg.canvas_length
    return {"soft_embedding_bytes": w.numel() * w.element_size(),  # the soft embedding reads the embedding again
            # logits written by the LM head, read by the sampler, probabilities written, read by the next step
            "canvas_vocab_bytes": 4 * rows * cfg.text.vocab_size * 4,
            "kv_cache_bytes": kv_cache_bytes(cfg, context, batch) * model.dtype.itemsize // 2}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_prefill(model, prompts: torch.Tensor) -> float:
    """ms to encode the prompts into a fresh cache (the causal encoder's pass)."""
    device = model.device
    ids = prompts.to(device)
    with torch.inference_mode():
        cache = model.new_cache(ids.shape[0], ids.shape[1])
        sync(device)
        t0 = time.perf_counter()
        model.encode(ids, cache)
        sync(device)
    return 1000 * (time.perf_counter() - t0)


def statistic(steps: int, canvases: int) -> str:
    """The timing statistic both sides report."""
    return (f"median of {(steps - 1) * canvases} step-to-step intervals (steps 2-{steps} of {canvases} canvas"
            f"{'es' if canvases > 1 else ''}), synchronised every step")


def median_step_ms(stamps: list[float], steps: int) -> float:
    """ms of the median step-to-step interval within each canvas; `stamps` holds one time per step, canvas after
    canvas, `steps` per canvas."""
    intervals = []
    for lo in range(0, len(stamps), steps):
        ts = stamps[lo : lo + steps]
        intervals += [b - a for a, b in zip(ts, ts[1:])]
    return 1000 * statistics.median(intervals)


def time_dgemma(engine, prompts, steps: int, canvases: int, device) -> tuple[float, int]:
    """(ms per step by `statistic`, steps that replayed a CUDA graph)."""
    from .sampler import Done, Step

    settings = engine.settings.override(max_new_tokens=canvases * engine.config.canvas_length,
                                        max_denoising_steps=steps, confidence_threshold=1e-12,
                                        eos_token_ids=(-1,))
    stamps, replays = [], 0
    for ev in engine.events(prompts, seed=0, settings=settings):
        if isinstance(ev, Step):
            sync(device)
            stamps.append(time.perf_counter())
        elif isinstance(ev, Done):
            replays = ev.stats.get("graph_replays", 0)
    assert len(stamps) == steps * canvases, "every canvas runs exactly `steps` steps"
    return median_step_ms(stamps, steps), replays


class _StepClock:
    """A streamer for the reference's generate: a timestamp after every denoising step (`put_draft`)."""

    def __init__(self, device):
        self.device, self.stamps = device, []

    def put(self, value) -> None:
        pass

    def put_draft(self, value=None, logits=None) -> None:
        sync(self.device)
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def reference_has_compiled_path() -> bool:
    """Whether the installed transformers' DiffusionGemma generate has its compiled static-cache path."""
    from transformers import DiffusionGemmaForBlockDiffusion

    return hasattr(DiffusionGemmaForBlockDiffusion, "_compile_functions")


def time_reference(config: dict, prompts: torch.Tensor, steps: int, canvases: int, device, dtype,
                   compiled: bool = True) -> tuple[float, str]:
    """The reference's ms per step by `statistic` (the same as dgemma's), and the path it ran: its compiled
    static-cache path when `compiled` and the installed transformers has one (eager if that fails, with the reason)."""
    try:
        from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig
    except ImportError:
        raise UsageError("--compare transformers needs transformers (pip install 'transformers>=5.11')") from None
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    cfg = DiffusionGemmaConfig(text_config=config["text_config"], vision_config=vision,
                               canvas_length=config.get("canvas_length", 256))
    with torch.device(device):  # built in `dtype` directly: a float32 build of the 26B would need 100 GB first
        ref = DiffusionGemmaForBlockDiffusion._from_config(cfg, dtype=dtype).eval()

    def run(**kw) -> list[float]:
        clock = _StepClock(device)
        with torch.no_grad():
            ref.generate(prompts, max_new_tokens=canvases * cfg.canvas_length, max_denoising_steps=steps,
                         confidence_threshold=1e-12, sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1),
                         t_min=0.4, t_max=0.8, stability_threshold=1, eos_token_id=[-1], pad_token_id=0,
                         streamer=clock, **kw)
        if len(clock.stamps) != steps * canvases:
            raise RuntimeError(f"the reference ran {len(clock.stamps)} steps, not {steps * canvases}")
        return clock.stamps

    mode, kw = "eager (dynamic cache)", {}
    if not compiled:
        mode += ", as asked"
    elif not reference_has_compiled_path():
        mode += ": this transformers has no compiled static-cache path"
    else:
        try:
            for _ in range(2):  # compile, then let its CUDA graphs record
                run(cache_implementation="static")
            mode, kw = "compiled (static cache, torch.compile)", dict(cache_implementation="static")
        except Exception as e:  # noqa: BLE001 - any failure of the compiled path: time the eager one, say why
            first = (str(e).strip().splitlines() or [""])[0][:160]
            mode += f": the compiled static-cache path failed ({type(e).__name__}: {first})"
    if not kw:
        run()  # warm-up
    ms = median_step_ms(run(**kw), steps)
    del ref
    return ms, mode


def run_bench(config: str = "mid", fmt: str = "nvfp4", policy: str = "experts", batch: int = 1, prompt: int = 512,
              steps: int = 16, canvases: int = 1, device: str = "auto", dtype: str = "auto",
              compare: str | None = None, note: Callable[[str], None] | None = None,
              gpu_memory: int | None = None) -> BenchResult:
    """`note(message)`, when given, hears each phase as it starts (a run takes from seconds to minutes). gpu_memory:
    the card memory to plan for, bytes (--gpu-memory): the experts that do not fit are made in host memory and
    stream to the card at every step, as `dgemma run --gpu-memory` runs them (dgemma_cli/placement)."""
    from .engine import Engine, check_kernels, resolve_device, resolve_dtype

    say = note or (lambda message: None)

    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)} (got {fmt!r})")
    if batch < 1 or prompt < 1 or steps < 5 or canvases < 1:
        raise UsageError("--batch, --prompt and --canvases must be >= 1 and --steps >= 5")
    if compare not in (None, *COMPARE):
        raise UsageError(f"--compare takes {' or '.join(repr(c) for c in COMPARE)} (got {compare!r})")
    name, raw = config_for(config)
    cfg = ModelConfig.from_dict(raw)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    check_kernels(dev)
    from .checkpoint.footprint import system_free, weight_bytes

    if fmt.startswith("gguf-") and (gpu_memory is not None or policy != "experts"):
        raise UsageError(f"--format {fmt} runs as a GGUF file is held: no --policy, no --gpu-memory (not yet)")
    if dev.type == "cpu":  # random weights are made in place: refuse what cannot fit instead of swapping to death
        need = (_gguf_bytes(cfg, fmt, dt) if fmt.startswith("gguf-") else
                sum(weight_bytes(cfg, fmt, policy).values()) * (dt.itemsize / 2))
        free = system_free()
        if free and need > 0.8 * free:
            raise UsageError(f"--config {name} needs about {need / 1e9:.0f} GB for its weights on the CPU; "
                             f"{free / 1e9:.0f} GB are free (use a GPU, or --config mid)")
    placement = None
    if gpu_memory is not None:
        placement = bench_placement(cfg, fmt, policy, dev, gpu_memory, batch, prompt + canvases * cfg.canvas_length)
    streamed = placement.streamed if placement is not None else []
    say(f"building {name} with random {fmt} weights on {dev} ({str(dt).removeprefix('torch.')})"
        + (f", {len(streamed)} layers' experts in host memory" if streamed else ""))
    torch.manual_seed(0)
    model = random_model(cfg, fmt, policy, dev, dt, host_layers=frozenset(streamed))
    if streamed:
        from .placement.streaming import ExpertStream

        model.expert_streams = [ExpertStream(model, streamed, dev)]
        model.expert_streams[0].check(model)
    engine = Engine(model, None, GenerationSettings(eos_token_ids=(1,)))
    V = cfg.text.vocab_size
    prompts = torch.randint(107, V, (batch, prompt), generator=torch.Generator().manual_seed(1))
    ids = prompts.tolist()
    say("warming up (5 steps)")
    time_dgemma(engine, ids, 5, 1, dev)  # warm-up: kernels compiled, graphs captured, allocator settled
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    say(f"timing {canvases * steps} steps (batch {batch}, prompt {prompt})")
    ms, replays = time_dgemma(engine, ids, steps, canvases, dev)
    say("timing the prefill and the device's copy bandwidth")
    prefill = time_prefill(model, prompts)
    peak = torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None
    bw = copy_bandwidth(dev)
    h2d = host_to_device_bandwidth(dev) / 1e9 if streamed and dev.type == "cuda" else None
    nbytes = floor_bytes(model, batch)
    beside = beside_floor_bytes(model, batch, prompt + (canvases - 1) * cfg.canvas_length)  # the last canvas's
    floor = 1000 * nbytes / bw
    result = BenchResult(name, fmt if fmt == "bf16" or policy == "experts" else f"{fmt} ({policy})", str(dev), batch,
                         prompt, steps, ms, batch * cfg.canvas_length * 1000 / (ms * steps), peak, floor, ms / floor,
                         nbytes, bw / 1e9, **beside, prefill_ms=prefill, statistic=statistic(steps, canvases),
                         graph_replays=replays, streamed_layers=len(streamed),
                         gpu_memory_gb=None if gpu_memory is None else gpu_memory / 1e9,
                         streamed_bytes_per_step=placement.streamed_bytes_per_step if placement is not None else 0,
                         host_to_device_gbs=h2d)
    if compare:
        del engine, model  # the reference gets the device to itself
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        say(f"timing the reference ({compare}) on the same shapes")
        ref_ms, mode = time_reference(raw, prompts.to(dev), steps, canvases, dev,
                                      torch.bfloat16 if dev.type == "cuda" else dt, compiled=compare == "transformers")
        result.reference_ms_per_step, result.reference_mode = ref_ms, mode
        result.speedup_vs_reference = ref_ms / ms
    return result


def bench_placement(cfg: ModelConfig, fmt: str, policy: str, dev: torch.device, gpu_memory: int, batch: int,
                    context: int):
    """The placement plan for a bench run on a card of `gpu_memory` bytes (the device's own figures on CUDA, a card
    of that size on the CPU); UsageError (one line) when it cannot hold."""
    from .engine import plan_on

    remedies = ["a shorter --prompt"] + (["a smaller --batch"] if batch > 1 else [])
    remedies += ["a smaller --format"] if fmt != "nvfp4" else ["--policy all"] if policy == "experts" else []
    p = plan_on(cfg, fmt, policy, [dev], [gpu_memory], context, batch, remedies + ["a larger --gpu-memory"])
    if not p.fits:
        raise UsageError(p.refusal)
    return p


def as_dict(r: BenchResult) -> dict:
    return asdict(r)


# ----------------------------------------------------------------------------- Triton path against torch path

# Both sides draw the same random numbers (same seed, DGEMMA_SAMPLER=torch: the fused head would draw its own);
# the Triton side runs as the engine does by default (CUDA graphs where they apply), the torch side eagerly.
KERNEL_PATHS = {"triton": {"DGEMMA_KERNELS": "triton", "DGEMMA_SAMPLER": "torch", "DGEMMA_EAGER": None},
                "torch": {"DGEMMA_KERNELS": "torch", "DGEMMA_SAMPLER": "torch", "DGEMMA_EAGER": "1"}}
PEAKED_NORM = 16.0  # the compared model's final-norm weight: peaked distributions, as a trained model's are
# Limits. The first step's logits: per canvas position max |triton - torch| / max |torch| over the vocabulary; the
# median position is held to LOGIT_TOL (by format and policy), the worst is reported. Then the share of generated
# tokens that agree. bf16 runs the same matmuls on both sides; the Triton side also runs the fused norms, router and
# logits cap (quant/kernels/rmsnorm.py, router.py, softcap.py), which differ from the torch ops by float32 summation
# order (in float32: 1.8e-6 at the worst position, every token equal), in bfloat16 by a rounding here and there and a
# router tie broken the other way (bfloat16 logits tie often; either choice is a top-k): median 2e-2 at most, 97.7%
# of the tokens equal at the tiny config in the interpreter. It also checks the CUDA-graph path against the eager
# one. Quantized formats differ by accumulation order and where bfloat16 rounding happens (the NVFP4
# kernels apply the global scale after the product, the torch path rounds it into the weights), each kernel within
# about one bfloat16 step of the torch path (tests/test_kernels.py). Measured at the tiny config in Triton's
# interpreter on the CPU, the median position: INT8 0 to 1e-3, NVFP4 experts 7e-3, NVFP4 every projection 2e-2 to
# 2.4e-2; an MoE kernel returning zeros gives 0.21 (an error of pure scale hardly shows: a norm follows the MoE).
# A router near-tie (random weights route almost uniformly) sends a token to another expert on one side, so a few
# positions differ far more on two correct paths: hence the median. Tokens are a weak check, a floor: one flipped
# sample changes every later step's input, so two correct paths drift apart (76% to 100% agree at 3 steps), and a
# random model's argmax leans on its input tokens (the MoE returning zeros still agrees on 64%).
LOGIT_TOL = {("bf16", "experts"): 2e-2, ("bf16", "all"): 2e-2, ("int8", "experts"): 1e-2, ("int8", "all"): 1e-2,
             ("nvfp4", "experts"): 2e-2, ("nvfp4", "all"): 5e-2}
AGREEMENT_MIN = {"bf16": 0.9, "int8": 0.5, "nvfp4": 0.5}
# The median alone passes a bug confined to fewer than half the positions (an expert or a tile computed wrong): so
# at most OUTLIER_SHARE of the positions may differ by more than OUTLIER_TOL x LOGIT_TOL. Measured at the tiny config
# in bfloat16 in Triton's interpreter (dgemma_cli.bench.compare_kernel_paths on the CPU): INT8 and NVFP4 experts
# none; NVFP4 every projection 1.6% (one position of 64: a router near-tie).
OUTLIER_TOL, OUTLIER_SHARE = 4, 0.1


@contextmanager
def environment(values: dict[str, str | None]):
    """Set (None: unset) environment variables for the block, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    try:
        _set_environment(values)
        yield
    finally:
        _set_environment(old)


def _set_environment(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def first_step_logits(model, prompts: torch.Tensor, canvas: torch.Tensor) -> torch.Tensor:
    """The first denoise step's float32 logits [B*C, V] for `canvas` after encoding `prompts` (eager)."""
    from .engine import ModelDenoiser

    B, T = prompts.shape
    d = ModelDenoiser(model, B, T + canvas.shape[1])
    out = torch.empty(canvas.numel(), model.cfg.text.vocab_size, device=model.device)
    with torch.inference_mode():
        d.encode(prompts, None)
        d.start_canvas()
        model.denoise(canvas, d.cache, d.ctx, out=out)  # the logits themselves, whatever head the sampler would use
    return out


def triton_families(fmt: str, policy: str, dtype: torch.dtype = torch.bfloat16) -> tuple[str, ...]:
    """The Triton kernel families a format's forward uses: the fused norms always, the router and the logits cap with
    16-bit weights, and the format's matmuls (none for bf16)."""
    glue = ("rms_norm",) + (("router", "softcap") if dtype in (torch.bfloat16, torch.float16) else ())
    if fmt == "bf16":
        return glue
    return glue + (f"moe_{fmt}", "moe_plan") + ((f"{fmt}_linear",) if policy == "all" else ())


def compare_kernel_paths(fmt: str = "bf16", policy: str = "all", config: str = "tiny", device: str = "auto",
                         dtype: str = "bfloat16", batch: int = 2, prompt: int = 40, canvases: int = 2,
                         steps: int = 3, seed: int = 0) -> dict:
    """Generate with one random model through DGEMMA_KERNELS=triton and =torch, the same draws on both sides
    (KERNEL_PATHS), and compare: the first step's logits on one random canvas, and the tokens of `canvases`
    canvases of exactly `steps` steps (3: the first step eager, the second captured, the third replayed; more steps
    only let the two sides drift further apart). `passed` holds when they agree within LOGIT_TOL / AGREEMENT_MIN, the Triton
    kernels the format uses ran (none fell back to torch after its first-use check), and on CUDA the Triton side
    replayed CUDA graphs (bfloat16) while the torch side ran eagerly; `failures` says what did not hold."""
    from .engine import Engine, check_kernels, resolve_device, resolve_dtype
    from .sampler import Done

    name, raw = config_for(config)
    cfg = ModelConfig.from_dict(raw)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    C, V = cfg.canvas_length, cfg.text.vocab_size
    model = random_model(cfg, fmt, policy, dev, dt, seed)
    with torch.no_grad():
        model.norm.weight.fill_(PEAKED_NORM)
    engine = Engine(model, None, GenerationSettings(eos_token_ids=(1,)))
    settings = engine.settings.override(max_new_tokens=canvases * C, max_denoising_steps=steps,
                                        confidence_threshold=1e-12, eos_token_ids=(-1,))
    g = torch.Generator().manual_seed(seed + 1)
    prompts = torch.randint(107, V, (batch, prompt), generator=g)
    canvas = torch.randint(0, V, (batch, C), generator=g).to(dev)
    logits, tokens, stats, kernels = {}, {}, {}, {}
    for side, env in KERNEL_PATHS.items():
        with environment(env):
            check_kernels(dev)
            logits[side] = first_step_logits(model, prompts.to(dev), canvas)
            for ev in engine.events(prompts.tolist(), seed=seed, settings=settings):
                if isinstance(ev, Done):
                    tokens[side], stats[side] = ev.token_ids, ev.stats
            if side == "triton":
                kernels = kernels_in_use(triton_families(fmt, policy, dt), dev, dt)
    a, b = logits["triton"], logits["torch"]
    per_position = (a - b).abs().amax(-1) / b.abs().amax(-1).clamp(min=1e-30)
    pairs = [(x, y) for ra, rb in zip(tokens["triton"], tokens["torch"]) for x, y in zip(ra, rb)]
    agreement = sum(x == y for x, y in pairs) / max(1, len(pairs))
    tol = LOGIT_TOL[fmt, policy]
    rel, outliers, failures = judge(per_position, agreement, fmt, policy)
    failures += [f"the Triton {f} kernel did not run (fell back to torch)" for f, ok in kernels.items() if not ok]
    if dev.type == "cuda" and dt == torch.bfloat16:
        t = stats["triton"]
        if not (t.get("graph_captures", 0) >= 1 and t.get("graph_replays", 0) >= 1):
            failures.append(f"the Triton side replayed no CUDA graph ({t})")
        if stats["torch"].get("graph_replays", 0):
            failures.append("the torch side (DGEMMA_EAGER=1) replayed a CUDA graph")
    return {"format": fmt if fmt == "bf16" else f"{fmt} ({policy})", "config": name, "device": str(dev),
            "dtype": str(dt).removeprefix("torch."), "tokens_compared": len(pairs),
            "tokens_equal": tokens["triton"] == tokens["torch"], "token_agreement": agreement,
            "first_step_logit_rel_diff": rel, "first_step_logit_rel_diff_worst": per_position.max().item(),
            "first_step_logit_rel_diff_p90": per_position.float().quantile(0.9).item(), "outlier_share": outliers,
            "logit_tol": tol, "agreement_min": AGREEMENT_MIN[fmt], "triton_kernels": kernels,
            "graph": {side: stats[side] for side in stats}, "passed": not failures, "failures": failures}


def judge(per_position: torch.Tensor, agreement: float, fmt: str, policy: str) -> tuple[float, float, list[str]]:
    """The verdict on two paths' first-step logits (per canvas position, max |a - b| / max |b|) and token agreement:
    (the figure held to LOGIT_TOL, the share of outlier positions, what failed): the median within LOGIT_TOL, at most
    OUTLIER_SHARE beyond OUTLIER_TOL times it."""
    tol = LOGIT_TOL[fmt, policy]
    per_position = per_position.float()
    rel = per_position.median().item()
    outliers = (per_position > OUTLIER_TOL * tol).float().mean().item()
    failures = []
    if not rel <= tol:
        failures.append(f"first-step logits differ by {rel:.2e} at the median position (limit {tol:.0e})")
    if not outliers <= OUTLIER_SHARE:
        failures.append(f"{outliers:.1%} of the positions differ by more than {OUTLIER_TOL} x {tol:.0e} (at most "
                        f"{OUTLIER_SHARE:.0%}: a bug confined to some positions)")
    if not agreement >= AGREEMENT_MIN[fmt]:
        failures.append(f"{agreement:.1%} of the tokens agree (at least {AGREEMENT_MIN[fmt]:.0%} needed)")
    return rel, outliers, failures


def kernels_in_use(families: tuple[str, ...], device: torch.device, dtype: torch.dtype) -> dict[str, bool]:
    """Per family: whether its Triton kernel runs (on a GPU it may have fallen back to torch at its first use)."""
    from quant.kernels.probe import family_ok

    return {f: family_ok(f, device, dtype) for f in families}
