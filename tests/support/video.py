"""Small videos made for a test by the ffmpeg program (FFmpeg's encoders, from the same
libraries the core decodes with)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

FFMPEG = shutil.which("ffmpeg")


def make_video(
    path: Path,
    *,
    size: str = "96x64",
    rate: str = "10",
    seconds: float = 1.0,
    codec: str = "libx264",
    pix_fmt: str = "yuv420p",
    extra: tuple[str, ...] = (),
) -> bytes:
    if codec == "libx265":
        extra = ("-x265-params", "log-level=none", *extra)
    if codec == "libaom-av1":
        extra = ("-cpu-used", "8", *extra)
    source = f"testsrc2=size={size}:rate={rate}"
    command = [FFMPEG or "ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", source]
    command += ["-t", str(seconds), "-c:v", codec, "-pix_fmt", pix_fmt, *extra, str(path)]
    subprocess.run(command, check=True)
    return path.read_bytes()
