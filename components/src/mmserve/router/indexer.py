"""The KV index: which worker holds which prefix of blocks, fed by the workers' KV events.

A radix tree over local block hashes (`tokens_hash`), kept in the Rust core (`_mm.KvIndex`): a
node is one block after one exact prefix. Each node records the workers holding it and, per
worker, the block hash that worker's events use for it (the chained sequence hash): events name
blocks by that hash, requests walk by local hashes. A worker's overlap with a request is the
number of leading blocks of the request it holds, without a gap.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmserve import _mm
from mmserve.kv.events import KvEventData
from mmserve.protocol import KvBlock, KvRemoved, KvStored

UnknownParentError = _mm.UnknownParentError
"""A stored event names a parent block the index does not hold for that worker (a KeyError)."""


class KvIndexer:
    """Radix index of the blocks cached by each worker."""

    def __init__(self) -> None:
        self._index = _mm.KvIndex()

    def apply_event(self, worker_id: str, event: KvEventData) -> None:
        """Apply one change of `worker_id`'s cache.

        A stored event after a parent the index does not know for the worker raises
        `UnknownParentError` and changes nothing: an event was missed, and the worker should be
        resynchronised from a dump.
        """
        if isinstance(event, KvStored):
            blocks = [(block.block_hash, block.tokens_hash) for block in event.blocks]
            self._index.apply_stored(worker_id, event.parent_hash, blocks)
        elif isinstance(event, KvRemoved):
            self._index.apply_removed(worker_id, list(event.block_hashes))
        else:
            self._index.clear_worker(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget `worker_id` and its blocks (it left the deployment)."""
        self._index.remove_worker(worker_id)

    def find_matches(self, local_hashes: Sequence[int]) -> dict[str, int]:
        """Overlap in blocks per worker; workers without overlap are absent."""
        return self._index.find_matches(list(local_hashes))

    def dump(self, worker_id: str) -> list[KvStored]:
        """`worker_id`'s blocks as stored events that rebuild them in an empty index: each event
        is an unbranched run whose parent is None or a block of an earlier event."""
        return [
            KvStored(
                parent_hash=parent,
                blocks=[KvBlock(block_hash=b, tokens_hash=t) for b, t in blocks],
            )
            for parent, blocks in self._index.dump(worker_id)
        ]

    def workers(self) -> list[str]:
        """Workers with events applied and not removed."""
        return self._index.workers()

    def num_blocks(self, worker_id: str) -> int:
        return self._index.num_blocks(worker_id)

    def num_nodes(self) -> int:
        return self._index.num_nodes()
