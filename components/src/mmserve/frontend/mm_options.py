"""The operator's multimodal settings and what a request may ask within them: media items per
prompt and modality (vLLM's `--limit-mm-per-prompt`), and the pixel bounds images are resized
under (vLLM's `--mm-processor-kwargs`, narrowed per request by `mm_processor_kwargs`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import msgspec

from mmserve.frontend.errors import ApiError
from mmserve.media.processing import PixelBounds
from mmserve.models.family import ModelSpec
from mmserve.protocol import MMProcessorKwargs

MODALITIES = ("image", "video")
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
                        "invalid_value",
                        f"mm_processor_kwargs.{name} must lie in [{low}, {high}], the pixel "
                        "bounds of this server",
                        param=f"mm_processor_kwargs.{name}",
                    )
            low = asked.min_pixels or low
            high = asked.max_pixels or high
            if low > high:
                raise ApiError(
                    "min_pixels_over_max_pixels",
                    f"mm_processor_kwargs: min_pixels ({low}) must not exceed max_pixels ({high})",
                    param="mm_processor_kwargs.min_pixels",
                )
        return None if (low, high) == self.model else (low, high)


def parse_mm_processor_kwargs(text: str) -> MMProcessorKwargs:
    """`--mm-processor-kwargs` JSON: `{"min_pixels": N, "max_pixels": M}`."""
    try:
        return msgspec.json.decode(text, type=MMProcessorKwargs)
    except msgspec.ValidationError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    except msgspec.DecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON: {err}") from None
