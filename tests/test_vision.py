"""Images through dgemma against the reference implementation, on a tiny random checkpoint with a vision tower
(written by transformers in the real layout, see checkpoints.VISION_SPEC), on the CPU in float32.

The vision tower's soft tokens and the encoder's outputs with images placed are identical to the reference's;
generation with one and with two images gives the reference `generate`'s token ids (with `pixel_values`) for the
same seed, through the Python API and through `dgemma run --image ... --json`. Bad image input fails in one line.
"""

import json
import shutil

import pytest
import torch

from dgemma_cli.tokenizer import Control

from checkpoints import VISION_SPEC, build_checkpoint
from cli_helpers import run_main
from test_exactness import ref_generate
from test_image import encoded, png_claiming, random_image

PROMPT = "Describe the picture in one sentence, then list its colours."


@pytest.fixture(scope="module")
def vision_ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("vision") / "ckpt", VISION_SPEC, seed=21)


@pytest.fixture(scope="module")
def ref_model(vision_ckpt):
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(vision_ckpt, dtype="float32").eval()


@pytest.fixture(scope="module")
def processor():
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil()


@pytest.fixture(scope="module")
def engine(vision_ckpt):
    from dgemma_cli.engine import load

    return load(vision_ckpt, device="cpu", dtype="float32")


IMAGES = [random_image(300, 200, seed=1), random_image(90, 400, seed=2)]  # wide, and tall with padding patches


def reference_inputs(ref, processor, ids_with_placeholders, images, budget):
    """What the reference's processor hands `generate`: expanded ids, pixel values, positions, token types."""
    px = processor(images=images, max_soft_tokens=budget, return_tensors="pt")
    cfg = ref.config
    ids = []
    counts = iter(int(n) for n in px["num_soft_tokens_per_image"])
    for t in ids_with_placeholders:
        ids += [cfg.boi_token_id] + [cfg.image_token_id] * next(counts) + [cfg.eoi_token_id] \
            if t == cfg.image_token_id else [t]
    mm = torch.tensor([[int(t == cfg.image_token_id) for t in ids]])
    return ids, dict(pixel_values=px["pixel_values"], image_position_ids=px["image_position_ids"],
                     mm_token_type_ids=mm)


@pytest.mark.parametrize("budget", [70, 280])
@pytest.mark.parametrize("which", [[0], [1], [0, 1]])
def test_vision_soft_tokens_match_reference(engine, ref_model, processor, budget, which):
    images = [IMAGES[i] for i in which]
    px = processor(images=images, max_soft_tokens=budget, return_tensors="pt")
    with torch.no_grad():
        expected = ref_model.model.encoder.get_image_features(px["pixel_values"], px["image_position_ids"])
    ours = engine.image_features(engine.image_patches(images, budget))
    assert ours.shape == expected.pooler_output.shape == (int(px["num_soft_tokens_per_image"].sum()), 64)
    assert torch.equal(ours, expected.pooler_output)


def test_encoder_outputs_with_images_match_reference(engine, ref_model, processor):
    from transformers.cache_utils import DynamicCache

    model, cfg = engine.model, ref_model.config
    W = engine.config.text.sliding_window
    g = torch.Generator().manual_seed(3)
    text = torch.randint(107, 512, (40,), generator=g).tolist()
    raw = [2] + text[:10] + [cfg.image_token_id] + text[10:25] + [cfg.image_token_id] + text[25:]
    ids, extra = reference_inputs(ref_model, processor, raw, IMAGES, 70)
    assert max(extra["mm_token_type_ids"].sum(), 0) > W  # an image block longer than the sliding window
    ids_t = torch.tensor([ids])
    cache = DynamicCache(config=ref_model.config.get_text_config(decoder=True))
    with torch.no_grad():
        masks = ref_model.model.encoder.create_masks_for_generate(  # what generate passes the encoder
            config=ref_model.config, inputs_embeds=torch.empty(1, len(ids), 0), attention_mask=None, cache=cache,
            position_ids=torch.arange(len(ids))[None], mm_token_type_ids=extra["mm_token_type_ids"])
        expected = ref_model.model.encoder(input_ids=ids_t, attention_mask=masks, cache=cache,
                                           pixel_values=extra["pixel_values"],
                                           image_position_ids=extra["image_position_ids"]).last_hidden_state
        features = engine.image_features(engine.image_patches(IMAGES, 70))
        kv = model.new_cache(1, len(ids) + 16)
        ours = model.encode(ids_t, kv, return_hidden=True, image_features=features)
        assert torch.equal(ours, expected)
        # Without the bidirectional image blocks the result differs: the comparison sees the mask.
        model.cfg.text.use_bidirectional_attention = None
        try:
            causal = model.encode(ids_t, model.new_cache(1, len(ids) + 16), return_hidden=True,
                                  image_features=features)
        finally:
            model.cfg.text.use_bidirectional_attention = "vision"
        assert not torch.allclose(causal, expected, atol=1e-4)
        # The decoder then reads the cache the images went into: its logits match too.
        canvas = torch.randint(0, 512, (1, 16), generator=g)
        ref_logits = ref_model(decoder_input_ids=canvas, cache=cache).logits
        ours_logits = model.denoise(canvas, kv, model.denoise_context(kv, 1))
        assert torch.equal(ours_logits, ref_logits)


@pytest.mark.parametrize("which", [[0], [1, 0]])
def test_generate_with_images_matches_reference(engine, ref_model, processor, which):
    images = [IMAGES[i] for i in which]
    placeholder = engine.image_placeholder()
    raw = engine.tokenizer.encode_chat([{"role": "user", "content": [Control(placeholder)] * len(images) + [PROMPT]}])
    ids, extra = reference_inputs(ref_model, processor, raw, images, 70)
    C = engine.config.canvas_length
    kw = dict(max_new_tokens=3 * C, max_denoising_steps=10)
    for seed in (0, 1):
        expected, _ = ref_generate(ref_model, [ids], seed, **extra, **kw)
        ours = engine.generate(PROMPT, images=images, image_tokens=70, seed=seed, **kw)
        assert ours.prompt_token_ids == [ids]
        assert ours.token_ids == expected
    # the images matter: without them (placeholders as text) the answer differs
    plain = engine.generate(PROMPT, seed=1, **kw)
    assert plain.token_ids != expected


def write_images(tmp_path):
    paths = []
    for i, (img, fmt) in enumerate(zip(IMAGES, ["PNG", "WEBP"])):
        p = tmp_path / f"img{i}.{fmt.lower()}"
        p.write_bytes(encoded(img, fmt, **({"lossless": True} if fmt == "WEBP" else {})))
        paths.append(p)
    return paths


def test_cli_run_with_two_images_matches_reference(vision_ckpt, ref_model, processor, engine, tmp_path, capsys):
    from dgemma_cli.image import open_image

    paths = write_images(tmp_path)
    images = [open_image(p) for p in paths]  # what the files decode to
    placeholder = engine.image_placeholder()
    raw = engine.tokenizer.encode_chat([{"role": "user", "content": [Control(placeholder)] * 2 + [PROMPT]}])
    ids, extra = reference_inputs(ref_model, processor, raw, images, 140)
    expected, _ = ref_generate(ref_model, [ids], 7, max_new_tokens=32, max_denoising_steps=8, **extra)
    args = ["run", PROMPT, "--model", str(vision_ckpt), "--image", str(paths[0]), "--image", str(paths[1]),
            "--image-tokens", "140", "--seed", "7", "--max-new-tokens", "32", "--steps", "8", "--json",
            "--device", "cpu", "--dtype", "float32"]
    assert run_main(args) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["prompt_token_ids"] == ids
    assert obj["token_ids"] == expected[0]


def text_only_copies(vision_ckpt, tmp_path):
    """(a) the checkpoint with no vision_config; (b) sharded, the vision shard not downloaded."""
    from safetensors.torch import load_file, save_file

    no_tower = tmp_path / "no_tower"
    shutil.copytree(vision_ckpt, no_tower)
    cfg = json.loads((no_tower / "config.json").read_text())
    del cfg["vision_config"]
    (no_tower / "config.json").write_text(json.dumps(cfg))
    partial = tmp_path / "partial"
    shutil.copytree(vision_ckpt, partial)
    tensors = load_file(partial / "model.safetensors")
    (partial / "model.safetensors").unlink()
    text = {k: v for k, v in tensors.items() if "vision" not in k}
    save_file(text, partial / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in text}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in tensors if "vision" in k})
    (partial / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return no_tower, partial


def run_fails(args, capsys, code):
    assert run_main(args) == code
    out, err = capsys.readouterr()
    assert out == ""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err
    return lines[0]


def test_cli_bad_images_are_one_line(vision_ckpt, tmp_path, capsys):
    base = ["run", PROMPT, "--model", str(vision_ckpt), "--device", "cpu", "--max-new-tokens", "16",
            "--steps", "2", "--view", "none"]
    truncated = tmp_path / "cut.jpg"
    truncated.write_bytes(encoded(IMAGES[0], "JPEG")[:500])
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_claiming(50_000, 50_000))
    before = sorted(p.name for p in tmp_path.iterdir())
    cases = {tmp_path / "missing.png": "no such file", notes: "not an image", truncated: "truncated",
             bomb: "pixels"}
    for path, words in cases.items():
        line = run_fails(base + ["--image", str(path)], capsys, 2)
        assert str(path) in line and words in line
    assert "image-tokens" in run_fails(base + ["--image", str(notes), "--image-tokens", "100"], capsys, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing left behind


def test_images_need_a_vision_tower(vision_ckpt, tmp_path, capsys):
    no_tower, partial = text_only_copies(vision_ckpt, tmp_path)
    img = write_images(tmp_path)[0]
    for model, words in ((no_tower, "no vision tower"), (partial, "model-00002-of-00002.safetensors is missing")):
        line = run_fails(["run", PROMPT, "--model", str(model), "--device", "cpu", "--image", str(img),
                          "--max-new-tokens", "16", "--steps", "2", "--view", "none"], capsys, 1)
        assert words in line
    # and text still runs on the partial download
    assert run_main(["run", PROMPT, "--model", str(partial), "--device", "cpu", "--max-new-tokens", "16",
                     "--steps", "2", "--view", "none", "--seed", "0"]) == 0


def test_stdin_cannot_be_both_prompt_and_image(vision_ckpt, capsys):
    line = run_fails(["run", "-", "--model", str(vision_ckpt), "--image", "-"], capsys, 2)
    assert "stdin" in line


def chat_turn(conv, text, settings, seed):
    events, stats = conv.turn_events(text, settings, seed=seed)
    first = done = None
    for ev in events:
        first = first or (ev if type(ev).__name__ == "Step" else None)
        done = ev if type(ev).__name__ == "Done" else done
    return first, done, stats


def test_chat_images_stay_in_the_cache(engine, tmp_path):
    from dgemma_cli.conversation import Conversation

    paths = write_images(tmp_path)
    settings = engine.settings.override(max_new_tokens=32, max_denoising_steps=8)
    reuse, fresh = Conversation(engine, 4096), Conversation(engine, 4096)
    for conv in (reuse, fresh):
        conv.image_tokens = 70
        assert conv.attach_image(str(paths[0])) > 0
        _, done, stats = chat_turn(conv, PROMPT, settings, seed=4)
        assert stats.rebuilt and conv.attached == []
    # the first turn is what `generate` computes for the same image and seed
    same = engine.generate(PROMPT, images=[str(paths[0])], image_tokens=70, seed=4, max_new_tokens=32,
                           max_denoising_steps=8)
    assert reuse.cached[: len(same.prompt_token_ids[0])] == same.prompt_token_ids[0]
    assert done.token_ids == same.token_ids
    # a second image with the next message: encoded onto the cache, or everything again from the kept turns
    fresh.stale = True
    for conv in (reuse, fresh):
        conv.attach_image(paths[1].read_bytes())
    a, da, sa = chat_turn(reuse, "And this one?", settings, seed=5)
    b, db, sb = chat_turn(fresh, "And this one?", settings, seed=5)
    assert not sa.rebuilt and sb.rebuilt and sa.encoded < sb.encoded
    assert torch.equal(a.argmax, b.argmax) and da.token_ids == db.token_ids
    image_id = engine.config.vision.image_token_id
    assert sum(t == image_id for t in reuse.full_ids(reuse.turns)) == sum(
        p.soft_tokens for t in reuse.turns for p in t.images)
    # /retry sends the message again with its image
    assert reuse.retry() == "And this one?" and len(reuse.attached) == 1


def test_chat_image_command_errors_are_one_line(engine, tmp_path):
    from dgemma_cli.conversation import Conversation
    from dgemma_cli.errors import UsageError

    conv = Conversation(engine, 4096)
    with pytest.raises(UsageError) as e:
        conv.attach_image(str(tmp_path / "missing.png"))
    assert "no such file" in str(e.value) and "\n" not in str(e.value)
    assert conv.attached == []


# ------------------------------------------------------------------ images through dgemma serve (image_url parts)


def test_server_image_parts_answer_as_the_engine(engine):
    """Two base64 data: URL image parts through the server's app answer exactly what the engine answers for the
    same images, prompt and seed; a URL, bad base64 or a file that is not an image get a JSON 400 each."""
    import base64

    from starlette.testclient import TestClient

    from dgemma_cli.server.batching import BatchLoop
    from dgemma_cli.server.app import build_app
    from dgemma_cli.server.state import Server

    files = [encoded(IMAGES[0], "PNG"), encoded(IMAGES[1], "JPEG")]
    urls = [f"data:image/{kind};base64,{base64.b64encode(b).decode()}" for b, kind in zip(files, ["png", "jpeg"])]
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": PROMPT}]
    kw = dict(max_new_tokens=32, max_denoising_steps=8)
    expected = engine.generate(PROMPT, images=files, image_tokens=70, seed=5, **kw).texts[0]
    loop = BatchLoop(engine.model, max_batch=4, max_queue=4)
    try:
        with TestClient(build_app(Server(engine, loop, "vision"))) as client:
            body = {"model": "vision", "messages": [{"role": "user", "content": parts}], "seed": 5,
                    "image_tokens": 70, "max_tokens": 32, "steps": 8}
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == expected
            assert r.json()["usage"]["prompt_tokens"] > 2 * 70  # the images' soft tokens are in the prompt
            bad = [({"url": "https://example.com/a.png"}, "invalid_image_url"),
                   ({"url": "data:image/png;base64,%%%"}, "invalid_image_url"),
                   ({"url": "data:image/png;base64," + base64.b64encode(b"not an image").decode()},
                    "invalid_image")]
            for ref, code in bad:
                msg = [{"role": "user", "content": [{"type": "image_url", "image_url": ref},
                                                    {"type": "text", "text": "x"}]}]
                r = client.post("/v1/chat/completions", json={"model": "vision", "messages": msg})
                assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
    finally:
        loop.close()


# ------------------------------------------------------------------ images from `dgemma pull`'s store entries

from fake_hub import fake_hub  # noqa: E402,F401  (the fixture)

VISION_REPO = "acme/tiny-vision"
VISION_SHARD = "model-00002-of-00002.safetensors"


@pytest.fixture
def served_vision(fake_hub, vision_ckpt, tmp_path):  # noqa: F811
    """The vision checkpoint on the fake Hub, sharded as published: the vision tower in a shard of its own."""
    from fake_hub import serve_directory
    from test_store import sharded_with_vision

    repo = sharded_with_vision(vision_ckpt, tmp_path / "repo")
    assert set(json.loads((repo / "model.safetensors.index.json").read_text())["weight_map"].values()) == {
        "model-00001-of-00002.safetensors", VISION_SHARD}
    serve_directory(fake_hub, VISION_REPO, repo)
    return fake_hub


def vision_tensors(directory) -> dict[str, tuple]:
    """{name: (dtype, shape, raw bytes)} of every vision-tower tensor a checkpoint directory's index lists."""
    from safetensors import safe_open

    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, f in weight_map.items():
        if ".vision_tower." in name or ".embed_vision." in name:
            with safe_open(directory / f, "pt") as st:
                t = st.get_tensor(name)
            out[name] = (t.dtype, tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return out


@pytest.mark.parametrize("quant", ["bf16", "int8", "nvfp4"])
def test_pulled_entries_read_images(served_vision, vision_ckpt, engine, quant, tmp_path, capsys):
    """`dgemma pull` fetches the vision tower's shard and the entry holds it: bf16 answers with an image exactly as
    the source checkpoint does; a quantized entry holds the tower byte for byte as the source stores it, in a shard
    of its own its quantization config leaves alone, and gives the source's soft tokens."""
    import fnmatch
    import re

    from dgemma_cli.store import models as store
    from dgemma_cli.engine import load

    assert run_main(["pull", VISION_REPO, "--quant", quant]) == 0
    assert len(served_vision.file_requests(VISION_SHARD, "GET")) == 1
    (entry,) = store.entries()
    source = vision_tensors(tmp_path / "repo")
    assert len(source) > 10 and vision_tensors(entry.path) == source
    assert entry.manifest["store"]["vision_tower"] is True
    stored = load(entry.path, device="cpu", dtype="float32")
    kw = dict(max_new_tokens=32, max_denoising_steps=8)
    images = [IMAGES[0]]
    if quant == "bf16":
        for seed in (0, 3):
            ours = stored.generate(PROMPT, images=images, image_tokens=70, seed=seed, **kw)
            assert ours.token_ids == engine.generate(PROMPT, images=images, image_tokens=70, seed=seed, **kw).token_ids
        return
    weight_map = json.loads((entry.path / "model.safetensors.index.json").read_text())["weight_map"]
    shards = {weight_map[n] for n in source}
    assert len(shards) == 1 and not {f for n, f in weight_map.items() if n not in source} & shards  # its own shard
    ignore = json.loads((entry.path / "config.json").read_text())["quantization_config"]["ignore"]
    for name in source:  # every vision module is in the ignore list, in the format's own syntax
        module = name.rsplit(".", 1)[0]
        if quant == "nvfp4":
            assert any(fnmatch.fnmatch(module, g) for g in ignore), module
        else:
            assert any(re.match(e[3:], module) if e.startswith("re:") else e == module for e in ignore), module
    patches = engine.image_patches(images, 70)
    assert torch.equal(stored.image_features(patches), engine.image_features(patches))
    assert run_main(["run", PROMPT, "--model", f"{VISION_REPO}:{quant}", "--image", str(write_images(tmp_path)[0]),
                     "--image-tokens", "70", "--device", "cpu", "--max-new-tokens", "16", "--steps", "2",
                     "--view", "none", "--seed", "0"]) == 0


def test_text_only_entry_says_how_to_fetch_the_tower(served_vision, tmp_path, capsys):
    """An entry made before dgemma kept the vision tower (simulated: its vision shard, index lines and manifest
    lines removed), given an image: one line naming the commands; running them gives an entry that reads images."""
    from dgemma_cli.store import models as store

    assert run_main(["pull", VISION_REPO, "--quant", "int8"]) == 0
    (entry,) = store.entries()
    index_path = entry.path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    (shard,) = {f for n, f in index["weight_map"].items() if "vision" in n}
    (entry.path / shard).unlink()
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != shard}
    index_path.write_text(json.dumps(index))
    manifest = json.loads((entry.path / store.MANIFEST).read_text())
    del manifest["files"][shard], manifest["store"]["vision_tower"]
    (entry.path / store.MANIFEST).write_text(json.dumps(manifest))
    capsys.readouterr()

    img = str(write_images(tmp_path)[0])
    args = ["run", PROMPT, "--model", "tiny-vision", "--image", img, "--device", "cpu", "--max-new-tokens", "16",
            "--steps", "2", "--view", "none", "--seed", "0"]
    name = f"{VISION_REPO}:int8"
    assert run_fails(args, capsys, 1) == (
        f"dgemma: error: {name} holds only the text model (made before dgemma kept the vision tower); to read "
        f"images: dgemma rm {name} && dgemma pull {VISION_REPO} --quant int8")
    # a copy of it outside the store (no manifest) keeps the loader's message, which speaks of files
    plain = tmp_path / "plain"
    shutil.copytree(entry.path, plain)
    (plain / store.MANIFEST).unlink()
    line = run_fails(args[:3] + [str(plain)] + args[4:], capsys, 1)
    assert "no vision tower tensors" in line and "dgemma rm" not in line
    # a source that publishes no tower: said as such, without commands that would not help
    manifest["store"]["vision_tower"] = False
    (entry.path / store.MANIFEST).write_text(json.dumps(manifest))
    assert run_fails(args, capsys, 1) == (
        f"dgemma: error: {name}: {VISION_REPO} publishes no vision tower weights, so this model cannot read images")
    # text still runs on the text-only entry, and the commands the line names give an entry that reads images
    assert run_main(args[:4] + args[6:]) == 0
    assert run_main(["rm", name, "--yes"]) == 0
    assert run_main(["pull", VISION_REPO, "--quant", "int8"]) == 0
    capsys.readouterr()
    assert run_main(args) == 0


def test_quantize_of_a_text_only_download_says_so(vision_ckpt, tmp_path, capsys):
    """`dgemma quantize` of a download whose vision shard is missing: a text-only output, said on stderr, and the
    loader's one line when it is given an image."""
    _, partial = text_only_copies(vision_ckpt, tmp_path)
    out = tmp_path / "q"
    assert run_main(["quantize", str(partial), "--quant", "int8", "--out", str(out)]) == 0
    assert "model-00002-of-00002.safetensors (the vision tower) is not here" in capsys.readouterr().err
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert not [n for n in weight_map if "vision" in n]
    line = run_fails(["run", PROMPT, "--model", str(out), "--device", "cpu", "--image",
                      str(write_images(tmp_path)[0]), "--max-new-tokens", "16", "--steps", "2", "--view", "none"],
                     capsys, 1)
    assert "no vision tower tensors" in line


@pytest.mark.parametrize("where", ["preprocessor_config.json", "processor_config.json"])
def test_the_processor_config_sets_the_default_budget(vision_ckpt, tmp_path, where):
    """A checkpoint whose image processor asks for 70 soft tokens gets 70 by default, as transformers' processor
    reading the same file does; a budget it does not support is refused in one line."""
    from transformers import AutoImageProcessor

    from dgemma_cli.config import ModelConfig
    from dgemma_cli.engine import load
    from dgemma_cli.errors import ModelError

    ckpt = tmp_path / "ckpt"
    shutil.copytree(vision_ckpt, ckpt)
    processor = {"image_processor_type": "Gemma4ImageProcessor", "max_soft_tokens": 70, "patch_size": 16,
                 "pooling_kernel_size": 3}
    body = processor if where == "preprocessor_config.json" else {"image_processor": processor}
    (ckpt / where).write_text(json.dumps(body))
    assert AutoImageProcessor.from_pretrained(ckpt).max_soft_tokens == 70
    assert ModelConfig.from_dir(vision_ckpt).vision.default_soft_tokens == 280  # config.json's, for comparison
    assert ModelConfig.from_dir(ckpt).vision.default_soft_tokens == 70
    e = load(ckpt, device="cpu", dtype="float32")
    by_default = e.generate(PROMPT, images=[IMAGES[0]], seed=0, max_new_tokens=8).prompt_token_ids[0]
    asked = e.generate(PROMPT, images=[IMAGES[0]], image_tokens=70, seed=0, max_new_tokens=8).prompt_token_ids[0]
    assert by_default == asked
    assert len(by_default) < len(e.generate(PROMPT, images=[IMAGES[0]], image_tokens=280, seed=0,
                                            max_new_tokens=8).prompt_token_ids[0])
    (ckpt / where).write_text(json.dumps({**body, "max_soft_tokens": 100} if where == "preprocessor_config.json"
                                         else {"image_processor": {**processor, "max_soft_tokens": 100}}))
    with pytest.raises(ModelError, match="max_soft_tokens must be one of"):
        ModelConfig.from_dir(ckpt)
