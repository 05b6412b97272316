"""A Dynamo deployment for end-to-end tests: Dynamo's own frontend (`python -m dynamo.frontend`,
from the environment `.ci/setup.sh` makes in `$VENV/dynamo`) in front of mmserve's worker as a
Dynamo backend (`python -m mmserve.dynamo`), on a real NATS (request and event planes) with
Dynamo's file discovery in a directory of the deployment's own."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support import forked
from tests.support.deployment import STARTUP_TIMEOUT_S, Process, free_port, stop_processes

DYNAMO_VERSION = "1.6.1"


def dynamo_python() -> Path:
    """The interpreter of the Dynamo environment beside this one (`$VENV/dynamo`)."""
    return Path(sys.prefix) / "dynamo" / "bin" / "python"


def dynamo_missing() -> str | None:
    """Why the Dynamo environment cannot run the frontend here, or None when it can."""
    python = dynamo_python()
    if not python.exists():
        return f"no Dynamo environment at {python.parent.parent} (made by .ci/setup.sh)"
    probe = subprocess.run(
        [
            str(python),
            "-W",
            "ignore",
            "-c",
            "import importlib.metadata as m, dynamo.frontend.main;print(m.version('ai-dynamo'))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode != 0 or probe.stdout.strip() != DYNAMO_VERSION:
        return f"the Dynamo environment has no ai-dynamo {DYNAMO_VERSION}: {probe.stderr[-300:]}"
    return None


@dataclass
class DynamoDeployment:
    """Dynamo's frontend, mmserve workers, encode workers and prefill workers; `running()`
    starts them and waits until the frontend lists the workers' model."""

    model_path: Path
    nats_url: str
    log_dir: Path
    worker_flags: list[str] = field(default_factory=list)
    workers: int = 1
    # Encode workers (`--disaggregation-mode encode`, with `encoder_flags`) for workers started
    # with `--route-to-encoder`.
    encoders: int = 0
    encoder_flags: list[str] = field(default_factory=list)
    # Prefill workers (`--disaggregation-mode prefill`, with `prefill_flags`) for workers
    # started with `--disaggregation-mode decode`.
    prefills: int = 0
    prefill_flags: list[str] = field(default_factory=list)
    frontend_flags: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # added to every process's environment
    namespace: str = field(default_factory=lambda: f"dyn{secrets.token_hex(4)}")
    http_port: int = field(default_factory=free_port)
    processes: dict[str, Process] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def planes(self) -> list[str]:
        return ["--discovery-backend", "file", "--request-plane", "nats", "--event-plane", "nats"]

    def log(self, name: str) -> str:
        return (self.log_dir / f"dynamo-{name}.log").read_text(errors="replace")

    def _spawn(self, name: str, argv: list[str]) -> None:
        store = self.log_dir / f"dynamo-discovery-{self.namespace}"
        store.mkdir(exist_ok=True)
        env = {
            "DYN_LOG": "warn",
            **os.environ,
            "NATS_SERVER": self.nats_url,
            "DYN_FILE_KV": str(store),
            "HF_HUB_OFFLINE": "1",
            **self.env,
        }
        log_path = self.log_dir / f"dynamo-{name}.log"
        if argv[:3] == [sys.executable, "-m", "mmserve.dynamo"] and forked.can_fork(env):
            self.processes[name] = forked.ForkedProcess(
                argv[3:], env, log_path, entry="mmserve.dynamo.cli:main"
            )
            return
        log = open(log_path, "wb")
        self.processes[name] = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def start_worker(self, name: str = "worker") -> None:
        if name in self.encoder_names:
            flags = self.encoder_flags
        elif name in self.prefill_names:
            flags = self.prefill_flags
        else:
            flags = self.worker_flags
        metrics_port = self.metrics_ports.setdefault(name, free_port())
        self._spawn(
            name,
            [
                sys.executable,
                "-m",
                "mmserve.dynamo",
                "--model-path",
                str(self.model_path),
                "--namespace",
                self.namespace,
                *self.planes,
                "--metrics-port",
                str(metrics_port),
                *flags,
            ],
        )

    @property
    def worker_names(self) -> list[str]:
        return ["worker", *(f"worker{n}" for n in range(2, self.workers + 1))]

    @property
    def encoder_names(self) -> list[str]:
        return [f"encode{n}" for n in range(1, self.encoders + 1)]

    @property
    def prefill_names(self) -> list[str]:
        return [f"prefill{n}" for n in range(1, self.prefills + 1)]

    @property
    def names(self) -> list[str]:
        """Every worker process's name."""
        return [*self.encoder_names, *self.prefill_names, *self.worker_names]

    def start(self) -> DynamoDeployment:
        for name in self.names:
            self.start_worker(name)
        self.start_frontend()
        return self

    def start_frontend(self) -> None:
        self._spawn(
            "frontend",
            [
                str(dynamo_python()),
                "-m",
                "dynamo.frontend",
                "--http-host",
                "127.0.0.1",
                "--http-port",
                str(self.http_port),
                "--namespace",
                self.namespace,
                *self.planes,
                *self.frontend_flags,
            ],
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited early:\n{self.log(name)[-3000:]}")
            if not all(" ready: instance " in self.log(name) for name in self.names):
                time.sleep(0.25)
                continue
            try:
                models = httpx.get(f"{self.base_url}/v1/models", timeout=5).json()
                if any(m["id"] == self.model_path.name for m in models.get("data", [])):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"Dynamo's frontend lists no model after {STARTUP_TIMEOUT_S}s")

    def kv_events_published(self) -> float:
        """The KV events every running worker handed Dynamo's publisher so far."""
        return sum(
            _counter(f"http://127.0.0.1:{port}/metrics", "mmserve_dynamo_kv_events_published")
            for name, port in self.metrics_ports.items()
            if self.processes[name].poll() is None
        )

    def worker_counter(self, worker: str, name: str, **labels: str) -> float:
        """A counter of one worker, over the samples with `labels`."""
        return _counter(f"http://127.0.0.1:{self.metrics_ports[worker]}/metrics", name, labels)

    def kv_events_applied(self) -> float:
        """The KV events the frontend's router applied to its index (any outcome)."""
        return _counter(f"{self.base_url}/metrics", "dynamo_component_kv_cache_events_applied")

    @contextlib.contextmanager
    def running(self) -> Iterator[DynamoDeployment]:
        try:
            self.start().wait_ready()
            yield self
        finally:
            self.stop()

    def kill(self, name: str) -> None:
        self.processes[name].send_signal(signal.SIGKILL)
        self.processes[name].wait()

    def stop(self) -> None:
        stop_processes(self.processes.values())


def _counter(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """A counter's total over its samples with `labels` (all of them by default), scraped
    from `url`."""
    text = httpx.get(url, timeout=5).text
    wanted = (labels or {}).items()
    return sum(
        point.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for point in family.samples
        if point.name == f"{name}_total" and wanted <= point.labels.items()
    )
