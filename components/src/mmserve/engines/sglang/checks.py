"""The installed SGLang checked against the adapter at start-up (`check_sglang`,
`check_sglang_padding`).

SGLang's `async_generate` and `GenerateReqInput` accept every field the engine sends
(`args.GENERATE_FIELDS`, `mm_hashes` among them), and the pad values it derives from an item
hash equal `mmserve.kv.pad.pad_values` under the configured scheme; a mismatch stops the worker
with the scheme that would match. The model class SGLang loads for the checkpoint must pad
exactly the plan's media span (the image token run) with them. `sglang_splits_images` asks
whether per-image `mm_hashes` can apply to a multi-image request.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import types
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmserve.engines.base import ItemEmbedding
from mmserve.engines.sglang.args import GENERATE_FIELDS
from mmserve.engines.sglang.convert import media_item
from mmserve.kv.pad import PadScheme, pad_values
from mmserve.models.family import ModelSpec, resolve_model_spec

log = logging.getLogger(__name__)

PAD_PROBE_HASH = 0x0123_4567_89AB_CDEF
"""The item hash whose pad values are compared with SGLang's at start-up."""


class SglangStartupError(RuntimeError):
    """The installed SGLang does not fit the configuration."""


def sglang_pad_values(item: Any, mm_hash: int) -> tuple[int, ...]:
    """The pad values SGLang gives `item` (an empty `MultimodalDataItem`) for `mm_hash`, as its
    tokenizer manager sets a caller's hash: `set_hash` (0.5.2x: four `padding_values`), else
    the hash field and `set_pad_value` (0.5.1x: one `pad_value`)."""
    if hasattr(item, "set_hash"):
        item.set_hash(mm_hash)
    else:
        item.hash = mm_hash
        item.set_pad_value()
    if hasattr(item, "padding_values"):
        return tuple(item.padding_values())
    return (item.pad_value,)


def sglang_splits_images() -> bool:
    """Whether SGLang turns a two-image `processor_output` item into one item per image, each
    then keyed by its own mm_hash. SGLang 0.5.23 (`get_new_expanded_mm_items`) splits by patch
    counts (t*h*w per grid), which precomputed embeddings (t*h*w / merge^2 rows) do not match,
    so the images stay one item and per-image mm_hashes cannot apply."""
    from sglang.srt.managers.mm_utils import get_new_expanded_mm_items
    from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor

    rows = [ItemEmbedding(n, (1, 4, 4), torch.zeros(4, 1)) for n in (1, 2)]
    tables = types.SimpleNamespace(ATTR_NAME_TO_MODALITY={}, FEATURE_NAMES=[])
    (item,) = BaseMultimodalProcessor.collect_mm_items_from_processor_output(
        tables, media_item("image", rows)
    )
    item.offsets = [(0, 4), (4, 8)]
    return len(get_new_expanded_mm_items([item])) == 2


def check_sglang(scheme: PadScheme) -> str:
    """Check the installed SGLang against the adapter; return its version."""
    try:
        import sglang
        from sglang.srt.entrypoints.engine import Engine as SglEngine
        from sglang.srt.managers.io_struct import GenerateReqInput
        from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem
    except ImportError as exc:
        raise SglangStartupError(
            f"cannot import SGLang ({exc}); install it with pip install -e '.[sglang]'"
        ) from exc

    version = sglang.__version__
    accepted = set(inspect.signature(SglEngine.async_generate).parameters)
    fields = {field.name for field in dataclasses.fields(GenerateReqInput)}
    missing = [name for name in GENERATE_FIELDS if name not in accepted or name not in fields]
    if missing:
        raise SglangStartupError(
            f"SGLang {version} does not accept {', '.join(missing)} in async_generate; "
            "the sglang engine needs a release with mm_hashes (0.5.1x or later)"
        )
    theirs = sglang_pad_values(MultimodalDataItem(modality=Modality.IMAGE), PAD_PROBE_HASH)
    if theirs != pad_values(PAD_PROBE_HASH, scheme):
        matching = [s.value for s in PadScheme if pad_values(PAD_PROBE_HASH, s) == theirs]
        hint = f"--pad-scheme {matching[0]}" if matching else "no known --pad-scheme matches"
        raise SglangStartupError(
            f"SGLang {version} pads media with other values than --pad-scheme {scheme.value}: "
            f"routing would miss every cached image; start the frontend, router and workers "
            f"with {hint}"
        )
    return version


def sglang_padded_probe(
    model_class: Any, spec: ModelSpec, mm_hash: int
) -> tuple[list[int], list[int]]:
    """A probe prompt with one image as the plan expands it (vision start, a run of image
    tokens, vision end; Gemma 3: begin of image, soft tokens, end of image; for a family
    without images, Qwen2-Audio, a run of audio tokens between two other tokens) as SGLang's
    `model_class.pad_input_ids` pads it for an item of `mm_hash`, and as the router's routing
    view pads it (the run replaced by the item's pad values, under the installed release's
    padding): `(sglang's, expected)`. The item's offsets and the ids in `MultimodalInputs` are
    the ones SGLang's processors give it."""
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, MultimodalInputs
    from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor

    token, start, end = spec.image_token_id, spec.vision_start_token_id, spec.vision_end_token_id
    audio = spec.core.audio_token_id
    # An audio family's image fields name its audio token: it takes no images.
    takes_images = audio is None or audio != token
    if not takes_images:
        start, end = 14, 15
    run = 6
    prompt = [11, 12, start, *[token] * run, end, 13]
    item = MultimodalDataItem(modality=Modality.IMAGE if takes_images else Modality.AUDIO)
    item.offsets = BaseMultimodalProcessor.get_mm_items_offset(torch.tensor(prompt), token)
    theirs = sglang_pad_values(item, mm_hash)
    if takes_images:
        inputs = MultimodalInputs(
            mm_items=[item], im_token_id=token, im_start_id=start, im_end_id=end
        )
    else:
        inputs = MultimodalInputs(
            mm_items=[item], audio_token_id=token, audio_start_id=start, audio_end_id=end
        )
    # The padding reads the prompt and the items, not the model's weights or state.
    padded = model_class.pad_input_ids(types.SimpleNamespace(), array("q", prompt), inputs)
    expected = list(prompt)
    expected[3 : 3 + run] = np.resize(np.array(theirs, dtype=object), run).tolist()
    return list(padded), expected


def check_sglang_padding(model_path: Path) -> None:
    """Stop the worker unless the model class SGLang loads for the checkpoint (its
    `ModelRegistry`, by `config.json` `architectures`) pads the plan's media span, and only it:
    the router's block hashes and the engine's KV events cover the same tokens SGLang caches.
    (The pad values themselves are `check_sglang`'s.)"""
    from sglang.srt.models.registry import ModelRegistry

    spec = resolve_model_spec(model_path)
    architectures = json.loads((model_path / "config.json").read_text()).get("architectures")
    try:
        model_class, arch = ModelRegistry.resolve_model_cls(architectures or [])
    except ValueError as exc:
        raise SglangStartupError(f"SGLang cannot load {architectures}: {exc}") from exc
    try:
        padded, expected = sglang_padded_probe(model_class, spec, PAD_PROBE_HASH)
    except AttributeError as exc:  # a padding that reads the loaded model cannot be probed
        log.warning("cannot check how SGLang's %s pads media (%s)", arch, exc)
        return
    if padded != expected:
        raise SglangStartupError(
            f"SGLang's {arch} pads other tokens of a media item than the plan's span (the "
            f"{spec.family} image or audio token run): KV routing would hash other tokens than "
            "SGLang caches"
        )
