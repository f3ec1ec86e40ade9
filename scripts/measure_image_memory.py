"""What reading one large picture costs: time and peak memory of `image.load_patches` (decode, convert, resize,
patchify at the 280 budget) in a fresh process, for pictures that cost a lot to decode.

Each picture is drawn and encoded in one process and written to a temporary file; another process imports
dgemma_cli.image, reads the file's bytes, notes its peak resident memory, then decodes: the figure is how far the
peak rose (what the decoding took, the import and the bytes excluded).

    .venv/bin/python scripts/measure_image_memory.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PICTURES = {  # name: (mode, size, format, fill)
    "7,990 x 7,990 RGB PNG": ("RGB", (7990, 7990), "PNG", (200, 10, 10)),
    "7,990 x 7,990 palette PNG": ("P", (7990, 7990), "PNG", 0),
    "7,990 x 7,990 RGB JPEG": ("RGB", (7990, 7990), "JPEG", (200, 10, 10)),
    "7,990 x 7,990 RGBA PNG": ("RGBA", (7990, 7990), "PNG", (200, 10, 10, 128)),
    "1 x 63,000,000 one-bit PNG": ("1", (63_000_000, 1), "PNG", 0),
}

DRAW = """
import sys
from PIL import Image
mode, w, h, fmt, fill = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], eval(sys.argv[5])
Image.new(mode, (w, h), fill).save(sys.argv[6], fmt)
"""

DECODE = """
import json, resource, sys, time
from dgemma_cli.image import load_patches
data = open(sys.argv[1], "rb").read()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
try:
    p = load_patches(data, 280)
    result = f"patches for {p.size[1]} x {p.size[0]}"
except Exception as e:
    result = f"refused: {e}"
rise = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
print(json.dumps({"result": result, "seconds": time.perf_counter() - t, "peak_rise_mb": rise / 1024,
                  "bytes": len(data)}))
"""


def main() -> int:
    print(f"{'picture':<28} {'file':>9} {'seconds':>8} {'peak rise':>10}  result")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (mode, (w, h), fmt, fill) in PICTURES.items():
            path = Path(tmp) / f"pic.{fmt.lower()}"
            subprocess.run([sys.executable, "-c", DRAW, mode, str(w), str(h), fmt, repr(fill), str(path)], check=True)
            out = subprocess.run([sys.executable, "-c", DECODE, str(path)], cwd=ROOT, capture_output=True, text=True,
                                 check=True)
            r = json.loads(out.stdout)
            print(f"{name:<28} {r['bytes'] / 1e3:>7.0f}kB {r['seconds']:>8.2f} {r['peak_rise_mb']:>7.0f} MB  "
                  f"{r['result'][:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
