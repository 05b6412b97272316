"""The checkpoint's tokenizer as engines hold it: read once per process and shared.

Reading Qwen's (a 151k-token vocabulary) takes over a second of CPU and holds about 120 MB; a
process that holds several engines of one checkpoint (roles side by side, tests) reads it once,
and keeps the two read last (a worker serves one checkpoint; a test process steps through many
families, and keeping every one cost it gigabytes). Engines only read
it (ids, decoding, the grammar compiler's vocabulary), so sharing it changes nothing they see;
code that changes a tokenizer (a chat template, added tokens) loads its own.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

_LOADING = threading.Lock()  # engines load on threads: the second waits for the first's read


def engine_tokenizer(path: Path) -> Any:
    """transformers' tokenizer of the checkpoint at `path` (a `PreTrainedTokenizerFast`)."""
    with _LOADING:
        return _load(path)


@functools.lru_cache(maxsize=2)
def _load(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
