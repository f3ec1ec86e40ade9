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
    if not isinstance(header, dict):
        raise ModelError(f"{path}: corrupt safetensors header")
    base = 8 + n
    records = {}
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES.get(info["dtype"])
            a, b = (int(v) for v in info["data_offsets"])
            shape = tuple(int(d) for d in info["shape"])
        except (TypeError, KeyError, ValueError):
            raise ModelError(f"{path}: corrupt safetensors header (tensor {name})") from None
        if dtype is None:
            raise ModelError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')}")
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= a <= b or b - a != numel * dtype.itemsize:
            raise ModelError(f"{path}: corrupt safetensors header (tensor {name}: {b - a} bytes for shape "
                             f"{list(shape)})")
        records[name] = TensorRecord(path, base + a, base + b, dtype, shape)
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


DECODER_PREFIX = "model.decoder."
DECODER_ONLY = ("self_conditioning.", "decoder_layer_scalar.")


def checkpoint_name(param: str, prefix: str) -> str:
    """Map one of our parameter names to its name in a checkpoint (the only place that knows the layout).

    The shared stack (embedding, layers, final norm) comes from `prefix`; what only the decoder has
    (self-conditioning, the decoder's layer scalars) always lives under `model.decoder.`; the encoder's layer
    scalars always under `model.encoder.language_model.`.
    """
    if param.startswith("decoder_layer_scalar."):
        return f"{DECODER_PREFIX}layers.{param.split('.')[1]}.layer_scalar"
    if param.startswith("encoder_layer_scalar."):
        return ENCODER_SCALAR.format(param.split(".")[1])
    if param.startswith(DECODER_ONLY):
        return DECODER_PREFIX + param
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
        itemsize = rec.dtype.itemsize
        if raw.storage_offset() % itemsize:  # unaligned data: one copy for this tensor only
            raw = raw.clone()
        return raw.view(rec.dtype).view(rec.shape)


def read_converted(rec: TensorRecord, dtype: torch.dtype, device, chunk_bytes: int = 64 << 20) -> torch.Tensor:
    """Read one tensor through a small bounce buffer straight into a new tensor of another dtype or device.

    Used instead of the memory map whenever a copy is needed anyway: mapped pages would stay resident until
    the whole load ends, while this holds at most `chunk_bytes` of source data at a time.
    """
    out = torch.empty(rec.shape, dtype=dtype, device=device)
    flat = out.view(-1)
    itemsize = rec.dtype.itemsize
    step = max(itemsize, chunk_bytes // itemsize * itemsize)
    bounce = torch.empty(min(step, rec.end - rec.start), dtype=torch.uint8)
    done = 0
    with open(rec.file, "rb", buffering=0) as f:
        f.seek(rec.start)
        while rec.start + done < rec.end:
            n = min(step, rec.end - rec.start - done)
            view = bounce[:n]
            if f.readinto(memoryview(view.numpy())) != n:
                raise ModelError(f"{rec.file}: truncated file; download it again")
            k = n // itemsize
            flat[done // itemsize : done // itemsize + k].copy_(view.view(rec.dtype))
            done += n
    return out


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
        ck = checkpoint_name(name, prefix)
        rec = records.get(ck)
        if rec is None and name.startswith("encoder_layer_scalar."):  # some exports store one set of scalars
            rec = records.get(checkpoint_name("decoder_" + name[len("encoder_"):], prefix))
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
    zero_copy = torch.device(device).type == "cpu"
    for name, rec in plan.items():
        if zero_copy and rec.dtype == dtype:
            t = files.tensor(rec)  # a view of the mapped file: no copy, pages load on first use
        else:
            t = read_converted(rec, dtype, device)
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
