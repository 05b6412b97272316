"""The prefill role: runs prompts for decode workers; with an encode stage, encodes their media
too.

When its engine moves the KV cache itself (SGLang), prefill answers decode at once with the
engine's `BootstrapInfo`, so decode joins the handover while the prompt runs. It then prefills
and hands over a `PrefillDone`: the first tokens and, for engines whose KV travels as tensors,
their handles, offered until decode has read them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from mmserve.engines.base import Embeddings
from mmserve.observability import metrics, nvtx
from mmserve.protocol import BootstrapInfo, PrefillDone, PrefillReply, PreprocessedRequest
from mmserve.roles.base import RoleCore, engine_request
from mmserve.roles.handover import hand_over_kv
from mmserve.roles.tracking import tracked
from mmserve.topology import Role
from mmserve.transfer import Lease


class PrefillCore(RoleCore):
    role = Role.PREFILL

    async def prefill(
        self, request: PreprocessedRequest, *, wait_for_reads: bool
    ) -> AsyncGenerator[PrefillReply, None]:
        """The engine's bootstrap (where it has one), then the handover. With
        `wait_for_reads`, the stream ends once decode has read the offered KV (mmserve's
        decode reads it while the stream is open); otherwise at once, the buffers staying
        offered until read or their lease's timeout (Dynamo's router reads the stream to its
        end before it calls decode)."""
        with tracked(self.component, request):
            with nvtx.nvtx_range(nvtx.PREFILL_BOOTSTRAP):
                bootstrap = self.engine.bootstrap_info()
                if bootstrap is not None:
                    yield bootstrap
            with nvtx.nvtx_range(nvtx.PREFILL_LOAD_MULTIMODAL):
                request = await self.skipping_cached(request)
                embeddings = await self.embeddings(request)
            done, leases = await self._prefill(request, embeddings, bootstrap)
            yield done
            if wait_for_reads:
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
