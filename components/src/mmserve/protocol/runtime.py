"""The runtime's messages (mmserve.runtime): discovery records, the frames around every
request and reply on NATS, and the topics a cache's events travel on (`CacheEventTopics`,
named by `kv/` for each cache and used by `runtime.cache_events`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from mmserve.protocol.errors import ERROR_CANCELLED, ErrorMessage
from mmserve.protocol.wire import WireMessage


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


@dataclass(frozen=True, slots=True)
class CacheEventTopics:
    """One cache's topics and messages for one component."""

    events_topic: str
    dump_topic: str
    event_type: type[Any]  # a WireMessage with worker_id, event_id and data
    dump_request_type: type[Any]  # a WireMessage with worker_id
    cleared_type: type[Any]  # the data that empties a worker's cache in the index
    name: str  # for logs: "KV", "encoder"
