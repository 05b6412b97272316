"""Precomputed image and audio embeddings (`image_embeds` and `audio_embeds` parts, behind
`--enable-mm-embeds`): read from safetensors or `.npy` only (a format that is never
unpickled), checked against the model before the request goes anywhere, and given an identity
from their bytes, so the same embedding sent again routes to and hits the same cached
prefix."""

from __future__ import annotations

import asyncio
import bisect
import io
from dataclasses import dataclass

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from mmserve import _mm, media
from mmserve._mm import MediaError
from mmserve.frontend.errors import ApiError
from mmserve.media import MediaPolicy
from mmserve.models.family import ModelSpec
from mmserve.protocol import (
    ERROR_EMBEDS_DTYPE,
    ERROR_EMBEDS_FORMAT,
    ERROR_EMBEDS_MISSING,
    ERROR_EMBEDS_SHAPE,
    ERROR_EMBEDS_VALUES,
    AudioEmbedsPart,
    ImageEmbedsPart,
)

EMBEDS = "image_embeds"
GRID = "image_grid_thw"
# Accepted dtypes, each with the integer view and exponent mask of its NaN and infinity (all
# exponent bits set), which the finiteness check reads.
_EXPONENT = {
    torch.float32: (torch.int32, 0x7F800000),
    torch.float16: (torch.int16, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7F80),
}
_NPY_MAGIC = b"\x93NUMPY"


@dataclass(frozen=True)
class PrecomputedImage:
    """One image's vision-tower output (a clip's audio-tower output) as the language model
    reads it."""

    mm_hash: int
    grid_thw: tuple[int, int, int]
    embeddings: torch.Tensor  # [tokens, hidden]
    deepstack: torch.Tensor | None  # [layers, tokens, hidden] (Qwen3-VL), else None


class EmbedsBudget:
    """The bytes a request's embeddings may still bring in (the core's per-request cap)."""

    def __init__(self) -> None:
        self.left = _mm.MAX_BYTES_PER_REQUEST


async def load_image_embeds(
    part: ImageEmbedsPart, spec: ModelSpec, policy: MediaPolicy, param: str, budget: EmbedsBudget
) -> PrecomputedImage:
    """The part's embedding, fetched under the media policy and checked against `spec` (the
    tensor work in a thread, off the event loop); every refusal is an `ApiError` naming
    `param` and what was expected."""
    value = part.image_embeds
    if isinstance(value, str):
        data = await _fetch(value, policy, param, budget)
        return await asyncio.to_thread(_from_file, data, spec, param)
    embeds = await _fetch(value.image_embeds, policy, f"{param}.{EMBEDS}", budget)
    numbers = value.image_grid_thw
    if isinstance(numbers, str):
        grid: bytes | tuple[int, int, int] = await _fetch(
            numbers, policy, f"{param}.{GRID}", budget
        )
    else:
        t, h, w = numbers  # three positive numbers, checked while decoding
        grid = (t, h, w)
    return await asyncio.to_thread(_from_files, embeds, grid, spec, param)


async def load_audio_embeds(
    part: AudioEmbedsPart, spec: ModelSpec, policy: MediaPolicy, param: str, budget: EmbedsBudget
) -> PrecomputedImage:
    """The part's clip embedding, as `load_image_embeds` reads an image's: its rows are the
    clip's tokens, planned as the shortest clip that makes them (grid `[1, 1, frames]`)."""
    data = await _fetch(part.audio_embeds, policy, param, budget)
    return await asyncio.to_thread(_audio_from_file, data, spec, param)


def _audio_from_file(data: bytes, spec: ModelSpec, param: str) -> PrecomputedImage:
    embeds = _float_rows(_single(_tensors(data, param), param), param).contiguous()
    extractor = spec.core.audio_extractor
    most = 0 if extractor is None else extractor.frames(extractor.max_samples or 0)[1]
    rows = embeds.shape[0] if embeds.ndim == 2 else 0
    frames = 1 + bisect.bisect_left(range(1, most + 1), rows, key=spec.core.audio_tokens)
    if (
        embeds.ndim != 2
        or rows < 1
        or embeds.shape[1] != spec.hidden_size
        or frames > most
        or spec.core.audio_tokens(frames) != rows
    ):
        raise ApiError(
            ERROR_EMBEDS_SHAPE,
            f"audio_embeds has shape {list(embeds.shape)}; expected [tokens, "
            f"{spec.hidden_size}]: one row per token of a clip (1 to "
            f"{spec.core.audio_tokens(most)}) by the model's hidden size {spec.hidden_size}",
            param,
        )
    grid = (1, 1, frames)
    return PrecomputedImage(_identity(embeds, grid, param), grid, embeds, None)


def _from_file(data: bytes, spec: ModelSpec, param: str) -> PrecomputedImage:
    """One safetensors file with both tensors."""
    tensors = _tensors(data, param)
    grid = _grid(_named(tensors, GRID, param), param)
    return _checked(_named(tensors, EMBEDS, param), grid, spec, param)


def _from_files(
    embeds: bytes, grid: bytes | tuple[int, int, int], spec: ModelSpec, param: str
) -> PrecomputedImage:
    """The tensors in files of their own (the grid maybe as its numbers)."""
    at = f"{param}.{EMBEDS}"
    tensor = _single(_tensors(embeds, at), at)
    if isinstance(grid, bytes):
        at = f"{param}.{GRID}"
        grid = _grid(_single(_tensors(grid, at), at), param)
    return _checked(tensor, grid, spec, param)


async def _fetch(source: str, policy: MediaPolicy, param: str, budget: EmbedsBudget) -> bytes:
    try:
        data = await media.fetch(source, policy, max_bytes=min(budget.left, _mm.MAX_BYTES_PER_ITEM))
    except MediaError as err:
        code, message = err.args[:2]
        if code == "fetch.too_large" and budget.left < _mm.MAX_BYTES_PER_ITEM:
            code = "request.too_many_bytes"
            message = (
                f"the request's embeddings add up to more than {_mm.MAX_BYTES_PER_REQUEST} "
                "bytes, the per-request limit"
            )
        raise ApiError(code, message, param=param) from err
    budget.left -= len(data)
    return data


def _tensors(data: bytes, param: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or the one array of a `.npy` file (under the name
    ""); anything else, pickles included, is refused."""
    if data.startswith(_NPY_MAGIC):
        try:
            array = np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as err:
            raise ApiError(
                ERROR_EMBEDS_FORMAT, f"the .npy array cannot be read: {err}", param
            ) from err
        if array.dtype.kind not in "fiu" or array.dtype.byteorder == ">":
            raise ApiError(
                ERROR_EMBEDS_DTYPE,
                f"the .npy array has dtype {array.dtype}; expected float32 or float16 "
                "(int64 for image_grid_thw), little-endian",
                param,
            )
        return {"": torch.from_numpy(np.ascontiguousarray(array))}
    if _looks_like_safetensors(data):
        try:
            return load_safetensors(data)
        except (SafetensorError, ValueError, RuntimeError) as err:
            message = f"the safetensors file cannot be read: {err}"
            raise ApiError(ERROR_EMBEDS_FORMAT, message, param) from err
    raise ApiError(
        ERROR_EMBEDS_FORMAT,
        "expected a safetensors file or a .npy array; other formats (torch.save and other "
        "pickles among them) are refused",
        param,
    )


def _looks_like_safetensors(data: bytes) -> bool:
    """A little-endian u64 header length, then the JSON header."""
    if len(data) < 10:
        return False
    header = int.from_bytes(data[:8], "little")
    return 8 + header <= len(data) and data[8:9] == b"{"


def _named(tensors: dict[str, torch.Tensor], name: str, param: str) -> torch.Tensor:
    if name not in tensors:
        have = ", ".join(repr(n) for n in tensors if n) or "one unnamed array"
        raise ApiError(
            ERROR_EMBEDS_MISSING,
            f"image_embeds must hold a tensor named {name!r} (it holds {have}); send a "
            f"safetensors file with {EMBEDS!r} and {GRID!r}, or "
            f'{{"{EMBEDS}": ..., "{GRID}": [t, h, w]}}',
            param,
        )
    return tensors[name]


def _single(tensors: dict[str, torch.Tensor], param: str) -> torch.Tensor:
    """The tensor of a one-tensor file, or the one named as the field (`param`'s last name)
    of a larger one."""
    if len(tensors) == 1:
        return next(iter(tensors.values()))
    return _named(tensors, param.rsplit(".", 1)[-1], param)


def _grid(grid: torch.Tensor, param: str) -> tuple[int, int, int]:
    shape = list(grid.shape)
    integers = not (grid.dtype.is_floating_point or grid.is_complex())
    if not integers or shape not in ([3], [1, 3]):
        raise ApiError(
            ERROR_EMBEDS_SHAPE,
            f"image_grid_thw must be three integers [t, h, w] (shape [1, 3] or [3]); got "
            f"shape {shape}" + ("" if integers else " of another dtype"),
            f"{param}.{GRID}",
        )
    t, h, w = (int(v) for v in grid.reshape(3).tolist())
    if min(t, h, w) < 1 or max(t, h, w) >= 2**31:
        raise ApiError(
            ERROR_EMBEDS_SHAPE, f"image_grid_thw {[t, h, w]} must be positive", f"{param}.{GRID}"
        )
    return t, h, w


def _float_rows(embeds: torch.Tensor, param: str) -> torch.Tensor:
    """`embeds` of an accepted dtype, vLLM's `[1, tokens, hidden]` as `[tokens, hidden]`."""
    if embeds.dtype not in _EXPONENT:
        field = param.rsplit(".", 1)[-1]
        raise ApiError(
            ERROR_EMBEDS_DTYPE,
            f"{field} has dtype {str(embeds.dtype).removeprefix('torch.')}; expected "
            "float32, float16 or bfloat16",
            param,
        )
    if embeds.ndim == 3 and embeds.shape[0] == 1:  # vLLM's (num_items, tokens, hidden)
        return embeds[0]
    return embeds


def _identity(embeds: torch.Tensor, grid: tuple[int, int, int], param: str) -> int:
    """The item's identity from its bytes and grid, once its values are all finite."""
    if not _all_finite(embeds):
        field = param.rsplit(".", 1)[-1]
        raise ApiError(ERROR_EMBEDS_VALUES, f"{field} holds NaN or infinite values", param)
    dtype = str(embeds.dtype).removeprefix("torch.")
    raw = embeds.view(torch.uint8).reshape(-1).numpy()
    return _mm.embeddings_identity(dtype, list(embeds.shape), grid, raw)


def _checked(
    embeds: torch.Tensor, grid: tuple[int, int, int], spec: ModelSpec, param: str
) -> PrecomputedImage:
    embeds = _float_rows(embeds, param)
    width = spec.hidden_size * (1 + spec.deepstack_layers)
    t, h, w = grid
    merge = spec.spatial_merge_size**2
    tokens = t * h * w // merge
    expected = f"[{tokens}, {width}]" if t * h * w % merge == 0 else f"[?, {width}]"
    if embeds.ndim != 2 or embeds.shape[1] != width or embeds.shape[0] != tokens:
        what = f"the model's hidden size {spec.hidden_size}" + (
            f" x (1 + {spec.deepstack_layers} deepstack layers)" if spec.deepstack_layers else ""
        )
        raise ApiError(
            ERROR_EMBEDS_SHAPE,
            f"image_embeds has shape {list(embeds.shape)}; expected {expected}: one row per "
            f"token of grid {list(grid)} (t*h*w / {merge}) by {what}",
            param,
        )
    embeds = embeds.contiguous()
    mm_hash = _identity(embeds, grid, param)
    main = embeds[:, : spec.hidden_size].contiguous()
    deepstack = None
    if spec.deepstack_layers:
        rows = embeds[:, spec.hidden_size :].reshape(tokens, spec.deepstack_layers, -1)
        deepstack = rows.transpose(0, 1).contiguous()
    return PrecomputedImage(mm_hash=mm_hash, grid_thw=grid, embeddings=main, deepstack=deepstack)


def _all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity, read from the exponent bits: torch.isfinite on a bfloat16 tensor of
    an image's embedding (5.6M values) takes ~90 ms on one core, this ~2 ms."""
    view, mask = _EXPONENT[tensor.dtype]
    return not bool(((tensor.view(view) & mask) == mask).any())
