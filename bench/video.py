"""Qwen2-VL video preprocessing, from the encoded bytes to pixel_values_videos + grid + hash.

Compares, in one run and on the same clips (testsrc2 content made with the `ffmpeg` program:
10 s and 60 s, 1280x720 and 1920x1080, H.264 in mp4 and VP9 in webm, 30 fps), sampled at
2 fps with the Qwen2-VL video processor's defaults:

- mmserve: `mmserve._mm.process_video` (Rust: headers, sampling, decoding only what the
  sampled frames need, resize, one-pass normalise + patchify, the video's mm_hash);
- transformers' `Qwen2VLVideoProcessor` on the same sampled frames, decoded by torchcodec
  (`VideoDecoder.get_frames_at`), PyAV (decode up to the last sampled frame) and decord
  (`VideoReader.get_batch`), each plus a blake3 hash of the bytes; a reader that is not
  installed (`pip install torchcodec av decord`) is left out with a note.

Single-thread rows are process CPU time (user + system) with one thread everywhere (torch,
the decoders). The anchor column is the `ffmpeg` program decoding every frame of the clip to
nothing (`-threads 1 -f null`, its start-up included): the floor a reader that decodes every
frame cannot go under. The pool rows are wall-clock throughput over a batch of videos processed from
a thread pool of 1 and of `os.cpu_count()` threads (mmserve only: the Rust call releases the
GIL). Each path runs in its own subprocess so its peak RSS is its own.

    .venv/bin/python -m bench.video            # all clips
    .venv/bin/python -m bench.video --quick    # 10 s clips at 1280x720 only, 2 runs
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import child, command_cpu_ms, serve_child

FPS = 2.0
CACHE = Path.home() / ".cache/mmserve/bench/video"
CLIPS = [
    (seconds, size, codec)
    for seconds in (10, 60)
    for size in ("1280x720", "1920x1080")
    for codec in ("h264", "vp9")
]
ENCODERS = {
    "h264": ("mp4", ["-c:v", "libx264", "-preset", "veryfast"]),
    "vp9": ("webm", ["-c:v", "libvpx-vp9", "-deadline", "realtime", "-cpu-used", "8"]),
}
READERS = {"torchcodec": "torchcodec", "pyav": "av", "decord": "decord"}


def clip(seconds: int, size: str, codec: str) -> Path:
    """The clip, made once and cached."""
    ext, args = ENCODERS[codec]
    path = CACHE / f"{codec}-{size}-{seconds}s.{ext}"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        source = f"testsrc2=size={size}:rate=30"
        command = ["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", source, "-t", str(seconds)]
        tmp = path.with_suffix(".tmp" + path.suffix)
        subprocess.run([*command, "-pix_fmt", "yuv420p", *args, str(tmp)], check=True)
        tmp.rename(path)
    return path


def mmserve_path() -> Callable[[bytes], Any]:
    from mmserve import _mm

    options = _mm.VideoOptions(fps=FPS)
    return lambda data: _mm.process_video(data, options)


def transformers_path(reader: str) -> Callable[[bytes], Any]:
    """transformers' video processor on frames the reader decodes at mmserve's (= its own)
    sampled indices, plus the hash of the bytes."""
    import blake3
    import torch
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    processor = Qwen2VLVideoProcessor()
    decode = {"torchcodec": torchcodec_frames, "pyav": pyav_frames, "decord": decord_frames}[reader]

    def run(data: bytes) -> Any:
        blake3.blake3(data).digest()
        frames, total, fps = decode(data)
        metadata = VideoMetadata(total_num_frames=total, fps=fps)
        indices = processor.sample_frames(metadata, fps=FPS).tolist()
        video = torch.from_numpy(np.ascontiguousarray(frames(indices))).permute(0, 3, 1, 2)
        out = processor(videos=[video], do_sample_frames=False, return_tensors="pt")
        return out["pixel_values_videos"], out["video_grid_thw"]

    return run


def torchcodec_frames(data: bytes) -> tuple[Callable[[list[int]], np.ndarray], int, float]:
    from torchcodec.decoders import VideoDecoder

    decoder = VideoDecoder(data, dimension_order="NHWC", num_ffmpeg_threads=1, device="cpu")
    meta = decoder.metadata
    return (
        lambda idx: decoder.get_frames_at(idx).data.numpy(),
        int(meta.num_frames or 0),
        float(meta.average_fps or 0),
    )


def pyav_frames(data: bytes) -> tuple[Callable[[list[int]], np.ndarray], int, float]:
    import av

    container = av.open(io.BytesIO(data))
    stream = container.streams.video[0]
    total, fps = stream.frames, float(stream.average_rate or 0)
    if total == 0:  # webm headers carry no frame count: count the packets, as mmserve does
        total = sum(1 for packet in container.demux(stream) if packet.size)
        container = av.open(io.BytesIO(data))
        stream = container.streams.video[0]
    stream.thread_type = "NONE"

    def frames(indices: list[int]) -> np.ndarray:
        wanted, out = set(indices), {}
        for i, frame in enumerate(container.decode(stream)):
            if i in wanted:
                out[i] = frame.to_ndarray(format="rgb24")
            if i >= indices[-1]:
                break
        return np.stack([out[i] for i in indices])

    return frames, total, fps


def decord_frames(data: bytes) -> tuple[Callable[[list[int]], np.ndarray], int, float]:
    import decord

    reader = decord.VideoReader(io.BytesIO(data), num_threads=1)
    return lambda idx: reader.get_batch(idx).asnumpy(), len(reader), reader.get_avg_fps()


def ffmpeg_decode_all_ms(clip_path: Path, runs: int) -> float:
    """CPU time of the ffmpeg program decoding every frame single-threaded (median)."""
    command = ["ffmpeg", "-v", "error", "-threads", "1", "-i", str(clip_path), "-f", "null"]
    return command_cpu_ms([*command, "-"], runs)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="timed runs per path and clip")
    parser.add_argument("--quick", action="store_true", help="10 s 1280x720 clips, 2 runs")
    parser.add_argument("--batch", type=int, default=8, help="videos per pool measurement")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        serve_child(args.child, mmserve_path, transformers_path)
        return
    if shutil.which("ffmpeg") is None:
        sys.exit("bench.video needs the ffmpeg program (make setup)")
    runs = 2 if args.quick else args.runs
    clips = [c for c in CLIPS if not args.quick or (c[0], c[1]) == (10, "1280x720")]
    readers = [r for r, module in READERS.items() if importlib.util.find_spec(module)]
    missing = sorted(set(READERS) - set(readers))
    print(f"load average {os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs; sampling at {FPS} fps")
    if missing:
        print(f"not installed, left out: {', '.join(missing)}")
    print()
    print("| clip | ffmpeg decodes all ms | mmserve ms | ", end="")
    print(" | ".join(f"{r} ms (x)" for r in readers), end="")
    print(" | mmserve peak RSS | pool 1 -> N videos/s |")
    print("|---" * (5 + len(readers)) + "|")
    threads = os.cpu_count() or 1
    for seconds, size, codec in clips:
        path = str(clip(seconds, size, codec))
        ours = child("bench.video", ["single", "mmserve", path, str(runs)])
        floor = ffmpeg_decode_all_ms(Path(path), runs)
        cells = [f"{seconds} s {size} {codec}", f"{floor:.0f}", f"{ours['ms']:.0f}"]
        for reader in readers:
            theirs = child("bench.video", ["single", reader, path, str(runs)])
            ratio = theirs["ms"] / ours["ms"]
            cells.append(f"{theirs['ms']:.0f} ({ratio:.1f}x, {theirs['rss_mib']:.0f} MiB)")
        one = child("bench.video", ["pool", "1", path, str(args.batch)])
        many = child("bench.video", ["pool", str(threads), path, str(args.batch)])
        cells.append(f"{ours['rss_mib']:.0f} MiB")
        scaling = many["per_s"] / one["per_s"]
        cells.append(f"{one['per_s']:.2f} -> {many['per_s']:.2f} ({scaling:.2f}x on {threads})")
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
