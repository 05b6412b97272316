"""Token ids of prompts already seen, so a prompt sent again skips the tokenizer, and a prompt
that extends one seen before (the next turn of a conversation) tokenizes only what is new.

Tokenizing a rendered chat prompt is most of a text request's frontend CPU (about 1.4 of 2.5 ms
for 1.5k tokens, `bench/frontend_cost.py`), and clients resend prompts: a benchmark's fixed set,
a retried request, a conversation's whole history on every turn. An exact hit is keyed by the
rendered text itself, so it gives exactly the ids the tokenizer would.

Prefixes: the tokenizer splits text on its special tokens before anything else, so the ids of
`A + B`, where `B` starts with a special token that strips no whitespace, are the ids of `A`
followed by those of `B`. Each message of a chat template starts with such a token (the
`Boundary`), so the cache also remembers, for every message start in a prompt it tokenized, a
digest of the text before it and how many ids that text has. A new prompt tokenizes only what
follows the longest prefix it shares at a message start with a prompt in the cache.

Entries are LRU under a byte budget (ids kept as uint32, the text and digests counted too).
"""

from __future__ import annotations

import hashlib
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmserve.kv.hashing import tokens_as_u32
from mmserve.observability import metrics

DEFAULT_TOKEN_CACHE_MIB = 64
# Tokens that open a message in the chat templates of the families served (Qwen's ChatML).
MESSAGE_START_TOKENS = ("<|im_start|>",)
_DIGEST_BYTES = 16
_PREFIX_OVERHEAD = 120  # bytes per remembered prefix: its digest, the dict slot, the tuple


@dataclass(frozen=True)
class Boundary:
    """A special token that opens every message: its text and its id."""

    text: str
    token_id: int


def message_boundary(tokenizer: Any) -> Boundary | None:
    """The tokenizer's message-start token, when it splits text the way prefixes rely on: an
    added special token that is not normalized and strips no whitespace around it."""
    for token_id, added in tokenizer.added_tokens_decoder.items():
        if (
            added.content in MESSAGE_START_TOKENS
            and added.special
            and not (added.lstrip or added.rstrip or added.normalized or added.single_word)
        ):
            return Boundary(added.content, token_id)
    return None


@dataclass
class _Entry:
    ids: np.ndarray  # uint32
    digests: list[bytes]  # of the prefixes registered for this prompt
    size: int


class TokenCache:
    """LRU of rendered prompt -> token ids, with the ids of its message-start prefixes; safe to
    use from several threads."""

    def __init__(self, max_bytes: int, boundary: Boundary | None = None) -> None:
        self.max_bytes = max_bytes
        self.boundary = boundary
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._prefixes: dict[bytes, tuple[_Entry, int]] = {}  # digest -> (entry, ids before)
        self._num_bytes = 0
        self._lock = threading.Lock()
        # The lookup counters by result, looked up once.
        self._hits, self._prefix_hits, self._misses = (
            metrics.CACHE_LOOKUPS.labels("frontend", "prompt_tokens", result)
            for result in ("hit", "prefix_hit", "miss")
        )

    def __len__(self) -> int:
        return len(self._entries)

    def tokens(self, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        """The ids of `text`: from the cache, or `encode` of what follows its longest cached
        prefix (then cached)."""
        with self._lock:
            found = self._entries.get(text)
            if found is not None:
                self._entries.move_to_end(text)
        if found is not None:
            self._hits.inc()
            return found.ids.tolist()
        starts = self._message_starts(text)
        ids = self._encode_after_prefix(text, starts, encode)
        self._store(text, ids, starts)
        return ids

    def _message_starts(self, text: str) -> list[tuple[int, bytes]]:
        """(offset, digest of the text before it) of each message start after the first
        character, in order."""
        if self.boundary is None:
            return []
        marker = self.boundary.text
        starts = []
        digest = hashlib.blake2b(digest_size=_DIGEST_BYTES)
        done = 0
        at = text.find(marker, 1)
        while at >= 0:
            digest.update(text[done:at].encode())
            done = at
            starts.append((at, digest.copy().digest()))
            at = text.find(marker, at + len(marker))
        return starts

    def _encode_after_prefix(
        self, text: str, starts: list[tuple[int, bytes]], encode: Callable[[str], list[int]]
    ) -> list[int]:
        prefix, offset = self._longest_prefix(starts)
        if prefix is None:
            self._misses.inc()
            return encode(text)
        self._prefix_hits.inc()
        return prefix + encode(text[offset:])

    def _longest_prefix(self, starts: list[tuple[int, bytes]]) -> tuple[list[int] | None, int]:
        """The ids of the longest cached prefix ending at one of `starts`, and its length in
        characters; (None, 0) when none is cached."""
        with self._lock:
            for offset, digest in reversed(starts):
                known = self._prefixes.get(digest)
                if known is not None:
                    entry, count = known
                    return entry.ids[:count].tolist(), offset
        return None, 0

    def _store(self, text: str, ids: list[int], starts: list[tuple[int, bytes]]) -> None:
        array = tokens_as_u32(ids)
        # The k-th message start in the text is the k-th boundary id in the ids: the special
        # token is always its own id, and nothing else becomes that id.
        counts: list[int] = []
        if self.boundary is not None:
            found = np.flatnonzero(array == self.boundary.token_id)
            counts = found[int(text.startswith(self.boundary.text)) :].tolist()
        if len(counts) != len(starts):
            starts = []  # not the split the prefixes rely on: keep only the exact entry
        size = sys.getsizeof(text) + array.nbytes + _PREFIX_OVERHEAD * len(starts)
        if size > self.max_bytes:
            return
        entry = _Entry(array, [digest for _, digest in starts], size)
        with self._lock:
            if text in self._entries:
                return
            self._entries[text] = entry
            for (_, digest), count in zip(starts, counts, strict=True):
                self._prefixes[digest] = (entry, count)
            self._num_bytes += size
            while self._num_bytes > self.max_bytes:
                self._evict_oldest()

    def _evict_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self._num_bytes -= entry.size
        for digest in entry.digests:
            known = self._prefixes.get(digest)
            if known is not None and known[0] is entry:
                del self._prefixes[digest]
