"""A video item's options: the checkpoint's video processor settings (`_mm.VideoOptions`), and
the per-request sampling the plan carries (`VideoSampling`) applied to them. The frontend plans
a video with these options and every hop that decodes it builds the same ones from the plan,
so all of them see the same frames."""

from __future__ import annotations

from pathlib import Path

from mmserve import _mm
from mmserve.protocol.pipeline import VideoSampling

# transformers reads a checkpoint's video processor settings from this file, else from the
# image processor's preprocessor_config.json.
VIDEO_CONFIG_FILES = ("video_preprocessor_config.json", "preprocessor_config.json")


def checkpoint_video_options(
    path: Path,
    *,
    family: str,
    max_duration_s: float | None = None,
    max_frames_decoded: int | None = None,
    max_pixels_per_frame: int | None = None,
    max_tokens: int | None = None,
) -> _mm.VideoOptions:
    """The video options of the checkpoint at `path`, as `family`'s (its model type)
    transformers video processor reads them, with the caps a video's headers must meet (None:
    the core's defaults)."""
    config = next((path / name for name in VIDEO_CONFIG_FILES if (path / name).exists()), None)
    if config is None:
        raise FileNotFoundError(f"{path} has no {' or '.join(VIDEO_CONFIG_FILES)}")
    return _mm.VideoOptions.from_hf_config(
        config.read_text(),
        family=family,
        max_duration_s=max_duration_s,
        max_frames_decoded=max_frames_decoded,
        max_pixels_per_frame=max_pixels_per_frame,
        max_tokens=max_tokens,
    )


def video_options(base: _mm.VideoOptions, sampling: VideoSampling) -> _mm.VideoOptions:
    """`base` (the checkpoint's options) sampled and sized as a planned item says."""
    return base.with_sampling(
        fps=sampling.fps,
        num_frames=sampling.num_frames,
        min_frames=sampling.min_frames,
        max_frames=sampling.max_frames,
        min_pixels=sampling.min_pixels,
        max_pixels=sampling.max_pixels,
        use_audio_in_video=sampling.use_audio_in_video,
    )


def sampling_of(options: _mm.VideoOptions) -> VideoSampling:
    """The sampling and sizing `options` apply, as a plan carries them."""
    return VideoSampling(
        fps=options.fps,
        num_frames=options.num_frames,
        min_frames=options.min_frames,
        max_frames=options.max_frames,
        min_pixels=options.min_pixels,
        max_pixels=options.max_pixels,
        use_audio_in_video=options.use_audio_in_video,
    )
