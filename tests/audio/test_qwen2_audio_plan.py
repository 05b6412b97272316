"""Qwen2-Audio's plan against its processor: the frontend's expanded ids equal
`Qwen2AudioProcessor`'s for clips in several formats, rates and channel counts, from a tenth
of a second to past the 30 s chunk (cut there, as the processor cuts it), counted without
features; the plan's identity is the encoder's; a clip too short for one token is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmserve import _mm, media
from mmserve.media import MediaPolicy
from mmserve.models.family import resolve_model_spec
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.audio import ENCODINGS, encode_one, signal, torchcodec_samples, wav_bytes

RATE = 16000
# (seconds, rate, channels, encoding name or a WAV sample format)
CLIPS = [
    (0.1, 16000, 1, "s16"),
    (0.37, 8000, 2, "s16"),
    (2.3, 44100, 1, "mp3_cbr"),
    (3.1, 48000, 2, "ogg_opus"),
    (4.4, 16000, 1, "flac"),
    (5.0, 22050, 1, "m4a_aac"),
    (29.99, 16000, 1, "f32"),
    (30.0, 16000, 1, "s16"),
    (41.5, 24000, 1, "webm_opus"),
]


@pytest.fixture(scope="module")
def model() -> tuple[Path, Any, Any]:
    import transformers

    path = build_tiny_model("qwen2_audio")
    return path, resolve_model_spec(path), transformers.AutoProcessor.from_pretrained(path)


def _clip(seconds: float, rate: int, channels: int, kind: str, seed: int) -> bytes:
    samples = signal("speech_like", rate, seconds, channels, np.random.default_rng(seed))
    if kind in ("s16", "f32"):
        return wav_bytes(samples, rate, kind)
    encoding = next(e for e in ENCODINGS if e.name == kind)
    return encode_one(samples, rate, encoding)


def _prompt(processor: Any, clips: int) -> str:
    content = [{"type": "audio"}] * clips + [{"type": "text", "text": "Describe."}]
    messages = [{"role": "user", "content": content}]
    text: str = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text


def test_expanded_ids_equal_the_processor_s(model: tuple[Path, Any, Any]) -> None:
    _, spec, processor = model
    clips = [_clip(*clip, seed=i) for i, clip in enumerate(CLIPS)]
    extractor = spec.core.audio_extractor
    assert extractor is not None
    # Two at a time, as a request with two clips: each pair's prompt against the processor's.
    for first, second in zip(clips[::2], clips[1::2] + clips[:1], strict=True):
        text = _prompt(processor, 2)
        ids = processor.tokenizer(text)["input_ids"]
        audio = [torchcodec_samples(clip, RATE) for clip in (first, second)]
        expected = processor(text=text, audio=audio, sampling_rate=RATE)["input_ids"][0]
        planned = media.plan_request_here(
            spec.core,
            ids,
            [first, second],
            MediaPolicy(),
            count_only=True,
            modalities=["audio", "audio"],
        )
        assert planned.plan.token_ids == list(expected)
        for item, clip, samples in zip(planned.plan.media, (first, second), audio, strict=True):
            assert item.mm_hash == extractor.identity(clip)
            kept = min(len(samples), 30 * RATE)
            assert item.grid_thw == (1, 1, -(-kept // 160))


def test_a_clip_too_short_for_a_token_is_refused(model: tuple[Path, Any, Any]) -> None:
    _, spec, processor = model
    ids = processor.tokenizer(_prompt(processor, 1))["input_ids"]
    short = wav_bytes(np.zeros((320, 1), np.float32), RATE, "s16")
    with pytest.raises(_mm.MediaError) as refused:
        media.plan_request_here(
            spec.core, ids, [short], MediaPolicy(), count_only=True, modalities=["audio"]
        )
    assert refused.value.args[0] == "audio.too_short"
    # 321 samples make three frames, the first token.
    enough = wav_bytes(np.zeros((321, 1), np.float32), RATE, "s16")
    planned = media.plan_request_here(
        spec.core, ids, [enough], MediaPolicy(), count_only=True, modalities=["audio"]
    )
    assert [item.length for item in planned.plan.media] == [1]
