"""Each launch script starts its deployment, answers curl, and leaves no process behind after
Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.deployment import free_port
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [
    "agg.sh",
    "agg_multimodal_router.sh",
    "multimodal_epd.sh",
    "multimodal_disagg.sh",
    "disagg.sh",
]
READY = re.compile(r"\[launch\] ready: curl (\S+)/v1/chat/completions")
TIMEOUT_S = 300.0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_every_launch_script_serves_and_stops_cleanly(
    nats_url: str, tmp_path: Path, image_server: str
) -> None:
    launched = {}
    for script in SCRIPTS:
        env = {**os.environ, "MMSERVE_NAMESPACE": f"launch-{secrets.token_hex(4)}"}
        flags = ["--http-port", str(free_port()), "--allowed-media-domains", "127.0.0.1"]
        if script == "agg.sh":
            # This one starts its own nats-server, as a user without NATS_URL gets.
            env.pop("NATS_URL", None)
            flags += ["--nats-port", str(free_port())]
        else:
            env["NATS_URL"] = nats_url
        log = tmp_path / f"{script}.log"
        launched[script] = (
            subprocess.Popen(
                ["bash", str(ROOT / "launch" / script), *flags],
                env=env,
                stdout=log.open("wb"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            ),
            log,
        )
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

        body = {
            "model": "tiny-qwen2_vl-seed0",
            "max_tokens": 3,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": f"{image_server}/small.png"}},
                        {"type": "text", "text": "Hello"},
                    ],
                }
            ],
        }
        for script, url in urls.items():
            out = subprocess.run(
                ["curl", "-sS", f"{url}/v1/chat/completions", "-H",
                 "Content-Type: application/json", "-d", json.dumps(body)],
                capture_output=True, text=True, timeout=120, check=True,
            )  # fmt: skip
            assert json.loads(out.stdout)["usage"]["completion_tokens"] == 3, (script, out.stdout)
    finally:
        for process, _ in launched.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)
        for script, (process, log) in launched.items():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                pytest.fail(f"{script} did not stop on Ctrl-C:\n{log.read_text()[-2000:]}")
    for script, (process, _) in launched.items():
        pid = process.pid
        wait_until(lambda: not _group_alive(pid), 10.0, f"{script} left processes behind")  # noqa: B023
