"""Encoders for test images that PIL cannot write: PNGs of every color type and bit depth,
interlaced or with gAMA, and JPEGs with libjpeg-turbo's own subsamplings (4:4:0, 4:1:1)."""

from __future__ import annotations

import ctypes
import ctypes.util
import struct
import zlib

import numpy as np

# (x0, y0, dx, dy) of the seven Adam7 passes.
ADAM7 = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2)]
ADAM7.append((0, 1, 1, 2))
CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


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
    chunks = [_chunk(b"IHDR", ihdr)]
    if gamma is not None:
        chunks.append(_chunk(b"gAMA", struct.pack(">I", round(gamma * 100000))))
    if palette is not None:
        chunks.append(_chunk(b"PLTE", palette))
    if trns is not None:
        chunks.append(_chunk(b"tRNS", trns))
    if exif is not None:
        chunks.append(_chunk(b"eXIf", exif))
    if interlace:
        raw = b"".join(
            _filtered_rows(samples[y0::dy, x0::dx], bit_depth)
            for x0, y0, dx, dy in ADAM7
            if samples[y0::dy, x0::dx].size
        )
    else:
        raw = _filtered_rows(samples, bit_depth)
    chunks.append(_chunk(b"IDAT", zlib.compress(raw)))
    chunks.append(_chunk(b"IEND", b""))
    return b"\x89PNG\r\n\x1a\n" + b"".join(chunks)


def png_header_only(width: int, height: int) -> bytes:
    """Signature + IHDR + IEND: a ~45-byte file announcing width x height RGB pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IEND", b"")


# libjpeg-turbo's TurboJPEG API, for subsamplings PIL's encoder does not offer.
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
