"""The Gemma 4 vision tower: image patches in, soft tokens in the text model's hidden size out.

    patches [B, P, 3 * patch^2] (P = budget * pool^2, zero-padded) and positions [B, P, 2] (x, y; -1 = padding)
    -> patch embedding: linear(2 * pixels - 1) + x-table[x] + y-table[y]        [B, P, Hv]
    -> L bidirectional layers (padding patches masked as keys), 2-D RoPE     [B, P, Hv]
    -> 3x3 average pooling by patch position, * sqrt(Hv), padding dropped    [N, Hv]  (N = sum of soft tokens)
    -> standardize ((h - std_bias) * std_scale, when the config says so)
    -> weightless RMSNorm, linear to the text hidden size ("embed_vision")    [N, H]

The rule: this file knows tensors, not pixels or tokens (image.py makes the patches, the engine places the soft
tokens). Numerics follow the reference (transformers' `Gemma4VisionModel`) op for op: float32 norms, attention
scale 1.0, q/k RMSNorms with weight and a weightless v norm, the pooling and its float32 scaling. Layers reuse the
text model's building blocks. The tower is stored in bf16 in every published checkpoint and is never quantized;
`load_vision` reads it from the checkpoint's own files, only when an image is given.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import VisionConfig
from .errors import ModelError
from .model import MLP, RMSNorm, apply_rope, attend
from .checkpoint.names import VISION_EMBED, VISION_ROOTS, VISION_TOWER

# Where a checkpoint keeps the tower and its projection (DiffusionGemma first, then the Gemma 4 layout).
VISION_PREFIXES = VISION_ROOTS  # where the tower may sit, preferred first (checkpoint/names.py)
TOWER, EMBED = VISION_TOWER, VISION_EMBED


def vision_inv_freq(cfg: VisionConfig) -> torch.Tensor:
    """[head_dim // 4] inverse frequencies, shared by the x and y axes: each axis rotates half the head dim."""
    half = cfg.head_dim // 2
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float, device="cpu") / half))


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.head_dim = D
        self.q_proj = nn.Linear(H, cfg.num_attention_heads * D, bias=False)
        self.k_proj = nn.Linear(H, cfg.num_key_value_heads * D, bias=False)
        self.v_proj = nn.Linear(H, cfg.num_key_value_heads * D, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.v_norm = RMSNorm(D, cfg.rms_norm_eps, with_scale=False)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, P, heads, D]: the first D/2 channels rotate by the x position, the last D/2 by the y position.
        cos, sin [B, P, 1, D] laid out as (x angles twice, y angles twice)."""
        h = self.head_dim // 2
        return torch.cat([apply_rope(x[..., :h], cos[..., :h], sin[..., :h]),
                          apply_rope(x[..., h:], cos[..., h:], sin[..., h:])], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None):
        B, P, _ = x.shape
        q = self.rope(self.q_norm(self.q_proj(x).view(B, P, -1, self.head_dim)), cos, sin).transpose(1, 2)
        k = self.rope(self.k_norm(self.k_proj(x).view(B, P, -1, self.head_dim)), cos, sin).transpose(1, 2)
        v = self.v_norm(self.v_proj(x).view(B, P, -1, self.head_dim)).transpose(1, 2)
        return self.o_proj(attend(q, k, v, mask))  # bidirectional: no causal flag


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        H = cfg.hidden_size
        self.self_attn = VisionAttention(cfg)
        self.mlp = MLP(H, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(H, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class VisionTower(nn.Module):
    """The tower and its projection into the text model (`embed_vision`)."""

    def __init__(self, cfg: VisionConfig, text_hidden: int):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.input_proj = nn.Linear(3 * cfg.patch_size**2, H, bias=False)
        self.position_table = nn.Parameter(torch.zeros(2, cfg.position_embedding_size, H))  # [x or y, position, H]
        self.layers = nn.ModuleList(VisionLayer(cfg) for _ in range(cfg.num_hidden_layers))
        if cfg.standardize:
            self.std_bias = nn.Parameter(torch.zeros(H))
            self.std_scale = nn.Parameter(torch.ones(H))
        self.embed_norm = RMSNorm(H, cfg.rms_norm_eps, with_scale=False)
        self.embed_proj = nn.Linear(H, text_hidden, bias=False)
        self.inv_freq = vision_inv_freq(cfg)  # derived, never loaded

    @property
    def dtype(self) -> torch.dtype:
        return self.input_proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.input_proj.weight.device

    def hidden(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """pixel_values [B, P, 3 * patch^2] float, position_ids [B, P, 2] -> the last layer's output [B, P, Hv]."""
        padding = (position_ids == -1).all(dim=-1)  # [B, P]
        x = self.input_proj((2 * (pixel_values - 0.5)).to(self.dtype))  # pixels in [-1, 1]
        at = position_ids.clamp(min=0)
        pos = F.embedding(at[..., 0], self.position_table[0]) + F.embedding(at[..., 1], self.position_table[1])
        x = x + torch.where(padding[..., None], 0.0, pos)
        # 2-D RoPE: angles [B, P, 2, D/4] -> (x, x, y, y) along the head dim [B, P, 1, D]
        angles = position_ids[..., None].float() * self.inv_freq.to(x.device)
        ax, ay = angles[:, :, 0], angles[:, :, 1]
        cos = torch.cat([ax.cos(), ax.cos(), ay.cos(), ay.cos()], dim=-1).to(x.dtype)[:, :, None]
        sin = torch.cat([ax.sin(), ax.sin(), ay.sin(), ay.sin()], dim=-1).to(x.dtype)[:, :, None]
        # Every patch sees every real patch; padding patches are masked as keys (None: nothing to mask).
        mask = None if not bool(padding.any()) else (~padding)[:, None, None, :].expand(-1, 1, x.shape[1], -1)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return x

    def pool(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """[B, P, Hv] -> the soft tokens of every image in order [N, Hv] (float32 until standardized, then the
        tower's dtype). Each token is the mean of a pool x pool block of patches, scaled by sqrt(Hv)."""
        B, P, H = x.shape
        k = self.cfg.pooling_kernel_size
        L = P // (k * k)  # soft-token slots per image
        padding = (position_ids == -1).all(dim=-1)
        x = x.masked_fill(padding[..., None], 0.0)
        at = position_ids.clamp(min=0)
        width = at[..., 0].max(dim=-1, keepdim=True)[0] + 1  # [B, 1] patches per row
        block = torch.div(at, k, rounding_mode="floor")
        slot = block[..., 0] + (width // k) * block[..., 1]  # [B, P] soft token each patch pools into
        weights = F.one_hot(slot.long(), L).float() / (k * k)  # [B, P, L]
        pooled = (weights.transpose(1, 2) @ x.float()).to(x.dtype)  # [B, L, Hv]
        used = ~(weights == 0).all(dim=1)  # [B, L]: slots some patch pools into
        h = (pooled.float() * H**0.5)[used]  # [N, Hv] float32: the scale can overflow float16
        if self.cfg.standardize:
            h = (h - self.std_bias.float()) * self.std_scale.float()
        return h.to(x.dtype)

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Patches of B images -> their soft tokens in the text model's space [N, H], image after image."""
        h = self.pool(self.hidden(pixel_values, position_ids), position_ids)
        return self.embed_proj(self.embed_norm(h))


# ----------------------------------------------------------------------------- loading


def checkpoint_name(param: str, prefix: str) -> str:
    """Our parameter name -> its name in the checkpoint, under `prefix` (e.g. "model.encoder.")."""
    tower = prefix + TOWER
    if param == "input_proj.weight":
        return tower + "patch_embedder.input_proj.weight"
    if param == "position_table":
        return tower + "patch_embedder.position_embedding_table"
    if param in ("std_bias", "std_scale"):
        return tower + param
    if param == "embed_proj.weight":
        return prefix + EMBED + "embedding_projection.weight"
    if param.startswith("layers.") and param.endswith("_proj.weight"):
        # the reference wraps each projection in a (clippable) module: ...q_proj.linear.weight
        return tower + "encoder." + param[: -len("weight")] + "linear.weight"
    return tower + "encoder." + param


def vision_records(directory: Path) -> tuple[dict, str]:
    """The vision tensors' records ({name: TensorRecord}) and their prefix (layout.vision_records, with torch
    dtypes); ModelError when the checkpoint's vision tower is missing or not downloaded."""
    from .checkpoint.layout import vision_records as records_of
    from .checkpoint.weights import read_header

    return records_of(directory, read=read_header)


def load_vision(directory: Path, cfg: VisionConfig, text_hidden: int, device="cpu",
                dtype: torch.dtype = torch.float32) -> VisionTower:
    """Build the tower on the meta device, check every tensor against the config, read it in `dtype` on `device`."""
    from .checkpoint.weights import checked_record, read_converted

    records, prefix = vision_records(directory)
    with torch.device("meta"):
        tower = VisionTower(cfg, text_hidden)
    state = {}
    for name, meta in tower.named_parameters():
        rec = checked_record(records, checkpoint_name(name, prefix), meta, None)
        state[name] = read_converted(rec, dtype, device).reshape(meta.shape)
    tower.load_state_dict(state, assign=True, strict=True)
    return tower.eval().requires_grad_(False)


def encode_images(tower: VisionTower, patches: list) -> torch.Tensor:
    """`image.Patches` of one budget -> soft tokens [sum of their soft_tokens, H] in the tower's dtype."""
    pv = torch.stack([p.pixel_values for p in patches]).to(tower.device)
    pos = torch.stack([p.position_ids for p in patches]).to(tower.device)
    with torch.inference_mode():
        out = tower(pv, pos)
    expected = sum(p.soft_tokens for p in patches)
    if out.shape[0] != expected:
        raise ModelError(f"the vision tower gave {out.shape[0]} soft tokens for images that take {expected}")
    return out
