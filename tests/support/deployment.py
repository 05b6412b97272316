"""Real deployments for end-to-end tests: every component is its own process on one NATS,
isolated from other tests by a namespace of its own; optionally each on a simulated host of its
own (`tests/support/hosts.py`)."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from tests.support import forked
from tests.support.hosts import SimulatedHost

T = TypeVar("T")
# A component: its own interpreter, or forked from the preloaded forkserver.
Process = subprocess.Popen[bytes] | forked.ForkedProcess

# Each pattern as (process name, role, role flags); the frontend comes on top.
PATTERNS: dict[str, list[tuple[str, str, list[str]]]] = {
    "agg": [("worker", "worker", ["--encode"])],
    "ep_d": [("prefill", "prefill", ["--encode"]), ("decode", "decode", [])],
    "e_pd": [("encode", "encode", []), ("worker", "worker", [])],
    "e_p_d": [("encode", "encode", []), ("prefill", "prefill", []), ("decode", "decode", [])],
}
STARTUP_TIMEOUT_S = 240.0


class CountingFileServer(http.server.ThreadingHTTPServer):
    """A file server that counts the GETs of each path (`gets`), so a test can tell how often
    a deployment fetched an image."""

    def __init__(self, root: Path) -> None:
        handler = functools.partial(_QuietFileHandler, directory=str(root))
        super().__init__(("127.0.0.1", 0), handler)
        self.gets: Counter[str] = Counter()
        self._gets_lock = threading.Lock()

    def count_get(self, path: str) -> None:
        with self._gets_lock:
            self.gets[path] += 1


class _QuietFileHandler(http.server.SimpleHTTPRequestHandler):
    server: CountingFileServer

    def do_GET(self) -> None:
        self.server.count_get(self.path)
        super().do_GET()

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def serve_directory(root: Path) -> Iterator[tuple[str, CountingFileServer]]:
    """A loopback HTTP server over `root` in a daemon thread, for one block: its base URL and
    the server (which counts the GETs of each path)."""
    server = CountingFileServer(root)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.shutdown()
        server.server_close()


_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A loopback port free now, never handed out before in this process (nor by another
    pytest-xdist worker: each picks from its own share), and outside the
    kernel's ephemeral range: a port from that range, picked and released, can become the
    source port of any process's outgoing connection before the component told to listen on
    it binds (and two binds in a row may get the same port)."""
    first, end = _this_workers_ports()
    with _handed_out_lock:
        for _ in range(1000):
            port = secrets.randbelow(end - first) + first
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:  # someone listens there
                    continue
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port in [{first}, {end})")


FIRST_PICKED_PORT = 10000


@functools.cache
def _this_workers_ports() -> tuple[int, int]:
    """The ports this pytest process picks from: below the ephemeral range, split evenly
    between pytest-xdist's workers so that two of them never hand out the same port."""
    low, _ = _ephemeral_range()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index, count = (
        int(worker.removeprefix("gw")),
        int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")),
    )
    share = (low - FIRST_PICKED_PORT) // count
    return FIRST_PICKED_PORT + index * share, FIRST_PICKED_PORT + (index + 1) * share


@functools.cache
def _ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    if int(low) - FIRST_PICKED_PORT < 2000:
        raise RuntimeError(f"ephemeral ports start at {low}: too few ports below for the tests")
    return int(low), int(high)


@dataclass
class Deployment:
    """One pattern's processes. `start()` launches them all; `wait_ready()` blocks until every
    worker registered and the frontend's /health is green."""

    pattern: str
    model_path: Path
    nats_url: str
    log_dir: Path
    transfer: str = "shm"
    frontend_flags: list[str] = field(default_factory=list)
    worker_flags: list[str] = field(default_factory=list)  # added to every worker, e.g. engine
    # (process name, role, role flags) to start instead of the pattern's own processes
    components: list[tuple[str, str, list[str]]] = field(default_factory=list)
    namespace: str = field(default_factory=lambda: f"e2e-{secrets.token_hex(4)}")
    http_port: int = field(default_factory=free_port)
    processes: dict[str, Process] = field(default_factory=dict)
    # process name ("frontend" included) -> the simulated host it runs on; others run here
    hosts: dict[str, SimulatedHost] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # added to every process's environment
    process_env: dict[str, dict[str, str]] = field(default_factory=dict)  # and to one's
    # processes started as the command is (`python -m mmserve.cli`), never forked: e.g. a
    # frontend measured as users run it (it re-executes itself with its allocator preloaded)
    unforked: frozenset[str] = frozenset()
    https: str | None = None  # the CA file of the frontend's certificate, when it serves HTTPS

    @property
    def workers(self) -> list[tuple[str, str, list[str]]]:
        return self.components or PATTERNS[self.pattern]

    @property
    def http_host(self) -> str:
        frontend_host = self.hosts.get("frontend")
        return frontend_host.address if frontend_host else "127.0.0.1"

    @property
    def base_url(self) -> str:
        scheme = "https" if self.https else "http"
        return f"{scheme}://{self.http_host}:{self.http_port}"

    def client_call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` where the frontend can be reached: on its simulated host when it has
        one (clients made inside `fn` open their sockets there), else here."""
        frontend_host = self.hosts.get("frontend")
        return frontend_host.call(fn, *args) if frontend_host else fn(*args)

    def _spawn(self, name: str, args: list[str]) -> None:
        env = {**os.environ, "NATS_URL": self.nats_url, "HF_HUB_OFFLINE": "1", **self.env}
        env.update(self.process_env.get(name, {}))
        log_path = self.log_dir / f"{self.pattern}-{name}.log"
        if name not in self.hosts and name not in self.unforked and forked.can_fork(env):
            self.processes[name] = forked.ForkedProcess(args, env, log_path)
            return
        log = open(log_path, "wb")
        argv = [sys.executable, "-m", "mmserve.cli", *args]
        if name in self.hosts:
            self.processes[name] = self.hosts[name].popen(argv, env=env, log=log)
            return
        self.processes[name] = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def _common(self) -> list[str]:
        return ["--model-path", str(self.model_path), "--namespace", self.namespace]

    def start(self) -> Deployment:
        for name, role, flags in self.workers:
            transfer = ["--transfer", self.transfer]
            self._spawn(name, [role, *self._common, *flags, *self.worker_flags, *transfer])
        self.start_frontend()
        return self

    def start_frontend(self, extra: list[str] | None = None) -> None:
        """Start the frontend (again, once the last one exited), with `extra` flags too."""
        media = ["--allowed-media-domains", "127.0.0.1"]
        self._spawn(
            "frontend",
            [
                "frontend",
                *self._common,
                "--http-host",
                self.http_host,
                "--http-port",
                str(self.http_port),
                *media,
                *(["--transfer", self.transfer] if "--transfer" not in self.frontend_flags else []),
                *self.frontend_flags,
                *(extra or []),
            ],
        )

    @contextlib.contextmanager
    def running(self) -> Iterator[Deployment]:
        """Started and ready inside the block, stopped when it ends however it ends."""
        try:
            self.start().wait_ready()
            yield self
        finally:
            self.stop()

    @classmethod
    def mock_agg(cls, nats_url: str, log_dir: Path) -> Deployment:
        """The aggregated pattern on the tiny Qwen2-VL with the mock engine (not started)."""
        from mmserve.tiny.checkpoints import build_tiny_model

        return cls(
            "agg",
            build_tiny_model("qwen2_vl"),
            nats_url,
            log_dir,
            worker_flags=["--engine", "mock"],
        )

    def log(self, name: str) -> str:
        return (self.log_dir / f"{self.pattern}-{name}.log").read_text(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        workers = [name for name, _, _ in self.workers]
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited early:\n{self.log(name)[-3000:]}")
            if all(" ready: instance " in self.log(name) for name in workers):
                try:
                    health = self.client_call(
                        functools.partial(httpx.get, verify=self.https or True),
                        f"{self.base_url}/health",
                    )
                    if health.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.25)
        raise TimeoutError(f"{self.pattern} not ready after {STARTUP_TIMEOUT_S}s")

    def kill(self, name: str) -> None:
        self.processes[name].send_signal(signal.SIGKILL)
        self.processes[name].wait()

    def stop(self) -> None:
        stop_processes(self.processes.values())


@contextlib.contextmanager
def all_running(deployments: list[Deployment]) -> Iterator[None]:
    """Every deployment started at once (their start-ups overlap) and ready inside the block;
    all stopped at once when it ends, however it ends."""
    try:
        for deployment in deployments:
            deployment.start()
        for deployment in deployments:
            deployment.wait_ready()
        yield
    finally:
        stop_processes([p for deployment in deployments for p in deployment.processes.values()])


def stop_processes(processes: Iterable[Process]) -> None:
    """SIGTERM every process still running, then wait for each (20 s, then SIGKILL its group)."""
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def spread(deployment: Deployment, hosts: dict[str, SimulatedHost]) -> Deployment:
    """`deployment` with each process (the frontend included) on the simulated host of its
    name, its tensor transfers bound to that host's address (NIXL over the network)."""

    def bind(name: str) -> list[str]:
        return ["--transfer-bind-address", hosts[name].address]

    deployment.components = [(n, role, [*flags, *bind(n)]) for n, role, flags in deployment.workers]
    deployment.frontend_flags = [*deployment.frontend_flags, *bind("frontend")]
    deployment.hosts = hosts
    deployment.transfer = "nixl"
    return deployment
