"""The Dynamo endpoints' handlers. `DynamoHandler` serves `generate` for Dynamo's frontend: plan
a preprocessed request with mmserve's Rust driver (expanded ids, media runs, M-RoPE positions),
encode its images, run the engine, stream Dynamo's output dicts; stop when Dynamo stops the
request; raise errors as Dynamo's. The images are planned and encoded in this process
(`LocalImages`) or by an encode worker (`RemoteImages`, `--route-to-encoder`), which serves
`DynamoEncodeHandler`: it plans and encodes and offers the embeddings by transfer. With prefill
and decode apart, `DynamoPrefillHandler` plans, encodes and prefills like `DynamoHandler` and
hands the KV over (mmserve's `PrefillDone`, by transfer) to `DynamoDecodeHandler`, which
streams the tokens."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

import msgspec
from dynamo.llm.exceptions import DynamoException, HttpError, InvalidArgument

from mmserve import media, protocol
from mmserve.dynamo import requests
from mmserve.dynamo.kv_events import DynamoKvEvents
from mmserve.encode.embeddings import load_embeddings, offer_embeddings
from mmserve.encode.stage import EncodeStage
from mmserve.engines.base import Engine, EngineRequest, ItemEmbedding
from mmserve.media.policy import MediaPolicy
from mmserve.observability import metrics, nvtx
from mmserve.protocol import EmbeddingsHandle, MediaPayload, PreprocessedRequest, RequestPlan
from mmserve.runtime import RemoteError
from mmserve.topology import Role
from mmserve.transfer import TransferAgent
from mmserve.worker.base import engine_request, stream_tokens
from mmserve.worker.errors import as_remote_error
from mmserve.worker.handover import fetch_kv, hand_over_kv
from mmserve.worker.tracking import tracked

log = logging.getLogger("mmserve.dynamo")

T = TypeVar("T")

# Dynamo's request carries no deadline; the engine path reads none, the field is the wire's.
REQUEST_DEADLINE_S = 3600.0


class RequestStopped(asyncio.CancelledError):
    """Dynamo stopped the request: counted and logged as cancelled, then the stream ends."""

    @classmethod
    def logged(cls, context: StopSignal) -> RequestStopped:
        log.info("request %s stopped by Dynamo", context.id())
        return cls(f"request {context.id()} stopped by Dynamo")


class StopSignal(Protocol):
    """The part of Dynamo's request `Context` the handler reads."""

    def id(self) -> str: ...

    def is_stopped(self) -> bool: ...

    def is_killed(self) -> bool: ...

    def async_killed_or_stopped(self) -> Any: ...


class Images(Protocol):
    """A request's images in two steps: `plan` (fetch under the media policy, hash, size,
    expand each placeholder, positions: the request with one payload per planned item), then
    `encode` (one embedding per planned item)."""

    async def plan(
        self, request: Mapping[str, Any], context: StopSignal
    ) -> PreprocessedRequest: ...

    async def encode(self, planned: PreprocessedRequest) -> list[ItemEmbedding]: ...


class LocalImages:
    """Images planned by the Rust driver and encoded by this process's encode stage; the
    bytes the driver fetched travel on inline to the stage."""

    def __init__(self, encoder: EncodeStage, policy: MediaPolicy, model_name: str) -> None:
        self.encoder = encoder
        self.policy = policy
        self.model_name = model_name

    async def plan(self, request: Mapping[str, Any], context: StopSignal) -> PreprocessedRequest:
        sources: list[str | bytes | media.Precomputed] = list(requests.image_sources(request))
        if len(sources) > self.policy.max_items:
            raise requests.RequestRefused(
                f"{len(sources)} images; this worker takes at most {self.policy.max_items}"
            )
        planned = await media.plan_request(
            self.encoder.spec,
            requests.token_ids(request),
            sources,
            self.policy,
            count_only=True,
            keep_bytes=True,
        )
        return PreprocessedRequest(
            request_id=context.id(),
            deadline=time.time() + REQUEST_DEADLINE_S,
            model=self.model_name,
            plan=planned.plan,
            payloads=[MediaPayload(data=None if d is None else bytes(d)) for d in planned.data],
        )

    async def encode(self, planned: PreprocessedRequest) -> list[ItemEmbedding]:
        encoded = await self.encoder.run(planned) if planned.plan.media else {}
        return [encoded[i] for i in range(len(planned.plan.media))]


class EncodedImages(msgspec.Struct, frozen=True, kw_only=True):
    """An encode worker's reply: the request's plan and, per planned item, the handle of its
    embeddings on the encode worker's transfer agent."""

    plan: RequestPlan
    embeddings: list[EmbeddingsHandle]


class RemoteImages:
    """Images planned and encoded by an encode worker (`DynamoEncodeHandler` behind `client`),
    their embeddings read by transfer; a request without images is planned here, with no
    hop. This worker never fetches media."""

    def __init__(self, client: Any, transfer: TransferAgent, local: LocalImages) -> None:
        self.client = client
        self.transfer = transfer
        self.local = local

    async def plan(self, request: Mapping[str, Any], context: StopSignal) -> PreprocessedRequest:
        """The encode worker's plan, each item's payload the handle of its embeddings."""
        if not requests.image_sources(request):
            return await self.local.plan(request, context)
        # What the encode worker reads of Dynamo's request; it fetches the images itself. The
        # request's context goes along: its id, and Dynamo's stop when the client leaves.
        forwarded = {key: request.get(key) for key in ("token_ids", "multi_modal_data")}
        stream = await self.client.round_robin(forwarded, context=context)
        replies = [reply.data() async for reply in stream]
        if not replies and (context.is_stopped() or context.is_killed()):
            # Dynamo stopped the encode worker's request too: it ends without a reply.
            raise RequestStopped.logged(context)
        if len(replies) != 1:
            raise RuntimeError(f"the encode worker sent {len(replies)} replies, not one")
        encoded = msgspec.convert(replies[0], EncodedImages)
        return PreprocessedRequest(
            request_id=context.id(),
            deadline=time.time() + REQUEST_DEADLINE_S,
            model=self.local.model_name,
            plan=encoded.plan,
            payloads=[MediaPayload.precomputed(handle) for handle in encoded.embeddings],
        )

    async def encode(self, planned: PreprocessedRequest) -> list[ItemEmbedding]:
        if not planned.plan.media:
            return []
        return await load_embeddings(self.transfer, planned.plan.media, planned.payloads)


class DynamoHandler:
    """Serves `generate` for Dynamo's frontend: one instance per worker process."""

    component = Role.WORKER.value

    def __init__(
        self,
        engine: Engine,
        images: Images,
        default_max_tokens: int,
        kv_events: DynamoKvEvents | None = None,
    ) -> None:
        self.engine = engine
        self.kv_events = kv_events
        self.images = images
        self.default_max_tokens = default_max_tokens

    async def plan(self, request: dict[str, Any], context: StopSignal) -> PreprocessedRequest:
        """The request planned, with its sampling and limits."""
        return msgspec.structs.replace(
            await self.images.plan(request, context),
            sampling=requests.sampling(request),
            stop=requests.stop_conditions(request, self.default_max_tokens),
        )

    async def embeddings(
        self, request: dict[str, Any], planned: PreprocessedRequest
    ) -> list[ItemEmbedding]:
        """The planned request's embeddings; its blocks remembered for the KV events."""
        embeddings = await self.images.encode(planned)
        if self.kv_events is not None:
            routing = requests.routing_mm_hashes(request, len(planned.plan.media))
            self.kv_events.remember(planned.plan, routing)
        return embeddings

    async def generate(
        self, request: dict[str, Any], context: StopSignal
    ) -> AsyncIterator[dict[str, Any]]:
        try:
            planned = await unless_stopped(self.plan(request, context), context)
            with tracked(self.component, planned) as progress, nvtx.nvtx_range(nvtx.PD_GENERATE):
                with nvtx.nvtx_range(nvtx.PD_LOAD_MULTIMODAL):
                    embeddings = await unless_stopped(self.embeddings(request, planned), context)
                chunks = self.engine.generate(engine_request(planned), embeddings)
                timed = stream_tokens(self.component, chunks, nvtx.PD_TTFT, prefills=True)
                async for chunk in until_stopped(timed, context):
                    yield requests.output(progress.passing(chunk))
        except RequestStopped:
            return
        except Exception as exc:
            raise dynamo_error(exc) from exc


class DynamoPrefillHandler(DynamoHandler):
    """Serves a prefill worker's `generate` (`--disaggregation-mode prefill`) for Dynamo's
    prefill router: plans and encodes as the aggregated worker does, runs the prompt, offers
    its KV by transfer and answers once with the handover, then ends the stream (the router
    reads it to the end before it calls a decode worker); the buffers stay offered until the
    decode worker has read them, or the lease times out."""

    component = Role.PREFILL.value

    def __init__(
        self,
        engine: Engine,
        images: Images,
        transfer: TransferAgent,
        default_max_tokens: int,
        kv_events: DynamoKvEvents | None = None,
    ) -> None:
        super().__init__(engine, images, default_max_tokens, kv_events)
        self.transfer = transfer

    async def generate(
        self, request: dict[str, Any], context: StopSignal
    ) -> AsyncIterator[dict[str, Any]]:
        try:
            planned = await unless_stopped(self.plan(request, context), context)
            with tracked(self.component, planned):
                with nvtx.nvtx_range(nvtx.PREFILL_LOAD_MULTIMODAL):
                    embeddings = await unless_stopped(self.embeddings(request, planned), context)
                with (
                    nvtx.nvtx_range(nvtx.PREFILL_ENGINE_ASYNC_GENERATE),
                    metrics.timed_stage(self.component, "prefill"),
                ):
                    kv = await self.engine.prefill(engine_request(planned), embeddings)
                done, _leases = await hand_over_kv(self.engine, self.transfer, kv)
            yield requests.prefill_output(done)
        except RequestStopped:
            return
        except Exception as exc:
            raise dynamo_error(exc) from exc


class DynamoDecodeHandler:
    """Serves a decode worker's `generate` (`--disaggregation-mode decode`), which Dynamo's
    prefill router calls with a prefill worker's handover: reads the prompt's KV by transfer,
    imports it and streams the completion from the prefill's first token. It plans nothing
    and never sees the images (their tokens are in the KV)."""

    component = Role.DECODE.value

    def __init__(
        self, engine: Engine, transfer: TransferAgent, default_max_tokens: int, model_name: str
    ) -> None:
        self.engine = engine
        self.transfer = transfer
        self.default_max_tokens = default_max_tokens
        self.model_name = model_name

    async def generate(
        self, request: dict[str, Any], context: StopSignal
    ) -> AsyncIterator[dict[str, Any]]:
        try:
            handover = requests.prefill_handover(request)
            # What the bookkeeping reads: the id, and the prompt as Dynamo sent it (its plan
            # stayed with the prefill worker).
            tracked_as = PreprocessedRequest(
                request_id=context.id(),
                deadline=time.time() + REQUEST_DEADLINE_S,
                model=self.model_name,
                plan=RequestPlan(token_ids=requests.token_ids(request)),
            )
            sampling = requests.sampling(request)
            stop = requests.stop_conditions(request, self.default_max_tokens)
            with (
                tracked(self.component, tracked_as) as progress,
                nvtx.nvtx_range(nvtx.DEC_FIRST_TOKEN),
            ):
                tensors = await fetch_kv(self.transfer, handover, self.component)
                # Engines whose KV travels as tensors read the request's id alone; the
                # handover's PrefillDone counts the prompt (Dynamo's ids are not expanded).
                kv = await self.engine.import_kv(
                    EngineRequest.from_plan(context.id(), tracked_as.plan, sampling, stop),
                    handover,
                    tensors,
                )
                chunks = self.engine.decode(kv, sampling, stop)
                timed = stream_tokens(self.component, chunks, nvtx.PD_TTFT, prefills=False)
                async for chunk in until_stopped(timed, context):
                    yield requests.output(progress.passing(chunk))
        except RequestStopped:
            return
        except Exception as exc:
            raise dynamo_error(exc) from exc


class DynamoEncodeHandler:
    """Serves an encode worker's `generate` (`--disaggregation-mode encode`) for the workers
    started with `--route-to-encoder`: plans and encodes the images of the request they
    forward and replies with the plan and the embeddings' transfer handles (`EncodedImages`).
    The buffers stay offered until the worker has read them, or the lease times out."""

    component = Role.ENCODE.value

    def __init__(self, images: LocalImages, transfer: TransferAgent) -> None:
        self.images = images
        self.transfer = transfer

    async def generate(
        self, request: dict[str, Any], context: StopSignal
    ) -> AsyncIterator[dict[str, Any]]:
        try:
            planned = await unless_stopped(self.images.plan(request, context), context)
            with tracked(self.component, planned), nvtx.nvtx_range(nvtx.ENC_GENERATE):
                embeddings = await unless_stopped(self.images.encode(planned), context)
                handles, _leases = await offer_embeddings(self.transfer, embeddings)
            yield msgspec.to_builtins(EncodedImages(plan=planned.plan, embeddings=handles))
        except RequestStopped:
            return
        except Exception as exc:
            raise dynamo_error(exc) from exc


def dynamo_error(exc: Exception) -> Exception:
    """The Dynamo exception for a failure: a request this worker cannot serve is the client's
    400 (InvalidArgument); one Dynamo's client raised (the encode worker's error, or its
    being unreachable) stays as Dynamo typed it; anything else keeps mmserve's status."""
    if isinstance(exc, requests.RequestRefused):
        return InvalidArgument(str(exc))
    if isinstance(exc, DynamoException):
        return exc
    return as_dynamo_error(as_remote_error(exc))


def as_dynamo_error(error: RemoteError) -> Exception:
    """The exception Dynamo's runtime turns into the client's HTTP error: a 400 keeps its
    message as InvalidArgument; any other status as HttpError."""
    message = f"{error.code}: {error.message}"
    status = protocol.http_status_for(error.code)
    if status == 400:
        return InvalidArgument(message)
    return HttpError(status, message)


Generate = Callable[[dict[str, Any], StopSignal], AsyncIterator[dict[str, Any]]]


def ended_when_cut(generate: Generate, cut: asyncio.Event) -> Generate:
    """`generate`, whose streams end with the client's 503 `unavailable` at their next item
    once `cut` is set (the worker's drain ran out of time), rather than being cancelled, which
    Dynamo's frontend would end as if complete."""

    async def generate_until_cut(
        request: dict[str, Any], context: StopSignal
    ) -> AsyncIterator[dict[str, Any]]:
        items = generate(request, context)
        try:
            async for item in items:
                if cut.is_set():
                    raise as_dynamo_error(
                        RemoteError(
                            protocol.ERROR_UNAVAILABLE,
                            "the worker stopped before the request finished (--drain-timeout)",
                        )
                    )
                yield item
        finally:
            aclose = getattr(items, "aclose", None)
            if aclose is not None:
                await aclose()

    return generate_until_cut


async def until_stopped(items: AsyncIterator[T], context: StopSignal) -> AsyncIterator[T]:
    """`items` until they end, or until Dynamo stops the request (client gone, router cancel):
    then the step in flight is cancelled, which aborts the engine's request, and
    `RequestStopped` raised."""
    stopped = asyncio.ensure_future(context.async_killed_or_stopped())
    try:
        while True:
            try:
                item = await _first_unless_stopped(anext(items), stopped, context)
            except StopAsyncIteration:
                return
            yield item
    finally:
        stopped.cancel()
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()


async def unless_stopped(step: Awaitable[T], context: StopSignal) -> T:
    """What `step` returns, unless Dynamo stops the request first: then `step` is cancelled (an
    encode in flight, the encode worker's reply awaited) and `RequestStopped` raised."""
    stopped = asyncio.ensure_future(context.async_killed_or_stopped())
    try:
        return await _first_unless_stopped(step, stopped, context)
    finally:
        stopped.cancel()


async def _first_unless_stopped(
    step: Awaitable[T], stopped: asyncio.Future[Any], context: StopSignal
) -> T:
    """What `step` returns, or `RequestStopped` (`step` cancelled) once `stopped` is done."""
    running = asyncio.ensure_future(step)
    await asyncio.wait({running, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not running.done():
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await running
        raise RequestStopped.logged(context)
    return running.result()
