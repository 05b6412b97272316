#!/usr/bin/env bash
# E/P/D: encode, prefill and decode workers; decode is the entry point of disaggregation.
LAUNCH_DESCRIPTION="E/P/D (frontend + encode + prefill + decode workers)"
# shellcheck source=_lib.sh
source "$(dirname "$0")/_lib.sh"
launch_parse "$@"
launch_worker encode encode
launch_worker prefill prefill
launch_worker decode decode
launch_frontend
launch_wait
