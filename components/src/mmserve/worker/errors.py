"""Worker failures as typed errors for the caller: a client mistake stays a 4xx all the way to
the HTTP edge, an overloaded engine a 503."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mmserve import _mm, protocol
from mmserve.engines.base import EngineError, EngineOverloaded
from mmserve.runtime import RemoteError


def as_remote_error(exc: Exception) -> RemoteError:
    if isinstance(exc, RemoteError):
        return exc
    if isinstance(exc, _mm.MediaError):
        code, message = exc.args[0], exc.args[1]
        return RemoteError(code, message)
    if isinstance(exc, EngineOverloaded):
        return RemoteError(protocol.ERROR_UNAVAILABLE, str(exc))
    if isinstance(exc, EngineError | ValueError):
        return RemoteError(protocol.ERROR_BAD_REQUEST, str(exc))
    return RemoteError(protocol.ERROR_INTERNAL, f"{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def typed_errors() -> Iterator[None]:
    """Re-raise any failure inside as the `RemoteError` the caller should see."""
    try:
        yield
    except Exception as exc:
        raise as_remote_error(exc) from exc
