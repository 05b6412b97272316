"""Qwen3-Omni-MoE's thinker in the Rust core, against transformers: the registry reads the
composite config (the thinker's inside it, the real checkpoint's ids), a clip's tokens follow
`_get_feat_extract_output_lengths`, its features and valid frames equal
`WhisperFeatureExtractor`'s as `Qwen3OmniMoeProcessor` calls it (`padding=True,
truncation=False`), and a clip too short to reflect is refused when planned. The frontend's ids
and positions against the processor and `get_rope_index` are in
`test_qwen3_omni_moe_plan.py`."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    _get_feat_extract_output_lengths,
)

from mmserve import _mm
from tests.support.audio import signal, wav_bytes

RATE = 16000
AUDIO, AUDIO_START, AUDIO_END = 151675, 151669, 151670
IMAGE, VIDEO, VISION_START, VISION_END = 151655, 151656, 151652, 151653

# Qwen3-Omni-30B-A3B-Instruct's preprocessor (the image processor's and the extractor's keys).
PREPROCESSOR: dict[str, Any] = {
    "feature_extractor_type": "WhisperFeatureExtractor",
    "image_processor_type": "Qwen2VLImageProcessor",
    "feature_size": 128,
    "sampling_rate": RATE,
    "hop_length": 160,
    "n_fft": 400,
    "chunk_length": 300,
    "n_samples": 4800000,
    "padding_value": 0.0,
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
# Its thinker's ids and sub-configs.
THINKER: dict[str, Any] = {
    "model_type": "qwen3_omni_moe_thinker",
    "audio_token_id": AUDIO,
    "image_token_id": IMAGE,
    "video_token_id": VIDEO,
    "audio_start_token_id": AUDIO_START,
    "audio_end_token_id": AUDIO_END,
    "vision_start_token_id": VISION_START,
    "vision_end_token_id": VISION_END,
    "position_id_per_seconds": 13,
    "audio_config": {
        "num_mel_bins": 128,
        "n_window": 50,
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "d_model": 64,
        "output_dim": 64,
    },
    "vision_config": {
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "deepstack_visual_indexes": [0],
        "depth": 1,
        "hidden_size": 32,
        "num_heads": 2,
        "intermediate_size": 64,
    },
    "text_config": {
        "vocab_size": 152064,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "num_experts": 2,
        "num_experts_per_tok": 1,
    },
}
CONFIG = {"model_type": "qwen3_omni_moe", "thinker_config": THINKER, "talker_config": {}}


@pytest.fixture(scope="module")
def checkpoint() -> _mm.Checkpoint:
    return _mm.Checkpoint.from_hf_configs(json.dumps(PREPROCESSOR), json.dumps(CONFIG))


def test_the_registry_reads_the_thinker_of_the_composite_config(
    checkpoint: _mm.Checkpoint,
) -> None:
    spec = checkpoint.spec
    assert spec.family == "qwen3_omni_moe"
    assert (spec.image_token_id, spec.video_token_id, spec.audio_token_id) == (IMAGE, VIDEO, AUDIO)
    assert (spec.patch_size, spec.merge_size, spec.image_mean) == (16, 2, (0.5, 0.5, 0.5))
    assert spec.rope == "mrope" and spec.takes_video
    assert not spec.audio_in_video
    assert checkpoint.vocab_size == 152064
    assert checkpoint.deepstack_layers == 1
    extractor = spec.audio_extractor
    assert extractor is not None and extractor.max_samples is None


def test_a_clips_tokens_follow_get_feat_extract_output_lengths(
    checkpoint: _mm.Checkpoint,
) -> None:
    frames = [1, 2, 99, 100, 101, 199, 200, 250, 3000, 30001, *range(0, 700)]
    expected = _get_feat_extract_output_lengths(torch.tensor(frames), 50).tolist()
    assert [checkpoint.spec.audio_tokens(f) for f in frames] == expected
    assert checkpoint.spec.audio_tokens(100) == 13


@pytest.mark.parametrize("samples", [1600, 1601, 1759, 16000, 48007, 35 * RATE])
def test_unpadded_features_and_valid_frames_equal_the_extractor(
    checkpoint: _mm.Checkpoint, samples: int
) -> None:
    """The extractor as the processor calls it (`padding=True, truncation=False`): a clip
    whose length is or is not a multiple of the hop, and one past Whisper's 30 s."""
    extractor = checkpoint.spec.audio_extractor
    assert extractor is not None
    rng = np.random.default_rng(samples)
    # Broadband (the extractor's own float32 rounding stays inside 1e-5 there).
    clip = signal("noise", RATE, samples / RATE, 1, rng)[:samples, 0]
    assert len(clip) == samples
    hf = WhisperFeatureExtractor(**PREPROCESSOR)
    out = hf(
        clip,
        sampling_rate=RATE,
        # What Qwen3OmniMoeProcessor passes, though the signature names strings.
        padding=True,  # type: ignore[arg-type]
        truncation=False,
        return_attention_mask=True,
        return_tensors="np",
    )
    expected, mask = out["input_features"][0], int(out["attention_mask"].sum())
    frames, valid = extractor.frames(samples)
    assert (frames, valid) == (expected.shape[1], mask) == (samples // 160, samples // 160)
    features, valid_frames = extractor(clip)
    assert valid_frames == mask
    assert features.shape == expected.shape
    assert np.abs(features - expected).max() <= 1e-5


def test_a_clip_the_extractor_cannot_reflect_is_refused_by_the_plan(
    checkpoint: _mm.Checkpoint,
) -> None:
    """190 samples make one frame (one token by the count) but too few for the extractor's
    reflected padding: refused when planned, not when featurized."""
    spec = checkpoint.spec
    ids = [1, AUDIO_START, AUDIO, AUDIO_END]
    for samples, refused in [(190, True), (200, True), (201, False)]:
        clip = wav_bytes(np.full((samples, 1), 0.1, np.float32), RATE, "s16")
        if refused:
            with pytest.raises(_mm.MediaError) as err:
                _mm.process(spec, ids, [clip], count_only=True, modalities=["audio"])
            assert err.value.args[0] == "audio.too_short"
            assert "fewer than the 201" in err.value.args[1]
        else:
            (item,) = _mm.process(spec, ids, [clip], count_only=True, modalities=["audio"]).items
            assert item.num_tokens == 1
