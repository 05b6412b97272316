"""The encode role (`mmserve encode`): encode each request's planned media, then hand the
request with its embeddings to the language hop (`topology`) and stream its answer back.
The instance is the one the frontend's router chose (`PreprocessedRequest.route`), or any
instance when none was chosen or it is gone (`runtime.retry`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

import msgspec

from mmserve import protocol
from mmserve.encode.embeddings import offer_embeddings
from mmserve.observability import nvtx
from mmserve.protocol import (
    EmbeddingPullReply,
    EmbeddingPullRequest,
    EncodeItemsRequest,
    MediaPayload,
    PreprocessedRequest,
    TokenChunk,
)
from mmserve.runtime import Client, InstanceWatcher, RemoteError, RequestContext
from mmserve.runtime.retry import stream_routed
from mmserve.topology import ENCODE_ITEMS, GENERATE, PULL_EMBEDDINGS, Role, language_hop
from mmserve.worker.base import RoleHandler
from mmserve.worker.errors import typed_errors
from mmserve.worker.tracking import tracked

LANGUAGE_ROLES = (Role.WORKER, Role.PREFILL, Role.DECODE)


class EncodeHandler(RoleHandler):
    role = Role.ENCODE

    async def serve(self) -> None:
        self._watchers: dict[Role, InstanceWatcher] = {
            role: await self.runtime.watch(role.value, GENERATE) for role in LANGUAGE_ROLES
        }
        self._clients: dict[Role, Client] = {
            role: self.runtime.client(role.value, GENERATE) for role in LANGUAGE_ROLES
        }
        await self.serve_reset_prefix_cache()
        await self.runtime.serve(
            self.component, PULL_EMBEDDINGS, self.pull_embeddings, EmbeddingPullRequest
        )
        await self.runtime.serve(
            self.component, ENCODE_ITEMS, self.encode_items, EncodeItemsRequest
        )
        await self.runtime.serve(self.component, GENERATE, self.generate, PreprocessedRequest)

    def _next_hop(self) -> Client:
        hop = language_hop(lambda role: bool(self._watchers[role].instances()))
        if hop is None:
            raise RemoteError(
                protocol.ERROR_UNAVAILABLE,
                "no worker, or decode and prefill worker, is registered to take encoded requests",
            )
        return self._clients[hop]

    async def pull_embeddings(
        self, request: EmbeddingPullRequest, ctx: RequestContext
    ) -> EmbeddingPullReply:
        """Offer a peer encoder the embeddings this encoder cache holds of `request.items`;
        None for those it no longer holds. The leases end when the peer has read them (or time
        out)."""
        cached = await self.engine.cached_embeddings(
            [(item.mm_hash, item.grid_thw) for item in request.items]
        )
        handles, _leases = await offer_embeddings(
            self.transfer, [item for item in cached if item is not None]
        )
        offered = iter(handles)
        return EmbeddingPullReply(
            embeddings=[None if item is None else next(offered) for item in cached]
        )

    async def encode_items(
        self, request: EncodeItemsRequest, ctx: RequestContext
    ) -> EmbeddingPullReply:
        """Encode the items of a request that a language worker skipped for its prefix cache,
        which dropped them since (`RoleHandler.run_prompt`); offered as for `generate`."""
        with typed_errors():
            assert self.encoder is not None  # the encode role always has its stage
            encoded = await self.encoder.run(request.request)
            handles, _leases = await offer_embeddings(self.transfer, list(encoded.values()))
        offered = dict(zip(encoded, handles, strict=True))
        media = request.request.plan.media
        return EmbeddingPullReply(embeddings=[offered.get(i) for i in range(len(media))])

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[TokenChunk]:
        with tracked(self.component, request) as progress, nvtx.nvtx_range(nvtx.ENC_GENERATE):
            next_hop = self._next_hop()
            assert self.encoder is not None  # the encode role always has its stage
            encoded = await self.encoder.run(request)
            handles, _leases = await offer_embeddings(self.transfer, list(encoded.values()))
            offered = dict(zip(encoded, handles, strict=True))
            # Precomputed embeddings pass on untouched (the language hop reads them from the
            # frontend), and so do an id-only item this cache no longer holds and a skipped one.
            payloads = [
                MediaPayload.precomputed(offered[i]) if i in offered else payload
                for i, payload in enumerate(request.payloads)
            ]
            downstream = msgspec.structs.replace(request, payloads=payloads)
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
                    yield progress.passing(chunk)
