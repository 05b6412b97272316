"""How a component's process ends: drained on a signal, without outliving its owner, and
without the interpreter's teardown.

Children that do not outlive their owner: Linux's parent-death signal (`PR_SET_PDEATHSIG`).

A process killed hard (SIGKILL, a closed terminal) runs no cleanup, so whatever it started must
stop by itself. Two ways in:
- `die_with_parent` is a `preexec_fn` for `subprocess.Popen`: the child asks for SIGTERM when the
  thread that started it ends (the kernel tracks the forking thread, not the process, so start
  long-lived children from the main thread);
- `follow_launcher` runs first in every `mmserve` command: a launch script sets
  `MMSERVE_PARENT_PID=$$` on each component it starts, and the component asks for SIGTERM when
  that script goes (or exits at once when it already went).
Elsewhere than Linux both are no-ops.

A component stopped by SIGTERM or SIGINT drains first (`--drain-timeout`, the same flag on the
frontend and every worker), and a finished command leaves by `exit_without_teardown`.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
from typing import NoReturn

PARENT_PID_ENV = "MMSERVE_PARENT_PID"
_PR_SET_PDEATHSIG = 1
# How long a stopping component finishes what it serves: Kubernetes' default grace period, long
# enough for a chat completion of several hundred tokens on a loaded worker.
DEFAULT_DRAIN_TIMEOUT_S = 30.0

# Loaded before any fork: the child of `die_with_parent` only calls into it.
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def set_parent_death_signal(signum: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `signum` to this process when its parent ends; False where it
    cannot (not Linux, or prctl refused)."""
    if _libc is None:
        return False
    return _libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def die_with_parent() -> None:
    """`preexec_fn`: SIGTERM this child when the thread that started it ends."""
    parent = os.getppid()
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # the parent ended before the signal was set
        os.kill(os.getpid(), signal.SIGTERM)


def follow_launcher() -> None:
    """Stop with the launch script that started this process (`$MMSERVE_PARENT_PID`). The
    variable is removed so this process's own children do not take it as theirs."""
    value = os.environ.pop(PARENT_PID_ENV, None)
    if not value or not value.isdigit():
        return
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != int(value) and not process_exists(int(value)):
        raise SystemExit(f"mmserve: the launcher (pid {value}) is gone; not starting")


def process_exists(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user's counts too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def add_drain_timeout_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """`--drain-timeout S`: on the first SIGTERM or SIGINT, finish `what` for up to S seconds,
    then cancel the rest and exit 0; a second signal stops at once."""
    parser.add_argument(
        "--drain-timeout",
        type=_seconds,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        metavar="S",
        help=f"on SIGTERM or SIGINT, stop taking new work and finish the {what} for up to S "
        "seconds, then cancel the rest and exit; a second signal stops at once "
        "(default: %(default)g)",
    )


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds, 0 or more, got {text}")
    return value


def exit_without_teardown(status: int) -> NoReturn:
    """Exit with `status` once the command is done, skipping the interpreter's teardown: a
    worker has triton's nanobind extension loaded (transformers' masking_utils imports
    torch._dynamo, which imports triton when it is installed) and its start-up heap frozen
    (`runtime.heap`); frozen objects are never collected, so at teardown nanobind finds
    triton's still alive and prints some thirty `nanobind: leaked ...` lines. Freeing a model's
    objects one by one also takes seconds for nothing. Every resource of ours is closed by
    then; the output is flushed here."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe whose reader left
            pass
    os._exit(status)
