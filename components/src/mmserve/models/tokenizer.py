"""The checkpoint's tokenizer, read once per process and shared by whatever in it serves that
checkpoint (the frontend, the engines).

Reading Qwen's (a 151k-token vocabulary) takes over a second of CPU and holds about 120 MB; a
process that holds several components of one checkpoint (a frontend beside its engines, roles
side by side, tests) reads it once, and keeps the two read last (a process serves one
checkpoint; a test process steps through many families, and keeping every one cost it
gigabytes). Its holders only read it (ids, decoding, the grammar compiler's vocabulary, the
chat template, which the frontend passes per call when the processor's replaces it), so
sharing it changes nothing they see; code that changes a tokenizer loads its own.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

_LOADING = threading.Lock()  # engines load on threads: the second waits for the first's read


def shared_tokenizer(path: Path) -> Any:
    """transformers' tokenizer of the checkpoint at `path` (a `PreTrainedTokenizerFast`)."""
    with _LOADING:
        return _load(path)


@functools.lru_cache(maxsize=2)
def _load(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
