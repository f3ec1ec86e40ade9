"""A DiffusionGemma GGUF file (llama.cpp's format, as the `diffusion-gemma` converter writes it): its metadata, its
tensors' types and shapes, and its blocks where they lie (a memory map; quant/ggml.py decodes them). The header is
parsed by gguf_header.py (a real file's in about a second; the `gguf` library's reader takes many), the type names
are the `gguf` library's.

Everything that can refuse a file does so here, in one line and before any weight is read: not a GGUF, a file cut
short, another architecture, a tensor of a type dgemma does not read (quant/ggml.py SUPPORTED). A split file
(`NAME-00001-of-00003.gguf`) is read from its first part, its other parts found beside it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelError

ARCH = "diffusion-gemma"
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: its GGUF name, type (quant/ggml.py's names), torch-order shape (the ggml order reversed: rows,
    then the columns its blocks run along), and its bytes (a read-only memory map)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    data: np.ndarray  # uint8: the raw bytes (blocks; the floats of F32 / F16 / BF16), a read-only view of the map

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class GGUFFile:
    """A GGUF checkpoint of DiffusionGemma: `metadata` (key -> value) and `tensors` (name -> GGUFTensor), over every
    part of a split file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        parts = split_parts(self.path)
        self.metadata: dict = {}
        self.tensors: dict[str, GGUFTensor] = {}
        for k, part in enumerate(parts):
            header = _open(part)
            if k == 0:
                self.metadata = header.metadata
            for t in header.tensors:
                self.tensors[t.name] = _tensor(part, t, header)
        arch = self.metadata.get("general.architecture")
        if arch != ARCH:
            raise ModelError(f"{self.path.name}: a GGUF of architecture {arch!r}, not DiffusionGemma ({ARCH!r})")

    def get(self, key: str, default=None):
        """A metadata value by its key without the architecture's prefix (`block_count` for
        `diffusion-gemma.block_count`), or by its whole key."""
        return self.metadata.get(f"{ARCH}.{key}", self.metadata.get(key, default))


    def footprint(self, layers: int, dtype_bytes: int = 2) -> dict:
        """What the model holds in memory as loaded (checkpoint/gguf_load.py): {"layers": per layer {"experts",
        "dense", "other"}, "totals": {"experts", "dense", "embedding", "other"}}, as footprint.layer_bytes and
        weight_bytes count a directory's: tensors kept as their blocks (gguf_names.kept_packed) at the file's bytes,
        the rest decoded to the compute dtype (`dtype_bytes` a weight). `rope_freqs` is not loaded."""
        from .gguf_names import LAYER, SCALARS, TOP, kept_packed

        ours_of = {v: k for k, v in TOP.items()}
        per = [{"experts": 0, "dense": 0, "other": 0} for _ in range(layers)]
        totals = {"experts": 0, "dense": 0, "embedding": 0, "other": 0}
        for t in self.tensors.values():
            decoded = int(np.prod(t.shape, dtype=np.int64)) * dtype_bytes
            if t.name.startswith("blk."):
                _, n, rest = t.name.split(".", 2)
                suffix = next((ours for ours, g in LAYER.items() if g in (rest, rest + ".weight")), None)
                if suffix is None or not n.isdigit() or int(n) >= layers:  # a scalar, or a tensor not loaded
                    if any(rest.removesuffix(".weight") == g for g in SCALARS.values()):
                        totals["other"] += decoded
                    continue
                part = ("experts" if suffix.startswith("experts.") else
                        "dense" if suffix.split(".")[0] in ("self_attn", "mlp") and "norm" not in suffix else "other")
                size = t.nbytes if kept_packed(f"layers.{n}.{suffix}", t.kind) else decoded
                per[int(n)][part] += size
            elif t.name == "token_embd.weight":  # as its blocks where it is of a block type (the head reads them)
                totals["embedding"] += t.nbytes if kept_packed("embed_tokens.weight", t.kind) else decoded
            elif t.name in ours_of:
                totals["other"] += t.nbytes if kept_packed(ours_of[t.name], t.kind) else decoded
        for lb in per:
            for part in ("experts", "dense", "other"):
                totals[part] += lb[part]
        return {"layers": per, "totals": totals}

    def config_dict(self) -> dict:
        """The model's config in config.json's layout (config.ModelConfig.from_dict reads it), from the file's
        `diffusion-gemma.*` keys: per-layer kv heads and the sliding pattern give the layer types and the full
        layers' geometry; the vocabulary is the tied embedding's rows. A key the file lacks is one line."""
        def need(key: str):
            value = self.get(key)
            if value is None:
                raise ModelError(f"{self.path.name}: a DiffusionGemma GGUF without {ARCH}.{key}")
            return value

        layers = int(need("block_count"))
        pattern = self.get("attention.sliding_window_pattern")
        sliding = [bool(x) for x in pattern] if isinstance(pattern, list) and len(pattern) == layers else \
            [(i + 1) % 6 != 0 for i in range(layers)]
        kv = need("attention.head_count_kv")
        kv = [int(x) for x in kv] if isinstance(kv, list) else [int(kv)] * layers
        embd = self.tensors.get("token_embd.weight")
        vocab = embd.shape[0] if embd is not None else len(self.get("tokenizer.ggml.tokens") or [])
        text = {
            "vocab_size": int(vocab), "hidden_size": int(need("embedding_length")),
            "intermediate_size": int(need("feed_forward_length")), "num_hidden_layers": layers,
            "num_attention_heads": int(need("attention.head_count")),
            "num_key_value_heads": next((k for k, s in zip(kv, sliding) if s), kv[0]),
            "num_global_key_value_heads": next((k for k, s in zip(kv, sliding) if not s), kv[-1]),
            "head_dim": int(self.get("attention.key_length_swa") or need("attention.key_length")),
            "global_head_dim": int(need("attention.key_length")),
            "num_experts": int(need("expert_count")), "top_k_experts": int(need("expert_used_count")),
            "moe_intermediate_size": int(need("expert_feed_forward_length")),
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        }
        for key, ours in (("attention.sliding_window", "sliding_window"),
                          ("final_logit_softcapping", "final_logit_softcapping"),
                          ("attention.layer_norm_rms_epsilon", "rms_norm_eps"),
                          ("context_length", "max_position_embeddings")):
            if self.get(key) is not None:
                text[ours] = self.get(key)
        for key, ours in (("tokenizer.ggml.bos_token_id", "bos_token_id"),
                          ("tokenizer.ggml.eos_token_id", "eos_token_id"),
                          ("tokenizer.ggml.padding_token_id", "pad_token_id")):
            if self.get(key) is not None:
                text[ours] = int(self.get(key))
        return {"model_type": "diffusion_gemma", "canvas_length": int(self.get("diffusion.canvas_length") or 256),
                "text_config": text}


_read: dict[tuple, tuple] = {}  # (path, size, mtime) -> (GGUFFile, ModelConfig), this process


def read_gguf(path: Path):
    """(the file, its ModelConfig): the metadata and tensors' places read, nothing decoded; every refusal one line.
    Read once a process per file as it is on disk: the `gguf` library parses a real file's header (262,144 tokens,
    514,906 merges) in many seconds, and plan, info and show each ask for the file more than once."""
    from ..config import ModelConfig

    path = Path(path)
    try:
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    except OSError:  # GGUFFile says what is wrong with it
        key = None
    if key is None or key not in _read:
        f = GGUFFile(path)
        found = (f, ModelConfig.from_dict(f.config_dict()))
        if key is None:
            return found
        _read[key] = found
    return _read[key]


# The sampler's hints a file may carry (`diffusion.eb_*`, the entropy-bound sampler's settings) -> GenerationSettings'
# fields. A file without them (Unsloth's) keeps the model's defaults.
SAMPLER_KEYS = {"diffusion.eb_max_steps": ("max_denoising_steps", int), "diffusion.eb_t_min": ("t_min", float),
                "diffusion.eb_t_max": ("t_max", float), "diffusion.eb_entropy_bound": ("entropy_bound", float),
                "diffusion.eb_stability_threshold": ("stability_threshold", int),
                "diffusion.eb_confidence_threshold": ("confidence_threshold", float)}


def sampler_defaults(f: GGUFFile) -> dict:
    """GenerationSettings fields from the file's `diffusion.eb_*` keys, where it has them."""
    return {field: kind(f.metadata[key]) for key, (field, kind) in SAMPLER_KEYS.items()
            if f.metadata.get(key) is not None}


def split_parts(path: Path) -> list[Path]:
    """The parts of a split GGUF from its first (or any) part, in order; [path] for a whole file. A part missing
    beside it is one line."""
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelError(f"{path.name}: a split GGUF whose part {missing[0]} is not beside it")
    return parts


def _open(path: Path):
    from .gguf_header import HeaderError, read_header

    if not path.is_file():
        raise ModelError(f"{path}: no such file")
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelError(f"{path.name}: not a GGUF file (it does not start with 'GGUF')")
        return read_header(path)
    except HeaderError as e:
        raise ModelError(f"{path.name}: not a whole GGUF file (cut short or damaged: {e})") from None
    except OSError as e:
        raise ModelError(f"{path.name}: cannot read it ({e.strerror or e})") from None


def _type_name(type_id: int) -> str:
    try:
        from gguf import GGMLQuantizationType
    except ImportError:  # pragma: no cover - a dependency of dgemma
        raise ModelError("reading a GGUF file needs the `gguf` package (pip install gguf)") from None
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


def _tensor(part: Path, t, header) -> GGUFTensor:
    from quant import ggml

    kind = _type_name(t.type_id)
    shape = tuple(int(d) for d in reversed(t.dims))
    if kind not in ggml.SUPPORTED:
        raise ModelError(f"{part.name}: tensor {t.name} is {kind}, a type dgemma does not read "
                         f"(it reads {', '.join(ggml.SUPPORTED)})")
    if shape and shape[-1] % ggml.ELEMENTS[kind]:
        raise ModelError(f"{part.name}: tensor {t.name}'s rows of {shape[-1]} are not whole {kind} blocks")
    want = int(np.prod(shape[:-1], dtype=np.int64)) * ggml.row_bytes(kind, shape[-1]) if shape else 0
    have = max(0, min(want, header.size - t.offset))
    if have != want:  # the data section is shorter than the header says: a file cut short
        raise ModelError(f"{part.name}: not a whole GGUF file (tensor {t.name} has {have:,} of its {want:,} bytes)")
    return GGUFTensor(t.name, kind, shape, np.frombuffer(header.map, dtype=np.uint8, count=want, offset=t.offset))
