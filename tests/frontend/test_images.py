"""Requests with images: what the first hop receives (placeholders, hashes, token counts) and
every refusal of a media item, with its status and error JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mmserve import _mm
from tests.support.images import data_url, encode_image, png_bomb
from tests.support.local_media import MediaServer

from .conftest import RunningFrontend

IMAGE_PAD = 151655


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


def _ask(frontend: RunningFrontend, content: list[dict[str, Any]]) -> httpx.Response:
    body = {
        "model": frontend.model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
    }
    return httpx.post(frontend.url + "/v1/chat/completions", json=body, timeout=60)


def _expected(frontend: RunningFrontend, data: bytes, width: int, height: int) -> dict[str, Any]:
    grid, tokens = frontend.app.preprocessor.model.spec.core.plan(width, height)
    mm_hash = _mm.content_hash(data)
    return {"mm_hash": mm_hash, "hex": f"{mm_hash:016x}", "grid": tuple(grid), "tokens": tokens}


def test_one_image_over_http(allowed_frontend: RunningFrontend, media_server: MediaServer):
    data = encode_image(320, 240)
    url = media_server.write("one.png", data)
    client = openai.OpenAI(base_url=allowed_frontend.url + "/v1", api_key="x", max_retries=0)
    completion = client.chat.completions.create(
        model=allowed_frontend.model,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, _image(url)]}
        ],
        max_tokens=4,
    )
    sent = allowed_frontend.dispatcher.requests[-1]
    expected = _expected(allowed_frontend, data, 320, 240)
    (item,) = sent.plan.media
    (payload,) = sent.payloads
    # The plan places the expanded run; the fetched bytes travel on (no second download).
    ids = sent.plan.token_ids
    assert ids[item.offset : item.end] == [IMAGE_PAD] * expected["tokens"]
    assert ids.count(IMAGE_PAD) == expected["tokens"]
    assert payload.data == data and payload.pixel_values is None
    assert item.mm_hash == expected["mm_hash"] and item.mm_hash_hex == expected["hex"]
    assert item.grid_thw == expected["grid"] and item.length == expected["tokens"]
    assert sent.plan.positions is not None and len(sent.plan.positions.rows) == 3 * len(ids)
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(ids)


def test_three_images_in_several_messages_streamed(
    allowed_frontend: RunningFrontend, media_server: MediaServer
) -> None:
    sizes = [(64, 48), (640, 480), (100, 300)]
    images = [encode_image(*sizes[0]), encode_image(*sizes[1], "JPEG"), encode_image(*sizes[2])]
    first_url = media_server.write("first.png", images[0])
    third_url = media_server.write("third.png", images[2])
    messages = [
        {"role": "system", "content": "You describe images."},
        {"role": "user", "content": [_image(first_url), {"type": "text", "text": "and"},
                                     _image(data_url(images[1], "image/jpeg"))]},
        {"role": "assistant", "content": "Two images."},
        # A bare string image_url, as some clients send it.
        {"role": "user", "content": [{"type": "image_url", "image_url": third_url}]},
    ]  # fmt: skip
    client = openai.OpenAI(base_url=allowed_frontend.url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model=allowed_frontend.model, messages=messages, stream=True, max_tokens=3
    )
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
    sent = allowed_frontend.dispatcher.requests[-1]
    expected = [_expected(allowed_frontend, d, *s) for d, s in zip(images, sizes, strict=True)]
    assert sent.plan.token_ids.count(IMAGE_PAD) == sum(e["tokens"] for e in expected)
    assert [m.mm_hash_hex for m in sent.plan.media] == [e["hex"] for e in expected]
    assert [m.length for m in sent.plan.media] == [e["tokens"] for e in expected]
    assert [p.data for p in sent.payloads] == images


def test_local_files_only_under_the_allowed_root(
    allowed_frontend: RunningFrontend, frontend: RunningFrontend, media_server: MediaServer
) -> None:
    inside = media_server.root / "allowed" / "cat.png"
    inside.write_bytes(encode_image(50, 60))
    outside = media_server.root / "outside.png"
    outside.write_bytes(encode_image(50, 60))
    for source in (str(inside), inside.as_uri()):
        assert _ask(allowed_frontend, [_image(source)]).status_code == 200
        assert allowed_frontend.dispatcher.requests[-1].payloads[0].data == inside.read_bytes()
    for target, source in ((allowed_frontend, str(outside)), (frontend, str(inside))):
        response = _ask(target, [{"type": "text", "text": "look"}, _image(source)])
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "fetch.local_path_not_allowed"
        assert error["param"] == "messages[0].content[1].image_url"


def test_private_address_refused_unless_allowed(
    frontend: RunningFrontend, media_server: MediaServer
) -> None:
    url = media_server.write("private.png", encode_image(40, 40))
    response = _ask(frontend, [_image(url)])
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "fetch.forbidden_address"
    assert "allowed media domains" in error["message"]
    assert error["param"] == "messages[0].content[0].image_url"


BAD_MEDIA = {
    "broken base64": (lambda s: "data:image/png;base64,@@not-base64@@", 400, "fetch.bad_data_url"),
    "not an image": (lambda s: data_url(b"hello, world"), 400, "decode.unknown_format"),
    "truncated jpeg": (
        lambda s: s.write("cut.jpg", encode_image(200, 200, "JPEG")[:300]), 400, "decode.corrupt"
    ),
    "image url 404": (lambda s: f"{s.url}/missing.png", 400, "fetch.http_status"),
    "aspect ratio over 200": (lambda s: data_url(encode_image(4020, 20)), 400,
                              "process.aspect_ratio"),
    "too many pixels": (lambda s: data_url(png_bomb(60000, 60000)), 413, "decode.too_many_pixels"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_MEDIA))
def test_bad_media_is_refused_and_the_server_keeps_serving(
    allowed_frontend: RunningFrontend, media_server: MediaServer, case: str
) -> None:
    make_source, status, code = BAD_MEDIA[case]
    good = data_url(encode_image(30, 30))
    response = _ask(allowed_frontend, [_image(good), _image(make_source(media_server))])
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert error["param"] == "messages[0].content[1].image_url"
    assert error["type"] == "invalid_request_error"
    assert _ask(allowed_frontend, [_image(good)]).status_code == 200


def test_frontend_decoding_ships_pixel_values(start_frontend) -> None:
    frontend = start_frontend("--frontend-decoding")
    data = encode_image(280, 140)
    response = _ask(frontend, [_image(data_url(data)), {"type": "text", "text": "?"}])
    assert response.status_code == 200, response.text
    sent = frontend.dispatcher.requests[-1]
    (item,) = sent.plan.media
    (payload,) = sent.payloads
    expected = _expected(frontend, data, 280, 140)
    assert payload.data is None and item.mm_hash == expected["mm_hash"]
    t, h, w = expected["grid"]
    # Qwen2-VL patches: one row per 14x14 patch, 3 channels x temporal 2 x 14 x 14 values.
    assert payload.pixel_values is not None
    assert payload.pixel_values.shape == (t * h * w, 3 * 2 * 14 * 14)
    request_id, shipped = frontend.tensor_sink.shipped[-1]
    assert request_id == sent.request_id and shipped.tobytes() == payload.pixel_values.descriptor


def test_openai_client_surfaces_media_errors(frontend: RunningFrontend, tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=frontend.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=frontend.model,
            messages=[{"role": "user", "content": [_image(str(tmp_path / "a.png"))]}],
        )
    assert info.value.code == "fetch.local_path_not_allowed"
    assert json.loads(info.value.response.text)["error"]["param"] is not None
