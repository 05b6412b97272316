"""The Dynamo endpoint's handler: plan a preprocessed request with mmserve's Rust driver
(expanded ids, media runs, M-RoPE positions), encode its images, run the engine, stream
Dynamo's output dicts; stop when Dynamo stops the request; raise errors as Dynamo's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol, TypeVar

from dynamo.llm.exceptions import HttpError, InvalidArgument

from mmserve import media, protocol
from mmserve.dynamo import requests
from mmserve.dynamo.kv_events import DynamoKvEvents
from mmserve.encode.stage import EncodeStage
from mmserve.engines.base import Engine
from mmserve.media.policy import MediaPolicy
from mmserve.observability import nvtx
from mmserve.protocol import MediaPayload, PreprocessedRequest
from mmserve.roles import Role
from mmserve.runtime import RemoteError
from mmserve.worker.base import engine_request, stream_tokens
from mmserve.worker.errors import as_remote_error
from mmserve.worker.tracking import tracked

log = logging.getLogger("mmserve.dynamo")

T = TypeVar("T")

# Dynamo's request carries no deadline; the engine path reads none, the field is the wire's.
REQUEST_DEADLINE_S = 3600.0


class RequestStopped(asyncio.CancelledError):
    """Dynamo stopped the request: counted and logged as cancelled, then the stream ends."""


class StopSignal(Protocol):
    """The part of Dynamo's request `Context` the handler reads."""

    def id(self) -> str: ...

    def async_killed_or_stopped(self) -> Any: ...


class DynamoHandler:
    """Serves `generate` for Dynamo's frontend: one instance per worker process."""

    component = Role.WORKER.value

    def __init__(
        self,
        engine: Engine,
        encoder: EncodeStage,
        policy: MediaPolicy,
        model_name: str,
        default_max_tokens: int,
        kv_events: DynamoKvEvents | None = None,
    ) -> None:
        self.engine = engine
        self.kv_events = kv_events
        self.encoder = encoder
        self.policy = policy
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens

    async def generate(
        self, request: dict[str, Any], context: StopSignal
    ) -> AsyncIterator[dict[str, Any]]:
        try:
            planned = await self._preprocess(request, context.id())
            with tracked(self.component, planned), nvtx.nvtx_range(nvtx.PD_GENERATE):
                with nvtx.nvtx_range(nvtx.PD_LOAD_MULTIMODAL):
                    encoded = await self.encoder.run(planned) if planned.plan.media else {}
                embeddings = [encoded[i] for i in range(len(planned.plan.media))]
                if self.kv_events is not None:
                    routing = requests.routing_mm_hashes(request, len(planned.plan.media))
                    self.kv_events.remember(planned.plan, routing)
                chunks = self.engine.generate(engine_request(planned), embeddings)
                timed = stream_tokens(self.component, chunks, nvtx.PD_TTFT, prefills=True)
                async for chunk in until_stopped(timed, context):
                    yield requests.output(chunk)
        except RequestStopped:
            return
        except requests.RequestRefused as exc:
            raise InvalidArgument(str(exc)) from exc
        except Exception as exc:
            raise as_dynamo_error(as_remote_error(exc)) from exc

    async def _preprocess(self, request: Mapping[str, Any], request_id: str) -> PreprocessedRequest:
        """mmserve's request for Dynamo's: the Rust driver fetches each image once, sizes it,
        expands its placeholder and computes the positions; the bytes travel on inline to the
        encode stage in this process."""
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
            request_id=request_id,
            deadline=time.time() + REQUEST_DEADLINE_S,
            model=self.model_name,
            plan=planned.plan,
            payloads=[MediaPayload(data=None if d is None else bytes(d)) for d in planned.data],
            sampling=requests.sampling(request),
            stop=requests.stop_conditions(request, self.default_max_tokens),
        )


def as_dynamo_error(error: RemoteError) -> Exception:
    """The exception Dynamo's runtime turns into the client's HTTP error: a 400 keeps its
    message as InvalidArgument; any other status as HttpError."""
    message = f"{error.code}: {error.message}"
    status = protocol.http_status_for(error.code)
    if status == 400:
        return InvalidArgument(message)
    return HttpError(status, message)


async def until_stopped(items: AsyncIterator[T], context: StopSignal) -> AsyncIterator[T]:
    """`items` until they end, or until Dynamo stops the request (client gone, router cancel):
    then the step in flight is cancelled, which aborts the engine's request, and
    `RequestStopped` raised."""
    stopped = asyncio.ensure_future(context.async_killed_or_stopped())
    try:
        while True:
            step = asyncio.ensure_future(anext(items))
            await asyncio.wait({step, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                log.info("request %s stopped by Dynamo", context.id())
                step.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await step
                raise RequestStopped(f"request {context.id()} stopped by Dynamo")
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        stopped.cancel()
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()
