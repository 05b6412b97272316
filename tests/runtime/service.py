"""A test service run as its own process: `python tests/runtime/service.py URL NAMESPACE COMPONENT`.

Endpoints (requests and replies are `TokenChunk`s):
  echo       unary: replies `<instance_id>:<text>`
  count      stream: `token_ids=[n]` -> n chunks, each after `usage.prompt_tokens` ms
  sleep      unary: sleeps until cancelled
  started    unary: the request ids whose `count` or `sleep` handler has started
  cancelled  unary: the request ids whose `count` or `sleep` saw a cancellation
  fail       unary: `text="typed"` raises a typed RemoteError, anything else a ValueError
  big        unary: replies `token_ids[0]` bytes of text
Exits 0 after SIGTERM/SIGINT, once in-flight calls are done.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

from mmserve import protocol as p
from mmserve.runtime import RemoteError, RequestContext, Runtime, run

Chunk = p.TokenChunk


async def main(url: str, namespace: str, component: str, keepalive_interval: str = "0.25") -> None:
    runtime = await Runtime.connect(
        url, namespace, keepalive_interval=float(keepalive_interval), graceful_timeout=60.0
    )
    runtime.install_signal_handlers()
    cancelled: list[str] = []
    started: list[str] = []

    async def echo(req: Chunk, ctx: RequestContext) -> Chunk:
        return Chunk(request_id=ctx.request_id, text=f"{runtime.instance_id}:{req.text}")

    async def count(req: Chunk, ctx: RequestContext) -> AsyncIterator[Chunk]:
        delay = (req.usage.prompt_tokens if req.usage else 0) / 1000
        started.append(ctx.request_id)
        try:
            for i in range(req.token_ids[0]):
                await asyncio.sleep(delay)
                yield Chunk(request_id=ctx.request_id, token_ids=[i])
        except asyncio.CancelledError:
            cancelled.append(ctx.request_id)
            raise

    async def sleep(req: Chunk, ctx: RequestContext) -> Chunk:
        started.append(ctx.request_id)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(ctx.request_id)
            raise
        return Chunk(request_id=ctx.request_id)

    async def seen_started(req: Chunk, ctx: RequestContext) -> Chunk:
        return Chunk(request_id=ctx.request_id, text=",".join(started))

    async def seen_cancelled(req: Chunk, ctx: RequestContext) -> Chunk:
        return Chunk(request_id=ctx.request_id, text=",".join(cancelled))

    async def fail(req: Chunk, ctx: RequestContext) -> Chunk:
        if req.text == "typed":
            raise RemoteError(p.ERROR_BAD_REQUEST, "typed failure")
        raise ValueError("untyped failure")

    async def big(req: Chunk, ctx: RequestContext) -> Chunk:
        return Chunk(request_id=ctx.request_id, text="x" * req.token_ids[0])

    for name, handler in [
        ("echo", echo),
        ("count", count),
        ("sleep", sleep),
        ("started", seen_started),
        ("cancelled", seen_cancelled),
        ("fail", fail),
        ("big", big),
    ]:
        await runtime.serve(component, name, handler, Chunk)
    await runtime.wait_for_shutdown()
    await runtime.shutdown()


if __name__ == "__main__":
    run(main(*sys.argv[1:5]))
