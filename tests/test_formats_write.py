"""The published formats, both directions: files written by the real producers read by dgemma, and files written by
dgemma read (or matched field by field) by the producers' own code.

- ModelOpt NVFP4: tests/fixtures/modelopt_nvfp4 is a tiny DiffusionGemma quantized by nvidia-modelopt itself with its
  DiffusionGemma recipe `nvfp4_experts_only` and exported by its HF export, on a CPU (scripts/make_modelopt_fixture.py,
  versions in PRODUCER.json). dgemma must give the same tokens as the engine fed the format's exact float32
  dequantization (e2m1 x fp32(weight_scale) x weight_scale_2), and ModelOpt's own dequantizer (stored beside the
  fixture) must agree with that within its rounding. dgemma's own NVFP4 output of a source of the same shapes must
  carry every tensor and config field ModelOpt's export has.
- compressed-tensors W8A8: dgemma's FP8 and INT8 files are validated and decompressed by compressed-tensors (in this
  environment) to exactly dgemma's dequantized weights (at the scale's dtype, bfloat16, as dgemma computes on a GPU).
- dgemma INT8 v1 (earlier versions' own layout) keeps loading.
- `dgemma pull` of each published repository from a local fake Hub: stored as published, runs, `info` shows format and
  scheme; bad or mixed descriptions, and GGUF-only repositories, refused in one line.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from fake_hub import fake_hub, serve_directory  # noqa: F401  (the fixture)
from safetensors.torch import load_file, save_file

from checkpoints import checkpoint_tensors, first_step_logits, write_float_copy
from cli_helpers import run_main
from dgemma_cli.store import models as store
from dgemma_cli.engine import Engine, load
from dgemma_cli.store.quantize import quantize_checkpoint
from dgemma_cli.checkpoint.weights import load_model
from quant import int8 as qint8

FIXTURES = Path(__file__).parent / "fixtures"
MODELOPT = FIXTURES / "modelopt_nvfp4"
PROMPTS = [[2, 200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211], [2, 300, 301, 302]]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def one_error_line(capsys) -> str:
    cap = capsys.readouterr()
    errors = [line for line in cap.err.strip().splitlines() if line.startswith("dgemma: error: ")]
    assert len(errors) == 1 and cap.err.strip().splitlines()[-1] == errors[0] and "Traceback" not in cap.err, cap.err
    return errors[0]


def float_model(path: Path):
    """load_model in float32 with every tensor in its own allocation (see test_compressed_tensors.float_model)."""
    model, _ = load_model(path, dtype=torch.float32)
    for p in model.parameters():
        p.data = p.data.clone()
    return model


def generate(engine: Engine):
    C = engine.config.canvas_length
    return engine.generate(PROMPTS, raw=True, max_new_tokens=3 * C, max_denoising_steps=6, seed=5).token_ids


# ----------------------------------------------------------------------------- ModelOpt NVFP4, written by ModelOpt


def nvfp4_exact(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """The format's value, restated here: e2m1 code (element 2i in the low nibble) x fp32(block scale), then x the
    global scale, in float32. [N, K/2] uint8 -> [N, K]."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()  # [N, K]
    values = torch.tensor(E2M1)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    N, K = values.shape
    blocks = values.reshape(N, K // 16, 16) * scale.float()[..., None]
    return (blocks * scale_2.float()).reshape(N, K)


@pytest.fixture(scope="module")
def modelopt_float(tmp_path_factory):
    tensors = checkpoint_tensors(MODELOPT)
    deq = {n[: -len("_scale")]: nvfp4_exact(tensors[n[: -len("_scale")]], t, tensors[n + "_2"])
           for n, t in tensors.items() if n.endswith(".weight_scale")}
    out = tmp_path_factory.mktemp("modelopt") / "float"
    write_float_copy(MODELOPT, out, deq)
    return out, deq


def test_modelopt_fixture_is_the_producers_layout():
    producer = json.loads((MODELOPT / "PRODUCER.json").read_text())
    assert producer["recipe"] == "huggingface/diffusion_gemma/ptq/nvfp4_experts_only"
    qc = json.loads((MODELOPT / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"], qc["producer"]["name"]) == ("modelopt", "NVFP4", "modelopt")
    tensors = checkpoint_tensors(MODELOPT)
    base = "model.decoder.layers.1.experts.2"
    assert tensors[f"{base}.gate_proj.weight"].dtype == torch.uint8
    assert tensors[f"{base}.gate_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert tensors[f"{base}.down_proj.input_scale"].shape == ()
    assert tensors["model.decoder.layers.1.self_attn.q_proj.weight"].dtype == torch.bfloat16  # experts only


def test_modelopt_checkpoint_runs_as_its_exact_dequantization(modelopt_float):
    path, deq = modelopt_float
    q_engine = load(MODELOPT, device="cpu", dtype="float32")
    assert q_engine.model.layers[0].experts.gate_up_proj.weight.dtype == torch.uint8
    f_model = float_model(path)
    assert torch.equal(q_engine.model.layers[1].experts.weights(torch.float32)[0],
                       f_model.layers[1].experts.gate_up_proj)
    f_engine = Engine(f_model, None, q_engine.settings)
    q_out = generate(q_engine)
    assert q_out == generate(f_engine)
    assert sum(map(len, q_out)) > q_engine.config.canvas_length
    assert torch.equal(first_step_logits(q_engine.model, PROMPTS[0]), first_step_logits(f_model, PROMPTS[0]))


def test_modelopts_own_dequantizer_agrees_within_its_rounding(modelopt_float):
    """ModelOpt multiplies e2m1 by (scale x scale_2), one float32 rounding earlier than the format's order: the two
    may differ by that one rounding, never more."""
    _, deq = modelopt_float
    theirs = load_file(MODELOPT / "producer_dequantized.safetensors")
    assert set(theirs) == set(deq) and len(deq) == 3 * 4 * 3  # every expert projection of every layer
    for name, exact in deq.items():
        assert ((theirs[name] - exact).abs() <= exact.abs() * 2**-23).all(), name


# ----------------------------------------------------------------------------- dgemma's NVFP4, field by field


@pytest.fixture(scope="module")
def dgemma_nvfp4(tmp_path_factory):
    """dgemma's NVFP4 of a bfloat16 source of the fixture's shapes (make_ct_fixtures.SPEC), default settings."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import checkpoints
    from make_ct_fixtures import SPEC, VISION

    root = tmp_path_factory.mktemp("dgemma_nvfp4")
    saved = checkpoints.TINY_VISION
    checkpoints.TINY_VISION = VISION
    try:
        src = checkpoints.build_checkpoint(root / "src", SPEC, seed=13, tweak=lambda m: m.to(torch.bfloat16))
    finally:
        checkpoints.TINY_VISION = saved
    quantize_checkpoint(src, root / "out", "nvfp4")
    return src, root / "out"


def test_dgemma_nvfp4_has_every_tensor_and_field_modelopt_exports(dgemma_nvfp4):
    _, out = dgemma_nvfp4
    theirs = checkpoint_tensors(MODELOPT)  # the vision tower included: dgemma carries it over unquantized, as ModelOpt
    ours = checkpoint_tensors(out)
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert (ours[name].dtype, ours[name].shape) == (t.dtype, t.shape), name
    their_cfg = json.loads((MODELOPT / "config.json").read_text())["quantization_config"]
    our_cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert list(our_cfg) == list(their_cfg)
    for key in ("config_groups", "quant_algo", "kv_cache_scheme", "quant_method"):
        assert our_cfg[key] == their_cfg[key], key
    their_hf = json.loads((MODELOPT / "hf_quant_config.json").read_text())
    our_hf = json.loads((out / "hf_quant_config.json").read_text())
    assert list(our_hf) == list(their_hf) and list(our_hf["quantization"]) == list(their_hf["quantization"])
    for key in ("quant_algo", "kv_cache_quant_algo", "group_size"):
        assert our_hf["quantization"][key] == their_hf["quantization"][key]
    # The exclude globs mean the same for every module a serving engine matches them against (fnmatch).
    modules = {n.rsplit(".", 1)[0] for n, t in theirs.items()  # the linear layers and expert projections
               if n.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in n} | {"lm_head"}
    assert len(modules) > 3 * 4 * 3 + 3 * 6
    for m in modules:
        for lst in (our_cfg["ignore"], our_hf["quantization"]["exclude_modules"]):
            excluded = any(fnmatch.fnmatch(m, g) for g in lst)
            assert excluded == any(fnmatch.fnmatch(m, g) for g in their_cfg["ignore"]), m
            assert excluded == (m + ".weight_scale" not in ours), m


def test_dgemma_nvfp4_input_scales_follow_modelopts_rule(dgemma_nvfp4):
    """One activation scale per projection type per layer, shared by its experts (ModelOpt's fused-experts export),
    gate equal to up, positive, and amax / (6 * 448) of what the float model's experts read on the calibration set."""
    from dgemma_cli.model import Experts
    from dgemma_cli.store.quantize import calibrate

    src, out = dgemma_nvfp4
    tensors = checkpoint_tensors(out)
    theirs = checkpoint_tensors(MODELOPT)
    amax, _ = calibrate(src, False)
    model, _ = load_model(src)
    layers = [p for p, m in model.named_modules() if isinstance(m, Experts)]
    assert len(layers) == 3
    for i, path in enumerate(layers):
        base = f"model.decoder.layers.{i}.experts"
        for proj, key in (("gate_proj", "gate_up"), ("up_proj", "gate_up"), ("down_proj", "down")):
            scales = torch.stack([tensors[f"{base}.{e}.{proj}.input_scale"] for e in range(4)])
            assert (scales == scales[0]).all() and scales[0] > 0
            assert scales[0] == (amax[f"{path}.{key}"].float() / 2688.0)
            # ModelOpt's own export shares them the same way
            theirs_s = torch.stack([theirs[f"{base}.{e}.{proj}.input_scale"] for e in range(4)])
            assert (theirs_s == theirs_s[0]).all()
        assert torch.equal(tensors[f"{base}.1.gate_proj.input_scale"], tensors[f"{base}.1.up_proj.input_scale"])
    # a layer's experts' inputs are the hidden states (unit RMS after the pre-norm): the scale is far from a default
    assert all(0 < float(v) < 1e3 for v in amax.values())


def test_dgemma_nvfp4_runs_and_resumes_to_the_same_bytes(dgemma_nvfp4, tmp_path):
    src, out = dgemma_nvfp4
    again = tmp_path / "again"
    quantize_checkpoint(src, again, "nvfp4")  # the calibration is deterministic: the same job, the same bytes
    assert {p.name: p.read_bytes() for p in again.glob("*.safetensors")} == \
        {p.name: p.read_bytes() for p in out.glob("*.safetensors")}
    engine = load(out, device="cpu", dtype="float32")
    assert len(generate(engine)[0]) > 0


BAD_MODELOPT = {
    "8-bit weights": (lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=8), "num_bits=8"),
    "group 32": (lambda qc: qc["config_groups"]["group_0"]["input_activations"].update(group_size=32),
                 "group_size=32"),
    "mixed groups": (lambda qc: qc["config_groups"].update(group_1={"weights": {"num_bits": 8, "type": "float"},
                                                                    "targets": ["re:.*mlp.*"]}), "group 'group_1'"),
    "another algorithm": (lambda qc: qc.update(quant_algo="MIXED_PRECISION"), "MIXED_PRECISION"),
}


@pytest.mark.parametrize("case", BAD_MODELOPT)
def test_bad_or_mixed_modelopt_configs_are_refused_in_one_line(case, tmp_path, capsys):
    edit, expected = BAD_MODELOPT[case]
    out = tmp_path / "m"
    shutil.copytree(MODELOPT, out)
    config = json.loads((out / "config.json").read_text())
    edit(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config))
    assert run_main(["run", "--model", str(out), "--device", "cpu", "--view", "none", "hi"]) == 1
    assert expected in one_error_line(capsys)


# ----------------------------------------------------------------------------- compressed-tensors, written by dgemma


@pytest.fixture(scope="module")
def dgemma_w8a8(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("dgemma_w8a8")
    return {fmt: quantize_checkpoint(checkpoints["five_to_one"], root / fmt, fmt) and root / fmt
            for fmt in ("fp8", "int8")}


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_compressed_tensors_decompresses_dgemmas_files_to_dgemmas_weights(dgemma_w8a8, fmt):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import is_match

    from quant import w8a8

    out = dgemma_w8a8[fmt]
    raw = json.loads((out / "config.json").read_text())["quantization_config"]
    qc = QuantizationConfig.model_validate(raw)  # the producer's own schema accepts the description
    from transformers.utils.quantization_config import CompressedTensorsConfig

    # what transformers' compressed-tensors loader builds from the description
    assert ModelCompressor.from_compression_config(CompressedTensorsConfig.from_dict(raw)) is not None
    scheme = next(iter(qc.config_groups.values()))
    compressor = BaseCompressor.load_from_registry(qc.format)
    tensors = checkpoint_tensors(out)
    linear = torch.nn.Linear(1, 1)
    checked = 0
    for name, t in tensors.items():
        if not name.endswith(".weight") or t.dim() != 2 or "embed_tokens" in name:
            continue
        module = name[: -len(".weight")]
        # compressed-tensors' own matching of its targets and ignore list says which modules are quantized
        targeted = is_match(module, linear, scheme.targets, qc.ignore)
        assert targeted == (module + ".weight_scale" in tensors), module
        if not targeted:
            continue
        theirs = compressor.decompress({"weight": t, "weight_scale": tensors[module + ".weight_scale"]}, scheme)
        ours = w8a8.dequantize(t, tensors[module + ".weight_scale"], torch.bfloat16)  # dgemma on a GPU, bf16
        assert theirs["weight"].dtype == torch.bfloat16 and torch.equal(theirs["weight"], ours), module
        exact = w8a8.dequantize(t, tensors[module + ".weight_scale"], torch.float32)
        assert torch.equal(theirs["weight"], exact.bfloat16())
        checked += 1
    # 6 layers of 8 experts x 3 projections, q k v o and the dense MLP; full-attention layer 5 has no v_proj
    assert checked == 6 * (8 * 3 + 7) - 1
    names = set(tensors)
    assert "model.decoder.layers.0.experts.7.down_proj.weight_scale" in names  # per expert, as published
    assert tensors["model.decoder.layers.0.experts.7.down_proj.weight_scale"].shape == (64, 1)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_dgemmas_w8a8_runs_as_its_exact_dequantization(dgemma_w8a8, fmt, tmp_path):
    out = dgemma_w8a8[fmt]
    tensors = checkpoint_tensors(out)
    deq = {n[: -len("_scale")]: tensors[n[: -len("_scale")]].float() * t.float()
           for n, t in tensors.items() if n.endswith(".weight_scale")}
    write_float_copy(out, tmp_path / "float", deq)
    q_engine = load(out, device="cpu", dtype="float32")
    f_model = float_model(tmp_path / "float")
    assert generate(q_engine) == generate(Engine(f_model, None, q_engine.settings))
    assert torch.equal(first_step_logits(q_engine.model, PROMPTS[0]), first_step_logits(f_model, PROMPTS[0]))


def test_experts_policy_ignores_attention_and_mlp(checkpoints, tmp_path, capsys):
    out = tmp_path / "fp8-experts"
    quantize_checkpoint(checkpoints["five_to_one"], out, "fp8", "experts")
    tensors = checkpoint_tensors(out)
    assert tensors["model.decoder.layers.0.self_attn.q_proj.weight"].dtype == torch.float32
    assert tensors["model.decoder.layers.0.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert run_main(["info", str(out)]) == 0
    info = capsys.readouterr().out
    assert "fp8 (routed experts quantized)" in info and "compressed-tensors FP8 W8A8" in info
    load(out, device="cpu", dtype="float32")  # its ignore list agrees with what is stored


# ----------------------------------------------------------------------------- dgemma INT8 v1 (earlier versions)


def write_dgemma_int8_v1(src: Path, out: Path) -> None:
    """What `dgemma quantize --quant int8` wrote before: fused int8 experts with float32 [E, N] scales, attention
    and dense MLP too (policy all), config {quant_method: dgemma, format: int8, format_version: 1}."""
    out.mkdir()
    new = {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.startswith("model.decoder.layers.") and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            qs = [qint8.quantize(t[e]) for e in range(t.shape[0])]
            new[name + ".weight"] = torch.stack([q.weight for q in qs])
            new[name + ".weight_scale"] = torch.stack([q.weight_scale for q in qs])
        elif name.startswith("model.decoder.layers.") and (".self_attn." in name or ".mlp." in name) \
                and name.endswith("_proj.weight"):
            q = qint8.quantize(t)
            new[name], new[name[: -len(".weight")] + ".weight_scale"] = q.weight, q.weight_scale
        else:
            new[name] = t
    save_file(new, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "dgemma", "format": "int8", "format_version": 1}
    (out / "config.json").write_text(json.dumps(config))
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copyfile(src / f, out / f)


def test_dgemma_int8_v1_keeps_loading(checkpoints, tmp_path, capsys):
    out = tmp_path / "v1"
    write_dgemma_int8_v1(checkpoints["five_to_one"], out)
    engine = load(out, device="cpu", dtype="float32")
    layer = engine.model.layers[0]
    assert type(layer.experts.gate_up_proj).__name__ == "Int8Stack"
    assert type(layer.self_attn.q_proj).__name__ == "Int8Linear"
    assert len(generate(engine)[0]) > 0
    assert run_main(["info", str(out)]) == 0
    info = capsys.readouterr().out
    assert "int8 (routed experts, attention, dense MLP quantized)" in info and "dgemma INT8 v1" in info


# ----------------------------------------------------------------------------- dgemma pull of the published releases


PUBLISHED = {
    "RedHatAI/diffusiongemma-26B-A4B-it-FP8-dynamic": ("ct_fp8_dynamic", "fp8", "compressed-tensors FP8 W8A8"),
    "aidendle94/diffusiongemma-26B-A4B-it-INT8-dynamic": ("ct_int8_dynamic", "int8", "compressed-tensors INT8 W8A8"),
    "nvidia/diffusiongemma-26B-A4B-it-NVFP4": ("modelopt_nvfp4", "nvfp4", "ModelOpt NVFP4"),
}


@pytest.mark.parametrize("repo", PUBLISHED)
def test_pull_stores_a_published_release_as_published(repo, fake_hub, capsys):  # noqa: F811
    fixture, label, scheme = PUBLISHED[repo]
    serve_directory(fake_hub, repo, FIXTURES / fixture)
    assert run_main(["pull", repo, "--quant", "int8" if label != "int8" else "fp8"]) == 2  # not convertible
    assert f"published in {label}" in one_error_line(capsys)
    assert run_main(["pull", repo]) == 0
    assert capsys.readouterr().out.strip() == f"{repo}:{label}"
    (entry,) = store.entries()
    assert entry.path == store.entry_dir(repo, label) and entry.manifest["store"]["published"] is True
    published = [f for f in (FIXTURES / fixture).iterdir()  # weights and description, byte for byte
                 if f.name.startswith("model-")
                 or f.name in ("model.safetensors", "config.json", "hf_quant_config.json")]
    assert len(published) >= 2
    for f in published:
        assert (entry.path / f.name).read_bytes() == f.read_bytes(), f.name
    from dgemma_cli.vision import vision_records

    assert len(vision_records(entry.path)[0]) > 10  # the vision tower came with it, whichever shard holds it
    assert run_main(["info", f"{repo}:{label}"]) == 0
    info = capsys.readouterr().out
    assert f"format:                 {label} (" in info and scheme in info and "(as published)" in info
    assert run_main(["run", "--model", repo, "--raw", "--seed", "1", "--max-new-tokens", "8", "--device", "cpu",
                     "--view", "none", "hi"]) == 0


def test_pull_refuses_a_bad_published_config_in_one_line(fake_hub, tmp_path, capsys):  # noqa: F811
    repo = tmp_path / "bad"
    shutil.copytree(FIXTURES / "ct_fp8_dynamic", repo)
    config = json.loads((repo / "config.json").read_text())
    config["quantization_config"]["format"] = "mixed-precision"
    (repo / "config.json").write_text(json.dumps(config))
    serve_directory(fake_hub, "acme/mixed-FP8", repo)
    assert run_main(["pull", "acme/mixed-FP8"]) == 1
    assert "mixed-precision" in one_error_line(capsys)
    assert not fake_hub.file_requests("model.safetensors")  # refused from the config, before any weights
    assert store.entries() == []


def test_pull_of_a_gguf_repository_into_a_format_says_it_runs_as_published(fake_hub, capsys):  # noqa: F811
    """A GGUF repository is taken as published, one of its quantizations (tests/test_gguf_model.py pulls one): asked
    for another format, the pull names them, before anything is downloaded."""
    fake_hub.add_repo("unsloth/diffusiongemma-26B-A4B-it-GGUF", {
        "README.md": b"# GGUF\n", "diffusiongemma-26B-A4B-it-Q4_K_M.gguf": b"GGUF" + b"\0" * 60,
        "diffusiongemma-26B-A4B-it-Q8_0.gguf": b"GGUF" + b"\0" * 60})
    assert run_main(["pull", "unsloth/diffusiongemma-26B-A4B-it-GGUF", "--quant", "nvfp4"]) == 2
    msg = one_error_line(capsys)
    assert "GGUF" in msg and "q4_k_m" in msg and "q8_0" in msg and "not nvfp4" in msg
    assert not [r for r in fake_hub.requests if "/resolve/" in r.path]  # nothing downloaded


def test_nvfp4_calibration_records_what_the_experts_read(dgemma_nvfp4, monkeypatch):
    """The amax `calibrate` records, against one observed independently: every expert layer's input as the layer
    receives it (a wrapper around Experts.forward, not calibrate's hook), and the down projection's input computed
    from the expert weights as stored in the checkpoint's file (not through the module), over the same calibration
    run. A calibration that recorded a multiple of the activations, or missed a token, fails here."""
    import dgemma_cli.model as model_mod
    from dgemma_cli.model import gelu_tanh
    from dgemma_cli.store.quantize import calibrate

    src, _ = dgemma_nvfp4
    seen: dict[int, list[torch.Tensor]] = {}
    forward = model_mod.Experts.forward

    def watching(self, x, top_k_index, top_k_weights):
        seen.setdefault(id(self), []).append((x.detach().clone(), top_k_index.clone()))
        return forward(self, x, top_k_index, top_k_weights)

    monkeypatch.setattr(model_mod.Experts, "forward", watching)
    amax, _ = calibrate(src, False)
    monkeypatch.setattr(model_mod.Experts, "forward", forward)
    assert len(seen) == 3  # the three layers' experts, each called by the calibration run
    stored = checkpoint_tensors(src)
    for i, calls in enumerate(seen.values()):
        xs = torch.cat([x.float() for x, _ in calls])
        assert amax[f"layers.{i}.experts.gate_up"] == xs.abs().max()
        gate_up = stored[f"model.decoder.layers.{i}.experts.gate_up_proj"].float()  # [E, 2I, H]
        down_in = []
        for x, idx in calls:
            for e in idx.unique().tolist():
                rows = (idx == e).any(-1)
                gate, up = (x[rows].float() @ gate_up[e].T).chunk(2, dim=-1)
                down_in.append((gelu_tanh(gate) * up).abs().max())
        assert torch.allclose(amax[f"layers.{i}.experts.down"], torch.stack(down_in).max(), rtol=1e-6)
