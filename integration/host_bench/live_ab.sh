#!/bin/bash
# One continuous agent on a larger host (see README.md here): `speed_bench live` (the steps of
# one chain revealed one at a time to a running `driftless agent`, each sync next to a hash,
# with the agent's CPU-seconds), a base build (`driftless_base`) next to this build, two
# rounds, at 1 and 4 GiB (`SIZES`, GiB, space-separated). Binaries may come gzipped.
source "$(dirname "$0")/common.sh"
for z in "$D"/*.gz; do [ -e "$z" ] && gunzip -f "$z" && chmod +x "${z%.gz}"; done
nproc; free -g | head -2
for sz in ${SIZES:-1 4}; do
  echo "== $sz GiB gen $(date +%T)"
  BENCH_BYTES=$((sz << 30)) BENCH_DELTAS=6 timeout 150 $D/speed_bench gen $W/sb$sz > /dev/null 2> $OUT/gen$sz.err
  echo "rc=$?"
  for round in 0 1; do
    for b in driftless_base driftless; do
      echo "-- $sz GiB, round $round, $b $(date +%T)"
      BENCH_AGENT_DIR=$SHM/l timeout 120 $D/speed_bench live $W/sb$sz $D/$b > $W/r.txt 2> $W/r.err
      echo "rc=$?"; grep -E "step [0-9]|median" $W/r.txt | cut -c1-110
      cat $W/r.txt >> $OUT/live.txt; rm -rf $SHM/l
    done
  done
  rm -rf $W/sb$sz
done
