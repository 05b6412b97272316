"""A request with a video through every deployment pattern's handlers, in one process over a
real nats-server: hf engines on each video family's tiny checkpoint and the inline transfer
backend (`tests/worker/patterns.py`). The plan is the frontend driver's, and each pattern gives
transformers' own `generate` tokens with `pixel_values_videos` (`tests/engines/test_hf_video.py`
builds the reference and the plan)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from mmserve.engines.hf import HfEngine
from mmserve.protocol import PreprocessedRequest, SamplingParams, StopConditions
from mmserve.tiny.checkpoints import build_tiny_model
from tests.engines.test_hf_video import (
    NEW_TOKENS,
    SAMPLING,
    Item,
    driver_plan,
    png,
    reference,
)
from tests.support.engines import make_image
from tests.video.test_video_core import FFMPEG, make_video
from tests.worker.patterns import PATTERNS, Patterns, every_pattern
from tests.worker.test_handlers import completion

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(300),
    pytest.mark.skipif(FFMPEG is None, reason="needs the ffmpeg program (make setup)"),
]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def model_path(request: pytest.FixtureRequest) -> Path:
    """Each way of placing a video: Qwen2-VL's temporal index, Qwen2.5-VL's spacing by time,
    and Qwen3-VL's and Qwen3.5's timestamp text before each temporal group."""
    return build_tiny_model(request.param)


@pytest.fixture(scope="module")
def planner(patterns: Patterns) -> HfEngine:
    """The engine whose model the reference and the plans are made with (between requests)."""
    return patterns.engines[0]


@pytest.fixture(scope="module")
def video(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return make_video(tmp_path_factory.mktemp("video") / "v.mp4", size="100x60", seconds=1.6)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def patterns(nats_url: str, model_path: Path) -> AsyncIterator[Patterns]:
    async with every_pattern(nats_url, model_path) as started:
        yield started


@pytest.mark.parametrize("num_images", [0, 2])
async def test_every_pattern_gives_transformers_tokens_for_a_video(
    patterns: Patterns, planner: HfEngine, video: bytes, num_images: int
) -> None:
    images = [Item(png(make_image(56 + 28 * i, 84 - 28 * i, seed=i))) for i in range(num_images)]
    items = [*images[:1], Item(video, SAMPLING), *images[1:]]
    inputs, expected = reference(planner, items)
    plan, payloads = driver_plan(planner.spec, items)
    assert plan.token_ids == inputs["input_ids"][0].tolist()
    for name in PATTERNS:
        request = PreprocessedRequest(
            request_id=uuid.uuid4().hex,
            deadline=time.time() + 120,
            model="tiny",
            plan=plan,
            payloads=payloads,
            sampling=SamplingParams(temperature=0.0),
            stop=StopConditions(max_tokens=NEW_TOKENS, ignore_eos=True),
        )
        chunks = await patterns.stream(name, request)
        assert completion(chunks) == expected, name
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.prompt_tokens == len(plan.token_ids)
