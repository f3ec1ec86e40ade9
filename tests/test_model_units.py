"""Unit checks of network pieces that the end-to-end reference tests exercise only indirectly."""

import pytest
import torch
import torch.nn.functional as F

from dgemma_cli import model as M


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_experts_match_a_plain_loop_including_empty_experts(monkeypatch, use_grouped_mm):
    if not use_grouped_mm:
        monkeypatch.delattr(F, "grouped_mm", raising=False)
    cfg = type("C", (), dict(num_experts=6, hidden_size=16, moe_intermediate_size=8))()
    experts = M.Experts(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(6, 16, 16, generator=g))
        experts.down_proj.copy_(torch.randn(6, 16, 8, generator=g))
    for n in (1, 17, 33):
        x = torch.randn(n, 16, generator=g)
        idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(n)])  # experts 4 and 5 stay empty
        w = torch.rand(n, 2, generator=g)
        expected = torch.zeros(n, 16)
        for t in range(n):
            for k in range(2):
                e = idx[t, k]
                gate, up = F.linear(x[t], experts.gate_up_proj[e]).chunk(2)
                expected[t] += w[t, k] * F.linear(M.gelu_tanh(gate) * up, experts.down_proj[e])
        with torch.no_grad():
            if use_grouped_mm:  # make sure this case really takes torch's grouped matmul
                assert M._grouped_mm_fits(x, experts.gate_up_proj)
            got = experts(x, idx, w)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_proportional_rope_leaves_the_unrotated_dims_alone():
    inv = M.rope_inv_freq({"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}, 32)
    assert inv.shape == (16,)
    assert (inv[4:] == 0).all() and (inv[:4] > 0).all()
    x = torch.randn(1, 3, 2, 32)
    cos, sin = M.rope_cos_sin(inv, torch.arange(5, 8)[None], torch.float32)
    y = M.apply_rope(x, cos, sin)
    rotated = torch.cat([torch.arange(0, 4), torch.arange(16, 20)])
    untouched = torch.tensor([i for i in range(32) if i not in rotated.tolist()])
    assert torch.equal(y[..., untouched], x[..., untouched])
    assert not torch.allclose(y[..., rotated], x[..., rotated])


def test_a_steps_inputs_are_made_on_the_device_without_a_host_copy():
    """The step's temperature is filled in on the device (a kernel taking n as its argument: no copy from host
    memory, after which torch would wait for the stream to drain), with the reference's values; host index lists
    come as int64 tensors of their values (on CUDA from pinned memory, copied without blocking)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dgemma_cli.config import GenerationSettings
    from dgemma_cli.model import host_index
    from dgemma_cli.sampler import step_temperature

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    s = GenerationSettings()
    ops = Ops()
    with ops:
        step_temperature(7, s, torch.device("meta"))
    assert ops.names[0] == "aten.full.default"
    for n in range(1, s.max_denoising_steps + 1):
        want = s.t_min + (s.t_max - s.t_min) * (torch.tensor(n, dtype=torch.int32) / s.max_denoising_steps)
        assert torch.equal(step_temperature(n, s, "cpu"), want)
    idx = host_index([3, 0, 2], torch.device("cpu"))
    assert idx.dtype == torch.int64 and idx.tolist() == [3, 0, 2]
