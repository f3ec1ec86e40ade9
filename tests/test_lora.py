"""LoRA adapters in PEFT's format (dgemma_cli/tuner/lora.py) against transformers + peft on tiny random checkpoints.

Adapters are made by peft itself (get_peft_model on transformers' DiffusionGemma, random A and B, saved with
save_pretrained); dgemma applies them unmerged and must give peft's tokens (generation) and logits."""

import json
import shutil

import pytest
import torch

from cli_helpers import run_main
from test_exactness import random_prompt, ref_generate, rel_err

peft = pytest.importorskip("peft")

# every kind of module an adapter may hold: attention and dense MLP on both passes (different deltas per pass, as
# the reference's two module trees allow), the self-conditioning MLP, the routed experts through target_parameters;
# per-module rank and alpha
TARGETS = (r".*language_model.*\.(q_proj|k_proj|o_proj|gate_proj)"
           r"|.*decoder.*\.(q_proj|v_proj|o_proj|up_proj|down_proj)")


def both_passes(model, cfg, prompt_len: int, seed: int):
    """-> a function giving (encoder logits, decoder logits) of `model` for a seeded random prompt and canvas."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.text.vocab_size, (1, prompt_len), generator=g)
    canvas = torch.randint(0, cfg.text.vocab_size, (1, cfg.canvas_length), generator=g)

    def logits():
        kv = model.new_cache(1, prompt_len + cfg.canvas_length)
        with torch.no_grad():
            enc = model.logits(model.encode(prompt, kv, return_hidden=True))
            return enc, model.denoise(canvas, kv, model.denoise_context(kv, 1))
    return logits


def make_adapter(path, out, seed=0, tokens=None, **extra):
    """A peft adapter with random A and B for the checkpoint at `path`, written to `out`; returns peft's model."""
    from peft import LoraConfig, get_peft_model
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype="float32").eval()
    kw = dict(r=4, lora_alpha=8, target_modules=TARGETS, target_parameters=["experts.gate_up_proj",
                                                                           "experts.down_proj"],
              init_lora_weights=False, rank_pattern={"o_proj": 2}, alpha_pattern={"v_proj": 3}, use_rslora=True)
    kw.update(extra)
    if tokens:
        kw["trainable_token_indices"] = {"embed_tokens": tokens}
    m = get_peft_model(ref, LoraConfig(**kw))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_" in n:
                p.mul_(3)  # deltas large enough to change the tokens
            if "trainable_tokens_delta" in n:
                p.copy_(torch.randn_like(p))
    m.save_pretrained(out)
    return m.eval()


def test_run_with_a_peft_adapter_gives_peft_tokens(checkpoints, tmp_path, capsys):
    path = checkpoints["five_to_one"]
    peft_model = make_adapter(path, tmp_path / "ad")
    ref = peft_model.base_model.model  # transformers' model with peft's layers in it
    from dgemma_cli.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(path)
    ids = tok.encode("Write a function that adds two numbers, then explain it line by line.")
    C = json.loads((path / "config.json").read_text())["canvas_length"]
    base_args = ["run", "--model", str(path), "--raw", "--seed", "3", "--max-new-tokens", str(3 * C), "--steps", "12",
                 "--json", "--device", "cpu", "--dtype", "float32"]
    text = "Write a function that adds two numbers, then explain it line by line."
    with torch.no_grad():
        expected, _ = ref_generate(ref, [ids], 3, max_new_tokens=3 * C, max_denoising_steps=12)
    assert run_main([*base_args, text, "--adapter", str(tmp_path / "ad")]) == 0
    got = json.loads(capsys.readouterr().out)["token_ids"]
    assert got == expected[0]
    assert run_main([*base_args, text]) == 0  # the base alone answers otherwise: the adapter mattered
    base = json.loads(capsys.readouterr().out)["token_ids"]
    assert base != got
    assert run_main([*base_args, text, "--adapter", f"{tmp_path / 'ad'}:0"]) == 0  # scale 0: the base's tokens
    assert json.loads(capsys.readouterr().out)["token_ids"] == base


def test_adapter_logits_match_peft_per_pass_with_token_rows(checkpoints, tmp_path):
    """Encoder and decoder logits, with trainable token rows (peft replaces embedding rows per module tree; the
    tied head takes the encoder's). Rows are replaced, not added: such an adapter runs at scale 1 and alone."""
    from transformers.cache_utils import DynamicCache

    from dgemma_cli.tuner.lora import attach, read_adapter
    from dgemma_cli.checkpoint.weights import load_model

    path = checkpoints["five_to_one"]
    m = make_adapter(path, tmp_path / "ad", seed=1, tokens=[5, 7, 300])
    ref = m.base_model.model
    model, cfg = load_model(path, dtype=torch.float32)
    from dgemma_cli.tuner.lora import AdapterError

    for pair in ([(read_adapter(tmp_path / "ad"), 0.5)], [(read_adapter(tmp_path / "ad"), 1.0)] * 2):
        with pytest.raises(AdapterError, match="embedding rows"):
            attach(model, pair)
    attach(model, [(read_adapter(tmp_path / "ad"), 1.0)])
    assert model.adapters == [("ad", 1.0)]
    V, C = cfg.text.vocab_size, cfg.canvas_length
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (2, 25), generator=g)
    prompt[0, 3], prompt[1, 4] = 5, 300
    canvas = torch.randint(0, V, (2, C), generator=g)
    canvas[0, 2] = 7
    cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
    kv = model.new_cache(2, prompt.shape[1] + C)
    with torch.no_grad():
        enc = ref.model.encoder(input_ids=prompt, cache=cache).last_hidden_state
        ref_enc = torch.tanh(ref.lm_head(enc).float() / 30) * 30
        assert rel_err(model.logits(model.encode(prompt, kv, return_hidden=True)), ref_enc) < 1e-4
        first = ref(decoder_input_ids=canvas, cache=cache).logits
        ours = model.denoise(canvas, kv, model.denoise_context(kv, 2))
        assert rel_err(ours, first) < 1e-4
        plain, _ = load_model(path, dtype=torch.float32)
        kv2 = plain.new_cache(2, prompt.shape[1] + C)
        plain.encode(prompt, kv2)
        assert rel_err(plain.denoise(canvas, kv2, plain.denoise_context(kv2, 2)), first) > 0.1


def test_adapter_bad_inputs_one_line(checkpoints, tmp_path, capsys):
    small, other = checkpoints["five_to_one"], checkpoints["alternating"]
    make_adapter(other, tmp_path / "other", target_parameters=None)
    args = ["run", "hello", "--model", str(small), "--raw", "--device", "cpu", "--max-new-tokens", "8"]
    cases = {"missing": (["--adapter", str(tmp_path / "nope")], "no such adapter directory"),
             "scale": (["--adapter", f"{tmp_path / 'other'}:inf"], "finite number"),
             "other base": (["--adapter", str(tmp_path / "other")], "does not fit this model")}  # other sizes
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "other", bad)
    (bad / "adapter_config.json").write_text("{not json")
    cases["config"] = (["--adapter", str(bad)], "cannot read it")
    dora = tmp_path / "dora"
    shutil.copytree(tmp_path / "other", dora)
    c = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**c, "use_dora": True}))
    cases["dora"] = (["--adapter", str(dora)], "use_dora")
    capsys.readouterr()  # transformers' progress bars while the adapter was made
    for name, (extra, words) in cases.items():
        assert run_main([*args, *extra]) != 0, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0] and "Traceback" not in err[0], (name, err)


def test_rank_above_the_layer_is_refused(checkpoints, tmp_path):
    from safetensors.torch import save_file

    from dgemma_cli.tuner.lora import AdapterError, attach, read_adapter
    from dgemma_cli.checkpoint.weights import load_model

    path = checkpoints["five_to_one"]
    model, cfg = load_model(path, dtype=torch.float32)
    H = cfg.text.hidden_size
    r = H + 1
    out = tmp_path / "wide"
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": r,
                                                         "target_modules": ["q_proj"]}))
    q = model.layers[0].self_attn.q_proj
    key = "base_model.model.model.decoder.layers.0.self_attn.q_proj"
    save_file({f"{key}.lora_A.weight": torch.zeros(r, H), f"{key}.lora_B.weight": torch.zeros(q.out_features, r)},
              str(out / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="above the layer's size"):
        attach(model, [(read_adapter(out), 1.0)])
    assert type(model.layers[0].self_attn.q_proj) is torch.nn.Linear and model.adapters == []  # nothing changed


def test_unmerged_expert_terms_equal_the_fold(checkpoints, tmp_path, monkeypatch):
    """Off the CPU the experts' deltas run as grouped low-rank matmuls beside the base's (never folded): the same
    logits as the fold, to float32 rounding."""
    from dgemma_cli.tuner.lora import ExpertLowRank, attach, read_adapter
    from dgemma_cli.checkpoint.weights import load_model

    path = checkpoints["five_to_one"]
    make_adapter(path, tmp_path / "ad", seed=2, target_modules=[])
    model, cfg = load_model(path, dtype=torch.float32)
    attach(model, [(read_adapter(tmp_path / "ad"), 1.0)])
    logits = both_passes(model, cfg, 20, seed=0)
    folded = logits()
    monkeypatch.setattr(ExpertLowRank, "folds", lambda self, x: False)
    unmerged = logits()
    for a, b in zip(folded, unmerged):
        assert rel_err(b, a) < 1e-4
    model.layers[0].experts.low_rank = None  # and the terms matter
    assert rel_err(logits()[1], folded[1]) > 1e-3


def test_a_dgemma_adapter_loads_in_peft_with_the_same_tokens(checkpoints, tmp_path, capsys):
    """new_adapter + save_adapter (what dgemma tune writes), B made non-zero: peft's PeftModel.from_pretrained on
    transformers' model generates dgemma's tokens."""
    from peft import PeftModel
    from transformers import DiffusionGemmaForBlockDiffusion

    from dgemma_cli.tuner.lora import new_adapter, save_adapter
    from dgemma_cli.checkpoint.weights import load_model

    path = checkpoints["five_to_one"]
    model, cfg = load_model(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    ad = new_adapter(model, rank=4, alpha=8, targets=("attention", "mlp", "self_conditioning"), expert_rank=2,
                     generator=g, base=str(path))
    with torch.no_grad():
        for A, B, _ in list(ad.linears.values()) + [p for parts in ad.experts.values() for p in parts]:
            B.copy_(torch.randn(B.shape, generator=g) * 0.5)
    save_adapter(ad, tmp_path / "mine")
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["adapter_config.json",
                                                                   "adapter_model.safetensors"]
    ref = PeftModel.from_pretrained(DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype="float32"),
                                    tmp_path / "mine").eval()
    V, C = cfg.text.vocab_size, cfg.canvas_length
    prompt = random_prompt(19, V, 8)
    with torch.no_grad():
        expected, _ = ref_generate(ref.base_model.model, [prompt], 6, max_new_tokens=3 * C, max_denoising_steps=10)
    from dgemma_cli.engine import load

    ours = load(path, device="cpu", dtype="float32", adapters=[(tmp_path / "mine", 1.0)])
    got = ours.generate([prompt], seed=6, max_new_tokens=3 * C, max_denoising_steps=10).token_ids
    assert got == expected
    plain = load(path, device="cpu", dtype="float32").generate([prompt], seed=6, max_new_tokens=3 * C,
                                                                max_denoising_steps=10).token_ids
    assert plain != got


def demo_adapters(tmp_path, n=2):
    """n adapters for the bundled demo model with random B (so each changes the answers), saved as peft does."""
    from dgemma_cli.tuner.lora import new_adapter, save_adapter
    from dgemma_cli.checkpoint.weights import load_model
    from dgemma_cli.checkpoint.names import DEMO_MODEL

    model, _ = load_model(DEMO_MODEL, dtype=torch.float32)
    dirs = []
    for k in range(n):
        g = torch.Generator().manual_seed(20 + k)
        ad = new_adapter(model, rank=4, alpha=8, targets=("attention", "mlp"), expert_rank=2, generator=g)
        with torch.no_grad():
            for A, B, _ in list(ad.linears.values()) + [p for parts in ad.experts.values() for p in parts]:
                B.copy_(torch.randn(B.shape, generator=g) * 0.3)
        save_adapter(ad, tmp_path / f"ad{k}")
        dirs.append(tmp_path / f"ad{k}")
    return dirs


def test_rows_of_one_batch_choose_their_adapter(tmp_path):
    """Rows with adapter slots 0 (base), 1 and 2 in one forward: each row's logits are bit for bit the logits of
    that row alone with only its adapter."""
    from dgemma_cli.tuner.lora import attach, read_adapter
    from dgemma_cli.checkpoint.names import DEMO_MODEL
    from dgemma_cli.checkpoint.weights import load_model

    dirs = demo_adapters(tmp_path)
    both, cfg = load_model(DEMO_MODEL, dtype=torch.float32)
    attach(both, [(read_adapter(d), 1.0) for d in dirs], slots=[1, 2])
    g = torch.Generator().manual_seed(3)
    V, C = cfg.text.vocab_size, cfg.canvas_length
    prompt = torch.randint(107, V, (1, 12), generator=g)
    canvas = torch.randint(0, V, (3, C), generator=g)

    def forward(model, rows, slots):
        """rows of canvas, one cache each (the server's layout), each row's adapter slot (None: as attached)."""
        caches = []
        for s in slots:
            kv = model.new_cache(1, 12 + C)
            model.phase.row_slots = None if s is None else torch.tensor([s])
            model.encode(prompt, kv)
            caches.append(kv)
        model.phase.row_slots = None if None in slots else torch.tensor(slots)
        with torch.no_grad():
            out = model.denoise(canvas[rows], caches, [model.denoise_context(kv, 1) for kv in caches],
                                experts_per_row=True)
        model.phase.row_slots = None
        return out

    mixed = forward(both, [0, 1, 2], [0, 1, 2])
    for row, d in zip((1, 2), dirs):
        alone, _ = load_model(DEMO_MODEL, dtype=torch.float32)
        attach(alone, [(read_adapter(d), 1.0)])
        assert torch.equal(mixed[row], forward(alone, [row], [None])[0])
    plain, _ = load_model(DEMO_MODEL, dtype=torch.float32)
    assert torch.equal(mixed[0], forward(plain, [0], [None])[0])
    assert not torch.equal(mixed[1], mixed[2])


def test_rows_choose_their_adapter_on_the_router_too():
    """An adapter on the router's projection, which runs on the batch's tokens flattened ([B*T, H], not [B, T, H]):
    a base row and an adapted row in one forward each get the logits they get alone."""
    from pathlib import Path

    from dgemma_cli.tuner.lora import Adapter, attach
    from dgemma_cli.checkpoint.names import DEMO_MODEL
    from dgemma_cli.checkpoint.weights import load_model

    model, cfg = load_model(DEMO_MODEL, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    H, E, V, C = cfg.text.hidden_size, cfg.text.num_experts, cfg.text.vocab_size, cfg.canvas_length
    ad = Adapter(Path("router"), {"r": 4, "lora_alpha": 8})
    for side in ("encoder", "decoder"):
        ad.linears[(side, "layers.0.router.proj")] = (torch.randn(4, H, generator=g), torch.randn(E, 4, generator=g),
                                                      2.0)
    prompt, canvas = torch.randint(107, V, (1, 8), generator=g), torch.randint(0, V, (2, C), generator=g)

    def forward(m, rows, slots):
        caches = []
        for s in slots:
            caches.append(m.new_cache(1, 8 + C))
            m.phase.row_slots = None if s is None else torch.tensor([s])
            m.encode(prompt, caches[-1])
        m.phase.row_slots = None if None in slots else torch.tensor(slots)
        with torch.no_grad():
            out = m.denoise(canvas[rows], caches, [m.denoise_context(kv, 1) for kv in caches], experts_per_row=True)
        m.phase.row_slots = None
        return out

    plain, _ = load_model(DEMO_MODEL, dtype=torch.float32)
    attach(model, [(ad, 1.0)], slots=[1])
    mixed = forward(model, [0, 1], [0, 1])
    assert torch.equal(mixed[0], forward(plain, [0], [None])[0])
    assert torch.equal(mixed[1], forward(model, [1], [None])[0])
    assert not torch.equal(mixed[1], forward(plain, [1], [None])[0])


@pytest.mark.slow  # make test's time (CI runs it in make test-slow)
def test_serve_answers_each_adapter_as_run_does(tmp_path):
    """`dgemma serve --adapter a=DIR --adapter b=DIR`: /v1/models lists them on the base; concurrent requests for
    the base and each adapter get exactly what the engine gives alone with that adapter."""
    from concurrent.futures import ThreadPoolExecutor

    from dgemma_cli.engine import load
    from test_serve import ServerProcess

    dirs = demo_adapters(tmp_path)
    s = ServerProcess(tmp_path, "--adapter", f"a={dirs[0]}", "--adapter", f"b={dirs[1]}:0.5")
    try:
        cards = {m["id"]: m for m in s.http.get("/v1/models").json()["data"]}
        assert set(cards) == {"demo", "a", "b"} and cards["a"]["parent"] == "demo"
        prompts = ["upper: hello diffusions", "upper: abc def 12 ghijk"]
        jobs = [(m, p) for m in ("demo", "a", "b") for p in prompts]

        def ask(job):
            m, p = job
            r = s.http.post("/v1/chat/completions", json={"model": m, "seed": 4,
                                                          "messages": [{"role": "user", "content": p}]})
            assert r.status_code == 200, r.text
            return r.json()["model"], r.json()["choices"][0]["message"]["content"]

        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(ask, jobs))
        engines = {"demo": load("demo", device="cpu", dtype="float32"),
                   "a": load("demo", device="cpu", dtype="float32", adapters=[(dirs[0], 1.0)]),
                   "b": load("demo", device="cpu", dtype="float32", adapters=[(dirs[1], 0.5)])}
        for (m, p), (named, text) in zip(jobs, got):
            assert named == m
            assert text == engines[m].generate(p, seed=4).texts[0], (m, p)
        assert got[0][1] != got[2][1] or got[0][1] != got[4][1]  # the adapters changed something
        r = s.http.post("/v1/chat/completions", json={"model": "c", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and "'a'" in r.json()["error"]["message"]
        tags = [m["name"] for m in s.http.get("/api/tags").json()["models"]]  # Ollama's API lists them too
        assert tags == ["demo:latest", "a:latest", "b:latest"]
        r = s.http.post("/api/generate", json={"model": "b", "prompt": "upper: hello diffusions", "stream": False,
                                               "options": {"seed": 4}})
        assert r.status_code == 200 and r.json()["model"] == "b:latest"
    finally:
        assert s.stop() == 0, "".join(s.lines)


def test_info_and_list_show_adapters_and_their_base(tmp_path, capsys):
    assert run_main(["info", "demo-sudoku-lora"]) == 0
    out = capsys.readouterr().out
    assert "adapts:                 demo" in out and "rank:                   64" in out and "routed experts:         yes" in out
    assert run_main(["list", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    lora = [r for r in rows if r["name"] == "demo-sudoku-lora"]
    assert lora and lora[0]["adapter_of"] == "demo" and lora[0]["format"] == "lora"
    dirs = demo_adapters(tmp_path, 1)
    assert run_main(["info", str(dirs[0]), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ranks"] == [4] and d["experts"] is True and "self_attn.q_proj" in d["modules"]


def test_the_bundled_sudoku_adapter_solves_the_demo_puzzle(capsys):
    """The README's and `make demo-lora`'s puzzle (held out: neither it nor its solution was tuned on): the base
    answers garbage, the adapter the solution, in at most 10 steps."""
    args = ["run", "--model", "demo", "--steps", "10", "--seed", "0", "--device", "cpu", "-q",
            "sudoku: ..4./..../.2.1/3..."]
    assert run_main(args) == 0
    assert capsys.readouterr().out.split() != ["1342", "2413", "4231", "3124"]
    assert run_main([*args, "--adapter", "demo-sudoku-lora"]) == 0
    assert capsys.readouterr().out.split() == ["1342", "2413", "4231", "3124"]


@pytest.mark.slow
def test_quantized_experts_take_the_adapter_in_their_kernels(checkpoints, tmp_path, monkeypatch):
    """An NVFP4 base with a peft adapter on its experts (and attention, dense MLP): under DGEMMA_KERNELS=triton (the
    interpreter here) the experts run the fused kernels with the adapter's terms (one rank-product launch per
    adapted projection, the rest in their epilogues), no expert stack is dequantized, and the logits are the torch
    path's (which dequantizes and adds the terms with torch's ops) to float32 rounding."""
    from dgemma_cli.tuner.lora import attach, read_adapter
    from dgemma_cli.store.quantize import quantize_checkpoint
    from dgemma_cli.checkpoint.weights import load_model
    import quant.kernels.moe_lora as moe_lora
    from quant.modules import NVFP4Stack

    path = checkpoints["five_to_one"]
    quantize_checkpoint(path, tmp_path / "q", "nvfp4", "all")
    make_adapter(path, tmp_path / "ad", seed=4)
    model, cfg = load_model(tmp_path / "q", dtype=torch.float32)
    attach(model, [(read_adapter(tmp_path / "ad"), 1.0)])
    passes = both_passes(model, cfg, 12, seed=1)

    shrinks = []
    real = moe_lora.moe_lora_shrink
    monkeypatch.setattr(moe_lora, "moe_lora_shrink", lambda *a, **k: shrinks.append(1) or real(*a, **k))
    monkeypatch.setenv("DGEMMA_KERNELS", "torch")
    reference = passes()
    monkeypatch.setenv("DGEMMA_KERNELS", "triton")
    monkeypatch.setattr(NVFP4Stack, "dequantize", lambda *a: pytest.fail("an expert stack was dequantized"))
    fused = passes()
    assert len(shrinks) == 2 * 2 * len(model.layers)  # gate-up and down, every layer of both passes
    # measured: 6.0e-6 (encoder) and 7.4e-5 (decoder) with this test alone in its process, 1.6e-4 (decoder) in a CI
    # worker where other files' tests ran first in the same process (what in that process's state moves the
    # decoder's last bits was not found; the path taken is the same: the shrink count above)
    for a, b in zip(fused, reference):
        assert rel_err(a, b) < 5e-4
