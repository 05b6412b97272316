"""One aggregated deployment under real clients: curl, LangChain, large inline images, and bad
input that gets its documented 4xx while the deployment keeps serving."""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from langchain_core.messages import HumanMessage
from langchain_core.outputs import ChatGeneration
from langchain_openai import ChatOpenAI

from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.deployment import Deployment, free_port
from tests.support.images import file_data_url, photo_like, png_bytes

WORKER_METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def agg(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = Deployment(
        "agg",
        build_tiny_model("qwen2_vl"),
        nats_url,
        tmp_path_factory.mktemp("agg-logs"),
        frontend_flags=["--max-media-items", "4"],
        worker_flags=["--metrics-port", str(WORKER_METRICS_PORT)],
    )
    with deployment.running():
        yield deployment


def _body(content: Any, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": "tiny-qwen2_vl-seed0",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _post(agg: Deployment, body: Any) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{agg.base_url}/v1/chat/completions",
        content=data,
        headers={"Content-Type": "application/json"},
        timeout=120,
    )


def test_curl_gets_a_completion(agg: Deployment, image_server: str) -> None:
    body = _body([_image(f"{image_server}/photo.jpg"), {"type": "text", "text": "Hi"}])
    out = subprocess.run(
        [
            "curl", "-sS", f"{agg.base_url}/v1/chat/completions",
            "-H", "Content-Type: application/json", "-d", json.dumps(body),
        ],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    response = json.loads(out.stdout)
    assert response["object"] == "chat.completion"
    assert response["usage"]["completion_tokens"] == 4
    assert response["choices"][0]["message"]["content"]


def test_n_completions_of_one_prompt_come_indexed_with_one_usage(
    agg: Deployment, image_server: str
) -> None:
    content = [_image(f"{image_server}/photo.jpg"), {"type": "text", "text": "Hi"}]
    greedy = _post(agg, {**_body(content), "n": 3}).json()
    assert [choice["index"] for choice in greedy["choices"]] == [0, 1, 2]
    assert len({choice["message"]["content"] for choice in greedy["choices"]}) == 1
    assert greedy["usage"]["completion_tokens"] == 3 * 4
    single = _post(agg, _body(content)).json()
    assert greedy["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]  # once

    body = {**_body(content, max_tokens=5), "n": 2, "temperature": 1.0, "seed": 4}
    body |= {"stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", f"{agg.base_url}/v1/chat/completions", json=body, timeout=120) as r:
        events = [
            json.loads(line.removeprefix("data: "))
            for line in r.iter_lines()
            if line.startswith("data: {")
        ]
    choices = [choice for event in events for choice in event["choices"]]
    texts = {}
    for index in (0, 1):
        mine = [choice for choice in choices if choice["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
        texts[index] = "".join(c["delta"].get("content") or "" for c in mine)
    unstreamed = _post(agg, {**body, "stream": False}).json()
    assert [c["message"]["content"] for c in unstreamed["choices"]] == [texts[0], texts[1]]
    assert [e["usage"]["completion_tokens"] for e in events if e.get("usage")] == [2 * 5]


def test_text_completions_give_n_choices_per_prompt(agg: Deployment) -> None:
    client = openai.OpenAI(base_url=f"{agg.base_url}/v1", api_key="unused", max_retries=0)
    prompts = ["Hello there", "Count to three:"]
    options: dict[str, Any] = {
        "model": "tiny-qwen2_vl-seed0",
        "max_tokens": 3,
        "temperature": 1.0,
        "seed": 5,
        "extra_body": {"ignore_eos": True},
    }
    out = client.completions.create(prompt=prompts, n=2, echo=True, logprobs=1, **options)
    choices = sorted(out.choices, key=lambda choice: choice.index)
    assert [choice.index for choice in choices] == [0, 1, 2, 3]
    singles = [client.completions.create(prompt=prompt, **options) for prompt in prompts]
    for index, choice in enumerate(choices):
        prompt, single = prompts[index // 2], singles[index // 2]
        assert choice.text.startswith(prompt)
        if index % 2 == 0:  # choice 0 of a prompt is its n=1 completion
            assert choice.text == prompt + single.choices[0].text
        assert choice.logprobs is not None and choice.logprobs.token_logprobs[0] is None
    # One prompt's choices share its echoed tokens' logprobs, and differ after them.
    for first, second in (choices[0:2], choices[2:4]):
        assert first.logprobs is not None and second.logprobs is not None
        echoed = len(first.logprobs.tokens) - 3
        assert first.logprobs.token_logprobs[:echoed] == second.logprobs.token_logprobs[:echoed]
        assert first.text != second.text
    assert out.usage is not None and out.usage.completion_tokens == 4 * 3
    prompt_tokens = [single.usage.prompt_tokens for single in singles if single.usage]
    assert out.usage.prompt_tokens == sum(prompt_tokens)  # each prompt once


def test_langchain_asks_for_logprobs_and_two_choices(agg: Deployment, image_server: str) -> None:
    """LangChain's `ChatOpenAI(logprobs=True, n=2)`: two generations of one image prompt,
    each with its tokens' logprobs in its response metadata."""
    llm = ChatOpenAI(
        base_url=f"{agg.base_url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        model="tiny-qwen2_vl-seed0",
        max_completion_tokens=4,
        temperature=1.0,
        seed=9,
        n=2,
        logprobs=True,
        top_logprobs=2,
        max_retries=0,
        extra_body={"ignore_eos": True},
    )
    image = {"type": "image_url", "image_url": {"url": f"{image_server}/photo.jpg"}}
    message = HumanMessage(content=[image, {"type": "text", "text": "Hi"}])
    (generations,) = llm.generate([[message]]).generations
    assert len(generations) == 2
    for generation in generations:
        assert isinstance(generation, ChatGeneration)
        content = generation.message.response_metadata["logprobs"]["content"]
        assert len(content) == 4
        assert all(len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0 for entry in content)
        said = b"".join(
            bytes(entry["bytes"]) for entry in content if not entry["token"].startswith("<|")
        )
        assert said.decode("utf-8", errors="replace") == generation.text


def test_a_data_url_over_the_nats_payload_limit_is_served(agg: Deployment) -> None:
    # ~2.3 MB of PNG noise: its data URL alone exceeds NATS' 1 MiB message limit.
    big = png_bytes(photo_like(1000, 800, seed=7, noise=127))
    assert len(big) > 2 * 1024 * 1024
    url = "data:image/png;base64," + base64.b64encode(big).decode()
    response = _post(agg, _body([_image(url), {"type": "text", "text": "Hi"}]))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] > 500


@pytest.mark.parametrize(
    ("name", "status", "code"),
    [
        ("malformed_json", 400, None),
        ("unknown_part", 400, None),
        ("broken_base64", 400, "fetch.bad_data_url"),
        ("truncated_jpeg", 400, "decode."),
        ("missing_image", 400, "fetch.http_status"),
        ("too_many_images", 400, "request.too_many_items"),
        ("image_over_limits", 400, "process.aspect_ratio"),
        ("local_path", 400, "fetch.local_path_not_allowed"),
        ("private_address", 400, "fetch.forbidden_address"),
        ("unknown_model", 404, None),
    ],
)
def test_bad_input_gets_a_4xx_and_serving_goes_on(
    agg: Deployment, image_server: str, image_dir: Path, name: str, status: int, code: str | None
) -> None:
    port = image_server.rsplit(":", 1)[1]
    bodies: dict[str, Any] = {
        "malformed_json": b'{"model": "tiny-qwen2_vl-seed0", "messages": [',
        "unknown_part": _body([{"type": "audio_url", "audio_url": {"url": "x"}}]),
        "broken_base64": _body([_image("data:image/png;base64,!!!not-base64!!!")]),
        "truncated_jpeg": _body([_image(f"{image_server}/truncated.jpg")]),
        "missing_image": _body([_image(f"{image_server}/missing.png")]),
        "too_many_images": _body([_image(f"{image_server}/small.png")] * 5),
        "image_over_limits": _body([_image(f"{image_server}/sliver.png")]),
        "local_path": _body([_image(str(image_dir / "small.png"))]),
        # Loopback by another name than the allowed one is still refused.
        "private_address": _body([_image(f"http://localhost:{port}/small.png")]),
        "unknown_model": {**_body("Hello"), "model": "gpt-nothing"},
    }
    response = _post(agg, bodies[name])
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"]
    if code is not None:
        assert error["code"].startswith(code), error
    if name == "broken_base64":  # refused by the frontend, which names the item
        assert error["param"] == "messages[0].content[0].image_url", error
    healthy = _post(
        agg, _body([_image(file_data_url(image_dir / "small.png")), {"type": "text", "text": "ok"}])
    )
    assert healthy.status_code == 200, healthy.text


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_repeated_images_and_prompts_hit_the_caches(agg: Deployment, image_server: str) -> None:
    body = _body([_image(f"{image_server}/tall.png"), {"type": "text", "text": "Again"}])
    url = f"http://127.0.0.1:{WORKER_METRICS_PORT}/metrics"
    before = httpx.get(url, timeout=10).text
    first, second = _post(agg, body), _post(agg, body)
    assert first.status_code == second.status_code == 200
    assert first.json()["choices"] == second.json()["choices"]
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    after = httpx.get(url, timeout=10).text
    # The repeated image is either read from the encoder cache or, once the first request's KV
    # events reached the router, skipped because the prefix cache holds its tokens.
    reused = [
        ("mmserve_encoder_cache_lookups_total", {"result": "hit"}),
        ("mmserve_encoder_skipped_items_total", {"result": "skipped"}),
    ]
    assert (
        sum(_metric(after, n, **labels) - _metric(before, n, **labels) for n, labels in reused) > 0
    )
    for name, labels in [
        ("mmserve_cache_lookups_total", {"cache": "prefix", "result": "hit"}),
        ("mmserve_requests_total", {"component": "worker"}),
        *(
            ("mmserve_stage_seconds_count", {"component": "worker", "stage": stage})
            for stage in ("preprocess", "encode", "prefill", "decode")
        ),
    ]:
        assert _metric(after, name, **labels) > _metric(before, name, **labels), name
