"""SGLang's KV events (its ZMQ publisher) turned into mmserve's `KvStored` / `KvRemoved` /
`KvCleared`.

SGLang publishes multipart messages `(topic, seq, payload)`; the payload is a msgpack
`KVEventBatch` `[ts, events, attn_dp_rank]` whose events are maps tagged by `type`
(`BlockStored {block_hashes, parent_block_hash, token_ids, block_size, ...}`,
`BlockRemoved {block_hashes}`, `AllBlocksCleared`), as `sglang/srt/disaggregation/kv_events.py`
writes them. SGLang's block hashes are its own; the router indexes Dynamo-compatible hashes of
the routing view (`mmserve.kv.view`). The bridge recomputes those from the event's token
ids: pad values wider than u32 (the `sglang-wide` scheme) are narrowed as the router narrows
them, and the mm_hash of every pad value the engine has sent (`remember`) is attached to the
blocks it appears in. SGLang's hashes only name the blocks for later removal.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from mmserve.kv.events import KvEventData, KvEventSink
from mmserve.kv.hashing import compute_block_hashes, compute_seq_hashes
from mmserve.kv.pad import MM_PAD_SHIFT, PadScheme, routing_pad_values
from mmserve.protocol import KvBlock, KvCleared, KvRemoved, KvStored

GPU_MEDIUM = "GPU"
"""SGLang's `StorageMedium.GPU`; events of other tiers (host, disk, external) are skipped."""
_ROUTING_MASK = (1 << 30) - 1


class SglangKvEventBridge:
    """Translates SGLang event batches; thread-safe (the ZMQ reader thread and `remember`)."""

    def __init__(self, block_size: int, scheme: PadScheme, max_media: int = 65536) -> None:
        self.block_size = block_size
        self.scheme = scheme
        self._max_media = max_media
        self._media: OrderedDict[int, int] = OrderedDict()  # routing pad value -> mm_hash
        # SGLang block hash -> (sequence hash, parent sequence hash, local hash)
        self._blocks: dict[int, tuple[int, int | None, int]] = {}
        self._lock = threading.Lock()
        self._decoder = msgspec.msgpack.Decoder()

    def remember(self, mm_hashes: Iterable[int]) -> None:
        """Record the pad values of items sent to the engine, so their blocks carry the item."""
        with self._lock:
            for mm_hash in mm_hashes:
                for value in routing_pad_values(mm_hash, self.scheme):
                    self._media[value] = mm_hash
                    self._media.move_to_end(value)
            while len(self._media) > self._max_media:
                self._media.popitem(last=False)

    def translate_payload(self, payload: bytes) -> list[KvEventData]:
        """One published `KVEventBatch` payload as mmserve events, in order."""
        batch = self._decoder.decode(payload)
        if not isinstance(batch, list) or len(batch) < 2:
            raise ValueError("not an SGLang KV event batch")
        out: list[KvEventData] = []
        for event in batch[1]:
            translated = self.translate(event)
            if translated is not None:
                out.append(translated)
        return out

    def translate(self, event: dict[str, Any]) -> KvEventData | None:
        """One event as mmserve's, or None when it changes nothing the router indexes (an
        unknown block, a partial block, a host or storage tier: the router counts the GPU's)."""
        kind = event.get("type")
        if event.get("medium") not in (None, GPU_MEDIUM):
            return None
        with self._lock:
            if kind == "BlockStored":
                return self._stored(event)
            if kind == "BlockRemoved":
                removed = [
                    self._blocks.pop(h)[0] for h in event["block_hashes"] if h in self._blocks
                ]
                return KvRemoved(block_hashes=removed) if removed else None
            if kind == "AllBlocksCleared":
                self._blocks.clear()
                return KvCleared()
        return None

    def snapshot(self) -> list[tuple[int, int | None, int]]:
        with self._lock:
            return list(self._blocks.values())

    def _stored(self, event: dict[str, Any]) -> KvStored | None:
        block_size = int(event.get("block_size") or self.block_size)
        if block_size != self.block_size:
            raise ValueError(
                f"SGLang publishes blocks of {block_size} tokens, the router hashes "
                f"{self.block_size}: start the worker with --block-size {block_size}"
            )
        sglang_hashes: Sequence[int] = event["block_hashes"]
        tokens = [self._narrow(t) for t in event["token_ids"]]
        if len(tokens) != len(sglang_hashes) * block_size:
            return None  # a partial block is never routed on
        parent = event.get("parent_block_hash")
        parent_seq = self._blocks[parent][0] if parent in self._blocks else None
        mm_infos = [
            sorted({self._media[t] for t in tokens[i : i + block_size] if t in self._media})
            for i in range(0, len(tokens), block_size)
        ]
        local = compute_block_hashes(tokens, block_size, mm_infos, event.get("lora_name"))
        seq = compute_seq_hashes(local, parent_seq)
        previous = parent_seq
        for sglang_hash, seq_hash, local_hash in zip(sglang_hashes, seq, local, strict=True):
            self._blocks[sglang_hash] = (seq_hash, previous, local_hash)
            previous = seq_hash
        return KvStored(
            parent_hash=parent_seq,
            blocks=[KvBlock(block_hash=s, tokens_hash=h) for s, h in zip(seq, local, strict=True)],
        )

    @staticmethod
    def _narrow(token: int) -> int:
        """A pad value as the router's u32 view holds it (`routing_pad_values`: identity for
        `dynamo` values); text ids lie below the shift (SGLang checks the vocabulary does)."""
        if token < MM_PAD_SHIFT:
            return token
        return MM_PAD_SHIFT + ((token - MM_PAD_SHIFT) & _ROUTING_MASK)


def zmq_reader(
    endpoint: str, topic: str, bridge: SglangKvEventBridge, sink: KvEventSink, stop: threading.Event
) -> None:
    """Subscribe to SGLang's publisher and call `sink` per translated event until `stop`."""
    import zmq

    context = zmq.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
    try:
        while not stop.is_set():
            if not socket.poll(100):
                continue
            frames = socket.recv_multipart()
            for event in bridge.translate_payload(frames[-1]):
                sink(event)
    finally:
        socket.close()
