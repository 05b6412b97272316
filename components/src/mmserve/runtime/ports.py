"""Who holds a TCP port: one line for a launcher that finds its port taken.

Reads /proc (Linux): the listening socket's inode from /proc/net/tcp and tcp6, then the process
with a descriptor on it. A process of another user stays anonymous (its descriptors are not
readable); elsewhere than Linux only "taken" is known. `mmserve check-port` prints the line for
the launch scripts.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

_TCP_LISTEN = "0A"
_NATS_STORE_PREFIX = "mmserve-nats-"  # NatsServer's temporary directory
_CMDLINE_CHARS = 160


@dataclass(frozen=True, slots=True)
class PortHolder:
    port: int
    pid: int | None  # None: the listener's process is not visible to this user
    cmdline: str

    @property
    def ours(self) -> bool:
        """An mmserve process, or a nats-server that `mmserve nats` or `NatsServer` started."""
        return self._nats() or self._mmserve()

    def message(self) -> str:
        """One line saying who holds the port and, for ours, how to stop it."""
        if self.pid is None:
            return f"port {self.port} is taken by a process this user cannot see"
        command = self.cmdline[:_CMDLINE_CHARS]
        command += "..." if len(self.cmdline) > _CMDLINE_CHARS else ""
        if not self.ours:
            return f"port {self.port} is taken by another program (pid {self.pid}: {command})"
        what = "a nats-server that mmserve started" if self._nats() else "mmserve"
        return (
            f"port {self.port} is taken by {what} (pid {self.pid}: {command}); "
            f"if an earlier launch left it behind, stop it with: kill {self.pid}"
        )

    def _nats(self) -> bool:
        return _NATS_STORE_PREFIX in self.cmdline

    def _mmserve(self) -> bool:
        words = self.cmdline.split()
        if words[1:2] == ["-m"]:
            return words[2:3] != [] and words[2].split(".")[0] == "mmserve"
        return any(os.path.basename(word) == "mmserve" for word in words[:2])


def port_holder(port: int, host: str = "127.0.0.1") -> PortHolder | None:
    """Who keeps `host` from binding `port`, or None when it can."""
    if _can_bind(host, port):
        return None
    for pid, cmdline in _processes_holding(_listening_inodes(port)):
        return PortHolder(port, pid, cmdline)
    return PortHolder(port, None, "")


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) < 10 or fields[3] != _TCP_LISTEN:
                    continue
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    return inodes


def _processes_holding(inodes: set[str]) -> list[tuple[int, str]]:
    wanted = {f"socket:[{inode}]" for inode in inodes}
    found: list[tuple[int, str]] = []
    if not wanted:
        return found
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in wanted:
                        raw = (proc / "cmdline").read_bytes()
                        found.append((int(proc.name), raw.replace(b"\0", b" ").decode().strip()))
                        break
    return sorted(found)


def _can_bind(host: str, port: int) -> bool:
    """False when the port is in use; another failure (a host not of this machine) raises."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check-port",
        help="say in one line who holds a TCP port (exit 1 when taken)",
        description="Exit 0 when HOST can bind PORT; 1, printing who listens on it (pid and "
        "command line, read from /proc), when it is taken; 2 when HOST cannot be bound at all.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument("--port", type=int, required=True)
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        holder = port_holder(args.port, args.host)
    except OSError as exc:
        print(f"cannot bind {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stdout)
        return 2
    if holder is None:
        return 0
    print(holder.message(), file=sys.stdout)
    return 1
