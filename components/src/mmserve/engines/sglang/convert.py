"""mmserve's requests and items as SGLang takes them, and SGLang's finish reasons back.

A generate call carries the expanded `input_ids`, the embeddings as one `processor_output`
image item (`precomputed_embeddings` with any deepstack features, `image_grid_thw`,
`modality`; SGLang takes exactly one such dict per request) and `mm_hashes` (16-digit hex,
`mmserve.protocol.mm_hash_hex`), so SGLang's pad values, radix cache and KV events use the
router's item identities. The encoder
takes the Rust core's pixels as the `MultimodalDataItem` SGLang's `MMEncoder` hands its model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mmserve.engines.base import EngineRequest, ItemEmbedding, MediaInput
from mmserve.protocol import (
    BootstrapInfo,
    FinishReason,
    SamplingParams,
    StopConditions,
    mm_hash_hex,
)


def image_item(embeddings: Sequence[ItemEmbedding]) -> dict[str, Any]:
    """The request's images as one SGLang `processor_output` item. Qwen3-VL's deepstack
    features follow each row's embedding (`[tokens, hidden x (1 + layers)]`), the layout its
    `separate_deepstack_embeds` splits again."""
    return {
        "format": "processor_output",
        "modality": "IMAGE",
        "precomputed_embeddings": torch.cat(
            [torch.cat([item.embeddings, *item.deepstack], dim=1) for item in embeddings]
        ),
        "image_grid_thw": torch.tensor([item.grid_thw for item in embeddings], dtype=torch.long),
    }


def encoder_item(item: MediaInput, device: torch.device | str = "cpu") -> Any:
    """The Rust core's pixels as the `MultimodalDataItem` SGLang's encoder hands its model
    (`MMEncoder._build_model_mm_items`: `from_dict` of modality and feature, then the grid)."""
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem

    mm_item = MultimodalDataItem.from_dict(
        {"modality": Modality.IMAGE, "feature": item.pixel_values.to(device)}
    )
    mm_item.set("image_grid_thw", torch.tensor([item.grid_thw], dtype=torch.long))
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
        "no_stop_trim": False,
    }
    if stop.stop:
        params["stop"] = list(stop.stop)
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    return params


def generate_kwargs(
    request: EngineRequest,
    embeddings: Sequence[ItemEmbedding],
    bootstrap: BootstrapInfo | None,
    *,
    splits_images: bool = True,
) -> dict[str, Any]:
    """The keyword arguments of one `async_generate` call (keys: `args.GENERATE_FIELDS`).

    `mm_hashes` go with one image, or with several where SGLang splits the item per image
    (`checks.sglang_splits_images`); otherwise SGLang would drop them with a warning anyway."""
    kwargs: dict[str, Any] = {
        "input_ids": list(request.token_ids),
        "sampling_params": sampling_params(request.sampling, request.stop),
        "stream": True,
        "rid": request.request_id,
    }
    if embeddings:
        kwargs["image_data"] = [image_item(embeddings)]
        if len(embeddings) == 1 or splits_images:
            kwargs["mm_hashes"] = [mm_hash_hex(item.mm_hash) for item in embeddings]
    if bootstrap is not None:
        kwargs["bootstrap_host"] = bootstrap.host
        kwargs["bootstrap_port"] = bootstrap.port
        kwargs["bootstrap_room"] = bootstrap.room
    return kwargs


def finish_reason(sglang_reason: Any) -> FinishReason:
    """SGLang's `meta_info.finish_reason` (`{"type": "stop"|"length"|"abort", ...}`)."""
    kind = sglang_reason.get("type") if isinstance(sglang_reason, dict) else str(sglang_reason)
    if kind == "length":
        return "length"
    if kind == "abort":
        return "error"
    return "stop"
