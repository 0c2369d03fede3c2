"""One trainer rank of the sharded tests, run as its own process:

    python sharded_rank.py URL RANK WORLD FIRST LAST CONTROL_DIR STORE_JSON KEY_PEM_PATH

Publishes steps FIRST..=LAST of the model `model_at` builds, holding the slices `slices_of`
gives this rank; after each step it prints the receipt as one JSON line, writes
CONTROL_DIR/done-STEP-RANK and waits for CONTROL_DIR/go-STEP. With CONTROL_DIR/pause-STEP-RANK
present it writes CONTROL_DIR/paused-STEP-RANK instead of publishing that step and sleeps (the
test kills it there with SIGKILL).
"""

import json
import os
import sys
import time

import numpy as np

SHAPES = {
    "model.row": (1200, 1024),  # rows sharded (2.4 MB: parts cut 1 MiB root chunks)
    "model.col": (256, 4096),  # columns sharded (tensor parallel on dim 1)
    "model.flat": (1000, 1500),  # FSDP flat ranges
    "model.whole": (512, 1024),  # held by the last rank alone
    "model.norm": (4096,),  # replicated on every rank; replica 0 publishes it
}


def model_at(step):
    """The gathered BF16 model (as uint16 bit patterns) of `step`: random weights, then about
    1% of elements changed by one ulp per step."""
    rng = np.random.default_rng(1234)
    m = {n: rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for n, s in SHAPES.items()}
    for t in range(1, step + 1):
        r = np.random.default_rng(1000 + t)
        for n, a in m.items():
            flat = a.reshape(-1)
            idx = r.integers(0, flat.size, size=max(1, flat.size // 100))
            flat[idx] ^= 1
    return m


def cuts(n, world):
    """Uneven split points of n into `world` non-empty pieces."""
    w = [2 + (i * 7) % 5 for i in range(world)]
    total = sum(w)
    points = [0]
    acc = 0
    for x in w[:-1]:
        acc += x
        points.append(n * acc // total)
    points.append(n)
    return list(zip(points[:-1], points[1:]))


def slices_of(model, rank, world):
    """This rank's shards of the gathered model, as BF16 arrays."""
    import driftless
    import ml_dtypes

    model = {n: a.view(ml_dtypes.bfloat16) for n, a in model.items()}
    out = {}
    r0, r1 = cuts(SHAPES["model.row"][0], world)[rank]
    out["model.row"] = driftless.shard(
        np.ascontiguousarray(model["model.row"][r0:r1]), SHAPES["model.row"], offsets=(r0, 0)
    )
    c0, c1 = cuts(SHAPES["model.col"][1], world)[rank]
    out["model.col"] = driftless.shard(
        np.ascontiguousarray(model["model.col"][:, c0:c1]), SHAPES["model.col"], offsets=(0, c0)
    )
    f0, f1 = cuts(int(np.prod(SHAPES["model.flat"])), world)[rank]
    out["model.flat"] = driftless.shard(
        model["model.flat"].reshape(-1)[f0:f1].copy(), SHAPES["model.flat"], flat_offset=f0
    )
    if rank == world - 1:
        out["model.whole"] = driftless.shard(model["model.whole"], SHAPES["model.whole"])
    out["model.norm"] = driftless.shard(model["model.norm"], SHAPES["model.norm"], replica=0 if rank == 0 else 1)
    return out


def main():
    url, rank, world, first, last, control, store, key = sys.argv[1:9]
    rank, world, first, last = int(rank), int(world), int(first), int(last)
    import driftless

    with open(key) as f:
        key_pem = f.read()
    p = driftless.ShardedPublisher(
        url, rank, world, signing_key=key_pem, anchor_every=3, commit_timeout=4.0, new_stream=True,
        **json.loads(store),
    )
    for step in range(first, last + 1):
        if os.path.exists(os.path.join(control, f"pause-{step}-{rank}")):
            open(os.path.join(control, f"paused-{step}-{rank}"), "w").close()
            time.sleep(600)
        r = p.publish(step, slices_of(model_at(step), rank, world))
        # The part is sent (and on rank 0 committed) after publish returns: wait for the
        # outcome before telling the test the step is done (flush raises when the step was
        # not committed; its outcome says why).
        r["uploaded"] = p.wait_sent()
        try:
            p.flush()
        except driftless.DriftlessError:
            pass
        r["outcome"] = p.last_outcome()
        r["sent"] = p.last_part()
        print(json.dumps(r), flush=True)
        open(os.path.join(control, f"done-{step}-{rank}"), "w").close()
        while not os.path.exists(os.path.join(control, f"go-{step}")):
            time.sleep(0.02)
    p.close()


if __name__ == "__main__":
    main()
