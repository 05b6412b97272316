"""NATS secured: TLS on every connection (certificates made by the test), a user per role with
its password in the environment (never on a command line), subject permissions that keep a
worker to its own subjects, and clients without credentials or without TLS refused; NKey and
token logins; a 3-node cluster with TLS routes. The frontend serves HTTPS with its API key."""

from __future__ import annotations

import asyncio
import secrets
import socket
import ssl
from pathlib import Path

import httpx
import nats
import nats.errors
import nkeys
import pytest

from mmserve import protocol
from mmserve.runtime import Disconnected, Runtime
from mmserve.runtime.discovery import list_instances
from mmserve.runtime.nats_options import nats_connect_options
from mmserve.runtime.nats_server import NatsServer
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.deployment import Deployment
from tests.support.nats_cluster import NatsCluster
from tests.support.tls import Certificates, make_certificates
from tests.support.waiting import wait_until_async

CONFIGS = Path(__file__).parents[2] / "configs" / "nats"
SECURE_CONFIG = CONFIGS / "secure.conf"
SECURE_CLUSTER_CONFIG = CONFIGS / "cluster-secure.conf"
API_KEY = secrets.token_hex(8)


def test_tls_auth_and_permissions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    certs = make_certificates(tmp_path)
    passwords = {role: secrets.token_hex(12) for role in ("frontend", "worker")}
    login = {role: {"NATS_USER": role, "NATS_PASSWORD": pw} for role, pw in passwords.items()}
    with NatsServer(config=str(SECURE_CONFIG), env=_server_env(certs, passwords)) as server:
        deployment = Deployment(
            "agg",
            build_tiny_model("qwen2_vl"),
            server.url,
            tmp_path,
            worker_flags=["--engine", "mock"],
            frontend_flags=[
                "--ssl-certfile",
                str(certs.cert),
                "--ssl-keyfile",
                str(certs.key),
            ],
            env={"NATS_CA": str(certs.ca), "MMSERVE_API_KEY": API_KEY},
            process_env=login,
            https=str(certs.ca),
        )
        with deployment.running():
            body = {
                "model": deployment.model_path.name,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            }
            url = f"{deployment.base_url}/v1/chat/completions"
            refused = httpx.post(url, json=body, verify=str(certs.ca))
            assert refused.status_code == 401
            answered = httpx.post(
                url, json=body, verify=str(certs.ca), headers={"Authorization": f"Bearer {API_KEY}"}
            )
            assert answered.status_code == 200, answered.text
            for process in [*deployment.processes.values()]:
                argv = Path(f"/proc/{process.pid}/cmdline").read_bytes()
                assert not any(pw.encode() in argv for pw in passwords.values())
            tls = ssl.create_default_context(cafile=str(certs.ca))
            asyncio.run(_refusals(server.url, tls, passwords["worker"]))
            monkeypatch.setenv("NATS_CA", str(certs.ca))
            for name, value in login["worker"].items():
                monkeypatch.setenv(name, value)
            asyncio.run(_worker_kept_to_its_subjects(server.url, deployment.namespace))


def _server_env(certs: Certificates, passwords: dict[str, str]) -> dict[str, str]:
    """What secure.conf and users.conf read from the server's environment."""
    return {
        "NATS_TLS_CERT": str(certs.cert),
        "NATS_TLS_KEY": str(certs.key),
        **{f"MMSERVE_{role.upper()}_PASSWORD": pw for role, pw in passwords.items()},
    }


async def _refusals(url: str, tls: ssl.SSLContext, worker_password: str) -> None:
    once = {"allow_reconnect": False, "connect_timeout": 2}
    with pytest.raises(nats.errors.Error, match=r"[Aa]uthorization"):
        await nats.connect(url, tls=tls, **once)  # no credentials
    with pytest.raises((nats.errors.Error, OSError)):
        await nats.connect(url, user="worker", password=worker_password, **once)  # no TLS
    with pytest.raises(nats.errors.Error, match=r"[Aa]uthorization"):
        await nats.connect(url, tls=tls, user="worker", password="wrong", **once)


async def _worker_kept_to_its_subjects(url: str, namespace: str) -> None:
    """With the worker's credentials (from the environment, as components take them): a
    forged record of another component and a request to another component's endpoint are
    refused by the server, while the worker's own records are there."""
    violations: list[str] = []

    async def on_error(exc: Exception) -> None:
        violations.append(str(exc).lower())

    nc = await nats.connect(url, error_cb=on_error, **nats_connect_options())
    try:
        forged = protocol.InstanceRecord(
            namespace=namespace, component="decode", endpoint="generate",
            instance_id="f" * 16, host="x", pid=1, started_at=0.0,
        )  # fmt: skip
        subject = f"$KV.mmserve_instances.{namespace}.decode.generate.{'f' * 16}"
        await nc.publish(subject, protocol.encode(forged))
        await nc.publish(f"mmserve.{namespace}.frontend.generate", b"")
        await nc.flush()
        await wait_until_async(lambda: len(violations) >= 2, 5, "the server's -ERR replies")
        assert all("permissions violation for publish" in v for v in violations), violations
        assert not await list_instances(nc, namespace, "decode")
        assert await list_instances(nc, namespace, "worker")
    finally:
        await nc.close()


def _nkey_seed_file(directory: Path) -> tuple[Path, str]:
    """A user NKey made here: its seed in a file (what NATS_NKEY names) and its public key."""
    seed = nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER)
    path = directory / "worker.nk"
    path.write_bytes(seed)
    path.chmod(0o600)
    return path, nkeys.from_seed(bytearray(seed)).public_key.decode()


@pytest.mark.parametrize("method", ["nkey", "token"])
async def test_nkey_and_token_credentials_come_from_the_environment(
    method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = secrets.token_hex(16)
    seed_path, public_key = _nkey_seed_file(tmp_path)
    config = tmp_path / "auth.conf"
    if method == "nkey":
        config.write_text(f"authorization {{ users = [ {{ nkey: {public_key} }} ] }}\n")
        (tmp_path / "stranger").mkdir()
        stranger, _ = _nkey_seed_file(tmp_path / "stranger")  # a key the server does not know
        good, bad = {"NATS_NKEY": str(seed_path)}, {"NATS_NKEY": str(stranger)}
    else:
        config.write_text("authorization { token: $MMSERVE_NATS_TOKEN }\n")
        good, bad = {"NATS_TOKEN": token}, {"NATS_TOKEN": "wrong"}
    with NatsServer(config=str(config), env={"MMSERVE_NATS_TOKEN": token}) as server:
        for name in ("NATS_NKEY", "NATS_TOKEN", "NATS_USER", "NATS_PASSWORD", "NATS_CA"):
            monkeypatch.delenv(name, raising=False)
        with pytest.raises(Disconnected, match=r"[Aa]uthorization"):
            await Runtime.connect(server.url, "auth", connect_wait=0.5)
        for name, value in bad.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(Disconnected, match=r"[Aa]uthorization"):
            await Runtime.connect(server.url, "auth", connect_wait=0.5)
        for name, value in good.items():
            monkeypatch.setenv(name, value)
        async with await Runtime.connect(server.url, "auth") as runtime:
            heard: asyncio.Queue[protocol.KvEvent] = asyncio.Queue()
            await runtime.subscribe("t", protocol.KvEvent, heard.put)
            await runtime.flush()
            event = protocol.KvEvent("w", 0, protocol.KvCleared())
            await runtime.publish("t", event)
            assert await asyncio.wait_for(heard.get(), 5.0) == event


def test_a_secure_cluster_routes_over_tls_and_serves_across_nodes(tmp_path: Path) -> None:
    """cluster-secure.conf: routes verify each other's certificates, clients need TLS and a
    user; the frontend on one node reaches the worker on another, discovery replicated."""
    certs = make_certificates(tmp_path)
    passwords = {role: secrets.token_hex(12) for role in ("frontend", "worker")}
    node_env = {**_server_env(certs, passwords), "NATS_TLS_CA": str(certs.ca)}
    with NatsCluster(3, config=SECURE_CLUSTER_CONFIG, env=node_env) as cluster:
        for node in cluster.nodes:
            assert _route_port_takes_only_the_cas_certificates(
                node.env["NATS_CLUSTER_LISTEN"], certs
            )
        first, _, last = cluster.nodes
        deployment = Deployment(
            "agg",
            build_tiny_model("qwen2_vl"),
            cluster.url,
            tmp_path,
            worker_flags=["--engine", "mock"],
            env={"NATS_CA": str(certs.ca)},
            process_env={
                "frontend": {
                    "NATS_URL": first.url,
                    "NATS_USER": "frontend",
                    "NATS_PASSWORD": passwords["frontend"],
                },
                "worker": {
                    "NATS_URL": last.url,
                    "NATS_USER": "worker",
                    "NATS_PASSWORD": passwords["worker"],
                },
            },
        )
        with deployment.running():
            assert cluster.node_of(deployment.processes["frontend"].pid) is first
            assert cluster.node_of(deployment.processes["worker"].pid) is last
            assert cluster.replicas("KV_mmserve_instances") == 3
            body = {
                "model": deployment.model_path.name,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            }
            answered = httpx.post(f"{deployment.base_url}/v1/chat/completions", json=body)
            assert answered.status_code == 200, answered.text
            assert answered.json()["usage"]["completion_tokens"] == 4
            tls = ssl.create_default_context(cafile=str(certs.ca))
            asyncio.run(_refusals(cluster.nodes[1].url, tls, passwords["worker"]))


def _route_port_takes_only_the_cas_certificates(address: str, certs: Certificates) -> bool:
    """A node's cluster port speaks TLS from the first byte and wants a client certificate:
    a node's certificate gets its INFO line, a client without one is refused."""
    host, _, port = address.rpartition(":")

    def hello(client_cert: bool) -> bytes:
        context = ssl.create_default_context(cafile=str(certs.ca))
        if client_cert:
            context.load_cert_chain(str(certs.cert), str(certs.key))
        with (
            socket.create_connection((host, int(port)), timeout=5) as raw,
            context.wrap_socket(raw, server_hostname=host) as route,
        ):
            return route.recv(5)

    try:
        hello(client_cert=False)
    except ssl.SSLError as exc:
        refused = "CERTIFICATE_REQUIRED" in str(exc)
    else:
        refused = False
    return refused and hello(client_cert=True) == b"INFO "
