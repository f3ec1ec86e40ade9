"""Tuning on first use (quant/kernels/tuning.py) and the first-use probe (quant/kernels/probe.py).

Tuning runs with a fake GPU: `device_name` names one and `timer` returns each candidate's made-up cost, so the
choice, the cache file and its failure modes are checked on the CPU. The probe runs the real kernels (Triton's
interpreter on the CPU, compiled on a GPU) with `needs_probe` forced on, and with wrappers that raise or lie.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from quant.kernels import probe, tuning

GPU = "NVIDIA Fake 9000 (rev 2)"
CANDIDATES = [{"BLOCK_M": 16, "num_warps": 4}, {"BLOCK_M": 32, "num_warps": 4}, {"BLOCK_M": 64, "num_warps": 8}]
COST = {16: 3.0, 32: 1.0, 64: 2.0}  # ms per call: 32 is the fastest
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    """A fake GPU with a fresh home; returns the list of launches (each a cfg), timed or not."""
    tuning.reset()
    monkeypatch.setenv("DGEMMA_HOME", str(tmp_path / "dg"))
    monkeypatch.setattr(tuning, "device_name", lambda device: GPU)
    monkeypatch.setattr(tuning, "capturing", lambda: False)
    launches = []

    def fake_timer(run, device):
        run()
        return COST[launches[-1]["BLOCK_M"]]

    monkeypatch.setattr(tuning, "timer", fake_timer)
    yield launches
    tuning.reset()


def cache_file(tmp_path):
    return tmp_path / "dg" / "kernels" / f"NVIDIA_Fake_9000_rev_2-{tuning.version()}.json"


def test_picks_the_fastest_caches_it_and_a_fresh_process_reads_it(gpu, tmp_path, capsys):
    key = (32, 2816, 2816, "torch.bfloat16")
    assert tuning.choose("k", key, CANDIDATES, gpu.append) == CANDIDATES[1]
    assert len(gpu) == 3  # each candidate timed once
    saved = json.loads(cache_file(tmp_path).read_text())
    assert saved["device"] == GPU and saved["configs"]["k"] == {json.dumps(list(key)): CANDIDATES[1]}
    assert tuning.choose("k", key, CANDIDATES, gpu.append) == CANDIDATES[1] and len(gpu) == 3  # from memory
    tuning.reset()  # a new process
    assert tuning.choose("k", key, CANDIDATES, gpu.append) is CANDIDATES[1] and len(gpu) == 3  # from the file
    assert tuning.choose("k", (64, 2816, 2816, "torch.bfloat16"), CANDIDATES, gpu.append) == CANDIDATES[1]
    assert len(gpu) == 6  # another key is tuned on its own, and added to the same file
    assert len(json.loads(cache_file(tmp_path).read_text())["configs"]["k"]) == 2
    assert capsys.readouterr().err == ""


def test_a_failing_candidate_is_skipped(gpu):
    def launch(cfg):
        gpu.append(cfg)
        if cfg["BLOCK_M"] == 32:
            raise RuntimeError("out of shared memory")

    assert tuning.choose("k", (1,), CANDIDATES, launch) == CANDIDATES[2]


def test_nothing_runs_gives_the_first_and_remembers_nothing(gpu, tmp_path):
    def launch(cfg):
        raise RuntimeError("no")

    assert tuning.choose("k", (1,), CANDIDATES, launch) == CANDIDATES[0]
    assert not cache_file(tmp_path).exists()


def test_a_corrupt_cache_is_reported_once_and_tuned_again(gpu, tmp_path, capsys):
    path = cache_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert tuning.choose("k", (1,), CANDIDATES, gpu.append) == CANDIDATES[1] and len(gpu) == 3
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("dgemma: ignoring the unreadable kernel settings cache")
    assert json.loads(path.read_text())["configs"]["k"]  # rewritten whole
    tuning.choose("k", (2,), CANDIDATES, gpu.append)
    assert capsys.readouterr().err == ""


def test_a_stale_setting_is_tuned_again(gpu, tmp_path):
    tuning.choose("k", (1,), CANDIDATES, gpu.append)
    tuning.reset()
    new = [{"BLOCK_M": 16, "num_warps": 2}, {"BLOCK_M": 64, "num_warps": 8}]  # the cached cfg is gone
    assert tuning.choose("k", (1,), new, gpu.append) == new[1] and len(gpu) == 5


@pytest.mark.parametrize("how", ["home_is_a_file", "read_only"])
def test_an_unwritable_home_does_not_crash(gpu, tmp_path, monkeypatch, capsys, how):
    if how == "home_is_a_file":
        home = tmp_path / "file"
        home.write_text("")
    elif os.geteuid() != 0:
        home = tmp_path / "ro"
        home.mkdir()
        home.chmod(0o500)
    else:  # root writes through read-only modes; nobody, root included, makes a directory in /proc
        home = Path("/proc") / f"dgemma-home-{os.getpid()}"
        assert not home.exists()
    monkeypatch.setenv("DGEMMA_HOME", str(home))
    assert tuning.choose("k", (1,), CANDIDATES, gpu.append) == CANDIDATES[1]
    assert tuning.choose("k", (2,), CANDIDATES, gpu.append) == CANDIDATES[1]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("dgemma: cannot save tuned kernel settings")
    assert len(gpu) == 6  # both keys tuned, each once: kept in memory
    tuning.choose("k", (1,), CANDIDATES, gpu.append)
    assert len(gpu) == 6


def test_no_timing_during_a_capture(gpu, tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "capturing", lambda: True)
    assert tuning.choose("k", (1,), CANDIDATES, gpu.append) == CANDIDATES[0]
    assert gpu == [] and not cache_file(tmp_path).exists()
    monkeypatch.setattr(tuning, "capturing", lambda: False)
    assert tuning.choose("k", (1,), CANDIDATES, gpu.append) == CANDIDATES[1]  # tuned at the next eager call
    monkeypatch.setattr(tuning, "capturing", lambda: True)
    assert tuning.choose("k", (1,), CANDIDATES, gpu.append) == CANDIDATES[1]  # a tuned key is used in a capture


def test_the_cpu_takes_the_first_candidate_untimed(tmp_path, monkeypatch):
    tuning.reset()
    monkeypatch.setenv("DGEMMA_HOME", str(tmp_path / "dg"))
    launches = []
    assert tuning.choose("k", (1,), CANDIDATES, launches.append, device=torch.device("cpu")) == CANDIDATES[0]
    assert launches == [] and not (tmp_path / "dg").exists()


def test_home_follows_the_store_rule(tmp_path, monkeypatch):
    monkeypatch.setenv("DGEMMA_HOME", str(tmp_path / "h"))
    assert tuning.home() == tmp_path / "h"
    monkeypatch.delenv("DGEMMA_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuning.home() == tmp_path / "xdg" / "dgemma"
    assert tuning.cache_path("NVIDIA H200 NVL").name == f"NVIDIA_H200_NVL-{tuning.version()}.json"


# ----------------------------------------------------------------------------- the first-use probe


@pytest.fixture
def probed(monkeypatch):
    """The Triton path selected, and probes run on this test's device (the CPU included)."""
    pytest.importorskip("triton")
    probe.reset()
    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    monkeypatch.setattr(probe, "needs_probe", lambda device: True)
    yield
    probe.reset()


class FakeCompilationError(Exception):
    pass


FakeCompilationError.__module__ = "triton.compiler.errors"  # where Triton's own compile errors live


def one_line(capsys) -> str:
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probes_pass_with_the_real_kernels(probed, capsys, dtype):
    with torch.inference_mode(dtype == torch.bfloat16):  # the engine generates under inference mode
        for family in probe.FAMILIES:
            assert probe.check(family, DEVICE, dtype) is None, family
            assert probe.family_ok(family, DEVICE, dtype)
    assert capsys.readouterr().err == ""


def test_a_kernel_that_fails_to_compile_falls_back_once(probed, capsys, monkeypatch):
    import quant.kernels.nvfp4_linear as kernel
    from quant import nvfp4
    from quant.modules import NVFP4Linear

    calls = []

    def broken(*args):
        calls.append(args)
        raise FakeCompilationError("at 12:4:\nunsupported layout\nmore detail")

    monkeypatch.setattr(kernel, "nvfp4_linear", broken)
    m = NVFP4Linear.from_weight(nvfp4.quantize(torch.randn(48, 64))).to(DEVICE)
    x = torch.randn(5, 64, device=DEVICE)
    assert torch.equal(m(x), F.linear(x, m.dequantize(x.dtype)))
    assert one_line(capsys) == ("dgemma: the Triton nvfp4_linear kernel failed to compile on this GPU "
                                "(FakeCompilationError: at 12:4:); using the torch path")
    assert torch.equal(m(x), F.linear(x, m.dequantize(x.dtype)))
    assert len(calls) == 1 and capsys.readouterr().err == ""  # not probed again


def test_a_kernel_that_disagrees_falls_back_once(probed, capsys, monkeypatch):
    import quant.kernels.int8_linear as kernel
    from quant import int8
    from quant.modules import Int8Linear

    real, calls = kernel.int8_linear, []

    def wrong(*args):
        calls.append(args)
        return real(*args) * 1.01

    monkeypatch.setattr(kernel, "int8_linear", wrong)
    m = Int8Linear.from_weight(int8.quantize(torch.randn(48, 64))).to(DEVICE)
    x = torch.randn(5, 64, device=DEVICE)
    assert torch.equal(m(x), F.linear(x, m.dequantize(x.dtype)))
    line = one_line(capsys)
    assert line.startswith("dgemma: the Triton int8_linear kernel disagrees with the torch path on this GPU (")
    assert line.endswith("); using the torch path")
    m(x)
    assert len(calls) == 1 and capsys.readouterr().err == ""


def test_a_failing_moe_kernel_leaves_the_experts_to_the_reference(probed, capsys, monkeypatch):
    import quant.kernels.moe_down as kernel
    from quant.modules import Int8Stack, fused_experts

    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("CUDA error: misaligned address")

    monkeypatch.setattr(kernel, "moe_down", broken)
    gu, dn = Int8Stack(4, 2 * 32, 64).to(DEVICE), Int8Stack(4, 64, 32).to(DEVICE)
    x = torch.randn(3, 64, device=DEVICE)
    index = torch.tensor([[0, 1], [2, 3], [1, 2]], device=DEVICE)
    weights = torch.rand(3, 2, device=DEVICE)
    assert fused_experts(gu, dn, x, index, weights) is None  # the caller runs its reference path
    assert one_line(capsys) == ("dgemma: the Triton moe_int8 kernel failed to run on this GPU (RuntimeError: CUDA "
                                "error: misaligned address); using the torch path")
    assert fused_experts(gu, dn, x, index, weights) is None
    assert len(calls) == 1 and capsys.readouterr().err == ""


def test_a_wrong_fused_head_is_caught(probed, capsys, monkeypatch):
    import quant.kernels.head as kernel

    real = kernel.fused_head

    def wrong(*args, **kw):
        buf = real(*args, **kw)
        buf.argmax.add_(1)
        return buf

    monkeypatch.setattr(kernel, "fused_head", wrong)
    assert not probe.family_ok("head", DEVICE)
    assert one_line(capsys) == ("dgemma: the Triton head kernel disagrees with the torch path on this GPU (argmax "
                                "differs); using the torch path")
    assert not probe.family_ok("head", DEVICE)  # asked once
    assert capsys.readouterr().err == ""


def test_no_probe_during_a_capture(probed, monkeypatch):
    runs = []
    monkeypatch.setitem(probe.PROBES, "int8_linear", lambda device, dtype: runs.append(1))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    cuda = torch.device("cuda", 0)
    assert not probe.family_ok("int8_linear", cuda)  # the torch path inside the capture
    assert runs == [] and not probe._ok  # nothing recorded: probed at the next eager use


def test_the_cpu_is_not_probed(monkeypatch):
    probe.reset()
    monkeypatch.setitem(probe.PROBES, "int8_linear", lambda device, dtype: "wrong")
    assert probe.family_ok("int8_linear", torch.device("cpu"))
    with pytest.raises(ValueError):
        probe.family_ok("nope", torch.device("cpu"))
