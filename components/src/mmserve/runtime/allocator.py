"""The frontend's memory allocator: mimalloc (or jemalloc) preloaded in place of glibc's malloc.

Tokenizing a prompt is most of the frontend's CPU on text requests, and glibc's malloc and free
are about 45% of the tokenizer's own time (many small short-lived strings and vectors, freed on
the pool's other thread): with mimalloc preloaded the same encode takes half the CPU. Serving
systems preload an allocator from outside (vLLM's CPU guide preloads tcmalloc), by
`LD_PRELOAD`, which only works when set before the process starts. So
`mmserve frontend` re-executes itself once, first thing, with the library added to
`LD_PRELOAD`: a new interpreter of a few tens of milliseconds, before any heavy import.

`MMSERVE_FRONTEND_MALLOC` picks the allocator: `auto` (the default: mimalloc, else jemalloc,
else glibc's), `mimalloc`, `jemalloc`, `tcmalloc`, `system` (glibc's, no re-exec) or the path
of a shared library. A named allocator that is not installed falls back to glibc's with a
warning; `auto` falls back silently. A process whose `LD_PRELOAD` already names an allocator
keeps it (the caller chose), and the re-executed process, whose `LD_PRELOAD` names it, does not
re-execute again.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

ALLOCATOR_ENV = "MMSERVE_FRONTEND_MALLOC"
DEFAULT_ALLOCATOR = "auto"
# Shared-library names by allocator, as Debian, Ubuntu, Fedora and conda install them.
LIBRARIES = {
    "mimalloc": ("libmimalloc.so.2", "libmimalloc.so"),
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so"),
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
}
AUTO_ORDER = ("mimalloc", "jemalloc")
SYSTEM = "system"


def library_dirs() -> list[Path]:
    """Where the allocators' libraries are looked for: the environment's own lib dir (conda),
    then the system's (the multiarch dir first)."""
    dirs = [Path(sys.prefix) / "lib"]
    multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        dirs.append(Path("/usr/lib") / multiarch)
    dirs += [Path("/usr/lib64"), Path("/usr/local/lib"), Path("/usr/lib")]
    return dirs


def find_library(name: str, dirs: list[Path] | None = None) -> Path | None:
    """The installed shared library of allocator `name`, or None."""
    for directory in library_dirs() if dirs is None else dirs:
        for filename in LIBRARIES[name]:
            if (candidate := directory / filename).is_file():
                return candidate
    return None


def choose_library(choice: str, dirs: list[Path] | None = None) -> Path | None:
    """The library to preload for the value of `MMSERVE_FRONTEND_MALLOC`, or None for glibc's
    malloc. Raises ValueError for an unknown value."""
    if choice == SYSTEM:
        return None
    if choice == "auto":
        for name in AUTO_ORDER:
            if (found := find_library(name, dirs)) is not None:
                return found
        return None
    if choice in LIBRARIES:
        found = find_library(choice, dirs)
        if found is None:
            print(
                f"mmserve: {ALLOCATOR_ENV}={choice}, but no {LIBRARIES[choice][0]} is installed; "
                "using glibc's malloc",
                file=sys.stderr,
            )
        return found
    if "/" in choice:
        path = Path(choice)
        if path.is_file():
            return path
        print(f"mmserve: {ALLOCATOR_ENV}: no file {choice}; using glibc's malloc", file=sys.stderr)
        return None
    known = ", ".join(["auto", *LIBRARIES, SYSTEM])
    raise ValueError(f"{ALLOCATOR_ENV}={choice!r}: expected one of {known}, or a library's path")


def preloads_allocator(ld_preload: str) -> bool:
    """Whether an `LD_PRELOAD` value already names an allocator (ours or the caller's)."""
    names = {filename.split(".so")[0] for filenames in LIBRARIES.values() for filename in filenames}
    entries = ld_preload.replace(":", " ").split()
    return any(Path(entry).name.split(".so")[0] in names for entry in entries)


def reexec_with_allocator() -> None:
    """Re-execute this process (`sys.orig_argv`) with the chosen allocator preloaded; returns
    when there is nothing to do (glibc's chosen or the only one installed, or one already
    preloaded). Call it before anything else: the process image is replaced."""
    environ = os.environ
    ld_preload = environ.get("LD_PRELOAD", "")
    if not sys.platform.startswith("linux") or preloads_allocator(ld_preload):
        return  # LD_PRELOAD is the Linux loader's
    try:
        library = choose_library(environ.get(ALLOCATOR_ENV, DEFAULT_ALLOCATOR))
    except ValueError as exc:
        raise SystemExit(f"mmserve: {exc}") from None
    if library is None:
        return
    env = {**environ, "LD_PRELOAD": f"{library}:{ld_preload}" if ld_preload else str(library)}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def loaded_allocator(maps: Path = Path("/proc/self/maps")) -> str:
    """The allocator mapped into this process (an entry of `LIBRARIES`), else `system`."""
    try:
        text = maps.read_text()
    except OSError:
        return SYSTEM
    for name, filenames in LIBRARIES.items():
        if any(f"/{filename}" in text for filename in filenames):
            return name
    return SYSTEM
