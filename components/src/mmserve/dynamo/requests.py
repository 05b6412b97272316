"""Dynamo's preprocessed request (a dict, as its frontend sends it to a `ModelInput.Tokens`
backend) to mmserve's types, and mmserve's token chunks to Dynamo's output dicts.

What the frontend sends (Dynamo 1.6.1): `token_ids` (the chat template's prompt with one image
placeholder per image), `stop_conditions` {max_tokens, stop, stop_token_ids,
stop_token_ids_hidden (the EOS ids), min_tokens, ignore_eos}, `sampling_options` {temperature,
top_p, top_k, seed, ...}, `output_options` {logprobs, prompt_logprobs, ...} and for images
`multi_modal_data` {"image_url": [{"Url": url}]} in prompt order. Stop strings stay with
Dynamo: its own detokenizer matches them on the tokens this worker streams.

Log-probabilities (Dynamo 1.6.1's `LLMEngineOutput`, lib/llm/src/protocols/common/llm_backend.rs):
`output_options.logprobs` is the top count the frontend asks for (chat: `top_logprobs`, or 1
when the client sets `logprobs: true` alone; completions: `logprobs`), and each output answers
with `log_probs` (the chosen tokens' logprobs, one per token id) and `top_logprobs` (one list
per token id of {rank, token_id, token, logprob}, rank from 1, most likely first). The worker
leaves `token` null: Dynamo's backend operator decodes each id with the model's tokenizer, as
it does for SGLang's workers. Dynamo's delta generators zip the lists with `token_ids` by
position, so each chunk carries exactly one entry per token. `output_options.prompt_logprobs`
(chat's and completions' `prompt_logprobs`) is answered on the last output, in
`engine_data.prompt_logprobs` (vLLM's form, Dynamo's `PromptLogprobs`): Dynamo's chat puts it
in the response's `prompt_logprobs`, its completions only in `nvext.prompt_logprobs`, for a
client that lists it in `nvext.extra_fields`.

`sampling_options.n` (1..16, `protocol.openai.DEFAULT_MAX_N`; Dynamo itself refuses n > 1 at
temperature 0) reaches the worker too, and is answered as Dynamo's vLLM worker answers it: one
stream whose outputs carry each choice's `index`, each choice ending with its own finish reason.
The prompt is planned, encoded and prefilled once for all choices (the role core's `n`).

Structured outputs: Dynamo's frontend forwards OpenAI's `response_format` and vLLM's older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (chat and completions) as
`sampling_options.guided_decoding`, vLLM's shape: one of `json` (`response_format` of type
`json_object` arrives as the schema `{"type": "object"}`), `regex`, `choice`, `grammar`, beside
`backend` (ignored: xgrammar serves) and `whitespace_pattern` (refused). It becomes the request's
`Grammar` (compact JSON, mmserve's default), which the engines enforce; the grammar is checked
when the engine compiles it, so a bad one is the client's 400. (Dynamo 1.6.1's frontend itself
refuses vLLM's `structured_outputs`.)

With prefill and decode workers apart, Dynamo's prefill router sends the request first to a
prefill worker with `max_tokens` 1, reads the `disaggregated_params` of its first output (and
the rest of its stream), and sends the request on to a decode worker with those params in
`prefill_result.disaggregated_params`: here, mmserve's KV handover (`PrefillDone`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec

from mmserve import protocol
from mmserve.grammar.base import GrammarError
from mmserve.grammar.forms import CONSTRAINTS, constraint_grammar
from mmserve.protocol import (
    Grammar,
    PrefillDone,
    SamplingParams,
    StopConditions,
    TokenChunk,
    TokenLogprob,
)
from mmserve.protocol.openai import DEFAULT_MAX_N
from mmserve.runtime import RemoteError

IMAGE_URL = "image_url"
MAX_LOGPROBS = 20  # mmserve's engines' (and OpenAI's) most top log-probabilities
# What a non-finite logprob goes to Dynamo as (its vLLM worker's clamp): JSON has no -inf, and
# the frontend would drop the chunk's logprobs on the null serde_json makes of one.
MIN_FINITE_LOGPROB = -1e30
# Dynamo's media keys this worker does not take: refused by name rather than dropped.
OTHER_MEDIA = ("video_url", "audio_url")


class RequestRefused(ValueError):
    """A request this worker cannot serve as sent (a 400 for the client)."""


def sampling(request: Mapping[str, Any]) -> SamplingParams:
    """mmserve's sampling of a request: Dynamo's `sampling_options`, and the top counts of its
    `output_options.logprobs` and `output_options.prompt_logprobs` (each 0..20)."""
    options = request.get("sampling_options") or {}
    n = _choices(options)
    outputs = request.get("output_options") or {}
    temperature = options.get("temperature")
    return SamplingParams(
        temperature=1.0 if temperature is None else float(temperature),
        top_p=float(options.get("top_p") or 1.0),
        top_k=int(options.get("top_k") or 0),
        min_p=float(options.get("min_p") or 0.0),
        seed=options.get("seed"),
        frequency_penalty=float(options.get("frequency_penalty") or 0.0),
        presence_penalty=float(options.get("presence_penalty") or 0.0),
        repetition_penalty=float(options.get("repetition_penalty") or 1.0),
        n=n,
        logprobs=_top_count(outputs.get("logprobs"), "logprobs"),
        prompt_logprobs=_top_count(outputs.get("prompt_logprobs"), "prompt_logprobs"),
        grammar=grammar(options.get("guided_decoding")),
    )


def grammar(guided: Any) -> Grammar | None:
    """The grammar of Dynamo's `guided_decoding` (None: free text)."""
    if not guided:
        return None
    if not isinstance(guided, dict):
        raise RequestRefused(f"guided_decoding must be an object, got {str(guided)[:100]}")
    for unsupported in ("whitespace_pattern", "structural_tag"):
        if guided.get(unsupported) is not None:
            raise RequestRefused(f"guided_decoding.{unsupported} is not supported")
    given = [key for key in CONSTRAINTS if guided.get(key) not in (None, False)]
    if len(given) != 1:
        raise RequestRefused(
            f"guided_decoding must set exactly one of {', '.join(CONSTRAINTS)}; it sets "
            f"{' and '.join(given) or 'none'}"
        )
    try:
        return constraint_grammar(given[0], guided[given[0]])
    except GrammarError as err:
        raise RequestRefused(f"guided_decoding.{given[0]}: {err}") from None


def _choices(options: Mapping[str, Any]) -> int:
    """The request's `n` (1..`DEFAULT_MAX_N`); `best_of` only equal to it, as mmserve's
    frontend takes them."""
    n = options.get("n") or 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= DEFAULT_MAX_N:
        raise RequestRefused(f"n must be an integer in [1, {DEFAULT_MAX_N}], got {n!r}")
    best_of = options.get("best_of")
    if best_of is not None and best_of != n:
        raise RequestRefused(f"best_of must equal n ({n}) here, got {best_of!r}")
    return n


def _top_count(value: Any, name: str) -> int | None:
    """A count of top log-probabilities as mmserve's engines take it (0..20), None for none."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestRefused(f"{name} must be an integer, got {value!r}")
    if not 0 <= value <= MAX_LOGPROBS:
        raise RequestRefused(f"{name} must lie in [0, {MAX_LOGPROBS}], got {value}")
    return value


def stop_conditions(request: Mapping[str, Any], default_max_tokens: int) -> StopConditions:
    conditions = request.get("stop_conditions") or {}
    max_tokens = conditions.get("max_tokens")
    return StopConditions(
        max_tokens=default_max_tokens if max_tokens is None else int(max_tokens),
        stop_token_ids=list(conditions.get("stop_token_ids") or []),
        ignore_eos=bool(conditions.get("ignore_eos")),
        min_tokens=int(conditions.get("min_tokens") or 0),
    )


def token_ids(request: Mapping[str, Any]) -> list[int]:
    ids = request.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise RequestRefused(
            "the request has no token_ids: serve this worker behind a frontend "
            "that tokenizes (ModelInput.Tokens)"
        )
    return [int(token) for token in ids]


def image_sources(request: Mapping[str, Any]) -> list[str]:
    """The images' URLs in prompt order (`data:` URLs, http(s), as the client sent them)."""
    data = request.get("multi_modal_data") or {}
    for key in OTHER_MEDIA:
        if data.get(key):
            raise RequestRefused(f"this worker takes images only; the request has {key}")
    sources = []
    for item in data.get(IMAGE_URL) or []:
        if isinstance(item, str):
            sources.append(item)
        elif isinstance(item, dict) and isinstance(item.get("Url"), str):
            sources.append(item["Url"])
        else:
            # {"Decoded": ...} comes from a frontend that decodes media (register_model's
            # media_decoder), which this worker never asks for.
            raise RequestRefused(f"unsupported image_url item: {str(item)[:200]}")
    return sources


def routing_mm_hashes(request: Mapping[str, Any], images: int) -> list[int] | None:
    """Dynamo's own hash of each image (`extra_args.mm_hashes`, 16 hex digits, prompt order):
    its router's view of the prompt puts each image's run in a pad value derived from it. None
    when the frontend sent none, or not one per image."""
    hashes = (request.get("extra_args") or {}).get("mm_hashes")
    if not isinstance(hashes, list) or len(hashes) != images:
        return None
    try:
        return [int(value, 16) for value in hashes]
    except (TypeError, ValueError):
        return None


def prefill_output(done: PrefillDone) -> dict[str, Any]:
    """A prefill worker's one output: no tokens (decode streams the first), and the handover
    in `disaggregated_params`, which Dynamo's router hands the decode worker. No finish reason:
    the router would take one for the whole request's end and answer the client with it."""
    return {"token_ids": [], "disaggregated_params": msgspec.to_builtins(done)}


def prefill_handover(request: Mapping[str, Any]) -> PrefillDone:
    """The handover of the prefill worker Dynamo's router sent the request to first."""
    params = (request.get("prefill_result") or {}).get("disaggregated_params")
    if params is None:
        raise RemoteError(
            protocol.ERROR_PROTOCOL,
            "the request reached a decode worker without a prefill_result: Dynamo's prefill "
            "router sends it to a prefill worker first (--disaggregation-mode prefill)",
        )
    try:
        return msgspec.convert(params, PrefillDone)
    except msgspec.ValidationError as exc:
        raise RemoteError(
            protocol.ERROR_PROTOCOL, f"the prefill_result is not an mmserve prefill's: {exc}"
        ) from None


class Outputs:
    """A stream's token chunks as Dynamo's output dicts (`of`): the choice's index and its new
    token ids, with their log-probabilities where the request asks for them; on a choice's last
    one its finish reason and the prompt's log-probabilities, which mmserve's first chunk
    carries and Dynamo reads from the last (`engine_data.prompt_logprobs`); the usage on the
    stream's last."""

    def __init__(self) -> None:
        self._prompt_logprobs: list[TokenLogprob] = []

    def of(self, chunk: TokenChunk) -> dict[str, Any]:
        out: dict[str, Any] = {"index": chunk.index, "token_ids": list(chunk.token_ids)}
        if chunk.logprobs:
            out["log_probs"] = [_finite(each.logprob) for each in chunk.logprobs]
            out["top_logprobs"] = [
                [
                    {"rank": rank, "token_id": token_id, "token": None, "logprob": _finite(value)}
                    for rank, (token_id, value) in enumerate(each.top, start=1)
                ]
                for each in chunk.logprobs
            ]
        if chunk.prompt_logprobs:
            self._prompt_logprobs = chunk.prompt_logprobs
        if chunk.finish_reason is not None:
            out["finish_reason"] = chunk.finish_reason
            if self._prompt_logprobs:
                out["engine_data"] = {"prompt_logprobs": _prompt_logprobs(self._prompt_logprobs)}
        if chunk.usage is not None:
            usage = chunk.usage
            out["completion_usage"] = {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            }
        return out


def _prompt_logprobs(scored: list[TokenLogprob]) -> list[dict[str, dict[str, Any]] | None]:
    """Dynamo's `PromptLogprobs`: None for the first prompt token, then per position a map of
    token id (a string: a JSON key) to {logprob, rank} for the prompt's token and the most
    likely ones, rank from 1 (vLLM's form; Dynamo's `PromptLogprobEntry`)."""
    payload: list[dict[str, dict[str, Any]] | None] = [None]
    for each in scored:
        position: dict[str, dict[str, Any]] = {}
        for rank, (token_id, value) in enumerate(each.top, start=1):
            position[str(token_id)] = {"logprob": _finite(value), "rank": rank}
        chosen: dict[str, Any] = {"logprob": _finite(each.logprob)}
        if each.rank is not None:
            chosen["rank"] = each.rank
        position[str(each.token_id)] = chosen
        payload.append(position)
    return payload


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_FINITE_LOGPROB
