"""The catalogue of error codes: every code a component answers with, its HTTP status, and what
it means. The Rust core owns its own codes (`<stage>.<kind>`, `MediaError.args[0]`), with their
statuses and meanings, and exports them as `_mm.error_catalogue()`; this module lists only the
codes Python raises, as constants, and merges the two.

A client's mistake is a 4xx; a fault of the deployment (a worker's bug, a broken config, a lost
peer) is a 5xx, never blamed on the client. A code missing from the catalogue is a 500.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve import _mm
from mmserve.protocol.wire import WireMessage


@dataclass(frozen=True)
class ErrorCode:
    code: str
    status: int
    meaning: str


# Between components.
ERROR_BAD_REQUEST = "bad_request"
ERROR_PAYLOAD_TOO_LARGE = "payload_too_large"
ERROR_UNAVAILABLE = "unavailable"
ERROR_DEADLINE_EXCEEDED = "deadline_exceeded"
ERROR_CANCELLED = "cancelled"
ERROR_DISCONNECTED = "disconnected"
ERROR_SLOW_CONSUMER = "slow_consumer"
ERROR_PROTOCOL = "protocol"
ERROR_INTERNAL = "internal"
# The HTTP edge.
ERROR_INVALID_JSON = "invalid_json"
ERROR_INVALID_VALUE = "invalid_value"
ERROR_UNSUPPORTED_OPTION = "unsupported_option"
ERROR_CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
ERROR_MIN_TOKENS_OVER_MAX_TOKENS = "min_tokens_over_max_tokens"
ERROR_TOP_LOGPROBS_WITHOUT_LOGPROBS = "top_logprobs_without_logprobs"
ERROR_TOKEN_NOT_IN_VOCABULARY = "token_not_in_vocabulary"
ERROR_MIN_PIXELS_OVER_MAX_PIXELS = "min_pixels_over_max_pixels"
ERROR_CHAT_TEMPLATE = "chat_template"
ERROR_INVALID_API_KEY = "invalid_api_key"
ERROR_MODEL_NOT_FOUND = "model_not_found"
ERROR_NOT_FOUND = "not_found"
ERROR_METHOD_NOT_ALLOWED = "method_not_allowed"
ERROR_BODY_TOO_LARGE = "body_too_large"
ERROR_INCOMPLETE = "incomplete"
ERROR_NO_WORKER = "no_worker"
ERROR_CACHE_RESET_FAILED = "cache_reset_failed"
# Media ids (a part's uuid).
ERROR_MEDIA_ID_UNKNOWN = "media_id.unknown"
ERROR_MEDIA_ID_GONE = "media_id.gone"
# Precomputed embeddings (image_embeds parts).
ERROR_EMBEDS_DISABLED = "embeds.disabled"
ERROR_EMBEDS_FORMAT = "embeds.format"
ERROR_EMBEDS_MISSING = "embeds.missing"
ERROR_EMBEDS_DTYPE = "embeds.dtype"
ERROR_EMBEDS_SHAPE = "embeds.shape"
ERROR_EMBEDS_VALUES = "embeds.values"
# Tools and the chat template's variables.
ERROR_TOOLS_SCHEMA = "tools.schema"
ERROR_TOOLS_DUPLICATE = "tools.duplicate_name"
ERROR_TOOLS_CHOICE = "tools.choice"
ERROR_TOOLS_ARGUMENTS = "tools.arguments"
ERROR_TEMPLATE_VARIABLE = "template.reserved_variable"
# Structured outputs (a request's grammar).
ERROR_GRAMMAR_INVALID = "grammar.invalid"
ERROR_GRAMMAR_UNSUPPORTED = "grammar.unsupported"
ERROR_GRAMMAR_TIMEOUT = "grammar.compile_timeout"

PYTHON_CODES: tuple[ErrorCode, ...] = (
    ErrorCode(ERROR_BAD_REQUEST, 400, "the request cannot be served as given"),
    ErrorCode(ERROR_PAYLOAD_TOO_LARGE, 413, "a message is over the NATS payload limit"),
    ErrorCode(ERROR_UNAVAILABLE, 503, "no instance can take the request now (none deployed, "
              "overloaded, or gone); retry later"),
    ErrorCode(ERROR_DEADLINE_EXCEEDED, 504, "the request's deadline passed"),
    ErrorCode(ERROR_CANCELLED, 499, "the caller gave up on the request"),
    ErrorCode(ERROR_DISCONNECTED, 503, "the connection to NATS or to the instance was lost"),
    ErrorCode(ERROR_SLOW_CONSUMER, 500, "a reader fell too far behind its stream"),
    ErrorCode(ERROR_PROTOCOL, 500, "a peer sent a message this side cannot read"),
    ErrorCode(ERROR_INTERNAL, 500, "a fault of the serving side; see its log"),
    ErrorCode(ERROR_INVALID_JSON, 400, "the request body is not valid JSON"),
    ErrorCode(ERROR_INVALID_VALUE, 400, "a request field has a wrong type or value"),
    ErrorCode(ERROR_UNSUPPORTED_OPTION, 400, "an OpenAI option mmserve does not implement is set"),
    ErrorCode(ERROR_CONTEXT_LENGTH_EXCEEDED, 400, "the prompt and completion exceed the context"),
    ErrorCode(ERROR_MIN_TOKENS_OVER_MAX_TOKENS, 400, "min_tokens is greater than max_tokens"),
    ErrorCode(ERROR_TOP_LOGPROBS_WITHOUT_LOGPROBS, 400, "top_logprobs is set without logprobs "
              "set to true"),
    ErrorCode(ERROR_TOKEN_NOT_IN_VOCABULARY, 400, "a token id (a logit_bias key, a prompt's id) "
              "is not in the model's vocabulary"),
    ErrorCode(ERROR_MIN_PIXELS_OVER_MAX_PIXELS, 400, "mm_processor_kwargs: min_pixels is greater "
              "than max_pixels"),
    ErrorCode(ERROR_CHAT_TEMPLATE, 400, "the model's chat template rejected the messages"),
    ErrorCode(ERROR_INVALID_API_KEY, 401, "the API key is missing or wrong"),
    ErrorCode(ERROR_MODEL_NOT_FOUND, 404, "the request names a model this server does not serve"),
    ErrorCode(ERROR_NOT_FOUND, 404, "no such path"),
    ErrorCode(ERROR_METHOD_NOT_ALLOWED, 405, "the HTTP method is not allowed on this path"),
    ErrorCode(ERROR_BODY_TOO_LARGE, 413, "the request body is over --max-request-body-bytes"),
    ErrorCode(ERROR_INCOMPLETE, 502, "the worker ended its stream without finishing"),
    ErrorCode(ERROR_NO_WORKER, 503, "no worker is reachable for the model; retry later"),
    ErrorCode(ERROR_CACHE_RESET_FAILED, 503, "some instances did not clear their caches (busy, "
              "failed, gone or timed out); the message names each"),
    ErrorCode(ERROR_MEDIA_ID_UNKNOWN, 400, "no media was sent under this uuid with this API key; "
              "send the item with its uuid"),
    ErrorCode(ERROR_MEDIA_ID_GONE, 400, "the deployment no longer holds the media of this uuid; "
              "send the item again with its uuid"),
    ErrorCode(ERROR_EMBEDS_DISABLED, 400, "image_embeds and audio_embeds parts need a server "
              "started with --enable-mm-embeds"),
    ErrorCode(ERROR_EMBEDS_FORMAT, 400, "the embedding is not a readable safetensors file or "
              ".npy array (pickled tensors are refused)"),
    ErrorCode(ERROR_EMBEDS_MISSING, 400, "a tensor the part needs (image_embeds, image_grid_thw) "
              "is not in it"),
    ErrorCode(ERROR_EMBEDS_DTYPE, 400, "the embedding's dtype is not float32, float16 or "
              "bfloat16"),
    ErrorCode(ERROR_EMBEDS_SHAPE, 400, "the embedding's shape does not fit the model's hidden "
              "size or the grid's token count (a clip's: the tokens a clip can make)"),
    ErrorCode(ERROR_EMBEDS_VALUES, 400, "the embedding holds NaN or infinite values"),
    ErrorCode(ERROR_TOOLS_SCHEMA, 400, "a tool's parameters are not a valid JSON Schema of an "
              "object (its arguments)"),
    ErrorCode(ERROR_TOOLS_DUPLICATE, 400, "two tools have one name"),
    ErrorCode(ERROR_TOOLS_CHOICE, 400, "tool_choice names a tool not in tools, or asks for "
              "calls without tools"),
    ErrorCode(ERROR_TOOLS_ARGUMENTS, 400, "an assistant message's tool call arguments are not a "
              "JSON object's text"),
    ErrorCode(ERROR_TEMPLATE_VARIABLE, 400, "chat_template_kwargs sets a name the server passes "
              "the template itself, or one of the template's functions"),
    ErrorCode(ERROR_GRAMMAR_INVALID, 400, "a structured output's JSON Schema, regex, EBNF "
              "grammar or choices cannot be compiled (the message says why)"),
    ErrorCode(ERROR_GRAMMAR_UNSUPPORTED, 400, "a JSON Schema uses a keyword or format the "
              "grammar engine would not enforce (the message names it and where)"),
    ErrorCode(ERROR_GRAMMAR_TIMEOUT, 400, "a structured output's grammar took longer to "
              "compile than --grammar-compile-timeout allows"),
)  # fmt: skip

CORE_CODES: tuple[ErrorCode, ...] = tuple(
    ErrorCode(code, status, meaning)
    for code, (status, meaning) in sorted(_mm.error_catalogue().items())
)


def _catalogue(*groups: tuple[ErrorCode, ...]) -> dict[str, ErrorCode]:
    """One lookup of every code; a code listed twice (Python's and the core's) is a bug."""
    merged: dict[str, ErrorCode] = {}
    for entry in (entry for group in groups for entry in group):
        if entry.code in merged:
            raise ValueError(f"error code {entry.code!r} is catalogued twice")
        merged[entry.code] = entry
    return merged


CATALOGUE: dict[str, ErrorCode] = _catalogue(PYTHON_CODES, CORE_CODES)


def http_status_for(code: str) -> int:
    """The HTTP status of an error code (500 for a code the catalogue does not list)."""
    entry = CATALOGUE.get(code)
    return entry.status if entry is not None else 500


class ErrorMessage(WireMessage, frozen=True):
    """A failure reported by the serving side; the caller raises it as `RemoteError`."""

    code: str
    message: str
    status: int = 500
    request_id: str = ""
    # The instance whose loss failed the call (it crashed, went silent past the idle timeout,
    # or stopped at its drain deadline), where one did: a caller that holds the client's
    # stream migrates the request away from it. Empty for every other failure.
    lost_instance: str = ""
