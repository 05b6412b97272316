"""The encode worker (`mmserve encode`): preprocess and encode each request's media, then hand
the expanded prompt and the embeddings to the next hop and stream its answer back.

The next hop is discovered: a decode worker when the deployment has one (E/P/D), else an
aggregated worker (E/PD). The instance is the one the frontend's router chose
(`PreprocessedRequest.route`), or any instance when none was chosen or it is gone.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

import msgspec

from mmserve import protocol
from mmserve.encode.embeddings import offer_embeddings
from mmserve.encode.stage import EncodeStage
from mmserve.observability import nvtx
from mmserve.protocol import PreprocessedRequest, TokenChunk
from mmserve.router.route import stream_routed
from mmserve.runtime import Client, InstanceWatcher, RemoteError, RequestContext, Runtime
from mmserve.transfer import TransferAgent
from mmserve.worker.tracking import tracked

COMPONENT = "encode"
GENERATE = "generate"
NEXT_HOPS = ("decode", "worker")  # in order of preference


class EncodeHandler:
    def __init__(self, runtime: Runtime, stage: EncodeStage, transfer: TransferAgent) -> None:
        self.runtime = runtime
        self.stage = stage
        self.transfer = transfer
        self._hops: list[tuple[InstanceWatcher, Client]] = []

    async def serve(self) -> None:
        for component in NEXT_HOPS:
            watcher = await self.runtime.watch(component, GENERATE)
            self._hops.append((watcher, self.runtime.client(component, GENERATE)))
        await self.runtime.serve(COMPONENT, GENERATE, self.generate, PreprocessedRequest)

    def _next_hop(self) -> Client:
        for watcher, client in self._hops:
            if watcher.instances():
                return client
        raise RemoteError(
            protocol.ERROR_UNAVAILABLE,
            f"no {' or '.join(NEXT_HOPS)} worker is registered to take encoded requests",
        )

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[TokenChunk]:
        with tracked(COMPONENT, request), nvtx.nvtx_range(nvtx.ENC_GENERATE):
            next_hop = self._next_hop()
            encoded = await self.stage.run(request)
            handles, _leases = await offer_embeddings(self.transfer, encoded.embeddings)
            media = [
                msgspec.structs.replace(item, embeddings=handle)
                for item, handle in zip(encoded.media, handles, strict=True)
            ]
            downstream = msgspec.structs.replace(
                request, token_ids=encoded.token_ids, media=media, expanded=True
            )
            # Leases return their buffers once the next hop has read them (or time out).
            replies: AsyncGenerator[TokenChunk, None] = stream_routed(
                next_hop,
                downstream,
                TokenChunk,
                instance_id=request.route.get(next_hop.component),
                request_id=request.request_id,
                deadline=request.deadline,
            )
            async with contextlib.aclosing(replies):
                async for chunk in replies:
                    yield chunk
