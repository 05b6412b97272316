#!/usr/bin/env bash
# P/D for text, EP/D for a vision-language model: the prefill worker encodes media itself.
LAUNCH_DESCRIPTION="P/D, or EP/D for images (frontend + prefill --encode + decode)"
# shellcheck source=_lib.sh
source "$(dirname "$0")/_lib.sh"
launch_parse "$@"
launch_worker prefill prefill --encode
launch_worker decode decode
launch_frontend
launch_wait
