"""Simulated hosts for multi-host tests and benchmarks: Linux network namespaces on a bridge.

`SimulatedHosts(n)` makes n namespaces ("hosts"), each with one interface `eth0` at
10.200.0.<i+1>/24, joined by veth pairs to a bridge that lives in a further namespace of its own:
no link or address is added outside the namespaces this helper creates, and deleting them
(`close()`, also on failure) removes everything. Names carry a random token, so parallel runs
do not collide. Needs root and iproute2; `available()` says whether this machine allows it.

A process runs on a host through `ip netns exec` (`host.popen`); code of the test process
itself reaches a host's network from a thread that joined the namespace (`host.call`), since a
network namespace is a property of each thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, TypeVar

T = TypeVar("T")

SUBNET = "10.200.0"
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


@functools.cache
def available() -> str | None:
    """None when simulated hosts can be made here, else why not (for a skip reason): root
    alone is not enough in a container without the capability to make namespaces."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces)"
    if shutil.which("ip") is None:
        return "simulated hosts need iproute2's ip"
    probe = f"mm{secrets.token_hex(3)}probe"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as exc:
        return f"network namespaces cannot be made here: {exc}"
    _ip("netns", "del", probe)
    return None


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


@dataclass
class SimulatedHost:
    name: str  # the namespace
    address: str
    link: str  # its veth end on the bridge, which `SimulatedHosts.partition` takes down
    _executor: concurrent.futures.ThreadPoolExecutor | None = field(default=None, repr=False)

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(
        self, argv: Sequence[str], *, env: dict[str, str], log: IO[bytes]
    ) -> subprocess.Popen[bytes]:
        """Start `argv` on this host, in a session of its own (a group kill ends it all)."""
        # UCX sees one machine (one boot id) and would move NIXL's data by cross-memory attach
        # or shared memory: without those transports it goes over the network, as between
        # separate machines.
        return subprocess.Popen(
            self.command(argv),
            env={**env, "UCX_TLS": "^sm"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def received_bytes(self) -> int:
        """Bytes its interface received so far: what came over the (simulated) network."""
        result = subprocess.run(
            ["ip", "-n", self.name, "-j", "-s", "link", "show", "eth0"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return int(json.loads(result.stdout)[0]["stats64"]["rx"]["bytes"])

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on a thread inside this host's network namespace: sockets it
        opens (an HTTP client's, say) live on this host."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=8, initializer=self._enter
            )
        return self._executor.submit(fn, *args, **kwargs).result()

    def _enter(self) -> None:
        with open(f"/var/run/netns/{self.name}") as ns:
            if _libc.setns(ns.fileno(), _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.name} failed")

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


class SimulatedHosts:
    """n hosts on one bridge; a context manager that tears everything down however it ends."""

    def __init__(self, count: int) -> None:
        token = secrets.token_hex(3)
        self._bridge_ns = f"mm{token}br"
        self.hosts = [
            SimulatedHost(name=f"mm{token}h{i}", address=f"{SUBNET}.{i + 1}", link=f"b{i}")
            for i in range(count)
        ]
        self._created: list[str] = []

    def __enter__(self) -> SimulatedHosts:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getitem__(self, index: int) -> SimulatedHost:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def _build(self) -> None:
        br = self._bridge_ns
        _ip("netns", "add", br)
        self._created.append(br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for host in self.hosts:
            _ip("netns", "add", host.name)
            self._created.append(host.name)
            _ip("-n", host.name, "link", "set", "lo", "up")
            # Both ends are made inside the namespaces: nothing appears on the machine's own.
            _ip("-n", br, "link", "add", host.link, "type", "veth", "peer", "name", "eth0",
                "netns", host.name)  # fmt: skip
            _ip("-n", br, "link", "set", host.link, "master", "br0", "up")
            _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.name, "link", "set", "eth0", "up")

    def partition(self, host: SimulatedHost) -> None:
        """Cut `host` off the others (its link to the bridge goes down)."""
        _ip("-n", self._bridge_ns, "link", "set", host.link, "down")

    def heal(self, host: SimulatedHost) -> None:
        _ip("-n", self._bridge_ns, "link", "set", host.link, "up")

    def close(self) -> None:
        for host in self.hosts:
            host.close()
        while self._created:
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", self._created.pop())


def start_nats(
    host: SimulatedHost, log_path: str, args: Sequence[str] = (), timeout: float = 30.0
) -> tuple[subprocess.Popen[bytes], str]:
    """`mmserve nats` on `host`, bound to its address: the process and the URL it printed."""
    argv = [sys.executable, "-m", "mmserve.cli", "nats", "--host", host.address, *args]
    with open(log_path, "wb") as log:
        process = host.popen(argv, env=dict(os.environ), log=log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = open(log_path, errors="replace").read().splitlines()
        if url := next((line for line in lines if line.startswith(("nats://", "tls://"))), None):
            return process, url
        if process.poll() is not None:
            raise RuntimeError(f"mmserve nats on {host.name} exited: {lines[-5:]}")
        time.sleep(0.05)
    process.kill()
    process.wait()
    raise TimeoutError(f"mmserve nats on {host.name} printed no URL within {timeout} s")
