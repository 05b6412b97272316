"""KV block hashes, compatible with Dynamo's KV router (computed in the Rust core).

The local hash of a complete block of `block_size` tokens is xxh3_64 over the tokens as u32
little-endian, followed, when media objects are attached to that block, by their mm_hashes
sorted ascending as u64 little-endian. The seed is 1337, plus (wrapping u64 add)
`xxh3_64(lora_name, seed 0)` when a LoRA adapter is named (a non-empty name). A partial tail
block is not hashed. `dynamo.llm.compute_block_hash_for_seq` (ai-dynamo-runtime) returns exactly
these values; the tests compare against it.

Sequence hashes chain the local hashes by position, as KV events carry them:
`seq_0 = local_0`, `seq_i = xxh3_64(le(seq_{i-1}) || le(local_i), seed 1337)`.
"""

from __future__ import annotations

import argparse
import warnings
from array import array as packed
from collections.abc import Sequence
from typing import Any

import numpy as np

from mmserve import _mm

DEFAULT_BLOCK_SIZE = 16
_U32 = next(code for code in "IL" if packed(code).itemsize == 4)  # the 4-byte unsigned code

MediaSpan = tuple[int, int, int]
"""`(mm_hash, start, end)`: a media item's token range `[start, end)` in a sequence."""


def tokens_as_u32(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """The token ids as a contiguous uint32 array; ids outside [0, 2**32) are rejected."""
    if isinstance(tokens, list):
        # A plan's ids are a list: `array.array` packs one without numpy's type discovery (6 instead
        # of 25 us for 1.5k ids), and refuses ids that do not fit.
        try:
            return np.frombuffer(packed(_U32, tokens), dtype=np.uint32)
        except OverflowError:
            raise ValueError("token ids must lie in [0, 2**32)") from None
        except TypeError as exc:
            raise ValueError(f"token ids must be integers: {exc}") from None
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {array.shape}")
    if array.dtype == np.uint32:
        return np.ascontiguousarray(array)
    if array.size == 0:
        return np.zeros(0, dtype=np.uint32)
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {array.dtype}")
    if int(array.min()) < 0 or int(array.max()) > 0xFFFF_FFFF:
        raise ValueError("token ids must lie in [0, 2**32)")
    return array.astype(np.uint32)


def compute_block_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_size: int = DEFAULT_BLOCK_SIZE,
    block_mm_infos: Sequence[Sequence[int] | None] | None = None,
    lora_name: str | None = None,
) -> list[int]:
    """Local hashes of the complete blocks of `tokens`.

    `block_mm_infos[i]` lists the mm_hashes of the media objects attached to block `i` (empty or
    None for none; entries past the last complete block are ignored), as in Dynamo's
    `compute_block_hash_for_seq`.
    """
    spans = [
        (mm_hash, index * block_size, (index + 1) * block_size)
        for index, hashes in enumerate(block_mm_infos or ())
        for mm_hash in hashes or ()
    ]
    return compute_block_hashes_with_spans(tokens, block_size, spans, lora_name)


def compute_block_hashes_with_spans(
    tokens: Sequence[int] | np.ndarray,
    block_size: int = DEFAULT_BLOCK_SIZE,
    media_spans: Sequence[MediaSpan] = (),
    lora_name: str | None = None,
) -> list[int]:
    """Local block hashes, each media span attached to every block it overlaps."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return _mm.compute_block_hashes(tokens_as_u32(tokens), block_size, list(media_spans), lora_name)


def compute_seq_hashes(
    local_hashes: Sequence[int], parent_seq_hash: int | None = None
) -> list[int]:
    """Chained sequence hashes of consecutive local block hashes.

    `parent_seq_hash` is the sequence hash of the block just before the first one, when the run
    does not start at the beginning of the sequence.
    """
    return _mm.compute_seq_hashes(list(local_hashes), parent_seq_hash)


def add_block_size_argument(
    parser: argparse._ActionsContainer, *, deprecated_alias: str | None = None
) -> None:
    """`--block-size`, which the frontend and the workers share (their values must agree).

    One name on both sides: `--block-size` is the engines' own (vLLM's `--block-size`; SGLang's
    `--page-size`, which the sglang engine sets equal to it), so a launcher passes one flag to
    every process, as it does `--pad-scheme`. Dynamo's frontend calls its copy
    `--kv-cache-block-size`; mmserve keeps the engines' name, which its workers always had.
    `deprecated_alias` is an old spelling still accepted (and listed in `--help`) for one release,
    with a warning when used: the frontend's `--kv-block-size`.
    """
    names = ["--block-size"]
    help_text = "KV block size in tokens; the frontend's and the workers' must agree"
    if deprecated_alias is not None:
        names.append(deprecated_alias)
        help_text += f" ({deprecated_alias}: the deprecated old name, gone in the next release)"
    help_text += f" (default: {DEFAULT_BLOCK_SIZE})"
    parser.add_argument(
        *names,
        dest="block_size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        metavar="TOKENS",
        action=_WarnOnAlias,
        help=help_text,
    )


class _WarnOnAlias(argparse.Action):
    """Stores the value; warns when it was given by a name other than the first."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if option_string is not None and option_string != self.option_strings[0]:
            warnings.warn(
                f"{option_string} is deprecated; use {self.option_strings[0]}",
                FutureWarning,
                stacklevel=2,
            )
        setattr(namespace, self.dest, values)
