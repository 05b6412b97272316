"""Block hashes against Dynamo's own implementation (ai-dynamo-runtime) and by hand."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
import xxhash
from dynamo.llm import compute_block_hash_for_seq

from mmserve.kv.hashing import (
    compute_block_hashes,
    compute_block_hashes_with_spans,
    compute_seq_hashes,
)

BLOCK_HASH_SEED = 1337


def dynamo_mm_infos(block_mm_infos: list[list[int]]) -> list[dict | None]:
    """Our per-block mm_hash lists in the dict shape Dynamo's Python binding takes."""
    return [
        {"mm_objects": [{"mm_hash": h, "offsets": []} for h in hashes]} if hashes else None
        for hashes in block_mm_infos
    ]


def random_case(rng: random.Random) -> tuple[list[int], int, list[list[int]], str | None]:
    block_size = rng.choice([1, 4, 16, 32, 64])
    tokens = [rng.randrange(0, 2**32) for _ in range(rng.randrange(0, 9 * block_size))]
    num_blocks = (len(tokens) + block_size - 1) // block_size
    mm = [
        [rng.randrange(0, 2**64) for _ in range(rng.choice([0, 0, 1, 2, 3]))]
        for _ in range(num_blocks)
    ]
    lora = rng.choice([None, "adapter-a", "ünïcode-lora", ""])  # "" means no adapter
    return tokens, block_size, mm, lora


def test_hand_computed_single_block() -> None:
    tokens = list(range(16))
    expected = xxhash.xxh3_64_intdigest(struct.pack("<16I", *tokens), seed=1337)
    assert compute_block_hashes(tokens) == [expected]


def test_partial_tail_block_is_not_hashed() -> None:
    assert len(compute_block_hashes(list(range(47)), block_size=16)) == 2
    assert compute_block_hashes(list(range(15)), block_size=16) == []


def test_mm_hashes_are_sorted_and_appended() -> None:
    tokens = list(range(16))
    expected = xxhash.xxh3_64_intdigest(
        struct.pack("<16I", *tokens) + struct.pack("<2Q", 3, 5), seed=1337
    )
    assert compute_block_hashes(tokens, block_mm_infos=[[5, 3]]) == [expected]


def test_lora_shifts_the_seed_with_wrapping_add() -> None:
    lora_part = xxhash.xxh3_64_intdigest(b"adapter", seed=0)
    tokens = list(range(16))
    expected = xxhash.xxh3_64_intdigest(
        struct.pack("<16I", *tokens), seed=(1337 + lora_part) % 2**64
    )
    assert compute_block_hashes(tokens, lora_name="adapter") == [expected]
    # An empty name is no adapter, as in Dynamo.
    assert compute_block_hashes(tokens, lora_name="") == compute_block_hashes(tokens)


@pytest.mark.parametrize("seed", range(4))
def test_parity_with_dynamo_on_random_sequences(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(100):
        tokens, block_size, mm, lora = random_case(rng)
        ours_plain = compute_block_hashes(tokens, block_size)
        assert ours_plain == compute_block_hash_for_seq(tokens, block_size)
        ours = compute_block_hashes(tokens, block_size, block_mm_infos=mm, lora_name=lora)
        theirs = compute_block_hash_for_seq(tokens, block_size, dynamo_mm_infos(mm), lora)
        assert ours == theirs


def test_spans_attach_to_every_block_they_overlap() -> None:
    tokens = list(range(64))
    # Media at [10, 40) overlaps blocks 0, 1 and 2 of 16 tokens; block 3 has none.
    by_span = compute_block_hashes_with_spans(tokens, 16, [(99, 10, 40)])
    by_block = compute_block_hashes(tokens, 16, [[99], [99], [99], []])
    assert by_span == by_block
    assert by_span[3] == compute_block_hashes(tokens, 16)[3]
    with pytest.raises(ValueError, match="empty or reversed"):
        compute_block_hashes_with_spans(tokens, 16, [(99, 5, 5)])
    with pytest.raises(ValueError, match="block_size"):
        compute_block_hashes(tokens, 0)


def test_numpy_input_matches_list_input() -> None:
    tokens = [7, 151655, 2**32 - 1, 0] * 8
    assert compute_block_hashes(np.array(tokens, dtype=np.int64)) == compute_block_hashes(tokens)
    assert compute_block_hashes(np.array(tokens, dtype=np.uint32)) == compute_block_hashes(tokens)


@pytest.mark.parametrize("bad", [[-1] * 16, [2**32] * 16])
def test_out_of_range_ids_are_rejected(bad: list[int]) -> None:
    with pytest.raises((ValueError, OverflowError)):
        compute_block_hashes(bad)


def test_seq_hashes_chain_by_position() -> None:
    local = [11, 22, 33]
    seq1 = xxhash.xxh3_64_intdigest(struct.pack("<2Q", 11, 22), seed=BLOCK_HASH_SEED)
    seq2 = xxhash.xxh3_64_intdigest(struct.pack("<2Q", seq1, 33), seed=BLOCK_HASH_SEED)
    assert compute_seq_hashes(local) == [11, seq1, seq2]
    # A run that continues a sequence chains from the given parent.
    assert compute_seq_hashes([22, 33], parent_seq_hash=11) == [seq1, seq2]
