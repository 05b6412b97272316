"""Every deployment pattern built in one process from the role handlers (`InProcess`): hf
engines on one checkpoint and the inline transfer backend. A pattern's handlers each have their
own engine; patterns share them (the i-th handler of each runs on the i-th engine), with every
cache emptied before each request, so no pattern reads what another left and a checkpoint
costs three engine loads, not eight. The video and audio pattern tests use it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from mmserve.engines.hf import HfEngine
from mmserve.protocol import PreprocessedRequest, TokenChunk
from mmserve.topology import Role
from tests.worker.test_handlers import InProcess

# Each pattern: its handlers (role, encodes) in start order, and the role a request enters at.
PATTERNS: dict[str, tuple[list[tuple[Role, bool]], Role]] = {
    "agg": ([(Role.WORKER, True)], Role.WORKER),
    "E/PD": ([(Role.WORKER, False), (Role.ENCODE, True)], Role.ENCODE),
    "EP/D": ([(Role.PREFILL, True), (Role.DECODE, False)], Role.DECODE),
    "E/P/D": ([(Role.PREFILL, False), (Role.DECODE, False), (Role.ENCODE, True)], Role.ENCODE),
}


@dataclass(frozen=True)
class Patterns:
    deployments: dict[str, InProcess]
    engines: list[HfEngine]

    async def stream(self, name: str, request: PreprocessedRequest) -> list[TokenChunk]:
        """`request`'s chunks from pattern `name`, sent where that pattern takes requests,
        every engine's caches emptied first."""
        for engine in self.engines:
            await engine.clear_caches()
        _, entry = PATTERNS[name]
        return await self.deployments[name].stream(entry, request)


@asynccontextmanager
async def every_pattern(nats_url: str, model_path: Path) -> AsyncIterator[Patterns]:
    """Each pattern's handlers on `model_path`, all serving."""
    async with AsyncExitStack() as stack:
        engines: list[HfEngine] = []
        for _ in range(max(len(handlers) for handlers, _ in PATTERNS.values())):
            engines.append(await HfEngine.load(model_path))
            stack.push_async_callback(engines[-1].close)
        deployments: dict[str, InProcess] = {}
        for name, (handlers, _) in PATTERNS.items():
            deployment = deployments[name] = InProcess(nats_url, model_path)
            stack.push_async_callback(deployment.close)
            for (role, encodes), engine in zip(handlers, engines, strict=False):
                await deployment.start(role, engine, encode=encodes)
        yield Patterns(deployments, engines)
