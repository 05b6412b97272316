"""Precomputed embeddings as a client makes them: the model's own vision tower run on an
image, saved as the safetensors file an `image_embeds` part carries."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save

from mmserve import _mm
from mmserve.models.family import model_class, resolve_model_spec


def vision_tower_safetensors(model_path: Path, image: bytes) -> bytes:
    """`image_embeds` [tokens, hidden x (1 + deepstack layers)] (vLLM's layout: Qwen3-VL's
    deepstack features after the tower's output) and `image_grid_thw` [1, 3] (Gemma 3: the
    plan's grid of its fixed-size tower)."""
    spec = resolve_model_spec(model_path)
    model = model_class(spec.family).from_pretrained(model_path, dtype=torch.float32)
    with torch.inference_mode():
        if spec.vision_input == "image":
            # One placeholder (Gemma 3: begin of image) for the driver to expand.
            (item,) = _mm.process(spec.core, [spec.vision_start_token_id], [image]).items
            grid = np.asarray(item.image_grid_thw)
            pixels = torch.from_numpy(np.asarray(item.pixel_values))[None]
            output = model.model.get_image_features(pixels, return_dict=True)
        else:
            pixel_values, grid, _ = _mm.preprocess(spec.core, image)
            output = model.model.get_image_features(
                torch.from_numpy(pixel_values), torch.from_numpy(grid), return_dict=True
            )
    deepstack = [layer[0] for layer in getattr(output, "deepstack_features", None) or []]
    embeds = torch.cat([output.pooler_output[0], *deepstack], dim=1).contiguous()
    return save({"image_embeds": embeds, "image_grid_thw": torch.from_numpy(grid)})


def embeds_part(data: bytes) -> dict[str, str]:
    return {"type": "image_embeds", "image_embeds": base64.b64encode(data).decode()}


def audio_tower_safetensors(model_path: Path, clip: bytes) -> bytes:
    """`audio_embeds` [tokens, hidden]: transformers' Qwen2-Audio tower and projector over the
    clip as its processor prepares it (what its forward scatters into the `<|AUDIO|>` run),
    cut to the clip's tokens."""
    import transformers

    from tests.support.audio import torchcodec_samples

    processor = transformers.AutoProcessor.from_pretrained(model_path)
    model = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(model_path).eval()
    text = "<|audio_bos|><|AUDIO|><|audio_eos|>"
    audio = torchcodec_samples(clip, processor.feature_extractor.sampling_rate)
    inputs = processor(text=text, audio=[audio], return_tensors="pt")
    projected: list[torch.Tensor] = []
    hook = model.model.multi_modal_projector.register_forward_hook(
        lambda _module, _args, output: projected.append(output)
    )
    with torch.inference_mode(), hook:
        model(**inputs)
    tokens = int((inputs["input_ids"] == model.config.audio_token_id).sum())
    return save({"audio_embeds": projected[0][0, :tokens].contiguous()})
