"""A Gemma 3 tokenizer built offline: Gemma's special tokens at their real ids, a Gemma chat
template, and a synthetic byte-level vocabulary padded to Gemma 3's size.

The text ids are not Gemma's (its SentencePiece model is not shipped offline), but every id the
serving path and the processor treat specially is: 0 `<pad>`, 1 `<eos>`, 2 `<bos>`, 3 `<unk>`,
105/106 `<start_of_turn>`/`<end_of_turn>`, 107/108 "\\n"/"\\n\\n", 255999/256000
`<start_of_image>`/`<end_of_image>` and 262144 `<image_soft_token>`.
"""

from __future__ import annotations

import json
from pathlib import Path

# The real Gemma 3 ids.
PAD, EOS, BOS, UNK, MASK = 0, 1, 2, 3, 4
START_OF_TURN, END_OF_TURN = 105, 106
NEWLINE, DOUBLE_NEWLINE = 107, 108
START_OF_IMAGE, END_OF_IMAGE = 255_999, 256_000
IMAGE_SOFT_TOKEN = 262_144
TOKENIZER_SIZE = IMAGE_SOFT_TOKEN + 1

SPECIAL_TOKENS: dict[int, str] = {
    PAD: "<pad>",
    EOS: "<eos>",
    BOS: "<bos>",
    UNK: "<unk>",
    MASK: "<mask>",
    START_OF_TURN: "<start_of_turn>",
    END_OF_TURN: "<end_of_turn>",
    START_OF_IMAGE: "<start_of_image>",
    END_OF_IMAGE: "<end_of_image>",
    IMAGE_SOFT_TOKEN: "<image_soft_token>",
}

# Gemma 3's chat template, as the Gemma 3 instruction-tuned checkpoints ship it.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate '
    'user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


def _vocab() -> dict[str, int]:
    """Every id up to the soft token: specials, "\\n" and "\\n\\n" at Gemma's ids, the 256
    byte-level symbols after them, the rest unused fillers (as Gemma's own `<unusedN>`)."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    newline = "\u010a"  # byte-level "\n"
    vocab: dict[str, int] = {token: id_ for id_, token in SPECIAL_TOKENS.items()}
    vocab[newline] = NEWLINE
    vocab[newline * 2] = DOUBLE_NEWLINE
    next_id = DOUBLE_NEWLINE + 1
    for symbol in alphabet:
        if symbol != newline:
            vocab[symbol] = next_id
            next_id += 1
    taken = set(vocab.values())
    for id_ in range(TOKENIZER_SIZE):
        if id_ not in taken:
            vocab[f"<unused{id_}>"] = id_
    return vocab


def write_gemma3_tokenizer(out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) into `out_dir`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    newline = "\u010a"
    tokenizer = Tokenizer(models.BPE(_vocab(), [(newline, newline)], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # As Gemma's own tokenizer: `<bos>` first unless special tokens are left out.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS)]
    )
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS.values()]
    )
    for id_, token in SPECIAL_TOKENS.items():
        if tokenizer.token_to_id(token) != id_:
            raise RuntimeError(f"{token} landed at {tokenizer.token_to_id(token)}, not {id_}")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    added = {
        str(id_): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for id_, token in SPECIAL_TOKENS.items()
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        # The names Gemma3Processor reads its image tokens by.
        "extra_special_tokens": {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": GEMMA3_CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
