#!/usr/bin/env bash
# Aggregated with several workers behind the frontend's router.
LAUNCH_DESCRIPTION="N aggregated workers behind the KV router (WORKERS=N, default 2; ROUTER_MODE=kv|round-robin|random, default kv)"
# shellcheck source=_lib.sh
source "$(dirname "$0")/_lib.sh"
launch_parse "$@"
for i in $(seq "${WORKERS:-2}"); do
  launch_worker "worker$i" worker --encode
done
launch_frontend --router-mode "${ROUTER_MODE:-kv}"
launch_wait
