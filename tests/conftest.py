"""Fixtures shared by every test suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mmserve.runtime.nats_server import NatsServer, nats_url_from_env_or_private


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    """`$NATS_URL` (CI starts one), else a private nats-server for the whole session."""
    with nats_url_from_env_or_private() as url:
        yield url


@pytest.fixture
def private_nats() -> Iterator[NatsServer]:
    """A nats-server of this test alone, which the test may stop, kill and restart."""
    with NatsServer() as server:
        yield server
