"""NVIDIA's benchmark client, aiperf, run against a deployment as a user runs it.

aiperf lives in its own environment (`.venv/aiperf`, made by `.ci/setup.sh`: it pins a Pillow
the main one does not). It needs a Hugging Face tokenizer to size its prompts; offline it only
reads the hub cache, so the tiny model's tokenizer is placed there under a repo id of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
AIPERF = Path(os.environ.get("MMSERVE_AIPERF", ROOT / ".venv" / "aiperf" / "bin" / "aiperf"))
TOKENIZER_REPO = "mmserve/tiny-tokenizer"
_SNAPSHOT = "0" * 40
TIMEOUT_S = 300


def offline_hub(model_dir: Path, root: Path) -> Path:
    """A hub cache under `root` holding `model_dir`'s tokenizer as `TOKENIZER_REPO`."""
    repo = root / ("models--" + TOKENIZER_REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / _SNAPSHOT
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(_SNAPSHOT)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        if not (snapshot / name).exists():
            (snapshot / name).symlink_to(model_dir / name)
    return root


def run_aiperf(base_url: str, model: str, hub: Path, out: Path, args: list[str]) -> dict[str, Any]:
    """`aiperf profile` with `args` against `base_url`; its JSON export. Raises with aiperf's
    output when it fails."""
    command = [
        str(AIPERF), "profile",
        "--model", model,
        "--url", base_url,
        "--endpoint-type", "chat",
        "--tokenizer", TOKENIZER_REPO,
        "--ui-type", "none",
        "--no-gpu-telemetry",
        "--artifact-dir", str(out),
        *args,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise AssertionError(f"aiperf failed ({done.returncode}):\n{done.stdout[-4000:]}")
    return json.loads((out / "profile_export_aiperf.json").read_text())
