"""The hand-written stubs (`components/src/mmserve/_mm.pyi`) match the built extension."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ALLOWLIST = Path(__file__).with_name("stubtest_allowlist.txt")


def test_stubs_match_the_extension(tmp_path: Path) -> None:
    config = tmp_path / "mypy.ini"
    config.write_text(f"[mypy]\ncache_dir = {tmp_path / 'cache'}\n")
    command = [sys.executable, "-m", "mypy.stubtest", "mmserve._mm"]
    command += ["--allowlist", str(ALLOWLIST), "--mypy-config-file", str(config)]
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
