"""The OpenAPI 3.1 document of the HTTP API, generated from the protocol's msgspec Structs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from mmserve import __version__
from mmserve.protocol import (
    COMPLETION_DEFAULT_ONLY_OPTIONS,
    DEFAULT_ONLY_OPTIONS,
    PAN_AND_SCAN_OPTIONS,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
    OpenAIError,
)
from mmserve.protocol.openai import DEFAULT_MAX_N

if TYPE_CHECKING:
    from mmserve.frontend.mm_options import PanAndScanRange, VideoRange

_REF = "#/components/schemas/{name}"


def _ref(struct: type) -> dict[str, str]:
    return {"$ref": _REF.format(name=struct.__name__)}


def _error_responses(*statuses: int) -> dict[str, Any]:
    reasons = {
        400: "Invalid request: malformed JSON, wrong types, unsupported option, bad media",
        401: "Missing or wrong API key",
        404: "Unknown model",
        413: "Request body or a media item too large",
        500: "Internal error (see the server log)",
        502: "The worker ended the stream without finishing",
        503: "No worker is reachable",
        504: "The request deadline passed",
    }
    return {
        str(status): {
            "description": reasons[status],
            "content": {"application/json": {"schema": _ref(OpenAIError)}},
        }
        for status in statuses
    }


def _restrict_chat_request(
    schema: dict[str, Any], model: str, default_only: dict[str, tuple[Any, ...]]
) -> None:
    """Narrows a request's schema to what the server accepts: the served model only, and the
    options it does not implement (`default_only`) only at their defaults, `logit_bias` keyed
    by token ids."""
    properties = schema["properties"]
    properties["model"] |= {
        "enum": [model],
        "description": "The served model, as `GET /v1/models` lists it; any other answers 404",
    }
    for name, accepted in default_only.items():
        properties[name] |= {
            "enum": list(accepted),
            "description": "Not implemented: accepted only at its default",
        }
    # msgspec's schema leaves out the keys' form: each a token id, written in decimal.
    for variant in properties["logit_bias"]["anyOf"]:
        if variant.get("type") == "object":
            variant["propertyNames"] = {"pattern": "^[0-9]+$"}


# The structured-output options mmserve does not implement, by the Struct that holds them.
_UNSUPPORTED_STRUCTURED = {
    "StructuredOutputs": ("whitespace_pattern", "structural_tag"),
    "ChatCompletionRequest": ("guided_whitespace_pattern",),
    "CompletionRequest": ("guided_whitespace_pattern",),
}


def _restrict_structured_outputs(components: dict[str, Any]) -> None:
    """The structured-output options that are not implemented only unset (that a request sets
    at most one form, `StructuredOutputs` says in words)."""
    for struct, names in _UNSUPPORTED_STRUCTURED.items():
        for name in names:
            components[struct]["properties"][name] = {
                "type": "null",
                "default": None,
                "description": "Not implemented: accepted only unset",
            }


def _restrict_audio_in_video(components: dict[str, Any]) -> None:
    """A model that serves no video's own audio track: `use_audio_in_video` only unset or
    false."""
    components["MMProcessorKwargs"]["properties"]["use_audio_in_video"] = {
        "enum": [None, False],
        "default": None,
        "description": "Not supported by this model: accepted only unset or false",
    }


def _restrict_choices(schema: dict[str, Any], max_n: int) -> None:
    """`n` up to the server's `--max-n`, and `best_of` unset or equal to `n` (one variant per
    `n`: JSON Schema cannot compare two fields)."""
    schema["properties"]["n"]["maximum"] = max_n
    unset = {"not": {"required": ["n"]}, "properties": {"best_of": {"enum": [None, 1]}}}
    schema["anyOf"] = [unset] + [
        {"required": ["n"], "properties": {"n": {"const": n}, "best_of": {"enum": [None, n]}}}
        for n in range(1, max_n + 1)
    ]


_TOKEN_IDS = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
    "minItems": 1,
}
_TEXT = {"type": "string", "minLength": 1}


def _restrict_completion_request(schema: dict[str, Any]) -> None:
    """A prompt is one of its four forms, none empty (ids outside the vocabulary answer
    `token_not_in_vocabulary`); `max_tokens` 0 needs `echo`."""
    schema["properties"]["prompt"] = {
        "description": schema["properties"]["prompt"]["description"],
        "oneOf": [
            _TEXT,
            {"type": "array", "items": _TEXT, "minItems": 1},
            _TOKEN_IDS,
            {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
        ],
    }
    schema["if"] = {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}}
    schema["then"] = {"required": ["echo"], "properties": {"echo": {"const": True}}}


def _restrict_pixel_bounds(
    schema: dict[str, Any], pixels: tuple[int, int], video: VideoRange | None
) -> None:
    """Each of `mm_processor_kwargs`' bounds lies inside the server's (`pixels`); that the
    minimum is not above the maximum no schema of one field can say."""
    low, high = pixels
    frames = ""
    if video is not None:
        frames = f"; for video frames, in [{video.base.min_pixels}, {video.base.max_pixels}]"
    for name in ("min_pixels", "max_pixels"):
        schema["properties"][name] = {
            "anyOf": [{"type": "integer", "minimum": low, "maximum": high}, {"type": "null"}],
            "default": None,
            "description": f"In [{low}, {high}], this server's image pixel bounds{frames}",
        }


def _restrict_video_sampling(schemas: list[dict[str, Any]], video: VideoRange | None) -> None:
    """The video options lie inside the server's bounds (`--max-video-fps`,
    `--max-video-frames`); without video, the options are ignored."""
    for schema in schemas:
        for name, prop in schema["properties"].items():
            if name not in ("fps", "num_frames", "min_frames", "max_frames"):
                continue
            if video is None:
                prop["description"] = "Ignored: this model takes no video"
                continue
            default = getattr(video.default, name)
            limit = video.max_fps if name == "fps" else video.max_frames
            (number,) = (kind for kind in prop["anyOf"] if kind.get("type") != "null")
            number["maximum"] = limit
            prop["description"] = (
                f"Video sampling, at most {limit:g} (default: {default}); fps and num_frames "
                "exclude each other"
            )


def _restrict_pan_and_scan(schema: dict[str, Any], pan_and_scan: PanAndScanRange | None) -> None:
    """Gemma 3's pan-and-scan options: at most the server's crops per image; for a model
    that does not pan and scan, ignored."""
    for name, prop in schema["properties"].items():
        if name not in PAN_AND_SCAN_OPTIONS:
            continue
        if pan_and_scan is None or not pan_and_scan.supported:
            prop["description"] = "Ignored: this model does not pan and scan"
            continue
        prop["description"] = "Gemma 3's pan-and-scan, as its image processor names it"
        if name == "pan_and_scan_max_num_crops":
            (number,) = (kind for kind in prop["anyOf"] if kind.get("type") != "null")
            number["maximum"] = pan_and_scan.max_num_crops
            prop["description"] += f"; at most {pan_and_scan.max_num_crops}"


def _require_media_or_uuid(schema: dict[str, Any], field: str) -> None:
    """A media part names its item by its `field` (a URL, a clip's bytes), or by the uuid of
    one sent before."""
    schema["anyOf"] = [
        {"required": [field], "properties": {field: {"not": {"type": "null"}}}},
        {"required": ["uuid"], "properties": {"uuid": {"type": "string"}}},
    ]


def _stream_event(chunk: type) -> dict[str, Any]:
    """One server-sent event of a streamed completion of `chunk`s, as its fields (`data`,
    `event`, ...): an event stream's schema describes each event, as OpenAPI 3.2's
    `itemSchema` does."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "description": f"A {chunk.__name__} as JSON; OpenAI's error JSON when the "
                "stream fails after it started; `[DONE]` last",
                "type": "string",
                "if": {"const": "[DONE]"},
                "else": {
                    "contentMediaType": "application/json",
                    "contentSchema": {"anyOf": [_ref(chunk), _ref(OpenAIError)]},
                },
            }
        },
    }


def _completion_operation(
    summary: str, operation_id: str, request: type, response: type, chunk: type
) -> dict[str, Any]:
    """A POST route that answers `response`, or with `stream: true` events of `chunk`s."""
    return {
        "post": {
            "summary": summary,
            "operationId": operation_id,
            # A key is needed only when the server sets one.
            "security": _SECURITY,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {
                "200": {
                    "description": "The completion; with `stream: true`, server-sent events "
                    f"each carrying a {chunk.__name__}, then `data: [DONE]`",
                    "content": {
                        "application/json": {"schema": _ref(response)},
                        "text/event-stream": {"schema": _stream_event(chunk)},
                    },
                },
                **_error_responses(400, 401, 404, 413, 500, 502, 503, 504),
            },
        }
    }


_SECURITY: list[dict[str, list[str]]] = [{"bearer": []}, {}]


def _health(status: str, description: str) -> dict[str, Any]:
    properties: dict[str, Any] = {"status": {"const": status}}
    if status != "ok":
        properties["reason"] = {"type": "string"}
    schema = {"type": "object", "required": list(properties), "properties": properties}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def openapi_document(
    model: str,
    pixels: tuple[int, int],
    video: VideoRange | None = None,
    pan_and_scan: PanAndScanRange | None = None,
    max_n: int = DEFAULT_MAX_N,
    audio_in_video: bool = False,
) -> dict[str, Any]:
    """The document of a server that serves `model` with images resized within `pixels`
    (min_pixels, max_pixels), videos sampled within `video` (None: no video), images
    panned and scanned within `pan_and_scan` (None: not at all), at most `max_n`
    completions a request, and a video's own audio track if `audio_in_video`."""
    (_, components) = msgspec.json.schema_components(
        [
            ChatCompletionRequest,
            ChatCompletionResponse,
            ChatCompletionChunk,
            CompletionRequest,
            CompletionResponse,
            ModelList,
            OpenAIError,
        ],
        ref_template=_REF,
    )
    _restrict_chat_request(components["ChatCompletionRequest"], model, DEFAULT_ONLY_OPTIONS)
    _restrict_chat_request(components["CompletionRequest"], model, COMPLETION_DEFAULT_ONLY_OPTIONS)
    _restrict_completion_request(components["CompletionRequest"])
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        _restrict_choices(components[request], max_n)
    _restrict_pixel_bounds(components["MMProcessorKwargs"], pixels, video)
    _restrict_video_sampling([components["MMProcessorKwargs"], components["VideoIoKwargs"]], video)
    _restrict_pan_and_scan(components["MMProcessorKwargs"], pan_and_scan)
    for part, field in (
        ("ImageUrlPart", "image_url"),
        ("InputAudioPart", "input_audio"),
        ("AudioUrlPart", "audio_url"),
    ):
        _require_media_or_uuid(components[part], field)
    _restrict_structured_outputs(components)
    if not audio_in_video:
        _restrict_audio_in_video(components)
    security = _SECURITY
    return {
        "openapi": "3.1.0",
        "info": {"title": "mmserve OpenAI-compatible API", "version": __version__},
        "paths": {
            "/v1/chat/completions": _completion_operation(
                "Create a chat completion (text, images and videos)",
                "createChatCompletion",
                ChatCompletionRequest,
                ChatCompletionResponse,
                ChatCompletionChunk,
            ),
            "/v1/completions": _completion_operation(
                "Create a text completion (OpenAI's legacy completions, vLLM's prompt logprobs)",
                "createCompletion",
                CompletionRequest,
                CompletionResponse,
                CompletionResponse,
            ),
            "/v1/models": {
                "get": {
                    "summary": "List the served models",
                    "operationId": "listModels",
                    "security": security,
                    "responses": {
                        "200": {
                            "description": "The served models",
                            "content": {"application/json": {"schema": _ref(ModelList)}},
                        },
                        **_error_responses(401),
                    },
                }
            },
            "/reset_prefix_cache": {
                "post": {
                    "summary": "Clear every worker's prefix and encoder caches (vLLM's endpoint)",
                    "operationId": "resetPrefixCache",
                    "security": security,
                    "responses": {
                        "200": {"description": "Every worker cleared its caches (empty body)"},
                        **_error_responses(401, 503),
                    },
                }
            },
            "/health": {
                "get": {
                    "summary": "Ready when a full path to a worker exists",
                    "operationId": "health",
                    "responses": {
                        "200": _health("ok", "Ready"),
                        "503": _health("unavailable", "Not ready; `reason` says why"),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics (text exposition format)",
                    "operationId": "metrics",
                    "responses": {
                        "200": {
                            "description": "Metrics",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
        },
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
