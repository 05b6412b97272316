#!/usr/bin/env bash
# Installs everything mmserve needs, from nothing, idempotently:
# Debian packages, the Rust toolchain check, the Python environment and the extension, and the
# default model.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# FFmpeg's libraries for the video and audio features (bindgen needs libclang), and the ffmpeg
# program the video and audio tests make their media with. mimalloc, which the frontend preloads
# in place of glibc's malloc (components/src/mmserve/runtime/allocator.py).
APT_PACKAGES=(pkg-config libturbojpeg0-dev curl iproute2 openssl
  libavformat-dev libavcodec-dev libswscale-dev libswresample-dev libavutil-dev clang libclang-dev
  ffmpeg libmimalloc2.0)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

command -v cargo >/dev/null || { echo "setup: cargo not found; install Rust (rustup) first" >&2; exit 1; }

# aiperf, NVIDIA's benchmark client, for tests/e2e/test_aiperf.py. In an environment of its own,
# not layered: it pins Pillow ~=12.3 where the main one pins 13.0.0, and it runs as a separate
# program. About 1 minute from nothing on 2 cores, mostly downloads: it is installed in the
# background while the main environment and the extension are built, and waited for at the end.
AIPERF_VERSION=0.13.0
AIPERF_VENV="$VENV/aiperf"
install_aiperf() {
  [ "$("$AIPERF_VENV/bin/aiperf" --version 2>/dev/null)" != "$AIPERF_VERSION" ] || return 0
  [ -x "$AIPERF_VENV/bin/python" ] || python3 -m venv "$AIPERF_VENV"
  "$AIPERF_VENV/bin/python" -m pip install -q "aiperf==$AIPERF_VERSION"
  [ "$("$AIPERF_VENV/bin/aiperf" --version)" = "$AIPERF_VERSION" ]
}
mkdir -p "$VENV"
AIPERF_LOG=$(mktemp)
install_aiperf >"$AIPERF_LOG" 2>&1 &
AIPERF_PID=$!

# The package (editable) with its test, NIXL and Dynamo extras; the parity references pinned exactly by
# constraints.txt. Installed again only when pyproject.toml or constraints.txt changed since the
# last install, or the environment drifted from the pins; otherwise only the extension is rebuilt
# (a no-op when the Rust sources are unchanged).
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
STAMP="$VENV/.mmserve-setup"
WANT=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
installed() {
  [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ] && [ -x "$VENV/bin/maturin" ] &&
    "$VENV/bin/python" - <<'PY' 2>/dev/null
import importlib.metadata
import sys

import mmserve._mm  # noqa: F401

pins = [line.split("#")[0].strip() for line in open("constraints.txt")]
pins = [pin.split("==") for pin in pins if pin]
sys.exit(any(importlib.metadata.version(name) != version for name, version in pins))
PY
}
if installed; then
  VIRTUAL_ENV=$(cd "$VENV" && pwd) "$VENV/bin/maturin" develop --release --skip-install --quiet
else
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e ".[test,nixl,dynamo]" -c constraints.txt
  echo "$WANT" >"$STAMP"
fi

# SGLang's Python modules for the sglang engine's contract tests (tests/engines/
# test_sglang_contract.py). The full package pulls ~11 GB of CUDA kernels; the modules the tests
# import need only the wheel and a few pure-Python packages. They go into $VENV/sglang, a
# virtual environment layered over $VENV (a .pth adds $VENV's site-packages after its own), so
# the main environment keeps its own versions. About 1.5 minutes from nothing on 2 cores.
SGLANG_VERSION=$(bash .ci/extra_pin sglang)  # pyproject.toml's sglang extra
SGLANG_CPU_DEPS=(orjson pybase64 psutil pyzmq aiohttp ipython "apache-tvm-ffi==0.1.11"
  sentencepiece compressed-tensors gguf partial-json-parser fastapi setproctitle einops dill)
SGLANG_VENV="$VENV/sglang"
SGLANG_PROBE="import sglang, sglang.srt.managers.io_struct, sglang.srt.disaggregation.encoder.server
import sglang.srt.multimodal.processors.base_processor
assert sglang.__version__ == '$SGLANG_VERSION'"
# layered_env DIR PROBE PACKAGE DEPS...: an environment at DIR that sees $VENV's packages, with
# PACKAGE installed without its declared dependencies and DEPS beside it; nothing is done while
# PROBE (Python) already succeeds there.
layered_env() {
  local dir=$1 probe=$2 package=$3
  shift 3
  "$dir/bin/python" -W ignore -c "$probe" >/dev/null 2>&1 && return 0
  [ -x "$dir/bin/python" ] || "$VENV/bin/python" -m venv --without-pip "$dir"
  site_of() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
  echo "import site; site.addsitedir('$(site_of "$VENV/bin/python")')" \
    >"$(site_of "$dir/bin/python")/mmserve_base_env.pth"
  local pip=("$VENV/bin/python" -m pip --python "$dir/bin/python" install -q
    --no-warn-conflicts -c constraints.txt)
  "${pip[@]}" --no-deps "$package"
  "${pip[@]}" "$@"
  "$dir/bin/python" -W ignore -c "$probe"
}
layered_env "$SGLANG_VENV" "$SGLANG_PROBE" "sglang==$SGLANG_VERSION" "${SGLANG_CPU_DEPS[@]}"
# NVIDIA Dynamo's frontend (`python -m dynamo.frontend`) for the tests of mmserve's worker as a
# Dynamo backend (tests/e2e/test_dynamo.py). `ai-dynamo` goes in without its dependencies (it
# requires `aisimulate`, which PyPI does not serve here; the frontend does not import it), then
# its other requirements; layered over $VENV like the SGLang one, whose `ai-dynamo-runtime` (the
# worker's side) it shares. A few seconds from a warm pip cache.
DYNAMO_VERSION=$(bash .ci/extra_pin ai-dynamo-runtime)  # pyproject.toml's dynamo extra
DYNAMO_DEPS=("ai-dynamo-runtime==$DYNAMO_VERSION" "aiohttp>=3.14.3,<4" "certifi>=2026.10.19"
  "kubernetes>=32.0.1,<33" "msgspec>=0.19" "prometheus-client>=0.23.1,<1" "pyzmq>=26"
  "redis>=6.2,<9" "tqdm>=4" "zstandard>=0.23,<1")
DYNAMO_VENV="$VENV/dynamo"
DYNAMO_PROBE="import importlib.metadata as m, dynamo.frontend.main
assert m.version('ai-dynamo') == m.version('ai-dynamo-runtime') == '$DYNAMO_VERSION'"
layered_env "$DYNAMO_VENV" "$DYNAMO_PROBE" "ai-dynamo==$DYNAMO_VERSION" "${DYNAMO_DEPS[@]}"
# instructor, the structured-output client the tool-call tests drive (tests/e2e/test_tools.py),
# without its declared dependencies: it caps jiter (<0.15) and rich (<15) below what openai and
# typer bring, and pip would downgrade openai to meet the caps; it runs with the newer ones.
INSTRUCTOR_VERSION=$(bash .ci/extra_pin instructor)  # pyproject.toml's instructor extra
if ! "$VENV/bin/python" -c "import importlib.metadata as m
assert m.version('instructor') == '$INSTRUCTOR_VERSION'" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q --no-deps "instructor==$INSTRUCTOR_VERSION"
  "$VENV/bin/python" -m pip install -q "docstring-parser==0.18.0"
fi
if ! wait "$AIPERF_PID"; then
  cat "$AIPERF_LOG" >&2
  echo "setup: installing aiperf failed" >&2
  exit 1
fi
rm -f "$AIPERF_LOG"

# The default model (`make run`): rebuilt from the trained weights the package ships, a few
# seconds; cached under ~/.cache/mmserve/models.
"$VENV/bin/mmserve" make-tiny-model --trained >/dev/null
echo "setup: done ($VENV)"
