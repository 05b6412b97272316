#!/usr/bin/env bash
# Fuzzes the media core with cargo fuzz (libFuzzer, nightly toolchain, AddressSanitizer, debug
# assertions and overflow checks on): the image decoders, inline sources (data: URLs, base64)
# the request driver, the video demuxer + decoder and the audio demuxer + decoder + resampler +
# features, each for a fixed time. Seeds are small images of every format made with Pillow, and
# short videos of every codec and short clips of every audio codec and container made with the
# ffmpeg program; corpora and crash artifacts stay under rust/mmserve-mm/fuzz/ (ignored by git).
#
#   bench/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     default: 60 s, all targets
#   RUNS=1000000 bench/fuzz.sh 7200 audio               stop at a million runs (or the time)
#
# Needs `cargo install cargo-fuzz` and `rustup toolchain install nightly`. Prints one markdown
# row per target: runs, corpus size, crashes (a crash keeps its input in fuzz/artifacts/TARGET).
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
budget=${1:-60}
runs_cap=${RUNS:--1}  # libFuzzer's -runs: -1 is no cap
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(decode inline_source driver video audio)
crate="$root/rust/mmserve-mm"
fuzz="$crate/fuzz"

"$root/.venv/bin/python" - "$fuzz/corpus" <<'PY'
"""Seeds: a few small images per format and variant, and inputs shaped like each target's."""
import base64
import io
import sys
from pathlib import Path

from PIL import Image

corpus = Path(sys.argv[1])
images = {}
rgb = Image.new("RGB", (13, 7), (200, 30, 60))
rgb.putpixel((3, 2), (0, 255, 0))
for name, image, fmt, options in [
    ("jpeg", rgb, "JPEG", {"quality": 80}),
    ("jpeg-progressive", rgb, "JPEG", {"progressive": True}),
    ("jpeg-gray", rgb.convert("L"), "JPEG", {}),
    ("jpeg-cmyk", rgb.convert("CMYK"), "JPEG", {}),
    ("png", rgb, "PNG", {}),
    ("png-palette", rgb.convert("P"), "PNG", {}),
    ("png-la", rgb.convert("LA"), "PNG", {}),
    ("png-1bit", rgb.convert("1"), "PNG", {}),
    ("webp-lossy", rgb, "WEBP", {"quality": 50}),
    ("webp-lossless", rgb, "WEBP", {"lossless": True}),
    ("gif", rgb.convert("P"), "GIF", {}),
    ("bmp", rgb, "BMP", {}),
    ("bmp-palette", rgb.convert("P"), "BMP", {}),
]:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    images[name] = out.getvalue()
frames = [Image.new("P", (5, 4), i) for i in range(3)]
out = io.BytesIO()
frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
images["gif-animated"] = out.getvalue()

def write(target, name, data):
    path = corpus / target / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_bytes(data)

png_b64 = base64.b64encode(images["png"])
for name, data in images.items():
    write("decode", name, data)
    # [mode, n_items, n_prompt_tokens, selectors...]: 1 or 2 items in full and count-only mode.
    write("driver", f"{name}-full", bytes([0, 1, 3, 1, 0, 2]) + data)
    write("driver", f"{name}-two", bytes([1, 2, 6, 1, 0, 2, 1, 0, 2]) + data + b"#ITEM#" + data)
write("inline_source", "data-base64", b"\x00image/png;base64," + png_b64)
write("inline_source", "data-percent", b"\x00text/plain,a%20b%41")
write("inline_source", "payload", b"\x01" + png_b64)
write("inline_source", "bare", b"\x02" + base64.urlsafe_b64encode(images["gif"]))
write("inline_source", "raw", b"\x03 aGVs\r\nbG8=")
PY

# Video seeds: a few frames of each codec and container the core takes.
mkdir -p "$fuzz/corpus/video"
for seed in "h264 mp4 libx264" "hevc mp4 libx265" "vp9 webm libvpx-vp9" "vp8 webm libvpx" \
  "av1 mkv libaom-av1" "mpeg4 mkv mpeg4" "mpeg4 mp4 mpeg4"; do
  read -r name ext codec <<<"$seed"
  out="$fuzz/corpus/video/$name.$ext"
  [ -e "$out" ] || ffmpeg -v error -f lavfi -i testsrc2=size=32x24:rate=10 -t 0.4 \
    -c:v "$codec" -pix_fmt yuv420p "$out" || exit 1
done
# A display matrix (the frames are turned) on the H.264 seed.
out="$fuzz/corpus/video/h264-rotated.mp4"
[ -e "$out" ] || ffmpeg -v error -i "$fuzz/corpus/video/h264.mp4" -c copy \
  -metadata:s:v rotate=90 "$out" || exit 1
# Cut without re-encoding: the edit list marks the packets before the cut discarded.
out="$fuzz/corpus/video/h264-cut.mp4"
[ -e "$out" ] || ffmpeg -v error -ss 0.15 -i "$fuzz/corpus/video/h264.mp4" -c copy "$out" \
  || exit 1

# Audio seeds: a fifth of a second of a stereo tone in each codec and container the core reads.
mkdir -p "$fuzz/corpus/audio"
for seed in "s16 wav pcm_s16le 22050" "u8 wav pcm_u8 8000" "f32 wav pcm_f32le 44100" \
  "alaw wav pcm_alaw 8000" "mulaw wav pcm_mulaw 8000" "flac flac flac 48000" \
  "flac mka flac 16000" "mp3 mp3 libmp3lame 44100" "vorbis ogg libvorbis 32000" \
  "opus ogg libopus 48000" "opus webm libopus 24000" "aac m4a aac 44100" "aac mp4 aac 22050"; do
  read -r name ext codec rate <<<"$seed"
  out="$fuzz/corpus/audio/$name.$ext"
  [ -e "$out" ] || ffmpeg -v error -f lavfi -i "sine=frequency=440:sample_rate=$rate" -t 0.2 \
    -ac 2 -c:a "$codec" -ar "$rate" "$out" || exit 1
done

cd "$crate" || exit 1
cargo +nightly fuzz build || exit 1
echo "| target | seconds | runs | corpus | crashes |"
echo "| --- | --- | --- | --- | --- |"
for target in "${targets[@]}"; do
    log="$fuzz/artifacts/$target.log"
    mkdir -p "$fuzz/artifacts/$target"
    cargo +nightly fuzz run "$target" "$fuzz/corpus/$target" -- \
        -max_total_time="$budget" -runs="$runs_cap" -timeout=10 -rss_limit_mb=2048 -max_len=262144 \
        -print_final_stats=1 >"$log" 2>&1
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$')
    corpus=$(find "$fuzz/corpus/$target" -type f | wc -l)
    crashes=$(find "$fuzz/artifacts/$target" -type f \( -name 'crash-*' -o -name 'oom-*' \
        -o -name 'timeout-*' -o -name 'leak-*' \) | wc -l)
    echo "| $target | $budget | ${runs:-?} | $corpus | $crashes |"
done
