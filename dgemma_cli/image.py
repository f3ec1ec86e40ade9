"""Images in: read a file safely, and turn it into the vision tower's patches (the Gemma 4 image processor).

The rule: this module knows pixels, nothing of the model. It reads PNG, JPEG, WebP and GIF (first frame) with
Pillow and refuses anything else in one line: a missing or unreadable file, a file that is not an image, a
truncated or corrupt one, and one whose decoding would cost more than a picture is worth (a decompression bomb).
What a picture may cost is bounded from its header, before any pixel is decoded: each side (`MAX_SIDE`), its
aspect ratio (`MAX_ASPECT`: past it the processor squeezes the long side anyway), its pixels (`MAX_PIXELS`), and
the working memory decoding and converting it takes (`MAX_DECODE_BYTES`, counting the decoded mode's bytes and
each conversion's copy). A JPEG far larger than any soft-token budget uses is decoded reduced (its DCT scaled by
1/2, 1/4 or 1/8, to at least twice the largest budget's size). Decoding runs one picture at a time per process
(`DECODE_SLOT`), so pictures sent together cost one picture's memory at a time.

`patchify` follows transformers' Gemma 4 image processor (its Pillow backend) value for value:
1. resize keeping the aspect ratio to the largest size with at most `budget * pool^2` patches whose sides are
   multiples of `pool * patch` (48 px), with Pillow's bicubic filter on the 8-bit RGB image (small images grow);
2. rescale to [0, 1] (x / 255 in float64, stored as float32); no mean/std normalisation;
3. cut into patch x patch squares, row-major, each flattened as (row, column, channel);
4. pad with zero patches to `budget * pool^2`, position ids (x, y) per patch and (-1, -1) for padding.
The image then takes `soft_tokens` = real patches / pool^2 image tokens in the prompt.
"""

from __future__ import annotations

import io
import math
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import IMAGE_TOKEN_BUDGETS
from .errors import UsageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_PIXELS = 64_000_000  # 64 megapixels: above any camera image people send a chat model; 192 MB decoded as RGB
MAX_SIDE = 16_384  # pixels on either side
MAX_ASPECT = max(IMAGE_TOKEN_BUDGETS)  # long side / short side: past one row of the largest budget, nothing is gained
MAX_DECODE_BYTES = 768 << 20  # the working memory of decoding and converting one picture (decode_bytes)
MAX_BYTES = 256 << 20  # a file (or data: URL) larger than this is refused before it is read
DECODE_SLOT = threading.Lock()  # one picture decoded at a time in this process


@dataclass
class Patches:
    """One image, ready for the vision tower."""

    pixel_values: torch.Tensor  # float32 [budget * pool^2, patch * patch * 3], zero rows past the real patches
    position_ids: torch.Tensor  # int64 [budget * pool^2, 2]: (x, y) of each patch, (-1, -1) for padding
    soft_tokens: int  # image tokens it takes in the prompt (real patches / pool^2)
    size: tuple[int, int]  # (height, width) after resizing


def open_image(source: str | Path | bytes, name: str | None = None):
    """A decoded RGB `PIL.Image` from a file path or the file's bytes; UsageError (one line) for bad input.

    `name` is what the messages call the image (default: the path, or "image").
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    if isinstance(source, (bytes, bytearray)):
        label = name or "image"
        if len(source) > MAX_BYTES:
            raise UsageError(f"{label}: {len(source) >> 20} MB is larger than the {MAX_BYTES >> 20} MB dgemma reads")
        data = bytes(source)
    else:
        path = Path(source).expanduser()
        label = name or str(source)
        try:
            if path.is_dir():
                raise UsageError(f"{label}: is a directory, not an image")
            if path.stat().st_size > MAX_BYTES:
                raise UsageError(f"{label}: {path.stat().st_size >> 20} MB is larger than the {MAX_BYTES >> 20} MB "
                                 "dgemma reads")
            data = path.read_bytes()
        except FileNotFoundError:
            raise UsageError(f"{label}: no such file") from None
        except OSError as e:
            raise UsageError(f"{label}: cannot read ({e.strerror or e})") from None
    if not data:
        raise UsageError(f"{label}: empty file, not an image")
    with warnings.catch_warnings():
        # Pillow only warns between its limit and twice it; ours is lower and checked below, before decoding.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
        except UnidentifiedImageError:
            raise UsageError(f"{label}: not an image dgemma reads (PNG, JPEG, WebP or GIF)") from None
        except Image.DecompressionBombError:
            raise UsageError(f"{label}: the image claims too many pixels (over {MAX_PIXELS // 1_000_000} "
                             "megapixels); refused") from None
        except Exception as e:  # a header Pillow cannot parse: its errors are of many types
            raise UsageError(f"{label}: truncated or corrupt image ({_reason(e)})") from None
        w, h = img.size
        check_size(label, w, h)
        if img.format == "JPEG":
            # Decode at the smallest DCT scale that keeps twice the largest budget's size: the same picture to the
            # processor, a fraction of the memory and time for a large photo.
            th, tw = target_size(h, w, max(IMAGE_TOKEN_BUDGETS))
            img.draft(img.mode, (2 * tw, 2 * th))
        cost = decode_bytes(img)
        if cost > MAX_DECODE_BYTES:
            raise UsageError(f"{label}: a {w} x {h} {img.mode} image takes {cost >> 20} MB to decode, over the "
                             f"{MAX_DECODE_BYTES >> 20} MB dgemma allows a picture; send it smaller")
        with DECODE_SLOT:
            try:
                img.load()  # the first frame of an animated GIF
                ImageOps.exif_transpose(img, in_place=True)  # camera photos stored rotated show as taken
                return to_rgb(img)
            except MemoryError:
                raise
            except Exception as e:  # OSError("image file is truncated ..."), SyntaxError("broken PNG file"), ...
                raise UsageError(f"{label}: truncated or corrupt image ({_reason(e)})") from None


def check_size(label: str, w: int, h: int) -> None:
    """Refuse, from the header's size, a picture no budget could use."""
    if w < 1 or h < 1:
        raise UsageError(f"{label}: the image claims {w} x {h} pixels; refused")
    if max(w, h) > MAX_SIDE:
        raise UsageError(f"{label}: the image claims {w} x {h} pixels; a side may have at most {MAX_SIDE}")
    if max(w, h) > MAX_ASPECT * min(w, h):
        raise UsageError(f"{label}: the image is {w} x {h} pixels, an aspect ratio over {MAX_ASPECT}:1 that the "
                         "processor cannot use")
    if w * h > MAX_PIXELS:
        raise UsageError(f"{label}: the image claims {w} x {h} pixels (over {MAX_PIXELS // 1_000_000} "
                         "megapixels); refused")


def decode_bytes(img) -> int:
    """The working memory of decoding `img` (header read, draft set) and making it 8-bit RGB: the decoded image,
    the RGB copy when its mode is another, and with transparency the RGBA copy, the white background and the
    composite (to_rgb). Bytes per pixel of the decoded mode count at least one (a 1-bit image is unpacked)."""
    w, h = img.size
    decoded = max(1, len(img.getbands())) * (4 if img.mode in ("I", "F", "I;16") else 1)
    rgb = 0 if img.mode == "RGB" else 3
    alpha = 12 if ("A" in img.getbands() or "transparency" in img.info) else 0
    return w * h * (decoded + rgb + alpha)


def _reason(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:120]


def to_rgb(img):
    """8-bit RGB; transparency is composited onto white (as the reference processor does)."""
    from PIL import Image

    if img.mode == "RGB":
        return img
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")


def target_size(height: int, width: int, budget: int, patch: int = 16, pool: int = 3) -> tuple[int, int]:
    """(height, width) to resize to: the aspect ratio kept, at most budget * pool^2 patches, sides multiples of
    pool * patch. A side that would round to nothing gets one multiple; the other is then limited to budget."""
    side = pool * patch
    max_px = budget * pool * pool * patch * patch
    scale = math.sqrt(max_px / (height * width))
    th = int(math.floor(scale * height / side)) * side
    tw = int(math.floor(scale * width / side)) * side
    if th == 0 and tw == 0:  # cannot happen for a budget of at least 1 (the area is at least pool^2 sides^2)
        raise UsageError(f"cannot fit a {width} x {height} image into {budget} soft tokens")
    if th == 0:  # very wide: one row of pooled patches
        th, tw = side, min(int(math.floor(width / height)) * side, budget * side)
    elif tw == 0:  # very tall
        tw, th = side, min(int(math.floor(height / width)) * side, budget * side)
    return th, tw


def patchify(img, budget: int = 280, patch: int = 16, pool: int = 3) -> Patches:
    """An RGB `PIL.Image` -> `Patches` for a soft-token budget (70, 140, 280, 560 or 1120)."""
    from PIL import Image

    if budget not in IMAGE_TOKEN_BUDGETS:
        raise UsageError(f"--image-tokens must be one of {', '.join(map(str, IMAGE_TOKEN_BUDGETS))} (got {budget})")
    img = to_rgb(img)
    w, h = img.size
    th, tw = target_size(h, w, budget, patch, pool)
    if (th, tw) != (h, w):
        img = img.resize((tw, th), resample=Image.Resampling.BICUBIC)
    pixels = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(th, tw, 3)  # [H, W, C]
    pixels = (pixels.double() * (1 / 255)).float()  # the reference rescales in float64, then stores float32
    ph, pw = th // patch, tw // patch
    # [H, W, C] -> [ph, patch, pw, patch, C] -> [ph, pw, patch, patch, C] -> [ph * pw, patch * patch * C]
    real = pixels.view(ph, patch, pw, patch, 3).permute(0, 2, 1, 3, 4).reshape(ph * pw, patch * patch * 3)
    ys, xs = torch.meshgrid(torch.arange(ph), torch.arange(pw), indexing="ij")
    positions = torch.stack([xs.reshape(-1), ys.reshape(-1)], dim=-1)  # [ph * pw, 2] as (x, y), row-major
    total = budget * pool * pool
    pixel_values = torch.zeros(total, patch * patch * 3, dtype=torch.float32)
    pixel_values[: ph * pw] = real
    position_ids = torch.full((total, 2), -1, dtype=torch.int64)
    position_ids[: ph * pw] = positions
    return Patches(pixel_values, position_ids, ph * pw // (pool * pool), (th, tw))


def load_patches(source: str | Path | bytes, budget: int = 280, patch: int = 16, pool: int = 3,
                 name: str | None = None) -> Patches:
    """open_image + patchify."""
    return patchify(open_image(source, name), budget, patch, pool)
