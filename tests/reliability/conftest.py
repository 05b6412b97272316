"""Fixtures of the reliability suite, and the table it writes for `docs/reliability.md`.

Each test records what it tried, how many times and what happened (`trial(...)`). With
`MMSERVE_RELIABILITY_REPORT=docs/reliability.md` the run rewrites the table between the
`<!-- suite:begin -->` and `<!-- suite:end -->` markers of that file.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.deployment import STARTUP_TIMEOUT_S, Deployment, stop_processes

BEGIN, END = "<!-- suite:begin -->", "<!-- suite:end -->"


@dataclass
class _Row:
    nodeid: str
    tried: str
    times: int
    happened: str


_rows: list[_Row] = []
_outcomes: dict[str, str] = {}

Trial = Callable[[str, int, str], None]


@pytest.fixture
def trial(request: pytest.FixtureRequest) -> Trial:
    """`trial(what was tried, how many times, what happened)`: one row of the report."""

    def record(tried: str, times: int, happened: str) -> None:
        _rows.append(_Row(request.node.nodeid, tried, times, happened))

    return record


def metric(port: int, name: str, labels: str) -> float:
    """One sample from the /metrics of the process serving them on `port`, e.g.
    `metric(port, "mmserve_active_requests", 'component="worker"')`; 0 when absent."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    found = re.search(rf"^{re.escape(name)}{{{re.escape(labels)}}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """Resident memory of process `pid` (`VmHWM`: its peak so far)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no {field} for process {pid}")


def restart_worker(deployment: Deployment, name: str, extra: Sequence[str] = ()) -> None:
    """Start worker `name` of `deployment` again with its flags (and `extra`), and wait until
    it registered. One still running is stopped first: a test that restarts a worker does not
    rely on an earlier test having stopped it (run alone, the second would find its ports
    taken)."""
    _, role, flags = next(worker for worker in deployment.workers if worker[0] == name)
    if name in deployment.processes:
        stop_processes([deployment.processes[name]])
    deployment._spawn(name, [
        role, "--model-path", str(deployment.model_path), "--namespace", deployment.namespace,
        *flags, *deployment.worker_flags, "--transfer", deployment.transfer, *extra,
    ])  # fmt: skip
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while " ready: instance " not in deployment.log(name):
        assert deployment.processes[name].poll() is None, deployment.log(name)[-3000:]
        assert time.monotonic() < deadline, f"{name} not ready"
        time.sleep(0.25)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif hasattr(report, "wasxfail"):
        _outcomes[report.nodeid] = "xfail"
    elif report.when == "call":
        _outcomes.setdefault(report.nodeid, report.outcome)


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = os.environ.get("MMSERVE_RELIABILITY_REPORT")
    if not target or not _rows:
        return
    path = Path(target)
    text = path.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    lines = [
        "| area | what was tried | times | what happened | test |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in _rows:
        area = row.nodeid.split("::")[0].rsplit("/", 1)[-1].removeprefix("test_")
        area = area.removesuffix(".py").replace("_", " ")
        outcome = _outcomes.get(row.nodeid, "not run")
        lines.append(f"| {area} | {row.tried} | {row.times} | {row.happened} | {outcome} |")
    path.write_text(f"{head}{BEGIN}\n{chr(10).join(lines)}\n{END}{tail}")
