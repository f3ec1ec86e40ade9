"""dgemma's model store, and how a `--model` value names a model.

The store is a folder (`$DGEMMA_HOME/models`, else `$XDG_CACHE_HOME/dgemma/models`, else `~/.cache/dgemma/models`)
with one directory per model: `OWNER--NAME--QUANT/`, a checkpoint in the Hugging Face layout plus
`dgemma-manifest.json` (source repo and commit, format, policy, and every file's size and sha256). An entry is
made in `OWNER--NAME--QUANT.partial/` and renamed into place only when complete and verified, so a listed entry is
always whole; `.partial` directories (an interrupted pull) are never listed and are resumed by the next pull.

A `--model` value is, in this order:
1. `demo`: the bundled demo model;
2. a directory: any value that is an existing directory, or starts with `/`, `.` or `~`;
3. a store name `[OWNER/]NAME[:QUANT]`, e.g. `google/diffusiongemma-26B-A4B-it:nvfp4`, or just
   `diffusiongemma-26B-A4B-it` when one entry matches. A repository id that is not in the store is an error that
   says which `dgemma pull` fetches it: nothing is downloaded behind the user's back.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import DgemmaError, ModelError, UsageError

MANIFEST = "dgemma-manifest.json"  # the same name quant.convert writes
DEFAULT_REPO = "google/diffusiongemma-26B-A4B-it"
QUANTS = ("bf16", "int8", "nvfp4")
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
STORE_NAME = re.compile(r"^(?:(?P<owner>[A-Za-z0-9][A-Za-z0-9._-]*)/)?(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)"
                        r"(?::(?P<quant>[a-z0-9]+))?$")


def store_root() -> Path:
    if os.environ.get("DGEMMA_HOME"):
        return Path(os.environ["DGEMMA_HOME"]).expanduser() / "models"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "dgemma" / "models"


@dataclass(frozen=True)
class Entry:
    repo: str  # OWNER/NAME
    quant: str
    path: Path
    manifest: dict

    @property
    def name(self) -> str:
        return f"{self.repo}:{self.quant}"

    @property
    def size(self) -> int:
        return sum(int(f["size"]) for f in self.manifest.get("files", {}).values())


def entry_dir(repo: str, quant: str) -> Path:
    owner, name = repo.split("/")
    return store_root() / f"{owner}--{name}--{quant}"


def entries() -> list[Entry]:
    """Every complete entry in the store (directories with a readable manifest), sorted by name."""
    root = store_root()
    out = []
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.name.endswith(".partial") or d.name.startswith("."):
            continue
        try:
            manifest = json.loads((d / MANIFEST).read_text())
            store = manifest["store"]
            out.append(Entry(store["repo"], store["quant"], d, manifest))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours, or damaged: `dgemma list` ignores it
    return out


def find(ref: str) -> list[Entry]:
    """Entries matching a store name `[OWNER/]NAME[:QUANT]` (names compare without regard to case)."""
    m = STORE_NAME.match(ref)
    if not m:
        return []
    owner, name, quant = m["owner"], m["name"].lower(), m["quant"]
    found = []
    for e in entries():
        e_owner, e_name = e.repo.lower().split("/")
        if name == e_name and (owner is None or owner.lower() == e_owner) and (quant is None or quant == e.quant):
            found.append(e)
    return found


def looks_like_path(ref: str) -> bool:
    return ref.startswith(("/", ".", "~")) or Path(ref).expanduser().is_dir()


def resolve(ref: str, demo: Path) -> Path:
    """A `--model` value -> a model directory (see the module docstring for the syntax)."""
    if ref == "demo":
        return demo
    if looks_like_path(ref):
        return Path(ref).expanduser()
    m = STORE_NAME.match(ref)
    if not m:
        raise UsageError(f"{ref!r} is neither a model directory nor a store name ([OWNER/]NAME[:QUANT])")
    if m["quant"] and m["quant"] not in QUANTS:
        raise UsageError(f"{ref}: unknown format {m['quant']!r} (one of {', '.join(QUANTS)})")
    found = find(ref)
    if len(found) == 1:
        return found[0].path
    if len(found) > 1:
        names = ", ".join(e.name for e in found)
        raise UsageError(f"{ref} matches {len(found)} models in the store ({names}); add :QUANT to choose")
    repo = f"{m['owner']}/{m['name']}" if m["owner"] else None
    quant = f" --quant {m['quant']}" if m["quant"] else ""
    hint = f"`dgemma pull {repo}{quant}` downloads it" if repo else "`dgemma list` shows what is there"
    raise ModelError(f"{ref}: no such model directory, and not in the store ({store_root()}); {hint}")


def describe(path: Path) -> dict:
    """What `dgemma info` prints about a model directory: format, policy, sizes, source."""
    from .config import ModelConfig
    from .footprint import runtime_bytes, weight_bytes
    from .weights import checkpoint_files, index_checkpoint, read_quant_format, text_prefix

    cfg = ModelConfig.from_dir(path)
    quantized = read_quant_format(path, cfg.raw)
    qc = cfg.raw.get("quantization_config") or {}
    policy = (qc.get("dgemma") or {}).get("policy") or ("experts" if quantized else "none")
    fmt = quantized or "bf16"  # sizes in memory: unquantized weights are held in bf16 on a GPU
    sized_as = policy if policy == "all" else "experts"
    records = index_checkpoint(path)
    stored = str(records[text_prefix(records) + "embed_tokens.weight"].dtype).replace("torch.", "")
    try:
        source = json.loads((path / MANIFEST).read_text()).get("store", {})
    except (OSError, ValueError):
        source = {}
    return {"path": str(path), "format": quantized or "unquantized", "dtype_on_disk": stored, "policy": policy,
            "size_on_disk": sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
            "weights_on_disk": sum(f.stat().st_size for f in checkpoint_files(path)),
            "weights_in_memory": sum(weight_bytes(cfg, fmt, sized_as).values()),
            "gpu_memory_estimate_8k": runtime_bytes(cfg, fmt, sized_as), "source": source,
            "layers": cfg.text.num_hidden_layers, "experts": cfg.text.num_experts, "vocab": cfg.text.vocab_size}


def remove(entry: Entry) -> None:
    """Take an entry out of the store: renamed away first (so it is never half-listed), then deleted."""
    trash = entry.path.with_name(f".{entry.path.name}.removing-{os.getpid()}")
    os.rename(entry.path, trash)
    shutil.rmtree(trash, ignore_errors=True)


# ----------------------------------------------------------------------------- pull


def _link_or_copy(src: Path, dst: Path) -> None:
    real = Path(os.path.realpath(src))
    try:
        os.link(real, dst)  # same file system: no second copy of tens of GB
    except OSError:
        shutil.copyfile(real, dst)


def _store_as_is(snapshot: Path, out: Path, store_meta: dict, note) -> dict:
    """An entry that is the downloaded checkpoint itself (bf16, or quantized as published): hard links where the
    file system allows, an index reduced to the shards that were fetched, and a manifest."""
    from quant.convert import partial_dir, write_manifest

    from .names import INDEX_FILE
    from .weights import checkpoint_files

    work = partial_dir(out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shards = checkpoint_files(snapshot)
    for f in snapshot.iterdir():
        if f.name == INDEX_FILE:
            index = json.loads(f.read_text())
            names = {s.name for s in shards}
            index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v in names}
            (work / INDEX_FILE).write_text(json.dumps(index, indent=1))
        elif f.is_file() and (f.suffix != ".safetensors" or f in shards):
            _link_or_copy(f, work / f.name)
    note("checking the files (sha256)")
    manifest = write_manifest(work, {"store": store_meta})
    os.rename(work, out)
    return manifest


def pull(repo: str, quant: str = "auto", revision: str | None = None, policy: str = "experts",
         progress: bool = True, note=lambda s: sys.stderr.write(f"dgemma: {s}\n")) -> Entry | None:
    """Download `repo` and make its store entry in the requested format. Returns the entry (None when it was
    already there: that is said, and nothing else is done)."""
    from . import hub
    from .config import ModelConfig
    from .footprint import choose_format, free_memory, runtime_bytes
    from .quantize import quantize_checkpoint
    from .weights import read_quant_format

    from .quantize import POLICIES

    if not REPO_ID.match(repo):
        raise UsageError(f"{repo!r} is not a repository id (OWNER/NAME, e.g. {DEFAULT_REPO})")
    if quant not in QUANTS + ("auto",):
        raise UsageError(f"--quant must be auto, {', '.join(QUANTS)} (got {quant!r})")
    if policy not in POLICIES:
        raise UsageError(f"--policy must be one of {', '.join(POLICIES)} (got {policy!r})")
    present = [e for e in entries() if e.repo.lower() == repo.lower() and quant in ("auto", e.quant)]
    if present:
        e = present[0]
        note(f"{e.name} is already in the store ({e.path}); nothing to do")
        return None

    decided: dict = {}

    def decide(snapshot: Path) -> None:
        """From the config alone, before any weights are fetched: the format, and whether it can be made."""
        cfg = ModelConfig.from_dir(snapshot)
        published = read_quant_format(snapshot, cfg.raw)
        fmt = quant
        if published is not None:
            if quant not in ("auto", published):
                raise UsageError(f"{repo} is published in {published}; it cannot be converted to {quant} "
                                 f"(pull the unquantized checkpoint for that)")
            fmt = published
        elif quant == "auto":
            free, where = free_memory()
            fmt = choose_format(cfg, free) or "nvfp4"
            need = runtime_bytes(cfg, fmt)
            fits = "fits" if need <= free else "may not fit"
            note(f"--quant auto: {fmt} ({need / 1e9:.1f} GB estimated at an 8k context {fits} the "
                 f"{free / 1e9:.1f} GB free in {where})")
        out = entry_dir(repo, fmt)
        if out.exists():  # entries() found no manifest there, so it is not a complete entry of ours
            raise ModelError(f"{out} exists but is not a complete store entry (no readable manifest); remove it "
                             "and pull again")
        decided.update(quant=fmt, published=published, out=out)

    snapshot = hub.download(repo, revision, progress=progress, on_config=decide)
    quant, published, out = decided["quant"], decided["published"], decided["out"]
    commit = snapshot.name
    meta = {"repo": repo, "quant": quant, "revision": commit, "policy": policy if quant in ("int8", "nvfp4") else None,
            "published": published is not None, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if quant == "bf16" or published is not None:
        manifest = _store_as_is(snapshot, out, meta, note)
    else:
        note(f"quantizing to {quant} (policy {policy}) into {out}")
        manifest = quantize_checkpoint(snapshot, out, quant, policy, store_meta=meta, progress=progress, note=note)
    return Entry(repo, quant, out, manifest)
