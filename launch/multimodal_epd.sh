#!/usr/bin/env bash
# E/PD: a separate encode worker, then one worker that prefills and decodes.
LAUNCH_DESCRIPTION="E/PD (frontend + encode worker + prefill/decode worker)"
# shellcheck source=_lib.sh
source "$(dirname "$0")/_lib.sh"
launch_parse "$@"
launch_worker encode encode
launch_worker worker worker
launch_frontend
launch_wait
