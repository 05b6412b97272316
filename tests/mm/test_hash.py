"""content_hash equals blake3 of the raw bytes, first 8 digest bytes as little-endian u64; the
identities built on it are the ones items had before the core made them all (the folds
themselves: `rust/mmserve-mm/src/identity.rs`)."""

from __future__ import annotations

import blake3
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve import _mm


def reference_hash(data: bytes) -> int:
    return int.from_bytes(blake3.blake3(data).digest()[:8], "little")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000))
def test_matches_the_blake3_package(data: bytes) -> None:
    assert _mm.content_hash(data) == reference_hash(data)


def test_large_input_and_range() -> None:
    # Crosses blake3's chunk and SIMD boundaries.
    for size in [0, 1, 1023, 1024, 1025, 1 << 16, (1 << 20) + 7]:
        data = bytes((i * 31) & 0xFF for i in range(size))
        value = _mm.content_hash(data)
        assert value == reference_hash(data)
        assert 0 <= value < 2**64


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(["float32", "float16", "bfloat16"]),
    st.integers(1, 6),
    st.integers(1, 6),
    st.tuples(st.integers(1, 4), st.integers(1, 64), st.integers(1, 64)),
    st.integers(0, 2**31),
)
def test_an_embedding_identity_is_the_one_python_folded(
    dtype: str, rows: int, width: int, grid: tuple[int, int, int], seed: int
) -> None:
    """The identity of precomputed embeddings, as the frontend folded it before the core did:
    blake3 of a header of dtype, shape and grid, then the raw values."""
    tensor = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    tensor = tensor.to(getattr(torch, dtype))
    raw = tensor.view(torch.uint8).reshape(-1).numpy()
    header = f"image_embeds:{tensor.dtype!s}:{list(tensor.shape)}:{list(grid)}:".encode()
    identity = _mm.embeddings_identity(dtype, list(tensor.shape), grid, raw)
    assert identity == reference_hash(header + raw.tobytes())
