"""The engine interface every worker calls, and the types it exchanges.

An engine runs the three model stages of a request:

- `encode(items)`: the vision tower over preprocessed media (pixel_values + grid from the Rust
  core), one `ItemEmbedding` per item;
- `prefill(request, embeddings)`: the planned prompt (each media item's run of tokens, one per
  embedding row, where the plan puts it) with the embeddings spliced in; samples the first
  token and returns a `KvHandle` that holds the KV cache;
- `decode(kv, sampling, stop)`: streams `TokenChunk`s, starting with the prefill's first token;
  the last one carries the finish reason and the usage.

`export_kv` / `import_kv` turn a handle into plain contiguous tensors and back, so the transfer
layer can move a prefill's cache to a decode engine in another process. The tensors hold the
cache alone: the decode worker imports them with its own request (the plan) and the prefill's
`protocol.PrefillDone`, the one source of the first token and the prompt and cached counts.

`Admission` is every engine's queue limit (`max_queue`); `engines.caching.CachingEngine` gives
an engine with mmserve's own prefix and encoder caches their events, snapshots and clearing.
Engines are engine-neutral: nothing here names a model family or a framework.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

import torch

from mmserve.kv.encoder_events import EncoderEventSink
from mmserve.kv.events import KvEventSink
from mmserve.protocol import (
    BootstrapInfo,
    CachesCleared,
    EncoderEntry,
    FirstToken,
    MRopePositions,
    PlannedMedia,
    PrefillDone,
    RequestPlan,
    Resumption,
    SamplingParams,
    StopConditions,
    TensorHandle,
    TokenChunk,
    TokenLogprob,
)

# protocol.SamplingParams defaults to temperature 1 (OpenAI's default); engine callers that
# give nothing get greedy decoding.
GREEDY = SamplingParams(temperature=0.0)


class EngineError(Exception):
    """A request the engine cannot run as given (bad shapes, counts, ids)."""


class UnsupportedRequest(EngineError):
    """A request this engine does not serve as asked (an option, in this engine's mode): the
    client's 400 `unsupported_option`, not the deployment's fault."""


class EngineOverloaded(EngineError):
    """The engine's queue is full; the caller should retry elsewhere or later (HTTP 503)."""


class MediaGone(EngineError):
    """An item came without its embedding (named by its media id alone, and no encoder cache
    held it; or skipped for the prefix cache, `ItemState.SKIPPED`) and the prefix
    cache does not hold its tokens either. The worker encodes a skipped item after all; for an
    id-only one the client must send the media again (HTTP 400 `media_id.gone`). `index` is the
    item's place in the plan."""

    def __init__(self, index: int) -> None:
        super().__init__(
            f"media item {index} was named by its uuid alone, and neither an encoder cache nor "
            "the prefix cache holds it any more; send the item again with its uuid"
        )
        self.index = index


MediaModality = Literal["image", "video", "audio"]
"""What a media item is (`PlannedMedia.modality`)."""

Embeddings = Sequence["ItemEmbedding | None"]
"""One per planned item, in plan order; None for an item named by its media id alone whose
embedding no encoder cache held (the prefix cache may still hold its tokens)."""


@dataclass(frozen=True)
class MediaInput:
    """One preprocessed image, video or audio clip for its tower.

    `mm_hash` is the item's identity (`PlannedMedia.mm_hash`: blake3 of the raw bytes, folded
    with the pixel bounds it was processed under, or for a video with its sampling): the
    encoder cache key, with the grid.
    `pixel_values` is `[grid_t * grid_h * grid_w, channels * temporal_patch * patch * patch]`
    (Qwen-VL patch rows; a video's `pixel_values_videos`), or one `[3, size, size]` image for a
    fixed-size tower (Gemma 3; see `ModelSpec.vision_input`); for a clip, its log-mel
    `input_features` `[mel bins, frames]`, its grid `(1, 1, valid frames)`.
    """

    mm_hash: int
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    modality: MediaModality = "image"
    # A video's own audio track served with its frames (`use_audio_in_video`).
    track: AudioTrack | None = None

    def track_clip(self) -> MediaInput | None:
        """The track as a clip for the audio tower (None without one)."""
        if self.track is None:
            return None
        return MediaInput(
            mm_hash=self.mm_hash,
            pixel_values=self.track.features,
            grid_thw=self.track.grid_thw,
            modality="audio",
        )


@dataclass(frozen=True)
class AudioTrack:
    """A video's own audio track, served interleaved with its frames (Qwen2.5-Omni's
    `use_audio_in_video`): its log-mel `input_features` `[mel bins, frames]`, its grid `(1, 1,
    valid frames)`, and which rows of the video's span are the track's (`rows`, bool, one per
    token of the span: True for an audio token, False for a frame's); the video's embedding
    holds the vision tower's rows and the audio tower's in that order."""

    features: torch.Tensor
    grid_thw: tuple[int, int, int]
    rows: torch.Tensor

    def interleave(self, frames: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """The span's rows: `frames`' where `rows` is False, `audio`'s where True."""
        heard = int(self.rows.sum())
        if (frames.shape[0], audio.shape[0]) != (len(self.rows) - heard, heard):
            raise EngineError(
                f"a video's span of {len(self.rows)} tokens ({heard} of its audio track) got "
                f"{frames.shape[0]} frame rows and {audio.shape[0]} audio rows"
            )
        rows = frames.new_empty((len(self.rows), frames.shape[1]))
        mask = self.rows.to(frames.device)
        rows[~mask] = frames
        rows[mask] = audio.to(frames.dtype)
        return rows


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
class VisionCost:
    """What the vision tower costs per token it computes, and the bytes of one embedding row
    (deepstack included): what an encoder weighs a peer pull against."""

    seconds_per_token: float
    row_bytes: int


@dataclass(frozen=True)
class EngineRequest:
    """A prompt ready for prefill: the request plan's part an engine reads.

    `token_ids` is the expanded prompt; `media` says where each item's run of tokens lies (the
    embeddings passed with the request follow the same order, one row per token of the run);
    `positions` are the plan's M-RoPE positions (None: 1-D positions 0..len).

    A request moved mid-stream to this engine (`resumed`, `protocol.Resumption`) runs its
    prompt with the completion's tokens so far after it: `token_ids` and `positions` hold
    both, `prompt_ids` the prompt alone. The engine continues that choice's completion as if
    it had sampled them: its first new token is the completion's token `len(resumed.token_ids)`
    (its draw's seed, the stop rules' counts), the penalties count them, and its text follows
    theirs (`engines.sampling`); a grammar's matcher (`SamplingParams.grammar`, where an
    engine constrains decoding) is built from the grammar and those tokens the same way.
    """

    request_id: str
    token_ids: tuple[int, ...]
    sampling: SamplingParams = GREEDY
    stop: StopConditions = field(default_factory=StopConditions)
    media: tuple[PlannedMedia, ...] = ()
    positions: MRopePositions | None = None
    resumed: Resumption | None = None

    @classmethod
    def from_plan(
        cls,
        request_id: str,
        plan: RequestPlan,
        sampling: SamplingParams = GREEDY,
        stop: StopConditions | None = None,
        resumed: Resumption | None = None,
    ) -> EngineRequest:
        generated = resumed.token_ids if resumed is not None else []
        if resumed is not None and sampling.n != 1:
            raise EngineError(f"a resumed request continues one choice, not n={sampling.n}")
        return cls(
            request_id=request_id,
            token_ids=(*plan.token_ids, *generated),
            media=tuple(plan.media),
            positions=_continued(plan, len(generated)),
            sampling=sampling,
            stop=stop if stop is not None else StopConditions(),
            resumed=resumed,
        )

    @property
    def resumed_ids(self) -> tuple[int, ...]:
        """The completion's tokens before this engine took it over (none for a new one)."""
        return () if self.resumed is None else tuple(self.resumed.token_ids)

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        """The prompt alone, without the tokens a resumed completion had."""
        return self.token_ids[: len(self.token_ids) - len(self.resumed_ids)]

    @property
    def first_choice(self) -> int:
        """The index of the request's first choice: the resumed one's, else 0."""
        return 0 if self.resumed is None else self.resumed.choice

    def check_media(self, embeddings: Embeddings) -> None:
        """The embeddings fit the plan: one per item, one row per token of its run, runs in
        order inside the prompt."""
        if len(embeddings) != len(self.media):
            raise EngineError(f"{len(embeddings)} embeddings for {len(self.media)} media items")
        previous_end = 0
        for index, (item, embedding) in enumerate(zip(self.media, embeddings, strict=True)):
            if item.offset < previous_end or item.end > len(self.token_ids):
                raise EngineError(
                    f"media item {index} spans [{item.offset}, {item.end}), outside the "
                    f"{len(self.token_ids)} prompt tokens or before the item ahead of it"
                )
            if embedding is not None and embedding.num_tokens != item.length:
                raise EngineError(
                    f"media item {index} fills {item.length} tokens but its embedding has "
                    f"{embedding.num_tokens} rows"
                )
            previous_end = item.end

    def live_embeddings(self, embeddings: Embeddings, cached: int) -> list[ItemEmbedding]:
        """The embeddings of the items with tokens past the first `cached` prompt tokens (the
        prefix the engine holds), in order: an item wholly inside it needs none, so one that
        came without its embedding is served from the prefix cache; else `MediaGone` (the first
        such item)."""
        live = []
        for index, (item, embedding) in enumerate(zip(self.media, embeddings, strict=True)):
            if item.end <= cached:
                continue
            if embedding is None:
                raise MediaGone(index)
            live.append(embedding)
        return live

    def media_mask(self) -> torch.Tensor:
        """A bool mask over the prompt, true at the tokens media items fill."""
        mask = torch.zeros(len(self.token_ids), dtype=torch.bool)
        for item in self.media:
            mask[item.offset : item.end] = True
        return mask


def _continued(plan: RequestPlan, generated: int) -> MRopePositions | None:
    """The plan's M-RoPE positions with `generated` text tokens after the prompt: each at the
    next position of all three rows, where decode would have put it (`len + delta` on)."""
    positions = plan.positions
    if positions is None or not generated:
        return positions
    length = len(plan.token_ids)
    after = range(length + positions.delta, length + positions.delta + generated)
    rows = [
        value
        for row in range(3)
        for value in (*positions.rows[row * length : (row + 1) * length], *after)
    ]
    return MRopePositions(rows=rows, delta=positions.delta)


StateT = TypeVar("StateT")
"""An engine's own state of a prefill's KV (`KvHandle.state`)."""


@dataclass
class KvHandle(Generic[StateT]):
    """A prefill's result, owned by the engine that made (or imported) it.

    `prompt_tokens` counts the prompt's tokens, `cached_tokens` those whose KV came from the
    prefix cache; `first_tokens` holds each choice's first token (one per `SamplingParams.n`)
    with its log-probabilities where the request asks for them. An imported handle takes
    them all from the prefill's `PrefillDone`.

    `state` is private to the engine. A handle is consumed by `decode` or freed by `release`.
    `sampling_seed` is the seed the first tokens were drawn with, and `prompt_logprobs` the
    prompt's log-probabilities, one per token after the first, where the request asks for them
    (`PrefillDone` carries both on).
    """

    request_id: str
    prompt_tokens: int
    first_tokens: list[FirstToken]
    cached_tokens: int
    state: StateT = field(repr=False)
    sampling_seed: int | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # The request's resumed completion (`EngineRequest.resumed`): `prompt_tokens` and the KV
    # then hold its tokens too, and the stream continues its choice after them.
    resumed: Resumption | None = None

    @property
    def first_token(self) -> int:
        """Choice 0's first token."""
        return self.first_tokens[0].token_id

    def prefill_done(self, kv: dict[str, TensorHandle] | None = None) -> PrefillDone:
        """What decode takes over from this prefill's handle (with the transfer handles of
        its exported tensors, where they travel by transfer): the first tokens and the counts."""
        return PrefillDone(
            request_id=self.request_id,
            first_tokens=self.first_tokens,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            kv=kv or {},
            sampling_seed=self.sampling_seed,
            prompt_logprobs=self.prompt_logprobs,
        )


class Admission:
    """An engine's queue limit: at most `max_queue` calls (encode, prefill, live decode
    streams) run at once; one more is refused with `EngineOverloaded`, any after `close` with
    `EngineError`."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.depth = 0
        self.closed = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        """Count a call against `max_queue` for as long as it runs."""
        if self.closed:
            raise EngineError("the engine is closed")
        if self.depth >= self.max_queue:
            raise EngineOverloaded(
                f"engine queue is full ({self.depth} requests in flight, limit "
                f"{self.max_queue}); retry later or on another worker"
            )
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def close(self) -> None:
        self.closed = True


class Engine(abc.ABC, Generic[StateT]):
    """The interface of an inference engine (hf, sglang, mock), over its own KV state."""

    @abc.abstractmethod
    async def encode(self, items: Sequence[MediaInput]) -> list[ItemEmbedding]:
        """The vision tower over `items`; repeated items come from the encoder cache."""

    @abc.abstractmethod
    async def prefill(
        self,
        request: EngineRequest,
        embeddings: Embeddings,
        bootstrap: BootstrapInfo | None = None,
    ) -> KvHandle[StateT]:
        """Run the prompt with `embeddings` spliced in; sample the first token. `bootstrap` is
        this engine's own `bootstrap_info` for the request, when it gives one. The embeddings
        of the items the prefix cache holds are not read (`EngineRequest.live_embeddings`)."""

    @abc.abstractmethod
    def decode(
        self, kv: KvHandle[StateT], sampling: SamplingParams, stop: StopConditions
    ) -> AsyncIterator[TokenChunk]:
        """Stream the completion from `kv`, starting with its first token; consumes `kv`.

        Chunks carry the new token ids and the text they complete; text that may still become
        a stop string is held back, and a matched stop string is never sent.
        """

    @abc.abstractmethod
    async def export_kv(self, kv: KvHandle[StateT]) -> dict[str, torch.Tensor]:
        """The handle's cache as plain contiguous CPU tensors (the handle stays valid); not
        the prompt, its plan or the first token, which decode has already."""

    @abc.abstractmethod
    async def import_kv(
        self,
        request: EngineRequest,
        done: PrefillDone,
        tensors: dict[str, torch.Tensor],
        bootstrap: BootstrapInfo | None = None,
    ) -> KvHandle[StateT]:
        """A handle for this engine from `export_kv`'s tensors, possibly made elsewhere:
        `request` is the decode worker's own (the plan the prefill ran), `done` the prefill's
        last reply (first token, prompt and cached counts), `bootstrap` the prefill's
        `bootstrap_info` when it gave one."""

    def bootstrap_info(self) -> BootstrapInfo | None:
        """Where a decode engine joins this prefill engine's KV handover of the next request
        (SGLang: its bootstrap server and a fresh room); None for engines whose KV travels as
        exported tensors. Prefill answers it to decode before it starts the prompt."""
        return None

    @abc.abstractmethod
    def release(self, kv: KvHandle[StateT]) -> None:
        """Free a handle that will not be decoded."""

    @abc.abstractmethod
    def subscribe_kv_events(self, sink: KvEventSink) -> None:
        """Call `sink` (from the engine's thread) for every prefix-cache change.

        The worker wraps each change in a `protocol.KvEvent` (worker id, event id) and
        publishes it; a sink must not block.
        """

    @abc.abstractmethod
    def kv_cache_snapshot(self) -> list[tuple[int, int | None, int]]:
        """Every cached block as `(block_hash, parent_hash, tokens_hash)`; callable from any
        thread (a router that lost track of this worker asks for a dump)."""

    def encoder_cache_stats(self) -> tuple[int, int]:
        """Encoder cache `(hits, misses)` so far; `(0, 0)` for an engine without one."""
        return 0, 0

    def subscribe_encoder_events(self, sink: EncoderEventSink) -> None:
        """Call `sink` (from any thread) for every encoder-cache change; an engine without an
        encoder cache never calls it. The worker publishes them as `protocol.EncoderEvent`s."""
        del sink  # nothing changes without a cache

    def encoder_cache_snapshot(self) -> list[EncoderEntry]:
        """Every encoder-cache entry; callable from any thread (for a router's dump)."""
        return []

    async def cached_embeddings(
        self, items: Sequence[tuple[int, tuple[int, int, int]]]
    ) -> list[ItemEmbedding | None]:
        """What the encoder cache holds for each `(mm_hash, grid_thw)`, None where it holds
        nothing (an item named by its media id alone); all None for an engine without one."""
        return [None for _ in items]

    async def media_in_cached_prefix(self, request: EngineRequest) -> list[int]:
        """The indices of the request's media items every token of which this engine's prefix
        cache holds, as far as a prefill would reuse them: their embeddings would go unread.
        None for an engine that does not say (its caller encodes everything)."""
        del request
        return []

    def store_embeddings(self, items: Sequence[ItemEmbedding]) -> None:
        """Keep embeddings made elsewhere (pulled from a peer encoder) in the encoder cache, as
        if encoded here; an engine without one keeps nothing."""
        del items

    def vision_cost(self) -> VisionCost | None:
        """The vision tower's cost, where the engine knows it; None otherwise (a peer pull is
        then always taken: a real tower costs far more than moving its output)."""
        return None

    async def clear_caches(self) -> CachesCleared:
        """Drop every prefix-cache block and encoder-cache entry (`POST /reset_prefix_cache`).

        The prefix cache says so with a `protocol.KvCleared` event through the KV event sinks,
        so the routers drop this worker's blocks. Requests already running keep their own KV.
        An engine without caches has nothing to drop. Raises `EngineOverloaded` when the engine
        cannot clear now (busy) and the caller should retry.
        """
        return CachesCleared()

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop the engine's thread; pending calls fail."""

    async def generate(
        self, request: EngineRequest, embeddings: Embeddings = ()
    ) -> AsyncIterator[TokenChunk]:
        """Prefill then decode, as one stream (the aggregated path)."""
        kv = await self.prefill(request, embeddings)
        async for chunk in self.decode(kv, request.sampling, request.stop):
            yield chunk
