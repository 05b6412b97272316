"""The prefill role (`mmserve prefill`): runs prompts for decode workers; with `--encode`,
encodes their media too.

When its engine moves the KV cache itself (SGLang), prefill answers decode at once with the
engine's `BootstrapInfo`, so decode joins the handover while the prompt runs. It then prefills
and ends with a `PrefillDone`: the first token and, for engines whose KV travels as tensors,
their handles; the stream ends once decode has read them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from mmserve.engines.base import Embeddings
from mmserve.observability import metrics, nvtx
from mmserve.protocol import (
    BootstrapInfo,
    PrefillDone,
    PrefillReply,
    PrefillRequest,
    PreprocessedRequest,
)
from mmserve.runtime import RequestContext
from mmserve.topology import GENERATE, Role
from mmserve.transfer import Lease
from mmserve.worker.base import RoleHandler, engine_request
from mmserve.worker.handover import hand_over_kv
from mmserve.worker.tracking import tracked


class PrefillHandler(RoleHandler):
    role = Role.PREFILL

    async def serve(self) -> None:
        await self.serve_reset_prefix_cache()
        await self.runtime.serve(self.component, GENERATE, self.generate, PrefillRequest)

    async def generate(
        self, prefill: PrefillRequest, ctx: RequestContext
    ) -> AsyncIterator[PrefillReply]:
        request = prefill.request
        with tracked(self.component, request):
            with nvtx.nvtx_range(nvtx.PREFILL_BOOTSTRAP):
                bootstrap = self.engine.bootstrap_info()
                if bootstrap is not None:
                    yield bootstrap
            with nvtx.nvtx_range(nvtx.PREFILL_LOAD_MULTIMODAL):
                embeddings = await self.embeddings(request)
            done, leases = await self._prefill(request, embeddings, bootstrap)
            yield done
            with nvtx.nvtx_range(nvtx.NIXL_WAIT_COMPLETION):
                await asyncio.gather(*(lease.wait() for lease in leases))

    async def _prefill(
        self,
        request: PreprocessedRequest,
        embeddings: Embeddings,
        bootstrap: BootstrapInfo | None,
    ) -> tuple[PrefillDone, list[Lease]]:
        with (
            nvtx.nvtx_range(nvtx.PREFILL_ENGINE_ASYNC_GENERATE),
            metrics.timed_stage(self.component, "prefill"),
        ):
            prompt = engine_request(request)
            kv = await self.run_prompt(
                request, embeddings, lambda given: self.engine.prefill(prompt, given, bootstrap)
            )
        return await hand_over_kv(self.engine, self.transfer, kv)
