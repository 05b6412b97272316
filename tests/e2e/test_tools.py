"""Reasoning output and tool calls through a real deployment: the tiny Qwen3.5, whose real
template opens `<think>` and asks for Qwen3-Coder's XML calls, served with `--reasoning-parser
qwen3`, under the official openai client.

A tiny model with random weights neither ends its reasoning nor writes calls by itself; these
tests make it do so with what any client may send: a `logit_bias` on `</think>` (the reasoning
then ends after a few tokens, a different number for each seed), and the grammars of
tool_choice required and named."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.deployment import Deployment

MODEL = "tiny-qwen3_5-seed0"
THINK_END = 248069  # Qwen3.5's </think>
ENDS_REASONING = {str(THINK_END): 10}


@pytest.fixture(scope="module")
def qwen3_5(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = Deployment(
        "agg",
        build_tiny_model("qwen3_5"),
        nats_url,
        tmp_path_factory.mktemp("tools-logs"),
        frontend_flags=["--reasoning-parser", "qwen3"],
    )
    with deployment.running():
        yield deployment


@pytest.fixture(scope="module")
def client(qwen3_5: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{qwen3_5.base_url}/v1", api_key="x", max_retries=0)


def _ask(client: openai.OpenAI, seed: int, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Think, then answer."}],
        max_tokens=24,
        seed=seed,
        logit_bias=ENDS_REASONING,
        **extra,
    )


@pytest.fixture(scope="module")
def thinking(client: openai.OpenAI) -> tuple[int, str]:
    """A seed whose completion reasons for a while, closes `</think>` (once: the bias may
    make it write the tag again in its answer, where it is text) and then answers, and that
    completion as the model wrote it (SGLang's `separate_reasoning: false`)."""
    for seed in range(16):
        raw = _ask(client, seed, extra_body={"separate_reasoning": False})
        text = raw.choices[0].message.content
        reasoning, _, answer = text.partition("</think>")
        if text.count("</think>") == 1 and reasoning.strip() and answer.strip():
            return seed, text
    raise AssertionError("no seed made the tiny model end its reasoning and answer")


def test_the_reasoning_is_split_from_the_answer_streamed_or_not(
    client: openai.OpenAI, thinking: tuple[int, str]
) -> None:
    seed, raw = thinking
    reasoning, _, answer = raw.partition("</think>")
    message = _ask(client, seed).choices[0].message
    assert message.model_extra["reasoning_content"] == reasoning.strip()
    assert message.model_extra["reasoning"] == reasoning.strip()  # vLLM's newer name
    assert message.content == answer.lstrip()
    assert "<think>" not in message.content and "</think>" not in message.content

    kinds, reasoning_parts, content_parts = [], [], []
    for chunk in _ask(client, seed, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            assert extra["reasoning"] == extra["reasoning_content"]
            kinds.append("reasoning")
            reasoning_parts.append(extra["reasoning_content"])
        if delta.content:
            kinds.append("content")
            content_parts.append(delta.content)
    assert "".join(reasoning_parts) == message.model_extra["reasoning_content"]
    assert "".join(content_parts) == message.content
    # Every reasoning delta comes before the first content delta, and there are several.
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)
    assert kinds.count("reasoning") > 1 and kinds.count("content") > 1


def test_include_reasoning_false_leaves_it_out(
    client: openai.OpenAI, thinking: tuple[int, str]
) -> None:
    seed, raw = thinking
    message = _ask(client, seed, extra_body={"include_reasoning": False}).choices[0].message
    assert "reasoning_content" not in (message.model_extra or {})
    assert message.content == raw.partition("</think>")[2].lstrip()


def test_with_thinking_off_the_completion_is_all_answer(client: openai.OpenAI) -> None:
    # The template closes an empty reasoning section in the prompt; the parser then reads
    # the whole completion as the answer, a </think> in it included.
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    message = _ask(client, 0, extra_body=off).choices[0].message
    raw = _ask(client, 0, extra_body={**off, "separate_reasoning": False}).choices[0].message
    assert "reasoning_content" not in (message.model_extra or {})
    assert message.content == raw.content
