"""The role cores (`mmserve.roles`) served on mmserve's NATS runtime: each role's endpoints
(`<role>.generate`, `<role>.reset_prefix_cache`, and the encode worker's `pull_embeddings` and
`encode_items`), and the calls a core makes to other roles: decode to a prefill worker, encode
to the language hop, a language worker to the encode worker for items its prefix cache dropped.
Each call targets the instance the frontend's router chose (`PreprocessedRequest.route`), or
any instance when none was chosen or it is gone (`runtime.retry`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator

from mmserve import protocol
from mmserve.encode.stage import EncodeStage
from mmserve.engines.base import Engine
from mmserve.protocol import (
    CachesCleared,
    EmbeddingPullReply,
    EmbeddingPullRequest,
    EncodeItemsRequest,
    PrefillReply,
    PrefillRequest,
    PreprocessedRequest,
    ResetCachesRequest,
    TokenChunk,
)
from mmserve.roles import (
    AggregatedCore,
    DecodeCore,
    EncodeCore,
    PrefillCore,
    RoleCore,
    build_core,
)
from mmserve.roles.encode import Forward
from mmserve.runtime import Client, InstanceWatcher, RemoteError, RequestContext, Runtime
from mmserve.runtime.discovery import DISCOVERY_GRACE, wait_for_change
from mmserve.runtime.retry import stream_routed
from mmserve.topology import (
    ENCODE_ITEMS,
    GENERATE,
    PULL_EMBEDDINGS,
    RESET_PREFIX_CACHE,
    Role,
    language_hop,
)
from mmserve.transfer import TransferAgent

LANGUAGE_ROLES = (Role.WORKER, Role.PREFILL, Role.DECODE)


class Endpoints:
    """A role core's endpoints on the runtime; `serve` registers them, `generate` last."""

    def __init__(self, runtime: Runtime, core: RoleCore) -> None:
        self.runtime = runtime
        self.core = core

    @property
    def component(self) -> str:
        return self.core.component

    async def serve(self) -> None:
        """Serve `reset_prefix_cache`, then `generate`: an instance the frontend discovers by
        `generate` already answers resets."""
        await self.runtime.serve(
            self.component, RESET_PREFIX_CACHE, self.reset_prefix_cache, ResetCachesRequest
        )

    async def reset_prefix_cache(
        self, request: ResetCachesRequest, ctx: RequestContext
    ) -> CachesCleared:
        return await self.core.clear_caches()


class AggregatedEndpoints(Endpoints):
    core: AggregatedCore

    async def serve(self) -> None:
        await super().serve()
        await self.runtime.serve(self.component, GENERATE, self.generate, PreprocessedRequest)

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[TokenChunk]:
        async with contextlib.aclosing(self.core.generate(request)) as chunks:
            async for chunk in chunks:
                yield chunk


class PrefillEndpoints(Endpoints):
    core: PrefillCore

    async def serve(self) -> None:
        await super().serve()
        await self.runtime.serve(self.component, GENERATE, self.generate, PrefillRequest)

    async def generate(
        self, prefill: PrefillRequest, ctx: RequestContext
    ) -> AsyncIterator[PrefillReply]:
        # Decode reads the KV while this stream is open; it ends once the read is done.
        replies = self.core.prefill(prefill.request, wait_for_reads=True)
        async with contextlib.aclosing(replies):
            async for reply in replies:
                yield reply


class DecodeEndpoints(Endpoints):
    core: DecodeCore

    async def serve(self) -> None:
        self.prefill = self.runtime.client(Role.PREFILL.value, GENERATE)
        await super().serve()
        await self.runtime.serve(self.component, GENERATE, self.generate, PreprocessedRequest)

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[TokenChunk]:
        handover: AsyncGenerator[PrefillReply, None] = stream_routed(
            self.prefill,
            PrefillRequest(request=request),
            PrefillReply,
            instance_id=request.route.get(Role.PREFILL.value),
            request_id=request.request_id,
            deadline=request.deadline,
        )
        async with contextlib.aclosing(self.core.generate(request, handover)) as chunks:
            async for chunk in chunks:
                yield chunk


class EncodeEndpoints(Endpoints):
    core: EncodeCore

    async def serve(self) -> None:
        self._watchers: dict[Role, InstanceWatcher] = {
            role: await self.runtime.watch(role.value, GENERATE) for role in LANGUAGE_ROLES
        }
        self._clients: dict[Role, Client] = {
            role: self.runtime.client(role.value, GENERATE) for role in LANGUAGE_ROLES
        }
        await super().serve()
        await self.runtime.serve(
            self.component, PULL_EMBEDDINGS, self.pull_embeddings, EmbeddingPullRequest
        )
        await self.runtime.serve(
            self.component, ENCODE_ITEMS, self.encode_items, EncodeItemsRequest
        )
        await self.runtime.serve(self.component, GENERATE, self.generate, PreprocessedRequest)

    async def pull_embeddings(
        self, request: EmbeddingPullRequest, ctx: RequestContext
    ) -> EmbeddingPullReply:
        return await self.core.pull_embeddings(request)

    async def encode_items(
        self, request: EncodeItemsRequest, ctx: RequestContext
    ) -> EmbeddingPullReply:
        return await self.core.encode_items(request.request)

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[TokenChunk]:
        async with contextlib.aclosing(self.core.generate(request, self._language_hop)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _language_hop(self) -> Forward[TokenChunk]:
        """The language hop to forward to. One not listed yet is waited for a little: a worker
        that has just started, or whose record the bucket expired while its event loop stalled,
        is heard again within a heartbeat."""
        deadline = time.monotonic() + DISCOVERY_GRACE
        while (hop := language_hop(lambda role: bool(self._watchers[role].instances()))) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RemoteError(
                    protocol.ERROR_UNAVAILABLE,
                    "no worker, or decode and prefill worker, is registered to take encoded "
                    "requests",
                )
            await wait_for_change(self._watchers.values(), left)
        client = self._clients[hop]

        def forward(encoded: PreprocessedRequest) -> AsyncGenerator[TokenChunk, None]:
            return stream_routed(
                client,
                encoded,
                TokenChunk,
                instance_id=encoded.route.get(client.component),
                request_id=encoded.request_id,
                deadline=encoded.deadline,
            )

        return forward


ENDPOINTS: dict[Role, type[Endpoints]] = {
    Role.WORKER: AggregatedEndpoints,
    Role.PREFILL: PrefillEndpoints,
    Role.DECODE: DecodeEndpoints,
    Role.ENCODE: EncodeEndpoints,
}


async def serve_role(
    role: Role,
    runtime: Runtime,
    engine: Engine,
    transfer: TransferAgent,
    encoder: EncodeStage | None,
) -> Endpoints:
    """`role`'s core on this process's engine (with `encoder` where it encodes), served on
    `runtime`."""
    core = build_core(
        role,
        engine,
        transfer,
        encoder,
        instance_id=runtime.instance_id,
        encode_elsewhere=EncodeWorker(runtime),
    )
    endpoints = ENDPOINTS[role](runtime, core)
    await endpoints.serve()
    return endpoints


class EncodeWorker:
    """`roles.EncodeElsewhere` on the runtime: the encode worker the request came through (any
    one if it is gone, or the request came straight to this hop) encodes the items."""

    def __init__(self, runtime: Runtime) -> None:
        self.client = runtime.client(Role.ENCODE.value, ENCODE_ITEMS)

    async def __call__(self, request: PreprocessedRequest) -> EmbeddingPullReply:
        replies: AsyncGenerator[EmbeddingPullReply, None] = stream_routed(
            self.client,
            EncodeItemsRequest(request=request),
            EmbeddingPullReply,
            instance_id=request.route.get(Role.ENCODE.value),
            request_id=request.request_id,
            deadline=request.deadline,
        )
        async with contextlib.aclosing(replies):
            return await anext(replies)
