"""Requests with videos through the HTTP API and the official openai client: video_url parts
from http(s), data: URLs and allowed local files, mixed with images; the plan the first hop
receives (video pads, identity, sampling, the bytes) and its token count against
transformers' processor; per-request sampling within the server's bounds; and every refusal
with its status and code while a good request beside it is served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest

from mmserve import _mm
from mmserve.frontend.chat import ChatOptions, ChatPreprocessor, ServedModel
from mmserve.frontend.errors import ApiError
from mmserve.media import MediaPolicy
from mmserve.media.video import video_options
from mmserve.protocol import ChatCompletionRequest, PreprocessedRequest
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.images import data_url, encode_image
from tests.support.local_media import MediaServer
from tests.support.video import FFMPEG, hf_reference, make_video

from .conftest import RunningFrontend

pytestmark = pytest.mark.skipif(FFMPEG is None, reason="needs the ffmpeg program (make setup)")

VIDEO_PAD = 151656


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """2 s at 24 fps (48 frames), 128x96."""
    return make_video(
        tmp_path_factory.mktemp("clip") / "v.mp4", size="128x96", rate="24", seconds=2.0
    )


def _video(url: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _client(frontend: RunningFrontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=frontend.url + "/v1", api_key="x", max_retries=0)


def _ask(frontend: RunningFrontend, content: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    body = {
        "model": frontend.model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        **extra,
    }
    return httpx.post(frontend.url + "/v1/chat/completions", json=body, timeout=60)


def _reference_ids(
    frontend: RunningFrontend, content: list[dict[str, Any]], media: list[tuple[str, bytes]]
) -> list[int]:
    """transformers' Qwen2VLProcessor's expanded ids for the rendered prompt, given the
    frames the plan samples."""
    preprocessor = frontend.app.preprocessor
    parts = [
        {"type": part["type"].removesuffix("_url")} if part["type"] != "text" else part
        for part in content
    ]
    text = preprocessor.model.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    assert preprocessor.video_range is not None
    settings = preprocessor.video_range.settings(None, None)
    ids, _, _ = hf_reference("qwen2_vl", text, media, settings)
    return ids


def _video_items(sent: PreprocessedRequest) -> list[Any]:
    return [item for item in sent.plan.media if item.modality == "video"]


def test_one_video_over_http_with_the_openai_client(
    allowed_frontend: RunningFrontend, media_server: MediaServer, clip: bytes
) -> None:
    url = media_server.write("clip.mp4", clip)
    content = [{"type": "text", "text": "What happens?"}, _video(url)]
    completion = _client(allowed_frontend).chat.completions.create(
        model=allowed_frontend.model,
        messages=[{"role": "user", "content": content}],
        max_tokens=4,
    )
    sent = allowed_frontend.dispatcher.requests[-1]
    (item,) = sent.plan.media
    (payload,) = sent.payloads
    video_range = allowed_frontend.app.preprocessor.video_range
    assert video_range is not None
    # The server's default sampling (the checkpoint samples nothing: fps 2), its identity and
    # grid as the core plans the bytes under it; the bytes travel on as fetched.
    assert item.modality == "video" and item.video == video_range.default
    assert item.video.fps == 2.0 and item.pixel_bounds is None
    own = _mm.plan_video(clip, video_options(video_range.base, item.video))
    assert (item.mm_hash, item.grid_thw, item.length) == (
        own["mm_hash"], own["grid_thw"], own["tokens"]
    )  # fmt: skip
    ids = sent.plan.token_ids
    assert ids[item.offset : item.end] == [VIDEO_PAD] * item.length
    assert ids.count(VIDEO_PAD) == item.length
    assert payload.data == clip
    assert sent.plan.positions is not None
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(ids)
    assert ids == _reference_ids(allowed_frontend, content, [("video", clip)])


def test_a_video_and_two_images_streamed(
    allowed_frontend: RunningFrontend, media_server: MediaServer, clip: bytes
) -> None:
    images = [encode_image(64, 48), encode_image(100, 300)]
    content = [
        _image(media_server.write("first.png", images[0])),
        {"type": "text", "text": "and"},
        _video(data_url(clip, "video/mp4")),
        _image(data_url(images[1])),
        {"type": "text", "text": "?"},
    ]
    stream = _client(allowed_frontend).chat.completions.create(
        model=allowed_frontend.model,
        messages=[{"role": "user", "content": content}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    sent = allowed_frontend.dispatcher.requests[-1]
    assert [item.modality for item in sent.plan.media] == ["image", "video", "image"]
    assert [payload.data for payload in sent.payloads] == [images[0], clip, images[1]]
    media = [("image", images[0]), ("video", clip), ("image", images[1])]
    expected = _reference_ids(allowed_frontend, content, media)
    assert sent.plan.token_ids == expected
    assert usage[-1] is not None and usage[-1].prompt_tokens == len(expected)


def test_local_video_files_only_under_the_allowed_root(
    allowed_frontend: RunningFrontend,
    frontend: RunningFrontend,
    media_server: MediaServer,
    clip: bytes,
) -> None:
    inside = media_server.root / "allowed" / "clip.mp4"
    inside.write_bytes(clip)
    for source in (str(inside), inside.as_uri()):
        assert _ask(allowed_frontend, [_video(source)]).status_code == 200
        assert allowed_frontend.dispatcher.requests[-1].payloads[0].data == clip
    with pytest.raises(openai.BadRequestError) as info:
        _client(frontend).chat.completions.create(
            model=frontend.model,
            messages=[{"role": "user", "content": [_video(str(inside))]}],
        )
    assert info.value.code == "fetch.local_path_not_allowed"
    error = info.value.response.json()["error"]
    assert error["param"] == "messages[0].content[0].video_url"


def test_requests_choose_their_sampling_within_the_bounds(
    frontend: RunningFrontend, clip: bytes
) -> None:
    source = data_url(clip, "video/mp4")
    by_fps = _ask(frontend, [_video(source)], mm_processor_kwargs={"fps": 4.0, "max_frames": 6})
    assert by_fps.status_code == 200, by_fps.text
    (item,) = _video_items(frontend.dispatcher.requests[-1])
    assert item.video is not None and (item.video.fps, item.video.max_frames) == (4.0, 6)
    assert item.grid_thw[0] == 3  # 2 s at 4 fps is 8 frames, at most 6: 3 temporal patches
    by_count = _ask(frontend, [_video(source)], media_io_kwargs={"video": {"num_frames": 4}})
    assert by_count.status_code == 200, by_count.text
    (counted,) = _video_items(frontend.dispatcher.requests[-1])
    assert counted.video is not None and (counted.video.fps, counted.video.num_frames) == (
        None, 4
    )  # fmt: skip
    assert counted.grid_thw[0] == 2 and counted.mm_hash != item.mm_hash


BAD_REQUESTS: dict[str, tuple[dict[str, Any], str, str | None]] = {
    "fps and num_frames": (
        {"mm_processor_kwargs": {"fps": 1.0, "num_frames": 4}},
        "video.bad_sampling",
        "mm_processor_kwargs.num_frames",
    ),
    "two rates that disagree": (
        {"mm_processor_kwargs": {"fps": 1.0}, "media_io_kwargs": {"video": {"fps": 2.0}}},
        "video.bad_sampling",
        "media_io_kwargs.video.fps",
    ),
    "fps over the bound": (
        {"mm_processor_kwargs": {"fps": 100.0}},
        "invalid_value",
        "mm_processor_kwargs.fps",
    ),
    "io fps over the bound": (
        {"media_io_kwargs": {"video": {"fps": 31.0}}},
        "invalid_value",
        "media_io_kwargs.video.fps",
    ),
    "too many frames": (
        {"mm_processor_kwargs": {"num_frames": 10_000}},
        "invalid_value",
        "mm_processor_kwargs.num_frames",
    ),
    "min_frames over max_frames": (
        {"mm_processor_kwargs": {"min_frames": 8, "max_frames": 4}},
        "video.bad_sampling",
        "mm_processor_kwargs.min_frames",
    ),
    "an unknown loader option": (
        {"media_io_kwargs": {"video": {"backend": "opencv"}}},
        "invalid_value",
        "media_io_kwargs.video",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_sampling_is_refused_by_name(frontend: RunningFrontend, clip: bytes, case: str):
    extra, code, param = BAD_REQUESTS[case]
    source = data_url(clip, "video/mp4")
    response = _ask(frontend, [_video(source)], **extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert _ask(frontend, [_video(source)]).status_code == 200


@pytest.mark.parametrize("case", ["too many frames", "io fps over the bound"])
def test_bad_sampling_is_refused_without_a_video(frontend: RunningFrontend, case: str) -> None:
    """A video option out of bounds is a 400 even when the request carries no video, as the
    OpenAPI document's bounds say."""
    extra, code, param = BAD_REQUESTS[case]
    response = _ask(frontend, [{"type": "text", "text": "hi"}], **extra)
    assert response.status_code == 400, response.text
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == (code, param)


def _truncated(clip: bytes, _: Path) -> bytes:
    return clip[: len(clip) // 2]


def _mpegts(_: bytes, root: Path) -> bytes:
    return make_video(root / "v.ts", seconds=0.5)


BAD_VIDEOS = {
    "truncated file": (_truncated, "video/mp4", 400, "video.corrupt"),
    "wrong container": (_mpegts, "video/mp2t", 400, "video.unsupported_container"),
    "an image called a video": (
        lambda _, __: encode_image(30, 30), "video/mp4", 400, "video.unsupported_container"
    ),
    "text called a video": (lambda _, __: b"hello, world", "video/webm", 400,
                            "video.unknown_container"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_VIDEOS))
def test_bad_videos_are_refused_and_the_server_keeps_serving(
    frontend: RunningFrontend, clip: bytes, tmp_path: Path, case: str
) -> None:
    make, mime, status, code = BAD_VIDEOS[case]
    good = data_url(clip, "video/mp4")
    bad = data_url(make(clip, tmp_path), mime)
    response = _ask(frontend, [_video(good), {"type": "text", "text": "vs"}, _video(bad)])
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert error["param"] == "messages[0].content[2].video_url"
    assert _ask(frontend, [_video(good)]).status_code == 200


@pytest.mark.parametrize(
    "flags, code, status",
    [
        (("--limit-mm-per-prompt", "video=1"), "request.too_many_items", 400),
        (("--max-video-duration", "1.5"), "video.too_long", 413),
        (("--max-video-total-frames", "30"), "video.too_many_frames", 413),
        (("--max-video-frame-pixels", "8000"), "video.too_many_pixels", 413),
        (("--max-video-tokens", "20"), "video.too_many_tokens", 413),
    ],
)
def test_server_caps_refuse_from_the_headers(
    start_frontend, clip: bytes, tmp_path: Path, flags: tuple[str, ...], code: str, status: int
) -> None:
    """Each cap refuses the 2 s, 48-frame, 128x96 clip (two of them for the count) while a
    1 s, 10-frame, 96x64 one within them is served."""
    frontend = start_frontend(*flags)
    small = make_video(tmp_path / "small.mp4")
    response = _ask(
        frontend, [_video(data_url(clip, "video/mp4")), _video(data_url(clip, "video/mp4"))]
    )
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    served = _ask(
        frontend, [_video(data_url(small, "video/mp4"))], mm_processor_kwargs={"num_frames": 4}
    )
    assert served.status_code == 200, served.text


def test_openapi_names_video_parts_and_their_bounds(frontend: RunningFrontend) -> None:
    schemas = httpx.get(frontend.url + "/openapi.json").json()["components"]["schemas"]
    assert schemas["VideoUrlPart"]["properties"]["type"]["enum"] == ["video_url"]
    fps = schemas["MMProcessorKwargs"]["properties"]["fps"]
    assert {"type": "number", "exclusiveMinimum": 0.0, "maximum": 30.0} in fps["anyOf"]
    assert "video" in schemas["MediaIoKwargs"]["properties"]


async def test_qwen3_vl_plans_each_temporal_group_after_its_timestamp(clip: bytes) -> None:
    """Qwen3-VL: the first hop gets one video item per temporal group, the ids equal to
    `Qwen3VLProcessor`'s (the timestamp text before each group, text right before the video
    part), the video's bytes with its first group and nothing with the others."""
    model = ServedModel.load(build_tiny_model("qwen3_vl"))
    preprocessor = ChatPreprocessor(model, ChatOptions(policy=MediaPolicy()))
    assert model.spec.core.video_per_group and preprocessor.video_range is not None
    images = [encode_image(64, 48), encode_image(100, 300)]
    content = [
        {"type": "image_url", "image_url": {"url": data_url(images[0])}},
        {"type": "text", "text": "then clip 3:"},
        _video(data_url(clip, "video/mp4")),
        {"type": "image_url", "image_url": {"url": data_url(images[1])}},
    ]
    request = msgspec.convert(
        {"model": model.name, "messages": [{"role": "user", "content": content}]},
        ChatCompletionRequest,
    )
    sent = await preprocessor.preprocess(request, "r", 1e12)
    videos = _video_items(sent)
    settings = preprocessor.video_range.settings(None, None)
    own = _mm.plan_video(clip, video_options(settings.base, settings.sampling))
    t, h, w = own["grid_thw"]
    assert t > 1 and [(v.temporal_group, v.grid_thw) for v in videos] == [
        (g, (1, h, w)) for g in range(t)
    ]
    assert [v.mm_hash for v in videos] == own["group_mm_hashes"]
    assert [item.modality for item in sent.plan.media] == ["image", *["video"] * t, "image"]
    assert [p.data for p in sent.payloads] == [images[0], clip, *[None] * (t - 1), images[1]]
    parts = [
        {"type": part["type"].removesuffix("_url")} if part["type"] != "text" else part
        for part in content
    ]
    text = model.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    media = [("image", images[0]), ("video", clip), ("image", images[1])]
    ids, positions, delta = hf_reference("qwen3_vl", text, media, settings)
    assert sent.plan.token_ids == ids
    assert sent.plan.positions is not None
    assert sent.plan.positions.rows == positions.reshape(-1).tolist()
    assert sent.plan.positions.delta == delta


async def test_families_without_video_refuse_it_clearly(clip: bytes) -> None:
    """Gemma 3 takes no video: a 400 that says so, before anything is fetched."""
    model = ServedModel.load(build_tiny_model("gemma3"))
    preprocessor = ChatPreprocessor(model, ChatOptions(policy=MediaPolicy()))
    assert not model.spec.core.takes_video and preprocessor.video_range is None
    content = [{"type": "text", "text": "?"}, _video(data_url(clip, "video/mp4"))]
    request = msgspec.convert(
        {"model": model.name, "messages": [{"role": "user", "content": content}]},
        ChatCompletionRequest,
    )
    with pytest.raises(ApiError) as info:
        await preprocessor.preprocess(request, "r", 1e12)
    assert (info.value.status, info.value.code) == (400, "process.video_unsupported")
    assert "not supported for this model family" in info.value.message


def test_frontend_decoding_ships_image_pixels_and_video_bytes(start_frontend, clip: bytes):
    """With --frontend-decoding an image's pixels travel; a video is planned from its headers
    either way, and its bytes travel by transfer."""
    frontend = start_frontend("--frontend-decoding")
    image = encode_image(56, 56)
    response = _ask(frontend, [_video(data_url(clip, "video/mp4")), _image(data_url(image))])
    assert response.status_code == 200, response.text
    sent = frontend.dispatcher.requests[-1]
    video_payload, image_payload = sent.payloads
    assert image_payload.pixel_values is not None and image_payload.encoded is None
    assert video_payload.pixel_values is None and video_payload.encoded is not None
    assert video_payload.encoded.descriptor == clip


def test_a_300_mib_video_is_refused_from_its_announced_size(
    allowed_frontend: RunningFrontend, media_server: MediaServer, clip: bytes
) -> None:
    """By URL and as an allowed local file (sparse: nothing is written or read past the
    cap), over the 64 MiB per item; a good video beside it is served."""
    for name in ("huge.mp4", "allowed/huge.mp4"):
        with open(media_server.root / name, "wb") as huge:
            huge.truncate(300 << 20)
    sources = [f"{media_server.url}/huge.mp4", str(media_server.root / "allowed" / "huge.mp4")]
    for source in sources:
        response = _ask(allowed_frontend, [_video(data_url(clip, "video/mp4")), _video(source)])
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == (
            "fetch.too_large", "messages[0].content[1].video_url"
        )  # fmt: skip
    assert _ask(allowed_frontend, [_video(data_url(clip, "video/mp4"))]).status_code == 200
