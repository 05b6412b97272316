"""Media ids (vLLM's `uuid` on a media part): what a tenant named, so a later part carrying the
id alone is planned as that item (same identity and grid, so the same routing view and
cache keys) without the image being sent again.

A tenant is the API key a request presented: one key never reaches another's ids, and an
unknown id and another tenant's id get the same answer. A tenant naming an id again with other
content replaces it. Only identities are kept here; the embedding itself lives in an encoder's
cache, which may have dropped it since (the encode stage then answers `media_id.gone`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

# Entries kept, least recently used dropped first: an id costs ~200 bytes here, so the cap
# bounds the frontend's memory (~13 MiB), not the usefulness of ids, which the encoder caches
# bound long before.
MAX_MEDIA_IDS = 65536


def tenant_of(authorization: bytes) -> str:
    """The tenant of a request: a digest of the credentials it presented (empty: none), so the
    key itself is not kept."""
    return hashlib.blake2b(authorization, digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class KnownMedia:
    mm_hash: int
    grid_thw: tuple[int, int, int]


class MediaIds:
    def __init__(self, max_entries: int = MAX_MEDIA_IDS) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], KnownMedia] = OrderedDict()

    def remember(self, tenant: str, uuid: str, media: KnownMedia) -> None:
        key = (tenant, uuid)
        self._entries[key] = media
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def recall(self, tenant: str, uuid: str) -> KnownMedia | None:
        media = self._entries.get((tenant, uuid))
        if media is not None:
            self._entries.move_to_end((tenant, uuid))
        return media

    def __len__(self) -> int:
        return len(self._entries)
