"""Model checkpoints: `family` (the facts of a checkpoint's family every worker needs), and the
offline tiny test models with their builders: `tiny`, `trained`, `training`, `scenes`, the
tokenizers (`tokenizer`, `gemma_tokenizer`), `chat_template` and the shipped `weights/`."""
