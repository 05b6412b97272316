"""The Rust core's video path against the references: FFmpeg's own conversion for the frames,
transformers' Qwen2-VL video processor for the sampling and the model inputs, and the stable
codes for what is refused. Videos are made here with the `ffmpeg` program."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.video_utils import VideoMetadata

from mmserve import _mm
from tests.support.video import FFMPEG, make_video

pytestmark = pytest.mark.skipif(FFMPEG is None, reason="needs the ffmpeg program (make setup)")


def ffmpeg_rgb(path: Path, width: int, height: int) -> np.ndarray:
    """Every frame as the ffmpeg program converts it with the same swscale flags."""
    command = [FFMPEG or "ffmpeg", "-v", "error", "-i", str(path), "-f", "rawvideo"]
    command += ["-pix_fmt", "rgb24", "-sws_flags", "bilinear", "-"]
    raw = subprocess.run(command, check=True, capture_output=True).stdout
    return np.frombuffer(raw, np.uint8).reshape(-1, height, width, 3)


SAMPLER = Qwen2VLVideoProcessor()


def media_code(call) -> str:  # type: ignore[no-untyped-def]
    return media_error(call)[0]


def media_error(call) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """(code, message) of the MediaError `call` raises."""
    with pytest.raises(_mm.MediaError) as err:
        call()
    return str(err.value.args[0]), str(err.value.args[1])


@pytest.mark.parametrize(
    "name, codec, size, rate, seconds, pix_fmt",
    [
        ("h264.mp4", "libx264", "96x64", "10", 1.5, "yuv420p"),
        ("h264_444.mp4", "libx264", "64x48", "10", 0.5, "yuv444p"),
        ("h264_422.mov", "libx264", "66x38", "10", 0.5, "yuv422p"),
        ("hevc.mp4", "libx265", "64x48", "10", 0.5, "yuv420p"),
        ("av1.mkv", "libaom-av1", "64x48", "10", 0.5, "yuv420p"),
        ("vp9.webm", "libvpx-vp9", "64x48", "25", 0.6, "yuv420p"),
        ("vp8.webm", "libvpx", "50x34", "30", 0.5, "yuv420p"),
        ("mpeg4.mkv", "mpeg4", "80x60", "24", 0.5, "yuv420p"),
        ("mpeg4.mp4", "mpeg4", "80x60", "24", 0.5, "yuv420p"),
    ],
)
def test_frames_equal_ffmpeg_and_headers_count_them(
    tmp_path: Path, name: str, codec: str, size: str, rate: str, seconds: float, pix_fmt: str
) -> None:
    data = make_video(
        tmp_path / name, size=size, rate=rate, seconds=seconds, codec=codec, pix_fmt=pix_fmt
    )
    width, height = map(int, size.split("x"))
    info = _mm.probe_video(data)
    reference = ffmpeg_rgb(tmp_path / name, width, height)
    assert (info["width"], info["height"]) == (width, height)
    assert info["total_frames"] == len(reference) == round(float(rate) * seconds)
    assert info["fps"] == pytest.approx(float(rate))
    _, frames = _mm.decode_video(data, list(range(info["total_frames"])))
    assert np.array_equal(frames, reference)
    # A subset, with a repeat, decodes to the same frames.
    _, some = _mm.decode_video(data, [0, 2, 2, info["total_frames"] - 1])
    assert np.array_equal(some, reference[[0, 2, 2, -1]])


@pytest.mark.parametrize("total", [1, 2, 3, 5, 7, 16, 29, 30, 31, 97, 300, 1001, 1799, 4000])
@pytest.mark.parametrize("video_fps", [1.0, 10.0, 24.0, 29.97002997002997, 60.0])
def test_sampling_equals_transformers(total: int, video_fps: float) -> None:
    processor = SAMPLER
    metadata = VideoMetadata(total_num_frames=total, fps=video_fps)
    for kwargs in [{"fps": 2.0}, {"fps": 0.5}, {"fps": 7.3}, {"num_frames": 3}, {"num_frames": 8}]:
        try:
            expected = processor.sample_frames(metadata, **kwargs).tolist()
        except (ValueError, ZeroDivisionError):
            with pytest.raises(_mm.MediaError) as err:
                _mm.sample_frame_indices(total, video_fps, **kwargs)
            assert err.value.args[0] == "video.too_few_frames"
            continue
        assert _mm.sample_frame_indices(total, video_fps, **kwargs) == expected, kwargs


def processed_by_transformers(frames: np.ndarray, **kwargs: object) -> tuple[np.ndarray, list]:
    processor = Qwen2VLVideoProcessor(**kwargs)  # type: ignore[arg-type]
    out = processor(
        videos=[torch.from_numpy(frames)],
        do_sample_frames=False,
        input_data_format="channels_last",
        return_tensors="pt",
    )
    return out["pixel_values_videos"].numpy(), out["video_grid_thw"].tolist()


@pytest.mark.parametrize(
    "size, seconds, fps, extra",
    [
        ("96x64", 1.5, 2.0, {}),  # upscaled to the video processor's least pixels
        ("640x360", 1.0, 5.0, {}),  # an odd number of sampled frames: the last one repeats
        ("131x47", 0.8, 4.0, {}),  # an odd aspect ratio
        ("320x240", 1.0, 8.0, {"cap_pixels_per_frame": True, "max_video_tokens": 400}),
    ],
)
def test_model_inputs_equal_transformers(
    tmp_path: Path, size: str, seconds: float, fps: float, extra: dict
) -> None:
    data = make_video(tmp_path / "v.mp4", size=size, rate="10", seconds=seconds)
    info = _mm.probe_video(data)
    indices = _mm.sample_frame_indices(info["total_frames"], info["fps"], fps=fps)
    _, frames = _mm.decode_video(data, indices)
    processor = Qwen2VLVideoProcessor(**extra)
    expected, grid = processed_by_transformers(frames, **{"cap_pixels_per_frame": False, **extra})
    ours, our_grid = _mm.preprocess_video(
        frames,
        min_pixels=processor.size["shortest_edge"],
        max_pixels=processor.size["longest_edge"],
        mean=list(processor.image_mean),
        std=list(processor.image_std),
        cap_pixels_per_frame=bool(extra.get("cap_pixels_per_frame", False)),
        max_video_tokens=processor.max_video_tokens,
    )
    assert [list(our_grid)] == grid
    assert ours.shape == expected.shape
    assert np.array_equal(ours, expected)


def test_refusals_have_stable_codes(tmp_path: Path) -> None:
    good = make_video(tmp_path / "good.mp4", seconds=2.0)
    assert media_code(lambda: _mm.probe_video(b"\x00" * 4096)) == "video.unknown_container"
    command = [FFMPEG or "ffmpeg", "-v", "error", "-f", "lavfi", "-i", "testsrc2=size=16x16"]
    command += ["-frames:v", "1", "-f", "image2pipe", "-c:v", "png", "-"]
    png = subprocess.run(command, check=True, capture_output=True).stdout
    with pytest.raises(_mm.MediaError, match="png"):
        _mm.probe_video(png)
    streams = make_video(tmp_path / "streams.mkv", seconds=0.3, extra=tuple(["-map", "0"] * 20))
    assert media_code(lambda: _mm.probe_video(streams)) == "video.too_many_streams"
    avi = make_video(tmp_path / "v.avi", codec="mpeg4", seconds=0.3)
    assert media_code(lambda: _mm.probe_video(avi)) == "video.unsupported_container"
    mjpeg = make_video(tmp_path / "v.mkv", codec="mjpeg", pix_fmt="yuvj420p", seconds=0.3)
    with pytest.raises(_mm.MediaError, match="mjpeg"):
        _mm.probe_video(mjpeg)
    assert media_code(lambda: _mm.probe_video(mjpeg)) == "video.unsupported_codec"
    # moov at the end: a cut file has no index; the message says what FFmpeg found.
    code, message = media_error(lambda: _mm.probe_video(good[: len(good) // 2]))
    assert code == "video.corrupt"
    assert message.endswith("reading the headers: Invalid data found when processing input")
    assert media_code(lambda: _mm.probe_video(good, max_frames=10)) == "video.too_many_frames"
    assert media_code(lambda: _mm.probe_video(good, max_pixels=1000)) == "video.too_many_pixels"
    assert media_code(lambda: _mm.probe_video(good, max_duration_s=1.0)) == "video.too_long"
    assert media_code(lambda: _mm.decode_video(good, [0], timeout_s=1e-9)) == "video.deadline"
    # The cap holds at the plan's own count and refuses one token less.
    tokens = _mm.plan_video(good, _mm.VideoOptions(fps=2.0))["tokens"]
    capped = _mm.VideoOptions(fps=2.0, max_tokens=tokens - 1)
    assert media_code(lambda: _mm.plan_video(good, capped)) == "video.too_many_tokens"
    assert _mm.plan_video(good, _mm.VideoOptions(fps=2.0, max_tokens=tokens))["tokens"] == tokens
    assert media_code(lambda: _mm.decode_video(good, [0, 99])) == "video.corrupt"
    deep = make_video(tmp_path / "deep.mp4", pix_fmt="yuv420p10le", seconds=0.3)
    assert media_code(lambda: _mm.decode_video(deep, [0])) == "video.unsupported_pixel_format"
    vp9_deep = make_video(
        tmp_path / "deep.webm", codec="libvpx-vp9", pix_fmt="yuv420p10le", seconds=0.3
    )
    assert media_code(lambda: _mm.decode_video(vp9_deep, [0])) == "video.unsupported_pixel_format"


@pytest.mark.parametrize("fps, size", [(2.0, "200x120"), (3.0, "64x300")])
def test_bytes_to_model_inputs_equal_transformers_sampling_and_processing(
    tmp_path: Path, fps: float, size: str
) -> None:
    data = make_video(tmp_path / "v.mp4", size=size, rate="24", seconds=2.0)
    plan, ours = _mm.process_video(data, _mm.VideoOptions(fps=fps))
    info = plan["info"]
    _, every = _mm.decode_video(data, list(range(info["total_frames"])))
    # transformers samples the decoded frames itself, from the same metadata.
    processor = Qwen2VLVideoProcessor(cap_pixels_per_frame=False)
    expected = processor(
        videos=[torch.from_numpy(every)],
        do_sample_frames=True,
        fps=fps,
        video_metadata=[VideoMetadata(total_num_frames=info["total_frames"], fps=info["fps"])],
        input_data_format="channels_last",
        return_tensors="pt",
    )
    assert [list(plan["grid_thw"])] == expected["video_grid_thw"].tolist()
    assert np.array_equal(ours, expected["pixel_values_videos"].numpy())
    assert plan["tokens"] == len(ours) // 4
    # The count-only plan agrees, without decoding.
    assert _mm.plan_video(data, _mm.VideoOptions(fps=fps)) == plan


def test_identity_covers_the_bytes_and_the_sampling(tmp_path: Path) -> None:
    data = make_video(tmp_path / "v.webm", codec="libvpx-vp9", seconds=1.0)
    other = make_video(tmp_path / "w.webm", codec="libvpx-vp9", seconds=1.1)
    hashes = {
        _mm.plan_video(video, options)["mm_hash"]
        for video in (data, other)
        for options in (
            _mm.VideoOptions(fps=2.0),
            _mm.VideoOptions(fps=4.0),
            _mm.VideoOptions(num_frames=4),
            _mm.VideoOptions(fps=2.0, max_pixels=128 * 28 * 28),
        )
    }
    assert len(hashes) == 8
    again = _mm.plan_video(data, _mm.VideoOptions(fps=2.0))["mm_hash"]
    assert again in hashes


@pytest.mark.parametrize(
    "settings",
    [
        {"do_sample_frames": True, "fps": 3.0},
        {"do_sample_frames": True, "num_frames": 6, "max_pixels": 64 * 28 * 28},
        {
            "do_sample_frames": True,
            "fps": 6.0,
            "cap_pixels_per_frame": True,
            "max_video_tokens": 300,
        },
        {"do_sample_frames": False},  # Qwen2-VL's default: every frame
    ],
)
def test_options_from_the_processor_config_equal_the_processor(
    tmp_path: Path, settings: dict
) -> None:
    data = make_video(tmp_path / "v.mp4", size="160x90", rate="12", seconds=1.0)
    processor = Qwen2VLVideoProcessor(**{"cap_pixels_per_frame": False, **settings})
    options = _mm.VideoOptions.from_hf_config(processor.to_json_string())
    plan, ours = _mm.process_video(data, options)
    info = plan["info"]
    _, every = _mm.decode_video(data, list(range(info["total_frames"])))
    expected = processor(
        videos=[torch.from_numpy(every)],
        video_metadata=[VideoMetadata(total_num_frames=info["total_frames"], fps=info["fps"])],
        input_data_format="channels_last",
        return_tensors="pt",
    )
    assert [list(plan["grid_thw"])] == expected["video_grid_thw"].tolist()
    assert np.array_equal(ours, expected["pixel_values_videos"].numpy())


def test_refuses_processor_configs_it_cannot_follow() -> None:
    for config in ['{"do_normalize": false}', '{"resample": 2}', "[]"]:
        with pytest.raises(_mm.MediaError) as err:
            _mm.VideoOptions.from_hf_config(config)
        assert err.value.args[0] in {"spec.invalid", "spec.json"}


@pytest.mark.parametrize(
    "name, codec, rate, extra",
    [
        ("closed_gop_bframes.mp4", "libx264", "25", ("-g", "5", "-bf", "2")),
        ("closed_gop_bframes.mkv", "libx264", "25", ("-g", "7", "-bf", "3")),
        ("open_gop.mkv", "libx264", "25", ("-x264-params", "keyint=6:min-keyint=6:open-gop=1")),
        ("hevc_cra.mp4", "libx265", "24", ("-x265-params", "keyint=6:min-keyint=6:bframes=3")),
        ("vp9.webm", "libvpx-vp9", "30", ("-g", "5", "-deadline", "realtime")),
        (
            "vp8.webm",
            "libvpx",
            "30",
            (
                "-g",
                "4",
            ),
        ),
        (
            "av1.mp4",
            "libaom-av1",
            "20",
            (
                "-g",
                "5",
            ),
        ),
        ("mpeg4.mkv", "mpeg4", "24", ("-g", "5", "-bf", "2")),
        ("no_keyframes_after_the_first.mp4", "libx264", "25", ("-g", "1000", "-bf", "2")),
    ],
)
def test_sampled_decoding_reads_past_and_skips_to_the_same_frames(
    tmp_path: Path, name: str, codec: str, rate: str, extra: tuple[str, ...]
) -> None:
    """Decoding only what sampled frames need (reading past packets before clean keyframes,
    dropping unsampled non-reference frames) gives exactly the frames of decoding all of
    them."""
    data = make_video(
        tmp_path / name, size="64x48", rate=rate, seconds=2.0, codec=codec, extra=extra
    )
    reference = ffmpeg_rgb(tmp_path / name, 64, 48)
    total = _mm.probe_video(data)["total_frames"]
    assert total == len(reference)
    rng = np.random.default_rng(len(name))
    picks = [
        [total - 1],
        [0, total - 1],
        list(range(1, total, 7)),
        list(range(3, total, 2)),
        sorted(rng.choice(total, size=6, replace=False).tolist() + [total // 2] * 2),
    ]
    for indices in picks:
        _, frames = _mm.decode_video(data, indices)
        assert np.array_equal(frames, reference[indices]), indices


@pytest.mark.parametrize(
    "name, codec, extra",
    [
        ("h264.mp4", "libx264", ("-g", "6", "-bf", "2")),
        ("h264_444.mkv", "libx264", ("-g", "8", "-pix_fmt", "yuv444p")),
        ("hevc.mp4", "libx265", ("-x265-params", "keyint=6:min-keyint=6")),
        ("vp9.webm", "libvpx-vp9", ("-g", "5", "-deadline", "realtime")),
        ("vp8.webm", "libvpx", ("-g", "4")),
        ("av1.mkv", "libaom-av1", ("-g", "5")),
        ("mpeg4.mkv", "mpeg4", ("-g", "5", "-bf", "2")),
        ("mpeg4.mp4", "mpeg4", ("-g", "5", "-bf", "2")),
    ],
)
def test_frames_equal_torchcodec(
    tmp_path: Path, name: str, codec: str, extra: tuple[str, ...]
) -> None:
    """The sampled frames equal torchcodec's (the decoder transformers' video processors
    default to) on the same system FFmpeg, byte for byte."""
    from torchcodec.decoders import VideoDecoder

    data = make_video(
        tmp_path / name, size="80x46", rate="24", seconds=2.0, codec=codec, extra=extra
    )
    info = _mm.probe_video(data)
    for options in [{"fps": 2.0}, {"fps": 7.0}, {"num_frames": 6}]:
        indices = _mm.sample_frame_indices(info["total_frames"], info["fps"], **options)
        _, ours = _mm.decode_video(data, indices)
        decoder = VideoDecoder(data, dimension_order="NHWC", num_ffmpeg_threads=1)
        assert np.array_equal(ours, decoder.get_frames_at(indices).data.numpy()), options


def test_mpeg4_in_mp4_takes_its_size_from_the_vol_header(tmp_path: Path) -> None:
    """mov clears MPEG-4 Part 2's size from the sample entry (libavformat leaves it to the
    decoder); the plan reads it from the VOL header, in the extradata or in-band, without
    decoding, and the frames equal torchcodec's."""
    from torchcodec.decoders import VideoDecoder

    for name, extra in [("global.mp4", ()), ("in_band.mp4", ("-flags", "-global_header"))]:
        data = make_video(
            tmp_path / name,
            size="80x46",
            rate="24",
            seconds=1.0,
            codec="mpeg4",
            extra=("-g", "5", "-bf", "2", *extra),
        )
        metadata = VideoDecoder(data).metadata
        info = _mm.probe_video(data)
        assert (info["width"], info["height"]) == (metadata.width, metadata.height) == (80, 46)
        options = _mm.VideoOptions(fps=7.0)
        plan, _ = _mm.process_video(data, options)
        assert plan == _mm.plan_video(data, options)
        decoder = VideoDecoder(data, dimension_order="NHWC", num_ffmpeg_threads=1)
        _, ours = _mm.decode_video(data, plan["indices"])
        assert np.array_equal(ours, decoder.get_frames_at(plan["indices"]).data.numpy())
    # Without a VOL header (its start code 00 00 01 20 broken where it occurs) there is no
    # size, and the message says so.
    data = (tmp_path / "global.mp4").read_bytes().replace(b"\x00\x00\x01\x20", b"\x00\x00\x01\xff")
    code, message = media_error(lambda: _mm.plan_video(data, _mm.VideoOptions(fps=2.0)))
    assert (code, message.split(": ")[-1]) == (
        "video.corrupt",
        "the video stream has no frame size",
    )


@pytest.mark.parametrize("start_s", ["0.45", "1.05"])
def test_an_mp4_cut_without_reencoding_counts_and_decodes_only_its_shown_frames(
    tmp_path: Path, start_s: str
) -> None:
    """An mp4 cut with `-ss` and `-c copy` keeps the packets from the keyframe before the cut,
    which its edit list marks discarded: the decoder needs them but shows none. The frame
    count leaves them out, as torchcodec's exact mode does, and the sampled frames (decoding
    those packets first) equal torchcodec's and the ffmpeg program's."""
    from torchcodec.decoders import VideoDecoder

    source = tmp_path / "v.mp4"
    make_video(source, size="64x48", rate="10", seconds=3.0, extra=("-g", "10", "-bf", "2"))
    cut = tmp_path / "cut.mp4"
    command = [FFMPEG or "ffmpeg", "-v", "error", "-y", "-ss", start_s, "-i", str(source)]
    subprocess.run([*command, "-c", "copy", str(cut)], check=True)
    data = cut.read_bytes()
    decoder = VideoDecoder(data, dimension_order="NHWC", num_ffmpeg_threads=1)
    reference = ffmpeg_rgb(cut, 64, 48)
    info = _mm.probe_video(data)
    assert info["total_frames"] == decoder.metadata.num_frames == len(reference) < 30
    options = _mm.VideoOptions(fps=4.0)
    plan, _ = _mm.process_video(data, options)
    assert plan == _mm.plan_video(data, options)
    for indices in [plan["indices"], [0], [len(reference) - 1], list(range(len(reference)))]:
        _, ours = _mm.decode_video(data, indices)
        assert np.array_equal(ours, reference[indices]), indices
        assert np.array_equal(ours, decoder.get_frames_at(indices).data.numpy()), indices


@pytest.mark.parametrize("rotate", [90, 180, 270])
def test_rotation_is_applied_as_torchcodec_applies_it(tmp_path: Path, rotate: int) -> None:
    """torchcodec 0.17 turns each frame by the stream's display matrix (quarter turns), so
    the frames, the reported size and the plan follow it."""
    from torchcodec.decoders import VideoDecoder

    make_video(tmp_path / "v.mp4", size="80x46", rate="24", seconds=1.0, extra=("-g", "6"))
    rotated = tmp_path / "rotated.mp4"
    command = [FFMPEG or "ffmpeg", "-v", "error", "-y", "-i", str(tmp_path / "v.mp4")]
    command += ["-c", "copy", "-metadata:s:v", f"rotate={rotate}", str(rotated)]
    subprocess.run(command, check=True)
    data = rotated.read_bytes()
    decoder = VideoDecoder(data, dimension_order="NHWC", num_ffmpeg_threads=1)
    info = _mm.probe_video(data)
    assert info["rotation"] == round(decoder.metadata.rotation) % 360 == rotate
    assert (info["width"], info["height"]) == (decoder.metadata.width, decoder.metadata.height)
    indices = [0, 5, 6, 23]
    _, ours = _mm.decode_video(data, indices)
    expected = decoder.get_frames_at(indices).data.numpy()
    assert np.array_equal(ours, expected)
    # Upright is the source turned: not the unrotated frames.
    _, upright = _mm.decode_video((tmp_path / "v.mp4").read_bytes(), indices)
    assert np.array_equal(np.rot90(upright, k=rotate // 90, axes=(1, 2)), expected)
    plan, _ = _mm.process_video(data, _mm.VideoOptions(fps=4.0))
    assert plan == _mm.plan_video(data, _mm.VideoOptions(fps=4.0))
