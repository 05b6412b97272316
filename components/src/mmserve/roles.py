"""The roles a component plays in a deployment; each serves `<role>.generate` and
`<role>.reset_prefix_cache` on the runtime."""

from __future__ import annotations

import enum


class Role(str, enum.Enum):
    """A component's role; its value is the component name it registers under."""

    ENCODE = "encode"  # fetch, preprocess, vision tower; forwards to the language hop
    WORKER = "worker"  # aggregated: prefill and decode in one engine
    PREFILL = "prefill"  # runs prompts for decode workers
    DECODE = "decode"  # the entry point of prefill/decode disaggregation

    def __str__(self) -> str:
        return self.value


GENERATE = "generate"
"""The endpoint every role serves."""

RESET_PREFIX_CACHE = "reset_prefix_cache"
"""The endpoint every role serves beside `generate`: clear the engine's prefix and encoder
caches (`protocol.ResetCachesRequest` -> `protocol.CachesCleared`)."""

PULL_EMBEDDINGS = "pull_embeddings"
"""The endpoint encode workers serve beside `generate`: offer the embeddings their encoder
cache holds to a peer encoder (`protocol.EmbeddingPullRequest` -> `EmbeddingPullReply`)."""

ENCODE_ITEMS = "encode_items"
"""The endpoint encode workers serve for language workers: encode the items a request skipped
for a prefix cache that no longer holds them (`protocol.EncodeItemsRequest` ->
`EmbeddingPullReply`)."""

KV_CACHING_ROLES = (Role.WORKER, Role.PREFILL)
"""Roles whose engines cache the prompts they run, so publish KV events (decode imports a
prefill's KV without caching it)."""
