"""schemathesis against the frontend's own `/openapi.json`, the way `st run` does it: every
phase (the document's examples, its boundaries and unsupported methods, random valid and
invalid requests) against `mmserve frontend`'s server over a one-token pipeline that puts each
request through the wire's encoding. Every answer must be documented (status, content type,
headers, body, each event of a stream), no request may get a 5xx, a request that breaks the
document must be refused, and one that follows it may be refused only for what a schema cannot
say (its media, the chat template, its length in tokens)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import jsonschema_rs
import pytest
import schemathesis
import uvloop
from schemathesis.engine import Status, events, from_schema

from mmserve.frontend.cli import serve
from mmserve.frontend.dispatch import Pipeline
from mmserve.protocol import PreprocessedRequest, TokenChunk, decode, encode
from mmserve.tiny.checkpoints import build_tiny_model
from tests.frontend.conftest import InlineTensorSink, parse_frontend_args
from tests.support.deployment import free_port

from .conftest import Trial
from .streams import MODEL
from .test_request_fuzz import _OneToken

# Generated requests per operation in the fuzzing phase; `MMSERVE_SCHEMATHESIS_EXAMPLES` sets
# it for a longer run outside CI.
EXAMPLES = int(os.environ.get("MMSERVE_SCHEMATHESIS_EXAMPLES", "150"))
CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    "unsupported_method",
    "refused_only_for_its_content",
]
# What a request that follows the document may still be refused for, besides its media (the
# core's `fetch.*`, `decode.*` and `request.*` codes): what no schema of one field can say.
REFUSABLE = (
    "chat_template",
    "context_length_exceeded",
    "min_tokens_over_max_tokens",
    "min_pixels_over_max_pixels",
    "top_logprobs_without_logprobs",
    "token_not_in_vocabulary",
)


@schemathesis.check
def refused_only_for_its_content(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> None:
    """A request the document allows gets a 200, or a 4xx naming what the document cannot."""
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return
    if response.status_code >= 400:
        code = response.json()["error"]["code"]
        assert "." in code or code in REFUSABLE, f"a valid request was refused: {response.text}"


class _OverTheWire(_OneToken):
    """The one-token pipeline, after the request went through the wire's msgpack encoding."""

    async def generate(self, request: PreprocessedRequest) -> AsyncIterator[TokenChunk]:
        async for chunk in super().generate(decode(encode(request), PreprocessedRequest)):
            yield chunk


@contextlib.asynccontextmanager
async def _pipeline(args: argparse.Namespace) -> AsyncIterator[Pipeline]:
    # The sink ships precomputed embeddings (image_embeds parts are on).
    yield Pipeline(_OverTheWire(), InlineTensorSink())


async def _serve_until_cancelled(args: argparse.Namespace) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        await serve(args, _pipeline)


@pytest.fixture(scope="module")
def frontend_url() -> Iterator[str]:
    """`mmserve frontend`'s own server (uvicorn with the CLI's settings) on a loopback port."""
    port = free_port()
    args = parse_frontend_args(
        build_tiny_model("qwen2_vl"),
        "--http-port",
        str(port),
        "--enable-mm-embeds",
        "--limit-mm-per-prompt",
        '{"image": 8}',
    )
    loop = uvloop.new_event_loop()
    server = loop.create_task(_serve_until_cancelled(args))
    thread = threading.Thread(target=loop.run_until_complete, args=(server,), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not _answers(url):
        assert thread.is_alive() and time.monotonic() < deadline, "the frontend did not start"
        time.sleep(0.05)
    yield url
    loop.call_soon_threadsafe(server.cancel)
    thread.join(timeout=10)
    loop.close()


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.TransportError):
        return httpx.get(url + "/health").status_code == 200
    return False


@pytest.fixture(scope="module")
def api(frontend_url: str) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_url(frontend_url + "/openapi.json")
    schema.config.update(workers=1)
    schema.config.generation.update(max_examples=EXAMPLES, deterministic=True)
    schema.config.checks.update(included_check_names=CHECKS)
    return schema


def _run(api: schemathesis.BaseSchema) -> tuple[dict[str, Counter[int]], list[str]]:
    """Runs every phase; the statuses answered per operation, and each failure or error."""
    statuses: dict[str, Counter[int]] = {}
    problems = []
    for event in from_schema(api).execute():
        if isinstance(event, events.NonFatalError | events.FatalError):
            problems.append(f"{type(event).__name__}: {event}")
        elif isinstance(event, events.EngineFinished):
            assert event.stop_reason == "completed", event.stop_reason
        recorder = getattr(event, "recorder", None)
        if recorder is None:
            continue
        seen = statuses.setdefault(recorder.label, Counter())
        for interaction in recorder.interactions.values():
            seen[interaction.response.status_code if interaction.response else 0] += 1
        for nodes in recorder.checks.values():
            problems += [
                f"{recorder.label} {node.name}: {node.failure_info.failure.message}\n"
                f"{node.failure_info.code_sample}"
                for node in nodes
                if node.status == Status.FAILURE and node.failure_info is not None
            ]
    return statuses, problems


def test_every_operation_follows_its_document(api: schemathesis.BaseSchema, trial: Trial) -> None:
    statuses, problems = _run(api)
    assert not problems, "\n\n".join(sorted(set(problems)))
    assert len(statuses) == 6 and all(sum(seen.values()) >= 10 for seen in statuses.values())
    for label, seen in sorted(statuses.items()):
        answers = ", ".join(f"{status}: {n}" for status, n in sorted(seen.items()))
        trial(f"schemathesis: {label} (all phases, derandomized)", sum(seen.values()),
              f"every answer documented and conforming ({answers}); no 5xx")  # fmt: skip


# Regressions of what the run found, each as the request that found it.


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [("TRACE", "/health", "GET"), ("POST", "/v1/models", "GET"), ("GET", "/v1/chat/completions",
     "POST")],
)  # fmt: skip
def test_a_405_names_the_allowed_method(frontend_url: str, method, path, allowed) -> None:
    response = httpx.request(method, frontend_url + path)
    assert response.status_code == 405
    assert response.headers["allow"] == allowed


def _chat_body(fields: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def _chat(api: schemathesis.BaseSchema, body: dict[str, Any]) -> schemathesis.Response:
    """The answer to `body`, validated by schemathesis against the document."""
    operation = api["/v1/chat/completions"]["POST"]
    return operation.Case(body=body, media_type="application/json").call_and_validate()


def test_stream_events_follow_the_document(api: schemathesis.BaseSchema) -> None:
    """Each event's `data` is a chunk as JSON or `[DONE]` (was: the chunk schema applied to
    the event itself)."""
    body = _chat_body({"stream": True, "stream_options": {"include_usage": True}})
    response = _chat(api, body)
    assert response.status_code == 200
    assert response.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize(
    "fields",
    [
        {"messages": []},
        {"n": 2},
        {"n": 2, "best_of": 2},
        {"n": 2, "best_of": 3},
        {"best_of": 1},
        {"best_of": 2},
        {"n": 17},
        {"presence_penalty": 0.5},
        {"logprobs": True},
        {"tools": [{"type": "function"}]},
        {"tool_choice": "none"},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"response_format": {"type": "json_object"}},
        {"temperature": 2.5},
        {"top_p": 0},
        {"max_tokens": 0},
        {"seed": 2**64},  # was: a 500, msgpack has no such integer
        {"top_k": 2**63},
        {"max_tokens": 1.0},  # was: refused, though JSON Schema's integers include it
        {"max_completion_tokens": 2e0, "seed": -1.0},
        {"n": 1, "presence_penalty": 0, "logprobs": False, "tools": [], "tool_choice": "auto"},
        {"mm_processor_kwargs": {"min_pixels": 3136, "max_pixels": 100_000}},
        {"mm_processor_kwargs": {"max_pixels": 10**12}},
        {"mm_processor_kwargs": {"do_resize": False}},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "uuid": None}]}]},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_embeds",
                            "image_embeds": {"image_embeds": "AAAA", "image_grid_thw": [1, 2]},
                        }
                    ],
                }
            ]
        },
    ],
)
def test_the_document_and_the_server_agree_on_a_request(
    api: schemathesis.BaseSchema, fields: dict[str, Any]
) -> None:
    """A request the document allows is served, one it forbids is refused (was: the document
    allowed empty messages, unsupported options and integers past 64 bits)."""
    body = _chat_body(fields)
    request_schema = {
        "$ref": "#/components/schemas/ChatCompletionRequest",
        "components": api.raw_schema["components"],
    }
    valid = jsonschema_rs.validator_for(request_schema).is_valid(body)
    assert _chat(api, body).status_code == (200 if valid else 400)
