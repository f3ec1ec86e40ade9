"""A GGUF file's header read lean: its metadata and its tensors' names, types, shapes and places, parsed straight from
a memory map (the format's own layout, ggml's gguf.md), without making a Python object of every element of its big
arrays. The `gguf` library's reader turns each of a real DiffusionGemma file's 262,144 tokens and 514,906 merges
into numpy objects: 17.7 s on this machine before a run could start; here a string array stays a list of offsets
into the map (`StringArray`), read when asked for, and a number array one numpy view.

Layout (little-endian): "GGUF", u32 version (2 or 3), u64 tensor count, u64 metadata count; each metadata entry a
string key (u64 length, UTF-8 bytes), a u32 value type and its value (an array: u32 element type, u64 count, the
elements); then per tensor a string name, u32 dimension count, u64 dimensions (ggml order: the fastest first), u32
type and u64 offset into the data section, which starts at the next multiple of `general.alignment` (32 without it).
Anything that does not parse, or runs past the file's end, raises `HeaderError` with what was being read.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# metadata value types -> (struct format, numpy dtype) for the fixed-size ones
_SCALAR = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16), 4: ("<I", np.uint32),
           5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_), 10: ("<Q", np.uint64),
           11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9
SMALL = 4096  # arrays up to this many elements become Python lists; longer ones stay views of the map


class HeaderError(ValueError):
    """The header does not parse (a file cut short, or not written as GGUF)."""


class StringArray:
    """A metadata array of strings, left in the map: its length at once, its strings when iterated or indexed."""

    def __init__(self, buf, starts: np.ndarray, lengths: np.ndarray):
        self._buf, self._starts, self._lengths = buf, starts, lengths

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i: int) -> str:
        s = int(self._starts[i])
        return bytes(self._buf[s: s + int(self._lengths[i])]).decode("utf-8", errors="replace")

    def __iter__(self):
        return (self[i] for i in range(len(self)))


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order (the fastest-varying first)
    type_id: int
    offset: int  # from the start of the file


@dataclass
class Header:
    version: int
    metadata: dict
    tensors: list[TensorInfo]
    data_start: int
    size: int  # the file's bytes
    map: object  # the memory map the tensors' data views come from


class _Cursor:
    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def take(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise HeaderError(f"the file ends inside {what}")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str) -> str:
        n = self.take("<Q", what)
        if self.pos + n > self.size:
            raise HeaderError(f"the file ends inside {what}")
        s = bytes(self.buf[self.pos: self.pos + n])
        self.pos += n
        try:
            return s.decode("utf-8")
        except UnicodeDecodeError:
            raise HeaderError(f"{what} is not UTF-8") from None

    def value(self, vtype: int, what: str):
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype][0], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise HeaderError(f"{what} has an unknown value type {vtype}")
        etype, count = self.take("<I", what), self.take("<Q", what)
        if etype in _SCALAR:
            dtype = np.dtype(_SCALAR[etype][1]).newbyteorder("<")
            end = self.pos + count * dtype.itemsize
            if end > self.size:
                raise HeaderError(f"the file ends inside {what}")
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos = end
            return arr.tolist() if count <= SMALL else arr
        if etype == _STRING:
            starts = np.empty(count, dtype=np.int64)
            lengths = np.empty(count, dtype=np.int64)
            pos, buf, size, unpack = self.pos, self.buf, self.size, struct.unpack_from
            for i in range(count):  # the only per-element loop: each string's length says where the next begins
                if pos + 8 > size:
                    raise HeaderError(f"the file ends inside {what}")
                n = unpack("<Q", buf, pos)[0]
                starts[i], lengths[i] = pos + 8, n
                pos += 8 + n
            if pos > size:
                raise HeaderError(f"the file ends inside {what}")
            self.pos = pos
            strings = StringArray(buf, starts, lengths)
            return list(strings) if count <= SMALL else strings
        if etype == _ARRAY:
            return [self.value(_ARRAY, what) for _ in range(count)]
        raise HeaderError(f"{what} is an array of an unknown type {etype}")


def read_header(path: Path) -> Header:
    """Parse `path`'s header (see the module docstring). Raises HeaderError, or OSError for an unreadable file."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise HeaderError("the file ends inside its header")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    c = _Cursor(mm, size)
    if bytes(mm[:4]) != b"GGUF":
        raise HeaderError("it does not start with 'GGUF'")
    c.pos = 4
    version = c.take("<I", "the version")
    if version not in (2, 3):
        raise HeaderError(f"GGUF version {version} (dgemma reads 2 and 3)")
    n_tensors, n_kv = c.take("<Q", "the tensor count"), c.take("<Q", "the metadata count")
    metadata = {}
    for _ in range(n_kv):
        key = c.string("a metadata key")
        metadata[key] = c.value(c.take("<I", f"{key}'s type"), key)
    infos = []
    for _ in range(n_tensors):
        name = c.string("a tensor's name")
        n_dims = c.take("<I", f"tensor {name}")
        if n_dims > 8:
            raise HeaderError(f"tensor {name} has {n_dims} dimensions")
        dims = tuple(c.take("<Q", f"tensor {name}") for _ in range(n_dims))
        infos.append((name, dims, c.take("<I", f"tensor {name}"), c.take("<Q", f"tensor {name}")))
    align = int(metadata.get("general.alignment", 32) or 32)
    data_start = -(-c.pos // align) * align
    tensors = [TensorInfo(name, dims, type_id, data_start + offset) for name, dims, type_id, offset in infos]
    return Header(version, metadata, tensors, data_start, size, mm)
