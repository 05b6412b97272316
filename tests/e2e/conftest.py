"""Fixtures of the end-to-end suites: test images on a loopback HTTP server, deployments."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from .images import photo_like


@pytest.fixture(scope="session")
def image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("images")
    photo_like(320, 240, 1).save(root / "photo.jpg", quality=90)
    photo_like(200, 300, 2).save(root / "tall.png")
    photo_like(90, 60, 3).save(root / "small.png")
    photo_like(1000, 4, 4).save(root / "sliver.png")  # aspect ratio over the models' 200
    jpeg = (root / "photo.jpg").read_bytes()
    (root / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    return root


@pytest.fixture(scope="session")
def image_server(image_dir: Path) -> Iterator[str]:
    """Base URL of a loopback HTTP server over `image_dir`."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(image_dir))
    handler.log_message = lambda *args: None  # type: ignore[method-assign]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
