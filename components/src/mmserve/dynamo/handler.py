"""The role cores (`mmserve.roles`) as Dynamo endpoints: each adapter translates Dynamo's
preprocessed request (a dict) into mmserve's planned request, runs the core, and translates its
replies into Dynamo's output dicts; `dynamo_endpoint` maps every failure to Dynamo's exceptions
in one place, and ends the stream quietly when Dynamo stopped the request.

- `DynamoAggregated` (the default worker): plan (`Translator`: the images here or on an
  encode worker, sampling, limits), the aggregated core, token outputs.
- `DynamoPrefill` (`--disaggregation-mode prefill`): plan, the prefill core, one output with
  the KV handover (mmserve's `PrefillDone`, by transfer) for Dynamo's prefill router.
- `DynamoDecode` (`--disaggregation-mode decode`): the handover the router brings, the decode
  core, token outputs. It plans nothing and never sees the images (their tokens are in the KV).
- `DynamoEncode` (`--disaggregation-mode encode`): plan the images of the request a worker
  started with `--route-to-encoder` forwards, the encode core, one reply with the plan and the
  embeddings' transfer handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import msgspec
from dynamo.llm.exceptions import DynamoException, EngineShutdown, HttpError, InvalidArgument

from mmserve import protocol
from mmserve.dynamo import requests
from mmserve.dynamo.images import REQUEST_DEADLINE_S, EncodedImages, Images
from mmserve.dynamo.kv_events import DynamoKvEvents
from mmserve.dynamo.stopping import RequestStopped, StopSignal, unless_stopped, until_stopped
from mmserve.protocol import PrefillDone, PrefillReply, PreprocessedRequest, RequestPlan
from mmserve.reasoning import ReasoningTokens, after_reasoning
from mmserve.roles import AggregatedCore, DecodeCore, EncodeCore, PrefillCore, RoleCore
from mmserve.roles.encode import Forward
from mmserve.roles.errors import as_remote_error
from mmserve.runtime.errors import RemoteError
from mmserve.topology import Role

Generate = Callable[[dict[str, Any], StopSignal], AsyncIterator[dict[str, Any]]]


class Translator:
    """Dynamo's requests as mmserve's planned requests: the served model's name, the completion
    length of a request that sets none, and for the roles that plan, how the images are
    planned (`images`) and the planned blocks remembered for the KV events."""

    def __init__(
        self,
        model_name: str,
        default_max_tokens: int,
        images: Images | None = None,
        kv_events: DynamoKvEvents | None = None,
        reasoning: ReasoningTokens | None = None,
    ) -> None:
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.images = images
        self.kv_events = kv_events
        # The model's reasoning tags (--dyn-reasoning-parser): a grammar starts after them.
        self.reasoning = reasoning

    async def planned(self, request: dict[str, Any], context: StopSignal) -> PreprocessedRequest:
        """The request planned (its images here or by an encode worker), with its sampling
        and limits."""
        if self.images is None:
            raise RuntimeError("this Dynamo worker plans no request")
        planned = await unless_stopped(self.images.plan(request, context), context)
        if self.kv_events is not None:
            routing = requests.routing_mm_hashes(request, len(planned.plan.media))
            self.kv_events.remember(planned.plan, routing)
        return self._with_limits(planned, request)

    def as_sent(self, request: dict[str, Any], context: StopSignal) -> PreprocessedRequest:
        """The prompt as Dynamo sent it, unplanned (a decode worker's: the plan stayed with
        the prefill worker; engines whose KV travels as tensors read the request's id alone,
        and the handover counts the prompt)."""
        unplanned = PreprocessedRequest(
            request_id=context.id(),
            deadline=time.time() + REQUEST_DEADLINE_S,
            model=self.model_name,
            plan=RequestPlan(token_ids=requests.token_ids(request)),
        )
        return self._with_limits(unplanned, request)

    def _with_limits(
        self, planned: PreprocessedRequest, request: dict[str, Any]
    ) -> PreprocessedRequest:
        sampling = requests.sampling(request)
        grammar = after_reasoning(sampling.grammar, self.reasoning, planned.plan.token_ids)
        return msgspec.structs.replace(
            planned,
            sampling=msgspec.structs.replace(sampling, grammar=grammar),
            stop=requests.stop_conditions(request, self.default_max_tokens),
        )


class DynamoAdapter:
    """A role core behind Dynamo's request plane; `generate` is the endpoint's handler."""

    def __init__(self, core: RoleCore, translator: Translator) -> None:
        self.core = core
        self.translator = translator

    def generate(
        self, request: dict[str, Any], context: StopSignal
    ) -> AsyncGenerator[dict[str, Any], None]:
        raise NotImplementedError


class DynamoAggregated(DynamoAdapter):
    core: AggregatedCore

    async def generate(
        self, request: dict[str, Any], context: StopSignal
    ) -> AsyncGenerator[dict[str, Any], None]:
        planned = await self.translator.planned(request, context)
        outputs = requests.Outputs()
        async for chunk in until_stopped(self.core.generate(planned), context):
            yield outputs.of(chunk)


class DynamoPrefill(DynamoAdapter):
    """The handover answers once, then the stream ends: the router reads it to the end before
    it calls a decode worker, and the buffers stay offered until that worker has read them, or
    the lease times out."""

    core: PrefillCore

    async def generate(
        self, request: dict[str, Any], context: StopSignal
    ) -> AsyncGenerator[dict[str, Any], None]:
        planned = await self.translator.planned(request, context)
        replies = self.core.prefill(planned, wait_for_reads=False)
        async for reply in until_stopped(replies, context):
            # No bootstrap comes: an engine that moves its own KV (SGLang) is not served here.
            if isinstance(reply, PrefillDone):
                yield requests.prefill_output(reply)


class DynamoDecode(DynamoAdapter):
    core: DecodeCore

    async def generate(
        self, request: dict[str, Any], context: StopSignal
    ) -> AsyncGenerator[dict[str, Any], None]:
        handover = requests.prefill_handover(request)
        chunks = self.core.generate(self.translator.as_sent(request, context), _once(handover))
        outputs = requests.Outputs()
        async for chunk in until_stopped(chunks, context):
            yield outputs.of(chunk)


class DynamoEncode(DynamoAdapter):
    core: EncodeCore

    async def generate(
        self, request: dict[str, Any], context: StopSignal
    ) -> AsyncGenerator[dict[str, Any], None]:
        planned = await self.translator.planned(request, context)
        replies = self.core.generate(planned, _reply_to_caller)
        async for reply in until_stopped(replies, context):
            yield msgspec.to_builtins(reply)


ADAPTERS: dict[Role, type[DynamoAdapter]] = {
    Role.WORKER: DynamoAggregated,
    Role.PREFILL: DynamoPrefill,
    Role.DECODE: DynamoDecode,
    Role.ENCODE: DynamoEncode,
}


async def _once(done: PrefillDone) -> AsyncGenerator[PrefillReply, None]:
    yield done


async def _reply_to_caller() -> Forward[EncodedImages]:
    async def reply(encoded: PreprocessedRequest) -> AsyncGenerator[EncodedImages, None]:
        yield EncodedImages.of(encoded)

    return reply


def dynamo_endpoint(
    generate: Callable[[dict[str, Any], StopSignal], AsyncGenerator[dict[str, Any], None]],
) -> Generate:
    """`generate` as Dynamo serves it: a request Dynamo stopped ends its stream, and any
    failure is raised as Dynamo's exception (`dynamo_error`)."""

    async def served(request: dict[str, Any], context: StopSignal) -> AsyncIterator[dict[str, Any]]:
        try:
            async with contextlib.aclosing(generate(request, context)) as items:
                async for item in items:
                    yield item
        except RequestStopped:
            return
        except Exception as exc:
            raise dynamo_error(exc) from exc

    return served


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


def ended_when_cut(generate: Generate, cut: asyncio.Event) -> Generate:
    """`generate`, whose streams end with Dynamo's `EngineShutdown` at their next item once
    `cut` is set (the worker's drain ran out of time), rather than being cancelled, which
    Dynamo's frontend would end as if complete: a frontend started with `--migration-limit`
    moves the request to another worker (it resends the prompt with the tokens so far),
    another answers the client's error."""

    async def generate_until_cut(
        request: dict[str, Any], context: StopSignal
    ) -> AsyncIterator[dict[str, Any]]:
        items = generate(request, context)
        try:
            async for item in items:
                if cut.is_set():
                    raise EngineShutdown(
                        "the worker stopped before the request finished (--drain-timeout)"
                    )
                yield item
        finally:
            aclose = getattr(items, "aclose", None)
            if aclose is not None:
                await aclose()

    return generate_until_cut
