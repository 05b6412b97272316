"""The operator's multimodal settings and what a request may ask within them: media items per
prompt and modality (vLLM's `--limit-mm-per-prompt`), the pixel bounds images are resized
under (vLLM's `--mm-processor-kwargs`, narrowed per request by `mm_processor_kwargs`), and how
videos are sampled and sized (defaults from the checkpoint's video processor config, then
`--mm-processor-kwargs` / `--media-io-kwargs`; per request `mm_processor_kwargs` /
`media_io_kwargs` within the `--max-video-*` bounds), and Gemma 3's pan-and-scan (the
checkpoint's setting, then `--mm-processor-kwargs`; per request `mm_processor_kwargs` with
at most the server's crops per image)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from mmserve import _mm
from mmserve.frontend.errors import ApiError
from mmserve.media import VideoSettings
from mmserve.media.processing import PanAndScanKnobs, PixelBounds
from mmserve.media.video import checkpoint_video_options, sampling_of
from mmserve.models.family import ModelSpec
from mmserve.protocol import (
    ERROR_INVALID_VALUE,
    ERROR_MIN_PIXELS_OVER_MAX_PIXELS,
    PAN_AND_SCAN_OPTIONS,
    MediaIoKwargs,
    MMProcessorKwargs,
)
from mmserve.protocol.pipeline import VideoSampling

# The sampling rate where neither the checkpoint nor the operator names one: Qwen's own
# (qwen-vl-utils' FPS); transformers' Qwen2-VL processor keeps every frame.
DEFAULT_VIDEO_FPS = 2.0
DEFAULT_MAX_VIDEO_FPS = 30.0

MODALITIES = ("image", "video", "audio")
_SIZE_HINTS = ("width", "height", "num_frames")


def parse_limit_mm_per_prompt(text: str) -> dict[str, int]:
    """`--limit-mm-per-prompt` in vLLM's forms: JSON (`{"image": 4}`, or with size hints
    `{"image": {"count": 4, "width": 512, "height": 512}}`) or `image=4,video=0`. Size hints
    size vLLM's memory profiling; mmserve profiles nothing, so it checks and drops them."""
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise argparse.ArgumentTypeError(f"not valid JSON: {err}") from None
        if not isinstance(raw, dict):
            raise argparse.ArgumentTypeError("expected a JSON object of modality -> count")
        items: list[tuple[str, Any]] = list(raw.items())
    else:
        items = []
        for entry in filter(None, (e.strip() for e in text.split(","))):
            name, sep, value = entry.partition("=")
            if not sep:
                raise argparse.ArgumentTypeError(f"{entry!r}: expected MODALITY=COUNT")
            items.append((name.strip(), _integer(value.strip(), name)))
    return {name: _count(name, value) for name, value in items}


def _integer(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: {text!r} is not a count") from None


def _count(name: str, value: Any) -> int:
    if name not in MODALITIES:
        raise argparse.ArgumentTypeError(
            f"unknown modality {name!r} (known: {', '.join(MODALITIES)})"
        )
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"count", *_SIZE_HINTS})
        hints = [value.get(hint) for hint in _SIZE_HINTS if hint in value]
        if unknown or not all(isinstance(h, int) and h > 0 for h in hints):
            raise argparse.ArgumentTypeError(
                f"{name}: expected {{'count': N}} with optional positive {', '.join(_SIZE_HINTS)}"
            )
        value = value.get("count")
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise argparse.ArgumentTypeError(f"{name}: the count must be an integer >= 0")
    return value


def check_media_counts(limits: dict[str, int], counts: dict[str, int]) -> None:
    """Refuses a request with more items of a modality than `--limit-mm-per-prompt` allows
    (before anything is fetched)."""
    for modality, count in counts.items():
        limit = limits.get(modality)
        if limit is not None and count > limit:
            allowed = f"at most {limit}" if limit else "none"
            raise ApiError(
                "request.too_many_items",
                f"the request has {count} {modality} item(s); this server accepts {allowed} "
                "per prompt (--limit-mm-per-prompt)",
                param="messages",
            )


@dataclass(frozen=True)
class PixelRange:
    """The pixel bounds the operator allows: the model's preprocessor_config, narrowed by
    `--mm-processor-kwargs`; a request may narrow them further."""

    min_pixels: int
    max_pixels: int
    model: PixelBounds  # the checkpoint's own bounds

    @classmethod
    def of(cls, spec: ModelSpec, operator: MMProcessorKwargs | None = None) -> PixelRange:
        model = (spec.min_pixels, spec.max_pixels)
        if operator is None:
            return cls(*model, model=model)
        low = operator.min_pixels or spec.min_pixels
        high = operator.max_pixels or spec.max_pixels
        if not spec.min_pixels <= low <= high <= spec.max_pixels:
            raise ValueError(
                f"--mm-processor-kwargs: min_pixels {low} and max_pixels {high} must satisfy "
                f"{spec.min_pixels} <= min_pixels <= max_pixels <= {spec.max_pixels} (the "
                "model's preprocessor_config)"
            )
        return cls(low, high, model=model)

    def bounds(self, asked: MMProcessorKwargs | None) -> PixelBounds | None:
        """The bounds a request's images are resized under; None where they are the model's
        own (the items keep their plain content identity)."""
        low, high = self.min_pixels, self.max_pixels
        if asked is not None:
            for name, value in (("min_pixels", asked.min_pixels), ("max_pixels", asked.max_pixels)):
                if value is not None and not low <= value <= high:
                    raise ApiError(
                        ERROR_INVALID_VALUE,
                        f"mm_processor_kwargs.{name} must lie in [{low}, {high}], the pixel "
                        "bounds of this server",
                        param=f"mm_processor_kwargs.{name}",
                    )
            low = asked.min_pixels or low
            high = asked.max_pixels or high
            if low > high:
                raise ApiError(
                    ERROR_MIN_PIXELS_OVER_MAX_PIXELS,
                    f"mm_processor_kwargs: min_pixels ({low}) must not exceed max_pixels ({high})",
                    param="mm_processor_kwargs.min_pixels",
                )
        return None if (low, high) == self.model else (low, high)


_VIDEO_OPTIONS = ("fps", "num_frames", "min_frames", "max_frames")
_RATES = ("fps", "num_frames")


def asks_video_options(asked: MMProcessorKwargs | None, io: MediaIoKwargs | None) -> bool:
    """Whether a request sets any video-only sampling option."""
    return io is not None or (
        asked is not None and any(getattr(asked, name) is not None for name in _VIDEO_OPTIONS)
    )


def _asked_sampling(
    kwargs: MMProcessorKwargs | None,
    io: MediaIoKwargs | None,
    names: tuple[str, ...],
    where: tuple[str, str],
) -> dict[str, tuple[Any, str]]:
    """The video options `kwargs` (the `names` of them) and `io` set: name -> (value, where
    it was set). `io`'s rate must agree with `kwargs`', and fps and num_frames exclude each
    other."""
    asked: dict[str, tuple[Any, str]] = {}
    for name in names:
        value = getattr(kwargs, name) if kwargs is not None else None
        if value is not None:
            asked[name] = (value, f"{where[0]}.{name}")
    video = io.video if io is not None else None
    for name in _RATES:
        value = getattr(video, name) if video is not None else None
        if value is None:
            continue
        param = f"{where[1]}.video.{name}"
        if name in asked and asked[name][0] != value:
            other_value, other = asked[name]
            raise ApiError(
                "video.bad_sampling",
                f"{param} ({value}) and {other} ({other_value}) disagree; set one of them",
                param=param,
            )
        asked.setdefault(name, (value, param))
    if "fps" in asked and "num_frames" in asked:
        raise ApiError(
            "video.bad_sampling",
            f"{asked['fps'][1]} and {asked['num_frames'][1]} exclude each other: sample by "
            "fps or by num_frames",
            param=asked["num_frames"][1],
        )
    return asked


def _with(default: VideoSampling, asked: dict[str, tuple[Any, str]]) -> VideoSampling:
    """`default` with the asked options; a rate asked replaces the default's rate."""
    fields = msgspec.structs.asdict(default)
    if any(name in asked for name in _RATES):
        fields |= dict.fromkeys(_RATES)
    fields |= {name: value for name, (value, _) in asked.items()}
    return VideoSampling(**fields)


@dataclass(frozen=True)
class VideoCaps:
    """The operator's bounds on videos (the `--max-video-*` flags): what requests may ask
    (`max_fps`, `max_frames` sampled), and what a video's headers may show (checked before
    anything is decoded; None: the core's defaults, or no cap on tokens)."""

    max_fps: float = DEFAULT_MAX_VIDEO_FPS
    max_frames: int | None = None  # None: the checkpoint's max_frames
    max_duration_s: float | None = None
    max_total_frames: int | None = None
    max_frame_pixels: int | None = None
    max_tokens: int | None = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("video bounds")
        group.add_argument(
            "--max-video-fps",
            type=float,
            default=DEFAULT_MAX_VIDEO_FPS,
            metavar="FPS",
            help="highest sampling rate a request may ask (mm_processor_kwargs.fps, "
            f"media_io_kwargs.video.fps) (default: {DEFAULT_MAX_VIDEO_FPS:g})",
        )
        group.add_argument(
            "--max-video-frames",
            type=int,
            default=None,
            metavar="N",
            help="most frames sampled from one video: the bound of a request's num_frames, "
            "min_frames and max_frames, and the default max_frames (default: the "
            "checkpoint's max_frames)",
        )
        group.add_argument(
            "--max-video-duration",
            type=float,
            default=None,
            metavar="SECONDS",
            help="longest video accepted, by its headers (default: 3600)",
        )
        group.add_argument(
            "--max-video-total-frames",
            type=int,
            default=None,
            metavar="N",
            help="most frames a video file may hold, by its headers (default: 216000)",
        )
        group.add_argument(
            "--max-video-frame-pixels",
            type=int,
            default=None,
            metavar="PIXELS",
            help="most pixels per frame of a video as stored, by its headers (default: 8192x8192)",
        )
        group.add_argument(
            "--max-video-tokens",
            type=int,
            default=None,
            metavar="N",
            help="most prompt tokens one video may take (default: no cap beyond the frame "
            "bounds and the context length)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> VideoCaps:
        return cls(
            max_fps=args.max_video_fps,
            max_frames=args.max_video_frames,
            max_duration_s=args.max_video_duration,
            max_total_frames=args.max_video_total_frames,
            max_frame_pixels=args.max_video_frame_pixels,
            max_tokens=args.max_video_tokens,
        )


@dataclass(frozen=True)
class VideoRange:
    """How videos are sampled and sized: the operator's default, and the bounds a request's
    options must lie in (`fps` at most `max_fps`; `num_frames`, `min_frames` and `max_frames`
    at most `max_frames`; per-frame pixels within the checkpoint's video bounds)."""

    base: _mm.VideoOptions  # the checkpoint's options, with the caps on a video's headers
    default: VideoSampling
    max_fps: float
    max_frames: int

    @classmethod
    def of(
        cls,
        spec: ModelSpec,
        operator: MMProcessorKwargs | None = None,
        io: MediaIoKwargs | None = None,
        caps: VideoCaps | None = None,
    ) -> VideoRange:
        """The range for a checkpoint: its video processor's sampling, else
        `DEFAULT_VIDEO_FPS`; `operator` and `io` (the flags) override the rate and frame
        counts, within `caps`."""
        caps = caps or VideoCaps()
        max_fps, max_frames = caps.max_fps, caps.max_frames
        base = checkpoint_video_options(
            spec.path,
            family=spec.core.family,
            max_duration_s=caps.max_duration_s,
            max_frames_decoded=caps.max_total_frames,
            max_pixels_per_frame=caps.max_frame_pixels,
            max_tokens=caps.max_tokens,
        )
        checkpoint = sampling_of(base)
        if checkpoint.fps is None and checkpoint.num_frames is None:
            checkpoint = msgspec.structs.replace(checkpoint, fps=DEFAULT_VIDEO_FPS)
        limit = checkpoint.max_frames if max_frames is None else max_frames
        checkpoint = msgspec.structs.replace(
            checkpoint, max_frames=min(checkpoint.max_frames, limit)
        )
        video = cls(base=base, default=checkpoint, max_fps=max_fps, max_frames=limit)
        try:
            asked = _asked_sampling(
                operator, io, _VIDEO_OPTIONS, ("--mm-processor-kwargs", "--media-io-kwargs")
            )
            default = video._checked(_with(checkpoint, asked), asked)
        except ApiError as err:
            raise ValueError(
                f"{err.message} (bounds: --max-video-fps, --max-video-frames)"
            ) from None
        return cls(base=base, default=default, max_fps=max_fps, max_frames=limit)

    def settings(self, asked: MMProcessorKwargs | None, io: MediaIoKwargs | None) -> VideoSettings:
        """How a request's videos are planned: the default with the request's options."""
        options = _asked_sampling(
            asked,
            io,
            (*_VIDEO_OPTIONS, "min_pixels", "max_pixels"),
            ("mm_processor_kwargs", "media_io_kwargs"),
        )
        sampling = self._checked(_with(self.default, options), options)
        if asked is not None and asked.use_audio_in_video:
            sampling = msgspec.structs.replace(sampling, use_audio_in_video=True)
        return VideoSettings(base=self.base, sampling=sampling)

    def _checked(self, sampling: VideoSampling, asked: dict[str, tuple[Any, str]]) -> VideoSampling:
        """`sampling`, once each `asked` value lies in its bounds and the minima are not
        above the maxima."""
        pixels = (self.base.min_pixels, self.base.max_pixels)
        bounds = {
            "fps": (0.0, self.max_fps),
            "num_frames": (1, self.max_frames),
            "min_frames": (1, self.max_frames),
            "max_frames": (1, self.max_frames),
            "min_pixels": pixels,
            "max_pixels": pixels,
        }
        for name, (value, param) in asked.items():
            low, high = bounds[name]
            if not low <= value <= high:
                raise ApiError(
                    ERROR_INVALID_VALUE,
                    f"{param} must lie in [{low:g}, {high:g}], this server's video bounds",
                    param=param,
                )
        for least, most in (("min_frames", "max_frames"), ("min_pixels", "max_pixels")):
            if getattr(sampling, least) > getattr(sampling, most):
                param = asked.get(least, asked.get(most, (None, least)))[1]
                raise ApiError(
                    "video.bad_sampling",
                    f"{least} ({getattr(sampling, least)}) must not exceed {most} "
                    f"({getattr(sampling, most)})",
                    param=param,
                )
        return sampling


@dataclass(frozen=True)
class PanAndScanRange:
    """Gemma 3's pan-and-scan as the server runs it: on or off and its knobs (the
    checkpoint's preprocessor config, else the processor's defaults, then
    `--mm-processor-kwargs`); a request may turn it on or off and set the knobs, with at
    most `max_num_crops` crops per image (the server's own). A family that cannot pan and
    scan (`knobs` None) ignores the options, as one without video ignores the video
    options."""

    enabled: bool
    knobs: PanAndScanKnobs | None
    max_num_crops: int

    @property
    def supported(self) -> bool:
        return self.knobs is not None

    @classmethod
    def of(cls, spec: ModelSpec, operator: MMProcessorKwargs | None = None) -> PanAndScanRange:
        """The range of a checkpoint whose family can pan and scan; refuses (ValueError) a
        family that cannot, when `operator` sets a pan-and-scan option."""
        model = spec.core.pan_and_scan
        if model is None:
            if operator is not None and _asks_pan_and_scan(operator):
                raise ValueError(f"--mm-processor-kwargs: {spec.family} does not pan and scan")
            return cls(enabled=False, knobs=None, max_num_crops=0)
        enabled = spec.core.do_pan_and_scan
        if operator is not None and operator.do_pan_and_scan is not None:
            enabled = operator.do_pan_and_scan
        knobs = _with_knobs(model, operator)
        return cls(enabled=enabled, knobs=knobs, max_num_crops=knobs[1])

    def knobs_for(self, asked: MMProcessorKwargs | None) -> PanAndScanKnobs | None:
        """The knobs a request's images are cropped by (None: not cropped): the server's,
        with the request's options; a request's max crops over the server's is refused."""
        if self.knobs is None:
            return None
        if asked is not None:
            crops = asked.pan_and_scan_max_num_crops
            if crops is not None and crops > self.max_num_crops:
                raise ApiError(
                    ERROR_INVALID_VALUE,
                    "mm_processor_kwargs.pan_and_scan_max_num_crops must lie in "
                    f"[1, {self.max_num_crops}], the crops per image of this server",
                    param="mm_processor_kwargs.pan_and_scan_max_num_crops",
                )
        enabled = self.enabled
        if asked is not None and asked.do_pan_and_scan is not None:
            enabled = asked.do_pan_and_scan
        return _with_knobs(self.knobs, asked) if enabled else None


def _asks_pan_and_scan(kwargs: MMProcessorKwargs) -> bool:
    return any(getattr(kwargs, name) is not None for name in PAN_AND_SCAN_OPTIONS)


def _with_knobs(knobs: PanAndScanKnobs, kwargs: MMProcessorKwargs | None) -> PanAndScanKnobs:
    """`knobs` with those `kwargs` sets."""
    if kwargs is None:
        return knobs
    min_crop, max_crops, min_ratio = knobs
    return (
        kwargs.pan_and_scan_min_crop_size or min_crop,
        kwargs.pan_and_scan_max_num_crops or max_crops,
        min_ratio
        if kwargs.pan_and_scan_min_ratio_to_activate is None
        else kwargs.pan_and_scan_min_ratio_to_activate,
    )


T = TypeVar("T")


def _json_flag(text: str, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(text, type=kind)
    except msgspec.ValidationError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    except msgspec.DecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON: {err}") from None


def parse_mm_processor_kwargs(text: str) -> MMProcessorKwargs:
    """`--mm-processor-kwargs` JSON: `{"min_pixels": N, "max_pixels": M}` for images,
    `fps` or `num_frames`, `min_frames`, `max_frames` for videos, and Gemma 3's
    `do_pan_and_scan` and `pan_and_scan_*` knobs."""
    return _json_flag(text, MMProcessorKwargs)


def parse_media_io_kwargs(text: str) -> MediaIoKwargs:
    """`--media-io-kwargs` JSON: `{"video": {"fps": F}}` or `{"video": {"num_frames": N}}`."""
    return _json_flag(text, MediaIoKwargs)
