"""compressed-tensors W8A8 checkpoints (FP8-dynamic, INT8-dynamic) written by the real producer.

The fixtures under tests/fixtures/ct_* are a tiny random DiffusionGemma quantized by llmcompressor's `model_free_ptq`
(scripts/make_ct_fixtures.py, which records the versions in each PRODUCER.json): experts split per expert by the
producer, attention and dense MLP quantized, routers, self-conditioning, embedding and vision tower left bf16; the
INT8 one sharded. What must hold, on the CPU:
- weight-only (the default there) computes exactly what the same engine computes fed this file's own float32
  dequantization (weight x weight_scale), written by the test as a plain float checkpoint: same logits, same tokens;
- compressed-tensors' own dequantizer gives that value rounded to bfloat16 (its output dtype);
- W8A8 (DGEMMA_W8A8=on: the float32 emulation on the CPU) computes what a float model does whose linear inputs and
  expert inputs are quantized per token by this file's own restatement of the rule;
- torch's FP8 and INT8 matmuls (the GPU path, runnable on the CPU too) agree with that emulation;
- anything else in compressed-tensors is refused in one line that names it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from checkpoints import checkpoint_tensors, first_step_logits, write_float_copy
from cli_helpers import run_main
from dgemma_cli.engine import Engine, load
from dgemma_cli.errors import ModelError
from dgemma_cli.model import QuantizedExperts
from dgemma_cli.checkpoint.weights import load_model
from quant import w8a8
from quant.modules import W8A8Linear

FIXTURES = Path(__file__).parent / "fixtures"
CASES = {"ct_fp8_dynamic": ("fp8", torch.float8_e4m3fn), "ct_int8_dynamic": ("int8", torch.int8)}
PROMPTS = [[2, 200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211], [2, 300, 301, 302]]


def dequantize_checkpoint(src: Path, out: Path) -> dict[str, torch.Tensor]:
    """Write `src` as a plain float32 checkpoint: every quantized weight replaced by weight x weight_scale (float32),
    per-expert projections stacked back into the fused layout. Returns the dequantized 2-D weights by name."""
    tensors = checkpoint_tensors(src)
    deq = {}
    for name in list(tensors):
        if name.endswith(".weight_scale"):
            w = name[: -len("_scale")]
            deq[w] = tensors[w].float() * tensors[name].float()  # [N, K] * [N, 1]
    write_float_copy(src, out, deq)
    return deq


@pytest.fixture(scope="module")
def dequantized(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct_dequantized")
    return {name: (root / name, dequantize_checkpoint(FIXTURES / name, root / name)) for name in CASES}


def float_model(path: Path):
    """load_model in float32, every tensor copied into its own allocation: a memory-mapped tensor that is not 16-byte
    aligned sends the experts to the per-group matmul instead of torch's grouped one (model._grouped_mm_fits), whose
    float32 sums may round differently; the quantized model's dequantized stacks are always aligned."""
    model, _ = load_model(path, dtype=torch.float32)
    for p in model.parameters():
        p.data = p.data.clone()
    return model


def generate(engine: Engine, **kw) -> list[list[int]]:
    C = engine.config.canvas_length
    args = dict(raw=True, max_new_tokens=3 * C, max_denoising_steps=6, seed=5) | kw
    return engine.generate(PROMPTS, **args).token_ids


# ----------------------------------------------------------------------------- loading and the weight-only path


@pytest.mark.parametrize("name", CASES)
def test_fixture_is_the_producers_layout(name):
    """The fixture holds what the published releases hold (so the tests below read the real thing)."""
    kind, dtype = CASES[name]
    config = json.loads((FIXTURES / name / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == {"fp8": "float-quantized", "int8": "int-quantized"}[kind]
    tensors = checkpoint_tensors(FIXTURES / name)
    base = "model.decoder.layers.0"
    assert tensors[f"{base}.experts.3.up_proj.weight"].dtype == dtype  # split per expert by the producer
    assert tensors[f"{base}.experts.3.up_proj.weight_scale"].dtype == torch.bfloat16
    assert tensors[f"{base}.experts.3.up_proj.weight_scale"].shape == (16, 1)
    assert tensors[f"{base}.self_attn.q_proj.weight"].dtype == dtype
    assert tensors[f"{base}.router.proj.weight"].dtype == torch.bfloat16
    assert tensors["model.decoder.self_conditioning.gate_proj.weight"].dtype == torch.bfloat16
    assert not any(k.endswith(("input_scale", "weight_zero_point")) for k in tensors)
    assert (FIXTURES / name / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("name", CASES)
def test_weight_only_equals_dequantized_float32(name, dequantized):
    kind, dtype = CASES[name]
    q_engine = load(FIXTURES / name, device="cpu", dtype="float32")
    layer = q_engine.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, W8A8Linear) and layer.self_attn.q_proj.weight.dtype == dtype
    assert layer.self_attn.q_proj.mode(torch.device("cpu")) == "weights"  # the CPU default
    assert isinstance(layer.experts, QuantizedExperts) and layer.experts.gate_up_proj.weight.dtype == dtype
    assert type(layer.router.proj) is torch.nn.Linear  # ignored: kept float
    assert type(q_engine.model.self_conditioning.up_proj) is torch.nn.Linear

    path, deq = dequantized[name]
    f_model = float_model(path)
    # the loaded stacks dequantize to the test's own values, expert by expert
    assert torch.equal(layer.experts.gate_up_proj.dequantize(torch.float32)[2, 16:],
                       deq["model.decoder.layers.0.experts.2.up_proj.weight"])
    f_engine = Engine(f_model, None, q_engine.settings)
    q_out, f_out = generate(q_engine), generate(f_engine)
    assert q_out == f_out
    assert sum(map(len, q_out)) > q_engine.config.canvas_length  # several canvases ran
    assert torch.equal(first_step_logits(q_engine.model, PROMPTS[0]), first_step_logits(f_model, PROMPTS[0]))


@pytest.mark.parametrize("name", CASES)
def test_producers_dequantizer_agrees_within_its_rounding(name, dequantized):
    """compressed-tensors' own dequantize (what vLLM's weight loading and the producer's tests use) returns bfloat16:
    the exact float32 value, rounded once."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    qc = QuantizationConfig.model_validate(json.loads((FIXTURES / name / "config.json").read_text())
                                           ["quantization_config"])
    scheme = next(iter(qc.config_groups.values()))
    tensors = checkpoint_tensors(FIXTURES / name)
    _, deq = dequantized[name]
    assert len(deq) > 50
    for w, exact in deq.items():
        theirs = dequantize(tensors[w], tensors[w + "_scale"], args=scheme.weights)
        assert theirs.dtype == torch.bfloat16
        assert torch.equal(theirs, exact.bfloat16()), w
        assert ((theirs.float() - exact).abs() <= exact.abs() * 2**-8).all()


def test_fused_experts_and_a_single_file_read_the_same(tmp_path):
    """The same FP8 checkpoint with the experts stored fused ([E, 2I, H], scales [E, 2I, 1]) in one file without an
    index: the same model, the same tokens."""
    src = FIXTURES / "ct_fp8_dynamic"
    tensors = checkpoint_tensors(src)
    fused = {}
    groups: dict[str, dict] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            groups.setdefault(".".join(parts[: i + 1]), {})[(int(parts[i + 1]), parts[i + 2], parts[i + 3])] = t
        else:
            fused[name] = t
    for base, by in groups.items():
        E = 1 + max(e for e, _, _ in by)
        for part in ("weight", "weight_scale"):
            fused[f"{base}.gate_up_proj.{part}"] = torch.stack(
                [torch.cat([by[(e, "gate_proj", part)], by[(e, "up_proj", part)]]) for e in range(E)])
            fused[f"{base}.down_proj.{part}"] = torch.stack([by[(e, "down_proj", part)] for e in range(E)])
    out = tmp_path / "fused"
    out.mkdir()
    save_file(fused, out / "model.safetensors")
    for f in ("config.json", "generation_config.json"):
        shutil.copyfile(src / f, out / f)
    a, b = load(src, device="cpu", dtype="float32"), load(out, device="cpu", dtype="float32")
    assert b.model.layers[1].experts.down_proj.weight_scale.shape == (4, 32, 1)
    assert generate(a) == generate(b)


@pytest.mark.parametrize("w8a8_mode", ["auto", "on"])
@pytest.mark.parametrize("name", CASES)
def test_runs_from_the_command_line(name, w8a8_mode, monkeypatch, capsys):
    monkeypatch.setenv("DGEMMA_W8A8", w8a8_mode)
    assert run_main(["run", "--model", str(FIXTURES / name), "--seed", "1", "--max-new-tokens", "8", "--device",
                     "cpu", "--view", "none", "hello"]) == 0
    assert capsys.readouterr().err.strip() == ""


# ----------------------------------------------------------------------------- W8A8


def fake_quant(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token symmetric quantize-dequantize, restated here: scale = amax / qmax per row (float32)."""
    qmax = 448.0 if kind == "fp8" else 127.0
    xf = x.float()
    s = (xf.abs().amax(-1, keepdim=True) / qmax).clamp(min=torch.finfo(torch.float32).tiny)
    q = (xf / s).clamp(-qmax, qmax)
    q = q.to(torch.float8_e4m3fn).float() if kind == "fp8" else torch.round(q)
    return q * s


class ReferenceExperts(torch.nn.Module):
    """Float experts [E, 2I, H] / [E, H, I] whose inputs are fake-quantized per token: each token's input once, each
    (token, expert) gated activation before the down projection. One expert at a time, rows in token order."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, kind: str):
        super().__init__()
        self.gate_up, self.down, self.kind = gate_up, down, kind

    def forward(self, x, top_k_index, top_k_weights):
        T, K = top_k_index.shape
        xq = fake_quant(x, self.kind)
        y = torch.zeros(T, K, x.shape[-1])
        for e in range(self.gate_up.shape[0]):
            t, k = (top_k_index == e).nonzero(as_tuple=True)
            if len(t):
                gate, up = F.linear(xq[t], self.gate_up[e]).chunk(2, dim=-1)
                h = fake_quant(F.gelu(gate, approximate="tanh") * up, self.kind)
                y[t, k] = F.linear(h, self.down[e])
        return (y * top_k_weights[..., None]).sum(1).to(x.dtype)


def reference_w8a8_model(path: Path, q_model, kind: str):
    """The float32 model with the dequantized weights, every quantized linear's input and the experts' inputs
    fake-quantized per token."""
    model = float_model(path)
    hooked = 0
    for name, mod in q_model.named_modules():
        if isinstance(mod, W8A8Linear):
            model.get_submodule(name).register_forward_pre_hook(lambda m, args: (fake_quant(args[0], kind),))
            hooked += 1
        elif isinstance(mod, QuantizedExperts):
            f = model.get_submodule(name)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, ReferenceExperts(f.gate_up_proj, f.down_proj, kind))
    assert hooked > 10
    return model


@pytest.mark.parametrize("name", CASES)
def test_w8a8_emulation_equals_its_reference(name, dequantized, monkeypatch):
    kind, _ = CASES[name]
    path, _ = dequantized[name]
    weight_only = load(FIXTURES / name, device="cpu", dtype="float32")
    wo_logits = first_step_logits(weight_only.model, PROMPTS[0])
    monkeypatch.setenv("DGEMMA_W8A8", "on")
    q_engine = load(FIXTURES / name, device="cpu", dtype="float32")
    assert q_engine.model.layers[0].mlp.up_proj.mode(torch.device("cpu")) == "emulate"
    ref = reference_w8a8_model(path, q_engine.model, kind)
    q_logits, r_logits = first_step_logits(q_engine.model, PROMPTS[0]), first_step_logits(ref, PROMPTS[0])
    torch.testing.assert_close(q_logits, r_logits, rtol=1e-5, atol=1e-5)
    assert (q_logits - wo_logits).abs().max() > 1e-3  # the activations really were quantized
    assert generate(q_engine) == generate(Engine(ref, None, q_engine.settings))


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("rows", [1, 5, 17, 40])
def test_torch_fp8_and_int8_matmuls_agree_with_the_emulation(kind, rows):
    """The GPU path's ops (torch._scaled_mm, torch._int_mm) run on the CPU too and agree with the emulation up to
    float32 rounding; INT8's integer sums are exact, so it gives the bits of (xq @ wq^T) * scale_x * scale_w."""
    g = torch.Generator().manual_seed(rows)
    N, K = 48, 64
    w = torch.randn(N, K, generator=g)
    scale = (w.abs().amax(-1, keepdim=True) / w8a8.QMAX[kind]).bfloat16().float()
    q = (w / scale).clamp(-w8a8.QMAX[kind], w8a8.QMAX[kind])
    q = q.to(torch.float8_e4m3fn) if kind == "fp8" else torch.round(q).to(torch.int8)
    x = torch.randn(rows, K, generator=g) * torch.rand(rows, 1, generator=g) * 4
    hw = w8a8.matmul_hw(x, q, scale, kind)
    emulated = w8a8.matmul_emulated(x, q, scale, kind)
    assert hw.shape == (rows, N)
    torch.testing.assert_close(hw, emulated, rtol=1e-5, atol=1e-5)
    if kind == "int8":
        xq, sx = w8a8.quantize_tokens(x, kind)
        assert torch.equal(hw, (xq.float() @ q.float().T) * sx * scale.T)
    assert not torch.equal(emulated, F.linear(x, w8a8.dequantize(q, scale)))  # activations quantized


@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_hardware_w8a8_on_cuda_matches_the_emulation(name, monkeypatch):
    kind, _ = CASES[name]
    cuda = torch.device("cuda")
    if not w8a8.hardware(kind, cuda):
        pytest.skip(f"this GPU has no {kind} tensor cores")
    engine = load(FIXTURES / name, device="cuda", dtype="bfloat16")
    lin = engine.model.layers[0].mlp.gate_proj  # [48, 32]: multiples of 16
    assert lin.mode(cuda) == "hw"
    for rows in (1, 5, 17, 40):
        x = torch.randn(rows, 32, device=cuda, dtype=torch.bfloat16)
        hw = w8a8.matmul(x, lin.weight, lin.weight_scale, kind, "hw").float()
        emulated = w8a8.matmul(x, lin.weight, lin.weight_scale, kind, "emulate").float()
        # The same products summed in float32 (int8: exact integer sums), each rounded to bf16: at most about one
        # bf16 step apart (2**-7 relative), plus a little for sums that cancel; and no systematic error (a 2-3%
        # error on these outputs, whose median is about 0.07, passed the old rtol = atol = 1e-2).
        err = (hw - emulated).abs()
        assert (err <= emulated.abs() * 2**-7 + 1e-3 * emulated.abs().max()).all(), err.max()
        assert err.mean() <= 2**-8 * emulated.abs().mean()
    # The whole model: its first-step logits on the GPU equal the CPU's float32 emulation of the same W8A8
    # arithmetic within bf16's rounding, not merely "some tokens came out".
    def first_step_logits(model, ids: list[int]) -> torch.Tensor:  # on the model's device, as a CPU tensor
        dev, C = model.device, model.cfg.canvas_length
        with torch.no_grad():
            cache = model.new_cache(1, len(ids) + C)
            model.encode(torch.tensor([ids], device=dev), cache)
            canvas = torch.randint(0, model.cfg.text.vocab_size, (1, C), generator=torch.Generator().manual_seed(1))
            return model.denoise(canvas.to(dev), cache, model.denoise_context(cache, 1)).float().cpu()

    ids = [2, 200, 201, 202]
    gpu_logits = first_step_logits(engine.model, ids)
    monkeypatch.setenv("DGEMMA_W8A8", "on")  # the CPU runs the float32 emulation of the W8A8 arithmetic
    cpu_logits = first_step_logits(load(FIXTURES / name, device="cpu", dtype="float32").model, ids)
    assert (gpu_logits - cpu_logits).abs().max() <= 0.03 * cpu_logits.abs().max()


def test_probe_of_the_hardware_matmuls(monkeypatch, capsys):
    """The first-use check a GPU's FP8/INT8 path passes through, run here on the CPU (where the ops exist too): it
    passes, and a matmul that fails or disagrees turns the path off with one line."""
    cpu = torch.device("cpu")
    assert w8a8.probe("fp8", cpu) and w8a8.probe("int8", cpu)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(torch, "_scaled_mm", broken)
    assert not w8a8.probe("fp8", cpu)
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: torch.zeros(a.shape[0], b.shape[1], dtype=torch.int32))
    assert not w8a8.probe("int8", cpu)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dgemma: torch's fp8 matmul failed to run (no kernel image is available for execution on the "
                   "device) on this device; not using it",
                   "dgemma: torch's int8 matmul disagrees with the emulation on this device; not using it"]


def test_per_token_activation_quantization_by_hand():
    x = torch.tensor([[448.0, -224.0, 1.0, 0.0], [2.0, -1.0, 0.5, 0.3], [0.0, 0.0, 0.0, 0.0]])
    q, s = w8a8.quantize_tokens(x, "fp8")
    assert s[:2, 0].tolist() == [1.0, torch.tensor(2.0 / 448).item()]  # amax / 448 in float32
    assert q.float()[0].tolist() == [448.0, -224.0, 1.0, 0.0]
    assert q.float()[1, :3].tolist() == [448.0, -224.0, 112.0]
    assert q.float()[1, 3].item() == 64.0  # 0.3 * 224 = 67.2 -> nearest e4m3 (step 8 in [64, 128))
    assert torch.equal(q.float()[2], torch.zeros(4))
    qi, si = w8a8.quantize_tokens(torch.tensor([[127.0, -63.5, 0.5, 1.5]]), "int8")
    assert si.item() == 1.0 and qi.tolist() == [[127, -64, 0, 2]]  # round half to even


def test_a_bad_w8a8_switch_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("DGEMMA_W8A8", "sometimes")
    assert run_main(["run", "--model", str(FIXTURES / "ct_int8_dynamic"), "--device", "cpu", "--view", "none",
                     "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "DGEMMA_W8A8 must be one of auto, off, on" in err[0]


def test_w8a8_switch(monkeypatch):
    cpu = torch.device("cpu")
    assert w8a8.mode("fp8", cpu) == "weights"
    monkeypatch.setenv("DGEMMA_W8A8", "on")
    assert w8a8.mode("int8", cpu) == "emulate"
    monkeypatch.setenv("DGEMMA_W8A8", "off")
    assert w8a8.mode("int8", cpu) == "weights"
    monkeypatch.setenv("DGEMMA_W8A8", "sometimes")
    with pytest.raises(ValueError, match="DGEMMA_W8A8"):
        w8a8.mode("int8", cpu)


def test_int8_weight_only_through_the_fused_kernels(monkeypatch):
    """The INT8 experts and linears take dgemma's Triton INT8 kernels on the weight-only path ([N, 1] scales are
    [N] in memory); here in Triton's interpreter, against the reference on the same weights."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)")
    engine = load(FIXTURES / "ct_int8_dynamic", device="cpu", dtype="float32")
    experts = engine.model.layers[0].experts
    lin = engine.model.layers[0].mlp.gate_proj
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 32, generator=g)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(6)])
    wts = torch.rand(6, 2, generator=g)
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")
    ref_e, ref_l = experts(x, idx, wts), lin(x)
    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    assert experts.gate_up_proj.fused_experts(experts.down_proj, x, idx, wts) is not None
    torch.testing.assert_close(experts(x, idx, wts), ref_e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x), ref_l, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- refusals


def with_config(tmp_path: Path, edit) -> Path:
    out = tmp_path / "ct"
    shutil.copytree(FIXTURES / "ct_fp8_dynamic", out)
    config = json.loads((out / "config.json").read_text())
    edit(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config))
    return out


def group(qc: dict) -> dict:
    return next(iter(qc["config_groups"].values()))


def second_int_group(qc: dict, naive: bool = False) -> None:
    """An INT8 group for the experts beside the FP8 one: with its own format, or (naive) under the generic
    `naive-quantized` format with none per group."""
    g = json.loads(json.dumps(group(qc)))
    g["weights"]["type"] = g["input_activations"]["type"] = "int"
    g["format"] = "int-quantized"
    g["targets"] = ["re:.*experts.*"]
    qc["config_groups"]["group_1"] = g
    if naive:
        qc["format"] = "naive-quantized"
        for each in qc["config_groups"].values():
            each.pop("format")


REFUSED = {
    "pack-quantized": (lambda qc: qc.update(format="pack-quantized"), "format 'pack-quantized'"),
    "nvfp4": (lambda qc: qc.update(format="nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized'"),
    "asymmetric": (lambda qc: group(qc)["weights"].update(symmetric=False), "symmetric=False"),
    "group": (lambda qc: group(qc)["weights"].update(strategy="group", group_size=128), "strategy='group'"),
    "static activations": (lambda qc: group(qc)["input_activations"].update(dynamic=False, strategy="tensor"),
                           "strategy='tensor'"),
    "4-bit": (lambda qc: group(qc)["weights"].update(num_bits=4), "num_bits=4"),
    "weight-only": (lambda qc: group(qc).update(input_activations=None), "weight-only"),
    "mixed formats": (lambda qc: qc.update(format="mixed-precision"), "mixed-precision"),
    "mixed group formats": (second_int_group, "group 'group_1' has format 'int-quantized'"),
    "mixed schemes": (lambda qc: second_int_group(qc, naive=True), "groups mix schemes (FP8_DYNAMIC: float, "
                      "group_1: int)"),
    "int weights, float activations": (lambda qc: (qc.update(format="int-quantized"),
                                                   group(qc).update(format="int-quantized"),
                                                   group(qc)["weights"].update(type="int")),
                                       "input activations (group 'FP8_DYNAMIC') are float"),
    "frozen": (lambda qc: qc.update(quantization_status="frozen"), "quantization_status 'frozen'"),
    "transform": (lambda qc: qc.update(transform_config={"config_groups": {"R1": {}}}), "transform_config"),
    "class target": (lambda qc: group(qc).update(targets=["Embedding"]), "target 'Embedding'"),
    "bad regex": (lambda qc: qc["ignore"].append("re:(unclosed"), "'re:(unclosed'"),
    "ignored but stored quantized": (lambda qc: qc["ignore"].append("re:.*self_attn.*"),
                                     "self_attn.q_proj is stored quantized but the checkpoint's ignore list"),
    "targeted but stored float": (lambda qc: qc["ignore"].remove("re:.*router.*"),
                                  "router.proj is stored unquantized"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unsupported_or_inconsistent_configs_are_refused_in_one_line(case, tmp_path, capsys):
    edit, expected = REFUSED[case]
    out = with_config(tmp_path, edit)
    with pytest.raises(ModelError, match=None) as e:
        load(out, device="cpu", dtype="float32")
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert run_main(["run", "--model", str(out), "--device", "cpu", "--view", "none", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0]


def test_tensors_of_another_dtype_are_refused(tmp_path):
    """An int8 tensor under a float-quantized description: named, with the dtype the format wants."""
    out = with_config(tmp_path, lambda qc: None)
    tensors = load_file(out / "model.safetensors")
    name = "model.decoder.layers.1.mlp.up_proj.weight"
    tensors[name] = torch.zeros(tensors[name].shape, dtype=torch.int8)
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ModelError, match=f"{name} has dtype torch.int8, expected torch.float8_e4m3fn"):
        load(out, device="cpu", dtype="float32")


def test_the_format_module_is_the_only_place_that_knows_it():
    """The loader reaches the format through quant.formats: its label and layouts come from there."""
    from dgemma_cli.checkpoint.weights import read_format, read_quant_format

    for name, (kind, _) in CASES.items():
        config = json.loads((FIXTURES / name / "config.json").read_text())
        fmt = read_format(FIXTURES / name, config)
        assert type(fmt).__module__ == "quant.formats.compressed_tensors"
        assert read_quant_format(FIXTURES / name, config) == kind
        assert fmt.ignored("model.decoder.layers.0.router.proj")
        assert not fmt.ignored("model.decoder.layers.0.mlp.up_proj")
        assert fmt.targets("model.decoder.layers.0.experts.3.down_proj")
        assert not fmt.targets("model.decoder.self_conditioning.gate_proj")
