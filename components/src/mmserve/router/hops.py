"""Which role a request goes to next, given what is deployed: the one rule every hop uses.

| deployed                        | pattern   | request that still needs encoding | otherwise |
|---------------------------------|-----------|-----------------------------------|-----------|
| worker --encode                 | agg       | worker                            | worker    |
| encode + worker                 | E/PD      | encode                            | worker    |
| encode + decode + prefill       | E/P/D     | encode                            | decode    |
| decode + prefill [--encode]     | EP/D, P/D | decode                            | decode    |

The language hop (where an encoded or text-only request goes) is decode when a decode and a
prefill worker are both deployed, else an aggregated worker.
"""

from __future__ import annotations

from collections.abc import Callable

from mmserve.roles import Role

Deployed = Callable[[Role], bool]
"""Whether at least one instance of a role is registered."""


def language_hop(deployed: Deployed) -> Role | None:
    if deployed(Role.DECODE) and deployed(Role.PREFILL):
        return Role.DECODE
    if deployed(Role.WORKER):
        return Role.WORKER
    return None


def next_hop(deployed: Deployed, *, needs_encode: bool) -> Role | None:
    """The role to send a request to; None when no language hop is deployed."""
    language = language_hop(deployed)
    if language is None:
        return None
    if needs_encode and deployed(Role.ENCODE):
        return Role.ENCODE
    return language


def kv_roles(language: Role) -> tuple[Role, ...]:
    """The roles a request's route names instances for, behind a language hop."""
    return (Role.WORKER,) if language is Role.WORKER else (Role.PREFILL, Role.DECODE)


def missing_language_hop_message() -> str:
    return "no worker is ready: the deployment needs a worker, or a decode and a prefill worker"
