"""The msgpack encoding of every internal message: the `WireMessage` base, its versioned tags,
and the one `encode` / `decode` pair.

Each message carries a `type` tag that embeds `PROTOCOL_VERSION` (e.g. `"token_chunk.v5"`), so a
peer speaking another version fails to decode with `ProtocolVersionError` instead of producing
garbage. Unknown fields are ignored, so adding a field with a default stays compatible;
removing, renaming or changing the meaning of a field needs a new `PROTOCOL_VERSION`. The tag
is made from the class name, so renaming a message class changes its tag: a wire break too.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar, overload

import msgspec

PROTOCOL_VERSION = 6


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
