"""Worker selection on synthetic KV events: media-aware overlap, load, modes."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import Counter

import pytest

from mmserve.kv.encoder_events import encoder_key
from mmserve.kv.hashing import compute_seq_hashes
from mmserve.kv.pad import PadScheme
from mmserve.kv.view import routing_view
from mmserve.protocol import (
    EncoderCleared,
    EncoderEntry,
    EncoderStored,
    KvBlock,
    KvStored,
    PlannedMedia,
    RequestPlan,
)
from mmserve.router.indexer import KvIndexer
from mmserve.router.scheduler import (
    KvCostConfig,
    NoWorkersError,
    RouteMedia,
    Router,
    RouteRequest,
    RouterMode,
)

IMAGE_PAD = 151655
WORKERS = ["w0", "w1", "w2", "w3"]
CAT, DOG = 0x1111_2222_3333_4444, 0x5555_6666_7777_8888
_request_ids = itertools.count()


def image(mm_hash: int, offset: int, length: int) -> PlannedMedia:
    return PlannedMedia(mm_hash=mm_hash, offset=offset, length=length, grid_thw=(1, 2, 2 * length))


def prompt(text: list[int], mm_hash: int | None, tail: list[int]) -> RouteRequest:
    media = [image(mm_hash, len(text), 64)] if mm_hash is not None else []
    ids = text + ([IMAGE_PAD] * 64 if mm_hash is not None else []) + tail
    view = routing_view(ids, media)
    return RouteRequest.from_view(f"req-{next(_request_ids)}", view)


def worker_caches(router: Router, worker_id: str, request: RouteRequest) -> None:
    """What the worker's engine reports after prefilling `request`."""
    seq = compute_seq_hashes(request.block_hashes)
    pairs = zip(seq, request.block_hashes, strict=True)
    blocks = [KvBlock(block_hash=s, tokens_hash=t) for s, t in pairs]
    router.indexer.apply_event(worker_id, KvStored(parent_hash=None, blocks=blocks))


SYSTEM = list(range(100, 132))  # two blocks of shared system prompt


def test_same_image_in_two_requests_lands_on_the_same_worker() -> None:
    router = Router(RouterMode.KV, rng=random.Random(0))
    first = prompt(SYSTEM, CAT, [7] * 20)
    chosen = router.select(first, WORKERS)
    router.on_finish(first.request_id)
    worker_caches(router, chosen.worker_id, first)
    # Another request with the same image (same content hash, whatever its URL) and a new
    # question after it.
    second = prompt(SYSTEM, CAT, [9] * 20)
    decision = router.select(second, WORKERS)
    assert decision.worker_id == chosen.worker_id
    # System prompt (2 blocks) + image (64 tokens: 4 blocks); the question differs.
    assert decision.overlap_blocks == 6


def test_a_different_image_is_no_overlap_beyond_the_text() -> None:
    router = Router(RouterMode.KV, rng=random.Random(0))
    cat = prompt(SYSTEM, CAT, [7] * 20)
    worker_caches(router, "w2", cat)
    dog = prompt(SYSTEM, DOG, [7] * 20)
    overlaps = router.indexer.find_matches(dog.block_hashes)
    assert overlaps == {"w2": 2}  # the shared system prompt only
    # Text-only requests with the same prefix still route by text.
    text_only = prompt(SYSTEM + [5] * 16, None, [])
    worker_caches(router, "w1", text_only)
    again = prompt(SYSTEM + [5] * 16, None, [6] * 16)
    assert router.select(again, WORKERS).worker_id == "w1"


def test_overlap_gives_way_to_load() -> None:
    router = Router(RouterMode.KV, rng=random.Random(0))
    cached = prompt(SYSTEM, CAT, [])
    worker_caches(router, "w0", cached)
    # w0 holds the 6 blocks, but is busy with 20 in-flight requests of 6 blocks each.
    for i in range(20):
        router.load.on_dispatch(f"busy-{i}", "w0", prefill_blocks=0, total_blocks=6)
    request = prompt(SYSTEM, CAT, [])
    logits = router.logits(request, WORKERS)
    # w0: 0 uncached + 120 decode blocks; others: 6 uncached + 0 decode.
    assert logits == {"w0": 120.0, "w1": 6.0, "w2": 6.0, "w3": 6.0}
    assert router.select(request, WORKERS).worker_id != "w0"


def test_the_router_counts_its_own_dispatches_until_they_finish() -> None:
    router = Router(RouterMode.KV, rng=random.Random(1))
    request = prompt(SYSTEM, CAT, [])  # 6 blocks, nothing cached anywhere
    chosen = router.select(request, ["w0", "w1"]).worker_id
    assert router.load.load(chosen) == (6, 6, 1)
    # A second identical request goes to the other worker: the first one's prefill is pending.
    other = prompt(SYSTEM, CAT, [])
    assert router.select(other, ["w0", "w1"]).worker_id != chosen
    router.on_first_token(request.request_id)
    assert router.load.load(chosen) == (0, 6, 0)
    router.on_finish(request.request_id)
    router.on_finish(request.request_id)  # idempotent
    assert router.load.load(chosen) == (0, 0, 0)


def test_blocks_that_requests_in_flight_share_count_once() -> None:
    router = Router(RouterMode.KV, rng=random.Random(5))
    # Two questions after the same system prompt on w0 (2 shared blocks + 1 own block each),
    # another 3-block prompt on w1; all past their prefill.
    on_w0 = [prompt(SYSTEM, None, [7] * 16), prompt(SYSTEM, None, [8] * 16)]
    on_w1 = prompt(list(range(500, 548)), None, [])
    for request in on_w0:
        router.select(request, ["w0"])
    router.select(on_w1, ["w1"])
    for request in [*on_w0, on_w1]:
        router.on_first_token(request.request_id)
    assert router.load.load("w0") == (0, 4, 0)
    # A third question after the same system prompt adds 1 block on w0 and 3 on w1:
    # w0 costs 3 uncached + 4 decode - 2 shared, w1 3 uncached + 3 decode.
    third = prompt(SYSTEM, None, [9] * 16)
    assert router.logits(third, ["w0", "w1"]) == {"w0": 5.0, "w1": 6.0}
    assert router.select(third, ["w0", "w1"]).worker_id == "w0"
    for request in [*on_w0, third]:
        router.on_finish(request.request_id)
    assert router.load.load("w0") == (0, 0, 0)


def test_ties_are_broken_at_random() -> None:
    router = Router(RouterMode.KV, rng=random.Random(2))
    picks: Counter[str] = Counter()
    for i in range(400):
        request = RouteRequest(f"r{i}", num_blocks=1)
        picks[router.select(request, WORKERS).worker_id] += 1
        router.on_finish(request.request_id)
    assert set(picks) == set(WORKERS)
    assert min(picks.values()) > 60


def test_temperature_samples_but_prefers_the_cheapest() -> None:
    router = Router(RouterMode.KV, cost=KvCostConfig(temperature=0.5), rng=random.Random(3))
    cached = prompt(SYSTEM, CAT, [])
    worker_caches(router, "w3", cached)
    picks: Counter[str] = Counter()
    for _ in range(400):
        request = prompt(SYSTEM, CAT, [])
        picks[router.select(request, WORKERS).worker_id] += 1
        router.on_finish(request.request_id)
    # Normalised logits: w3 0, others 1 -> weights 1 vs e^-2 each: w3 ~71% of picks.
    assert picks["w3"] > 220
    assert len(picks) > 1


def test_round_robin_and_random_modes() -> None:
    round_robin = Router(RouterMode.ROUND_ROBIN)
    order = [round_robin.select(RouteRequest(f"r{i}"), WORKERS).worker_id for i in range(8)]
    assert order == WORKERS * 2
    rand = Router(RouterMode.RANDOM, rng=random.Random(4))
    picks = Counter(rand.select(RouteRequest(f"r{i}"), WORKERS).worker_id for i in range(200))
    assert set(picks) == set(WORKERS)


def test_removed_worker_loses_blocks_and_load() -> None:
    router = Router(RouterMode.KV, indexer=KvIndexer(), rng=random.Random(5))
    request = prompt(SYSTEM, CAT, [])
    worker_caches(router, "w0", request)
    router.load.on_dispatch("x", "w0", prefill_blocks=3, total_blocks=3)
    router.remove_worker("w0")
    assert router.indexer.find_matches(request.block_hashes) == {}
    assert router.load.load("w0") == (0, 0, 0)
    assert router.load.in_flight() == 0


def test_request_for_uses_the_routers_block_size_and_pad_scheme() -> None:
    router = Router(block_size=4, pad_scheme=PadScheme.SGLANG_WIDE)
    plan = RequestPlan(
        token_ids=[*SYSTEM, *[IMAGE_PAD] * 10, 7], media=[image(CAT, len(SYSTEM), 10)]
    )
    request = router.request_for("r", plan, lora_name="x")
    view = routing_view(plan.token_ids, plan.media, scheme=PadScheme.SGLANG_WIDE)
    expected = RouteRequest.from_view("r", view, block_size=4, lora_name="x")
    item = RouteMedia(encoder_key(CAT, plan.media[0].grid_thw), 10, len(SYSTEM) + 10)
    assert request == dataclasses.replace(expected, media=[item])
    assert request.num_blocks == -(-(32 + 10 + 1) // 4)


def test_no_workers_is_an_error() -> None:
    with pytest.raises(NoWorkersError):
        Router().select(RouteRequest("r"), [])


def test_negative_weights_are_refused() -> None:
    with pytest.raises(ValueError):
        KvCostConfig(overlap_weight=-1)


def test_a_worker_that_encodes_is_weighed_by_the_embeddings_its_encoder_cache_holds() -> None:
    """Two workers that encode hold the same text prefix; the one whose encoder cache holds
    the image (its embedding-cache events say so) saves the vision tower and gets the request,
    until the other holds every token of the image in its KV cache: then neither encodes it,
    and the longer prefix wins. A worker that has not told of its encoder cache yet holds
    nothing there; where no worker told of one, none encodes and images cost nothing."""
    router = Router(RouterMode.KV, rng=random.Random(0))
    media = [image(CAT, len(SYSTEM), 64)]
    ids = SYSTEM + [IMAGE_PAD] * 64 + [7] * 20
    plan = RequestPlan(token_ids=ids, media=media)
    text_only = prompt(SYSTEM, None, [])
    for worker_id in ("w0", "w1"):
        worker_caches(router, worker_id, text_only)
    router.encoder_index.apply_event("w0", EncoderCleared())
    entry = EncoderEntry(mm_hash=CAT, grid_thw=media[0].grid_thw, num_tokens=64)
    router.encoder_index.apply_event("w1", EncoderStored(entries=[entry]))

    request = router.request_for("cat", plan)
    # Eight blocks, two cached on each; the image's 64 tokens are four blocks of encoding.
    assert router.logits(request, ["w0", "w1"]) == {"w0": 6 + 4.0, "w1": 6.0}
    assert router.select(request, ["w0", "w1"]).worker_id == "w1"
    router.on_finish("cat")
    assert router.logits(request, ["w2"]) == {"w2": 8 + 4.0}  # a fresh one: nothing held
    assert Router(RouterMode.KV).logits(request, ["w2"]) == {"w2": 8.0}  # nobody encodes

    worker_caches(router, "w0", request)  # every block, the image's included
    assert router.logits(request, ["w0", "w1"]) == {"w0": 1.0, "w1": 6.0}
