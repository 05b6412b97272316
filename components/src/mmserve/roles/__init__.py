"""The role core: what each role does with a request, whatever transport brought it. One core
per role (`aggregated`, `prefill`, `decode`, `encode`) on the shared `base` (embeddings, the
prompt with its skipped-item fallback, the token stream's metrics), with the per-request
bookkeeping (`tracking`), typed errors (`errors`) and the KV handover (`handover`). The NATS
workers (`worker.endpoints`) and the Dynamo backend (`dynamo.handler`) are thin adapters over
these cores; `build_core` is the one role -> core table both use."""

from __future__ import annotations

from mmserve.encode.stage import EncodeStage
from mmserve.engines.base import Engine
from mmserve.roles.aggregated import AggregatedCore
from mmserve.roles.base import EncodeElsewhere, RoleCore
from mmserve.roles.decode import DecodeCore
from mmserve.roles.encode import EncodeCore
from mmserve.roles.prefill import PrefillCore
from mmserve.topology import Role
from mmserve.transfer import TransferAgent

CORES: dict[Role, type[RoleCore]] = {
    Role.WORKER: AggregatedCore,
    Role.PREFILL: PrefillCore,
    Role.DECODE: DecodeCore,
    Role.ENCODE: EncodeCore,
}


def build_core(
    role: Role,
    engine: Engine,
    transfer: TransferAgent,
    encoder: EncodeStage | None,
    *,
    instance_id: str,
    encode_elsewhere: EncodeElsewhere | None = None,
) -> RoleCore:
    """The core of `role` on this process's engine, transfer and encode stage (where it
    encodes; the encode role always does)."""
    if role is Role.ENCODE and encoder is None:
        raise ValueError("the encode role needs an encode stage")
    return CORES[role](
        engine, transfer, encoder, instance_id=instance_id, encode_elsewhere=encode_elsewhere
    )


__all__ = [
    "CORES",
    "AggregatedCore",
    "DecodeCore",
    "EncodeCore",
    "EncodeElsewhere",
    "PrefillCore",
    "RoleCore",
    "build_core",
]
