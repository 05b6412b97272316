"""300 MiB of images in one request, against an aggregated deployment (mock engine: the media
path is the same whatever the engine) with the default limits: the documented 413 comes back,
a good request beside it gets its usual answer, every process stays up, and neither the
frontend (which fetches every item to count its tokens, and refuses first) nor the worker
keeps the memory.

The images are sparse files on a loopback server: a PNG signature and header, then zeros, so
they cost no disk and little time to make.
"""

from __future__ import annotations

import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.deployment import Deployment, serve_directory

from .conftest import Trial, rss_mib
from .media import sample

# The hostile-input suite's helpers; its `good_answer` fixture (the good request's answer when
# nothing else runs) is imported as a fixture of this module, over this module's deployment.
from .test_hostile_input import (  # noqa: F401
    _body,
    _check_beside_a_good_request,
    _expect,
    good_answer,
)

MIB = 1 << 20
PARTS, PART_MIB = 6, 50  # 300 MiB in six images, each under the 64 MiB per-source cap
WHOLE_MIB = 300  # one image of 300 MiB
# The request cap is 256 MiB: holding on to it, or to the parts, would show well above this.
RSS_SLACK_MIB = 64.0


def sparse_png(path: Path, size_mib: int) -> None:
    """A PNG signature and IHDR (4096 x 4096 RGB) followed by zeros up to `size_mib`."""
    ihdr = struct.pack(">IIBBBBB", 4096, 4096, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr
    chunk += struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    with path.open("wb") as out:
        out.write(b"\x89PNG\r\n\x1a\n" + chunk)
        out.truncate(size_mib * MIB)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("large-media")
    (root / "sample.jpeg").write_bytes(sample("JPEG"))  # the good request's image
    for part in range(PARTS):
        sparse_png(root / f"part-{part}.png", PART_MIB)
    sparse_png(root / "whole.png", WHOLE_MIB)
    with serve_directory(root) as (url, _server):
        yield url


@pytest.fixture(scope="module")
def agg(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with Deployment.mock_agg(
        nats_url, tmp_path_factory.mktemp("large-media-logs")
    ).running() as deployment:
        yield deployment


CASES = {
    # name: (image paths, expected status, expected code)
    f"{PARTS} images of {PART_MIB} MiB (300 MiB) by URL": (
        [f"part-{part}.png" for part in range(PARTS)],
        413,
        "request.too_many_bytes",
    ),
    f"one image of {WHOLE_MIB} MiB by URL": (["whole.png"], 413, "fetch.too_large"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_300_mib_of_images(
    agg: Deployment,
    server: str,
    good_answer: str,  # noqa: F811 (the imported fixture)
    trial: Trial,
    case: str,
) -> None:
    paths, status, code = CASES[case]
    pids = {name: agg.processes[name].pid for name in ("frontend", "worker")}
    before = {name: rss_mib(pid) for name, pid in pids.items()}
    started = time.monotonic()
    [response] = _check_beside_a_good_request(
        agg, server, good_answer, _body([f"{server}/{path}" for path in paths])
    )
    took = time.monotonic() - started
    happened = _expect(response, status, code)
    after = {name: rss_mib(pid) for name, pid in pids.items()}
    peak = rss_mib(pids["frontend"], "VmHWM")

    for name in pids:
        assert after[name] - before[name] < RSS_SLACK_MIB, (name, before, after)
    trial(
        case,
        1,
        f"{happened} in {took:.1f} s; good request beside it unaffected; RSS frontend "
        f"{before['frontend']:.0f} -> {after['frontend']:.0f} MiB (peak {peak:.0f}), worker "
        f"{before['worker']:.0f} -> {after['worker']:.0f} MiB",
    )
