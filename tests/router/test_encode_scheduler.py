"""Encode worker selection by the embeddings each encoder holds, against its pending work."""

from __future__ import annotations

import random

from mmserve.kv.encoder_events import encoder_key
from mmserve.protocol import EncoderEntry, EncoderStored
from mmserve.router.encode_scheduler import EncodeRouter, EncodeRouterMode

WORKERS = ["e0", "e1", "e2", "e3"]
IMAGE = (encoder_key(11, (1, 32, 32)), 256)
OTHER = (encoder_key(12, (1, 32, 32)), 256)


def holding(worker: str, *items: tuple[tuple[int, tuple[int, int, int]], int]) -> EncodeRouter:
    router = EncodeRouter(rng=random.Random(0))
    entries = [EncoderEntry(mm_hash=k[0], grid_thw=k[1], num_tokens=n) for k, n in items]
    router.index.apply_event(worker, EncoderStored(entries=entries))
    return router


def test_the_encoder_holding_the_image_gets_it() -> None:
    router = holding("e2", IMAGE)
    decision = router.select("r", [IMAGE, OTHER], WORKERS)
    assert (decision.worker_id, decision.held_tokens, decision.request_tokens) == ("e2", 256, 512)
    assert router.pending("e2") == (256, 1)  # only the tokens it does not hold
    router.on_first_token("r")
    assert router.pending("e2") == (0, 0)


def test_a_busy_holder_loses_to_an_idle_encoder_once_its_queue_costs_more() -> None:
    router = holding("e2", IMAGE)
    for n in range(2):  # each books 2 x 256 uncached tokens on e2... until it is the dearest
        router.select(f"busy{n}", [OTHER, (encoder_key(100 + n, (1, 64, 32)), 512)], ["e2"])
    assert router.select("r", [IMAGE], WORKERS).worker_id != "e2"


def test_a_burst_of_new_images_spreads_over_the_encoders() -> None:
    router = EncodeRouter(rng=random.Random(0))
    chosen = {
        router.select(f"r{n}", [(encoder_key(n, (1, 32, 32)), 256)], WORKERS).worker_id
        for n in range(4)
    }
    assert chosen == set(WORKERS)


def test_round_robin_ignores_the_caches() -> None:
    router = holding("e2", IMAGE)
    router.mode = EncodeRouterMode.ROUND_ROBIN
    picks = [router.select(f"r{n}", [IMAGE], WORKERS).worker_id for n in range(5)]
    assert picks == [*WORKERS, "e0"]


def test_a_removed_encoder_leaves_the_index_and_its_load() -> None:
    router = holding("e2", IMAGE)
    router.select("r", [IMAGE], ["e2"])
    router.remove_worker("e2")
    assert router.index.held_tokens([IMAGE]) == {}
    assert router.pending("e2") == (0, 0)
    router.on_finish("r")  # a request of the gone worker ends later: nothing to release


def test_requests_in_flight_with_one_new_image_share_its_encoder() -> None:
    router = EncodeRouter(rng=random.Random(0))
    first = router.select("a", [IMAGE], WORKERS).worker_id
    # Before any event says so, the second finds the image on its way into first's cache.
    second = router.select("b", [IMAGE], WORKERS)
    assert (second.worker_id, second.held_tokens) == (first, 256)
    router.on_first_token("a")
    router.on_first_token("b")
    assert router.held_tokens([IMAGE], WORKERS) == {}  # only its events can say so now


def test_peer_pull_names_a_peer_for_each_item_the_chosen_encoder_lacks() -> None:
    router = holding("e2", IMAGE)
    router.index.apply_event(
        "e1",
        EncoderStored(entries=[EncoderEntry(mm_hash=12, grid_thw=(1, 32, 32), num_tokens=256)]),
    )
    decision = router.select("r", [IMAGE, OTHER], WORKERS)
    assert decision.worker_id in ("e1", "e2")  # each holds half
    holders = router.peer_holders("r", [IMAGE, OTHER], decision.worker_id, WORKERS)
    missing = OTHER if decision.worker_id == "e2" else IMAGE
    assert holders == {missing[0]: "e1" if decision.worker_id == "e2" else "e2"}
    # A peer that left is not named; an item nobody else holds needs no peer.
    assert router.peer_holders("r", [IMAGE, OTHER], decision.worker_id, [decision.worker_id]) == {}


def test_an_item_already_encoding_on_the_chosen_encoder_is_not_pulled() -> None:
    router = holding("e1", OTHER)
    router.select("first", [IMAGE], ["e0"])  # e0 will hold IMAGE once encoded
    assert router.peer_holders("second", [IMAGE, OTHER], "e0", WORKERS) == {OTHER[0]: "e1"}
