"""NVIDIA ModelOpt NVFP4, as nvidia/diffusiongemma-26B-A4B-it-NVFP4 and dgemma's converter write it.

Description: config.json's `quantization_config` {quant_method: modelopt, quant_algo: NVFP4, group_size: 16}, or
(older exports) only `hf_quant_config.json` {quantization: {quant_algo: NVFP4, ...}}.
Tensors per quantized linear (quant/nvfp4.py): `weight` uint8 [N, K/2], `weight_scale` e4m3 [N, K/16],
`weight_scale_2` float32 [] and `input_scale` float32 [] (the calibrated activation scale: read where present, used by
W4A4). Routed experts per
expert, `experts.E.{gate,up,down}_proj.*`, each projection with its own `weight_scale_2`: stacked on load into
[E, 2I, ...] buffers that keep two global scales per expert (gate, up); dgemma's converter may also write fused
stacks. Which modules are quantized: exactly those whose `weight_scale` is stored (the exclude list is globs over
names that differ between exports, so it is not used to decide).

ModelOpt 0.45+ writes the description in compressed-tensors' shape as well: `config_groups` (weights and input
activations FP4, group 16, static), an `ignore` list of globs, `kv_cache_scheme` and `producer`; an
hf_quant_config.json beside it says the same as {quant_algo, kv_cache_quant_algo, group_size, exclude_modules}. A
group of any other scheme (another bit width, group size or type, or several different groups) is refused in one line.

Writing (`dgemma quantize --quant nvfp4`): `quantization_config` and `hf_quant_config` below give exactly the fields
nvidia-modelopt 0.47's HF export writes for its DiffusionGemma recipe `nvfp4_experts_only`
(tests/fixtures/modelopt_nvfp4, scripts/make_modelopt_fixture.py), with the published release's generic ignore globs
instead of one glob per layer. Like that recipe, the description asks for an FP8 KV cache cast without scales
(`kv_cache_scheme` 8-bit float, no k_scale / v_scale tensors): what a serving engine does with the published
checkpoint it does with dgemma's. `input_scale` = amax / (6 * 448), amax the largest |input| the calibration saw at
that projection; ModelOpt shares one input quantizer per projection type among a layer's experts, so the amax is the
layer's (every expert's gate and up carry the same value, every down another).
"""

from __future__ import annotations

from pathlib import Path

from .. import modules as qmodules
from . import Format, FormatError, read_json

DESCRIPTION = "ModelOpt NVFP4"
GROUP_SIZE = 16


class ModelOptNVFP4(Format):
    label = "nvfp4"
    scheme = ("ModelOpt NVFP4: 4-bit e2m1 weights in groups of 16 with e4m3 scales and a global scale; FP4 activations "
              "(W4A4) where the GPU has FP4 tensor cores")
    expert_layouts = ("per_expert", "fused")
    per_projection_parts = ("weight_scale_2", "input_scale")
    input_scales = True

    def make_linear(self, in_features: int, out_features: int, device=None):
        return qmodules.NVFP4Linear(in_features, out_features, device=device)

    def make_experts(self, num: int, hidden: int, intermediate: int, layout: str, device=None):
        segments = 2 if layout == "per_expert" else 1  # per expert: gate and up keep their own global scale
        return (qmodules.NVFP4Stack(num, 2 * intermediate, hidden, segments, device=device),
                qmodules.NVFP4Stack(num, hidden, intermediate, 1, device=device))


def claim(config: dict, directory: Path) -> Format | None:
    qc = config.get("quantization_config")
    if qc is None:
        hf_quant = directory / "hf_quant_config.json"
        raw = read_json(hf_quant)
        if raw is None:
            return None
        try:
            qc = dict(raw["quantization"], quant_method="modelopt")
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"{hf_quant}: not a valid ModelOpt quantization file") from None
    if str(qc.get("quant_method", "")).lower() != "modelopt":
        return None
    algo = str(qc.get("quant_algo", "")).upper()
    try:
        group = int(qc.get("group_size", GROUP_SIZE))
    except (TypeError, ValueError):
        group = None
    if algo != "NVFP4" or group != GROUP_SIZE:
        raise FormatError(f"config.json: ModelOpt quantization {algo or '?'} is not supported (dgemma reads NVFP4 with "
                          "group size 16)")
    _check_groups(qc.get("config_groups"))
    return ModelOptNVFP4()


# What each of ModelOpt's NVFP4 config groups holds (weights; input activations, or none for weight-only).
FP4_ARGS = {"num_bits": 4, "type": "float", "group_size": GROUP_SIZE}


def _check_groups(groups) -> None:
    """Every config group must be the NVFP4 scheme: refuse anything else (or a mix) by name, in one line."""
    if groups is None:
        return
    if not isinstance(groups, dict) or not groups:
        raise FormatError("config.json: ModelOpt config_groups is not a non-empty object")
    for name, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise FormatError(f"config.json: ModelOpt config group {name!r} has no weights description")
        for part in ("weights", "input_activations"):
            args = group.get(part)
            if args is None and part == "input_activations":
                continue
            if not isinstance(args, dict):
                raise FormatError(f"config.json: ModelOpt config group {name!r}: {part} is not an object")
            for key, want in FP4_ARGS.items():
                got = args.get(key)
                if str(got).lower() != str(want).lower():
                    raise FormatError(f"config.json: ModelOpt config group {name!r} has {part} {key}={got!r}; dgemma "
                                      f"reads NVFP4 (4-bit float, group {GROUP_SIZE}) in every group")


# ------------------------------------------------------------------- writing (`dgemma quantize --quant nvfp4`)

E4M3_MAX, E2M1_MAX = 448.0, 6.0
# The published release's exclude globs (fnmatch over module names), and what the experts-only policy adds. The
# vision tower and its projection are carried over unquantized, so they are excluded, as in the release.
IGNORE = ["lm_head", "*router*", "*self_conditioning*", "*vision_tower*", "*embed_vision*"]
IGNORE_DENSE = ["*mlp*", "*self_attn*"]
KV_CACHE_SCHEME = {"dynamic": False, "num_bits": 8, "type": "float"}  # the recipe's FP8 KV cache cast (no scales)


def quantization_config(quantize_dense: bool, producer: dict) -> dict:
    """config.json's `quantization_config` as ModelOpt's HF export writes it for NVFP4 (keys in its order)."""
    args = dict(dynamic=False, num_bits=4, type="float", group_size=GROUP_SIZE)
    return {"config_groups": {"group_0": {"input_activations": dict(args), "weights": dict(args),
                                          "targets": ["Linear"]}},
            "ignore": sorted(IGNORE + ([] if quantize_dense else IGNORE_DENSE)), "quant_algo": "NVFP4",
            "kv_cache_scheme": dict(KV_CACHE_SCHEME), "producer": dict(producer), "quant_method": "modelopt"}


def excludes_dense(config: dict, directory: Path) -> bool:
    """From its descriptions alone (before any weights are fetched): whether a ModelOpt checkpoint leaves attention
    and the dense MLP unquantized (the experts-only recipe, NVIDIA's release), by the ignore globs of config.json's
    quantization_config, else of hf_quant_config.json's exclude_modules (per layer or generic)."""
    from fnmatch import fnmatch

    ignore = (config.get("quantization_config") or {}).get("ignore")
    if ignore is None:
        raw = read_json(Path(directory) / "hf_quant_config.json") or {}
        ignore = (raw.get("quantization") or {}).get("exclude_modules") if isinstance(raw, dict) else None
    ignore = [g for g in ignore or [] if isinstance(g, str)]
    names = [f"{root}layers.0.{m}" for root in ("model.decoder.", "model.language_model.", "model.")
             for m in ("self_attn.q_proj", "mlp.gate_proj")]
    return any(fnmatch(n, g) for n in names for g in ignore)


def hf_quant_config(qc: dict) -> dict:
    """hf_quant_config.json for a `quantization_config` made above (ModelOpt writes both)."""
    return {"producer": qc["producer"],
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": GROUP_SIZE,
                             "exclude_modules": qc["ignore"]}}


def input_scale(amax):
    """The static activation scale of a projection whose inputs reached `amax` (float32 []): amax / (6 * 448), so the
    largest input's block scale is e4m3's largest value (ModelOpt's NVFP4QTensor.get_activation_scaling_factor)."""
    return (amax.float() / (E2M1_MAX * E4M3_MAX)).reshape(())
