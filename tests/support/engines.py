"""Images, preprocessing and the transformers reference for the engine tests."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import xxhash
from PIL import Image

from mmserve.engines.base import MediaInput

IMAGE_TOKEN_ID = 151655
GEMMA3_IMAGE_TOKEN_ID = 262144


def _model_type(model_path: Path | str) -> str:
    return str(json.loads((Path(model_path) / "config.json").read_text())["model_type"])


def image_token_id(model_path: Path | str) -> int:
    """The checkpoint's image placeholder (Qwen3.5: 248056, Gemma 3: its soft token)."""
    if _model_type(model_path) == "gemma3":
        return GEMMA3_IMAGE_TOKEN_ID
    return int(json.loads((Path(model_path) / "config.json").read_text())["image_token_id"])


def make_image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def preprocess(model_path: Path, images: Sequence[Image.Image]) -> list[MediaInput]:
    """pixel_values + grid per image with transformers' own processor (the Rust core's twin)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    config = json.loads((model_path / "preprocessor_config.json").read_text())
    if _model_type(model_path) == "gemma3":
        return _preprocess_gemma3(model_path, config, images)
    processor = Qwen2VLImageProcessorPil(
        **{k: v for k, v in config.items() if k not in ("image_processor_type", "processor_class")}
    )
    items = []
    for image in images:
        out = processor(images=[image], return_tensors="pt")
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        mm_hash = xxhash.xxh3_64_intdigest(image.tobytes())
        items.append(MediaInput(mm_hash, out["pixel_values"], grid))
    return items


def _preprocess_gemma3(
    model_path: Path, config: dict, images: Sequence[Image.Image]
) -> list[MediaInput]:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    processor = Gemma3ImageProcessorPil(
        **{k: v for k, v in config.items() if k not in ("image_processor_type", "processor_class")}
    )
    patch = json.loads((model_path / "config.json").read_text())["vision_config"]["patch_size"]
    items = []
    for image in images:
        pixels = processor(images=[image], return_tensors="pt")["pixel_values"][0]
        grid = (1, pixels.shape[1] // patch, pixels.shape[2] // patch)
        items.append(MediaInput(xxhash.xxh3_64_intdigest(image.tobytes()), pixels, grid))
    return items


def expand_prompt(
    tokenizer, text_parts: Sequence[str], items: Sequence[MediaInput], merge: int = 2
) -> list[int]:
    """A chat prompt with one image part per item, placeholders expanded to the token count
    (Gemma 3: the ids of transformers' Gemma3Processor)."""
    content: list[dict] = [{"type": "image"} for _ in items]
    content += [{"type": "text", "text": part} for part in text_parts]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    if _model_type(tokenizer.name_or_path) == "gemma3":
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(tokenizer.name_or_path)
        # The ids do not depend on the pixels: every image is 256 soft tokens.
        images = [make_image(8, 8, seed=0) for _ in items] or None
        # As the processor's own apply_chat_template: the template already wrote `<bos>`.
        return processor(text=text, images=images, add_special_tokens=False)["input_ids"][0]
    ids = tokenizer(text)["input_ids"]
    image_token = image_token_id(tokenizer.name_or_path)
    counts = iter([int(np.prod(item.grid_thw)) // merge**2 for item in items])
    expanded: list[int] = []
    for token in ids:
        expanded.extend([token] * next(counts) if token == image_token else [token])
    return expanded


def reference_generate(model, ids: list[int], items: Sequence[MediaInput], max_new_tokens: int):
    """transformers' own greedy `generate` with pixel_values: (new tokens, first-step logits)."""
    input_ids = torch.tensor([ids])
    kwargs = {}
    if items and model.config.model_type == "gemma3":
        kwargs = {
            "pixel_values": torch.stack([item.pixel_values for item in items]),
            "token_type_ids": (input_ids == GEMMA3_IMAGE_TOKEN_ID).long(),
        }
    elif items:
        kwargs = {
            "pixel_values": torch.cat([item.pixel_values for item in items]),
            "image_grid_thw": torch.tensor([item.grid_thw for item in items]),
            "mm_token_type_ids": (input_ids == model.config.image_token_id).int(),
        }
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    return out.sequences[0, len(ids) :].tolist(), out.logits[0][0]


def placements(
    ids: Sequence[int],
    items: Sequence[MediaInput],
    merge: int = 2,
    image_token: int = IMAGE_TOKEN_ID,
) -> list:
    """Each item's run of placeholder tokens in expanded `ids`, as a request plan names it."""
    from mmserve.protocol import PlannedMedia

    starts = [
        i
        for i, token in enumerate(ids)
        if token == image_token and (i == 0 or ids[i - 1] != image_token)
    ]
    assert len(starts) == len(items), f"{len(starts)} placeholder runs for {len(items)} items"
    return [
        PlannedMedia(
            mm_hash=item.mm_hash,
            offset=start,
            length=int(np.prod(item.grid_thw)) // merge**2,
            grid_thw=tuple(item.grid_thw),
        )
        for start, item in zip(starts, items, strict=True)
    ]


def planned_request(
    request_id: str,
    ids: Sequence[int],
    items: Sequence[MediaInput] = (),
    sampling=None,
    stop=None,
    *,
    model=None,
):
    """An `EngineRequest` for expanded `ids`, with the items' placements and, given the model,
    the M-RoPE positions from its own `get_rope_index` (the reference the driver matches)."""
    from mmserve.engines.base import GREEDY, EngineRequest
    from mmserve.protocol import MRopePositions, StopConditions

    gemma3 = model is not None and model.config.model_type == "gemma3"
    image_token = model.config.image_token_id if model is not None else IMAGE_TOKEN_ID
    media = placements(ids, items, image_token=image_token)
    positions = None  # Gemma 3's are 1-D
    if model is not None and items and not gemma3:
        input_ids = torch.tensor([list(ids)])
        rows, delta = model.model.get_rope_index(
            input_ids,
            (input_ids == image_token).int(),
            image_grid_thw=torch.tensor([item.grid_thw for item in items]),
        )
        positions = MRopePositions(rows=rows.reshape(-1).tolist(), delta=int(delta.flatten()[0]))
    return EngineRequest(
        request_id,
        tuple(ids),
        sampling if sampling is not None else GREEDY,
        stop if stop is not None else StopConditions(),
        media=tuple(media),
        positions=positions,
    )
