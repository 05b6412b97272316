"""Fixtures of the end-to-end suites: test images on a loopback HTTP server, deployments."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.deployment import CountingFileServer, serve_directory
from tests.support.images import photo_like
from tests.support.video import make_video


@pytest.fixture(scope="session")
def image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("images")
    photo_like(320, 240, 1).save(root / "photo.jpg", quality=90)
    photo_like(200, 300, 2).save(root / "tall.png")
    photo_like(90, 60, 3).save(root / "small.png")
    photo_like(1000, 4, 4).save(root / "sliver.png")  # aspect ratio over the models' 200
    jpeg = (root / "photo.jpg").read_bytes()
    (root / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    make_video(root / "clip.mp4", size="112x84", rate="10", seconds=2.0)
    return root


@pytest.fixture(scope="session")
def image_file_server(image_dir: Path) -> Iterator[tuple[str, CountingFileServer]]:
    """A loopback HTTP server over `image_dir`: its base URL, and the server counting GETs."""
    with serve_directory(image_dir) as served:
        yield served


@pytest.fixture(scope="session")
def image_server(image_file_server: tuple[str, CountingFileServer]) -> str:
    """Base URL of a loopback HTTP server over `image_dir`."""
    return image_file_server[0]


@pytest.fixture
def image_gets(image_file_server: tuple[str, CountingFileServer]) -> Counter[str]:
    """GETs per path the image server answered (a live count: compare before and after)."""
    return image_file_server[1].gets
