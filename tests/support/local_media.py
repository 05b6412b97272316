"""Test media on disk, served by a real HTTP server on 127.0.0.1 (the images: `support.images`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.deployment import serve_directory


@dataclass(frozen=True)
class MediaServer:
    root: Path
    url: str  # http://127.0.0.1:PORT

    def write(self, name: str, data: bytes) -> str:
        """Stores `data` under `name` and returns its URL."""
        (self.root / name).write_bytes(data)
        return f"{self.url}/{name}"


@contextmanager
def media_server_over(root: Path) -> Iterator[MediaServer]:
    """A loopback HTTP server over `root` (`deployment.serve_directory`'s), for one block."""
    with serve_directory(root) as (url, _server):
        yield MediaServer(root, url)
