"""Video through the encode stage and the hf engine against transformers' own model.

For tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE checkpoints and a video made here with
FFmpeg: the reference is transformers' processor (given the frames mmserve's `decode_video`
returns at the sampled indices) for `pixel_values_videos`, `video_grid_thw` and the expanded
ids, and the model's own `generate`; mmserve's side is the encode stage from the video's bytes
and the engine, given a request plan built from those ids, the Rust M-RoPE positions and the
count-only video plan (Qwen3-VL: the driver's plan, one item per temporal group)."""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image
from transformers.video_utils import VideoMetadata

from mmserve import _mm
from mmserve.encode.stage import EncodeStage
from mmserve.engines.base import EngineError, EngineRequest, ItemEmbedding, MediaInput
from mmserve.engines.hf import HfEngine
from mmserve.media import MediaPolicy, VideoSettings, plan_request_here
from mmserve.media.text_pieces import text_pieces
from mmserve.media.video import checkpoint_video_options, video_options
from mmserve.models.family import ModelSpec
from mmserve.protocol import (
    ItemState,
    MediaPayload,
    MRopePositions,
    PlannedMedia,
    PreprocessedRequest,
    RequestPlan,
    StopConditions,
    TokenChunk,
)
from mmserve.protocol.pipeline import VideoSampling
from mmserve.tiny.checkpoints import build_tiny_model
from mmserve.transfer.inline import InlineTransferAgent
from tests.support.engines import IMAGE_TOKEN_ID, make_image
from tests.support.video import hf_processor
from tests.video.test_video_core import FFMPEG, make_video

pytestmark = pytest.mark.skipif(FFMPEG is None, reason="needs the ffmpeg program (make setup)")

VIDEO_TOKEN_ID = IMAGE_TOKEN_ID + 1
SAMPLING = VideoSampling(fps=2.0, min_pixels=3136, max_pixels=64 * 28 * 28)
NEW_TOKENS = 8
PROMPT = "<|im_start|>user\n{media}Describe what you see.<|im_end|>\n<|im_start|>assistant\n"
VIDEO_PART = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE_PART = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def engine(request: pytest.FixtureRequest) -> HfEngine:
    return HfEngine(build_tiny_model(request.param))


@pytest.fixture(scope="module")
def video(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return make_video(tmp_path_factory.mktemp("video") / "v.mp4", size="100x60", seconds=1.6)


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@dataclass(frozen=True)
class Item:
    """One media item of a prompt: its bytes and, for a video, its sampling."""

    data: bytes
    sampling: VideoSampling | None = None


def base_options(spec: ModelSpec) -> _mm.VideoOptions:
    """The checkpoint's video options, as the frontend and the encode stage read them."""
    return checkpoint_video_options(Path(spec.path), family=spec.core.family)


def video_plan(spec: ModelSpec, item: Item) -> dict[str, Any]:
    """The count-only plan of a video, as the frontend makes it."""
    assert item.sampling is not None
    options = video_options(base_options(spec), item.sampling)
    return dict(_mm.plan_video(item.data, options))


def time_interval(engine: HfEngine, plan: dict[str, Any]) -> float:
    """How far apart a video's temporal patches sit in M-RoPE: Qwen2.5-VL's `tokens_per_second
    * second_per_grid_ts` (float32, as torch multiplies), where `second_per_grid_ts` is the
    temporal patch over the sampled frame rate; 1 for Qwen2-VL."""
    if engine.spec.family != "qwen2_5_vl":
        return 1.0
    info = plan["info"]
    sampled_fps = len(plan["indices"]) / info["total_frames"] * info["fps"]
    seconds = np.float32(engine.spec.temporal_patch_size / sampled_fps)
    tokens_per_second = engine.model.config.vision_config.tokens_per_second
    return float(np.float32(tokens_per_second) * seconds)


def request_plan(engine: HfEngine, ids: list[int], items: list[Item]) -> RequestPlan:
    """The plan of expanded `ids` whose media runs hold `items` in order."""
    starts = [
        i
        for i, token in enumerate(ids)
        if token in (IMAGE_TOKEN_ID, VIDEO_TOKEN_ID) and ids[i - 1] != token
    ]
    media, blocks = [], []
    for start, item in zip(starts, items, strict=True):
        if item.sampling is None:
            image = Image.open(io.BytesIO(item.data))
            grid, length = engine.spec.core.plan(image.width, image.height)
            planned = PlannedMedia(
                mm_hash=_mm.content_hash(item.data), offset=start, length=length, grid_thw=grid
            )
            interval = 1.0
        else:
            plan = video_plan(engine.spec, item)
            planned = PlannedMedia(
                modality="video",
                video=item.sampling,
                mm_hash=plan["mm_hash"],
                offset=start,
                length=plan["tokens"],
                grid_thw=plan["grid_thw"],
            )
            interval = time_interval(engine, plan)
        media.append(planned)
        blocks.append((planned.offset, planned.end, planned.grid_thw, interval))
    rows, delta = _mm.mrope_positions(len(ids), blocks, engine.spec.spatial_merge_size)
    positions = MRopePositions(rows=rows.reshape(-1).tolist(), delta=delta)
    return RequestPlan(token_ids=ids, media=media, positions=positions)


def reference(engine: HfEngine, items: list[Item]) -> tuple[dict[str, torch.Tensor], list[int]]:
    """transformers' processor inputs for the prompt with `items` (videos as the frames
    mmserve decodes at the sampled indices), and the greedy tokens of the model's `generate`."""
    processor = hf_processor(engine.spec.path)
    media = "".join(IMAGE_PART if item.sampling is None else VIDEO_PART for item in items)
    videos, metadata, images = [], [], []
    for item in items:
        if item.sampling is None:
            images.append(Image.open(io.BytesIO(item.data)))
            continue
        plan = video_plan(engine.spec, item)
        info, frames = _mm.decode_video(item.data, plan["indices"])
        videos.append(torch.from_numpy(frames))
        metadata.append(
            VideoMetadata(
                total_num_frames=info["total_frames"],
                fps=info["fps"],
                frames_indices=plan["indices"],
            )
        )
    inputs = processor(
        text=[PROMPT.format(media=media)],
        images=images or None,
        videos=videos or None,
        video_metadata=metadata or None,
        do_sample_frames=False,
        cap_pixels_per_frame=False,  # the class default, which the checkpoint keeps
        # The video's pixel budget; the images keep the model's.
        videos_kwargs={
            "size": {"shortest_edge": SAMPLING.min_pixels, "longest_edge": SAMPLING.max_pixels}
        },
        input_data_format="channels_last",
        return_tensors="pt",
    )
    inputs.pop("mm_token_type_ids", None)
    ids = inputs["input_ids"]
    spec = engine.spec
    mm_token_type_ids = (ids == spec.image_token_id).int() + 2 * (ids == spec.video_token_id).int()
    out = engine.model.generate(
        **inputs,
        mm_token_type_ids=mm_token_type_ids,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
    )
    return inputs, out[0, ids.shape[1] :].tolist()


async def encode(
    engine: HfEngine, plan: RequestPlan, payloads: list[MediaPayload], seconds: float = 120
) -> list[ItemEmbedding]:
    stage = EncodeStage(engine, InlineTransferAgent(), engine.spec.path, "worker")
    request = PreprocessedRequest(
        request_id="video",
        deadline=time.time() + seconds,
        model="tiny",
        plan=plan,
        payloads=payloads,
    )
    encoded = await stage.run(request)
    return [encoded[i] for i in range(len(plan.media))]


async def generate(engine: HfEngine, plan: RequestPlan, items: list[Item]) -> list[TokenChunk]:
    embeddings = await encode(engine, plan, [MediaPayload(data=item.data) for item in items])
    request = EngineRequest.from_plan(
        "video", plan, stop=StopConditions(max_tokens=NEW_TOKENS, ignore_eos=True)
    )
    return [chunk async for chunk in engine.generate(request, embeddings)]


def tokens_of(chunks: list[TokenChunk]) -> list[int]:
    return [token for chunk in chunks for token in chunk.token_ids]


@pytest.mark.parametrize("num_images", [0, 2])
async def test_greedy_tokens_equal_transformers_with_a_video(
    engine: HfEngine, video: bytes, num_images: int
) -> None:
    images = [Item(png(make_image(56 + 28 * i, 84 - 28 * i, seed=i))) for i in range(num_images)]
    # The video between the images: its runs and positions sit among theirs.
    video_item = Item(video, SAMPLING)
    items = [*images[:1], video_item, *images[1:]]
    inputs, expected = reference(engine, items)
    ids = inputs["input_ids"][0].tolist()
    plan = request_plan(engine, ids, items)

    (planned,) = [item for item in plan.media if item.modality == "video"]
    assert [list(planned.grid_thw)] == inputs["video_grid_thw"].tolist()
    options = video_options(base_options(engine.spec), SAMPLING)
    _, pixel_values_videos = _mm.process_video(video, options)
    assert np.array_equal(pixel_values_videos, inputs["pixel_values_videos"].numpy())
    if engine.spec.family == "qwen2_5_vl":
        seconds = float(inputs["second_per_grid_ts"][0])
        assert time_interval(engine, video_plan(engine.spec, video_item)) == float(
            np.float32(engine.model.config.vision_config.tokens_per_second) * np.float32(seconds)
        )
    input_ids = inputs["input_ids"]
    rope_kwargs = {k: inputs[k] for k in ("image_grid_thw", "second_per_grid_ts") if k in inputs}
    rows, delta = engine.model.model.get_rope_index(
        input_ids,
        (input_ids == IMAGE_TOKEN_ID).int() + 2 * (input_ids == VIDEO_TOKEN_ID).int(),
        video_grid_thw=inputs["video_grid_thw"],
        **rope_kwargs,
    )
    assert plan.positions is not None
    assert plan.positions.rows == rows.reshape(-1).tolist()
    assert plan.positions.delta == int(delta.flatten()[0])

    assert tokens_of(await generate(engine, plan, items)) == expected


async def test_the_same_video_hits_the_encoder_cache_and_another_fps_misses(
    engine: HfEngine, video: bytes
) -> None:
    engine.encoder_cache.clear()
    transfer = InlineTransferAgent()
    handle, _lease = await transfer.offer(torch.frombuffer(bytearray(video), dtype=torch.uint8))
    item = Item(video, SAMPLING)
    ids = [1, 2, *[VIDEO_TOKEN_ID] * video_plan(engine.spec, item)["tokens"], 3]
    plan = request_plan(engine, ids, [item])
    # The bytes by transfer, as the frontend sends them on.
    first = await encode(engine, plan, [MediaPayload(data=video)])
    hits, misses = engine.encoder_cache.stats()
    (again,) = await encode(engine, plan, [MediaPayload(encoded=handle)])
    assert engine.encoder_cache.stats() == (hits + 1, misses)
    assert again.embeddings is first[0].embeddings

    faster = Item(video, msgspec.structs.replace(SAMPLING, fps=4.0))
    faster_plan = request_plan(
        engine, [1, 2, *[VIDEO_TOKEN_ID] * video_plan(engine.spec, faster)["tokens"], 3], [faster]
    )
    assert faster_plan.media[0].mm_hash != plan.media[0].mm_hash
    (other,) = await encode(engine, faster_plan, [MediaPayload(data=video)])
    assert engine.encoder_cache.stats() == (hits + 1, misses + 1)
    assert other.grid_thw[0] > first[0].grid_thw[0]  # more frames, more temporal patches


async def test_a_repeated_video_prompt_reuses_its_prefix_blocks_and_another_fps_does_not(
    engine: HfEngine, video: bytes
) -> None:
    engine.prefix_cache.clear()
    items = [Item(video, SAMPLING)]
    inputs, expected = reference(engine, items)
    plan = request_plan(engine, inputs["input_ids"][0].tolist(), items)
    first, again = await generate(engine, plan, items), await generate(engine, plan, items)
    assert tokens_of(first) == tokens_of(again) == expected
    assert first[-1].usage is not None and again[-1].usage is not None
    block = engine.prefix_cache.block_size
    assert first[-1].usage.cached_tokens == 0
    assert again[-1].usage.cached_tokens == (len(plan.token_ids) - 1) // block * block
    # The same bytes sampled at another rate: blocks over the video are another video's.
    faster = [Item(video, msgspec.structs.replace(SAMPLING, fps=4.0))]
    inputs, _ = reference(engine, faster)
    other = await generate(
        engine, request_plan(engine, inputs["input_ids"][0].tolist(), faster), faster
    )
    assert other[-1].usage is not None
    assert other[-1].usage.cached_tokens == plan.media[0].offset // block * block


async def test_frontend_decoded_pixels_of_a_video_give_its_embeddings(
    engine: HfEngine, video: bytes
) -> None:
    """`--frontend-decoding`: the video's `pixel_values_videos` travel instead of its bytes and
    go through the tower's video path all the same."""
    item = Item(video, SAMPLING)
    ids = [1, *[VIDEO_TOKEN_ID] * video_plan(engine.spec, item)["tokens"], 3]
    plan = request_plan(engine, ids, [item])
    (from_bytes,) = await encode(engine, plan, [MediaPayload(data=video)])
    engine.encoder_cache.clear()
    _, pixel_values_videos = _mm.process_video(
        video, video_options(base_options(engine.spec), SAMPLING)
    )
    transfer = InlineTransferAgent()
    handle, _lease = await transfer.offer(torch.from_numpy(pixel_values_videos))
    stage = EncodeStage(engine, transfer, engine.spec.path, "worker")
    request = PreprocessedRequest(
        request_id="pixels",
        deadline=time.time() + 120,
        model="tiny",
        plan=plan,
        payloads=[MediaPayload(pixel_values=handle)],
    )
    from_pixels = (await stage.run(request))[0]
    assert torch.equal(from_pixels.embeddings, from_bytes.embeddings)


async def test_frontend_decoded_image_pixels_beside_video_bytes(
    engine: HfEngine, video: bytes
) -> None:
    """`--frontend-decoding` with an image and a video: the image's pixels travel, the video's
    bytes beside them; each item gets the embeddings its bytes give."""
    image = Item(png(make_image(56, 84, seed=3)))
    items = [image, Item(video, SAMPLING)]
    image_tokens = engine.spec.core.plan(56, 84)[1]
    ids = [1, *[IMAGE_TOKEN_ID] * image_tokens, 2]
    ids += [*[VIDEO_TOKEN_ID] * video_plan(engine.spec, items[1])["tokens"], 3]
    plan = request_plan(engine, ids, items)
    from_bytes = await encode(engine, plan, [MediaPayload(data=item.data) for item in items])
    engine.encoder_cache.clear()
    pixel_values, _, _ = _mm.preprocess(engine.spec.core, image.data)
    transfer = InlineTransferAgent()
    handle, _lease = await transfer.offer(torch.from_numpy(pixel_values))
    stage = EncodeStage(engine, transfer, engine.spec.path, "worker")
    request = PreprocessedRequest(
        request_id="mixed",
        deadline=time.time() + 120,
        model="tiny",
        plan=plan,
        payloads=[MediaPayload(pixel_values=handle), MediaPayload(data=video)],
    )
    encoded = await stage.run(request)
    for index, expected in enumerate(from_bytes):
        assert torch.equal(encoded[index].embeddings, expected.embeddings), index


async def test_a_plan_that_disagrees_with_the_decoded_video_is_our_fault(
    engine: HfEngine, video: bytes
) -> None:
    item = Item(video, SAMPLING)
    ids = [1, *[VIDEO_TOKEN_ID] * video_plan(engine.spec, item)["tokens"], 3]
    plan = request_plan(engine, ids, [item])
    wrong = msgspec.structs.replace(plan.media[0], mm_hash=plan.media[0].mm_hash ^ 1)
    bad = msgspec.structs.replace(plan, media=[wrong])
    with pytest.raises(EngineError, match="decodes to grid"):
        await encode(engine, bad, [MediaPayload(data=video)])


async def test_a_video_that_fails_to_decode_is_refused_with_its_code(
    engine: HfEngine, video: bytes
) -> None:
    """The frontend plans from the headers; a body that breaks off, or the request's deadline
    passing, is found here and named with the core's code (a 4xx at the edge)."""
    item = Item(video, SAMPLING)
    ids = [1, *[VIDEO_TOKEN_ID] * video_plan(engine.spec, item)["tokens"], 3]
    plan = request_plan(engine, ids, [item])
    with pytest.raises(_mm.MediaError) as error:
        await encode(engine, plan, [MediaPayload(data=video)], seconds=-1)
    assert error.value.args[0] == "video.deadline"
    # Its headers (the moov atom, at the end) stay whole: only decoding finds the damage.
    broken = bytearray(video)
    start = video.index(b"mdat") + 64
    broken[start : start + 2048] = bytes(2048)
    with pytest.raises(_mm.MediaError) as error:
        await encode(engine, plan, [MediaPayload(data=bytes(broken))])
    assert error.value.args[0] == "video.corrupt"


async def test_an_image_only_family_refuses_a_video(video: bytes) -> None:
    gemma = HfEngine(build_tiny_model("gemma3"))
    pixels = torch.zeros(4, 1176)
    with pytest.raises(EngineError, match="gemma3 models take no video"):
        await gemma.encode([MediaInput(1, pixels, (2, 2, 2), modality="video")])
    planned = PlannedMedia(
        modality="video", video=SAMPLING, mm_hash=1, offset=1, length=2, grid_thw=(2, 2, 2)
    )
    plan = RequestPlan(token_ids=[1, 5, 5, 2], media=[planned])
    with pytest.raises(EngineError, match="takes none"):
        await encode(gemma, plan, [MediaPayload(data=video)])
    await gemma.close()


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def qwen3(request: pytest.FixtureRequest) -> HfEngine:
    """Qwen3-VL, Qwen3-VL-MoE and Qwen3.5: one vision side, one processor."""
    return HfEngine(build_tiny_model(request.param))


def driver_plan(spec: ModelSpec, items: list[Item]) -> tuple[RequestPlan, list[MediaPayload]]:
    """The plan the frontend's driver makes of the prompt with `items` (from its bytes, count
    only), and the payloads it sends on (a video's bytes with its first planned item)."""
    tokenizer = hf_processor(spec.path).tokenizer  # the checkpoint's AutoTokenizer
    media = "".join(IMAGE_PART if item.sampling is None else VIDEO_PART for item in items)
    settings = VideoSettings(base=base_options(spec), sampling=SAMPLING)
    planned = plan_request_here(
        spec.core,
        tokenizer(PROMPT.format(media=media))["input_ids"],
        [item.data for item in items],
        MediaPolicy(),
        count_only=True,
        keep_bytes=True,
        modalities=["image" if item.sampling is None else "video" for item in items],
        video=settings,
        text_pieces=text_pieces(tokenizer, spec),
    )
    payloads = [MediaPayload(data=None if d is None else bytes(d)) for d in planned.data]
    return planned.plan, payloads


@pytest.mark.parametrize("num_images", [0, 2])
async def test_qwen3_vl_video_greedy_tokens_equal_transformers(
    qwen3: HfEngine, video: bytes, num_images: int
) -> None:
    """Qwen3-VL (and Qwen3-VL-MoE) writes each temporal group of a video as its own run of
    `<|video_pad|>` tokens after the group's timestamp text: the driver plans one item per
    group (grid `(1, h, w)`), with ids equal to `Qwen3VLProcessor`'s and positions equal to the
    model's `get_rope_index`; the encode stage decodes the video once and gives each group its
    rows of `pixel_values_videos` (deepstack included), from which the engine gives
    transformers' greedy tokens; the same video again is read from the encoder cache, group by
    group."""
    images = [Item(png(make_image(56 + 32 * i, 96 - 32 * i, seed=i))) for i in range(num_images)]
    items = [*images[:1], Item(video, SAMPLING), *images[1:]]
    inputs, expected = reference(qwen3, items)
    plan, payloads = driver_plan(qwen3.spec, items)
    input_ids = inputs["input_ids"]
    assert plan.token_ids == input_ids[0].tolist()
    t, h, w = inputs["video_grid_thw"][0].tolist()
    groups = [item for item in plan.media if item.modality == "video"]
    assert [(g.temporal_group, g.grid_thw) for g in groups] == [(g, (1, h, w)) for g in range(t)]
    assert [p.data is not None for p in payloads] == [
        item.temporal_group in (None, 0) for item in plan.media
    ]
    options = video_options(base_options(qwen3.spec), SAMPLING)
    _, pixel_values_videos = _mm.process_video(video, options)
    assert np.array_equal(pixel_values_videos, inputs["pixel_values_videos"].numpy())
    rows, delta = qwen3.model.model.get_rope_index(
        input_ids,
        (input_ids == qwen3.spec.image_token_id).int()
        + 2 * (input_ids == qwen3.spec.video_token_id).int(),
        image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs["video_grid_thw"],
    )
    assert plan.positions is not None
    assert plan.positions.rows == rows.reshape(-1).tolist()
    assert plan.positions.delta == int(delta.flatten()[0])

    qwen3.encoder_cache.clear()
    embeddings = await encode(qwen3, plan, payloads)
    assert all(len(e.deepstack) == qwen3.spec.deepstack_layers for e in embeddings)
    request = EngineRequest.from_plan(
        "qwen3-video", plan, stop=StopConditions(max_tokens=NEW_TOKENS, ignore_eos=True)
    )
    tokens = [t async for chunk in qwen3.generate(request, embeddings) for t in chunk.token_ids]
    assert tokens == expected
    hits, misses = qwen3.encoder_cache.stats()
    again = await encode(qwen3, plan, payloads)
    assert qwen3.encoder_cache.stats() == (hits + len(plan.media), misses)
    assert all(a.embeddings is b.embeddings for a, b in zip(again, embeddings, strict=True))
    # Groups the prefix cache holds are left to the encoder with the video's others all the
    # same (its bytes are read once); a skipped image stays skipped.
    images_at = [i for i, item in enumerate(plan.media) if item.modality == "image"]
    first_group = plan.media.index(groups[0])
    stage = EncodeStage(qwen3, InlineTransferAgent(), qwen3.spec.path, "worker")
    skipping = PreprocessedRequest(
        request_id="skip",
        deadline=time.time() + 120,
        model="tiny",
        plan=plan,
        payloads=payloads,
    ).skipping([first_group, *images_at])
    assert skipping.items(ItemState.SKIPPED) == images_at
    encoded = await stage.run(skipping)
    assert sorted(encoded) == [i for i in range(len(plan.media)) if i not in images_at]
