"""Qwen2-Audio's audio tower and projector over clips' log-mel features, as transformers'
`Qwen2AudioForConditionalGeneration` runs them: each clip attends to its valid frames only
(its `feature_attention_mask`), and keeps the rows those frames make. The hf engine calls it
on its transformers model, the sglang engine on the tower SGLang loads (transformers' own
`Qwen2AudioEncoder` and projector), so both give transformers' rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mmserve.engines.base import MediaInput


def audio_rows(
    tower: Any, projector: Any, clips: Sequence[MediaInput], dtype: torch.dtype
) -> list[torch.Tensor]:
    """Each clip's rows (`[tokens, hidden]`): `tower` over its features (`pixel_values`,
    `[mel bins, frames]`) attending to its valid frames (`grid_thw[2]`), then `projector`."""
    from transformers.masking_utils import create_bidirectional_mask

    device = next(tower.parameters()).device
    features = torch.stack([clip.pixel_values for clip in clips]).to(device, dtype)
    valid = torch.tensor([clip.grid_thw[2] for clip in clips], device=device)
    after_conv, rows = tower._get_feat_extract_output_lengths(valid)
    positions = (features.shape[-1] - 2) // 2 + 1
    attended = torch.arange(positions, device=device)[None, :] < after_conv[:, None]
    mask = create_bidirectional_mask(
        config=tower.config,
        inputs_embeds=torch.zeros((len(clips), positions, 1), dtype=dtype),
        attention_mask=attended.long(),
    )
    hidden = tower(features, attention_mask=mask).last_hidden_state
    projected = projector(hidden)
    return [projected[i, : int(n)] for i, n in enumerate(rows.tolist())]
