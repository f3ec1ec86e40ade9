"""The image processor against transformers' Gemma 4 image processor (its Pillow backend: the torchvision one needs
torchvision, which this environment lacks, and resizes with another filter), and bad image files.

Pixel values, position ids and soft-token counts must be identical, for tiny, square, wide, tall and
larger-than-the-budget images at every budget, and for modes that need converting (RGBA, palette, grayscale).
"""

import io
import struct
import zlib

import pytest
import torch
from PIL import Image

from dgemma_cli.errors import UsageError
from dgemma_cli.image import MAX_PIXELS, load_patches, open_image, patchify, target_size

BUDGETS = [70, 140, 280, 560, 1120]
SIZES = {  # (width, height)
    "tiny": (5, 7),
    "square": (300, 300),
    "wide_3_1": (900, 300),
    "tall_1_3": (200, 600),
    "over_budget": (2400, 1700),
    "sliver": (2000, 9),  # one side rounds to nothing
}


def random_image(w, h, mode="RGB", seed=0):
    g = torch.Generator().manual_seed(seed)
    bands = len(Image.new(mode, (1, 1)).getbands())
    data = torch.randint(0, 256, (h, w, bands), dtype=torch.uint8, generator=g)
    return Image.frombytes(mode, (w, h), bytes(data.flatten().tolist()))


@pytest.fixture(scope="module")
def reference():
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil()


def check_equal(ref_proc, img, budget):
    ref = ref_proc(images=[img], max_soft_tokens=budget, return_tensors="pt")
    ours = patchify(img, budget)
    assert ours.pixel_values.dtype == ref["pixel_values"].dtype == torch.float32
    assert torch.equal(ours.pixel_values, ref["pixel_values"][0])
    assert torch.equal(ours.position_ids, ref["image_position_ids"][0].long())
    assert ours.soft_tokens == int(ref["num_soft_tokens_per_image"][0])
    return ours


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("shape", list(SIZES))
def test_patches_equal_reference(reference, shape, budget):
    w, h = SIZES[shape]
    ours = check_equal(reference, random_image(w, h, seed=w + h), budget)
    th, tw = ours.size
    assert th % 48 == 0 and tw % 48 == 0
    assert (th // 16) * (tw // 16) <= budget * 9
    assert 0 < ours.soft_tokens <= budget
    real = (ours.position_ids[:, 0] >= 0).sum().item()
    assert real == ours.soft_tokens * 9 and (ours.pixel_values[real:] == 0).all()


@pytest.mark.parametrize("mode", ["RGBA", "P", "L", "LA"])
def test_converted_modes_equal_reference(reference, mode):
    img = random_image(130, 90, mode="RGB", seed=3).convert(mode)
    if mode == "RGBA":  # real transparency, composited onto white
        alpha = random_image(130, 90, mode="L", seed=4)
        img.putalpha(alpha)
    check_equal(reference, img, 70)


def test_target_size_matches_reference_arithmetic():
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        w, h = (int(v) for v in torch.randint(1, 5000, (2,), generator=g))
        for budget in BUDGETS:
            assert target_size(h, w, budget) == get_aspect_ratio_preserving_size(h, w, 16, budget * 9, 3)


def encoded(img, fmt, **kw):
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_reads_each_format_from_file_and_bytes(tmp_path, fmt):
    img = random_image(64, 40, seed=5)
    data = encoded(img, fmt)
    path = tmp_path / f"x.{fmt.lower()}"
    path.write_bytes(data)
    a, b = open_image(path), open_image(data)
    assert a.mode == "RGB" and a.size == (64, 40)
    assert a.tobytes() == b.tobytes()
    if fmt == "PNG":  # lossless: the very pixels
        assert a.tobytes() == img.tobytes()


def test_gif_first_frame(tmp_path):
    frames = [Image.new("RGB", (32, 32), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    img = open_image(buf.getvalue())
    assert img.getpixel((5, 5)) == (255, 0, 0)


def png_claiming(width, height):
    """A PNG whose header claims width x height, with a single tiny (wrong) data chunk."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 10)) + chunk(b"IEND", b"")


def one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg and msg
    return msg


def test_bad_inputs_are_one_line(tmp_path):
    with pytest.raises(UsageError) as e:
        open_image(tmp_path / "nope.png")
    assert "no such file" in one_line(e)
    with pytest.raises(UsageError) as e:
        open_image(tmp_path)
    assert "directory" in one_line(e)
    text = tmp_path / "notes.png"
    text.write_text("this is not an image\n")
    with pytest.raises(UsageError) as e:
        open_image(text)
    assert "not an image" in one_line(e)
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    with pytest.raises(UsageError) as e:
        open_image(empty)
    assert "empty" in one_line(e)
    bmp = encoded(random_image(8, 8), "BMP")  # a real image, but not one of the formats read
    with pytest.raises(UsageError) as e:
        open_image(bmp)
    assert "not an image dgemma reads" in one_line(e)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_truncated_image_refused(fmt):
    data = encoded(random_image(200, 150, seed=9), fmt)
    with pytest.raises(UsageError) as e:
        open_image(data[: len(data) // 2], name="cut")
    msg = one_line(e)
    assert msg.startswith("cut: ") and ("truncated" in msg or "corrupt" in msg)


@pytest.mark.parametrize("side", [9000, 100_000, 2**31 - 1])
def test_decompression_bomb_refused_before_decoding(side, monkeypatch):
    assert side * side > MAX_PIXELS
    decoded = []
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(self) or None)
    with pytest.raises(UsageError) as e:
        open_image(png_claiming(side, side), name="bomb.png")
    msg = one_line(e)
    assert msg.startswith("bomb.png: ") and "pixels" in msg
    assert not decoded  # refused from the header alone


def test_under_the_limit_the_data_is_decoded():
    with pytest.raises(UsageError) as e:  # a plausible size passes the header check; the short data does not
        open_image(png_claiming(40, 30), name="x.png")
    assert "truncated or corrupt" in one_line(e)
    data = encoded(random_image(300, 200), "PNG")
    assert load_patches(data, 70).soft_tokens > 0


def test_bad_budget_refused():
    with pytest.raises(UsageError) as e:
        patchify(random_image(10, 10), 100)
    assert "70, 140, 280, 560, 1120" in one_line(e)


@pytest.mark.parametrize("width, height, says", [
    (63_000_000, 1, "a side may have at most"),
    (16_385, 100, "a side may have at most"),
    (12_000, 6, "aspect ratio"),
    (6, 12_000, "aspect ratio"),
    (9_000, 8_000, "megapixels"),
])
def test_costly_pictures_are_refused_from_the_header(width, height, says):
    with pytest.raises(UsageError) as e:
        open_image(png_claiming(width, height))
    assert says in one_line(e)


def test_the_decoding_budget_counts_conversions():
    """RGB counts its own bytes; another mode adds the RGB copy; transparency the RGBA copies compositing makes."""
    from dgemma_cli.image import MAX_DECODE_BYTES, decode_bytes

    assert decode_bytes(Image.new("RGB", (100, 10))) == 100 * 10 * 3
    assert decode_bytes(Image.new("L", (100, 10))) == 100 * 10 * (1 + 3)
    assert decode_bytes(Image.new("RGBA", (100, 10))) == 100 * 10 * (4 + 3 + 12)
    assert decode_bytes(Image.new("1", (100, 10))) == 100 * 10 * (1 + 3)
    big = encoded(Image.new("RGBA", (7000, 7000)), "PNG")  # 49 MP: under the pixel cap, over the memory one
    assert 7000 * 7000 * 19 > MAX_DECODE_BYTES
    with pytest.raises(UsageError) as e:
        open_image(big)
    assert "MB to decode" in one_line(e)


def test_a_large_jpeg_is_decoded_reduced_and_a_small_one_whole():
    """A JPEG over four times the largest budget's size decodes at a DCT scale (nearly the same patches, a fraction
    of the memory); one within it decodes whole, so small pictures give the reference's very pixels."""
    small = random_image(640, 480)
    data = encoded(small, "JPEG")
    assert open_image(data).tobytes() == Image.open(io.BytesIO(data)).convert("RGB").tobytes()
    grad = Image.linear_gradient("L").resize((8000, 6000)).convert("RGB")  # smooth: DCT scaling loses little
    data = encoded(grad, "JPEG")
    reduced = open_image(data)
    assert reduced.size == (4000, 3000)  # scale 1/2: still over twice the 1120 budget's 1824 x 1344
    a = patchify(reduced, 1120).pixel_values
    b = patchify(Image.open(io.BytesIO(data)).convert("RGB"), 1120).pixel_values
    assert (a - b).abs().max() < 0.03


@pytest.mark.parametrize("orientation, size", [(1, (60, 40)), (3, (60, 40)), (6, (40, 60)), (8, (40, 60))])
def test_a_photo_stored_rotated_shows_as_taken(orientation, size):
    """EXIF orientation (a camera's rotation flag): the picture is turned as viewers turn it, before the processor
    sees it; the top-left pixel lands where that turn puts it."""
    img = Image.new("RGB", (60, 40), (0, 0, 255))
    img.putpixel((0, 0), (255, 0, 0))  # red marks the stored top-left corner
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    img.save(buf, "PNG", exif=exif.tobytes())
    out = open_image(buf.getvalue())
    assert out.size == size
    corner = {1: (0, 0), 3: (59, 39), 6: (39, 0), 8: (0, 59)}[orientation]
    assert out.getpixel(corner) == (255, 0, 0)
