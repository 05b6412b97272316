#!/usr/bin/env bash
# Installs everything mmserve needs, from nothing, idempotently:
# Debian packages, the Rust toolchain check, the Python environment and the extension.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
APT_PACKAGES=(pkg-config libturbojpeg0-dev curl)

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

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[test,nixl]"
echo "setup: done ($VENV)"
