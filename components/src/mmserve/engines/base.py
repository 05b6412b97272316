"""The engine interface every worker calls, and the types it exchanges.

An engine runs the three model stages of a request:

- `encode(items)`: the vision tower over preprocessed media (pixel_values + grid from the Rust
  core), one `ItemEmbedding` per item;
- `prefill(request, embeddings)`: the prompt (placeholders already expanded to one token per
  embedding row) with the embeddings spliced in; samples the first token and returns a
  `KvHandle` that holds the KV cache;
- `decode(kv, sampling)`: streams `EngineOutput`s, starting with the prefill's first token.

`export_kv` / `import_kv` turn a handle into plain contiguous tensors and back, so the transfer
layer can move a prefill's cache to a decode engine in another process. Engines are
engine-neutral: nothing here names a model family or a framework.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

FinishReason = Literal["stop", "length"]


class EngineError(Exception):
    """A request the engine cannot run as given (bad shapes, counts, ids)."""


class EngineOverloaded(EngineError):
    """The engine's queue is full; the caller should retry elsewhere or later (HTTP 503)."""


@dataclass(frozen=True)
class MediaInput:
    """One preprocessed image for the vision tower.

    `mm_hash` is the item's content hash (u64, blake3 of the raw bytes): the encoder cache key.
    `pixel_values` is `[grid_t * grid_h * grid_w, channels * temporal_patch * patch * patch]`.
    """

    mm_hash: int
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]


@dataclass(frozen=True)
class ItemEmbedding:
    """The vision tower's output for one item: one row per placeholder token.

    `deepstack` holds the extra per-layer features some families (Qwen3-VL) add to the first
    decoder layers' hidden states at the same positions; empty otherwise.
    """

    mm_hash: int
    grid_thw: tuple[int, int, int]
    embeddings: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.embeddings.shape[0])


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. `temperature == 0` is greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise EngineError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise EngineError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise EngineError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EngineError(f"top_k must be >= 0, got {self.top_k}")


@dataclass(frozen=True)
class EngineRequest:
    """A prompt ready for prefill.

    `token_ids` is the expanded prompt: each media item's placeholder already repeated once per
    embedding row, items in prompt order. `mm_hashes` lists the items' content hashes in the same
    order; the prefix cache keys media blocks by them.
    """

    request_id: str
    token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    mm_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class EngineOutput:
    """One step of a decode stream: new token ids and the text they complete.

    `text` can be shorter than the tokens' text while a stop string may still be forming; the
    last output carries `finish_reason` and `usage`.
    """

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


@dataclass
class KvHandle:
    """A prefill's result, owned by the engine that made (or imported) it.

    `state` is private to the engine. A handle is consumed by `decode` or freed by `release`.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    first_token: int
    cached_tokens: int
    state: Any = field(repr=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class KvBlockStored:
    """Blocks that entered the prefix cache, in sequence order after `parent_hash`."""

    parent_hash: int | None
    block_hashes: tuple[int, ...]
    token_hashes: tuple[int, ...]


@dataclass(frozen=True)
class KvBlockRemoved:
    block_hashes: tuple[int, ...]


KvEvent = KvBlockStored | KvBlockRemoved
KvEventSink = Callable[[KvEvent], None]


class Engine(abc.ABC):
    """The interface of an inference engine (hf, sglang, mock)."""

    @abc.abstractmethod
    async def encode(self, items: Sequence[MediaInput]) -> list[ItemEmbedding]:
        """The vision tower over `items`; repeated items come from the encoder cache."""

    @abc.abstractmethod
    async def prefill(
        self, request: EngineRequest, embeddings: Sequence[ItemEmbedding]
    ) -> KvHandle:
        """Run the prompt with `embeddings` spliced in; sample the first token."""

    @abc.abstractmethod
    def decode(self, kv: KvHandle, sampling: SamplingParams) -> AsyncIterator[EngineOutput]:
        """Stream the completion from `kv`, starting with its first token; consumes `kv`."""

    @abc.abstractmethod
    async def export_kv(self, kv: KvHandle) -> dict[str, torch.Tensor]:
        """The handle as plain contiguous CPU tensors (the handle stays valid)."""

    @abc.abstractmethod
    async def import_kv(self, request_id: str, tensors: dict[str, torch.Tensor]) -> KvHandle:
        """A handle for this engine from `export_kv`'s tensors, possibly made elsewhere."""

    @abc.abstractmethod
    def release(self, kv: KvHandle) -> None:
        """Free a handle that will not be decoded."""

    @abc.abstractmethod
    def subscribe_kv_events(self, sink: KvEventSink) -> None:
        """Call `sink` (from the engine's thread) for every prefix-cache change."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop the engine's thread; pending calls fail."""

    async def generate(
        self, request: EngineRequest, embeddings: Sequence[ItemEmbedding] = ()
    ) -> AsyncIterator[EngineOutput]:
        """Prefill then decode, as one stream (the aggregated path)."""
        kv = await self.prefill(request, embeddings)
        async for output in self.decode(kv, request.sampling):
            yield output
