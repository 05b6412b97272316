"""Fixtures of the transfer tests: a backend, a probe process and an agent per module."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from mmserve.transfer import TransferAgent
from mmserve.transfer.probe import ProbeProcess
from tests.support.transfer import BACKENDS, make_agent, start_probe


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def probe(nats_url: str, backend: str) -> AsyncIterator[ProbeProcess]:
    started = await start_probe(nats_url, backend)
    yield started
    await started.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def agent(backend: str) -> AsyncIterator[TransferAgent]:
    async with make_agent(backend) as created:
        yield created
