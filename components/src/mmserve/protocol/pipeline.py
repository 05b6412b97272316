"""The messages of a request through the pipeline: the request plan the frontend computes once,
the payloads that travel beside it, prefill's handover to decode, and the token stream back."""

from __future__ import annotations

import enum
from collections.abc import Collection
from typing import Literal

import msgspec

from mmserve.protocol.openai import FinishReason, Usage
from mmserve.protocol.wire import WireMessage, mm_hash_hex

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "ebnf"]


class Grammar(msgspec.Struct, frozen=True, kw_only=True):
    """What a completion's text must follow (vLLM's structured outputs), as the frontend
    validated it; each worker compiles it for its own tokenizer (`mmserve.grammar`), and a
    decode worker rebuilds the matcher from it and the tokens already sampled."""

    kind: GrammarKind
    # The JSON Schema as JSON text, the regex, the EBNF grammar, or the choices as a JSON list
    # of strings; empty for `json_object` (any JSON object).
    spec: str = ""
    # With a reasoning parser on, the grammar starts after this token id (the reasoning
    # section's end, `</think>`); None: from the first token.
    start_after: int | None = None
    # JSON kinds: whitespace wherever JSON allows it (vLLM's default), else compact JSON with
    # ", " and ": " between items (vLLM's `disable_any_whitespace`, mmserve's default).
    any_whitespace: bool = False


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How each token is chosen (the logits chain in `engines.logits`, vLLM's formulas), and
    how many log-probabilities come back with it."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means disabled
    min_p: float = 0.0  # 0 means disabled
    seed: int | None = None
    # Over the completion's tokens (OpenAI's, -2..2).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # Over the prompt's and the completion's tokens (vLLM's and SGLang's, > 0; 1 is off).
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    # None: no log-probabilities; k >= 0: the chosen token's and the k most likely.
    logprobs: int | None = None
    # Completions of the one prompt, each its own stream of draws (`TokenChunk.index`).
    n: int = 1
    # The same for every prompt token after the first (vLLM's `prompt_logprobs`): the engine
    # scores the whole prompt, recomputing any prefix its cache holds.
    prompt_logprobs: int | None = None
    # Constrained decoding: each token is one the grammar allows; None: free text.
    grammar: Grammar | None = None

    @property
    def penalized(self) -> bool:
        return (
            self.frequency_penalty != 0
            or self.presence_penalty != 0
            or self.repetition_penalty != 1
        )


class StopConditions(msgspec.Struct, frozen=True, kw_only=True):
    """When a completion ends: EOS (unless `ignore_eos`), a stop id or string, `max_tokens`;
    before `min_tokens` tokens neither EOS, a stop id nor a stop string ends it (vLLM's
    rules)."""

    max_tokens: int = 16  # 0: a prefill only (prompt scoring), no token is emitted
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    # How the text ends (vLLM's output options): special tokens' text left out, and a stop
    # string (or a stop id's text) cut off unless it is to be included.
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class TensorHandle(msgspec.Struct, frozen=True, kw_only=True):
    """A tensor that travels outside NATS: the transfer backend named in `backend` reads
    `descriptor` (backend-specific bytes) to fetch `shape` x `dtype`."""

    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the prefix: "bfloat16", "float32", "int64", ...
    backend: str  # "nixl" | "shm" | "inline"
    descriptor: bytes


DEEPSTACK = "deepstack"
"""The `EmbeddingsHandle.aux` entry of Qwen3-VL's deepstack features, `[layers, tokens,
hidden]`."""


class EmbeddingsHandle(msgspec.Struct, frozen=True, kw_only=True):
    """Vision-tower output for one media item; `aux` holds extra per-item tensors by name
    (Qwen3-VL's stacked deepstack features under `DEEPSTACK`)."""

    embeddings: TensorHandle
    aux: dict[str, TensorHandle] = {}


class VideoSampling(msgspec.Struct, frozen=True, kw_only=True):
    """How a video item is sampled and sized, resolved once by the frontend from the operator's
    defaults and bounds and the request's `mm_processor_kwargs` / `media_io_kwargs`; every hop
    that decodes the video reads these values, so all of them see the same frames. Names and
    meanings are those of transformers' Qwen2-VL video processor (`sample_frames`,
    `smart_resize` with the video pixel budget)."""

    fps: float | None = None  # frames sampled per second of video; exclusive with num_frames
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int
    max_pixels: int
    # Qwen2.5-Omni's `use_audio_in_video`: the video's own audio track is served with its
    # frames, their tokens interleaved in the item's span (its rows: the vision tower's and
    # the audio tower's, in the span's order); it enters the item's identity.
    use_audio_in_video: bool = False


class PlannedMedia(msgspec.Struct, frozen=True, kw_only=True):
    """One media item of a request plan: what it is, its identity, and the run of tokens it
    fills in the plan's token ids (vLLM's `MultiModalFeatureSpec` with its `PlaceholderRange`).
    """

    modality: Literal["image", "video", "audio"] = "image"
    # The item's identity, as the Rust core's `identity` module makes it: blake3 of the raw
    # encoded bytes truncated to u64 (folded with `pixel_bounds` when set, with its crop for a
    # pan-and-scan crop, with every `video` option for a video, with its group for a temporal
    # group), or for precomputed embeddings blake3 of the tensors.
    mm_hash: int
    offset: int  # index of the item's first token in `RequestPlan.token_ids`
    length: int  # tokens the item fills: one per row of its embedding
    grid_thw: tuple[int, int, int]
    # (min_pixels, max_pixels) the image is resized under; None: the model's own.
    pixel_bounds: tuple[int, int] | None = None
    # A video's sampling and sizing (set exactly when `modality` is "video").
    video: VideoSampling | None = None
    # For a family that plans a video one item per temporal group (Qwen3-VL): which group
    # of its video this item is (its identity folds the video's with the group).
    temporal_group: int | None = None
    # Gemma 3's pan-and-scan knobs `(min_crop_size, max_num_crops, min_ratio_to_activate)`
    # the image was planned under (set on an image and its crops when pan-and-scan is on).
    pan_and_scan: tuple[int, int, float] | None = None
    # Which pan-and-scan crop of its image this item is, 1 for the first (its identity is
    # the image's folded with the crop and the knobs).
    crop: int | None = None
    # The index in `RequestPlan.media` of the item whose payload carries this item's bytes
    # when that is another item: a video's group 0 for its later groups, the image for its
    # crops. None: its own payload does (`RequestPlan.source_of`).
    source: int | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def mm_hash_hex(self) -> str:
        """The 16-hex form engines key their caches with (`mm_hashes`)."""
        return mm_hash_hex(self.mm_hash)


class MRopePositions(msgspec.Struct, frozen=True, kw_only=True):
    """M-RoPE position ids of a prompt: `rows` is `[3, len]` flattened row by row (temporal,
    height, width); decode continues at `len + delta`."""

    rows: list[int]
    delta: int


class RequestPlan(msgspec.Struct, frozen=True, kw_only=True):
    """A request as the model will read it, computed once by the Rust driver in the frontend:
    the expanded token ids (each item's placeholder repeated `length` times), each media item
    with its place in them, and the positions (`None`: 1-D positions 0..len, which is also what
    an M-RoPE model uses for a prompt without media). Every later hop reads it; none re-derives
    it."""

    token_ids: list[int]
    media: list[PlannedMedia] = []
    positions: MRopePositions | None = None

    def source_of(self, index: int) -> int:
        """The index of the item whose payload carries the bytes of item `index` (itself, a
        video's group 0, a crop's image): the items of one source share it."""
        source = self.media[index].source
        return index if source is None else source


class ItemState(enum.Enum):
    """What becomes of one planned item at the hop that reads its payload."""

    ENCODE = "encode"  # its bytes (or pixels) travel: an encoder encodes it
    REUSE = "reuse"  # named by its media id alone: an encoder reads its cache for it
    PRECOMPUTED = "precomputed"  # its embeddings travel: the client's own, or an encoder's
    # The routed language worker's prefix cache holds every token of it (the router's KV
    # index says so): no encoder runs it, and that worker encodes it after all, or asks an
    # encode worker to, when its cache dropped it meanwhile (`roles.base`).
    SKIPPED = "skipped"

    @property
    def by_encoder(self) -> bool:
        """Whether an encoder provides the item's embeddings: encoded, or read from its
        cache."""
        return self in (ItemState.ENCODE, ItemState.REUSE)


class MediaPayload(msgspec.Struct, frozen=True, kw_only=True):
    """What travels beside one planned item for the stage that needs it, and what that stage
    does with it (`state`): its encoded bytes (inline in `data`, or by transfer in `encoded`),
    its pixels (`--frontend-decoding`), its embeddings (after encode, or precomputed by the
    client: `PRECOMPUTED` exactly when they travel), or nothing (`REUSE`)."""

    state: ItemState = ItemState.ENCODE
    data: bytes | None = None
    encoded: TensorHandle | None = None  # uint8 encoded bytes
    pixel_values: TensorHandle | None = None
    embeddings: EmbeddingsHandle | None = None

    def __post_init__(self) -> None:
        if (self.state is ItemState.PRECOMPUTED) != (self.embeddings is not None):
            carried = "carries" if self.embeddings is not None else "carries no"
            raise ValueError(f"a {self.state.value} media payload {carried} embeddings")
        if self.state is ItemState.REUSE and self.carries_media:
            raise ValueError("a reuse media payload carries nothing")

    @classmethod
    def precomputed(cls, embeddings: EmbeddingsHandle) -> MediaPayload:
        return cls(state=ItemState.PRECOMPUTED, embeddings=embeddings)

    @property
    def carries_media(self) -> bool:
        return self.data is not None or self.encoded is not None or self.pixel_values is not None


class Resumption(msgspec.Struct, frozen=True, kw_only=True):
    """A completion moved to another instance mid-stream (migration): the tokens choice
    `choice` had streamed to the client before its instance was lost. The instance reads them
    after the prompt, as its own completion so far: its draws go on at token index
    `len(token_ids)` of that choice, the penalties count them, `min_tokens` and `max_tokens`
    count them, and its text starts after theirs. The request it travels in has `n` 1."""

    choice: int = 0
    token_ids: list[int]


class PreprocessedRequest(WireMessage, frozen=True):
    """What the frontend sends to the first worker: the plan, one payload per planned media
    item, and the sampling. `deadline` is unix time in seconds. `route` names the instance the
    router chose per component (`worker`, `prefill`, `decode`); a hop that calls one of them
    addresses that instance.
    """

    request_id: str
    deadline: float
    model: str
    plan: RequestPlan
    payloads: list[MediaPayload] = []
    sampling: SamplingParams = SamplingParams()
    stop: StopConditions = StopConditions()
    lora_name: str | None = None
    route: dict[str, str] = {}  # component -> instance id
    # Media item index -> an encode instance whose encoder cache holds that item while the
    # routed encoder does not (`--encode-router-mode peer-pull`): the encoder may pull it.
    peers: dict[int, str] = {}
    # Set when the request continues a stream its first instance lost (migration).
    resume: Resumption | None = None

    def items(self, *states: ItemState) -> list[int]:
        """The indices of the planned items in one of `states`."""
        return [i for i, payload in enumerate(self.payloads) if payload.state in states]

    def items_to_encode(self) -> list[int]:
        """The items an encoder provides (`ItemState.by_encoder`): every hop's one rule for
        whether, and what, the request still needs encoding."""
        return [i for i, payload in enumerate(self.payloads) if payload.state.by_encoder]

    def skipping(self, indices: Collection[int]) -> PreprocessedRequest:
        """The request with the items of `indices` an encoder would provide marked
        `SKIPPED`, but for a source kept whole: when an item of a video's temporal groups or
        of an image and its crops is left to an encoder, so are the others (the encoder reads
        the source's bytes once, and a transfer may not give them twice)."""
        to_encode = self.items_to_encode()
        wanted = set(indices).intersection(to_encode)
        encoded = {self.plan.source_of(i) for i in to_encode if i not in wanted}
        skipped = {i for i in wanted if self.plan.source_of(i) not in encoded}
        payloads = [
            msgspec.structs.replace(p, state=ItemState.SKIPPED) if i in skipped else p
            for i, p in enumerate(self.payloads)
        ]
        return msgspec.structs.replace(self, payloads=payloads)

    def encoding_skipped(self) -> PreprocessedRequest:
        """The request for an encoder to encode the skipped items after all (the prefix cache
        dropped one of them): each encoded from the bytes its source carries, else read from
        the encoder's cache; the other items an encoder would provide are left out, marked
        `SKIPPED` (the hop holds their embeddings already)."""

        def state(index: int, payload: MediaPayload) -> ItemState:
            if payload.state is ItemState.SKIPPED:
                carrier = self.payloads[self.plan.source_of(index)]
                return ItemState.ENCODE if carrier.carries_media else ItemState.REUSE
            return ItemState.SKIPPED if payload.state.by_encoder else payload.state

        payloads = [
            msgspec.structs.replace(payload, state=state(i, payload))
            for i, payload in enumerate(self.payloads)
        ]
        return msgspec.structs.replace(self, payloads=payloads)


class BootstrapInfo(WireMessage, frozen=True):
    """Where decode joins prefill's KV handover (SGLang's bootstrap server and room): prefill's
    first reply when its engine moves the KV cache itself."""

    host: str
    port: int
    room: int


class PrefillRequest(WireMessage, frozen=True):
    request: PreprocessedRequest


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """A chosen token's log-probability and the `top` most likely tokens' (id, logprob), most
    likely first: of the model's own distribution, before any sampling step (vLLM's "raw").
    `rank` is the token's 1-based rank in that distribution, where the engine gives it (the
    prompt's tokens)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []
    rank: int | None = None


class FirstToken(msgspec.Struct, frozen=True, array_like=True):
    """A choice's first token, sampled by the prefill, with its log-probabilities where the
    request asks for them."""

    token_id: int
    logprob: TokenLogprob | None = None


class PrefillDone(WireMessage, frozen=True):
    """Prefill's last reply to decode: each choice's first token (one per `SamplingParams.n`,
    choice 0 first) and the prompt's KV cache, once for all choices, exported by the engine as
    named tensors that decode fetches by transfer (empty for engines that move the cache
    themselves through the bootstrap room). `sampling_seed` is the seed the prefill sampled
    with (the request's own, or one it drew), so decode samples each next token as an
    aggregated worker would."""

    request_id: str
    first_tokens: list[FirstToken]
    prompt_tokens: int
    cached_tokens: int = 0
    kv: dict[str, TensorHandle] = {}
    sampling_seed: int | None = None
    # One per prompt token after the first, where the request asks for them.
    prompt_logprobs: list[TokenLogprob] = []

    @property
    def first_token_id(self) -> int:
        """Choice 0's first token."""
        return self.first_tokens[0].token_id


PrefillReply = BootstrapInfo | PrefillDone


class TokenChunk(WireMessage, frozen=True):
    """A step of one choice's generation (`index`, 0 unless the request asks for `n` > 1):
    each choice's last chunk has its `finish_reason`, and the stream's last chunk also the
    `usage` of all of them (the prompt counted once); the stream's first chunk carries the
    prompt's log-probabilities where the request asks for them (one per prompt token after the
    first). A request with `max_tokens` 0 streams one chunk without token ids."""

    request_id: str
    token_ids: list[int] = []
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] = []  # one per token id, where the request asks for them
    index: int = 0
    prompt_logprobs: list[TokenLogprob] = []
