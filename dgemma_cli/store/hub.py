"""The download side of `dgemma pull`: fetch a DiffusionGemma checkpoint from the Hugging Face Hub.

Only what the model needs is fetched: the small files (config, generation config, tokenizer files, chat
template, quantization config; each only if the repo has it), then either the safetensors shards that hold at
least one text-stack or vision-tower tensor (per `model.safetensors.index.json`; the vision tower, about 1.15 GB
in bf16 for the 26B-A4B, is fetched so that images work; a shard holding anything else, an audio tower say, is
skipped) or the single `model.safetensors`.

Everything goes through huggingface_hub into its own cache, so HF_HOME / HF_HUB_CACHE, HF_TOKEN, HF_ENDPOINT,
HF_HUB_OFFLINE and its progress bars apply, and the files are shared with every other tool using that cache.
The revision is resolved to one commit first and every file is fetched at that commit, so a branch that moves
during a pull cannot mix two versions; files already cached at that commit are not requested again. When the
Hub cannot be reached (or HF_HUB_OFFLINE=1), the revision and the files are taken from the cache alone.

Files are fetched one after the other in the calling thread, so Ctrl-C stops a pull at once (KeyboardInterrupt
propagates unchanged). huggingface_hub resumes a dropped connection within one call (HTTP Range requests); a
partial file left by an interrupted process is not reused, that file is fetched again from its start.

Every failure becomes a one-line DgemmaError that says what to do.
"""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path, PurePosixPath
from typing import Callable

import httpx2
from huggingface_hub import HfApi, constants, hf_hub_download, is_offline_mode
from huggingface_hub.errors import (
    DisabledRepoError,
    FileMetadataError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    RevisionResolutionError,
)
from huggingface_hub.utils import tqdm as hf_tqdm

from ..errors import DgemmaError
from ..checkpoint.names import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, INDEX_FILE, SINGLE_FILE, TEXT_PREFIXES, model_shards,
                    text_shards)

CONFIG_FILE = "config.json"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)  # a PEFT LoRA adapter repository's
SMALL_FILES = (
    CONFIG_FILE,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "hf_quant_config.json",
    "preprocessor_config.json",  # the image processor's settings: dgemma has its own, other runtimes read these
    "processor_config.json",
)


class _NoBars(hf_tqdm):
    """huggingface_hub's progress bar, always disabled (for progress=False)."""

    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def download(repo_id: str, revision: str | None = None, *, progress: bool = True,
             on_config: Callable[[Path], None] | None = None,
             on_gguf: Callable[[dict], str] | None = None) -> Path:
    """Fetch the model (text stack and vision tower) from the Hub into huggingface_hub's own cache; return the
    snapshot dir. A LoRA adapter's repository (adapter_config.json, no config.json) gives its two files only.

    on_config(snapshot dir) runs once the small files (config.json first) are there and before any weights are
    fetched: a caller can refuse the model there without downloading gigabytes. on_gguf(choices) picks one of a
    GGUF repository's quantizations ({label: [(file, bytes), ...]}, `gguf_choices`) before any is fetched; then
    that file (every part of a split one) and the small files the repository has are fetched. Without it a
    GGUF-only repository is refused in one line.
    """
    try:
        return _download(repo_id, revision, None if progress else _NoBars, on_config, on_gguf)
    except DgemmaError:
        raise
    except Exception as e:  # KeyboardInterrupt is not an Exception: it propagates unchanged
        raise DgemmaError(_one_line(_explain(e, repo_id, revision))) from e


def fetch_files(repo_id: str, names, revision: str | None = None, *, progress: bool = True) -> dict[str, Path]:
    """The small files of `names` that `repo_id` has (from the cache when offline), by name; no weights."""
    out = {}
    for name in names:
        try:
            out[name] = Path(hf_hub_download(repo_id, name, revision=revision, local_files_only=is_offline_mode(),
                                             tqdm_class=None if progress else _NoBars))
        except (LocalEntryNotFoundError, RemoteEntryNotFoundError):
            continue
        except Exception as e:  # KeyboardInterrupt is not an Exception: it propagates unchanged
            raise DgemmaError(_one_line(_explain(e, repo_id, revision))) from e
    return out


def resolve_commit(repo_id: str, revision: str | None) -> str:
    """The commit that `revision` (branch, tag or commit; None: the default branch) of `repo_id` names now, asked
    of the Hub, or read from the cache when offline or when the Hub cannot be reached. No file is fetched."""
    try:
        return HfApi().resolve_revision(repo_id, revision=revision, local_files_only=is_offline_mode()).resolved
    except DgemmaError:
        raise
    except Exception as e:  # KeyboardInterrupt is not an Exception: it propagates unchanged
        raise DgemmaError(_one_line(_explain(e, repo_id, revision))) from e


def _download(repo_id: str, revision: str | None, bars, on_config=None, on_gguf=None) -> Path:
    api = HfApi()
    offline = is_offline_mode()
    # One commit for every file; falls back to the cached ref when the Hub cannot be reached.
    rev = api.resolve_revision(repo_id, revision=revision, local_files_only=offline)
    listing: set[str] | None = None  # the repo's files; None: use the cache alone
    sizes: dict[str, int] = {}  # their bytes (asked for where a GGUF repository may be met)
    unreachable: Exception | None = None
    if not offline:
        try:
            info = api.model_info(repo_id, revision=rev.resolved, files_metadata=on_gguf is not None)
            listing = {s.rfilename for s in info.siblings or ()}
            sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or ()}
        except (httpx2.TransportError, OfflineModeIsEnabled) as e:
            unreachable = e
        except HfHubHTTPError as e:
            if e.response.status_code < 500:
                raise
            unreachable = e

    gguf = gguf_choices(sizes) if listing is not None and not (SINGLE_FILE in listing or INDEX_FILE in listing) \
        else {}
    if gguf and on_gguf is None:
        _refuse_gguf(repo_id, listing)
    snapshot: Path | None = None

    def fetch(name: str, required: bool = True, shown: str | None = None) -> Path | None:
        nonlocal snapshot
        try:
            path = Path(hf_hub_download(repo_id, name, revision=rev, local_files_only=listing is None,
                                        tqdm_class=bars))
        except LocalEntryNotFoundError:
            if listing is not None:
                raise
            if not required:
                return None
            what = f"{shown or name} of {repo_id}" if snapshot else _repo_at(repo_id, revision)
            raise DgemmaError(_one_line(_not_cached(what, unreachable))) from None
        snapshot = path.parents[len(PurePosixPath(name).parts) - 1]
        return path

    def has(name: str) -> bool:
        return listing is None or name in listing

    if gguf:  # llama.cpp's format: the chosen quantization's file (or parts), as published
        label = on_gguf(gguf)
        for name in SMALL_FILES:
            if has(name):
                fetch(name, required=False)
        for name, _ in gguf[label]:
            fetch(name)
        assert snapshot is not None
        return snapshot

    # A LoRA adapter's repository (PEFT's files, no model config): its two files, as published.
    if listing is not None and ADAPTER_FILES[0] in listing and CONFIG_FILE not in listing or \
            listing is None and fetch(ADAPTER_FILES[0], required=False) is not None \
            and fetch(CONFIG_FILE, required=False) is None:
        for name in ADAPTER_FILES:
            fetch(name)
        assert snapshot is not None
        return snapshot
    for name in SMALL_FILES:
        if has(name):
            fetch(name, required=name == CONFIG_FILE)
    if on_config is not None:
        on_config(snapshot)
    index = fetch(INDEX_FILE, required=False) if has(INDEX_FILE) else None
    if index is not None:
        shards = _model_shards(index, repo_id)
        if listing is not None and (absent := [s for s in shards if s not in listing]):
            raise DgemmaError(f"{repo_id}: {INDEX_FILE} lists {absent[0]}, which is not in the repo")
    elif has(SINGLE_FILE):
        shards = [SINGLE_FILE]
    else:
        raise DgemmaError(f"{_repo_at(repo_id, revision)} has no safetensors weights "
                          f"(neither {SINGLE_FILE} nor {INDEX_FILE})")
    for shard in shards:
        fetch(shard, shown=shard if index is not None else f"{SINGLE_FILE} (or {INDEX_FILE})")
    assert snapshot is not None
    return snapshot


# What dgemma reads instead of GGUF, with a published repository of each (one line, for a GGUF-only repository).
READS = ("safetensors checkpoints: bf16 (google/diffusiongemma-26B-A4B-it), ModelOpt NVFP4 "
         "(nvidia/diffusiongemma-26B-A4B-it-NVFP4) and compressed-tensors FP8/INT8 W8A8 "
         "(RedHatAI/diffusiongemma-26B-A4B-it-FP8-dynamic)")


def _refuse_gguf(repo_id: str, listing: set[str]) -> None:
    """A repository of GGUF files only, where the caller takes none, is refused before anything is fetched."""
    gguf = sorted(n for n in listing if n.lower().endswith(".gguf"))
    raise DgemmaError(f"{repo_id} holds GGUF files ({len(gguf)}, e.g. {gguf[0]}), llama.cpp's format: `dgemma pull "
                      f"{repo_id} --quant LABEL` takes one (dgemma also reads {READS})")


_GGUF_LABEL = re.compile(r"[-_.](?P<label>(?:UD-)?(?:[IT]?Q\d(?:_[A-Z0-9]+)+|BF16|F16|F32))"  # q4_k_m, ud-q4_k_xl
                         r"(?:-\d{5}-of-\d{5})?\.gguf$", re.IGNORECASE)  # a split file's part


def gguf_choices(sizes: dict[str, int]) -> dict[str, list[tuple[str, int]]]:
    """A repository's GGUF files by quantization label (lower case, from the file name: `...-Q4_K_M.gguf` ->
    q4_k_m, a split file's parts together, in order): {label: [(file, bytes), ...]}. Vision projector files
    (`mmproj*`) are not models and are left out."""
    out: dict[str, list[tuple[str, int]]] = {}
    for name, size in sorted(sizes.items()):
        base = PurePosixPath(name).name
        m = _GGUF_LABEL.search(base)
        if m is None or base.lower().startswith("mmproj"):
            continue
        out.setdefault(m["label"].lower(), []).append((name, size))
    return out


def _model_shards(index: Path, repo_id: str) -> list[str]:
    """The shards of an index that hold at least one text-stack or vision-tower tensor, in index order."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = model_shards(weight_map)
        text = text_shards(weight_map)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise DgemmaError(f"{repo_id}: {INDEX_FILE} is not a valid safetensors index") from None
    if not text:
        raise DgemmaError(f"{repo_id}: {INDEX_FILE} lists no text-model tensors (names starting with "
                          f"{' or '.join(TEXT_PREFIXES)}); is this a DiffusionGemma checkpoint?")
    return shards


def _repo_at(repo_id: str, revision: str | None) -> str:
    return f"{repo_id} (revision {revision})" if revision else repo_id


def _not_cached(what: str, unreachable: Exception | None) -> str:
    if unreachable is None:
        return (f"offline (HF_HUB_OFFLINE=1) and {what} is not in the Hugging Face cache; "
                "unset HF_HUB_OFFLINE to download it")
    return (f"cannot reach the Hub ({constants.ENDPOINT}): {_reason(unreachable)}, and {what} is not in the "
            "Hugging Face cache; check the connection and run the command again")


def _explain(e: BaseException, repo_id: str, revision: str | None) -> str:
    """One sentence for a failure raised by huggingface_hub (or the disk) while pulling `repo_id`."""
    endpoint = constants.ENDPOINT
    cache = constants.HF_HUB_CACHE
    # "Not in the cache, and the Hub could not be asked": the reason is the cause.
    if isinstance(e, (RevisionResolutionError, LocalEntryNotFoundError)):
        if e.__cause__ is not None:
            return _explain(e.__cause__, repo_id, revision)
        if is_offline_mode():
            return _not_cached(_repo_at(repo_id, revision), None)
        return f"{_repo_at(repo_id, revision)} is not in the Hugging Face cache ({cache}): {_reason(e)}"
    if isinstance(e, OfflineModeIsEnabled):
        return _not_cached(_repo_at(repo_id, revision), None)
    if isinstance(e, GatedRepoError):
        if _sent_token(e):
            return (f"{repo_id} is gated and HF_TOKEN has no access to it: accept its license at "
                    f"{endpoint}/{repo_id} with the account the token belongs to")
        return (f"{repo_id} is gated: accept its license at {endpoint}/{repo_id} and set HF_TOKEN "
                "(or run `hf auth login`)")
    if isinstance(e, RepositoryNotFoundError):
        if _sent_token(e):
            return f"{repo_id}: no such model on the Hub, or HF_TOKEN has no access to it"
        return f"{repo_id}: no such model on the Hub (if it is private, set HF_TOKEN)"
    if isinstance(e, RevisionNotFoundError):
        return f"{repo_id} has no revision {revision!r} on the Hub (check the branch, tag or commit)"
    if isinstance(e, DisabledRepoError):
        return f"{repo_id} has been disabled on the Hub"
    if isinstance(e, RemoteEntryNotFoundError):
        gone = e.response.url.path.rsplit("/", 1)[-1]
        return f"{repo_id} changed on the Hub during the download ({gone} is gone); run the command again"
    if isinstance(e, FileMetadataError):
        return (f"{endpoint} does not answer like the Hugging Face Hub: check HF_ENDPOINT and any proxy "
                f"settings ({_reason(e)})")
    if isinstance(e, httpx2.TransportError):
        return (f"cannot reach the Hub ({endpoint}): {_reason(e)}; check the connection, "
                "or set HF_HUB_OFFLINE=1 to use the cache")
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code
        if status == 401:
            return "the Hub rejected HF_TOKEN (invalid or expired): set a valid token or run `hf auth login`"
        if status == 429:
            return "the Hub is rate-limiting this machine (HTTP 429); wait a few minutes and run the command again"
        if status >= 500:
            return (f"the Hub ({endpoint}) answered HTTP {status}; try again later, "
                    "or set HF_HUB_OFFLINE=1 to use the cache")
        detail = f": {e.server_message}" if e.server_message else ""
        return f"the Hub answered HTTP {status} for {repo_id}{detail}"
    if isinstance(e, HFValidationError):
        return f"{repo_id!r} is not a valid Hub model id (expected OWNER/NAME)"
    if isinstance(e, OSError):
        where = e.filename or cache
        if e.errno == errno.ENOSPC:
            return (f"disk full while downloading {repo_id} into {where}; free some space there, "
                    "or set HF_HOME to a folder on a larger disk")
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return (f"cannot write the Hugging Face cache at {where} ({e.strerror}); fix its permissions, "
                    "or set HF_HOME to a writable folder")
        return f"downloading {repo_id} failed: {_reason(e)}; run the command again"
    return f"downloading {repo_id} failed: {type(e).__name__}: {_reason(e)}"


def _sent_token(e: HfHubHTTPError) -> bool:
    try:
        return bool(e.response.request.headers.get("authorization"))
    except (AttributeError, RuntimeError):  # no request recorded
        return False


def _reason(e: BaseException) -> str:
    """The first line of an exception's text (or its class name when it has none)."""
    for line in str(e).splitlines():
        if line.strip():
            return line.strip().rstrip(".")
    return type(e).__name__


def _one_line(message: str) -> str:
    return " ".join(message.splitlines())
