"""What every role's handler shares: the engine, transfer, the encode stage where the worker
encodes, getting a request's embeddings from whoever encoded them (and encoding the items the
router skipped for a prefix cache that dropped them since), and clearing the engine's caches
(`<role>.reset_prefix_cache`, served beside `generate`)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from mmserve import protocol
from mmserve.encode.embeddings import load_embeddings
from mmserve.encode.stage import EncodeStage
from mmserve.engines.base import Embeddings, Engine, EngineRequest, ItemEmbedding, MediaGone
from mmserve.observability import metrics, nvtx
from mmserve.protocol import (
    CachesCleared,
    EmbeddingPullReply,
    EncodeItemsRequest,
    ItemState,
    MediaPayload,
    PreprocessedRequest,
    ResetCachesRequest,
    TokenChunk,
)
from mmserve.runtime import RemoteError, RequestContext, Runtime
from mmserve.runtime.retry import stream_routed
from mmserve.topology import ENCODE_ITEMS, RESET_PREFIX_CACHE, Role
from mmserve.transfer import TransferAgent
from mmserve.worker.errors import typed_errors

log = logging.getLogger("mmserve.worker")

T = TypeVar("T")


class RoleHandler:
    """Base of the handler of each role; `serve` registers it at `<role>.generate`."""

    role: Role

    def __init__(
        self,
        runtime: Runtime,
        engine: Engine,
        transfer: TransferAgent,
        encoder: EncodeStage | None,
    ) -> None:
        self.runtime = runtime
        self.engine = engine
        self.transfer = transfer
        self.encoder = encoder

    @property
    def component(self) -> str:
        return self.role.value

    async def serve(self) -> None:
        """Serve `reset_prefix_cache` (`serve_reset_prefix_cache`), then `generate`: an
        instance the frontend discovers by `generate` already answers resets."""
        raise NotImplementedError

    async def serve_reset_prefix_cache(self) -> None:
        await self.runtime.serve(
            self.component, RESET_PREFIX_CACHE, self.reset_prefix_cache, ResetCachesRequest
        )

    async def reset_prefix_cache(
        self, request: ResetCachesRequest, ctx: RequestContext
    ) -> CachesCleared:
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
            counted(self.component, self.runtime.instance_id, "encoded").inc(len(skipped))
            return result
        counted(self.component, self.runtime.instance_id, "skipped").inc(len(skipped))
        return result

    async def _encode_skipped(
        self, request: PreprocessedRequest, skipped: list[int]
    ) -> dict[int, ItemEmbedding]:
        """The embeddings of the `skipped` items, by index: from this worker's encode stage, or
        from the encode worker the request came through (any one if it is gone, or it came
        straight to this hop)."""
        wanted = request.encoding_skipped()
        if self.encoder is not None:
            return await self.encoder.run(wanted)
        replies: AsyncGenerator[EmbeddingPullReply, None] = stream_routed(
            self.runtime.client(Role.ENCODE.value, ENCODE_ITEMS),
            EncodeItemsRequest(request=wanted),
            EmbeddingPullReply,
            instance_id=request.route.get(Role.ENCODE.value),
            request_id=request.request_id,
            deadline=request.deadline,
        )
        async with contextlib.aclosing(replies):
            reply = await anext(replies)
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
    streamed (`RoleHandler.run_prompt` may then run it again)."""
    first = await anext(chunks)

    async def stream() -> AsyncIterator[TokenChunk]:
        yield first
        async for chunk in chunks:
            yield chunk

    return stream()


def engine_request(request: PreprocessedRequest) -> EngineRequest:
    return EngineRequest.from_plan(request.request_id, request.plan, request.sampling, request.stop)


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
