"""Model checkpoints: `family`, the facts of a checkpoint's family every worker needs, and
`tokenizer`, its tokenizer read once per process (the offline test models and their builders
are `mmserve.tiny`)."""
