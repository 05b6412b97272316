"""A Dynamo request's images planned: by the Rust driver in this process (`LocalImages`: fetch
under the media policy, hash, size, expand each placeholder, positions), or by an encode worker
(`RemoteImages`, `--route-to-encoder`), which plans and encodes them and replies with the
handles of their embeddings (`EncodedImages`). Either way the result is a planned request
whose payloads the role core reads: the bytes to encode here, or the embeddings to load by
transfer."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

import msgspec

from mmserve import _mm, media
from mmserve.dynamo import requests
from mmserve.dynamo.stopping import RequestStopped, StopSignal
from mmserve.media.policy import MediaPolicy
from mmserve.protocol import EmbeddingsHandle, MediaPayload, PreprocessedRequest, RequestPlan

# Dynamo's request carries no deadline; the engine path reads none, the field is the wire's.
REQUEST_DEADLINE_S = 3600.0


class Images(Protocol):
    """Plans a request's images: the request with one payload per planned item."""

    async def plan(
        self, request: Mapping[str, Any], context: StopSignal
    ) -> PreprocessedRequest: ...


class LocalImages:
    """Images planned by the Rust driver; the bytes it fetched travel on inline to the encode
    stage."""

    def __init__(self, spec: _mm.Spec, policy: MediaPolicy, model_name: str) -> None:
        self.spec = spec
        self.policy = policy
        self.model_name = model_name

    async def plan(self, request: Mapping[str, Any], context: StopSignal) -> PreprocessedRequest:
        sources: list[str | bytes | media.Precomputed] = list(requests.image_sources(request))
        if len(sources) > self.policy.max_items:
            raise requests.RequestRefused(
                f"{len(sources)} images; this worker takes at most {self.policy.max_items}"
            )
        planned = await media.plan_request(
            self.spec,
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


class EncodedImages(msgspec.Struct, frozen=True, kw_only=True):
    """An encode worker's reply: the request's plan and, per planned item, the handle of its
    embeddings on the encode worker's transfer agent."""

    plan: RequestPlan
    embeddings: list[EmbeddingsHandle]

    @classmethod
    def of(cls, encoded: PreprocessedRequest) -> EncodedImages:
        """The reply for a request the encode core encoded (every item offered)."""
        handles = [payload.embeddings for payload in encoded.payloads]
        if any(handle is None for handle in handles):
            raise RuntimeError("the encode core left an item of a Dynamo request unencoded")
        return cls(plan=encoded.plan, embeddings=[h for h in handles if h is not None])


class RemoteImages:
    """Images planned and encoded by an encode worker (`DynamoEncode` behind `client`): the
    request's payloads are the handles of their embeddings. A request without images is
    planned here, with no hop. This worker never fetches media."""

    def __init__(self, client: Any, local: LocalImages) -> None:
        self.client = client
        self.local = local

    async def plan(self, request: Mapping[str, Any], context: StopSignal) -> PreprocessedRequest:
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
