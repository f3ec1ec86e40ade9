"""dgemma's model store: pull, describe and remove entries.

The store is a folder (`$DGEMMA_HOME/models`, else `$XDG_CACHE_HOME/dgemma/models`, else `~/.cache/dgemma/models`)
with one directory per model: `OWNER--NAME--QUANT/`, a checkpoint in the Hugging Face layout plus
`dgemma-manifest.json` (source repo and commit, format, policy, and every file's size and sha256). An entry is
made in `OWNER--NAME--QUANT.partial/` and renamed into place only when complete and verified, so a listed entry is
always whole; `.partial` directories (an interrupted pull) are never listed and are resumed by the next pull.

How a `--model` value names a model, and the store's location and listing (`entries`, `find`,
`resolve`), live in checkpoint/names.py, below the engine; they are imported here too.

An entry holds the text stack and the vision tower (when the source has one). Entries made before dgemma kept the
tower hold only the text model: `check_images` says, in one line, how to replace one when it is given an image.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

# The naming and listing half of the store (checkpoint/names.py), used here and by the CLI as store.entries,
# store.find, ...
from ..checkpoint.names import (  # noqa: F401
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MANIFEST,
    QUANTS,
    STORE_NAME,
    Entry,
    entries,
    entry_dir,
    find,
    looks_like_path,
    resolve,
    store_root,
)
from ..errors import ModelError, UsageError

DEFAULT_REPO = "google/diffusiongemma-26B-A4B-it"
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def describe(path: Path) -> dict:
    """What `dgemma info` prints about a model directory: format and scheme, what is quantized, sizes, source.

    What is quantized is read from the checkpoint itself (a projection is quantized when its scale tensor is
    stored): `policy` is `all` when attention and the dense MLP are, `experts` when only the routed experts are."""
    from ..checkpoint.footprint import runtime_bytes, weight_bytes
    from ..checkpoint.layout import (
        checkpoint_files,
        checkpoint_name,
        expert_base,
        index_checkpoint,
        text_prefix,
        vision_records,
    )
    from ..config import ModelConfig
    from ..errors import ModelError
    from ..placement.plan import planned_context

    cfg = ModelConfig.from_dir(path)
    context = planned_context(cfg)  # the GPU estimate's: 8k, or the model's own where shorter
    fmt = _read_format(path, cfg.raw)
    records = index_checkpoint(path)  # headers only, read without torch
    prefix = text_prefix(records)
    experts_at, dense_at = expert_base(0, prefix), checkpoint_name("layers.0.mlp.up_proj", prefix)
    if fmt is not None:
        experts = fmt.expert_layout(experts_at, records) is not None
        dense = fmt.quantized_linear(dense_at, records)
    else:  # quant.formats.Format's own checks (the loader refuses such tensors without a quantization_config)
        experts = f"{experts_at}.0.gate_proj.weight" in records or f"{experts_at}.gate_up_proj.weight_scale" in records
        dense = f"{dense_at}.weight_scale" in records
    policy = "all" if dense else "experts" if experts else "none"
    label = fmt.label if fmt else None
    sized = label or "bf16"  # sizes in memory: unquantized weights are held in bf16 on a GPU
    sized_as = "all" if dense else "experts"
    stored = _TORCH_DTYPE_NAMES.get(records[prefix + "embed_tokens.weight"].dtype, "?")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = {}
    quantized = [p for p, yes in (("routed experts", experts), ("attention", dense), ("dense MLP", dense)) if yes]
    try:  # the vision tower: its weights' bytes here, or why it cannot read images
        vision = sum(r.end - r.start for r in vision_records(path)[0].values())
        images = None
    except ModelError as e:
        vision, images = 0, str(e)
    return {"path": str(path), "format": label or "unquantized", "scheme": fmt.scheme if fmt else None,
            "quantized": quantized, "dtype_on_disk": stored, "policy": policy,
            "size_on_disk": size_on_disk(path),
            "weights_on_disk": sum(f.stat().st_size for f in checkpoint_files(path)),
            "vision_tower_on_disk": vision, "images": images is None, "no_images_because": images,
            "weights_in_memory": sum(weight_bytes(cfg, sized, sized_as).values()),
            "gpu_memory_estimate": runtime_bytes(cfg, sized, sized_as, context=context), "gpu_memory_context": context,
            "source": manifest.get("store", {}),
            "layers": cfg.text.num_hidden_layers, "experts": cfg.text.num_experts, "vocab": cfg.text.vocab_size}


def describe_gguf(path: Path) -> dict:
    """`describe` for a GGUF file (checkpoint/gguf_file.py): its block types by share of the bytes, the sizes, and
    what it holds in memory as loaded (GGUFFile.footprint: the experts and projections as their blocks, the rest in
    16 bits), with one layer's experts unpacked at a time for the GPU estimate."""
    from ..checkpoint.footprint import RUNTIME_SLACK, dequantized_layer_bytes, kv_cache_bytes, request_bytes
    from ..checkpoint.gguf_file import read_gguf, split_parts
    from ..placement.plan import planned_context

    f, cfg = read_gguf(path)
    context = planned_context(cfg)
    by_type: dict[str, int] = {}
    for t in f.tensors.values():
        by_type[t.kind] = by_type.get(t.kind, 0) + t.nbytes
    total = sum(by_type.values())
    footprint = f.footprint(cfg.text.num_hidden_layers)
    in_memory = sum(footprint["totals"].values())
    kinds = sorted(by_type, key=lambda k: -by_type[k])
    return {"path": str(path), "format": "gguf", "scheme": ", ".join(f"{k} {by_type[k] / total:.0%}" for k in kinds),
            "quantized": [k for k in kinds if k not in ("F32", "F16", "BF16")], "dtype_on_disk": "gguf blocks",
            "policy": None, "size_on_disk": sum(p.stat().st_size for p in split_parts(path)),
            "weights_on_disk": total, "bytes_by_type": by_type, "vision_tower_on_disk": 0, "images": False,
            "no_images_because": "a GGUF holds no vision tower", "footprint": footprint,
            "weights_in_memory": in_memory,
            "gpu_memory_estimate": in_memory + kv_cache_bytes(cfg, context) + request_bytes(cfg)
            + dequantized_layer_bytes(cfg) + RUNTIME_SLACK, "gpu_memory_context": context,
            "source": {}, "layers": cfg.text.num_hidden_layers, "experts": cfg.text.num_experts,
            "vocab": cfg.text.vocab_size}


def size_on_disk(path: Path) -> int:
    """Bytes of a model directory's files, every one (the manifest included): what `info` and `quantize` say."""
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


# safetensors' dtype names as torch names them (what `dgemma info` has always shown: "bfloat16", "float32", ...)
_TORCH_DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _read_format(path: Path, raw_config: dict):
    """The checkpoint's quantization format (weights.read_format), or None: an unquantized checkpoint (no
    quantization_config, no ModelOpt hf_quant_config.json) is told without importing quant's modules, and torch."""
    if raw_config.get("quantization_config") is None and not (path / "hf_quant_config.json").exists():
        return None
    from ..checkpoint.weights import read_format

    return read_format(path, raw_config)


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
    file system allows, an index reduced to the shards that were fetched (text stack and vision tower, as
    `names.model_shards` chooses them), and a manifest."""
    from quant.convert import partial_dir, write_manifest

    from ..checkpoint.names import INDEX_FILE, SINGLE_FILE, model_shards

    work = partial_dir(out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    index = json.loads((snapshot / INDEX_FILE).read_text()) if (snapshot / INDEX_FILE).is_file() else None
    shards = set(model_shards(index["weight_map"])) if index is not None else {SINGLE_FILE}
    for f in snapshot.iterdir():
        if f.name == INDEX_FILE:
            index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v in shards}
            (work / INDEX_FILE).write_text(json.dumps(index, indent=1))
        elif f.is_file() and (f.suffix != ".safetensors" or f.name in shards):
            _link_or_copy(f, work / f.name)
    if missing := sorted(shards - {f.name for f in work.iterdir()}):
        shutil.rmtree(work, ignore_errors=True)
        raise ModelError(f"{snapshot}: {missing[0]} was not downloaded; run the command again")
    note("checking the files (sha256)")
    manifest = write_manifest(work, {"store": store_meta})
    os.rename(work, out)
    return manifest


def _has_vision(snapshot: Path) -> bool:
    """Whether a downloaded checkpoint holds a vision tower (per its index, or its single file's header)."""
    from ..checkpoint.names import INDEX_FILE, SINGLE_FILE, VISION_TENSOR_PREFIXES, vision_names
    from ..checkpoint.weights import read_header

    if (snapshot / INDEX_FILE).is_file():
        return bool(vision_names(json.loads((snapshot / INDEX_FILE).read_text())["weight_map"]))
    return any(n.startswith(VISION_TENSOR_PREFIXES) for n in read_header(snapshot / SINGLE_FILE))


def _check_stored_revision(e: Entry, revision: str, resolve_commit, note) -> None:
    """`pull --revision REV` of a repo already in the store: nothing to do when the entry was made from the commit
    REV names (a commit or its prefix is compared without asking the Hub); otherwise say what is there and how to
    replace it. One entry per repository and format, so a second revision never sits beside the first."""
    stored = str(e.manifest.get("store", {}).get("revision") or "")
    rev = revision.lower()
    if stored and (rev == stored or (len(rev) >= 7 and re.fullmatch(r"[0-9a-f]+", rev) and stored.startswith(rev))):
        commit = stored
    else:
        commit = resolve_commit(e.repo, revision)
    if stored and commit == stored:
        note(f"{e.name} is already in the store at {revision} (commit {stored[:12]}, {e.path}); nothing to do")
        return
    at = f"commit {stored[:12]}" if stored else "an unrecorded commit"
    raise UsageError(f"{e.name} is already in the store at {at}, not at {revision} (commit {commit[:12]}); to "
                     f"replace it: `dgemma rm {e.name}`, then `dgemma pull {e.repo} --quant {e.quant} "
                     f"--revision {revision}`")


def pull(repo: str, quant: str = "auto", revision: str | None = None, policy: str | None = None,
         progress: bool = True, note=lambda s: sys.stderr.write(f"dgemma: {s}\n")) -> Entry | None:
    """Download `repo` and make its store entry in the requested format. Returns the entry (None when it was
    already there: that is said, and nothing else is done)."""
    from ..checkpoint.names import GGUF_QUANT, POLICIES

    # Bad flags first, before anything imports torch (seconds).
    if not REPO_ID.match(repo):
        raise UsageError(f"{repo!r} is not a repository id (OWNER/NAME, e.g. {DEFAULT_REPO})")
    quant = quant.lower()
    if quant not in QUANTS + ("auto",) and not GGUF_QUANT.match(quant):
        raise UsageError(f"--quant must be auto, {', '.join(QUANTS)}, or a GGUF repository's quantization (q4_k_m, "
                         f"q8_0, ...) (got {quant!r})")
    if policy is not None and policy not in POLICIES:
        raise UsageError(f"--policy must be one of {', '.join(POLICIES)} (got {policy!r})")
    from ..checkpoint.footprint import DEFAULT_POLICY, candidates, capability, choose_format, free_memory, runtime_bytes
    from ..checkpoint.weights import read_quant_format
    from ..config import ModelConfig
    from . import hub
    from .quantize import quantize_checkpoint

    present = [e for e in entries() if e.repo.lower() == repo.lower() and quant in ("auto", e.quant)]
    if present:
        e = present[0]
        if revision is None:
            note(f"{e.name} is already in the store ({e.path}); nothing to do")
            return None
        _check_stored_revision(e, revision, hub.resolve_commit, note)
        return None

    decided: dict = {}

    def decide(snapshot: Path) -> None:
        """From the config alone, before any weights are fetched: the format, and whether it can be made."""
        if quant not in QUANTS + ("auto",):  # a GGUF file's label, for a repository of safetensors
            raise UsageError(f"{repo} is a safetensors checkpoint: --quant takes auto, {', '.join(QUANTS)} ({quant} "
                             "names a file of a GGUF repository)")
        cfg = ModelConfig.from_dir(snapshot)
        published = read_quant_format(snapshot, cfg.raw)
        fmt = quant
        if published is not None:
            if quant not in ("auto", published):
                raise UsageError(f"{repo} is published in {published}; it cannot be converted to {quant} "
                                 f"(pull the unquantized checkpoint for that)")
            fmt = published
            decided["to_all"] = _release_to_all(cfg, snapshot, published, quant, policy, note)
        elif quant == "auto":
            free, where = free_memory()
            cap = capability()
            fmt = choose_format(cfg, free, capability=cap) or "nvfp4"
            need = runtime_bytes(cfg, fmt)
            weighed = "/".join(candidates(cap))
            if need <= free:
                fits = "fits"
            else:  # NVFP4 with the experts that do not fit streamed from host memory (dgemma_cli/placement)
                from ..placement.cards import Card
                from ..placement.plan import plan, planned_context

                placed = plan(cfg, fmt, [Card(where, free, 0.0, 4, 16)], context=planned_context(cfg))
                fits = (f"does not fit whole in; {len(placed.streamed)} of {placed.layers} layers' experts will stream "
                        "from host memory (`dgemma plan` shows the plan), in" if placed.fits else "does not fit")
            note(f"--quant auto: {fmt} of {weighed} ({need / 1e9:.1f} GB estimated at an 8k context {fits} the "
                 f"{free / 1e9:.1f} GB free in {where})")
        out = entry_dir(repo, fmt)
        if out.exists():  # entries() found no manifest there, so it is not a complete entry of ours
            raise ModelError(f"{out} exists but is not a complete store entry (no readable manifest); remove it "
                             "and pull again")
        decided.update(quant=fmt, published=published, out=out)

    def take_gguf(choices: dict) -> str:
        """A GGUF repository: which quantization's file, before any is fetched."""
        label = _gguf_label(repo, quant, choices, note)
        out = entry_dir(repo, label)
        if out.exists():
            raise ModelError(f"{out} exists but is not a complete store entry (no readable manifest); remove it "
                             "and pull again")
        decided.update(quant=label, gguf=[name for name, _ in choices[label]], out=out)
        return label

    snapshot = hub.download(repo, revision, progress=progress, on_config=decide, on_gguf=take_gguf)
    if decided.get("gguf"):
        return _store_gguf(repo, snapshot, decided, progress, note)
    if not decided and (snapshot / ADAPTER_CONFIG).is_file():  # a LoRA adapter: stored as published
        return _store_adapter(repo, quant, snapshot, note)
    quant, published, out = decided["quant"], decided["published"], decided["out"]
    commit = snapshot.name
    to_all = decided.get("to_all", False)  # NVIDIA's NVFP4 release, its 16-bit attention and dense MLP quantized
    as_is = quant == "bf16" or (published is not None and not to_all)
    policy = "all" if to_all else policy or DEFAULT_POLICY[quant]
    meta = {"repo": repo, "quant": quant, "revision": commit, "policy": None if as_is else policy,
            "published": published is not None and not to_all, "vision_tower": _has_vision(snapshot),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if as_is:
        manifest = _store_as_is(snapshot, out, meta, note)
    else:
        device = quantize_device()
        note(f"quantizing to {quant} (policy {policy}) on the {'GPU' if device == 'cuda' else 'CPU'} into {out}")
        manifest = quantize_checkpoint(snapshot, out, quant, policy, device=device, store_meta=meta, progress=progress,
                                       note=note)
    return Entry(repo, quant, out, manifest)


def _release_to_all(cfg, snapshot: Path, published: str, quant: str, policy: str | None, note) -> bool:
    """Whether a published NVFP4 release of the experts alone (NVIDIA's) is made NVFP4 `all` here, its 16-bit
    attention and dense MLP quantized (dgemma_cli/store/quantize.py): asked for (--policy all), or --quant auto on a
    card where the release as published would stream experts from host memory and `all` would not (a 16 GB card:
    the RTX 4080's step bound is about twice as long streamed). Said in one line when it is chosen."""
    from quant.formats.modelopt import excludes_dense

    from ..checkpoint.footprint import free_memory
    from ..placement.cards import Card
    from ..placement.plan import plan, planned_context

    if published != "nvfp4" or not excludes_dense(cfg.raw, snapshot) or policy == "experts":
        return False
    if policy == "all":
        note("quantizing the release's 16-bit attention and dense MLP to NVFP4 (--policy all); its experts are kept "
             "as published")
        return True
    if quant != "auto":
        return False
    free, where = free_memory()
    card = [Card(where, free, 0.0, 4, 16)]
    as_is = plan(cfg, "nvfp4", card, context=planned_context(cfg), policy="experts")
    whole = plan(cfg, "nvfp4", card, context=planned_context(cfg), policy="all")
    if as_is.streamed and whole.fits and len(whole.streamed) < len(as_is.streamed):
        note(f"--quant auto: the release as published would stream {len(as_is.streamed)} layers' experts in the "
             f"{free / 1e9:.1f} GB free in {where}; with attention and the dense MLP quantized too (--policy all) "
             f"{len(whole.streamed) or 'none'} stream: quantizing them, the experts kept as published")
        return True
    return False


GGUF_ALLOWANCE = 3.5e9  # beyond a GGUF file's bytes on the card at an 8k context (26B-A4B: its embedding decoded,
# one layer's experts unpacked, the KV cache, a request's step memory, slack): an estimate made before the file is
# there, from `dgemma plan` of the published Q4_K_M (17.6 GB held, 20.2 GB estimated: 3.4 GB over its 16.8 GB)
BASE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def _gguf_label(repo: str, quant: str, choices: dict, note) -> str:
    """The quantization to pull from a GGUF repository: the one named, or with --quant auto the largest whose file
    the card holds whole (with GGUF_ALLOWANCE), else the smallest (it streams least)."""
    from ..checkpoint.footprint import free_memory

    labels = ", ".join(sorted(choices))
    sizes = {label: sum(size for _, size in files) for label, files in choices.items()}
    if quant == "auto":
        free, where = free_memory()
        fits = [label for label in choices if sizes[label] + GGUF_ALLOWANCE <= free]
        label = max(fits, key=sizes.get) if fits else min(choices, key=sizes.get)
        how = ("the largest that fits whole in" if fits else "the smallest (its experts will partly stream from host "
               "memory; `dgemma plan` shows how) for")
        note(f"--quant auto: {label} ({sizes[label] / 1e9:.1f} GB) of {repo}'s GGUF files ({labels}), {how} the "
             f"{free / 1e9:.1f} GB free in {where}")
        return label
    if quant not in choices:
        raise UsageError(f"{repo} holds GGUF files, as published: --quant takes one of their quantizations "
                         f"({labels}), not {quant}")
    return quant


def _store_gguf(repo: str, snapshot: Path, decided: dict, progress: bool, note) -> Entry:
    """A GGUF entry: the chosen file (every part) as published, hard-linked where the file system allows, with the
    tokenizer, chat template and generation config beside it: the repository's own, else the base model's (said)."""
    from quant.convert import partial_dir, write_manifest

    from . import hub

    out, label = decided["out"], decided["quant"]
    work = partial_dir(out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for name in decided["gguf"]:
        _link_or_copy(snapshot / name, work / Path(name).name)
    for name in BASE_FILES:
        if (snapshot / name).is_file():
            _link_or_copy(snapshot / name, work / name)
    if not (work / "tokenizer.json").is_file():
        note(f"{repo} has no tokenizer.json: the tokenizer, chat template and generation config are "
             f"{DEFAULT_REPO}'s")
        for name, path in hub.fetch_files(DEFAULT_REPO, BASE_FILES, progress=progress).items():
            if not (work / name).is_file():
                _link_or_copy(path, work / name)
        _check_own_tokenizer(work / Path(decided["gguf"][0]).name, work, note)
    meta = {"repo": repo, "quant": label, "revision": snapshot.name, "policy": None, "published": True,
            "format": "gguf", "vision_tower": False, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    note("checking the files (sha256)")
    manifest = write_manifest(work, {"store": meta})
    os.rename(work, out)
    return Entry(repo, label, out, manifest)


def _check_own_tokenizer(gguf_path: Path, beside: Path, note) -> None:
    """Where a GGUF carries its own tokenizer (checkpoint/gguf_tokenizer.py) and the base model's tokenizer.json is
    beside it: whether the two give the same ids for a text corpus, said in one line (the one beside is what runs)."""
    from ..checkpoint.gguf_file import read_gguf
    from ..checkpoint.gguf_tokenizer import CORPUS, agrees, tokenizer_from_metadata
    from ..tokenizer import Tokenizer

    if not (beside / "tokenizer.json").is_file():
        return
    own = tokenizer_from_metadata(read_gguf(gguf_path)[0].metadata, gguf_path.name)
    if own is None:
        return
    differs = agrees(own, Tokenizer.from_dir(beside))
    note(f"the file's own tokenizer agrees with {DEFAULT_REPO}'s tokenizer.json on {len(CORPUS)} texts"
         if differs is None else f"the file's own tokenizer differs from {DEFAULT_REPO}'s tokenizer.json ({differs});"
         " the tokenizer.json beside it is used")


def _store_adapter(repo: str, quant: str, snapshot: Path, note) -> Entry:
    """A PEFT LoRA adapter pulled from the Hub: checked as dgemma reads adapters, linked into the store as
    OWNER--NAME--lora with a manifest naming the model it adapts."""
    from quant.convert import partial_dir, write_manifest

    from ..tuner.lora import AdapterError, read_adapter

    if quant not in ("auto", "lora"):
        raise UsageError(f"{repo} is a LoRA adapter: it is stored as published (no --quant)")
    try:
        ad = read_adapter(snapshot)
    except AdapterError as e:
        raise ModelError(f"{repo}: {e}") from None
    out = entry_dir(repo, "lora")
    work = partial_dir(out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        _link_or_copy(snapshot / name, work / name)
    meta = {"repo": repo, "quant": "lora", "revision": snapshot.name, "adapter_of": ad.base or None,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    note("checking the files (sha256)")
    manifest = write_manifest(work, {"store": meta})
    os.rename(work, out)
    note(f"a LoRA adapter of {ad.base or 'an unnamed base'}: run it with --adapter {repo}")
    return Entry(repo, "lora", out, manifest)


def quantize_device() -> str:
    """Where a pull quantizes: the GPU when there is one (the arithmetic is a few seconds per layer there, minutes
    on a CPU), else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
