"""How things are named, below everything that uses the names (engine, store, quantize, hub, weights):

- checkpoint file names and text-stack prefixes: the torch-free part of the layout (see weights.py for the rest),
  shared by the loader and the downloader;
- what a `--model` value names, and the model store's location and listing (store.py pulls and removes entries).

Imports nothing of dgemma_cli but errors, and no torch.

A `--model` value is, in this order:
1. `demo`: the bundled demo model (upper-casing); `demo-sudoku`: the bundled 4x4 sudoku solver; `demo-shapes`: the
   bundled model that names the shape and colour in a picture (`--image`);
2. a directory: any value that is an existing directory, or starts with `/`, `.` or `~`;
3. a store name `[OWNER/]NAME[:QUANT]`, e.g. `google/diffusiongemma-26B-A4B-it:nvfp4`, or just
   `diffusiongemma-26B-A4B-it` when one entry matches. A repository id that is not in the store is an error that
   says which `dgemma pull` fetches it: nothing is downloaded behind the user's back.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError, UsageError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Text-stack prefixes in the order they are preferred. The first one that holds the embedding wins.
TEXT_PREFIXES = ("model.decoder.", "model.encoder.language_model.", "model.language_model.")


# The vision tower and its projection into the text model, in every layout vision.py reads (DiffusionGemma's
# `model.encoder.*` first, then Gemma 4's `model.*`).
# The vision tower's tensors: under the encoder (DiffusionGemma's layout) or the model (Gemma 4's), the tower itself and
# its projection into the text model; vision.py reads them under these names.
VISION_ROOTS = ("model.encoder.", "model.")
VISION_TOWER, VISION_EMBED = "vision_tower.", "embed_vision."
VISION_TENSOR_PREFIXES = tuple(root + part for root in VISION_ROOTS for part in (VISION_TOWER, VISION_EMBED))


def text_shards(weight_map: dict[str, str]) -> list[str]:
    """The shards of an index that hold at least one text-stack tensor, in index order: what the text model loads
    (a shard holding only the vision tower is read only for images, so it need not be present for text)."""
    return list(dict.fromkeys(f for n, f in weight_map.items() if n.startswith(TEXT_PREFIXES)))


def vision_names(weight_map: dict[str, str]) -> dict[str, str]:
    """{tensor name: shard} of the index's vision-tower tensors (empty for a checkpoint without one)."""
    return {n: f for n, f in weight_map.items() if n.startswith(VISION_TENSOR_PREFIXES)}


def model_shards(weight_map: dict[str, str]) -> list[str]:
    """The shards of an index that hold at least one text-stack or vision-tower tensor, in index order: what
    `dgemma pull` fetches and stores (a shard of anything else, an audio tower say, is left out)."""
    wanted = TEXT_PREFIXES + VISION_TENSOR_PREFIXES
    return list(dict.fromkeys(f for n, f in weight_map.items() if n.startswith(wanted)))


# ----------------------------------------------------------------------------- models and the store

PACKAGE = Path(__file__).resolve().parent.parent  # dgemma_cli/, where the bundled models sit
DEMO_MODEL = PACKAGE / "demo_model"
DEMO_SUDOKU = PACKAGE / "demo_sudoku"
DEMO_SHAPES = PACKAGE / "demo_shapes"
# names of the models that ship inside dgemma
BUNDLED = {"demo": DEMO_MODEL, "demo-sudoku": DEMO_SUDOKU, "demo-shapes": DEMO_SHAPES}
BUNDLED_ABOUT = {  # what each bundled model does, as `dgemma list` says it
    "demo": "upper-cases 16-character text (\"upper: hello diffusions\")",
    "demo-sudoku": "solves 4x4 sudoku (\"sudoku: ..4./..../.2.1/3...\")",
    "demo-shapes": "names the shape and colour in a picture (--image)",
}

MANIFEST = "dgemma-manifest.json"  # the same name quant.convert writes
QUANTS = ("bf16", "fp8", "int8", "nvfp4")
# a GGUF repository's quantizations, by the label its file names carry (q4_k_m, q8_0, iq4_xs, ud-q4_k_xl, bf16, ...)
GGUF_QUANT = re.compile(r"^(?:ud-)?(?:[it]?q\d(?:_[a-z0-9]+)+|bf16|f16|f32)$")
POLICIES = ("experts", "all")  # what a format quantizes: the routed experts, or also attention and the dense MLP
STORE_NAME = re.compile(r"^(?:(?P<owner>[A-Za-z0-9][A-Za-z0-9._-]*)/)?(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)"
                        r"(?::(?P<quant>[a-z0-9_-]+))?$")


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


def entry_model(path: Path) -> Path:
    """What runs from a store entry: the directory, or the GGUF file in it (a split file's first part)."""
    files = sorted(path.glob("*.gguf"))
    return files[0] if files and not (path / "config.json").is_file() else path


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
    return ref.startswith(("/", ".", "~")) or Path(ref).expanduser().is_dir() or ref.lower().endswith(".gguf")


def resolve(ref: str, demo: Path) -> Path:
    """A `--model` value -> a model directory (see the module docstring for the syntax)."""
    if ref == "demo":
        return demo
    if ref in BUNDLED:
        return BUNDLED[ref]
    if looks_like_path(ref):
        path = Path(ref).expanduser()
        if (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file():
            _adapter_as_model(ref, path)
        return path
    if ref in BUNDLED_ADAPTERS:
        _adapter_as_model(ref, BUNDLED_ADAPTERS[ref])
    m = STORE_NAME.match(ref)
    if not m:
        raise UsageError(f"{ref!r} is neither a model directory nor a store name ([OWNER/]NAME[:QUANT])")
    if m["quant"] and m["quant"] not in QUANTS and not GGUF_QUANT.match(m["quant"]):
        raise UsageError(f"{ref}: unknown format {m['quant']!r} (one of {', '.join(QUANTS)}, or a GGUF file's "
                         "quantization: q4_k_m, q8_0, ...)")
    found = [e for e in find(ref) if e.quant != "lora"]  # an adapter is not a model (--adapter takes it)
    if len(found) == 1:
        return entry_model(found[0].path)
    if len(found) > 1:
        names = ", ".join(e.name for e in found)
        raise UsageError(f"{ref} matches {len(found)} models in the store ({names}); add :QUANT to choose")
    adapters = [e for e in find(ref) if (e.path / ADAPTER_CONFIG).is_file()]
    if len(adapters) == 1:
        _adapter_as_model(ref, adapters[0].path)
    repo = f"{m['owner']}/{m['name']}" if m["owner"] else None
    quant = f" --quant {m['quant']}" if m["quant"] else ""
    hint = f"`dgemma pull {repo}{quant}` downloads it" if repo else "`dgemma list` shows what is there"
    raise ModelError(f"{ref}: no such model directory, and not in the store ({store_root()}); {hint}")


ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # a PEFT LoRA adapter's files
# LoRA adapters that ship inside dgemma: name -> (directory, the bundled model it adapts, what it does)
BUNDLED_ADAPTERS = {"demo-sudoku-lora": PACKAGE / "demo_sudoku_lora"}
BUNDLED_ADAPTERS_ABOUT = {
    "demo-sudoku-lora": ("demo", "teaches demo 4x4 sudoku (dgemma run --model demo --adapter demo-sudoku-lora "
                                 "\"sudoku: ..4./..../.2.1/3...\")"),
}


def _adapter_as_model(ref: str, directory: Path) -> None:
    """Refuse a LoRA adapter given as --model, saying how it runs: on the base its adapter_config.json names."""
    try:
        base = json.loads((directory / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    base = base if isinstance(base, str) and base.strip() else "BASE"
    raise UsageError(f"{ref} is a LoRA adapter, not a model: run it on its base model, --model {base} --adapter {ref}")


def resolve_adapter(arg: str) -> tuple[Path, float]:
    """An `--adapter` value, DIR or NAME with an optional :SCALE (default 1) -> (adapter directory, scale). A name is
    a bundled adapter or one in the store; checked here, before torch is imported."""
    import math

    ref, scale = arg, 1.0
    head, sep, tail = arg.rpartition(":")
    if sep and head:
        try:
            scale, ref = float(tail), head
        except ValueError:
            if _adapter_named(head) and not _adapter_named(arg):  # demo-sudoku-lora:abc: a scale that is no number
                raise UsageError(f"--adapter {arg}: SCALE (after ':') must be a number, such as 0.5 "
                                 f"(got {tail!r})") from None
    if not math.isfinite(scale):
        raise UsageError(f"--adapter {arg}: the scale after ':' must be a finite number")
    if ref in BUNDLED_ADAPTERS:
        path = BUNDLED_ADAPTERS[ref]
    elif looks_like_path(ref):
        path = Path(ref).expanduser()
    else:
        found = [e for e in find(ref) if (e.path / ADAPTER_CONFIG).is_file()] if STORE_NAME.match(ref) else []
        if len(found) != 1:
            raise UsageError(f"--adapter {ref}: no such adapter directory" +
                             (", and not in the store" if STORE_NAME.match(ref) else ""))
        path = found[0].path
    if not path.is_dir():
        raise UsageError(f"--adapter {ref}: no such adapter directory")
    if not (path / ADAPTER_CONFIG).is_file():
        raise UsageError(f"--adapter {ref}: {path} has no {ADAPTER_CONFIG} (not a PEFT adapter)")
    return path, scale


def _adapter_named(ref: str) -> bool:
    """Whether `ref` names an adapter as resolve_adapter reads it (bundled, a directory, a store entry)."""
    if ref in BUNDLED_ADAPTERS:
        return True
    if looks_like_path(ref):
        return Path(ref).expanduser().is_dir()
    return bool(STORE_NAME.match(ref)) and any((e.path / ADAPTER_CONFIG).is_file() for e in find(ref))


def resolve_model(model: str | Path) -> Path:
    """'demo' (the bundled demo model), a directory, or a name in the store (see the module docstring)."""
    if isinstance(model, Path):
        return model
    return resolve(model, DEMO_MODEL)
