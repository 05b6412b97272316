"""The frontend's allocator (`runtime/allocator.py`): `mmserve frontend` re-executes itself with
mimalloc (or jemalloc) preloaded, falls back to glibc's malloc when none is installed or when
asked, and keeps an allocator its caller preloaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmserve.runtime.allocator import (
    ALLOCATOR_ENV,
    choose_library,
    find_library,
    loaded_allocator,
    preloads_allocator,
)

# `mmserve frontend` as the command runs it (`cli.run`), with `main` replaced by a report of
# the allocator mapped into the process that reaches it.
FRONTEND = (
    "import sys\n"
    "import mmserve.cli as cli\n"
    "from mmserve.runtime.allocator import loaded_allocator\n"
    "sys.argv = ['mmserve', 'frontend']\n"
    "cli.main = lambda: print(loaded_allocator(), flush=True) or 0\n"
    "cli.run()\n"
)


def _frontend_allocator(**env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", ALLOCATOR_ENV)}
    done = subprocess.run(
        [sys.executable, "-c", FRONTEND],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _install(directory: Path, *filenames: str) -> Path:
    directory.mkdir(exist_ok=True)
    for filename in filenames:
        (directory / filename).write_bytes(b"")
    return directory


def test_auto_prefers_mimalloc_then_jemalloc_then_glibc(tmp_path: Path) -> None:
    both = _install(tmp_path / "both", "libjemalloc.so.2", "libmimalloc.so.2")
    assert choose_library("auto", [both]) == both / "libmimalloc.so.2"
    jemalloc = _install(tmp_path / "je", "libjemalloc.so.2")
    assert choose_library("auto", [tmp_path / "none", jemalloc]) == jemalloc / "libjemalloc.so.2"
    assert choose_library("auto", [tmp_path / "none"]) is None
    assert choose_library("system", [both]) is None


def test_a_named_allocator_that_is_missing_falls_back_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tcmalloc = _install(tmp_path / "tc", "libtcmalloc_minimal.so.4")
    assert choose_library("tcmalloc", [tcmalloc]) == tcmalloc / "libtcmalloc_minimal.so.4"
    assert choose_library("mimalloc", [tcmalloc]) is None
    assert "no libmimalloc.so.2 is installed; using glibc's malloc" in capsys.readouterr().err
    assert choose_library(str(tcmalloc / "libtcmalloc_minimal.so.4")) is not None
    assert choose_library(str(tmp_path / "libnothing.so")) is None
    with pytest.raises(ValueError, match=f"{ALLOCATOR_ENV}='glibc': expected one of auto"):
        choose_library("glibc")


def test_an_allocator_in_ld_preload_is_recognised() -> None:
    assert preloads_allocator("/usr/lib/x86_64-linux-gnu/libmimalloc.so.2")
    assert preloads_allocator("libfoo.so /opt/lib/libjemalloc.so.2")
    assert preloads_allocator("/a/libtcmalloc_minimal.so.4:/b/libfoo.so")
    assert not preloads_allocator("")
    assert not preloads_allocator("/usr/lib/libasan.so.8")


def test_loaded_allocator_reads_the_process_maps(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libmimalloc.so.2.0\n")
    assert loaded_allocator(maps) == "mimalloc"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert loaded_allocator(maps) == "system"


@pytest.mark.skipif(
    find_library("mimalloc") is None and find_library("jemalloc") is None,
    reason="needs mimalloc or jemalloc installed (libmimalloc2.0 / libjemalloc2)",
)
def test_the_frontend_command_runs_with_the_allocator_preloaded() -> None:
    """The real re-exec, in a process started as the command is: it reaches `main` with the
    allocator mapped, or with glibc's when told `system`; a caller's choice is kept."""
    expected = "mimalloc" if find_library("mimalloc") is not None else "jemalloc"
    assert _frontend_allocator() == expected
    assert _frontend_allocator(**{ALLOCATOR_ENV: "system"}) == "system"
    jemalloc = find_library("jemalloc")
    if jemalloc is not None:
        assert _frontend_allocator(LD_PRELOAD=str(jemalloc)) == "jemalloc"
