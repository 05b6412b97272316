"""Worker failures as typed errors for the caller: a media item the core refuses stays a 4xx
all the way to the HTTP edge, so does an option the engine does not serve or a grammar it
cannot compile (in time), an overloaded engine is a 503, and the worker's own faults 500."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mmserve import _mm, protocol
from mmserve.engines.base import EngineOverloaded, MediaGone, UnsupportedRequest
from mmserve.grammar.base import GrammarError
from mmserve.protocol import ERROR_MEDIA_ID_GONE
from mmserve.runtime.errors import RemoteError


def as_remote_error(exc: Exception) -> RemoteError:
    if isinstance(exc, RemoteError):
        return exc
    if isinstance(exc, _mm.MediaError):
        code, message = exc.args[0], exc.args[1]
        return RemoteError(code, message)
    if isinstance(exc, MediaGone):
        return RemoteError(ERROR_MEDIA_ID_GONE, str(exc))
    if isinstance(exc, EngineOverloaded):
        return RemoteError(protocol.ERROR_UNAVAILABLE, str(exc))
    if isinstance(exc, UnsupportedRequest):
        return RemoteError(protocol.ERROR_UNSUPPORTED_OPTION, str(exc))
    if isinstance(exc, GrammarError):
        return RemoteError(exc.code, str(exc))
    # Requests reach a worker planned and validated by the frontend: whatever else fails here
    # is the deployment's fault, not the client's.
    return RemoteError(protocol.ERROR_INTERNAL, f"{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def typed_errors() -> Iterator[None]:
    """Re-raise any failure inside as the `RemoteError` the caller should see."""
    try:
        yield
    except Exception as exc:
        raise as_remote_error(exc) from exc
