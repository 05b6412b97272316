"""Audio towers over clips' log-mel features, as transformers runs them: each clip attends to
its valid frames only (its `feature_attention_mask`), and keeps the rows those frames make.

- Qwen2-Audio (`audio_rows`): the tower and projector of `Qwen2AudioForConditionalGeneration`.
  The hf engine calls it on its transformers model, the sglang engine on the tower SGLang loads
  (transformers' own `Qwen2AudioEncoder` and projector), so both give transformers' rows.
- The Omni thinkers (`thinker_audio_rows`): their `get_audio_features`, whose towers attend
  within chunks of `2 x n_window` frames (Qwen3-Omni's convolutions run over those chunks too)
  and project their own output."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    valid = _valid_frames(clips, device)
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


def _valid_frames(clips: Sequence[MediaInput], device: torch.device) -> torch.Tensor:
    """Each clip's valid feature frames, the plan's `grid_thw[2]`."""
    return torch.tensor([clip.grid_thw[2] for clip in clips], device=device)


def thinker_audio_rows(
    thinker: Any,
    clips: Sequence[MediaInput],
    dtype: torch.dtype,
    tokens: Callable[[int], int],
) -> list[torch.Tensor]:
    """Each clip's rows (`[tokens, hidden]`): an Omni thinker's `get_audio_features` over the
    clips' features (`pixel_values`, `[mel bins, frames]`; Qwen3-Omni's as long as each clip,
    padded here to the longest) masked to their valid frames, as its forward calls it on the
    processor's `input_features`. `tokens` is the family's rows for a clip's valid frames (the
    spec's `audio_tokens`), which divides the concatenated rows among the clips."""
    device = next(thinker.parameters()).device
    longest = max(clip.pixel_values.shape[-1] for clip in clips)
    features = torch.stack(
        [
            torch.nn.functional.pad(clip.pixel_values, (0, longest - clip.pixel_values.shape[-1]))
            for clip in clips
        ]
    ).to(device, dtype)
    valid = _valid_frames(clips, device)
    mask = torch.arange(longest, device=device)[None, :] < valid[:, None]
    rows = thinker.get_audio_features(
        features, feature_attention_mask=mask.long(), return_dict=True
    ).last_hidden_state
    return list(rows.split([tokens(clip.grid_thw[2]) for clip in clips]))
