"""Worker selection: KV-aware cost, round robin or random, behind one interface.

KV mode scores each worker with

    logit = overlap_weight * uncached_prefill_blocks + active_decode_blocks
            - shared_active_blocks + queue_weight * queued_requests

where `uncached_prefill_blocks` is the part of this prompt the worker does not hold plus the
prefill work already sent to it, `active_decode_blocks` the KV blocks of its requests in flight
(a block that several of them share counts once: a prefix-caching engine holds it once),
`shared_active_blocks` the leading blocks of this prompt already among them (it would add no
memory for those) and `queued_requests` the requests still waiting for their first token. On a
worker that encodes (`worker --encode`, `prefill --encode`: it publishes embedding-cache
events) `uncached_prefill_blocks` also counts the vision-tower work, in blocks of image tokens:
the items neither in its cached prefix (skipped, `ItemState.SKIPPED`) nor in its
encoder cache. The
lowest logit wins, ties are broken at random; a positive temperature samples from a softmax
over the normalised logits instead. The router counts in-flight load itself, from its own
decisions, so a burst of requests spreads out before any worker reports back.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from mmserve.kv.encoder_events import EncoderKey, encoder_key
from mmserve.kv.hashing import DEFAULT_BLOCK_SIZE, compute_seq_hashes
from mmserve.kv.pad import PadScheme
from mmserve.kv.view import RoutingView, reusable_blocks, routing_view
from mmserve.protocol import RequestPlan
from mmserve.router.encoder_index import EncoderIndex
from mmserve.router.indexer import KvIndexer


class RouterMode(enum.Enum):
    KV = "kv"
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"


class NoWorkersError(RuntimeError):
    """There is no worker to route to."""


@dataclass(frozen=True, slots=True)
class KvCostConfig:
    overlap_weight: float = 1.0
    queue_weight: float = 0.0
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.overlap_weight < 0 or self.queue_weight < 0 or self.temperature < 0:
            raise ValueError("overlap_weight, queue_weight and temperature must be >= 0")


@dataclass(frozen=True, slots=True)
class RouteMedia:
    """A media item as the router weighs it on a worker that encodes: its encoder-cache key,
    its tokens and where they end in the prompt."""

    key: EncoderKey
    length: int
    end: int


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router needs of a request: its block hashes and its size in blocks (and
    tokens), and its media items.

    With no block hashes (e.g. the decode hop of E/P/D), KV mode routes by load alone.
    """

    request_id: str
    block_hashes: Sequence[int] = ()
    num_blocks: int = 0  # KV blocks the prompt occupies, a partial tail block included
    num_tokens: int = 0
    media: Sequence[RouteMedia] = ()

    @classmethod
    def from_view(
        cls,
        request_id: str,
        view: RoutingView,
        block_size: int = DEFAULT_BLOCK_SIZE,
        lora_name: str | None = None,
    ) -> RouteRequest:
        return cls(
            request_id=request_id,
            block_hashes=view.block_hashes(block_size, lora_name),
            num_blocks=-(-len(view.ids) // block_size),
            num_tokens=len(view.ids),
        )


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    worker_id: str
    overlap_blocks: int  # leading blocks of the prompt the worker already holds
    request_blocks: int


@dataclass(slots=True)
class _InFlight:
    worker_id: str
    prefill_blocks: int
    seq_hashes: Sequence[int]  # its full blocks, by sequence hash
    other_blocks: int  # the rest: a partial tail block, or all when routed by size alone
    prefilled: bool = False


@dataclass(slots=True)
class _WorkerLoad:
    prefill_blocks: int = 0
    shared: Counter[int] = field(default_factory=Counter)  # block -> requests holding it
    other_blocks: int = 0
    queued: int = 0

    @property
    def decode_blocks(self) -> int:
        return len(self.shared) + self.other_blocks


class LoadTracker:
    """In-flight load per worker, counted from the router's own dispatches."""

    def __init__(self) -> None:
        self._requests: dict[str, _InFlight] = {}
        self._workers: dict[str, _WorkerLoad] = {}

    def on_dispatch(
        self,
        request_id: str,
        worker_id: str,
        prefill_blocks: int,
        total_blocks: int,
        seq_hashes: Sequence[int] = (),
    ) -> None:
        """Books a request of `total_blocks` on a worker; `seq_hashes` name its leading full
        blocks, which count once however many requests in flight there share them."""
        self.on_finish(request_id)  # a retried request replaces its earlier dispatch
        other_blocks = total_blocks - len(seq_hashes)
        self._requests[request_id] = _InFlight(worker_id, prefill_blocks, seq_hashes, other_blocks)
        load = self._workers.setdefault(worker_id, _WorkerLoad())
        load.prefill_blocks += prefill_blocks
        load.shared.update(seq_hashes)
        load.other_blocks += other_blocks
        load.queued += 1

    def on_first_token(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is None or request.prefilled:
            return
        request.prefilled = True
        load = self._workers[request.worker_id]
        load.prefill_blocks -= request.prefill_blocks
        load.queued -= 1

    def on_finish(self, request_id: str) -> None:
        self.on_first_token(request_id)
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        load = self._workers[request.worker_id]
        load.other_blocks -= request.other_blocks
        shared = load.shared
        for block in request.seq_hashes:
            if (holders := shared[block] - 1) > 0:
                shared[block] = holders
            else:
                shared.pop(block, None)  # dict's own: Counter's __delitem__ runs in Python

    def remove_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        for request_id in [r for r, req in self._requests.items() if req.worker_id == worker_id]:
            del self._requests[request_id]

    def load(self, worker_id: str) -> tuple[int, int, int]:
        """`(pending prefill blocks, active decode blocks, queued requests)` of a worker."""
        load = self._workers.get(worker_id)
        if load is None:
            return (0, 0, 0)
        return (load.prefill_blocks, load.decode_blocks, load.queued)

    def shared_prefix(self, worker_id: str, seq_hashes: Sequence[int]) -> int:
        """How many leading blocks of `seq_hashes` requests in flight on the worker hold. A
        request books all its leading blocks, so the held ones are a prefix: binary search."""
        load = self._workers.get(worker_id)
        if load is None or not load.shared:
            return 0
        return bisect.bisect_left(
            range(len(seq_hashes)), True, key=lambda i: seq_hashes[i] not in load.shared
        )

    def in_flight(self) -> int:
        return len(self._requests)


class Router:
    """Picks a worker per request (`select`) and tracks the load it sent.

    `select` counts the request as dispatched to the chosen worker; call `on_first_token` when
    its first token arrives and `on_finish` when it ends, however it ends.
    """

    def __init__(
        self,
        mode: RouterMode = RouterMode.KV,
        indexer: KvIndexer | None = None,
        cost: KvCostConfig | None = None,
        rng: random.Random | None = None,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        pad_scheme: PadScheme = PadScheme.DYNAMO,
    ) -> None:
        self.mode = mode
        self.block_size = block_size
        self.pad_scheme = pad_scheme
        self.indexer = indexer if indexer is not None else KvIndexer()
        # The encoder caches of workers that encode, fed by their embedding-cache events.
        self.encoder_index = EncoderIndex()
        self.cost = cost if cost is not None else KvCostConfig()
        self.load = LoadTracker()
        self._rng = rng if rng is not None else random.Random()
        self._next_round_robin = 0

    def request_for(
        self, request_id: str, plan: RequestPlan, *, lora_name: str | None = None
    ) -> RouteRequest:
        """The routing request of a planned prompt, with this router's block size and pad
        scheme."""
        view = routing_view(plan.token_ids, plan.media, scheme=self.pad_scheme)
        request = RouteRequest.from_view(request_id, view, self.block_size, lora_name)
        media = [
            RouteMedia(encoder_key(item.mm_hash, item.grid_thw), item.length, item.end)
            for item in plan.media
            if item.length > 0
        ]
        return dataclasses.replace(request, media=media)

    def select(self, request: RouteRequest, workers: Sequence[str]) -> RoutingDecision:
        if not workers:
            raise NoWorkersError("no worker is available")
        overlaps = self.indexer.find_matches(request.block_hashes) if request.block_hashes else {}
        seq_hashes = compute_seq_hashes(request.block_hashes) if request.block_hashes else []
        if self.mode is RouterMode.KV:
            logits = self.logits(request, workers, overlaps, seq_hashes)
            worker_id = self._pick_by_cost(logits)
        elif self.mode is RouterMode.ROUND_ROBIN:
            worker_id = workers[self._next_round_robin % len(workers)]
            self._next_round_robin += 1
        else:
            worker_id = self._rng.choice(list(workers))
        num_blocks = max(request.num_blocks, len(request.block_hashes))
        overlap = overlaps.get(worker_id, 0)
        self.load.on_dispatch(
            request.request_id, worker_id, num_blocks - overlap, num_blocks, seq_hashes
        )
        return RoutingDecision(worker_id, overlap, num_blocks)

    def logits(
        self,
        request: RouteRequest,
        workers: Sequence[str],
        overlaps: dict[str, int] | None = None,
        seq_hashes: Sequence[int] | None = None,
    ) -> dict[str, float]:
        """The KV cost of sending `request` to each worker (lower is better)."""
        if overlaps is None:
            overlaps = self.indexer.find_matches(request.block_hashes)
        if seq_hashes is None:
            seq_hashes = compute_seq_hashes(request.block_hashes)
        num_blocks = max(request.num_blocks, len(request.block_hashes))
        logits = {}
        for worker_id in workers:
            pending_prefill, decode_blocks, queued = self.load.load(worker_id)
            overlap = overlaps.get(worker_id, 0)
            uncached = (num_blocks - overlap + pending_prefill) + self.vision_blocks(
                request, worker_id, overlap
            )
            logits[worker_id] = (
                self.cost.overlap_weight * uncached
                + decode_blocks
                - self.load.shared_prefix(worker_id, seq_hashes)
                + self.cost.queue_weight * queued
            )
        return logits

    def vision_blocks(self, request: RouteRequest, worker_id: str, overlap: int) -> float:
        """The vision-tower work, in blocks of image tokens, that `request` costs a worker that
        encodes, holding `overlap` blocks of it: its items neither in that prefix nor in the
        worker's encoder cache (one that has not told of its cache yet holds none). 0 where no
        worker of the role has published embedding-cache events: they do not encode (a
        deployment's workers of one role all encode, or none)."""
        if not request.media or not self.encoder_index.workers():
            return 0.0
        reused = min(overlap, reusable_blocks(request.num_tokens, self.block_size))
        live = [item for item in request.media if item.end > reused * self.block_size]
        held = self.encoder_index.held_keys(worker_id, [item.key for item in live])
        return sum(item.length for item in live if item.key not in held) / self.block_size

    def on_first_token(self, request_id: str) -> None:
        self.load.on_first_token(request_id)

    def on_finish(self, request_id: str) -> None:
        self.load.on_finish(request_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker that left: its blocks, its embeddings and its in-flight load."""
        self.indexer.remove_worker(worker_id)
        self.encoder_index.remove_worker(worker_id)
        self.load.remove_worker(worker_id)

    def _pick_by_cost(self, logits: dict[str, float]) -> str:
        return pick_by_cost(logits, self.cost.temperature, self._rng)


def pick_by_cost(logits: dict[str, float], temperature: float, rng: random.Random) -> str:
    """The lowest logit, ties broken at random; with a positive temperature, a draw from a
    softmax over the logits normalised to [0, 1]."""
    lowest, highest = min(logits.values()), max(logits.values())
    if temperature == 0 or highest == lowest:
        return rng.choice([w for w, logit in logits.items() if logit == lowest])
    # Normalised so the temperature does not depend on the prompt's size.
    weights = [
        math.exp(-(logit - lowest) / (highest - lowest) / temperature) for logit in logits.values()
    ]
    return rng.choices(list(logits), weights=weights)[0]
