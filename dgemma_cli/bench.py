"""`dgemma bench`: the denoise step's speed on random weights at any config's shapes, against its physical floor.

Random weights time the engine faithfully (speed does not depend on the values), so no download is needed: the
network is built on the meta device and its tensors are made directly on the target device, in the chosen format
(packed random codes and scales for NVFP4 and INT8). A run: one random prompt of `prompt` tokens per row, encoded
once, then `canvases` canvases of exactly `steps` steps (adaptive stopping off, end tokens ignored).

Reported: ms per denoise step (forward + sampler, synchronised at every step; the median step, so the one that
captures a canvas's CUDA graph does not count), tokens per second inside the canvas
(batch x canvas tokens per `steps` steps), peak device memory, and the step's floor: the bytes one step must move
(weights of every expert the canvas can hit, the embedding twice: LM head and self-conditioning, the KV cache, the
canvas x vocab float32 traffic of logits and sampler) divided by the device's measured copy bandwidth. With
`compare="transformers"` the reference implementation runs the same shapes in the same process (bf16, eager,
random init), timed the same way: steps are timed by the difference between a 4-step and a `steps`-step canvas.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

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
FORMATS = ("bf16", "int8", "nvfp4")


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
    step_bytes: int
    bandwidth_gbs: float
    prefill_ms: float
    reference_ms_per_step: float | None = None
    speedup_vs_reference: float | None = None

    def table(self) -> str:
        rows = [("config / format", f"{self.config} / {self.format}, batch {self.batch}, prompt {self.prompt}, "
                                    f"{self.steps} steps, {self.device}"),
                ("ms per denoise step", f"{self.ms_per_step:.2f}"),
                ("tokens/s in the canvas", f"{self.tokens_per_s:,.0f}"),
                ("prefill (ms)", f"{self.prefill_ms:.1f}"),
                ("peak memory", "n/a (CPU)" if self.peak_memory_gb is None else f"{self.peak_memory_gb:.2f} GB"),
                ("weight-read floor", f"{self.floor_ms:.2f} ms ({self.step_bytes / 1e9:.2f} GB at "
                                      f"{self.bandwidth_gbs:.0f} GB/s copy bandwidth)"),
                ("step / floor", f"{self.floor_ratio:.2f}x")]
        if self.reference_ms_per_step is not None:
            rows += [("reference ms per step", f"{self.reference_ms_per_step:.2f}"),
                     ("speed-up vs reference", f"{self.speedup_vs_reference:.2f}x")]
        return "\n".join(f"{k + ':':<26}{v}" for k, v in rows)


def config_for(name: str) -> tuple[str, dict]:
    """A named config (real, mid, tiny) or a model directory's config.json."""
    from pathlib import Path

    from .config import read_json_object
    from .errors import ModelError

    if name in CONFIGS:
        return name, CONFIGS[name]
    path = Path(name).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise UsageError(f"--config must be one of {', '.join(CONFIGS)} or a model directory (got {name!r})")
    try:
        return str(path.parent), read_json_object(path)
    except ModelError as e:  # a bad --config value is a usage error here
        raise UsageError(str(e)) from None


def random_model(cfg: ModelConfig, fmt: str, policy: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """The network with random weights made on `device`, quantized modules filled with random packed values."""
    from quant import modules as q

    from .model import DiffusionGemma, Experts, QuantizedExperts, RMSNorm

    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    if fmt != "bf16":
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
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layer_scalar") or name.endswith(("router.scale", "per_expert_scale")):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
        for mod in model.modules():
            if isinstance(mod, RMSNorm) and mod.weight is not None:
                mod.weight.fill_(1.0)
        for name, b in model.named_buffers():
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


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    n = (1 << 30) if device.type == "cuda" else (256 << 20)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    reps = 10 if device.type == "cuda" else 3
    t0 = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    sync(device)
    return 2 * n * reps / (time.perf_counter() - t0)


def step_bytes(cfg: ModelConfig, fmt: str, policy: str, batch: int, context: int) -> int:
    """Bytes one denoise step must read or write at least (see the module docstring)."""
    from .footprint import kv_cache_bytes, weight_bytes

    t, C = cfg.text, cfg.canvas_length
    w = weight_bytes(cfg, fmt, policy)
    hit = t.num_experts * (1 - (1 - t.top_k_experts / t.num_experts) ** (batch * C))  # expected experts hit
    experts = w["experts"] * hit / t.num_experts
    canvas_vocab = 4 * batch * C * t.vocab_size * 4  # logits written, read and rewritten by the sampler, read back
    return int(experts + w["dense"] + w["other"] + 2 * w["embedding"] + kv_cache_bytes(cfg, context, batch)
               + canvas_vocab)


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


def time_dgemma(engine, prompts, steps: int, canvases: int, device) -> float:
    """ms per step from timestamps taken after a device sync at every step."""
    from .sampler import Step

    settings = engine.settings.override(max_new_tokens=canvases * engine.config.canvas_length,
                                        max_denoising_steps=steps, confidence_threshold=1e-12,
                                        eos_token_ids=(-1,))
    stamps = []
    for ev in engine.events(prompts, seed=0, settings=settings):
        if isinstance(ev, Step):
            sync(device)
            stamps.append((ev.canvas_index, time.perf_counter()))
    intervals = []  # step to step, within a canvas
    for c in range(canvases):
        ts = [t for ci, t in stamps if ci == c]
        intervals += [b - a for a, b in zip(ts, ts[1:])]
    # the median: the steady step; the step that captures the canvas's CUDA graph is an outlier
    return 1000 * statistics.median(intervals)


def time_reference(config: dict, prompts: torch.Tensor, steps: int, device, dtype) -> float:
    """The reference's ms per step: (time of a `steps`-step canvas - time of a 4-step one) / (steps - 4)."""
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
    C = cfg.canvas_length

    def run(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            ref.generate(prompts, max_new_tokens=C, max_denoising_steps=n, confidence_threshold=1e-12,
                         sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1), t_min=0.4, t_max=0.8,
                         stability_threshold=1, eos_token_id=[-1], pad_token_id=0)
        sync(device)
        return time.perf_counter() - t0

    run(4)  # warm-up
    short, long = run(4), run(steps)
    del ref
    return 1000 * (long - short) / (steps - 4)


def run_bench(config: str = "mid", fmt: str = "nvfp4", policy: str = "experts", batch: int = 1, prompt: int = 512,
              steps: int = 16, canvases: int = 1, device: str = "auto", dtype: str = "auto",
              compare: str | None = None) -> BenchResult:
    from .engine import Engine, check_kernels, resolve_device, resolve_dtype

    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)} (got {fmt!r})")
    if batch < 1 or prompt < 1 or steps < 5 or canvases < 1:
        raise UsageError("--batch, --prompt and --canvases must be >= 1 and --steps >= 5")
    if compare not in (None, "transformers"):
        raise UsageError(f"--compare takes 'transformers' (got {compare!r})")
    name, raw = config_for(config)
    cfg = ModelConfig.from_dict(raw)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    check_kernels(dev)
    from .footprint import system_free, weight_bytes

    if dev.type == "cpu":  # random weights are made in place: refuse what cannot fit instead of swapping to death
        need = sum(weight_bytes(cfg, fmt, policy).values()) * (dt.itemsize / 2)
        free = system_free()
        if free and need > 0.8 * free:
            raise UsageError(f"--config {name} needs about {need / 1e9:.0f} GB for its weights on the CPU; "
                             f"{free / 1e9:.0f} GB are free (use a GPU, or --config mid)")
    torch.manual_seed(0)
    model = random_model(cfg, fmt, policy, dev, dt)
    engine = Engine(model, None, GenerationSettings(eos_token_ids=(1,)))
    V = cfg.text.vocab_size
    prompts = torch.randint(107, V, (batch, prompt), generator=torch.Generator().manual_seed(1))
    ids = prompts.tolist()
    time_dgemma(engine, ids, 5, 1, dev)  # warm-up: kernels compiled, graphs captured, allocator settled
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    ms = time_dgemma(engine, ids, steps, canvases, dev)
    prefill = time_prefill(model, prompts)
    peak = torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None
    bw = copy_bandwidth(dev)
    nbytes = step_bytes(cfg, fmt, policy, batch, prompt + canvases * cfg.canvas_length)
    floor = 1000 * nbytes / bw
    result = BenchResult(name, fmt if fmt == "bf16" or policy == "experts" else f"{fmt} ({policy})", str(dev), batch,
                         prompt, steps, ms, batch * cfg.canvas_length * 1000 / (ms * steps), peak, floor, ms / floor,
                         nbytes, bw / 1e9, prefill)
    if compare:
        del engine, model  # the reference gets the device to itself
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        ref_ms = time_reference(raw, prompts.to(dev), steps, dev, torch.bfloat16 if dev.type == "cuda" else dt)
        result.reference_ms_per_step, result.speedup_vs_reference = ref_ms, ref_ms / ms
    return result


def as_dict(r: BenchResult) -> dict:
    return asdict(r)
