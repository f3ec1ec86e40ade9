"""Checkpoint names, layouts and loading, in one place.

A checkpoint directory in the Hugging Face layout holds `model.safetensors` or shards listed by
`model.safetensors.index.json`. Only the text stack is read: it is stored once under `model.decoder.*`
(or, in some exports, `model.encoder.language_model.*`); the vision tower is never touched. Files are
memory-mapped and each tensor is viewed in place (zero copy) when it already has the wanted dtype on the CPU,
so loading a checkpoint of S bytes costs about S bytes of resident memory. The model is built on the meta
device and every expected tensor is checked for presence, shape and dtype before it is assigned.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig
from .errors import ModelError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Text-stack prefixes in the order they are preferred. The first one that holds the embedding wins.
TEXT_PREFIXES = ("model.decoder.", "model.encoder.language_model.", "model.language_model.")
ENCODER_SCALAR = "model.encoder.language_model.layers.{}.layer_scalar"

_DTYPES = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
FLOAT_DTYPES = {torch.float32, torch.bfloat16, torch.float16}


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor lives: file, byte range of its data, dtype and shape (from the safetensors header)."""

    file: Path
    start: int  # absolute byte offset in the file
    end: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, TensorRecord]:
    """Parse a safetensors header and check that the file holds all the bytes it declares."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8 or n > 100_000_000:
                raise ModelError(f"{path}: truncated or corrupt safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ModelError(f"{path}: cannot read ({e.strerror})") from None
    except ValueError:
        raise ModelError(f"{path}: corrupt safetensors header") from None
    base = 8 + n
    records = {}
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ModelError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')}")
        a, b = info["data_offsets"]
        records[name] = TensorRecord(path, base + a, base + b, dtype, tuple(info["shape"]))
        data_end = max(data_end, base + b)
    if data_end > size:
        raise ModelError(f"{path}: truncated file ({size} bytes, header promises {data_end}); download it again")
    return records


def checkpoint_files(directory: Path) -> list[Path]:
    d = Path(directory)
    index = d / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError):
            raise ModelError(f"{index}: not a valid safetensors index") from None
        files = sorted({d / f for f in weight_map.values()})
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise ModelError(f"{d}: shard {missing[0].name} listed in {INDEX_FILE} is missing")
        return files
    if (d / SINGLE_FILE).is_file():
        return [d / SINGLE_FILE]
    raise ModelError(f"{d}: no {SINGLE_FILE} or {INDEX_FILE}")


def index_checkpoint(directory: Path) -> dict[str, TensorRecord]:
    records: dict[str, TensorRecord] = {}
    for f in checkpoint_files(directory):
        records.update(read_header(f))
    return records


def text_prefix(records: dict[str, TensorRecord]) -> str:
    for p in TEXT_PREFIXES:
        if p + "embed_tokens.weight" in records:
            return p
    raise ModelError("checkpoint has no text embedding (expected model.decoder.embed_tokens.weight)")


def checkpoint_name(param: str, prefix: str, num_layers: int) -> str:
    """Map one of our parameter names to its name in a checkpoint (the only place that knows the layout)."""
    if param.startswith("decoder_layer_scalar."):
        return f"{prefix}layers.{param.split('.')[1]}.layer_scalar"
    if param.startswith("encoder_layer_scalar."):
        return ENCODER_SCALAR.format(param.split(".")[1])
    return prefix + param


class MappedFiles:
    """Keeps each checkpoint file memory-mapped (private, copy-on-write) while tensors are viewed from it."""

    def __init__(self):
        self._maps: dict[Path, torch.Tensor] = {}

    def bytes_of(self, rec: TensorRecord) -> torch.Tensor:
        m = self._maps.get(rec.file)
        if m is None:
            size = os.path.getsize(rec.file)
            storage = torch.UntypedStorage.from_file(str(rec.file), shared=False, nbytes=size)
            m = torch.empty(0, dtype=torch.uint8).set_(storage)
            self._maps[rec.file] = m
        return m[rec.start : rec.end]

    def tensor(self, rec: TensorRecord) -> torch.Tensor:
        raw = self.bytes_of(rec)
        itemsize = torch.empty(0, dtype=rec.dtype).element_size()
        if raw.storage_offset() % itemsize:  # unaligned data: one copy for this tensor only
            raw = raw.clone()
        return raw.view(rec.dtype).view(rec.shape)


def expected_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our parameter name -> meta tensor (shape, dtype), with [L] layer scalars split per layer."""
    out = {}
    for name, p in model.named_parameters():
        if name in ("encoder_layer_scalar", "decoder_layer_scalar"):
            for i in range(p.shape[0]):
                out[f"{name}.{i}"] = torch.empty((1,), device="meta")
        else:
            out[name] = p
    return out


def load_model(directory: Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Build the network on the meta device and fill it from a checkpoint directory.

    dtype None keeps the checkpoint's dtype. Returns (model, ModelConfig).
    """
    from .model import DiffusionGemma

    directory = Path(directory)
    if not directory.is_dir():
        raise ModelError(f"{directory}: no such model directory")
    cfg = ModelConfig.from_dir(directory)
    records = index_checkpoint(directory)
    prefix = text_prefix(records)
    if dtype is None:
        dtype = records[prefix + "embed_tokens.weight"].dtype
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    L = cfg.text.num_hidden_layers

    # Check everything before reading any data: a damaged checkpoint fails fast, naming the tensor.
    plan = {}
    for name, meta in expected_tensors(model).items():
        ck = checkpoint_name(name, prefix, L)
        rec = records.get(ck)
        if rec is None and name.startswith("encoder_layer_scalar."):
            rec = records.get(checkpoint_name("decoder_" + name[len("encoder_"):], prefix, L))
        if rec is None:
            raise ModelError(f"checkpoint is missing tensor {ck}")
        if tuple(rec.shape) != tuple(meta.shape):
            raise ModelError(f"tensor {ck} has shape {list(rec.shape)}, config.json implies {list(meta.shape)}")
        if rec.dtype not in FLOAT_DTYPES:
            raise ModelError(f"tensor {ck} has dtype {rec.dtype}, expected a float type")
        plan[name] = rec

    files = MappedFiles()
    state = {}
    scalars = {"encoder_layer_scalar": [None] * L, "decoder_layer_scalar": [None] * L}
    for name, rec in plan.items():
        t = files.tensor(rec)
        if t.dtype != dtype or torch.device(device).type != "cpu":
            t = t.to(device=device, dtype=dtype)
        if name.split(".")[0] in scalars:
            kind, i = name.split(".")
            scalars[kind][int(i)] = t.reshape(())
        else:
            state[name] = t
    for kind, parts in scalars.items():
        state[kind] = torch.stack(parts).to(device=device, dtype=dtype)
    model.load_state_dict(state, assign=True, strict=True)
    model.eval().requires_grad_(False)
    return model, cfg
