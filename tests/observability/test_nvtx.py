"""NVTX ranges: no-ops bound at import when DYN_NVTX is unset, real ranges when set."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import json
from mmserve.observability import nvtx
with nvtx.nvtx_range(nvtx.ENC_GENERATE):
    nvtx.range_end(nvtx.range_start(nvtx.PD_TTFT))
print(json.dumps({
    "enabled": nvtx.ENABLED,
    "noop": nvtx.nvtx_range is nvtx._noop_range and nvtx.range_start is nvtx._noop_start,
    "shared_null": nvtx.nvtx_range("a") is nvtx.nvtx_range("b"),
}))
"""


def _probe(env_value: str | None) -> dict[str, bool]:
    import json

    env = {k: v for k, v in os.environ.items() if k != "DYN_NVTX"}
    if env_value is not None:
        env["DYN_NVTX"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_disabled_ranges_are_noops_bound_at_import() -> None:
    result = _probe(None)
    assert result == {"enabled": False, "noop": True, "shared_null": True}


def test_enabled_ranges_use_a_real_backend() -> None:
    result = _probe("1")
    assert result["enabled"] is True
    assert result["noop"] is False
