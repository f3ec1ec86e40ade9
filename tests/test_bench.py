"""`dgemma bench` on the CPU at a tiny config; on CUDA only: the graphed denoise step against the eager one, and the
Triton path's tokens against the torch path's."""

import json
import sys

import pytest
import torch

from cli_helpers import run_main
from dgemma_cli import bench
from dgemma_cli import engine as engine_mod
from dgemma_cli.bench import (TINY, compare_kernel_paths, experts_hit, floor_bytes, median_step_ms, random_model,
                              statistic)
from dgemma_cli.config import DIFFUSIONGEMMA_26B_A4B, GenerationSettings, ModelConfig
from dgemma_cli.sampler import Done

CPU = torch.device("cpu")


def tiny_elements() -> tuple[int, int]:
    """The TINY config's decoder-step weights counted by hand, in elements: (routed experts, everything else).
    Layer 0 is sliding (4 heads x 16, 2 kv heads), layer 1 full (4 heads x 32, 1 kv head of 32, no v_proj)."""
    sliding_attn = 64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 16 + 16  # q, k, v, o, q_norm, k_norm
    full_attn = 128 * 64 + 32 * 64 + 64 * 128 + 32 + 32  # q, k, o, q_norm, k_norm
    per_layer = 3 * 96 * 64 + (64 + 8 + 8 * 64) + 7 * 64  # dense MLP, router (scale, expert scales, proj), norms
    top = 512 * 64 + 64 + (64 + 3 * 96 * 64) + 2  # embedding, final norm, self-conditioning, decoder layer scalars
    experts = 2 * (8 * 64 * 64 + 8 * 64 * 32)  # per layer gate_up [8, 64, 64] and down [8, 64, 32]
    return experts, sliding_attn + full_attn + 2 * per_layer + top


HIT = 1 - (1 - 2 / 8) ** 32  # expected share of TINY's 8 experts (top-2) that 32 canvas tokens reach


@pytest.mark.parametrize("fmt,policy", [("bf16", "experts"), ("int8", "experts"), ("nvfp4", "all"),
                                        ("gguf-q4_k_m", "experts")])
def test_bench_reports_consistent_figures(capsys, fmt, policy):
    args = ["bench", "--config", "tiny", "--format", fmt, "--policy", policy, "--prompt", "20", "--steps", "5",
            "--device", "cpu", "--json"]
    assert run_main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ms_per_step"] > 0 and r["prefill_ms"] >= 0
    C = TINY["canvas_length"]
    assert r["tokens_per_s"] == pytest.approx(r["batch"] * C * 1000 / (r["ms_per_step"] * r["steps"]))
    assert r["floor_ms"] == pytest.approx(1000 * r["floor_bytes"] / (r["bandwidth_gbs"] * 1e9))
    assert r["floor_ratio"] == pytest.approx(r["ms_per_step"] / r["floor_ms"])
    assert r["peak_memory_gb"] is None  # CPU
    assert r["graph_replays"] == 0  # no CUDA graph on the CPU
    assert r["statistic"] == statistic(5, 1)
    assert r["canvas_vocab_bytes"] == 4 * C * 512 * 4
    assert r["reference_ms_per_step"] is None and r["reference_mode"] is None


def test_bench_says_each_phase_as_it_starts(monkeypatch):
    heard = []
    real = bench.random_model
    monkeypatch.setattr(bench, "random_model", lambda *a, **k: (heard.append("(built)"), real(*a, **k))[1])
    bench.run_bench("tiny", "bf16", prompt=20, steps=5, device="cpu", dtype="float32", note=heard.append)
    assert heard[:2] == ["building tiny with random bf16 weights on cpu (float32)", "(built)"]  # said before it ran
    assert heard[2:] == ["warming up (5 steps)", "timing 5 steps (batch 1, prompt 20)",
                         "timing the prefill and the device's copy bandwidth"]


@pytest.mark.parametrize("terminal", [True, False])
def test_bench_command_says_its_phases_on_a_terminal_stderr(capsys, monkeypatch, terminal):
    """A long run is not silent where a person watches stderr; stdout keeps only the JSON object either way."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    args = ["bench", "--config", "tiny", "--format", "bf16", "--prompt", "20", "--steps", "5", "--device", "cpu",
            "--json"]
    assert run_main(args) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["ms_per_step"] > 0
    if terminal:
        assert err.splitlines()[0].startswith("dgemma: bench: building tiny with random bf16 weights on cpu")
        assert len(err.splitlines()) == 4 and all(line.startswith("dgemma: bench: ") for line in err.splitlines())
    else:
        assert err == ""


def test_floor_is_the_weights_one_step_reads_over_the_peak_bandwidth(monkeypatch):
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 2e9)
    r = bench.run_bench("tiny", "bf16", batch=1, prompt=20, steps=5, device="cpu", dtype="bfloat16")
    experts, rest = tiny_elements()
    assert r.floor_bytes == int(2 * rest + 2 * experts * HIT)  # bf16: 2 bytes an element, each tensor read once
    assert r.bandwidth_gbs == 2.0
    assert r.floor_ms == pytest.approx(1000 * r.floor_bytes / 2e9)
    assert r.floor_ratio == pytest.approx(r.ms_per_step / r.floor_ms)
    # beside the floor, not in it: the embedding read again, 4 canvas x vocab float32 passes, the KV cache read
    assert r.soft_embedding_bytes == 2 * 512 * 64
    assert r.canvas_vocab_bytes == 4 * 32 * 512 * 4
    # K and V, bf16: the sliding layer sees window - 1 = 15 cached positions + the canvas, the full one 20 + 32
    assert r.kv_cache_bytes == 2 * 2 * ((15 + 32) * 2 * 16 + (20 + 32) * 1 * 32)
    table = r.table()
    assert "median of 4 step-to-step intervals" in table and "not in the floor" in table


def test_floor_counts_each_tensor_in_the_format_it_is_held_in():
    cfg = ModelConfig.from_dict(TINY)
    experts, rest = tiny_elements()
    assert floor_bytes(random_model(cfg, "bf16", "experts", CPU, torch.float32), 1) == int(4 * rest + 4 * experts * HIT)
    # NVFP4 experts: codes (half a byte), one e4m3 scale per 16 inputs, float32 global scales [E, segments]
    packed = 2 * (8 * 64 * (32 + 4) + 8 * 2 * 4 + 8 * 64 * (16 + 2) + 8 * 1 * 4)
    m = random_model(cfg, "nvfp4", "experts", CPU, torch.bfloat16)
    assert floor_bytes(m, 1) == int(2 * rest + packed * HIT)
    assert experts_hit(ModelConfig.from_dict(DIFFUSIONGEMMA_26B_A4B), 1) > 0.9999  # 256 tokens x top-8 of 128: all


def test_median_step_ms_takes_intervals_within_each_canvas():
    stamps = [0.0, 1.0, 3.0, 6.0, 100.0, 102.0, 103.0, 107.0]  # two canvases of 4 steps, seconds
    assert median_step_ms(stamps, 4) == pytest.approx(2000.0)  # median of 1 2 3 | 2 1 4; the gap between canvases
    assert statistic(16, 2).startswith("median of 30 step-to-step intervals")


def test_reference_reports_the_same_statistic(capsys):
    args = ["bench", "--config", "tiny", "--format", "bf16", "--prompt", "20", "--steps", "5", "--device", "cpu",
            "--compare", "transformers-eager"]
    assert run_main([*args, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["reference_ms_per_step"] > 0 and r["reference_mode"] == "eager (dynamic cache), as asked"
    assert r["speedup_vs_reference"] == pytest.approx(r["reference_ms_per_step"] / r["ms_per_step"])
    assert run_main(args) == 0
    assert "(the same statistic)" in capsys.readouterr().out


@pytest.mark.slow
def test_reference_runs_its_compiled_static_cache_path():
    assert bench.reference_has_compiled_path()  # the installed transformers has it
    r = bench.run_bench("tiny", "bf16", prompt=20, steps=5, device="cpu", compare="transformers")
    assert r.reference_mode == "compiled (static cache, torch.compile)" and r.reference_ms_per_step > 0


def test_random_model_keeps_packed_dtypes():
    cfg = ModelConfig.from_dict(TINY)
    m = random_model(cfg, "nvfp4", "all", CPU, torch.bfloat16)
    stack = m.layers[0].experts.gate_up_proj
    assert stack.weight.dtype == torch.uint8 and stack.weight_scale.dtype == torch.float8_e4m3fn
    assert stack.weight_scale_2.dtype == torch.float32
    assert m.embed_tokens.weight.dtype == torch.bfloat16 and m.layers[0].self_attn.q_proj.weight.dtype == torch.uint8
    assert torch.isfinite(m.layers[0].experts.weights(torch.float32)[0]).all()


def test_a_random_gguf_model_is_held_as_the_file_would_be():
    """--format gguf-q4_k_m: the experts, the projections and the embedding as GGUF blocks of the mix's types, their
    f16 scales small, so every decoded weight is finite and of the size of the other formats' random weights."""
    from quant.ggml_modules import GGUFEmbedding, GGUFLinear, GGUFStack

    m = random_model(ModelConfig.from_dict(TINY), "gguf-q4_k_m", "experts", CPU, torch.bfloat16)
    assert isinstance(m.embed_tokens, GGUFEmbedding) and isinstance(m.layers[0].self_attn.q_proj, GGUFLinear)
    assert isinstance(m.layers[0].experts.gate_up_proj, GGUFStack) and m.dtype == torch.bfloat16
    for w in (m.embed_tokens.rows(0, 512, torch.float32), m.layers[0].self_attn.q_proj.dequantize(torch.float32),
              m.layers[1].experts.down_proj.dequantize_experts(0, 2, torch.float32)):
        assert torch.isfinite(w).all() and 0 < w.abs().max() < 10


def test_bench_usage_errors(capsys, monkeypatch):
    for args in (["--format", "fp4"], ["--steps", "2"], ["--config", "nowhere"], ["--compare", "something-else"]):
        assert run_main(["bench", "--device", "cpu", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("dgemma: error:")
    monkeypatch.setenv("DGEMMA_SAMPLER", "bogus")
    assert run_main(["bench", "--device", "cpu", "--config", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "DGEMMA_SAMPLER" in err[0]


# ----------------------------------------------------------------------------- CUDA-graph bookkeeping


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: a replay computes nothing (only the counts matter here)."""

    def replay(self):
        pass


def fake_cuda_graphs(monkeypatch, fail: bool):
    from contextlib import contextmanager

    @contextmanager
    def graph(g, pool=None):
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        yield

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(engine_mod, "make_denoiser", engine_mod.GraphedDenoiser)


def tiny_stats(**overrides) -> Done:
    cfg = ModelConfig.from_dict(TINY)
    engine = engine_mod.Engine(random_model(cfg, "bf16", "experts", CPU, torch.float32), None,
                               GenerationSettings(eos_token_ids=(-1,), confidence_threshold=1e-12))
    done = [ev for ev in engine.events([[5, 6, 7]], seed=0, max_new_tokens=64, max_denoising_steps=4, **overrides)
            if isinstance(ev, Done)]
    return done[0]


def test_done_event_counts_graph_captures_and_replays(monkeypatch):
    assert tiny_stats().stats == {"graph_captures": 0, "graph_replays": 0, "graph_fallback": None}  # CPU: eager
    fake_cuda_graphs(monkeypatch, fail=False)
    # per canvas: step 1 eager (no self-conditioning), step 2 eager then captured, steps 3 and 4 replayed
    assert tiny_stats().stats == {"graph_captures": 2, "graph_replays": 4, "graph_fallback": None}


def test_a_step_the_host_takes_part_in_keeps_its_forward_graph(monkeypatch):
    """A step that is not graphed whole (constrained rows: the host searches each step's log-probabilities) still
    has its forward pass captured once per canvas and replayed, as before the whole step was one graph."""
    from dgemma_cli.sampler import SamplerBuffers

    fake_cuda_graphs(monkeypatch, fail=False)
    cfg = ModelConfig.from_dict(TINY)
    model = random_model(cfg, "bf16", "experts", CPU, torch.float32)
    C, V = cfg.canvas_length, cfg.text.vocab_size
    d = engine_mod.GraphedDenoiser(model, 1, 3 + C)
    d.encode(torch.tensor([[5, 6, 7]]), None)
    d.start_canvas()
    buf, canvas = SamplerBuffers(C, V, CPU), torch.randint(0, V, (1, C))
    for k in range(4):  # step 1 eager, step 2 eager then its forward captured, steps 3 and 4 replay the forward
        d.run_step(lambda: d.denoise(canvas, buf, k > 0), graphable=False)
    assert d.stats() == {"graph_captures": 1, "graph_replays": 2, "graph_fallback": None}


def test_failed_capture_is_recorded_not_silent(monkeypatch):
    fake_cuda_graphs(monkeypatch, fail=True)
    stats = tiny_stats().stats
    assert stats["graph_captures"] == 0 and stats["graph_replays"] == 0
    assert stats["graph_fallback"] == "operation not permitted when stream is capturing"


@pytest.mark.slow  # make test's time: the slow suite (CI) runs it
def test_kernel_path_comparison_on_the_cpu():
    r = compare_kernel_paths("bf16", device="cpu", dtype="float32", steps=4)
    # float32: the fused norms differ from the torch ops by summation order only (measured 1.8e-6 at the worst)
    assert r["passed"] and r["tokens_equal"] and r["first_step_logit_rel_diff_worst"] <= 1e-5
    assert r["tokens_compared"] == 2 * 2 * TINY["canvas_length"] and r["triton_kernels"] == {"rms_norm": True}


# ----------------------------------------------------------------------------- on CUDA


@pytest.mark.gpu
def test_graphed_denoise_step_equals_eager():
    from dgemma_cli.engine import GraphedDenoiser, ModelDenoiser

    cfg = ModelConfig.from_dict(TINY)
    model = random_model(cfg, "nvfp4", "experts", torch.device("cuda"), torch.bfloat16)
    V, C = cfg.text.vocab_size, cfg.canvas_length
    prompt = torch.randint(0, V, (2, 40), device="cuda")
    from dgemma_cli.sampler import SamplerBuffers

    g = torch.Generator("cuda").manual_seed(0)
    for head in (None, (cfg.text.hidden_size, torch.bfloat16)):  # the torch path's logits; the fused head's draws
        outs, denoisers = [], []
        for cls in (ModelDenoiser, GraphedDenoiser):
            d = cls(model, 2, 40 + C)
            d.encode(prompt, None)
            d.start_canvas()
            buf = SamplerBuffers(2 * C, V, "cuda", head)
            results = []
            for step in range(3):
                g.manual_seed(step)
                canvas = torch.randint(0, V, (2, C), device="cuda", generator=g)
                if head is None:  # the previous step's softmax, in place
                    buf.probs.copy_(torch.softmax(torch.randn(2 * C, V, device="cuda", generator=g), -1))
                else:  # its soft embedding, this step's temperature and uniforms, in place
                    buf.fused.soft.copy_(torch.randn(2 * C, cfg.text.hidden_size, device="cuda", generator=g))
                    buf.temperature.fill_(0.5 + 0.1 * step)
                    buf.uniforms.uniform_(generator=g)
                d.denoise(canvas, buf, step > 0)
                results.append([t.clone() for t in ((buf.logits,) if head is None else
                                                    (buf.fused.sample, buf.fused.argmax, buf.fused.entropy,
                                                     buf.fused.soft))])
            outs.append(results)
            denoisers.append(d)
        # step 1 eager, step 2 eager then captured, step 3 replayed: a silent eager fallback fails here
        assert denoisers[1].stats() == {"graph_captures": 1, "graph_replays": 1, "graph_fallback": None}
        assert denoisers[0].stats()["graph_replays"] == 0
        for a, b in zip(*outs):
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,policy", [("bf16", "experts"), ("nvfp4", "all"), ("int8", "all"), ("nvfp4", "experts")])
def test_triton_path_gives_the_torch_paths_tokens(fmt, policy):
    """bf16 weights on CUDA: the engine's default path (Triton switch, CUDA graphs) against DGEMMA_KERNELS=torch
    run eagerly, with the same random draws (the torch sampler on both sides): identical tokens and logits. The
    quantized formats: first-step logits within LOGIT_TOL and most tokens equal (bench.py says why)."""
    r = compare_kernel_paths(fmt, policy, device="cuda", dtype="bfloat16")
    assert r["passed"], r["failures"]
    assert r["graph"]["triton"]["graph_replays"] >= 1 and r["graph"]["torch"]["graph_replays"] == 0
    if fmt == "bf16":
        assert r["tokens_equal"] and r["first_step_logit_rel_diff"] == 0
    else:
        assert all(r["triton_kernels"].values()) and r["triton_kernels"]


@pytest.mark.parametrize("fmt,policy", [("int8", "all"), ("nvfp4", "experts"), ("nvfp4", "all")])
def test_the_kernel_check_fails_a_bug_confined_to_some_positions(fmt, policy):
    """The verdict on the Triton path against the torch path: a median within tolerance is not enough when a third
    of the positions are far off (an expert or a tile computed wrong), while the rare router near-tie of two
    correct paths (measured: at most 1 position of 64) passes."""
    from dgemma_cli.bench import LOGIT_TOL, judge

    tol = LOGIT_TOL[fmt, policy]
    healthy = torch.full((64,), tol / 2)
    healthy[7] = 0.5  # one near-tie
    assert judge(healthy, 0.9, fmt, policy)[2] == []
    broken = healthy.clone()
    broken[:21] = 0.3  # a third of the positions wrong: the median is still within tolerance
    assert broken.median() <= tol
    rel, share, failures = judge(broken, 0.9, fmt, policy)
    assert rel <= tol and share > 0.3 and any("positions differ" in f for f in failures)
    assert judge(healthy, 0.4, fmt, policy)[2]  # too few tokens agree


def _streaming_size(cfg: ModelConfig, context: int, streamed: int) -> int:
    """The largest card size at which `cfg` (bf16, batch 1) streams `streamed` layers at `context` tokens."""
    from plan_sizes import card_size

    return card_size(cfg, "bf16", lambda p: len(p.streamed) >= streamed, context=context)


def test_bench_with_gpu_memory_streams_the_experts_that_do_not_fit(capsys, monkeypatch, checkpoints):
    made = []
    real = bench.random_model
    monkeypatch.setattr(bench, "random_model", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    cfg = ModelConfig.from_dir(checkpoints["five_to_one"])
    size = _streaming_size(cfg, 20 + cfg.canvas_length, 4)
    args = ["bench", "--config", str(checkpoints["five_to_one"]), "--format", "bf16", "--prompt", "20", "--steps", "5",
            "--device", "cpu", "--json", "--gpu-memory", f"{size / 1e6:.6f}MB"]
    assert run_main(args) == 0
    r = json.loads(capsys.readouterr().out)
    stream = made[0].expert_streams[0]
    n = len(stream.layers)
    assert r["streamed_layers"] == n >= 4 and r["gpu_memory_gb"] == pytest.approx(size / 1e9, rel=1e-6)
    t = cfg.text
    assert r["streamed_bytes_per_step"] == n * 3 * t.num_experts * t.moe_intermediate_size * t.hidden_size * 2
    assert stream.copies >= n * 10  # every streamed layer at every step (warm-up and timed)
    assert all(t.device.type == "cpu" for h in stream.host.values() for t in h.values())
    capsys.readouterr()
    assert run_main(args[:-1] + ["300MB"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not fit" in err, err


# ----------------------------------------------------------------------------- make bench-gpu (scripts/bench_gpu.py)


def _bench_gpu():
    """scripts/bench_gpu.py as a module (loaded once; its dataclass needs its module in sys.modules)."""
    import importlib.util
    from pathlib import Path

    if "bench_gpu_script" not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "scripts" / "bench_gpu.py"
        spec = importlib.util.spec_from_file_location("bench_gpu_script", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_gpu_script"]


def test_bench_gpu_plan_fits_eight_minutes_and_lists_every_part():
    from pathlib import Path

    g = _bench_gpu()
    assert g.TOTAL_S == 480 and g.planned_seconds() <= 480
    text = g.plan_text()
    assert all(p.label in text for p in g.PARTS)
    assert text.count("not timed:") == sum(p.budget is None for p in g.PARTS) >= 1
    assert f"{g.planned_seconds()}  of 480 s" in text
    kinds = [p.kind for p in g.PARTS]
    assert kinds[:2] == ["setup", "doctor"] and kinds[-1] == "report"
    # the steps: NVFP4 and FP8 W8A8 at batch 1 and 4, NVFP4 streamed at 12 GB, each beside its bound
    benches = {(p.bench["fmt"], p.bench["batch"], p.bench.get("gpu_memory")) for p in g.PARTS if p.kind == "bench"}
    assert {("nvfp4", 1, None), ("nvfp4", 4, None), ("nvfp4", 1, 12 * 10**9), ("fp8", 1, None),
            ("fp8", 4, None), ("gguf-q4_k_m", 1, None)} <= benches
    assert all(p.bench["fmt"] in bench.FORMATS for p in g.PARTS if p.kind == "bench")
    assert {p.bound for p in g.PARTS if p.kind == "bench" and p.bench["fmt"] == "fp8"} == {("w8a8-fp8", 1),
                                                                                       ("w8a8-fp8", 4)}
    bounds = g.static_bounds((Path(__file__).resolve().parent.parent / "BENCHMARKS.md").read_text())
    assert ("H100 SXM", "w8a8-fp8", 1) in bounds and ("H100 SXM", "nvfp4", 4) in bounds  # the report has them
    # the GGUF row's bound comes from the GGUF step table (consumer cards only: an H100 run has none to show)
    assert {p.bound for p in g.PARTS if p.kind == "bench" and p.bench["fmt"].startswith("gguf")} == {
        ("gguf-q4_k_m", 1)} and ("RTX 4090", "gguf-q4_k_m", 1) in bounds


def test_bench_gpu_plan_touches_no_gpu():
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_gpu.py"
    code = (f"import runpy, sys; sys.argv = [{str(script)!r}, '--plan']\n"
            f"try:\n    runpy.run_path({str(script)!r}, run_name='__main__')\n"
            "except SystemExit as e:\n    rc = e.code\n"
            "assert rc == 0 and 'torch' not in sys.modules, rc")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "total" in p.stdout and "of 480 s" in p.stdout


def test_bench_gpu_skips_a_part_the_time_left_cannot_hold():
    g = _bench_gpu()
    P = g.Part
    parts = [P("setup", 10, "setup"), P("a", 100, "bench"), P("b", 100, "bench"), P("c", 50, "bench"),
             P("d", 60, "bench"), P("e", None, "not timed", "no such format"), P("report", 20, "report")]
    now = [5.0]  # the fake clock: 5 s went to the setup before the runner started
    took = {"a": 100, "b": 150, "c": 40, "d": 60}  # b overran its budget (its subprocess stopped late)
    ran, heard = [], []

    def run(p):
        ran.append(p.label)
        now[0] += took[p.label]
        return {"ms_per_step": 1.0}

    r = g.run_parts(parts, run, clock=lambda: now[0], start=0.0, total=300, record=lambda k, v: heard.append(k))
    # 300 s less the report's 20: a at 5 (100 fits), b at 105 (100 fits), c at 255 (25 left < 50), d at 255 (< 60)
    assert ran == ["a", "b"]
    assert r["setup"]["seconds"] == 5.0
    assert r["a"]["seconds"] == 100 and r["b"]["seconds"] == 150 and r["a"]["budget_s"] == 100
    assert r["c"] == {"skipped": "budget", "elapsed_s": 255.0, "budget_s": 50}
    assert r["d"]["skipped"] == "budget" and r["e"] == {"not timed": "no such format"}
    assert "report" not in r and heard == ["setup", "a", "b", "c", "d", "e"]
    # with time to spare every part runs, in order
    now[0], ran[:] = 0.0, []
    took["b"] = 100
    g.run_parts(parts, run, clock=lambda: now[0], start=0.0, total=400)
    assert ran == ["a", "b", "c", "d"]


def test_bench_gpu_records_the_doctor_or_its_absence(tmp_path):
    g = _bench_gpu()
    env = dict(__import__("os").environ)
    missing = [sys.executable, "-c", "import sys; sys.stderr.write(\"dgemma: error: No such command 'doctor'.\\n\"); "
               "sys.exit(2)"]
    r = g.run_doctor(tmp_path / "doctor.json", env, 30, command=missing)
    assert r["status"] == "not available" and r["report"] is None and not r["passed"]
    turned_off = [sys.executable, "-c", f"import json, sys; open({str(tmp_path / 'doctor.json')!r}, 'w').write("
                  "json.dumps({'ok': False})); sys.exit(1)"]
    r = g.run_doctor(tmp_path / "doctor.json", env, 30, command=turned_off)
    assert r["status"] == "a kernel family turned off or a check failed" and r["report"] == {"ok": False}
    slow = [sys.executable, "-c", "import time; time.sleep(30)"]
    r = g.run_doctor(tmp_path / "doctor.json", env, 1, command=slow)
    assert r["status"] == "timed out after 1 s" and r["returncode"] is None


def _fake_results(g, **parts) -> dict:
    row = dict(ms_per_step=7.5, tokens_per_s=2131.0, peak_memory_gb=16.2, graph_replays=14, floor_ms=4.0,
               floor_ratio=1.875, gpu_memory_gb=None, streamed_layers=0, streamed_bytes_per_step=0,
               host_to_device_gbs=None)
    base = {label: {"skipped": "budget", "elapsed_s": 470.0, "budget_s": 40} for label in
            (p.label for p in g.PARTS if p.kind == "bench")}
    base.update({p.label: {"not timed": p.what} for p in g.PARTS if p.budget is None})
    base.update({label: dict(row, **value) if value is not None else row for label, value in parts.items()})
    return {"date": "2030-01-02", "commit": "abc1234", "dry_run": False, "budget_s": 480, "seconds": 471.0,
            "device": {"name": "NVIDIA H100 80GB HBM3", "torch": "9.9", "triton": "9.9"},
            "doctor": {"status": "passed"}, "parts": base}


def test_bench_gpu_writes_only_the_measured_rows_into_benchmarks(tmp_path):
    from pathlib import Path

    g = _bench_gpu()
    real = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
    before_real = real.read_text()
    copy = tmp_path / "BENCHMARKS.md"
    copy.write_text(before_real)
    assert g.BENCH_BEGIN in before_real and g.NOT_YET in before_real

    # nothing measured (every row skipped, errors, timeouts): nothing written
    results = _fake_results(g)
    results["parts"]["nvfp4 (all) b4 p256"] = {"error": "timed out after 45 s (its budget)"}
    assert g.write_benchmarks(results, copy) is False and copy.read_text() == before_real

    bound = g.static_bounds(before_real)[("H100 SXM", "nvfp4", 1)]  # the kernel report's, read from the file
    results = _fake_results(g, **{"nvfp4 (all) b1 p256": None, "nvfp4 (all) b1 p256 in 12 GB": dict(
        ms_per_step=9.0, gpu_memory_gb=12.0, streamed_layers=16, streamed_bytes_per_step=6.85e9,
        host_to_device_gbs=25.1)})
    results["parts"]["nvfp4 (all) b4 p256"] = {"error": "timed out after 45 s (its budget)"}
    assert g.write_benchmarks(results, copy) is True
    text = copy.read_text()
    section = text[text.index(g.BENCH_BEGIN):text.index(g.BENCH_END)]
    table = [line for line in section.splitlines() if line.startswith("| ")][1:]  # the header left out
    assert [line.split("|")[1].strip() for line in table] == ["nvfp4 (all) b1 p256", "nvfp4 (all) b1 p256 in 12 GB"]
    assert f"| {bound:.2f} ({7.5 / bound:.2f}x) |" in table[0]  # beside the static bound
    assert "16 layers' experts streamed" in table[1] and table[1].split("|")[7].strip() == "-"  # no bound for it
    assert "#### 2030-01-02, NVIDIA H100 80GB HBM3, commit abc1234" in section and g.NOT_YET not in section
    said = " ".join(section.split())  # the paragraphs are wrapped
    assert "Not measured in this run: nvfp4 (all) b4 p256 (timed out after 45 s (its budget));" in said
    assert "fp8 w8a8 (all) b1 p256 (skipped: budget)" in said and "int8 (all) b1 p256 (not timed:" in said
    # everything outside the section is as it was
    begin, end = before_real.index(g.BENCH_BEGIN), before_real.index(g.BENCH_END)
    assert text[:text.index(g.BENCH_BEGIN)] == before_real[:begin]
    assert text[text.index(g.BENCH_END):] == before_real[end:]
    # a second run's table goes after the first; a card the kernel report has no rows for gets no bound
    second = _fake_results(g, **{"bf16 b1 p256": None})
    second["device"]["name"], second["date"] = "NVIDIA GeForce RTX 3090", "2030-01-03"
    assert g.write_benchmarks(second, copy) is True
    section = copy.read_text()[copy.read_text().index(g.BENCH_BEGIN):copy.read_text().index(g.BENCH_END)]
    assert section.index("#### 2030-01-02") < section.index("#### 2030-01-03")
    rows = [line for line in section.splitlines() if line.startswith("| bf16 b1 p256")]
    assert len(rows) == 1 and rows[0].split("|")[7].strip() == "-"
    assert real.read_text() == before_real  # the real file is never written by the tests


def test_bench_gpu_targets_say_what_was_not_measured():
    g = _bench_gpu()
    results = _fake_results(g, **{"nvfp4 (all) b1 p256": dict(tokens_per_s=3100.0),
                                  "nvfp4 (all) b4 p256": dict(tokens_per_s=6200.0)})
    t = g.targets(results)
    assert t[">= 3000 tok/s in the canvas, NVFP4"] == {"value": 3100.0, "met": True}
    assert t["batch 4 >= 2.5x batch 1 tok/s"] == {"value": 2.0, "met": False}
    assert t["NVFP4 peak memory at 8k < 20 GB"] == {"value": None, "met": None}  # skipped: not measured, not failed
    assert t[">= 5x transformers (bf16)"]["met"] is None
    results["doctor"] = {"status": "not available"}
    assert g.targets(results)["doctor: every kernel family passed or did not apply"]["met"] is None


def test_bench_gpu_writes_the_doctors_timed_kernel_calls_and_only_those_measured(tmp_path):
    from pathlib import Path

    g = _bench_gpu()
    copy = tmp_path / "BENCHMARKS.md"
    copy.write_text((Path(__file__).resolve().parent.parent / "BENCHMARKS.md").read_text())
    timed = {"call": "nvfp4_linear 256x2816->2112", "ms": 0.0412, "bound_ms": 0.0171, "bound_by": "DRAM",
             "x_bound": 2.41}
    unmeasured = dict(timed, call="head 256 rows, vocab 262144", ms=None, x_bound=None)
    results = _fake_results(g)  # no step row measured
    results["doctor"]["report"] = {"at_sizes": [
        {"name": "nvfp4_linear", "status": "pass", "timings": [timed]},
        {"name": "head", "status": "pass", "timings": [unmeasured]},
        {"name": "moe_plan", "status": "off", "timings": None}]}
    assert g.write_benchmarks(results, copy) is True
    text = copy.read_text()
    section = text[text.index(g.BENCH_BEGIN):text.index(g.BENCH_END)]
    rows = [line for line in section.splitlines() if line.startswith("| nvfp4_linear") or "head 256" in line]
    assert rows == ["| nvfp4_linear | nvfp4_linear 256x2816->2112 | 0.0412 | 0.0171 | DRAM | 2.41 |"]
    results["doctor"]["report"]["at_sizes"] = results["doctor"]["report"]["at_sizes"][1:]  # nothing timed
    copy.write_text((Path(__file__).resolve().parent.parent / "BENCHMARKS.md").read_text())
    assert g.write_benchmarks(results, copy) is False
