"""Cold start of ``Follower.apply_to`` (the anchor streamed into caller arrays), and the warm
anchor route (arrays holding a verified step: the anchor proven before it is written): time
and the peak anonymous memory the call adds on top of the arrays, sampled every 2 ms.

    python bench_follower_cold.py BUCKET_URL KEY.pub MODEL.safetensors [ENDPOINT]

``ENDPOINT``: an S3 endpoint over plain HTTP for an ``s3://`` bucket (e.g. SeaweedFS behind
``rate_proxy``, as ``integration/network_bench.py`` sets it up).

``MODEL.safetensors`` only gives the tensor names and shapes (e.g. ``speed_bench gen``'s
``last/model.safetensors``: a 1 GiB BF16 model whose bucket holds an anchor at step 0 and
deltas after it). Printed next to the sizes of the model and of the anchor objects.
"""
import json
import os
import struct
import sys
import threading
import time

import ml_dtypes
import numpy as np

import driftless


def rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0


def main() -> None:
    url, key, model = sys.argv[1:4]
    endpoint = sys.argv[4] if len(sys.argv) > 4 else None
    with open(model, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    arrays = {}
    for name, info in header.items():
        assert info["dtype"] == "BF16", "a BF16 model"
        a = np.empty(info["shape"], dtype=ml_dtypes.bfloat16)
        a.view(np.uint16).fill(1)  # fault every page in: the arrays are the baseline
        arrays[name] = a
    model_mib = sum(a.nbytes for a in arrays.values()) / 2**20
    anchor_dir = url.removeprefix("file://") + "/anchors/000000000000"
    anchor_mib = sum(e.stat().st_size for e in os.scandir(anchor_dir)) / 2**20 if url.startswith("file://") else 0
    f = driftless.Follower(url, trusted_keys=[key], endpoint=endpoint, allow_http=endpoint is not None)
    # Cold: the anchor streamed into the arrays (then with the deltas after it). Warm: arrays
    # at the newest verified step taken back to step 0, whose only route is the anchor, proven
    # before it is written (decoded into a TMPDIR spool and hashed, then read into the arrays).
    for step, cold in ((0, True), (None, True), (0, False)):
        if cold:
            f.reset()
        base = rss_anon_kib()
        peak = [base]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], rss_anon_kib())
                time.sleep(0.002)

        t = threading.Thread(target=sample)
        t.start()
        t0 = time.perf_counter()
        out = f.apply_to(arrays, step=step)
        secs = time.perf_counter() - t0
        stop.set()
        t.join()
        print(
            f"apply_to {'cold' if cold else 'warm'}, {out['route']} to step {out['step']}: {secs:.2f} s, peak anonymous memory over the "
            f"arrays {(peak[0] - base) / 1024:.0f} MiB (model {model_mib:.0f} MiB, anchor objects {anchor_mib:.0f} MiB)"
        )


if __name__ == "__main__":
    main()
