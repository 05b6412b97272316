"""The KV handover from a prefill engine to a decode engine in another process, for engines
whose KV travels as exported tensors: prefill exports the prompt's cache and offers each tensor
by transfer (`hand_over_kv`: the `PrefillDone` with their handles, the first token and the
prompt and cached counts), decode fetches them (`fetch_kv`) and imports them into its engine
with its own request (the plan, which the handover does not carry back). The prefill and
decode cores use it, whichever transport serves them."""

from __future__ import annotations

import torch

from mmserve.engines.base import Engine, KvHandle
from mmserve.observability import metrics, nvtx
from mmserve.protocol import PrefillDone
from mmserve.transfer import Lease, TransferAgent


async def hand_over_kv(
    engine: Engine, transfer: TransferAgent, kv: KvHandle
) -> tuple[PrefillDone, list[Lease]]:
    """The prefill's KV as decode takes it over (the handle is released), and the leases that
    keep the offered buffers until decode has read them (or their timeout)."""
    try:
        tensors = await engine.export_kv(kv)
    finally:
        engine.release(kv)
    handles = {}
    leases = []
    for name, tensor in tensors.items():
        handles[name], lease = await transfer.offer(tensor)
        leases.append(lease)
    return kv.prefill_done(handles), leases


async def fetch_kv(
    transfer: TransferAgent, done: PrefillDone, component: str
) -> dict[str, torch.Tensor]:
    """The tensors of a prefill's handover, read by transfer (which completes its leases)."""
    with nvtx.nvtx_range(nvtx.NIXL_BEGIN_READ), metrics.timed_stage(component, "transfer"):
        return {name: await transfer.fetch(handle) for name, handle in done.kv.items()}
