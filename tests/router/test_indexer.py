"""The KV index fed with synthetic events: overlap, removal, clearing, workers leaving, dumps."""

from __future__ import annotations

import random

import pytest

from mmserve.protocol import KvBlock, KvCleared, KvRemoved, KvStored
from mmserve.router.hashing import compute_seq_hashes
from mmserve.router.indexer import KvIndexer, UnknownParentError


def stored(local: list[int], parent_local: list[int] | None = None) -> KvStored:
    """Blocks with local hashes `local`, continuing the sequence `parent_local` (if any)."""
    prefix = parent_local or []
    seq = compute_seq_hashes(prefix + local)
    return KvStored(
        parent_hash=seq[len(prefix) - 1] if prefix else None,
        blocks=[
            KvBlock(block_hash=s, tokens_hash=t)
            for s, t in zip(seq[len(prefix) :], local, strict=True)
        ],
    )


def test_overlap_is_the_held_prefix() -> None:
    index = KvIndexer()
    index.apply_event("a", stored([1, 2, 3, 4]))
    index.apply_event("b", stored([1, 2, 7]))
    assert index.find_matches([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    assert index.find_matches([1, 2, 7]) == {"a": 2, "b": 3}
    assert index.find_matches([9, 2, 3]) == {}
    assert index.find_matches([]) == {}


def test_same_blocks_at_another_position_do_not_match() -> None:
    index = KvIndexer()
    index.apply_event("a", stored([5, 6, 7]))
    # The request's blocks 6, 7 equal a's, but after a different first block.
    assert index.find_matches([1, 6, 7]) == {}


def test_stored_continues_after_its_parent() -> None:
    index = KvIndexer()
    index.apply_event("a", stored([1, 2]))
    index.apply_event("a", stored([3, 4], parent_local=[1, 2]))
    assert index.find_matches([1, 2, 3, 4]) == {"a": 4}
    assert index.num_blocks("a") == 4


def test_unknown_parent_is_refused_without_change() -> None:
    index = KvIndexer()
    with pytest.raises(UnknownParentError):
        index.apply_event("a", stored([3], parent_local=[1, 2]))
    assert index.num_blocks("a") == 0
    assert index.find_matches([1, 2, 3]) == {}


def test_removed_block_cuts_the_overlap_at_the_gap() -> None:
    index = KvIndexer()
    event = stored([1, 2, 3, 4])
    index.apply_event("a", event)
    index.apply_event("a", KvRemoved(block_hashes=[event.blocks[2].block_hash]))
    assert index.find_matches([1, 2, 3, 4]) == {"a": 2}
    # Removing what is not there changes nothing.
    index.apply_event("a", KvRemoved(block_hashes=[123456]))
    index.apply_event("nobody", KvRemoved(block_hashes=[1]))
    assert index.find_matches([1, 2, 3, 4]) == {"a": 2}


def test_cleared_drops_the_blocks_of_one_worker() -> None:
    index = KvIndexer()
    index.apply_event("a", stored([1, 2]))
    index.apply_event("b", stored([1, 2]))
    index.apply_event("a", KvCleared())
    assert index.find_matches([1, 2]) == {"b": 2}
    assert set(index.workers()) == {"a", "b"}


def test_removed_worker_leaves_with_its_blocks_and_the_tree_shrinks() -> None:
    index = KvIndexer()
    index.apply_event("a", stored([1, 2, 3]))
    index.apply_event("b", stored([1, 2]))
    assert index.num_nodes() == 3
    index.remove_worker("a")
    assert index.find_matches([1, 2, 3]) == {"b": 2}
    assert index.workers() == ["b"]
    assert index.num_nodes() == 2
    index.remove_worker("b")
    assert index.num_nodes() == 0


def test_dump_rebuilds_the_worker_in_an_empty_index() -> None:
    rng = random.Random(3)
    index = KvIndexer()
    sequences = []
    for _ in range(20):
        # Sequences share prefixes of random length, so the tree branches.
        base = rng.choice(sequences) if sequences else []
        local = base[: rng.randrange(len(base) + 1)] + [rng.randrange(50) for _ in range(4)]
        sequences.append(local)
        index.apply_event("a", stored(local))
    index.apply_event("b", stored([1, 2, 3]))

    rebuilt = KvIndexer()
    for event in index.dump("a"):
        rebuilt.apply_event("a", event)
    assert rebuilt.num_blocks("a") == index.num_blocks("a")
    for local in sequences:
        assert rebuilt.find_matches(local)["a"] == index.find_matches(local)["a"] == len(local)
    assert index.dump("nobody") == []
