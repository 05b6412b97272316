"""Audio through every deployment pattern's handlers (`tests/worker/patterns.py`), in one
process over a real nats-server. The request is the frontend's own: `ChatPreprocessor` plans
the openai-shaped messages the e2e tests send. Every pattern gives the aggregated worker's
tokens, and those are transformers' greedy completion on the processor's inputs (the e2e
tests' references): Qwen2-Audio with one clip and with two, Qwen2.5-Omni's thinker with two
clips beside an image, and with a video served with its own audio track
(`use_audio_in_video`), Qwen3-Omni-MoE's thinker with two clips beside an image (its deepstack
features at the image's tokens only), and with a clip beside a video. The e2e tests run agg
and E/P/D as processes through the openai client, streamed and not; this module adds EP/D and
E/PD at an in-process cost."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import pytest_asyncio
from PIL import Image

from mmserve.frontend.chat import ChatOptions, ChatPreprocessor, ServedModel
from mmserve.media import MediaPolicy
from mmserve.protocol import ChatCompletionRequest
from mmserve.tiny.checkpoints import build_tiny_model
from tests.e2e import test_audio, test_omni
from tests.e2e.test_audio import _user, input_audio
from tests.support.audio import FFMPEG, Encoding, encode_one, signal, wav_bytes
from tests.support.engines import make_image
from tests.support.images import data_url, png_data_url
from tests.support.video import make_video, make_video_with_track
from tests.worker.patterns import PATTERNS, Patterns, every_pattern
from tests.worker.test_handlers import completion

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(300),
    pytest.mark.skipif(FFMPEG is None, reason="needs the ffmpeg program (make setup)"),
]

MAX_TOKENS = test_audio.MAX_TOKENS
QUESTION = {"type": "text", "text": "What do you hear?"}


@dataclass(frozen=True)
class Case:
    """A user turn's parts, and the clips, images and video in it, in order, for the
    reference; `track`: the video is served with its audio track (`use_audio_in_video`)."""

    messages: list[dict[str, Any]]
    clips: list[bytes]
    images: list[Image.Image]
    video: bytes | None = None
    track: bool = False


@dataclass(frozen=True)
class Clips:
    speech: bytes  # a 16 kHz WAV
    tone: bytes  # a 44.1 kHz stereo MP3, resampled and mixed down on the way
    video: bytes  # H.264 with a stereo AAC track, 2.5 s: the track crosses a 2 s chunk
    # 2 s at 10 fps, sampled at 2 fps: a temporal group is 1 s, so Qwen3-Omni's video positions
    # (transformers keeps them as floats; mmserve floors them, docs/media.md) are integers.
    # The 2.5 s video samples at 1.6 fps, 16.25 positions a group, which the floor changes.
    whole_second_video: bytes


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Clips:
    rng = np.random.default_rng(9)
    speech = wav_bytes(signal("speech_like", 16000, 2.3, 1, rng), 16000, "s16")
    mp3 = Encoding("mp3", "mp3", ("-c:a", "libmp3lame", "-b:a", "64k"))
    tone = encode_one(signal("tone", 44100, 0.9, 2, rng), 44100, mp3)
    videos = tmp_path_factory.mktemp("video")
    video = make_video_with_track(videos / "t.mp4", seconds=2.5)
    return Clips(speech, tone, video, make_video(videos / "v.mp4", seconds=2.0))


def qwen2_audio_cases(clips: Clips) -> dict[str, Case]:
    return {
        "one clip": Case(_user(input_audio(clips.speech, "wav"), QUESTION), [clips.speech], []),
        "two clips": Case(
            _user(QUESTION, input_audio(clips.tone, "mp3"), input_audio(clips.speech, "wav")),
            [clips.tone, clips.speech],
            [],
        ),
    }


def qwen2_5_omni_cases(clips: Clips) -> dict[str, Case]:
    """The speech crosses the audio tower's 2 s attention chunk."""
    image = make_image(90, 60, seed=3)
    picture = {"type": "image_url", "image_url": {"url": png_data_url(image)}}
    return {
        "clips beside an image": Case(
            _user(
                input_audio(clips.tone, "mp3"), picture, QUESTION, input_audio(clips.speech, "wav")
            ),
            [clips.tone, clips.speech],
            [image],
        ),
        "a video with its track": Case(
            _user(
                {"type": "video_url", "video_url": {"url": data_url(clips.video, "video/mp4")}},
                QUESTION,
            ),
            [],
            [],
            clips.video,
            track=True,
        ),
    }


def qwen3_omni_moe_cases(clips: Clips) -> dict[str, Case]:
    """Clips of one length: the processor pads a request's clips to its longest before their
    features, where the core takes each clip alone (docs/media.md), which differ at a shorter
    clip's last frames."""
    rng = np.random.default_rng(4)
    hum = wav_bytes(signal("tone", 16000, 2.3, 1, rng), 16000, "s16")
    image = make_image(90, 60, seed=3)
    picture = {"type": "image_url", "image_url": {"url": png_data_url(image)}}
    url = data_url(clips.whole_second_video, "video/mp4")
    video = {"type": "video_url", "video_url": {"url": url}}
    return {
        "clips beside an image": Case(
            _user(input_audio(hum, "wav"), picture, QUESTION, input_audio(clips.speech, "wav")),
            [hum, clips.speech],
            [image],
        ),
        "a clip beside a video": Case(
            _user(input_audio(clips.tone, "mp3"), video, QUESTION),
            [clips.tone],
            [],
            clips.whole_second_video,
        ),
    }


def qwen2_audio_reference(model_path: Path, case: Case) -> tuple[str, int]:
    assert not case.images, "Qwen2-Audio takes no image"
    return test_audio.reference(model_path, case.messages, case.clips)


def omni_reference(model_path: Path, case: Case) -> tuple[str, int]:
    return test_omni.reference(
        model_path, case.messages, case.clips, case.images, case.video, case.track
    )


@dataclass(frozen=True)
class Family:
    cases: Callable[[Clips], dict[str, Case]]
    reference: Callable[[Path, Case], tuple[str, int]]
    """transformers' greedy completion's text, and the processor's prompt length."""


FAMILIES = {
    "qwen2_audio": Family(qwen2_audio_cases, qwen2_audio_reference),
    "qwen2_5_omni": Family(qwen2_5_omni_cases, omni_reference),
    "qwen3_omni_moe": Family(qwen3_omni_moe_cases, omni_reference),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def model_path(request: pytest.FixtureRequest) -> Path:
    return build_tiny_model(request.param)


@pytest.fixture(scope="module")
def preprocessor(model_path: Path) -> ChatPreprocessor:
    return ChatPreprocessor(ServedModel.load(model_path), ChatOptions(policy=MediaPolicy()))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def patterns(nats_url: str, model_path: Path) -> AsyncIterator[Patterns]:
    async with every_pattern(nats_url, model_path) as started:
        yield started


async def test_every_pattern_gives_transformers_tokens_for_audio(
    patterns: Patterns,
    preprocessor: ChatPreprocessor,
    model_path: Path,
    clips: Clips,
) -> None:
    family = FAMILIES[preprocessor.model.spec.family]
    tokenizer = preprocessor.model.tokenizer
    for case_name, case in family.cases(clips).items():
        body = {
            "model": preprocessor.model.name,
            "messages": case.messages,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        if case.track:
            body["mm_processor_kwargs"] = {"use_audio_in_video": True}
        request = msgspec.convert(body, ChatCompletionRequest)
        preprocessor.validate(request)
        expected = family.reference(model_path, case)
        tokens = {}
        for name in PATTERNS:
            planned = await preprocessor.preprocess(
                request, f"{name}-{case_name}", time.time() + 120
            )
            chunks = await patterns.stream(name, planned)
            tokens[name] = completion(chunks)
            assert chunks[-1].usage is not None
            text = tokenizer.decode(tokens[name], skip_special_tokens=True)
            assert (text, chunks[-1].usage.prompt_tokens) == expected, (case_name, name)
        assert all(t == tokens["agg"] for t in tokens.values()), (case_name, tokens)
