"""The OpenAPI 3.1 document of the HTTP API, generated from the protocol's msgspec Structs."""

from __future__ import annotations

from typing import Any

import msgspec

from mmserve import __version__
from mmserve.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ModelList,
    OpenAIError,
)

_REF = "#/components/schemas/{name}"


def _ref(struct: type) -> dict[str, str]:
    return {"$ref": _REF.format(name=struct.__name__)}


def _error_responses(*statuses: int) -> dict[str, Any]:
    reasons = {
        400: "Invalid request: malformed JSON, wrong types, unsupported option, bad media",
        401: "Missing or wrong API key",
        404: "Unknown model",
        413: "Request body or a media item too large",
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


def openapi_document() -> dict[str, Any]:
    (_, components) = msgspec.json.schema_components(
        [
            ChatCompletionRequest,
            ChatCompletionResponse,
            ChatCompletionChunk,
            ModelList,
            OpenAIError,
        ],
        ref_template=_REF,
    )
    security = [{"bearer": []}, {}]  # a key is needed only when the server sets one
    return {
        "openapi": "3.1.0",
        "info": {"title": "mmserve OpenAI-compatible API", "version": __version__},
        "paths": {
            "/v1/chat/completions": {
                "post": {
                    "summary": "Create a chat completion (text and images)",
                    "operationId": "createChatCompletion",
                    "security": security,
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref(ChatCompletionRequest)}},
                    },
                    "responses": {
                        "200": {
                            "description": "The completion; with `stream: true`, server-sent "
                            "events each carrying a ChatCompletionChunk, then `data: [DONE]`",
                            "content": {
                                "application/json": {"schema": _ref(ChatCompletionResponse)},
                                "text/event-stream": {"schema": _ref(ChatCompletionChunk)},
                            },
                        },
                        **_error_responses(400, 401, 404, 413, 503, 504),
                    },
                }
            },
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
            "/health": {
                "get": {
                    "summary": "Ready when a full path to a worker exists",
                    "operationId": "health",
                    "responses": {
                        "200": {"description": "Ready"},
                        "503": {"description": "Not ready; the body gives the reason"},
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
