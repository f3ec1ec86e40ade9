"""Draw a held-out picture for the shapes demo (`make demo-image`): one the model was never trained on.

    python scripts/make_shape_image.py --out pic.png [--index K] [--shape circle] [--colour red]

The picture is the first held-out one (scripts/eval_shapes.py's list, from index K on) with the asked shape and
colour, if any; the line printed says what it shows, to compare with the model's answer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from eval_shapes import held_out  # noqa: E402
from train_shapes import COLOURS, SHAPES, answer_text, draw  # noqa: E402

SEARCHED = 500  # held-out pictures looked through for one of the asked shape and colour (each pair has ~40)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the PNG file to write")
    ap.add_argument("--index", type=int, default=0, help="start at this held-out picture")
    ap.add_argument("--shape", choices=SHAPES)
    ap.add_argument("--colour", choices=list(COLOURS))
    args = ap.parse_args()
    specs = held_out(max(SEARCHED, args.index + 1))[args.index :]
    spec = next(s for s in specs if args.shape in (None, s.shape) and args.colour in (None, s.colour))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    draw(spec).save(args.out)
    print(f"{args.out}: {answer_text(spec)}, {spec.width} x {spec.height} px (a held-out picture)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
