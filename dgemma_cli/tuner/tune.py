"""`dgemma tune`: LoRA fine-tuning with the model's own objective, on a frozen base in any format dgemma reads.

The objective is the block-diffusion loss the bundled demos are trained with (scripts/train_demo.py): the prompt
(and the answer's earlier canvases) through the causal encoder into the KV cache; each position of the answer's
canvas replaced by a uniformly random token with probability t ~ U(0, 1) (held positions never); the bidirectional
decoder predicts the clean canvas; in half the batches it is self-conditioned on its own first prediction (softmax
at a temperature drawn from [0.4, 0.8]), as the sampler feeds it. Cross-entropy over the noised-or-not, non-held
positions. Only the adapter's factors train (lora.trainable); the base stays as loaded (a quantized base is
dequantized layer by layer in the forward pass, never stored in 16 bits).

Data (JSONL, one example per line; a line that is not one of these stops the run before any training, naming it):
    {"messages": [{"role": "user", "content": "..."}, ..., {"role": "assistant", "content": "..."}]}
    {"prompt": "...", "completion": "..."}        (the prompt as a user message, or as raw text with --raw)
    {"prefix": "...", "middle": "...", "suffix": "..."}   (fill in the middle, as `dgemma fim` asks: the prefix
        through the encoder, the suffix's first tokens held at the canvas's end)

State: OUT/.tune/state.pt (the adapter, the optimiser, the step, every random generator), replaced atomically every
--checkpoint-every steps; a run started again on the same OUT with the same settings resumes from it exactly (the
same losses as an uninterrupted run). The adapter itself goes to OUT in PEFT's format at each checkpoint and at the
end. An OUT that holds other files and no such state (an adapter another run made) is refused (`others_in`) unless
the run is told to start over (--restart).
"""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import DgemmaError, UsageError

STATE_DIR = ".tune"
STATE = "state.pt"


class TuneError(DgemmaError):
    """A run that cannot go on (its state cannot be written): one line, exit status 1."""


class TuneDataError(UsageError):
    """A training file that cannot be used: one line naming the file and the line."""


@dataclass
class Example:
    """prompt ids (through the encoder), answer ids (canvases, an end id last), held suffix ids (FIM)."""

    prompt: list[int]
    answer: list[int]
    held: list[int] = field(default_factory=list)
    text: str = ""  # the answer's text, for the task metric


@dataclass
class TuneSettings:
    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = ("attention", "mlp")
    expert_rank: int = 0
    steps: int = 1000
    batch_size: int = 16
    lr: float = 1e-3
    warmup: int = 50
    seed: int = 0
    held_out: int = 64  # examples kept apart (from the data, by seed) for the held-out loss and task metric
    eval_every: int = 100
    eval_examples: int = 32  # held-out examples generated for the task metric at each evaluation
    checkpoint_every: int = 100
    raw: bool = False
    held_tokens: int = 8
    max_denoising_steps: int | None = None  # the metric's generation; None: the model's

    def key(self, base: str = "") -> dict:
        """What a resumed run must share with the run it resumes (the base model's name among it)."""
        d = asdict(self)
        d["base"] = base
        d["targets"] = list(d["targets"])
        for k in ("steps", "eval_every", "eval_examples", "checkpoint_every", "max_denoising_steps"):
            d.pop(k)
        return d


# ------------------------------------------------------------------------------------------------ data


def read_examples(path: Path, tokenizer, canvas: int, raw: bool = False, held_tokens: int = 8) -> list[Example]:
    """Every line of a JSONL file as an Example; TuneDataError naming the first bad line (nothing is trained on a
    half-read file)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TuneDataError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TuneDataError(f"{path}: cannot read it ({e.__class__.__name__}: {e})") from None
    end = tokenizer.end_of_turn_id if tokenizer.end_of_turn_id is not None else tokenizer.eos_id
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TuneDataError(f"{path}:{n}: not JSON ({e.msg})") from None
        try:
            out.append(_example(obj, tokenizer, end, canvas, raw, held_tokens))
        except (TypeError, ValueError, KeyError) as e:
            raise TuneDataError(f"{path}:{n}: {e}") from None
    if not out:
        raise TuneDataError(f"{path}: no examples")
    return out


def _text(obj: dict, key: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str):
        raise ValueError(f'"{key}" must be a string')
    return v


def _example(obj, tok, end: int, canvas: int, raw: bool, held_tokens: int) -> Example:
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or len(msgs) < 2 or not all(isinstance(m, dict) for m in msgs):
            raise ValueError('"messages" must list at least a user message and the assistant\'s answer')
        last = msgs[-1]
        if last.get("role") != "assistant" or not isinstance(last.get("content"), str):
            raise ValueError('the last message must be the assistant\'s, with a string "content"')
        for m in msgs[:-1]:
            if m.get("role") not in ("system", "user", "assistant", "tool") or not isinstance(m.get("content"), str):
                raise ValueError('every message needs a role and a string "content"')
        prompt = tok.encode_chat([{"role": m["role"], "content": m["content"]} for m in msgs[:-1]])
        answer = last["content"]
        return Example(prompt, tok.encode_text(answer) + [end], text=answer)
    if "prompt" in obj or "completion" in obj:
        p, c = _text(obj, "prompt"), _text(obj, "completion")
        prompt = (([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(p)) if raw else \
            tok.encode_chat([{"role": "user", "content": p}])
        return Example(prompt, tok.encode_text(c) + [end], text=c)
    if "middle" in obj:
        pre, mid, suf = _text(obj, "prefix"), _text(obj, "middle"), _text(obj, "suffix")
        held = tok.encode_text(suf)[:held_tokens]
        middle = tok.encode_text(mid)
        if len(middle) + len(held) > canvas:
            raise ValueError(f'"middle" is {len(middle)} tokens; with {len(held)} held it must fit a canvas of '
                             f"{canvas}")
        return Example(([tok.bos_id] if tok.bos_id is not None else []) + tok.encode_text(pre), middle, held,
                       text=mid)
    raise ValueError('expected "messages", "prompt" and "completion", or "prefix", "middle" and "suffix"')


def batch_of(examples: list[Example], canvas: int, pad: int, rng: random.Random):
    """Left-padded prompts [B, T] + valid mask, clean canvases [B, C], held mask [B, C]: for each example one of its
    answer's canvases (the earlier ones then join its prompt, as generation appends them to the cache)."""
    rows = []
    for ex in examples:
        if ex.held:  # fill in the middle: one canvas, the held suffix at its end
            c = ex.answer + [pad] * (canvas - len(ex.answer) - len(ex.held)) + ex.held
            rows.append((ex.prompt, c, len(ex.held)))
            continue
        k = rng.randrange(max(1, math.ceil(len(ex.answer) / canvas)))
        part = ex.answer[k * canvas : (k + 1) * canvas]
        rows.append((ex.prompt + ex.answer[: k * canvas], part + [pad] * (canvas - len(part)), 0))
    T = max(len(p) for p, _, _ in rows)
    prompt = torch.tensor([[pad] * (T - len(p)) + p for p, _, _ in rows])
    valid = torch.tensor([[False] * (T - len(p)) + [True] * len(p) for p, _, _ in rows])
    clean = torch.tensor([c for _, c, _ in rows])
    held = torch.zeros(clean.shape, dtype=torch.bool)
    for b, (_, _, h) in enumerate(rows):
        if h:
            held[b, canvas - h :] = True
    return prompt, valid, clean, held


# ------------------------------------------------------------------------------------------------ objective


def diffusion_loss(model, prompt, valid, canvas, held, gen: torch.Generator, self_condition: bool) -> torch.Tensor:
    """The demos' block-diffusion loss (module docstring). Tensors on the model's device; gen on the CPU."""
    B, C = canvas.shape
    V = model.cfg.text.vocab_size
    dev = model.device
    cache = model.new_cache(B, prompt.shape[1] + C)
    model.encode(prompt.to(dev), cache, valid.to(dev))
    t = torch.rand(B, 1, generator=gen)
    noise = (torch.rand(B, C, generator=gen) < t) & ~held
    noisy = torch.where(noise, torch.randint(0, V, (B, C), generator=gen), canvas).to(dev)
    ctx = model.denoise_context(cache, B)
    sc_probs = None
    temp = 0.4 + 0.4 * torch.rand(B, 1, 1, generator=gen)
    if self_condition:
        with torch.no_grad():
            first = model.denoise(noisy, cache.clone(), ctx)
            sc_probs = torch.softmax(first / temp.to(dev), dim=-1).view(B * C, V)
    logits = model.denoise(noisy, cache.clone(), ctx, sc_probs=sc_probs)
    ce = F.cross_entropy(logits.reshape(-1, V).float(), canvas.to(dev).reshape(-1), reduction="none").view(B, C)
    keep = (~held).to(dev)
    return (ce * keep).sum() / keep.sum()


def learning_rate(step: int, base: float, warmup: int, steps: int) -> float:
    """At step 1..steps: linear warm-up over `warmup` steps, then cosine decay to zero (the schedule the bundled demos
    were trained with: scripts/train_demo.py takes it from here)."""
    return base * min(1.0, step / max(1, warmup)) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps)))


# ------------------------------------------------------------------------------------------------ memory


def memory_estimate(model, ad, settings: TuneSettings, prompt_len: int, checkpointing: bool = True) -> dict:
    """Bytes a tune needs at most, by part (footprint.tune_bytes' count, computed from the shapes): the base as
    loaded (plus a quantized layer's dequantized experts: one layer's with checkpointing, all without), the
    adapter's factors with their gradients and AdamW's moments, the activations kept for the backward pass, the
    head's float32 logits."""
    from ..checkpoint.footprint import dequantized_layer_bytes, tune_bytes
    from .lora import trainable
    from ..model import QuantizedExperts

    parts = tune_bytes(model.cfg, "bf16", settings.batch_size, prompt_len, settings.rank, settings.targets,
                       settings.expert_rank, checkpointing, dtype_bytes=model.dtype.itemsize)
    base = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    quantized = any(isinstance(layer.experts, QuantizedExperts) for layer in model.layers)
    dequantized = dequantized_layer_bytes(model.cfg, model.dtype.itemsize) \
        * (1 if checkpointing else model.cfg.text.num_hidden_layers) if quantized else 0
    adapter = 16 * sum(p.numel() for p in trainable(ad))
    acts = parts["activations"] + parts["head"]
    return dict(base=base + dequantized, adapter=adapter, activations=acts, total=base + dequantized + adapter + acts,
                parameters=adapter // 16)


# ------------------------------------------------------------------------------------------------ state


def save_state(out: Path, state: dict) -> None:
    """OUT/.tune/state.pt, replaced atomically: a failed write (a full disk) leaves the previous one whole."""
    d = out / STATE_DIR
    d.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".state-")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / STATE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def others_in(out: Path) -> list[str]:
    """The names of what OUT holds when it holds no stopped tune to resume (OUT/.tune/state.pt), a tune's own state
    directory aside: what a tune there would write beside, or over (an adapter another run made). [] where OUT does
    not exist, is empty or holds a stopped tune."""
    if not out.is_dir() or (out / STATE_DIR / STATE).is_file():
        return []
    return sorted(p.name for p in out.iterdir() if p.name != STATE_DIR)


def load_state(out: Path) -> dict | None:
    p = out / STATE_DIR / STATE
    if not p.is_file():
        return None
    try:
        return torch.load(p, weights_only=False)
    except Exception as e:  # noqa: BLE001 - a damaged state file: said in one line, never trained over silently
        raise UsageError(f"{p}: cannot read the saved state ({e.__class__.__name__}); remove {out / STATE_DIR} to "
                         "start over") from None


# ------------------------------------------------------------------------------------------------ the loop


@dataclass
class Evaluation:
    step: int
    train_loss: float
    held_loss: float | None
    exact: float | None  # share of held-out examples whose generated answer equals the example's


def split(examples: list[Example], held_out: int, seed: int) -> tuple[list[Example], list[Example]]:
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n = min(held_out, len(examples) // 5) if held_out else 0  # never more than a fifth of the data
    return [examples[i] for i in order[n:]], [examples[i] for i in order[:n]]


class Tuner:
    """One tuning run: `run()` trains from the start or from OUT's saved state and writes the adapter."""

    def __init__(self, engine, examples: list[Example], out: Path, settings: TuneSettings, base_name: str,
                 report=None, held: list[Example] | None = None):
        """held: the held-out examples (an --eval file); None: settings.held_out of `examples`, drawn by seed."""
        from .lora import attach, new_adapter

        self.engine, self.model = engine, engine.model
        self.out, self.s = Path(out), settings
        self.canvas = self.model.cfg.canvas_length
        self.pad = engine.tokenizer.pad_id if engine.tokenizer.pad_id is not None else 0
        self.train, self.held = (examples, held) if held is not None else split(examples, settings.held_out,
                                                                                 settings.seed)
        for p in self.model.parameters():  # the base is frozen: only the adapter's factors get gradients
            p.requires_grad_(False)
        torch.manual_seed(settings.seed)
        self.adapter = new_adapter(self.model, settings.rank, settings.alpha, settings.targets, settings.expert_rank,
                                   generator=torch.Generator().manual_seed(settings.seed), base=base_name)
        attach(self.model, [(self.adapter, 1.0)])
        from .lora import trainable

        self.params = trainable(self.adapter)
        self.opt = torch.optim.AdamW(self.params, lr=settings.lr, weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(settings.seed)
        self.rng = random.Random(settings.seed)
        self.step = 0
        self.saved = 0  # the step of the last state written
        self.base = base_name
        self.report = report or (lambda kind, **kw: None)
        self.history: list[Evaluation] = []

    # --- state
    def state(self) -> dict:
        return dict(key=self.s.key(self.base), step=self.step, params=[p.detach().cpu().clone() for p in self.params],
                    opt=self.opt.state_dict(), gen=self.gen.get_state(), rng=self.rng.getstate(),
                    torch_rng=torch.get_rng_state(), history=[asdict(e) for e in self.history])

    def restore(self, st: dict) -> None:
        if st.get("key") != self.s.key(self.base):
            theirs, ours = st.get("key") or {}, self.s.key(self.base)
            diff = next((k for k in ours if theirs.get(k) != ours[k]), "settings")
            raise UsageError(f"{self.out / STATE_DIR} holds a stopped tune with another {diff} ({theirs.get(diff)!r}, "
                             f"now {ours.get(diff)!r}); use another --out, or --restart to start over")
        with torch.no_grad():
            for p, v in zip(self.params, st["params"]):
                p.copy_(v)
        self.opt.load_state_dict(st["opt"])
        self.gen.set_state(st["gen"])
        self.rng.setstate(st["rng"])
        torch.set_rng_state(st["torch_rng"])
        self.step = self.saved = st["step"]
        self.history = [Evaluation(**e) for e in st.get("history", [])]

    def checkpoint(self) -> None:
        """The state, then the adapter; a failed write (a full disk) stops the run with one line and leaves the last
        saved state and adapter as they were."""
        from .lora import save_adapter

        try:
            save_state(self.out, self.state())
            save_adapter(self.adapter, self.out)
        except OSError as e:
            kept = f"the state saved at step {self.saved} is kept" if self.saved else "nothing was saved before"
            raise TuneError(f"cannot save the tune's state in {self.out} ({e.strerror or e}); {kept}") from None
        self.saved = self.step

    # --- training
    def train_step(self) -> float:
        s = self.s
        self.step += 1
        for g in self.opt.param_groups:
            g["lr"] = learning_rate(self.step, s.lr, s.warmup, s.steps)
        batch = [self.train[self.rng.randrange(len(self.train))] for _ in range(s.batch_size)]
        prompt, valid, clean, held = batch_of(batch, self.canvas, self.pad, self.rng)
        self.model.train()
        loss = diffusion_loss(self.model, prompt, valid, clean, held, self.gen, self_condition=self.step % 2 == 0)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        return loss.item()

    @torch.no_grad()
    def evaluate(self, train_loss: float) -> Evaluation:
        """Held-out loss on fixed noise (the same draws at every evaluation) and the share of held-out examples whose
        greedy-seeded generation equals the example's answer exactly."""
        if not self.held:
            return Evaluation(self.step, train_loss, None, None)
        self.model.eval()
        gen = torch.Generator().manual_seed(12345)
        rng = random.Random(12345)
        losses = []
        for i in range(0, len(self.held), self.s.batch_size):
            prompt, valid, clean, held = batch_of(self.held[i : i + self.s.batch_size], self.canvas, self.pad, rng)
            losses.append(float(diffusion_loss(self.model, prompt, valid, clean, held, gen, self_condition=True)))
        exact = None
        shown = [ex for ex in self.held if not ex.held][: self.s.eval_examples]
        if shown:
            kw = {"max_denoising_steps": self.s.max_denoising_steps} if self.s.max_denoising_steps else {}
            limit = max(len(ex.answer) for ex in shown)
            res = self.engine.generate([ex.prompt for ex in shown], seed=0, max_new_tokens=limit, **kw)
            exact = sum(t.strip() == ex.text.strip() for t, ex in zip(res.texts, shown)) / len(shown)
        return Evaluation(self.step, train_loss, sum(losses) / len(losses), exact)

    def run(self) -> list[Evaluation]:
        s = self.s
        recent: list[float] = []
        t0 = time.perf_counter()
        self.report("start", step=self.step, steps=s.steps)
        try:
            while self.step < s.steps:
                recent.append(self.train_step())
                recent = recent[-20:]
                self.report("step", step=self.step, steps=s.steps, loss=sum(recent) / len(recent),
                            seconds=time.perf_counter() - t0)
                if self.step % s.eval_every == 0 or self.step == s.steps:
                    ev = self.evaluate(sum(recent) / len(recent))
                    self.history.append(ev)
                    self.report("eval", evaluation=ev)
                if self.step % s.checkpoint_every == 0 or self.step == s.steps:
                    self.checkpoint()
                    self.report("checkpoint", step=self.step)
        finally:  # Ctrl-C or a failed checkpoint too: the progress bar gives the terminal back
            self.report("end")
        return self.history
