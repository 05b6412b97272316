"""Dynamo's preprocessed requests (as its 1.6.1 frontend sends them, recorded from one) to
mmserve's types, mmserve's token chunks to Dynamo's output dicts, and a prefill worker's KV
handover through Dynamo's prefill router to a decode worker."""

from __future__ import annotations

import json

import pytest

from mmserve import protocol
from mmserve.dynamo import requests
from mmserve.protocol import (
    FirstToken,
    PrefillDone,
    TensorHandle,
    TokenChunk,
    TokenLogprob,
    Usage,
)
from mmserve.runtime import RemoteError

# A request Dynamo 1.6.1's frontend sent for a chat with one image (the data URL shortened).
RECORDED = {
    "model": "tiny",
    "token_ids": [151644, 872, 198, 151652, 151655, 151653, 151645, 198, 151644, 77091, 198],
    "multi_modal_data": {"image_url": [{"Url": "data:image/png;base64,iVBORw0KGgo="}]},
    "stop_conditions": {
        "max_tokens": 3,
        "stop": None,
        "stop_token_ids": None,
        "stop_token_ids_hidden": [151645, 151643],
        "min_tokens": None,
        "ignore_eos": None,
    },
    "sampling_options": {
        "n": None,
        "best_of": None,
        "presence_penalty": None,
        "frequency_penalty": None,
        "repetition_penalty": None,
        "temperature": 0.0,
        "top_p": None,
        "top_k": None,
        "min_p": None,
        "seed": None,
        "guided_decoding": None,
    },
    "eos_token_ids": [151645, 151643],
}


def test_a_recorded_request_translates() -> None:
    assert requests.token_ids(RECORDED) == RECORDED["token_ids"]
    assert requests.image_sources(RECORDED) == ["data:image/png;base64,iVBORw0KGgo="]
    sampling = requests.sampling(RECORDED)
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.0, 1.0, 0)
    stop = requests.stop_conditions(RECORDED, default_max_tokens=99)
    assert (stop.max_tokens, stop.stop_token_ids, stop.ignore_eos, stop.min_tokens) == (
        3,
        [],
        False,
        0,
    )
    # Stop strings stay with Dynamo's detokenizer.
    assert stop.stop == []


def test_defaults_where_dynamo_sends_none() -> None:
    bare = {"token_ids": [1, 2]}
    assert requests.sampling(bare).temperature == 1.0
    assert requests.stop_conditions(bare, default_max_tokens=77).max_tokens == 77
    assert requests.image_sources(bare) == []


@pytest.mark.parametrize(
    ("request_", "refusal"),
    [
        ({"token_ids": []}, "no token_ids"),
        ({"token_ids": [1], "multi_modal_data": {"video_url": [{"Url": "x"}]}}, "video_url"),
        ({"token_ids": [1], "multi_modal_data": {"image_url": [{"Decoded": {}}]}}, "Decoded"),
        (
            {
                "token_ids": [1],
                "sampling_options": {"guided_decoding": {"regex": "a", "choice": ["b"]}},
            },
            "exactly one of json, regex, choice, grammar, json_object; it sets regex and choice",
        ),
        (
            {"token_ids": [1], "sampling_options": {"guided_decoding": {"choice": [3]}}},
            "guided_decoding.choice",
        ),
        (
            {"token_ids": [1], "sampling_options": {"guided_decoding": {"json": "{x"}}},
            "not valid JSON",
        ),
        (
            {
                "token_ids": [1],
                "sampling_options": {"guided_decoding": {"regex": "a", "whitespace_pattern": " "}},
            },
            "guided_decoding.whitespace_pattern is not supported",
        ),
        ({"token_ids": [1], "sampling_options": {"n": 17}}, r"n must be an integer in \[1, 16\]"),
        ({"token_ids": [1], "sampling_options": {"n": 2, "best_of": 3}}, "best_of must equal n"),
        ({"token_ids": [1], "output_options": {"logprobs": 21}}, r"logprobs must lie in \[0, 20\]"),
        ({"token_ids": [1], "output_options": {"logprobs": -1}}, "logprobs must lie"),
        ({"token_ids": [1], "output_options": {"logprobs": True}}, "logprobs must be an integer"),
        # Dynamo's wire for vLLM's prompt_logprobs=-1 (the whole vocabulary): u32::MAX.
        ({"token_ids": [1], "output_options": {"prompt_logprobs": 2**32 - 1}}, "prompt_logprobs"),
    ],
)
def test_what_the_worker_cannot_serve_is_refused_by_name(request_: dict, refusal: str) -> None:
    with pytest.raises(requests.RequestRefused, match=refusal):
        requests.token_ids(request_)
        requests.image_sources(request_)
        requests.sampling(request_)


@pytest.mark.parametrize(
    ("guided", "grammar"),
    [
        # response_format json_schema and guided_json, as Dynamo 1.6.1's frontend sent them
        (
            {"json": {"type": "integer"}},
            protocol.Grammar(kind="json_schema", spec='{"type":"integer"}'),
        ),
        # response_format json_object
        (
            {"json": {"type": "object"}},
            protocol.Grammar(kind="json_schema", spec='{"type":"object"}'),
        ),
        ({"regex": "a+", "backend": None}, protocol.Grammar(kind="regex", spec="a+")),
        ({"choice": ["x", "y"]}, protocol.Grammar(kind="choice", spec='["x", "y"]')),
        ({"grammar": 'root ::= "a"'}, protocol.Grammar(kind="ebnf", spec='root ::= "a"')),
        (None, None),
    ],
)
def test_guided_decoding_is_the_requests_grammar(guided, grammar) -> None:
    assert requests.sampling({"sampling_options": {"guided_decoding": guided}}).grammar == grammar


def test_neutral_values_of_unimplemented_options_pass() -> None:
    options = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "n": 1}
    assert requests.sampling({"sampling_options": options}).temperature == 1.0


def test_n_choices_are_one_stream_whose_outputs_carry_each_choices_index() -> None:
    """Dynamo forwards `n` and reads each output's `index`, as its vLLM worker answers."""
    assert requests.sampling({"sampling_options": {"n": 3, "best_of": 3}}).n == 3
    assert requests.sampling({"sampling_options": {"n": None}}).n == 1
    outputs = requests.Outputs()
    first = outputs.of(TokenChunk(request_id="r", token_ids=[4], index=2))
    assert (first["index"], first["token_ids"]) == (2, [4])
    assert requests.Outputs().of(TokenChunk(request_id="r", token_ids=[5]))["index"] == 0


def test_the_penalties_dynamo_forwards_are_honoured() -> None:
    options = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": -1.0}
    sampling = requests.sampling({"sampling_options": {**options, "min_p": 0.1}})
    assert (sampling.repetition_penalty, sampling.presence_penalty) == (1.3, 0.5)
    assert (sampling.frequency_penalty, sampling.min_p) == (-1.0, 0.1)


def test_the_log_probability_counts_dynamo_asks_for_are_the_engines_top_counts() -> None:
    # Dynamo's chat: `top_logprobs` (1 for `logprobs: true` alone); completions: `logprobs`;
    # `prompt_logprobs` from either.
    for top in (0, 1, 3, 20):
        sampling = requests.sampling({"output_options": {"logprobs": top, "prompt_logprobs": top}})
        assert (sampling.logprobs, sampling.prompt_logprobs) == (top, top)
    sampling = requests.sampling(
        {"output_options": {"logprobs": None, "skip_special_tokens": True}}
    )
    assert (sampling.logprobs, sampling.prompt_logprobs) == (None, None)
    assert requests.sampling({}).logprobs is None


def test_each_tokens_log_probabilities_go_out_as_dynamos_llm_engine_output() -> None:
    chunk = TokenChunk(
        request_id="r",
        token_ids=[5, 9],
        logprobs=[
            TokenLogprob(5, -0.25, top=[(5, -0.25), (7, -1.5)]),
            TokenLogprob(9, float("-inf"), top=[(3, -0.5), (4, -0.75)]),
        ],
    )
    out = requests.Outputs().of(chunk)
    # One entry per token id, by position (Dynamo zips them with `token_ids`); the token's
    # text left to Dynamo's detokenizer.
    assert out["log_probs"] == [-0.25, requests.MIN_FINITE_LOGPROB]
    assert out["top_logprobs"] == [
        [
            {"rank": 1, "token_id": 5, "token": None, "logprob": -0.25},
            {"rank": 2, "token_id": 7, "token": None, "logprob": -1.5},
        ],
        [
            {"rank": 1, "token_id": 3, "token": None, "logprob": -0.5},
            {"rank": 2, "token_id": 4, "token": None, "logprob": -0.75},
        ],
    ]
    json.dumps(out, allow_nan=False)  # what Dynamo's serde_json can read
    # `top_logprobs: 0`: the chosen token's logprob, an empty list of others per token.
    bare = requests.Outputs().of(
        TokenChunk(request_id="r", token_ids=[5], logprobs=[TokenLogprob(5, -1.0)])
    )
    assert (bare["log_probs"], bare["top_logprobs"]) == ([-1.0], [[]])
    # None asked for: neither field.
    assert requests.Outputs().of(TokenChunk(request_id="r", token_ids=[5])).keys() == {
        "index",
        "token_ids",
    }


def test_the_prompts_log_probabilities_go_out_on_the_last_output() -> None:
    scored = [TokenLogprob(11, -2.0, top=[(12, -0.5), (11, -2.0)], rank=2), TokenLogprob(13, -0.1)]
    outputs = requests.Outputs()
    first = outputs.of(TokenChunk(request_id="r", token_ids=[5], prompt_logprobs=scored))
    assert "engine_data" not in first
    last = outputs.of(TokenChunk(request_id="r", token_ids=[6], finish_reason="stop"))
    # Dynamo's PromptLogprobs (vLLM's form): None for the first prompt token, then per position
    # token id (as a JSON key) -> logprob and rank.
    assert last["engine_data"] == {
        "prompt_logprobs": [
            None,
            {"12": {"logprob": -0.5, "rank": 1}, "11": {"logprob": -2.0, "rank": 2}},
            {"13": {"logprob": -0.1}},
        ]
    }


def test_the_last_chunk_carries_finish_reason_and_usage() -> None:
    assert requests.Outputs().of(TokenChunk(request_id="r", token_ids=[5])) == {
        "index": 0,
        "token_ids": [5],
    }
    last = TokenChunk(
        request_id="r",
        token_ids=[6],
        finish_reason="length",
        usage=Usage(prompt_tokens=10, completion_tokens=2, cached_tokens=8),
    )
    assert requests.Outputs().of(last) == {
        "index": 0,
        "token_ids": [6],
        "finish_reason": "length",
        "completion_usage": {
            "prompt_tokens": 10,
            "completion_tokens": 2,
            "total_tokens": 12,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
    }


def test_dynamos_image_hashes_are_read_one_per_image() -> None:
    request = {"extra_args": {"mm_hashes": ["f9705e0cf5a21391", "0000000000000001"]}}
    assert requests.routing_mm_hashes(request, images=2) == [0xF9705E0CF5A21391, 1]
    assert requests.routing_mm_hashes(request, images=1) is None
    assert requests.routing_mm_hashes({"extra_args": {"mm_hashes": ["zz"]}}, images=1) is None
    assert requests.routing_mm_hashes({}, images=0) is None


def test_a_prefill_handover_reaches_decode_through_dynamos_json() -> None:
    handle = TensorHandle(shape=(2, 3), dtype="bfloat16", backend="shm", descriptor=b"\x00\xffk")
    done = PrefillDone(
        request_id="r",
        first_tokens=[FirstToken(7)],
        prompt_tokens=40,
        cached_tokens=16,
        kv={"keys": handle},
    )
    output = requests.prefill_output(done)
    # No tokens and no finish reason: Dynamo's router takes either for the request's end.
    assert output["token_ids"] == [] and "finish_reason" not in output
    # Dynamo's router keeps `disaggregated_params` as a JSON value and hands it on.
    params = json.loads(json.dumps(output["disaggregated_params"]))
    request = {"token_ids": [1], "prefill_result": {"disaggregated_params": params}}
    assert requests.prefill_handover(request) == done


@pytest.mark.parametrize(
    "request_",
    [{"token_ids": [1]}, {"token_ids": [1], "prefill_result": {"disaggregated_params": {}}}],
)
def test_a_decode_request_without_an_mmserve_handover_is_a_protocol_error(
    request_: dict,
) -> None:
    with pytest.raises(RemoteError) as raised:
        requests.prefill_handover(request_)
    assert raised.value.code == protocol.ERROR_PROTOCOL


@pytest.mark.parametrize(
    ("prompt_end", "start_after"),
    [([198, 151667, 198], 151668), ([151667, 271, 151668, 271], None), ([77091, 198], None)],
)
def test_with_dynamos_reasoning_parser_a_grammar_starts_after_the_reasoning(
    prompt_end: list[int], start_after: int | None
) -> None:
    # Qwen3-VL's and Qwen3.5's tags: <think> 151667, </think> 151668. A prompt that opens the
    # reasoning has the grammar wait for its end (the JSON then lands in what Dynamo's parser
    # reads as the answer); one that closed it (thinking off), or never opened it, not.
    from mmserve.dynamo.handler import Translator
    from mmserve.reasoning import REASONING_PARSERS, ReasoningTokens

    reasoning = ReasoningTokens(REASONING_PARSERS["qwen3"], 151667, 151668)
    request = {
        **RECORDED,
        "token_ids": [151644, 872, 198, 151645, 198, 151644, 77091, *prompt_end],
        "sampling_options": {"guided_decoding": {"json": {"type": "object"}}},
    }
    sent = Translator("tiny", 16, reasoning=reasoning).as_sent(request, _Signal())
    assert sent.sampling.grammar is not None
    assert sent.sampling.grammar.start_after == start_after


class _Signal:
    """Dynamo's context as the translator reads it here: the request's id."""

    def id(self) -> str:
        return "r"

    def is_stopped(self) -> bool:
        return False

    def is_killed(self) -> bool:
        return False

    def async_killed_or_stopped(self) -> None:
        return None
