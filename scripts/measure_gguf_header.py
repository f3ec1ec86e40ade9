"""How long a GGUF's header takes to read at a real DiffusionGemma tokenizer's size: dgemma's lean parser
(dgemma_cli/checkpoint/gguf_header.py) against the `gguf` library's GGUFReader, on a file written by the library with
262,144 tokens, their scores and types, and 514,906 merges (the real file's counts; the strings are made up), and one
small tensor.

    .venv/bin/python scripts/measure_gguf_header.py [--out /tmp/tokenizer-sized.gguf]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOKENS, MERGES = 262_144, 514_906


def write(out: Path) -> None:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(out), "diffusion-gemma")
    w.add_uint32("diffusion-gemma.block_count", 30)
    w.add_token_list([f"tok{i}_{'x' * (i % 9)}" for i in range(TOKENS)])
    w.add_token_scores(np.random.default_rng(0).random(TOKENS).astype(np.float32).tolist())
    w.add_token_types([1] * TOKENS)
    w.add_token_merges([f"a{i} b{i % 977}" for i in range(MERGES)])
    w.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/tokenizer-sized.gguf"))
    args = ap.parse_args()
    if not args.out.exists():
        write(args.out)
    import gguf

    from dgemma_cli.checkpoint.gguf_header import read_header

    t0 = time.perf_counter()
    h = read_header(args.out)
    ours = time.perf_counter() - t0
    assert len(h.metadata["tokenizer.ggml.tokens"]) == TOKENS and len(h.metadata["tokenizer.ggml.merges"]) == MERGES
    t0 = time.perf_counter()
    gguf.GGUFReader(args.out)
    theirs = time.perf_counter() - t0
    print(f"{args.out} ({args.out.stat().st_size / 1e6:.1f} MB): gguf_header.read_header {ours:.2f} s, "
          f"gguf.GGUFReader {theirs:.2f} s ({theirs / ours:.0f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
