"""A deployment's topology: the roles its components play, the endpoints each serves on the
runtime (`<role>.generate`, `<role>.reset_prefix_cache`, ...), and which role a request goes to
next given what is deployed, the one rule every hop uses:

| deployed                        | pattern   | request that still needs encoding | otherwise |
|---------------------------------|-----------|-----------------------------------|-----------|
| worker --encode                 | agg       | worker                            | worker    |
| encode + worker                 | E/PD      | encode                            | worker    |
| encode + decode + prefill       | E/P/D     | encode                            | decode    |
| decode + prefill [--encode]     | EP/D, P/D | decode                            | decode    |

The language hop (where an encoded or text-only request goes) is decode when a decode and a
prefill worker are both deployed, else an aggregated worker.
"""

from __future__ import annotations

import enum
from collections.abc import Callable


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


Deployed = Callable[[Role], bool]
"""Whether at least one instance of a role is registered."""


def language_hop(deployed: Deployed) -> Role | None:
    if deployed(Role.DECODE) and deployed(Role.PREFILL):
        return Role.DECODE
    if deployed(Role.WORKER):
        return Role.WORKER
    return None


def next_hop(deployed: Deployed, *, needs_encode: bool) -> Role | None:
    """The role to send a request to; None when no language hop is deployed."""
    language = language_hop(deployed)
    if language is None:
        return None
    if needs_encode and deployed(Role.ENCODE):
        return Role.ENCODE
    return language


def kv_roles(language: Role) -> tuple[Role, ...]:
    """The roles a request's route names instances for, behind a language hop."""
    return (Role.WORKER,) if language is Role.WORKER else (Role.PREFILL, Role.DECODE)


def missing_language_hop_message() -> str:
    return "no worker is ready: the deployment needs a worker, or a decode and a prefill worker"
