"""Streaming, resumable writer of safetensors checkpoints: the converter's machinery, format-agnostic.

The caller describes the output as shards of groups; a group is a list of output tensors (name, dtype, shape) and
a function that yields their bytes in that order, in pieces of any size (one expert at a time, say). Nothing is
held but the piece in flight, so converting a checkpoint of any size costs the caller's pieces plus small buffers.

On disk, while it works: `<out>.partial/` next to the output holds finished shards and `progress.json` (the job's
description and, per finished shard, its size and sha256, hashed while writing). A shard is written to a `.tmp`
file, fsynced, renamed, then recorded. Interrupted (Ctrl-C, kill, power) and run again with the same job, it skips
the recorded shards and rewrites the rest; a different job (other source, format, policy) starts over. When every
shard is written, each is hashed again and compared with its record, the small files, the index and a manifest
(every file's size and sha256) are written, and only then is the directory renamed to `<out>`: the output exists
complete and verified, or not at all. A full disk or a bad input removes `<out>.partial/` (nothing half-made is
left); an interruption keeps it for the next run.

This package never imports dgemma_cli: names and policies come from the caller.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

MANIFEST = "dgemma-manifest.json"
PROGRESS = "progress.json"
INDEX = "model.safetensors.index.json"

SAFETENSORS_DTYPE = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8", torch.uint8: "U8",
    torch.float8_e4m3fn: "F8_E4M3", torch.int32: "I32", torch.int64: "I64",
}


class ConvertError(Exception):
    """A conversion that cannot go on (full disk, bad source); the message is one line."""


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass
class Group:
    """Output tensors written back to back; `produce()` yields their bytes in order as tensors of any shape."""

    outputs: list[OutTensor]
    produce: Callable[[], Iterable[torch.Tensor]]


@dataclass
class Shard:
    filename: str
    groups: list[Group] = field(default_factory=list)

    @property
    def tensors(self) -> list[OutTensor]:
        return [t for g in self.groups for t in g.outputs]

    def header(self) -> bytes:
        """The safetensors header (8-byte length + JSON padded with spaces to a multiple of 8)."""
        entries, offset = {}, 0
        for t in self.tensors:
            entries[t.name] = {"dtype": SAFETENSORS_DTYPE[t.dtype], "shape": list(t.shape),
                               "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw = json.dumps(entries, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        return len(raw).to_bytes(8, "little") + raw

    @property
    def nbytes(self) -> int:
        return len(self.header()) + sum(t.nbytes for t in self.tensors)


def sha256_of(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _atomic_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def partial_dir(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def _write_shard(shard: Shard, path: Path, on_bytes: Callable[[int], None]) -> tuple[int, str]:
    """Write one shard to `path` (its .tmp first); returns (size, sha256)."""
    tmp = path.with_name(path.name + ".tmp")
    h = hashlib.sha256()
    size = 0
    with open(tmp, "wb") as f:
        def put(data) -> None:
            nonlocal size
            f.write(data)
            h.update(data)
            size += len(data)
            on_bytes(len(data))

        put(shard.header())
        for group in shard.groups:
            want = sum(t.nbytes for t in group.outputs)
            got = 0
            for piece in group.produce():
                raw = piece.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()
                got += raw.nbytes
                if got > want:
                    break
                put(memoryview(raw))
            if got != want:
                raise ConvertError(f"{group.outputs[0].name}: produced {got} bytes, expected {want} (bad source?)")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return size, h.hexdigest()


def write_checkpoint(out: Path, shards: list[Shard], files: dict[str, bytes], job: dict,
                     on_bytes: Callable[[int], None] = lambda n: None,
                     on_note: Callable[[str], None] = lambda s: None, manifest_extra: dict | None = None) -> dict:
    """Write (or finish writing) a sharded checkpoint at `out`; returns the manifest.

    files: small files to write beside the shards (config.json, tokenizer, ...). job: a JSON-able description of
    what is being made; a partial output from a different job is discarded. manifest_extra: more keys for the
    manifest (not part of the job: it may differ between runs).
    """
    out = Path(out)
    if out.exists():
        raise ConvertError(f"{out} already exists")
    work = partial_dir(out)
    progress_path = work / PROGRESS
    done: dict[str, dict] = {}
    if work.exists():
        if not progress_path.is_file():  # not ours: never delete what this writer did not make
            raise ConvertError(f"{work} exists and is not an unfinished conversion; move it away or choose another "
                               "output")
        try:
            state = json.loads(progress_path.read_text())
            if state.get("job") == job:
                done = state.get("done", {})
        except (OSError, ValueError):
            pass
        if not done:
            shutil.rmtree(work)  # an unfinished conversion of something else: start over
        else:
            on_note(f"resuming: {len(done)} of {len(shards)} shards already written")
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConvertError(f"cannot create {work}: {e.strerror}") from None
    for name in list(done):  # a recorded shard must still be there, whole
        if (work / name).is_file() and (work / name).stat().st_size == done[name]["size"]:
            continue
        del done[name]
    _atomic_json(progress_path, {"job": job, "done": done})

    for name in done:
        on_bytes(done[name]["size"])  # progress counts what an earlier run wrote
    todo = [s for s in shards if s.filename not in done]
    need = sum(s.nbytes for s in todo) + sum(len(b) for b in files.values())
    free = shutil.disk_usage(work).free
    if need > free:
        _discard(work, keep=bool(done))
        raise ConvertError(f"not enough disk space at {work.parent}: {need / 1e9:.2f} GB needed, "
                           f"{free / 1e9:.2f} GB free")
    try:
        for shard in todo:
            size, digest = _write_shard(shard, work / shard.filename, on_bytes)
            done[shard.filename] = {"size": size, "sha256": digest}
            _atomic_json(progress_path, {"job": job, "done": done})
        # Verify: every shard read back must hash to what was written.
        for shard in shards:
            if sha256_of(work / shard.filename) != done[shard.filename]["sha256"]:
                raise ConvertError(f"{work / shard.filename}: does not read back as written (disk error?)")
        weight_map = {t.name: s.filename for s in shards for t in s.tensors}
        total = sum(done[s.filename]["size"] for s in shards)
        files = dict(files)
        files[INDEX] = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode()
        entries = {s.filename: done[s.filename] for s in shards}
        for name, data in files.items():
            (work / name).write_bytes(data)
            entries[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        manifest = dict(manifest_extra or {}, job=job, files=entries,
                        total_bytes=sum(e["size"] for e in entries.values()))
        _atomic_json(work / MANIFEST, manifest)
        progress_path.unlink()
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            _discard(work)
            raise ConvertError(f"disk full while writing {work}; removed the partial output "
                               f"({need / 1e9:.2f} GB needed)") from None
        raise ConvertError(f"cannot write {work}: {e.strerror or e}; run the command again to continue") from None
    except ConvertError:
        _discard(work)
        raise
    os.rename(work, out)
    return manifest


def _discard(work: Path, keep: bool = False) -> None:
    if not keep:
        shutil.rmtree(work, ignore_errors=True)


def write_manifest(directory: Path, extra: dict) -> dict:
    """Hash every file of a finished directory into its manifest (for outputs not made by write_checkpoint)."""
    directory = Path(directory)
    entries = {f.name: {"size": f.stat().st_size, "sha256": sha256_of(f)}
               for f in sorted(directory.iterdir()) if f.is_file() and f.name != MANIFEST}
    manifest = dict(extra, files=entries, total_bytes=sum(e["size"] for e in entries.values()))
    _atomic_json(directory / MANIFEST, manifest)
    return manifest


def verify(directory: Path) -> dict:
    """Check every file of a finished output against its manifest; returns the manifest."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        raise ConvertError(f"{directory}: no readable {MANIFEST}") from None
    for name, entry in manifest["files"].items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != entry["size"]:
            raise ConvertError(f"{path}: missing or of the wrong size")
        if sha256_of(path) != entry["sha256"]:
            raise ConvertError(f"{path}: sha256 does not match the manifest")
    return manifest
