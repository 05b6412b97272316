"""KV block hashes, compatible with Dynamo's KV router.

The local hash of a complete block of `block_size` tokens is xxh3_64 over the tokens as u32
little-endian, followed, when media objects are attached to that block, by their mm_hashes
sorted ascending as u64 little-endian. The seed is 1337, plus (wrapping u64 add)
`xxh3_64(lora_name, seed 0)` when a LoRA adapter is named (a non-empty name). A partial tail
block is not hashed.
`dynamo.llm.compute_block_hash_for_seq` (ai-dynamo-runtime) returns exactly these values; the
tests compare against it.

Sequence hashes chain the local hashes by position, as KV events carry them:
`seq_0 = local_0`, `seq_i = xxh3_64(le(seq_{i-1}) || le(local_i), seed 1337)`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

DEFAULT_BLOCK_SIZE = 16
BLOCK_HASH_SEED = 1337
_U64_MASK = (1 << 64) - 1

_xxh3_64 = xxhash.xxh3_64_intdigest


def block_hash_seed(lora_name: str | None = None) -> int:
    """The xxh3 seed of the local block hashes: 1337, shifted per LoRA adapter.

    An empty name means no adapter, as in Dynamo.
    """
    if not lora_name:
        return BLOCK_HASH_SEED
    return (BLOCK_HASH_SEED + _xxh3_64(lora_name.encode(), seed=0)) & _U64_MASK


def tokens_as_u32_le(tokens: Sequence[int] | np.ndarray) -> bytes:
    """The token ids as u32 little-endian bytes; ids outside [0, 2**32) are rejected."""
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {array.shape}")
    if array.size and array.dtype != np.uint32:
        if not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got dtype {array.dtype}")
        if int(array.min()) < 0 or int(array.max()) > 0xFFFF_FFFF:
            raise ValueError("token ids must lie in [0, 2**32)")
    return array.astype("<u4", copy=False).tobytes()


def compute_block_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_size: int = DEFAULT_BLOCK_SIZE,
    block_mm_infos: Sequence[Sequence[int] | None] | None = None,
    lora_name: str | None = None,
) -> list[int]:
    """Local hashes of the complete blocks of `tokens`.

    `block_mm_infos[i]` lists the mm_hashes of the media objects attached to block `i` (empty or
    None for none; entries past the last complete block are ignored). Order does not matter:
    the hashes are sorted before hashing, as Dynamo does.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    data = tokens_as_u32_le(tokens)
    block_bytes = 4 * block_size
    num_blocks = len(data) // block_bytes
    seed = block_hash_seed(lora_name)
    view = memoryview(data)
    if not block_mm_infos:
        return [
            _xxh3_64(view[start : start + block_bytes], seed=seed)
            for start in range(0, num_blocks * block_bytes, block_bytes)
        ]
    hashes = []
    suffixes: dict[tuple[int, ...], bytes] = {}
    for index in range(num_blocks):
        block = view[index * block_bytes : (index + 1) * block_bytes]
        mm_hashes = block_mm_infos[index] if index < len(block_mm_infos) else None
        if mm_hashes:
            key = tuple(mm_hashes)
            suffix = suffixes.get(key)
            if suffix is None:
                suffix = suffixes[key] = struct.pack(f"<{len(key)}Q", *sorted(key))
            hashes.append(_xxh3_64(bytes(block) + suffix, seed=seed))
        else:
            hashes.append(_xxh3_64(block, seed=seed))
    return hashes


def compute_seq_hashes(
    local_hashes: Sequence[int], parent_seq_hash: int | None = None
) -> list[int]:
    """Chained sequence hashes of consecutive local block hashes.

    `parent_seq_hash` is the sequence hash of the block just before the first one, when the run
    does not start at the beginning of the sequence.
    """
    seq_hashes = []
    previous = parent_seq_hash
    for local in local_hashes:
        if previous is None:
            current = local
        else:
            current = _xxh3_64(
                previous.to_bytes(8, "little") + local.to_bytes(8, "little"), seed=BLOCK_HASH_SEED
            )
        seq_hashes.append(current)
        previous = current
    return seq_hashes
