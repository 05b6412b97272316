"""Typed errors of calls over the runtime.

A handler raises `RemoteError(code, message)` (or a subclass) to answer with a typed error; any
other exception becomes code `internal`. On the caller side every failure of a call, remote or
local (deadline, lost connection, payload too large), is raised as a `RemoteError` subclass.
"""

from __future__ import annotations

from mmserve import protocol


class RemoteError(Exception):
    """A failed call, with a stable `code` (see `mmserve.protocol`) and an HTTP status hint.
    `lost_instance` names the instance whose loss failed it, where one did (it crashed, went
    silent, or stopped at its drain deadline; `protocol.ErrorMessage.lost_instance`): the
    failures a request may migrate away from."""

    code: str = protocol.ERROR_INTERNAL

    def __init__(
        self,
        code: str | None,
        message: str,
        status: int | None = None,
        *,
        lost_instance: str = "",
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.status = protocol.http_status_for(self.code) if status is None else status
        self.lost_instance = lost_instance

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"

    def to_message(self, request_id: str = "") -> protocol.ErrorMessage:
        return protocol.ErrorMessage(
            code=self.code,
            message=self.message,
            status=self.status,
            request_id=request_id,
            lost_instance=self.lost_instance,
        )

    @classmethod
    def from_message(cls, error: protocol.ErrorMessage) -> RemoteError:
        """The most specific subclass for the code, so callers can `except DeadlineExceeded`."""
        subclass = _BY_CODE.get(error.code, RemoteError)
        return subclass(error.code, error.message, error.status, lost_instance=error.lost_instance)


class DeadlineExceeded(RemoteError):
    code = protocol.ERROR_DEADLINE_EXCEEDED


class Cancelled(RemoteError):
    code = protocol.ERROR_CANCELLED


class Unavailable(RemoteError):
    """No instance serves the endpoint (or the addressed instance is gone)."""

    code = protocol.ERROR_UNAVAILABLE


class Disconnected(RemoteError):
    """The connection to NATS or to the serving instance was lost while the call was open."""

    code = protocol.ERROR_DISCONNECTED


class PayloadTooLarge(RemoteError):
    """A message exceeds the NATS max payload: send the bulk through `mmserve.transfer`."""

    code = protocol.ERROR_PAYLOAD_TOO_LARGE


class WireProtocolError(RemoteError):
    """A frame could not be decoded (other protocol version, lost frame, wrong type)."""

    code = protocol.ERROR_PROTOCOL


_BY_CODE: dict[str, type[RemoteError]] = {
    cls.code: cls
    for cls in (
        DeadlineExceeded,
        Cancelled,
        Unavailable,
        Disconnected,
        PayloadTooLarge,
        WireProtocolError,
    )
}
