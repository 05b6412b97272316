"""`/openapi.json` is a valid OpenAPI 3.1 document of the routes; `/metrics` counts requests,
errors by kind and latencies; `mmserve frontend` documents its flags, fails fast with a reason,
and `serve()` runs the app over the pipeline its factory connects."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mmserve.cli import main
from mmserve.frontend.cli import serve, server_config
from mmserve.frontend.dispatch import Pipeline
from mmserve.frontend.openapi import openapi_document
from tests.support.deployment import free_port

from .conftest import EchoDispatcher, RunningFrontend, parse_frontend_args


def _resolve(document: dict, ref: str) -> dict:
    assert ref.startswith("#/")
    node = document
    for key in ref[2:].split("/"):
        node = node[key]
    return node


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if "$ref" in node else []
        return found + [r for value in node.values() for r in _refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in _refs(value)]
    return []


def test_openapi_document(frontend: RunningFrontend) -> None:
    response = httpx.get(frontend.url + "/openapi.json")
    assert response.status_code == 200
    document = response.json()
    assert document["openapi"] == "3.1.0"
    assert set(document["paths"]) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/reset_prefix_cache",
        "/health",
        "/metrics",
    }
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert {"200", "400", "401", "404", "413", "503", "504"} <= set(chat["responses"])
    # Every reference resolves inside the document.
    for ref in _refs(document):
        _resolve(document, ref)
    request_schema = _resolve(
        document, chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    )
    assert set(request_schema["required"]) == {"model", "messages"}
    assert {"messages", "stream", "stream_options", "stop", "top_k", "seed"} <= set(
        request_schema["properties"]
    )
    # The extensions the server implements, each described, with its range.
    properties = request_schema["properties"]
    assert (
        properties["ignore_eos"]["type"] == "boolean"
        and properties["ignore_eos"]["default"] is False
    )
    assert properties["min_tokens"]["minimum"] == 0 and properties["min_tokens"]["default"] == 0
    stream_options = document["components"]["schemas"]["StreamOptions"]["properties"]
    assert stream_options["continuous_usage_stats"]["type"] == "boolean"
    for described in (properties["ignore_eos"], properties["min_tokens"]):
        assert described["description"]
    assert "every chunk" in stream_options["continuous_usage_stats"]["description"]


def test_the_document_offers_use_audio_in_video_only_to_a_model_that_serves_a_track() -> None:
    """Qwen2.5-Omni reads a video's own audio track; any other model refuses the option, so
    its document accepts it only unset or false."""

    def option(audio_in_video: bool) -> dict[str, Any]:
        document = openapi_document("m", (1, 2), audio_in_video=audio_in_video)
        return document["components"]["schemas"]["MMProcessorKwargs"]["properties"][
            "use_audio_in_video"
        ]

    assert option(False)["enum"] == [None, False]
    served = option(True)
    assert "enum" not in served and "boolean" in json.dumps(served)


def _metric_samples(frontend: RunningFrontend) -> dict[str, float]:
    response = httpx.get(frontend.url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in response.text.splitlines()
        if line and not line.startswith("#")
    }


def test_metrics_count_requests_errors_and_latency(frontend: RunningFrontend) -> None:
    # The frontend serves the whole session: what these two requests add is what they count.
    before = _metric_samples(frontend)
    body = {"model": frontend.model, "messages": [{"role": "user", "content": "hi"}]}
    httpx.post(frontend.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30)
    httpx.post(frontend.url + "/v1/chat/completions", json={**body, "best_of": 3}, timeout=30)
    after = _metric_samples(frontend)

    def added(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert added('mmserve_requests_total{component="frontend"}') == 2
    assert added('mmserve_errors_total{code="unsupported_option",component="frontend"}') == 1
    assert added('mmserve_ttft_seconds_count{component="frontend"}') == 1
    assert added('mmserve_inter_token_latency_seconds_count{component="frontend"}') >= 1
    assert added('mmserve_stage_seconds_count{component="frontend",stage="preprocess"}') == 1


def test_cli_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["frontend", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--http-host",
        "--http-port",
        "--http-keep-alive",
        "--api-key",
        "--request-timeout",
        "--frontend-decoding",
        "--router-mode",
        "--allowed-media-domains",
        "--allowed-local-media-path",
        "--media-fetch-timeout",
        "--tool-call-parser",
        "--reasoning-parser",
    ):
        assert flag in out


def test_idle_connections_outlive_the_client_pool_expiry(
    frontend: RunningFrontend, tiny_model_path: Path
) -> None:
    # A server that closes an idle connection first races the client's next request on it.
    config = server_config(parse_frontend_args(tiny_model_path), frontend.app)
    assert config.timeout_keep_alive > httpx.Limits().keepalive_expiry
    args = parse_frontend_args(tiny_model_path, "--http-keep-alive", "2.5")
    assert server_config(args, frontend.app).timeout_keep_alive == 2.5


@contextlib.contextmanager
def _served(app: object, tiny_model_path: Path) -> Iterator[int]:
    """The frontend's own uvicorn settings in a thread; yields the port."""
    import threading

    import uvicorn
    import uvloop

    server = uvicorn.Server(server_config(parse_frontend_args(tiny_model_path), app))
    thread = threading.Thread(target=uvloop.run, args=(server.serve(),), daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "uvicorn did not start"
            threading.Event().wait(0.02)
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _exchange(port: int, pieces: list[bytes]) -> bytes:
    """Sends `pieces` one write each and reads until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        with contextlib.suppress(ConnectionError):
            for piece in pieces:
                conn.sendall(piece)
            conn.shutdown(socket.SHUT_WR)
        answer = b""
        with contextlib.suppress(ConnectionError):
            while chunk := conn.recv(65536):
                answer += chunk
    return answer


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer else 0


@pytest.mark.parametrize("pieces", [1, 400], ids=["one-write", "many-small-writes"])
def test_the_server_refuses_an_oversized_request_head_before_the_app(
    frontend: RunningFrontend, tiny_model_path: Path, pieces: int
) -> None:
    """The frontend's HTTP parser bounds a request's head (16 KiB), so a client cannot grow the
    server's memory with headers, whether it sends them at once or a few bytes at a time."""
    headers = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 40) for i in range(2000))
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"
    step = -(-len(head) // pieces)
    with _served(frontend.app, tiny_model_path) as port:
        answer = _exchange(port, [head[i : i + step] for i in range(0, len(head), step)])
    # Refused with 431 (or the connection dropped mid-send); the app would have answered 200.
    assert not answer or _status(answer) == 431, answer[:200]


def test_a_head_under_the_bound_and_a_body_over_it_are_served(
    frontend: RunningFrontend, tiny_model_path: Path
) -> None:
    """Only the head counts: 12 KiB of headers, then a 1 MiB body sent in the head's write."""
    headers = b"X-Pad: " + b"a" * (12 * 1024) + b"\r\n"
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n" + headers + b"Connection: close\r\n\r\n"
    body = json.dumps({"model": "m", "messages": [], "padding": "b" * (1 << 20)}).encode()
    post = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
    )
    with _served(frontend.app, tiny_model_path) as port:
        assert _status(_exchange(port, [health])) == 200
        # The app answered (a 4xx of its own for the empty messages), not the parser's 431.
        answer = _exchange(port, [post])
    assert _status(answer) == 400 and b'"error"' in answer, answer[:300]


def test_cli_exits_with_a_one_line_reason_when_the_model_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["frontend", "--model-path", str(tmp_path / "none")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmserve frontend: ")
    assert str(tmp_path / "none") in lines[0]


async def test_serve_connects_the_pipeline_and_closes_it(tiny_model_path) -> None:
    port = free_port()
    args = parse_frontend_args(tiny_model_path, "--http-port", str(port))
    dispatcher = EchoDispatcher()
    closed = asyncio.Event()

    @contextlib.asynccontextmanager
    async def echo_pipeline(parsed: argparse.Namespace) -> AsyncIterator[Pipeline]:
        assert parsed is args
        try:
            yield Pipeline(dispatcher)
        finally:
            closed.set()

    server = asyncio.create_task(serve(args, echo_pipeline))
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(timeout=30) as client:
        while True:
            try:
                if (await client.get(url + "/health")).status_code == 200:
                    break
            except httpx.ConnectError:
                assert not server.done(), server.exception()
                await asyncio.sleep(0.05)
        body = {"model": "tiny-qwen2_vl-seed0", "messages": [{"role": "user", "content": "hi"}]}
        response = await client.post(url + "/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.json()["id"] == dispatcher.requests[-1].request_id
    server.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await server
    assert closed.is_set()
