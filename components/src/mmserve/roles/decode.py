"""The decode role: joins a prefill's KV handover (its bootstrap, or the exported tensors by
transfer), imports it with its own request and streams the completion. Where the handover comes
from is the transport's: mmserve's decode worker asks a prefill worker for it, Dynamo's prefill
router brings it in the request."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

import torch

from mmserve import protocol
from mmserve.engines.base import KvHandle
from mmserve.observability import nvtx
from mmserve.protocol import (
    BootstrapInfo,
    PrefillDone,
    PrefillReply,
    PreprocessedRequest,
    TokenChunk,
)
from mmserve.roles.base import RoleCore, engine_request, stream_tokens
from mmserve.roles.handover import fetch_kv
from mmserve.roles.tracking import tracked
from mmserve.runtime.errors import RemoteError
from mmserve.topology import Role


class DecodeCore(RoleCore):
    role = Role.DECODE

    async def generate(
        self, request: PreprocessedRequest, handover: AsyncGenerator[PrefillReply, None]
    ) -> AsyncGenerator[TokenChunk, None]:
        """The completion of `request`, whose prompt a prefill ran and hands over in
        `handover`'s replies."""
        with tracked(self.component, request) as progress:
            with nvtx.nvtx_range(nvtx.DEC_FIRST_TOKEN):
                kv = await self._take_over(request, handover)
            chunks = self.engine.decode(kv, request.sampling, request.stop)
            async for chunk in stream_tokens(self.component, chunks, nvtx.PD_TTFT, prefills=False):
                yield progress.passing(chunk)

    async def _take_over(
        self, request: PreprocessedRequest, handover: AsyncGenerator[PrefillReply, None]
    ) -> KvHandle:
        """Read the handover to its end, fetching the KV when it comes, so a prefill that
        waits for the read sees it before it finishes."""
        bootstrap: BootstrapInfo | None = None
        done: PrefillDone | None = None
        tensors: dict[str, torch.Tensor] = {}
        async with contextlib.aclosing(handover):
            async for reply in handover:
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
