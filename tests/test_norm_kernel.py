"""The fused RMSNorm kernel (quant/kernels/rmsnorm.py) against the torch ops the model runs, under Triton's
interpreter on this CPU (compiled on a CUDA machine), and the model's denoise step with it against without it.

The kernel makes every rounding to the output dtype that the torch path makes, at the same place; what may differ is
float32 summation order in the mean of squares, so the outputs agree to one step of the output dtype at most, and
almost everywhere exactly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dgemma_cli.model import RMSNorm, apply_rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _norm(weight, D, eps):
    norm = RMSNorm(D, eps, with_scale=weight is not None)
    if weight is not None:
        norm.weight.data = weight
    return norm


def reference(a, weight, eps, a2=None, residual=None, scale=None, cos=None, sin=None, a_weight=None,
              a2_weight=None):
    """The model's torch path, op for op (RMSNorm.forward, apply_rope, the residual add and layer scale; the
    post-feed-forward norms before the add)."""
    D = a.shape[-1]
    norm = _norm(weight, D, eps)
    with torch.no_grad():
        if a_weight is not None:
            a = _norm(a_weight, D, eps)(a)
        if a2_weight is not None:
            a2 = _norm(a2_weight, D, eps)(a2)
        x = a if a2 is None else a + a2
        n = norm(x) if cos is None else apply_rope(norm(x), cos, sin)
        out = n if residual is None else residual + n
        return out if scale is None else out * scale


def ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference in steps of ref's dtype at ref's magnitude."""
    step = torch.finfo(ref.dtype).eps * ref.float().abs().clamp(min=torch.finfo(ref.dtype).tiny)
    return ((got.float() - ref.float()).abs() / step).max().item()


CASES = {
    "plain": {},
    "no weight": dict(weight=None),
    "pre-add, residual, scale": dict(a2=True, residual=True, scale=True),
    "rope": dict(rope=True),
    "rope, one angle set": dict(rope=True, shared=True),
    "normed inputs, residual, scale": dict(a2=True, residual=True, scale=True, pre=True),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_norm_matches_the_torch_ops(monkeypatch, case, dtype):
    from quant.kernels.rmsnorm import rms_norm

    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    opts = CASES[case]
    g = torch.Generator().manual_seed(0)
    B, T, heads = 2, 5, 3
    D = 64 if opts.get("rope") else 96  # RoPE: head widths are powers of two; else a partial block of 128
    make = lambda *shape: (torch.randn(*shape, generator=g) * 3).to(dtype)  # noqa: E731
    a = make(B, T, heads, D)
    kw = dict(weight=(torch.rand(D, generator=g) + 0.5).to(dtype))
    if "weight" in opts:
        kw["weight"] = None
    if opts.get("a2"):
        kw["a2"] = make(B, T, heads, D)
    if opts.get("residual"):
        kw["residual"] = make(B, T, heads, D)
    if opts.get("scale"):
        kw["scale"] = torch.tensor(0.8125, dtype=dtype)
    if opts.get("pre"):  # the dense MLP's and the experts' post-norms, applied before the sum's
        kw["a_weight"], kw["a2_weight"] = ((torch.rand(D, generator=g) + 0.5).to(dtype) for _ in range(2))
    if opts.get("rope"):
        angles = torch.rand(1 if opts.get("shared") else B, T, 1, D, generator=g) * 6
        kw["cos"], kw["sin"] = angles.cos().to(dtype), angles.sin().to(dtype)
    ref = reference(a, eps=1e-6, **kw)
    got = rms_norm(a.to(DEVICE), eps=1e-6, **{k: v.to(DEVICE) if v is not None else None for k, v in kw.items()})
    assert got.dtype == ref.dtype and got.shape == ref.shape
    got = got.cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:
        assert ulps(got, ref) <= 2.01  # a rounding apart at most (two where RoPE or the residual round again)
        assert (got == ref).float().mean() > 0.97  # and almost everywhere the same bits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_norms_of_one_input_in_one_kernel(monkeypatch, dtype):
    """RMSNorm.pair: the two pre-feed-forward norms of the residual from one kernel, each as its own norm gives it."""
    from quant.kernels.rmsnorm import rms_norm

    g = torch.Generator().manual_seed(1)
    D = 96
    a = (torch.randn(2, 7, D, generator=g) * 3).to(dtype)
    w1, w2 = ((torch.rand(D, generator=g) + 0.5).to(dtype) for _ in range(2))
    y1, y2 = rms_norm(a.to(DEVICE), w1.to(DEVICE), 1e-6, weight2=w2.to(DEVICE))
    for got, w in ((y1, w1), (y2, w2)):
        ref = reference(a, w, 1e-6)
        if dtype == torch.float32:
            torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-5)
        else:
            assert ulps(got.cpu(), ref) <= 1.01 and (got.cpu() == ref).float().mean() > 0.97
    with pytest.raises(ValueError):
        rms_norm(a, w1, 1e-6, weight2=w2, residual=a)
    # the second output in the NVFP4 decode's pair order: the same values, columns as pair_ordered puts them
    from quant.kernels.moe_gate_up import pair_ordered

    z1, z2 = rms_norm(a.to(DEVICE), w1.to(DEVICE), 1e-6, weight2=w2.to(DEVICE), pair_order_y2=True)
    assert torch.equal(z1, y1) and torch.equal(z2.reshape(-1, D), pair_ordered(y2.reshape(-1, D)))
    # the model's RMSNorm.pair on the torch path (no fused norms) gives that order too
    n1, n2 = _norm(w1, D, 1e-6), _norm(w2, D, 1e-6)
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")
    with torch.no_grad():
        t1, t2 = n1.pair(a, n2, pair_order=True)
    assert torch.equal(t1, n1(a)) and torch.equal(t2.reshape(-1, D), pair_ordered(n2(a).reshape(-1, D)))


@pytest.mark.parametrize("pair_order", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_residual_update_then_its_two_norms_in_one_kernel(monkeypatch, dtype, pair_order):
    """RMSNorm.add_then_pair: the post-attention residual update and the two pre-feed-forward norms of its result in
    one launch, each as the three norms give them one after another (the second in pair order where asked); and the
    model's layer takes them (Layer.post_attention, then feed_forward with them)."""
    from quant.kernels.moe_gate_up import pair_ordered

    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    g = torch.Generator().manual_seed(2)
    D = 96
    x, h = ((torch.randn(2, 7, D, generator=g) * 3).to(dtype) for _ in range(2))
    post, first, second = (_norm((torch.rand(D, generator=g) + 0.5).to(dtype), D, 1e-6) for _ in range(3))
    with torch.no_grad():
        y, p1, p2, quantized = post.add_then_pair(x, h, first, second, pair_order=pair_order)
        assert quantized is None  # none asked for
        want_y = reference(h, post.weight, 1e-6, residual=x)
        want = [reference(y, first.weight, 1e-6), reference(y, second.weight, 1e-6)]
    if pair_order:
        want[1] = pair_ordered(want[1].reshape(-1, D)).view(want[1].shape)
    for got, ref in ((y, want_y), (p1, want[0]), (p2, want[1])):
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        else:
            assert ulps(got, ref) <= 1.01 and (got == ref).float().mean() > 0.97
    # the second norms read y as stored: from the kernel's own y they are those norms exactly, up to summation order
    with torch.no_grad():
        assert ulps(p1, first(y)) <= 1.01
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")
    assert post.add_then_pair(x, h, first, second) is None  # not fused: the caller's two steps


def test_a_norm_written_into_a_kv_cache_slot():
    """k's norm with RoPE and v's plain norm written through strided views of a cache's scratch slots ([B, Hkv,
    capacity, D] buffers, the canvas's T positions at the end): the same values as the torch path's, nothing else in
    the cache touched."""
    from quant.kernels.rmsnorm import rms_norm

    g = torch.Generator().manual_seed(2)
    B, T, Hkv, D, cap = 2, 5, 3, 64, 12
    k_raw = (torch.randn(B, T, Hkv, D, generator=g) * 3).to(torch.bfloat16)
    w = (torch.rand(D, generator=g) + 0.5).to(torch.bfloat16)
    angles = torch.rand(B, T, 1, D, generator=g) * 6
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    cache = torch.full((B, Hkv, cap, D), 7.0, dtype=torch.bfloat16, device=DEVICE)
    slot = cache[:, :, cap - T :]  # [B, Hkv, T, D]
    got = rms_norm(k_raw.to(DEVICE), w.to(DEVICE), 1e-6, cos=cos.to(DEVICE), sin=sin.to(DEVICE),
                   out=slot.transpose(1, 2))
    ref = reference(k_raw, w, 1e-6, cos=cos, sin=sin)
    assert ulps(got.cpu(), ref) <= 2.01 and got.data_ptr() == slot.data_ptr()
    assert torch.equal(cache[:, :, cap - T :].transpose(1, 2).cpu(), got.cpu())
    assert (cache[:, :, : cap - T] == 7.0).all()  # the cached prefix untouched
    v = rms_norm(k_raw.to(DEVICE), None, 1e-6, out=slot.transpose(1, 2))  # v: no weight, no RoPE
    assert ulps(v.cpu(), reference(k_raw, None, 1e-6)) <= 1.01
    with pytest.raises(ValueError):
        rms_norm(k_raw, w, 1e-6, out=torch.empty(B, T, Hkv, D + 1, dtype=torch.bfloat16))


def test_q_and_k_norms_in_one_launch():
    """A layer's q [B, T, 4, D] and k [B, T, 2, D] normed and rotated by one launch, k into a cache's slots: each as
    its own norm with RoPE gives it."""
    from quant.kernels.rmsnorm import rms_norm_rope_pair

    g = torch.Generator().manual_seed(3)
    B, T, D, cap = 2, 5, 64, 9
    q, k = ((torch.randn(B, T, h, D, generator=g) * 3).to(torch.bfloat16) for h in (4, 2))
    wq, wk = ((torch.rand(D, generator=g) + 0.5).to(torch.bfloat16) for _ in range(2))
    angles = torch.rand(1, T, 1, D, generator=g) * 6
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    cache = torch.zeros(B, 2, cap, D, dtype=torch.bfloat16, device=DEVICE)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    got_q, got_k = rms_norm_rope_pair(dev(q), dev(wq), dev(k), dev(wk), 1e-6, dev(cos), dev(sin),
                                      out_b=cache[:, :, cap - T :].transpose(1, 2))
    assert ulps(got_q.cpu(), reference(q, wq, 1e-6, cos=cos, sin=sin)) <= 2.01
    assert ulps(got_k.cpu(), reference(k, wk, 1e-6, cos=cos, sin=sin)) <= 2.01
    assert torch.equal(cache[:, :, cap - T :].transpose(1, 2).cpu(), got_k.cpu()) and (cache[:, :, : cap - T] == 0).all()
    with pytest.raises(ValueError):
        rms_norm_rope_pair(q, wq, k[:, :3], wk, 1e-6, cos, sin)
    # and v (k's shape) in the same launch: no weight, no RoPE, into its own cache slots
    v = (torch.randn(B, T, 2, D, generator=g) * 3).to(torch.bfloat16)
    v_cache = torch.zeros(B, 2, cap, D, dtype=torch.bfloat16, device=DEVICE)
    cache.zero_()
    q3, k3, v3 = rms_norm_rope_pair(dev(q), dev(wq), dev(k), dev(wk), 1e-6, dev(cos), dev(sin),
                                    out_b=cache[:, :, cap - T :].transpose(1, 2), c=dev(v),
                                    out_c=v_cache[:, :, cap - T :].transpose(1, 2))
    assert torch.equal(q3, got_q) and torch.equal(k3, got_k)
    assert ulps(v3.cpu(), reference(v, None, 1e-6)) <= 1.01
    assert torch.equal(v_cache[:, :, cap - T :].transpose(1, 2).cpu(), v3.cpu())
    assert (v_cache[:, :, : cap - T] == 0).all()
    q4, k4, v4 = rms_norm_rope_pair(dev(q), dev(wq), dev(k), dev(wk), 1e-6, dev(cos), dev(sin), c=dev(v))
    assert torch.equal(q4, got_q) and torch.equal(k4.cpu(), got_k.cpu()) and torch.equal(v4.cpu(), v3.cpu())


@pytest.mark.slow  # make test's time: the slow suite (CI) runs it
def test_the_model_step_with_fused_norms_matches_without(monkeypatch):
    """The demo DiffusionGemma's denoise logits with every norm fused (DGEMMA_KERNELS=triton, the interpreter) against
    the torch path: the same to float32 summation order, and the same argmax."""
    from dgemma_cli.engine import load

    model = load("demo", device="cpu", dtype="bfloat16").model  # the bundled demo: a trained DiffusionGemma
    cfg = model.cfg
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.text.vocab_size, (1, 9))
    canvas = torch.randint(0, cfg.text.vocab_size, (2, cfg.canvas_length))

    def step():
        with torch.no_grad():
            cache = model.new_cache(2, 16)
            model.encode(ids.expand(2, -1), cache)
            ctx = model.denoise_context(cache, 2)
            first = model.denoise(canvas, cache, ctx)
            probs = first.float().softmax(-1).view(-1, first.shape[-1])
            return model.denoise(canvas, cache, ctx, sc_probs=probs)

    monkeypatch.setenv("DGEMMA_KERNELS", "torch")
    ref = step()
    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    from quant.kernels import rmsnorm

    launches = []
    original = rmsnorm.rms_norm
    monkeypatch.setattr(rmsnorm, "rms_norm", lambda *a, **k: launches.append(1) or original(*a, **k))
    got = step()
    layers = cfg.text.num_hidden_layers
    # every norm of every layer, encoder and denoise steps: 10 norms a layer in 4 kernels (q's, k's and v's in one,
    # the post-attention norm with the two pre-feed-forward norms of its result, the three post-feed-forward ones
    # in one, the input norm), 3 of them through rms_norm, and the final norm, in each of the three passes
    assert len(launches) == 3 * (3 * layers + 1)
    assert (got - ref).abs().max() <= 0.01 * ref.abs().max()  # measured: 0.058 of 9.98
    assert (got == ref).float().mean() > 0.75  # measured: 86% of the logits bit for bit
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.99  # measured: all


def test_softcap_kernel_and_the_models_logits(monkeypatch):
    """The logits' float32 conversion and soft-capping in one kernel: within 1e-5 of torch's tanh at cap 30, and
    DiffusionGemma.logits writing the sampler's buffer through it."""
    from quant.kernels.softcap import softcap_into

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 10007, generator=g) * 40).to(torch.bfloat16)
    ref = torch.tanh(x.float() / 30.0) * 30.0
    got = softcap_into(torch.empty(3, 10007, device=DEVICE), x.to(DEVICE), 30.0).cpu()
    assert (got - ref).abs().max() <= 1e-5
    with pytest.raises(ValueError):
        softcap_into(torch.empty(7, dtype=torch.float16), x, 30.0)

    from dgemma_cli.engine import load

    model = load("demo", device="cpu", dtype="bfloat16").model
    hidden = torch.randn(2, 5, model.cfg.text.hidden_size, generator=g).to(torch.bfloat16)
    V = model.cfg.text.vocab_size
    outs = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("DGEMMA_KERNELS", mode)
        with torch.no_grad():
            outs[mode] = model.logits(hidden, torch.empty(10, V)).clone()
    assert (outs["triton"] - outs["torch"]).abs().max() <= 1e-5
