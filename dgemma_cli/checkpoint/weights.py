"""Checkpoint names, layouts and loading, in one place.

A checkpoint directory in the Hugging Face layout holds `model.safetensors` or shards listed by
`model.safetensors.index.json`. Only the text stack is read: it is stored once under `model.decoder.*`
(or, in some exports, `model.encoder.language_model.*`); the vision tower is never touched. Files are
memory-mapped and each tensor is viewed in place (zero copy) when it already has the wanted dtype on the CPU,
so loading a checkpoint of S bytes costs about S bytes of resident memory. The model is built on the meta
device and every expected tensor is checked for presence, shape and dtype before it is assigned.

Quantized checkpoints describe themselves: config.json's `quantization_config` (or ModelOpt's
`hf_quant_config.json`) names the format, and a projection is quantized exactly when its `weight_scale` tensor is in
the checkpoint; the module is then swapped for the format's `quant.modules` one before loading and its packed tensors
are kept as they are. Everything format-specific (which checkpoints, tensor names and scales, what an ignore list
leaves unquantized, which modules) is the format's own module under quant/formats/; this file asks it. Routed
experts come either fused (`experts.gate_up_proj`, `experts.down_proj`: bf16, or quantized with `.weight` /
`.weight_scale`) or per expert (`experts.E.{gate,up,down}_proj.*`, as ModelOpt and compressed-tensors write them),
which are stacked into [E, ...] buffers on load.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from quant import formats as qformats
from quant.formats import dgemma_int8

from . import layout
from ..config import ModelConfig
from ..errors import ModelError, UsageError
from .layout import (DECODER_ONLY, DECODER_PREFIX, ENCODER_SCALAR, checkpoint_files,  # noqa: F401 - the loader's
                     checkpoint_name, expert_base, text_prefix)
from .names import INDEX_FILE, SINGLE_FILE  # noqa: F401 - scripts import them from here

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
    """Parse a safetensors header and check that the file holds all the bytes it declares (layout.read_header, with
    torch dtypes)."""
    return {name: TensorRecord(r.file, r.start, r.end, _DTYPES[r.dtype], r.shape)
            for name, r in layout.read_header(path).items()}


def index_checkpoint(directory: Path) -> dict[str, TensorRecord]:
    records: dict[str, TensorRecord] = {}
    for f in checkpoint_files(directory):
        records.update(read_header(f))
    return records


ALIGN = 64  # torch's own CPU allocations start at a multiple of this many bytes; a view of a mapped file need not


def empty_at(shape, dtype: torch.dtype, offset: int = 0, pin_memory: bool = False) -> torch.Tensor:
    """A new contiguous tensor whose data starts `offset` bytes (a multiple of dtype's size) past a multiple of
    ALIGN, as a view of a mapped file may (`MappedFiles.offset`)."""
    if not offset:
        return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
    n = math.prod(shape) * dtype.itemsize
    raw = torch.empty(n + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
    skip = (offset - raw.data_ptr()) % ALIGN
    return raw[skip : skip + n].view(dtype).view(shape)


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

    def offset(self, rec: TensorRecord) -> int:
        """Where `tensor(rec)`'s data starts, modulo ALIGN (0 where it is a copy): the file maps at a page, so the
        view sits wherever the header put it."""
        if rec.start % rec.dtype.itemsize:
            return 0
        return self.bytes_of(rec).data_ptr() % ALIGN


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

DGEMMA_INT8_VERSION = dgemma_int8.VERSION


def read_format(directory: Path, raw_config: dict) -> qformats.Format | None:
    """The checkpoint's quantization format from its own description (quant/formats/), or None (unquantized).

    Each published layout is one module there (ModelOpt NVFP4, dgemma INT8, compressed-tensors FP8/INT8 W8A8);
    anything else is refused by name rather than loaded wrongly.
    """
    try:
        return qformats.detect(Path(directory), raw_config)
    except qformats.FormatError as e:
        raise ModelError(str(e)) from None


def read_quant_format(directory: Path, raw_config: dict) -> str | None:
    """The format's short name ('nvfp4', 'int8', 'fp8'), or None (unquantized)."""
    fmt = read_format(directory, raw_config)
    return None if fmt is None else fmt.label


def stored_format(directory: Path, raw_config: dict) -> tuple[str, str | None]:
    """What a checkpoint runs as, and so what its placement plans: its format's short name ('bf16' unquantized) and
    what it quantizes (layout.stored_policy; None for bf16). `dgemma plan --model` plans the same."""
    from .layout import stored_policy

    fmt = read_quant_format(directory, raw_config) or "bf16"
    return fmt, stored_policy(directory) if fmt != "bf16" else None


def stored_model(path: Path) -> tuple[ModelConfig, str, str | None]:
    """(config, format, policy) of a model as `dgemma run` runs it: "gguf" for a GGUF file (its tensors' own types:
    gguf_file.GGUFFile.footprint counts them)."""
    from .stored import is_gguf, model_config

    if is_gguf(path):
        return model_config(path), "gguf", None
    cfg = ModelConfig.from_dir(path)
    return (cfg, *stored_format(path, cfg.raw))


def swap_quantized_modules(model: torch.nn.Module, records: dict[str, TensorRecord], prefix: str,
                           fmt: qformats.Format | None) -> dict[str, str]:
    """Replace (on the meta model) every projection and expert block the checkpoint holds quantized.

    Returns {module path: 'linear' | 'fused' | 'per_expert'} for what was swapped. A module is quantized exactly when
    its scale tensor is stored; where the format's description also lists what it quantizes (compressed-tensors'
    targets and ignore list), the two must agree. A quantized tensor in a checkpoint that declares no format is an
    error: the format is never guessed.
    """
    from ..model import Experts, QuantizedExperts

    def agree(module: str, quantized: bool) -> None:
        if fmt is None:
            return
        if quantized and fmt.ignored(module):
            raise ModelError(f"{module} is stored quantized but the checkpoint's ignore list names it")
        if not quantized and fmt.targets(module):
            raise ModelError(f"{module} is stored unquantized but the checkpoint's quantization_config quantizes it "
                             "(it is not in the ignore list)")

    swapped = {}
    for path, mod in list(model.named_modules()):
        if isinstance(mod, torch.nn.Linear):
            base = checkpoint_name(path + ".weight", prefix)[: -len(".weight")]
            quantized = (fmt or qformats.Format()).quantized_linear(base, records)
            agree(base, quantized)
            if quantized:
                swapped[path] = "linear"
                if fmt:
                    new = fmt.make_linear(mod.in_features, mod.out_features, "meta")
                    if fmt.input_scales and base + ".input_scale" in records:
                        new.expect_input_scale()
                    _set_module(model, path, new)
        elif isinstance(mod, Experts):
            layer = int(path.split(".")[1])
            base = expert_base(layer, prefix)
            E, twoI, H = mod.gate_up_proj.shape
            layout = (fmt or qformats.Format()).expert_layout(base, records)
            if layout is None:  # float experts are 3-D tensors, not linear modules: no list speaks of them
                continue
            names = ("0.gate_proj", "0.up_proj", "0.down_proj") if layout == "per_expert" else (
                "gate_up_proj", "down_proj")  # per expert, the first stands for all (every name is checked on load)
            for name in names:
                agree(f"{base}.{name}", True)
            swapped[path] = layout
            if fmt:
                if layout not in fmt.expert_layouts:
                    how = "per expert" if layout == "per_expert" else "fused"
                    raise ModelError(f"{base}: the checkpoint stores these experts {how}, which its {fmt.label} "
                                     "format does not")
                gate_up, down = fmt.make_experts(E, H, twoI // 2, layout, device="meta")
                if fmt.input_scales and layout == "per_expert":  # fused stacks: no published layout stores them
                    for stack, proj in ((gate_up, "gate_proj"), (down, "down_proj")):
                        if qformats.per_expert_name(base, 0, proj, "input_scale") in records:
                            stack.expect_input_scale()
                _set_module(model, path, QuantizedExperts(E, gate_up, down))
    if swapped and fmt is None:
        first = next(iter(swapped))
        raise ModelError(f"checkpoint holds quantized tensors ({first}) but config.json has no quantization_config")
    return swapped


def _set_module(model: torch.nn.Module, path: str, new: torch.nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


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


def load_model(directory: Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               host_layers=frozenset(), layer_devices: list | None = None):
    """Build the network on the meta device and fill it from a checkpoint directory.

    dtype None keeps the checkpoint's dtype (the compute dtype; packed tensors always keep theirs). host_layers: the
    layers whose routed experts stay in host memory (the placement plan's streamed layers, dgemma_cli/placement):
    read from the files straight into host memory, never onto `device`. layer_devices: each layer's device when the
    plan splits the layers over several cards (the rest, embedding and head, on `device`); None: all on `device`.
    Returns (model, ModelConfig).
    """
    from ..model import DiffusionGemma

    directory = Path(directory)
    if not directory.is_dir():
        raise ModelError(f"{directory}: no such model directory")
    cfg = ModelConfig.from_dir(directory)
    fmt = read_format(directory, cfg.raw)
    if fmt is not None:
        try:
            fmt.check_settings()
        except ValueError as e:
            raise UsageError(str(e)) from None
    records = index_checkpoint(directory)
    prefix = text_prefix(records)
    if dtype is None:
        dtype = records[prefix + "embed_tokens.weight"].dtype
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    swapped = swap_quantized_modules(model, records, prefix, fmt)
    per_expert = {p for p, kind in swapped.items() if kind == "per_expert"}

    # Check everything before reading any data: a damaged checkpoint fails fast, naming the tensor.
    expected = expected_tensors(model)
    packed = dict(model.named_buffers())  # quantized tensors: they keep their own dtype
    plan: dict[str, list[tuple[TensorRecord, tuple | None]]] = {}
    for name, meta in expected.items():
        if name.rsplit(".", 2)[0] in per_expert:  # one tensor per expert and projection, stacked here
            parts = fmt.per_expert_parts(name, tuple(meta.shape), expert_base(int(name.split(".")[1]), prefix))
            plan[name] = [(checked_record(records, ck, meta, idx), idx) for ck, idx in parts]
            continue
        ck = checkpoint_name(name, prefix)
        rec = records.get(ck)
        if rec is None and name.startswith("encoder_layer_scalar."):  # some exports store one set of scalars
            rec = records.get(checkpoint_name("decoder_" + name[len("encoder_"):], prefix))
        plan[name] = [(checked_record(records, ck, meta, None, rec), None)]

    files = MappedFiles()
    state = {}
    host_prefixes = tuple(f"layers.{i}.experts." for i in host_layers)
    pin = torch.device(device).type == "cuda"  # the host store of streamed experts: pinned where a card copies from it
    for name, parts in plan.items():
        meta = expected[name]
        want = meta.dtype if name in packed else dtype
        target = device
        if layer_devices is not None and name.startswith("layers."):
            target = layer_devices[int(name.split(".")[1])]
        zero_copy = torch.device(target).type == "cpu"
        if name.startswith(host_prefixes):
            # a streamed layer's experts: read from the files into host memory the store owns (pinned on CUDA), one
            # copy, never a mapping (its pages would be a second copy of what the store holds) nor the device. On the
            # CPU it starts where the resident load's view of the mapped file would (modulo ALIGN), and the layer
            # buffers take each layer's copy at that offset too (placement/streaming.py): the experts' matmuls get
            # operands aligned as the resident run's, which can choose a BLAS kernel's path and so its bits
            viewed = zero_copy and parts[0][1] is None and parts[0][0].dtype == want
            t = empty_at(meta.shape, want, files.offset(parts[0][0]) if viewed else 0, pin_memory=pin)
            for rec, idx in parts:
                read_into(rec, t[idx] if idx is not None else t)
            state[name] = t
            continue
        if parts[0][1] is not None:  # stacked from per-expert pieces
            t = torch.empty(meta.shape, dtype=want, device=target)
            for rec, idx in parts:
                read_into(rec, t[idx])
        else:
            rec = parts[0][0]
            if zero_copy and rec.dtype == want:
                t = files.tensor(rec)  # a view of the mapped file: no copy, pages load on first use
            else:
                t = read_converted(rec, want, target)
            t = t.reshape(meta.shape)  # only scalars differ ([] vs [1])
        state[name] = t
    assign_weights(model, state, device, dtype, layer_devices)
    return model, cfg


def assign_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], device, dtype: torch.dtype,
                   layer_devices: list | None = None) -> None:
    """Give the network built on the meta device its tensors, by expected_tensors' names: the per-layer scalars
    (`decoder_layer_scalar.N`, `encoder_layer_scalar.N`) stacked into their [L] parameters on `device` in `dtype`,
    the rest assigned as they are; then each layer's device where the plan splits them, and eval mode."""
    state, scalars = {}, {kind: {} for kind in ("encoder_layer_scalar", "decoder_layer_scalar")}
    for name, t in tensors.items():
        kind, _, i = name.partition(".")
        if kind in scalars:
            scalars[kind][int(i)] = t.reshape(())
        else:
            state[name] = t
    for kind, parts in scalars.items():
        state[kind] = torch.stack([parts[i] for i in range(len(parts))]).to(device=device, dtype=dtype)
    model.load_state_dict(state, assign=True, strict=True)
    if layer_devices is not None:
        model.layer_devices = [torch.device(d) for d in layer_devices]
    model.eval().requires_grad_(False)


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
