"""Encode worker selection: by the embeddings each encoder already holds, round robin or random.

In embedding-cache mode each encode worker is scored with

    logit = overlap_weight * (uncached_tokens + pending_tokens) + queue_weight * queued_requests

where `uncached_tokens` are the image tokens of this request the worker's encoder cache does
not hold (the vision-tower work it would run; the encoder index learns the caches from the
workers' embedding-cache events) nor will hold once the requests in flight there are encoded,
`pending_tokens` the uncached tokens of the requests already sent to it and not answered yet,
and `queued_requests` those requests. The lowest logit wins; among equal ones, the worker that
holds the most of the request's tokens, then one at random (a positive temperature samples
instead, `scheduler.pick_by_cost`). So a request goes to the encoder that saves the most
vision-tower work, unless that encoder is busy with more than it would save. The router counts
the work in flight from its own decisions, so a burst that shares an image lands on one encoder
(which encodes it once) and a burst of new images spreads, before any event arrives.
"""

from __future__ import annotations

import enum
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from mmserve.kv.encoder_events import EncoderKey, encoder_key
from mmserve.protocol import PreprocessedRequest
from mmserve.router.encoder_index import EncoderIndex
from mmserve.router.scheduler import KvCostConfig, NoWorkersError, pick_by_cost


class EncodeRouterMode(enum.Enum):
    EMBEDDING_CACHE = "embedding-cache"
    PEER_PULL = "peer-pull"  # embedding-cache, and the chosen encoder pulls what a peer holds
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"

    @property
    def follows_caches(self) -> bool:
        return self in (EncodeRouterMode.EMBEDDING_CACHE, EncodeRouterMode.PEER_PULL)


EncodeItems = Sequence[tuple[EncoderKey, int]]
"""The items a request has encoded: their encoder key and token count."""


def encode_items(request: PreprocessedRequest) -> list[tuple[EncoderKey, int]]:
    """The encoder keys and token counts of the items an encoder provides
    (`PreprocessedRequest.items_to_encode`)."""
    media = request.plan.media
    return [
        (encoder_key(media[i].mm_hash, media[i].grid_thw), media[i].length)
        for i in request.items_to_encode()
    ]


@dataclass(frozen=True, slots=True)
class EncodeDecision:
    worker_id: str
    held_tokens: int  # image tokens of the request the chosen encoder holds
    request_tokens: int


@dataclass(slots=True)
class _Pending:
    worker_id: str
    tokens: int  # the uncached ones
    keys: list[EncoderKey]


@dataclass(slots=True)
class _EncoderLoad:
    tokens: int = 0  # uncached tokens of the requests in flight
    requests: int = 0
    keys: Counter[EncoderKey] = field(default_factory=Counter)  # their items, as they will be held


class EncodeRouter:
    """Picks an encode worker per request (`select`) and tracks the work it sent until
    `on_first_token` (the encode is done by then) or `on_finish`, however the request ends."""

    def __init__(
        self,
        mode: EncodeRouterMode = EncodeRouterMode.EMBEDDING_CACHE,
        index: EncoderIndex | None = None,
        cost: KvCostConfig | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.mode = mode
        self.index = index if index is not None else EncoderIndex()
        self.cost = cost if cost is not None else KvCostConfig()
        self._rng = rng if rng is not None else random.Random()
        self._next_round_robin = 0
        self._requests: dict[str, _Pending] = {}
        self._load: dict[str, _EncoderLoad] = {}

    def select(self, request_id: str, items: EncodeItems, workers: Sequence[str]) -> EncodeDecision:
        if not workers:
            raise NoWorkersError("no encode worker is available")
        self.on_finish(request_id)  # a retried request replaces its earlier dispatch
        total = sum(tokens for _, tokens in items)
        held = self.held_tokens(items, workers)
        if self.mode.follows_caches:
            worker_id = self._pick(self.logits(total, held, workers), held)
        elif self.mode is EncodeRouterMode.ROUND_ROBIN:
            worker_id = workers[self._next_round_robin % len(workers)]
            self._next_round_robin += 1
        else:
            worker_id = self._rng.choice(list(workers))
        tokens = total - held.get(worker_id, 0)
        keys = [key for key, _ in items]
        self._requests[request_id] = _Pending(worker_id, tokens, keys)
        load = self._load.setdefault(worker_id, _EncoderLoad())
        load.tokens += tokens
        load.requests += 1
        load.keys.update(keys)
        return EncodeDecision(worker_id, held.get(worker_id, 0), total)

    def held_tokens(self, items: EncodeItems, workers: Sequence[str]) -> dict[str, int]:
        """Tokens of `items` each worker holds, or will once its requests in flight are
        encoded; workers holding none are absent."""
        if not items:
            return {}
        cached = {
            worker_id: self.index.held_keys(worker_id, [key for key, _ in items])
            for worker_id in workers
        }
        held = {}
        for worker_id in workers:
            in_flight = self._load.get(worker_id)
            tokens = sum(
                count
                for key, count in items
                if key in cached[worker_id] or (in_flight is not None and key in in_flight.keys)
            )
            if tokens:
                held[worker_id] = tokens
        return held

    def peer_holders(
        self, request_id: str, items: EncodeItems, worker_id: str, workers: Sequence[str]
    ) -> dict[EncoderKey, str]:
        """For each of `items` (request `request_id`'s, routed to `worker_id`) that `worker_id`
        neither holds nor will hold once its other requests in flight are encoded, another of
        `workers` whose cache holds it (the least busy one); items no other worker holds are
        absent."""
        keys = [key for key, _ in items]
        own = self.index.held_keys(worker_id, keys)
        load = self._load.get(worker_id)
        if load is not None:
            pending = self._requests.get(request_id)
            others = load.keys - Counter(pending.keys if pending is not None else [])
            own |= {key for key in keys if key in others}
        wanted = [key for key in keys if key not in own]
        if not wanted:
            return {}
        peers = [w for w in workers if w != worker_id]
        held = {peer: self.index.held_keys(peer, wanted) for peer in peers}
        holders = {}
        for key in wanted:
            holding = [peer for peer in peers if key in held[peer]]
            if holding:
                holders[key] = min(holding, key=lambda peer: self.pending(peer)[1])
        return holders

    def logits(self, total: int, held: dict[str, int], workers: Sequence[str]) -> dict[str, float]:
        """The cost of encoding `total` tokens on each worker, `held` of them cached there."""
        logits = {}
        for worker_id in workers:
            pending_tokens, queued = self.pending(worker_id)
            uncached = total - held.get(worker_id, 0) + pending_tokens
            logits[worker_id] = (
                self.cost.overlap_weight * uncached + self.cost.queue_weight * queued
            )
        return logits

    def _pick(self, logits: dict[str, float], held: dict[str, int]) -> str:
        if self.cost.temperature > 0:
            return pick_by_cost(logits, self.cost.temperature, self._rng)
        lowest = min(logits.values())
        cheapest = [w for w, logit in logits.items() if logit == lowest]
        most = max(held.get(w, 0) for w in cheapest)
        return self._rng.choice([w for w in cheapest if held.get(w, 0) == most])

    def pending(self, worker_id: str) -> tuple[int, int]:
        """`(uncached tokens, requests)` sent to the worker and not answered yet."""
        load = self._load.get(worker_id)
        return (0, 0) if load is None else (load.tokens, load.requests)

    def on_first_token(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        load = self._load[request.worker_id]
        load.tokens -= request.tokens
        load.requests -= 1
        load.keys.subtract(request.keys)
        if load.requests == 0:
            del self._load[request.worker_id]
        else:
            load.keys = +load.keys  # drop the keys no request holds any more

    def on_finish(self, request_id: str) -> None:
        self.on_first_token(request_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker that left: its entries and the work sent to it."""
        self.index.remove_worker(worker_id)
        self._load.pop(worker_id, None)
        for request_id in [r for r, p in self._requests.items() if p.worker_id == worker_id]:
            del self._requests[request_id]
