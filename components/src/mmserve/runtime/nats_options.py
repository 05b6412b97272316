"""How a component reaches NATS: the servers, TLS and credentials, all from the environment.

The variable names are the `nats` CLI's, so one environment serves both:

| variable | meaning |
| --- | --- |
| `NATS_URL` | one server, or several separated by commas (see below) |
| `NATS_CA` | CA certificate file that signs the servers' certificates: TLS on |
| `NATS_CERT`, `NATS_KEY` | this client's certificate and key files (servers that verify clients) |
| `NATS_CREDS` | a credentials file (JWT + NKey seed) |
| `NATS_NKEY` | a file holding an NKey seed |
| `NATS_USER`, `NATS_PASSWORD` | user and password |
| `NATS_TOKEN` | an authentication token |

With several servers the client picks one at random and reconnects to any other, and to those
the cluster announces. Credentials never come from the command line, where every local user
could read them (`ps`).
"""

from __future__ import annotations

import os
import ssl
from typing import Any

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def nats_servers(url: str | None = None) -> list[str]:
    """`url` (else `$NATS_URL`, else loopback) split into its servers."""
    given = url or os.environ.get("NATS_URL") or DEFAULT_NATS_URL
    return [server.strip() for server in given.split(",") if server.strip()]


def nats_connect_options() -> dict[str, Any]:
    """The TLS and credential keywords of `nats.connect` that the environment asks for."""
    env = os.environ
    options: dict[str, Any] = {}
    if ca := env.get("NATS_CA"):
        context = ssl.create_default_context(cafile=ca)
        if env.get("NATS_CERT"):
            context.load_cert_chain(env["NATS_CERT"], env.get("NATS_KEY"))
        options["tls"] = context
    elif env.get("NATS_CERT"):
        raise ValueError("NATS_CERT is set without NATS_CA: name the CA that signs the servers")
    if creds := env.get("NATS_CREDS"):
        options["user_credentials"] = creds
    if nkey := env.get("NATS_NKEY"):
        options["nkeys_seed"] = nkey
    if user := env.get("NATS_USER"):
        options["user"] = user
        options["password"] = env.get("NATS_PASSWORD", "")
    if token := env.get("NATS_TOKEN"):
        options["token"] = token
    return options
