#!/usr/bin/env bash
# GPU smoke test of the sglang engine: agg, E/PD and E/P/D end to end on a real checkpoint.
# Each pattern starts from its launch script, answers one chat request with an image (greedy),
# and must give the aggregated pattern's text. Prints PASS/FAIL per pattern; exit 1 on any FAIL.
#
#   bash bench/gpu_smoke.sh /path/to/Qwen2.5-VL-7B-Instruct [-- SGLang flags, e.g. --tp 1]
#
# Needs a CUDA GPU and pip install -e '.[sglang]'. IMAGE=/path/to/file.png picks the image
# (default: a generated 640x480 gradient).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: bash bench/gpu_smoke.sh MODEL_DIR [-- SGLang flags]}
shift
[ "${1:-}" = "--" ] && shift
SGLANG_FLAGS=("$@")
PORT=${PORT:-8000}
PAD_SCHEME=${PAD_SCHEME:-sglang-wide}  # SGLang 0.5.2x; dynamo for 0.5.1x
READY_TIMEOUT_S=${READY_TIMEOUT_S:-900}
LOGS=$(mktemp -d)
if [ -z "${IMAGE:-}" ]; then
  IMAGE="$LOGS/gradient.png"
  python3 -c 'import sys; from PIL import Image
Image.linear_gradient("L").resize((640, 480)).convert("RGB").save(sys.argv[1])' "$IMAGE"
fi
[ -f "$IMAGE" ] || { echo "gpu_smoke: no image at $IMAGE" >&2; exit 2; }
IMAGE_DIR=$(cd "$(dirname "$IMAGE")" && pwd)
IMAGE_URL="file://$IMAGE_DIR/$(basename "$IMAGE")"

request() {
  curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'content-type: application/json' -d "{
    \"model\": \"$(basename "$MODEL")\", \"max_tokens\": 32, \"temperature\": 0,
    \"messages\": [{\"role\": \"user\", \"content\": [
      {\"type\": \"image_url\", \"image_url\": {\"url\": \"$IMAGE_URL\"}},
      {\"type\": \"text\", \"text\": \"Describe this image in one sentence.\"}]}]}" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])'
}

run_pattern() {  # script name -> prints the answer, or nothing on failure
  local script=$1 log="$LOGS/$1.log"
  bash "launch/$script" --engine sglang --model-path "$MODEL" --http-port "$PORT" \
    --pad-scheme "$PAD_SCHEME" \
    --allowed-local-media-path "$IMAGE_DIR" -- ${SGLANG_FLAGS[@]+"${SGLANG_FLAGS[@]}"} \
    >"$log" 2>&1 &
  local pid=$! waited=0
  until grep -q "\[launch\] ready" "$log"; do
    sleep 2; waited=$((waited + 2))
    if ! kill -0 "$pid" 2>/dev/null || [ "$waited" -ge "$READY_TIMEOUT_S" ]; then
      kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
      echo "gpu_smoke: $script did not become ready; log: $log" >&2
      return 0
    fi
  done
  request || echo "gpu_smoke: $script: request failed; log: $log" >&2
  kill -INT "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

declare -A ANSWERS
for script in agg.sh multimodal_epd.sh multimodal_disagg.sh; do
  ANSWERS[$script]=$(run_pattern "$script")
done
status=0
reference=${ANSWERS[agg.sh]}
for script in agg.sh multimodal_epd.sh multimodal_disagg.sh; do
  answer=${ANSWERS[$script]}
  if [ -n "$answer" ] && [ "$answer" = "$reference" ]; then
    echo "PASS $script: $answer"
  else
    echo "FAIL $script: ${answer:-<no answer>} (agg: ${reference:-<no answer>})"
    status=1
  fi
done
echo "logs: $LOGS"
exit "$status"
