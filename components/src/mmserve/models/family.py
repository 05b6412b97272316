"""Model family resolution from a checkpoint dir's config files.

`resolve_model_spec(path)` reads config.json, generation_config.json and
preprocessor_config.json and returns the facts the workers and the Rust core need. It works the
same for the tiny checkpoints and for any real local Qwen-VL checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class UnsupportedModel(ValueError):
    """The checkpoint dir is missing a file or names a family this package cannot run."""


@dataclass(frozen=True)
class FamilyInfo:
    name: str
    model_class: str
    # Qwen3-VL adds per-layer vision features to the first decoder layers.
    has_deepstack: bool


FAMILIES: dict[str, FamilyInfo] = {
    "qwen2_vl": FamilyInfo("qwen2_vl", "Qwen2VLForConditionalGeneration", has_deepstack=False),
    "qwen2_5_vl": FamilyInfo("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", False),
    "qwen3_vl": FamilyInfo("qwen3_vl", "Qwen3VLForConditionalGeneration", has_deepstack=True),
}


@dataclass(frozen=True)
class ModelSpec:
    """What a worker needs to know about a checkpoint, without loading its weights."""

    path: Path
    family: FamilyInfo
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    hidden_size: int
    num_layers: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    # The longest sequence (prompt and completion) the model was built for, if it says.
    max_position_embeddings: int | None
    # Digest of the config files: two specs with equal ids produce equal embeddings.
    spec_id: str

    @property
    def image_factor(self) -> int:
        """Image sides are rounded to multiples of this (patch x merge)."""
        return self.patch_size * self.spatial_merge_size

    def image_token_count(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // (self.spatial_merge_size**2)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UnsupportedModel(
            f"{path.parent} is not a model checkpoint: {path.name} missing"
        ) from None
    except json.JSONDecodeError as error:
        raise UnsupportedModel(f"{path} is not valid JSON: {error}") from None


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _pixel_bounds(preprocessor: dict[str, Any]) -> tuple[int, int]:
    size = preprocessor.get("size") or {}
    min_pixels = preprocessor.get("min_pixels", size.get("shortest_edge"))
    max_pixels = preprocessor.get("max_pixels", size.get("longest_edge"))
    if min_pixels is None or max_pixels is None:
        raise UnsupportedModel("preprocessor_config.json gives no min/max pixels")
    return int(min_pixels), int(max_pixels)


def resolve_model_spec(path: str | Path) -> ModelSpec:
    """The family and facts of the checkpoint at `path`."""
    path = Path(path).expanduser().resolve()
    config = _read_json(path / "config.json")
    preprocessor = _read_json(path / "preprocessor_config.json")
    generation_path = path / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.exists() else {}

    model_type = config.get("model_type")
    family = FAMILIES.get(model_type or "")
    if family is None:
        known = ", ".join(sorted(FAMILIES))
        raise UnsupportedModel(f"model_type {model_type!r} is not supported (known: {known})")
    # Older checkpoints keep the text settings at the top level instead of in text_config.
    text = {**config, **config.get("text_config", {})}
    vision = config.get("vision_config", {})
    eos_ids = _as_ids(generation.get("eos_token_id")) or _as_ids(text.get("eos_token_id"))
    min_pixels, max_pixels = _pixel_bounds(preprocessor)
    digest = hashlib.sha256()
    for part in (config, preprocessor):
        digest.update(json.dumps(part, sort_keys=True).encode())
    return ModelSpec(
        path=path,
        family=family,
        image_token_id=int(config["image_token_id"]),
        video_token_id=int(config["video_token_id"]),
        vision_start_token_id=int(config["vision_start_token_id"]),
        vision_end_token_id=int(config["vision_end_token_id"]),
        eos_token_ids=eos_ids,
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        num_layers=int(text["num_hidden_layers"]),
        patch_size=int(preprocessor.get("patch_size", vision.get("patch_size"))),
        temporal_patch_size=int(
            preprocessor.get("temporal_patch_size", vision.get("temporal_patch_size"))
        ),
        spatial_merge_size=int(preprocessor.get("merge_size", vision.get("spatial_merge_size"))),
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        image_mean=tuple(preprocessor["image_mean"]),
        image_std=tuple(preprocessor["image_std"]),
        max_position_embeddings=_optional_int(text.get("max_position_embeddings")),
        spec_id=digest.hexdigest()[:16],
    )
