"""`dgemma doctor` on the CPU (the kernels in Triton's interpreter, small shapes): its report, the verdicts it keeps
for the card, and a wrong kernel injected on purpose: caught, turned off, kept, and the run after it gives the torch
path's tokens; the quick form at load, said once per card."""

from __future__ import annotations

import json

import pytest
import torch

from cli_helpers import run_main

pytest.importorskip("triton")

PROMPT = "upper: hello diffusions"


@pytest.fixture
def fresh(monkeypatch):
    from quant.kernels import probe

    probe.reset()
    yield
    probe.reset()


def run_ids(monkeypatch, capsys, kernels: str) -> list[int]:
    monkeypatch.setenv("DGEMMA_KERNELS", kernels)
    assert run_main(["run", PROMPT, "--model", "demo", "--device", "cpu", "--dtype", "float32", "--seed", "0",
                     "--steps", "4", "--view", "none", "--json", "-q"]) == 0
    return json.loads(capsys.readouterr().out)["token_ids"]


def test_the_doctor_reports_every_family_and_says_what_it_did_not_run(fresh, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert run_main(["doctor", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    text = out.read_text()
    report = json.loads(text)
    from quant.kernels.probe import FAMILIES

    assert report["ok"] and report["card"] == "cpu (Triton interpreter)" and not report["turned_off"]
    assert [k["name"] for k in report["kernels"]] == list(FAMILIES)
    assert all(k["status"] == "pass" and (k["error"] is None or k["error"] <= 1) for k in report["kernels"])
    # the machinery: what needs CUDA said so; the streamed experts and the split run as the CPU runs them
    assert {c["name"]: c["status"] for c in report["cuda"]} == {
        "cuda_graph": "not run", "copy_stream": "pass", "pinned_h2d": "not run", "two_cards": "pass"}
    assert all(c["detail"] == "needs a CUDA card" for c in report["cuda"] if c["status"] == "not run")
    (stream,) = [c for c in report["cuda"] if c["name"] == "copy_stream"]
    assert "the resident tokens" in stream["detail"] and "no CUDA stream" in stream["detail"]
    # the real sizes: not in the interpreter, said why
    assert report["sizes"] is None and [c["status"] for c in report["at_sizes"]] == ["not run"]
    assert "needs a CUDA card" in report["at_sizes"][0]["detail"] and "--sizes tiny" in report["at_sizes"][0]["detail"]
    assert report["not_done"]  # what the doctor does not check yet is said, never implied
    assert str(tmp_path) not in text and "/home" not in text and PROMPT not in text  # nothing of the user's
    assert "not run" in captured.out and "rms_norm" in captured.out  # the table
    assert captured.err.strip().splitlines()[-1] == ("dgemma: 24 of 24 kernel families agree with the torch path "
                                                     "on cpu (Triton interpreter)")
    from quant.kernels import verdicts

    kept = verdicts.load(report["card_key"])
    assert len(kept) == 24 and all(v["ok"] for v in kept.values())


@pytest.mark.slow  # five generations and two doctors in the interpreter
def test_a_wrong_kernel_is_caught_turned_off_kept_and_the_run_after_gives_the_torch_tokens(fresh, monkeypatch,
                                                                                           capsys, tmp_path):
    import quant.kernels.rmsnorm as rmsnorm

    torch_ids = run_ids(monkeypatch, capsys, "torch")
    real = rmsnorm.rms_norm

    def wrong(*args, **kwargs):  # a kernel that writes its columns in the wrong order, as a miscompiled one may
        out = real(*args, **kwargs)
        return (out[0].flip(-1), *out[1:]) if isinstance(out, tuple) else out.flip(-1)

    monkeypatch.setattr(rmsnorm, "rms_norm", wrong)
    # with the wrong kernel and nothing decided yet (the CPU is never probed), the run's tokens change
    assert run_ids(monkeypatch, capsys, "triton") != torch_ids
    assert run_main(["doctor", "--quick", "--json", str(tmp_path / "r.json")]) == 1  # the common families
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["turned_off"] == ["rms_norm"] and not report["ok"]
    (norm,) = [k for k in report["kernels"] if k["name"] == "rms_norm"]
    assert norm["status"] == "off" and "disagrees with the torch path" in norm["detail"] and norm["error"] > 1
    assert "turned off (the torch path runs instead): rms_norm" in capsys.readouterr().err
    # the same process, and a fresh one (the verdict read back from the home): the torch path's tokens
    assert run_ids(monkeypatch, capsys, "triton") == torch_ids
    from quant.kernels import probe

    probe.reset()
    assert run_ids(monkeypatch, capsys, "triton") == torch_ids
    assert run_main(["doctor", "--reset"]) == 0
    assert "forgot the kernel verdicts" in capsys.readouterr().err
    probe.reset()
    assert run_ids(monkeypatch, capsys, "triton") != torch_ids  # forgotten: the wrong kernel runs again


@pytest.mark.slow  # two generations in the interpreter
def test_a_card_met_for_the_first_time_is_checked_quickly_and_said_once(fresh, monkeypatch, capsys):
    """run, chat and serve check the families the model uses the first time they meet a card (probed devices: a
    CUDA card; the CPU stands in for one here) and say so in one line; the next load reads the verdicts."""
    from quant.kernels import probe

    monkeypatch.setattr(probe, "needs_probe", lambda device: True)
    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    args = ["run", PROMPT, "--model", "demo", "--device", "cpu", "--dtype", "float32", "--seed", "0", "--steps", "2",
            "--view", "none"]
    assert run_main(args) == 0
    said = [x for x in capsys.readouterr().err.splitlines() if "first use of" in x]
    assert len(said) == 1 and said[0].startswith("dgemma: first use of cpu (Triton interpreter): 6 kernel "
                                                 "families checked against the torch path in "), said
    assert said[0].endswith("all agree; `dgemma doctor` gives the full report")
    probe.reset()  # a later process
    assert run_main(args) == 0
    assert "first use of" not in capsys.readouterr().err


def test_a_report_that_cannot_be_written_is_said_before_anything_runs(capsys, tmp_path):
    assert run_main(["doctor", "--json", str(tmp_path / "no" / "such" / "dir" / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--json" in err and "no such folder" in err and "Traceback" not in err


def test_kernels_a_card_cannot_run_are_not_run_there_not_turned_off(monkeypatch):
    """On an H100 (sm_90) the FP4 tensor-core kernels do not exist and on an A100 (sm_80) the FP8 ones: their
    probes would fail to compile and be reported as broken. The doctor says they are not for that card instead, and
    keeps no verdict for them."""
    import quant.kernels as kernels
    from dgemma_cli.doctor.checks import not_for

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(kernels, "arch", lambda device: 90)
    assert not_for("nvfp4_w4a4", cuda).startswith("not for this card: FP4 tensor cores")
    assert not_for("moe_nvfp4_w4a4", cuda) and not_for("nvfp4_w4a4_gated", cuda)
    assert not_for("moe_w8a8_fp8", cuda) is None and not_for("nvfp4_linear", cuda) is None
    monkeypatch.setattr(kernels, "arch", lambda device: 80)
    assert not_for("w8a8_linear_fp8", cuda).startswith("not for this card: FP8 tensor cores (sm_89")
    assert not_for("moe_w8a8_int8", cuda) is None
    monkeypatch.setattr(kernels, "arch", lambda device: 120)
    assert not_for("nvfp4_w4a4", cuda) is None and not_for("w8a8_linear_fp8", cuda) is None
    assert not_for("nvfp4_w4a4", torch.device("cpu")) is None  # the interpreter runs every kernel


# ----------------------------------------------------------------------------- the kernels at a model's sizes


def tiny_sizes():
    from quant.probes import Sizes

    from dgemma_cli.bench import TINY
    from dgemma_cli.config import ModelConfig

    return Sizes.of(ModelConfig.from_dict(TINY))


def test_each_kernel_call_at_a_models_sizes_is_timed_against_its_bound(fresh):
    """At a model's sizes each family's kernel calls are left to be timed with their least bytes and FLOPs; the time
    is set against the bound for the card: the longer of the bytes at its bandwidth and the FLOPs at its tensor peak.
    A fake card and clock stand in for a GPU's here (the interpreter's time says nothing)."""
    from quant.kernels.roofline import GPU

    from dgemma_cli.doctor.sizes import sized_checks

    gpu = GPU("test card", 10, 1.0, 1.0, 0.001, 99 * 1024)  # 1 TB/s; 1 GFLOP/s, so a matmul is tensor-bound
    s = tiny_sizes()
    checks = sized_checks(torch.device("cpu"), torch.float32, ("softcap", "nvfp4_linear", "lora"), s, "tiny",
                          timer=lambda run, device: 2e-3 if run() is not None else None, gpu=gpu)
    assert [c.name for c in checks] == ["softcap", "nvfp4_linear"]  # lora runs small only
    assert all(c.status == "pass" and c.error <= 1 for c in checks)
    (cap,), (lin,) = (c.timings for c in checks)
    n = s.rows * s.vocab
    assert cap["call"] == f"softcap {n} logits" and cap["bound_by"] == "DRAM" and cap["ms"] == 2.0
    assert cap["bound_ms"] == pytest.approx(n * (2 + 4) / 1e12 * 1e3, rel=1e-3)  # bf16 in, float32 out
    assert cap["x_bound"] == pytest.approx(2.0 / cap["bound_ms"], rel=1e-2)
    flops = 2 * s.rows * s.intermediate * s.hidden
    assert lin["bound_by"] == "tensor" and lin["bound_ms"] == pytest.approx(flops / 1e9 * 1e3, rel=1e-3)


def test_the_roofline_knows_a_card_by_its_name_and_sms():
    from quant.kernels.roofline import gpu_named

    assert gpu_named("NVIDIA GeForce RTX 4090", 128).name == "RTX 4090"
    assert gpu_named("NVIDIA H100 80GB HBM3", 132).name == "H100 SXM"
    assert gpu_named("NVIDIA GeForce RTX 4060 Ti", 34).name == "RTX 4060 Ti 16GB"
    assert gpu_named("NVIDIA GeForce RTX 4060", 24).name == "RTX 4060"
    # another memory, another bandwidth: no bound rather than a wrong one
    assert gpu_named("NVIDIA H100 PCIe", 114) is None and gpu_named("NVIDIA A100-SXM4-40GB", 108) is None
    assert gpu_named("NVIDIA GeForce RTX 4090", 100) is None and gpu_named("Tesla T4", 40) is None


def test_a_machinery_check_that_breaks_is_a_failure_not_a_crash(monkeypatch):
    from dgemma_cli.doctor import cuda

    def broken(device):
        raise RuntimeError("copy engine hung\nmore")

    monkeypatch.setitem(cuda.CHECKS, "copy_stream", broken)
    monkeypatch.setitem(cuda.CHECKS, "two_cards", lambda device: ("fail", "the split gave other tokens"))
    rows = {c.name: c for c in cuda.cuda_checks(torch.device("cpu"), 0)}
    assert rows["copy_stream"].status == "fail" and rows["copy_stream"].detail == ("raised RuntimeError: copy engine "
                                                                                    "hung")
    assert rows["two_cards"].status == "fail" and rows["cuda_graph"].status == "not run"


def test_a_kernel_wrong_only_at_a_models_sizes_is_caught_there_and_turned_off(fresh, monkeypatch, tmp_path,
                                                                                capsys):
    """A kernel right on the small problem and wrong past it (as an offset that overflows at a real size would be):
    the small check passes, the check at the model's sizes turns the family off and keeps the verdict."""
    import quant.kernels.softcap as softcap

    real = softcap.softcap_into

    def wrong_past_8192(out, x, cap):
        real(out, x, cap)
        if out.numel() > 8192:
            out[8192:] = 0
        return out

    monkeypatch.setattr(softcap, "softcap_into", wrong_past_8192)
    assert run_main(["doctor", "--quick", "--sizes", "tiny", "--json", str(tmp_path / "r.json")]) == 1
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["sizes"] == "tiny" and report["turned_off"] == ["softcap"] and not report["ok"]
    (small,) = [k for k in report["kernels"] if k["name"] == "softcap"]
    (sized,) = [k for k in report["at_sizes"] if k["name"] == "softcap"]
    assert small["status"] == "pass" and sized["status"] == "off" and sized["error"] > 1
    assert all(k["status"] == "pass" for k in report["at_sizes"] if k["name"] != "softcap")
    assert "tiny's sizes" in capsys.readouterr().err
    from quant.kernels import probe, verdicts

    kept = verdicts.load(report["card_key"])
    assert kept["softcap float32"]["ok"] is False and "tiny's sizes" in kept["softcap float32"]["why"]
    probe.reset()
    assert probe.family_ok("softcap", torch.device("cpu"), torch.float32) is False  # a later process follows it


def test_the_doctor_leaves_the_processs_kernel_setting_as_it_found_it(fresh, monkeypatch):
    import os

    monkeypatch.delenv("DGEMMA_KERNELS", raising=False)
    assert run_main(["doctor", "--quick", "--sizes", "none", "-q"]) == 0
    assert "DGEMMA_KERNELS" not in os.environ  # later work in this process takes its own path, not the interpreter's


def test_a_card_too_small_for_a_sized_check_is_not_a_failing_kernel(fresh, monkeypatch):
    """Running out of the card's memory while a check at the model's sizes builds its problem says so and decides
    nothing: the family is not turned off for a card that merely has less memory than the check."""
    from quant.kernels import probe

    from dgemma_cli.doctor.sizes import sized_checks

    def oom(device, dtype, sizes=None):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setitem(probe.PROBES, "softcap", oom)
    (check,) = sized_checks(torch.device("cpu"), torch.float32, ("softcap",), tiny_sizes(), "tiny")
    assert check.status == "not run" and "free memory" in check.detail
    assert "softcap float32" not in probe.kept_verdicts(torch.device("cpu"))
    assert probe.family_ok("softcap", torch.device("cpu"), torch.float32)
