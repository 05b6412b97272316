"""OpenAI chat request -> `PreprocessedRequest`: validation, the model's chat template,
tokenization, and the request plan (one run of the Rust driver: each media item's identity,
place in the expanded prompt and grid, and the positions)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from mmserve import media
from mmserve._mm import MediaError
from mmserve.frontend.answers import OutputRules
from mmserve.frontend.dispatch import TensorSink
from mmserve.frontend.embeds import (
    EmbedsBudget,
    PrecomputedImage,
    load_audio_embeds,
    load_image_embeds,
)
from mmserve.frontend.errors import ApiError
from mmserve.frontend.media_ids import KnownMedia, MediaIds
from mmserve.frontend.mm_options import (
    PanAndScanRange,
    PixelRange,
    VideoCaps,
    VideoRange,
    asks_video_options,
    check_media_counts,
)
from mmserve.frontend.prompt_encoder import PromptEncoder
from mmserve.frontend.structured import request_grammar
from mmserve.frontend.template import TemplateFacts, template_messages
from mmserve.frontend.token_cache import DEFAULT_TOKEN_CACHE_MIB, TokenCache, message_boundary
from mmserve.frontend.tool_parsers import HermesCalls, NamedCall, Qwen3CoderCalls, RequiredCalls
from mmserve.frontend.tools import (
    check_tool_grammar,
    check_tools,
    parameter_types,
    template_tools,
    tool_grammar,
    tool_mode,
)
from mmserve.grammar.defaults import DEFAULT_COMPILE_TIMEOUT_S
from mmserve.media import DEFAULT_MAX_AUDIO_DURATION_S, MediaPolicy, PixelBounds
from mmserve.media.processing import PanAndScanKnobs
from mmserve.media.text_pieces import text_pieces
from mmserve.models.family import ModelSpec, resolve_model_spec
from mmserve.models.tokenizer import shared_tokenizer
from mmserve.protocol import (
    DEEPSTACK,
    ERROR_CHAT_TEMPLATE,
    ERROR_CONTEXT_LENGTH_EXCEEDED,
    ERROR_EMBEDS_DISABLED,
    ERROR_INVALID_VALUE,
    ERROR_MEDIA_ID_UNKNOWN,
    ERROR_MIN_TOKENS_OVER_MAX_TOKENS,
    ERROR_MODEL_NOT_FOUND,
    ERROR_TOKEN_NOT_IN_VOCABULARY,
    ERROR_TOP_LOGPROBS_WITHOUT_LOGPROBS,
    ERROR_UNSUPPORTED_OPTION,
    AudioEmbedsPart,
    AudioUrlPart,
    ChatCompletionRequest,
    EmbeddingsHandle,
    Grammar,
    ImageEmbedsPart,
    ImageUrlPart,
    InputAudioPart,
    ItemState,
    MediaIoKwargs,
    MediaPayload,
    MMProcessorKwargs,
    NamedToolChoice,
    PreprocessedRequest,
    RequestPlan,
    SamplingParams,
    StopConditions,
    StructuredOutputFields,
    TextPart,
    VideoUrlPart,
)
from mmserve.protocol.openai import DEFAULT_MAX_N
from mmserve.reasoning import Opening, ReasoningTokens, after_reasoning

# Request ids: a random prefix drawn once per process, then a counter (32 hex digits, as a
# uuid4's): unique across frontends without a system call per request.
_ID_PREFIX = secrets.token_hex(8)
_ID_COUNTER = itertools.count()


def new_request_id(kind: str = "chatcmpl") -> str:
    return f"{kind}-{_ID_PREFIX}{next(_ID_COUNTER):016x}"


def new_call_id() -> str:
    """A tool call's id, in OpenAI's form (`call_...`)."""
    return f"call_{_ID_PREFIX}{next(_ID_COUNTER):016x}"


@dataclass(frozen=True)
class ServedModel:
    """A checkpoint as the frontend serves it: its public name, tokenizer and facts."""

    name: str
    spec: ModelSpec
    tokenizer: Any  # transformers PreTrainedTokenizerFast, shared: only read
    created: int
    # The template prompts are rendered with where it is not the tokenizer's own (None).
    chat_template: str | None = None

    @classmethod
    def load(cls, path: str | Path, name: str | None = None) -> ServedModel:
        spec = resolve_model_spec(path)  # before the slow import: a bad path fails at once
        tokenizer = shared_tokenizer(spec.path)
        processor_template = _processor_chat_template(spec.path)
        if not (processor_template or getattr(tokenizer, "chat_template", None)):
            raise ValueError(f"{spec.path} has no chat template in its tokenizer config")
        return cls(
            name=name or spec.path.name,
            spec=spec,
            tokenizer=tokenizer,
            created=int(time.time()),
            chat_template=processor_template,
        )

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        """The tokenizer's `apply_chat_template` with the template this model renders with."""
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, **kwargs
        )


def _processor_chat_template(path: Path) -> str | None:
    """The processor's template of a checkpoint that keeps it apart (`chat_template.json`, as
    Qwen2-VL's and Qwen2.5-VL's do), which renders images; their tokenizer's, which
    transformers' tokenizer loads, is the text model's and cannot. vLLM prefers it too."""
    if (path / "chat_template.jinja").is_file() or not (path / "chat_template.json").is_file():
        return None
    template: str = json.loads((path / "chat_template.json").read_text())["chat_template"]
    return template


@dataclass(frozen=True)
class ChatOptions:
    """Frontend settings that shape requests."""

    policy: MediaPolicy
    default_max_tokens: int = 1024
    request_timeout_s: float = 300.0
    frontend_decoding: bool = False
    # Prompt and completion together; None: the model's max_position_embeddings (no limit if
    # the checkpoint names none).
    context_length: int | None = None
    # Budget of the cache of rendered prompts' token ids; 0 turns it off.
    token_cache_bytes: int = DEFAULT_TOKEN_CACHE_MIB << 20
    # Most items per prompt by modality (--limit-mm-per-prompt); a modality not named is
    # bounded by the policy's max_items alone.
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    # The operator's processor options (--mm-processor-kwargs): default pixel bounds that
    # requests may narrow, and the default video sampling.
    mm_processor_kwargs: MMProcessorKwargs | None = None
    # The operator's default video sampling rate (--media-io-kwargs).
    media_io_kwargs: MediaIoKwargs | None = None
    # What requests may ask of videos, and the caps on a video's headers (--max-video-*).
    video_caps: VideoCaps = field(default_factory=VideoCaps)
    # The longest audio clip a request may carry, from its headers (--max-audio-duration).
    max_audio_duration_s: float = DEFAULT_MAX_AUDIO_DURATION_S
    # image_embeds and audio_embeds parts are refused unless the operator allows them.
    enable_mm_embeds: bool = False
    # The most completions one request may ask for (`n`; vLLM has no such bound).
    max_n: int = DEFAULT_MAX_N
    # How tool calls are read from a completion under tool_choice auto (tool_parsers.py):
    # None is the format the chat template writes calls in, "none" no parser.
    tool_call_parser: str | None = None
    # The reasoning section's format (mmserve.reasoning); None: the text is not split.
    reasoning_parser: str | None = None
    # The longest a structured output's grammar may take to check (--grammar-compile-timeout).
    grammar_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S


MediaPart = (
    ImageUrlPart | VideoUrlPart | ImageEmbedsPart | InputAudioPart | AudioUrlPart | AudioEmbedsPart
)
EMBEDS_PARTS = (ImageEmbedsPart, AudioEmbedsPart)


@dataclass(frozen=True)
class _MediaRef:
    part: MediaPart
    param: str  # where the item sits in the request, for error messages

    @property
    def modality(self) -> media.Modality:
        if isinstance(self.part, InputAudioPart | AudioUrlPart | AudioEmbedsPart):
            return "audio"
        return "video" if isinstance(self.part, VideoUrlPart) else "image"

    @property
    def audio_format(self) -> str | None:
        """The format an input_audio part names (none for a clip named by its uuid)."""
        if isinstance(self.part, InputAudioPart) and self.part.input_audio is not None:
            return self.part.input_audio.format
        return None


@functools.cache
def _tokenizer_threads() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that render and tokenize prompts, one per core this process may run on:
    the work is CPU-bound, and more threads than cores only contend for the GIL (asyncio's
    default pool, which media fetches wait in, has cores + 4)."""
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=len(os.sched_getaffinity(0)), thread_name_prefix="mmserve-tokenize"
    )


class ChatPreprocessor:
    def __init__(
        self, model: ServedModel, options: ChatOptions, tensor_sink: TensorSink | None = None
    ) -> None:
        if options.frontend_decoding and tensor_sink is None:
            raise ValueError("frontend decoding needs a tensor sink to ship pixel_values")
        if options.enable_mm_embeds and tensor_sink is None:
            raise ValueError("--enable-mm-embeds needs a tensor sink to ship embeddings")
        self.model = model
        self.options = options
        self.template = TemplateFacts.of(model.tokenizer, model.chat_template)
        self.tool_call_parser = _tool_call_parser(options.tool_call_parser, self.template)
        self.reasoning = (
            None
            if options.reasoning_parser is None
            else ReasoningTokens.of(options.reasoning_parser, model.tokenizer)
        )
        self.pixel_range = PixelRange.of(model.spec, options.mm_processor_kwargs)
        self.pan_and_scan = PanAndScanRange.of(model.spec, options.mm_processor_kwargs)
        # None for a family whose videos the core does not plan: it refuses their parts.
        self.video_range = (
            VideoRange.of(
                model.spec,
                options.mm_processor_kwargs,
                options.media_io_kwargs,
                options.video_caps,
            )
            if model.spec.core.takes_video
            else None
        )
        # Whether a video's own audio track is served (`use_audio_in_video`).
        self.audio_in_video = model.spec.core.audio_in_video
        # The ids of the texts the driver writes into prompts, checked against the tokenizer.
        self.text_pieces = text_pieces(model.tokenizer, model.spec)
        self.media_ids = MediaIds()
        self.encoder = PromptEncoder(model.tokenizer.backend_tokenizer)
        self._tensor_sink = tensor_sink
        self._token_cache = (
            TokenCache(options.token_cache_bytes, message_boundary(model.tokenizer))
            if options.token_cache_bytes > 0
            else None
        )
        # (placeholder, what the family's processor writes in its place, and what it writes
        # for an image with pan-and-scan crops), if it pads it: the text part of the family's
        # prompt update, which joins the words around it (the core's `Spec`).
        self._image_text: tuple[str, str, str] | None = None
        core = model.spec.core
        if core.image_text_padding:
            placeholder = model.tokenizer.convert_ids_to_tokens(model.spec.vision_start_token_id)
            image = f"{core.image_text_padding}{placeholder}{core.image_text_padding}"
            self._image_text = (placeholder, image, core.panned_image_text + image)

    async def preprocess(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        deadline: float,
        tenant: str = "",
        grammar: Grammar | None = None,
    ) -> PreprocessedRequest:
        """The request for the first hop; `request` must have passed `validate`. `tenant`
        scopes the media ids the request names (`frontend.media_ids`); `grammar` is what its
        completion follows (`grammar_of`)."""
        items = _media_refs(request)
        if len(items) > self.options.policy.max_items:
            raise ApiError(
                "request.too_many_items",
                f"the request has {len(items)} media items; at most "
                f"{self.options.policy.max_items} are allowed",
                param="messages",
            )
        if (
            request.mm_processor_kwargs
            and request.mm_processor_kwargs.use_audio_in_video
            and not self.audio_in_video
        ):
            raise ApiError(
                ERROR_UNSUPPORTED_OPTION,
                f"mm_processor_kwargs.use_audio_in_video is not supported by this model "
                f"({self.model.spec.family}): it serves no video's own audio track",
                param="mm_processor_kwargs.use_audio_in_video",
            )
        counts = {"image": 0, "video": 0, "audio": 0}
        for ref in items:
            counts[ref.modality] += 1
        check_media_counts(self.options.limit_mm_per_prompt, counts)
        videos = counts["video"]
        bounds = self.pixel_range.bounds(request.mm_processor_kwargs)
        pan_and_scan = self.pan_and_scan.knobs_for(request.mm_processor_kwargs)
        video = None
        if self.video_range is not None and (
            videos or asks_video_options(request.mm_processor_kwargs, request.media_io_kwargs)
        ):
            # Checked even without a video, so an option out of bounds is always a 400.
            video = self.video_range.settings(request.mm_processor_kwargs, request.media_io_kwargs)
        known = self._recall(items, tenant)
        precomputed = await self._precomputed(items)
        loop = asyncio.get_running_loop()
        if items:
            token_ids, panned_ids = await loop.run_in_executor(
                _tokenizer_threads(), self._tokenize, request, pan_and_scan is not None
            )
            planned = await self._plan(
                token_ids, items, known, precomputed, bounds, video, pan_and_scan, panned_ids
            )
        else:  # nothing to fetch: the driver's run is CPU work like tokenizing, in the same hop
            planned = await loop.run_in_executor(_tokenizer_threads(), self._plan_text, request)
        plan = planned.plan
        max_tokens = self.completion_budget(
            _max_tokens(request), request.min_tokens, len(plan.token_ids)
        )
        grammar = after_reasoning(grammar, self.reasoning, plan.token_ids)
        payloads = await self._payloads(planned, known, precomputed, request_id)
        for item, source in zip(plan.media, planned.sources, strict=True):
            part = items[source].part
            if item.crop is not None:  # the uuid names the image, not its crops
                continue
            if isinstance(part, NAMED_PARTS) and part.uuid is not None and part.url is not None:
                self.media_ids.remember(tenant, part.uuid, KnownMedia(item.mm_hash, item.grid_thw))
        return PreprocessedRequest(
            request_id=request_id,
            deadline=deadline,
            model=self.model.name,
            plan=plan,
            payloads=payloads,
            sampling=sampling_params(request, grammar),
            stop=stop_rules(request, max_tokens),
        )

    def output_rules(self, request: ChatCompletionRequest, prompt_ids: list[int]) -> OutputRules:
        """How the request's completions are read: the reasoning split off (unless the request
        asks for it whole, SGLang's `separate_reasoning`), the calls its tool_choice asks
        for."""
        reasoning = self.reasoning if request.separate_reasoning else None
        mode = tool_mode(request)
        calls: Any = None
        if isinstance(mode, NamedToolChoice):
            calls = functools.partial(NamedCall, name=mode.function.name)
        elif mode == "required":
            calls = RequiredCalls
        elif mode == "auto" and request.tools and self.tool_call_parser == "qwen3_coder":
            calls = functools.partial(Qwen3CoderCalls, types=parameter_types(request))
        elif mode == "auto" and request.tools:
            calls = HermesCalls
        return OutputRules(
            reasoning=None if reasoning is None else reasoning.format,
            opening=Opening.EITHER if reasoning is None else reasoning.opening(prompt_ids),
            include_reasoning=request.include_reasoning,
            calls=calls,
            single_call=request.parallel_tool_calls is False,
        )

    async def grammar_of(self, request: StructuredOutputFields) -> Grammar | None:
        """The checked grammar of the request's structured-output form, if it has one."""
        return await request_grammar(request, self.options.grammar_compile_timeout_s)

    async def chat_grammar_of(self, request: ChatCompletionRequest) -> Grammar | None:
        """The checked grammar of a chat request: its tool_choice's (required or a named
        tool) or its structured-output form's; asking for both is refused."""
        grammar = tool_grammar(request)
        if grammar is None:
            return await self.grammar_of(request)
        await check_tool_grammar(request, grammar, self.options.grammar_compile_timeout_s)
        return grammar

    @property
    def context_length(self) -> int | None:
        return self.options.context_length or self.model.spec.max_position_embeddings

    def completion_budget(
        self, asked: int | None, min_tokens: int, prompt: int, prompt_param: str = "messages"
    ) -> int:
        """The request's max_tokens `asked` (the default where it gives none, shortened to
        what the context leaves after the `prompt` tokens; never below `min_tokens`); a prompt
        that leaves no room, or a max_tokens or min_tokens past it, is refused (the prompt
        named by `prompt_param`)."""
        budget = asked if asked is not None else max(self.options.default_max_tokens, min_tokens)
        limit = self.context_length
        if limit is None:
            return budget
        # The context must have room for the completion the client asked for, at least.
        needed, param = (asked, "max_tokens") if asked else (min_tokens, "min_tokens")
        if prompt >= limit or prompt + needed > limit:
            wanted = f"{prompt} tokens in the {prompt_param}" + (
                f" and {needed} in the completion" if needed else ""
            )
            raise ApiError(
                ERROR_CONTEXT_LENGTH_EXCEEDED,
                f"this model's context length is {limit} tokens; the request needs {wanted}",
                param=prompt_param if prompt >= limit else param,
            )
        return min(budget, limit - prompt)

    def validate(self, request: ChatCompletionRequest) -> None:
        """Cheap checks that need no media and no tokenizer (run before anything costly); the
        ranges of values are the request Struct's own constraints, checked while decoding."""
        self.check_common(request.model, request.min_tokens, _max_tokens(request))
        for item in _media_refs(request):
            if isinstance(item.part, NAMED_PARTS) and item.part.url is None is item.part.uuid:
                field = _MEDIA_FIELDS[type(item.part)]
                raise ApiError(
                    ERROR_INVALID_VALUE,
                    f"a {field} part needs its {field}, or the uuid of an item sent before",
                    param=item.param,
                )
        if not self.options.enable_mm_embeds:
            for item in _media_refs(request):
                if isinstance(item.part, EMBEDS_PARTS):
                    raise ApiError(
                        ERROR_EMBEDS_DISABLED,
                        f"{_MEDIA_FIELDS[type(item.part)]} parts are not accepted: the server "
                        "was started without --enable-mm-embeds",
                        param=item.param,
                    )
        self._validate_logprobs(request)
        self.check_logit_bias(request.logit_bias)
        self.check_n(request.n, request.best_of)
        self.check_supported(request.unsupported_options())
        self.template.check(request)
        check_tools(request, self.tool_call_parser)

    @staticmethod
    def check_supported(unsupported: list[str]) -> None:
        """Refuse the first option set to a value mmserve cannot honour, by name."""
        if unsupported:
            name = unsupported[0]
            raise ApiError(
                ERROR_UNSUPPORTED_OPTION,
                f"{name} cannot be set to this value: it is not supported",
                param=name,
            )

    def check_n(self, n: int, best_of: int | None) -> None:
        """At most `--max-n` completions, and `best_of` only equal to `n`."""
        if n > self.options.max_n:
            raise ApiError(
                ERROR_INVALID_VALUE,
                f"n must be at most {self.options.max_n} (the server's --max-n), got {n}",
                param="n",
            )
        if best_of is not None and best_of != n:
            raise ApiError(
                ERROR_UNSUPPORTED_OPTION,
                f"best_of cannot be {best_of}: only best_of equal to n ({n}) is served (every "
                "completion sampled is returned)",
                param="best_of",
            )

    @staticmethod
    def _validate_logprobs(request: ChatCompletionRequest) -> None:
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(
                ERROR_TOP_LOGPROBS_WITHOUT_LOGPROBS,
                "top_logprobs needs logprobs set to true",
                param="top_logprobs",
            )

    def check_common(self, model: str, min_tokens: int, max_tokens: int | None) -> None:
        """The checks chat and text completions share: the served model, min_tokens at most
        max_tokens."""
        if model != self.model.name:
            raise ApiError(
                ERROR_MODEL_NOT_FOUND,
                f"the model {model!r} does not exist; this server serves {self.model.name!r}",
                param="model",
            )
        if max_tokens is not None and min_tokens > max_tokens:
            raise ApiError(
                ERROR_MIN_TOKENS_OVER_MAX_TOKENS,
                f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})",
                param="min_tokens",
            )

    def check_logit_bias(self, logit_bias: dict[str, float] | None) -> None:
        """Each key a token id of the vocabulary (the values' range is the Struct's)."""
        vocab_size = self.model.spec.vocab_size
        for key in logit_bias or {}:
            if not key.isdecimal() or not key.isascii():
                raise ApiError(
                    ERROR_INVALID_VALUE,
                    f"logit_bias key {key!r} is not a token id (a decimal integer)",
                    param="logit_bias",
                )
            if not int(key) < vocab_size:
                raise ApiError(
                    ERROR_TOKEN_NOT_IN_VOCABULARY,
                    f"logit_bias key {key!r} is not a token id in [0, {vocab_size})",
                    param="logit_bias",
                )

    def _tokenize(
        self, request: ChatCompletionRequest, panned: bool = False
    ) -> tuple[list[int], list[int] | None]:
        """The prompt's ids, and with `panned` (pan-and-scan is on) its ids with every image
        written as the processor writes one with crops (the driver takes the text before
        each image that has them from there)."""
        from jinja2 import TemplateError

        messages = template_messages(request)
        try:
            text = self.model.apply_chat_template(
                messages,
                tools=template_tools(request),
                tokenize=False,
                add_generation_prompt=True,
                **(request.chat_template_kwargs or {}),
            )
        except TemplateError as err:
            raise ApiError(
                ERROR_CHAT_TEMPLATE, f"the model's chat template rejected the messages: {err}"
            ) from err
        if self._image_text is None:
            return self._cached_encode(text), None
        placeholder, image, panned_image = self._image_text
        panned_ids = (
            self._cached_encode(text.replace(placeholder, panned_image)) if panned else None
        )
        return self._cached_encode(text.replace(placeholder, image)), panned_ids

    def _cached_encode(self, text: str) -> list[int]:
        if self._token_cache is None:
            return self.encoder.encode(text)
        return self._token_cache.tokens(text, self.encoder.encode)

    def _recall(self, items: list[_MediaRef], tenant: str) -> dict[int, KnownMedia]:
        """The items named by their media id alone, by item index."""
        known = {}
        for index, item in enumerate(items):
            part = item.part
            if isinstance(part, NAMED_PARTS) and part.url is None and part.uuid is not None:
                media_item = self.media_ids.recall(tenant, part.uuid)
                if media_item is None:
                    raise ApiError(
                        ERROR_MEDIA_ID_UNKNOWN,
                        f"no {item.modality} was sent with uuid {part.uuid!r} under this API "
                        "key; send it with its uuid",
                        param=item.param,
                    )
                known[index] = media_item
        return known

    async def _precomputed(self, items: list[_MediaRef]) -> dict[int, PrecomputedImage]:
        """The request's precomputed embeddings by item index, read and checked (before the
        prompt is tokenized or any image fetched)."""
        budget = EmbedsBudget()
        spec, policy = self.model.spec, self.options.policy
        loaded = {}
        for index, item in enumerate(items):
            if isinstance(item.part, ImageEmbedsPart):
                loaded[index] = await load_image_embeds(item.part, spec, policy, item.param, budget)
            elif isinstance(item.part, AudioEmbedsPart):
                loaded[index] = await load_audio_embeds(item.part, spec, policy, item.param, budget)
        return loaded

    def _plan_text(self, request: ChatCompletionRequest) -> media.PlannedRequest:
        """Tokenize and plan a request without media, on the calling thread."""
        token_ids, _ = self._tokenize(request)
        return self.plan_tokens(token_ids)

    def plan_tokens(self, token_ids: list[int]) -> media.PlannedRequest:
        """The plan of a prompt without media, on the calling thread. Text goes through the
        driver too: it refuses a prompt that holds the image placeholder token."""
        policy = self.options.policy
        try:
            return media.plan_request_here(
                self.model.spec.core, token_ids, [], policy, count_only=True
            )
        except MediaError as err:
            raise ApiError.from_media_error(err, []) from err

    async def plan_prompt(self, token_ids: list[int] | None, text: str = "") -> RequestPlan:
        """The plan of a completion's prompt: `token_ids` as given, else `text` tokenized as
        vLLM tokenizes a completion's prompt (with the tokenizer's special tokens), in the
        tokenizer threads."""
        return (
            await asyncio.get_running_loop().run_in_executor(
                _tokenizer_threads(), self._plan_prompt, token_ids, text
            )
        ).plan

    def _plan_prompt(self, token_ids: list[int] | None, text: str) -> media.PlannedRequest:
        if token_ids is None:
            token_ids = self.encoder.encode(text, add_special_tokens=True)
        return self.plan_tokens(token_ids)

    async def _plan(
        self,
        token_ids: list[int],
        items: list[_MediaRef],
        known: dict[int, KnownMedia],
        precomputed: dict[int, PrecomputedImage],
        bounds: PixelBounds | None,
        video: media.VideoSettings | None,
        pan_and_scan: PanAndScanKnobs | None,
        panned_ids: list[int] | None,
    ) -> media.PlannedRequest:
        """The request plan, from one run of the Rust driver: it fetches each item once and
        keeps its bytes to ship on (or, with frontend decoding, preprocesses an image in full;
        a video is planned from its headers and its bytes ship on); an item named by its id
        alone, and a precomputed one, is planned from its identity and grid; with
        `pan_and_scan` an image it crops is followed by its crops (`panned_ids`: the prompt
        announcing them)."""
        decoding = self.options.frontend_decoding
        sources: list[str | bytes | media.Precomputed] = []
        for index, item in enumerate(items):
            part = item.part
            if isinstance(part, EMBEDS_PARTS) or part.url is None:
                facts = known.get(index) or precomputed[index]
                sources.append((facts.mm_hash, facts.grid_thw))
            else:
                sources.append(part.url)
        try:
            return await media.plan_request(
                self.model.spec.core,
                token_ids,
                sources,
                self.options.policy,
                count_only=not decoding,
                # A video's and a clip's bytes travel even with frontend decoding: the encoder
                # decodes them.
                keep_bytes=not decoding
                or video is not None
                or any(item.modality == "audio" for item in items),
                pixel_bounds=bounds,
                modalities=[item.modality for item in items],
                audio_formats=[item.audio_format for item in items],
                max_audio_duration_s=self.options.max_audio_duration_s,
                video=video,
                text_pieces=self.text_pieces,
                pan_and_scan=pan_and_scan,
                panned_input_ids=panned_ids,
            )
        except MediaError as err:
            raise ApiError.from_media_error(err, [item.param for item in items]) from err

    async def _payloads(
        self,
        planned: media.PlannedRequest,
        known: dict[int, KnownMedia],
        precomputed: dict[int, PrecomputedImage],
        request_id: str,
    ) -> list[MediaPayload]:
        """What the first hop reads for each item: with frontend decoding its pixels, else its
        encoded bytes, both by transfer (so a large item never meets the NATS payload limit);
        inline bytes only where no transfer sink is attached. Precomputed embeddings go by
        transfer too, ready for the language hop; an item named by its id alone carries
        nothing, and neither does a video's temporal group after its first (the encoder reads
        the video's bytes from that one)."""
        sink = self._tensor_sink
        payloads = []
        items = zip(planned.data, planned.pixel_values, planned.sources, strict=True)
        for data, pixel_values, index in items:
            if index in known:
                payloads.append(MediaPayload(state=ItemState.REUSE))
            elif index in precomputed and sink is not None:
                payloads.append(await _embeddings_payload(sink, request_id, precomputed[index]))
            elif pixel_values is not None and sink is not None:
                payloads.append(MediaPayload(pixel_values=await sink(request_id, pixel_values)))
            elif data is not None and sink is not None:
                array = np.frombuffer(data, dtype=np.uint8)
                payloads.append(MediaPayload(encoded=await sink(request_id, array)))
            else:
                payloads.append(MediaPayload(data=None if data is None else bytes(data)))
        return payloads


async def _embeddings_payload(
    sink: TensorSink, request_id: str, image: PrecomputedImage
) -> MediaPayload:
    aux = {}
    if image.deepstack is not None:
        aux[DEEPSTACK] = await sink(request_id, image.deepstack)
    handle = EmbeddingsHandle(embeddings=await sink(request_id, image.embeddings), aux=aux)
    return MediaPayload.precomputed(handle)


class SamplingFields(Protocol):
    """The token-choice fields chat and text completion requests share."""

    @property
    def temperature(self) -> float | None: ...
    @property
    def top_p(self) -> float | None: ...
    @property
    def top_k(self) -> int | None: ...
    @property
    def min_p(self) -> float | None: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def frequency_penalty(self) -> float | None: ...
    @property
    def presence_penalty(self) -> float | None: ...
    @property
    def repetition_penalty(self) -> float | None: ...
    @property
    def logit_bias(self) -> dict[str, float] | None: ...
    @property
    def n(self) -> int: ...


class StopFields(Protocol):
    """The fields of when a completion ends that chat and text completion requests share."""

    @property
    def stop(self) -> str | list[str] | None: ...
    @property
    def stop_token_ids(self) -> list[int] | None: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def min_tokens(self) -> int: ...
    @property
    def skip_special_tokens(self) -> bool: ...
    @property
    def include_stop_str_in_output(self) -> bool: ...


def stop_rules(request: StopFields, max_tokens: int) -> StopConditions:
    """When the request's completion ends, within `max_tokens`, and how its text ends."""
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    return StopConditions(
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=list(request.stop_token_ids or []),
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
    )


def sampling_params(
    request: ChatCompletionRequest, grammar: Grammar | None = None
) -> SamplingParams:
    """The request's token choice, OpenAI's defaults where it gives none; `logprobs` asks
    the engines for the chosen token's and `top_logprobs` more."""
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    return token_choice(request, logprobs, grammar=grammar)


def token_choice(
    request: SamplingFields,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    grammar: Grammar | None = None,
) -> SamplingParams:
    """A request's token choice, OpenAI's defaults where it gives none, the
    log-probabilities it asks of the engines, and the grammar its text follows."""
    return SamplingParams(
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=request.top_k or 0,
        min_p=request.min_p or 0.0,
        seed=request.seed,
        frequency_penalty=request.frequency_penalty or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        repetition_penalty=request.repetition_penalty or 1.0,
        logit_bias={int(key): value for key, value in (request.logit_bias or {}).items()},
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        n=request.n,
        grammar=grammar,
    )


def _max_tokens(request: ChatCompletionRequest) -> int | None:
    if request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens


# Each media part's field that holds its media, for error messages' `param`.
NAMED_PARTS = (ImageUrlPart, InputAudioPart, AudioUrlPart)
"""The parts that may name their item by a uuid (vLLM's media ids)."""

_MEDIA_FIELDS: dict[type, str] = {
    ImageUrlPart: "image_url",
    VideoUrlPart: "video_url",
    ImageEmbedsPart: "image_embeds",
    AudioEmbedsPart: "audio_embeds",
    InputAudioPart: "input_audio",
    AudioUrlPart: "audio_url",
}


def _media_refs(request: ChatCompletionRequest) -> list[_MediaRef]:
    """The request's media parts in prompt order (the order of the template's placeholders)."""
    refs = []
    for m, message in enumerate(request.messages):
        if isinstance(message.content, list):
            for p, part in enumerate(message.content):
                if not isinstance(part, TextPart):
                    field = _MEDIA_FIELDS[type(part)]
                    refs.append(_MediaRef(part, f"messages[{m}].content[{p}].{field}"))
    return refs


def _tool_call_parser(asked: str | None, template: TemplateFacts) -> str | None:
    """The tool-call parser in use: the one asked for, else the format the chat template
    writes calls in."""
    if asked is None:
        return template.tool_call_format
    return None if asked == "none" else asked
