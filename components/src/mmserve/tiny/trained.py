"""The default model: a tiny Qwen2-VL trained to answer questions about synthetic scenes.

`mmserve train-tiny-model` (`models/training.py`) trains it; what ships is only what training
changed, in `weights/tiny-qwen2_vl-scenes.safetensors`: every weight but the embedding table,
and the embedding rows of the token ids that occur in training. No other row ever gets a
gradient (its token is in no training sequence and the table is tied to the LM head only through
rows the loss sees, see `training.py`), so those rows stay at a seeded draw that is rebuilt here,
and the full checkpoint is written to the cache on first use.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from mmserve.tiny.checkpoints import (
    VOCAB_SIZE,
    cache_dir,
    has_marker,
    preprocessor_config,
    write_checkpoint,
)

SCENES_MODEL_NAME = "tiny-qwen2_vl-scenes"
# Bumped whenever the rebuilt checkpoint would change for the same shipped weights.
TRAINED_BUILDER_VERSION = 2
WEIGHTS_FILE = Path(__file__).parent / "weights" / f"{SCENES_MODEL_NAME}.safetensors"
EMBED_KEY = "model.language_model.embed_tokens.weight"
ROW_IDS_KEY = "embed_rows.ids"
ROW_WEIGHTS_KEY = "embed_rows.weight"
EMBED_SEED = 0
# The usual 0.02 leaves training on a plateau where the answer ignores the image for
# thousands of steps; at 0.1 it starts reading the image within a hundred.
INIT_RANGE = 0.1
TEXT_HIDDEN = 128
ROPE_THETA = 10.0
# Scenes are SCENE_SIZE (112) pixels a side; larger images are scaled down to about that.
MAX_PIXELS = 112 * 112

# Token ids the config names; the training model renumbers them (see `model_config`).
SPECIAL_IDS = {
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "image_token_id": 151655,
    "video_token_id": 151656,
}


def model_config(vocab_size: int = VOCAB_SIZE, ids: dict[str, int] | None = None) -> Any:
    """The trained model's Qwen2VLConfig; training uses a smaller vocabulary with its own ids."""
    import transformers

    ids = ids or SPECIAL_IDS
    text = {
        "vocab_size": vocab_size,
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "initializer_range": INIT_RANGE,
        "rope_parameters": {
            "rope_type": "default",
            # M-RoPE gives the width axis the lowest frequencies: at the usual 10,000 a 4-token
            # wide image turns them by under 0.01 radian, so left and right look the same.
            "rope_theta": ROPE_THETA,
            "mrope_section": [4, 6, 6],  # sums to head_dim / 2
        },
        "bos_token_id": ids["bos_token_id"],
        "eos_token_id": ids["eos_token_id"],
    }
    vision = {
        "depth": 3,
        "num_heads": 4,
        "embed_dim": 64,
        "hidden_size": TEXT_HIDDEN,
        "mlp_ratio": 2,
        "initializer_range": INIT_RANGE,
    }
    return transformers.Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=True,
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
    )


def scenes_preprocessor_config() -> dict[str, Any]:
    config = preprocessor_config("qwen2_vl")
    config["max_pixels"] = MAX_PIXELS
    config["size"] = {"shortest_edge": config["min_pixels"], "longest_edge": MAX_PIXELS}
    return config


def seeded_embeddings(vocab_size: int = VOCAB_SIZE) -> Any:
    """The embedding table before training: a fixed draw, the same on every machine."""
    import torch

    generator = torch.Generator().manual_seed(EMBED_SEED)
    return torch.randn(vocab_size, TEXT_HIDDEN, generator=generator) * INIT_RANGE


def _weights_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def trained_model_dir(out: Path | None = None) -> Path:
    return (out or cache_dir()) / SCENES_MODEL_NAME


def build_trained_model(out: Path | None = None, weights: Path = WEIGHTS_FILE) -> Path:
    """The trained checkpoint dir, rebuilt from the seeded table and `weights` unless valid."""
    info = {"builder_version": TRAINED_BUILDER_VERSION, "weights": _weights_digest(weights)}
    target = trained_model_dir(out)
    if has_marker(target, info):
        return target
    # Only a rebuild pays for these imports (the launch scripts call this on every start).
    import torch
    import transformers
    from safetensors.torch import load_file

    trained = load_file(weights)
    ids = trained.pop(ROW_IDS_KEY)
    rows = trained.pop(ROW_WEIGHTS_KEY)
    embeddings = seeded_embeddings()
    embeddings[ids] = rows.float()
    state = {name: tensor.float() for name, tensor in trained.items()}
    state[EMBED_KEY] = embeddings
    model = transformers.Qwen2VLForConditionalGeneration(model_config())
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"{weights}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    with torch.no_grad():
        if not torch.equal(model.lm_head.weight, embeddings):
            raise RuntimeError("the LM head is not tied to the embedding table")
    return write_checkpoint(target, info, model.eval(), scenes_preprocessor_config())
