#!/bin/bash
# Sharded cold start A/B on a larger host (see README.md here): a base build (`driftless_base`,
# shards one after another) next to this build (shards side by side) at 4 and 8 anchor parts,
# on a 4 GiB synthetic model in shards of SHARD bytes (default 1 GiB: four shards), two rounds;
# then the same on one shard, where the two builds should not differ.
source "$(dirname "$0")/common.sh"
nproc; free -g | head -2
for shard in ${SHARD:-1073741824} 0; do
  echo "== coldmem, shards of ${shard} bytes (0: one shard) $(date +%T)"
  if [ "$shard" = 0 ]; then unset BENCH_SHARD_BYTES; else export BENCH_SHARD_BYTES=$shard; fi
  BENCH_SIZES_GIB=${SIZES:-4} BENCH_BASE_BIN=$D/driftless_base BENCH_PARTS=4,8 BENCH_COLD_ROUNDS=2 \
    BENCH_AGENT_DIR=$SHM/c timeout 300 $D/speed_bench coldmem $W/cm $D/driftless > $OUT/sharded_$shard.txt 2> $OUT/sharded_$shard.err
  echo "rc=$? $(date +%T)"; rm -rf $SHM/c $W/cm
  grep -v "^|---" $OUT/sharded_$shard.txt
done
