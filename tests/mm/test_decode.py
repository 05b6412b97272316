"""decode_image against transformers' pipeline (`load_image`: `exif_transpose`, then
`convert("RGB")`; then the processors' `convert_to_rgb`) over generated images of every
supported format and every kind of transparency, plus the refusals: bombs, deep samples,
damage. probe_image must give the decoded size for every one of them, from the headers alone."""

from __future__ import annotations

import io
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from mmserve import _mm
from tests.support.images import png_bomb

from .images import (
    CHANNELS,
    TJSAMP,
    encode_bmp_rle,
    encode_gif,
    encode_png,
    orientation_exif,
    pipeline_image,
    pipeline_rgb,
    random_rle_ops,
    transparent_images,
    turbojpeg_encode,
)

RNG_SEED = 20260


@pytest.fixture(autouse=True)
def roomy_encoder_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """PIL's progressive JPEG encoder fails on noisy images with its default output block."""
    monkeypatch.setattr(ImageFile, "MAXBLOCK", 1 << 24)


_XMP_ROTATED = b'<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>'


def assert_same_as_pil(data: bytes) -> None:
    got = _mm.decode_image(data)
    ref = pipeline_rgb(data)
    assert got.dtype == np.uint8
    assert got.shape == ref.shape
    assert _mm.probe_image(data) == (ref.shape[1], ref.shape[0])
    diff = np.abs(got.astype(np.int16) - ref.astype(np.int16))
    assert diff.max() == 0, f"max abs diff {diff.max()}, {np.count_nonzero(diff)} samples differ"


def photo(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """Smooth gradients plus noise: exercises both the DC path and high frequencies."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width, 1), y * 255 / max(height, 1), (x * y) % 256], -1)
    return np.clip(base + rng.normal(0, 25, (height, width, 3)), 0, 255).astype(np.uint8)


def save(image: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


# ---------------------------------------------------------------------------------------------
# PNG


PNG_KINDS = [(0, 1), (0, 2), (0, 4), (0, 8), (2, 8), (3, 1), (3, 2), (3, 4), (3, 8), (4, 8), (6, 8)]


@pytest.mark.parametrize(("color_type", "bit_depth"), PNG_KINDS)
def test_png_matches_pil(color_type: int, bit_depth: int) -> None:
    rng = np.random.default_rng(RNG_SEED + color_type * 16 + bit_depth)
    for case in range(12):
        width, height = (int(v) for v in rng.integers(1, 48, 2))
        samples = rng.integers(0, 2**bit_depth, (height, width, CHANNELS[color_type]))
        palette = trns = None
        if color_type == 3:
            entries = 2**bit_depth if case % 3 else int(samples.max()) + 1  # short PLTE too
            palette = rng.integers(0, 256, entries * 3, dtype=np.uint8).tobytes()
            if case % 2:
                trns = rng.integers(0, 256, max(1, entries // 2), dtype=np.uint8).tobytes()
        elif color_type in (0, 2) and case % 4 == 1:
            trns = struct.pack(">" + "H" * CHANNELS[color_type], *samples[0, 0])
        data = encode_png(
            samples,
            color_type,
            bit_depth,
            palette=palette,
            trns=trns,
            gamma=0.45455 if case % 3 == 0 else None,
            interlace=case % 2 == 0,
        )
        assert_same_as_pil(data)


def test_png_indices_past_the_palette_match_pil() -> None:
    indices = np.arange(64).reshape(8, 8, 1)
    assert_same_as_pil(encode_png(indices, 3, 8, palette=bytes(range(10, 40))))


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "RGB", "RGBA"])
def test_png_written_by_pil(mode: str) -> None:
    rgb = Image.fromarray(photo(np.random.default_rng(RNG_SEED), 67, 45))
    image = rgb.convert(mode) if mode != "P" else rgb.quantize(200)
    assert_same_as_pil(save(image, "PNG", optimize=True))


@pytest.mark.parametrize(("color_type", "channels"), [(0, 1), (2, 3), (4, 2), (6, 4)])
def test_png_16_bit_matches_the_pipeline(color_type: int, channels: int) -> None:
    """PIL reads 16-bit color and gray + alpha by their high byte and clips 16-bit gray."""
    rng = np.random.default_rng(RNG_SEED + color_type)
    edges = np.array([0, 1, 255, 256, 300, 511, 32768, 65535])
    for width, height in [(8, 1), (17, 9)]:
        samples = rng.integers(0, 65536, (height, width, channels))
        samples[0, :8] = edges[:width, None]
        for interlace in (False, True):
            assert_same_as_pil(encode_png(samples, color_type, 16, interlace=interlace))
    assert_same_as_pil(save(Image.fromarray(np.full((4, 4), 40000, np.uint16)), "PNG"))


def test_every_kind_of_transparency_matches_the_pipeline() -> None:
    """Alpha is dropped; the colour PIL keeps as transparent (tRNS, a palette's one transparent
    entry, a GIF's transparent index) is painted white wherever it appears."""
    painted = 0
    for seed, (width, height) in enumerate([(1, 1), (9, 8), (31, 17), (64, 48)]):
        for name, data in transparent_images(np.random.default_rng(seed), width, height).items():
            try:
                assert_same_as_pil(data)
            except AssertionError as e:
                raise AssertionError(f"{name} {width}x{height}: {e}") from None
            loaded = np.asarray(pipeline_image(data))
            painted += int(np.count_nonzero(np.any(pipeline_rgb(data) != loaded, -1)))
    assert painted > 100, "the images must hold transparent colours the pipeline paints"


# ---------------------------------------------------------------------------------------------
# JPEG


JPEG_SIZES = [(1, 1), (17, 3), (3, 17), (64, 48), (333, 257)]


@pytest.mark.parametrize("subsampling", [0, 1, 2])
@pytest.mark.parametrize("progressive", [False, True])
def test_jpeg_matches_pil(subsampling: int, progressive: bool) -> None:
    rng = np.random.default_rng(RNG_SEED + subsampling)
    for i, quality in enumerate([10, 25, 50, 75, 90, 95, 100]):
        width, height = JPEG_SIZES[i % len(JPEG_SIZES)]
        image = Image.fromarray(photo(rng, width, height))
        options: dict[str, object] = {"quality": quality, "subsampling": subsampling}
        if progressive:
            options["progressive"] = True
        elif i % 2:
            options["restart_marker_blocks"] = 1 + i
        assert_same_as_pil(save(image, "JPEG", **options))


def test_jpeg_large_odd_size_matches_pil() -> None:
    image = Image.fromarray(photo(np.random.default_rng(RNG_SEED), 1001, 999))
    assert_same_as_pil(save(image, "JPEG", quality=90, subsampling=2))


@pytest.mark.parametrize("subsampling", sorted(TJSAMP))
def test_jpeg_every_libjpeg_subsampling_matches_pil(subsampling: str) -> None:
    rng = np.random.default_rng(RNG_SEED + len(subsampling))
    for quality, (width, height) in zip([20, 80, 98], [(37, 61), (1, 1), (129, 31)], strict=True):
        assert_same_as_pil(turbojpeg_encode(photo(rng, width, height), quality, subsampling))


def test_jpeg_grayscale_and_cmyk_match_pil() -> None:
    rng = np.random.default_rng(RNG_SEED)
    gray = Image.fromarray(photo(rng, 45, 29)[..., 1])
    assert_same_as_pil(save(gray, "JPEG", quality=85))
    cmyk = Image.fromarray(rng.integers(0, 256, (29, 45, 4), dtype=np.uint8), "CMYK")
    for quality in (60, 100):
        assert_same_as_pil(save(cmyk, "JPEG", quality=quality))


def test_cmyk_conversion_matches_pil_for_every_ink_and_black_level() -> None:
    # Channels convert independently, so all (ink, black) pairs cover the whole table.
    ink, black = np.meshgrid(np.arange(256), np.arange(256))
    cmyk = np.stack([ink, 255 - ink, ink // 2, black], -1).astype(np.uint8)
    assert_same_as_pil(save(Image.fromarray(cmyk, "CMYK"), "JPEG", quality=100, subsampling=0))


def test_jpeg_deeper_than_8_bits_is_refused() -> None:
    data = bytearray(save(Image.new("RGB", (16, 16), (10, 20, 30)), "JPEG"))
    precision_at = data.index(b"\xff\xc0") + 4  # SOF0: marker, length, then precision
    data[precision_at] = 12
    for read in (_mm.decode_image, _mm.probe_image):
        with pytest.raises(_mm.MediaError) as e:
            read(bytes(data))
        assert e.value.args[0] == "decode.unsupported_bit_depth"
        assert "12-bit" in e.value.args[1]


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_matches_exif_transpose(orientation: int) -> None:
    image = Image.fromarray(photo(np.random.default_rng(orientation), 13, 7))
    exif = Image.Exif()
    exif[0x0112] = orientation
    for fmt, options in [("JPEG", {"quality": 95}), ("PNG", {}), ("WEBP", {"lossless": True})]:
        data = save(image, fmt, exif=exif.tobytes(), **options)
        assert_same_as_pil(data)
    if orientation in (5, 6, 7, 8):
        assert _mm.decode_image(data).shape == (13, 7, 3)


def test_xmp_orientation_is_used_when_exif_has_none() -> None:
    image = Image.fromarray(photo(np.random.default_rng(3), 11, 5))
    xmp = b'<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>'
    data = save(image, "JPEG", xmp=xmp)
    assert_same_as_pil(data)
    assert _mm.decode_image(data).shape == (11, 5, 3)


# ---------------------------------------------------------------------------------------------
# WebP, GIF, BMP


@pytest.mark.parametrize("mode", ["RGB", "RGBA"])
def test_webp_lossless_and_lossy_match_pil(mode: str) -> None:
    rng = np.random.default_rng(RNG_SEED)
    for width, height in [(1, 1), (17, 3), (64, 48), (301, 199)]:
        image = Image.fromarray(photo(rng, width, height)).convert(mode)
        if mode == "RGBA":
            alpha = rng.integers(0, 256, (height, width), dtype=np.uint8)
            image.putalpha(Image.fromarray(alpha))
        assert_same_as_pil(save(image, "WEBP", lossless=True))
        for quality in (5, 50, 95):
            assert_same_as_pil(save(image, "WEBP", quality=quality))


def test_gif_first_frame_matches_pil() -> None:
    rng = np.random.default_rng(RNG_SEED)
    frames = [Image.fromarray(photo(rng, 41, 23)).quantize(64) for _ in range(3)]
    assert_same_as_pil(save(frames[0], "GIF", save_all=True, append_images=frames[1:]))
    gray = Image.fromarray(photo(rng, 19, 9)[..., 0])
    assert_same_as_pil(save(gray, "GIF"))
    with_transparency = frames[1].copy()
    with_transparency.info["transparency"] = 3
    assert_same_as_pil(save(with_transparency, "GIF", transparency=3, interlace=True))
    assert _mm.decode_image(save(frames[2], "GIF")).shape == (23, 41, 3)


GIF_CASES = {
    "frame inside the screen": ((20, 10), (3, 2, 9, 5), 16, None, None),
    "transparent index fills the canvas": ((20, 10), (3, 2, 9, 5), 16, None, 5),
    "frame overhangs the screen": ((8, 8), (4, 5, 9, 6), 16, None, None),
    "local table wins": ((9, 6), (0, 0, 9, 6), 16, 4, None),
    "indices past the table": ((9, 6), (0, 0, 9, 6), 4, None, None),
    "no color table at all": ((9, 6), (0, 0, 9, 6), 0, None, None),
}


@pytest.mark.parametrize("case", sorted(GIF_CASES))
def test_gif_canvas_rules_match_pil(case: str) -> None:
    screen, frame, global_entries, local_entries, transparent = GIF_CASES[case]
    rng = np.random.default_rng(len(case))

    def table(entries: int | None) -> bytes | None:
        return rng.integers(0, 256, entries * 3, dtype=np.uint8).tobytes() if entries else None

    indices = rng.integers(0, 256 if global_entries in (0, 4) else 16, (frame[3], frame[2]))
    data = encode_gif(
        screen,
        frame,
        indices,
        global_palette=table(global_entries),
        local_palette=table(local_entries),
        transparent=transparent,
    )
    assert_same_as_pil(data)


def test_gif_gray_ramp_table_reads_indices_as_levels_like_pil() -> None:
    ramp = bytes(i for i in range(4) for _ in range(3))
    indices = np.arange(54).reshape(6, 9)
    assert_same_as_pil(encode_gif((9, 6), (0, 0, 9, 6), indices, global_palette=ramp))


@pytest.mark.parametrize("mode", ["1", "L", "P", "RGB", "RGBA"])
def test_bmp_written_by_pil_matches(mode: str) -> None:
    rgb = Image.fromarray(photo(np.random.default_rng(RNG_SEED), 37, 21))
    image = rgb.quantize(16) if mode == "P" else rgb.convert(mode)
    assert_same_as_pil(save(image, "BMP"))


def bmp_v3(
    width: int,
    height: int,
    bpp: int,
    pixel_rows: bytes,
    masks: tuple[int, ...] = (),
    palette: bytes = b"",
) -> bytes:
    """A BITMAPINFOHEADER BMP, with BI_BITFIELDS masks or a BGRX palette (negative height =
    top-down)."""
    compression = 3 if masks else 0
    colors = len(palette) // 4
    header = struct.pack("<IiiHHIIiiII", 40, width, height, 1, bpp, compression, 0, 0, 0, colors, 0)
    tables = struct.pack("<" + "I" * len(masks), *masks) + palette
    offset = 14 + len(header) + len(tables)
    size = offset + len(pixel_rows)
    return b"BM" + struct.pack("<IHHI", size, 0, 0, offset) + header + tables + pixel_rows


def test_bmp_indices_past_a_short_palette_match_pil() -> None:
    indices = bytes(range(0, 256, 8))  # 8 x 4 pixels, most of them past 16 entries
    gray_ramp = b"".join(bytes([i, i, i, 0]) for i in range(16))
    colored = b"".join(bytes([i, 2 * i, 3 * i, 0]) for i in range(16))
    for palette in (gray_ramp, colored):
        assert_same_as_pil(bmp_v3(8, 4, 8, indices, palette=palette))


@pytest.mark.parametrize(
    ("bpp", "masks"),
    [
        (16, ()),
        (16, (0xF800, 0x07E0, 0x001F)),
        (16, (0x7C00, 0x03E0, 0x001F)),
        (32, (0xFF0000, 0xFF00, 0xFF)),
        (32, (0xFF000000, 0xFF0000, 0xFF00)),
        (32, (0xFF000000, 0xFF00, 0xFF)),
        (32, (0, 0, 0)),
        (24, (0xFF0000, 0xFF00, 0xFF)),
    ],
)
@pytest.mark.parametrize("top_down", [False, True])
def test_bmp_bit_fields_match_pil(bpp: int, masks: tuple[int, ...], top_down: bool) -> None:
    rng = np.random.default_rng(bpp + len(masks))
    width, height = 7, 5
    stride = (width * bpp + 31) // 32 * 4
    rows = rng.integers(0, 256, stride * height, dtype=np.uint8).tobytes()
    assert_same_as_pil(bmp_v3(width, -height if top_down else height, bpp, rows, masks))


@pytest.mark.parametrize("four_bit", [False, True])
def test_bmp_rle_matches_pil_including_its_refusals(four_bit: bool) -> None:
    outcomes = set()
    for seed in range(80):
        rng = np.random.default_rng(seed)
        width, height = (int(v) for v in rng.integers(1, 30, 2))
        palette = rng.integers(0, 256, (16 if four_bit else 256) * 4, np.uint8).tobytes()
        ops = random_rle_ops(rng, width, height, four_bit, complete=seed % 5 != 0)
        data = encode_bmp_rle(width, height if seed % 3 else -height, four_bit, ops, palette)
        try:
            reference = pipeline_rgb(data)
        except (OSError, ValueError):
            with pytest.raises(_mm.MediaError):
                _mm.decode_image(data)
            outcomes.add("refused")
            continue
        np.testing.assert_array_equal(_mm.decode_image(data), reference)
        outcomes.add("decoded")
    assert outcomes == {"refused", "decoded"}


# ---------------------------------------------------------------------------------------------
# Refusals


def test_decompression_bomb_header_fails_fast_without_allocating() -> None:
    bomb = png_bomb(100_000, 100_000)
    assert len(bomb) < 60
    started = time.perf_counter()
    for read in (_mm.decode_image, _mm.probe_image):
        with pytest.raises(_mm.MediaError) as e:
            read(bomb)
        # 30 GB would be refused as out of memory, not as over the limit, had it been allocated.
        assert e.value.args[0] == "decode.too_many_pixels"
        assert "100000x100000" in e.value.args[1]
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_pixel_limit_applies_to_every_format(fmt: str) -> None:
    data = save(Image.new("RGB", (40, 25), (9, 99, 199)), fmt)
    assert _mm.decode_image(data, max_pixels=1000).shape == (25, 40, 3)
    assert _mm.probe_image(data, max_pixels=1000) == (40, 25)
    for read in (_mm.decode_image, _mm.probe_image):
        with pytest.raises(_mm.MediaError) as e:
            read(data, max_pixels=999)
        assert e.value.args[0] == "decode.too_many_pixels"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_truncated_and_corrupt_files_are_errors_not_crashes(fmt: str) -> None:
    rng = np.random.default_rng(RNG_SEED)
    image = Image.fromarray(photo(rng, 64, 40))
    data = save(image.quantize(64) if fmt == "GIF" else image, fmt)
    for cut in [4, 16, 40, len(data) // 2, len(data) - 30]:
        with pytest.raises(_mm.MediaError) as e:
            _mm.decode_image(data[:cut])
        assert e.value.args[0] in ("decode.corrupt", "decode.unknown_format"), cut
    for _ in range(40):
        damaged = bytearray(data)
        for at in rng.integers(0, len(data), 8):
            damaged[at] = int(rng.integers(0, 256))
        try:
            out = _mm.decode_image(bytes(damaged))
        except _mm.MediaError as e:
            assert e.args[0].startswith("decode."), e.args
        else:
            assert out.ndim == 3 and out.shape[2] == 3


def test_unknown_format_is_named() -> None:
    for read in (_mm.decode_image, _mm.probe_image):
        with pytest.raises(_mm.MediaError) as e:
            read(b"<svg xmlns='http://www.w3.org/2000/svg'/>")
        assert e.value.args[0] == "decode.unknown_format"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_probe_reads_headers_only(fmt: str) -> None:
    """A body cut after its headers still probes to its size; decoding refuses it."""
    image = Image.fromarray(photo(np.random.default_rng(RNG_SEED), 64, 40))
    data = save(image.quantize(64) if fmt == "GIF" else image, fmt)
    cut = data[: len(data) * 3 // 4]
    assert _mm.probe_image(cut) == (64, 40)
    with pytest.raises(_mm.MediaError):
        _mm.decode_image(cut)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def with_chunk_before_iend(png: bytes, chunk: bytes) -> bytes:
    iend = png.rindex(b"IEND") - 4
    return png[:iend] + chunk + png[iend:]


@pytest.mark.parametrize(
    "chunk",
    [
        # eXIf after the image data (PIL and the decoder read it there too).
        png_chunk(b"eXIf", orientation_exif(6)),
        # XMP in an uncompressed and in a compressed iTXt chunk.
        png_chunk(b"iTXt", b"XML:com.adobe.xmp\0\0\0\0\0" + _XMP_ROTATED),
        png_chunk(b"iTXt", b"XML:com.adobe.xmp\0\1\0\0\0" + zlib.compress(_XMP_ROTATED)),
    ],
    ids=["exif-after-idat", "xmp", "compressed-xmp"],
)
def test_png_orientation_anywhere_in_the_file(chunk: bytes) -> None:
    image = Image.fromarray(photo(np.random.default_rng(5), 13, 7))
    data = with_chunk_before_iend(save(image, "PNG"), chunk)
    assert_same_as_pil(data)
    assert _mm.probe_image(data) == (7, 13)


def test_output_array_owns_its_rust_buffer() -> None:
    data = save(Image.new("RGB", (5, 3), (1, 2, 3)), "PNG")
    out = _mm.decode_image(data)
    assert out.flags.c_contiguous and out.flags.writeable
    assert out.tolist() == [[[1, 2, 3]] * 5] * 3
