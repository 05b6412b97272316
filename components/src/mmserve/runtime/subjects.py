"""The NATS subjects of a namespace, and the names allowed in them.

* `mmserve.<ns>.<component>.<endpoint>`: requests, load-balanced by a NATS queue group.
* `mmserve.<ns>.<component>.<endpoint>.<instance_id>`: requests to one instance.
* `mmserve.<ns>._cancel`: `CancelFrame`s, heard by every instance of the namespace.
* `mmserve.<ns>._events.<topic>`: broadcasts (the KV and encoder-cache events).
"""

from __future__ import annotations

import re

SUBJECT_ROOT = "mmserve"
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def check_name(kind: str, name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"{kind} name {name!r} must match [A-Za-z0-9_-]+")
    return name


def endpoint_subject(namespace: str, component: str, endpoint: str) -> str:
    return f"{SUBJECT_ROOT}.{namespace}.{component}.{endpoint}"


def cancel_subject(namespace: str) -> str:
    return f"{SUBJECT_ROOT}.{namespace}._cancel"


def event_subject(namespace: str, topic: str) -> str:
    return f"{SUBJECT_ROOT}.{namespace}._events.{check_name('topic', topic)}"
