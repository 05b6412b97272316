"""How a worker's failures reach the caller: the client's mistakes and the options an engine
does not serve stay 4xx, an overloaded engine is a 503, and the worker's own faults 500."""

from __future__ import annotations

import pytest

from mmserve import protocol
from mmserve.engines.base import EngineError, EngineOverloaded, MediaGone, UnsupportedRequest
from mmserve.roles.errors import as_remote_error, typed_errors
from mmserve.runtime.errors import RemoteError


@pytest.mark.parametrize(
    ("failure", "code", "status"),
    [
        (UnsupportedRequest("n > 1 is not served here"), protocol.ERROR_UNSUPPORTED_OPTION, 400),
        (MediaGone(0), protocol.ERROR_MEDIA_ID_GONE, 400),
        (EngineOverloaded("the queue is full"), protocol.ERROR_UNAVAILABLE, 503),
        (EngineError("bad shapes"), protocol.ERROR_INTERNAL, 500),
        (ValueError("a bug"), protocol.ERROR_INTERNAL, 500),
    ],
)
def test_a_failure_is_the_error_its_cause_deserves(
    failure: Exception, code: str, status: int
) -> None:
    error = as_remote_error(failure)
    assert (error.code, protocol.http_status_for(error.code)) == (code, status)
    assert str(failure) in error.message
    with pytest.raises(RemoteError) as raised, typed_errors():
        raise failure
    assert raised.value.code == code and raised.value.__cause__ is failure
