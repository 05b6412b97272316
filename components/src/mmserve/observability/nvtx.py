"""NVTX ranges for nsys, behind `DYN_NVTX=1`.

When the variable is unset the public functions are bound at import to no-ops, so a disabled
range costs one call to a function that does nothing. Names follow Dynamo's multimodal path.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

# Range names, one place. `mm:fe:*` are the frontend's own.
ENC_GENERATE = "mm:enc:generate"
ENC_VISION_ENCODE = "mm:enc:vision_encode"
ENC_EMBEDDING_TRANSFER = "mm:enc:embedding_transfer"
NIXL_BEGIN_READ = "mm:nixl:begin_read"
NIXL_WAIT_COMPLETION = "mm:nixl:wait_completion"
PD_GENERATE = "mm:pd:generate"
PD_TTFT = "mm:pd:ttft"
PD_LOAD_MULTIMODAL = "mm:pd:load_multimodal"
DEC_FIRST_TOKEN = "mm:dec:first_token"
PREFILL_BOOTSTRAP = "mm:prefill:bootstrap"
PREFILL_LOAD_MULTIMODAL = "mm:prefill:load_multimodal"
PREFILL_ENGINE_ASYNC_GENERATE = "mm:prefill:engine_async_generate"
FE_PREPROCESS = "mm:fe:preprocess"
FE_ROUTE = "mm:fe:route"
FE_FIRST_TOKEN = "mm:fe:first_token"


def _enabled() -> bool:
    return os.environ.get("DYN_NVTX", "").strip().lower() in {"1", "true", "yes", "on"}


def _load_backend() -> tuple[Callable[[str], object], Callable[[object], object]] | None:
    """The start/end pair of the `nvtx` package, else torch's, else None.

    Start/end ranges (not push/pop) because async handlers interleave on one thread: a range
    belongs to its request, not to the thread's stack.
    """
    try:
        import nvtx  # type: ignore[import-not-found]

        return (lambda name: nvtx.start_range(message=name)), nvtx.end_range
    except ImportError:
        pass
    try:
        import torch.cuda.nvtx as torch_nvtx

        torch_nvtx.range_end(torch_nvtx.range_start("mm:probe"))
        return torch_nvtx.range_start, torch_nvtx.range_end
    except Exception as exc:  # torch without CUDA libraries raises here
        log.warning("DYN_NVTX=1 but no NVTX backend is usable (%s); ranges are off", exc)
        return None


def _noop_start(name: str) -> None:
    return None


def _noop_end(range_id: object) -> None:
    return None


_NULL_CONTEXT = contextlib.nullcontext()


def _noop_range(name: str) -> contextlib.AbstractContextManager[None]:
    return _NULL_CONTEXT


def _make_range(start: Callable[[str], object], end: Callable[[object], object]):
    @contextlib.contextmanager
    def nvtx_range(name: str) -> Iterator[None]:
        range_id = start(name)
        try:
            yield
        finally:
            end(range_id)

    return nvtx_range


_backend = _load_backend() if _enabled() else None
ENABLED: bool = _backend is not None

if _backend is None:
    range_start = _noop_start
    range_end = _noop_end
    nvtx_range = _noop_range
else:
    range_start, range_end = _backend  # type: ignore[assignment]
    nvtx_range = _make_range(*_backend)  # type: ignore[assignment]
