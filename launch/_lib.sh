# shellcheck shell=bash
# Shared by the launch scripts: flags, nats-server, process supervision.
# Sourced, not run. Each script calls `launch_parse "$@"`, then `launch_start NAME CMD...` per
# component, then `launch_wait`. Every process it started is stopped on Ctrl-C, on SIGTERM or
# SIGHUP, or as soon as one of them exits, in order: the frontend first (it drains the requests
# in flight), then the workers (they leave discovery and drain), then the nats-server they all
# talk through. A second Ctrl-C stops them at once; what still runs LAUNCH_KILL_AFTER_S seconds
# later is killed. Each component runs in its own session, so a Ctrl-C in the terminal reaches
# this script alone; killed hard (SIGKILL), the script takes them along by their parent-death
# signal (MMSERVE_PARENT_PID, mmserve/runtime/lifetime.py), so nothing is left behind.

set -euo pipefail

# Use the project's environment when the caller has not activated one.
LAUNCH_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if ! command -v mmserve >/dev/null 2>&1 && [ -x "$LAUNCH_ROOT/.venv/bin/mmserve" ]; then
  export PATH="$LAUNCH_ROOT/.venv/bin:$PATH"
fi

MODEL_PATH=""
ENGINE="hf"
HTTP_HOST="127.0.0.1"
HTTP_PORT="8000"
NATS_PORT="4222"
NATS_ARGS=()
EXTRA_ARGS=()
SGLANG_ARGS=()
PAD_ARGS=()
BLOCK_ARGS=()
TRANSFER_ARGS=()
MEDIA_ARGS=()
FRONTEND_ARGS=()
# Flags of one role (worker, encode, prefill, decode: the mmserve command), as given by
# --ROLE-args; split on whitespace where used.
declare -A ROLE_ARGS=()
declare -A ROLES_STARTED=()
PIDS=()
NAMES=()
# Past the components' own drain (--drain-timeout, 30 s by default) and their last second.
LAUNCH_STOP_WAIT_S=${LAUNCH_STOP_WAIT_S:-45}
LAUNCH_KILL_AFTER_S=5
LAUNCH_SIGNALLED=""
LAUNCH_STOPPING=""
LAUNCH_KILL_AT_MS=0
LAUNCH_NOW_MS=0

launch_usage() {
  cat <<USAGE
usage: $(basename "$0") [--model-path DIR] [--engine hf|mock|sglang] [--http-host H] [--http-port P]
                [--nats-port P] [--nats-config FILE] [--pad-scheme S] [--block-size N] [--transfer B]
                [--frontend-args "FLAGS"]
                [--worker-args|--encode-args|--prefill-args|--decode-args "FLAGS"]
                [-- extra worker flags...]

Starts $LAUNCH_DESCRIPTION.
  --model-path DIR  a local checkpoint dir, Qwen-VL or Gemma 3 (default: the tiny Qwen2-VL trained on
                    synthetic scenes, tiny-qwen2_vl-scenes, built if missing)
  --engine NAME     engine for the workers (default: hf)
  --http-host H     frontend host (default: 127.0.0.1)
  --http-port P     frontend port (default: 8000)
  --nats-port P     port of the nats-server started when NATS_URL is unset (default: 4222)
  --nats-config FILE
                    its config file (configs/nats/: single.conf, cluster.conf, secure.conf; they
                    read their \$VARIABLES from the environment)
  --pad-scheme S    media pad values for the frontend and every worker (default: dynamo;
                    SGLang 0.5.2x needs sglang-wide)
  --block-size N    KV block size in tokens for the frontend and every worker (default: 16)
  --transfer B      tensor transfer backend (nixl, shm, inline) for the frontend and every
                    worker; all must agree (default: nixl where it imports, else shm)
  --allowed-media-domains H..., --allowed-local-media-path DIR..., --media-fetch-timeout S,
  --max-media-items N
                    media policy of the frontend (the one process that fetches media)
  --frontend-args "FLAGS"
                    flags for the frontend (\`mmserve frontend --help\`), after the script's own:
                    --api-key KEY, --frontend-decoding, the router's --router-mode M,
                    --kv-overlap-weight W, --router-queue-weight W, --router-temperature T; the limits --max-request-body-bytes N,
                    --context-length N, --default-max-tokens N, --request-timeout S ...
  --worker-args|--encode-args|--prefill-args|--decode-args "FLAGS"
                    flags for the workers of that role only (\`mmserve ROLE --help\`), after the
                    flags every worker gets; the script must start that role
FLAGS are split on whitespace (no quoting inside); each of these may be given more than once.
Unknown flags, and everything after --, are passed to every worker; with --engine sglang,
everything after -- is SGLang's own flags (--tp 2 --mem-fraction-static 0.8 ...).
USAGE
}

launch_parse() {
  while [ $# -gt 0 ]; do
    case "$1" in
      -h|--help) launch_usage; exit 0 ;;
      --model-path) MODEL_PATH="$2"; shift 2 ;;
      --engine) ENGINE="$2"; shift 2 ;;
      --http-host) HTTP_HOST="$2"; shift 2 ;;
      --http-port) HTTP_PORT="$2"; shift 2 ;;
      --nats-port) NATS_PORT="$2"; shift 2 ;;
      --nats-config) NATS_ARGS=(--config "$2"); shift 2 ;;
      --pad-scheme) PAD_ARGS=(--pad-scheme "$2"); shift 2 ;;
      --block-size) BLOCK_ARGS=(--block-size "$2"); shift 2 ;;
      --transfer) TRANSFER_ARGS=(--transfer "$2"); shift 2 ;;
      --frontend-args)
        local split=()
        read -r -a split <<<"$2"
        FRONTEND_ARGS+=(${split[@]+"${split[@]}"}); shift 2 ;;
      --worker-args|--encode-args|--prefill-args|--decode-args)
        local role=${1#--}; role=${role%-args}
        ROLE_ARGS[$role]="${ROLE_ARGS[$role]:-} $2"; shift 2 ;;
      --allowed-media-domains|--allowed-local-media-path|--media-fetch-timeout|--max-media-items)
        MEDIA_ARGS+=("$1"); shift
        while [ $# -gt 0 ] && [[ "$1" != --* ]]; do MEDIA_ARGS+=("$1"); shift; done ;;
      --) shift
          if [ "$ENGINE" = sglang ]; then SGLANG_ARGS+=("$@"); else EXTRA_ARGS+=("$@"); fi
          break ;;
      *) EXTRA_ARGS+=("$1"); shift ;;
    esac
  done
  trap _launch_on_signal INT TERM HUP
  trap launch_stop_quiet EXIT
  launch_check_port "$HTTP_HOST" "$HTTP_PORT"
  if [ -z "${NATS_URL:-}" ]; then
    launch_check_port 127.0.0.1 "$NATS_PORT"
    launch_start nats mmserve nats --port "$NATS_PORT" ${NATS_ARGS[@]+"${NATS_ARGS[@]}"}
    export NATS_URL="nats://127.0.0.1:$NATS_PORT"
    launch_wait_port 127.0.0.1 "$NATS_PORT" 30
  fi
  if [ -z "$MODEL_PATH" ]; then
    MODEL_PATH=$(mmserve make-tiny-model --trained | tail -n 1)
  fi
}

# The frontend, with the media policy; the script's frontend flags may follow, then the user's
# (--frontend-args), which win. Started after the workers, so it also refuses --ROLE-args for a
# role the script did not start.
launch_frontend() {
  local role
  for role in "${!ROLE_ARGS[@]}"; do
    if [ -z "${ROLES_STARTED[$role]:-}" ]; then
      echo "[launch] $(basename "$0") starts no $role worker, so --$role-args has nowhere to go" >&2
      exit 2
    fi
  done
  # SGLang's engine serves no media from its prefix cache here: every skipped encode would be
  # asked for again (docs/routing.md).
  local engine_args=()
  if [ "$ENGINE" = sglang ]; then engine_args=(--no-skip-cached-encode); fi
  launch_start frontend mmserve frontend --model-path "$MODEL_PATH" --http-host "$HTTP_HOST" \
    --http-port "$HTTP_PORT" ${MEDIA_ARGS[@]+"${MEDIA_ARGS[@]}"} ${PAD_ARGS[@]+"${PAD_ARGS[@]}"} \
    ${BLOCK_ARGS[@]+"${BLOCK_ARGS[@]}"} ${TRANSFER_ARGS[@]+"${TRANSFER_ARGS[@]}"} \
    ${engine_args[@]+"${engine_args[@]}"} "$@" ${FRONTEND_ARGS[@]+"${FRONTEND_ARGS[@]}"}
}

# A worker of ROLE (worker, prefill, decode, encode) with its flags, then the flags of every
# worker, then the role's own (--ROLE-args). Only the frontend fetches media, so only it takes
# the media policy.
launch_worker() {
  local name=$1 role=$2; shift 2
  local sglang=() own=()
  if [ "$ENGINE" = sglang ]; then
    sglang=(-- ${SGLANG_ARGS[@]+"${SGLANG_ARGS[@]}"} ${WORKER_SGLANG_ARGS[@]+"${WORKER_SGLANG_ARGS[@]}"})
  fi
  read -r -a own <<<"${ROLE_ARGS[$role]:-}"
  ROLES_STARTED[$role]=1
  launch_start "$name" mmserve "$role" --model-path "$MODEL_PATH" --engine "$ENGINE" "$@" \
    ${PAD_ARGS[@]+"${PAD_ARGS[@]}"} ${BLOCK_ARGS[@]+"${BLOCK_ARGS[@]}"} \
    ${TRANSFER_ARGS[@]+"${TRANSFER_ARGS[@]}"} ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} \
    ${own[@]+"${own[@]}"} ${sglang[@]+"${sglang[@]}"}
}

# Starts CMD in the background, in a session of its own. MMSERVE_PARENT_PID makes it stop
# (SIGTERM) when this script dies, however it dies.
launch_start() {
  local name=$1; shift
  launch_check_signal
  echo "[launch] starting $name: $*" >&2
  MMSERVE_PARENT_PID=$$ setsid "$@" &
  PIDS+=($!)
  NAMES+=("$name")
}

# Exits with one line when HOST cannot bind PORT, naming the holder when the port is taken.
launch_check_port() {
  local why
  if ! why=$(mmserve check-port --host "$1" --port "$2"); then
    echo "[launch] ${why:-cannot bind $1:$2}" >&2
    exit 1
  fi
}

launch_wait_port() {
  local host=$1 port=$2 timeout=$3 i
  for ((i = 0; i < timeout * 10; i++)); do
    (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null && return 0
    launch_check_signal
    launch_check_alive || exit 1
    sleep 0.1
  done
  echo "[launch] nothing listens on $host:$port after ${timeout}s" >&2
  return 1
}

launch_wait_ready() {
  local url="http://$HTTP_HOST:$HTTP_PORT" i
  for ((i = 0; i < 1800; i++)); do
    if curl -fsS "$url/health" >/dev/null 2>&1; then
      echo "[launch] ready: curl $url/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\": \"$(basename "$MODEL_PATH")\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'"
      return 0
    fi
    launch_check_signal
    launch_check_alive || return 1
    sleep 0.1
  done
  echo "[launch] $url/health never became ready" >&2
  return 1
}

launch_check_alive() {
  local i
  for i in "${!PIDS[@]}"; do
    if ! kill -0 "${PIDS[$i]}" 2>/dev/null; then
      echo "[launch] ${NAMES[$i]} (pid ${PIDS[$i]}) exited; stopping everything" >&2
      return 1
    fi
  done
}

# Sets LAUNCH_NOW_MS, without the subshell that `$(...)` would fork: the stop's loop reads it
# at every look.
_launch_now() {
  local now=${EPOCHREALTIME/[.,]/}
  LAUNCH_NOW_MS=$((now / 1000))
}

# Waits $1 seconds without forking sleep(1): a read that times out on a pipe nothing writes to.
# On a loaded machine each fork of the stop's loop took CPU from the components it waits on.
_launch_nap() {
  if [ -z "${LAUNCH_NAP_FD:-}" ]; then exec {LAUNCH_NAP_FD}<> <(:); fi
  read -r -t "$1" -u "$LAUNCH_NAP_FD" _ || true
}

# Whether component NAME belongs to GROUP: frontend, nats, or workers (every other one).
_launch_in_group() {
  case $1 in
    frontend | nats) [ "$1" = "$2" ] ;;
    *) [ "$2" = workers ] ;;
  esac
}

# SIGTERM to the components of GROUP, then waits for them until LAUNCH_KILL_AT_MS, when the
# survivors get SIGKILL. It looks every 20 ms for the first second, then every 100 ms: an idle
# component is gone within tens of ms of its SIGTERM, and a look every 100 ms added up to a
# third of an idle Ctrl-C's time over the three groups.
_launch_stop_group() {
  local group=$1 i pids=()
  for i in "${!PIDS[@]}"; do
    if _launch_in_group "${NAMES[$i]}" "$group"; then pids+=("${PIDS[$i]}"); fi
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  _launch_now
  LAUNCH_KILL_AT_MS=$((LAUNCH_NOW_MS + LAUNCH_STOP_WAIT_S * 1000))
  kill -TERM "${pids[@]}" 2>/dev/null || true
  local pid looks=0
  for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && _launch_now && [ "$LAUNCH_NOW_MS" -lt "$LAUNCH_KILL_AT_MS" ]; do
      if [ $((looks++)) -lt 50 ]; then _launch_nap 0.02; else _launch_nap 0.1; fi
    done
    kill -KILL "$pid" 2>/dev/null || true
  done
}

# A signal is only noted here: bash runs no trap while another one runs, so the stop itself
# runs outside of it, where a second signal can still cut it short. That one sends a second
# SIGTERM to every component still running but the nats-server (each stops at once; the
# nats-server still stops last, once they are gone, or their shutdown fails on a lost
# connection), and SIGKILL to what is left LAUNCH_KILL_AFTER_S seconds later.
_launch_on_signal() {
  if [ -z "$LAUNCH_STOPPING" ]; then
    LAUNCH_SIGNALLED=1
    return 0
  fi
  echo "[launch] stopping at once" >&2
  local i
  for i in "${!PIDS[@]}"; do
    if [ "${NAMES[$i]}" != nats ]; then kill -TERM "${PIDS[$i]}" 2>/dev/null || true; fi
  done
  _launch_now
  local kill_at=$((LAUNCH_NOW_MS + LAUNCH_KILL_AFTER_S * 1000))
  if [ "$kill_at" -lt "$LAUNCH_KILL_AT_MS" ]; then LAUNCH_KILL_AT_MS=$kill_at; fi
  LAUNCH_STOP_WAIT_S=$LAUNCH_KILL_AFTER_S
}

# Stops what runs after a signal, then exits 130.
launch_check_signal() {
  [ -n "$LAUNCH_SIGNALLED" ] || return 0
  echo "[launch] stopping: the frontend, the workers, then NATS (Ctrl-C again to stop at once)" >&2
  launch_stop_quiet
  exit 130
}

launch_stop_quiet() {
  if [ -n "$LAUNCH_STOPPING" ]; then return 0; fi
  LAUNCH_STOPPING=1
  _launch_stop_group frontend
  _launch_stop_group workers
  _launch_stop_group nats
  PIDS=()
}

# Blocks until one process exits (then stops the rest) or a signal arrives (which interrupts
# `wait`).
launch_wait() {
  launch_wait_ready || exit 1
  local rc=0
  wait -n "${PIDS[@]}" || rc=$?
  launch_check_signal
  launch_check_alive || true
  launch_stop_quiet
  exit "$rc"
}
