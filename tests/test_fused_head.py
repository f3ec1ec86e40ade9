"""The fused head (quant/kernels/head.py): logits, cap, the sampler's statistics and draw, the next step's soft
embedding. In Triton's interpreter here (on a GPU where there is one), against the same head in torch ops from the
same uniforms, against the torch path, and end to end through the engine and the server's batch loop."""

import pytest
import torch

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _head_case(R=37, H=96, V=1000, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(R, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    t = torch.rand(R, generator=g) * 0.6 + 0.3
    u = torch.rand(R, 2, generator=g)
    return h, w, t, u


def test_fused_head_equals_its_reference_from_the_same_uniforms():
    """Draws, argmax, entropy and soft embedding against the same head in float32 torch ops (head_reference), over
    two chunks, a partial tile, a partial row tile and a hidden size that is no multiple of the K step; without the
    cap too, with the soft embedding's chunk columns split three ways. The same uniforms give the same tokens."""
    from quant.kernels.head import HeadBuffers, fused_head, head_reference

    for cap, seed, splits in ((30.0, 0, 1), (None, 1, 1), (30.0, 2, 3)):  # 3 splits of 2 tiles: one split is empty
        h, w, t, u = _head_case(seed=seed)
        R, H = h.shape
        V = w.shape[0]
        buf = HeadBuffers(R + 5, V, H, torch.bfloat16, DEVICE, chunk=512, tile=256)  # more rows than used
        fused_head(h.to(DEVICE), w.to(DEVICE), cap, H**0.5, t.to(DEVICE), u.to(DEVICE), buf, splits=splits)
        sample, argmax, entropy, soft = head_reference(h, w, cap, H**0.5, t, u, tile=256)
        out = buf.first(R)
        assert torch.equal(out.sample.cpu(), sample)
        assert torch.equal(out.argmax.cpu(), argmax)
        assert (out.entropy.cpu() - entropy).abs().max() < 1e-4
        assert ((out.soft.cpu().float() - soft).abs().max() / soft.abs().max()) < 8e-3  # bfloat16 output
        assert torch.isinf(buf.chunk_max).all() and (buf.chunk_max < 0).all()  # left at -inf for the next step


def test_fused_head_with_the_factor_after_the_product_equals_its_reference(monkeypatch):
    """The soft-embedding kernel as it runs where the tensor cores read P from shared memory (sm_90, sm_100: AFTER,
    each vocab tile's factor applied to its float32 partial sum): the same tokens and entropies as the reference,
    the soft embedding within bfloat16 rounding of it and closer than the path that rounds P times the factor."""
    from quant.kernels import head
    from quant.kernels.head import HeadBuffers, fused_head, head_reference

    settings = head._settings
    h, w, t, u = _head_case(seed=2)
    R, H = h.shape
    V = w.shape[0]
    soft = {}
    for after in (False, True):
        monkeypatch.setattr(head, "_settings", lambda device, *a, after=after: {  # AFTER with sm_90's step, a tile
            **settings(device, *a), "soft": {**settings(device, *a)["soft"], "AFTER": after,
                                             "BLOCK_K": 128 if after else 64}})
        buf = HeadBuffers(R, V, H, torch.bfloat16, DEVICE, chunk=512, tile=256)
        fused_head(h.to(DEVICE), w.to(DEVICE), 30.0, H**0.5, t.to(DEVICE), u.to(DEVICE), buf, splits=3)
        sample, argmax, entropy, want = head_reference(h, w, 30.0, H**0.5, t, u, tile=256)
        assert torch.equal(buf.sample.cpu(), sample) and torch.equal(buf.argmax.cpu(), argmax)
        assert (buf.entropy.cpu() - entropy).abs().max() < 1e-4
        soft[after] = (buf.soft.cpu().float() - want).abs().max() / want.abs().max()
        assert soft[after] < 8e-3
    assert soft[True] <= soft[False]


def test_fused_head_soft_embedding_matches_the_torch_path():
    """The soft embedding the next step reads, against the torch path's (DiffusionGemma.soft_embedding of the
    softmax of the capped logits over t), within bfloat16 rounding; the entropy against torch's Categorical. The
    head keeps the logits in float32 from the tensor cores on (the torch path rounds them to 16 bits first, which
    moves entropies by ~1e-2 here), so the logits here are float32 products too."""
    from quant.kernels.head import HeadBuffers, fused_head

    h, w, t, u = _head_case(R=9, H=64, V=700, seed=3)
    buf = HeadBuffers(9, 700, 64, torch.bfloat16, DEVICE, chunk=256, tile=256)
    fused_head(h.to(DEVICE), w.to(DEVICE), 30.0, 8.0, t.to(DEVICE), u.to(DEVICE), buf)
    logits = torch.tanh((h.float() @ w.float().t()) / 30.0) * 30.0
    probs = torch.softmax(logits / t[:, None], -1)
    want = (probs.to(torch.bfloat16) @ w).float() * 8.0
    assert ((buf.soft.cpu().float() - want).abs().max() / want.abs().max()) < 1e-2
    entropy = torch.distributions.Categorical(logits=logits / t[:, None]).entropy()
    assert (buf.entropy.cpu() - entropy).abs().max() < 1e-4


@pytest.mark.parametrize("kind", ["Q6_K", pytest.param("Q8_0", marks=pytest.mark.slow)])  # make test's time
def test_a_gguf_head_reads_its_blocks_as_the_decoded_embedding(kind, monkeypatch):
    """The tied embedding as GGUF blocks (a GGUF file's token_embd, Q6_K in the published ones) read by both kernels
    where they lie (ggml_tile, each in its own order): the same draws, argmax and entropy as the head over the
    embedding decoded to bfloat16 (what a GGUF model held before), and against the float32 reference on that decoded
    matrix; with the factor after the product (sm_90's soft embedding) too. Two chunks, a partial tile."""
    from quant import ggml
    from quant.kernels import head
    from quant.kernels.head import HeadBuffers, fused_head, head_reference

    g = torch.Generator().manual_seed(7)
    R, H, V = 37, 256, 700
    # weights of rms ~0.05 (the f16 scales times the random codes): logits of a few units, far from the cap
    blocks = ggml.random_blocks(kind, V, H, g, scale=1e-4 if kind == "Q6_K" else 1e-3)
    w = ggml.decode(blocks, kind, (V, H), torch.float32).to(torch.bfloat16)  # the embedding as loaded before
    h = torch.randn(R, H, generator=g).to(torch.bfloat16)
    t = torch.rand(R, generator=g) * 0.6 + 0.3
    u = torch.rand(R, 2, generator=g)
    sample, argmax, entropy, soft = head_reference(h, w, 30.0, H**0.5, t, u, tile=256)
    assert len(set(sample.tolist())) > R // 2  # the draws are spread: a decode that is off would move them
    settings = head._settings
    for after in (False, True):
        monkeypatch.setattr(head, "_settings", lambda device, *a, after=after: {
            **settings(device, *a), "soft": {**settings(device, *a)["soft"], "AFTER": after}})
        buf = HeadBuffers(R, V, H, torch.bfloat16, DEVICE, chunk=512, tile=256)
        fused_head(h.to(DEVICE), blocks.to(DEVICE), 30.0, H**0.5, t.to(DEVICE), u.to(DEVICE), buf, splits=2,
                   kind=kind)
        plain = HeadBuffers(R, V, H, torch.bfloat16, DEVICE, chunk=512, tile=256)
        fused_head(h.to(DEVICE), w.to(DEVICE), 30.0, H**0.5, t.to(DEVICE), u.to(DEVICE), plain, splits=2)
        assert torch.equal(buf.sample.cpu(), sample) and torch.equal(buf.sample.cpu(), plain.sample.cpu())
        assert torch.equal(buf.argmax.cpu(), argmax)
        assert (buf.entropy.cpu() - entropy).abs().max() < 1e-4
        assert (buf.entropy.cpu() - plain.entropy.cpu()).abs().max() < 1e-5
        err = (buf.soft.cpu().float() - soft).abs().max() / soft.abs().max()
        assert err < 8e-3, err
        assert torch.allclose(buf.soft.cpu().float(), plain.soft.cpu().float(), rtol=1e-2, atol=1e-2 * soft.abs().max())
    with pytest.raises(ValueError, match="cannot read"):
        fused_head(h, blocks[:, 1:], 30.0, H**0.5, t, u, HeadBuffers(R, V, H, torch.bfloat16, "cpu"), kind=kind)


def test_a_gguf_embedding_the_head_kernels_cannot_tile_takes_the_torch_path():
    """The GGUF head's kernels read whole tiles of the hidden size (256 inputs for the 256-weight types, else 128):
    where a model's is not (a small model), its head family is None and the sampler keeps the torch path."""
    import types

    from dgemma_cli.model import DiffusionGemma
    from dgemma_cli.sampler import use_fused_head
    from quant.ggml_modules import GGUFEmbedding, fused_head_fits

    assert fused_head_fits("Q6_K", 2816) and fused_head_fits("Q8_0", 2816) and fused_head_fits("Q8_0", 128)
    assert not fused_head_fits("Q6_K", 128) and not fused_head_fits("Q8_0", 96) and not fused_head_fits("F16", 256)
    for H, kind, family in ((256, "Q6_K", "head_gguf"), (96, "Q8_0", None)):
        model = types.SimpleNamespace(embed_tokens=GGUFEmbedding(8, H, kind, "meta"))
        model.packed_embedding = True
        assert DiffusionGemma.head_family.fget(model) == family
    assert not use_fused_head(torch.device("cuda"), torch.bfloat16, None)


@pytest.mark.slow
def test_fused_head_draws_follow_the_distribution():
    """Many rows of the same logits: each token is drawn about p_v of the time (chi-square well below its 0.999
    quantile); a peaked distribution across tiles draws its mode; rows never draw a token past the vocabulary."""
    from quant.kernels.head import HeadBuffers, fused_head

    R, H, V = 1000, 16, 300  # two tiles of 256, the second partial
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(V, H, generator=g) * 0.25).to(torch.bfloat16)
    h = torch.randn(1, H, generator=g).to(torch.bfloat16).expand(R, H).contiguous()
    t = torch.full((R,), 0.7)
    u = torch.rand(R, 2, generator=g)
    buf = HeadBuffers(R, V, H, torch.bfloat16, DEVICE, chunk=256, tile=256)
    fused_head(h.to(DEVICE), w.to(DEVICE), 30.0, 4.0, t.to(DEVICE), u.to(DEVICE), buf)
    sample = buf.sample.cpu()
    assert ((sample >= 0) & (sample < V)).all()
    p = torch.softmax(torch.tanh((h[0] @ w.t()).float() / 30.0) * 30.0 / 0.7, -1).double()
    counts = torch.bincount(sample, minlength=V).double()
    big = p * R >= 5  # the chi-square test's usual condition, the rest pooled
    expected = torch.cat([p[big] * R, (p[~big].sum() * R).view(1)])
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    dof = int(big.sum())  # cells - 1
    assert chi2 < dof + 4.4 * (2 * dof) ** 0.5, (chi2, dof)  # ~ the 0.999 quantile (normal approximation)


@pytest.fixture
def fused_head_on(monkeypatch):
    """The sampler takes the fused head wherever asked (here: the CPU, in the interpreter)."""
    import dgemma_cli.server.batching as batching
    import dgemma_cli.sampler as sampler

    monkeypatch.setattr(sampler, "use_fused_head", lambda device, dtype, family="head": True)
    monkeypatch.setattr(batching, "use_fused_head", lambda device, dtype, family="head": True)


def test_the_demo_answers_the_same_through_the_fused_head(fused_head_on, monkeypatch):
    """The bundled demo (a trained DiffusionGemma, bfloat16) greedy through the fused head and through the torch
    path: the same answer, in as many steps (its logits are float32 products in the head, rounded to 16 bits first
    on the torch path; a trained model's argmax does not sit on such a tie)."""
    import dgemma_cli.sampler as sampler
    from dgemma_cli.engine import load

    engine = load("demo", device=DEVICE, dtype="bfloat16")
    made = []
    original = sampler.new_buffers
    monkeypatch.setattr(sampler, "new_buffers", lambda *a, **kw: made.append(original(*a, **kw)) or made[-1])
    fused = engine.generate("What is the capital of France?", greedy=True, seed=0, max_new_tokens=32)
    assert made[-1].fused is not None and made[-1].logits is None  # no canvas x vocab float32 buffer
    monkeypatch.setattr(sampler, "use_fused_head", lambda device, dtype, family="head": False)
    torch_path = engine.generate("What is the capital of France?", greedy=True, seed=0, max_new_tokens=32)
    assert made[-1].fused is None
    assert fused.texts == torch_path.texts and fused.texts[0].strip()
    assert fused.steps_per_canvas == torch_path.steps_per_canvas


@pytest.mark.slow
def test_the_servers_batch_loop_through_the_fused_head(fused_head_on, monkeypatch, capfd):
    """Three requests in the server's loop through the fused head (no canvas x vocab float32 buffer): one row at a
    time, and two rows at once with rows joining and leaving (their soft embeddings move with them), give every
    request the same answer (on the CPU; on a GPU each the demo's): its draws come from its own generator, its rows
    never mix with another's. The same when every batched forward raises: the loop puts the rows' generators back
    (the head's uniforms are drawn before the forward) and runs each row alone on its rows of the buffers
    (`HeadBuffers.span`), and one line says so. And one row at a time is the single run of the same seed, step for
    step, on a slow canvas (one position accepted a step, a stop only when the argmax held for two steps: 20-40
    steps), whose length shows that each row compares its argmax with its own earlier ones, not with the head's
    reused buffer."""
    import dataclasses
    import threading

    import dgemma_cli.server.batching as batching
    from dgemma_cli.server.batching import BatchLoop, Job, RowDone
    from dgemma_cli.engine import load

    engine = load("demo", device=DEVICE, dtype="bfloat16")

    def answers(words: list[str], max_batch: int, settings) -> dict[str, tuple[str, list[int]]]:
        loop = BatchLoop(engine.model, max_batch=max_batch, max_queue=4)
        got: dict[str, tuple[str, list[int]]] = {}
        done = threading.Event()

        def sink(word):
            def deliver(ev):
                if isinstance(ev, RowDone):
                    got[word] = (engine.tokenizer.decode(ev.token_ids).strip(), ev.steps_per_canvas)
                    if len(got) == len(words):
                        done.set()
            return deliver

        try:
            assert loop.buf.fused is not None and loop.buf.logits is None
            with loop.cond:  # every job queued before the loop admits the first
                for i, word in enumerate(words):
                    ids = engine.prompt_ids(f"upper: {word}")
                    loop.submit(Job(ids, settings, i, engine.check_context(len(ids), settings)), sink(word))
            assert done.wait(300)
        finally:
            loop.close()
        return got

    words = ["hello", "diffusion", "canvas"]
    alone = answers(words, 1, engine.settings)
    assert all(w.upper() in alone[w][0] for w in words), alone  # the demo's (bfloat16) answers
    together = answers(words, 2, engine.settings)
    if DEVICE == "cpu":  # bit for bit per row on the CPU (server/batching.py); a GPU's matmuls may round rows otherwise
        assert together == alone
    else:
        assert all(w.upper() in together[w][0] for w in words), together
    real = batching.denoise_rows

    def no_batches(model, rows, *args, **kw):
        if len(rows) > 1:
            raise RuntimeError("no batches today")
        return real(model, rows, *args, **kw)

    monkeypatch.setattr(batching, "denoise_rows", no_batches)
    capfd.readouterr()
    retried = answers(words[:2], 2, engine.settings)
    monkeypatch.setattr(batching, "denoise_rows", real)
    if DEVICE == "cpu":
        assert retried == {w: alone[w] for w in words[:2]}
    else:
        assert all(w.upper() in retried[w][0] for w in words[:2]), retried
    assert capfd.readouterr().err == ("dgemma: internal error in a step of 2 rows together (each ran alone "
                                      "instead): RuntimeError: no batches today\n")
    slow = dict(entropy_bound=1e-6, stability_threshold=2, confidence_threshold=1e9, t_max=2.0)
    text, steps = answers(["canvas"], 1, dataclasses.replace(engine.settings, **slow))["canvas"]
    assert steps[0] > 3
    if DEVICE == "cpu":  # the same draws as the single run of that seed
        single = engine.generate("upper: canvas", seed=0, **slow)
        assert (single.texts[0], single.steps_per_canvas[0]) == (text, steps)


def test_the_soft_embedding_and_router_splits_fill_the_gpu(monkeypatch):
    """At batch 1 the soft-embedding grid is 88 programs; the split makes the fewest waves per unit of work for each
    GPU's SM count (H200 132: 3, RTX 4090 128: 7, RTX 5090 170: 7), and none where the SM count is unknown. The
    router's 16 token blocks of a canvas (64 of four) split their inputs 8 ways (2) by the same rule, in powers of
    two (kernels.fewest_waves)."""
    import quant.kernels as kernels
    import quant.kernels.head as head

    meta = torch.device("meta")
    for cc, want in ((90, 3), (89, 7), (120, 7)):
        monkeypatch.setattr(kernels, "arch", lambda device, cc=cc: cc)
        assert head._splits(meta, 88, 256) == want
        assert kernels.fewest_waves(meta, 16, (1, 2, 4, 8)) == 8
        assert kernels.fewest_waves(meta, 64, (1, 2, 4, 8)) == 2
    monkeypatch.undo()
    assert head._splits(torch.device("cpu"), 88, 256) == 1


def test_a_head_stopped_midway_is_reset():
    """The chunk maxima are the one state a step leaves for the next (-inf): stale ones (a head that raised midway)
    scale the soft embedding to nothing; HeadBuffers.reset, which the server's loop calls after a failed step, puts
    them back."""
    from quant.kernels.head import HeadBuffers, fused_head, head_reference

    h, w, t, u = _head_case(R=5, H=64, V=600, seed=6)
    buf = HeadBuffers(5, 600, 64, torch.bfloat16, DEVICE, chunk=256, tile=256)
    args = (h.to(DEVICE), w.to(DEVICE), 30.0, 8.0, t.to(DEVICE), u.to(DEVICE), buf)
    soft = head_reference(h, w, 30.0, 8.0, t, u, tile=256)[3]
    buf.chunk_max.fill_(1e4)  # as a step stopped after its first chunks might leave them
    fused_head(*args)
    assert (buf.soft.cpu().float() - soft).abs().max() > 0.5 * soft.abs().max()
    buf.reset()
    fused_head(*args)
    assert ((buf.soft.cpu().float() - soft).abs().max() / soft.abs().max()) < 8e-3


@pytest.mark.slow  # make test's time (the held rows' host search through the loop: tests/test_held_rows.py)
@pytest.mark.parametrize("on_device", [pytest.param(False, id="host-search"), pytest.param(True, id="device-search")])
def test_structured_rows_through_the_fused_head(fused_head_on, on_device, monkeypatch):
    """The server's batch loop with the fused head (no log-probabilities in its buffers): a row held to a regular
    expression gets its own from the step's hidden states (host-search) or its class pass runs in the head and its
    programme on the device (device-search: the interpreter stands in for a GPU), answers within the expression for
    every seed, and greedily answers as the torch path's loop does; a free row beside it keeps the fused head's
    answer."""
    import threading

    from dgemma_cli.structured import constrain

    monkeypatch.setattr(constrain, "device_search_default", lambda device: on_device)

    import dgemma_cli.server.batching as batching
    from dgemma_cli.server.batching import BatchLoop, Job, RowDone
    from dgemma_cli.structured.constrain import Structure
    from dgemma_cli.engine import load

    engine = load("demo", device=DEVICE, dtype="bfloat16")
    auto = engine.automaton(Structure("regex", "[A-Z ]{16}"))
    pattern = __import__("re").compile("[A-Z ]{16}")

    def run(jobs):
        loop = BatchLoop(engine.model, max_batch=4, max_queue=8)
        got, done = {}, threading.Event()

        def sink(key):
            def deliver(ev):
                if isinstance(ev, RowDone):
                    got[key] = engine.tokenizer.decode(ev.token_ids)
                    if len(got) == len(jobs):
                        done.set()
            return deliver

        try:
            for key, (prompt, seed, settings, automaton) in jobs.items():
                ids = engine.prompt_ids(prompt)
                loop.submit(Job(ids, settings, seed, engine.check_context(len(ids), settings), automaton=automaton),
                            sink(key))
            assert done.wait(300)
        finally:
            fused = loop.buf.fused is not None
            assert (loop._held_keys is not None) == (fused and on_device)  # the head made class keys
            loop.close()
        return got, fused

    import dataclasses

    greedy = dataclasses.replace(engine.settings, greedy=True)
    jobs = {f"held {s}": ("upper: hello diffusions", s, engine.settings, auto) for s in range(4)}
    jobs["free"] = ("upper: abc def 12 ghijk", 0, engine.settings, None)
    jobs["greedy"] = ("upper: the quick brown ", 0, greedy, auto)
    got, fused = run(jobs)
    assert fused
    for key, text in got.items():
        if key != "free":
            assert pattern.fullmatch(text), (key, text)
    batching.use_fused_head = lambda device, dtype, family="head": False  # restored by the fixture's monkeypatch
    torch_path, fused = run({"greedy": jobs["greedy"]})
    assert not fused and torch_path["greedy"] == got["greedy"]


def test_logprobs_through_the_fused_head_are_the_torch_paths(fused_head_on):
    """A row that asks for log-probabilities through the fused head (whose buffers hold none) gets them from its
    step's hidden states: greedily, the same tokens with the same values and the same alternatives as the torch
    path's loop (within bfloat16's rounding of the logits, which the torch path rounds and the head does not)."""
    import dataclasses
    import math
    import threading

    import dgemma_cli.server.batching as batching
    from dgemma_cli.server.batching import BatchLoop, Job, RowCanvas, RowDone
    from dgemma_cli.engine import load

    engine = load("demo", device=DEVICE, dtype="bfloat16")
    greedy = dataclasses.replace(engine.settings, greedy=True)

    def canvases() -> tuple[list[RowCanvas], bool]:
        loop = BatchLoop(engine.model, max_batch=2, max_queue=4)
        got, done = [], threading.Event()

        def deliver(ev):
            if isinstance(ev, RowCanvas):
                got.append(ev)
            elif isinstance(ev, RowDone):
                done.set()

        try:
            ids = engine.prompt_ids("upper: hello diffusions")
            loop.submit(Job(ids, greedy, 0, engine.check_context(len(ids), greedy), logprobs=3), deliver)
            assert done.wait(300)
        finally:
            fused = loop.buf.fused is not None
            loop.close()
        return got, fused

    head, fused = canvases()
    assert fused and head and all(c.logprobs is not None for c in head)
    batching.use_fused_head = lambda device, dtype, family="head": False  # restored by the fixture's monkeypatch
    torch_path, fused = canvases()
    assert not fused
    assert [c.tokens for c in head] == [c.tokens for c in torch_path]
    for a, b in zip(head, torch_path):
        assert len(a.logprobs) == len(b.logprobs) == len(a.tokens)
        for (va, top_a), (vb, top_b), token in zip(a.logprobs, b.logprobs, a.tokens):
            assert math.isclose(va, vb, abs_tol=0.05), (token, va, vb)
            assert len(top_a) == len(top_b) == 3 and top_a[0][0] == top_b[0][0] == token  # greedy: the argmax
            assert all(math.isclose(x, y, abs_tol=0.05) for (_, x), (_, y) in zip(top_a, top_b)), (top_a, top_b)
            assert va <= 0 and all(x >= y for (_, x), (_, y) in zip(top_a, top_a[1:]))



@pytest.mark.parametrize("own_generators", [False, True])
def test_the_prepared_steps_draws_follow_the_distribution(own_generators):
    """The draws a step makes from the uniforms `prepare_step` writes before the forward (torch's generator, or each
    request's own): each token about p_v of the time. The head draws a tile by the first uniform and a token within
    it by the second, so the two must be independent: were they one number, a uniform distribution over two tiles
    would only ever draw the first quarter and the last quarter of the vocabulary. Counted through head_reference
    (the draw as a function of the uniforms, which the kernel computes: checked here on a few rows and in
    test_fused_head_equals_its_reference_from_the_same_uniforms)."""
    from dgemma_cli.sampler import SamplerBuffers, prepare_step, sample_step
    from quant.kernels.head import TILE, fused_head, head_reference

    R, H, V = 4000, 16, 2 * TILE
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(1, H, generator=g) * 0.25).to(torch.bfloat16).expand(V, H).contiguous()  # equal logits
    h = torch.randn(R, H, generator=g).to(torch.bfloat16)
    buf = SamplerBuffers(R, V, DEVICE, head=(H, torch.bfloat16))
    temperature = torch.tensor(0.7, device=DEVICE)
    torch.manual_seed(11)
    gens = [torch.Generator(device=DEVICE).manual_seed(100 + i) for i in range(R // 40)] if own_generators else None
    prepare_step(buf, temperature, gens)  # 100 requests of a 40-position canvas each, or torch's generator
    assert torch.equal(buf.temperature.cpu(), torch.full((R,), 0.7))
    sample = head_reference(h, w, 30.0, 4.0, buf.temperature.cpu(), buf.uniforms.cpu(), tile=TILE)[0]
    bins = torch.bincount(sample // (V // 8), minlength=8).double()  # eight bins of 32 tokens: 500 draws each
    chi2 = ((bins - R / 8) ** 2 / (R / 8)).sum().item()
    assert chi2 < 24.3, (chi2, bins.tolist())  # chi-square, 7 degrees of freedom: its 0.999 quantile
    # the kernel draws what the reference draws from those uniforms (a few rows: Triton's interpreter is slow)
    n = 24
    fused_head(h[:n].to(DEVICE), w.to(DEVICE), 30.0, 4.0, buf.temperature[:n], buf.uniforms[:n], buf.fused.first(n))
    assert torch.equal(sample_step(buf.first(n), temperature)[0].cpu(), sample[:n])


def _held_reference(h, w, cap, t, u, class_of, slot, width):
    """The class pass of held rows as the head runs it, in torch ops: x = capped logits / t in base 2, each class's
    best x and best x + Gumbel noise x log2 e (philox keyed by the row's uniforms at the token), as keys."""
    import numpy as np

    from quant.kernels.class_pass import KEY_MIN, keys_of, philox_uniform

    LOG2E = 1.4426950408889634
    l = h.float() @ w.float().t()
    if cap:
        l = torch.tanh(l / cap) * cap
    x = l / t.float()[:, None] * LOG2E
    R, V = x.shape
    keys = torch.full((2, R, width), KEY_MIN, dtype=torch.int64)
    bits = u.float().contiguous().view(torch.int32).long()
    for r in range(R):
        if slot[r] < 0:
            continue
        seed = (int(bits[r, 0]) << 32) | (int(bits[r, 1]) & 0xFFFFFFFF)
        g = -torch.log(-torch.log(torch.from_numpy(philox_uniform(seed, np.arange(V))).clamp(min=1e-20))) * LOG2E
        cls = class_of[slot[r]].long()
        inside = cls >= 0
        toks = torch.arange(V)[inside]
        keys[0, r].scatter_reduce_(0, cls[inside], keys_of(x[r, inside], toks), "amax")
        keys[1, r].scatter_reduce_(0, cls[inside], keys_of(x[r, inside] + g[inside], toks), "amax")
    return keys


@pytest.mark.parametrize("size", [pytest.param((13, 300, 128, 256), id="small", marks=pytest.mark.slow),
                                  pytest.param((37, 1000, 256, 512), id="two-chunks", marks=pytest.mark.slow)])
def test_the_head_runs_the_class_pass_of_held_rows(size):
    """Rows held to structures (two class maps, free rows between them): the logits kernel's class pass equals the
    same pass in torch ops on the reference's logits (the same keys, values within the logits' rounding), the free
    rows' keys are untouched, and the head's own outputs are as without held rows."""
    from quant.kernels.class_pass import KEY_MIN, indices_of, values_of
    from quant.kernels.head import HeadBuffers, HeldRows, fused_head, head_reference

    R, V, tile, chunk = size
    h, w, t, u = _head_case(R=R, H=64, V=V, seed=4)
    H = h.shape[1]
    g = torch.Generator().manual_seed(9)
    width = 12
    class_of = torch.randint(-1, width, (2, V), generator=g, dtype=torch.int32)
    slot = torch.tensor([0] * (R // 3) + [-1] * (R // 3) + [1] * (R - 2 * (R // 3)), dtype=torch.int32)
    keys = torch.full((2, R + 5, width), KEY_MIN, dtype=torch.int64)
    buf = HeadBuffers(R + 5, V, H, torch.bfloat16, DEVICE, chunk=chunk, tile=tile)
    from dgemma_cli.structured.device_search import tile_runs

    tables = [tile_runs(class_of[k].numpy(), tile) for k in range(2)]
    buf.held = HeldRows(torch.cat([slot, torch.full((5,), -1, dtype=torch.int32)]).to(DEVICE),
                        torch.stack([torch.from_numpy(t[0]) for t in tables]).to(DEVICE),
                        torch.stack([torch.from_numpy(t[1]) for t in tables]).to(DEVICE), keys.to(DEVICE))
    fused_head(h.to(DEVICE), w.to(DEVICE), 30.0, H**0.5, t.to(DEVICE), u.to(DEVICE), buf)
    sample, argmax, _, _ = head_reference(h, w, 30.0, H**0.5, t, u, tile=tile)
    assert torch.equal(buf.first(R).sample.cpu(), sample) and torch.equal(buf.first(R).argmax.cpu(), argmax)
    got = buf.held.keys.cpu()[:, :R]
    want = _held_reference(h, w, 30.0, t, u, class_of, slot, width)
    held = slot >= 0
    assert (got[:, ~held] == KEY_MIN).all() and (got[:, held] != KEY_MIN).all()
    assert torch.equal(indices_of(got), indices_of(want))
    assert (values_of(got[:, held]) - values_of(want[:, held])).abs().max() < 1e-3
