"""The trained default model answers questions about generated scenes right in every pattern.

Equal tokens across patterns (test_patterns.py) cannot tell an image that arrived from one that
was dropped or scrambled the same way everywhere; right answers can. The questions are the kind
the shipped model answers at its target accuracy (colour and count, docs/models.md), and
two-image questions in both orders, each asked about images whose answers differ, so an image
dropped, swapped between requests (16 at once) or between the two images of one request, or
scrambled in transfer gives a wrong answer.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from PIL import Image

from mmserve.models.family import model_class, resolve_model_spec
from mmserve.tiny import scenes
from mmserve.tiny.trained import build_trained_model
from tests.support.deployment import Deployment
from tests.support.images import png_data_url

PATTERNS = ["agg", "ep_d", "e_pd", "e_p_d"]
CONCURRENT = 16


def _messages(images: tuple[Image.Image, ...], text: str) -> list[dict]:
    parts: list[dict] = [
        {"type": "image_url", "image_url": {"url": png_data_url(i)}} for i in images
    ]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


async def _ask(client: openai.AsyncOpenAI, model: str, images: tuple, text: str) -> str:
    response = await client.chat.completions.create(
        model=model,
        messages=_messages(images, text),  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
    )
    assert response.choices[0].finish_reason == "stop"
    return response.choices[0].message.content or ""


def _pair(kind: str, text: str) -> tuple[scenes.Question, scenes.Question]:
    """The first two held-out questions of `kind` asking `text`, with different answers."""
    found = [q for q in (scenes.question(kind, seed) for seed in range(100)) if q.text == text]
    second = next(q for q in found if q.answer != found[0].answer)
    return found[0], second


def _colour_question(seed: int) -> scenes.Question:
    return scenes.question("colour", seed)


async def _check(client: openai.AsyncOpenAI, model: str) -> None:
    # The same question about two images: two right answers, for each shape, and for a count.
    texts = [("colour", scenes.COLOUR_TEXT.format(shape=shape)) for shape in scenes.SHAPES]
    for kind, text in [*texts, ("count", scenes.COUNT_TEXT.format(shape="square"))]:
        for question in _pair(kind, text):
            got = await _ask(client, model, question.images, question.text)
            assert got == question.answer, (question.text, question.answer, got)
    # Two images in one request, in both orders: an image swapped with the other one of its
    # request gives the other image's answer.
    for seed in (0, 1):  # a colour pair and a word pair
        pair = scenes.held_out_pair(seed)
        for swapped in (False, True):
            question = pair.ask(0, swapped)
            got = await _ask(client, model, question.images, question.text)
            assert got == question.answer, (question.text, swapped, question.answer, got)
    # Many requests at once, each with its own image: each answer is its own image's.
    questions = [_colour_question(100 + i) for i in range(CONCURRENT)]
    assert len({q.answer for q in questions}) > 3
    got = await asyncio.gather(*(_ask(client, model, q.images, q.text) for q in questions))
    assert got == [q.answer for q in questions]


async def _sampled(client: openai.AsyncOpenAI, model: str) -> list[tuple[str, list[float]]]:
    """Two seeded, penalised completions of one prompt with their logprobs, non-streamed and
    streamed: the same either way, their tokens' bytes their texts."""
    question = _colour_question(7)
    options: dict[str, Any] = {
        "model": model,
        "messages": _messages(question.images, question.text),
        "max_tokens": 6,
        "temperature": 0.8,
        "seed": 11,
        "n": 2,
        "frequency_penalty": 0.5,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": {"ignore_eos": True, "repetition_penalty": 1.1},
    }
    response = await client.chat.completions.create(**options)
    assert [choice.index for choice in response.choices] == [0, 1]
    assert response.usage is not None and response.usage.completion_tokens == 2 * 6
    stream = await client.chat.completions.create(**options, stream=True)
    streamed = [c.choices[0] async for c in stream if c.choices]
    sampled = []
    for choice in response.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        content = choice.logprobs.content
        assert len(content) == 6
        # The content leaves special tokens out (the EOS the request ignores); their logprobs
        # stay.
        said = [entry for entry in content if not entry.token.startswith("<|")]
        raw = b"".join(bytes(entry.bytes or []) for entry in said)
        assert raw.decode("utf-8", errors="replace") == choice.message.content
        for entry in content:
            assert len(entry.top_logprobs) == 3
            values = [top.logprob for top in entry.top_logprobs]
            assert values == sorted(values, reverse=True) and entry.logprob <= 0
        mine = [c for c in streamed if c.index == choice.index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        entries = [e for c in mine if c.logprobs for e in c.logprobs.content or []]
        assert [e.token for e in entries] == [e.token for e in content]
        sampled.append((choice.message.content or "", [entry.logprob for entry in content]))
    assert sampled[0] != sampled[1]  # one prompt, two draws
    return sampled


# lm-eval's loglikelihood requests: (context, continuation) pairs.
SCORED = [
    (
        "The scene shows coloured circles, squares and triangles on a plain background. "
        "What colour is the circle in the picture on the left of the scene?",
        " red",
    ),
    (
        "How many squares are there in this picture of coloured shapes? Count each of the "
        "squares once, whatever its colour and size. There are",
        " two",
    ),
    ("The word in block letters is", " CAT"),
]


def _direct_logprobs(model_path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """log_softmax of transformers' own logits at every position of each prompt."""
    family = resolve_model_spec(model_path).family
    model = model_class(family).from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [
            torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
            for ids in prompts
        ]


async def _scored(
    client: openai.AsyncOpenAI, model: str, prompts: list[list[int]]
) -> list[list[float]]:
    """lm-eval's `local-completions` loglikelihood call, with max_tokens 1 and 0, each
    after the prompts' prefixes are in the prefix cache: each prompt's token_logprobs (the
    first None), the same in both calls and in vLLM's prompt_logprobs; the continuation's
    tokens each the greedy one's (the top alternative) where the model says so."""
    for _ in range(2):  # the prompts' blocks into the prefix cache
        warm = await client.completions.create(model=model, prompt=prompts, max_tokens=1)
    assert warm.usage is not None and warm.usage.prompt_tokens_details is not None
    assert warm.usage.prompt_tokens_details.cached_tokens
    results = []
    for max_tokens in (1, 0):
        response = await client.completions.create(
            model=model,
            prompt=prompts,  # type: ignore[arg-type]
            echo=True,
            logprobs=1,
            max_tokens=max_tokens,
            temperature=0,
            seed=1234,
            extra_body={"prompt_logprobs": 1},
        )
        assert [choice.index for choice in response.choices] == list(range(len(prompts)))
        assert response.usage is not None
        assert response.usage.prompt_tokens == sum(len(ids) for ids in prompts)
        assert response.usage.completion_tokens == max_tokens * len(prompts)
        details = response.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens == 0  # the prompts ran whole
        scored: list[list[float]] = []
        for ids, choice in zip(prompts, response.choices, strict=True):
            logprobs = choice.logprobs
            assert logprobs is not None and logprobs.top_logprobs is not None
            assert logprobs.token_logprobs is not None
            assert len(logprobs.token_logprobs) == len(ids) + max_tokens
            assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
            assert choice.finish_reason == "length"
            values = [float(value) for value in logprobs.token_logprobs[1 : len(ids)]]
            vllm = choice.model_extra["prompt_logprobs"]
            assert vllm[0] is None and len(vllm) == len(ids)
            for position, token in enumerate(ids[1:], start=1):
                entry = vllm[position][str(token)]
                assert entry["logprob"] == pytest.approx(values[position - 1], abs=1e-6)
                best = max(logprobs.top_logprobs[position].values())
                assert (entry["rank"] == 1) == (best == values[position - 1])
            scored.append(values)
        results.append(scored)
    assert results[0] == results[1]
    return results[0]


def test_every_pattern_answers_about_its_images(nats_url: str, tmp_path: Path) -> None:
    model_path = build_trained_model()
    deployments = [
        # E/P/D moves embeddings and KV caches over NIXL, the others over shared memory.
        Deployment(p, model_path, nats_url, tmp_path, transfer="nixl" if p == "e_p_d" else "shm")
        for p in PATTERNS
    ]

    tokenizer = transformers_tokenizer(model_path)
    contexts = [tokenizer.encode(context) for context, _ in SCORED]
    prompts = [tokenizer.encode(context + rest) for context, rest in SCORED]
    direct = _direct_logprobs(model_path, prompts)

    async def check_all() -> None:
        sampled = {}
        for deployment in deployments:
            deployment.wait_ready()
            client = openai.AsyncOpenAI(base_url=f"{deployment.base_url}/v1", api_key="unused")
            async with client:
                try:
                    await _check(client, model_path.name)
                    sampled[deployment.pattern] = await _sampled(client, model_path.name)
                    scored = await _scored(client, model_path.name, prompts)
                    _check_scored(scored, prompts, contexts, direct)
                except AssertionError as error:
                    pytest.fail(f"{deployment.pattern}: {error}")
        # A seed samples the same tokens, with the same logprobs, in every pattern.
        for pattern, choices in sampled.items():
            for (text, logprobs), (agg_text, agg_logprobs) in zip(
                choices, sampled["agg"], strict=True
            ):
                assert text == agg_text, pattern
                assert logprobs == pytest.approx(agg_logprobs, abs=1e-4), pattern

    try:
        for deployment in deployments:
            deployment.start()
        asyncio.run(check_all())
    finally:
        for deployment in deployments:
            deployment.stop()


def transformers_tokenizer(model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _check_scored(
    scored: list[list[float]],
    prompts: list[list[int]],
    contexts: list[list[int]],
    direct: list[torch.Tensor],
) -> None:
    """Every prompt position's log-probability is the model's own (1e-4), and the
    continuation's sum is the loglikelihood."""
    for ids, context, values, expected in zip(prompts, contexts, scored, direct, strict=True):
        assert ids[: len(context)] == context
        want = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(torch.tensor(values), want, atol=1e-4, rtol=0)
        continuation = sum(values[len(context) - 1 :])
        assert continuation == pytest.approx(float(want[len(context) - 1 :].sum()), abs=1e-3)
