#!/usr/bin/env bash
# Aggregated: the frontend and one worker that encodes, prefills and decodes.
LAUNCH_DESCRIPTION="the aggregated deployment (frontend + worker --encode)"
# shellcheck source=_lib.sh
source "$(dirname "$0")/_lib.sh"
launch_parse "$@"
launch_worker worker worker --encode
launch_frontend
launch_wait
