"""Pad values against hand-computed values and SGLang's formulas."""

from __future__ import annotations

import hashlib
import random

import numpy as np

from mmserve.kv.pad import (
    PadScheme,
    pad_value,
    pad_values,
    routing_pad_run,
    routing_pad_values,
)


def sglang_wide_pad_values(mm_hash: int) -> tuple[int, ...]:
    """SGLang 0.5.23's `_compute_pad_values(self.hash.to_bytes(8, byteorder="big"))`
    (sglang/srt/managers/schedule_batch.py), with its constants inlined:

        digest = hashlib.sha256(_MM_WIDE_PAD_TAG + identity).digest()
        return tuple(
            MM_PAD_SHIFT_VALUE
            + (int.from_bytes(digest[i : i + 8], byteorder="big") & _MM_WIDE_PAD_MASK)
            for i in range(0, _MM_IDENTITY_BYTES, 8)
        )
    """
    identity = mm_hash.to_bytes(8, byteorder="big")
    digest = hashlib.sha256(b"sglang-mm-wide-pad-v1" + identity).digest()
    return tuple(
        1_000_000 + (int.from_bytes(digest[i : i + 8], byteorder="big") & ((1 << 62) - 1))
        for i in range(0, 32, 8)
    )


def sglang_015_pad_value(mm_hash: int) -> int:
    """SGLang 0.5.15's `_compute_pad_value`: `MM_PAD_SHIFT_VALUE + (hash % (1 << 30))`."""
    return 1_000_000 + (mm_hash % (1 << 30))


def test_dynamo_pad_value_by_hand() -> None:
    # 0x9ABC_DEF0 & 0x3FFF_FFFF = 0x1ABC_DEF0 = 448_585_456, plus the 1_000_000 shift.
    assert pad_value(0x1234_5678_9ABC_DEF0) == 449_585_456
    assert pad_value(0) == 1_000_000
    assert pad_value(2**64 - 1) == 1_000_000 + 2**30 - 1


def test_dynamo_matches_sglang_015_formula() -> None:
    rng = random.Random(7)
    for mm_hash in [rng.randrange(2**64) for _ in range(500)]:
        assert pad_values(mm_hash) == (sglang_015_pad_value(mm_hash),)


def test_wide_matches_sglang_023_formula() -> None:
    rng = random.Random(8)
    for mm_hash in [0, 1, 2**64 - 1, *(rng.randrange(2**64) for _ in range(500))]:
        values = pad_values(mm_hash, PadScheme.SGLANG_WIDE)
        assert values == sglang_wide_pad_values(mm_hash)
        assert pad_value(mm_hash, PadScheme.SGLANG_WIDE) == values[0]
        assert all(1_000_000 <= v < 2**63 for v in values)


def test_wide_first_sentinel_by_hand() -> None:
    digest = hashlib.sha256(b"sglang-mm-wide-pad-v1" + bytes.fromhex("00000000deadbeef")).digest()
    first_word = int(digest[:8].hex(), 16)
    assert pad_value(0xDEADBEEF, PadScheme.SGLANG_WIDE) == 1_000_000 + first_word % 2**62


def test_routing_values_fit_u32_and_stay_above_the_vocabulary() -> None:
    for mm_hash in (0, 0xDEADBEEF, 2**64 - 1):
        assert routing_pad_values(mm_hash) == pad_values(mm_hash)
        wide = routing_pad_values(mm_hash, PadScheme.SGLANG_WIDE)
        engine = pad_values(mm_hash, PadScheme.SGLANG_WIDE)
        assert wide == tuple(1_000_000 + (v - 1_000_000) % 2**30 for v in engine)
        assert all(1_000_000 <= v < 2**32 for v in wide)


def test_wide_run_cycles_the_four_sentinels() -> None:
    values = routing_pad_values(42, PadScheme.SGLANG_WIDE)
    run = routing_pad_run(42, 10, PadScheme.SGLANG_WIDE)
    assert run.dtype == np.uint32
    assert run.tolist() == [*values, *values, *values[:2]]
    assert routing_pad_run(42, 3).tolist() == [pad_value(42)] * 3
