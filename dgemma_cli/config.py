"""Model and generation settings, parsed from a checkpoint's config.json and generation_config.json.

Settings are resolved in one documented order: the checkpoint's files, then built-in defaults for what they
leave unset, then explicit overrides (command-line flags). Derived per-layer values (head dim, kv heads, RoPE
frequencies per layer type) follow the reference `DiffusionGemmaTextConfig.__post_init__` exactly.
No torch import here: the CLI reads configs before deciding to load anything heavy.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .errors import ModelError, UsageError

SLIDING = "sliding_attention"
FULL = "full_attention"

# Keys of text_config that must be present: a config without them is not a DiffusionGemma text stack.
_REQUIRED_TEXT_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "num_experts",
    "top_k_experts",
    "moe_intermediate_size",
)

_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(frozen=True)
class LayerSpec:
    """What differs between layers: attention kind and head geometry."""

    kind: str  # SLIDING or FULL
    head_dim: int
    num_kv_heads: int

    @property
    def is_sliding(self) -> bool:
        return self.kind == SLIDING


@dataclass
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    pad_token_id: int = 0
    bos_token_id: int = 2
    eos_token_id: int | list[int] = 1
    sliding_window: int = 512
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = 30.0
    attention_bias: bool = False
    use_bidirectional_attention: str | None = None
    rope_parameters: dict[str, dict[str, Any]] | None = None
    # Derived in __post_init__:
    layers: list[LayerSpec] = field(default_factory=list)
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    per_layer_config: dict[str, dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.use_bidirectional_attention == "all":
            # Mirrors the reference: flash-style exclusive bounds.
            self.sliding_window = (self.sliding_window // 2) + 1
        if self.layer_types is None:
            self.layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(self.num_hidden_layers)]
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelError(
                f"config.json: layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        bad = set(self.layer_types) - {SLIDING, FULL}
        if bad:
            raise ModelError(f"config.json: unknown layer type {sorted(bad)[0]!r}")
        if self.layer_types[-1] != FULL:  # the reference forces the last layer to full attention
            self.layer_types[-1] = FULL
        if self.rope_parameters is None:
            self.rope_parameters = _DEFAULT_ROPE
        if self.attention_bias:
            raise ModelError("config.json: attention_bias=true is not a DiffusionGemma layout")

        # Per-layer overrides: explicit `per_layer_config` wins; otherwise full layers get the global geometry.
        if self.per_layer_config is None:
            overrides: dict[str, Any] = {"head_dim": self.global_head_dim}
            if self.num_global_key_value_heads is not None:
                overrides["num_key_value_heads"] = self.num_global_key_value_heads
            per_layer = {str(i): overrides for i, t in enumerate(self.layer_types) if t == FULL}
        else:
            per_layer = {str(k): v for k, v in self.per_layer_config.items()}
        self.layers = []
        for i, kind in enumerate(self.layer_types):
            o = per_layer.get(str(i), {})
            spec = LayerSpec(
                kind=kind,
                head_dim=int(o.get("head_dim", self.head_dim)),
                num_kv_heads=int(o.get("num_key_value_heads", self.num_key_value_heads)),
            )
            if self.num_attention_heads % spec.num_kv_heads:
                raise ModelError(f"config.json: layer {i} has {spec.num_kv_heads} kv heads for "
                                 f"{self.num_attention_heads} query heads")
            self.layers.append(spec)
        for kind in set(self.layer_types):
            dims = {s.head_dim for s in self.layers if s.kind == kind}
            if len(dims) != 1:
                raise ModelError(f"config.json: {kind} layers have different head dims {sorted(dims)}")
            if kind not in self.rope_parameters:
                raise ModelError(f"config.json: rope_parameters has no entry for {kind}")

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return list(e) if isinstance(e, (list, tuple)) else [e]

    def head_dim_of(self, kind: str) -> int:
        return next(s.head_dim for s in self.layers if s.kind == kind)


# The image soft-token budgets the Gemma 4 image processor accepts (patches per image = budget x pooling^2).
IMAGE_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)


@dataclass
class VisionConfig:
    """The `gemma4_vision` tower (config.json's vision_config) plus the image token ids from the top level.

    An image becomes `boi_token_id`, N x `image_token_id`, `eoi_token_id` in the prompt; the tower's N projected
    soft tokens replace the image-token embeddings (encoder only).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10 * 1024
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    hidden_activation: str = "gelu_pytorch_tanh"
    standardize: bool = False
    use_clipped_linears: bool = False
    image_token_id: int = 258_880
    boi_token_id: int = 255_999
    eoi_token_id: int = 258_882
    default_soft_tokens: int = 280

    @classmethod
    def from_model_dict(cls, raw: dict[str, Any], source: str = "config.json") -> VisionConfig | None:
        """The vision config of a model's config.json, or None when it has no vision tower."""
        v = raw.get("vision_config")
        if not isinstance(v, dict):
            return None
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
                   if k not in v]
        if missing:
            raise ModelError(f"{source}: vision_config is missing {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        kw = {k: v[k] for k in known if v.get(k) is not None}
        kw.setdefault("num_key_value_heads", v["num_attention_heads"])
        kw.setdefault("head_dim", v["hidden_size"] // v["num_attention_heads"])
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_theta") is not None:
            kw["rope_theta"] = float(rope["rope_theta"])
        for key in ("image_token_id", "boi_token_id", "eoi_token_id"):
            if raw.get(key) is not None:
                kw[key] = int(raw[key])
        if raw.get("vision_soft_tokens_per_image") in IMAGE_TOKEN_BUDGETS:
            kw["default_soft_tokens"] = int(raw["vision_soft_tokens_per_image"])
        cfg = cls(**kw)
        if cfg.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ModelError(f"{source}: unsupported vision hidden_activation {cfg.hidden_activation!r}")
        if cfg.use_clipped_linears:
            raise ModelError(f"{source}: a vision tower with clipped linears is not supported")
        if cfg.num_attention_heads % cfg.num_key_value_heads or cfg.head_dim % 4:
            raise ModelError(f"{source}: vision_config has an unsupported head geometry")
        return cfg


@dataclass
class ModelConfig:
    text: TextConfig
    canvas_length: int = 256
    source: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False)  # config.json as read (quantization_config, ...)
    processor_soft_tokens: int | None = None  # the image processor's max_soft_tokens (processor_soft_tokens)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        model_type = raw.get("model_type")
        archs = raw.get("architectures") or []
        if model_type != "diffusion_gemma" and "DiffusionGemmaForBlockDiffusion" not in archs:
            got = model_type or (archs[0] if archs else "unknown")
            raise ModelError(f"{source}: not a DiffusionGemma checkpoint (model_type {got!r})")
        text_raw = raw.get("text_config")
        if not isinstance(text_raw, dict):
            raise ModelError(f"{source}: DiffusionGemma config has no text_config")
        missing = [k for k in _REQUIRED_TEXT_KEYS if k not in text_raw]
        if missing:
            raise ModelError(f"{source}: text_config is missing {', '.join(missing)}")
        known = {f.name for f in fields(TextConfig)} - {"layers"}
        text = TextConfig(**{k: v for k, v in text_raw.items() if k in known})
        return cls(text=text, canvas_length=int(raw.get("canvas_length") or 256), source=source, raw=raw)

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ModelError(f"{path}: no config.json (is this a model directory?)")
        cfg = cls.from_dict(read_json_object(cfg_path), source=str(cfg_path))
        cfg.processor_soft_tokens = processor_soft_tokens(Path(path))
        return cfg

    @property
    def vision(self) -> VisionConfig | None:
        """The vision tower's config, None for a text-only config.json. Its default soft tokens per image are the
        image processor's (as transformers' processor would use), else config.json's, else 280."""
        v = VisionConfig.from_model_dict(self.raw, self.source or "config.json")
        if v is not None and self.processor_soft_tokens is not None:
            v = replace(v, default_soft_tokens=self.processor_soft_tokens)
        return v


def processor_soft_tokens(path: Path) -> int | None:
    """`max_soft_tokens` of the checkpoint's image processor, where transformers' AutoImageProcessor reads it:
    preprocessor_config.json, else processor_config.json's "image_processor" (or its top level). A value that is
    not a budget the processor supports is an error, as it is there."""
    for name, keys in (("preprocessor_config.json", ()), ("processor_config.json", ("image_processor",)),
                       ("processor_config.json", ())):
        file = path / name
        if not file.is_file():
            continue
        raw = read_json_object(file)
        for key in keys:
            raw = raw.get(key) if isinstance(raw.get(key), dict) else {}
        value = raw.get("max_soft_tokens")
        if value is None:
            continue
        if value not in IMAGE_TOKEN_BUDGETS or isinstance(value, bool):
            raise ModelError(f"{file}: max_soft_tokens must be one of {', '.join(map(str, IMAGE_TOKEN_BUDGETS))} "
                             f"(got {value!r})")
        return int(value)
    return None


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object; anything else is one ModelError line."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path}: not a JSON object")
    return raw


# The sampler's settings a user can change: flag name (without "--", also chat's /set name) -> (field of
# GenerationSettings, type, what it does). Names follow generation_config.json's keys.
SAMPLER_FLAGS: dict[str, tuple[str, type, str]] = {
    "max-new-tokens": ("max_new_tokens", int, "Most tokens to generate."),
    "steps": ("max_denoising_steps", int, "Most denoising steps per canvas."),
    "t-max": ("t_max", float, "Sampling temperature at a canvas's first step; it falls linearly to --t-min at "
              "the last."),
    "t-min": ("t_min", float, "Sampling temperature at a canvas's last step."),
    "entropy-bound": ("entropy_bound", float, "Each step accepts the surest tokens while their summed entropy "
                      "stays within this bound: lower is more careful and takes more steps."),
    "confidence-threshold": ("confidence_threshold", float, "A canvas stops early once its mean entropy is "
                             "below this and its best guess is stable (0: always take --steps steps)."),
    "stability-threshold": ("stability_threshold", int, "Steps the best guess must stay unchanged before a "
                            "canvas may stop early."),
}


@dataclass
class GenerationSettings:
    """The sampler's knobs (docs/design.md, The sampler). Defaults are the reference's global defaults."""

    max_new_tokens: int = 256
    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int = 0
    # Greedy: each draw is the step's argmax instead of a sample; which positions a step accepts still follows the
    # entropies at the temperature schedule (t_max -> t_min), so the canvas settles at the usual pace.
    greedy: bool = False

    @classmethod
    def from_checkpoint(cls, path: Path | None, text: TextConfig | None = None) -> GenerationSettings:
        """Checkpoint generation_config.json first, then the model config's eos/pad, then built-in defaults."""
        s = cls()
        if text is not None:
            s = replace(s, eos_token_ids=tuple(text.eos_ids), pad_token_id=text.pad_token_id)
        gen_path = Path(path) / "generation_config.json" if path is not None else None
        if gen_path is None or not gen_path.is_file():
            return s
        try:
            raw = json.loads(gen_path.read_text())
        except (OSError, ValueError) as e:
            raise ModelError(f"{gen_path}: cannot read JSON ({e})") from None
        upd: dict[str, Any] = {}
        for key in ("max_new_tokens", "max_denoising_steps", "t_min", "t_max", "stability_threshold",
                    "confidence_threshold", "pad_token_id"):
            if raw.get(key) is not None:
                upd[key] = raw[key]
        sc = raw.get("sampler_config")
        if isinstance(sc, dict) and sc.get("entropy_bound") is not None:
            upd["entropy_bound"] = float(sc["entropy_bound"])
        if raw.get("eos_token_id") is not None:
            e = raw["eos_token_id"]
            upd["eos_token_ids"] = tuple(e) if isinstance(e, list) else (e,)
        return replace(s, **upd)

    def override(self, **kwargs: Any) -> GenerationSettings:
        """Apply explicit overrides; `None` means "not given" and keeps the current value.

        `temperature` (the API's, and `--temperature`) is not a field: it scales this schedule (t_min and t_max
        times it; 1 keeps it), and 0 is greedy. A schedule end given alone moves the other end with it where the
        schedule would otherwise run backwards (--t-max 0.1 under a model's t_min of 0.4 makes both 0.1)."""
        given = {k: v for k, v in kwargs.items() if v is not None}
        temperature = given.pop("temperature", None)
        if temperature is not None:
            if "t_min" in given or "t_max" in given:
                raise UsageError("--temperature scales the model's schedule; give it, or --t-max / --t-min, not both")
            if not 0 <= temperature <= 2:  # NaN fails too
                raise UsageError(f"--temperature must be between 0 (greedy) and 2; 1 keeps the model's schedule "
                                 f"(got {temperature:g})")
            if temperature == 0:
                given["greedy"] = True
            else:
                given["t_min"], given["t_max"] = self.t_min * temperature, self.t_max * temperature
        elif "t_max" in given and "t_min" not in given and given["t_max"] < self.t_min:
            given["t_min"] = given["t_max"]
        elif "t_min" in given and "t_max" not in given and given["t_min"] > self.t_max:
            given["t_max"] = given["t_min"]
        s = replace(self, **given)
        s.validate()
        return s

    def validate(self) -> None:
        """Each setting named by its flag (SAMPLER_FLAGS), as the user gave it."""
        if self.max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be at least 1 (got {self.max_new_tokens})")
        if self.max_denoising_steps < 1:
            raise UsageError(f"--steps must be at least 1 (got {self.max_denoising_steps})")
        if not self.t_max > 0:  # NaN fails too
            raise UsageError(f"--t-max must be > 0 (got {self.t_max:g}); for greedy draws use --temperature 0")
        if not 0 <= self.t_min <= self.t_max:
            raise UsageError(f"--t-min must be between 0 and --t-max (got --t-min {self.t_min:g}, --t-max "
                             f"{self.t_max:g})")
        if not self.entropy_bound > 0:
            raise UsageError(f"--entropy-bound must be > 0 (got {self.entropy_bound:g})")
        if not self.confidence_threshold >= 0:
            raise UsageError(f"--confidence-threshold must be >= 0 (got {self.confidence_threshold:g})")
        if self.stability_threshold < 0:
            raise UsageError(f"--stability-threshold must be >= 0 (got {self.stability_threshold})")

    def describe(self) -> list[tuple[str, str]]:
        """(flag name, value) for each setting a user can change, in SAMPLER_FLAGS's order."""
        out = []
        for flag, (name, _, _) in SAMPLER_FLAGS.items():
            value = getattr(self, name)
            out.append((flag, f"{value:g}" if isinstance(value, float) else str(value)))
        return out

    def canvases_for(self, canvas_length: int) -> int:
        return math.ceil(self.max_new_tokens / canvas_length)


# The published google/diffusiongemma-26B-A4B-it's shapes (docs/design.md, The model), for sizes and benchmarks computed
# or run without the download.
DIFFUSIONGEMMA_26B_A4B = {
    "model_type": "diffusion_gemma",
    "canvas_length": 256,
    "text_config": {
        "vocab_size": 262144, "hidden_size": 2816, "intermediate_size": 2112, "moe_intermediate_size": 704,
        "num_experts": 128, "top_k_experts": 8, "num_hidden_layers": 30, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 256, "num_global_key_value_heads": 2, "global_head_dim": 512,
        "sliding_window": 1024, "max_position_embeddings": 262144, "final_logit_softcapping": 30.0,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
        },
    },
}
