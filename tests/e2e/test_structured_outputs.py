"""Structured outputs through real deployments (agg, EP/D, E/PD, E/P/D on the tiny Qwen2-VL,
hf engine): JSON Schema outputs validate, streamed and not, with `n` > 1, and every pattern
answers what the aggregated one answers for the same seed (the decode worker rebuilds each
choice's matcher past the prefill's first token); regex, choice and EBNF outputs match whole; a
grammar with an image routes and caches as without one; instructor and LangChain get validated
objects; a grammar whose compile runs past the worker's timeout is the client's 400, and the
next request is served."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from typing import Any, Literal

import instructor
import openai
import pytest
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field, SecretStr

from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.deployment import Deployment, all_running
from tests.support.schemas import random_schema, validates

PATTERNS = ["agg", "ep_d", "e_pd", "e_p_d"]
MODEL = "tiny-qwen2_vl-seed0"
# A grammar past this takes the worker's timeout: the tests' own grammars compile in a tenth of
# it or less (an ordinary schema in 0.03 s, fifty properties in 0.5 s, on CI's 2 cores).
WORKER_COMPILE_TIMEOUT_S = "2"
SCHEMAS = [random_schema(4)]
QUESTION: list[Any] = [{"role": "user", "content": "Describe the harbour as JSON."}]


class Boat(BaseModel):
    name: str = Field(max_length=8)
    length: int = Field(ge=1, le=99)
    kind: Literal["sail", "motor"]
    tags: list[Literal["red", "old", "fast"]] = Field(max_length=2)


@pytest.fixture(scope="module")
def deployments(
    nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Deployment]]:
    model = build_tiny_model("qwen2_vl")
    log_dir = tmp_path_factory.mktemp("structured")
    started = {
        pattern: Deployment(
            pattern,
            model,
            nats_url,
            log_dir,
            transfer="nixl" if pattern == "e_p_d" else "shm",
            worker_flags=["--grammar-compile-timeout", WORKER_COMPILE_TIMEOUT_S],
        )
        for pattern in PATTERNS
    }
    with all_running(list(started.values())):
        yield started


def _client(deployment: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{deployment.base_url}/v1", api_key="unused", max_retries=0)


def _response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def _chat(deployment: Deployment, messages: list, **fields: Any) -> list[tuple[str, str]]:
    """Each choice's text and finish reason, answered whole."""
    response = _client(deployment).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=400, **fields
    )
    return [(c.message.content or "", c.finish_reason) for c in response.choices]


def _streamed(deployment: Deployment, messages: list, **fields: Any) -> list[tuple[str, str]]:
    """Each choice's text and finish reason, from its stream's deltas."""
    stream = _client(deployment).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=400, stream=True, **fields
    )
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index, "")
    return [(texts[i], finishes[i]) for i in sorted(texts)]


def test_json_schema_outputs_validate_and_every_pattern_gives_the_aggregated_ones(
    deployments: dict[str, Deployment],
) -> None:
    answers: dict[str, list] = {}
    for pattern, deployment in deployments.items():
        answers[pattern] = []
        for schema in SCHEMAS:
            fields = {"response_format": _response_format(schema), "n": 2, "seed": 7}
            whole = _chat(deployment, QUESTION, temperature=1.0, **fields)
            assert _streamed(deployment, QUESTION, temperature=1.0, **fields) == whole, pattern
            for text, finish in whole:
                assert finish == "stop" and validates(schema, text), (pattern, text)
            answers[pattern].append(whole)
    assert all(each == answers["agg"] for each in answers.values()), answers


@pytest.mark.parametrize(
    ("fields", "matches"),
    [
        ({"extra_body": {"guided_regex": r"[A-Z][a-z]{2,6} \d{2}"}}, r"[A-Z][a-z]{2,6} \d{2}"),
        (
            {"extra_body": {"structured_outputs": {"choice": ["calm", "rough", "stormy sea"]}}},
            r"calm|rough|stormy sea",
        ),
        (
            {"extra_body": {"guided_grammar": 'root ::= "wind " [1-9] " from " ("N" | "S")'}},
            r"wind [1-9] from [NS]",
        ),
    ],
)
def test_regex_choice_and_ebnf_outputs_match_whole_in_every_pattern(
    deployments: dict[str, Deployment], fields: dict[str, Any], matches: str
) -> None:
    answers = {
        pattern: _chat(deployment, QUESTION, temperature=0.0, **fields)
        for pattern, deployment in deployments.items()
    }
    ((text, finish),) = answers["agg"]
    assert finish == "stop" and re.fullmatch(matches, text), text
    assert all(each == answers["agg"] for each in answers.values()), answers
    completion = _client(deployments["e_p_d"]).completions.create(
        model=MODEL, prompt="The sea today:", max_tokens=50, temperature=0, **fields
    )
    assert re.fullmatch(matches, completion.choices[0].text)


def test_a_grammar_with_an_image_routes_and_caches_as_before(
    deployments: dict[str, Deployment], image_server: str, image_gets: Counter[str]
) -> None:
    """The same image request twice: the second reuses the prefix the first cached (its
    image's tokens included), each fetches the image once, and the answers are the same
    in every pattern."""
    messages: list[Any] = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": f"{image_server}/tall.png"}},
                {"type": "text", "text": "The boat in the picture, as JSON."},
            ],
        }
    ]
    fields: dict[str, Any] = {
        "response_format": _response_format(Boat.model_json_schema()),
        "temperature": 0.0,
    }
    answers = {}
    for pattern, deployment in deployments.items():
        before = image_gets["/tall.png"]
        first = _client(deployment).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=200, **fields
        )
        again = _client(deployment).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=200, **fields
        )
        assert image_gets["/tall.png"] - before == 2, pattern
        assert first.usage is not None and again.usage is not None
        details = again.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens, pattern
        assert first.usage.prompt_tokens > 64  # the image's tokens
        text = first.choices[0].message.content or ""
        Boat.model_validate_json(text)
        assert again.choices[0].message.content == text
        answers[pattern] = text
    assert len(set(answers.values())) == 1, answers


def test_instructor_and_langchain_get_validated_objects(
    deployments: dict[str, Deployment],
) -> None:
    agg = deployments["agg"]
    client = instructor.from_openai(_client(agg), mode=instructor.Mode.JSON_SCHEMA)
    boat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, response_model=Boat, max_tokens=200, max_retries=0
    )
    assert isinstance(boat, Boat)
    llm = ChatOpenAI(
        base_url=f"{agg.base_url}/v1",
        api_key=SecretStr("unused"),
        model=MODEL,
        temperature=0,
        max_retries=0,
    )
    structured = llm.with_structured_output(Boat, method="json_schema")
    assert isinstance(structured.invoke([HumanMessage("A boat, as JSON.")]), Boat)


def test_a_grammar_past_the_workers_compile_timeout_is_a_400_and_the_next_request_is_served(
    deployments: dict[str, Deployment],
) -> None:
    """The frontend's check needs no tokenizer and passes it; the worker's compile of a string
    of up to 600 characters runs past its 2 s timeout (it takes about 4 s on CI's 2 cores, and
    longer on a busier machine; the compile goes on in its thread, so the test asks for no more
    than it needs): 400 `grammar.compile_timeout`, the request ends, and the worker serves the
    next one."""
    for pattern in ("agg", "e_p_d"):
        hostile = {
            "type": "object",
            "properties": {"a": {"type": "string", "maxLength": 600 + len(pattern)}},
            "required": ["a"],
        }
        with pytest.raises(openai.BadRequestError) as refused:
            _chat(deployments[pattern], QUESTION, response_format=_response_format(hostile))
        assert refused.value.code == "grammar.compile_timeout", refused.value.body
        served = _chat(deployments[pattern], QUESTION, extra_body={"guided_choice": ["ok"]})
        assert served == [("ok", "stop")]


@pytest.fixture(scope="module")
def mock_agg(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = Deployment.mock_agg(nats_url, tmp_path_factory.mktemp("structured-mock"))
    deployment.worker_flags += ["--mock-decode-ms-per-token", "0"]
    with deployment.running():
        yield deployment


class Note(BaseModel):
    """Any JSON object validates (every field has a default): what JSON mode can promise."""

    title: str = "untitled"
    count: int = 0


def test_instructors_json_mode_gets_a_validated_object_on_the_mock_engine(
    mock_agg: Deployment,
) -> None:
    """instructor's JSON mode asks for any JSON object (the schema goes in the prompt, which a
    random-weight model cannot read); the mock engine's tokens follow the grammar and end
    soon, so the object comes back parsed and validated."""
    client = instructor.from_openai(_client(mock_agg), mode=instructor.Mode.JSON)
    note = client.chat.completions.create(
        model=MODEL, messages=QUESTION, response_model=Note, max_tokens=400, max_retries=0
    )
    assert isinstance(note, Note)
