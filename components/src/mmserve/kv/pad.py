"""Pad values: the token ids that stand for a media item's tokens in a prefix cache key.

An engine with a token-keyed prefix cache (SGLang's radix cache, the hf engine's block cache)
cannot tell two images apart by their placeholder tokens, which are all the same id. It
overwrites each item's placeholder run with values derived from the item's mm_hash, so the
cache key changes with the content. The router must build the same view, so the scheme is a
setting that must match the engine's.

- `dynamo` (the default): one value, `1_000_000 + (mm_hash & (2**30 - 1))`. The contract of
  Dynamo's KV router and of SGLang 0.5.1x (`_compute_pad_value` in
  `sglang/srt/managers/schedule_batch.py`, 0.5.15: `MM_PAD_SHIFT_VALUE + (hash % (1 << 30))`;
  0.5.1 had no shift).
- `sglang-wide`: SGLang 0.5.2x. Four sentinels from `sha256(b"sglang-mm-wide-pad-v1" ||
  mm_hash as 8 bytes big-endian)`: each 8-byte big-endian word of the digest, masked to 62 bits,
  plus 1_000_000 (`_compute_pad_values` in `sglang/srt/managers/schedule_batch.py`, 0.5.23).
  SGLang pads a run of n tokens with the four values cycled (`padding_sequence`).

Block hashes take u32 tokens (Dynamo's contract), and the wide sentinels do not fit: in the
routing view each sentinel keeps its low 30 bits above the shift, the same width as `dynamo`.
The full mm_hash still enters the block hash through the block's media list.
"""

from __future__ import annotations

import argparse
import enum
import hashlib

import numpy as np

MM_PAD_SHIFT = 1_000_000
_PAD_HASH_MASK = (1 << 30) - 1
_WIDE_PAD_TAG = b"sglang-mm-wide-pad-v1"
_WIDE_PAD_MASK = (1 << 62) - 1
_U64_MASK = (1 << 64) - 1


class PadScheme(enum.Enum):
    DYNAMO = "dynamo"
    SGLANG_WIDE = "sglang-wide"


def pad_values(mm_hash: int, scheme: PadScheme = PadScheme.DYNAMO) -> tuple[int, ...]:
    """The engine's pad values for one item, in the order they repeat over its tokens."""
    mm_hash &= _U64_MASK
    if scheme is PadScheme.DYNAMO:
        return (MM_PAD_SHIFT + (mm_hash & _PAD_HASH_MASK),)
    digest = hashlib.sha256(_WIDE_PAD_TAG + mm_hash.to_bytes(8, "big")).digest()
    return tuple(
        MM_PAD_SHIFT + (int.from_bytes(digest[i : i + 8], "big") & _WIDE_PAD_MASK)
        for i in range(0, 32, 8)
    )


def pad_value(mm_hash: int, scheme: PadScheme = PadScheme.DYNAMO) -> int:
    """The item's scalar pad value (SGLang's `pad_value`: the first of its pad values)."""
    return pad_values(mm_hash, scheme)[0]


def routing_pad_values(mm_hash: int, scheme: PadScheme = PadScheme.DYNAMO) -> tuple[int, ...]:
    """The item's pad values narrowed to u32 for block hashing (identity for `dynamo`)."""
    return tuple(
        MM_PAD_SHIFT + ((value - MM_PAD_SHIFT) & _PAD_HASH_MASK)
        for value in pad_values(mm_hash, scheme)
    )


def routing_pad_run(
    mm_hash: int, token_count: int, scheme: PadScheme = PadScheme.DYNAMO
) -> np.ndarray:
    """The u32 routing tokens that replace an item's run of `token_count` tokens."""
    values = np.array(routing_pad_values(mm_hash, scheme), dtype=np.uint32)
    return np.tile(values, -(-token_count // len(values)))[:token_count]


def add_pad_scheme_argument(parser: argparse._ActionsContainer) -> None:
    """`--pad-scheme`, which the frontend and the workers share (their values must agree)."""
    parser.add_argument(
        "--pad-scheme",
        choices=[scheme.value for scheme in PadScheme],
        default=PadScheme.DYNAMO.value,
        help="media pad values in the block hashes of the engines' prefix caches: dynamo "
        "(SGLang 0.5.1x) or sglang-wide (SGLang 0.5.2x); the frontend's and the workers' must "
        "agree (default: dynamo)",
    )
