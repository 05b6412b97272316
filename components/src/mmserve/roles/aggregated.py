"""The aggregated role: prefill and decode in one engine; with an encode stage, encode too."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from mmserve.engines.base import Embeddings
from mmserve.observability import nvtx
from mmserve.protocol import PreprocessedRequest, TokenChunk
from mmserve.roles.base import RoleCore, engine_request, started, stream_tokens
from mmserve.roles.tracking import tracked
from mmserve.topology import Role


class AggregatedCore(RoleCore):
    role = Role.WORKER

    async def generate(self, request: PreprocessedRequest) -> AsyncGenerator[TokenChunk, None]:
        """The request's completion: its embeddings, its prompt, its tokens."""
        with tracked(self.component, request) as progress, nvtx.nvtx_range(nvtx.PD_GENERATE):
            with nvtx.nvtx_range(nvtx.PD_LOAD_MULTIMODAL):
                request = await self.skipping_cached(request)
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
