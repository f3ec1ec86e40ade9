"""Train dgemma's bundled demo model: a tiny DiffusionGemma that upper-cases text, in the real checkpoint format.

    python scripts/train_demo.py --out dgemma_cli/demo_model      # fixed seed; about 20 minutes on 2 CPU cores

The task: `upper: <text>` -> `<TEXT>`, for texts of exactly 16 characters (lowercase words, digits, spaces).
Answers are checkable, each canvas visibly sharpens, and a small model learns it on a CPU. Two example formats are mixed:

- chat (80%): the prompt is the chat template around `upper: <text>`; the canvas is the answer, `<turn|>`, then
  `<pad>` to the canvas length;
- infill (20%): raw text `<bos>upper: <text>\\n<TEXT>\\n` with a hole inside the answer line: the prefix is the
  encoder's input, the canvas holds the hole's text, then `<pad>`, then the first (up to 8) tokens after the
  hole, held at the end of the canvas (never noised, no loss), as `dgemma fim` lays an infill out.

The objective is DiffusionGemma's: the prompt goes through the causal encoder into the KV cache; every canvas
position is replaced by a uniformly random token with probability t ~ U(0, 1); the bidirectional decoder predicts
the clean canvas (cross-entropy on every non-held position); in half the batches it is self-conditioned on its
own first prediction (softmax of logits / T, T ~ U(t_min, t_max), computed without gradient), as at sampling time.

The tokenizer is character-level (every character one token, Gemma 4's control tokens at their real ids), so the
canvas shows letters sharpening one by one.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dgemma_cli.config import ModelConfig  # noqa: E402
from dgemma_cli.model import DiffusionGemma  # noqa: E402
from dgemma_cli.tokenizer import FALLBACK_CHAT_TEMPLATE  # noqa: E402
from dgemma_cli.tuner.tune import learning_rate  # noqa: E402  (the demos' schedule, dgemma tune's too)

CONTROL = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 48: "<|tool_call>", 49: "<tool_call|>",
           50: "<|tool_response>", 98: "<|think|>", 100: "<|channel>", 101: "<channel|>", 105: "<|turn>",
           106: "<turn|>"}
FIRST_CHAR_ID = 107
CHARS = " \n!\"#$%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqrstuvwxyz{|}~"
VOCAB = 208  # 107 control/reserved + 95 characters, padded to a multiple of 16
CANVAS = 32
HELD = 8  # suffix tokens an infill holds at the end of the canvas
LETTERS = "abcdefghijklmnopqrstuvwxyz"
TEXT_LEN = 16  # every text the demo model handles has exactly this many characters

TEXT_CONFIG = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, top_k_experts=2,
                   moe_intermediate_size=128, sliding_window=64, max_position_embeddings=4096,
                   layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                   per_layer_config={"3": {"head_dim": 64, "num_key_value_heads": 1}},
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                       "rope_theta": 1000000.0}},
                   hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=2,
                   eos_token_id=1, final_logit_softcapping=30.0, tie_word_embeddings=True, attention_bias=False,
                   attention_dropout=0.0, use_bidirectional_attention=None, model_type="diffusion_gemma_text")
GENERATION_CONFIG = {"max_new_tokens": CANVAS, "max_denoising_steps": 48,
                     "sampler_config": {"entropy_bound": 0.1, "_cls_name": "EntropyBoundSamplerConfig"},
                     "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1, "confidence_threshold": 0.005,
                     "eos_token_id": [1, 106, 50], "pad_token_id": 0, "bos_token_id": 2}


# ----------------------------------------------------------------------------- tokenizer files


def write_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {}
    for i in range(FIRST_CHAR_ID):
        vocab[CONTROL.get(i, f"<unused{i}>")] = i
    for j, ch in enumerate(CHARS):
        vocab[ch] = FIRST_CHAR_ID + j
    for i in range(FIRST_CHAR_ID + len(CHARS), VOCAB):
        vocab[f"<unused{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token per character
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in vocab if t.startswith("<")
                            and t.endswith(">") and len(t) > 1])
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(FALLBACK_CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
         "model_max_length": TEXT_CONFIG["max_position_embeddings"]}, indent=2))


def encode(text: str) -> list[int]:
    """Character-level encoding matching tokenizer.json (control tokens written as their strings)."""
    ids, i = [], 0
    names = {v: k for k, v in CONTROL.items()}
    while i < len(text):
        if text[i] == "<":
            end = text.find(">", i)
            if end > 0 and text[i : end + 1] in names:
                ids.append(names[text[i : end + 1]])
                i = end + 1
                continue
        ids.append(FIRST_CHAR_ID + CHARS.index(text[i]))
        i += 1
    return ids


def chat_prompt(user: str) -> str:
    return f"<bos><|turn>user\n{user}<turn|>\n<|turn>model\n"


# ----------------------------------------------------------------------------- data


def random_text(rng: random.Random) -> str:
    """Exactly TEXT_LEN characters of short lowercase words, sometimes a digit group, single spaces between.

    One fixed length keeps each answer character at one fixed distance from its source character, so a model
    this small learns the task within the time budget (with free lengths it had not after 25 minutes).
    """
    while True:
        words = []
        while sum(len(w) + 1 for w in words) <= TEXT_LEN:
            if rng.random() < 0.12:
                words.append(str(rng.randint(0, 999)))
            else:
                words.append("".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 7))))
        text = " ".join(words)[:TEXT_LEN]
        if len(text) == TEXT_LEN and text[-1] != " " and "  " not in text:
            return text


def chat_example(text: str) -> tuple[list[int], list[int], int]:
    """(prompt ids, canvas ids, held count)."""
    answer = encode(text.upper()) + [106]
    return encode(chat_prompt(f"upper: {text}")), answer + [0] * (CANVAS - len(answer)), 0


def infill_example(text: str, rng: random.Random) -> tuple[list[int], list[int], int]:
    full = encode(f"<bos>upper: {text}\n{text.upper()}\n")
    answer_start = len(encode(f"<bos>upper: {text}\n"))
    i = rng.randint(answer_start, answer_start + len(text) - 1)
    j = rng.randint(i + 1, min(answer_start + len(text), i + CANVAS - HELD - 1))
    middle, suffix = full[i:j], full[j:]
    held = suffix[:HELD]
    canvas = middle + [0] * (CANVAS - len(middle) - len(held)) + held
    return full[:i], canvas, len(held)


def make_batch(rng: random.Random, size: int):
    """Left-padded prompts [B, T] with valid mask, clean canvases [B, C], held mask [B, C]."""
    rows = [infill_example(random_text(rng), rng) if rng.random() < 0.2 else chat_example(random_text(rng))
            for _ in range(size)]
    T = max(len(p) for p, _, _ in rows)
    prompt = torch.tensor([[0] * (T - len(p)) + p for p, _, _ in rows])
    valid = torch.tensor([[False] * (T - len(p)) + [True] * len(p) for p, _, _ in rows])
    canvas = torch.tensor([c for _, c, _ in rows])
    held = torch.zeros(size, CANVAS, dtype=torch.bool)
    for b, (_, _, h) in enumerate(rows):
        if h:
            held[b, CANVAS - h :] = True
    return prompt, valid, canvas, held


# ----------------------------------------------------------------------------- model


def build_model(seed: int, canvas: int = CANVAS, text_config: dict = TEXT_CONFIG) -> tuple[DiffusionGemma, dict]:
    config = {"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
              "canvas_length": canvas, "text_config": text_config, "tie_word_embeddings": True,
              "boi_token_id": 255999, "eoi_token_id": 258882, "image_token_id": 258880,
              "initializer_range": 0.02, "dtype": "float32"}
    torch.manual_seed(seed)
    model = DiffusionGemma(ModelConfig.from_dict(config))
    with torch.no_grad():  # Gemma's init: normal(0, 0.02) for matrices, ones for norms and scales
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)
    return model, config


def loss_on(model: DiffusionGemma, prompt, valid, canvas, held, rng: torch.Generator, self_condition: bool):
    B, C = canvas.shape
    V = model.cfg.text.vocab_size
    cache = model.new_cache(B, prompt.shape[1] + C)
    model.encode(prompt, cache, valid)
    t = torch.rand(B, 1, generator=rng)
    noisy = torch.where((torch.rand(B, C, generator=rng) < t) & ~held,
                        torch.randint(0, V, (B, C), generator=rng), canvas)
    ctx = model.denoise_context(cache, B)
    sc_probs = None
    if self_condition:
        with torch.no_grad():
            first = model.denoise(noisy, cache.clone(), ctx)
            temp = 0.4 + 0.4 * torch.rand(B, 1, 1, generator=rng)
            sc_probs = torch.softmax(first / temp, dim=-1).view(B * C, V)
    logits = model.denoise(noisy, cache.clone(), ctx, sc_probs=sc_probs)
    ce = F.cross_entropy(logits.reshape(-1, V), canvas.reshape(-1), reduction="none").view(B, C)
    return (ce * ~held).sum() / (~held).sum()


def save(model: DiffusionGemma, config: dict, out: Path, generation_config: dict = GENERATION_CONFIG) -> None:
    """Write the checkpoint in the published layout: text stack under model.decoder.*, encoder scalars apart."""
    from safetensors.torch import save_file

    from dgemma_cli.checkpoint.weights import checkpoint_name, expected_tensors

    out.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    tensors = {}
    for name in expected_tensors(model):
        if name.split(".")[0] in ("encoder_layer_scalar", "decoder_layer_scalar"):
            kind, i = name.split(".")
            value = params[kind][int(i)].reshape(1)
        else:
            value = params[name]
        tensors[checkpoint_name(name, "model.decoder.")] = value.detach().contiguous().clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    write_tokenizer(out)


def main() -> int:
    ap = argparse.ArgumentParser(description="Train the bundled demo model.")
    ap.add_argument("--out", type=Path, default=ROOT / "dgemma_cli" / "demo_model")
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=28.0, help="stop early (and save) after this long")
    args = ap.parse_args()

    torch.set_num_threads(2)
    model, config = build_model(args.seed)
    model.train()
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = 100
    start = time.time()
    avg = None
    for step in range(1, args.steps + 1):
        lr = learning_rate(step, args.lr, warmup, args.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        prompt, valid, canvas, held = make_batch(rng, args.batch)
        loss = loss_on(model, prompt, valid, canvas, held, gen, self_condition=step % 2 == 0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        avg = loss.item() if avg is None else 0.98 * avg + 0.02 * loss.item()
        if step % 50 == 0:
            print(f"step {step:5d}  loss {avg:.4f}  lr {lr:.2e}  {time.time() - start:6.0f}s", flush=True)
        if step % 500 == 0:
            save(model, config, args.out)
        if time.time() - start > args.minutes * 60:
            print(f"time limit reached at step {step}", flush=True)
            break
    save(model, config, args.out)
    print(f"saved {args.out} after {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
