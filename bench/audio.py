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
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import child, command_cpu_ms, serve_child

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


def ffmpeg_decode_ms(clip_path: Path, runs: int) -> float:
    """CPU time of the ffmpeg program decoding and resampling the clip to 16 kHz mono (median)."""
    command = ["ffmpeg", "-v", "error", "-threads", "1", "-i", str(clip_path), "-ac", "1"]
    return command_cpu_ms([*command, "-ar", str(RATE), "-f", "f32le", "-y", os.devnull], runs)


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
        serve_child(args.child, mmserve_path, transformers_path)
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
        ours = child("bench.audio", ["single", "mmserve", path, str(runs)])
        floor = ffmpeg_decode_ms(Path(path), runs)
        cells = [f"{seconds} s {fmt}", f"{floor:.0f}", f"{ours['ms']:.1f}"]
        for loader in loaders:
            theirs = child("bench.audio", ["single", loader, path, str(runs)])
            ratio = theirs["ms"] / ours["ms"]
            cells.append(f"{theirs['ms']:.1f} ({ratio:.1f}x, {theirs['rss_mib']:.0f} MiB)")
        one = child("bench.audio", ["pool", "1", path, str(args.batch)])
        many = child(
            "bench.audio",
            ["pool", str(threads), path, str(args.batch)],
            {"MMSERVE_MM_THREADS": str(threads)},
        )
        cells.append(f"{ours['rss_mib']:.0f} MiB")
        scaling = many["per_s"] / one["per_s"]
        cells.append(f"{one['per_s']:.1f} -> {many['per_s']:.1f} ({scaling:.2f}x on {threads})")
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
