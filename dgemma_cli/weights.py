"""Checkpoint names, layouts and loading, in one place.

A checkpoint directory in the Hugging Face layout holds `model.safetensors` or shards listed by
`model.safetensors.index.json`. Only the text stack is read: it is stored once under `model.decoder.*`
(or, in some exports, `model.encoder.language_model.*`); the vision tower is never touched. Files are
memory-mapped and each tensor is viewed in place (zero copy) when it already has the wanted dtype on the CPU,
so loading a checkpoint of S bytes costs about S bytes of resident memory. The model is built on the meta
device and every expected tensor is checked for presence, shape and dtype before it is assigned.

Quantized checkpoints describe themselves: config.json's `quantization_config` (or ModelOpt's
`hf_quant_config.json`) names the format, and a projection is quantized exactly when its `weight_scale` tensor is in
the checkpoint; the module is then swapped for a `quant.modules` one before loading and its packed tensors are kept
as they are. Routed experts come either fused (`experts.gate_up_proj`, `experts.down_proj`: bf16, or dgemma INT8
with `.weight` / `.weight_scale`) or per expert as ModelOpt writes them (`experts.E.{gate,up,down}_proj.*`), which are
stacked into [E, ...] buffers on load.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from quant import modules as qmodules

from .config import ModelConfig
from .errors import ModelError
from .names import INDEX_FILE, SINGLE_FILE, TEXT_PREFIXES, text_shards

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
        files = sorted({d / f for f in text_shards(weight_map)})  # vision-only shards may be absent
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


def read_into(rec: TensorRecord, out: torch.Tensor, chunk_bytes: int = 64 << 20) -> torch.Tensor:
    """Read one tensor through a small bounce buffer into `out` (contiguous, any dtype or device: converted).

    Used instead of the memory map whenever a copy is needed anyway: mapped pages would stay resident until
    the whole load ends, while this holds at most `chunk_bytes` of source data at a time.
    """
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


def read_converted(rec: TensorRecord, dtype: torch.dtype, device) -> torch.Tensor:
    """One tensor read into a new tensor of another dtype or device (see `read_into`)."""
    return read_into(rec, torch.empty(rec.shape, dtype=dtype, device=device))


# ----------------------------------------------------------------------------- quantized checkpoints

QUANT_FORMATS = ("nvfp4", "int8")
DGEMMA_INT8_VERSION = 1


def read_quant_format(directory: Path, raw_config: dict) -> str | None:
    """The checkpoint's quantization format ('nvfp4', 'int8') from its own description, or None (unquantized).

    ModelOpt NVFP4: `quantization_config` {quant_method: modelopt, quant_algo: NVFP4} in config.json, or the
    older `hf_quant_config.json` {quantization: {quant_algo: NVFP4}}. dgemma INT8: {quant_method: dgemma,
    format: int8, format_version: 1}. Anything else is refused by name rather than loaded wrongly.
    """
    qc = raw_config.get("quantization_config")
    if qc is None:
        hf_quant = Path(directory) / "hf_quant_config.json"
        if not hf_quant.is_file():
            return None
        try:
            qc = dict(json.loads(hf_quant.read_text())["quantization"], quant_method="modelopt")
        except (OSError, ValueError, KeyError, TypeError):
            raise ModelError(f"{hf_quant}: not a valid ModelOpt quantization file") from None
    if not isinstance(qc, dict):
        raise ModelError("config.json: quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower()
    if method == "modelopt":
        algo = str(qc.get("quant_algo", "")).upper()
        if algo == "NVFP4" and int(qc.get("group_size", 16)) == 16:
            return "nvfp4"
        raise ModelError(f"config.json: ModelOpt quantization {algo or '?'} is not supported (dgemma reads NVFP4 "
                         "with group size 16)")
    if method == "dgemma":
        fmt = str(qc.get("format", "")).lower()
        if fmt == "int8" and qc.get("format_version") == DGEMMA_INT8_VERSION:
            return "int8"
        raise ModelError(f"config.json: dgemma quantization format {fmt!r} version {qc.get('format_version')!r} is "
                         "not supported by this dgemma")
    raise ModelError(f"config.json: quantization method {method or '?'!r} is not supported (dgemma reads ModelOpt "
                     "NVFP4 and its own INT8)")


def expert_base(layer: int, prefix: str) -> str:
    return checkpoint_name(f"layers.{layer}.experts.gate_up_proj", prefix).rsplit(".", 1)[0]


def per_expert_name(base: str, expert: int, proj: str, part: str) -> str:
    """ModelOpt's per-expert tensor name, e.g. model.decoder.layers.3.experts.17.gate_proj.weight_scale."""
    return f"{base}.{expert}.{proj}.{part}"


def swap_quantized_modules(model: torch.nn.Module, records: dict[str, TensorRecord], prefix: str,
                           fmt: str | None) -> dict[str, str]:
    """Replace (on the meta model) every projection and expert block the checkpoint holds quantized.

    Returns {module path: 'linear' | 'experts' | 'per_expert'} for what was swapped. A quantized tensor in a
    checkpoint that declares no format is an error: the format is never guessed.
    """
    from .model import Experts, QuantizedExperts

    swapped = {}
    for path, mod in list(model.named_modules()):
        if isinstance(mod, torch.nn.Linear):
            base = checkpoint_name(path + ".weight", prefix)[: -len(".weight")]
            if base + ".weight_scale" in records:
                swapped[path] = "linear"
                if fmt:
                    _set_module(model, path, qmodules.make_linear(fmt, mod.in_features, mod.out_features, "meta"))
        elif isinstance(mod, Experts):
            layer = int(path.split(".")[1])
            base = expert_base(layer, prefix)
            E, twoI, H = mod.gate_up_proj.shape
            I = twoI // 2
            if per_expert_name(base, 0, "gate_proj", "weight") in records:
                kind, segments = "per_expert", (2, 1)
            elif base + ".gate_up_proj.weight_scale" in records:
                kind, segments = "experts", (1, 1)
            else:
                continue
            swapped[path] = kind
            if fmt:
                if kind == "per_expert" and fmt != "nvfp4":
                    raise ModelError(f"{base}: per-expert tensors are read as ModelOpt NVFP4, but the checkpoint "
                                     f"says {fmt}")
                gate_up = qmodules.make_stack(fmt, E, 2 * I, H, segments[0], device="meta")
                down = qmodules.make_stack(fmt, E, H, I, segments[1], device="meta")
                _set_module(model, path, QuantizedExperts(E, gate_up, down))
    if swapped and fmt is None:
        first = next(iter(swapped))
        raise ModelError(f"checkpoint holds quantized tensors ({first}) but config.json has no quantization_config")
    return swapped


def _set_module(model: torch.nn.Module, path: str, new: torch.nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def per_expert_parts(name: str, meta: torch.Tensor, base: str) -> list[tuple[str, tuple]]:
    """Where the pieces of a stacked buffer (e.g. experts.gate_up_proj.weight [E, 2I, H/2]) live per expert:
    [(checkpoint name, index into the buffer)]. Gate rows come first, then up; each has its own global scale."""
    proj, part = name.split(".")[-2:]  # e.g. gate_up_proj, weight_scale_2
    E = meta.shape[0]
    out = []
    for e in range(E):
        if proj == "down_proj":
            out.append((per_expert_name(base, e, "down_proj", part), (e, 0) if part == "weight_scale_2" else (e,)))
            continue
        half = meta.shape[1] // 2
        for j, sub in enumerate(("gate_proj", "up_proj")):
            idx = (e, j) if part == "weight_scale_2" else (e, slice(j * half, (j + 1) * half))
            out.append((per_expert_name(base, e, sub, part), idx))
    return out


def expected_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our parameter or buffer name -> meta tensor (shape, dtype), with [L] layer scalars split per layer."""
    out = {}
    for name, p in model.named_parameters():
        if name in ("encoder_layer_scalar", "decoder_layer_scalar"):
            for i in range(p.shape[0]):
                out[f"{name}.{i}"] = torch.empty((1,), device="meta")
        else:
            out[name] = p
    out.update(model.named_buffers())  # quantized modules' packed tensors
    return out


def load_model(directory: Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Build the network on the meta device and fill it from a checkpoint directory.

    dtype None keeps the checkpoint's dtype (the compute dtype; packed tensors always keep theirs).
    Returns (model, ModelConfig).
    """
    from .model import DiffusionGemma

    directory = Path(directory)
    if not directory.is_dir():
        raise ModelError(f"{directory}: no such model directory")
    cfg = ModelConfig.from_dir(directory)
    fmt = read_quant_format(directory, cfg.raw)
    records = index_checkpoint(directory)
    prefix = text_prefix(records)
    if dtype is None:
        dtype = records[prefix + "embed_tokens.weight"].dtype
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    swapped = swap_quantized_modules(model, records, prefix, fmt)
    per_expert = {p for p, kind in swapped.items() if kind == "per_expert"}
    L = cfg.text.num_hidden_layers

    # Check everything before reading any data: a damaged checkpoint fails fast, naming the tensor.
    expected = expected_tensors(model)
    packed = dict(model.named_buffers())  # quantized tensors: they keep their own dtype
    plan: dict[str, list[tuple[TensorRecord, tuple | None]]] = {}
    for name, meta in expected.items():
        if name.rsplit(".", 2)[0] in per_expert:  # ModelOpt: one tensor per expert and projection, stacked here
            parts = per_expert_parts(name, meta, expert_base(int(name.split(".")[1]), prefix))
            plan[name] = [(checked_record(records, ck, meta, idx), idx) for ck, idx in parts]
            continue
        ck = checkpoint_name(name, prefix)
        rec = records.get(ck)
        if rec is None and name.startswith("encoder_layer_scalar."):  # some exports store one set of scalars
            rec = records.get(checkpoint_name("decoder_" + name[len("encoder_"):], prefix))
        plan[name] = [(checked_record(records, ck, meta, None, rec), None)]

    files = MappedFiles()
    state = {}
    scalars = {"encoder_layer_scalar": [None] * L, "decoder_layer_scalar": [None] * L}
    zero_copy = torch.device(device).type == "cpu"
    for name, parts in plan.items():
        meta = expected[name]
        want = meta.dtype if name in packed else dtype
        if parts[0][1] is not None:  # stacked from per-expert pieces
            t = torch.empty(meta.shape, dtype=want, device=device)
            for rec, idx in parts:
                read_into(rec, t[idx])
        else:
            rec = parts[0][0]
            if zero_copy and rec.dtype == want:
                t = files.tensor(rec)  # a view of the mapped file: no copy, pages load on first use
            else:
                t = read_converted(rec, want, device)
            t = t.reshape(meta.shape)  # only scalars differ ([] vs [1])
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


def checked_record(records: dict[str, TensorRecord], ck: str, meta: torch.Tensor, idx: tuple | None,
             rec: TensorRecord | None = None) -> TensorRecord:
    """The record for `ck`, checked against what the model expects there (a whole tensor, or meta[idx])."""
    rec = rec if rec is not None else records.get(ck)
    if rec is None:
        raise ModelError(f"checkpoint is missing tensor {ck}")
    want_shape = tuple(meta[idx].shape) if idx is not None else tuple(meta.shape)
    numel = 1
    for d in rec.shape:
        numel *= d
    scalar_ok = want_shape in ((), (1,)) and numel == 1  # global scales are stored as [] or [1]
    if tuple(rec.shape) != want_shape and not scalar_ok:
        raise ModelError(f"tensor {ck} has shape {list(rec.shape)}, config.json implies {list(want_shape)}")
    if meta.dtype in FLOAT_DTYPES:
        if rec.dtype not in FLOAT_DTYPES:
            raise ModelError(f"tensor {ck} has dtype {rec.dtype}, expected a float type")
    elif rec.dtype != meta.dtype:
        raise ModelError(f"tensor {ck} has dtype {rec.dtype}, expected {meta.dtype} for its quantization format")
    return rec
