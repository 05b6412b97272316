"""Imported by the forkserver (`forked.PRELOAD`): reads the tokenizers of the two checkpoints
most components serve (the tiny Qwen2-VL and the default model) into the process's shared
tokenizer (`mmserve.models.tokenizer`), so that every component forked from it finds them read,
as a preforking server's workers find what their parent loaded. Reading one is 1.5 to 2 CPU
seconds (Qwen's 151k-token vocabulary); the suite starts hundreds of components of these two.

A checkpoint not yet built is left to the components, which read it themselves.
"""

from __future__ import annotations

from mmserve.models.tokenizer import shared_tokenizer
from mmserve.tiny.checkpoints import MARKER_FILE, tiny_model_dir
from mmserve.tiny.trained import trained_model_dir

for checkpoint in (tiny_model_dir("qwen2_vl"), trained_model_dir()):
    # The marker is the last file a build writes before renaming the directory into place.
    if (checkpoint / MARKER_FILE).is_file():
        shared_tokenizer(checkpoint.resolve())
