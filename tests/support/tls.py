"""Certificates made for one test: a CA and a server certificate it signs (openssl CLI)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certificates:
    ca: Path
    cert: Path
    key: Path


def make_certificates(directory: Path, addresses: tuple[str, ...] = ("127.0.0.1",)) -> Certificates:
    """A fresh CA and a server certificate for `addresses` (IP SANs), valid for a day."""
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    cert, key, csr = directory / "server.pem", directory / "server.key", directory / "server.csr"
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = ["openssl", "req", *ec, "-days", "1"]
    subprocess.run(
        [*run, "-x509", "-keyout", ca_key, "-out", ca, "-subj", "/CN=mmserve test CA"],
        check=True, capture_output=True,
    )  # fmt: skip
    subprocess.run(
        [*run, "-keyout", key, "-out", csr, "-subj", "/CN=mmserve test server"],
        check=True, capture_output=True,
    )  # fmt: skip
    sans = directory / "sans.cnf"
    sans.write_text("subjectAltName=" + ",".join(f"IP:{a}" for a in addresses) + "\n")
    subprocess.run(
        ["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "1", "-extfile", sans],
        check=True, capture_output=True,
    )  # fmt: skip
    return Certificates(ca=ca, cert=cert, key=key)
