"""Every message mmserve puts on a wire, in one place.

Two families live here:

* OpenAI chat-completions shapes (JSON at the HTTP edge). Unknown request fields are ignored, as
  OpenAI-compatible servers usually do, so clients that send extra options keep working; options
  the server knows but does not support are declared here so the frontend can reject a
  non-default value by name (`ChatCompletionRequest.unsupported_options`).
* Internal messages (msgpack over NATS), all subclasses of `WireMessage`. Each carries a `type`
  tag that embeds `PROTOCOL_VERSION` (e.g. `"token_chunk.v1"`), so a peer speaking another
  version fails to decode with `ProtocolVersionError` instead of producing garbage. Unknown
  fields are ignored, so adding a field with a default stays compatible; removing, renaming or
  changing the meaning of a field needs a new `PROTOCOL_VERSION`.

`encode(msg)` / `decode(data, type)` are the one msgpack pair for internal messages. Hashes (u64)
travel as integers; `mm_hashes` travel as 16-digit lowercase hex strings (the engine contract).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar, overload

import msgspec

PROTOCOL_VERSION = 2

# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------


class ProtocolError(ValueError):
    """A message could not be decoded into the expected type."""


class ProtocolVersionError(ProtocolError):
    """The peer speaks a different protocol version."""


def _versioned_tag(class_name: str) -> str:
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", class_name).lower()
    return f"{snake}.v{PROTOCOL_VERSION}"


class WireMessage(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag=_versioned_tag):
    """Base of every internal message; the tag is `<snake_case_name>.v<PROTOCOL_VERSION>`."""


class _TagOnly(msgspec.Struct):
    type: str = ""


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}
_tag_peeker = msgspec.msgpack.Decoder(_TagOnly)
_VERSION_SUFFIX = re.compile(r"\.v(\d+)$")

M = TypeVar("M")


def encode(msg: WireMessage) -> bytes:
    """msgpack bytes of an internal message."""
    return _encoder.encode(msg)


# A class decodes to its instances; a union of classes (a `types.UnionType`) to `Any`.
@overload
def decode(data: bytes | memoryview, type: type[M]) -> M: ...
@overload
def decode(data: bytes | memoryview, type: Any) -> Any: ...
def decode(data: bytes | memoryview, type: Any) -> Any:
    """Decode `data` into `type` (a `WireMessage` subclass or a union of them).

    Raises `ProtocolVersionError` when the tag names another protocol version, `ProtocolError`
    for anything else that does not fit.
    """
    decoder = _decoders.get(type)
    if decoder is None:
        decoder = _decoders[type] = msgspec.msgpack.Decoder(type)
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as exc:
        _raise_if_version_mismatch(data)
        raise ProtocolError(f"cannot decode {_type_name(type)}: {exc}") from exc


def _raise_if_version_mismatch(data: bytes | memoryview) -> None:
    try:
        tag = _tag_peeker.decode(data).type
    except msgspec.DecodeError:
        return
    found = _VERSION_SUFFIX.search(tag)
    if found and int(found.group(1)) != PROTOCOL_VERSION:
        raise ProtocolVersionError(
            f"peer sent {tag!r} (protocol v{found.group(1)}); this side speaks "
            f"v{PROTOCOL_VERSION}: upgrade the older side"
        )


def _type_name(type_: Any) -> str:
    return getattr(type_, "__name__", None) or str(type_)


def mm_hash_hex(mm_hash: int) -> str:
    """The 16-digit lowercase hex form of a u64 media hash (`mm_hashes` on the wire)."""
    return f"{mm_hash:016x}"


# ---------------------------------------------------------------------------------------------
# OpenAI chat completions (JSON at the HTTP edge)
# ---------------------------------------------------------------------------------------------


class TextPart(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="text"):
    text: str


class ImageUrl(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="image_url"):
    image_url: ImageUrl | str  # some clients send the URL as a bare string

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


ContentPart = TextPart | ImageUrlPart


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_usage: bool = False


# The request's integers travel on to the workers as msgpack's 64-bit integers.
_INT64_MAX = 2**63 - 1


class ChatCompletionRequest(msgspec.Struct, frozen=True, kw_only=True):
    """`POST /v1/chat/completions` body. Unknown fields are ignored (see module docstring)."""

    model: str
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=_INT64_MAX)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1, le=_INT64_MAX)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0, le=_INT64_MAX)] | None = None  # 0: off
    seed: Annotated[int, msgspec.Meta(ge=-_INT64_MAX - 1, le=_INT64_MAX)] | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Known OpenAI options that mmserve does not implement: accepted only at their defaults.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    response_format: Any | None = None
    user: str | None = None

    def unsupported_options(self) -> list[str]:
        """Names of options set to a value mmserve cannot honour (the frontend answers 400)."""
        return [
            name
            for name, accepted in DEFAULT_ONLY_OPTIONS.items()
            if getattr(self, name) not in accepted
        ]


# The known OpenAI options mmserve does not implement, with the values it accepts for each
# (their defaults); `/openapi.json` documents these as the options' only values.
DEFAULT_ONLY_OPTIONS: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "frequency_penalty": (None, 0.0),
    "presence_penalty": (None, 0.0),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
}


FinishReason = Literal["stop", "length", "cancelled", "error"]


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class OpenAIUsage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None

    @classmethod
    def from_usage(cls, usage: Usage) -> OpenAIUsage:
        return cls(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            total_tokens=usage.prompt_tokens + usage.completion_tokens,
            prompt_tokens_details={"cached_tokens": usage.cached_tokens},
        )


class AssistantMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: None = None


class ChatCompletionResponse(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: OpenAIUsage | None = None
    object: Literal["chat.completion"] = "chat.completion"


class ChoiceDelta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionChunkChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    delta: ChoiceDelta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One SSE `data:` payload; the usage-only chunk has `choices=[]` and `usage` set."""

    id: str
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: OpenAIUsage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class OpenAIErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(msgspec.Struct, frozen=True, kw_only=True):
    """`{"error": {...}}`, OpenAI's error JSON."""

    error: OpenAIErrorBody


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    created: int
    owned_by: str = "mmserve"
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct, frozen=True, kw_only=True):
    data: list[ModelCard]
    object: Literal["list"] = "list"


# ---------------------------------------------------------------------------------------------
# Errors on the wire
# ---------------------------------------------------------------------------------------------

# Stable error codes. Media errors reuse the Rust core's codes (`fetch.too_large`, ...) as-is.
ERROR_BAD_REQUEST = "bad_request"
ERROR_NOT_FOUND = "not_found"
ERROR_TOO_LARGE = "too_large"
ERROR_PAYLOAD_TOO_LARGE = "payload_too_large"
ERROR_UNAVAILABLE = "unavailable"
ERROR_DEADLINE_EXCEEDED = "deadline_exceeded"
ERROR_CANCELLED = "cancelled"
ERROR_DISCONNECTED = "disconnected"
ERROR_SLOW_CONSUMER = "slow_consumer"
ERROR_PROTOCOL = "protocol"
ERROR_INTERNAL = "internal"

HTTP_STATUS_BY_CODE: dict[str, int] = {
    ERROR_BAD_REQUEST: 400,
    ERROR_NOT_FOUND: 404,
    ERROR_TOO_LARGE: 413,
    ERROR_PAYLOAD_TOO_LARGE: 413,
    ERROR_UNAVAILABLE: 503,
    ERROR_DEADLINE_EXCEEDED: 504,
    ERROR_CANCELLED: 499,
    ERROR_DISCONNECTED: 503,
    ERROR_SLOW_CONSUMER: 500,
    ERROR_PROTOCOL: 500,
    ERROR_INTERNAL: 500,
}


def http_status_for(code: str) -> int:
    """HTTP status hint for an error code; `<stage>.<kind>` media codes map to 400, or 413
    when a size limit was passed (bytes of an item or a request, pixels of an image)."""
    if code in HTTP_STATUS_BY_CODE:
        return HTTP_STATUS_BY_CODE[code]
    if code.endswith(("too_large", "too_many_bytes", "too_many_pixels")):
        return 413
    return 400 if "." in code else 500


class ErrorMessage(WireMessage, frozen=True):
    """A failure reported by the serving side; the caller raises it as `RemoteError`."""

    code: str
    message: str
    status: int = 500
    request_id: str = ""


# ---------------------------------------------------------------------------------------------
# Requests through the pipeline
# ---------------------------------------------------------------------------------------------


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means disabled
    seed: int | None = None


class StopConditions(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int = 16
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class TensorHandle(msgspec.Struct, frozen=True, kw_only=True):
    """A tensor that travels outside NATS: the transfer backend named in `backend` reads
    `descriptor` (backend-specific bytes) to fetch `shape` x `dtype`."""

    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the prefix: "bfloat16", "float32", "int64", ...
    backend: str  # "nixl" | "shm" | "inline"
    descriptor: bytes


class EmbeddingsHandle(msgspec.Struct, frozen=True, kw_only=True):
    """Vision-tower output for one media item; `aux` holds extra per-item tensors by name
    (Qwen3-VL's stacked deepstack features under "deepstack")."""

    embeddings: TensorHandle
    aux: dict[str, TensorHandle] = {}


class PlannedMedia(msgspec.Struct, frozen=True, kw_only=True):
    """One media item of a request plan: what it is, its identity, and the run of tokens it
    fills in the plan's token ids (vLLM's `MultiModalFeatureSpec` with its `PlaceholderRange`).
    """

    modality: Literal["image"] = "image"
    mm_hash: int  # blake3 of the raw encoded bytes, truncated to u64: the item's identity
    offset: int  # index of the item's first token in `RequestPlan.token_ids`
    length: int  # tokens the item fills: one per row of its embedding
    grid_thw: tuple[int, int, int]

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


class MediaPayload(msgspec.Struct, frozen=True, kw_only=True):
    """What travels beside one planned item for the stage that needs it: its encoded bytes
    (inline in `data`, or by transfer in `encoded`), its pixels (`--frontend-decoding`), or,
    after encode, its embeddings."""

    data: bytes | None = None
    encoded: TensorHandle | None = None  # uint8 encoded bytes
    pixel_values: TensorHandle | None = None
    embeddings: EmbeddingsHandle | None = None


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


class BootstrapInfo(WireMessage, frozen=True):
    """Where decode joins prefill's KV handover (SGLang's bootstrap server and room): prefill's
    first reply when its engine moves the KV cache itself."""

    host: str
    port: int
    room: int


class PrefillRequest(WireMessage, frozen=True):
    request: PreprocessedRequest


class PrefillDone(WireMessage, frozen=True):
    """Prefill's last reply to decode: the first token and the prompt's KV cache, exported by
    the engine as named tensors that decode fetches by transfer (empty for engines that move
    the cache themselves through the bootstrap room)."""

    request_id: str
    first_token_id: int
    prompt_tokens: int
    cached_tokens: int = 0
    kv: dict[str, TensorHandle] = {}


PrefillReply = BootstrapInfo | PrefillDone


class TokenChunk(WireMessage, frozen=True):
    """A step of generation; the last chunk has `finish_reason` and `usage`."""

    request_id: str
    token_ids: list[int] = []
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


# ---------------------------------------------------------------------------------------------
# Routing: KV events, discovery
# ---------------------------------------------------------------------------------------------


class KvBlock(msgspec.Struct, frozen=True, kw_only=True):
    block_hash: int  # chained sequence hash (u64)
    tokens_hash: int  # local hash of the block's tokens (u64)


class KvStored(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="stored"):
    parent_hash: int | None
    blocks: list[KvBlock]


class KvRemoved(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="removed"):
    block_hashes: list[int]


class KvCleared(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="cleared"):
    pass


class KvEvent(WireMessage, frozen=True):
    """One change of a worker's prefix cache; `event_id` increases by one per worker."""

    worker_id: str
    event_id: int
    data: KvStored | KvRemoved | KvCleared


class KvDumpRequest(WireMessage, frozen=True):
    """A router asks `worker_id` to publish its whole cache as KV events (it lost track)."""

    worker_id: str


class InstanceRecord(WireMessage, frozen=True):
    """Discovery entry of one serving instance of one endpoint. `facts` holds addresses a
    peer needs (e.g. `"transfer.backend"`, `"bootstrap.port"`)."""

    namespace: str
    component: str
    endpoint: str
    instance_id: str
    host: str
    pid: int
    started_at: float
    facts: dict[str, str] = {}


# ---------------------------------------------------------------------------------------------
# Runtime frames (mmserve.runtime): the envelope around every request and reply on NATS
# ---------------------------------------------------------------------------------------------


class RequestFrame(WireMessage, frozen=True):
    """A call: `payload` is the encoded request message; replies go to the NATS reply subject."""

    request_id: str
    deadline: float  # unix seconds
    payload: msgspec.Raw


class ReplyFrame(WireMessage, frozen=True):
    """One reply item; `seq` counts from 0 so a lost frame is detected."""

    request_id: str
    seq: int
    payload: msgspec.Raw
    instance_id: str = ""  # who serves the call: the caller fails it if that instance dies


class EndFrame(WireMessage, frozen=True):
    """End of a reply stream; `error` set when the handler failed."""

    request_id: str
    seq: int
    error: ErrorMessage | None = None


class KeepaliveFrame(WireMessage, frozen=True):
    """Sent by a server whose handler is working but has nothing to reply yet."""

    request_id: str
    instance_id: str = ""


class CancelFrame(WireMessage, frozen=True):
    """The caller gave up on the call answered to `reply_subject`: the server cancels it."""

    request_id: str
    reply_subject: str
    reason: str = ERROR_CANCELLED


ServerFrame = ReplyFrame | EndFrame | KeepaliveFrame


# ---------------------------------------------------------------------------------------------
# Transfer (mmserve.transfer): what `TensorHandle.descriptor` holds, per backend
# ---------------------------------------------------------------------------------------------
# backend "inline": the descriptor is the tensor's bytes (C order) themselves.


class NixlBufferDescriptor(WireMessage, frozen=True):
    """A registered buffer of one NIXL agent holding the tensor (READ mode: the producer's
    buffer; WRITE mode: the consumer's landing buffer). `agent_metadata` is the agent's partial
    metadata for this buffer (connection info + its memory keys); a peer loads it once per
    `(agent, buffer_id)`. Completion and failure travel as NIXL notifications naming
    `transfer_id`. The peer transfers only before `transfer_by` (Unix time; 0: not said): the
    owner's lease ends a little later, and then the buffer may hold another tensor."""

    transfer_id: str
    agent: str
    agent_metadata: bytes
    buffer_id: int
    mem_type: Literal["DRAM", "VRAM"]
    device_id: int
    address: int
    nbytes: int
    transfer_by: float = 0.0


class ShmBufferDescriptor(WireMessage, frozen=True):
    """A pooled shared-memory file on this host holding the tensor after a 64-byte header.
    `sequence` names this use of the buffer; the peer acknowledges it in the header."""

    name: str  # file name inside the shared-memory directory both sides use
    sequence: int
    nbytes: int


class TransferPoolStats(WireMessage, frozen=True):
    """Registered buffers of one transfer agent (all devices together)."""

    buffers: int
    registered_bytes: int
    in_use: int
    registrations: int  # buffers ever registered: flat once the pool is warm


class TransferProbeFetch(WireMessage, frozen=True):
    """`python -m mmserve.transfer.probe`: fetch each handle, answer the content digests."""

    handles: list[TensorHandle]
    pause_s: float = 0.0  # wait this long before fetching (a slow consumer)
    check: bool = True  # answer digests (costly for large tensors); timings come either way


class TransferProbeWrite(WireMessage, frozen=True):
    """Probe: write a seeded pattern into each destination, answer the digests written."""

    destinations: list[TensorHandle]
    seed: int


class TransferProbeReply(WireMessage, frozen=True):
    digests: list[str] = []
    seconds: list[float] = []  # per tensor: the fetch (until the data is here) or the write
    stats: TransferPoolStats | None = None
    error: str = ""
