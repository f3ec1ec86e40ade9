"""How many bytes a model takes, per format and policy, computed from its config's shapes (no weights needed).

`weight_bytes`: the tensors dgemma keeps in memory (the text stack; quantized ones packed). `runtime_bytes`: an
estimate of GPU memory for a run: weights, the KV cache at a context length, each request's step memory
(`request_bytes`: the fused head's buffers and a layer's activations), and for quantized experts the one layer that the PyTorch path dequantizes at a time. `choose_format` is what
`--quant auto` uses. Everything here is arithmetic on shapes; figures from it are computed, not measured.
"""

from __future__ import annotations

from ..config import ModelConfig  # torch is imported only where a device is asked about: `dgemma show` never does

FORMATS = ("bf16", "fp8", "int8", "nvfp4")  # least lossy first (FP8 and INT8 are the same size)
# What each format quantizes by default, as its published releases do: NVFP4 the routed experts (NVIDIA's export),
# FP8 and INT8 also attention and the dense MLP (the compressed-tensors W8A8 releases).
DEFAULT_POLICY = {"bf16": "experts", "nvfp4": "experts", "fp8": "all", "int8": "all"}
FP8_CAPABILITY = (8, 9)  # FP8 tensor cores from Ada (sm_89)
DENSE = ("self_attn", "mlp")
RUNTIME_SLACK = 512 << 20  # CUDA context, allocator slack, small activations (a guess, not measured)


def packed_bytes(fmt: str, n: int, k: int) -> int:
    """Bytes of one [N, K] matrix in a format."""
    if fmt == "nvfp4":
        return n * k // 2 + n * k // 16 + 8  # codes, e4m3 block scales, global scale, input scale
    if fmt in ("int8", "fp8"):
        return n * k + 2 * n  # codes, bfloat16 row scales (dgemma's INT8 v1 had float32 ones: 2n more)
    return 2 * n * k


def layer_bytes(cfg: ModelConfig, fmt: str, policy: str | None = None) -> list[dict[str, int]]:
    """Per layer, bytes by part: its routed experts, its dense weights (attention + dense MLP), the rest (router, norms,
    q/k norms). What the placement planner puts on a card or streams, layer by layer."""
    t = cfg.text
    policy = policy or DEFAULT_POLICY[fmt]
    H, I, Im, E = t.hidden_size, t.intermediate_size, t.moe_intermediate_size, t.num_experts
    dense_fmt = fmt if policy == "all" else "bf16"
    out = []
    for spec in t.layers:
        q, kv = t.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        linears = [(q, H), (kv, H), (H, q), (I, H), (I, H), (H, I)] + ([(kv, H)] if spec.is_sliding else [])
        out.append({"experts": E * (packed_bytes(fmt, 2 * Im, H) + packed_bytes(fmt, H, Im)),
                    "dense": sum(packed_bytes(dense_fmt, n, k) for n, k in linears),  # [out, in]: attention, MLP
                    "other": 2 * (2 * spec.head_dim + E * H + H + E + 7 * H)})  # q/k norms; router; norms
    return out


def weight_bytes(cfg: ModelConfig, fmt: str, policy: str | None = None) -> dict[str, int]:
    """Bytes by part: experts, dense (attention + dense MLP), embedding, other (router, norms, self-conditioning).

    Counted from the config's shapes, module by module as model.DiffusionGemma builds them (tests check the two
    agree), without building it: no torch."""
    t = cfg.text
    H, I, L = t.hidden_size, t.intermediate_size, t.num_hidden_layers
    layers = layer_bytes(cfg, fmt, policy)
    # final norm; self-conditioning's pre-norm, gate, up, down; layer scalars
    other = 2 * (H + H + 3 * H * I + 2 * L) + sum(lb["other"] for lb in layers)
    return {"experts": sum(lb["experts"] for lb in layers), "dense": sum(lb["dense"] for lb in layers),
            "embedding": 2 * t.vocab_size * H, "other": other}


def layer_cache_bytes(cfg: ModelConfig, context: int, batch: int = 1) -> list[int]:
    """Per layer, bf16 K and V: sliding layers keep a window, full layers the whole context (+ a canvas)."""
    t, C = cfg.text, cfg.canvas_length
    return [2 * batch * ((min(context, t.sliding_window - 1) if spec.is_sliding else context) + C)
            * spec.num_kv_heads * spec.head_dim * 2 for spec in t.layers]


def kv_cache_bytes(cfg: ModelConfig, context: int, batch: int = 1) -> int:
    """bf16 K and V for every layer: sliding layers keep a window, full layers the whole context (+ a canvas)."""
    return sum(layer_cache_bytes(cfg, context, batch))


HEAD_CHUNK, HEAD_TILE = 32768, 128  # the fused head's vocabulary chunk and tile (quant/kernels/head.py)
PLAN_BLOCK = 64  # the experts' largest block of rows: the plan pads each expert to a multiple of it


def request_bytes(cfg: ModelConfig, splits: int = 8) -> int:
    """GPU memory one request's canvas needs during a step besides the weights and its KV cache, on the GPU path (the
    fused head: no canvas x vocab float32 buffer): the head's buffers kept between steps, and the larger of the
    head's scratch and a layer's activations (they are never alive at once). The layer's: the experts' intermediate
    for every routed row and the plan's padding, their per-assignment outputs, a full-attention layer's q twice, and
    a handful of hidden-size activations. splits: the head's soft-embedding running sums (one per split of a chunk's
    columns; quant/kernels/head.py `_splits` picks 1-8 by the GPU's SM count: 8, the most, by default). The step
    trace measures it (dgemma_cli/step_trace.py, `make kernel-report`); this is the same count from the shapes."""
    t, C = cfg.text, cfg.canvas_length
    H, V, K, E = t.hidden_size, t.vocab_size, t.top_k_experts, t.num_experts
    tiles, chunks = -(-V // HEAD_TILE), -(-V // min(HEAD_CHUNK, V))
    head_kept = C * (2 * H + 8 + 8 + 4 + 4 + 8 + 4 * chunks)  # soft embedding, draws, entropy, temperature, uniforms
    head_scratch = C * (2 * min(HEAD_CHUNK, V) + 5 * 4 * tiles + 4 * H * splits)
    heads_dim = t.num_attention_heads * max(spec.head_dim for spec in t.layers)
    layer = (2 * (C * K + E * (PLAN_BLOCK - 1)) * t.moe_intermediate_size + 2 * C * K * H + 2 * 2 * C * heads_dim
             + 6 * 2 * C * H)
    return head_kept + max(head_scratch, layer)


def dequantized_layer_bytes(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """One layer's routed experts unpacked to the compute dtype (gate, up and down of every expert): what the PyTorch
    path of a quantized stack makes for a layer's forward."""
    t = cfg.text
    return dtype_bytes * t.num_experts * 3 * t.moe_intermediate_size * t.hidden_size


def runtime_bytes(cfg: ModelConfig, fmt: str, policy: str | None = None, context: int = 8192, batch: int = 1) -> int:
    weights = sum(weight_bytes(cfg, fmt, policy).values())
    canvas = batch * request_bytes(cfg)
    unpacked = 0 if fmt == "bf16" else dequantized_layer_bytes(cfg)
    return weights + kv_cache_bytes(cfg, context, batch) + canvas + unpacked + RUNTIME_SLACK


def candidates(capability: tuple[int, int] | None) -> list[str]:
    """The formats `--quant auto` weighs, in order of preference, on a GPU of `capability` (None: no GPU). FP8 only
    where the GPU has FP8 tensor cores (its activations then run 8-bit there); it is preferred to INT8 of the same
    size there, since FP8's relative steps keep a token's small activations beside its outliers, which INT8's uniform
    per-token steps round away."""
    fp8 = capability is not None and tuple(capability) >= FP8_CAPABILITY
    return [f for f in FORMATS if f != "fp8" or fp8]


def choose_format(cfg: ModelConfig, free: int, context: int = 8192,
                  capability: tuple[int, int] | None = None) -> str | None:
    """The first of `candidates(capability)` whose estimate at `context` (each format with its default policy) fits
    in `free` bytes, or None when none does."""
    for fmt in candidates(capability):
        if runtime_bytes(cfg, fmt, context=context) <= free:
            return fmt
    return None


def capability() -> tuple[int, int] | None:
    """The first CUDA device's compute capability, None without one."""
    import torch

    if torch.cuda.is_available():
        return tuple(torch.cuda.get_device_capability(0))
    return None


def system_free() -> int:
    """Available system memory in bytes (0 when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


def free_memory() -> tuple[int, str]:
    """(bytes, where): free memory of the first CUDA device, else available system memory."""
    import torch

    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(0)
        return free, f"GPU {torch.cuda.get_device_name(0)}"
    return system_free(), "system memory (no CUDA GPU found)"


def adapter_parameters(cfg: ModelConfig, rank: int, targets=("attention", "mlp"), expert_rank: int = 0) -> int:
    """Parameters of a LoRA adapter as lora.new_adapter makes it (one set shared by both passes)."""
    t = cfg.text
    H, I, E, Im = t.hidden_size, t.intermediate_size, t.num_experts, t.moe_intermediate_size
    n = 0
    for spec in t.layers:
        if "attention" in targets:
            q, kv = t.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
            n += rank * (H + q) * 2 + rank * (H + kv) * (2 if spec.is_sliding else 1)  # q, o; k (and v)
        if "mlp" in targets:
            n += rank * (H + I) * 3
        n += expert_rank * E * ((H + 2 * Im) + (Im + H))
    if "self_conditioning" in targets:
        n += rank * (H + I) * 3
    return n


def tune_bytes(cfg: ModelConfig, fmt: str, batch: int, prompt: int, rank: int, targets=("attention", "mlp"),
               expert_rank: int = 0, checkpointing: bool = True, policy: str | None = None,
               dtype_bytes: int = 2) -> dict[str, int]:
    """Memory `dgemma tune` needs at most, by part (computed from the shapes, not measured):

    - weights: the base as stored (quantized ones packed; a quantized layer's experts are dequantized for its
      forward: one layer at a time with checkpointing, every layer's kept for the backward pass without);
    - adapter: its float32 factors, their gradients and AdamW's two moments (16 bytes a parameter);
    - activations kept for the backward pass, in the compute dtype: per layer and token of the prompt and of the
      canvas (twice: the self-conditioning pass and the trained one), the attention's (the normed input, q, k, v,
      the attention output, the residual) and, without checkpointing, the feed-forward's (the dense MLP's three
      intermediates, each routed assignment's gate, up and product, the expert outputs); with it, only each
      stage's input. The KV caches (the prompt's and two clones for the canvas passes);
    - the head: float32 logits of the canvas, their softmax for self-conditioning and their gradient.
    """
    t, C = cfg.text, cfg.canvas_length
    H, V, K = t.hidden_size, t.vocab_size, t.top_k_experts
    weights = sum(weight_bytes(cfg, fmt, policy).values())
    dequantized = 0 if fmt == "bf16" else dequantized_layer_bytes(cfg, dtype_bytes)
    dequantized *= 1 if checkpointing else t.num_hidden_layers
    adapter = 16 * adapter_parameters(cfg, rank, targets, expert_rank)
    tokens = batch * (prompt + 2 * C)
    per_layer = 0
    for spec in t.layers:
        q, kv = t.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        attention = 3 * H + 2 * q + 2 * kv
        ffn = H if checkpointing else (4 * H + 3 * t.intermediate_size + K * (4 * t.moe_intermediate_size + H))
        per_layer += attention + ffn
    activations = dtype_bytes * tokens * per_layer + 3 * kv_cache_bytes(cfg, prompt, batch)
    head = 3 * 4 * batch * C * V
    return dict(weights=weights + dequantized, adapter=adapter, activations=activations, head=head,
                total=weights + dequantized + adapter + activations + head + RUNTIME_SLACK)
