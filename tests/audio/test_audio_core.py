"""The Rust core's audio path against the references, over a few hundred clips made here:
decoded and resampled samples byte for byte against torchcodec's AudioDecoder (what
transformers' `load_audio` uses, on the same FFmpeg), log-mel features against transformers'
WhisperFeatureExtractor (Qwen2-Audio's), and the stable codes for what is refused."""

from __future__ import annotations

import functools
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from mmserve import _mm
from tests.support.audio import (
    ENCODINGS,
    FFMPEG,
    SIGNALS,
    Encoding,
    encode,
    encode_one,
    signal,
    torchcodec_samples,
    wav_bytes,
    whisper_features,
)

pytestmark = pytest.mark.skipif(FFMPEG is None, reason="needs the ffmpeg program (make setup)")

RATE = 16000
CHUNK = 30 * RATE
RATES = (8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000, 96000)
CHANNELS = (1, 2, 6)
# PCM WAV from numpy: every kind of signal at lengths from 0.1 s to past the chunk.
WAV_SECONDS = (0.1, 0.37, 1.0, 4.2, 12.5, 29.99, 30.0, 31.3)
# Each WAV signal in two sample formats, every format in turn.
WAV_FORMAT_PAIRS = (("u8", "s32"), ("s16", "f32"), ("s24", "f64"))
# Through each of ffmpeg's encoders: every kind, short (encoding dominates the module's time).
ENCODED_SECONDS = (0.1, 1.7)
# And one clip past the chunk in the lossy codecs.
LONG_ENCODINGS = ("mp3_cbr", "m4a_aac", "ogg_opus")

Clips = dict[str, bytes]


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Clips:
    """A few hundred clips, named by how they were made."""
    rng = np.random.default_rng(2026)
    out: Clips = {}
    i = 0
    for kind in SIGNALS:
        for seconds in WAV_SECONDS:
            rate, channels = RATES[i % len(RATES)], CHANNELS[i % len(CHANNELS)]
            x = signal(kind, rate, seconds, channels, rng)
            for fmt in WAV_FORMAT_PAIRS[i % len(WAV_FORMAT_PAIRS)]:
                out[f"{kind}_{seconds}s_{rate}hz_{channels}ch_wav_{fmt}"] = wav_bytes(x, rate, fmt)
            i += 1
    jobs: list[tuple[str, np.ndarray, int, tuple[Encoding, ...]]] = []
    for kind in SIGNALS:
        for seconds in ENCODED_SECONDS:
            rate, channels = RATES[i % len(RATES)], CHANNELS[i % 2]
            jobs.append(
                (
                    f"{kind}_{seconds}s_{rate}hz_{channels}ch",
                    signal(kind, rate, seconds, channels, rng),
                    rate,
                    ENCODINGS,
                )
            )
            i += 1
    long = tuple(e for e in ENCODINGS if e.name in LONG_ENCODINGS)
    jobs.append(
        ("speech_like_31.3s_44100hz_2ch", signal("speech_like", 44100, 31.3, 2, rng), 44100, long)
    )

    # One directory made here: the factory's first mktemp creates its base directory, which
    # two of the pool's threads would race to create.
    root = tmp_path_factory.mktemp("clips")

    def run(job: tuple[str, np.ndarray, int, tuple[Encoding, ...]]) -> Clips:
        name, x, rate, encodings = job
        workdir = root / name
        workdir.mkdir()
        return {f"{name}_{k}": v for k, v in encode(x, rate, encodings, workdir).items()}

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for encoded in pool.map(run, jobs):
            out.update(encoded)
    return out


@pytest.fixture(scope="module")
def reference(clips: Clips) -> dict[str, np.ndarray]:
    """torchcodec's samples of each clip at 16 kHz, mono."""
    return {name: torchcodec_samples(data, RATE) for name, data in clips.items()}


def test_the_corpus_covers_every_codec_and_container(clips: Clips) -> None:
    assert len(clips) >= 250
    seen = {(info["codec"], info["container"]) for info in map(_mm.probe_audio, clips.values())}
    codecs = {codec for codec, _ in seen}
    assert {"pcm_u8", "pcm_s16le", "pcm_s24le", "pcm_s32le", "pcm_f32le", "pcm_f64le"} <= codecs
    assert {"pcm_alaw", "pcm_mulaw", "flac", "mp3", "vorbis", "opus", "aac"} <= codecs
    containers = {container for _, container in seen}
    assert containers == {"wav", "flac", "mp3", "ogg", "matroska,webm", "mov,mp4,m4a,3gp,3g2,mj2"}


def test_samples_equal_torchcodec_byte_for_byte(
    clips: Clips, reference: dict[str, np.ndarray]
) -> None:
    differ = []
    for name, data in clips.items():
        info, samples = _mm.decode_audio(data, sample_rate=RATE)
        assert info["complete"]
        expected = reference[name]
        if samples.shape != expected.shape or samples.tobytes() != expected.tobytes():
            differ.append((name, samples.shape, expected.shape))
    assert not differ, differ


@pytest.mark.parametrize("rate", [8000, 24000, 44100, 48000])
def test_other_rates_equal_torchcodec(clips: Clips, rate: int) -> None:
    """Resampling to other rates, and no resampling where the clip is already at the rate
    (the decoder's own planar float copied as it is)."""
    some = {name: data for i, (name, data) in enumerate(clips.items()) if i % 19 == rate % 19}
    for name, data in some.items():
        _, samples = _mm.decode_audio(data, sample_rate=rate)
        expected = torchcodec_samples(data, rate)
        assert samples.tobytes() == expected.tobytes(), name


def test_a_cut_clip_stops_decoding_at_the_chunk_with_the_same_samples(
    clips: Clips, reference: dict[str, np.ndarray]
) -> None:
    long = [name for name in clips if name.startswith(("speech_like_31.3s", "tone_31.3s"))]
    assert len(long) >= 4
    for name in long:
        info, samples = _mm.decode_audio(clips[name], sample_rate=RATE, max_samples=CHUNK)
        assert not info["complete"], name
        assert samples.tobytes() == reference[name][:CHUNK].tobytes(), name


def test_the_headers_bound_every_decoded_count(
    clips: Clips, reference: dict[str, np.ndarray]
) -> None:
    """The plan counts a clip from its headers where they fix its frames: the bounds it reads
    hold the count torchcodec decodes, cut to the chunk, for every clip that has them; and
    every integer PCM WAV (but the 0.1 s ones, too short to count through the resampler) and
    every clip claiming well past the chunk has them."""
    bounded = set()
    for name, data in clips.items():
        info = _mm.probe_audio(data, sample_rate=RATE, max_samples=CHUNK)
        if info["sample_bounds"] is None:
            continue
        bounded.add(name)
        low, high = info["sample_bounds"]
        assert low <= min(len(reference[name]), CHUNK) <= high, name
        assert high - low <= 2, name
    pcm = {n for n in clips if "_wav" in n and "_0.1s_" not in n}
    pcm -= {n for n in pcm if n.endswith(("_f32", "_f64"))}
    long = {n for n in clips if "31.3s" in n}
    assert pcm | long <= bounded
    # Float PCM may hold samples that are not numbers, which only decoding finds.
    assert not any(n.endswith(("_f32", "_f64")) for n in bounded - long)


@pytest.mark.parametrize("rate", [16000, 8000, 22050, 44100, 48000])
def test_pcm_bounds_hold_at_the_frame_boundaries(rate: int) -> None:
    """Integer PCM WAV whose length at 16 kHz falls a sample or two either side of a feature
    frame's edge, or on it: the bounds hold torchcodec's count, and settle the frames but
    where the resampler's last sample could cross the edge."""
    rng = np.random.default_rng(rate)
    extractor = _mm.AudioFeatureExtractor(feature_size=128)
    settled = total = 0
    for frames in (11, 100, 517, 1999):
        for off in (-2, -1, 0, 1, 2):
            n = round((frames * 160 + off) * rate / RATE)
            x = signal("noise", rate, n / rate + 0.01, 1 + n % 2, rng)
            data = wav_bytes(x[:n], rate, "s16")
            bounds = _mm.probe_audio(data, sample_rate=RATE)["sample_bounds"]
            assert bounds is not None, n
            low, high = bounds
            count = len(torchcodec_samples(data, RATE))
            assert low <= count <= high, (n, count, low, high)
            total += 1
            if extractor.frames(low) == extractor.frames(high):
                settled += 1
                assert extractor.frames(count) == extractor.frames(low)
    # At the family's rate the count is the packets' own; through the resampler, a length on
    # an edge (a whole number of 10 ms) is settled, and some a sample or two off are left to
    # decoding.
    assert settled == total if rate == RATE else settled >= total // 5


def _extractor_pair(feature_size: int) -> tuple[WhisperFeatureExtractor, _mm.AudioFeatureExtractor]:
    return WhisperFeatureExtractor(feature_size=feature_size), _mm.AudioFeatureExtractor(
        feature_size=feature_size
    )


def test_mel_filters_equal_transformers() -> None:
    for feature_size in (80, 128):
        hf, ours = _extractor_pair(feature_size)
        expected = hf.mel_filters.astype(np.float32).astype(np.float64)
        assert np.array_equal(ours.mel_filters(), expected)


def float64_log_mel(
    extractor: WhisperFeatureExtractor, padded: np.ndarray, frames: int
) -> tuple[np.ndarray, float]:
    """The extractor's torch path carried out in float64 (the value its float32 arithmetic
    rounds) over the signal as padded: its first `frames` frames, floored as the whole clip
    is (no frame is above them, none below the padding's -10), and the value of a frame of
    padding alone."""
    window = torch.hann_window(extractor.n_fft, dtype=torch.float64)
    stft = torch.stft(
        torch.from_numpy(padded),
        extractor.n_fft,
        extractor.hop_length,
        window=window,
        return_complex=True,
    )
    power = stft[..., :frames].abs() ** 2
    filters = torch.from_numpy(extractor.mel_filters.astype(np.float32).astype(np.float64))
    log = torch.clamp(filters.T @ power, min=1e-10).log10()
    floor = max(float(log.max()), -10.0) - 8.0
    return ((torch.clamp(log, min=floor) + 4.0) / 4.0).numpy(), (max(-10.0, floor) + 4.0) / 4.0


def padded_float64_features(
    extractor: WhisperFeatureExtractor, samples: np.ndarray, frames: int
) -> tuple[np.ndarray, float]:
    """`float64_log_mel` of a clip padded to the chunk, over just enough of the padding that
    none of the first `frames` frames reaches the reflected end."""
    padded = np.zeros(min(CHUNK, extractor.hop_length * (frames + 3)), np.float64)
    kept = samples[: len(padded)]
    padded[: len(kept)] = kept
    return float64_log_mel(extractor, padded, frames)


def test_features_equal_whisper_feature_extractor(
    clips: Clips, reference: dict[str, np.ndarray]
) -> None:
    """Bytes to features in one call against torchcodec + WhisperFeatureExtractor (128 mel
    bins, Qwen2-Audio's): within 1e-5. The extractor's own float32 rounding passes that on
    narrow-band signals (a tone's quiet bins near the floor, up to about 1e-4): there the
    core must equal the extractor's computation carried out in float64 within 1e-6. Each
    signal once (a WAV signal is in two sample formats)."""
    hf, ours = _extractor_pair(128)
    twins = tuple(f"_wav_{second}" for _, second in WAV_FORMAT_PAIRS)
    names = [n for n in clips if not n.endswith(twins)]
    results = _mm.audio_features([clips[n] for n in names], ours)
    expected_all = [
        f
        for i in range(0, len(names), 16)
        for f in whisper_features(hf, [reference[n] for n in names[i : i + 16]])
    ]
    rounded = []
    for name, (_, features, valid, samples), (expected, mask) in zip(
        names, results, expected_all, strict=True
    ):
        assert features.shape == expected.shape == (128, 3000), name
        assert (valid, samples) == (mask, min(len(reference[name]), CHUNK)), name
        diff = float(np.abs(features - expected).max())
        assert diff <= 1e-4, name
        if diff > 1e-5:
            frames = min(3000, (samples + 200) // hf.hop_length + 2)
            exact, padding = padded_float64_features(hf, reference[name], frames)
            assert np.abs(features[:, :frames] - exact).max() <= 1e-6, name
            assert np.all(np.abs(features[:, frames:] - padding) <= 1e-6), name
            rounded.append(name)
    assert len(names) >= 200
    assert len(rounded) < len(names) * 2 // 3, rounded


def test_unpadded_features_equal_the_extractor_with_longest_padding(
    reference: dict[str, np.ndarray],
) -> None:
    """Qwen3-Omni's call: padding="longest" and no truncation, so one clip is its own length."""
    hf = WhisperFeatureExtractor(feature_size=128)
    ours = _mm.AudioFeatureExtractor(feature_size=128, padding="longest", truncation=False)
    names = [n for n in reference if n.endswith(("wav_s16", "mp3_cbr", "ogg_opus"))][::2]
    for name in names:
        samples = reference[name]
        [(expected, mask)] = whisper_features(hf, [samples], padding="longest", truncation=False)
        features, valid = ours(samples)
        assert features.shape == expected.shape, name
        assert valid == mask
        if np.abs(features - expected).max() > 1e-5:
            exact, _ = float64_log_mel(hf, samples.astype(np.float64), features.shape[1])
            assert np.abs(features - exact).max() <= 1e-6, name
    # torch's reflected padding needs more samples than the half window it reflects.
    assert media_error(lambda: ours(np.zeros(200, np.float32)))[0] == "audio.too_short"


def media_error(call: Callable[[], object]) -> tuple[str, str]:
    """(code, message) of the MediaError `call` raises."""
    with pytest.raises(_mm.MediaError) as err:
        call()
    return str(err.value.args[0]), str(err.value.args[1])


WAV_CODECS = {
    "u8": "pcm_u8",
    "s16": "pcm_s16le",
    "s24": "pcm_s24le",
    "s32": "pcm_s32le",
    "f32": "pcm_f32le",
    "f64": "pcm_f64le",
}


def test_probe_reads_the_headers(clips: Clips, reference: dict[str, np.ndarray]) -> None:
    for name, data in clips.items():
        info = _mm.probe_audio(data)
        if "_wav_" in name and not name.endswith(("alaw", "mulaw")):
            # {kind}_{seconds}s_{rate}hz_{channels}ch_wav_{fmt}, written by wav_bytes.
            _, seconds, rate, channels, _, fmt = name.rsplit("_", 5)
            assert info == {
                "container": "wav",
                "codec": WAV_CODECS[fmt],
                "sample_rate": int(rate.removesuffix("hz")),
                "channels": int(channels.removesuffix("ch")),
                "duration_s": pytest.approx(float(seconds.removesuffix("s")), abs=1e-4),
            }, name
        # A header's duration may count a codec's priming and padding, never much more.
        if info["duration_s"] is not None:
            assert abs(info["duration_s"] - len(reference[name]) / RATE) < 0.5, name


@pytest.fixture(scope="module")
def short_wav() -> tuple[np.ndarray, bytes]:
    x = signal("speech_like", 16000, 2.0, 1, np.random.default_rng(1))
    return x, wav_bytes(x, 16000, "s16")


def test_a_format_name_is_checked_against_the_bytes(short_wav: tuple[np.ndarray, bytes]) -> None:
    _, data = short_wav
    assert _mm.probe_audio(data, format="wav")["codec"] == "pcm_s16le"
    assert _mm.decode_audio(data, sample_rate=RATE, format="WAV")[1].shape == (32000,)
    code, message = media_error(lambda: _mm.probe_audio(data, format="mp3"))
    assert code == "audio.format_mismatch"
    assert "wav" in message and "mp3" in message
    assert (
        media_error(lambda: _mm.probe_audio(data, format="aiff"))[0] == "audio.unknown_format_name"
    )


def test_what_is_not_audio_is_refused(short_wav: tuple[np.ndarray, bytes], tmp_path: Path) -> None:
    x, _ = short_wav
    assert media_error(lambda: _mm.probe_audio(b"\x00" * 4000))[0] == "audio.unknown_format"
    assert media_error(lambda: _mm.probe_audio(b""))[0] == "audio.unknown_format"
    png = b"\x89PNG\r\n\x1a\n" + b"\x00" * 100
    assert media_error(lambda: _mm.decode_audio(png, sample_rate=RATE))[0] in (
        "audio.unknown_format",
        "audio.unsupported_container",
    )
    # Containers and codecs off the whitelist.
    adts = encode_one(x, 16000, Encoding("adts", "aac", ("-c:a", "aac")))
    assert media_error(lambda: _mm.probe_audio(adts)) == (
        "audio.unsupported_container",
        'the container "aac" is not supported (supported: wav, flac, mp3, ogg, webm/mkv, m4a/mp4)',
    )
    aiff = encode_one(x, 16000, Encoding("aiff", "aiff", ("-c:a", "pcm_s16be")))
    assert media_error(lambda: _mm.probe_audio(aiff))[0] == "audio.unsupported_container"
    adpcm = encode_one(x, 16000, Encoding("adpcm", "wav", ("-c:a", "adpcm_ima_wav")))
    code, message = media_error(lambda: _mm.decode_audio(adpcm, sample_rate=RATE))
    assert code == "audio.unsupported_codec" and "adpcm_ima_wav" in message
    # A video without sound.
    video = tmp_path / "silent.mp4"
    command = [FFMPEG or "ffmpeg", "-v", "error", "-f", "lavfi", "-i", "testsrc2=size=32x24:rate=5"]
    subprocess.run([*command, "-t", "0.4", "-c:v", "mpeg4", str(video)], check=True)
    assert media_error(lambda: _mm.probe_audio(video.read_bytes()))[0] == "audio.no_audio_stream"


def with_flac_total_samples(data: bytes, total: int) -> bytes:
    """A FLAC file whose STREAMINFO block claims `total` samples (36 bits from bit 4 of the
    block's 14th byte)."""
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0
    head = bytearray(data)
    head[21] = (head[21] & 0xF0) | (total >> 32)
    head[22:26] = (total & 0xFFFFFFFF).to_bytes(4, "big")
    return bytes(head)


def test_a_header_that_lies_about_its_length_is_refused(
    short_wav: tuple[np.ndarray, bytes],
) -> None:
    x, _ = short_wav
    flac = encode_one(x, 16000, Encoding("flac", "flac", ("-c:a", "flac")))
    assert _mm.probe_audio(flac)["duration_s"] == 2.0
    # STREAMINFO claims ten times the samples the frames hold.
    longer = with_flac_total_samples(flac, 10 * len(x))
    assert _mm.probe_audio(longer)["duration_s"] == 20.0
    code, message = media_error(lambda: _mm.decode_audio(longer, sample_rate=RATE))
    assert code == "audio.length_mismatch"
    assert message == "the audio's header claims 20.00 s, its data decodes to only 2.00 s"
    # Or a tenth: the frames go on past the claim.
    shorter = with_flac_total_samples(flac, len(x) // 10)
    code, message = media_error(lambda: _mm.decode_audio(shorter, sample_rate=RATE))
    assert code == "audio.length_mismatch"
    assert message.startswith("the audio's header claims 0.20 s, its data decodes to more than")
    # A claim within a codec's priming and padding of the data is believed.
    near = with_flac_total_samples(flac, len(x) + 4000)
    assert _mm.decode_audio(near, sample_rate=RATE)[1].shape == (32000,)
    # libavformat does not believe a WAV data chunk larger than the file (a file cut short):
    # the header states no length, and the clip is what the file holds, as torchcodec reads it.
    cut = wav_bytes(x, 16000, "s16", data_size=10 * len(x) * 2)
    assert _mm.probe_audio(cut)["duration_s"] is None
    assert _mm.decode_audio(cut, sample_rate=RATE)[1].tobytes() == (
        torchcodec_samples(cut, RATE).tobytes()
    )


def test_an_empty_clip_is_refused() -> None:
    empty = wav_bytes(np.zeros((0, 1), np.float32), 16000, "s16")
    assert media_error(lambda: _mm.decode_audio(empty, sample_rate=RATE))[0] == "audio.empty"
    # Too few samples to survive resampling: torchcodec returns none either.
    tiny = wav_bytes(np.full((10, 1), 0.5, np.float32), 8000, "s16")
    assert len(torchcodec_samples(tiny, RATE)) == 0
    assert media_error(lambda: _mm.decode_audio(tiny, sample_rate=RATE))[0] == "audio.empty"


def test_samples_that_are_not_numbers_are_refused(short_wav: tuple[np.ndarray, bytes]) -> None:
    """A float WAV may hold NaN or infinities; torchcodec passes them on to the features."""
    x, _ = short_wav
    for bad in (np.nan, np.inf):
        y = x.astype(np.float32).copy()
        y[1000] = bad
        data = wav_bytes(y, 16000, "f32")
        assert not np.isfinite(torchcodec_samples(data, RATE)).all()
        code, message = media_error(functools.partial(_mm.decode_audio, data, sample_rate=RATE))
        assert code == "audio.corrupt"
        assert (
            message
            == "the audio is corrupt or truncated: it holds samples that are not finite numbers"
        )


def test_samples_whose_features_overflow_are_refused(short_wav: tuple[np.ndarray, bytes]) -> None:
    """Finite float samples past 1e15 make mel powers float32 cannot hold (the extractor's
    features are infinite, then NaN); a float file at a 24-bit integer scale decodes as it is."""
    x, _ = short_wav
    for peak, refused in [(8388607.0, False), (1e30, True)]:
        y = x.astype(np.float32).copy()
        y[1000] = peak
        data = wav_bytes(y, 16000, "f32")
        if not refused:
            decoded = _mm.decode_audio(data, sample_rate=RATE)[1]
            assert decoded.max() == peak
            continue
        code, message = media_error(functools.partial(_mm.decode_audio, data, sample_rate=RATE))
        assert code == "audio.corrupt"
        assert "its samples reach 1.0e30" in message


def test_a_clip_over_the_duration_cap_is_refused_from_its_headers(clips: Clips) -> None:
    data = clips["speech_like_31.3s_44100hz_2ch_mp3_cbr"]
    code, message = media_error(lambda: _mm.probe_audio(data, max_duration_s=30.0))
    assert code == "audio.too_long"
    assert message.startswith("the audio lasts 31.3 s, over the limit of 30.0 s")
    assert media_error(lambda: _mm.decode_audio(data, sample_rate=RATE, max_duration_s=30.0))[
        0
    ] == ("audio.too_long")
    # A WAV whose header states no length (a streamed one) is capped while decoding.
    x = signal("noise", 8000, 12.0, 1, np.random.default_rng(3))
    streamed = wav_bytes(x, 8000, "s16", data_size=0xFFFFFFFF)
    assert _mm.probe_audio(streamed)["duration_s"] is None
    assert (
        media_error(lambda: _mm.decode_audio(streamed, sample_rate=RATE, max_duration_s=10.0))[0]
        == "audio.too_long"
    )
    assert _mm.decode_audio(streamed, sample_rate=RATE)[1].shape == (192000,)


def refusal_and_peak_mib(call: str, data: bytes) -> tuple[str, int]:
    """`_mm.<call>` on `data` in a child process: the refusal's code, and the child's peak
    memory in MiB (its own, from VmHWM: `ru_maxrss` carries over across exec)."""
    script = f"""
import re, sys
from mmserve import _mm
data = sys.stdin.buffer.read()
try:
    _mm.{call}
except _mm.MediaError as err:
    peak_kib = re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)
    print(err.args[0], int(peak_kib) // 1024)
"""
    child = subprocess.run(
        [sys.executable, "-c", script], input=data, capture_output=True, check=True, timeout=60
    )
    code, peak_mib = child.stdout.decode().split()
    return code, int(peak_mib)


def test_a_lying_rate_is_refused_before_its_samples_are_made() -> None:
    """A WAV that claims 1 Hz and states no length: each of its frames would resample to more
    than an hour at 16 kHz (a 13 kB file took 1.3 GB before it was refused). The length is
    checked before a frame is resampled."""
    x = signal("noise", 1, 16384.0, 1, np.random.default_rng(5))
    data = wav_bytes(x, 1, "u8", data_size=0xFFFFFFFF)
    call = f"decode_audio(data, sample_rate={RATE}, max_duration_s=600.0)"
    code, peak_mib = refusal_and_peak_mib(call, data)
    assert code == "audio.too_long"
    assert peak_mib < 200, f"{peak_mib} MiB"


def test_a_header_that_claims_a_huge_block_costs_no_memory() -> None:
    """A WAV whose INFO entry claims 1.3 GB: FFmpeg's WAV demuxer allocates and zeroes what
    the entry claims before reading it (2 GB at peak for this 3 kB file). FFmpeg's allocations
    are bounded (256 MiB), so the entry is refused instead."""
    clip = wav_bytes(signal("noise", 8000, 0.2, 1, np.random.default_rng(6)), 8000, "s16")
    huge_entry = b"ISFT" + struct.pack("<I", 0x50000000) + b"x" * 64
    info = b"LIST" + struct.pack("<I", 0x7FFF0000) + b"INFO" + huge_entry
    at = clip.index(b"data")
    code, peak_mib = refusal_and_peak_mib("probe_audio(data)", clip[:at] + info + clip[at:])
    assert code == "audio.corrupt"
    assert peak_mib < 200, f"{peak_mib} MiB"


def test_a_deadline_stops_decoding(clips: Clips) -> None:
    data = clips["speech_like_31.3s_44100hz_2ch_ogg_opus"]
    assert media_error(lambda: _mm.decode_audio(data, sample_rate=RATE, timeout_s=0.0))[0] == (
        "audio.deadline"
    )


def test_a_failing_clip_is_named(short_wav: tuple[np.ndarray, bytes]) -> None:
    _, data = short_wav
    extractor = _mm.AudioFeatureExtractor(feature_size=80)
    with pytest.raises(_mm.MediaError) as err:
        _mm.audio_features([data, b"not audio", data], extractor)
    assert err.value.args[0] == "audio.unknown_format"
    assert err.value.args[2] == 1
    with pytest.raises(_mm.MediaError) as err:
        _mm.audio_features([data], extractor, formats=["mp3"])
    assert err.value.args[:3:2] == ("audio.format_mismatch", 0)
