"""Model family resolution from a checkpoint dir's config files.

`resolve_model_spec(path)` reads config.json, generation_config.json and
preprocessor_config.json and returns the facts the workers and the Rust core need. The Rust
core's registry parses the files (`_mm.spec_from_hf_configs`, one parser with one set of
fallbacks); this module adds what Python alone knows about a family (`FAMILIES`), and reads the
two facts of config.json the core does not carry (deepstack and linear-attention layers). It works
the same for the tiny checkpoints and for any real local checkpoint of a family in `FAMILIES`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mmserve import _mm


class UnsupportedModel(ValueError):
    """The checkpoint dir is missing a file or names a family this package cannot run."""


@dataclass(frozen=True)
class FamilyInfo:
    """What only the Python side knows about a family."""

    name: str
    model_class: str
    # Qwen3-VL adds per-layer vision features to the first decoder layers.
    has_deepstack: bool
    # The model takes video, so its config must name a video token.
    has_video: bool = True
    # The workers and engines run it end to end; a family with only its preprocessing and
    # request plan in place is refused at start-up rather than half served.
    served: bool = True
    # What the vision tower takes per item: "patches" (Qwen-VL: `[patches, channels]` rows and
    # the grid) or "image" (SigLIP: one `[3, height, width]` image of the tower's fixed size).
    vision_input: Literal["patches", "image"] = "patches"
    # How the hf engine runs the language model. "mrope": the text model directly, with the
    # plan's M-RoPE grid. "own_forward": the model's own forward, which builds the mask from
    # token_type_ids (Gemma 3's bidirectional attention within each image), 1-D positions.
    text_forward: Literal["mrope", "own_forward"] = "mrope"
    # The format its instruction-tuned checkpoints write tool calls in (the frontend's
    # `--tool-call-parser` default, vLLM's names); None: they were not trained to call tools.
    tool_call_parser: str | None = None


FAMILIES: dict[str, FamilyInfo] = {
    "qwen2_vl": FamilyInfo("qwen2_vl", "Qwen2VLForConditionalGeneration", has_deepstack=False),
    "qwen2_5_vl": FamilyInfo(
        "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", False, tool_call_parser="hermes"
    ),
    "qwen3_vl": FamilyInfo(
        "qwen3_vl", "Qwen3VLForConditionalGeneration", True, tool_call_parser="hermes"
    ),
    "qwen3_vl_moe": FamilyInfo(
        "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", True, tool_call_parser="hermes"
    ),
    # Qwen3-VL's vision without deepstack, a hybrid language model (docs/engines.md); its
    # template asks for Qwen3-Coder's XML calls.
    "qwen3_5": FamilyInfo(
        "qwen3_5", "Qwen3_5ForConditionalGeneration", False, tool_call_parser="qwen3_coder"
    ),
    "qwen3_5_moe": FamilyInfo(
        "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", False, tool_call_parser="qwen3_coder"
    ),
    "gemma3": FamilyInfo(
        "gemma3",
        "Gemma3ForConditionalGeneration",
        has_deepstack=False,
        has_video=False,
        vision_input="image",
        text_forward="own_forward",
    ),
}


@dataclass(frozen=True)
class ModelSpec:
    """What a worker needs to know about a checkpoint, without loading its weights."""

    path: Path
    family: FamilyInfo
    core: _mm.Spec  # the Rust core's spec: what its preprocessing and driver read
    image_token_id: int
    video_token_id: int | None  # None for image-only families (Gemma 3)
    # The tokens around an image (Gemma 3: begin and end of image).
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
    # Vision layers whose features Qwen3-VL adds to the first decoder layers (0: none).
    deepstack_layers: int = 0
    # Indices of the language model's linear-attention layers (Qwen3.5's Gated DeltaNet,
    # `text_config.layer_types`): each holds a state of the whole prefix, not a per-token KV.
    linear_attention_layers: tuple[int, ...] = ()

    @property
    def reuses_prefix_blocks(self) -> bool:
        """Whether a prefill may resume from cached prefix blocks (and announce them). A
        recurrent state exists only at the token where it was taken, so a model with
        linear-attention layers reuses none (docs/engines.md, "Hybrid models")."""
        return not self.linear_attention_layers

    @property
    def image_factor(self) -> int:
        """Image sides are rounded to multiples of this (patch x merge)."""
        return self.patch_size * self.spatial_merge_size

    def image_token_count(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // (self.spatial_merge_size**2)


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise UnsupportedModel(
            f"{path.parent} is not a model checkpoint: {path.name} missing"
        ) from None


def _required(spec: _mm.Spec, name: str, value: int | None) -> int:
    if value is None:
        raise UnsupportedModel(f"{spec.family} checkpoint: config.json gives no {name}")
    return value


def resolve_model_spec(path: str | Path, *, unserved: bool = False) -> ModelSpec:
    """The family and facts of the checkpoint at `path`. A family the workers cannot serve yet
    is refused unless `unserved` (for its preprocessing alone)."""
    path = Path(path).expanduser().resolve()
    config = _read_text(path / "config.json")
    preprocessor = _read_text(path / "preprocessor_config.json")
    generation_path = path / "generation_config.json"
    generation = _read_text(generation_path) if generation_path.exists() else None
    try:
        spec = _mm.spec_from_hf_configs(preprocessor, config, generation)
    except _mm.MediaError as error:
        raise UnsupportedModel(f"{path}: {error.args[1]}") from None
    family = FAMILIES.get(spec.family)
    if family is None:
        known = ", ".join(sorted(FAMILIES))
        raise UnsupportedModel(f"model_type {spec.family!r} is not supported (known: {known})")
    if not (family.served or unserved):
        raise UnsupportedModel(
            f"{path}: {family.name} has its preprocessing and request plan but no engine "
            "serves it yet"
        )
    if spec.spec_id is None:  # set for every spec made from config files
        raise UnsupportedModel(f"{path}: the core gave no digest of the config files")
    return ModelSpec(
        path=path,
        family=family,
        core=spec,
        image_token_id=spec.image_token_id,
        video_token_id=(
            _required(spec, "video_token_id", spec.video_token_id)
            if family.has_video
            else spec.video_token_id
        ),
        vision_start_token_id=spec.vision_start_token_id,
        vision_end_token_id=spec.vision_end_token_id,
        eos_token_ids=tuple(spec.eos_token_ids),
        vocab_size=_required(spec, "vocab_size", spec.vocab_size),
        hidden_size=_required(spec, "hidden_size", spec.hidden_size),
        num_layers=_required(spec, "num_hidden_layers", spec.num_layers),
        patch_size=spec.patch_size,
        temporal_patch_size=spec.temporal_patch_size,
        spatial_merge_size=spec.merge_size,
        min_pixels=spec.min_pixels,
        max_pixels=spec.max_pixels,
        image_mean=spec.image_mean,
        image_std=spec.image_std,
        max_position_embeddings=spec.max_position_embeddings,
        spec_id=spec.spec_id,
        deepstack_layers=_deepstack_layers(config) if family.has_deepstack else 0,
        linear_attention_layers=_linear_attention_layers(config),
    )


def _linear_attention_layers(config: str) -> tuple[int, ...]:
    parsed = json.loads(config)
    text = parsed.get("text_config") or parsed
    kinds = text.get("layer_types") or []
    return tuple(index for index, kind in enumerate(kinds) if kind == "linear_attention")


def _deepstack_layers(config: str) -> int:
    vision = json.loads(config).get("vision_config") or {}
    return len(vision.get("deepstack_visual_indexes") or [])
