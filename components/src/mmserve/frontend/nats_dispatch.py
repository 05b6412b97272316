"""The frontend's pipeline over NATS: discovers which workers are deployed and sends each
request to the right first hop.

| deployed                        | pattern         | first hop of a request with media |
|---------------------------------|-----------------|-----------------------------------|
| worker --encode                 | agg             | worker                            |
| encode + worker                 | E/PD            | encode                            |
| encode + decode + prefill       | E/P/D           | encode                            |
| decode + prefill [--encode]     | EP/D, P/D       | decode                            |

A request without media skips the encode worker. Within a component, requests are balanced
round robin by NATS queue groups.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator

import numpy as np
import torch

from mmserve.frontend.dispatch import Pipeline
from mmserve.protocol import PreprocessedRequest, TensorHandle, TokenChunk
from mmserve.runtime import InstanceWatcher, Runtime, Unavailable
from mmserve.transfer import TransferAgent, create_transfer_agent

GENERATE = "generate"
COMPONENTS = ("encode", "worker", "decode", "prefill")


class NatsDispatcher:
    def __init__(self, runtime: Runtime, watchers: dict[str, InstanceWatcher]) -> None:
        self.runtime = runtime
        self._watchers = watchers
        self._clients = {name: runtime.client(name, GENERATE) for name in COMPONENTS}

    @classmethod
    async def start(cls, runtime: Runtime) -> NatsDispatcher:
        watchers = {name: await runtime.watch(name, GENERATE) for name in COMPONENTS}
        return cls(runtime, watchers)

    def _has(self, component: str) -> bool:
        return bool(self._watchers[component].instances())

    def _language_hop(self) -> str | None:
        """Where an encoded (or text-only) request goes."""
        if self._has("decode") and self._has("prefill"):
            return "decode"
        if self._has("worker"):
            return "worker"
        return None

    def first_hop(self, has_media: bool) -> str | None:
        language_hop = self._language_hop()
        if language_hop is None:
            return None
        if has_media and self._has("encode"):
            return "encode"
        return language_hop

    def ready(self) -> bool:
        return self._language_hop() is not None

    async def generate(self, request: PreprocessedRequest) -> AsyncIterator[TokenChunk]:
        hop = self.first_hop(bool(request.media))
        if hop is None:
            raise Unavailable(
                None,
                "no worker is ready: the deployment needs a worker, or a decode and a prefill "
                "worker",
            )
        replies = self._clients[hop].stream(
            request, TokenChunk, request_id=request.request_id, deadline=request.deadline
        )
        async with contextlib.aclosing(replies):
            async for chunk in replies:
                yield chunk


class TransferTensorSink:
    """Offers a request's arrays by transfer (pixel_values with frontend decoding, else the
    encoded bytes of inline images); the encoder reads them. Each lease gives its buffer back
    once read (or when it times out)."""

    def __init__(self, transfer: TransferAgent) -> None:
        self.transfer = transfer

    async def __call__(self, request_id: str, array: np.ndarray) -> TensorHandle:
        handle, _lease = await self.transfer.offer(torch.from_numpy(array))
        return handle


@contextlib.asynccontextmanager
async def open_nats_pipeline(args: argparse.Namespace) -> AsyncIterator[Pipeline]:
    """The deployment of `--namespace` on NATS, with a transfer agent for the arrays the
    frontend ships to the encoders."""
    async with contextlib.AsyncExitStack() as stack:
        runtime = await Runtime.connect(namespace=args.namespace)
        stack.push_async_callback(runtime.shutdown)
        transfer = create_transfer_agent(args)
        stack.push_async_callback(transfer.close)
        yield Pipeline(await NatsDispatcher.start(runtime), TransferTensorSink(transfer))
