"""The KV index fed with synthetic events: overlap, removal, clearing, workers leaving, dumps."""

from __future__ import annotations

import json
import random

import pytest
from dynamo.llm import RadixTree
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.kv.hashing import compute_seq_hashes
from mmserve.protocol import KvBlock, KvCleared, KvRemoved, KvStored
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
    sequences: list[list[int]] = []
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


class ReferenceIndex:
    """The index's meaning, computed the slow way: a worker holds a prefix (a tuple of local
    hashes) when it holds a block at that path."""

    def __init__(self) -> None:
        self.paths: dict[str, dict[int, tuple[int, ...]]] = {}  # worker -> block hash -> path

    def store(self, worker: str, parent: int | None, blocks: list[KvBlock]) -> None:
        held = self.paths.setdefault(worker, {})
        if parent is not None and parent not in held:
            raise UnknownParentError(parent)
        path = held[parent] if parent is not None else ()
        for block in blocks:
            path = (*path, block.tokens_hash)
            held[block.block_hash] = path

    def overlap(self, worker: str, query: list[int]) -> int:
        held = set(self.paths.get(worker, {}).values())
        depth = 0
        while depth < len(query) and tuple(query[: depth + 1]) in held:
            depth += 1
        return depth


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_index_matches_the_reference_under_random_events(data: st.DataObject) -> None:
    index, reference = KvIndexer(), ReferenceIndex()
    workers = ["a", "b", "c"]
    paths: list[list[int]] = [[]]  # prefixes seen so far, to grow and query
    for _ in range(data.draw(st.integers(1, 40))):
        worker = data.draw(st.sampled_from(workers))
        action = data.draw(st.sampled_from(["store", "store", "store", "remove", "clear", "leave"]))
        if action == "store":
            base = data.draw(st.sampled_from(paths))
            cut = data.draw(st.integers(0, len(base)))
            local = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
            event = stored(local, parent_local=base[:cut])
            expect_error = False
            try:
                reference.store(worker, event.parent_hash, event.blocks)
            except UnknownParentError:
                expect_error = True
            if expect_error:
                with pytest.raises(UnknownParentError):
                    index.apply_event(worker, event)
            else:
                index.apply_event(worker, event)
                paths.append(base[:cut] + local)
        elif action == "remove":
            held = sorted(reference.paths.get(worker, {}))
            if held:
                gone = data.draw(st.lists(st.sampled_from(held), max_size=3, unique=True))
                index.apply_event(worker, KvRemoved(block_hashes=gone))
                for block_hash in gone:
                    del reference.paths[worker][block_hash]
        elif action == "clear":
            index.apply_event(worker, KvCleared())
            reference.paths.get(worker, {}).clear()
        else:
            index.remove_worker(worker)
            reference.paths.pop(worker, None)
    for query in paths:
        expected = {w: reference.overlap(w, query) for w in workers}
        assert index.find_matches(query) == {w: n for w, n in expected.items() if n > 0}
        for worker in workers:
            assert index.num_blocks(worker) == len(reference.paths.get(worker, {}))


def dynamo_event(event_id: int, event: KvStored | KvRemoved | KvCleared) -> bytes:
    """The JSON form of a KV event that Dynamo's RadixTree applies."""
    if isinstance(event, KvStored):
        blocks = [{"block_hash": b.block_hash, "tokens_hash": b.tokens_hash} for b in event.blocks]
        data: object = {"stored": {"parent_hash": event.parent_hash, "blocks": blocks}}
    elif isinstance(event, KvRemoved):
        data = {"removed": {"block_hashes": list(event.block_hashes)}}
    else:
        data = "cleared"
    return json.dumps({"event_id": event_id, "data": data}).encode()


@pytest.mark.parametrize("seed", range(3))
def test_overlaps_equal_dynamos_radix_tree(seed: int) -> None:
    """Engine-like event streams (runs stored after cached blocks, leaves evicted, caches
    cleared) give the same overlaps here as in Dynamo's own index."""
    rng = random.Random(seed)
    ours, theirs = KvIndexer(), RadixTree()
    # worker -> block hash -> (path of local hashes, parent block hash)
    cached: dict[int, dict[int, tuple[tuple[int, ...], int | None]]] = {0: {}, 1: {}, 2: {}}
    queries: list[list[int]] = []
    for event_id in range(300):
        worker = rng.randrange(3)
        held = cached[worker]
        roll = rng.random()
        if roll < 0.6:
            parent = rng.choice([None, *held]) if held else None
            prefix = list(held[parent][0]) if parent is not None else []
            local = [rng.randrange(4) for _ in range(rng.randint(1, 4))]
            event = stored(local, parent_local=prefix)
            for depth, block in enumerate(event.blocks):
                path = tuple(prefix + local[: depth + 1])
                before = event.blocks[depth - 1].block_hash if depth else event.parent_hash
                held[block.block_hash] = (path, before)
            queries.append(prefix + local)
        elif roll < 0.95:
            parents = {parent for _, parent in held.values()}
            leaves = [block for block in held if block not in parents]
            if not leaves:
                continue
            gone = rng.sample(leaves, min(len(leaves), rng.randint(1, 3)))
            event = KvRemoved(block_hashes=gone)
            for block in gone:
                del held[block]
        else:
            event = KvCleared()
            held.clear()
        ours.apply_event(str(worker), event)
        theirs.apply_event(worker, dynamo_event(event_id, event))
    for query in queries:
        expected = {str(w): n for (w, _rank), n in theirs.find_matches(query).scores.items()}
        assert ours.find_matches(query) == {w: n for w, n in expected.items() if n > 0}
