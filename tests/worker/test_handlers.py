"""The worker and encode handlers, in one process over a real nats-server: each role's handler
on its own runtime, the mock engine on the tiny Qwen2-VL (no simulated time) and the inline
transfer backend, driven with planned requests as the frontend builds them; and the frontend's
NATS dispatcher asking every instance to clear its caches (`POST /reset_prefix_cache`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
import torch
from prometheus_client import REGISTRY

from mmserve import media, protocol
from mmserve.encode.embeddings import offer_embeddings
from mmserve.encode.stage import EncodeStage
from mmserve.engines.base import Engine, EngineOverloaded, EngineRequest, ItemEmbedding
from mmserve.engines.mock import MockEngine
from mmserve.frontend.nats_dispatch import NatsDispatcher
from mmserve.kv.view import reusable_blocks
from mmserve.media import MediaPolicy
from mmserve.models.family import resolve_model_spec
from mmserve.protocol import (
    MediaPayload,
    PrefillReply,
    PrefillRequest,
    PreprocessedRequest,
    SamplingParams,
    StopConditions,
    TokenChunk,
)
from mmserve.runtime import RemoteError, Runtime, Unavailable
from mmserve.runtime.discovery import DISCOVERY_GRACE
from mmserve.tiny.checkpoints import build_tiny_model
from mmserve.topology import GENERATE, Role
from mmserve.transfer import DEFAULT_INLINE_THRESHOLD, TransferAgent, create_transfer_agent
from mmserve.worker.endpoints import ENDPOINTS, Endpoints, serve_role
from mmserve.worker.publishers import (
    EncoderEventPublisher,
    KvEventPublisher,
    publish_encoder_events,
    publish_kv_events,
)
from tests.support.images import photo_like, png_bytes
from tests.support.waiting import wait_until_async

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]

NO_SIMULATED_TIME = {
    "prefill_us_per_token": 0.0,
    "decode_ms_per_token": 0.0,
    "encode_us_per_token": 0.0,
}
MAX_TOKENS = 8
# Small images (a few tokens each) of different sizes, so their grids differ.
IMAGES = {
    "wide": png_bytes(photo_like(84, 56, seed=1)),
    "tall": png_bytes(photo_like(56, 112, seed=2)),
    "wide_other": png_bytes(photo_like(84, 56, seed=3)),  # same size as "wide", other pixels
}


def inline_transfer() -> TransferAgent:
    args = argparse.Namespace(
        transfer="inline", transfer_inline_threshold=DEFAULT_INLINE_THRESHOLD, transfer_timeout=5.0
    )
    return create_transfer_agent(args)


@dataclass
class InProcess:
    """Handlers of one namespace, each on its own runtime, as their processes would be; and a
    runtime for the test to call them from."""

    nats_url: str
    model_path: Path
    namespace: str = field(default_factory=lambda: f"handlers-{uuid.uuid4().hex[:8]}")
    runtimes: list[Runtime] = field(default_factory=list)
    transfers: list[TransferAgent] = field(default_factory=list)
    handlers: dict[Role, Endpoints] = field(default_factory=dict)
    publishers: list[KvEventPublisher | EncoderEventPublisher] = field(default_factory=list)
    _caller: Runtime | None = None

    async def runtime(self) -> Runtime:
        runtime = await Runtime.connect(self.nats_url, self.namespace, idle_timeout=10.0)
        self.runtimes.append(runtime)
        return runtime

    async def start(
        self, role: Role, engine: Engine, *, encode: bool = False, kv_events: bool = False
    ) -> Endpoints:
        """Serve `role`'s handler (with an encode stage if `encode`, publishing the engine's
        KV events if `kv_events`, and its embedding-cache events too if it also encodes) and
        wait until a caller on the namespace sees it registered."""
        transfer = inline_transfer()
        self.transfers.append(transfer)
        stage = EncodeStage(engine, transfer, self.model_path, role.value) if encode else None
        runtime = await self.runtime()
        if kv_events:
            self.publishers.append(await publish_kv_events(runtime, engine, role.value))
            if encode:
                self.publishers.append(await publish_encoder_events(runtime, engine, role.value))
        handler = await serve_role(role, runtime, engine, transfer, stage)
        self.handlers[role] = handler
        caller = await self.caller()

        async def registered() -> bool:
            instances = await caller.list_instances(role.value, GENERATE)
            return handler.runtime.instance_id in {i.instance_id for i in instances}

        await wait_until_async(registered, what=f"{role} registered")
        return handler

    async def caller(self) -> Runtime:
        if self._caller is None:
            self._caller = await self.runtime()
        return self._caller

    async def stream(self, role: Role, request: PreprocessedRequest) -> list[TokenChunk]:
        caller = await self.caller()
        replies = caller.client(role.value, GENERATE).stream(
            request, TokenChunk, request_id=request.request_id, deadline=request.deadline
        )
        async with contextlib.aclosing(replies):
            return [chunk async for chunk in replies]

    async def close(self) -> None:
        for publisher in self.publishers:
            await publisher.stop()
        for runtime in reversed(self.runtimes):
            with contextlib.suppress(Exception):
                await runtime.shutdown(graceful_timeout=1.0)
        for transfer in self.transfers:
            await transfer.close()


@dataclass(frozen=True)
class Prompts:
    """Planned requests as the frontend makes them: chat template, tokenization, one run of
    the driver (sized from headers, bytes kept to travel on)."""

    tokenizer: Any
    spec: Any

    async def planned(
        self, images: Sequence[bytes], text: str = "What is in the picture?"
    ) -> media.PlannedRequest:
        content: list[dict[str, str]] = [{"type": "image"} for _ in images]
        content.append({"type": "text", "text": text})
        prompt = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        token_ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return await media.plan_request(
            self.spec, token_ids, list(images), MediaPolicy(), count_only=True, keep_bytes=True
        )

    async def request(
        self, images: Sequence[bytes], *, payload_bytes: Sequence[bytes] | None = None, **kw: Any
    ) -> PreprocessedRequest:
        """The request for `images`; `payload_bytes` replaces the bytes that travel with it."""
        planned = await self.planned(images, **kw)
        data = planned.data if payload_bytes is None else list(payload_bytes)
        return PreprocessedRequest(
            request_id=uuid.uuid4().hex,
            deadline=time.time() + 30,
            model="tiny",
            plan=planned.plan,
            payloads=[MediaPayload(data=d) for d in data],
            sampling=SamplingParams(temperature=0.0),
            stop=StopConditions(max_tokens=MAX_TOKENS),
        )


@pytest.fixture(scope="module")
def model_path() -> Path:
    return build_tiny_model("qwen2_vl")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(model_path: Path) -> AsyncIterator[list[MockEngine]]:
    """One engine per serving handler: agg, bare worker, E/P/D's encode, prefill, decode."""
    # Imported here first: transformers' lazy imports race when threads make them at once.
    from transformers import AutoTokenizer  # noqa: F401

    loaded = await asyncio.gather(
        *(MockEngine.load(model_path, **NO_SIMULATED_TIME) for _ in range(5))
    )
    yield list(loaded)
    for engine in loaded:
        await engine.close()


@pytest.fixture(scope="module")
def prompts(model_path: Path, engines: list[MockEngine]) -> Prompts:
    return Prompts(tokenizer=engines[0].tokenizer, spec=resolve_model_spec(model_path).core)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def agg(
    nats_url: str, model_path: Path, engines: list[MockEngine]
) -> AsyncIterator[InProcess]:
    """`worker --encode`."""
    deployment = InProcess(nats_url, model_path)
    try:
        await deployment.start(Role.WORKER, engines[0], encode=True)
        yield deployment
    finally:
        await deployment.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bare_worker(
    nats_url: str, model_path: Path, engines: list[MockEngine]
) -> AsyncIterator[InProcess]:
    """`worker` without `--encode` and no encode worker."""
    deployment = InProcess(nats_url, model_path)
    try:
        await deployment.start(Role.WORKER, engines[1])
        yield deployment
    finally:
        await deployment.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def e_p_d(
    nats_url: str, model_path: Path, engines: list[MockEngine]
) -> AsyncIterator[InProcess]:
    """encode + prefill + decode; encode last, so its watchers start with the language hop."""
    deployment = InProcess(nats_url, model_path)
    try:
        await deployment.start(Role.PREFILL, engines[3])
        await deployment.start(Role.DECODE, engines[4])
        await deployment.start(Role.ENCODE, engines[2], encode=True)
        yield deployment
    finally:
        await deployment.close()


def requests_seen(component: str) -> float:
    return REGISTRY.get_sample_value("mmserve_requests_total", {"component": component}) or 0.0


def completion(chunks: list[TokenChunk]) -> list[int]:
    return [token for chunk in chunks for token in chunk.token_ids]


def assert_complete(chunks: list[TokenChunk], request: PreprocessedRequest) -> None:
    """One token per chunk, the finish reason and usage on the last chunk only."""
    assert chunks, "no chunks"
    assert all(chunk.request_id == request.request_id for chunk in chunks)
    assert all(chunk.finish_reason is None and chunk.usage is None for chunk in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason in ("stop", "length")
    assert last.usage is not None
    assert last.usage.prompt_tokens == len(request.plan.token_ids)
    assert last.usage.completion_tokens == len(completion(chunks))
    # Mock tokens are ordinary vocabulary ids, never EOS: the budget ends the stream.
    assert (last.finish_reason, len(completion(chunks))) == ("length", MAX_TOKENS)


IMAGE_SETS = {
    "no_image": [],
    "one_image": ["wide"],
    "two_images": ["wide", "tall"],
}


@pytest.mark.parametrize(
    "names", [IMAGE_SETS["one_image"], IMAGE_SETS["two_images"]], ids=["one_image", "two_images"]
)
async def test_the_aggregated_worker_encodes_and_streams_a_planned_request(
    agg: InProcess, prompts: Prompts, names: list[str]
) -> None:
    request = await prompts.request([IMAGES[name] for name in names])
    assert len(request.plan.media) == len(names)
    assert all(item.length > 0 for item in request.plan.media)
    chunks = await agg.stream(Role.WORKER, request)
    assert_complete(chunks, request)


@pytest.mark.parametrize("names", list(IMAGE_SETS.values()), ids=list(IMAGE_SETS))
async def test_e_p_d_gives_the_aggregated_tokens(
    agg: InProcess, e_p_d: InProcess, prompts: Prompts, names: list[str]
) -> None:
    request = await prompts.request([IMAGES[name] for name in names])
    before = {role: requests_seen(role.value) for role in ENDPOINTS}
    reference = await agg.stream(Role.WORKER, request)
    chunks = await e_p_d.stream(Role.ENCODE, request)
    assert_complete(chunks, request)
    assert completion(chunks) == completion(reference)
    assert chunks[-1].usage == msgspec.structs.replace(
        reference[-1].usage, cached_tokens=chunks[-1].usage.cached_tokens
    )
    # Each handler ran the request once: the tokens came through encode, decode and prefill.
    assert {role: requests_seen(role.value) - before[role] for role in ENDPOINTS} == dict.fromkeys(
        ENDPOINTS, 1.0
    )


async def test_the_same_images_in_another_order_give_other_tokens(
    agg: InProcess, prompts: Prompts
) -> None:
    """The mock's tokens depend on the media, so the equality above means something."""
    forward = await prompts.request([IMAGES["wide"], IMAGES["tall"]])
    backward = await prompts.request([IMAGES["tall"], IMAGES["wide"]])
    other = await prompts.request([IMAGES["wide_other"], IMAGES["tall"]])
    tokens = [completion(await agg.stream(Role.WORKER, r)) for r in (forward, backward, other)]
    assert len({tuple(t) for t in tokens}) == 3


@pytest.mark.parametrize("entry", [Role.WORKER, Role.DECODE])
async def test_a_worker_that_does_not_encode_refuses_unencoded_media_as_unavailable(
    bare_worker: InProcess, e_p_d: InProcess, prompts: Prompts, entry: Role
) -> None:
    """A worker without `--encode` (or decode's prefill worker, which never encodes in
    E/P/D) that gets media still as bytes says the deployment lacks an encoder."""
    deployment = bare_worker if entry is Role.WORKER else e_p_d
    request = await prompts.request([IMAGES["wide"]])
    with pytest.raises(RemoteError) as raised:
        await deployment.stream(entry, request)
    assert raised.value.code == protocol.ERROR_UNAVAILABLE
    assert "does not encode media" in raised.value.message
    # Text-only requests need no encoder and still work.
    text_only = await prompts.request([])
    assert_complete(await deployment.stream(entry, text_only), text_only)


@pytest.mark.parametrize("entry", [Role.WORKER, Role.ENCODE])
@pytest.mark.parametrize("swapped_in", ["wide_other", "tall"], ids=["same_size", "other_size"])
async def test_an_encode_stage_names_bytes_that_do_not_match_the_plan_and_serves_on(
    agg: InProcess, e_p_d: InProcess, prompts: Prompts, entry: Role, swapped_in: str
) -> None:
    deployment = agg if entry is Role.WORKER else e_p_d
    # An image no other request sent: a worker whose prefix cache held its tokens would not
    # encode it, nor read the bytes.
    seed = 10 + 2 * ["wide_other", "tall"].index(swapped_in) + (entry is Role.ENCODE)
    unseen = png_bytes(photo_like(84, 56, seed=seed))
    request = await prompts.request([unseen], payload_bytes=[IMAGES[swapped_in]])
    planned = request.plan.media[0]
    with pytest.raises(RemoteError) as raised:
        await deployment.stream(entry, request)
    message = raised.value.message
    assert "media item 0" in message and "the plan says" in message, message
    assert planned.mm_hash_hex in message and str(planned.grid_thw) in message, message
    assert raised.value.status >= 500, raised.value  # the pipeline's fault, not the client's
    good = await prompts.request([IMAGES["wide"]])
    assert_complete(await deployment.stream(entry, good), good)


async def offered_embeddings(
    transfer: TransferAgent, request: PreprocessedRequest, extra_rows: int
) -> list[MediaPayload]:
    """Payloads with embeddings of `extra_rows` more rows than the plan gives each item."""
    items = [
        ItemEmbedding(item.mm_hash, item.grid_thw, torch.zeros((item.length + extra_rows, 8)))
        for item in request.plan.media
    ]
    handles, _leases = await offer_embeddings(transfer, items)
    return [MediaPayload.precomputed(handle) for handle in handles]


@pytest.mark.parametrize("entry", [Role.DECODE, Role.PREFILL])
async def test_a_prefill_the_engine_rejects_is_a_server_error(
    e_p_d: InProcess, prompts: Prompts, entry: Role
) -> None:
    """Embeddings whose rows do not fit the plan: the engine refuses the prefill, and the
    caller sees the worker's fault (5xx), never a client's 400."""
    transfer = inline_transfer()
    request = await prompts.request([IMAGES["wide"]])
    bad = msgspec.structs.replace(
        request, payloads=await offered_embeddings(transfer, request, extra_rows=1)
    )
    caller = await e_p_d.caller()
    with pytest.raises(RemoteError) as raised:
        if entry is Role.DECODE:
            await e_p_d.stream(Role.DECODE, bad)
        else:
            replies = caller.client(Role.PREFILL.value, GENERATE).stream(
                PrefillRequest(request=bad), PrefillReply, deadline=bad.deadline
            )
            async with contextlib.aclosing(replies):
                _ = [reply async for reply in replies]
    assert raised.value.code == protocol.ERROR_INTERNAL, raised.value
    assert raised.value.status == 500
    assert "embedding has" in raised.value.message, raised.value.message
    # Embeddings that fit go through.
    fitting = msgspec.structs.replace(
        request, payloads=await offered_embeddings(transfer, request, extra_rows=0)
    )
    assert_complete(await e_p_d.stream(Role.DECODE, fitting), fitting)
    await transfer.close()


async def fresh_engines(model_path: Path, count: int) -> list[MockEngine]:
    """Engines of one test's own, so the caches it clears are no other test's."""
    return list(
        await asyncio.gather(
            *(MockEngine.load(model_path, **NO_SIMULATED_TIME) for _ in range(count))
        )
    )


async def test_reset_prefix_cache_clears_every_instance_and_the_routers_index(
    nats_url: str, model_path: Path, prompts: Prompts
) -> None:
    """E/P/D behind the frontend's dispatcher: a request fills prefill's cache and the
    frontend's index of it; the reset empties both, and the repeat runs cold."""
    engines = await fresh_engines(model_path, 3)
    deployment = InProcess(nats_url, model_path)
    dispatcher: NatsDispatcher | None = None
    try:
        prefill = await deployment.start(Role.PREFILL, engines[0], kv_events=True)
        await deployment.start(Role.DECODE, engines[1])
        await deployment.start(Role.ENCODE, engines[2], encode=True)
        dispatcher = await NatsDispatcher.start(await deployment.runtime())
        assert dispatcher.ready()
        index = dispatcher.routers[Role.PREFILL].indexer
        prefill_id = prefill.runtime.instance_id

        request = await prompts.request([IMAGES["wide"]])
        first = [chunk async for chunk in dispatcher.generate(request)]
        assert_complete(first, request)
        blocks = engines[0].prefix_cache.num_blocks
        assert blocks > 0
        await wait_until_async(
            lambda: index.num_blocks(prefill_id) == blocks, what="the index holds prefill's blocks"
        )

        assert await dispatcher.reset_prefix_cache() == 3  # encode, prefill and decode

        assert engines[0].prefix_cache.num_blocks == 0
        await wait_until_async(
            lambda: index.num_blocks(prefill_id) == 0, what="the index drops prefill's blocks"
        )
        again_request = msgspec.structs.replace(request, request_id=uuid.uuid4().hex)
        again = [chunk async for chunk in dispatcher.generate(again_request)]
        assert again[-1].usage is not None and again[-1].usage.cached_tokens == 0
        assert completion(again) == completion(first)
    finally:
        if dispatcher is not None:
            await dispatcher.stop()
        await deployment.close()
        for engine in engines:
            await engine.close()


async def test_an_encoder_waits_for_the_language_worker_that_starts_just_after_it(
    nats_url: str, model_path: Path, prompts: Prompts
) -> None:
    """A request reaching an encoder before its language worker is listed (the worker has just
    started, or its record expired while its event loop stalled) waits for it; with none at
    all, it is refused as unavailable once the grace has passed."""
    engines = await fresh_engines(model_path, 2)
    deployment = InProcess(nats_url, model_path)
    try:
        await deployment.start(Role.ENCODE, engines[0], encode=True)
        request = await prompts.request([IMAGES["wide"]])
        started = time.monotonic()
        with pytest.raises(RemoteError) as raised:
            await deployment.stream(Role.ENCODE, request)
        assert raised.value.code == protocol.ERROR_UNAVAILABLE
        assert "registered to take encoded requests" in raised.value.message
        assert time.monotonic() - started >= DISCOVERY_GRACE

        # The request is sent first; the worker registers while the encoder waits (its
        # registration takes several round trips to nats-server, the request one).
        again = msgspec.structs.replace(request, request_id=uuid.uuid4().hex)
        chunks, _ = await asyncio.gather(
            deployment.stream(Role.ENCODE, again), deployment.start(Role.WORKER, engines[1])
        )
        assert_complete(chunks, again)
    finally:
        await deployment.close()
        for engine in engines:
            await engine.close()


async def test_a_reset_names_the_instances_that_failed_or_timed_out(
    nats_url: str, model_path: Path
) -> None:
    """Three workers: one clears, one is busy, one never answers; the reset waits for all,
    then fails naming the two (with their codes); the one that could clear did."""
    engines = await fresh_engines(model_path, 3)
    ok, busy, stuck = engines

    async def refuse() -> protocol.CachesCleared:
        raise EngineOverloaded("busy with requests")

    async def hang() -> protocol.CachesCleared:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    busy.clear_caches = refuse  # type: ignore[method-assign]
    stuck.clear_caches = hang  # type: ignore[method-assign]
    await ok.prefill(EngineRequest("warm", tuple(range(1000, 1049))))  # 3 blocks cached
    deployment = InProcess(nats_url, model_path)
    dispatcher: NatsDispatcher | None = None
    try:
        empty = await NatsDispatcher.start(await deployment.runtime())
        with pytest.raises(Unavailable, match="no instance is deployed"):
            await empty.reset_prefix_cache()
        await empty.stop()
        handlers = [await deployment.start(Role.WORKER, engine) for engine in engines]
        ok_id, busy_id, stuck_id = (handler.runtime.instance_id for handler in handlers)
        dispatcher = await NatsDispatcher.start(await deployment.runtime())
        with pytest.raises(RemoteError) as raised:
            await dispatcher.reset_prefix_cache(timeout=0.5)
        error = raised.value
        assert (error.code, error.status) == (protocol.ERROR_CACHE_RESET_FAILED, 503)
        assert error.message.startswith("2 of 3 instances did not clear their caches"), error
        assert f"worker {busy_id}: [unavailable] busy with requests" in error.message, error
        assert f"worker {stuck_id}: [deadline_exceeded]" in error.message, error
        assert ok_id not in error.message
        assert ok.prefix_cache.num_blocks == 0
    finally:
        if dispatcher is not None:
            await dispatcher.stop()
        await deployment.close()
        for engine in engines:
            await engine.close()


def skipped_items(handler: Endpoints, result: str) -> float:
    labels = {"component": handler.component, "worker": handler.runtime.instance_id}
    value = REGISTRY.get_sample_value(
        "mmserve_encoder_skipped_items_total", labels | {"result": result}
    )
    return value or 0.0


def lookups(engine: MockEngine) -> int:
    return sum(engine.encoder_cache.stats())


async def test_a_worker_that_encodes_skips_an_image_its_own_prefix_cache_holds(
    agg: InProcess, engines: list[MockEngine], prompts: Prompts
) -> None:
    """A request nobody marked (Dynamo's router, a round-robin one): the worker finds the
    image's tokens in its own prefix cache and neither encodes it nor looks it up again, with
    the same tokens; once the cache is cleared it encodes the image again."""
    worker, engine = agg.handlers[Role.WORKER], engines[0]
    image = png_bytes(photo_like(84, 56, seed=40))
    first = await prompts.request([image])
    tokens = await agg.stream(Role.WORKER, first)
    assert_complete(tokens, first)
    looked_up, skipped = lookups(engine), skipped_items(worker, "skipped")
    again = await agg.stream(Role.WORKER, await prompts.request([image]))
    assert [c.token_ids for c in again] == [c.token_ids for c in tokens]
    usage = again[-1].usage
    assert usage is not None and usage.cached_tokens >= first.plan.media[0].end
    assert lookups(engine) == looked_up
    assert skipped_items(worker, "skipped") == skipped + 1
    await engine.clear_caches()
    third = await prompts.request([image])
    assert_complete(await agg.stream(Role.WORKER, third), third)
    assert lookups(engine) == looked_up + 1 and skipped_items(worker, "skipped") == skipped + 1


@pytest.mark.parametrize("pattern", ["e_pd", "e_p_d"])
async def test_the_frontend_sends_a_request_whose_image_the_prefix_cache_holds_past_encode(
    nats_url: str, model_path: Path, prompts: Prompts, pattern: str
) -> None:
    """E/PD and E/P/D behind the frontend's dispatcher: once the KV events of the worker that
    prefills (E/PD's worker, E/P/D's prefill) show it holds every token of an image, a
    request showing that image after the same prefix has nothing left to encode
    (`ItemState.SKIPPED`): it goes straight to the language hop, never reaching the encode
    worker, which looks nothing up; the prefilling worker serves the image from its prefix
    cache, counts it skipped, and answers with the tokens the request gets through the encode
    worker with its image encoded."""
    engines = await fresh_engines(model_path, 3)
    encoder_engine, prefill_engine, decode_engine = engines
    deployment = InProcess(nats_url, model_path)
    dispatcher: NatsDispatcher | None = None
    try:
        if pattern == "e_pd":
            language = await deployment.start(Role.WORKER, prefill_engine, kv_events=True)
        else:
            language = await deployment.start(Role.PREFILL, prefill_engine, kv_events=True)
            await deployment.start(Role.DECODE, decode_engine)
        await deployment.start(Role.ENCODE, encoder_engine, encode=True)
        dispatcher = await NatsDispatcher.start(await deployment.runtime())
        # As a frontend's /health: the workers in this process heartbeat from the test's own
        # loop, and a loop starved past the lease hides them from discovery for a moment.
        await wait_until_async(dispatcher.ready, what="discovery holds the workers")
        index = dispatcher.routers[language.core.role].indexer
        language_id = language.runtime.instance_id

        question = "Look closely at this picture and say what is in it, in a few words"
        first = await prompts.request([IMAGES["wide"]], text=f"{question}.")
        assert_complete([c async for c in dispatcher.generate(first)], first)
        assert first.plan.media[0].end <= 32  # inside the two blocks every request here shares
        await wait_until_async(
            lambda: index.num_blocks(language_id) == prefill_engine.prefix_cache.num_blocks > 0,
            what="the index holds the prefilling worker's blocks",
        )
        looked_up = lookups(encoder_engine)
        encodes = requests_seen(Role.ENCODE.value)

        second = await prompts.request([IMAGES["wide"]], text=f"{question}, and its colour?")
        chunks = [c async for c in dispatcher.generate(second)]
        assert_complete(chunks, second)
        assert chunks[-1].usage is not None and chunks[-1].usage.cached_tokens >= 16
        assert requests_seen(Role.ENCODE.value) == encodes  # straight to the language hop
        assert lookups(encoder_engine) == looked_up  # not encoded, nor even looked up
        assert skipped_items(language, "skipped") == 1
        assert skipped_items(language, "encoded") == 0

        # Another image after the same text is not held: it goes through the encode worker.
        other = await prompts.request([IMAGES["tall"]], text=f"{question}, and its colour?")
        assert_complete([c async for c in dispatcher.generate(other)], other)
        assert requests_seen(Role.ENCODE.value) == encodes + 1
        assert lookups(encoder_engine) == looked_up + 1
        assert skipped_items(language, "skipped") == 1

        # The held request sent through the encode worker, its image encoded: the same tokens.
        encoded = msgspec.structs.replace(second, request_id="encoded")
        assert completion(await deployment.stream(Role.ENCODE, encoded)) == completion(chunks)
        assert requests_seen(Role.ENCODE.value) == encodes + 2
    finally:
        if dispatcher is not None:
            await dispatcher.stop()
        await deployment.close()
        for engine in engines:
            await engine.close()


LARGE_IMAGE = png_bytes(photo_like(224, 448, seed=4))  # 128 tokens: eight blocks


async def hold_prefix(engine: MockEngine, request: PreprocessedRequest, tokens: int) -> None:
    """Fill `engine`'s prefix cache with the first `tokens` of `request`'s prompt (its image
    cut there), as an earlier request that ended there would."""
    item = request.plan.media[0]
    cut = msgspec.structs.replace(item, length=tokens - item.offset)
    rows = torch.zeros((cut.length, 8))
    # One token past them, which runs: every block of `tokens` is cached.
    await engine.prefill(
        EngineRequest("earlier", tuple(request.plan.token_ids[: tokens + 1]), media=(cut,)),
        [ItemEmbedding(item.mm_hash, item.grid_thw, rows)],
    )


@pytest.mark.parametrize("pattern", ["agg", "e_pd", "e_p_d"])
async def test_a_skipped_image_the_prefix_cache_dropped_is_encoded_after_all(
    nats_url: str, model_path: Path, prompts: Prompts, pattern: str
) -> None:
    """A request routed with its image skipped (`ItemState.SKIPPED`, as the frontend sends it) to a
    worker whose prefix cache holds all of the image's tokens, part of them or none (dropped
    between routing and arrival): each answers with the tokens of the request sent with its
    image (the mock's follow the prompt and the items' hashes; that the hf engine's prefix
    cache serves an item to the same tokens is `tests/engines/test_hf_engine.py`'s); only the
    first skips the vision tower. A worker that encodes does so itself (agg);
    one that does not asks the encode worker (E/PD's worker, E/P/D's prefill)."""
    engines = await fresh_engines(model_path, 3)
    deployment = InProcess(nats_url, model_path)
    try:
        if pattern == "agg":
            language = await deployment.start(Role.WORKER, engines[0], encode=True)
            encoder_engine, entry = engines[0], Role.WORKER
        elif pattern == "e_pd":
            language = await deployment.start(Role.WORKER, engines[0])
            await deployment.start(Role.ENCODE, engines[1], encode=True)
            encoder_engine, entry = engines[1], Role.ENCODE
        else:
            language = await deployment.start(Role.PREFILL, engines[0])
            await deployment.start(Role.DECODE, engines[2])
            await deployment.start(Role.ENCODE, engines[1], encode=True)
            encoder_engine, entry = engines[1], Role.ENCODE
        request = await prompts.request([LARGE_IMAGE])
        item = request.plan.media[0]
        assert item.length == 128
        part = (item.end - 8) // 16 * 16  # the blocks before the image's last one
        assert item.offset < part < item.end
        # Sent with its image: the reference tokens, and every block in the cache.
        expected = completion(await deployment.stream(entry, request))

        all_cached = reusable_blocks(len(request.plan.token_ids), 16) * 16
        assert item.end <= all_cached
        for held, cached, counted, encoded in [
            ("all", all_cached, "skipped", 0),
            ("part", part, "encoded", 1),
            ("none", 0, "encoded", 1),
        ]:
            if held != "all":
                engines[0].prefix_cache.clear()
            if held == "part":
                await hold_prefix(engines[0], request, part)
            looked_up = lookups(encoder_engine)
            before = skipped_items(language, counted)
            skipping = msgspec.structs.replace(request, request_id=held).skipping([0])

            chunks = await deployment.stream(entry, skipping)

            assert_complete(chunks, skipping)
            assert completion(chunks) == expected, held
            assert chunks[-1].usage is not None
            assert chunks[-1].usage.cached_tokens == cached, held
            assert skipped_items(language, counted) == before + 1, held
            assert lookups(encoder_engine) == looked_up + encoded, held
        assert skipped_items(language, "skipped") == 1
        assert skipped_items(language, "encoded") == 2
    finally:
        await deployment.close()
        for engine in engines:
            await engine.close()


async def test_the_frontend_routes_to_the_aggregated_worker_whose_encoder_holds_the_image(
    nats_url: str, model_path: Path, prompts: Prompts
) -> None:
    """Two `worker --encode` behind the frontend's dispatcher, neither holding any of the
    prompt's blocks: the request goes to the one whose encoder cache holds its image (its
    embedding-cache events told the router), which encodes nothing."""
    engines = await fresh_engines(model_path, 2)
    deployment = InProcess(nats_url, model_path)
    dispatcher: NatsDispatcher | None = None
    try:
        handlers = [
            await deployment.start(Role.WORKER, engine, encode=True, kv_events=True)
            for engine in engines
        ]
        dispatcher = await NatsDispatcher.start(await deployment.runtime())
        router = dispatcher.routers[Role.WORKER]
        first = await prompts.request([IMAGES["tall"]])
        assert_complete([c async for c in dispatcher.generate(first)], first)
        holder = next(i for i, engine in enumerate(engines) if engine.prefix_cache.num_blocks)
        holder_id = handlers[holder].runtime.instance_id
        await wait_until_async(
            lambda: router.encoder_index.num_entries(holder_id) == 1,
            what="the router follows the worker's encoder cache",
        )
        engines[holder].prefix_cache.clear()  # the KV goes, the embedding stays
        await wait_until_async(
            lambda: router.indexer.num_blocks(holder_id) == 0, what="the index drops the blocks"
        )
        hits, misses = engines[holder].encoder_cache.stats()

        # Each a coin toss without the encoder caches in the cost: 1 in 16 to pass by chance.
        texts = ("Describe it.", "And its colours?", "How big is it?", "Where is it?")
        for text in texts:
            again = await prompts.request([IMAGES["tall"]], text=text)
            assert_complete([c async for c in dispatcher.generate(again)], again)
            engines[holder].prefix_cache.clear()
        assert engines[holder].encoder_cache.stats() == (hits + len(texts), misses)
        assert sum(engines[1 - holder].encoder_cache.stats()) == 0
    finally:
        if dispatcher is not None:
            await dispatcher.stop()
        await deployment.close()
        for engine in engines:
            await engine.close()
