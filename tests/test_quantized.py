"""Quantized checkpoints end to end: dgemma's converter, loading, and a ModelOpt-layout checkpoint written here.

The runtime must compute exactly what the same engine computes when fed the dequantized weights in float32: same
logits, same tokens for the same seed. A checkpoint in NVIDIA ModelOpt's per-expert NVFP4 layout, written by this
file's own encoder (not dgemma's writer), must load and run.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import first_step_logits
from cli_helpers import run_main
from dgemma_cli.engine import Engine, load
from dgemma_cli.model import QuantizedExperts
from dgemma_cli.store.quantize import quantize_checkpoint
from dgemma_cli.checkpoint.weights import load_model
from quant.convert import MANIFEST, verify

CASES = [("nvfp4", "experts"), ("nvfp4", "all"), ("int8", "experts"), ("int8", "all")]


@pytest.fixture(scope="module")
def quantized(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    src = checkpoints["five_to_one"]
    return {case: quantize_checkpoint(src, root / "-".join(case), *case) and root / "-".join(case) for case in CASES}


def dequantized_float_model(src: Path, qmodel) -> torch.nn.Module:
    """The unquantized float32 model with every quantized weight replaced by its dequantized value."""
    model, _ = load_model(src, dtype=torch.float32)
    replaced = 0
    for path, mod in qmodel.named_modules():
        if isinstance(mod, QuantizedExperts):
            target = model.get_submodule(path)
            gate_up, down = mod.weights(torch.float32)
            target.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
            target.down_proj = torch.nn.Parameter(down, requires_grad=False)
            replaced += 1
        elif hasattr(mod, "dequantize") and ".experts." not in path:
            model.get_submodule(path).weight = torch.nn.Parameter(mod.dequantize(torch.float32), requires_grad=False)
            replaced += 1
    assert replaced > 0
    return model


@pytest.mark.parametrize("fmt,policy", CASES)
def test_quantized_run_equals_dequantized_float32(checkpoints, quantized, fmt, policy):
    src = checkpoints["five_to_one"]
    q_engine = load(quantized[(fmt, policy)], device="cpu", dtype="float32")
    f_model = dequantized_float_model(src, q_engine.model)
    f_engine = Engine(f_model, q_engine.tokenizer, q_engine.settings)
    layer = q_engine.model.layers[0]
    assert isinstance(layer.experts, QuantizedExperts)
    assert layer.experts.gate_up_proj.weight.dtype == (torch.uint8 if fmt == "nvfp4" else torch.int8)
    assert (type(layer.self_attn.q_proj).__name__ != "Linear") == (policy == "all")
    if fmt == "nvfp4":  # the calibrated activation scales the converter wrote are loaded (W4A4 uses them)
        stored = {}
        for shard in quantized[(fmt, policy)].glob("*.safetensors"):
            stored.update(load_file(shard))
        scales = {k: v for k, v in stored.items() if k.endswith(".input_scale")}
        modules = [m for m in [layer.self_attn.q_proj, layer.experts.gate_up_proj] if hasattr(m, "input_scale")]
        assert len(modules) == (2 if policy == "all" else 1)
        assert all(m.input_scale is not None and (m.input_scale > 0).all() for m in modules)
        if policy == "all":
            q_key = next(k for k in scales if k.endswith("layers.0.self_attn.q_proj.input_scale"))
            assert torch.equal(layer.self_attn.q_proj.input_scale, scales[q_key])
        up_key = next(k for k in scales if k.endswith("layers.0.experts.3.up_proj.input_scale"))
        assert torch.equal(layer.experts.gate_up_proj.input_scale[3, 1], scales[up_key])
    # the quantization really changed the weights (else the comparison below proves nothing)
    original, _ = load_model(src, dtype=torch.float32)
    assert not torch.equal(original.layers[0].experts.gate_up_proj, f_model.layers[0].experts.gate_up_proj)

    C = q_engine.config.canvas_length
    prompts = [[2, 200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211], [2, 300, 301, 302]]
    kw = dict(raw=True, max_new_tokens=3 * C, max_denoising_steps=6, seed=5)
    q_out = q_engine.generate(prompts, **kw)
    f_out = f_engine.generate(prompts, **kw)
    assert q_out.token_ids == f_out.token_ids
    assert sum(map(len, q_out.token_ids)) > C  # several canvases ran

    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        logits = []
        for m in (q_engine.model, f_model):
            cache = m.new_cache(1, 64)
            m.encode(ids, cache)
            canvas = torch.arange(100, 100 + C)[None]
            logits.append(m.denoise(canvas, cache, m.denoise_context(cache, 1)))
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("fmt,policy", CASES)
def test_converter_output_is_complete_and_verified(quantized, checkpoints, fmt, policy):
    out = quantized[(fmt, policy)]
    manifest = verify(out)
    names = {p.name for p in out.iterdir()}
    assert set(manifest["files"]) | {MANIFEST} == names
    assert not out.with_name(out.name + ".partial").exists()
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    if fmt == "nvfp4":
        assert (qc["quant_method"], qc["quant_algo"]) == ("modelopt", "NVFP4")
        assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 16
        hf = json.loads((out / "hf_quant_config.json").read_text())
        assert (hf["quantization"]["quant_algo"], hf["quantization"]["group_size"]) == ("NVFP4", 16)
    else:  # compressed-tensors W8A8 (tests/test_formats_write.py checks it field by field)
        assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "int-quantized")
    tensors = {}
    for shard in out.glob("*.safetensors"):
        tensors.update(load_file(shard))
    # the vision tower is carried over as it is stored in the source: same names, dtypes and values
    source = load_file(checkpoints["five_to_one"] / "model.safetensors")
    vision = {k for k in source if ".vision_tower." in k or ".embed_vision." in k}
    assert vision and vision == {k for k in tensors if "vision" in k}
    assert all(torch.equal(tensors[k], source[k]) and tensors[k].dtype == source[k].dtype for k in vision)
    base = "model.decoder.layers.0.experts"
    if fmt == "nvfp4":
        E = 8
        for e in range(E):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert tensors[f"{base}.{e}.{proj}.weight"].dtype == torch.uint8
                assert tensors[f"{base}.{e}.{proj}.weight_scale"].dtype == torch.float8_e4m3fn
                assert tensors[f"{base}.{e}.{proj}.weight_scale_2"].shape == ()
            # gate and up share their global scale
            assert torch.equal(tensors[f"{base}.{e}.gate_proj.weight_scale_2"],
                               tensors[f"{base}.{e}.up_proj.weight_scale_2"])
    else:  # per expert, as the published W8A8 releases
        assert tensors[f"{base}.3.up_proj.weight"].dtype == torch.int8
        assert tensors[f"{base}.3.up_proj.weight_scale"].shape == (32, 1)
        assert tensors[f"{base}.3.up_proj.weight_scale"].dtype == torch.bfloat16
    q_name = "model.decoder.layers.0.self_attn.q_proj.weight"
    assert (tensors[q_name].dtype in (torch.uint8, torch.int8)) == (policy == "all")
    # never quantized, whatever the policy
    assert tensors["model.decoder.layers.0.router.proj.weight"].dtype == torch.float32
    assert tensors["model.decoder.embed_tokens.weight"].dtype == torch.float32


# ----------------------------------------------------------------------------- a ModelOpt checkpoint from elsewhere

E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def modelopt_encode(w: torch.Tensor, scale_2: float):
    """An independent NVFP4 encoder (plain absmax, nearest value by brute force): W [N, K] -> (packed, scales, values).

    Written without dgemma's quant package, so a misreading of the layout on either side shows up here.
    """
    N, K = w.shape
    blocks = w.double().reshape(N, K // 16, 16)
    scale = (blocks.abs().amax(-1) / 6.0 / scale_2).clamp(max=448.0).to(torch.float8_e4m3fn)
    s = scale.double()[..., None] * scale_2
    x = torch.where(s > 0, blocks / s, torch.zeros_like(blocks))
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    idx = (x.abs()[..., None] - grid).abs().argmin(-1)  # nearest magnitude (ties: the smaller one; fine here)
    code = idx + 8 * ((x < 0) & (idx > 0))
    code = code.reshape(N, K).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)  # element 2i in the low nibble
    values = (torch.where(code >= 8, -1.0, 1.0) * grid[(code & 7).long()]).float()
    deq = (values.reshape(N, K // 16, 16) * scale.float()[..., None]) * torch.tensor(scale_2, dtype=torch.float32)
    return packed, scale, deq.reshape(N, K)


def test_converter_carries_the_small_files_over(checkpoints, tmp_path):
    """The processor's settings and the live view's board layout travel with the weights, byte for byte."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(checkpoints["five_to_one"], src)
    extra = {"dgemma_view.json": b'{"board": {"rows": 4, "cols": 4, "row_stride": 5}}',
             "preprocessor_config.json": b'{"image_processor_type": "Gemma4ImageProcessor"}'}
    for name, data in extra.items():
        (src / name).write_bytes(data)
    quantize_checkpoint(src, tmp_path / "out", "int8", "experts")
    for name, data in extra.items():
        assert (tmp_path / "out" / name).read_bytes() == data


def input_scale_of(expert: int, proj: str) -> float:
    """The calibrated activation scale write_modelopt_checkpoint stores for an expert projection: distinct for each,
    so a test sees which lands where."""
    return 0.001 * (1 + expert) * {"gate_proj": 1.0, "up_proj": 1.5, "down_proj": 0.25}[proj]


def write_modelopt_checkpoint(src: Path, out: Path):
    """Rewrite a float checkpoint as ModelOpt exports NVFP4: experts per expert (gate and up with their *own*
    weight_scale_2 here, to exercise that), input_scale tensors, under the `model.language_model.` prefix, and only
    an hf_quant_config.json (older exports put nothing in config.json). Returns the float weights it encoded."""
    out.mkdir()
    tensors = load_file(src / "model.safetensors")
    new, dequant = {}, {}
    for name, t in tensors.items():
        if name.startswith("model.encoder.language_model.") and name.endswith("layer_scalar"):
            new[name] = t  # the encoder's own layer scalars
        if not name.startswith("model.decoder."):
            continue
        short = name[len("model.decoder."):]
        decoder_only = short.startswith("self_conditioning") or short.endswith("layer_scalar")
        target = name if decoder_only else "model.language_model." + short
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            base = target.rsplit(".", 1)[0]
            E = t.shape[0]
            for e in range(E):
                if name.endswith("gate_up_proj"):
                    I = t.shape[1] // 2
                    parts = {"gate_proj": t[e, :I], "up_proj": t[e, I:]}
                else:
                    parts = {"down_proj": t[e]}
                for proj, w in parts.items():
                    scale_2 = float(w.abs().max()) / (6 * 448)
                    packed, scale, deq = modelopt_encode(w, scale_2)
                    key = f"{base}.{e}.{proj}"
                    new[f"{key}.weight"] = packed
                    new[f"{key}.weight_scale"] = scale
                    new[f"{key}.weight_scale_2"] = torch.tensor(scale_2, dtype=torch.float32)
                    new[f"{key}.input_scale"] = torch.tensor(input_scale_of(e, proj), dtype=torch.float32)
                    dequant[(name, e, proj)] = deq
            continue
        new[target] = t
    save_file(new, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config))
    (out / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.0"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                         "exclude_modules": ["lm_head", "*router*", "*self_attn*", "*mlp*", "*embed*"]}}))
    for f in ("tokenizer.json", "generation_config.json", "chat_template.jinja"):
        if (src / f).exists():
            (out / f).write_bytes((src / f).read_bytes())
    return dequant


def test_modelopt_layout_checkpoint_loads_and_runs(checkpoints, tmp_path):
    src = checkpoints["five_to_one"]
    out = tmp_path / "modelopt"
    dequant = write_modelopt_checkpoint(src, out)
    q_engine = load(out, device="cpu", dtype="float32")
    experts = q_engine.model.layers[2].experts
    assert isinstance(experts, QuantizedExperts)
    assert experts.gate_up_proj.weight_scale_2.shape == (8, 2)  # gate and up scales kept apart
    # the calibrated activation scales, per expert and projection, for W4A4 (the largest of the layer's)
    want = torch.tensor([[input_scale_of(e, p) for p in ("gate_proj", "up_proj")] for e in range(8)])
    assert torch.equal(experts.gate_up_proj.input_scale, want)
    down = torch.tensor([[input_scale_of(e, "down_proj")] for e in range(8)])
    assert torch.equal(experts.down_proj.input_scale, down)
    assert experts.gate_up_proj.activation_scale().item() == want.max().item()

    # the float32 model fed this file's own dequantization
    f_model, _ = load_model(src, dtype=torch.float32)
    for L, layer in enumerate(f_model.layers):
        base = f"model.decoder.layers.{L}.experts"
        E = layer.experts.num_experts
        gate_up = torch.stack([torch.cat([dequant[(base + ".gate_up_proj", e, "gate_proj")],
                                          dequant[(base + ".gate_up_proj", e, "up_proj")]]) for e in range(E)])
        down = torch.stack([dequant[(base + ".down_proj", e, "down_proj")] for e in range(E)])
        torch.testing.assert_close(q_engine.model.layers[L].experts.weights(torch.float32)[0], gate_up,
                                   rtol=0, atol=0)
        layer.experts.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
        layer.experts.down_proj = torch.nn.Parameter(down, requires_grad=False)
    f_engine = Engine(f_model, q_engine.tokenizer, q_engine.settings)
    kw = dict(raw=True, max_new_tokens=32, max_denoising_steps=5, seed=3)
    prompt = [[2, 150, 151, 152, 153, 154, 155, 156, 157, 158]]
    assert q_engine.generate(prompt, **kw).token_ids == f_engine.generate(prompt, **kw).token_ids

    # and through the command line
    assert run_main(["run", "--model", str(out), "--raw", "--seed", "1", "--max-new-tokens", "8", "--device", "cpu",
                     "--view", "none", "hello"]) == 0


def test_quantized_tensors_without_a_declared_format_are_refused(checkpoints, tmp_path, capsys):
    out = tmp_path / "modelopt"
    write_modelopt_checkpoint(checkpoints["five_to_one"], out)
    (out / "hf_quant_config.json").unlink()
    assert run_main(["run", "--model", str(out), "--device", "cpu", "--view", "none", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no quantization_config" in err[0]


def test_unsupported_quantization_is_refused_by_name(checkpoints, tmp_path, capsys):
    out = tmp_path / "q"
    quantize_checkpoint(checkpoints["five_to_one"], out, "int8")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (out / "config.json").write_text(json.dumps(config))
    assert run_main(["run", "--model", str(out), "--device", "cpu", "--view", "none", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'gptq'" in err[0]


def first_step_log_probs(engine, prompts):
    """log softmax of the decoder's first step on a fixed random canvas [B, C, V] (float32)."""
    return torch.cat([torch.log_softmax(first_step_logits(engine.model, ids), -1) for ids in prompts])


def test_kl_and_agreement_against_the_unquantized_model(checkpoints, quantized):
    """The measured cost of each format: KL(ref || quant) of the first-step distribution and argmax agreement.
    INT8 must sit well below NVFP4, and quantizing more (policy all) must cost more."""
    src = checkpoints["five_to_one"]
    g = torch.Generator().manual_seed(9)
    prompts = [[2] + torch.randint(107, 512, (12,), generator=g).tolist() for _ in range(6)]
    ref = first_step_log_probs(load(src, device="cpu", dtype="float32"), prompts)
    kl, agree = {}, {}
    for case in CASES:
        lp = first_step_log_probs(load(quantized[case], device="cpu", dtype="float32"), prompts)
        kl[case] = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        agree[case] = (ref.argmax(-1) == lp.argmax(-1)).float().mean().item()
    assert 0 < kl[("int8", "experts")] < kl[("nvfp4", "experts")] < 0.05
    assert kl[("int8", "experts")] < kl[("int8", "all")] and kl[("nvfp4", "experts")] < kl[("nvfp4", "all")]
    assert agree[("int8", "experts")] > agree[("nvfp4", "all")] and agree[("int8", "experts")] > 0.5
