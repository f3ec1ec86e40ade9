"""The commands about models on disk: pull, list (ls), info, show, rm, quantize."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from ..errors import ModelError, UsageError
from .options import QUIET_OPTION, be_quiet, gb, model_arg, note


def pull(
    repo: str = typer.Argument("google/diffusiongemma-26B-A4B-it", help="Hub repository id (OWNER/NAME)."),
    quant: str = typer.Option("auto", "--quant", help="auto (from free GPU memory), bf16, fp8, int8 or nvfp4; for a "
                              "GGUF repository, a file's quantization (q4_k_m, q8_0, ...), taken as published."),
    revision: Optional[str] = typer.Option(None, "--revision",
                                           help="Branch, tag or commit (default: main). An entry already stored "
                                                "from another commit is not replaced: it says how."),
    policy: Optional[str] = typer.Option(None, "--policy",
                                         help="What fp8/int8/nvfp4 quantize: experts or all (+ attention, dense MLP); "
                                              "default as published: all for fp8/int8, experts for nvfp4."),
    quiet: bool = QUIET_OPTION,
) -> None:
    """Download a model from the Hub into the store: a published quantized release as published, an unquantized one
    quantized to --quant (on the GPU when there is one). HF_TOKEN, HF_HOME and HF_HUB_OFFLINE apply."""
    be_quiet(quiet)
    from ..errors import Interrupted
    from ..store.models import pull as do_pull

    try:
        entry = do_pull(repo, quant, revision, policy, progress=sys.stderr.isatty() and not quiet, note=note)
    except KeyboardInterrupt:
        raise Interrupted("interrupted; run the same command again to continue (finished files are kept)") from None
    if entry is not None:
        note(f"stored {entry.name} ({gb(entry.size)}) in {entry.path}")
        sys.stdout.write(f"{entry.name}\n")


def list_models(as_json: bool = typer.Option(False, "--json", help="JSON Lines instead of a table."),
                quiet: bool = QUIET_OPTION) -> None:
    """The models in the store, and the small demo models bundled with dgemma."""
    be_quiet(quiet)
    from ..checkpoint.names import BUNDLED, BUNDLED_ABOUT, BUNDLED_ADAPTERS, BUNDLED_ADAPTERS_ABOUT
    from ..store.models import entries, store_root

    found = entries()
    bundled = [(name, path, sum(f.stat().st_size for f in path.iterdir() if f.is_file()))
               for name, path in BUNDLED.items()]
    adapters = [(name, path, sum(f.stat().st_size for f in path.iterdir() if f.is_file()))
                for name, path in BUNDLED_ADAPTERS.items() if path.is_dir()]
    if as_json:
        for name, path, size in bundled:
            sys.stdout.write(json.dumps({"name": name, "format": "unquantized", "size": size, "path": str(path),
                                         "bundled": True, "about": BUNDLED_ABOUT[name]}) + "\n")
        for name, path, size in adapters:
            base, about = BUNDLED_ADAPTERS_ABOUT[name]
            sys.stdout.write(json.dumps({"name": name, "format": "lora", "size": size, "path": str(path),
                                         "bundled": True, "adapter_of": base, "about": about}) + "\n")
        for e in found:
            row = {"name": e.name, "format": e.quant, "size": e.size, "path": str(e.path),
                   "revision": e.manifest["store"].get("revision")}
            if e.quant == "lora":
                row["adapter_of"] = e.manifest["store"].get("adapter_of")
            sys.stdout.write(json.dumps(row) + "\n")
        return
    width = max(len(n) for n in [*BUNDLED, *BUNDLED_ADAPTERS, *(e.name for e in found)])
    sys.stdout.write(f"{'NAME':<{width}}  {'SIZE':>9}  WHERE\n")
    for e in found:
        of = e.manifest["store"].get("adapter_of") if e.quant == "lora" else None
        sys.stdout.write(f"{e.name:<{width}}  {gb(e.size):>9}  {e.path}"
                         + (f" (LoRA adapter of {of})" if of else " (LoRA adapter)" if e.quant == "lora" else "")
                         + "\n")
    for name, _, size in bundled:
        sys.stdout.write(f"{name:<{width}}  {gb(size):>9}  bundled: {BUNDLED_ABOUT[name]}\n")
    for name, _, size in adapters:
        base, about = BUNDLED_ADAPTERS_ABOUT[name]
        sys.stdout.write(f"{name:<{width}}  {gb(size):>9}  bundled LoRA adapter of {base}: {about}\n")
    if not found and not quiet:
        note(f"the store is empty ({store_root()}); `dgemma pull` fetches a model")




def info(
    model: str = typer.Argument(..., help="A store name, a model directory, or 'demo'."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object."),
    quiet: bool = QUIET_OPTION,
) -> None:
    """Format, sizes, estimated GPU memory and location of a model; or what a LoRA adapter adapts."""
    be_quiet(quiet)
    from ..checkpoint.names import resolve_model
    from ..store.models import describe

    if _is_adapter(model):
        return _adapter_info(model, as_json)
    path = resolve_model(model_arg(model))
    from ..checkpoint.stored import is_gguf

    if is_gguf(path):
        from ..store.models import describe_gguf

        d = describe_gguf(path)
    else:
        d = describe(path)
    placement = _local_placement(path, d)
    if as_json:
        sys.stdout.write(json.dumps({**d, "placement": placement}) + "\n")
        return
    _info_rows(d)
    if placement is not None:
        _write_rows([("on this machine's card", placement["summary"])])


def _local_placement(path, described: dict) -> dict | None:
    """The model as stored (`described`: describe's format and policy), planned onto this machine's first NVIDIA
    card at an 8k context (None: no card found). No torch."""
    from ..placement.cards import local_cards
    from ..placement.plan import plan, planned_context

    cards = local_cards()
    if not cards:
        return None
    from ..checkpoint.stored import model_config

    cfg = model_config(path)
    fmt = described["format"] if described["format"] in ("nvfp4", "int8", "fp8") else "bf16"
    p = plan(cfg, fmt, cards[:1], context=planned_context(cfg),
             policy=described["policy"] if fmt != "bf16" else None)
    c = p.cards[0]
    held = p.summary() or "everything on the card"
    summary = p.refusal if not p.fits else f"{c.card.name} ({gb(c.card.memory)}): {held}"
    return {**p.as_dict(), "summary": summary}


def _is_adapter(ref: str) -> bool:
    """Whether `info`/`show` REF names a LoRA adapter (bundled, a directory holding one, or a store entry)."""
    from pathlib import Path

    from ..checkpoint.names import ADAPTER_CONFIG, BUNDLED_ADAPTERS, STORE_NAME, find

    return ref in BUNDLED_ADAPTERS or (Path(ref).expanduser() / ADAPTER_CONFIG).is_file() or bool(
        STORE_NAME.match(ref) and any(e.quant == "lora" for e in find(ref)))


def _adapter_info(ref: str, as_json: bool) -> None:
    """`dgemma info` of a LoRA adapter: its base, rank, targets, tensors and size (read from its files only)."""
    from ..checkpoint.names import BUNDLED_ADAPTERS_ABOUT, resolve_adapter
    from ..tuner.lora import read_adapter

    path, _ = resolve_adapter(ref)
    ad = read_adapter(path)
    ranks = sorted({a.shape[0] for a, _, _ in ad.linears.values()})
    modules = sorted({name.split(".", 2)[-1] if name.startswith("layers.") else name for _, name in ad.linears})
    base = BUNDLED_ADAPTERS_ABOUT[ref][0] if ref in BUNDLED_ADAPTERS_ABOUT else ad.base or "(not recorded)"
    d = {"path": str(path), "format": "lora (PEFT)", "base": base, "ranks": ranks, "modules": modules,
         "experts": bool(ad.experts), "token_rows": sorted({i for ids, _ in ad.tokens.values() for i in ids}),
         "alpha": ad.config.get("lora_alpha"), "size_on_disk": sum(f.stat().st_size for f in path.iterdir()
                                                                    if f.is_file())}
    if as_json:
        sys.stdout.write(json.dumps(d) + "\n")
        return
    rows = [("path", d["path"]), ("format", d["format"]), ("adapts", d["base"]),
            ("rank", ", ".join(map(str, ranks)) or "-"), ("alpha", d["alpha"]),
            ("modules", ", ".join(modules) or "-"), ("routed experts", "yes" if d["experts"] else "no"),
            ("size on disk", gb(d["size_on_disk"]))]
    if d["token_rows"]:
        rows.append(("token rows", ", ".join(map(str, d["token_rows"]))))
    _write_rows(rows)


def _write_rows(rows: list[tuple[str, object]]) -> None:
    """`dgemma info`'s "name:   value" lines."""
    for k, v in rows:
        sys.stdout.write(f"{k + ':':<24}{v}\n")


def _info_rows(d: dict) -> None:
    src = d["source"]
    fmt = d["format"] + (f" ({', '.join(d['quantized'])} quantized)" if d["quantized"] else
                         f" ({d['dtype_on_disk']} on disk)")
    rows = [("path", d["path"]), ("format", fmt)] + ([("scheme", d["scheme"])] if d["scheme"] else []) + [
            ("size on disk", gb(d["size_on_disk"])), ("weights in memory", gb(d["weights_in_memory"])),
            ("GPU memory", f"{gb(d['gpu_memory_estimate'])} at a {d['gpu_memory_context']:,}-token context (estimate)"),
            ("shape", f"{d['layers']} layers, {d['experts']} experts, vocabulary {d['vocab']}"),
            ("images", f"yes (vision tower, {gb(d['vision_tower_on_disk'])} on disk)" if d["images"]
             else f"no ({d['no_images_because'].removeprefix(d['path'] + ': ')})")]
    if src:
        rows.append(("source", f"{src.get('repo')} @ {str(src.get('revision'))[:12]}"
                               + (" (as published)" if src.get("published") else "")))
    _write_rows(rows)


def show(
    model: str = typer.Argument(..., help="A store name, a model directory, or a bundled model ('demo', ...)."),
    template: bool = typer.Option(False, "--template", help="Only the chat template, as the model ships it."),
    parameters: bool = typer.Option(False, "--parameters", help="Only the sampler's defaults, one per line."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object: info, parameters, template."),
    quiet: bool = QUIET_OPTION,
) -> None:
    """What a model is: its format and sizes (as `info`), the sampler's defaults it brings and its chat template.
    For a LoRA adapter: what it adapts (as `info`)."""
    be_quiet(quiet)
    if _is_adapter(model):
        if template or parameters:
            raise UsageError(f"{model} is a LoRA adapter: it has no chat template or sampler settings of its own "
                             "(those of the model it adapts apply)")
        return _adapter_info(model, as_json)
    from ..checkpoint.names import resolve_model
    from ..config import SAMPLER_FLAGS, GenerationSettings
    from ..store.models import describe
    from ..tokenizer import Tokenizer

    if template and parameters:
        raise UsageError("--template and --parameters exclude each other (neither: both, and the rest)")
    from ..checkpoint.stored import model_config

    path = resolve_model(model_arg(model))
    cfg = model_config(path)
    from ..checkpoint.stored import is_gguf

    gguf = is_gguf(path)
    beside = path.parent if gguf else path  # a GGUF's tokenizer and generation config lie beside it
    settings = GenerationSettings.from_checkpoint(beside, cfg.text)
    if gguf:  # its own sampler hints, as run reads them
        import dataclasses

        from ..checkpoint.gguf_file import read_gguf, sampler_defaults

        settings = dataclasses.replace(settings, **sampler_defaults(read_gguf(path)[0]))
    params = {flag: getattr(settings, name) for flag, (name, _, _) in SAMPLER_FLAGS.items()}
    params.update({"canvas-length": cfg.canvas_length, "context": cfg.text.max_position_embeddings,
                   "eos-token-ids": list(settings.eos_token_ids)})
    tok = Tokenizer.from_dir(beside) if (beside / "tokenizer.json").is_file() else None
    chat_template = tok.chat_template if tok is not None else None
    if template:
        if chat_template is None:
            raise ModelError(f"{path}: no tokenizer.json, so no chat template")
        sys.stdout.write(chat_template if chat_template.endswith("\n") else chat_template + "\n")
        return
    if parameters:
        for k, v in params.items():
            sys.stdout.write(f"{k:<24}{' '.join(map(str, v)) if isinstance(v, list) else v}\n")
        return
    if gguf:
        from ..store.models import describe_gguf

        d = describe_gguf(path)
    else:
        d = describe(path)
    if as_json:
        sys.stdout.write(json.dumps({**d, "parameters": params, "template": chat_template,
                                     "template_from": tok.template_origin if tok else None}) + "\n")
        return
    _info_rows(d)
    sys.stdout.write("\nparameters (the model's defaults; the flags of the same names change them):\n")
    for k, v in params.items():
        sys.stdout.write(f"  {k:<22}{' '.join(map(str, v)) if isinstance(v, list) else v}\n")
    where = tok.template_origin if tok else "no tokenizer.json"
    sys.stdout.write(f"\ntemplate ({where}; `dgemma show {model} --template` prints it whole):\n")
    for line in (chat_template or "").splitlines()[:8]:
        sys.stdout.write(f"  {line}\n")


def rm(
    model: str = typer.Argument(..., help="A store name [OWNER/]NAME[:QUANT]."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    quiet: bool = QUIET_OPTION,
) -> None:
    """Remove a model from the store (never touches directories outside it)."""
    be_quiet(quiet)
    from ..store.models import find, remove, store_root

    found = find(model)
    from ..checkpoint.names import BUNDLED

    if model in BUNDLED:  # as everywhere a model is named, 'demo' is the bundled one, never a store entry
        same = f"; to remove the store's {', '.join(e.name for e in found)}, give its full name" if found else ""
        raise UsageError(f"{model} is a bundled demo model, part of dgemma itself: it cannot be removed{same}")
    if not found:
        raise ModelError(f"{model}: not in the store ({store_root()}); `dgemma list` shows what is there")
    if len(found) > 1:
        raise UsageError(f"{model} matches {', '.join(e.name for e in found)}; add :QUANT to choose")
    entry = found[0]
    if not yes:
        if not sys.stdin.isatty():
            raise UsageError(f"removing {entry.name} needs --yes when stdin is not a terminal")
        sys.stderr.write(f"remove {entry.name} ({gb(entry.size)}, {entry.path})? [y/N] ")
        sys.stderr.flush()
        if sys.stdin.readline().strip().lower() not in ("y", "yes"):
            note("nothing removed")
            return
    remove(entry)
    note(f"removed {entry.name}")


def quantize(
    src: str = typer.Argument(..., help="An unquantized checkpoint: a directory or a store name."),
    quant: str = typer.Option(..., "--quant", help="nvfp4 (ModelOpt), fp8 or int8 (compressed-tensors W8A8)."),
    out: str = typer.Option(..., "--out", help="The new directory to write (must not exist)."),
    policy: Optional[str] = typer.Option(None, "--policy",
                                         help="experts or all (+ attention, dense MLP); default as published: all "
                                              "for fp8/int8, experts for nvfp4."),
    scales: str = typer.Option("auto", "--scales", help="auto, absmax or search (block scales chosen by error)."),
    device: str = typer.Option("auto", "--device", help="Where to compute: cpu, cuda or auto."),
    quiet: bool = QUIET_OPTION,
) -> None:
    """Quantize a local checkpoint, streaming and resumable: run it again after an interruption to continue."""
    be_quiet(quiet)
    from pathlib import Path

    from ..errors import Interrupted

    if scales not in ("auto", "absmax", "search"):
        raise UsageError(f"--scales must be auto, absmax or search (got {scales!r})")
    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device must be cpu, cuda or auto (got {device!r})")
    from ..checkpoint.names import POLICIES, QUANTS, resolve_model

    if quant not in QUANTS or quant == "bf16":
        raise UsageError(f"--quant must be one of {', '.join(q for q in QUANTS if q != 'bf16')} (got {quant!r})")
    if policy is not None and policy not in POLICIES:
        raise UsageError(f"--policy must be one of {', '.join(POLICIES)} (got {policy!r})")
    source = resolve_model(model_arg(src))  # checked before torch is imported
    from ..store.quantize import quantize_checkpoint

    search = None if scales == "auto" else scales == "search"
    try:
        manifest = quantize_checkpoint(source, Path(out), quant, policy, search, device,
                                       progress=sys.stderr.isatty() and not quiet, note=note)
    except KeyboardInterrupt:
        raise Interrupted("interrupted; run the same command again to continue where it stopped") from None
    from ..store.models import size_on_disk

    note(f"wrote {out} ({quant}, policy {manifest['quantize']['policy']}, {gb(size_on_disk(Path(out)))})")  # as info
