"""Dynamo's preprocessed request (a dict, as its frontend sends it to a `ModelInput.Tokens`
backend) to mmserve's types, and mmserve's token chunks to Dynamo's output dicts.

What the frontend sends (Dynamo 1.6.1): `token_ids` (the chat template's prompt with one image
placeholder per image), `stop_conditions` {max_tokens, stop, stop_token_ids,
stop_token_ids_hidden (the EOS ids), min_tokens, ignore_eos}, `sampling_options` {temperature,
top_p, top_k, seed, ...}, and for images `multi_modal_data` {"image_url": [{"Url": url}]} in
prompt order. Stop strings stay with Dynamo: its own detokenizer matches them on the tokens this
worker streams.

With prefill and decode workers apart, Dynamo's prefill router sends the request first to a
prefill worker with `max_tokens` 1, reads the `disaggregated_params` of its first output (and
the rest of its stream), and sends the request on to a decode worker with those params in
`prefill_result.disaggregated_params`: here, mmserve's KV handover (`PrefillDone`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from mmserve import protocol
from mmserve.protocol import PrefillDone, SamplingParams, StopConditions, TokenChunk
from mmserve.runtime import RemoteError

IMAGE_URL = "image_url"
# Dynamo's media keys this worker does not take: refused by name rather than dropped.
OTHER_MEDIA = ("video_url", "audio_url")


class RequestRefused(ValueError):
    """A request this worker cannot serve as sent (a 400 for the client)."""


def sampling(request: Mapping[str, Any]) -> SamplingParams:
    options = request.get("sampling_options") or {}
    # Options Dynamo forwards that mmserve's engines do not implement.
    unsupported = []
    if (options.get("n") or 1) != 1 or (options.get("best_of") or 1) != 1:
        unsupported.append("n")
    if options.get("guided_decoding"):
        unsupported.append("guided_decoding")
    outputs = request.get("output_options") or {}
    # The backend returns no log-probabilities to Dynamo yet: refused, never dropped.
    unsupported += [
        name for name in ("logprobs", "prompt_logprobs") if outputs.get(name) is not None
    ]
    if unsupported:
        raise RequestRefused(f"mmserve's engines do not implement: {', '.join(unsupported)}")
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
    )


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


def output(chunk: TokenChunk) -> dict[str, Any]:
    """One Dynamo output dict: the new token ids, and on the last one the finish reason and
    the usage."""
    out: dict[str, Any] = {"token_ids": list(chunk.token_ids)}
    if chunk.finish_reason is not None:
        out["finish_reason"] = chunk.finish_reason
    if chunk.usage is not None:
        usage = chunk.usage
        out["completion_usage"] = {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        }
    return out
