"""The forkserver's last preload (`forked.PRELOAD`), once the heavy modules are imported: what
every component forked from it would otherwise repeat at its start.

- It reads the tokenizers of the two checkpoints most components serve (the tiny Qwen2-VL and
  the default model) into the process's shared tokenizer (`mmserve.models.tokenizer`), as a
  preforking server's workers find what their parent loaded. Reading one is 1.5 to 2 CPU
  seconds (Qwen's 151k-token vocabulary); the suite starts hundreds of components of these
  two. A checkpoint not yet built is left to the components, which read it themselves.
- It then freezes its heap (`gc.freeze`, as CPython's documentation advises before forking):
  a component's own collection at start-up (`mmserve.runtime.heap`) walks only what the
  component made, not the half a million objects of torch and transformers again (0.4 CPU
  seconds each), and no collection in a child writes to the pages it shares with this one.
"""

from __future__ import annotations

import atexit
import gc

from mmserve.models.tokenizer import shared_tokenizer
from mmserve.tiny.checkpoints import MARKER_FILE, tiny_model_dir
from mmserve.tiny.trained import trained_model_dir

for checkpoint in (tiny_model_dir("qwen2_vl"), trained_model_dir()):
    # The marker is the last file a build writes before renaming the directory into place.
    if (checkpoint / MARKER_FILE).is_file():
        shared_tokenizer(checkpoint.resolve())
gc.collect()
gc.freeze()
# Torn down frozen, this process's objects would outlive the interpreter, and triton's
# extension (imported with torch) reports them as leaked on the way out.
atexit.register(gc.unfreeze)
