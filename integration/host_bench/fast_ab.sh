#!/bin/bash
# Fast path A/B on a larger host (see README.md here): a base build on deltas its own publisher
# wrote (one segment at 1 GiB) against this build on those and on deltas split for parallel
# decoding.
source "$(dirname "$0")/common.sh"
G=${GIB:-1}
for sz in $G 4; do
  bytes=$((sz << 30)); [ "$sz" = 0 ] && bytes=268435456
  echo "== $sz GiB gen $(date +%T)"
  BENCH_BYTES=$bytes BENCH_DELTAS=5 timeout 150 $D/speed_bench_base gen $W/old$sz > /dev/null 2> $OUT/gen_old$sz.err; echo "rc=$?"
  BENCH_BYTES=$bytes BENCH_DELTAS=5 timeout 150 $D/speed_bench gen $W/new$sz > /dev/null 2> $OUT/gen_new$sz.err; echo "rc=$?"
  ls $W/old$sz/bucket/deltas/000000000003 $W/new$sz/bucket/deltas/000000000003 | tr '\n' ' '; echo
  for round in 0 1; do
    for v in "base old" "new old" "new new"; do
      set -- $v; bin=$D/driftless; [ $1 = base ] && bin=$D/driftless_base
      echo "-- $sz GiB, round $round, $1 build on $2 deltas $(date +%T)"
      BENCH_REPS=4 BENCH_FAST_ONLY=1 BENCH_AGENT_DIR=$SHM/a timeout 120 $D/speed_bench run $W/$2$sz $bin > $W/r.txt 2> $W/r.err
      echo "rc=$?"; grep -E "fast path: 1 delta|median" $W/r.txt | grep -v "the same" | cut -c1-110
      cat $W/r.txt >> $OUT/runs.txt; rm -rf $SHM/a
    done
  done
  rm -rf $W/old$sz $W/new$sz
done
