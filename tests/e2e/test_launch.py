"""Each launch script starts its deployment, answers the README's curl right, and after Ctrl-C
stops its components in order (frontend, workers, nats-server), quietly, leaving no process
behind; `make run` idle stops within 2 s of Ctrl-C and frees its ports, its frontend running with
its allocator preloaded; flags reach the frontend and each role; a SIGKILL leaves no nats-server
holding its port; a taken port is named in one line."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmserve.runtime.allocator import AUTO_ORDER, find_library
from mmserve.runtime.nats_server import NatsServer
from mmserve.runtime.ports import port_holder
from tests.support.deployment import free_port
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
# agg.sh, `make run`'s script, has a test of its own below (started as the README starts it,
# answering its curl, stopped by Ctrl-C leaving nothing): the others start here together.
SCRIPTS = [
    "agg_multimodal_router.sh",
    "multimodal_epd.sh",
    "multimodal_disagg.sh",
    "disagg.sh",
]
READY = re.compile(r"\[launch\] ready: curl (\S+)/v1/chat/completions")
TIMEOUT_S = 300.0


@pytest.fixture(autouse=True)
def sigint_reaches_the_scripts() -> Iterator[None]:
    """The scripts get Ctrl-C as a terminal's foreground job does, however the suite was
    started: one run in the background of a non-interactive shell inherits SIGINT ignored, and
    so would the scripts (bash cannot trap a signal ignored when it starts). A handler here is
    reset to the default in each child."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


API_KEY = "launch-test-key"


# Ctrl-C on an idle `make run` takes about 0.5 s on a loaded 2-core machine (load average 4);
# the bound, with room for a busier one.
IDLE_STOP_S = 2.0


def _children(pid: int) -> list[int]:
    """The processes `pid` started (each component runs in a session of its own); none once
    it has ended."""
    try:
        listed = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(child) for child in listed.split()]


def _descendants(pid: int) -> list[int]:
    """Every process under `pid`, grandchildren too (mmserve nats's nats-server), whichever of
    its parent's threads started it."""
    found = []
    for tasks in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children = [int(child) for child in tasks.read_text().split()]
        except FileNotFoundError:
            continue
        for child in children:
            found += [child, *_descendants(child)]
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has ended


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _launch(script: str, flags: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", str(ROOT / "launch" / script), *flags],
        env={"MMSERVE_NAMESPACE": f"launch-{secrets.token_hex(4)}", **env},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _curl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["curl", "-sS", *args], capture_output=True, text=True, timeout=120, check=True
    )


def _readme_request() -> tuple[dict, str]:
    """The body of the README's curl and the answer the README shows."""
    readme = (ROOT / "README.md").read_text()
    body = re.search(r"-d '(\{.*?\})'\n```", readme, re.DOTALL)
    answer = re.search(r'The answer is `"content": "([^"]+)"`', readme)
    assert body and answer, "README.md lost its curl or its answer"
    return json.loads(body.group(1)), answer.group(1)


def _default_allocator() -> str:
    """The allocator a frontend runs with by default here: the first of auto's installed."""
    return next((name for name in AUTO_ORDER if find_library(name) is not None), "system")


def _started(log: Path, name: str) -> str:
    """The command line the script printed for component NAME."""
    found = re.search(rf"^\[launch\] starting {name}: (.*)$", log.read_text(), re.MULTILINE)
    assert found, f"{name} not started:\n{log.read_text()[-2000:]}"
    return found.group(1)


def test_every_launch_script_serves_and_stops_cleanly(nats_url: str, tmp_path: Path) -> None:
    launched = {}
    metrics_port = free_port()
    for script in SCRIPTS:
        env = {**os.environ, "NATS_URL": nats_url}
        flags = ["--http-port", str(free_port()), "--allowed-media-domains", "127.0.0.1"]
        if script == "multimodal_disagg.sh":
            # A frontend flag, and a flag for one role of three.
            flags += ["--frontend-args", f"--api-key {API_KEY}"]
            flags += ["--decode-args", f"--metrics-port {metrics_port}"]
        log = tmp_path / f"{script}.log"
        launched[script] = (_launch(script, flags, env, log), log)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        urls: dict[str, str] = {}
        while len(urls) < len(SCRIPTS) and time.monotonic() < deadline:
            for script, (process, log) in launched.items():
                text = log.read_text(errors="replace")
                assert process.poll() is None, f"{script} exited early:\n{text[-3000:]}"
                if script not in urls and (found := READY.search(text)):
                    urls[script] = found.group(1)
            time.sleep(0.5)
        assert len(urls) == len(SCRIPTS), f"not ready: {set(SCRIPTS) - set(urls)}"

        # A newcomer's first request: the README's curl, answered right by every script.
        body, answer = _readme_request()
        for script, url in urls.items():
            auth = ["-H", f"Authorization: Bearer {API_KEY}"]
            out = _curl(f"{url}/v1/chat/completions", "-H", "Content-Type: application/json",
                        *auth, "-d", json.dumps(body))  # fmt: skip
            choice = json.loads(out.stdout)["choices"][0]
            assert choice["message"]["content"] == answer, (script, out.stdout)

        # --frontend-args reached the frontend: without the key, 401.
        disagg_url = urls["multimodal_disagg.sh"]
        unauthenticated = _curl("-o", "/dev/null", "-w", "%{http_code}", f"{disagg_url}/v1/models")
        assert unauthenticated.stdout == "401"
        # --decode-args reached the decode worker alone.
        disagg_log = launched["multimodal_disagg.sh"][1]
        assert f"--metrics-port {metrics_port}" in _started(disagg_log, "decode")
        for role in ("encode", "prefill"):
            assert "--metrics-port" not in _started(disagg_log, role)
        assert "# HELP" in _curl(f"http://127.0.0.1:{metrics_port}/metrics").stdout
        # The router script's frontend decodes images (and served the image request above).
        router_log = launched["agg_multimodal_router.sh"][1]
        assert "--frontend-decoding" in _started(router_log, "frontend").split()
    finally:
        components = {script: _children(process.pid) for script, (process, _) in launched.items()}
        for process, _ in launched.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)
        for script, (process, log) in launched.items():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                pytest.fail(f"{script} did not stop on Ctrl-C:\n{log.read_text()[-2000:]}")
    for script, (_, log) in launched.items():
        left = [pid for pid in components[script] if _alive(pid)]
        assert not left, f"{script} left processes behind: {left}"
        text = log.read_text(errors="replace")
        # In order: the workers deregistered while NATS was still up, and quietly.
        assert "could not deregister" not in text, text[-3000:]
        assert "nanobind: leaked" not in text, text[-3000:]
        assert "Traceback" not in text, text[-3000:]


def test_ctrl_c_on_an_idle_make_run_returns_within_2_s_leaving_nothing(tmp_path: Path) -> None:
    """`make run` as the README runs it (agg.sh, the hf engine, a nats-server of its own), idle
    after one answer: Ctrl-C, as a terminal sends it (SIGINT to the foreground group: make and
    the script), returns within 2 s, without a leak report (the worker has triton loaded, by
    transformers through torch._dynamo, and a frozen heap) or a deregistration timed out, and
    leaves no process and no port behind. Its frontend ran with mimalloc preloaded (when
    installed)."""
    http_port, nats_port = free_port(), free_port()
    env = {key: value for key, value in os.environ.items() if key != "NATS_URL"}
    for key in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL"):  # when the suite itself runs under make
        env.pop(key, None)
    env["MMSERVE_NAMESPACE"] = f"launch-{secrets.token_hex(4)}"
    run_args = f"--http-port {http_port} --nats-port {nats_port}"
    log = tmp_path / "make-run.log"
    process = subprocess.Popen(
        ["make", "-s", "-C", str(ROOT), "run", f"VENV={sys.prefix}", f"RUN_ARGS={run_args}"],
        env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(
            lambda: READY.search(log.read_text(errors="replace")) or process.poll() is not None,
            TIMEOUT_S,
            "make run to be ready",
        )
        assert process.poll() is None, log.read_text(errors="replace")[-3000:]
        body, answer = _readme_request()
        out = _curl(f"http://127.0.0.1:{http_port}/v1/chat/completions",
                    "-H", "Content-Type: application/json", "-d", json.dumps(body))  # fmt: skip
        assert json.loads(out.stdout)["choices"][0]["message"]["content"] == answer, out.stdout
        components = _descendants(process.pid)
        assert len(components) >= 5, components  # the script, nats + nats-server, worker, frontend
        started = time.monotonic()
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=60)
        took = time.monotonic() - started
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    text = log.read_text(errors="replace")
    assert took < IDLE_STOP_S, f"Ctrl-C took {took:.2f} s:\n{text[-3000:]}"
    assert "leaked" not in text, text[-3000:]
    assert "could not deregister" not in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    # The frontend re-executed itself with its allocator preloaded (runtime/allocator.py).
    assert f"malloc: {_default_allocator()})" in text, text[-3000:]
    assert [pid for pid in components if _alive(pid)] == []
    assert port_holder(http_port) is None and port_holder(nats_port) is None


def test_sigkill_of_the_scripts_group_leaves_no_nats_server(tmp_path: Path) -> None:
    """The nats-server runs in its own session, out of the group's reach: its parent-death
    signal stops it once `mmserve nats` is killed, and the port is free for the next launch."""
    nats_port = free_port()
    env = {key: value for key, value in os.environ.items() if key != "NATS_URL"}
    log = tmp_path / "agg.log"
    flags = ["--engine", "mock", "--http-port", str(free_port()), "--nats-port", str(nats_port)]
    process = _launch("agg.sh", flags, env, log)
    try:
        wait_until(lambda: READY.search(log.read_text()) or process.poll() is not None, 120.0)
        assert process.poll() is None, log.read_text()[-3000:]
        assert port_holder(nats_port) is not None
    finally:
        components = _children(process.pid)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    wait_until(lambda: port_holder(nats_port) is None, 20.0, "the nats port to be free")
    wait_until(lambda: not _group_alive(process.pid), 20.0, "the script's group to be gone")
    wait_until(
        lambda: not any(_alive(pid) for pid in components), 20.0, "the components to be gone"
    )


def test_a_taken_port_is_named_in_one_line(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "NATS_URL"}
    with NatsServer() as stray:
        expected = (
            f"port {stray.port} is taken by a nats-server that mmserve started (pid {stray.pid}: "
        )
        log = tmp_path / "agg.log"
        flags = ["--engine", "mock", "--http-port", str(free_port())]
        process = _launch("agg.sh", [*flags, "--nats-port", str(stray.port)], env, log)
        assert process.wait(timeout=60) == 1
        lines = log.read_text().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"[launch] {expected}"), lines
        assert lines[0].endswith(f"stop it with: kill {stray.pid}")

        # `mmserve nats` itself, started by hand on the taken port.
        mmserve = str(Path(sys.executable).parent / "mmserve")
        by_hand = subprocess.run(
            [mmserve, "nats", "--port", str(stray.port)],
            capture_output=True, text=True, timeout=30, env=env,
        )  # fmt: skip
        assert by_hand.returncode == 1
        lines = by_hand.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"mmserve nats: {expected}"), lines
