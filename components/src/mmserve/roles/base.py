"""What every role's core shares: the engine, transfer, the encode stage where the worker
encodes, getting a request's embeddings from whoever encoded them (and encoding the items the
router skipped for a prefix cache that dropped them since), clearing the engine's caches, and
the token stream's metrics. Nothing here names a transport: the NATS endpoints (`worker`) and
the Dynamo backend (`dynamo`) translate their requests into these calls."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

from mmserve import protocol
from mmserve.encode.embeddings import load_embeddings
from mmserve.encode.stage import EncodeStage
from mmserve.engines.base import Embeddings, Engine, EngineRequest, ItemEmbedding, MediaGone
from mmserve.observability import metrics, nvtx
from mmserve.protocol import (
    CachesCleared,
    EmbeddingPullReply,
    ItemState,
    MediaPayload,
    PreprocessedRequest,
    TokenChunk,
)
from mmserve.roles.errors import typed_errors
from mmserve.runtime.errors import RemoteError
from mmserve.topology import Role
from mmserve.transfer import TransferAgent

log = logging.getLogger("mmserve.worker")

T = TypeVar("T")


class EncodeElsewhere(Protocol):
    """Encode the items of a request (`PreprocessedRequest.encoding_skipped()`) on an encode
    worker: the handle of each item's embeddings by item index, None for the others. What a
    language worker without an encode stage calls when its prefix cache dropped an item the
    router skipped."""

    def __call__(self, request: PreprocessedRequest) -> Awaitable[EmbeddingPullReply]: ...


class RoleCore:
    """The role logic one worker process runs, whatever transport brought the request."""

    role: Role

    def __init__(
        self,
        engine: Engine,
        transfer: TransferAgent,
        encoder: EncodeStage | None,
        *,
        instance_id: str,
        encode_elsewhere: EncodeElsewhere | None = None,
    ) -> None:
        self.engine = engine
        self.transfer = transfer
        self.encoder = encoder
        self.instance_id = instance_id
        self.encode_elsewhere = encode_elsewhere

    @property
    def component(self) -> str:
        return self.role.value

    async def clear_caches(self) -> CachesCleared:
        """Clear the engine's prefix and encoder caches; its KV events tell the routers."""
        with typed_errors():
            cleared = await self.engine.clear_caches()
        log.info(
            "%s caches cleared: %d prefix blocks, %d encoder entries",
            self.component,
            cleared.prefix_blocks,
            cleared.encoder_items,
        )
        return cleared

    async def skipping_cached(self, request: PreprocessedRequest) -> PreprocessedRequest:
        """`request` with the items this worker would encode but its prefix cache already
        holds all the tokens of marked `ItemState.SKIPPED`, as a router that knows the cache
        marks them before the first hop (one behind Dynamo's router, or a round-robin one,
        does not): their embeddings would go unread. Should the cache drop one before the
        prompt runs, `run_prompt` encodes them after all."""
        if self.encoder is None or not request.items_to_encode():
            return request
        cached = await self.engine.media_in_cached_prefix(engine_request(request))
        return request.skipping(cached) if cached else request

    async def embeddings(self, request: PreprocessedRequest) -> list[ItemEmbedding | None]:
        """The embeddings of the request's planned media, whoever made them: loaded by
        transfer where a payload carries them (an upstream encoder's, or the client's own
        precomputed ones), encoded here for the rest. An item named by its media id alone
        comes from this worker's encoder cache, or is None when no encoder cache holds it
        (the engine serves it from its prefix cache, or refuses it); so is an item the router
        skipped for the prefix cache (`ItemState.SKIPPED`, see `run_prompt`)."""
        media, payloads = request.plan.media, request.payloads
        if not media:
            return []
        if self.encoder is None and request.items(ItemState.ENCODE):
            raise RemoteError(
                protocol.ERROR_UNAVAILABLE,
                f"this {self.component} worker does not encode media: deploy an encode worker "
                "or start it with --encode",
            )
        encoded: dict[int, ItemEmbedding] = {}
        if self.encoder is not None and request.items_to_encode():
            encoded = await self.encoder.run(request)
        carried = request.items(ItemState.PRECOMPUTED)
        with metrics.timed_stage(self.component, "transfer"):
            loaded = await load_embeddings(
                self.transfer, [media[i] for i in carried], [payloads[i] for i in carried]
            )
        by_index = encoded | dict(zip(carried, loaded, strict=True))
        return [by_index.get(i) for i in range(len(media))]

    async def run_prompt(
        self,
        request: PreprocessedRequest,
        embeddings: Embeddings,
        run: Callable[[Embeddings], Awaitable[T]],
    ) -> T:
        """`run(embeddings)`, the engine's prefill. The items the router skipped because this
        worker's prefix cache held all their tokens (`ItemState.SKIPPED`) come without embeddings;
        when the engine finds the cache dropped one since (`MediaGone`), the skipped items are
        encoded (here, or by an encode worker) and the prompt runs again. Each skipped item
        counts in `mmserve_encoder_skipped_items_total` as skipped or encoded."""
        skipped = request.items(ItemState.SKIPPED)
        if not skipped:
            return await run(embeddings)
        counted = metrics.SKIPPED_ENCODES.labels
        try:
            result = await run(embeddings)
        except MediaGone as gone:
            if gone.index not in skipped:
                raise
            log.info(
                "request %s: the prefix cache no longer holds media item %d; encoding the %d "
                "skipped items",
                request.request_id,
                gone.index,
                len(skipped),
            )
            encoded = await self._encode_skipped(request, skipped)
            result = await run([encoded.get(i, e) for i, e in enumerate(embeddings)])
            counted(self.component, self.instance_id, "encoded").inc(len(skipped))
            return result
        counted(self.component, self.instance_id, "skipped").inc(len(skipped))
        return result

    async def _encode_skipped(
        self, request: PreprocessedRequest, skipped: list[int]
    ) -> dict[int, ItemEmbedding]:
        """The embeddings of the `skipped` items, by index: from this worker's encode stage, or
        from an encode worker (`encode_elsewhere`)."""
        wanted = request.encoding_skipped()
        if self.encoder is not None:
            return await self.encoder.run(wanted)
        if self.encode_elsewhere is None:
            raise RemoteError(
                protocol.ERROR_UNAVAILABLE,
                f"this {self.component} worker's prefix cache dropped a skipped media item, and "
                "it has no encoder to encode it again",
            )
        reply = await self.encode_elsewhere(wanted)
        handles = {i: h for i, h in enumerate(reply.embeddings) if i in skipped and h is not None}
        with metrics.timed_stage(self.component, "transfer"):
            loaded = await load_embeddings(
                self.transfer,
                [request.plan.media[i] for i in handles],
                [MediaPayload.precomputed(handle) for handle in handles.values()],
            )
        return dict(zip(handles, loaded, strict=True))


async def started(chunks: AsyncIterator[TokenChunk]) -> AsyncIterator[TokenChunk]:
    """`chunks` once its first chunk came, so a prefill that fails fails here, before anything
    streamed (`RoleCore.run_prompt` may then run it again)."""
    first = await anext(chunks)

    async def stream() -> AsyncIterator[TokenChunk]:
        yield first
        async for chunk in chunks:
            yield chunk

    return stream()


def engine_request(request: PreprocessedRequest) -> EngineRequest:
    return EngineRequest.from_plan(
        request.request_id, request.plan, request.sampling, request.stop, request.resume
    )


async def stream_tokens(
    component: str, chunks: AsyncIterator[TokenChunk], ttft_range: str, *, prefills: bool
) -> AsyncIterator[TokenChunk]:
    """Pass chunks through, recording time to first token, inter-token latency and the
    decode stage (first token to the end); the prefill stage too where this engine `prefills`
    (its time to first token)."""
    started = last = first_token_at = time.perf_counter()
    first = True
    ttft = nvtx.range_start(ttft_range)
    try:
        async for chunk in chunks:
            now = time.perf_counter()
            if first:
                nvtx.range_end(ttft)
                metrics.TTFT.labels(component).observe(now - started)
                if prefills:
                    metrics.STAGE_SECONDS.labels(component, "prefill").observe(now - started)
                first_token_at = now
                first = False
            else:
                metrics.ITL.labels(component).observe(now - last)
            last = now
            if chunk.usage is not None:
                hit = "hit" if chunk.usage.cached_tokens else "miss"
                metrics.CACHE_LOOKUPS.labels(component, "prefix", hit).inc()
            if chunk.finish_reason is not None:
                # Before the last yield: the caller may close the stream once it has the end.
                metrics.STAGE_SECONDS.labels(component, "decode").observe(now - first_token_at)
            yield chunk
    finally:
        if first:
            nvtx.range_end(ttft)
