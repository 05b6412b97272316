"""Inputs beyond image URLs: precomputed embeddings (`image_embeds` parts), per-request pixel
bounds (`mm_processor_kwargs`) and the per-prompt limits (`--limit-mm-per-prompt`): what the
first hop receives, and each refusal with its status and code."""

from __future__ import annotations

import argparse
import base64
import io
import pickle
import struct
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import save as save_safetensors

from mmserve import _mm
from mmserve.frontend.mm_options import parse_limit_mm_per_prompt
from mmserve.protocol import ItemState
from tests.support.images import data_url, encode_image
from tests.support.local_media import MediaServer

from .conftest import RunningFrontend

IMAGE_PAD = 151655
HIDDEN = 64  # the tiny Qwen2-VL's hidden size
GRID = [1, 4, 6]  # 6 tokens
TOKENS = 6


def _ask(frontend: RunningFrontend, content: list[dict[str, Any]], **fields: Any) -> httpx.Response:
    body = {
        "model": frontend.model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        **fields,
    }
    return httpx.post(frontend.url + "/v1/chat/completions", json=body, timeout=60)


def _error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    return error


def _safetensors(embeds: torch.Tensor, grid: list[int] | None = GRID) -> str:
    tensors = {"image_embeds": embeds}
    if grid is not None:
        tensors["image_grid_thw"] = torch.tensor([grid])
    return base64.b64encode(save_safetensors(tensors)).decode()


def _npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    # An object array is saved as a pickle inside the .npy file, which the server refuses.
    np.save(buffer, array, allow_pickle=array.dtype == object)
    return base64.b64encode(buffer.getvalue()).decode()


def _embeds_part(value: Any) -> dict[str, Any]:
    return {"type": "image_embeds", "image_embeds": value}


def _embeds(seed: int = 0, rows: int = TOKENS, width: int = HIDDEN, dtype=torch.float32):
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def embeds_frontend(start_frontend, media_server: MediaServer) -> RunningFrontend:
    allowed = media_server.root / "embeds"
    allowed.mkdir(exist_ok=True)
    return start_frontend(
        "--enable-mm-embeds",
        "--allowed-media-domains",
        "127.0.0.1",
        "--allowed-local-media-path",
        str(allowed),
    )


# -- --limit-mm-per-prompt ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "limits"),
    [
        ('{"image": 2, "video": 0}', {"image": 2, "video": 0}),
        ('{"image": {"count": 3, "width": 512, "height": 512}}', {"image": 3}),
        ("image=4,video=1", {"image": 4, "video": 1}),
        ('{"audio": 2}', {"audio": 2}),
    ],
)
def test_limit_mm_per_prompt_reads_vllms_forms(text: str, limits: dict[str, int]) -> None:
    assert parse_limit_mm_per_prompt(text) == limits


@pytest.mark.parametrize(
    "text", ['{"speech": 1}', '{"image": -1}', '{"image": {"count": 1, "depth": 2}}', "image", "["]
)
def test_limit_mm_per_prompt_refuses_what_it_cannot_read(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_limit_mm_per_prompt(text)


def test_past_the_limit_is_refused_before_any_fetch(
    start_frontend, media_server: MediaServer
) -> None:
    frontend = start_frontend(
        "--limit-mm-per-prompt", '{"image": 1}', "--allowed-media-domains", "127.0.0.1"
    )
    # A private address the policy refuses: fetching it would answer fetch.forbidden_address.
    parts = [{"type": "image_url", "image_url": {"url": "http://10.0.0.1/a.png"}}] * 2
    error = _error(_ask(frontend, parts), 400, "request.too_many_items")
    assert (
        "2 image item(s)" in error["message"] and "accepts at most 1 per prompt" in error["message"]
    )
    url = media_server.write("limit.png", encode_image(32, 32))
    assert _ask(frontend, [{"type": "image_url", "image_url": {"url": url}}]).status_code == 200
    text_only = start_frontend("--limit-mm-per-prompt", "image=0")
    error = _error(_ask(text_only, parts[:1]), 400, "request.too_many_items")
    assert "accepts none" in error["message"]


# -- mm_processor_kwargs ----------------------------------------------------------------------


def test_pixel_bounds_change_the_grid_and_the_identity(frontend: RunningFrontend) -> None:
    data = encode_image(640, 480)
    part = [{"type": "image_url", "image_url": {"url": data_url(data)}}]
    assert _ask(frontend, part).status_code == 200
    plain = frontend.dispatcher.requests[-1].plan.media[0]
    bounds = {"min_pixels": 3136, "max_pixels": 100_000}
    assert _ask(frontend, part, mm_processor_kwargs=bounds).status_code == 200
    small = frontend.dispatcher.requests[-1].plan.media[0]
    assert plain.pixel_bounds is None and plain.mm_hash == _mm.content_hash(data)
    assert small.pixel_bounds == (3136, 100_000)
    # The fold Python made before the core did: the same identity.
    folded = struct.pack("<8sQQQ", b"pixbnds1", _mm.content_hash(data), 3136, 100_000)
    assert small.mm_hash == _mm.content_hash(folded) != plain.mm_hash
    _, h, w = small.grid_thw
    assert h * w * 14 * 14 <= 100_000 < plain.grid_thw[1] * plain.grid_thw[2] * 14 * 14
    # The model's own bounds are no change: the plain identity, shared caches.
    spec = frontend.app.preprocessor.model.spec
    same = {"min_pixels": spec.min_pixels, "max_pixels": spec.max_pixels}
    assert _ask(frontend, part, mm_processor_kwargs=same).status_code == 200
    assert frontend.dispatcher.requests[-1].plan.media[0] == plain


@pytest.mark.parametrize(
    ("kwargs", "code", "param"),
    [
        ({"max_pixels": 10**12}, "invalid_value", "mm_processor_kwargs.max_pixels"),
        ({"min_pixels": 10}, "invalid_value", "mm_processor_kwargs.min_pixels"),
        (
            {"min_pixels": 200_000, "max_pixels": 100_000},
            "min_pixels_over_max_pixels",
            "mm_processor_kwargs.min_pixels",
        ),
        ({"do_resize": False}, "invalid_value", None),
        (
            {"pan_and_scan_min_crop_size": 0},
            "invalid_value",
            "mm_processor_kwargs.pan_and_scan_min_crop_size",
        ),
        (
            {"pan_and_scan_min_crop_size": 2**32},
            "invalid_value",
            "mm_processor_kwargs.pan_and_scan_min_crop_size",
        ),
        (
            {"pan_and_scan_min_ratio_to_activate": -1.0},
            "invalid_value",
            "mm_processor_kwargs.pan_and_scan_min_ratio_to_activate",
        ),
        ({"do_pan_and_scan": "yes"}, "invalid_value", "mm_processor_kwargs.do_pan_and_scan"),
    ],
)
def test_pixel_bounds_outside_the_servers_are_refused(
    frontend: RunningFrontend, kwargs: dict[str, Any], code: str, param: str | None
) -> None:
    part = [{"type": "image_url", "image_url": {"url": data_url(encode_image(32, 32))}}]
    error = _error(_ask(frontend, part, mm_processor_kwargs=kwargs), 400, code)
    if param is not None:
        assert error["param"] == param


def test_operator_bounds_are_the_default_and_the_ceiling(start_frontend) -> None:
    frontend = start_frontend("--mm-processor-kwargs", '{"max_pixels": 50000}')
    data = encode_image(640, 480)
    part = [{"type": "image_url", "image_url": {"url": data_url(data)}}]
    assert _ask(frontend, part).status_code == 200
    item = frontend.dispatcher.requests[-1].plan.media[0]
    assert item.pixel_bounds == (frontend.app.preprocessor.model.spec.min_pixels, 50000)
    error = _error(
        _ask(frontend, part, mm_processor_kwargs={"max_pixels": 60000}), 400, "invalid_value"
    )
    assert "[3136, 50000]" in error["message"]


# -- image_embeds ---------------------------------------------------------------------------


def test_embeds_are_refused_unless_enabled(frontend: RunningFrontend) -> None:
    error = _error(_ask(frontend, [_embeds_part(_safetensors(_embeds()))]), 400, "embeds.disabled")
    assert error["param"] == "messages[0].content[0].image_embeds"
    assert "--enable-mm-embeds" in error["message"]
    clip = {"type": "audio_embeds", "audio_embeds": _npy(np.zeros((5, 64), np.float32))}
    error = _error(_ask(frontend, [clip]), 400, "embeds.disabled")
    assert error["param"] == "messages[0].content[0].audio_embeds"


def test_embeds_are_planned_from_their_grid_and_shipped(embeds_frontend: RunningFrontend):
    embeds = _embeds()
    image = encode_image(56, 56)
    content = [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        _embeds_part(_safetensors(embeds)),
        {"type": "text", "text": "Compare."},
    ]
    response = _ask(embeds_frontend, content)
    assert response.status_code == 200, response.text
    sent = embeds_frontend.dispatcher.requests[-1]
    first, second = sent.plan.media
    assert (second.grid_thw, second.length, second.pixel_bounds) == (tuple(GRID), TOKENS, None)
    assert sent.plan.token_ids[second.offset : second.end] == [IMAGE_PAD] * TOKENS
    assert first.mm_hash == _mm.content_hash(image)
    # Both travel by transfer: the image's bytes for an encoder, the embedding ready for the
    # language hop.
    assert sent.payloads[0].encoded is not None and sent.payloads[0].embeddings is None
    assert sent.payloads[0].encoded.descriptor == image
    handle = sent.payloads[1].embeddings
    assert handle is not None and handle.aux == {}
    assert handle.embeddings.shape == (TOKENS, HIDDEN)
    shipped = np.frombuffer(handle.embeddings.descriptor, dtype=np.float32)
    assert np.array_equal(shipped.reshape(TOKENS, HIDDEN), embeds.numpy())
    assert response.json()["usage"]["prompt_tokens"] == len(sent.plan.token_ids)

    # Identity from the tensor's bytes: the same embedding in another file format is the same
    # item; another embedding is another.
    grid_by_value = {"image_embeds": _npy(embeds.numpy()), "image_grid_thw": GRID}
    assert _ask(embeds_frontend, [_embeds_part(grid_by_value)]).status_code == 200
    assert embeds_frontend.dispatcher.requests[-1].plan.media[0].mm_hash == second.mm_hash
    assert _ask(embeds_frontend, [_embeds_part(_safetensors(_embeds(seed=1)))]).status_code == 200
    assert embeds_frontend.dispatcher.requests[-1].plan.media[0].mm_hash != second.mm_hash


def test_embeds_by_reference(embeds_frontend: RunningFrontend, media_server: MediaServer):
    data = base64.b64decode(_safetensors(_embeds(), GRID))
    path = media_server.root / "embeds" / "item.safetensors"
    path.write_bytes(data)
    assert _ask(embeds_frontend, [_embeds_part(str(path))]).status_code == 200
    url = media_server.write("item.safetensors", data)
    assert _ask(embeds_frontend, [_embeds_part(url)]).status_code == 200
    outside = media_server.root / "outside.safetensors"
    outside.write_bytes(data)
    error = _error(
        _ask(embeds_frontend, [_embeds_part(str(outside))]), 400, "fetch.local_path_not_allowed"
    )
    assert error["param"] == "messages[0].content[0].image_embeds"


def _pickled(embeds: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save({"image_embeds": embeds}, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(
    ("value", "code", "says"),
    [
        (_pickled(_embeds()), "embeds.format", "pickles"),
        (base64.b64encode(pickle.dumps(np.zeros(3))).decode(), "embeds.format", "pickles"),
        (_npy(np.array([object()], dtype=object)), "embeds.format", "cannot be read"),
        (_safetensors(_embeds(width=HIDDEN + 1)), "embeds.shape", f"[{TOKENS}, {HIDDEN}]"),
        (_safetensors(_embeds(rows=TOKENS + 1)), "embeds.shape", f"[{TOKENS}, {HIDDEN}]"),
        (_safetensors(torch.zeros(TOKENS, HIDDEN, dtype=torch.int32)), "embeds.dtype", "float32"),
        (
            _safetensors(_embeds().index_fill(0, torch.tensor([2]), float("nan"))),
            "embeds.values",
            "NaN",
        ),
        (_safetensors(_embeds(), grid=None), "embeds.missing", "image_grid_thw"),
        (_safetensors(_embeds(), grid=[1, 3, 8]), "process.grid", "merge_size"),
        (_safetensors(_embeds(), grid=[2, 2, 6]), "process.grid", "t = 1"),
        (
            {"image_embeds": _npy(_embeds().numpy()), "image_grid_thw": [1, 4]},
            "invalid_value",
            "length",
        ),
        ({"image_embeds": _npy(_embeds().numpy())}, "invalid_value", "image_grid_thw"),
        (
            {"image_embeds": _npy(_embeds().numpy()), "image_grid_thw": GRID, "x": 1},
            "invalid_value",
            "x",
        ),
        (
            {"image_embeds": _npy(_embeds().numpy()), "image_grid_thw": _npy(np.ones(3))},
            "embeds.shape",
            "integers",
        ),
        (_npy(_embeds().numpy()), "embeds.missing", "image_grid_thw"),
        ("bm90IGEgdGVuc29y", "embeds.format", "safetensors"),
    ],
)
def test_each_malformed_embedding_gets_its_400(
    embeds_frontend: RunningFrontend, value: Any, code: str, says: str
) -> None:
    error = _error(_ask(embeds_frontend, [_embeds_part(value)]), 400, code)
    assert says in error["message"], error
    # The server keeps serving.
    assert _ask(embeds_frontend, [_embeds_part(_safetensors(_embeds()))]).status_code == 200


def test_embeds_count_toward_the_limit(start_frontend) -> None:
    frontend = start_frontend("--enable-mm-embeds", "--limit-mm-per-prompt", "image=1")
    part = _embeds_part(_safetensors(_embeds()))
    _error(_ask(frontend, [part, part]), 400, "request.too_many_items")


def test_bfloat16_embeds_are_shipped_as_given(embeds_frontend: RunningFrontend) -> None:
    embeds = _embeds(dtype=torch.bfloat16)
    assert _ask(embeds_frontend, [_embeds_part(_safetensors(embeds))]).status_code == 200
    handle = embeds_frontend.dispatcher.requests[-1].payloads[0].embeddings
    assert handle is not None and handle.embeddings.dtype == "bfloat16"


def test_pickle_is_never_loaded(embeds_frontend: RunningFrontend, tmp_path: Path) -> None:
    """A pickle whose loading would run code is refused without running it."""
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (marker,))

    value = base64.b64encode(pickle.dumps(Exploit())).decode()
    _error(_ask(embeds_frontend, [_embeds_part(value)]), 400, "embeds.format")
    assert not marker.exists()


# -- media ids ------------------------------------------------------------------------------


def _named_image(url: str | None, uuid: str) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "image_url", "uuid": uuid}
    if url is not None:
        part["image_url"] = {"url": url}
    return part


def _ask_as(frontend: RunningFrontend, key: str, content: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": frontend.model, "messages": [{"role": "user", "content": content}]}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(frontend.url + "/v1/chat/completions", json=body, headers=headers)


def test_an_id_alone_is_planned_as_the_image_it_named(frontend: RunningFrontend) -> None:
    data = encode_image(100, 80)
    assert _ask_as(frontend, "a", [_named_image(data_url(data), "cat")]).status_code == 200
    original = frontend.dispatcher.requests[-1]
    assert _ask_as(frontend, "a", [_named_image(None, "cat")]).status_code == 200
    repeat = frontend.dispatcher.requests[-1]
    # The same item: identity, grid and place, so the same routing view and cache keys.
    assert repeat.plan == original.plan
    assert repeat.payloads[0].state is ItemState.REUSE and repeat.payloads[0].data is None
    # `image_url: null` is the same as leaving it out.
    content = [{"type": "image_url", "image_url": None, "uuid": "cat"}]
    assert _ask_as(frontend, "a", content).status_code == 200


def test_an_id_is_the_tenants_own(frontend: RunningFrontend) -> None:
    data = encode_image(64, 64)
    assert _ask_as(frontend, "a", [_named_image(data_url(data), "dog")]).status_code == 200
    unknown = _error(_ask_as(frontend, "b", [_named_image(None, "dog")]), 400, "media_id.unknown")
    assert unknown["param"] == "messages[0].content[0].image_url"
    never = _error(_ask_as(frontend, "a", [_named_image(None, "owl")]), 400, "media_id.unknown")
    assert never["message"].replace("owl", "dog") == unknown["message"]  # nothing leaks
    # Another tenant naming the same id holds its own image under it.
    other = encode_image(48, 96)
    assert _ask_as(frontend, "b", [_named_image(data_url(other), "dog")]).status_code == 200
    assert _ask_as(frontend, "a", [_named_image(None, "dog")]).status_code == 200
    assert frontend.dispatcher.requests[-1].plan.media[0].mm_hash == _mm.content_hash(data)
    # Naming it again with other content replaces it.
    assert _ask_as(frontend, "a", [_named_image(data_url(other), "dog")]).status_code == 200
    assert _ask_as(frontend, "a", [_named_image(None, "dog")]).status_code == 200
    assert frontend.dispatcher.requests[-1].plan.media[0].mm_hash == _mm.content_hash(other)


def test_an_image_part_needs_a_url_or_an_id(frontend: RunningFrontend) -> None:
    error = _error(_ask(frontend, [{"type": "image_url"}]), 400, "invalid_value")
    assert "uuid" in error["message"]
    _error(_ask(frontend, [_named_image(None, "")]), 400, "invalid_value")
