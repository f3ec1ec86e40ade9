"""The MoE's routing on the GPU path, against the torch ops it replaces (Triton's interpreter on this CPU): the block
plan bit for bit (quant/kernels/moe_plan.py); the router (quant/kernels/router.py) choosing the same experts with
the same weights, compared as sets per token: bfloat16 logits tie often among 128 experts, and the order of equal
values is torch.topk's own (the kernel puts the lower index first), which changes only the slot order of a sum."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from quant.kernels.moe_plan import moe_blocks_fused  # noqa: E402
from quant.kernels.routing import moe_blocks  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tokens,top,experts,block_m", [(33, 2, 6, 16), (256, 8, 128, 64), (1024, 8, 128, 64),
                                                        (5, 8, 128, 16), (300, 8, 128, 128)])
def test_block_plan_is_the_torch_plan(tokens, top, experts, block_m):
    g = torch.Generator().manual_seed(tokens)
    index = torch.stack([torch.randperm(experts, generator=g)[:top] for _ in range(tokens)])
    index[: tokens // 2, 0] = 1  # one expert takes many blocks
    want = moe_blocks(index, experts, block_m)
    got = moe_blocks_fused(index.to(DEVICE), experts, block_m)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_block_plan_probe_agrees():
    from quant.kernels import probe

    assert probe.check("moe_plan", torch.device(DEVICE), torch.int32) is None


def by_expert(w: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (expert, weight) pairs sorted by expert."""
    order = i.argsort(dim=1)
    return w.gather(1, order), i.gather(1, order)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=pytest.mark.slow), torch.float16])
def test_router_kernel_routes_as_the_torch_ops(dtype):
    """The fused router against the model's torch ops on 300 tokens of a real-width router (hidden 2816, top-8 of
    128): the same experts for all but a near-tie or two, and the same weights where the experts agree."""
    from quant.kernels.router import route, route_reference

    g = torch.Generator().manual_seed(1)
    T, H, E = 300, 2816, 128
    x = (torch.randn(T, H, generator=g) * 2).to(dtype)
    scale = (torch.rand(H, generator=g) + 0.5).to(dtype)
    w = (torch.randn(E, H, generator=g) * 0.05).to(dtype)
    pes = (torch.rand(E, generator=g) + 0.5).to(dtype)
    want_w, want_i, probs = route_reference(x, scale, w, pes, 8, 1e-6, with_probs=True)
    got_w, got_i = (t.cpu() for t in route(*(t.to(DEVICE) for t in (x, scale, w, pes)), 8, 1e-6))
    assert got_w.dtype == torch.float32 and got_i.dtype == torch.int64 and got_i.shape == (T, 8)
    (got_w, got_i), (want_w, want_i) = by_expert(got_w, got_i), by_expert(want_w, want_i)
    same = (got_i == want_i).all(dim=1)
    assert same.float().mean() >= 0.9, f"{int((~same).sum())} tokens routed differently"
    assert torch.allclose(got_w[same], want_w[same], rtol=2e-3, atol=1e-5)
    # where the sets differ, only at the k-th place and only between experts whose probabilities tie exactly in the
    # torch path (16-bit logits tie often; either choice is a top-k)
    for t in torch.nonzero(~same).flatten().tolist():
        only_got = set(got_i[t].tolist()) - set(want_i[t].tolist())
        only_want = set(want_i[t].tolist()) - set(got_i[t].tolist())
        kth = probs[t].sort(descending=True).values[7]
        assert {probs[t, e].item() for e in only_got | only_want} == {kth.item()}, t


def test_router_split_over_programs_routes_the_same():
    """The inputs split over 4 or 2 programs a token block (the last to finish adds their partial sums and takes the
    top-k), against one program a block, over a partial block: the same experts for all but a near-tie (a logit may
    differ by one rounding), the same weights where they agree, the same bits on a second launch, and the counters
    back at 0 after each launch (so the next launch counts from 0)."""
    from quant import kernels
    from quant.kernels import router

    g = torch.Generator().manual_seed(4)
    T, H, E = 40, 512, 128
    scale = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(E, H, generator=g) * 0.1).to(torch.bfloat16).to(DEVICE)
    pes = (torch.rand(E, generator=g) + 0.5).to(torch.bfloat16).to(DEVICE)
    for splits in (4, 2):  # new tokens each time: partial sums left from the launch before would not pass
        x = (torch.randn(T, H, generator=g) * 2).to(torch.bfloat16).to(DEVICE)
        one_w, one_i = (t.cpu() for t in router.route(x, scale, w, pes, 8, 1e-6, splits=1))
        got_w, got_i = (t.cpu() for t in router.route(x, scale, w, pes, 8, 1e-6, splits=splits))
        assert not kernels._counters[("router", x.device)].any()
        again_w, again_i = (t.cpu() for t in router.route(x, scale, w, pes, 8, 1e-6, splits=splits))
        assert torch.equal(again_i, got_i) and torch.equal(again_w, got_w)
        (got_w, got_i), (one_w, one_i) = by_expert(got_w, got_i), by_expert(one_w, one_i)
        same = (got_i == one_i).all(dim=1)
        assert same.float().mean() >= 0.95, (splits, int((~same).sum()))
        assert torch.allclose(got_w[same], one_w[same], rtol=2e-3, atol=1e-5)
    with pytest.raises(ValueError, match="1, 2, 4 or 8"):
        router.route(x, scale, w, pes, 8, 1e-6, splits=8)  # 4 steps of 128 inputs: at most 4 ways


def test_router_in_the_model_and_its_probe(monkeypatch):
    """Router.forward takes the kernel under DGEMMA_KERNELS=triton (the interpreter) with the same choices."""
    from dgemma_cli.engine import load
    from quant.kernels import probe

    assert probe.check("router", torch.device(DEVICE), torch.bfloat16) is None
    model = load("demo", device="cpu", dtype="bfloat16").model
    router = model.layers[0].router
    x = torch.randn(64, model.cfg.text.hidden_size, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    results = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("DGEMMA_KERNELS", mode)
        with torch.no_grad():
            results[mode] = router(x)
    (tw, ti), (kw, ki) = by_expert(*results["torch"]), by_expert(*results["triton"])
    same = (ti == ki).all(dim=1)
    assert same.float().mean() >= 0.95
    assert torch.allclose(kw[same], tw[same], rtol=2e-3, atol=1e-5)
