from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import pytest

from mmserve import _mm
from mmserve import protocol as p
from mmserve.protocol import errors

U64_MAX = 2**64 - 1

HANDLE = p.TensorHandle(shape=(4, 8), dtype="bfloat16", backend="shm", descriptor=b"\x00\x01")
PLAN = p.RequestPlan(
    token_ids=[1, 151655, 151655, 2, 151655],
    media=[
        p.PlannedMedia(mm_hash=U64_MAX, offset=1, length=2, grid_thw=(1, 2, 4)),
        p.PlannedMedia(mm_hash=7, offset=4, length=1, grid_thw=(1, 2, 2)),
    ],
    positions=p.MRopePositions(rows=[0, 1, 1, 3, 4] * 3, delta=-1),
)
REQUEST = p.PreprocessedRequest(
    request_id="req-1",
    deadline=1_900_000_000.5,
    model="tiny",
    plan=PLAN,
    payloads=[
        p.MediaPayload(
            state=p.ItemState.PRECOMPUTED,
            pixel_values=HANDLE,
            embeddings=p.EmbeddingsHandle(embeddings=HANDLE, aux={"deepstack": HANDLE}),
        ),
        p.MediaPayload(data=b"\x89PNG"),
    ],
    sampling=p.SamplingParams(temperature=0.0, top_k=5, seed=3),
    stop=p.StopConditions(max_tokens=8, stop=["\n"], stop_token_ids=[151645], ignore_eos=True),
    lora_name="adapter",
)
# A video planned one item per temporal group (its bytes with group 0), an image and its crop,
# and an image named by its id alone; the second group skipped for the prefix cache.
GROUPED_PLAN = p.RequestPlan(
    token_ids=[1, 9, 9, 9, 9, 8, 8, 8, 7, 2],
    media=[
        p.PlannedMedia(modality="video", mm_hash=1, offset=1, length=2, grid_thw=(1, 2, 4)),
        p.PlannedMedia(
            modality="video",
            mm_hash=2,
            offset=3,
            length=2,
            grid_thw=(1, 2, 4),
            temporal_group=1,
            source=0,
        ),
        p.PlannedMedia(mm_hash=3, offset=5, length=2, grid_thw=(1, 2, 4)),
        p.PlannedMedia(mm_hash=4, offset=7, length=1, grid_thw=(1, 2, 2), crop=1, source=2),
        p.PlannedMedia(mm_hash=5, offset=8, length=1, grid_thw=(1, 2, 2)),
    ],
)
GROUPED = msgspec.structs.replace(
    REQUEST,
    plan=GROUPED_PLAN,
    payloads=[
        p.MediaPayload(encoded=HANDLE),
        p.MediaPayload(state=p.ItemState.SKIPPED),
        p.MediaPayload(data=b"\x89PNG"),
        p.MediaPayload(),
        p.MediaPayload(state=p.ItemState.REUSE),
    ],
)
BOOTSTRAP = p.BootstrapInfo(host="127.0.0.1", port=8998, room=U64_MAX)

WIRE_SAMPLES: list[p.WireMessage] = [
    p.ErrorMessage(code="fetch.too_large", message="image over 64 MiB", status=413),
    REQUEST,
    GROUPED,
    BOOTSTRAP,
    p.PrefillRequest(request=REQUEST),
    p.PrefillDone(
        request_id="r1", first_tokens=[p.FirstToken(9)], prompt_tokens=12, kv={"k0": HANDLE}
    ),
    p.TokenChunk(
        request_id="r",
        token_ids=[5, 6],
        text="hé",
        finish_reason="length",
        usage=p.Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1),
    ),
    p.KvEvent(
        worker_id="w1",
        event_id=3,
        data=p.KvStored(parent_hash=None, blocks=[p.KvBlock(block_hash=U64_MAX, tokens_hash=0)]),
    ),
    p.KvEvent(worker_id="w1", event_id=4, data=p.KvRemoved(block_hashes=[U64_MAX, 1])),
    p.KvEvent(worker_id="w1", event_id=5, data=p.KvCleared()),
    p.EncoderEvent(
        worker_id="w1",
        event_id=0,
        data=p.EncoderStored(
            entries=[p.EncoderEntry(mm_hash=U64_MAX, grid_thw=(1, 16, 16), num_tokens=64)]
        ),
    ),
    p.EncoderEvent(
        worker_id="w1",
        event_id=1,
        data=p.EncoderEvicted(
            entries=[p.EncoderEntry(mm_hash=1, grid_thw=(1, 2, 2), num_tokens=1)]
        ),
    ),
    p.EncoderEvent(worker_id="w1", event_id=2, data=p.EncoderCleared()),
    p.EncoderDumpRequest(worker_id="w1"),
    p.ResetCachesRequest(),
    p.CachesCleared(prefix_blocks=3, encoder_items=1),
    p.InstanceRecord(
        namespace="ns",
        component="worker",
        endpoint="generate",
        instance_id="ab12",
        host="127.0.0.1",
        pid=42,
        started_at=1.0,
        facts={"transfer.backend": "nixl"},
    ),
    p.CancelFrame(request_id="r", reply_subject="_INBOX.x.1"),
    p.KeepaliveFrame(request_id="r"),
    p.EndFrame(request_id="r", seq=2, error=p.ErrorMessage(code="internal", message="boom")),
]


@pytest.mark.parametrize("msg", WIRE_SAMPLES, ids=lambda m: type(m).__name__)
def test_wire_messages_round_trip(msg: p.WireMessage) -> None:
    assert p.decode(p.encode(msg), type(msg)) == msg


def test_an_item_carries_its_source_and_state() -> None:
    assert [GROUPED_PLAN.source_of(i) for i in range(5)] == [0, 0, 2, 2, 4]
    assert GROUPED.items_to_encode() == [0, 2, 3, 4]
    assert GROUPED.items(p.ItemState.SKIPPED) == [1]
    assert REQUEST.items(p.ItemState.PRECOMPUTED) == [0]


def test_a_payload_carries_embeddings_exactly_when_precomputed() -> None:
    embeddings = p.EmbeddingsHandle(embeddings=HANDLE)
    with pytest.raises(ValueError, match="encode media payload carries embeddings"):
        p.MediaPayload(embeddings=embeddings)
    with pytest.raises(ValueError, match="precomputed media payload carries no embeddings"):
        p.MediaPayload(state=p.ItemState.PRECOMPUTED)
    with pytest.raises(ValueError, match="reuse media payload carries nothing"):
        p.MediaPayload(state=p.ItemState.REUSE, data=b"x")
    assert p.MediaPayload.precomputed(embeddings).state is p.ItemState.PRECOMPUTED
    wire = msgspec.msgpack.encode({"state": "reuse", "data": b"x"})
    with pytest.raises(msgspec.ValidationError, match="carries nothing"):
        msgspec.msgpack.decode(wire, type=p.MediaPayload)


def test_skipping_keeps_a_source_whole() -> None:
    """Skipping the whole video, the crop alone and the id-only image: the crop stays with
    its image, which is left to encode; a precomputed item is never skipped."""
    request = GROUPED.skipping([0, 1, 3, 4, 99])
    assert request.items(p.ItemState.SKIPPED) == [0, 1, 4]
    assert request.items_to_encode() == [2, 3]
    assert REQUEST.skipping([0, 1]).items(p.ItemState.SKIPPED) == [1]


def test_encoding_skipped_encodes_only_the_skipped_items() -> None:
    """Each skipped item as an encoder takes it after all: encoded from the bytes its source
    carries (a later temporal group from its group 0's), read from the encoder cache when
    nothing does; the items encoded already are left out."""
    request = GROUPED.skipping([0, 1, 4]).encoding_skipped()
    states = [payload.state for payload in request.payloads]
    assert states == [
        p.ItemState.ENCODE,
        p.ItemState.ENCODE,
        p.ItemState.SKIPPED,
        p.ItemState.SKIPPED,
        p.ItemState.REUSE,
    ]
    assert REQUEST.skipping([1]).encoding_skipped().items_to_encode() == [1]


def test_tags_name_the_protocol_version() -> None:
    raw = msgspec.msgpack.decode(p.encode(p.KeepaliveFrame(request_id="r")))
    assert raw["type"] == f"keepalive_frame.v{p.PROTOCOL_VERSION}"


def test_union_decoding_picks_the_tagged_type() -> None:
    frames: list[p.WireMessage] = [
        p.ReplyFrame(request_id="r", seq=0, payload=msgspec.Raw(p.encode(BOOTSTRAP))),
        p.KeepaliveFrame(request_id="r"),
        p.EndFrame(request_id="r", seq=1),
    ]
    decoded = [p.decode(p.encode(f), p.ServerFrame) for f in frames]
    assert [type(f) for f in decoded] == [type(f) for f in frames]
    reply = decoded[0]
    assert isinstance(reply, p.ReplyFrame)
    assert p.decode(reply.payload, p.BootstrapInfo) == BOOTSTRAP


def test_other_protocol_version_is_an_error_not_garbage() -> None:
    chunk = next(m for m in WIRE_SAMPLES if isinstance(m, p.TokenChunk))
    raw = msgspec.msgpack.decode(p.encode(chunk))
    newer, ours = p.PROTOCOL_VERSION + 1, p.PROTOCOL_VERSION
    raw["type"] = f"token_chunk.v{newer}"
    with pytest.raises(p.ProtocolVersionError, match=rf"protocol v{newer}.*speaks v{ours}"):
        p.decode(msgspec.msgpack.encode(raw), p.TokenChunk)


def test_wrong_message_type_is_a_protocol_error() -> None:
    with pytest.raises(p.ProtocolError, match="TokenChunk") as info:
        p.decode(p.encode(BOOTSTRAP), p.TokenChunk)
    assert not isinstance(info.value, p.ProtocolVersionError)
    with pytest.raises(p.ProtocolError):
        p.decode(b"\xc1 not msgpack", p.TokenChunk)


def test_mm_hash_hex_is_16_lowercase_digits() -> None:
    assert p.mm_hash_hex(U64_MAX) == "ffffffffffffffff"
    assert p.mm_hash_hex(0xAB) == "00000000000000ab"


def test_chat_request_parses_text_and_image_parts_and_ignores_unknown_fields() -> None:
    body = b"""{"model": "tiny", "stream": true, "stream_options": {"include_usage": true},
      "stop": ["a", "b"], "max_completion_tokens": 4, "some_vendor_option": {"x": 1},
      "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
          {"type": "text", "text": "what is this?"},
          {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "low"}}]}]}"""
    req = msgspec.json.decode(body, type=p.ChatCompletionRequest)
    assert req.messages[0].content == "be brief"
    parts = req.messages[1].content
    assert isinstance(parts, list)
    assert parts[0] == p.TextPart(text="what is this?")
    assert parts[1] == p.ImageUrlPart(image_url=p.ImageUrl(url="https://x/y.png", detail="low"))
    assert req.stop == ["a", "b"]
    assert req.stream_options == p.StreamOptions(include_usage=True)
    assert req.unsupported_options() == []


def test_chat_request_rejects_unknown_content_part_with_its_path() -> None:
    body = b"""{"model": "m", "messages": [{"role": "user",
      "content": [{"type": "input_file", "file": {}}]}]}"""
    with pytest.raises(msgspec.ValidationError, match=r"input_file.*messages\[0\]\.content"):
        msgspec.json.decode(body, type=p.ChatCompletionRequest)


def test_an_audio_part_without_its_format_names_the_field() -> None:
    body = b"""{"model": "m", "messages": [{"role": "user",
      "content": [{"type": "input_audio", "input_audio": {"data": "AAAA"}}]}]}"""
    with pytest.raises(msgspec.ValidationError, match=r"format.*messages\[0\]\.content"):
        msgspec.json.decode(body, type=p.ChatCompletionRequest)


def test_unsupported_options_are_named() -> None:
    req = p.ChatCompletionRequest(
        model="m", messages=[], n=2, logprobs=True, tool_choice="auto", functions=[{}]
    )
    assert req.unsupported_options() == ["functions"]


def test_openai_responses_serialise_like_openai() -> None:
    chunk = p.ChatCompletionChunk(
        id="c",
        created=1,
        model="m",
        choices=[p.ChatCompletionChunkChoice(index=0, delta=p.ChoiceDelta(content="hi"))],
    )
    as_json = msgspec.json.decode(msgspec.json.encode(chunk))
    assert as_json["object"] == "chat.completion.chunk"
    assert as_json["choices"][0]["delta"] == {"content": "hi"}
    usage = p.OpenAIUsage.from_usage(p.Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1))
    assert usage.total_tokens == 5
    assert usage.prompt_tokens_details == {"cached_tokens": 1}


def all_wire_messages(cls: type = p.WireMessage) -> list[type]:
    found: list[type] = []
    subclasses: list[type] = cls.__subclasses__()
    for sub in subclasses:
        found += [sub, *all_wire_messages(sub)]
    return found


def test_every_wire_message_has_its_own_versioned_tag() -> None:
    tags = [cls.__struct_config__.tag for cls in all_wire_messages()]
    assert len(tags) == len(set(tags)), "two wire messages share a class name"
    assert all(tag.endswith(f".v{p.PROTOCOL_VERSION}") for tag in tags)


def test_a_field_added_by_a_newer_peer_is_ignored() -> None:
    raw = msgspec.msgpack.decode(p.encode(BOOTSTRAP))
    raw["added_later"] = [1, 2]
    assert p.decode(msgspec.msgpack.encode(raw), p.BootstrapInfo) == BOOTSTRAP


def test_every_core_code_is_catalogued_with_its_core_status() -> None:
    core = _mm.error_catalogue()
    assert len(core) > 70  # the core exports its whole table
    for code, (status, meaning) in core.items():
        stage, _, kind = code.partition(".")
        assert stage and kind, code
        assert 400 <= status < 600 and meaning, code
        assert (p.CATALOGUE[code].status, p.CATALOGUE[code].meaning) == (status, meaning)


def test_python_codes_are_its_constants_and_never_a_core_code() -> None:
    constants = {value for name, value in vars(errors).items() if name.startswith("ERROR_")}
    python = {entry.code for entry in errors.PYTHON_CODES}
    assert constants == python
    assert not python & set(_mm.error_catalogue()), sorted(python & set(_mm.error_catalogue()))
    assert all(400 <= entry.status < 600 for entry in errors.PYTHON_CODES)
    assert set(p.CATALOGUE) == python | set(_mm.error_catalogue())


def test_every_code_the_package_raises_by_its_text_is_catalogued() -> None:
    """Python's own codes are raised by their constants; a core code raised from Python (the
    frontend refusing what the core would) is spelt out, and must be one the core lists."""
    package = Path(p.__file__).resolve().parents[1]
    spelt: dict[str, str] = {}
    for source in package.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("ApiError", "RemoteError")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                spelt[str(node.args[0].value)] = f"{source.name}:{node.lineno}"
    assert spelt, "the scan sees no code raised by its text"
    assert {code: at for code, at in spelt.items() if code not in _mm.error_catalogue()} == {}


def test_a_code_catalogued_twice_is_refused() -> None:
    entry = p.ErrorCode("fetch.too_large", 400, "a second meaning")
    with pytest.raises(ValueError, match=r"fetch\.too_large"):
        errors._catalogue(errors.CORE_CODES, (entry,))


def test_meanings_read_the_core_limits() -> None:
    assert f"{_mm.MAX_BYTES_PER_ITEM >> 20} MiB" in p.CATALOGUE["fetch.too_large"].meaning
    assert f"{_mm.MAX_BYTES_PER_REQUEST >> 20} MiB" in p.CATALOGUE["request.too_many_bytes"].meaning
    assert f"at most {_mm.MAX_ITEMS_PER_REQUEST}" in p.CATALOGUE["request.too_many_items"].meaning


def test_a_refused_item_raises_a_catalogued_code() -> None:
    with pytest.raises(_mm.MediaError) as refused:
        _mm.decode_image(b"hello, world")
    assert p.http_status_for(refused.value.args[0]) == 400


@pytest.mark.parametrize(
    "code, status",
    [
        ("fetch.too_large", 413),
        ("decode.corrupt", 400),
        ("decode.too_many_pixels", 413),
        ("video.corrupt", 400),
        ("video.too_long", 413),
        ("fetch.bad_proxy", 500),  # the operator's setting, not the client's
        ("media_id.gone", 400),
        ("request.too_many_bytes", 413),
        ("process.offsets", 500),  # the driver's own inconsistency, not the client's
        ("spec.missing", 500),
        (p.ERROR_UNAVAILABLE, 503),
        (p.ERROR_DEADLINE_EXCEEDED, 504),
        ("no.such_code", 500),  # no suffix guesses: an unknown code is a fault of ours
    ],
)
def test_statuses_come_from_the_catalogue(code: str, status: int) -> None:
    assert p.http_status_for(code) == status
