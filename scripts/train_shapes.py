"""Train dgemma's image demo: a tiny DiffusionGemma with a tiny vision tower that names the shape in a picture.

    python scripts/train_shapes.py --out dgemma_cli/demo_shapes      # fixed seed, one CPU thread; about 8 minutes

The task: a picture of one filled shape (circle, square or triangle) in one colour (red, green, blue, yellow) on a
white background, at a random place and size, and a question such as `What is in the picture?` -> `a red circle`.
Answers are checkable (scripts/eval_shapes.py scores colour and shape apart).

The model is the real architecture at a tiny size: the text stack of the upper-casing demo (scripts/train_demo.py,
whose functions are imported) with fewer, smaller experts, image tokens bidirectional in the encoder as in the
published config, and a `gemma4_vision` tower (patch 16, 3x3 pooling, as the image processor requires) whose soft
tokens replace the image-token embeddings. Images go through dgemma's own image processor at 70 soft tokens, the
smallest budget it accepts, which is also the checkpoint's default (`vision_soft_tokens_per_image`): any picture is
resized to at most 630 patches (a square one to 384 x 384 px, 24 x 24 patches, 64 soft tokens).

Training has two stages, as a vision-language model's does. First the tower alone learns to tell shape and colour
through throwaway linear heads (warm_start; its patch embedding starts with edge filters, edge_filters), since the
diffusion objective alone never taught it shape within the budget. Then everything trains end to end (the tower at
a lower learning rate) with the demo's objective (train_demo.loss_on): the prompt, image included, goes through the
causal encoder into the KV cache; each canvas position is replaced by a uniformly random token with probability
t ~ U(0, 1); the bidirectional decoder predicts the clean canvas, self-conditioned in half the batches. The tower
runs once per batch and its soft tokens reach the encoder through a thin wrapper (WithImages).

Held out: a picture is fixed by its spec (shape, colour, picture size, shape size and place, all integers); a hash of
the spec puts one in ten specs in the test split and one in ten in the validation split, and training never draws
either. scripts/eval_shapes.py scores test-split pictures only.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
import zlib
from dataclasses import astuple, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import dgemma_cli  # noqa: E402,F401  (before torch: OpenMP threads sleep instead of spinning on a shared CPU)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from train_demo import (GENERATION_CONFIG, TEXT_CONFIG, build_model, chat_prompt, encode,  # noqa: E402
                        learning_rate, loss_on, save)

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (240, 200, 30)}
QUESTION = "What is in the picture?"  # what the demo, the evaluation and the tests ask
QUESTIONS = (QUESTION, "What is in the image?", "What do you see?", "What shape is this?", "Describe the picture.")
CANVAS = 32
IMAGE_TOKENS = 70  # soft tokens per image: the smallest budget the image processor accepts
# The image tokens sit on placeholders of the tiny vocabulary (the real ids, 255999 and up, are far outside it),
# under Gemma 4's names.
BOI_ID, IMAGE_ID, EOI_ID = 205, 206, 207
IMAGE_TOKEN_NAMES = {BOI_ID: "<|image>", IMAGE_ID: "<|image|>", EOI_ID: "<image|>"}
PICTURE_SIDES = (96, 400)  # width and height of a picture, each drawn from this range (pixels)
SHAPE_FRACTION = (0.3, 0.8)  # a shape's extent as a fraction of the picture's shorter side
SPLIT_MOD = 10  # spec hash % SPLIT_MOD: 0 test, 1 validation, anything else training
EDGE_ORIENTATIONS = 8  # patch-embedding rows that start as edge filters (edge_filters)

SHAPES_TEXT_CONFIG = dict(TEXT_CONFIG, num_experts=4, moe_intermediate_size=64, use_bidirectional_attention="vision")
VISION_CONFIG = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, hidden_activation="gelu_pytorch_tanh",
                     rms_norm_eps=1e-6, patch_size=16, pooling_kernel_size=3, position_embedding_size=1024,
                     rope_parameters={"rope_type": "axial", "rope_theta": 100.0}, standardize=True,
                     use_clipped_linears=False, attention_bias=False, attention_dropout=0.0, initializer_range=0.02)


# ----------------------------------------------------------------------------- pictures


@dataclass(frozen=True)
class Spec:
    """Everything a picture is drawn from, in pixels: shape, colour, picture width and height, the shape's extent
    (diameter, side, or the triangle's base and height) and its top-left corner."""

    shape: str
    colour: str
    width: int
    height: int
    size: int
    left: int
    top: int

    def split(self) -> str:
        """"test", "validation" or "train": a fixed hash of the spec, the same on every machine."""
        h = zlib.crc32(repr(astuple(self)).encode()) % SPLIT_MOD
        return {0: "test", 1: "validation"}.get(h, "train")


def random_spec(rng: random.Random) -> Spec:
    """A spec drawn uniformly: the shape lies wholly inside the picture."""
    w, h = rng.randint(*PICTURE_SIDES), rng.randint(*PICTURE_SIDES)
    lo, hi = SHAPE_FRACTION
    size = rng.randint(int(lo * min(w, h)), int(hi * min(w, h)))
    return Spec(rng.choice(SHAPES), rng.choice(list(COLOURS)), w, h, size, rng.randint(0, w - size),
                rng.randint(0, h - size))


def spec_in(split: str, rng: random.Random) -> Spec:
    """A random spec of one split (rejection sampling: about 1 in 10 draws lands in test or validation)."""
    while True:
        spec = random_spec(rng)
        if spec.split() == split:
            return spec


def split_specs(split: str, n: int, seed: int) -> list[Spec]:
    """n distinct specs of a split, from a seed of their own."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        spec = spec_in(split, rng)
        if spec not in seen:
            seen.add(spec)
            out.append(spec)
    return out


def draw(spec: Spec):
    """The picture of a spec: an RGB `PIL.Image` of width x height, white, with the filled shape."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (spec.width, spec.height), (255, 255, 255))
    pen = ImageDraw.Draw(img)
    x0, y0, s = spec.left, spec.top, spec.size
    fill = COLOURS[spec.colour]
    if spec.shape == "circle":
        pen.ellipse([x0, y0, x0 + s - 1, y0 + s - 1], fill=fill)
    elif spec.shape == "square":
        pen.rectangle([x0, y0, x0 + s - 1, y0 + s - 1], fill=fill)
    else:  # point up, base at the bottom
        pen.polygon([(x0 + (s - 1) / 2, y0), (x0, y0 + s - 1), (x0 + s - 1, y0 + s - 1)], fill=fill)
    return img


def answer_text(spec: Spec) -> str:
    return f"a {spec.colour} {spec.shape}"


def parse_answer(text: str) -> tuple[str | None, str | None]:
    """(colour, shape) named in an answer, None for one it names not exactly once."""
    words = text.lower().replace(".", " ").split()
    colours = [w for w in words if w in COLOURS]
    shapes = [w for w in words if w in SHAPES]
    return (colours[0] if len(colours) == 1 else None), (shapes[0] if len(shapes) == 1 else None)


# ----------------------------------------------------------------------------- data


def prompt_ids(question: str, soft_tokens: int) -> list[int]:
    """The chat prompt with one image before the question, as dgemma's engine lays it out: the template around
    `<|image|>question`, the placeholder expanded to begin-of-image, soft_tokens image tokens, end-of-image."""
    mark = IMAGE_TOKEN_NAMES[IMAGE_ID]
    head, tail = chat_prompt(mark + question).split(mark)
    return encode(head) + [BOI_ID] + [IMAGE_ID] * soft_tokens + [EOI_ID] + encode(tail)


def canvas_ids(spec: Spec) -> list[int]:
    """The answer, `<turn|>`, then `<pad>` to the canvas length [CANVAS]."""
    answer = encode(answer_text(spec)) + [106]
    return answer + [0] * (CANVAS - len(answer))


def pictures(specs: list[Spec]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The specs' pictures through dgemma's image processor at IMAGE_TOKENS: pixel_values [B, P, 768], position_ids
    [B, P, 2] (P = 70 * 9 patches, zero-padded) and each picture's soft-token count (pictures of other shapes take
    other numbers)."""
    from dgemma_cli.image import patchify

    patches = [patchify(draw(spec), IMAGE_TOKENS) for spec in specs]
    return (torch.stack([p.pixel_values for p in patches]), torch.stack([p.position_ids for p in patches]),
            [p.soft_tokens for p in patches])


def make_batch(rng: random.Random, size: int, split: str = "train"):
    """A batch of pictures and questions: pixel_values and position_ids (`pictures`), left-padded prompts [B, T]
    with their valid mask, clean canvases [B, C] and the held mask [B, C] (none held)."""
    specs = [spec_in(split, rng) for _ in range(size)]
    pixels, positions, soft_tokens = pictures(specs)
    prompts = [prompt_ids(rng.choice(QUESTIONS), n) for n in soft_tokens]
    T = max(map(len, prompts))
    prompt = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    valid = torch.tensor([[False] * (T - len(p)) + [True] * len(p) for p in prompts])
    canvas = torch.tensor([canvas_ids(spec) for spec in specs])
    return pixels, positions, prompt, valid, canvas, torch.zeros_like(canvas, dtype=torch.bool)


# ----------------------------------------------------------------------------- model


class WithImages:
    """The text model, its `encode` placing the given soft tokens [N, H] at the prompt's image tokens: lets
    train_demo.loss_on (which encodes text only) train through the vision tower. Everything else is the model's."""

    def __init__(self, model, features: torch.Tensor):
        self.model, self.features = model, features

    def __getattr__(self, name):
        return getattr(self.model, name)

    def encode(self, ids, cache, valid=None):
        return self.model.encode(ids, cache, valid, image_features=self.features)


def edge_filters(tower, orientations: int = EDGE_ORIENTATIONS) -> None:
    """Start the first `orientations` rows of the patch embedding (input_proj.weight [Hv, 16 * 16 * 3], inputs in
    (row, column, channel) order) as step-edge filters through the patch centre at evenly spaced angles, the same on
    every colour channel, unit norm.

    Why: from a random init this tiny tower learns colour within a hundred steps but sits at chance on shape for
    hundreds more, until it has found edge detectors of its own (a patch inside a shape looks the same for every
    shape; only edge orientations tell a circle, a square and a triangle apart). Measured with a small classifier
    on this tower alone (its soft tokens mean-pooled, batches of 32): with these filters, 99% right on shape within
    100 steps; from a random init, 47% after 200 (67% after 250 at twice the width).
    """
    side = tower.cfg.patch_size
    ys, xs = torch.meshgrid(torch.arange(side) - (side - 1) / 2, torch.arange(side) - (side - 1) / 2, indexing="ij")
    weight = tower.input_proj.weight
    with torch.no_grad():
        for k in range(orientations):
            angle = math.pi * k / orientations
            edge = torch.tanh((xs * math.cos(angle) + ys * math.sin(angle)) / 2)  # [side, side]: -1 one side, +1 other
            edge = edge[:, :, None].expand(side, side, 3) / (edge.norm() * math.sqrt(3))
            weight[k] = edge.reshape(-1)


def build(seed: int):
    """(text model, vision tower, config.json as a dict): train_demo.build_model's text stack and init, a vision
    config beside it, and a tower initialized the same way (normal(0, 0.02) matrices and position table, ones for
    norms and the standardization scale, zeros for its bias), its patch embedding starting with edge filters."""
    from dgemma_cli.config import ModelConfig
    from dgemma_cli.vision import VisionTower

    model, config = build_model(seed, canvas=CANVAS, text_config=SHAPES_TEXT_CONFIG)
    config.update(vision_config=VISION_CONFIG, boi_token_id=BOI_ID, image_token_id=IMAGE_ID, eoi_token_id=EOI_ID,
                  vision_soft_tokens_per_image=IMAGE_TOKENS, dtype="bfloat16")
    model.cfg = ModelConfig.from_dict(config)
    torch.manual_seed(seed + 1)
    tower = VisionTower(model.cfg.vision, SHAPES_TEXT_CONFIG["hidden_size"])
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(0.0 if name == "std_bias" else 1.0)
    edge_filters(tower)
    return model, tower, config


def warm_start(tower, rng: random.Random, steps: int, batch: int, lr: float) -> float:
    """Train the tower alone for `steps` steps to tell the shape and the colour of training pictures, through two
    throwaway linear heads on the mean of each picture's soft tokens; returns the last 25 steps' shape accuracy.

    Why: a real vision tower is pretrained before the language model learns to read it, and this one needs it too.
    Trained only end to end with the diffusion objective, it learns colour but stays at chance on shape for the
    whole budget (400 steps measured; a probe on its features then found no shape either): a shape word is
    predictable from any one of its letters still on the canvas, so the picture's shape is needed only where all of
    them are noised, and the weak signal left reaches the tower through a text model that has not yet learned to
    read it.
    """
    H = tower.embed_proj.weight.shape[0]
    heads = torch.nn.ModuleDict({"shape": torch.nn.Linear(H, len(SHAPES)), "colour": torch.nn.Linear(H, len(COLOURS))})
    opt = torch.optim.AdamW(list(tower.parameters()) + list(heads.parameters()), lr=lr, betas=(0.9, 0.98))
    hits = []
    for step in range(1, steps + 1):
        specs = [spec_in("train", rng) for _ in range(batch)]
        pixels, positions, soft_tokens = pictures(specs)
        pooled = torch.stack([x.mean(0) for x in tower(pixels, positions).split(soft_tokens)])  # [B, H]
        shape = torch.tensor([SHAPES.index(s.shape) for s in specs])
        colour = torch.tensor([list(COLOURS).index(s.colour) for s in specs])
        logits = heads["shape"](pooled)
        loss = F.cross_entropy(logits, shape) + F.cross_entropy(heads["colour"](pooled), colour)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        hits.append((logits.argmax(-1) == shape).float().mean().item())
        if step % 25 == 0:
            print(f"tower {step:4d}  loss {loss.item():.4f}  shape accuracy {sum(hits[-25:]) / 25:.1%}", flush=True)
    return sum(hits[-25:]) / len(hits[-25:])


def train_step(model, tower, opt, batch, gen: torch.Generator, self_condition: bool) -> float:
    """One optimizer step on a batch from make_batch; returns the loss."""
    pixels, positions, prompt, valid, canvas, held = batch
    features = tower(pixels, positions)  # [N, H]: every picture's soft tokens, picture after picture
    loss = loss_on(WithImages(model, features), prompt, valid, canvas, held, gen, self_condition=self_condition)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
    opt.step()
    return loss.item()


# ----------------------------------------------------------------------------- saving


def add_image_tokens(out: Path) -> None:
    """Rename the three placeholders that carry the image tokens in train_demo's tokenizer.json to Gemma 4's
    names, so that the chat's `<|image|>` encodes to the image token id."""
    path = out / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    for token_id, name in IMAGE_TOKEN_NAMES.items():
        del vocab[f"<unused{token_id}>"]
        vocab[name] = token_id
    for added in tok["added_tokens"]:
        if added["id"] in IMAGE_TOKEN_NAMES:
            added["content"] = IMAGE_TOKEN_NAMES[added["id"]]
    path.write_text(json.dumps(tok, ensure_ascii=False, indent=2))


def save_all(model, tower, config: dict, out: Path) -> None:
    """The checkpoint in the published layout: train_demo.save's text stack, configs and tokenizer, the vision
    tower beside it under its real names (vision.checkpoint_name: model.encoder.vision_tower.*, embed_vision.*),
    every tensor in bfloat16 as published checkpoints store them."""
    from safetensors.torch import load_file, save_file

    from dgemma_cli.vision import checkpoint_name

    save(model, config, out, dict(GENERATION_CONFIG, max_new_tokens=CANVAS))
    add_image_tokens(out)
    tensors = load_file(str(out / "model.safetensors"))
    for name, p in tower.named_parameters():
        tensors[checkpoint_name(name, "model.encoder.")] = p.detach().clone()
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------------------- validation while training


def validate(out: Path, specs: list[Spec], seed: int = 0) -> tuple[float, float, float]:
    """(colour, shape, both) accuracy through dgemma's engine on the checkpoint just saved."""
    from dgemma_cli.engine import load

    engine = load(out, device="cpu", dtype="float32")
    hits = [0, 0, 0]
    for spec in specs:
        text = engine.generate(QUESTION, images=[draw(spec)], seed=seed).texts[0]
        colour, shape = parse_answer(text)
        hits[0] += colour == spec.colour
        hits[1] += shape == spec.shape
        hits[2] += colour == spec.colour and shape == spec.shape
    return tuple(h / len(specs) for h in hits)


def main() -> int:
    ap = argparse.ArgumentParser(description="Train the bundled shapes demo model (a picture in, its shape out).")
    ap.add_argument("--out", type=Path, default=ROOT / "dgemma_cli" / "demo_shapes")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tower-steps", type=int, default=150, help="steps of the tower's warm start (warm_start)")
    ap.add_argument("--tower-lr-scale", type=float, default=0.3,
                    help="the tower's learning rate in the end-to-end stage, relative to --lr")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=20.0, help="stop early (and save) after this long")
    ap.add_argument("--validate-every", type=int, default=200, help="steps between validations (0: none)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    start = time.time()
    model, tower, config = build(args.seed)
    model.train()
    tower.train()
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    val = split_specs("validation", 48, args.seed + 777)
    if args.tower_steps:
        warm_start(tower, rng, args.tower_steps, args.batch, args.lr)
    groups = [{"params": list(model.parameters()), "scale": 1.0},
              {"params": list(tower.parameters()), "scale": args.tower_lr_scale}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = 50
    avg = None
    for step in range(1, args.steps + 1):
        lr = learning_rate(step, args.lr, warmup, args.steps)
        for group in opt.param_groups:
            group["lr"] = lr * group["scale"]
        loss = train_step(model, tower, opt, make_batch(rng, args.batch), gen, self_condition=step % 2 == 0)
        avg = loss if avg is None else 0.95 * avg + 0.05 * loss
        if step % 25 == 0:
            print(f"step {step:5d}  loss {avg:.4f}  lr {lr:.2e}  {time.time() - start:6.0f}s", flush=True)
        if args.validate_every and step % args.validate_every == 0:
            save_all(model, tower, config, args.out)
            colour, shape, both = validate(args.out, val)
            print(f"step {step:5d}  validation on {len(val)} pictures: colour {colour:.1%}, shape {shape:.1%}, "
                  f"both {both:.1%}", flush=True)
        if time.time() - start > args.minutes * 60:
            print(f"time limit reached at step {step}", flush=True)
            break
    save_all(model, tower, config, args.out)
    print(f"saved {args.out}; wall time {time.time() - start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
