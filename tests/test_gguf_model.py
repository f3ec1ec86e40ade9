"""A DiffusionGemma GGUF run by dgemma: a tiny model in the `diffusion-gemma` converter's layout, written by the
`gguf` library with every block type dgemma reads (tests/gguf_fixture.py), gives on the CPU exactly the tokens the
reference (transformers) gives on its twin, the same checkpoint holding what `gguf.dequantize` reads from the file.
And what a GGUF cannot do is said in one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from checkpoints import build_checkpoint  # noqa: E402
from cli_helpers import run_main  # noqa: E402
from fake_hub import fake_hub  # noqa: E402, F401  (the fixture)
from gguf_fixture import GGUF_SPEC, write_gguf, write_twin  # noqa: E402
from test_exactness import random_prompt, ref_generate  # noqa: E402

from dgemma_cli.engine import load  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(the GGUF, its twin, the checkpoint it was made from). The GGUF's directory holds the tokenizer and the
    generation config beside it, as GGUF repositories often do."""
    root = tmp_path_factory.mktemp("gguf_model")
    src = build_checkpoint(root / "hf", GGUF_SPEC, seed=0)
    (root / "gguf").mkdir()
    path = root / "gguf" / "tiny-Q4_K_M.gguf"
    held = write_gguf(src, path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(src / name, root / "gguf" / name)
    return path, write_twin(src, root / "twin", held), src


def test_the_fixture_mixes_every_type_dgemma_reads(files):
    from dgemma_cli.checkpoint.gguf_file import GGUFFile
    from quant import ggml

    f = GGUFFile(files[0])
    assert {t.kind for t in f.tensors.values()} == set(ggml.SUPPORTED)
    assert f.tensors["token_embd.weight"].kind == "Q6_K" and "blk.2.attn_v.weight" not in f.tensors  # K as V


def test_a_gguf_gives_the_references_tokens_on_its_twin(files, reference):
    path, twin, _ = files
    engine = load(path, device="cpu", dtype="float32")
    ref = reference(twin)
    C, V = engine.config.canvas_length, engine.config.text.vocab_size
    kw = dict(max_new_tokens=3 * C, max_denoising_steps=8)
    lengths = set()
    for seed in range(5):
        prompt = random_prompt(2 * engine.config.text.sliding_window + 3 + seed, V, seed)
        expected, _ = ref_generate(ref, [prompt], seed, **kw)
        ours = engine.generate([prompt], seed=seed, **kw)
        assert ours.token_ids == expected
        lengths.add(len(ours.token_ids[0]))
    assert max(lengths) > C  # past the first canvas
    # the weights are exactly the file's: a quantized matrix and the tied embedding against gguf.dequantize
    from dgemma_cli.checkpoint.gguf_file import GGUFFile

    f = GGUFFile(path)
    model = engine.model
    for got, name in ((model.embed_tokens.rows(0, V, torch.float32), "token_embd.weight"),
                      (model.layers[1].experts.down_proj.dequantize(torch.float32), "blk.1.ffn_down_exps.weight"),
                      (model.layers[0].self_attn.q_proj.dequantize(torch.float32), "blk.0.attn_q.weight")):
        t = f.tensors[name]
        want = gguf.dequantize(np.asarray(t.data), getattr(gguf.GGMLQuantizationType, t.kind))
        assert np.array_equal(got.numpy(), want.reshape(got.shape).astype(np.float32)), name


def test_a_gguf_is_held_as_its_blocks(files):
    """The routed experts and the block-typed projections stay as the file's bytes (decoded where used); the rest
    is decoded at load. What the model holds is what the file's footprint says it holds."""
    from dgemma_cli.checkpoint.gguf_file import GGUFFile
    from quant.ggml_modules import GGUFEmbedding, GGUFLinear, GGUFStack

    engine = load(files[0], device="cpu", dtype="float32")
    model, f = engine.model, GGUFFile(files[0])
    stacks = [m for m in model.modules() if isinstance(m, GGUFStack)]
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    L = engine.config.text.num_hidden_layers
    assert len(stacks) == 2 * L and linears
    assert isinstance(model.embed_tokens, GGUFEmbedding) and model.embed_tokens.kind == "Q6_K"  # the head reads it
    assert model.embed_tokens.weight.dtype == torch.uint8 and model.dtype == torch.float32
    from dgemma_cli.checkpoint.gguf_names import find

    held = sum(m.weight.numel() for m in stacks + linears + [model.embed_tokens])  # uint8 bytes, as the file has them
    packed = [n if isinstance(m, GGUFStack) else n + ".weight" for n, m in model.named_modules()
              if isinstance(m, (GGUFStack, GGUFLinear, GGUFEmbedding))]
    file_bytes = sum(find(f.tensors, n).nbytes for n in packed)
    assert held == file_bytes
    fp = f.footprint(L, dtype_bytes=4)  # float32 here
    in_memory = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    assert in_memory == sum(fp["totals"].values())


def test_a_gguf_runs_from_the_command_line_with_the_tokenizer_beside_it(files, capsys):
    path = files[0]
    assert run_main(["run", "--model", str(path), "--seed", "0", "--max-new-tokens", "16", "--view", "none",
                     "--json", "-q", "hello"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] and isinstance(out["text"], str)


def test_what_a_gguf_cannot_do_is_one_line(files, tmp_path, capsys):
    path, _, src = files
    # an image: a GGUF holds no vision tower, and says where the vision weights come from
    image = tmp_path / "i.png"
    from PIL import Image

    Image.new("RGB", (32, 32)).save(image)
    rc = run_main(["run", "--model", str(path), "--image", str(image), "-q", "what is this"])
    err = capsys.readouterr().err
    assert rc != 0 and err.count("\n") == 1 and "no vision tower" in err and "dgemma pull" in err, err
    # a tensor the file lacks: named, before any weight is decoded
    short = tmp_path / "short.gguf"
    write_gguf(src, short, drop=("blk.1.ffn_up.weight",))
    rc = run_main(["run", "--model", str(short), "-q", "hello"])
    err = capsys.readouterr().err
    assert rc != 0 and err.count("\n") == 1 and "blk.1.ffn_up.weight" in err and "Traceback" not in err, err
    # another architecture, and a file cut short
    other = tmp_path / "other.gguf"
    write_gguf(src, other, arch="llama", metadata=False)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    for bad, says in ((other, "not DiffusionGemma"), (cut, "not a whole GGUF file")):
        rc = run_main(["run", "--model", str(bad), "-q", "hello"])
        err = capsys.readouterr().err
        assert rc != 0 and err.count("\n") == 1 and says in err, err
    # no tokenizer beside the file: said, naming the file
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copyfile(path, alone / "m.gguf")
    rc = run_main(["run", "--model", str(alone / "m.gguf"), "-q", "hello"])
    err = capsys.readouterr().err
    assert rc != 0 and err.count("\n") == 1 and "tokenizer" in err, err


def test_sampler_hints_in_the_file_are_its_defaults(files, tmp_path):
    from dgemma_cli.checkpoint.gguf_file import GGUFFile
    from dgemma_cli.checkpoint.gguf_file import sampler_defaults

    path = files[0]
    assert sampler_defaults(GGUFFile(path)) == {}  # Unsloth's files carry none: the model's defaults stand
    hinted = tmp_path / "hinted.gguf"
    w = gguf.GGUFWriter(str(hinted), "diffusion-gemma")
    w.add_uint32("diffusion.eb_max_steps", 20)
    w.add_float32("diffusion.eb_entropy_bound", 0.25)
    w.add_float32("diffusion.eb_t_min", 0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = sampler_defaults(GGUFFile(hinted))
    assert got == {"max_denoising_steps": 20, "entropy_bound": pytest.approx(0.25), "t_min": pytest.approx(0.5)}
    assert torch.is_tensor(torch.tensor(0))  # (torch imported for the fixture's checkpoint)


def test_plan_info_and_show_read_a_real_shaped_gguf_from_its_header(tmp_path, capsys):
    """A file shaped like the published Q4_K_M (the real keys, names, shapes and a llama.cpp mix of types; its data a
    sparse file of zeros, scripts/make_gguf_shaped.py): plan and info read its header alone and count each tensor in
    its own type."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "make_gguf_shaped.py"
    spec = importlib.util.spec_from_file_location("make_gguf_shaped", script)
    shaped = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shaped)
    path = tmp_path / "diffusiongemma-26B-A4B-it-Q4_K_M.gguf"
    size = shaped.write(path, "q4_k_m")
    assert 16.0e9 < size < 17.6e9  # the published file: 16.8 GB
    rc = run_main(["plan", "--model", str(path), "--gpu", "RTX 4080", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert rc == 0 and plan["layers"] == 30 and plan["format"] == "gguf" and plan["fits"]
    assert 16.0e9 < plan["gguf"]["weights_on_disk"] < 17.6e9 and set(plan["gguf"]["bytes_by_type"]) >= {"Q4_K", "Q6_K"}
    # held as its blocks, the Q6_K embedding too (the head reads it as it lies): the file's size within its float32
    # norms held in 16 bits, and on a 16 GB card the experts of some layers stream, as their blocks
    assert abs(plan["gguf"]["weights_in_memory"] - plan["gguf"]["weights_on_disk"]) < 0.01 * plan["gguf"][
        "weights_on_disk"]
    assert 0 < len(plan["streamed_layers"]) < 30 and plan["streamed_bytes_per_step"] < 8e9
    rc = run_main(["plan", "--model", str(path), "--gpu", "RTX 4090", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["streamed_layers"] == []  # 24 GB holds it all
    assert run_main(["info", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["format"], info["layers"], info["experts"], info["vocab"]) == ("gguf", 30, 128, 262144)
    assert info["images"] is False and info["weights_in_memory"] == plan["gguf"]["weights_in_memory"]
    assert run_main(["plan", "--model", str(path), "--gpu", "RTX 4080", "--quant", "nvfp4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs as it is" in err


@pytest.mark.slow  # a second GGUF and two loads (make test's time)
def test_streamed_gguf_experts_give_the_resident_runs_tokens(files, tmp_path):
    """A card too small for every layer's experts streams them as their blocks: layers whose stacks differ in block
    type (so in size: llama.cpp gives some layers more bits) share the two buffers, each copy viewed as its own, a
    buffer as large as the largest of its layers (here the last layer's, F16, after smaller Q4_K ones)."""
    from dgemma_cli.checkpoint.gguf_file import read_gguf
    from dgemma_cli.placement.cards import Card
    from dgemma_cli.placement.plan import plan, planned_context

    path = tmp_path / "gguf" / "mixed.gguf"
    path.parent.mkdir()
    L = GGUF_SPEC["text"]["num_hidden_layers"]
    kinds = {f"blk.{i}.{p}.weight": "F16" if i == L - 1 else "Q4_K" for i in range(L)
             for p in ("ffn_gate_up_exps", "ffn_down_exps")}
    write_gguf(files[2], path, types=kinds)
    f, cfg = read_gguf(path)
    whole = plan(cfg, "gguf", [Card("any", 10**15, 0.0, 4, 16)], context=planned_context(cfg),
                 footprint=f.footprint(cfg.text.num_hidden_layers))
    c = whole.cards[0]
    resident = load(path, device="cpu", dtype="float32")
    streamed = load(path, device="cpu", dtype="float32", gpu_memory=c.fixed_bytes + 3 * c.expert_bytes)
    layers = streamed.model.placement.streamed
    stream = streamed.model.expert_streams[0]
    size = {i: stream.host[i]["gate_up_proj.weight"].numel() for i in layers}
    assert len(layers) >= 2 and L - 1 in layers
    assert any(size[i] > size[stream.first[stream.buffer_of[i]]] for i in layers)  # a buffer's later layer is larger
    prompt = [[2, 30, 31, 32, 33, 34]]
    kw = dict(raw=True, seed=3, max_new_tokens=3 * cfg.canvas_length, max_denoising_steps=6)
    before = stream.copies
    assert streamed.generate(prompt, **kw).token_ids == resident.generate(prompt, **kw).token_ids
    assert stream.copies - before >= len(layers)


# ----------------------------------------------------------------------------- dgemma pull of a GGUF repository


@pytest.mark.slow  # five pulls through a local hub (make test's time)
def test_pull_takes_one_gguf_of_a_repository_as_published_and_its_name_runs(files, fake_hub, tmp_path, capsys,
                                                                            monkeypatch):
    """`dgemma pull OWNER/NAME-GGUF --quant LABEL` fetches that file alone (and a split file's every part), as
    published, with the tokenizer and generation config of the base repository beside it where the GGUF repository
    has none (said); `--quant auto` takes the largest the card holds whole; the store name runs."""
    from dgemma_cli.checkpoint import footprint
    from dgemma_cli.store import models as store

    path, _, src = files
    small = tmp_path / "small.gguf"
    write_gguf(src, small, types={})  # the mix again, in other bytes: a second quantization of the same model
    big = tmp_path / "big.gguf"
    write_gguf(src, big, types={"token_embd.weight": "F16"})
    repo = "acme/tiny-GGUF"
    published = {"tiny-Q4_K_M.gguf": path.read_bytes(), "tiny-F16.gguf": big.read_bytes(),
                 "mmproj-F16.gguf": b"not a model", "README.md": b"# tiny"}
    fake_hub.add_repo(repo, published)
    fake_hub.add_repo(store.DEFAULT_REPO, {n: (src / n).read_bytes() for n in ("tokenizer.json",
                                                                               "tokenizer_config.json",
                                                                               "generation_config.json")})
    assert run_main(["pull", repo, "--quant", "nvfp4"]) == 2  # a GGUF repository runs as published
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "q4_k_m" in err and "f16" in err and not fake_hub.file_requests("tiny-Q4_K_M.gguf")
    assert run_main(["pull", repo, "--quant", "q4_k_m"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == f"{repo}:q4_k_m" and f"the tokenizer, chat template and generation config are " \
        f"{store.DEFAULT_REPO}'s" in out.err
    assert not fake_hub.file_requests("tiny-F16.gguf", "GET") and not fake_hub.file_requests("mmproj-F16.gguf", "GET")
    (entry,) = store.entries()
    assert entry.quant == "q4_k_m" and (entry.path / "tiny-Q4_K_M.gguf").read_bytes() == path.read_bytes()
    assert (entry.path / "tokenizer.json").is_file() and entry.manifest["store"]["format"] == "gguf"
    args = ["run", "--seed", "0", "--max-new-tokens", "16", "--view", "none", "--json", "-q", "hello"]
    assert run_main([*args, "--model", f"{repo}:q4_k_m"]) == 0
    by_name = json.loads(capsys.readouterr().out)["token_ids"]
    assert run_main([*args, "--model", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == by_name
    # --quant auto: the largest that the card holds whole, else the smallest
    sizes = {"q4_k_m": len(published["tiny-Q4_K_M.gguf"]), "f16": len(published["tiny-F16.gguf"])}
    assert sizes["f16"] > sizes["q4_k_m"]
    for k, (free, want, says) in enumerate(((sizes["f16"] + store.GGUF_ALLOWANCE + 1, "f16", "the largest that fits"),
                                            (sizes["f16"] + store.GGUF_ALLOWANCE - 1, "q4_k_m", "the largest"),
                                            (1e9, "q4_k_m", "will partly stream"))):
        other = f"acme/copy{k}-GGUF"
        fake_hub.add_repo(other, published)
        monkeypatch.setattr(footprint, "free_memory", lambda free=free: (free, "a test GPU"))
        assert run_main(["pull", other]) == 0
        out = capsys.readouterr()
        assert out.out.strip() == f"{other}:{want}" and f"--quant auto: {want}" in out.err and says in out.err


@pytest.mark.slow  # every family a GGUF uses, in Triton's interpreter (15 s)
def test_the_doctor_checks_what_a_gguf_uses(files, tmp_path):
    """`dgemma doctor --model FILE.gguf`: the common families and the GGUF block decode, as a first use would."""
    out = tmp_path / "r.json"
    assert run_main(["doctor", "--model", str(files[0]), "--sizes", "none", "--json", str(out), "-q"]) == 0
    names = [k["name"] for k in json.loads(out.read_text())["kernels"]]
    assert {"ggml_decode", "ggml_linear", "moe_gguf", "head_gguf", "rms_norm"} <= set(names) and "nvfp4_linear" not in names


def test_a_gguf_split_over_two_cards_gives_one_cards_tokens(files):
    """The planner's split over two cards (here the CPU standing in for both, as `dgemma doctor`'s two-card check
    runs there) of a GGUF, each layer's blocks on its card: the tokens of the model on one."""
    from dgemma_cli.checkpoint.gguf_file import read_gguf
    from dgemma_cli.placement.cards import Card
    from dgemma_cli.placement.plan import plan, planned_context

    path = files[0]
    f, cfg = read_gguf(path)
    kw = dict(context=planned_context(cfg), footprint=f.footprint(cfg.text.num_hidden_layers))
    size = plan(cfg, "gguf", [Card("any", 10**15, 0.0, 4, 16)], **kw).resident_bytes
    while size > 0:  # the largest card memory at which two cards split the layers, nothing streamed
        p = plan(cfg, "gguf", [Card("card", size, 0.0, 4, 16)] * 2, **kw)
        if p.fits and len(p.cards) == 2 and all(c.layers for c in p.cards) and not any(c.streamed for c in p.cards):
            break
        size -= max(1, p.expert_bytes // 4)
    assert size > 0
    one = load(path, device="cpu", dtype="float32")
    split = load(path, devices="cpu,cpu", dtype="float32", gpu_memory=size)
    assert [len(c.layers) > 0 for c in split.model.placement.cards] == [True, True]
    prompt = [[2, 30, 31, 32, 33, 34]]
    kw = dict(raw=True, seed=5, max_new_tokens=2 * cfg.canvas_length, max_denoising_steps=6)
    assert split.generate(prompt, **kw).token_ids == one.generate(prompt, **kw).token_ids


def test_a_lora_adapter_on_a_gguf_gives_its_twins_tokens(files, tmp_path):
    """A PEFT adapter (attention, the dense MLP and the routed experts, rank 4, random factors) attached to the GGUF
    gives the tokens it gives on the GGUF's twin, and other tokens than the GGUF without it."""
    from dgemma_cli.tuner.lora import new_adapter, save_adapter, trainable

    path, twin, _ = files
    base = load(twin, device="cpu", dtype="float32")
    ad = new_adapter(base.model, rank=4, alpha=8, targets=("attention", "mlp"), expert_rank=4)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in trainable(ad):
            t.copy_(torch.randn(t.shape, generator=g) * 0.2)
    save_adapter(ad, tmp_path / "adapter")
    prompt = [[2, 30, 31, 32, 33, 34, 35, 36]]
    kw = dict(raw=True, seed=2, max_new_tokens=2 * base.config.canvas_length, max_denoising_steps=6)
    adapters = [(tmp_path / "adapter", 1.0)]
    on_twin = load(twin, device="cpu", dtype="float32", adapters=adapters).generate(prompt, **kw).token_ids
    on_gguf = load(path, device="cpu", dtype="float32", adapters=adapters).generate(prompt, **kw).token_ids
    plain = load(path, device="cpu", dtype="float32").generate(prompt, **kw).token_ids
    assert on_gguf == on_twin and on_gguf != plain


def test_a_gguf_alone_runs_with_its_own_tokenizer(files, tmp_path, capsys, monkeypatch):
    """A GGUF with no tokenizer.json beside it reads its own (`tokenizer.ggml.*`, the converter's `gemma4` model, and
    `tokenizer.chat_template`): the same ids as the base model's tokenizer.json for a corpus (prose, code, other
    scripts, byte fallback, control tokens), the same text back, the same chat prompt; said in one line."""
    from dgemma_cli.checkpoint.gguf_file import GGUFFile
    from dgemma_cli.checkpoint.gguf_tokenizer import CORPUS, agrees, tokenizer_from_metadata
    from dgemma_cli.tokenizer import Tokenizer
    from tokenizer_fixture import CORPUS as TRAINED

    src = files[2]
    (tmp_path / "alone").mkdir()
    path = tmp_path / "alone" / "tiny.gguf"
    write_gguf(src, path, tokenizer=True)
    reference = Tokenizer.from_dir(src)
    ours = tokenizer_from_metadata(GGUFFile(path).metadata, path.name)
    assert ours is not None and agrees(ours, reference, CORPUS + tuple(TRAINED)) is None
    chat = [{"role": "user", "content": "Why is the sky blue?"}]
    assert ours.encode_chat(chat) == reference.encode_chat(chat)
    # a real file's long arrays come as the header left them (gguf_header: numpy arrays, string arrays in the map)
    import numpy as np

    from dgemma_cli.checkpoint.gguf_header import StringArray

    from dgemma_cli.checkpoint import gguf_header

    monkeypatch.setattr(gguf_header, "SMALL", 16)  # this fixture's arrays are short: read as long ones are
    long = GGUFFile(path).metadata
    monkeypatch.undo()
    assert isinstance(long["tokenizer.ggml.tokens"], StringArray) and isinstance(long["tokenizer.ggml.merges"],
                                                                                  StringArray)
    assert isinstance(long["tokenizer.ggml.token_type"], np.ndarray)
    assert agrees(tokenizer_from_metadata(long, path.name), reference) is None
    # a tokenizer of another kind is not rebuilt, and the check says where two disagree
    assert tokenizer_from_metadata({**GGUFFile(path).metadata, "tokenizer.ggml.model": "llama"}, "x") is None
    other = tokenizer_from_metadata({**GGUFFile(path).metadata, "tokenizer.ggml.merges": []}, "x")
    assert "ids differ" in agrees(other, reference)
    # pulled beside the base model's tokenizer.json (a GGUF repository without one), the two are checked at pull
    from dgemma_cli.store.models import _check_own_tokenizer

    said = []
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, tmp_path / name)
    _check_own_tokenizer(path, tmp_path, said.append)
    assert len(said) == 1 and "agrees with" in said[0]
    from dgemma_cli.checkpoint import gguf_file

    real = gguf_file.read_gguf
    no_merges = type("File", (), {"metadata": {**real(path)[0].metadata, "tokenizer.ggml.merges": []}})()
    monkeypatch.setattr(gguf_file, "read_gguf", lambda p: (no_merges, None))  # a file whose merges are not the base's
    _check_own_tokenizer(path, tmp_path, said.append)
    monkeypatch.undo()
    assert "differs from" in said[1] and "beside it is used" in said[1]
    # the command line runs it, and says where the tokenizer came from
    assert run_main(["run", "--model", str(path), "--max-new-tokens", "8", "--device", "cpu", "--view", "none",
                     "Why is the sky blue?"]) == 0
    assert "tokenizer and chat template from tiny.gguf's own metadata" in capsys.readouterr().err


def test_the_fused_head_reads_the_gguf_embedding_as_its_blocks(files, monkeypatch):
    """A GGUF model's fused head reads the Q6_K embedding's blocks: the sampler asks for its own kernel family
    (head_gguf) and the model hands the blocks and their type to the head, whose draws, entropies and soft embedding
    are those of the same head over the embedding decoded to the compute dtype (what the model held before), in the
    interpreter here. (A whole generation is not compared: in bfloat16 a tiny random model's trajectory turns on the
    soft embedding's last bit, which the two sums' orders round differently.)"""
    import torch.nn as nn

    import dgemma_cli.sampler as sampler
    from dgemma_cli.engine import ModelDenoiser
    from quant.kernels import head
    from quant.kernels.head import HeadBuffers

    pytest.importorskip("triton")
    engine = load(files[0], device="cpu", dtype="bfloat16")
    model = engine.model
    asked = []
    monkeypatch.setattr(sampler, "use_fused_head", lambda device, dtype, family="head": asked.append(family) or True)
    assert sampler.new_buffers(4, ModelDenoiser(model, 1, 64), model.device).fused is not None
    assert asked == ["head_gguf"]
    V, H, C = engine.config.text.vocab_size, engine.config.text.hidden_size, engine.config.canvas_length
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, C, H, generator=g).to(torch.bfloat16)
    t, u = torch.full((2 * C,), 0.8), torch.rand(2 * C, 2, generator=g)
    kinds = []
    real = head.fused_head
    monkeypatch.setattr(head, "fused_head", lambda *a, **kw: kinds.append(kw.get("kind")) or real(*a, **kw))
    blocks = model.fused_head(hidden, t, u, HeadBuffers(2 * C, V, H, torch.bfloat16, "cpu"))
    model.embed_tokens = nn.Embedding(V, H, _weight=model.embed_tokens.rows(0, V, torch.bfloat16))
    assert model.head_family == "head" and not model.packed_embedding
    plain = model.fused_head(hidden, t, u, HeadBuffers(2 * C, V, H, torch.bfloat16, "cpu"))
    assert kinds == ["Q6_K", None]
    assert torch.equal(blocks.sample, plain.sample) and torch.equal(blocks.argmax, plain.argmax)
    assert (blocks.entropy - plain.entropy).abs().max() < 1e-5
    assert (blocks.soft.float() - plain.soft.float()).abs().max() < 8e-3 * plain.soft.float().abs().max()
