"""The aggregated role (`mmserve worker`): prefill and decode in one engine; with `--encode`,
encode too."""

from __future__ import annotations

from collections.abc import AsyncIterator

from mmserve.engines.base import Embeddings
from mmserve.observability import nvtx
from mmserve.protocol import PreprocessedRequest, TokenChunk
from mmserve.runtime import RequestContext
from mmserve.topology import GENERATE, Role
from mmserve.worker.base import RoleHandler, engine_request, started, stream_tokens
from mmserve.worker.tracking import tracked


class AggregatedHandler(RoleHandler):
    role = Role.WORKER

    async def serve(self) -> None:
        await self.serve_reset_prefix_cache()
        await self.runtime.serve(self.component, GENERATE, self.generate, PreprocessedRequest)

    async def generate(
        self, request: PreprocessedRequest, ctx: RequestContext
    ) -> AsyncIterator[TokenChunk]:
        with tracked(self.component, request) as progress, nvtx.nvtx_range(nvtx.PD_GENERATE):
            with nvtx.nvtx_range(nvtx.PD_LOAD_MULTIMODAL):
                embeddings = await self.embeddings(request)
            chunks = self._chunks(request, embeddings)
            async for chunk in stream_tokens(self.component, chunks, nvtx.PD_TTFT, prefills=True):
                yield progress.passing(chunk)

    async def _chunks(
        self, request: PreprocessedRequest, embeddings: Embeddings
    ) -> AsyncIterator[TokenChunk]:
        prompt = engine_request(request)
        chunks = await self.run_prompt(
            request, embeddings, lambda given: started(self.engine.generate(prompt, given))
        )
        async for chunk in chunks:
            yield chunk
