"""mmserve's requests and items as SGLang takes them, and SGLang's finish reasons back.

A generate call carries the expanded `input_ids`, the embeddings as one `processor_output`
item per modality (`precomputed_embeddings` with any deepstack features, `image_grid_thw` or
`video_grid_thw`, or for audio `feature_attention_mask` and the call's `input_ids`; `modality`;
SGLang takes exactly one such dict per modality, in `image_data`, `video_data` and
`audio_data`) and `mm_hashes` (16-digit hex, `mmserve.protocol.mm_hash_hex`), so SGLang's
pad values, radix cache and KV events use the router's item identities. The encoder takes the
Rust core's pixels as the `MultimodalDataItem` SGLang's `MMEncoder` hands its model.

A request's grammar goes as SGLang's own sampling parameters: a regex as `regex`, everything
else as `ebnf`, the EBNF text of the grammar the hf engine compiles (SGLang compiles it with
the same xgrammar): JSON as the request asks it written (compact unless it asks for any
whitespace, which SGLang sets only server-wide), its bounded strings repaired, choices as
alternatives. A grammar that starts after a reasoning section asks SGLang for
`require_reasoning`, which defers the grammar to the end of the section its own
`--reasoning-parser` finds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import msgspec
import torch

from mmserve.engines.base import (
    EngineRequest,
    ItemEmbedding,
    MediaInput,
    MediaModality,
    UnsupportedRequest,
)
from mmserve.engines.logits import step_seed
from mmserve.grammar.xgrammar_backend import ebnf_text
from mmserve.protocol import (
    BootstrapInfo,
    FinishReason,
    Grammar,
    MRopePositions,
    SamplingParams,
    StopConditions,
    mm_hash_hex,
)


def sglang_rows(embedding: ItemEmbedding) -> torch.Tensor:
    """An item's embedding rows as SGLang takes them: Qwen3-VL's deepstack features follow
    each row (`[tokens, hidden x (1 + layers)]`), the layout its `separate_deepstack_embeds`
    splits again; other families' rows alone."""
    return torch.cat([embedding.embeddings, *embedding.deepstack], dim=1)


def media_item(
    modality: MediaModality,
    embeddings: Sequence[ItemEmbedding],
    positions: MRopePositions | None = None,
) -> dict[str, Any]:
    """The request's items of one modality as one SGLang `processor_output` item (rows as
    `sglang_rows` lays them out). With `positions`, the plan's M-RoPE
    positions, which SGLang's Qwen-VL processor takes from the request's first item instead of
    computing its own (`mrope_positions`, `mrope_position_delta`). Clips go as `audio_item`."""
    item: dict[str, Any] = {
        "format": "processor_output",
        "modality": modality.upper(),
        "precomputed_embeddings": torch.cat([sglang_rows(e) for e in embeddings]),
    }
    if modality == "audio":
        return item | {"feature_attention_mask": feature_attention_mask(embeddings)}
    item[f"{modality}_grid_thw"] = torch.tensor([e.grid_thw for e in embeddings], dtype=torch.long)
    if positions is not None:
        rows = torch.tensor(positions.rows, dtype=torch.long)
        item["mrope_positions"] = rows.view(3, -1)
        item["mrope_position_delta"] = torch.tensor([positions.delta], dtype=torch.long)
    return item


def feature_attention_mask(clips: Sequence[ItemEmbedding]) -> torch.Tensor:
    """Qwen2-Audio's `feature_attention_mask` of the clips (one row each, ones over its valid
    frames, `grid_thw[2]`): SGLang's Qwen2-Audio processor requires it beside precomputed rows
    and counts each clip's tokens (`audio_feature_lens`) from it."""
    frames = torch.tensor([clip.grid_thw[2] for clip in clips])
    return (torch.arange(int(frames.max()))[None, :] < frames[:, None]).long()


def encoder_item(item: MediaInput, device: torch.device | str = "cpu") -> Any:
    """The Rust core's pixels as the `MultimodalDataItem` SGLang's encoder hands its model
    (`MMEncoder._build_model_mm_items`: `from_dict` of modality and feature, then the grid;
    the model's `get_image_feature` or `get_video_feature` reads it)."""
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem

    mm_item = MultimodalDataItem.from_dict(
        {"modality": Modality.from_str(item.modality), "feature": item.pixel_values.to(device)}
    )
    mm_item.set(f"{item.modality}_grid_thw", torch.tensor([item.grid_thw], dtype=torch.long))
    return mm_item


def sampling_params(sampling: SamplingParams, stop: StopConditions) -> dict[str, Any]:
    """mmserve's sampling and stop rules as SGLang's `sampling_params` dict."""
    params: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "max_new_tokens": stop.max_tokens,
        "min_new_tokens": stop.min_tokens,
        "stop_token_ids": list(stop.stop_token_ids),
        "ignore_eos": stop.ignore_eos,
        "no_stop_trim": stop.include_stop_str_in_output,
        "skip_special_tokens": stop.skip_special_tokens,
    }
    if stop.stop:
        params["stop"] = list(stop.stop)
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    params |= {
        "min_p": sampling.min_p,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        "repetition_penalty": sampling.repetition_penalty,
    }
    if sampling.logit_bias:
        params["logit_bias"] = {str(token): bias for token, bias in sampling.logit_bias.items()}
    return params | grammar_params(sampling.grammar)


def grammar_params(grammar: Grammar | None) -> dict[str, Any]:
    """A request's grammar as SGLang's sampling parameters (none for free text)."""
    if grammar is None:
        return {}
    if grammar.kind == "regex":
        return {"regex": grammar.spec}
    return {"ebnf": ebnf_text(grammar)}


def resumed_sampling_params(request: EngineRequest) -> dict[str, Any]:
    """`sampling_params` of the request, for a resumed one (`EngineRequest.resumed`) those of
    what is left: SGLang reads the completion's tokens so far as prompt, so its budget
    (`max_new_tokens`, `min_new_tokens`) is what remains, and a seeded choice keeps the seed
    its first call had (`choice_seed`). SGLang's own detokenizer starts again at the cut: a
    stop string that spans the cut is not matched, and its frequency and presence penalties
    count the new tokens only."""
    resumed = request.resumed
    if resumed is None:
        return sampling_params(request.sampling, request.stop)
    done = len(resumed.token_ids)
    stop = msgspec.structs.replace(
        request.stop,
        max_tokens=request.stop.max_tokens - done,
        min_tokens=max(0, request.stop.min_tokens - done),
    )
    sampling = request.sampling
    if sampling.seed is not None:
        seed = choice_seed(sampling.seed, resumed.choice)
        sampling = msgspec.structs.replace(sampling, seed=seed)
    return sampling_params(sampling, stop)


def generate_kwargs(
    request: EngineRequest,
    embeddings: Sequence[ItemEmbedding],
    bootstrap: BootstrapInfo | None,
    *,
    splits_images: bool = True,
) -> dict[str, Any]:
    """The keyword arguments of one `async_generate` call (keys: `args.GENERATE_FIELDS`);
    `embeddings` follow `request.media`.

    SGLang lists a request's items images first, then videos, then clips, and splits no bundle
    into one item per image, video or clip (0.5.23: precomputed rows do not match its patch
    counts; a video's run is not split per temporal patch; a clip bundle stays one item), so
    `mm_hashes` go only where each bundle holds one item, or images are split
    (`checks.sglang_splits_images`) and the request has at most one video and one clip;
    otherwise SGLang would drop them with a warning anyway. With a video,
    the plan's positions go with the first item: SGLang 0.5.23 reads Qwen2.5-VL's
    `second_per_grid_ts` from that item alone, so it cannot compute them itself. A Qwen3-VL
    video, planned one item per temporal group with its timestamp text between the groups'
    runs, goes as those items in the video bundle: SGLang finds one run per group in the given
    ids and fills them in order, as its own encoder-disaggregated path (one item per frame
    group) does, and the timestamp text stays text."""
    kwargs: dict[str, Any] = {
        "input_ids": list(request.token_ids),
        "sampling_params": resumed_sampling_params(request),
        "stream": True,
        "rid": request.request_id,
    }
    bundles: dict[MediaModality, list[ItemEmbedding]] = {"image": [], "video": [], "audio": []}
    for item, embedding in zip(request.media, embeddings, strict=True):
        bundles[item.modality].append(embedding)
    positions = request.positions if bundles["video"] else None
    for modality, bundle in bundles.items():
        if bundle:
            kwargs[f"{modality}_data"] = [media_item(modality, bundle, positions)]
            positions = None
    if bundles["audio"]:
        # SGLang's Qwen2-Audio processor decodes the ids to text and tokenizes that again
        # unless the item carries them: the plan's ids stay the prompt.
        kwargs["audio_data"][0]["input_ids"] = torch.tensor(request.token_ids)
    images, videos, clips = bundles["image"], bundles["video"], bundles["audio"]
    if embeddings and (len(images) <= 1 or splits_images) and len(videos) <= 1 and len(clips) <= 1:
        kwargs["mm_hashes"] = [mm_hash_hex(item.mm_hash) for item in (*images, *videos, *clips)]
    if bootstrap is not None:
        kwargs["bootstrap_host"] = bootstrap.host
        kwargs["bootstrap_port"] = bootstrap.port
        kwargs["bootstrap_room"] = bootstrap.room
    kwargs |= logprob_kwargs(request)
    grammar = request.sampling.grammar
    if grammar is not None and grammar.start_after is not None:
        kwargs["require_reasoning"] = True
    return kwargs


def logprob_kwargs(request: EngineRequest) -> dict[str, Any]:
    """SGLang's log-probability arguments for the request's `logprobs` and `prompt_logprobs`
    (none where it asks for neither): `return_logprob`, one `top_logprobs_num` for the
    output and the prompt (the larger of the two counts; each side is cut to its own), and
    for prompt log-probabilities `logprob_start_len` 0 (the whole prompt, which SGLang then
    recomputes rather than reading its radix cache) and, with media, `token_ids_logprob` of
    the items' placeholder ids: SGLang scores an item's positions as its pad values (clamped
    to the vocabulary), so the placeholder's own log-probability there comes from that list."""
    sampling = request.sampling
    if sampling.logprobs is None and sampling.prompt_logprobs is None:
        return {}
    top = max(sampling.logprobs or 0, sampling.prompt_logprobs or 0)
    kwargs: dict[str, Any] = {"return_logprob": True, "top_logprobs_num": top}
    if sampling.prompt_logprobs is not None:
        kwargs["logprob_start_len"] = 0
        placeholders = sorted({request.token_ids[item.offset] for item in request.media})
        if placeholders:
            kwargs["token_ids_logprob"] = placeholders
    return kwargs


def check_disaggregated(sampling: SamplingParams) -> None:
    """Refuse by name what a prefill/decode pair joined through SGLang's bootstrap room cannot
    serve (SGLang 0.5.23): `n` > 1, since a bootstrap room pairs one prefill request with one
    decode request, and the handover has one room and one first token (SGLang's own `n`
    would send its prefix warm-up and every sample with the one room); and
    `prompt_logprobs`, which SGLang's prefill computes but does not hand decode (only the
    first output token's log-probabilities cross, in its metadata buffers). Output
    `logprobs` are served."""
    if sampling.n != 1:
        raise UnsupportedRequest(
            "n > 1 is not served by a prefill/decode-disaggregated sglang engine: a SGLang "
            "bootstrap room pairs one prefill request with one decode request"
        )
    if sampling.prompt_logprobs is not None:
        raise UnsupportedRequest(
            "prompt_logprobs are not served by a prefill/decode-disaggregated sglang engine: "
            "SGLang's decode does not receive the prompt's log-probabilities from its prefill"
        )


def choice_seed(seed: int, choice: int) -> int:
    """The `sampling_seed` of choice `choice` of a seeded request: the request's own for
    choice 0 (so it draws as the request with `n` 1 would), one derived from (seed, choice)
    for the others (`logits.step_seed`, within SGLang's signed 64-bit range)."""
    return seed if choice == 0 else step_seed(seed, choice, 0)


def generate_calls(
    request: EngineRequest,
    embeddings: Sequence[ItemEmbedding],
    bootstrap: BootstrapInfo | None,
    *,
    splits_images: bool = True,
) -> list[dict[str, Any]]:
    """The `async_generate` calls of one request, one per choice (choice i's outputs are
    call i's): for `n` > 1, choice i goes with rid `<id>.<i>` and, for a seeded request,
    `sampling_seed` `choice_seed(seed, i)`. A request with `max_tokens` 0 scores the prompt
    only: one call whatever its `n`.

    Not SGLang's own `n` (`sampling_params["n"]`, parallel sampling) in SGLang 0.5.23: it
    turns the request into a batch, whose `mm_hashes` must hold one list per request with one
    hash per `image_data` entry (the engine sends one bundled entry per modality, and video
    hashes), so a request with a video or a split multi-image bundle is refused, and without
    `mm_hashes` SGLang pads with its own hashes, which KV routing cannot predict; and it gives
    every sample the one `sampling_params`, hence one `sampling_seed`, with which SGLang's
    seeded draws (a hash of seed and position) are the same for every sample. Its one gain,
    the prompt prefilled once, is what the radix cache gives n requests under a cache-aware
    `--schedule-policy` (`lpm`: SGLang schedules one of the prompts sharing a prefix first);
    under SGLang's default `fcfs`, the n requests of one prompt are prefilled together, each
    on its own."""
    sampling = request.sampling
    n = sampling.n if request.stop.max_tokens > 0 else 1
    if n == 1:
        return [generate_kwargs(request, embeddings, bootstrap, splits_images=splits_images)]
    calls = []
    for choice in range(n):
        seed = None if sampling.seed is None else choice_seed(sampling.seed, choice)
        one = replace(
            request,
            request_id=f"{request.request_id}.{choice}",
            sampling=msgspec.structs.replace(sampling, seed=seed, n=1),
        )
        calls.append(generate_kwargs(one, embeddings, bootstrap, splits_images=splits_images))
    return calls


def finish_reason(sglang_reason: Any) -> FinishReason:
    """SGLang's `meta_info.finish_reason` (`{"type": "stop"|"length"|"abort", ...}`)."""
    kind = sglang_reason.get("type") if isinstance(sglang_reason, dict) else str(sglang_reason)
    if kind == "length":
        return "length"
    if kind == "abort":
        return "error"
    return "stop"
