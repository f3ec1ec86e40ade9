"""A checkpoint's tensors as its files declare them, read without torch: safetensors headers, the text stack's files
and prefix, checkpoint names, and the vision tower's tensors.

`dgemma show` and `dgemma info` (store.describe) read a model from here alone, so they never import torch; the loader
(weights.py) and the vision tower (vision.py) read the same headers through here and give the records torch dtypes.
Each record's dtype is safetensors' own name ("BF16", "F8_E4M3", ...).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError
from .names import INDEX_FILE, SINGLE_FILE, TEXT_PREFIXES, VISION_EMBED, VISION_ROOTS, VISION_TOWER, text_shards

# The dtypes dgemma reads, by safetensors' names, and their sizes in bytes (weights.py maps them to torch's).
DTYPE_SIZES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class HeaderRecord:
    """Where one tensor lives: file, byte range of its data, safetensors dtype name and shape."""

    file: Path
    start: int  # absolute byte offset in the file
    end: int
    dtype: str
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, HeaderRecord]:
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
            dtype = info["dtype"]
            itemsize = DTYPE_SIZES.get(dtype)
            a, b = (int(v) for v in info["data_offsets"])
            shape = tuple(int(d) for d in info["shape"])
        except (TypeError, KeyError, ValueError):
            raise ModelError(f"{path}: corrupt safetensors header (tensor {name})") from None
        if itemsize is None:
            raise ModelError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= a <= b or b - a != numel * itemsize:
            raise ModelError(f"{path}: corrupt safetensors header (tensor {name}: {b - a} bytes for shape "
                             f"{list(shape)})")
        records[name] = HeaderRecord(path, base + a, base + b, dtype, shape)
        data_end = max(data_end, base + b)
    if data_end > size:
        raise ModelError(f"{path}: truncated file ({size} bytes, header promises {data_end}); download it again")
    return records


def checkpoint_files(directory: Path) -> list[Path]:
    """The files holding the text stack: the single file, or the index's shards that hold text tensors."""
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


def index_checkpoint(directory: Path) -> dict[str, HeaderRecord]:
    records: dict[str, HeaderRecord] = {}
    for f in checkpoint_files(directory):
        records.update(read_header(f))
    return records


def text_prefix(records: dict) -> str:
    for p in TEXT_PREFIXES:
        if p + "embed_tokens.weight" in records:
            return p
    raise ModelError("checkpoint has no text embedding (expected model.decoder.embed_tokens.weight)")


ENCODER_SCALAR = "model.encoder.language_model.layers.{}.layer_scalar"
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


def expert_base(layer: int, prefix: str) -> str:
    return checkpoint_name(f"layers.{layer}.experts.gate_up_proj", prefix).rsplit(".", 1)[0]


# ----------------------------------------------------------------------------- the vision tower

VISION_PREFIXES = VISION_ROOTS  # where the tower may sit, preferred first (names.py)


def vision_prefix_of(name: str) -> str | None:
    """The vision prefix a tensor name is under (None: not a vision-tower tensor)."""
    for p in VISION_PREFIXES:
        if name.startswith((p + VISION_TOWER, p + VISION_EMBED)):
            return p
    return None


def vision_records(directory: Path, read: Callable[[Path], dict] = read_header) -> tuple[dict, str]:
    """The vision tensors' records ({name: record}, as `read` gives a file's) and their prefix; ModelError when the
    checkpoint's vision tower is missing or not downloaded (a text-only store entry keeps only the text shards)."""
    d = Path(directory)
    index = d / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            raise ModelError(f"{index}: not a valid safetensors index") from None
        names = {n: f for n, f in weight_map.items() if vision_prefix_of(n) is not None}
        files = sorted(set(names.values()))
        missing = [f for f in files if not (d / f).is_file()]
        if missing:
            raise ModelError(f"{d}: the vision tower's weights are not here ({missing[0]} is missing); this "
                             "download holds only the text model")
        files = [d / f for f in files]
    elif (d / SINGLE_FILE).is_file():
        files = [d / SINGLE_FILE]
    else:
        raise ModelError(f"{d}: no {SINGLE_FILE} or {INDEX_FILE}")
    records = {}
    for f in files:
        records.update({n: r for n, r in read(f).items() if vision_prefix_of(n) is not None})
    prefixes = {vision_prefix_of(n) for n in records}
    if not records:
        raise ModelError(f"{d}: the checkpoint holds no vision tower tensors")
    prefix = min(prefixes, key=VISION_PREFIXES.index)
    return records, prefix


def check_images(directory: Path) -> None:
    """Before images are read with `directory`: ModelError (one line) when it is a store entry that holds only the
    text model, saying how to get the vision tower. Anything else (not an entry, a whole entry, a damaged index) is
    left to the loader, whose messages speak of files."""
    from .names import INDEX_FILE, MANIFEST, vision_names

    d = Path(directory)
    try:
        meta = json.loads((d / MANIFEST).read_text())["store"]
        repo, quant = str(meta["repo"]), str(meta["quant"])
        names = vision_names(json.loads((d / INDEX_FILE).read_text())["weight_map"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return  # not an entry, or a single-file one (stored whole, as published)
    if names and all((d / f).is_file() for f in set(names.values())):
        return
    name = f"{repo}:{quant}"
    if meta.get("vision_tower") is False:  # recorded by pull: the source itself has no tower
        raise ModelError(f"{name}: {repo} publishes no vision tower weights, so this model cannot read images")
    raise ModelError(f"{name} holds only the text model (made before dgemma kept the vision tower); to read "
                     f"images: dgemma rm {name} && dgemma pull {repo} --quant {quant}")


def stored_policy(directory: Path) -> str:
    """What a quantized checkpoint quantizes, read from its headers: "all" when the dense MLP's projections are stored
    with scales (attention and the dense MLP quantized), else "experts"."""
    records = index_checkpoint(Path(directory))
    return policy_of(records, text_prefix(records))


def policy_of(records: dict, prefix: str) -> str:
    """`stored_policy` from a checkpoint already indexed (index_checkpoint's records, text_prefix's prefix)."""
    return "all" if checkpoint_name("layers.0.mlp.up_proj.weight_scale", prefix) in records else "experts"
