"""The block prefix cache on its own: keys, LRU order, budgets, events and snapshots."""

from __future__ import annotations

from mmserve.engines.prefix_cache import PrefixCache
from mmserve.kv.view import prompt_block_keys
from mmserve.protocol import KvCleared, KvRemoved, KvStored, PlannedMedia

BLOCK = 4


def keys_for(tokens: list[int], media: list[PlannedMedia] = ()):
    return prompt_block_keys(tokens, media, BLOCK)


def image(mm_hash: int, offset: int) -> PlannedMedia:
    return PlannedMedia(mm_hash=mm_hash, offset=offset, length=4, grid_thw=(1, 4, 4))


def test_stored_runs_name_their_parent_and_snapshot_lists_the_chain():
    cache: PrefixCache[str] = PrefixCache(BLOCK)
    events: list = []
    cache.subscribe(events.append)
    keys = keys_for(list(range(26)))  # 6 complete blocks, a partial tail
    assert len(keys.seq_hashes) == 6
    cache.store(keys, 0, ["b0", "b1", "b2"])
    cache.store(keys, 3, ["b3", "b4"])
    assert events == [
        KvStored(parent_hash=None, blocks=events[0].blocks),
        KvStored(parent_hash=keys.seq_hashes[2], blocks=events[1].blocks),
    ]
    assert [b.block_hash for b in events[1].blocks] == list(keys.seq_hashes[3:5])
    assert [b.tokens_hash for b in events[1].blocks] == list(keys.local_hashes[3:5])
    parents = {block: parent for block, parent, _ in cache.snapshot()}
    assert parents[keys.seq_hashes[0]] is None
    assert parents[keys.seq_hashes[4]] == keys.seq_hashes[3]
    assert cache.match(keys.seq_hashes) == ["b0", "b1", "b2", "b3", "b4"]
    assert cache.match(keys.seq_hashes, max_blocks=2) == ["b0", "b1"]


def test_a_different_prefix_or_image_changes_every_later_key():
    tokens = list(range(16))
    base = keys_for(tokens, [image(7, 8)])
    other_image = keys_for(tokens, [image(8, 8)])
    other_text = keys_for([99, *tokens[1:]], [image(7, 8)])
    assert base.seq_hashes[:2] == other_image.seq_hashes[:2]
    assert set(base.seq_hashes[2:]).isdisjoint(other_image.seq_hashes[2:])
    # The last block is identical in both, but its chained key still differs.
    assert base.local_hashes[3] == other_image.local_hashes[3]
    assert set(base.seq_hashes).isdisjoint(other_text.seq_hashes)


def test_eviction_trims_chains_from_the_tail_and_reports_it():
    cache: PrefixCache[bytes] = PrefixCache(BLOCK, max_bytes=30, payload_bytes=len)
    events: list = []
    cache.subscribe(events.append)
    first = keys_for(list(range(16)))
    second = keys_for(list(range(100, 116)))
    cache.store(first, 0, [b"0123456789"] * 3)
    assert cache.num_bytes == 30
    cache.store(second, 0, [b"0123456789"] * 2)
    removed = events[-1]
    assert isinstance(removed, KvRemoved)
    # The older chain loses its deepest blocks first; its first block survives.
    assert removed.block_hashes == [first.seq_hashes[2], first.seq_hashes[1]]
    assert cache.match(first.seq_hashes) == [b"0123456789"]
    assert cache.num_blocks == 3 and cache.num_bytes == 30
    cache.clear()
    assert isinstance(events[-1], KvCleared)
    assert cache.snapshot() == []
