"""Two terminal figures on the mid-size random config: chat cache reuse, and the live view's overhead.

    python scripts/measure_chat_view.py

Model: `dgemma bench`'s mid config (vocabulary 32768, hidden 256, 6 layers, 16 experts, canvas 256), random
weights, float32 on the CPU, with the tests' small BPE tokenizer (vocabulary 512 used of it) and the Gemma 4 chat
template. Answers are one canvas of 4 fixed steps (random weights never converge).

1. Chat: five turns of about 800 tokens each, so the fifth turn starts with about 4,200 tokens of history. Time
   from sending the fifth message to the first denoise step's result (`TurnStats.seconds_to_first_step`), with the
   KV cache kept from turn 4 (encodes only the new tokens) against a conversation told to re-encode everything
   (the same turns, same seeds). Median of 3 conversations each.
2. View: one 256-token canvas of 16 fixed steps through `Engine.generate`, with the live view drawing into a
   terminal emulator's worth of output (rich, forced terminal, 80 x 24) against no view; the overhead is the
   difference of the medians of 3 runs, and the view's own render time (`CanvasView.draw_seconds`) is reported
   with it. Also the cost of one frame of a full 256-token canvas, and what that costs at the view's 8 redraws
   per second against a 5 ms GPU step (a projection from the CPU-measured frame time, not a GPU measurement).
"""

from __future__ import annotations

import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from dgemma_cli.bench import MID, random_model  # noqa: E402
from dgemma_cli.conversation import Conversation  # noqa: E402
from dgemma_cli.config import GenerationSettings, ModelConfig  # noqa: E402
from dgemma_cli.engine import Engine  # noqa: E402
from dgemma_cli.tokenizer import Tokenizer  # noqa: E402
from dgemma_cli.cli.view import DEFAULT_FPS as MAX_FPS  # noqa: E402
from tokenizer_fixture import build_tokenizer_files  # noqa: E402

WORDS = ("the model reads the prompt into a cache and then denoises a whole canvas at once step by step "
         "accepting tokens it is sure of while the rest is noise again until the canvas is stable").split()


def message(n_tokens: int, tok: Tokenizer, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    words = []
    while len(tok.encode(" ".join(words))) < n_tokens:
        words.append(WORDS[int(torch.randint(len(WORDS), (1,), generator=g))])
    return " ".join(words)


def conversation_times(engine, settings, texts) -> tuple[float, float, int, int]:
    """(reuse seconds, re-encode seconds, tokens encoded by each) to the fifth turn's first step."""
    out = []
    for rebuild in (False, True):
        conv = Conversation(engine, 16384)
        for i, text in enumerate(texts[:-1]):
            events, _ = conv.turn_events(text, settings, seed=i)
            for _ in events:
                pass
        if rebuild:
            conv.stale = True
        events, stats = conv.turn_events(texts[-1], settings, seed=99)
        for _ in events:
            pass
        history = len(conv.full_ids(conv.turns[:-1]))
        out.append((stats.seconds_to_first_step, stats.encoded, history))
    (reuse, n_reuse, history), (full, n_full, _) = out
    return reuse, full, n_reuse, n_full, history


def main() -> int:
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict(MID)
    model = random_model(cfg, "bf16", "experts", torch.device("cpu"), torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        build_tokenizer_files(Path(tmp), vocab_size=512)
        tok = Tokenizer.from_dir(Path(tmp))
    settings = GenerationSettings(max_new_tokens=256, max_denoising_steps=4, confidence_threshold=1e-12,
                                  eos_token_ids=(1, 106))
    engine = Engine(model, tok, settings)
    texts = [message(800, tok, seed) for seed in range(5)]

    runs = [conversation_times(engine, settings, texts) for _ in range(3)]
    reuse = statistics.median(r[0] for r in runs)
    full = statistics.median(r[1] for r in runs)
    n_reuse, n_full, history = runs[0][2], runs[0][3], runs[0][4]
    print(f"chat, 5th turn, {history} tokens of history before it:")
    print(f"  cache kept:     {reuse:.3f} s to the first step ({n_reuse} tokens encoded)   runs: "
          + " ".join(f"{r[0]:.3f}" for r in runs))
    print(f"  re-encode all:  {full:.3f} s to the first step ({n_full} tokens encoded)   runs: "
          + " ".join(f"{r[1]:.3f}" for r in runs))
    print(f"  speed-up:       {full / reuse:.2f}x")

    from dgemma_cli.cli.view import view_for

    prompt = tok.encode_chat([{"role": "user", "content": texts[0]}])
    one = settings.override(max_new_tokens=256, max_denoising_steps=16)

    def run(with_view: bool) -> tuple[float, float]:
        buf = io.StringIO()
        from rich.console import Console

        console = Console(file=buf, width=80, height=24, force_terminal=True, color_system="truecolor")
        view = view_for(tok, console=console) if with_view else None
        t0 = time.perf_counter()
        if view is not None:
            with view:
                engine.generate([prompt], settings=one, seed=0, on_event=view)
        else:
            engine.generate([prompt], settings=one, seed=0)
        return time.perf_counter() - t0, (view.draw_seconds if view else 0.0)

    run(False)
    plain_runs = [run(False)[0] for _ in range(3)]
    view_runs = [run(True) for _ in range(3)]
    base, with_view = statistics.median(plain_runs), statistics.median(r[0] for r in view_runs)
    drawn = statistics.median(r[1] for r in view_runs)
    print("\nview, one 256-token canvas, 16 steps:")
    print(f"  no view:   {base:.3f} s   runs: " + " ".join(f"{t:.3f}" for t in plain_runs))
    print(f"  live view: {with_view:.3f} s   runs: " + " ".join(f"{t:.3f}" for t, _ in view_runs))
    print(f"  overhead:  {100 * (with_view - base) / base:+.2f}% (difference of medians); the view's own render "
          f"time {drawn:.3f} s = {100 * drawn / base:.2f}% of the run")

    # one frame of a full canvas, all positions accepted (the most text to lay out)
    from rich.console import Console

    from dgemma_cli.sampler import Step

    console = Console(file=io.StringIO(), width=80, height=24, force_terminal=True, color_system="truecolor")
    view = view_for(tok, console=console, max_fps=1e9)
    ids = torch.tensor([tok.encode(texts[1])[:256]])
    ev = Step(0, 3, 16, ids, ids, torch.ones_like(ids, dtype=torch.bool), torch.full(ids.shape, 0.1),
              torch.tensor([False]))
    with view:
        for _ in range(5):
            view(ev)
        t0 = time.perf_counter()
        for _ in range(50):
            view(ev)
        frame = (time.perf_counter() - t0) / 50
    print(f"  one frame of a full 256-token canvas: {1000 * frame:.2f} ms; at {MAX_FPS:g} redraws/s that is "
          f"{100 * MAX_FPS * frame:.1f}% of wall time, whatever the step time (projection)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
