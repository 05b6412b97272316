"""The frontend's routers: which instance of a role serves a request. `scheduler` (KV-aware
worker choice), `encode_scheduler` (encode-worker choice by the embeddings each holds),
`indexer` and `kv_events` (the KV index and the subscriber that follows the workers' KV events),
`encoder_index` (the embedding index and its subscriber) and `settings` (their command-line
options). Which role comes next is `topology`; the retry of a gone instance is `runtime.retry`."""
