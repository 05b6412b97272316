"""The media policy (flags -> dataclass -> the core's fetch rules) and the async core calls,
against real files, a real HTTP server on 127.0.0.1 and a server that never answers."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmserve import _mm, media
from mmserve.frontend.errors import ApiError
from mmserve.media import MediaPolicy
from mmserve.models.family import resolve_model_spec
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.images import data_url, encode_image
from tests.support.local_media import MediaServer, media_server_over

IMAGE_PAD = 151655
VISION_START, VISION_END = 151652, 151653


@pytest.fixture(scope="module")
def media_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MediaServer]:
    with media_server_over(tmp_path_factory.mktemp("served")) as server:
        yield server


@pytest.fixture
def silent_server() -> Iterator[str]:
    """Accepts TCP connections (the kernel's backlog) but never answers a byte."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/slow.png"


def _policy(*flags: str) -> MediaPolicy:
    parser = argparse.ArgumentParser()
    MediaPolicy.add_cli_args(parser)
    return MediaPolicy.from_args(parser.parse_args(list(flags)))


def test_policy_from_flags(tmp_path: Path) -> None:
    assert _policy() == MediaPolicy()
    assert MediaPolicy().allowed_domains == frozenset()
    assert MediaPolicy().allowed_local_roots == ()
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    policy = _policy(
        "--allowed-media-domains", "127.0.0.1", "Images.Example",
        "--allowed-local-media-path", str(link), "/srv/media",
        "--media-fetch-timeout", "2.5", "--max-media-items", "3",
    )  # fmt: skip
    assert policy.allowed_domains == {"127.0.0.1", "images.example"}
    assert policy.allowed_local_roots == (tmp_path.resolve(), Path("/srv/media"))
    assert policy.fetch_timeout_s == 2.5 and policy.max_items == 3


async def test_fetch_follows_the_policy(media_server: MediaServer, tmp_path: Path) -> None:
    data = encode_image(20, 10)
    url = media_server.write("a.png", data)
    local = tmp_path / "b.png"
    local.write_bytes(data)
    assert await media.fetch(data_url(data), MediaPolicy()) == data
    assert await media.fetch(url, _policy("--allowed-media-domains", "127.0.0.1")) == data
    assert (
        await media.fetch(str(local), _policy("--allowed-local-media-path", str(tmp_path))) == data
    )
    for source, code in (
        (url, "fetch.forbidden_address"),
        (str(local), "fetch.local_path_not_allowed"),
    ):
        with pytest.raises(_mm.MediaError) as info:
            await media.fetch(source, MediaPolicy())
        assert info.value.args[0] == code
        assert ApiError.from_media_error(info.value, []).status == 400


async def test_fetch_timeout_is_a_client_error(silent_server: str) -> None:
    policy = _policy("--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "0.3")
    with pytest.raises(_mm.MediaError) as info:
        await media.fetch(silent_server, policy)
    assert info.value.args[0] == "fetch.timeout"
    error = ApiError.from_media_error(info.value, ["messages[0].content[0].image_url"])
    assert (error.status, error.type) == (400, "invalid_request_error")


async def test_the_plan_places_hashes_and_sizes_each_item() -> None:
    spec = resolve_model_spec(build_tiny_model("qwen2_vl")).core
    images = [encode_image(56, 56), encode_image(280, 112)]
    prompt = [1, VISION_START, IMAGE_PAD, VISION_END, 2, VISION_START, IMAGE_PAD, VISION_END]
    result = await media.plan_request(
        spec, prompt, [data_url(d) for d in images], MediaPolicy(), count_only=True, keep_bytes=True
    )
    plan = result.plan
    # 56x56 -> 4x4 patches -> 4 tokens; 280x112 -> 8x20 patches -> 40 tokens (merge 2x2).
    assert [i.grid_thw for i in plan.media] == [(1, 4, 4), (1, 8, 20)]
    assert [(i.offset, i.length) for i in plan.media] == [(2, 4), (9, 40)]
    assert [i.mm_hash for i in plan.media] == [_mm.content_hash(d) for d in images]
    assert result.pixel_values == [None, None] and result.data == images
    assert len(plan.token_ids) == len(prompt) - 2 + 4 + 40
    assert all(plan.token_ids[i.offset : i.end] == [IMAGE_PAD] * i.length for i in plan.media)
    assert plan.positions is not None and len(plan.positions.rows) == 3 * len(plan.token_ids)


async def test_process_reports_the_failing_item_and_413_for_limits() -> None:
    spec = resolve_model_spec(build_tiny_model("qwen2_vl")).core
    prompt = [VISION_START, IMAGE_PAD, VISION_END] * 2
    with pytest.raises(_mm.MediaError) as info:
        await media.plan_request(
            spec, prompt, [data_url(encode_image(8, 8)), "data:,x"], MediaPolicy(), count_only=True
        )
    error = ApiError.from_media_error(info.value, ["first", "second"])
    assert error.param == "second" and error.status == 400
    too_large = ApiError.from_media_error(_mm.MediaError("fetch.too_large", "big", 0), ["a"])
    assert (too_large.status, too_large.param) == (413, "a")
