"""Errors as the HTTP client sees them: a status and OpenAI's error JSON."""

from __future__ import annotations

from mmserve._mm import MediaError
from mmserve.protocol import OpenAIError, OpenAIErrorBody, http_status_for


class ApiError(Exception):
    """A request that ends with an error response: `{"error": {message, type, param, code}}`,
    with the code's status from the catalogue (`protocol.errors`) unless a peer said another."""

    def __init__(
        self, code: str, message: str, param: str | None = None, *, status: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = http_status_for(code) if status is None else status
        self.code = code
        self.message = message
        self.param = param

    @property
    def type(self) -> str:
        """OpenAI's error `type`: what kind of failure, for clients that branch on it."""
        if self.status == 401:
            return "authentication_error"
        if self.status == 404:
            return "not_found_error"
        if self.status < 500:
            return "invalid_request_error"
        return "server_error"

    def body(self) -> OpenAIError:
        return OpenAIError(
            error=OpenAIErrorBody(
                message=self.message, type=self.type, param=self.param, code=self.code
            )
        )

    @classmethod
    def from_media_error(
        cls, err: MediaError, item_params: list[str], item: int | None = None
    ) -> ApiError:
        """A refused or broken media item. The core's stable code is kept as the error code;
        sizes over a limit answer 413, everything else about the item (a forbidden address, a
        local path outside the allowed roots, a fetch timeout, an undecodable image) 400.
        `item_params` names each item's place in the request, for `param`; `item` is the
        failing item's index where the core's error does not carry one."""
        code, message, index = (*err.args, None)[:3]
        index = item if index is None else index
        param = item_params[index] if isinstance(index, int) and index < len(item_params) else None
        return cls(code, message, param)
