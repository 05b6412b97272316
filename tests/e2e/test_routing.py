"""KV-aware routing over real processes on the mock engine: requests land where their prefix
(images included, by content) is cached, a dead worker leaves the index, and E/P/D routes the
prefill hop by overlap."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.encode_router import scrape_encoders
from mmserve.protocol import EmbeddingPullReply, EmbeddingPullRequest, EncoderItem
from mmserve.runtime import Runtime
from mmserve.tiny.checkpoints import build_tiny_model
from mmserve.topology import PULL_EMBEDDINGS, Role
from tests.support.deployment import Deployment, free_port
from tests.support.images import file_data_url

MOCK = ["--engine", "mock", "--mock-prefill-us-per-token", "50", "--mock-decode-ms-per-token", "1"]
KV = ["--router-mode", "kv"]
LONG_TEXT = " ".join(f"clause {i} of the shared instructions." for i in range(40))


def image_request(url: str, question: str = "What is in this picture?") -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": question},
            ],
        }
    ]


def text_request(question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": LONG_TEXT}, {"role": "user", "content": question}]


class Client:
    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.http = httpx.Client(base_url=deployment.base_url, timeout=60)

    def chat(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        body = {
            "model": self.deployment.model_path.name,
            "messages": messages,
            "max_tokens": 4,
            "temperature": 0,
        }
        response = self.http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    def served_by(self, answer: dict[str, Any], names: list[str]) -> str:
        """The process whose log finished the request."""
        done = [
            name for name in names if f"request {answer['id']} done" in self.deployment.log(name)
        ]
        assert len(done) == 1, f"{answer['id']} finished on {done}"
        return done[0]


def instance_id(deployment: Deployment, name: str) -> str:
    found = re.search(r" ready: instance (\S+),", deployment.log(name))
    assert found is not None
    return found.group(1)


def cached(answer: dict[str, Any]) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


Deploy = Callable[..., Deployment]


@pytest.fixture
def deploy(nats_url: str, tmp_path: Path) -> Iterator[Deploy]:
    """Starts mock-engine workers behind a kv-routing frontend; stops them after the test."""
    started: list[Deployment] = []

    def start(
        pattern: str, components: list[tuple[str, str, list[str]]], frontend: Sequence[str] = ()
    ) -> Deployment:
        deployment = Deployment(
            pattern,
            build_tiny_model("qwen2_vl"),
            nats_url,
            tmp_path,
            frontend_flags=[*KV, *frontend],
            worker_flags=MOCK,
            components=components,
        )
        started.append(deployment.start())
        deployment.wait_ready()
        return deployment

    yield start
    for deployment in started:
        deployment.stop()


def test_kv_routing_follows_cached_images_and_text_and_drops_a_dead_worker(
    deploy: Deploy, image_server: str, image_dir: Path
) -> None:
    workers = [(f"worker{i}", "worker", ["--encode"]) for i in range(3)]
    names = [name for name, _, _ in workers]
    deployment = deploy("agg", workers)
    client = Client(deployment)

    # The same bytes by another URL: the router sends it where the image is cached.
    first = client.chat(image_request(f"{image_server}/photo.jpg"))
    holder = client.served_by(first, names)
    again = client.chat(image_request(file_data_url(image_dir / "photo.jpg")))
    assert client.served_by(again, names) == holder
    image_tokens = first["usage"]["prompt_tokens"] - 30
    assert cached(again) > image_tokens

    # Another image after the same text shares only the blocks before the image.
    other = client.chat(image_request(f"{image_server}/tall.png"))
    assert cached(other) < 32

    # Text alone routes by text.
    text = client.chat(text_request("Summarise them."))
    text_holder = client.served_by(text, names)
    text_again = client.chat(text_request("Now list them."))
    assert client.served_by(text_again, names) == text_holder
    assert cached(text_again) >= 16 * 10

    # The image's worker dies: requests keep succeeding, the router forgets its blocks...
    dead = instance_id(deployment, holder)
    deployment.kill(holder)
    assert client.chat(image_request(f"{image_server}/photo.jpg"))["choices"]
    dropped = re.compile(rf"worker {dead} left: (\d+) cached blocks dropped")
    deadline = time.monotonic() + 30
    while not (found := dropped.search(deployment.log("frontend"))):
        assert time.monotonic() < deadline, "discovery did not drop the killed worker"
        time.sleep(0.2)
    assert int(found.group(1)) > image_tokens // 16
    # ...and sends nothing to it once discovery noticed.
    notice = len(deployment.log("frontend"))
    living = [name for name in names if name != holder]
    for url in (f"{image_server}/photo.jpg", f"{image_server}/small.png"):
        answer = client.chat(image_request(url))
        assert client.served_by(answer, living) in living
    assert dead not in deployment.log("frontend")[notice:]


def test_e_p_d_routes_prefill_to_the_instance_holding_the_prefix(
    deploy: Deploy, image_server: str, image_dir: Path
) -> None:
    components: list[tuple[str, str, list[str]]] = [
        ("encode", "encode", []),
        ("prefill0", "prefill", []),
        ("prefill1", "prefill", []),
        ("decode", "decode", []),
    ]
    deployment = deploy("e_p_d", components)
    client = Client(deployment)
    prefills = ["prefill0", "prefill1"]
    first = client.chat(image_request(f"{image_server}/photo.jpg"))
    holder = client.served_by(first, prefills)
    for question in ("And the colours?", "What is in this picture?"):
        answer = client.chat(image_request(file_data_url(image_dir / "photo.jpg"), question))
        assert client.served_by(answer, prefills) == holder
        assert cached(answer) > 64


def test_encode_routing_follows_the_encoder_cache_and_drops_a_dead_encoder(
    deploy: Deploy, image_server: str, image_dir: Path
) -> None:
    ports = [free_port() for _ in range(3)]
    encoders = [(f"encode{i}", "encode", ["--metrics-port", str(p)]) for i, p in enumerate(ports)]
    names = [name for name, _, _ in encoders]
    deployment = deploy("e_pd", [*encoders, ("worker", "worker", [])])
    client = Client(deployment)

    # The same bytes by another URL: the encode router sends it to the encoder holding it.
    first = client.chat(image_request(f"{image_server}/photo.jpg"))
    holder = client.served_by(first, names)
    for question in ("And now?", "Once more?"):
        again = client.chat(image_request(file_data_url(image_dir / "photo.jpg"), question))
        assert client.served_by(again, names) == holder
    # The frontend counts the image tokens it sent to each encoder, held there or new.
    holder_id = instance_id(deployment, holder)
    routed = {
        (sample.labels["worker"], sample.labels["result"]): sample.value
        for family in text_string_to_metric_families(client.http.get("/metrics").text)
        for sample in family.samples
        if sample.name == "mmserve_router_encode_tokens_total"
    }
    image_tokens = routed[(holder_id, "new")]
    assert image_tokens > 0 and routed[(holder_id, "held")] == 2 * image_tokens
    assert scrape_encoders(ports).misses == 1

    # Every cache empties behind the router's back (its events may not have arrived when the
    # next request is routed): whichever encoder gets the image encodes it again, once.
    assert client.http.post("/reset_prefix_cache").status_code == 200
    after_reset = client.chat(image_request(f"{image_server}/photo.jpg"))
    assert scrape_encoders(ports).misses == 2
    holder = client.served_by(after_reset, names)

    # The holder dies: requests keep succeeding and the router forgets its embeddings.
    dead = instance_id(deployment, holder)
    deployment.kill(holder)
    assert client.chat(image_request(f"{image_server}/photo.jpg"))["choices"]
    dropped = re.compile(rf"encode {dead} left: (\d+) cached embeddings dropped")
    deadline = time.monotonic() + 30
    while not (found := dropped.search(deployment.log("frontend"))):
        assert time.monotonic() < deadline, "discovery did not drop the killed encoder"
        time.sleep(0.2)
    assert int(found.group(1)) == 1
    assert dead not in encode_routed(client)  # its series went with it
    living = [name for name in names if name != holder]
    answer = client.chat(image_request(f"{image_server}/small.png"))
    assert client.served_by(answer, living) in living


# A slow vision tower: pulling is cheaper than encoding, and the first image of `split_images`
# is still encoding when the second is routed.
SLOW_TOWER = ["--mock-encode-us-per-token", "15000"]
PEER_PULL = ["--encode-router-mode", "peer-pull"]


def both_images(image_server: str) -> list[dict[str, Any]]:
    parts = [
        {"type": "image_url", "image_url": {"url": f"{image_server}/{name}"}}
        for name in ("photo.jpg", "small.png")
    ]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Compare them."}]}]


def encode_routed(client: Client) -> dict[str, float]:
    """Image tokens the frontend routed to each encoder so far."""
    routed: dict[str, float] = {}
    for family in text_string_to_metric_families(client.http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "mmserve_router_encode_tokens_total":
                worker = sample.labels["worker"]
                routed[worker] = routed.get(worker, 0) + sample.value
    return routed


def split_images(client: Client, image_server: str, names: list[str]) -> tuple[str, str]:
    """photo.jpg cached on one encoder and small.png on the other: the second is routed while
    the first is encoding, so its encoder's pending work sends it elsewhere. Returns the names
    of (photo's holder, small's holder)."""
    background = Client(client.deployment)
    with ThreadPoolExecutor(1) as pool:
        photo = pool.submit(background.chat, image_request(f"{image_server}/photo.jpg"))
        deadline = time.monotonic() + 30
        while not encode_routed(client):
            assert time.monotonic() < deadline, "the first image was never routed"
            time.sleep(0.02)
        small = client.chat(image_request(f"{image_server}/small.png"))
        holders = client.served_by(photo.result(), names), client.served_by(small, names)
    assert holders[0] != holders[1]
    return holders


def test_an_encoder_pulls_the_embedding_a_peer_holds_instead_of_encoding_it(
    deploy: Deploy, image_server: str
) -> None:
    ports = {f"encode{i}": free_port() for i in range(2)}
    encoders = [(n, "encode", ["--metrics-port", str(p), *SLOW_TOWER]) for n, p in ports.items()]
    deployment = deploy("e_pd_pull", [*encoders, ("worker", "worker", [])], PEER_PULL)
    client = Client(deployment)
    photo_holder, small_holder = split_images(client, image_server, list(ports))

    # Both images: the photo's holder (more tokens held) gets the request and pulls the
    # small image's embedding from its peer; nothing is encoded again.
    pulled = client.chat(both_images(image_server))
    assert client.served_by(pulled, list(ports)) == photo_holder
    requester = scrape_encoders([ports[photo_holder]])
    assert (requester.pulls, requester.failed_pulls) == (1, 0)
    assert scrape_encoders(list(ports.values())).misses == 2

    # The same request with every cache emptied (the router may still expect the small image
    # on its holder: its pull then finds nothing) is encoded again and gives the same tokens.
    assert client.http.post("/reset_prefix_cache").status_code == 200
    encoded = client.chat(both_images(image_server))
    assert encoded["choices"][0]["message"] == pulled["choices"][0]["message"]
    totals = scrape_encoders(list(ports.values()))
    assert totals.pulls == 1 and totals.misses >= 4
    # What a pull that arrives after an eviction finds: nothing, which the puller encodes.
    asked = asyncio.run(ask_for_evicted(deployment, instance_id(deployment, small_holder)))
    assert asked.embeddings == [None]


async def ask_for_evicted(deployment: Deployment, holder: str) -> EmbeddingPullReply:
    async with await Runtime.connect(deployment.nats_url, deployment.namespace) as runtime:
        client = runtime.client(Role.ENCODE.value, PULL_EMBEDDINGS)
        request = EmbeddingPullRequest(
            request_id="evicted", items=[EncoderItem(mm_hash=1, grid_thw=(1, 4, 4))]
        )
        reply: EmbeddingPullReply = await client.call(
            request, EmbeddingPullReply, instance_id=holder, timeout=10
        )
        return reply


def test_a_pull_from_an_encoder_that_died_falls_back_to_encoding(
    deploy: Deploy, image_server: str
) -> None:
    ports = {f"encode{i}": free_port() for i in range(2)}
    encoders = [(n, "encode", ["--metrics-port", str(p), *SLOW_TOWER]) for n, p in ports.items()]
    deployment = deploy("e_pd_pull_dead", [*encoders, ("worker", "worker", [])], PEER_PULL)
    client = Client(deployment)
    photo_holder, small_holder = split_images(client, image_server, list(ports))

    # The small image's holder dies; discovery has not noticed when the request is routed, so
    # the photo's holder is told to pull from it, fails at once, and encodes the image itself.
    deployment.kill(small_holder)
    answer = client.chat(both_images(image_server))
    assert client.served_by(answer, [photo_holder]) == photo_holder
    requester = scrape_encoders([ports[photo_holder]])
    assert (requester.pulls, requester.failed_pulls) == (0, 1)
    assert requester.misses == 2  # the photo earlier, the small image now
