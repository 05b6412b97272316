"""content_hash equals blake3 of the raw bytes, first 8 digest bytes as little-endian u64."""

from __future__ import annotations

import blake3
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
