#!/bin/bash
# Signed parts A/B on a larger host (see README.md here): cold starts of a one-shard anchor of
# 1 and 4 GiB, the build before signed parts (`driftless_prev`: one serial SHA-256 per object)
# next to this build (each part checked as it arrives) at 4 and 8 anchor parts, two rounds; then
# the same on a 4 GiB model in four shards. Binaries may come gzipped (`NAME.gz`).
source "$(dirname "$0")/common.sh"
for z in "$D"/*.gz; do [ -e "$z" ] && gunzip -f "$z" && chmod +x "${z%.gz}"; done
nproc; free -g | head -2
run() {
  local name=$1; shift
  echo "== $name $(date +%T)"
  env "$@" BENCH_COLD_ROUNDS=2 BENCH_PARTS=${PARTS:-4,8} BENCH_AGENT_DIR=$SHM/c \
    timeout 240 $D/speed_bench coldmem $W/cm $D/driftless > $OUT/$name.txt 2> $OUT/$name.err
  echo "rc=$? $(date +%T)"; rm -rf $SHM/c $W/cm
  grep -v "^|---" $OUT/$name.txt
}
run one_shard BENCH_SIZES_GIB=${SIZES:-1,4} BENCH_BASE_BIN=$D/driftless_prev
run four_shards BENCH_SIZES_GIB=4 BENCH_SHARD_BYTES=1073741824 BENCH_BASE_BIN=$D/driftless_prev
