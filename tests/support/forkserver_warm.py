"""The forkserver's last preload (`forked.PRELOAD`), once the heavy modules are imported: what
every component forked from it would otherwise repeat at its start.

- It reads the tokenizers of the two checkpoints most components serve (the tiny Qwen2-VL and
  the default model, named by `forked.WARM_TOKENIZERS_ENV`) into the process's shared
  tokenizer (`mmserve.models.tokenizer`), as a preforking server's workers find what their
  parent loaded. Reading one is 1.5 to 2 CPU seconds (Qwen's 151k-token vocabulary); the
  suite starts hundreds of components of these two.
- It then freezes its heap (`mmserve.runtime.heap`, as CPython's documentation advises before
  forking): a component's own collection at start-up (the same call) walks only what it made,
  not the half a million objects of torch and transformers again (0.4 CPU seconds each), and
  no collection in a child writes to the pages it shares with this one.
"""

from __future__ import annotations

import atexit
import gc
import os
from pathlib import Path

from mmserve.models.tokenizer import shared_tokenizer
from mmserve.runtime.heap import freeze_startup_heap
from tests.support.forked import WARM_TOKENIZERS_ENV

for checkpoint in filter(None, os.environ.get(WARM_TOKENIZERS_ENV, "").split(os.pathsep)):
    shared_tokenizer(Path(checkpoint).resolve())
freeze_startup_heap()
# Torn down frozen, this process's objects would outlive the interpreter, and triton's
# extension (imported with torch) reports them as leaked on the way out.
atexit.register(gc.unfreeze)
