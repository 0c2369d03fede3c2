#!/bin/bash
# Issue 12 on a 16-core host: the agent's speed_bench sections, each figure next to its
# same-run baseline (see README.md here).
source "$(dirname "$0")/common.sh"
B=$D/driftless
SB=$D/speed_bench
BYTES=${BYTES:-1073741824}
SIZES=${SIZES:-1,4}
{
  echo "== machine"; nproc; lscpu | grep -E "Model name|Socket|Core|Thread|NUMA node\(s\)|L3"
  grep -o -w -E 'sha_ni|avx512f|avx2' /proc/cpuinfo | sort | uniq -c
  free -g; df -h "$W" "$SHM"; uname -r
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
sec() { # name timeout cmd...
  local n=$1 t=$2; shift 2
  echo "== $n ($(date +%T))"
  local s=$(date +%s%N)
  echo "== $n" >> "$OUT/results.txt"; echo "== $n" >> "$OUT/stderr.txt"
  timeout "$t" "$@" > "$W/$n.txt" 2> "$W/$n.err"; local rc=$?
  cat "$W/$n.txt" >> "$OUT/results.txt"; cat "$W/$n.err" >> "$OUT/stderr.txt"
  echo "   rc=$rc in $(( ($(date +%s%N) - s) / 1000000 )) ms" | tee -a "$OUT/results.txt"
}
sec gen 200 env BENCH_BYTES=$BYTES "$SB" gen "$W/sb"
grep -E "step (0|1|8):" "$W/gen.err" | cut -c1-160
sec run_tmpfs 150 env BENCH_REPS=5 BENCH_AGENT_DIR=$SHM/a "$SB" run "$W/sb" "$B"
rm -rf $SHM/a
sec run_disk 150 env BENCH_REPS=5 "$SB" run "$W/sb" "$B"
rm -rf "$W/sb"/A "$W/sb"/B "$W/sb"/C
sec proc 60 env BENCH_ROUNDS=5 "$SB" proc "$W/sb"
sec fast_2threads 100 env BENCH_REPS=3 BENCH_FAST_ONLY=1 BENCH_AGENT_DIR=$SHM/t RAYON_NUM_THREADS=2 "$SB" run "$W/sb" "$B"
rm -rf $SHM/t "$W/sb"
sec coldmem 200 env BENCH_SIZES_GIB=$SIZES BENCH_AGENT_DIR=$SHM/c "$SB" coldmem "$W/cm" "$B"
rm -rf $SHM/c "$W/cm"
sec rewrite 150 env BENCH_BYTES=$BYTES BENCH_AGENT_DIR=$SHM/r "$SB" rewrite "$W/rw" "$B"
rm -rf $SHM/r "$W/rw"
sec gen4 260 env BENCH_BYTES=$((BYTES * 4)) BENCH_DELTAS=4 "$SB" gen "$W/sb4"
sec run_tmpfs_4gib 150 env BENCH_REPS=3 BENCH_FAST_ONLY=1 BENCH_AGENT_DIR=$SHM/a4 "$SB" run "$W/sb4" "$B"
rm -rf $SHM/a4 "$W/sb4"
echo "== summary"
for f in run_tmpfs run_disk proc fast_2threads coldmem rewrite run_tmpfs_4gib; do
  echo "-- $f"; grep -v -E '^\|---|operation \(CLI\)|the same' "$W/$f.txt" | cut -c1-120
  tail -1 "$W/$f.err" | cut -c1-160
done
