"""A checkpoint's family and facts, as the Rust core reads them from its config files.

`resolve_model_spec(path)` reads the text of config.json, preprocessor_config.json and
generation_config.json and hands it to the core's family registry (`_mm.Checkpoint`), the one
parser of those files: it knows every family and what its files say. `ModelSpec` reads its facts
through; Python adds only the checkpoint's path, and the transformers class that runs the
family (`model_class`, transformers' own for the model type). It works the same for the tiny
checkpoints and for any real local checkpoint of a family the registry knows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from mmserve import _mm

if TYPE_CHECKING:
    from transformers import PreTrainedModel


# The thinker class of each composite family (`load_model`).
_THINKERS = {
    "qwen2_5_omni": "Qwen2_5OmniThinkerForConditionalGeneration",
    "qwen3_omni_moe": "Qwen3OmniMoeThinkerForConditionalGeneration",
}


class UnsupportedModel(ValueError):
    """The checkpoint dir is missing a file or names a family this package cannot run."""


@dataclass(frozen=True)
class ModelSpec:
    """What a worker needs to know about a checkpoint, without loading its weights: the core's
    reading of its config files (`checkpoint`), at `path`."""

    path: Path
    checkpoint: _mm.Checkpoint

    @property
    def core(self) -> _mm.Spec:
        """The preprocessing spec the core's driver and preprocessing calls take."""
        return self.checkpoint.spec

    @property
    def family(self) -> str:
        """The family's name, its config.json `model_type`."""
        return self.core.family

    @property
    def image_token_id(self) -> int:
        return self.core.image_token_id

    @property
    def video_token_id(self) -> int | None:
        """None for a family without video (Gemma 3)."""
        return self.core.video_token_id

    @property
    def vision_start_token_id(self) -> int:
        """The token before an image (Gemma 3: begin of image)."""
        return self.core.vision_start_token_id

    @property
    def vision_end_token_id(self) -> int:
        return self.core.vision_end_token_id

    @property
    def patch_size(self) -> int:
        return self.core.patch_size

    @property
    def temporal_patch_size(self) -> int:
        return self.core.temporal_patch_size

    @property
    def spatial_merge_size(self) -> int:
        return self.core.merge_size

    @property
    def min_pixels(self) -> int:
        return self.core.min_pixels

    @property
    def max_pixels(self) -> int:
        return self.core.max_pixels

    @property
    def vision_input(self) -> Literal["patches", "image"]:
        """What the vision tower takes per item: patch rows and the grid (Qwen-VL), or one
        `[3, height, width]` image of its fixed size (SigLIP's)."""
        return self.core.vision_input

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.checkpoint.eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.checkpoint.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.checkpoint.hidden_size

    @property
    def num_layers(self) -> int:
        return self.checkpoint.num_layers

    @property
    def max_position_embeddings(self) -> int | None:
        """The longest sequence (prompt and completion) the model was built for, if it says."""
        return self.checkpoint.max_position_embeddings

    @property
    def deepstack_layers(self) -> int:
        """Vision layers whose features Qwen3-VL adds to the first decoder layers (0: none)."""
        return self.checkpoint.deepstack_layers

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """Indices of the language model's linear-attention layers (Qwen3.5's Gated
        DeltaNet): each holds a state of the whole prefix, not a per-token KV."""
        return tuple(self.checkpoint.linear_attention_layers)

    @property
    def reuses_prefix_blocks(self) -> bool:
        """Whether a prefill may resume from cached prefix blocks (and announce them). A
        recurrent state exists only at the token where it was taken, so a model with
        linear-attention layers reuses none (docs/engines.md, "Hybrid models")."""
        return not self.checkpoint.linear_attention_layers

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


def resolve_model_spec(path: str | Path) -> ModelSpec:
    """The family and facts of the checkpoint at `path`."""
    path = Path(path).expanduser().resolve()
    config = _read_text(path / "config.json")
    preprocessor = _read_text(path / "preprocessor_config.json")
    generation_path = path / "generation_config.json"
    generation = _read_text(generation_path) if generation_path.exists() else None
    try:
        checkpoint = _mm.Checkpoint.from_hf_configs(preprocessor, config, generation)
    except _mm.MediaError as error:
        raise UnsupportedModel(f"{path}: {error.args[1]}") from None
    return ModelSpec(path=path, checkpoint=checkpoint)


def model_class(family: str) -> type[PreTrainedModel]:
    """The transformers class of a family's whole model (its towers and language model):
    transformers' own for the model type, the one `AutoModelForImageTextToText` loads, or for
    a family without images (Qwen2-Audio) the one `AutoModelForMultimodalLM` loads."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
    )

    name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(
        family, MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES.get(family)
    )
    if name is None:
        raise UnsupportedModel(f"transformers {transformers.__version__} has no model for {family}")
    cls: type[PreTrainedModel] = getattr(transformers, name)
    return cls


def load_model(family: str, path: str | Path, **options: Any) -> PreTrainedModel:
    """The model that reads the prompt and writes the text, from the checkpoint at `path`
    (`options` go to `from_pretrained`). A composite checkpoint (Qwen2.5-Omni's: a thinker
    beside a talker that speaks) loads its thinker alone, from the thinker's config and weights
    (`thinker.*`), as vLLM serves it; the talker's weights are never read."""
    import transformers

    if family not in _THINKERS:
        return model_class(family).from_pretrained(path, **options)
    config = transformers.AutoConfig.from_pretrained(path)
    thinker: type[PreTrainedModel] = getattr(transformers, _THINKERS[family])
    return thinker.from_pretrained(
        path, config=config.thinker_config, key_mapping={r"^thinker\.": ""}, **options
    )
