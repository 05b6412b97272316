"""Audio clips made for a test: signals from numpy (tones, noise shaped like speech, silence,
clipping), encoded by the ffmpeg program (FFmpeg's encoders, from the same libraries the core
decodes with) into every container and codec the core reads; and the references: torchcodec's
decoder and transformers' Whisper feature extractor."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torchcodec.decoders import AudioDecoder
from transformers import WhisperFeatureExtractor

FFMPEG = shutil.which("ffmpeg")


@dataclass(frozen=True)
class Encoding:
    """An output of the ffmpeg program: its file extension and the options that make it."""

    name: str
    ext: str
    options: tuple[str, ...]
    rate: int | None = None
    """The rate the encoder runs at, when it differs from the signal's."""


# Every codec the core reads in every container, at rates each encoder takes (PCM WAV is
# written by `wav_bytes`, without a process).
ENCODINGS = (
    Encoding("wav_alaw", "wav", ("-c:a", "pcm_alaw"), rate=8000),
    Encoding("wav_mulaw", "wav", ("-c:a", "pcm_mulaw"), rate=8000),
    Encoding("flac", "flac", ("-c:a", "flac")),
    Encoding("flac_24bit", "flac", ("-c:a", "flac", "-sample_fmt", "s32")),
    Encoding("mka_flac", "mka", ("-c:a", "flac")),
    Encoding("mp3_cbr", "mp3", ("-c:a", "libmp3lame", "-b:a", "96k"), rate=44100),
    Encoding("mp3_vbr", "mp3", ("-c:a", "libmp3lame", "-q:a", "5"), rate=22050),
    Encoding("mp3_8k", "mp3", ("-c:a", "libmp3lame", "-b:a", "24k"), rate=8000),
    Encoding("ogg_vorbis", "ogg", ("-c:a", "libvorbis", "-q:a", "3")),
    Encoding("ogg_opus", "ogg", ("-c:a", "libopus", "-b:a", "48k"), rate=48000),
    Encoding("webm_opus", "webm", ("-c:a", "libopus", "-b:a", "32k"), rate=24000),
    Encoding("m4a_aac", "m4a", ("-c:a", "aac", "-b:a", "96k")),
    Encoding("mp4_aac", "mp4", ("-c:a", "aac", "-b:a", "64k"), rate=22050),
)


def tone(rate: int, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """A few harmonics of a random pitch."""
    t = np.arange(round(rate * seconds)) / rate
    pitch = rng.uniform(80, 900)
    harmonics = [0.3 / k * np.sin(2 * np.pi * k * pitch * t + rng.uniform(0, 6)) for k in (1, 2, 3)]
    return np.sum(harmonics, axis=0)


def speech_like(rate: int, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """Noise through a moving resonance, in syllable-length bursts."""
    n = round(rate * seconds)
    t = np.arange(n) / rate
    noise = rng.standard_normal(n)
    resonance = np.sin(2 * np.pi * rng.uniform(300, 2500) * t) * noise
    envelope = np.clip(np.sin(2 * np.pi * rng.uniform(2, 6) * t), 0, None) ** 2
    return 0.4 * resonance * envelope


def noise(rate: int, seconds: float, rng: np.random.Generator) -> np.ndarray:
    return rng.uniform(0.01, 0.5) * rng.standard_normal(round(rate * seconds))


def clipped(rate: int, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """A tone driven far past full scale, then clipped."""
    return np.clip(8 * tone(rate, seconds, rng), -1.0, 1.0)


def silence(rate: int, seconds: float, rng: np.random.Generator) -> np.ndarray:
    return np.zeros(round(rate * seconds))


def sweep(rate: int, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """A chirp over most of the band, with a click in the middle."""
    t = np.arange(round(rate * seconds)) / rate
    top = rng.uniform(1000, rate / 2.2)
    x = 0.5 * np.sin(2 * np.pi * (50 + (top - 50) * t / (2 * max(seconds, 1e-3))) * t)
    x[len(x) // 2 : len(x) // 2 + 3] = 0.99
    return x


SIGNALS: dict[str, Callable[[int, float, np.random.Generator], np.ndarray]] = {
    "tone": tone,
    "speech_like": speech_like,
    "noise": noise,
    "clipped": clipped,
    "silence": silence,
    "sweep": sweep,
}


def signal(
    kind: str, rate: int, seconds: float, channels: int, rng: np.random.Generator
) -> np.ndarray:
    """`[n, channels]` float32 samples of one kind, each channel its own draw."""
    make = SIGNALS[kind]
    return np.stack([make(rate, seconds, rng) for _ in range(channels)], axis=1).astype(np.float32)


# WAV sample formats: (format tag, bytes per sample); tag 1 is integer PCM, 3 IEEE float.
WAV_FORMATS = {
    "u8": (1, 1),
    "s16": (1, 2),
    "s24": (1, 3),
    "s32": (1, 4),
    "f32": (3, 4),
    "f64": (3, 8),
}


def wav_bytes(samples: np.ndarray, rate: int, fmt: str, *, data_size: int | None = None) -> bytes:
    """`samples` ([n, channels] float) as a WAV file of sample format `fmt` (clipped to [-1, 1]
    for an integer one, as they are for a float one); the data chunk's size field says
    `data_size` when given (a header that lies)."""
    tag, width = WAV_FORMATS[fmt]
    channels = samples.shape[1]
    x = samples.astype(np.float64) if tag == 3 else np.clip(samples.astype(np.float64), -1, 1)
    if fmt == "u8":
        data = np.round(x * 127 + 128).astype(np.uint8).tobytes()
    elif fmt in ("s16", "s32"):
        scale = 2 ** (8 * width - 1) - 1
        data = np.round(x * scale).astype(f"<i{width}").tobytes()
    elif fmt == "s24":
        ints = np.round(x * (2**23 - 1)).astype("<i4").reshape(-1, 1).view(np.uint8)
        data = ints[:, :3].tobytes()
    else:
        data = x.astype(f"<f{width}").tobytes()
    block = channels * width
    fmt_chunk = (
        tag.to_bytes(2, "little")
        + channels.to_bytes(2, "little")
        + rate.to_bytes(4, "little")
        + (rate * block).to_bytes(4, "little")
        + block.to_bytes(2, "little")
        + (8 * width).to_bytes(2, "little")
    )
    size = len(data) if data_size is None else data_size
    body = b"WAVE" + b"fmt " + len(fmt_chunk).to_bytes(4, "little") + fmt_chunk
    body += b"data" + size.to_bytes(4, "little") + data
    return b"RIFF" + len(body).to_bytes(4, "little") + body


def encode(
    samples: np.ndarray, rate: int, encodings: Sequence[Encoding], workdir: Path
) -> dict[str, bytes]:
    """`samples` ([n, channels] float32 at `rate`) in each encoding, from one ffmpeg run."""
    channels = samples.shape[1]
    command = [FFMPEG or "ffmpeg", "-v", "error", "-y", "-f", "f32le", "-ar", str(rate)]
    command += ["-ac", str(channels), "-i", "-"]
    paths = {}
    for encoding in encodings:
        path = workdir / f"{encoding.name}.{encoding.ext}"
        paths[encoding.name] = path
        command += [*encoding.options, "-ar", str(encoding.rate or rate), str(path)]
    subprocess.run(command, input=np.ascontiguousarray(samples).tobytes(), check=True)
    return {name: path.read_bytes() for name, path in paths.items()}


def encode_one(samples: np.ndarray, rate: int, encoding: Encoding) -> bytes:
    with tempfile.TemporaryDirectory() as workdir:
        return encode(samples, rate, [encoding], Path(workdir))[encoding.name]


def torchcodec_samples(data: bytes, rate: int) -> np.ndarray:
    """What transformers' `load_audio` gives: torchcodec's decoder at `rate`, mono."""
    decoder = AudioDecoder(data, sample_rate=rate, num_channels=1)
    return decoder.get_all_samples().data[0].numpy()


def whisper_features(
    extractor: WhisperFeatureExtractor,
    clips: Sequence[np.ndarray],
    *,
    padding: str = "max_length",
    truncation: bool = True,
) -> list[tuple[np.ndarray, int]]:
    """(input_features, attention_mask sum) of each clip as Qwen2-Audio's processor calls the
    extractor (a batch at a time: each clip's features are its own)."""
    out = extractor(
        list(clips),
        sampling_rate=extractor.sampling_rate,
        return_attention_mask=True,
        return_tensors="np",
        padding=padding,
        truncation=truncation,
    )
    masks = out["attention_mask"].sum(axis=1)
    return [(out["input_features"][i], int(masks[i])) for i in range(len(clips))]
