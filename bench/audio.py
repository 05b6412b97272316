"""Audio preprocessing for the Qwen2-Audio families, from the encoded bytes to input_features.

Compares, in one run and on the same clips (speech-like noise made with numpy, 44.1 kHz
stereo; 10 s and 60 s; WAV 16-bit PCM and MP3 at 128 kb/s, encoded by the `ffmpeg` program):

- mmserve: `mmserve._mm.audio_features` (Rust: demux, decode and resample to 16 kHz mono with
  FFmpeg's libraries, stopping at the 30 s the extractor keeps; 128-bin log-mel features);
- transformers' `WhisperFeatureExtractor(feature_size=128)` (Qwen2-Audio's, called as its
  processor calls it) on samples decoded by torchcodec (`AudioDecoder(data, sample_rate=16000,
  num_channels=1)`, what transformers' `load_audio` uses) and by librosa (`librosa.load(data,
  sr=None)` then `librosa.resample` to 16 kHz, as vLLM loads audio); a loader that is not
  installed (`pip install -e .[bench]`) is left out with a note.

Rows are process CPU time (user + system, the median of the runs) with one thread everywhere
(torch, the core's pool, the decoders); the ratio is the other path's time over mmserve's. The
anchor column is the `ffmpeg` program decoding and resampling the whole clip to 16 kHz mono
(`-threads 1`, its start-up included). Each path runs in its own subprocess so its peak RSS
(ru_maxrss, which counts the interpreter and its imports) is its own. The pool row is
wall-clock throughput over a batch of clips from a thread pool of 1 and of `os.cpu_count()`
threads (mmserve only: the Rust call releases the GIL).

    .venv/bin/python -m bench.audio            # all clips
    .venv/bin/python -m bench.audio --quick    # 10 s clips only, 3 runs
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

RATE = 16000
FEATURE_SIZE = 128
CACHE = Path.home() / ".cache/mmserve/bench/audio"
CLIPS = [(seconds, fmt) for seconds in (10, 60) for fmt in ("wav", "mp3")]
ENCODERS = {"wav": ["-c:a", "pcm_s16le"], "mp3": ["-c:a", "libmp3lame", "-b:a", "128k"]}
LOADERS = {"torchcodec": "torchcodec", "librosa": "librosa"}


def clip(seconds: int, fmt: str) -> Path:
    """The clip, made once and cached: noise through a moving resonance in syllable-length
    bursts, 44.1 kHz stereo."""
    path = CACHE / f"speech-{seconds}s.{fmt}"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        rate, rng = 44100, np.random.default_rng(seconds)
        t = np.arange(rate * seconds) / rate
        channels = [
            0.4
            * np.sin(2 * np.pi * rng.uniform(300, 2500) * t)
            * rng.standard_normal(len(t))
            * np.clip(np.sin(2 * np.pi * rng.uniform(2, 6) * t), 0, None) ** 2
            for _ in range(2)
        ]
        pcm = np.stack(channels, axis=1).astype(np.float32).tobytes()
        tmp = path.with_suffix(".tmp." + fmt)
        command = ["ffmpeg", "-v", "error", "-y", "-f", "f32le", "-ar", str(rate), "-ac", "2"]
        subprocess.run([*command, "-i", "-", *ENCODERS[fmt], str(tmp)], input=pcm, check=True)
        tmp.rename(path)
    return path


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def mmserve_path() -> Callable[[bytes], Any]:
    from mmserve import _mm

    extractor = _mm.AudioFeatureExtractor(feature_size=FEATURE_SIZE)
    return lambda data: _mm.audio_features([data], extractor)


def transformers_path(loader: str) -> Callable[[bytes], Any]:
    """transformers' feature extractor, called as Qwen2-Audio's processor calls it, on the
    samples the loader decodes at 16 kHz, mono."""
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=FEATURE_SIZE)
    load = {"torchcodec": torchcodec_samples, "librosa": librosa_samples}[loader]

    def run(data: bytes) -> Any:
        out = extractor(
            load(data),
            sampling_rate=RATE,
            return_attention_mask=True,
            padding="max_length",
            return_tensors="np",
        )
        return out["input_features"], out["attention_mask"]

    return run


def torchcodec_samples(data: bytes) -> np.ndarray:
    from torchcodec.decoders import AudioDecoder

    decoder = AudioDecoder(data, sample_rate=RATE, num_channels=1)
    return decoder.get_all_samples().data[0].numpy()


def librosa_samples(data: bytes) -> np.ndarray:
    import librosa

    samples, rate = librosa.load(io.BytesIO(data), sr=None, mono=True)
    return librosa.resample(samples, orig_sr=rate, target_sr=RATE)


def measure_single(path: str, clip_path: Path, runs: int) -> dict[str, Any]:
    data = clip_path.read_bytes()
    run = mmserve_path() if path == "mmserve" else transformers_path(path)
    run(data)  # warm-up: imports, tables
    times = []
    for _ in range(runs):
        start = cpu_seconds()
        run(data)
        times.append(cpu_seconds() - start)
    return {"ms": statistics.median(times) * 1e3, "rss_mib": peak_rss_mib()}


def ffmpeg_decode_ms(clip_path: Path, runs: int) -> float:
    """CPU time of the ffmpeg program decoding and resampling the clip to 16 kHz mono (median)."""
    times = []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        command = ["ffmpeg", "-v", "error", "-threads", "1", "-i", str(clip_path), "-ac", "1"]
        subprocess.run([*command, "-ar", str(RATE), "-f", "f32le", "-y", os.devnull], check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        times.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return statistics.median(times) * 1e3


def measure_pool(clip_path: Path, threads: int, batch: int) -> dict[str, Any]:
    data = clip_path.read_bytes()
    run = mmserve_path()
    run(data)
    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(run, [data] * batch))
        wall = time.perf_counter() - start
    return {"clips_per_s": batch / wall, "rss_mib": peak_rss_mib()}


def child(args: list[str], threads: int = 1) -> dict[str, Any]:
    env = dict(os.environ)
    one = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
    env.update(one | {"MMSERVE_MM_THREADS": str(threads)})
    command = [sys.executable, "-m", "bench.audio", "--child", *args]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="timed runs per path and clip")
    parser.add_argument("--quick", action="store_true", help="10 s clips only, 3 runs")
    parser.add_argument("--batch", type=int, default=16, help="clips per pool measurement")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, path, clip_path, n = args.child
        if kind == "single":
            import torch

            torch.set_num_threads(1)
            result = measure_single(path, Path(clip_path), int(n))
        else:
            result = measure_pool(Path(clip_path), int(path), int(n))
        print(json.dumps(result))
        return
    if shutil.which("ffmpeg") is None:
        sys.exit("bench.audio needs the ffmpeg program (make setup)")
    runs = 3 if args.quick else args.runs
    clips = [c for c in CLIPS if not args.quick or c[0] == 10]
    loaders = [name for name, module in LOADERS.items() if importlib.util.find_spec(module)]
    missing = sorted(set(LOADERS) - set(loaders))
    print(f"load average {os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs; {FEATURE_SIZE} mel bins")
    if missing:
        print(f"not installed, left out: {', '.join(missing)}")
    print()
    print("| clip | ffmpeg decodes ms | mmserve ms | ", end="")
    print(" | ".join(f"{name} + transformers ms (x)" for name in loaders), end="")
    print(" | mmserve peak RSS | pool 1 -> N clips/s |")
    print("|---" * (5 + len(loaders)) + "|")
    threads = os.cpu_count() or 1
    for seconds, fmt in clips:
        path = str(clip(seconds, fmt))
        ours = child(["single", "mmserve", path, str(runs)])
        floor = ffmpeg_decode_ms(Path(path), runs)
        cells = [f"{seconds} s {fmt}", f"{floor:.0f}", f"{ours['ms']:.1f}"]
        for loader in loaders:
            theirs = child(["single", loader, path, str(runs)])
            ratio = theirs["ms"] / ours["ms"]
            cells.append(f"{theirs['ms']:.1f} ({ratio:.1f}x, {theirs['rss_mib']:.0f} MiB)")
        one = child(["pool", "1", path, str(args.batch)])
        many = child(["pool", str(threads), path, str(args.batch)], threads=threads)
        cells.append(f"{ours['rss_mib']:.0f} MiB")
        scaling = many["clips_per_s"] / one["clips_per_s"]
        cells.append(
            f"{one['clips_per_s']:.1f} -> {many['clips_per_s']:.1f} ({scaling:.2f}x on {threads})"
        )
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
