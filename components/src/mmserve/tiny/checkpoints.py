"""`mmserve make-tiny-model`: tiny vision-language checkpoints with random weights, built offline.

Each checkpoint is a normal HF dir (config.json, generation_config.json,
preprocessor_config.json, tokenizer.json, tokenizer_config.json, model.safetensors) with the
real Qwen tokenizer and special-token ids (Qwen3.5: the same tokens at its own ids, 248044 on,
which its config classes name by default; Gemma 3: Gemma's special tokens at their real ids
over a synthetic vocabulary, `models/gemma_tokenizer.py`), tiny hidden sizes (CPU steps take
milliseconds) and weights drawn with a scale large enough that image pixels and token positions
visibly move the logits. Building is deterministic for a seed and idempotent. `--trained`
builds the default model instead, the tiny Qwen2-VL trained on synthetic scenes
(`tiny/trained.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

TINY_FAMILIES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "gemma3",
)
# Families that hear (the Omni thinkers see too): built like the others, kept apart from
# TINY_FAMILIES, which the image tests run over.
AUDIO_FAMILIES = ("qwen2_audio", "qwen2_5_omni", "qwen3_omni_moe")
# Families with Qwen3-VL's vision tower, preprocessing and interleaved M-RoPE.
_QWEN3_VISION = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# Qwen3-VL's vision tower with deepstack beside a mixture-of-experts text model.
_QWEN3_DEEPSTACK_MOE = ("qwen3_vl_moe", "qwen3_omni_moe")
# Qwen3.5's hybrid language models: Gated DeltaNet linear-attention layers beside full attention.
_QWEN3_5 = ("qwen3_5", "qwen3_5_moe")
DEFAULT_FAMILY = "qwen2_vl"
DEFAULT_SEED = 0
# Bumped whenever the builder's output changes, so stale cached checkpoints are rebuilt.
BUILDER_VERSION = 2
MARKER_FILE = "mmserve_tiny.json"
# The default 0.02 leaves a 2-layer model's logits nearly flat; this makes inputs matter.
INIT_SCALE = 0.25

VOCAB_SIZE = 151936  # Qwen2-VL's padded vocabulary: covers every special-token id
QWEN3_5_VOCAB_SIZE = 248320  # Qwen3.5's padded vocabulary, past its video pad 248057
GEMMA3_VOCAB_SIZE = 262208  # Gemma 3's padded vocabulary, past the image soft token 262144
TEXT_HIDDEN = 64
# Gemma 3's SigLIP input side: 32 x 32 patches of 14, average-pooled 2 x 2 to its 256 tokens.
GEMMA3_IMAGE_SIZE = 448
# Shorter than a prompt with an image, so the tests reach past the sliding layers' window.
GEMMA3_SLIDING_WINDOW = 128
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
)

# Qwen2-Audio's Whisper-style extractor: 128 mel bins, 25 ms windows every 10 ms at 16 kHz,
# every clip padded or cut to 30 s.
WHISPER_MEL_BINS = 128

_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def cache_dir() -> Path:
    """Where built checkpoints live: $MMSERVE_CACHE_DIR/models or ~/.cache/mmserve/models."""
    root = os.environ.get("MMSERVE_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "mmserve"
    return base / "models"


def tiny_model_dir(family: str, seed: int = DEFAULT_SEED, out: Path | None = None) -> Path:
    return (out or cache_dir()) / f"tiny-{family}-seed{seed}"


def _first_special_id(family: str) -> int:
    """The id of `<|endoftext|>`, the first of the Qwen special tokens."""
    from mmserve.tiny.tokenizer import QWEN2_NUM_RANKS, QWEN3_5_FIRST_SPECIAL_ID

    return QWEN3_5_FIRST_SPECIAL_ID if family in _QWEN3_5 else QWEN2_NUM_RANKS


def _text_config(family: str) -> dict[str, Any]:
    special = _first_special_id(family)
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "mrope_section": [2, 3, 3],  # sums to head_dim / 2
    }
    if family in (*_QWEN3_VISION, "qwen3_omni_moe"):
        rope["mrope_interleaved"] = True
    config: dict[str, Any] = {
        "vocab_size": QWEN3_5_VOCAB_SIZE if family in _QWEN3_5 else VOCAB_SIZE,
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "initializer_range": INIT_SCALE,
        "rope_parameters": rope,
        "bos_token_id": special,
        "eos_token_id": special + 2,  # <|im_end|>
    }
    if family in (*_QWEN3_VISION, "qwen3_omni_moe"):
        config["head_dim"] = 16
    if family in _QWEN3_5:
        # A linear-attention layer before a full-attention one, so every test crosses both;
        # the real models' partial rotary (a quarter of 256) kept partial over a wider head.
        rope["partial_rotary_factor"] = 0.5
        config.update(
            head_dim=32,
            layer_types=["linear_attention", "full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        )
    if family == "qwen3_5_moe":
        config.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        )
    if family in _QWEN3_DEEPSTACK_MOE:
        # Every layer sparse, two of four experts per token: routing reaches each expert.
        config.update(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1
        )
    return config


def _gemma3_text_config() -> dict[str, Any]:
    from mmserve.tiny import gemma_tokenizer as ids

    return {
        "vocab_size": GEMMA3_VOCAB_SIZE,
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": GEMMA3_SLIDING_WINDOW,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "initializer_range": INIT_SCALE,
        "bos_token_id": ids.BOS,
        "eos_token_id": ids.EOS,
        "pad_token_id": ids.PAD,
    }


def _qwen2_audio_encoder_config() -> dict[str, Any]:
    # max_source_positions is the real one: a 30 s chunk's 3000 frames, halved by the conv.
    return {
        "num_mel_bins": WHISPER_MEL_BINS,
        "encoder_layers": 2,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "d_model": 32,
        "max_source_positions": 1500,
        "initializer_range": INIT_SCALE,
    }


def _qwen2_5_omni_thinker_config() -> dict[str, Any]:
    """A tiny thinker: Qwen2.5-VL's tiny vision tower, Qwen2-Audio's tiny encoder with the
    real `n_window` (its attention runs in chunks of 2 x 100 frames), the tiny text model."""
    audio = {**_qwen2_audio_encoder_config(), "n_window": 100, "output_dim": TEXT_HIDDEN}
    return {
        "text_config": _text_config("qwen2_5_omni"),
        "vision_config": _vision_config("qwen2_5_vl"),
        "audio_config": audio,
        # Not a field of the thinker's config class, yet read by its `get_rope_index` (and
        # written by the real checkpoints).
        "vision_start_token_id": _first_special_id("qwen2_5_omni") + 9,
        "vision_end_token_id": _first_special_id("qwen2_5_omni") + 10,
        "initializer_range": INIT_SCALE,
        "tie_word_embeddings": True,
    }


def _qwen3_omni_moe_thinker_config() -> dict[str, Any]:
    """A tiny thinker: Qwen3-VL-MoE's tiny vision tower (with deepstack) and text model, a tiny
    audio encoder with the real `n_window` (its convolutions run over chunks of 2 x 50
    frames), and the real checkpoints' token ids (the audio tokens after Qwen3's)."""
    special = _first_special_id("qwen3_omni_moe")
    audio = {
        **_qwen2_audio_encoder_config(),
        "n_window": 50,
        "n_window_infer": 800,
        "downsample_hidden_size": 16,
        "output_dim": TEXT_HIDDEN,
    }
    return {
        "text_config": _text_config("qwen3_omni_moe"),
        "vision_config": _vision_config("qwen3_vl_moe"),
        "audio_config": audio,
        "image_token_id": special + 12,
        "video_token_id": special + 13,
        "audio_token_id": special + 32,  # <|audio_pad|>
        "audio_start_token_id": special + 26,
        # Not fields of the thinker's config class, yet read by its `get_rope_index` (and
        # written by the real checkpoints).
        "audio_end_token_id": special + 27,
        "vision_start_token_id": special + 9,
        "vision_end_token_id": special + 10,
        "position_id_per_seconds": 13,
        "initializer_range": INIT_SCALE,
        "tie_word_embeddings": True,
    }


def _gemma3_vision_config() -> dict[str, Any]:
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": GEMMA3_IMAGE_SIZE,
        "patch_size": 14,
        "vision_use_head": False,
    }


def _vision_config(family: str) -> dict[str, Any]:
    common = {"depth": 2, "num_heads": 2, "initializer_range": INIT_SCALE}
    if family == "qwen2_vl":
        return {**common, "embed_dim": 32, "hidden_size": TEXT_HIDDEN, "mlp_ratio": 2}
    if family == "qwen2_5_vl":
        return {
            **common,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": TEXT_HIDDEN,
            "window_size": 112,
            "fullatt_block_indexes": [1],
        }
    vision = {
        **common,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": TEXT_HIDDEN,
        "num_position_embeddings": 256,
    }
    if family in _QWEN3_5:
        return vision  # no deepstack
    return {**vision, "deepstack_visual_indexes": [0, 1]}


def preprocessor_config(family: str) -> dict[str, Any]:
    if family == "qwen3_omni_moe":
        # As its checkpoints: Qwen2-VL's image processor over 16-pixel patches and the
        # extractor's keys (a 300 s chunk, which its processor's `padding=True` never pads to).
        return {
            **preprocessor_config("qwen3_vl"),
            **preprocessor_config("qwen2_audio"),
            "min_pixels": 3136,
            "max_pixels": 12845056,
            "size": {"shortest_edge": 3136, "longest_edge": 12845056},
            "chunk_length": 300,
            "n_samples": 4800000,
            "nb_max_frames": 30000,
            "processor_class": "Qwen3OmniMoeProcessor",
        }
    if family == "qwen2_5_omni":
        # As its checkpoints: the image processor's and the extractor's keys in one file.
        return {
            **preprocessor_config("qwen2_5_vl"),
            **preprocessor_config("qwen2_audio"),
            "processor_class": "Qwen2_5OmniProcessor",
        }
    if family == "qwen2_audio":
        return {
            "feature_extractor_type": "WhisperFeatureExtractor",
            "processor_class": "Qwen2AudioProcessor",
            "feature_size": WHISPER_MEL_BINS,
            "sampling_rate": 16000,
            "hop_length": 160,
            "n_fft": 400,
            "chunk_length": 30,
            "n_samples": 480000,
            "nb_max_frames": 3000,
            "padding_value": 0.0,
            "padding_side": "right",
            "return_attention_mask": True,
            "dither": 0.0,
        }
    if family == "gemma3":
        return {
            "image_processor_type": "Gemma3ImageProcessor",
            "processor_class": "Gemma3Processor",
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "do_convert_rgb": None,
            "do_pan_and_scan": None,
            "image_mean": [0.5] * 3,
            "image_std": [0.5] * 3,
            "image_seq_length": 256,
            "resample": 2,
            "size": {"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE},
        }
    if family in _QWEN3_VISION:
        patch, mean, std, min_pixels, max_pixels = 16, [0.5] * 3, [0.5] * 3, 65536, 16777216
        processor_class = "Qwen3VLProcessor"
    else:
        patch, mean, std, min_pixels, max_pixels = 14, _CLIP_MEAN, _CLIP_STD, 3136, 12845056
        processor_class = "Qwen2_5_VLProcessor" if family == "qwen2_5_vl" else "Qwen2VLProcessor"
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor_class,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": mean,
        "image_std": std,
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }


def _build_model(family: str, seed: int) -> Any:
    import torch
    import transformers

    from mmserve.models.family import model_class

    config: transformers.PreTrainedConfig
    if family == "gemma3":
        from mmserve.tiny import gemma_tokenizer as ids

        config = transformers.Gemma3Config(
            text_config=_gemma3_text_config(),
            vision_config=_gemma3_vision_config(),
            mm_tokens_per_image=256,
            boi_token_index=ids.START_OF_IMAGE,
            eoi_token_index=ids.END_OF_IMAGE,
            image_token_index=ids.IMAGE_SOFT_TOKEN,
            initializer_range=INIT_SCALE,
            tie_word_embeddings=True,
        )
    elif family == "qwen2_audio":
        text = _text_config(family)
        del text["rope_parameters"]["mrope_section"]
        config = transformers.Qwen2AudioConfig(
            text_config={**text, "model_type": "qwen2"},
            audio_config=_qwen2_audio_encoder_config(),
            initializer_range=INIT_SCALE,  # type: ignore[call-arg]
        )
        config.tie_word_embeddings = True
    elif family == "qwen2_5_omni":
        # The whole model's config, as the real checkpoints ship it, without the talker that
        # speaks: only the thinker is served.
        config = transformers.Qwen2_5OmniConfig(
            thinker_config=_qwen2_5_omni_thinker_config(), enable_audio_output=False
        )
    elif family == "qwen3_omni_moe":
        config = transformers.Qwen3OmniMoeConfig(
            thinker_config=_qwen3_omni_moe_thinker_config(), enable_audio_output=False
        )
    else:
        config_class = {
            "qwen2_vl": transformers.Qwen2VLConfig,
            "qwen2_5_vl": transformers.Qwen2_5_VLConfig,
            "qwen3_vl": transformers.Qwen3VLConfig,
            "qwen3_vl_moe": transformers.Qwen3VLMoeConfig,
            "qwen3_5": transformers.Qwen3_5Config,
            "qwen3_5_moe": transformers.Qwen3_5MoeConfig,
        }[family]
        config = config_class(
            text_config=_text_config(family),
            vision_config=_vision_config(family),
            tie_word_embeddings=True,
            # Not a named parameter of these configs, yet kept in config.json and used to
            # initialise the weights.
            initializer_range=INIT_SCALE,  # type: ignore[call-arg]
        )
    torch.manual_seed(seed)
    model = model_class(family)(config)
    if family == "gemma3":
        with torch.no_grad():
            # Gemma 3 initialises its image projection to zeros, which would leave images unseen.
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, INIT_SCALE)
            # Its input embeddings are scaled by sqrt(hidden) and tied to the LM head: at the
            # usual init the last token's own embedding outweighs the context and greedy
            # decoding repeats it. Undo the scale at the input, make it up at the output (the
            # final norm is (1 + weight)), so that context moves the logits.
            model.model.language_model.embed_tokens.weight.mul_(TEXT_HIDDEN**-0.5)
            model.model.language_model.norm.weight.fill_(3.0)
            # SigLIP's patch embedding init leaves the pixels' effect on the logits faint.
            model.model.vision_tower.embeddings.patch_embedding.weight.normal_(0, 0.1)
    return model.eval()


def has_marker(path: Path, info: dict[str, Any]) -> bool:
    """Whether `path` is a complete checkpoint whose builder marker says `info`."""
    marker = path / MARKER_FILE
    if not all((path / name).is_file() for name in CHECKPOINT_FILES) or not marker.is_file():
        return False
    try:
        return bool(json.loads(marker.read_text()) == info)
    except json.JSONDecodeError:
        return False


def is_valid_checkpoint(path: Path, seed: int) -> bool:
    return has_marker(path, {"builder_version": BUILDER_VERSION, "seed": seed})


def write_checkpoint(
    target: Path,
    info: dict[str, Any],
    model: Any,
    preprocessor: dict[str, Any],
    family: str = DEFAULT_FAMILY,
) -> Path:
    """Save `model` with the family's tokenizer and chat template,
    generation and preprocessor configs and a marker saying `info` as `target`, unless it is
    already there."""
    if has_marker(target, info):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a concurrent builder never sees a partial dir.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)
    try:
        from mmserve.tiny import gemma_tokenizer
        from mmserve.tiny.tokenizer import write_qwen_tokenizer

        model.save_pretrained(staging)
        if family == "gemma3":
            # As the Gemma 3 instruction-tuned checkpoints: a turn ends generation too.
            eos, pad = [gemma_tokenizer.EOS, gemma_tokenizer.END_OF_TURN], gemma_tokenizer.PAD
        else:
            special = _first_special_id(family)
            eos, pad = [special + 2, special], special
        model.generation_config.eos_token_id = eos
        model.generation_config.pad_token_id = pad
        model.generation_config.save_pretrained(staging)
        (staging / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
        if family == "gemma3":
            gemma_tokenizer.write_gemma3_tokenizer(staging)
        else:
            write_qwen_tokenizer(staging, family, _first_special_id(family))
        if family in ("qwen2_5_omni", "qwen3_omni_moe"):
            # As its checkpoints: the processor's template apart (its processor reads only it).
            from mmserve.tiny.chat_template import qwen_chat_template

            template = {"chat_template": qwen_chat_template(family)}
            (staging / "chat_template.json").write_text(json.dumps(template, indent=2) + "\n")
        (staging / MARKER_FILE).write_text(json.dumps(info) + "\n")
        if target.exists():
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            if not has_marker(target, info):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_tiny_model(
    family: str = DEFAULT_FAMILY, seed: int = DEFAULT_SEED, out: Path | None = None
) -> Path:
    """The tiny checkpoint dir for `family` and `seed`, built unless already valid."""
    if family not in (*TINY_FAMILIES, *AUDIO_FAMILIES):
        known = ", ".join((*TINY_FAMILIES, *AUDIO_FAMILIES))
        raise ValueError(f"unknown family {family!r} (known: {known})")
    target = tiny_model_dir(family, seed, out)
    if is_valid_checkpoint(target, seed):
        return target
    return write_checkpoint(
        target,
        {"builder_version": BUILDER_VERSION, "seed": seed},
        _build_model(family, seed),
        preprocessor_config(family),
        family,
    )


def default_model_path() -> Path:
    """The default model (the tiny Qwen2-VL trained on scenes), built if missing."""
    from mmserve.tiny.trained import build_trained_model

    return build_trained_model()


def _handle(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser() if args.out else None
    if args.trained:
        from mmserve.tiny.trained import build_trained_model

        print(build_trained_model(out))
        return 0
    families = (*TINY_FAMILIES, *AUDIO_FAMILIES) if args.family == "all" else (args.family,)
    for family in families:
        print(build_tiny_model(family, args.seed, out))
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "make-tiny-model",
        help="build tiny checkpoints (offline): random weights, or the trained default",
        description=(
            "Build tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE / Qwen3.5 / Qwen3.5-MoE "
            "/ Gemma 3 / Qwen2-Audio / Qwen2.5-Omni / Qwen3-Omni-MoE (their thinkers) "
            "checkpoints with random weights and the real Qwen tokenizer (Qwen3.5, Gemma 3 and "
            "the Omni families: their special-token ids); prints each checkpoint dir. Skips "
            "ones already built."
        ),
    )
    parser.add_argument(
        "--family", choices=(*TINY_FAMILIES, *AUDIO_FAMILIES, "all"), default=DEFAULT_FAMILY
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="weight seed")
    parser.add_argument(
        "--trained",
        action="store_true",
        help="build the default model instead: the tiny Qwen2-VL trained on synthetic scenes "
        "(tiny-qwen2_vl-scenes, from the weights the package ships; see train-tiny-model)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="parent dir of the checkpoints (default: $MMSERVE_CACHE_DIR/models or "
        "~/.cache/mmserve/models)",
    )
    parser.set_defaults(handler=_handle)
