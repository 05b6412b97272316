"""A planned request with a video through the mock engine: its usage counts the video's
tokens, and its prefix cache (and KV events, the router's input) keys the video's run by the
video's identity, as an image's (Qwen3-VL's: each temporal group's run by its own)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mmserve.engines.base import EngineRequest, MediaInput
from mmserve.engines.mock import MockEngine
from mmserve.frontend.mm_options import VideoRange
from mmserve.kv.view import prompt_block_keys
from mmserve.media import MediaPolicy, plan_request_here
from mmserve.media.text_pieces import text_pieces
from mmserve.protocol import (
    KvStored,
    MMProcessorKwargs,
    RequestPlan,
    SamplingParams,
    StopConditions,
)
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.images import encode_image
from tests.support.video import FFMPEG, IMAGE, VIDEO, checkpoint, make_video

pytestmark = pytest.mark.skipif(FFMPEG is None, reason="needs the ffmpeg program (make setup)")

BLOCK = 16


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "qwen3_vl_moe"])
async def test_usage_and_prefix_keys_cover_the_video(tmp_path: Any, family: str) -> None:
    spec, processor, _ = checkpoint(family)
    clip = make_video(tmp_path / "v.mp4", rate="30", seconds=3.0)
    image = encode_image(64, 48)
    text = f"<|im_start|>user\n{'x ' * 20}{VIDEO} and {IMAGE}?<|im_end|>\n"
    ids = processor.tokenizer(text)["input_ids"]
    video_range = VideoRange.of(spec)
    pieces = text_pieces(processor.tokenizer, spec)

    def plan(**asked: Any) -> RequestPlan:
        return plan_request_here(
            spec.core, ids, [clip, image], MediaPolicy(), count_only=True,
            modalities=["video", "image"],
            video=video_range.settings(MMProcessorKwargs(**asked), None),
            text_pieces=pieces,
        ).plan  # fmt: skip

    engine = await MockEngine.load(
        build_tiny_model(family), prefill_us_per_token=0.0, decode_ms_per_token=0.0
    )
    events: list[Any] = []
    engine.subscribe_kv_events(events.append)

    async def run(name: str, plan: RequestPlan) -> Any:
        items = [MediaInput(m.mm_hash, torch.zeros(0), m.grid_thw) for m in plan.media]
        embeddings = await engine.encode(items)
        request = EngineRequest.from_plan(
            name, plan, SamplingParams(temperature=0.0), StopConditions(max_tokens=2)
        )
        chunks = [chunk async for chunk in engine.generate(request, list(embeddings))]
        return chunks[-1].usage

    cold = plan()
    video = cold.media[0]
    videos = [item for item in cold.media if item.modality == "video"]
    assert video.modality == "video" and sum(item.length for item in videos) > BLOCK
    # Qwen3-VL(-MoE): one item per temporal group (more than one here).
    groups = [None] if family == "qwen2_vl" else list(range(max(len(videos), 2)))
    assert [item.temporal_group for item in videos] == groups
    usage = await run("a", cold)
    assert usage.prompt_tokens == len(cold.token_ids)
    assert usage.cached_tokens == 0
    stored = [event for event in events if isinstance(event, KvStored)]
    keys = prompt_block_keys(cold.token_ids, cold.media, BLOCK)
    assert [b.block_hash for e in stored for b in e.blocks] == list(keys.seq_hashes)
    # The same request again: every complete block is cached, the video's included.
    assert (await run("b", plan())).cached_tokens == len(keys.seq_hashes) * BLOCK
    # The same bytes under another sampling (same grid, other identity): only the text before
    # the video is shared.
    other = plan(min_frames=2)
    assert other.media[0].grid_thw == video.grid_thw
    assert other.media[0].mm_hash != video.mm_hash
    assert (await run("c", other)).cached_tokens == video.offset // BLOCK * BLOCK
