"""Encoders for test images that PIL cannot write: PNGs of every color type and bit depth,
interlaced or with gAMA, and JPEGs with libjpeg-turbo's own subsamplings (4:4:0, 4:1:1); images
with transparency of every kind; and the reference reading of an image: transformers' pipeline."""

from __future__ import annotations

import base64
import ctypes
import ctypes.util
import struct
import warnings
import zlib

import numpy as np
from PIL import Image
from transformers.image_transforms import convert_to_rgb
from transformers.image_utils import load_image

from tests.support.images import encoded, png_chunk

# (x0, y0, dx, dy) of the seven Adam7 passes.
ADAM7 = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2)]
ADAM7.append((0, 1, 1, 2))
CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    if pa <= pb and pa <= pc:
        return a
    return b if pb <= pc else c


def _filtered_rows(samples: np.ndarray, bit_depth: int) -> bytes:
    """Packs rows of samples (h, w, channels) and filters row y with filter type y % 5."""
    h, w, ch = samples.shape
    bpp = max(1, ch * bit_depth // 8)
    out = bytearray()
    prev = bytes(((w * ch * bit_depth) + 7) // 8)
    for y in range(h):
        flat = samples[y].reshape(-1)
        if bit_depth == 16:
            row = flat.astype(">u2").tobytes()
        elif bit_depth == 8:
            row = flat.astype(np.uint8).tobytes()
        else:
            row = np.packbits(
                np.unpackbits(flat.astype(np.uint8)[:, None], axis=1)[:, 8 - bit_depth :]
            ).tobytes()
        kind = y % 5
        filtered = bytearray(len(row))
        for i, x in enumerate(row):
            a = row[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            predictor = [0, a, b, (a + b) // 2, _paeth(a, b, c)][kind]
            filtered[i] = (x - predictor) & 0xFF
        out += bytes([kind]) + filtered
        prev = row
    return bytes(out)


def encode_png(
    samples: np.ndarray,
    color_type: int,
    bit_depth: int = 8,
    *,
    palette: bytes | None = None,
    trns: bytes | None = None,
    gamma: float | None = None,
    interlace: bool = False,
    exif: bytes | None = None,
) -> bytes:
    """A PNG of `samples` (h, w, channels), each sample already in 0..2**bit_depth-1."""
    h, w, _ = samples.shape
    ihdr = struct.pack(">IIBBBBB", w, h, bit_depth, color_type, 0, 0, int(interlace))
    chunks = [png_chunk(b"IHDR", ihdr)]
    if gamma is not None:
        chunks.append(png_chunk(b"gAMA", struct.pack(">I", round(gamma * 100000))))
    if palette is not None:
        chunks.append(png_chunk(b"PLTE", palette))
    if trns is not None:
        chunks.append(png_chunk(b"tRNS", trns))
    if exif is not None:
        chunks.append(png_chunk(b"eXIf", exif))
    if interlace:
        raw = b"".join(
            _filtered_rows(samples[y0::dy, x0::dx], bit_depth)
            for x0, y0, dx, dy in ADAM7
            if samples[y0::dy, x0::dx].size
        )
    else:
        raw = _filtered_rows(samples, bit_depth)
    chunks.append(png_chunk(b"IDAT", zlib.compress(raw)))
    chunks.append(png_chunk(b"IEND", b""))
    return b"\x89PNG\r\n\x1a\n" + b"".join(chunks)


TJSAMP = {"4:4:4": 0, "4:2:2": 1, "4:2:0": 2, "gray": 3, "4:4:0": 4, "4:1:1": 5}
_TJPF_RGB, _TJPF_GRAY = 0, 6


def _turbojpeg() -> ctypes.CDLL:
    name = ctypes.util.find_library("turbojpeg") or "libturbojpeg.so.0"
    lib = ctypes.CDLL(name)
    lib.tjInitCompress.restype = ctypes.c_void_p
    lib.tjCompress2.argtypes = [
        ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_ulong),
        ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    lib.tjFree.argtypes = [ctypes.c_void_p]
    lib.tjDestroy.argtypes = [ctypes.c_void_p]
    return lib


def turbojpeg_encode(rgb: np.ndarray, quality: int, subsampling: str) -> bytes:
    lib = _turbojpeg()
    handle = lib.tjInitCompress()
    gray = subsampling == "gray"
    pixels = np.ascontiguousarray(rgb[..., 0] if gray else rgb, dtype=np.uint8)
    h, w = pixels.shape[:2]
    buf, size = ctypes.c_void_p(), ctypes.c_ulong(0)
    try:
        rc = lib.tjCompress2(
            handle, pixels.tobytes(), w, 0, h, _TJPF_GRAY if gray else _TJPF_RGB,
            ctypes.byref(buf), ctypes.byref(size), TJSAMP[subsampling], quality, 0,
        )  # fmt: skip
        assert rc == 0, "tjCompress2 failed"
        return ctypes.string_at(buf, size.value)
    finally:
        lib.tjFree(buf)
        lib.tjDestroy(handle)


def _lzw_literals(indices: bytes) -> bytes:
    """GIF LZW data (minimum code size 8) that codes every index as a literal, with a clear
    code often enough that the code size stays at 9 bits."""
    clear, end = 256, 257
    codes = [clear]
    for i, index in enumerate(indices):
        if i and i % 250 == 0:
            codes.append(clear)
        codes.append(index)
    codes.append(end)
    bits = 0
    nbits = 0
    out = bytearray()
    for code in codes:
        bits |= code << nbits
        nbits += 9
        while nbits >= 8:
            out.append(bits & 0xFF)
            bits >>= 8
            nbits -= 8
    if nbits:
        out.append(bits & 0xFF)
    blocks = b"".join(
        bytes([len(out[i : i + 255])]) + out[i : i + 255] for i in range(0, len(out), 255)
    )
    return b"\x08" + blocks + b"\x00"


def encode_gif(
    screen: tuple[int, int],
    frame: tuple[int, int, int, int],
    indices: np.ndarray,
    *,
    global_palette: bytes | None,
    local_palette: bytes | None = None,
    transparent: int | None = None,
    background: int = 0,
) -> bytes:
    """A one-frame GIF: `frame` is (left, top, width, height); palettes hold 2**n RGB entries."""

    def table_bits(palette: bytes) -> int:
        return (len(palette) // 3).bit_length() - 2

    flags = 0x80 | table_bits(global_palette) if global_palette else 0
    out = b"GIF89a" + struct.pack("<HHBBB", *screen, flags, background, 0)
    out += global_palette or b""
    if transparent is not None:
        out += b"\x21\xf9\x04\x01\x00\x00" + bytes([transparent]) + b"\x00"
    left, top, width, height = frame
    local_flags = 0x80 | table_bits(local_palette) if local_palette else 0
    out += b"\x2c" + struct.pack("<HHHHB", left, top, width, height, local_flags)
    out += local_palette or b""
    out += _lzw_literals(indices.astype(np.uint8).tobytes())
    return out + b"\x3b"


def random_rle_ops(
    rng: np.random.Generator, width: int, height: int, four_bit: bool, complete: bool
) -> bytes:
    """A random BMP RLE stream: encoded runs (some overlong), absolute runs, end of line and
    delta escapes; `complete` appends enough full rows to set every pixel, then end of bitmap."""
    out = bytearray()
    for _ in range(int(rng.integers(1, 3 * height + 2))):
        op = int(rng.integers(0, 10))
        if op < 5:
            out += bytes([int(rng.integers(1, 2 * width + 2)), int(rng.integers(0, 256))])
        elif op < 7:
            n = int(rng.integers(3, 40))
            literal = rng.integers(0, 256, (n + 1) // 2 if four_bit else n, np.uint8)
            out += bytes([0, n]) + literal.tobytes()
            out += b"\0" * (len(out) % 2)
        elif op < 9:
            out += b"\0\0"
        else:
            out += bytes([0, 2, int(rng.integers(0, 5)), int(rng.integers(0, 2))])
    if complete:
        out += bytes([min(width, 255), 7, 0, 0]) * height
    return bytes(out + b"\0\1")


def encode_bmp_rle(width: int, height: int, four_bit: bool, data: bytes, palette: bytes) -> bytes:
    """A BITMAPINFOHEADER BMP with RLE4 / RLE8 data and a BGRX palette."""
    header = struct.pack(
        "<IiiHHIIiiII",
        40, width, height, 1, 4 if four_bit else 8, 2 if four_bit else 1,
        len(data), 0, 0, len(palette) // 4, 0,
    )  # fmt: skip
    offset = 14 + len(header) + len(palette)
    return b"BM" + struct.pack("<IHHI", offset + len(data), 0, 0, offset) + header + palette + data


def pipeline_image(data: bytes) -> Image.Image:
    """The image as transformers' pipeline loads encoded bytes: `load_image` (exif_transpose,
    then `convert("RGB")`), which the processors receive."""
    with warnings.catch_warnings():
        # PIL warns when a palette with per-entry alpha is converted to RGB.
        warnings.simplefilter("ignore")
        return load_image(base64.b64encode(data).decode())


def pipeline_rgb(data: bytes) -> np.ndarray:
    """The RGB the image processors work on: `pipeline_image`, then their `convert_to_rgb`
    (which paints the colour PIL keeps as transparent white)."""
    return np.asarray(convert_to_rgb(pipeline_image(data), return_numpy=True))


def orientation_exif(value: int) -> bytes:
    """The body of an eXIf chunk holding only the Orientation tag."""
    exif = Image.Exif()
    exif[0x0112] = value
    return exif.tobytes()[len(b"Exif\0\0") :]


def transparent_images(rng: np.random.Generator, width: int, height: int) -> dict[str, bytes]:
    """One image of each kind of transparency, `width` x `height` (GIFs on a larger screen):
    alpha channels partial, full and none, tRNS colours and palette entries (one transparent
    entry, per-entry alphas, PIL's quirks), 16-bit samples, GIF and WebP alpha."""
    h, w = height, width
    rgb = rng.integers(0, 256, (h, w, 3))
    rgb[: h // 2] //= 64  # few distinct colours, so tRNS colours repeat
    alpha = rng.integers(0, 256, (h, w, 1))
    gray = rng.integers(0, 256, (h, w, 1))
    indices = rng.integers(0, 16, (h, w, 1))
    palette = rng.integers(0, 256, 16 * 3, dtype=np.uint8).tobytes()
    duplicated = palette[:9] + palette[:3] + palette[12:]  # entry 3 is entry 0's colour
    wide_rgb = rng.integers(0, 65536, (h, w, 3))
    wide_rgb[0, 0] = [0, 256, 511]  # high bytes (0, 1, 1): the tRNS below names them
    rgba8 = np.concatenate([rgb, alpha], -1).astype(np.uint8)
    clear = rgba8.copy()
    clear[..., 3] = 0
    trns_gray = struct.pack(">H", int(gray[0, 0, 0]))
    trns_rgb = struct.pack(">HHH", *(int(v) for v in rgb[0, 0]))
    quantized = Image.fromarray(rgb.astype(np.uint8)).quantize(12)
    gif_indices = indices[..., 0]
    return {
        "rgba partial alpha": encode_png(np.concatenate([rgb, alpha], -1), 6),
        "rgba fully transparent": encode_png(clear, 6),
        "la partial alpha": encode_png(np.concatenate([gray, alpha], -1), 4),
        "la fully transparent": encode_png(np.concatenate([gray, 0 * alpha], -1), 4),
        "palette one transparent entry": encode_png(indices, 3, palette=palette, trns=b"\xff\0"),
        "palette transparent entry shared": encode_png(indices, 3, palette=duplicated, trns=b"\0"),
        "palette per-entry alpha": encode_png(indices, 3, palette=palette, trns=b"\x80\xff\0"),
        "palette alpha ends in newline": encode_png(indices, 3, palette=palette, trns=b"\0\n"),
        "palette all opaque trns": encode_png(indices, 3, palette=palette, trns=b"\xff\xff"),
        "palette transparent past palette": encode_png(
            indices, 3, palette=palette[:12], trns=b"\xff" * 9 + b"\0"
        ),
        "palette 4-bit transparent": encode_png(indices, 3, 4, palette=palette, trns=b"\xff\0"),
        "palette written by pil": encoded(quantized, "PNG", transparency=5),
        "gray trns": encode_png(gray, 0, trns=trns_gray),
        "gray trns over 8 bits": encode_png(gray, 0, trns=struct.pack(">H", 256 + 7)),
        "gray 1-bit trns black": encode_png(indices % 2, 0, 1, trns=b"\0\0"),
        "gray 1-bit trns white": encode_png(indices % 2, 0, 1, trns=b"\0\1"),
        "gray 2-bit trns zero": encode_png(indices % 4, 0, 2, trns=b"\0\0"),
        "rgb trns": encode_png(rgb, 2, trns=trns_rgb),
        "rgb trns over 8 bits": encode_png(rgb, 2, trns=struct.pack(">HHH", 256, 0, 0)),
        "rgb trns interlaced": encode_png(rgb, 2, trns=trns_rgb, interlace=True),
        "rgb trns rotated": encode_png(rgb, 2, trns=trns_rgb, exif=orientation_exif(6)),
        "rgba 16-bit": encode_png(rng.integers(0, 65536, (h, w, 4)), 6, 16),
        "la 16-bit": encode_png(rng.integers(0, 65536, (h, w, 2)), 4, 16),
        "rgb 16-bit trns": encode_png(wide_rgb, 2, 16, trns=struct.pack(">HHH", 0, 1, 1)),
        "gray 16-bit trns": encode_png(
            rng.integers(0, 600, (h, w, 1)), 0, 16, trns=struct.pack(">H", 255)
        ),
        "gray 16-bit trns zero": encode_png(
            rng.integers(0, 3, (h, w, 1)) * 200, 0, 16, trns=b"\0\0"
        ),
        "gray 16-bit trns low byte zero": encode_png(
            rng.integers(0, 3, (h, w, 1)) * 200, 0, 16, trns=struct.pack(">H", 512)
        ),
        "rgb 16-bit trns low bytes": encode_png(
            wide_rgb, 2, 16, trns=struct.pack(">HHH", 256, 257, 257)
        ),
        "gif transparent index": encode_gif(
            (w, h), (0, 0, w, h), gif_indices, global_palette=palette, transparent=3
        ),
        "gif transparent canvas": encode_gif(
            (w + 5, h + 2), (2, 1, w, h), gif_indices, global_palette=palette, transparent=7
        ),
        "gif transparent gray": encode_gif(
            (w, h), (0, 0, w, h), gif_indices, global_palette=None, transparent=4
        ),
        "gif written by pil": encoded(quantized, "GIF", transparency=2),
        "webp lossless alpha": encoded(Image.fromarray(rgba8, "RGBA"), "WEBP", lossless=True),
        "webp lossy alpha": encoded(Image.fromarray(rgba8, "RGBA"), "WEBP", quality=70),
        "webp fully transparent": encoded(
            Image.fromarray(clear, "RGBA"), "WEBP", lossless=True, exact=True
        ),
        "bmp rgba": encoded(Image.fromarray(rgba8, "RGBA"), "BMP"),
    }
