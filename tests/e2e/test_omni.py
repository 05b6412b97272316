"""Qwen2.5-Omni's thinker end to end on its tiny checkpoint: the aggregated worker and encode /
prefill / decode apart give transformers' greedy tokens (the thinker's `generate` on its
processor's inputs), through the official openai client, streamed and not, for a clip alone,
clips beside an image, a clip beside a video (its audio tower's chunked attention, its vision
tower, TMRoPE), and a video served with its own audio track (`use_audio_in_video`); a silent
video under that option is refused naming its part. One pair of deployments."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from mmserve.tiny.checkpoints import build_tiny_model
from tests.e2e.test_audio import _complete, _refusal, _stream, _user, input_audio
from tests.support.audio import signal, torchcodec_samples, wav_bytes
from tests.support.deployment import Deployment, all_running
from tests.support.engines import make_image
from tests.support.images import data_url, png_data_url
from tests.support.video import make_video, make_video_with_track, sampled_frames

MAX_TOKENS = 8
PATTERNS = ("agg", "e_p_d")


@pytest.fixture(scope="module")
def model_path() -> Path:
    return build_tiny_model("qwen2_5_omni")


@pytest.fixture(scope="module")
def clients(
    model_path: Path, nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, openai.OpenAI]]:
    """An openai client of each pattern's frontend, both deployments running."""
    log_dir = tmp_path_factory.mktemp("omni-logs")
    deployments = [Deployment(p, model_path, nats_url, log_dir) for p in PATTERNS]
    with all_running(deployments):
        yield {
            d.pattern: openai.OpenAI(base_url=f"{d.base_url}/v1", api_key="unused", max_retries=0)
            for d in deployments
        }


@functools.lru_cache(maxsize=1)  # a processor's tokenizer holds 120 MB
def _reference_model(model_path: Path) -> tuple[Any, Any]:
    import transformers

    from mmserve.models.family import load_model

    processor = transformers.AutoProcessor.from_pretrained(model_path)
    family = transformers.AutoConfig.from_pretrained(model_path).model_type
    return processor, load_model(family, model_path).eval()


def reference(
    model_path: Path,
    messages: list[dict[str, Any]],
    clips: list[bytes],
    images: list[Any],
    video: bytes | None = None,
    use_audio_in_video: bool = False,
) -> tuple[str, int]:
    """The thinker's greedy completion on the processor's inputs (each clip loaded as
    transformers loads audio, a video's frames as the core samples them; with
    `use_audio_in_video`, its track loaded as a clip and given as the video's audio, after the
    clips): its text and prompt length."""
    import torch

    processor, thinker = _reference_model(model_path)
    kinds = {
        "input_audio": {"type": "audio"},
        "image_url": {"type": "image"},
        "video_url": {"type": "video"},
    }
    template = [
        {"role": m["role"], "content": [kinds.get(p["type"], p) for p in m["content"]]}
        for m in messages
    ]
    text = processor.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    audio = [torchcodec_samples(clip, 16000) for clip in clips]
    videos: dict[str, Any] = {}
    if use_audio_in_video:
        assert video is not None
        audio.append(torchcodec_samples(video, 16000))
        videos["audio_from_video_indices"] = [None] * len(clips) + [0]
        videos["use_audio_in_video"] = True
    if video is not None:
        frames, metadata, fps = sampled_frames(video, _default_video_settings(model_path))
        sampling = _default_video_settings(model_path).sampling
        size = {"shortest_edge": sampling.min_pixels, "longest_edge": sampling.max_pixels}
        videos |= {
            "videos": [frames],
            "video_metadata": [metadata],
            "do_sample_frames": False,
            "videos_kwargs": {"fps": fps, "size": size},
            "input_data_format": "channels_last",
        }
    inputs = processor(
        text=text, audio=audio or None, images=images or None, return_tensors="pt", **videos
    )
    with torch.inference_mode():
        out = thinker.generate(
            **inputs,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            use_audio_in_video=use_audio_in_video,
        )
    prompt = inputs["input_ids"].shape[1]
    return processor.tokenizer.decode(out[0, prompt:], skip_special_tokens=True), prompt


@functools.cache
def _default_video_settings(model_path: Path) -> Any:
    """How the frontend samples a video by default."""
    from mmserve.frontend.chat import ChatOptions, ChatPreprocessor, ServedModel
    from mmserve.media import MediaPolicy

    preprocessor = ChatPreprocessor(ServedModel.load(model_path), ChatOptions(policy=MediaPolicy()))
    assert preprocessor.video_range is not None
    return preprocessor.video_range.settings(None, None)


def test_each_pattern_gives_the_thinkers_tokens(
    clients: dict[str, openai.OpenAI], model_path: Path, tmp_path: Path
) -> None:
    rng = np.random.default_rng(5)
    # Past the tower's 200-frame attention chunk (2 s), so its chunking is crossed.
    speech = wav_bytes(signal("speech_like", 16000, 4.3, 1, rng), 16000, "s16")
    tone = wav_bytes(signal("tone", 22050, 0.9, 2, rng), 22050, "s16")
    image = make_image(90, 60, seed=3)
    question = {"type": "text", "text": "What do you hear and see?"}
    one = _user(input_audio(speech, "wav"), question)
    mixed = _user(
        input_audio(tone, "wav"),
        {"type": "image_url", "image_url": {"url": png_data_url(image)}},
        question,
        input_audio(speech, "wav"),
    )
    video = make_video(tmp_path / "v.mp4", size="96x64", rate="10", seconds=2.0)
    watched = _user(
        input_audio(tone, "wav"),
        {"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}},
        question,
    )
    expected = {
        "one": reference(model_path, one, [speech], []),
        "mixed": reference(model_path, mixed, [tone, speech], [image]),
        "watched": reference(model_path, watched, [tone], [], video),
    }
    # The clip moves the tokens: a served prompt that lost it would not pass.
    other = _user(input_audio(tone, "wav"), question)
    assert reference(model_path, other, [tone], [])[0] != expected["one"][0]
    name = model_path.name
    for pattern, client in clients.items():
        assert _complete(client, name, one) == expected["one"], pattern
        assert _complete(client, name, mixed) == expected["mixed"], pattern
        assert _stream(client, name, mixed) == expected["mixed"][0], pattern
        assert _complete(client, name, watched) == expected["watched"], pattern


def test_a_videos_own_audio_track_gives_the_thinkers_tokens(
    clients: dict[str, openai.OpenAI], model_path: Path, tmp_path: Path
) -> None:
    """`use_audio_in_video`: a 3 s video's frames and its track interleaved (the track
    crosses a 2 s chunk) give `generate(..., use_audio_in_video=True)`'s tokens in each
    pattern; a silent video under the option is refused naming its part."""
    video = make_video_with_track(tmp_path / "t.mp4", seconds=3.0)
    watched = _user(
        {"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}},
        {"type": "text", "text": "What do you hear and see?"},
    )
    expected = reference(model_path, watched, [], [], video, use_audio_in_video=True)
    # The track moves the tokens: a served prompt that lost it would not pass.
    assert reference(model_path, watched, [], [], video)[0] != expected[0]
    option = {"mm_processor_kwargs": {"use_audio_in_video": True}}
    name = model_path.name
    for pattern, client in clients.items():
        response = client.chat.completions.create(
            model=name,
            messages=watched,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body=option,
        )
        assert response.usage is not None
        got = (response.choices[0].message.content, response.usage.prompt_tokens)
        assert got == expected, pattern
    silent = make_video(tmp_path / "s.mp4", seconds=1.0)
    silent_part = {"type": "video_url", "video_url": {"url": data_url(silent, "video/mp4")}}
    with pytest.raises(openai.BadRequestError) as caught:
        clients["agg"].chat.completions.create(
            model=name,
            messages=_user(silent_part),  # type: ignore[arg-type]
            max_tokens=1,
            extra_body=option,
        )
    assert caught.value.code == "audio.no_audio_stream"
    assert caught.value.param == "messages[0].content[0].video_url"
    assert _refusal(clients["agg"], name, _user(input_audio(b"x" * 64, "wav")))[0] == 400
