"""A 3-node nats-server cluster from `configs/nats/cluster.conf`, for the fault tests and the
multi-host benchmark: each node a `NatsServer` (so a test can SIGKILL one and start it again)
with its monitoring port, by which the cluster's health and its clients are read."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from mmserve.runtime.nats_server import NatsServer
from tests.support.deployment import free_port

NAME = "NATS_SERVER_NAME"
CLUSTER_CONFIG = Path(__file__).parents[2] / "configs" / "nats" / "cluster.conf"


class NatsCluster:
    def __init__(
        self,
        size: int = 3,
        host: str = "127.0.0.1",
        config: Path = CLUSTER_CONFIG,
        env: dict[str, str] | None = None,
    ) -> None:
        """`config`: cluster.conf or cluster-secure.conf; `env`: what every node's environment
        adds (certificates, passwords) to the node's own name and routes."""
        routes = [f"nats://{host}:{free_port()}" for _ in range(size)]
        self.nodes = [
            NatsServer(
                host,
                free_port(),
                config=str(config),
                http_port=free_port(),
                env={
                    **(env or {}),
                    NAME: f"n{i}",
                    "NATS_CLUSTER_LISTEN": route.removeprefix("nats://"),
                    **{f"NATS_ROUTE_{j + 1}": other for j, other in enumerate(routes)},
                },
            )
            for i, route in enumerate(routes)
        ]

    @property
    def url(self) -> str:
        """Every node, as components take them (`NATS_URL`)."""
        return ",".join(node.url for node in self.nodes)

    def __enter__(self) -> NatsCluster:
        try:
            for node in self.nodes:
                node.start()
            self.wait_healthy()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def monitor(self, node: NatsServer, path: str) -> dict:
        url = f"http://{node.host}:{node.http_port}/{path}"
        return httpx.get(url, timeout=5).json()  # type: ignore[no-any-return]

    def healthy(self, node: NatsServer) -> bool:
        """Routed to every other node, and JetStream current (it has a meta leader and its
        replicas caught up)."""
        try:
            routed = {r["remote_name"] for r in self.monitor(node, "routez")["routes"]}
            health = self.monitor(node, "healthz")
        except (httpx.HTTPError, ValueError):
            return False
        return len(routed) == len(self.nodes) - 1 and health.get("status") == "ok"

    def wait_healthy(self, timeout: float = 30.0) -> float:
        """Wait until every running node is healthy; returns how long that took."""
        started = time.monotonic()
        while not all(self.healthy(node) for node in self.nodes if node.is_running()):
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"nats cluster not healthy within {timeout} s")
            time.sleep(0.1)
        return time.monotonic() - started

    def node_of(self, pid: int) -> NatsServer:
        """The node process `pid` is connected to (mmserve names its connections by pid)."""
        for node in self.nodes:
            if node.is_running():
                names = {c.get("name") for c in self.monitor(node, "connz")["connections"]}
                if f"mmserve-{pid}" in names:
                    return node
        raise LookupError(f"process {pid} is connected to no node")

    def replicas(self, stream: str, current: bool = False) -> int:
        """How many nodes hold `stream` (`current`: and are caught up), as its leader sees it
        (a follower's view of the other followers lags)."""
        for node in self.nodes:
            if not node.is_running():
                continue
            jsz = self.monitor(node, "jsz?streams=true")
            for account in jsz.get("account_details", []):
                for detail in account.get("stream_detail", []):
                    cluster = detail.get("cluster", {})
                    if detail["name"] != stream or cluster.get("leader") != node.env[NAME]:
                        continue
                    followers = cluster.get("replicas", [])
                    if current:
                        followers = [r for r in followers if r.get("current")]
                    return 1 + len(followers)
        return 0
