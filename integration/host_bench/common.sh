# Sourced by the scripts here: D (the scripts' and binaries' directory), OUT (results), W (a
# scratch directory on the disk, emptied), SHM (a tmpfs: one mounted at /mnt/dlshm when root
# can, else /dev/shm).
set -u
D=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${OUT:-/tmp/devout}; mkdir -p "$OUT"
W=${W:-/var/tmp/dl}; rm -rf "$W"; mkdir -p "$W"
SHM=/mnt/dlshm; mkdir -p $SHM
mount -t tmpfs -o size=40g tmpfs $SHM 2>/dev/null || { SHM=/dev/shm/dl; mkdir -p $SHM; }
