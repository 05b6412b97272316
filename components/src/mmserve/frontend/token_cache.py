"""Token ids of prompts already seen, so a prompt sent again skips the tokenizer.

Tokenizing a rendered chat prompt is most of a text request's frontend CPU (about 1.4 of 2.5 ms
for 1.5k tokens, `bench/frontend_cost.py`), and clients resend prompts: a benchmark's fixed set,
a retried request. The key is the rendered text itself, so a hit gives exactly the ids the
tokenizer would; entries are LRU under a byte budget (ids kept as uint32, the text counted too).
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from mmserve.observability import metrics

DEFAULT_TOKEN_CACHE_MIB = 64


class TokenCache:
    """LRU of rendered prompt -> token ids; safe to use from several threads."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, np.ndarray] = OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def tokens(self, text: str, encode: Callable[[str], list[int]]) -> list[int]:
        """The ids of `text`: from the cache, or `encode(text)` (then cached)."""
        with self._lock:
            found = self._entries.get(text)
            if found is not None:
                self._entries.move_to_end(text)
        if found is not None:
            metrics.CACHE_LOOKUPS.labels("frontend", "prompt_tokens", "hit").inc()
            return found.tolist()
        metrics.CACHE_LOOKUPS.labels("frontend", "prompt_tokens", "miss").inc()
        ids = encode(text)
        self._store(text, np.asarray(ids, dtype=np.uint32))
        return ids

    def _store(self, text: str, ids: np.ndarray) -> None:
        size = sys.getsizeof(text) + ids.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            if text in self._entries:
                return
            self._entries[text] = ids
            self._num_bytes += size
            while self._num_bytes > self.max_bytes:
                evicted_text, evicted = self._entries.popitem(last=False)
                self._num_bytes -= sys.getsizeof(evicted_text) + evicted.nbytes
