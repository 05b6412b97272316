"""The encode role: encode each request's planned media and offer the embeddings by transfer,
then hand the request with their handles on (mmserve's encode worker streams the language hop's
answer back; Dynamo's replies with the handles to the worker that called it). It also encodes,
for a language worker, the items its prefix cache dropped after the router skipped them, and
offers a peer encoder the embeddings its encoder cache holds."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable

import msgspec

from mmserve.encode.embeddings import offer_embeddings
from mmserve.encode.stage import EncodeStage
from mmserve.observability import nvtx
from mmserve.protocol import (
    EmbeddingPullReply,
    EmbeddingPullRequest,
    MediaPayload,
    PreprocessedRequest,
)
from mmserve.roles.base import RoleCore, T
from mmserve.roles.errors import typed_errors
from mmserve.roles.tracking import tracked
from mmserve.topology import Role

Forward = Callable[[PreprocessedRequest], AsyncGenerator[T, None]]
"""Send the encoded request on; its replies are the caller's."""


class EncodeCore(RoleCore):
    role = Role.ENCODE
    encoder: EncodeStage  # never None: `roles.build_core` refuses an encode core without one

    async def generate(
        self, request: PreprocessedRequest, hop: Callable[[], Awaitable[Forward[T]]]
    ) -> AsyncGenerator[T, None]:
        """Encode the request and forward it: `hop()` says where, before anything is encoded
        (it refuses when there is nowhere to go)."""
        with tracked(self.component, request) as progress, nvtx.nvtx_range(nvtx.ENC_GENERATE):
            forward = await hop()
            replies = forward(await self.encoded(request))
            async with contextlib.aclosing(replies):
                async for reply in replies:
                    yield progress.passing(reply)

    async def encoded(self, request: PreprocessedRequest) -> PreprocessedRequest:
        """`request` with each item this worker encoded (or read from its encoder cache) as
        the handle of its embeddings. Precomputed embeddings pass on untouched (the language
        hop reads them from the frontend), and so do an id-only item this cache no longer
        holds and a skipped one. The leases return the buffers once the next hop has read
        them (or time out)."""
        encoded = await self.encoder.run(request)
        handles, _leases = await offer_embeddings(self.transfer, list(encoded.values()))
        offered = dict(zip(encoded, handles, strict=True))
        payloads = [
            MediaPayload.precomputed(offered[i]) if i in offered else payload
            for i, payload in enumerate(request.payloads)
        ]
        return msgspec.structs.replace(request, payloads=payloads)

    async def encode_items(self, request: PreprocessedRequest) -> EmbeddingPullReply:
        """Encode the items of a request that a language worker skipped for its prefix cache,
        which dropped them since (`RoleCore.run_prompt`); offered as for `generate`."""
        with typed_errors():
            encoded = await self.encoder.run(request)
            handles, _leases = await offer_embeddings(self.transfer, list(encoded.values()))
        offered = dict(zip(encoded, handles, strict=True))
        return EmbeddingPullReply(
            embeddings=[offered.get(i) for i in range(len(request.plan.media))]
        )

    async def pull_embeddings(self, request: EmbeddingPullRequest) -> EmbeddingPullReply:
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
