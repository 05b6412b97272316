"""The chat templates the tiny checkpoints ship: each family's own, as its instruction-tuned
checkpoints carry it, so prompts, tools and reasoning render as they do for the real models.

- Qwen2-VL and Qwen2.5-VL (whose processor template is Qwen2-VL's): each image content part
  becomes `<|vision_start|><|image_pad|><|vision_end|>` (the single `<|image_pad|>` is expanded
  later to one token per embedding row); neither renders tools.
- Qwen3-VL (Instruct; `templates/qwen3_vl.jinja`, byte for byte): tools in the system turn,
  calls as Hermes-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, results in
  `<tool_response>` blocks of a user turn.
- Qwen3.5 (`templates/qwen3_5.jinja`): tools, calls as `<tool_call><function=NAME>
  <parameter=P>...` blocks (Qwen3-Coder's format), and thinking: the generation prompt opens
  `<think>`, or with `enable_thinking: false` closes an empty one.
- Qwen2-Audio (`Qwen2AudioProcessor.default_chat_template`, which its instruction-tuned
  checkpoint ships too): each audio part becomes `Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>`
  and a newline (the single `<|AUDIO|>` is expanded later to one token per embedding row).
- Qwen2.5-Omni (`Qwen2_5OmniProcessor`'s): images, videos and clips in order, as
  `<|vision_bos|><|IMAGE|><|vision_eos|>`, `<|vision_bos|><|VIDEO|><|vision_eos|>` and
  `<|audio_bos|><|AUDIO|><|audio_eos|>`, after its default system prompt.
- Qwen3-Omni-MoE (`templates/qwen3_omni_moe.jinja`): Qwen3-VL's, with each audio part as
  `<|audio_start|><|audio_pad|><|audio_end|>` where it comes.
"""

from __future__ import annotations

import functools
from pathlib import Path

_TEMPLATES = Path(__file__).parent / "templates"

QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN2_AUDIO_CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if 'audio' in content or 'audio_url' in content or message['type'] == 'audio' "
    "or content['type'] == 'audio' %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2.5-Omni's (its processor's): images, videos and clips in the order given, each between
# its own bos and eos, after its default system prompt.
QWEN2_5_OMNI_CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are Qwen, a virtual human developed by the Qwen Team, Alibaba "
    "Group, capable of perceiving auditory and visual inputs, as well as generating text and "
    "speech.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "{% if add_audio_id %}Audio {{ audio_count.value }}: {% endif %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Each Qwen family's template: Qwen2-VL's string, or the name of a file under templates/.
_QWEN_TEMPLATES = {
    "qwen2_vl": None,
    "qwen2_5_vl": None,
    "qwen3_vl": "qwen3_vl.jinja",
    "qwen3_vl_moe": "qwen3_vl.jinja",
    "qwen3_5": "qwen3_5.jinja",
    "qwen3_5_moe": "qwen3_5.jinja",
    "qwen3_omni_moe": "qwen3_omni_moe.jinja",
}


@functools.cache
def qwen_chat_template(family: str) -> str:
    """The chat template of a Qwen family's instruction-tuned checkpoints."""
    if family == "qwen2_audio":
        return QWEN2_AUDIO_CHAT_TEMPLATE
    if family == "qwen2_5_omni":
        return QWEN2_5_OMNI_CHAT_TEMPLATE
    name = _QWEN_TEMPLATES[family]
    return QWEN2_VL_CHAT_TEMPLATE if name is None else (_TEMPLATES / name).read_text()
