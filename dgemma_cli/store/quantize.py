"""`dgemma quantize`: turn an unquantized checkpoint into a published format, streaming: ModelOpt NVFP4 or
compressed-tensors W8A8 (FP8 or INT8), the layouts serving engines (vLLM, TensorRT-LLM, SGLang) read.

This module knows which tensors exist and what each becomes (the policy); `quant.convert` does the streaming,
resumable, verified writing; the format modules under `quant/formats/` know each layout (how a weight is quantized,
what the description says) and `quant.nvfp4` the NVFP4 numbers.

Policies (written into the checkpoint's own description, its ignore list, never inferred later from names):
- `experts` (NVFP4's default, as NVIDIA's export): only the routed experts;
- `all` (FP8's and INT8's default, as the published W8A8 releases): the routed experts, attention (q, k, v, o) and
  the dense MLP.
The router, embeddings (tied with the LM head), norms, layer scalars and self-conditioning always stay as they are.

Output layout: one shard per layer plus one for the rest, the source's tensor names, routed experts split per
expert as the releases store them; then, when the source has one, one shard holding the vision tower (`vision_sources`:
every `...vision_tower.*` / `...embed_vision.*` tensor, its name, dtype and bytes as in the source, never quantized,
and named in both formats' ignore lists as the releases do):
- nvfp4 (ModelOpt): `...experts.E.{gate,up,down}_proj.{weight [N, K/2] uint8, weight_scale [N, K/16] e4m3,
  weight_scale_2 [] float32, input_scale [] float32}`, gate and up sharing weight_scale_2; `input_scale` comes from a
  calibration pass (`calibrate`) over CALIBRATION_PROMPTS through the float model; config.json's quantization_config
  and hf_quant_config.json in ModelOpt's form (quant/formats/modelopt.py).
- fp8 / int8 (compressed-tensors): `...experts.E.{gate,up,down}_proj.{weight [N, K] e4m3 or int8, weight_scale
  [N, 1] bfloat16}` and the same per quantized linear; activations are quantized per token at run time, so nothing
  is calibrated (quant/formats/compressed_tensors.py).
dgemma's own INT8 layout of earlier versions (quant/formats/dgemma_int8.py) is still read, no longer written.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from quant import nvfp4
from quant.convert import ConvertError, Group, OutTensor, Shard, write_checkpoint
from quant.formats import compressed_tensors as ct_format
from quant.formats import modelopt as modelopt_format

from .. import __version__
from ..config import ModelConfig
from ..device import resolve_device
from ..errors import ModelError, UsageError
from ..checkpoint.names import POLICIES
# per format, as its published releases: NVFP4 experts, FP8 and INT8 all
from ..checkpoint.footprint import DEFAULT_POLICY
from ..checkpoint.weights import (
    TensorRecord, checked_record, checkpoint_files, checkpoint_name, expected_tensors, expert_base, index_checkpoint,
    read_converted, read_header, read_quant_format, text_prefix,
)

FORMATS = ("nvfp4", "fp8", "int8")
# Per format: whether scales are searched (measured in BENCHMARKS.md: it lowers NVFP4's error, not INT8's).
DEFAULT_SEARCH = {"nvfp4": True, "fp8": False, "int8": False}
# carried over unchanged: the tokenizer and chat format, the image processor's settings (other runtimes read them),
# and how dgemma's live view draws the canvas
SMALL_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
               "special_tokens_map.json", "preprocessor_config.json", "processor_config.json", "dgemma_view.json")
COPY_CHUNK = 64 << 20  # bytes per piece when a tensor is copied unchanged
DENSE_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
W8_DTYPE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
# NVFP4's static activation scales are set from what these reach in the float model: a few short conversations of
# different kinds (code, prose, numbers, other languages), encoded as chat prompts, and one denoising step each.
CALIBRATION_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Explain in two paragraphs why the sky is blue.",
    "What is 17 * 23 + 4096 / 8? Show the steps.",
    "Traduis en français : the weather is nice today and we are going to the sea.",
    "List five uses of a binary search tree and their time complexity.",
    "Summarize the plot of a detective story set in a lighthouse, in 3 sentences.",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 3; -- explain this query",
    "Give me a JSON object describing a cat with name, age and favourite toys.",
)
CALIBRATION_SEED = 0


def rows(rec: TensorRecord, lo: int, hi: int) -> TensorRecord:
    """The record of rows lo..hi of a tensor's leading dimension (a contiguous byte range)."""
    row = (rec.end - rec.start) // rec.shape[0]
    return TensorRecord(rec.file, rec.start + lo * row, rec.start + hi * row, rec.dtype, (hi - lo, *rec.shape[1:]))


def read_rows(rec: TensorRecord, lo: int, hi: int, device) -> torch.Tensor:
    return read_converted(rows(rec, lo, hi), torch.float32, device)


def copy_group(name: str, rec: TensorRecord) -> Group:
    """A tensor carried over unchanged, read in pieces of at most COPY_CHUNK bytes."""
    def produce() -> Iterator[torch.Tensor]:
        if not rec.shape:
            yield read_converted(rec, rec.dtype, "cpu")
            return
        row = max(1, (rec.end - rec.start) // max(1, rec.shape[0]))
        step = max(1, COPY_CHUNK // row)
        for lo in range(0, rec.shape[0], step):
            yield read_converted(rows(rec, lo, min(rec.shape[0], lo + step)), rec.dtype, "cpu")

    return Group([OutTensor(name, rec.dtype, rec.shape)], produce)


def outputs_of(fmt: str, name: str, n: int, k: int) -> list[OutTensor]:
    """The tensors one quantized [N, K] projection `name` (a module name, no `.weight`) becomes."""
    if fmt == "nvfp4":
        return [OutTensor(f"{name}.weight", torch.uint8, (n, k // 2)),
                OutTensor(f"{name}.weight_scale", torch.float8_e4m3fn, (n, k // nvfp4.BLOCK)),
                OutTensor(f"{name}.weight_scale_2", torch.float32, ()),
                OutTensor(f"{name}.input_scale", torch.float32, ())]
    return [OutTensor(f"{name}.weight", W8_DTYPE[fmt], (n, k)),
            OutTensor(f"{name}.weight_scale", torch.bfloat16, (n, 1))]


def pieces_of(fmt: str, w: torch.Tensor, search: bool, scale_2: torch.Tensor | None = None,
              amax: torch.Tensor | None = None) -> list[torch.Tensor]:
    """One projection W [N, K] (float32) quantized, in `outputs_of`'s order. NVFP4: `scale_2` the global scale it
    shares (gate with up), `amax` the calibrated input amax its input_scale comes from."""
    if fmt == "nvfp4":
        q = nvfp4.quantize(w, scale_2, search)
        return [q.weight, q.weight_scale, q.weight_scale_2.reshape(()), modelopt_format.input_scale(amax).cpu()]
    return list(ct_format.quantize(w, fmt, search))


def linear_group(fmt: str, base: str, rec: TensorRecord, search: bool, device,
                 amax: torch.Tensor | None = None) -> Group:
    """One dense projection W [N, K] quantized whole (the largest is a few tens of MB)."""
    n, k = rec.shape
    return Group(outputs_of(fmt, base, n, k),
                 lambda: pieces_of(fmt, read_converted(rec, torch.float32, device), search, amax=amax))


def expert_groups(fmt: str, base: str, gate_up: TensorRecord, down: TensorRecord, search: bool, device,
                  amax: dict | None = None) -> list[Group]:
    """The routed experts of one layer, read and quantized one expert at a time, written per expert
    (`base.E.{gate,up,down}_proj.*`). NVFP4: `amax` {"gate_up": [], "down": []}, the layer's calibrated inputs."""
    E, two_i, H = gate_up.shape
    I = two_i // 2
    outputs = []
    for e in range(E):
        outputs += outputs_of(fmt, f"{base}.{e}.gate_proj", I, H)
        outputs += outputs_of(fmt, f"{base}.{e}.up_proj", I, H)
        outputs += outputs_of(fmt, f"{base}.{e}.down_proj", H, I)
    a_in, a_down = (amax["gate_up"], amax["down"]) if amax else (None, None)

    def produce():
        for e in range(E):
            gu = read_rows(gate_up, e, e + 1, device)[0]  # [2I, H]
            # gate and up share one global scale, as ModelOpt exports (vLLM fuses them with one scale)
            shared = nvfp4.global_scale(gu) if fmt == "nvfp4" else None
            yield from pieces_of(fmt, gu[:I], search, shared, a_in)
            yield from pieces_of(fmt, gu[I:], search, shared, a_in)
            yield from pieces_of(fmt, read_rows(down, e, e + 1, device)[0], search, amax=a_down)

    return [Group(outputs, produce)]


def quantization_config(fmt: str, policy: str) -> dict:
    """config.json's `quantization_config`: the format's own description of what it covers."""
    if fmt == "nvfp4":
        return modelopt_format.quantization_config(policy == "all", {"name": "dgemma", "version": __version__})
    return ct_format.quantization_config(fmt, policy == "all")


# ----------------------------------------------------------------------------- calibration (NVFP4's input scales)


def calibration_ids(src: Path, vocab: int) -> tuple[list[list[int]], str]:
    """(token ids per prompt, what they are): CALIBRATION_PROMPTS in the checkpoint's chat format, or seeded random
    ids when the checkpoint has no tokenizer."""
    from ..tokenizer import Tokenizer

    try:
        tok = Tokenizer.from_dir(src)
        ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in CALIBRATION_PROMPTS]
        if all(0 <= i < vocab for p in ids for i in p):
            return ids, f"{len(ids)} built-in chat prompts"
    except Exception:  # no tokenizer (or one that does not fit the vocabulary): the fallback below
        pass
    g = torch.Generator().manual_seed(CALIBRATION_SEED)
    return [torch.randint(0, vocab, (48,), generator=g).tolist() for _ in CALIBRATION_PROMPTS], "random token ids"


def calibrate(src: Path, quantize_dense: bool, note: Callable[[str], None] = lambda s: None) -> tuple[dict, str]:
    """Run the float model over the calibration prompts (encode, then one denoising step on a seeded random canvas)
    and record the largest |input| of every projection NVFP4 quantizes. Returns ({model path: float32 []}, what was
    run), paths `layers.L.experts.gate_up` (every expert's gate and up input: the layer's expert input),
    `layers.L.experts.down` (every expert's gelu(gate) * up) and, with `quantize_dense`, `layers.L.self_attn.q_proj`,
    ... The model is memory-mapped on the CPU in the checkpoint's dtype (no copy of the weights)."""
    from ..model import Experts, gelu_tanh
    from ..checkpoint.weights import load_model

    model, cfg = load_model(src, device="cpu")
    ids, what = calibration_ids(src, cfg.text.vocab_size)
    note(f"calibrating NVFP4 input scales on {what}")
    amax: dict[str, torch.Tensor] = {}

    def record(key: str, value: torch.Tensor) -> None:
        m = value.detach().abs().max().float() if value.numel() else torch.zeros(())
        amax[key] = torch.maximum(amax[key], m) if key in amax else m

    def expert_hook(path: str):
        def hook(mod, args):
            x, top_k_index, _ = args  # x [T, H], top_k_index [T, K]
            record(f"{path}.gate_up", x)
            gate_up, down = mod.weights(torch.float32)
            for e in top_k_index.unique().tolist():
                rows_e = (top_k_index == e).any(-1)
                gate, up = torch.nn.functional.linear(x[rows_e].float(), gate_up[e].float()).chunk(2, dim=-1)
                record(f"{path}.down", gelu_tanh(gate) * up)  # [n, I]: what the down projection reads
        return hook

    handles = []
    for path, mod in model.named_modules():
        if isinstance(mod, Experts):
            handles.append(mod.register_forward_pre_hook(expert_hook(path)))
        elif quantize_dense and path.split(".", 2)[-1] in DENSE_LINEARS:
            handles.append(mod.register_forward_pre_hook(lambda m, args, p=path: record(p, args[0])))
    try:
        T = max(map(len, ids))
        batch = torch.tensor([[0] * (T - len(p)) + p for p in ids])  # left-padded
        valid = torch.tensor([[False] * (T - len(p)) + [True] * len(p) for p in ids])
        C = cfg.canvas_length
        with torch.no_grad():
            cache = model.new_cache(len(ids), T + C)
            model.encode(batch, cache, valid)
            g = torch.Generator().manual_seed(CALIBRATION_SEED)
            canvas = torch.randint(0, cfg.text.vocab_size, (len(ids), C), generator=g)
            model.denoise(canvas, cache, model.denoise_context(cache, len(ids)))
    finally:
        for h in handles:
            h.remove()
    # An input no calibration token reached (or that was all zeros) takes the largest of its kind, so every scale is
    # positive (ModelOpt's export refuses a zero scale).
    kind = lambda key: key.split(".", 2)[2]  # layers.L.experts.down -> experts.down
    top = {}
    for k, v in amax.items():
        top[kind(k)] = torch.maximum(top.get(kind(k), v), v)
    for k, v in amax.items():
        if v <= 0:
            amax[k] = top[kind(k)]
    return amax, what


def vision_sources(src: Path, records: dict[str, TensorRecord],
                   note: Callable[[str], None] = lambda s: None) -> dict[str, TensorRecord]:
    """The source's vision-tower tensors {checkpoint name: record}, in the source's order, to carry over unchanged.
    `records`: the text model's (index_checkpoint); a single-file source has the tower among them, a sharded one
    in the shards its index names for it. Empty when the source has no tower, or when its shards are not here (a
    download of the text shards only): the output then reads text only, and says so when given an image."""
    from ..checkpoint.names import INDEX_FILE, VISION_TENSOR_PREFIXES, vision_names

    index = src / INDEX_FILE
    if not index.is_file():
        return {n: r for n, r in records.items() if n.startswith(VISION_TENSOR_PREFIXES)}
    try:
        names = vision_names(json.loads(index.read_text())["weight_map"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ModelError(f"{index}: not a valid safetensors index") from None
    files = list(dict.fromkeys(names.values()))
    if missing := [f for f in files if not (src / f).is_file()]:
        note(f"{src}: {missing[0]} (the vision tower) is not here; the output will read text only")
        return {}
    headers = {f: read_header(src / f) for f in files}
    out = {}
    for name, f in names.items():
        if name not in headers[f]:
            raise ModelError(f"{src / f}: {INDEX_FILE} lists {name} in this shard, which does not hold it")
        out[name] = headers[f][name]
    return out


def plan(src: Path, fmt: str, policy: str, search: bool, device,
         note: Callable[[str], None] = lambda s: None) -> tuple[list[Shard], dict[str, bytes], dict, dict]:
    """Check the source completely and describe the output: (shards, small files, job description, facts for the
    manifest)."""
    from ..model import DiffusionGemma, Experts

    if fmt not in FORMATS:
        raise UsageError(f"--quant must be one of {', '.join(FORMATS)} (got {fmt!r})")
    if policy not in POLICIES:
        raise UsageError(f"--policy must be one of {', '.join(POLICIES)} (got {policy!r})")
    src = Path(src)
    if not src.is_dir():
        raise ModelError(f"{src}: no such model directory")
    cfg = ModelConfig.from_dir(src)
    raw_config = cfg.raw
    records = index_checkpoint(src)
    prefix = text_prefix(records)
    # NVIDIA's NVFP4 release (experts only) to NVFP4 `all`: its experts carried over as published, its 16-bit
    # attention and dense MLP quantized here (a 16 GB card then holds the model without streaming, from a 16 GB
    # download rather than the 52 GB bf16 one)
    published = read_quant_format(src, raw_config)
    from_release = release_to_all(published, records, prefix, fmt, policy)
    if published is not None and not from_release:
        raise UsageError(f"{src}: already quantized; quantize from the unquantized (bf16) checkpoint (an NVFP4 "
                         "release of the experts alone also converts to --quant nvfp4 --policy all)")
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    expected = expected_tensors(model)

    def source(name: str) -> tuple[str, TensorRecord]:
        ck = checkpoint_name(name, prefix)
        rec = records.get(ck)
        if rec is None and name.startswith("encoder_layer_scalar."):
            ck = checkpoint_name("decoder_" + name[len("encoder_"):], prefix)
            rec = records.get(ck)
        return ck, checked_record(records, ck, expected[name], None, rec)

    def released_expert(name: str) -> bool:  # the release's experts: carried over, not read as 16-bit tensors
        return from_release and ".experts." in name and name.startswith("layers.")

    if fmt == "nvfp4":  # every quantized input dimension must split into 16-wide blocks
        t = cfg.text
        dims = [t.hidden_size, t.moe_intermediate_size] + ([t.intermediate_size] + [
            t.num_attention_heads * s.head_dim for s in t.layers] if policy == "all" else [])
        bad = [d for d in dims if d % nvfp4.BLOCK]
        if bad:
            raise UsageError(f"NVFP4 needs input dimensions that are multiples of 16; this model has {bad[0]}")
    for name in expected:  # every tensor present and of the right shape before any work (calibration included)
        if not released_expert(name):
            source(name)
    released = {}  # per layer, the release's expert tensors (the per-expert NVFP4 names), carried over
    if from_release:
        for layer in range(cfg.text.num_hidden_layers):
            base = expert_base(layer, prefix) + "."
            released[layer] = {n: r for n, r in records.items() if n.startswith(base)}
            want = 3 * 4 * cfg.text.num_experts  # gate, up, down: weight, weight_scale, weight_scale_2, input_scale
            if len(released[layer]) != want:
                raise ModelError(f"{src}: layer {layer}'s experts hold {len(released[layer])} NVFP4 tensors, not "
                                 f"{want} (weight, weight_scale, weight_scale_2 and input_scale of each projection)")
    vision = vision_sources(src, records, note)
    facts: dict = {}
    amax: dict = {}
    if fmt == "nvfp4":
        amax, facts["calibration"] = calibrate(src, policy == "all", note)

    quantized_linears = {f"layers.{i}.{m}" for i in range(cfg.text.num_hidden_layers) for m in DENSE_LINEARS} \
        if policy == "all" else set()
    by_shard: dict[str, list[Group]] = {}
    written = set()

    def shard_of(name: str) -> str:
        parts = name.split(".")
        if parts[0] == "layers":
            return f"layer{int(parts[1]):04d}"
        if parts[0].endswith("layer_scalar"):
            return f"layer{int(parts[1]):04d}"
        return "rest"

    for path, mod in model.named_modules():
        if isinstance(mod, Experts) and from_release:
            layer = int(path.split(".")[1])
            by_shard.setdefault(shard_of(path), []).extend(copy_group(n, r) for n, r in released[layer].items())
            written.update({f"{path}.gate_up_proj", f"{path}.down_proj"})
        elif isinstance(mod, Experts):
            layer = int(path.split(".")[1])
            _, gu = source(f"{path}.gate_up_proj")
            _, dn = source(f"{path}.down_proj")
            layer_amax = {"gate_up": amax[f"{path}.gate_up"], "down": amax[f"{path}.down"]} if amax else None
            by_shard.setdefault(shard_of(path), []).extend(
                expert_groups(fmt, expert_base(layer, prefix), gu, dn, search, device, layer_amax))
            written.update({f"{path}.gate_up_proj", f"{path}.down_proj"})
        elif path in quantized_linears and getattr(mod, "weight", None) is not None:
            ck, rec = source(f"{path}.weight")
            group = linear_group(fmt, ck[: -len(".weight")], rec, search, device, amax.get(path))
            by_shard.setdefault(shard_of(path), []).append(group)
            written.add(f"{path}.weight")
    seen = set()
    for name in expected:
        if name in written:
            continue
        ck, rec = source(name)
        if ck not in seen:
            seen.add(ck)
            by_shard.setdefault(shard_of(name), []).append(copy_group(ck, rec))

    if vision:  # carried over as stored: [shape] in the source's dtype (bf16 in the releases), in a shard of its own
        by_shard["vision"] = [copy_group(name, rec) for name, rec in vision.items()]
    keys = sorted(k for k in by_shard if k not in ("rest", "vision")) + ["rest"] + (["vision"] if vision else [])
    n = len(keys)
    shards = [Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", by_shard[k]) for i, k in enumerate(keys)]

    qc = quantization_config(fmt, policy)
    config = dict(raw_config, quantization_config=qc)
    files = {"config.json": json.dumps(config, indent=2).encode()}
    if fmt == "nvfp4":
        files["hf_quant_config.json"] = json.dumps(modelopt_format.hf_quant_config(qc), indent=4).encode()
    for name in SMALL_FILES:
        if (src / name).is_file():
            files[name] = (src / name).read_bytes()
    read = dict.fromkeys([*checkpoint_files(src), *(rec.file for rec in vision.values())])  # every file read
    fingerprint = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in read]
    job = {"source": str(src.resolve()), "source_files": fingerprint, "format": fmt, "policy": policy,
           "search": search, "writer": __version__, "device": str(torch.device(device).type)}
    if amax:  # the scales are part of what is written: a different calibration is a different job
        job["input_amax"] = {k: float(v) for k, v in sorted(amax.items())}
    facts.update(policy=policy, scales="search" if search else "absmax", vision_tensors=len(vision))
    if from_release:
        facts["experts"] = "carried over from the NVFP4 release as published"
    return shards, files, job, facts


def release_to_all(published: str | None, records: dict, prefix: str, fmt: str, policy: str) -> bool:
    """Whether a source published in `published` (read_quant_format's), indexed as `records` under `prefix`, is an
    NVFP4 release of the routed experts alone (NVIDIA's) asked for as NVFP4 `all`: the one quantized source `plan`
    takes (its experts kept, the rest quantized)."""
    from ..checkpoint.layout import policy_of

    return (fmt, policy) == ("nvfp4", "all") and published == "nvfp4" and policy_of(records, prefix) == "experts"


def quantize_checkpoint(src: Path, out: Path, fmt: str, policy: str | None = None, search: bool | None = None,
                        device: str = "cpu", store_meta: dict | None = None, progress: bool = False,
                        note: Callable[[str], None] = lambda s: None) -> dict:
    """Quantize `src` into the new directory `out` (resumable; see quant.convert). Returns the manifest.

    policy: None for the format's default (DEFAULT_POLICY); device: where the quantization arithmetic runs ('auto':
    CUDA when present; NVFP4's calibration pass always runs on the CPU from the memory-mapped checkpoint);
    progress: a bar on stderr.
    """
    out = Path(out)
    if out.exists():
        raise UsageError(f"{out} already exists; remove it or choose another --out")
    device = str(resolve_device(device))
    search = DEFAULT_SEARCH.get(fmt, False) if search is None else search
    policy = DEFAULT_POLICY.get(fmt, "experts") if policy is None else policy
    shards, files, job, facts = plan(src, fmt, policy, search, device, note)
    from tqdm import tqdm

    extra = {"quantize": facts}
    if store_meta:
        extra["store"] = store_meta
    total = sum(s.nbytes for s in shards)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"quantizing to {fmt}", disable=not progress,
              file=sys.stderr, dynamic_ncols=True) as bar:
        try:
            return write_checkpoint(out, shards, files, job, bar.update, note, manifest_extra=extra)
        except ConvertError as e:
            raise ModelError(str(e)) from None
