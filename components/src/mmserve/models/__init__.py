"""Model checkpoints: `family`, the facts of a checkpoint's family every worker needs (the
offline test models and their builders are `mmserve.tiny`)."""
