"""NATS runtime: serve endpoints, call them, discover instances. See docs/runtime.md.

`connection` (the `Runtime`: connect, namespace, shutdown, drain), `serving` (handlers,
keepalives, server-side cancellation), `calling` (`Client`: call and stream, deadlines,
instance targeting, typed errors), `events` (publish and subscribe), `cache_events` (numbered
cache events with dumps, for the routers), `discovery`, `subjects`,
`retry` (the one retry policy for a routed instance that is gone), `errors`, `nats_server`,
`lifetime` (children that stop with their owner), `ports` (who holds a port).

Names are imported lazily so that `mmserve nats` and the CLI stay light to import.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Cancelled": "errors",
    "DeadlineExceeded": "errors",
    "Disconnected": "errors",
    "PayloadTooLarge": "errors",
    "RemoteError": "errors",
    "Unavailable": "errors",
    "WireProtocolError": "errors",
    "InstanceEvent": "discovery",
    "InstanceWatcher": "discovery",
    "NatsServer": "nats_server",
    "find_nats_server_binary": "nats_server",
    "nats_url_from_env_or_private": "nats_server",
    "Client": "calling",
    "RequestContext": "serving",
    "ServedEndpoint": "serving",
    "Runtime": "connection",
    "run": "connection",
    "run_component": "connection",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mmserve.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"mmserve.runtime.{_EXPORTS[name]}"), name)
