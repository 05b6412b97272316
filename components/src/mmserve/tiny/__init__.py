"""The offline tiny models every test, benchmark and `make run` uses, and their builders:
`checkpoints` (a seeded tiny checkpoint per family, the default model, `make-tiny-model`),
`trained` (the default model: the tiny Qwen2-VL with the shipped `weights/`), `training` and
`scenes` (how those weights were trained, on generated scenes), the tokenizers (`tokenizer`,
`gemma_tokenizer`) and `chat_template`."""
