"""The frontend's dispatcher routes by the KV events of stand-in workers over a real
nats-server, and a routed call falls back to any instance when its instance is gone."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

import pytest

from mmserve.engines.prefix_cache import PrefixCache
from mmserve.frontend.nats_dispatch import NatsDispatcher
from mmserve.kv.view import prompt_block_keys
from mmserve.protocol import PlannedMedia, PreprocessedRequest, RequestPlan, TokenChunk
from mmserve.router.scheduler import RouterMode
from mmserve.router.settings import RouterSettings
from mmserve.runtime import RequestContext, Runtime
from mmserve.runtime.retry import stream_routed
from mmserve.worker.publishers import KvEventPublisher

from .test_kv_events import eventually

PLACEHOLDER = 151655
IMAGE_TOKENS = 40
TEXT = list(range(1000, 1040))


class StandIn:
    """A worker: answers with its instance id and the route it was given; caches prompts
    as an engine does and publishes the KV events."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.cache: PrefixCache[None] = PrefixCache(16)

    async def start(self) -> StandIn:
        publisher = await KvEventPublisher(self.runtime, "worker", self.cache.snapshot).start()
        self.cache.subscribe(publisher.publish)
        await self.runtime.serve("worker", "generate", self.generate, PreprocessedRequest)
        return self

    def hold(self, mm_hash: int) -> int:
        """Cache the prompt of `request(mm_hash)`, expanded as the engine sees it; returns
        its number of blocks."""
        plan = request(mm_hash).plan
        keys = prompt_block_keys(plan.token_ids, plan.media)
        self.cache.store(keys, 0, [None] * len(keys.seq_hashes))
        return len(keys.seq_hashes)

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[TokenChunk]:
        text = f"{ctx.instance_id} {request.route.get('worker')}"
        yield TokenChunk(request_id=request.request_id, text=text, finish_reason="stop")


def request(mm_hash: int) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=uuid.uuid4().hex,
        deadline=time.time() + 30,
        model="m",
        plan=RequestPlan(
            token_ids=[*TEXT, *[PLACEHOLDER] * IMAGE_TOKENS, *TEXT],
            media=[
                PlannedMedia(
                    mm_hash=mm_hash, offset=len(TEXT), length=IMAGE_TOKENS, grid_thw=(1, 2, 2)
                )
            ],
        ),
    )


async def answer(dispatcher: NatsDispatcher, mm_hash: int) -> tuple[str, str]:
    chunks = [chunk async for chunk in dispatcher.generate(request(mm_hash))]
    served_by, routed_to = chunks[-1].text.split()
    return served_by, routed_to


@pytest.fixture
async def namespace_runtimes(nats_url: str) -> AsyncIterator[list[Runtime]]:
    namespace = f"route-{uuid.uuid4().hex[:8]}"
    runtimes = [await Runtime.connect(nats_url, namespace) for _ in range(3)]
    yield runtimes
    for runtime in runtimes:
        with contextlib.suppress(Exception):
            await runtime.shutdown()


async def test_kv_mode_routes_to_the_holder_until_it_leaves(
    namespace_runtimes: list[Runtime],
) -> None:
    router_rt, first_rt, second_rt = namespace_runtimes
    first, second = await StandIn(first_rt).start(), await StandIn(second_rt).start()
    settings = RouterSettings(mode=RouterMode.KV)
    dispatcher = await NatsDispatcher.start(router_rt, settings)
    try:
        index = dispatcher.routers["worker"].indexer
        await eventually(
            lambda: dispatcher.ready() and len(dispatcher._watchers["worker"].instance_ids()) == 2
        )
        blocks = first.hold(mm_hash=7)
        assert second.hold(mm_hash=8) == blocks == 7
        await eventually(lambda: index.num_blocks(first_rt.instance_id) == blocks, 20)
        await eventually(lambda: index.num_blocks(second_rt.instance_id) == blocks, 20)
        for _ in range(4):  # sequential: no load builds up, the overlap decides
            assert await answer(dispatcher, 7) == (first_rt.instance_id,) * 2
            assert await answer(dispatcher, 8) == (second_rt.instance_id,) * 2
        assert dispatcher.routers["worker"].load.in_flight() == 0
        await first_rt.shutdown()
        await eventually(lambda: index.num_blocks(first_rt.instance_id) == 0, 20)
        assert await answer(dispatcher, 7) == (second_rt.instance_id,) * 2
    finally:
        await dispatcher.stop()


async def test_a_routed_call_to_a_gone_instance_goes_to_another(
    namespace_runtimes: list[Runtime],
) -> None:
    caller_rt, server_rt, _ = namespace_runtimes
    await StandIn(server_rt).start()
    client = caller_rt.client("worker", "generate")
    routed = request(7)
    for instance_id in (server_rt.instance_id, "gone0123456789ab"):
        replies: AsyncGenerator[TokenChunk, None] = stream_routed(
            client,
            routed,
            TokenChunk,
            instance_id=instance_id,
            request_id=routed.request_id,
            deadline=routed.deadline,
        )
        chunks = [chunk async for chunk in replies]
        assert chunks[-1].text.split()[0] == server_rt.instance_id
