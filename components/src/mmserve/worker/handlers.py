"""One handler class per worker role: aggregated (prefill + decode), prefill, decode.

Every handler is served at `<component>.generate`. Requests arrive either unexpanded (one
placeholder per media item; the worker encodes them itself when started with `--encode`) or
expanded by an encode worker, with the embeddings waiting to be fetched by transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator

import torch

from mmserve import protocol
from mmserve.encode.embeddings import load_embeddings
from mmserve.encode.stage import Encoded, EncodeStage
from mmserve.engines.base import Engine, EngineRequest, ItemEmbedding, KvHandle
from mmserve.observability import metrics, nvtx
from mmserve.protocol import (
    BootstrapInfo,
    PrefillDone,
    PrefillReply,
    PrefillRequest,
    PreprocessedRequest,
    TokenChunk,
)
from mmserve.router.route import stream_routed
from mmserve.runtime import RemoteError, RequestContext, Runtime
from mmserve.transfer import Lease, TransferAgent
from mmserve.worker.tracking import tracked

log = logging.getLogger(__name__)

GENERATE = "generate"


class WorkerHandler:
    """What every role shares: the engine, transfer, and getting a request's embeddings."""

    component: str

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

    async def serve(self) -> None:
        raise NotImplementedError

    async def _multimodal(self, request: PreprocessedRequest) -> Encoded:
        """The expanded prompt and its embeddings, whoever encodes them."""
        if not request.media:
            return Encoded(token_ids=list(request.token_ids))
        if all(item.embeddings is not None for item in request.media):
            with metrics.timed_stage(self.component, "transfer"):
                embeddings = await load_embeddings(self.transfer, request.media)
            return Encoded(list(request.token_ids), embeddings, list(request.media))
        if self.encoder is None:
            raise RemoteError(
                protocol.ERROR_UNAVAILABLE,
                f"this {self.component} worker does not encode media: deploy an encode worker "
                "or start it with --encode",
            )
        return await self.encoder.run(request)


def _engine_request(request: PreprocessedRequest, token_ids: list[int]) -> EngineRequest:
    return EngineRequest(
        request_id=request.request_id,
        token_ids=tuple(token_ids),
        sampling=request.sampling,
        stop=request.stop,
    )


async def _stream_tokens(
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
            yield chunk
    finally:
        if first:
            nvtx.range_end(ttft)
    if not first:
        metrics.STAGE_SECONDS.labels(component, "decode").observe(last - first_token_at)


class AggregatedHandler(WorkerHandler):
    """Prefill and decode in one engine (`mmserve worker`; with `--encode`, E too)."""

    component = "worker"

    async def serve(self) -> None:
        await self.runtime.serve(self.component, GENERATE, self.generate, PreprocessedRequest)

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[TokenChunk]:
        with tracked(self.component, request), nvtx.nvtx_range(nvtx.PD_GENERATE):
            with nvtx.nvtx_range(nvtx.PD_LOAD_MULTIMODAL):
                encoded = await self._multimodal(request)
            chunks = self.engine.generate(
                _engine_request(request, encoded.token_ids), encoded.embeddings
            )
            async for chunk in _stream_tokens(self.component, chunks, nvtx.PD_TTFT, prefills=True):
                yield chunk


class PrefillHandler(WorkerHandler):
    """Runs prompts for decode workers (`mmserve prefill`; with `--encode`, E too).

    Answers at once with its bootstrap info, then prefills and hands the KV cache over by
    transfer in a `PrefillDone`; the stream ends once decode has read it.
    """

    component = "prefill"

    async def serve(self) -> None:
        await self.runtime.serve(self.component, GENERATE, self.generate, PrefillRequest)

    async def generate(
        self, prefill: PrefillRequest, ctx: RequestContext
    ) -> AsyncIterator[PrefillReply]:
        request = prefill.request
        with tracked(self.component, request):
            with nvtx.nvtx_range(nvtx.PREFILL_BOOTSTRAP):
                yield BootstrapInfo(host=socket.gethostname(), port=0, room=secrets.randbits(63))
            with nvtx.nvtx_range(nvtx.PREFILL_LOAD_MULTIMODAL):
                encoded = await self._multimodal(request)
            done, leases = await self._prefill(request, encoded.token_ids, encoded.embeddings)
            yield done
            with nvtx.nvtx_range(nvtx.NIXL_WAIT_COMPLETION):
                await asyncio.gather(*(lease.wait() for lease in leases))

    async def _prefill(
        self,
        request: PreprocessedRequest,
        token_ids: list[int],
        embeddings: list[ItemEmbedding],
    ) -> tuple[PrefillDone, list[Lease]]:
        with (
            nvtx.nvtx_range(nvtx.PREFILL_ENGINE_ASYNC_GENERATE),
            metrics.timed_stage(self.component, "prefill"),
        ):
            kv = await self.engine.prefill(_engine_request(request, token_ids), embeddings)
        try:
            tensors = await self.engine.export_kv(kv)
        finally:
            self.engine.release(kv)
        handles = {}
        leases = []
        for name, tensor in tensors.items():
            handles[name], lease = await self.transfer.offer(tensor)
            leases.append(lease)
        done = PrefillDone(
            request_id=request.request_id,
            first_token_id=kv.first_token,
            prompt_tokens=kv.prompt_tokens,
            cached_tokens=kv.cached_tokens,
            kv=handles,
        )
        return done, leases


class DecodeHandler(WorkerHandler):
    """The entry point of disaggregation (`mmserve decode`): asks a prefill worker to run the
    prompt, loads the KV cache it hands over, and streams the completion."""

    component = "decode"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.prefill = self.runtime.client(PrefillHandler.component, GENERATE)

    async def serve(self) -> None:
        await self.runtime.serve(self.component, GENERATE, self.generate, PreprocessedRequest)

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[TokenChunk]:
        with tracked(self.component, request):
            with nvtx.nvtx_range(nvtx.DEC_FIRST_TOKEN):
                kv = await self._remote_prefill(request)
            chunks = self.engine.decode(kv, request.sampling, request.stop)
            async for chunk in _stream_tokens(self.component, chunks, nvtx.PD_TTFT, prefills=False):
                yield chunk

    async def _remote_prefill(self, request: PreprocessedRequest) -> KvHandle:
        """Run the prompt on a prefill worker (the one the router chose, if any); read its
        stream to the end, so prefill sees its KV buffers read before it finishes."""
        tensors: dict[str, torch.Tensor] | None = None
        replies: AsyncGenerator[PrefillReply, None] = stream_routed(
            self.prefill,
            PrefillRequest(request=request),
            PrefillReply,
            instance_id=request.route.get(PrefillHandler.component),
            request_id=request.request_id,
            deadline=request.deadline,
        )
        async with contextlib.aclosing(replies):
            async for reply in replies:
                if isinstance(reply, PrefillDone):
                    with (
                        nvtx.nvtx_range(nvtx.NIXL_BEGIN_READ),
                        metrics.timed_stage(self.component, "transfer"),
                    ):
                        tensors = {
                            name: await self.transfer.fetch(handle)
                            for name, handle in reply.kv.items()
                        }
        if tensors is None:
            raise RemoteError(
                protocol.ERROR_PROTOCOL, "prefill ended without handing over the KV cache"
            )
        return await self.engine.import_kv(request.request_id, tensors)
