"""Where components take their NATS servers, TLS and credentials from: the environment."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from mmserve.runtime.nats_options import nats_connect_options, nats_servers
from mmserve.transfer.options import interface_holding
from tests.support.tls import make_certificates

VARIABLES = ("NATS_URL", "NATS_CA", "NATS_CERT", "NATS_KEY", "NATS_CREDS", "NATS_NKEY")
VARIABLES += ("NATS_USER", "NATS_PASSWORD", "NATS_TOKEN")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_servers_come_from_the_argument_the_environment_or_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert nats_servers() == ["nats://127.0.0.1:4222"]
    monkeypatch.setenv("NATS_URL", "nats://a:4222, nats://b:4222,,nats://c:4222")
    assert nats_servers() == ["nats://a:4222", "nats://b:4222", "nats://c:4222"]
    assert nats_servers("tls://d:4222") == ["tls://d:4222"]


def test_credentials_and_tls_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert nats_connect_options() == {}
    monkeypatch.setenv("NATS_USER", "worker")
    monkeypatch.setenv("NATS_PASSWORD", "secret")
    monkeypatch.setenv("NATS_CREDS", "/etc/mmserve/worker.creds")
    monkeypatch.setenv("NATS_CA", str(make_certificates(tmp_path).ca))
    options = nats_connect_options()
    assert (options["user"], options["password"]) == ("worker", "secret")
    assert options["user_credentials"] == "/etc/mmserve/worker.creds"
    assert isinstance(options["tls"], ssl.SSLContext)


def test_a_client_certificate_without_a_ca_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_CERT", "/etc/mmserve/client.pem")
    with pytest.raises(ValueError, match="NATS_CERT is set without NATS_CA"):
        nats_connect_options()


def test_the_transfer_bind_address_names_its_interface() -> None:
    assert interface_holding("127.0.0.1") == "lo"
    with pytest.raises(SystemExit, match="no network interface here holds it"):
        interface_holding("192.0.2.77")  # TEST-NET-1: on no interface
