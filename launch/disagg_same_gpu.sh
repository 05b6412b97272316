#!/usr/bin/env bash
# P/D (EP/D for images) with prefill and decode sharing one GPU, as Dynamo's SGLang
# disagg_same_gpu.sh: each SGLang engine gets a share of the GPU's memory. --engine sglang only.
LAUNCH_DESCRIPTION="P/D on one GPU (frontend + prefill --encode + decode, sglang engine)"
# shellcheck source=_lib.sh
source "$(dirname "$0")/_lib.sh"
launch_parse --engine sglang "$@"
[ "$ENGINE" = sglang ] || { echo "disagg_same_gpu.sh runs the sglang engine only" >&2; exit 2; }
# The prefill worker also loads the vision model for encoding (see docs/sglang.md).
PREFILL_MEM_FRACTION=${PREFILL_MEM_FRACTION:-0.35}
DECODE_MEM_FRACTION=${DECODE_MEM_FRACTION:-0.35}
WORKER_SGLANG_ARGS=(--mem-fraction-static "$PREFILL_MEM_FRACTION" --base-gpu-id 0)
launch_worker prefill prefill --encode
WORKER_SGLANG_ARGS=(--mem-fraction-static "$DECODE_MEM_FRACTION" --base-gpu-id 0)
launch_worker decode decode
launch_frontend
launch_wait
