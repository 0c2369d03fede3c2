#!/bin/bash
# Cold start A/B on a larger host (see README.md here): a base build against this build at 4, 8
# and 16 anchor parts, 1 and 4 GiB, two rounds; then the fast path's phases (agent debug logs).
source "$(dirname "$0")/common.sh"
nproc; free -g | head -2
echo "== coldmem $(date +%T)"
BENCH_SIZES_GIB=${SIZES:-1,4} BENCH_BASE_BIN=$D/driftless_base BENCH_PARTS=4,8,16 BENCH_COLD_ROUNDS=2 \
  BENCH_AGENT_DIR=$SHM/c timeout 300 $D/speed_bench coldmem $W/cm $D/driftless > $OUT/coldmem.txt 2> $OUT/coldmem.err
echo "rc=$? $(date +%T)"; rm -rf $SHM/c $W/cm
cat $OUT/coldmem.txt
echo "== fast path phases $(date +%T)"
BENCH_BYTES=${BYTES:-1073741824} BENCH_DELTAS=5 timeout 120 $D/speed_bench gen $W/sb > /dev/null 2> $OUT/gen.err
echo "gen rc=$? $(date +%T)"
DRIFTLESS_LOG="warn,driftless_agent=debug" BENCH_VERBOSE=1 BENCH_REPS=4 BENCH_FAST_ONLY=1 BENCH_AGENT_DIR=$SHM/a \
  timeout 120 $D/speed_bench run $W/sb $D/driftless > $OUT/fast.txt 2> $OUT/fast.err
echo "rc=$? $(date +%T)"
grep -v "^|---" $OUT/fast.txt | grep -v "the same" | cut -c1-110
grep -E "sync plan|pass and flush|deltas applied|synced step" $OUT/fast.err | sed -E 's/\x1b\[[0-9;]*m//g' | cut -c1-200 | tail -24
