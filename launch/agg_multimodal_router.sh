#!/usr/bin/env bash
# Aggregated with several workers behind the frontend's router. As Dynamo's
# agg_multimodal_router.sh, the frontend decodes images itself (--frontend-decoding): it fetches,
# decodes and preprocesses each image once and ships pixel_values to the worker it routes to.
LAUNCH_DESCRIPTION="N aggregated workers behind the KV router, the frontend decoding images
(--frontend-decoding) (WORKERS=N, default 2; ROUTER_MODE=kv|round-robin|random, default kv;
--frontend-args \"--router-mode M\" overrides ROUTER_MODE)"
# shellcheck source=_lib.sh
source "$(dirname "$0")/_lib.sh"
launch_parse "$@"
for i in $(seq "${WORKERS:-2}"); do
  launch_worker "worker$i" worker --encode
done
launch_frontend --router-mode "${ROUTER_MODE:-kv}" --frontend-decoding
launch_wait
