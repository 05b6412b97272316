"""OpenAI chat-completions shapes (JSON at the HTTP edge).

Unknown request fields are ignored, as OpenAI-compatible servers usually do, so clients that
send extra options keep working; options the server knows but does not support are declared
here so the frontend can reject a non-default value by name
(`ChatCompletionRequest.unsupported_options`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from mmserve.protocol.structured import StructuredOutputFields


class TextPart(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="text"):
    text: str


class ImageUrl(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


MediaUuid = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=256,
        description="vLLM's media id: names the item for later requests of the same API key, "
        "which may then send the id alone (no image_url, input_audio or audio_url)",
    ),
]


class ImageUrlPart(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="image_url"):
    # Some clients send the URL as a bare string; None (or absent) with a `uuid` names an image
    # sent before.
    image_url: ImageUrl | str | None = None
    uuid: MediaUuid | None = None

    @property
    def url(self) -> str | None:
        if self.image_url is None or isinstance(self.image_url, str):
            return self.image_url
        return self.image_url.url


class VideoUrl(msgspec.Struct, frozen=True, kw_only=True):
    url: str


class VideoUrlPart(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="video_url"):
    """vLLM's and SGLang's video part: an http(s) URL, a `data:video/...` URL or an allowed
    local file of an mp4, mov, webm or mkv video (some clients send the URL as a bare
    string)."""

    video_url: VideoUrl | str

    @property
    def url(self) -> str:
        return self.video_url if isinstance(self.video_url, str) else self.video_url.url


class InputAudio(msgspec.Struct, frozen=True, kw_only=True):
    data: Annotated[str, msgspec.Meta(description="the clip's bytes, base64")]
    format: Annotated[
        str,
        msgspec.Meta(
            description="wav, mp3, flac, ogg, opus, webm, mka, m4a, mp4...: data of another "
            "format is refused"
        ),
    ]


class InputAudioPart(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="input_audio"
):
    """OpenAI's audio part: a clip's bytes in base64 and the format they are in; or, with a
    `uuid` and no `input_audio`, a clip sent before under that id."""

    input_audio: InputAudio | None = None
    uuid: MediaUuid | None = None

    @property
    def url(self) -> str | None:
        return None if self.input_audio is None else f"data:;base64,{self.input_audio.data}"


class AudioUrl(msgspec.Struct, frozen=True, kw_only=True):
    url: str


class AudioUrlPart(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="audio_url"):
    """vLLM's audio part: an http(s) URL, a `data:audio/...` URL or an allowed local file of a
    wav, flac, mp3, ogg, webm or m4a clip (some clients send the URL as a bare string); or,
    with a `uuid` and no `audio_url`, a clip sent before under that id."""

    audio_url: AudioUrl | str | None = None
    uuid: MediaUuid | None = None

    @property
    def url(self) -> str | None:
        if self.audio_url is None or isinstance(self.audio_url, str):
            return self.audio_url
        return self.audio_url.url


_GridThw = Annotated[
    list[Annotated[int, msgspec.Meta(ge=1, lt=2**31)]], msgspec.Meta(min_length=3, max_length=3)
]


class ImageEmbedsTensors(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An image's precomputed tensors by name, each a source (base64, a `data:` URL, an
    allowed local path or an allowed URL) of a safetensors file or a `.npy` array."""

    image_embeds: Annotated[
        str,
        msgspec.Meta(
            description="[tokens, hidden]: the vision tower's output (Qwen3-VL: with its "
            "deepstack features concatenated, hidden x (1 + deepstack layers))"
        ),
    ]
    image_grid_thw: Annotated[
        str | _GridThw, msgspec.Meta(description="the patch grid [t, h, w], or its source")
    ]


class AudioEmbedsPart(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="audio_embeds"
):
    """vLLM's part for a clip's precomputed audio-tower output (after the projector); refused
    unless the server runs with `--enable-mm-embeds`. Safetensors and `.npy` only, never
    pickle."""

    audio_embeds: Annotated[
        str,
        msgspec.Meta(
            description="[tokens, hidden] (or [1, tokens, hidden]): a safetensors file (its "
            "one tensor, or the one named audio_embeds) or a .npy array, as base64, a data: "
            "URL, an allowed local path or an allowed URL"
        ),
    ]


class ImageEmbedsPart(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="image_embeds"
):
    """vLLM's part for an image's precomputed vision-tower output; refused unless the server
    runs with `--enable-mm-embeds`. Safetensors and `.npy` only, never pickle."""

    image_embeds: Annotated[
        str | ImageEmbedsTensors,
        msgspec.Meta(
            description="A safetensors file holding `image_embeds` and `image_grid_thw`, as "
            "base64, a data: URL, an allowed local path or an allowed URL; or the tensors by "
            "name"
        ),
    ]


ContentPart = (
    TextPart
    | ImageUrlPart
    | VideoUrlPart
    | ImageEmbedsPart
    | InputAudioPart
    | AudioUrlPart
    | AudioEmbedsPart
)


class FunctionCall(msgspec.Struct, frozen=True, kw_only=True):
    """A function the model called: its name and its arguments as a JSON text."""

    name: str
    arguments: str


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A call in an answer, or in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant message's calls, and the call a `tool` message answers.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # An earlier answer's reasoning, which thinking templates render (SGLang's and vLLM's
    # older name, and vLLM's newer one).
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDefinition(msgspec.Struct, frozen=True, kw_only=True):
    name: Annotated[str, msgspec.Meta(min_length=1)]
    description: str | None = None
    parameters: Annotated[
        dict[str, Any] | None,
        msgspec.Meta(description="The arguments as a JSON Schema object; none: no arguments"),
    ] = None
    strict: bool | None = None


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(msgspec.Struct, frozen=True, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    """`{"type": "function", "function": {"name": ...}}`: the answer is a call of that tool."""

    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: Annotated[
        bool,
        msgspec.Meta(
            description="vLLM's extension: every chunk carries the usage so far (here also "
            "without include_usage, which adds the usage-only chunk at the end)"
        ),
    ] = False


# The request's integers travel on to the workers as msgpack's 64-bit integers.
_INT64_MAX = 2**63 - 1


_Int64 = Annotated[int, msgspec.Meta(ge=-_INT64_MAX - 1, le=_INT64_MAX)]
_Positive = Annotated[int, msgspec.Meta(ge=1, le=_INT64_MAX)]
_PositiveU32 = Annotated[int, msgspec.Meta(ge=1, le=2**32 - 1)]  # what the core holds as u32


class MMProcessorKwargs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """vLLM's per-request processor options, under the names of transformers' Qwen2-VL image
    and video processors, each inside the server's own bounds: the pixel bounds this
    request's images, and each frame of its videos, are resized under; how its videos are
    sampled (`fps` or `num_frames`, `min_frames` / `max_frames`); Gemma 3's pan-and-scan, under
    the names of its image processor (`do_pan_and_scan`, `pan_and_scan_*`); Qwen-Omni's
    `use_audio_in_video` (a video's own audio track served with its frames)."""

    min_pixels: _Positive | None = None
    max_pixels: _Positive | None = None
    fps: Annotated[float, msgspec.Meta(gt=0)] | None = None
    num_frames: _Positive | None = None
    min_frames: _Positive | None = None
    max_frames: _Positive | None = None
    do_pan_and_scan: bool | None = None
    pan_and_scan_min_crop_size: _PositiveU32 | None = None
    pan_and_scan_max_num_crops: _PositiveU32 | None = None
    pan_and_scan_min_ratio_to_activate: Annotated[float, msgspec.Meta(ge=0, le=1e6)] | None = None
    # Qwen-Omni's: a video's own audio track interleaved with its frames (refused by name on
    # a model that serves none).
    use_audio_in_video: bool | None = None


# Gemma 3's pan-and-scan options of `MMProcessorKwargs`.
PAN_AND_SCAN_OPTIONS = (
    "do_pan_and_scan",
    "pan_and_scan_min_crop_size",
    "pan_and_scan_max_num_crops",
    "pan_and_scan_min_ratio_to_activate",
)


class VideoIoKwargs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How many frames of each video are read: `fps` or `num_frames` (vLLM's video loader
    options)."""

    fps: Annotated[float, msgspec.Meta(gt=0)] | None = None
    num_frames: _Positive | None = None


class MediaIoKwargs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """vLLM's per-request media loader options, by modality."""

    video: VideoIoKwargs | None = None


MAX_TOP_LOGPROBS = 20  # OpenAI's limits
MAX_LOGIT_BIAS = 300
DEFAULT_MAX_N = 16  # the most completions a request may ask for, unless --max-n says


LogitBias = Annotated[
    dict[str, Annotated[float, msgspec.Meta(ge=-100, le=100)]],
    msgspec.Meta(max_length=MAX_LOGIT_BIAS),
]
Choices = Annotated[
    int,
    msgspec.Meta(
        ge=1,
        le=_INT64_MAX,
        description="Completions of each prompt, sampled on one worker from one prefill (at most "
        "the server's --max-n); on /v1/completions choice i*n+j is prompt i's j-th",
    ),
]
BestOf = Annotated[
    int | None, msgspec.Meta(description="Extension (vLLM's): only equal to n (or unset) is served")
]


class ChatCompletionRequest(StructuredOutputFields, frozen=True, kw_only=True):
    """`POST /v1/chat/completions` body. Unknown fields are ignored (see module docstring)."""

    model: str
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=_INT64_MAX)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1, le=_INT64_MAX)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0, le=_INT64_MAX)] | None = None  # 0: off
    seed: Annotated[int, msgspec.Meta(ge=-_INT64_MAX - 1, le=_INT64_MAX)] | None = None
    stop: str | list[str] | None = None
    n: Choices = 1
    best_of: BestOf = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's and SGLang's extensions.
    ignore_eos: Annotated[
        bool, msgspec.Meta(description="Extension: EOS does not end the completion")
    ] = False
    min_tokens: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            le=_INT64_MAX,
            description="Extension: neither EOS, a stop token nor a stop string ends the "
            "completion before this many tokens; at most max_tokens",
        ),
    ] = 0
    mm_processor_kwargs: Annotated[
        MMProcessorKwargs | None,
        msgspec.Meta(
            description="Extension (vLLM's): pixel bounds for this request's images and "
            "video frames, and its videos' sampling, inside the server's bounds; media "
            "processed under other options are other items to every cache"
        ),
    ] = None
    media_io_kwargs: Annotated[
        MediaIoKwargs | None,
        msgspec.Meta(
            description='Extension (vLLM\'s): {"video": {"fps": F} or {"num_frames": N}}, '
            "the frames read from each video (the same as mm_processor_kwargs' fps and "
            "num_frames)"
        ),
    ] = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    repetition_penalty: (
        Annotated[
            float,
            msgspec.Meta(
                gt=0,
                description="Extension (vLLM's): the logits of ids in the prompt or the completion "
                "divided (positive) or multiplied (negative) by it; 1 is off",
            ),
        ]
        | None
    ) = None
    min_p: (
        Annotated[
            float,
            msgspec.Meta(
                ge=0,
                le=1,
                description="Extension (vLLM's): ids less likely than min_p times the most likely "
                "one are not sampled",
            ),
        ]
        | None
    ) = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    logit_bias: LogitBias | None = None
    stop_token_ids: (
        Annotated[
            list[_Int64],
            msgspec.Meta(description="Extension (vLLM's): token ids that end the completion"),
        ]
        | None
    ) = None
    skip_special_tokens: Annotated[
        bool,
        msgspec.Meta(description="Extension (vLLM's): special tokens' text is left out"),
    ] = True
    include_stop_str_in_output: Annotated[
        bool,
        msgspec.Meta(
            description="Extension (vLLM's): the text ends after the stop string (or the "
            "stop token's text) that ended it, not before"
        ),
    ] = False
    tools: Annotated[
        list[Tool] | None,
        msgspec.Meta(description="Functions the model may call; [] is the same as none"),
    ] = None
    tool_choice: Annotated[
        ToolChoice | None,
        msgspec.Meta(
            description="none: no call; auto (the default with tools): the model chooses and its "
            "calls are parsed (--tool-call-parser); required: one or more calls; or the named "
            "tool: one call of it. required and named constrain decoding to valid calls"
        ),
    ] = None
    parallel_tool_calls: Annotated[
        bool | None,
        msgspec.Meta(description="false: at most one call (default: any number)"),
    ] = None
    chat_template_kwargs: Annotated[
        dict[str, Any] | None,
        msgspec.Meta(
            description="Extension (vLLM's): variables for the chat template, e.g. "
            '{"enable_thinking": false}'
        ),
    ] = None
    include_reasoning: Annotated[
        bool,
        msgspec.Meta(
            description="Extension (vLLM's): false leaves the reasoning out of the answer "
            "(with --reasoning-parser)"
        ),
    ] = True
    separate_reasoning: Annotated[
        bool,
        msgspec.Meta(
            description="Extension (SGLang's): false keeps the reasoning in content, as the "
            "model wrote it (with --reasoning-parser)"
        ),
    ] = True
    # Known OpenAI options that mmserve does not implement, accepted only at their defaults:
    # its deprecated function calling, which `tools` replaced.
    functions: list[Any] | None = None
    function_call: Any | None = None
    user: str | None = None

    def unsupported_options(self) -> list[str]:
        """Names of options set to a value mmserve cannot honour (the frontend answers 400)."""
        return _unsupported(self, DEFAULT_ONLY_OPTIONS)


# The known OpenAI options mmserve does not implement, with the values it accepts for each
# (their defaults); `/openapi.json` documents these as the options' only values.
DEFAULT_ONLY_OPTIONS: dict[str, tuple[Any, ...]] = {
    "functions": (None,),
    "function_call": (None,),
}


def _unsupported(request: msgspec.Struct, accepted: dict[str, tuple[Any, ...]]) -> list[str]:
    return [name for name, values in accepted.items() if getattr(request, name) not in values]


FinishReason = Literal["stop", "length", "cancelled", "error"]
# What an answer's choice says: the engine's reason, or that it ended in tool calls.
ChoiceFinishReason = Literal["stop", "length", "cancelled", "error", "tool_calls"]


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class OpenAIUsage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None

    @classmethod
    def from_usage(cls, usage: Usage) -> OpenAIUsage:
        return cls(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            total_tokens=usage.prompt_tokens + usage.completion_tokens,
            prompt_tokens_details={"cached_tokens": usage.cached_tokens},
        )


class AssistantMessage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """An answer: `content` is always written (null beside tool calls with no text); the
    reasoning under both names clients read (SGLang's and Dynamo's `reasoning_content`,
    vLLM's `reasoning`) and the calls only when there are some."""

    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct, frozen=True, kw_only=True):
    """A token of the completion: its text, its UTF-8 bytes (a character may span tokens), its
    log-probability and the most likely tokens at its position."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class ChatCompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    message: AssistantMessage
    finish_reason: ChoiceFinishReason | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionResponse(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: OpenAIUsage | None = None
    object: Literal["chat.completion"] = "chat.completion"


class FunctionCallDelta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A piece of a streamed call: its id, type and name come first, then its arguments in
    fragments, each under the call's `index`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChoiceDelta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatCompletionChunkChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    delta: ChoiceDelta
    finish_reason: ChoiceFinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One SSE `data:` payload; the usage-only chunk has `choices=[]` and `usage` set."""

    id: str
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: OpenAIUsage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class OpenAIErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(msgspec.Struct, frozen=True, kw_only=True):
    """`{"error": {...}}`, OpenAI's error JSON."""

    error: OpenAIErrorBody


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    created: int
    owned_by: str = "mmserve"
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct, frozen=True, kw_only=True):
    data: list[ModelCard]
    object: Literal["list"] = "list"


# -- text completions (`POST /v1/completions`, OpenAI's legacy API with vLLM's extras) -----------

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit of the legacy `logprobs`

_TokenId = Annotated[int, msgspec.Meta(ge=-(2**31), lt=2**31)]
CompletionPrompt = Annotated[
    str | list[str | _TokenId | list[_TokenId]],
    msgspec.Meta(
        description="A string, a list of strings, a list of token ids, or a list of lists of "
        "token ids: one choice per prompt, `index` its place in the list"
    ),
]


class CompletionRequest(StructuredOutputFields, frozen=True, kw_only=True):
    """`POST /v1/completions` body. Unknown fields are ignored (see module docstring)."""

    model: str
    prompt: CompletionPrompt
    max_tokens: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            le=_INT64_MAX,
            description="At most this many tokens (OpenAI's default 16); 0 only with echo: "
            "the prompt is scored, nothing generated",
        ),
    ] = 16
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0, le=_INT64_MAX)] | None = None  # 0: off
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=-_INT64_MAX - 1, le=_INT64_MAX)] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: Annotated[
        bool,
        msgspec.Meta(description="The prompt comes first in the text (and in the logprobs)"),
    ] = False
    logprobs: (
        Annotated[
            int,
            msgspec.Meta(
                ge=0,
                le=MAX_COMPLETION_LOGPROBS,
                description="Each token's log-probability and this many most likely tokens' "
                "(with echo, the prompt's tokens too)",
            ),
        ]
        | None
    ) = None
    prompt_logprobs: (
        Annotated[
            int,
            msgspec.Meta(
                ge=0,
                le=MAX_TOP_LOGPROBS,
                description="Extension (vLLM's): the prompt's log-probabilities, each position's "
                "token and this many most likely, in `choices[].prompt_logprobs`",
            ),
        ]
        | None
    ) = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0)] | None = None
    logit_bias: LogitBias | None = None
    stop_token_ids: list[_Int64] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=_INT64_MAX)] = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    n: Choices = 1
    best_of: BestOf = None
    # Known OpenAI options that mmserve does not implement: accepted only at their defaults.
    suffix: str | None = None

    def unsupported_options(self) -> list[str]:
        """Names of options set to a value mmserve cannot honour (the frontend answers 400)."""
        return _unsupported(self, COMPLETION_DEFAULT_ONLY_OPTIONS)


COMPLETION_DEFAULT_ONLY_OPTIONS: dict[str, tuple[Any, ...]] = {
    "suffix": (None,),
}


class CompletionLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    """OpenAI's legacy log-probabilities: per token its text, log-probability (None for the
    echoed prompt's first), the most likely tokens' by text (None likewise) and its offset in
    the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's entry of a prompt position's token."""

    logprob: float
    rank: int | None
    decoded_token: str


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    # vLLM's: None for the first token, then per position the token's and the most likely
    # ones' entries by token id.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(msgspec.Struct, frozen=True, kw_only=True):
    """A text completion, and each chunk of a streamed one (`usage` on the last, with
    `stream_options.include_usage`, and `choices` empty there)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: OpenAIUsage | None = None
    object: Literal["text_completion"] = "text_completion"
