"""`dgemma quantize`: turn an unquantized checkpoint into NVFP4 (ModelOpt layout) or dgemma INT8, streaming.

This module knows which tensors exist and what each becomes (the policy); `quant.convert` does the streaming,
resumable, verified writing, and `quant.nvfp4` / `quant.int8` the numbers.

Policies (written into the checkpoint's quantization_config, never inferred later from names):
- `experts` (default, as NVIDIA's export): only the routed experts;
- `all`: the routed experts, attention (q, k, v, o) and the dense MLP.
The router, embeddings (tied with the LM head), norms, layer scalars and self-conditioning always stay as they are.

Output layout: one shard per layer plus one for the rest, the source's tensor names (text stack only; the vision
tower is not carried over). NVFP4 experts are written per expert as ModelOpt does
(`...experts.E.{gate,up,down}_proj.{weight,weight_scale,weight_scale_2}`, gate and up sharing weight_scale_2);
INT8 experts stay fused (`...experts.gate_up_proj.weight` int8 [E, 2I, H], `.weight_scale` float32 [E, 2I]).
No `input_scale` is written: dgemma computes with 16-bit activations and calibrates nothing.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from quant import int8, nvfp4
from quant.convert import ConvertError, Group, OutTensor, Shard, write_checkpoint

from . import __version__
from .config import ModelConfig
from .device import resolve_device
from .errors import ModelError, UsageError
from .weights import (
    DGEMMA_INT8_VERSION, TensorRecord, checked_record, checkpoint_files, checkpoint_name, expected_tensors,
    expert_base, index_checkpoint, read_converted, read_quant_format, text_prefix,
)

POLICIES = ("experts", "all")
FORMATS = ("nvfp4", "int8")
# Per format: whether scales are searched (measured in BENCHMARKS.md: it lowers NVFP4's error, not INT8's).
DEFAULT_SEARCH = {"nvfp4": True, "int8": False}
SMALL_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
               "special_tokens_map.json")
COPY_CHUNK = 64 << 20  # bytes per piece when a tensor is copied unchanged
DENSE_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


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


def _nvfp4_outputs(name: str, n: int, k: int) -> list[OutTensor]:
    return [OutTensor(f"{name}.weight", torch.uint8, (n, k // 2)),
            OutTensor(f"{name}.weight_scale", torch.float8_e4m3fn, (n, k // nvfp4.BLOCK)),
            OutTensor(f"{name}.weight_scale_2", torch.float32, ())]


def _nvfp4_pieces(q: nvfp4.NVFP4Weight) -> list[torch.Tensor]:
    return [q.weight, q.weight_scale, q.weight_scale_2.reshape(())]


def linear_group(fmt: str, base: str, rec: TensorRecord, search: bool, device) -> Group:
    """One dense projection W [N, K] quantized whole (the largest is a few tens of MB)."""
    n, k = rec.shape
    if fmt == "nvfp4":
        outputs = _nvfp4_outputs(base, n, k)
        produce = lambda: _nvfp4_pieces(nvfp4.quantize(read_converted(rec, torch.float32, device), search=search))
    else:
        outputs = [OutTensor(f"{base}.weight", torch.int8, (n, k)),
                   OutTensor(f"{base}.weight_scale", torch.float32, (n,))]

        def produce():
            q = int8.quantize(read_converted(rec, torch.float32, device), search=search)
            return [q.weight, q.weight_scale]
    return Group(outputs, produce)


def expert_groups(fmt: str, base: str, gate_up: TensorRecord, down: TensorRecord, search: bool, device) -> list[Group]:
    """The routed experts of one layer, read and quantized one expert at a time."""
    E, two_i, H = gate_up.shape
    I = two_i // 2
    if fmt == "nvfp4":
        outputs = []
        for e in range(E):
            outputs += _nvfp4_outputs(f"{base}.{e}.gate_proj", I, H)
            outputs += _nvfp4_outputs(f"{base}.{e}.up_proj", I, H)
            outputs += _nvfp4_outputs(f"{base}.{e}.down_proj", H, I)

        def produce():
            for e in range(E):
                gu = read_rows(gate_up, e, e + 1, device)[0]  # [2I, H]
                shared = nvfp4.global_scale(gu)  # gate and up share one global scale, as ModelOpt exports
                yield from _nvfp4_pieces(nvfp4.quantize(gu[:I], shared, search))
                yield from _nvfp4_pieces(nvfp4.quantize(gu[I:], shared, search))
                yield from _nvfp4_pieces(nvfp4.quantize(read_rows(down, e, e + 1, device)[0], search=search))

        return [Group(outputs, produce)]

    def stacked(rec: TensorRecord, name: str) -> Group:
        E_, N, K = rec.shape
        outputs = [OutTensor(f"{name}.weight", torch.int8, (E_, N, K)),
                   OutTensor(f"{name}.weight_scale", torch.float32, (E_, N))]

        def produce():
            scales = []
            for e in range(E_):
                q = int8.quantize(read_rows(rec, e, e + 1, device)[0], search=search)
                scales.append(q.weight_scale.cpu())
                yield q.weight
            yield torch.stack(scales)

        return Group(outputs, produce)

    return [stacked(gate_up, f"{base}.gate_up_proj"), stacked(down, f"{base}.down_proj")]


def quantization_config(fmt: str, policy: str, prefix: str, search: bool) -> dict:
    """What goes into config.json (and, for NVFP4, hf_quant_config.json): the format and what it covers."""
    keep = [f"{prefix}layers.*.router.*", f"{prefix}embed_tokens", "model.decoder.self_conditioning.*", "lm_head"]
    if policy == "experts":
        keep += [f"{prefix}layers.*.self_attn.*", f"{prefix}layers.*.mlp.*"]
    extra = {"policy": policy, "scales": "search" if search else "absmax"}
    if fmt == "nvfp4":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                "exclude_modules": keep, "producer": {"name": "dgemma", "version": __version__}, "dgemma": extra}
    return {"quant_method": "dgemma", "format": "int8", "format_version": DGEMMA_INT8_VERSION,
            "weights": "int8 symmetric, one float32 scale per output channel: value = weight * weight_scale[..., None]",
            "quantized": [f"{prefix}layers.*.experts"] + ([f"{prefix}layers.*.{m}" for m in DENSE_LINEARS]
                                                          if policy == "all" else []),
            "not_quantized": keep, "producer": {"name": "dgemma", "version": __version__}, "dgemma": extra}


def plan(src: Path, fmt: str, policy: str, search: bool, device) -> tuple[list[Shard], dict[str, bytes], dict]:
    """Check the source completely and describe the output: (shards, small files, job description)."""
    from .model import DiffusionGemma, Experts

    if fmt not in FORMATS:
        raise UsageError(f"--quant must be one of {', '.join(FORMATS)} (got {fmt!r})")
    if policy not in POLICIES:
        raise UsageError(f"--policy must be one of {', '.join(POLICIES)} (got {policy!r})")
    src = Path(src)
    if not src.is_dir():
        raise ModelError(f"{src}: no such model directory")
    cfg = ModelConfig.from_dir(src)
    raw_config = cfg.raw
    if read_quant_format(src, raw_config) is not None:
        raise UsageError(f"{src}: already quantized; quantize from the unquantized (bf16) checkpoint")
    records = index_checkpoint(src)
    prefix = text_prefix(records)
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

    if fmt == "nvfp4":  # every quantized input dimension must split into 16-wide blocks
        t = cfg.text
        dims = [t.hidden_size, t.moe_intermediate_size] + ([t.intermediate_size] + [
            t.num_attention_heads * s.head_dim for s in t.layers] if policy == "all" else [])
        bad = [d for d in dims if d % nvfp4.BLOCK]
        if bad:
            raise UsageError(f"NVFP4 needs input dimensions that are multiples of 16; this model has {bad[0]}")

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
        if isinstance(mod, Experts):
            layer = int(path.split(".")[1])
            _, gu = source(f"{path}.gate_up_proj")
            _, dn = source(f"{path}.down_proj")
            by_shard.setdefault(shard_of(path), []).extend(
                expert_groups(fmt, expert_base(layer, prefix), gu, dn, search, device))
            written.update({f"{path}.gate_up_proj", f"{path}.down_proj"})
        elif path in quantized_linears and getattr(mod, "weight", None) is not None:
            ck, rec = source(f"{path}.weight")
            group = linear_group(fmt, ck[: -len(".weight")], rec, search, device)
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

    keys = sorted(k for k in by_shard if k != "rest") + ["rest"]
    n = len(keys)
    shards = [Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", by_shard[k]) for i, k in enumerate(keys)]

    qc = quantization_config(fmt, policy, prefix, search)
    config = dict(raw_config, quantization_config=qc)
    files = {"config.json": json.dumps(config, indent=2).encode()}
    if fmt == "nvfp4":
        hf = {"producer": qc["producer"], "quantization": {k: qc[k] for k in
                                                           ("quant_algo", "group_size", "kv_cache_quant_algo",
                                                            "exclude_modules")}}
        files["hf_quant_config.json"] = json.dumps(hf, indent=2).encode()
    for name in SMALL_FILES:
        if (src / name).is_file():
            files[name] = (src / name).read_bytes()
    fingerprint = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in checkpoint_files(src)]
    job = {"source": str(src.resolve()), "source_files": fingerprint, "format": fmt, "policy": policy,
           "search": search, "writer": __version__, "device": str(torch.device(device).type)}
    return shards, files, job


def quantize_checkpoint(src: Path, out: Path, fmt: str, policy: str = "experts", search: bool | None = None,
                        device: str = "cpu", store_meta: dict | None = None, progress: bool = False,
                        note: Callable[[str], None] = lambda s: None) -> dict:
    """Quantize `src` into the new directory `out` (resumable; see quant.convert). Returns the manifest.

    device: where the quantization arithmetic runs ('auto': CUDA when present); progress: a bar on stderr.
    """
    out = Path(out)
    if out.exists():
        raise UsageError(f"{out} already exists; remove it or choose another --out")
    device = str(resolve_device(device))
    search = DEFAULT_SEARCH.get(fmt, False) if search is None else search
    shards, files, job = plan(src, fmt, policy, search, device)
    from tqdm import tqdm

    total = sum(s.nbytes for s in shards)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"quantizing to {fmt}", disable=not progress,
              file=sys.stderr, dynamic_ncols=True) as bar:
        try:
            return write_checkpoint(out, shards, files, job, bar.update, note,
                                    manifest_extra={"store": store_meta} if store_meta else None)
        except ConvertError as e:
            raise ModelError(str(e)) from None

