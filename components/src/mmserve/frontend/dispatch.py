"""The seam between the HTTP frontend and the serving pipeline.

The frontend turns an OpenAI request into a `PreprocessedRequest` and hands it to a
`Dispatcher`; the dispatcher picks the first hop (an aggregated worker, an encode worker or a
decode worker, whichever the deployment registered) and streams back `TokenChunk`s.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from mmserve.protocol import PreprocessedRequest, TensorHandle, TokenChunk

if TYPE_CHECKING:
    import torch

# Ships one array of a request (pixel_values with frontend decoding, else the encoded bytes of
# an inline image; a precomputed embedding as a tensor, which may be bfloat16) to the first
# hop by transfer; returns the handle that travels in the `MediaPayload`.
TensorSink = Callable[[str, "np.ndarray | torch.Tensor"], Awaitable[TensorHandle]]


class Dispatcher(Protocol):
    """What the frontend needs from the pipeline.

    `generate` yields token chunks in order; the last one carries `finish_reason` and `usage`. The
    frontend stops iterating (closing the iterator, or cancelling the task awaiting it) when the
    client disconnects or the deadline passes (stop strings are the engines' job,
    `engines.sampling`): the implementation must then cancel the work downstream. Failures are
    raised as `mmserve.runtime.RemoteError` (whose code and status the client sees, as the runtime's
    `Client.stream` raises them); a request whose worker is lost mid-stream is migrated first
    where the implementation can (`frontend.migration`), the client seeing one stream.
    `ready()` is true only while a full path to a worker exists.

    `reset_prefix_cache()` asks every instance of the deployment, whatever its role, to clear
    its prefix and encoder caches, and returns how many did once all of them have; when any
    failed, was busy, gone or too slow it raises a `RemoteError` whose message names each.
    """

    def ready(self) -> bool: ...

    def generate(self, request: PreprocessedRequest) -> AsyncIterator[TokenChunk]: ...

    async def reset_prefix_cache(self) -> int: ...


@dataclass(frozen=True)
class Pipeline:
    """What the frontend is connected to: the dispatcher, and the pixel sink that
    `--frontend-decoding` needs."""

    dispatcher: Dispatcher
    tensor_sink: TensorSink | None = None
