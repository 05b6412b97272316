"""Hostile and broken input against one aggregated deployment: each gets its documented 4xx
while a well-formed request sent at the same moment gets exactly the answer it gets alone, and
every process stays up."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mmserve import _mm
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.deployment import Deployment
from tests.support.images import png_bomb

from .conftest import Trial
from .media import (
    FORMATS,
    gif_many_frames,
    gif_screen_bomb,
    hostile_server,
    sample,
)

MODEL = "tiny-qwen2_vl-seed0"
BODY_LIMIT = 8 << 20
FETCH_TIMEOUT_S = 3
# Every request of this suite ends well before this; a hang fails the test instead.
HANG_S = 90


@pytest.fixture(scope="module")
def files() -> dict[str, tuple[str, bytes]]:
    served = {f"/sample.{fmt.lower()}": ("image/*", sample(fmt)) for fmt in FORMATS}
    served["/png-bomb.png"] = ("image/png", png_bomb())
    served["/png-as-html"] = ("text/html", sample("PNG"))
    served["/html-as-png"] = ("image/png", b"<html><body>not an image</body></html>")
    return served


@pytest.fixture(scope="module")
def server(files: dict[str, tuple[str, bytes]]) -> Iterator[str]:
    with hostile_server(files) as url:
        yield url


@pytest.fixture(scope="module")
def local_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An allowed media root, beside a secret image outside it and a symlink out of it."""
    base = tmp_path_factory.mktemp("local-media")
    root = base / "allowed"
    root.mkdir()
    (root / "inside.png").write_bytes(sample("PNG"))
    (base / "secret.png").write_bytes(sample("PNG"))
    os.symlink(base / "secret.png", root / "link.png")
    return root


@pytest.fixture(scope="module")
def agg(
    nats_url: str, tmp_path_factory: pytest.TempPathFactory, local_root: Path
) -> Iterator[Deployment]:
    deployment = Deployment(
        "agg",
        build_tiny_model("qwen2_vl"),
        nats_url,
        tmp_path_factory.mktemp("hostile-logs"),
        frontend_flags=[
            "--max-request-body-bytes", str(BODY_LIMIT),
            "--media-fetch-timeout", str(FETCH_TIMEOUT_S),
            "--allowed-local-media-path", str(local_root),
        ],
    )  # fmt: skip
    with deployment.running():
        yield deployment


def _body(images: list[str], text: str = "Describe.", stream: bool = False) -> dict[str, Any]:
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": url}} for url in images
    ]
    content.append({"type": "text", "text": text})
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
    }


def _good_body(server: str) -> dict[str, Any]:
    return _body([f"{server}/sample.jpeg"], "Good request.", stream=True)


async def _post(client: httpx.AsyncClient, body: dict[str, Any] | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await client.post(
        "/v1/chat/completions", content=content, headers={"Content-Type": "application/json"}
    )


def _streamed_text(response: httpx.Response) -> str:
    """The content of an SSE answer; fails unless it finished and ended with [DONE]."""
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", response.text
    chunks = [json.loads(event) for event in events[:-1]]
    assert all("error" not in chunk for chunk in chunks), response.text
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop"), response.text
    return "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)


@pytest.fixture(scope="module")
def good_answer(agg: Deployment, server: str) -> str:
    """The streamed answer to the good request when nothing else runs."""

    async def once() -> str:
        async with httpx.AsyncClient(base_url=agg.base_url, timeout=HANG_S) as client:
            response = await _post(client, _good_body(server))
            assert response.status_code == 200, response.text
            return _streamed_text(response)

    return asyncio.run(once())


def _check_beside_a_good_request(
    agg: Deployment, server: str, good_answer: str, *hostile: dict[str, Any] | bytes
) -> list[httpx.Response]:
    """Sends the `hostile` requests and a good one all at once; the good one must get its usual
    answer and every process must still run. Returns the hostile requests' responses."""

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=agg.base_url, timeout=HANG_S) as client:
            bodies = [*hostile, _good_body(server)]
            return list(await asyncio.gather(*(_post(client, body) for body in bodies)))

    *bad, good = asyncio.run(together())
    assert good.status_code == 200, good.text
    assert _streamed_text(good) == good_answer
    for name, process in agg.processes.items():
        assert process.poll() is None, f"{name} exited:\n{agg.log(name)[-2000:]}"
    return bad


def _expect(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    assert error["message"]
    return f"{status} {code}"


MEDIA_CASES = {
    # name: (what is sent, expected status, expected code)
    "png_bomb_100k_x_100k": ("png-bomb", 413, "decode.too_many_pixels"),
    "gif_screen_65535_x_65535": ("gif-bomb", 413, "decode.too_many_pixels"),
    "png_as_html_is_sniffed": ("png-as-html", 200, ""),
    "html_labelled_png": ("html-as-png", 400, "decode.unknown_format"),
    "slow_loris_one_byte_a_second": ("slow", 400, "fetch.timeout"),
    "missing_file": ("missing", 400, "fetch.http_status"),
}


@pytest.mark.parametrize("case", sorted(MEDIA_CASES))
def test_hostile_media_url(
    agg: Deployment, server: str, good_answer: str, trial: Trial, case: str
) -> None:
    what, status, code = MEDIA_CASES[case]
    urls = {
        "png-bomb": f"{server}/png-bomb.png",
        "gif-bomb": "data:image/gif;base64," + base64.b64encode(gif_screen_bomb()).decode(),
        "png-as-html": f"{server}/png-as-html",
        "html-as-png": f"{server}/html-as-png",
        "slow": f"{server}/slow",
        "missing": f"{server}/missing.png",
    }
    [response] = _check_beside_a_good_request(agg, server, good_answer, _body([urls[what]]))
    if status == 200:
        assert response.status_code == 200, response.text
        happened = "200"
    else:
        happened = _expect(response, status, code)
    trial(case.replace("_", " "), 1, f"{happened}; good request beside it unaffected")


def test_damaged_files_of_every_format(
    agg: Deployment, server: str, good_answer: str, trial: Trial
) -> None:
    damaged = {}
    for fmt in FORMATS:
        data = sample(fmt)
        damaged[f"{fmt} truncated to half"] = data[: len(data) // 2]
        damaged[f"{fmt} cut after 20 bytes"] = data[:20]
    urls = [f"data:image/*;base64,{base64.b64encode(d).decode()}" for d in damaged.values()]
    bodies = [_body([url]) for url in urls]
    responses = _check_beside_a_good_request(agg, server, good_answer, *bodies)
    for tried, response in zip(damaged, responses, strict=True):
        trial(tried, 1, _expect(response, 400, "decode.corrupt"))


def test_a_gif_with_2000_frames_gives_its_first(
    agg: Deployment, server: str, good_answer: str, trial: Trial
) -> None:
    url = "data:image/gif;base64," + base64.b64encode(gif_many_frames()).decode()
    [response] = _check_beside_a_good_request(agg, server, good_answer, _body([url]))
    assert response.status_code == 200, response.text
    trial("GIF with 2000 frames", 1, "200 (first frame only)")


def test_request_shape_limits(agg: Deployment, server: str, good_answer: str, trial: Trial) -> None:
    small = "data:image/png;base64," + base64.b64encode(sample("PNG")).decode()
    junk = base64.b64encode(os.urandom(BODY_LIMIT // 2)).decode()
    cases: list[tuple[str, dict[str, Any] | bytes, int, str]] = [
        ("65 images in one request", _body([small] * 65), 400, "request.too_many_items"),
        ("a body over the limit", b" " * (BODY_LIMIT + 1), 413, "body_too_large"),
        ("5.3 MB of base64 noise", _body(["data:image/png;base64," + junk]), 400,
         "decode.unknown_format"),
        # Not starting with "/" (one noise in 64 does): that reads as a local path.
        ("bare base64 with a bad character", _body([junk[:4096].lstrip("/") + "*"]), 400,
         "fetch.bad_base64"),
    ]  # fmt: skip
    responses = _check_beside_a_good_request(agg, server, good_answer, *(c[1] for c in cases))
    for (tried, _, status, code), response in zip(cases, responses, strict=True):
        trial(tried, 1, _expect(response, status, code))


# Private and special addresses a URL may name or redirect to (port 9: nothing listens).
PRIVATE_TARGETS = [
    "http://127.0.0.2:9/x.png",
    "http://10.0.0.1:9/x.png",
    "http://172.16.0.1:9/x.png",
    "http://192.168.0.1:9/x.png",
    "http://169.254.169.254/latest/meta-data",
    "http://[::1]:9/x.png",
    "http://[fd00::1]:9/x.png",
    "http://[fc00::1]:9/x.png",
    "http://[::ffff:10.0.0.1]:9/x.png",
    "http://0.0.0.0:9/x.png",
]


@pytest.mark.parametrize("how", ["direct", "redirect", "double_redirect"])
def test_private_addresses_are_refused(
    agg: Deployment, server: str, good_answer: str, trial: Trial, how: str
) -> None:
    port = server.rsplit(":", 1)[1]
    # `localhost` is refused after DNS resolution: only the literal 127.0.0.1 is allowed.
    targets = [*PRIVATE_TARGETS, f"http://localhost:{port}/sample.png"]
    bodies = []
    for target in targets:
        url = target
        for _ in range({"direct": 0, "redirect": 1, "double_redirect": 2}[how]):
            url = str(httpx.URL(f"{server}/redirect", params={"to": url}))
        bodies.append(_body([url]))
    for response in _check_beside_a_good_request(agg, server, good_answer, *bodies):
        _expect(response, 400, "fetch.forbidden_address")
    trial(
        f"{len(targets)} private targets ({how.replace('_', ' ')}): 127/8, 10/8, 172.16/12, "
        "192.168/16, 169.254/16, ::1, fc00::/7, v4-mapped, 0.0.0.0, localhost",
        len(targets),
        "400 fetch.forbidden_address each",
    )


def test_local_files_outside_the_root_are_refused(
    agg: Deployment, server: str, good_answer: str, trial: Trial, local_root: Path
) -> None:
    # The frontend refuses these itself (the worker of this harness has no local root).
    policy = {"allowed_local_roots": [str(local_root)]}
    assert _mm.fetch_bytes(f"file://{local_root}/inside.png", **policy) == sample("PNG")
    refused = [
        "file:///etc/passwd",
        "/etc/passwd",
        f"file://{local_root}/../secret.png",
        f"{local_root}/../secret.png",
        f"{local_root}/link.png",
        f"file://{local_root}/%2e%2e/secret.png",
    ]
    responses = _check_beside_a_good_request(
        agg, server, good_answer, *(_body([source]) for source in refused)
    )
    for source, response in zip(refused, responses, strict=True):
        assert response.status_code == 400, (source, response.text)
        assert response.json()["error"]["code"].startswith("fetch.local_"), response.text
    trial(
        "file:// and paths outside the allowed root (.., symlink, %2e%2e, /etc/passwd)",
        len(refused),
        "400 fetch.local_* each",
    )
