"""The decode role (`mmserve decode`), the entry point of disaggregation: asks a prefill worker
to run the prompt, joins its KV handover (its bootstrap, or the exported tensors by transfer),
and streams the completion."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

import torch

from mmserve import protocol
from mmserve.engines.base import KvHandle
from mmserve.observability import nvtx
from mmserve.protocol import (
    BootstrapInfo,
    PrefillDone,
    PrefillReply,
    PrefillRequest,
    PreprocessedRequest,
    TokenChunk,
)
from mmserve.runtime import RemoteError, RequestContext
from mmserve.runtime.retry import stream_routed
from mmserve.topology import GENERATE, Role
from mmserve.worker.base import RoleHandler, engine_request, stream_tokens
from mmserve.worker.handover import fetch_kv
from mmserve.worker.tracking import tracked


class DecodeHandler(RoleHandler):
    role = Role.DECODE

    async def serve(self) -> None:
        self.prefill = self.runtime.client(Role.PREFILL.value, GENERATE)
        await self.serve_reset_prefix_cache()
        await self.runtime.serve(self.component, GENERATE, self.generate, PreprocessedRequest)

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[TokenChunk]:
        with tracked(self.component, request) as progress:
            with nvtx.nvtx_range(nvtx.DEC_FIRST_TOKEN):
                kv = await self._remote_prefill(request)
            chunks = self.engine.decode(kv, request.sampling, request.stop)
            async for chunk in stream_tokens(self.component, chunks, nvtx.PD_TTFT, prefills=False):
                yield progress.passing(chunk)

    async def _remote_prefill(self, request: PreprocessedRequest) -> KvHandle:
        """Run the prompt on a prefill worker (the one the router chose, if any); read its
        stream to the end, so prefill sees its KV buffers read before it finishes."""
        bootstrap: BootstrapInfo | None = None
        done: PrefillDone | None = None
        tensors: dict[str, torch.Tensor] = {}
        replies: AsyncGenerator[PrefillReply, None] = stream_routed(
            self.prefill,
            PrefillRequest(request=request),
            PrefillReply,
            instance_id=request.route.get(Role.PREFILL.value),
            request_id=request.request_id,
            deadline=request.deadline,
        )
        async with contextlib.aclosing(replies):
            async for reply in replies:
                if isinstance(reply, BootstrapInfo):
                    bootstrap = reply
                elif isinstance(reply, PrefillDone):
                    done = reply
                    tensors = await fetch_kv(self.transfer, reply, self.component)
        if done is None:
            raise RemoteError(
                protocol.ERROR_PROTOCOL, "prefill ended without handing over the KV cache"
            )
        # The plan is this worker's own: the handover carries the cache alone.
        return await self.engine.import_kv(engine_request(request), done, tensors, bootstrap)
