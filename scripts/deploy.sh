#!/usr/bin/env bash
# Start a local Prefect server and a process worker on 127.0.0.1, and register the deployments of prefect.yaml.
#   scripts/deploy.sh start [STATE_DIR]   (default state dir: .deploy, git-ignored; pids and logs live there)
#   scripts/deploy.sh stop  [STATE_DIR]   cancels the flow runs in flight (DRAIN=1: waits for them; STOP_TIMEOUT s),
#                                          then stops exactly the server and worker that `start` recorded there
# Environment: PREFECT_PORT (default 4200), PY (default .venv/bin/python).
set -euo pipefail
cmd=${1:?usage: deploy.sh start|stop [STATE_DIR]}
state=$(realpath -m "${2:-.deploy}")
PY=${PY:-.venv/bin/python}
PREFECT="$(dirname "$PY")/prefect"
port=${PREFECT_PORT:-4200}

stop_pid() {  # stop one recorded process: SIGTERM, then SIGINT (an idle worker ignores SIGTERM), then SIGKILL
  local f=$1
  [ -f "$f" ] || return 0
  local pid; pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -INT -- "-$pid" 2>/dev/null || true
    for _ in $(seq 10); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

case "$cmd" in
start)
  mkdir -p "$state"
  if [ -f "$state/server.pid" ] && kill -0 "$(cat "$state/server.pid")" 2>/dev/null; then
    echo "already running (pids in $state); run 'make deploy-stop' first" >&2; exit 1
  fi
  export PREFECT_HOME="$state/home" PREFECT_API_URL="http://127.0.0.1:$port/api"
  export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=true PREFECT_WORKER_QUERY_SECONDS=2
  export EVOHARNESS_REPO="$PWD" PREFECT_RESULTS_LOCAL_STORAGE_PATH="${PREFECT_RESULTS_LOCAL_STORAGE_PATH:-$PWD/runs/prefect-results}"
  if "$PY" -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', $port)) != 0)"; then
    echo "port $port on 127.0.0.1 is already in use: set PREFECT_PORT to a free port" >&2; exit 1
  fi
  fail() { echo "$1" >&2; stop_pid "$state/worker.pid"; stop_pid "$state/server.pid"; exit 1; }
  setsid "$PREFECT" server start --host 127.0.0.1 --port "$port" --analytics-off --no-ui \
    > "$state/server.log" 2>&1 < /dev/null &
  echo $! > "$state/server.pid"
  up=0
  for _ in $(seq 120); do
    kill -0 "$(cat "$state/server.pid")" 2>/dev/null || fail "Prefect server exited; see $state/server.log"
    if "$PY" -c "import urllib.request; urllib.request.urlopen('$PREFECT_API_URL/health', timeout=2)" 2>/dev/null; then
      up=1; break
    fi
    sleep 1
  done
  [ "$up" = 1 ] || fail "Prefect server did not answer within 120 s; see $state/server.log"
  "$PREFECT" --no-prompt work-pool create evoharness-process --type process --overwrite > "$state/deploy.log" 2>&1 \
    || fail "creating the work pool failed; see $state/deploy.log"
  "$PREFECT" --no-prompt deploy --all >> "$state/deploy.log" 2>&1 || fail "prefect deploy failed; see $state/deploy.log"
  setsid "$PREFECT" worker start --pool evoharness-process > "$state/worker.log" 2>&1 < /dev/null &
  echo $! > "$state/worker.pid"
  echo "$PREFECT_API_URL" > "$state/api_url"
  echo "Prefect server $PREFECT_API_URL (pid $(cat "$state/server.pid")), worker pid $(cat "$state/worker.pid")"
  echo "deployments: evoharness-pipeline/weekly, evoharness-collect/collect, evoharness-evaluate/evaluate, evoharness-dagger/dagger"
  echo "run one:  PREFECT_API_URL=$PREFECT_API_URL $PREFECT deployment run evoharness-pipeline/weekly --watch"
  ;;
stop)
  # in-flight flow runs first, while the server and worker are up: cancelled through Prefect (DRAIN=1: waited for),
  # their MLflow runs closed as KILLED with the reason
  if [ -f "$state/api_url" ] && [ -f "$state/server.pid" ] && kill -0 "$(cat "$state/server.pid")" 2>/dev/null; then
    PREFECT_API_URL=$(cat "$state/api_url") PREFECT_HOME="$state/home" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
      "$PY" scripts/stop_flow_runs.py ${DRAIN:+--drain} ${STOP_TIMEOUT:+--timeout "$STOP_TIMEOUT"} \
      || echo "stopping the in-flight flow runs failed (see above); stopping the worker and server anyway" >&2
  fi
  stop_pid "$state/worker.pid"
  stop_pid "$state/server.pid"
  echo "stopped the Prefect worker and server recorded in $state"
  ;;
*) echo "usage: deploy.sh start|stop [STATE_DIR]" >&2; exit 2 ;;
esac
