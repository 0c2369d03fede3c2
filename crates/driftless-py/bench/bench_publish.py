#!/usr/bin/env python3
"""publish() call time versus upload time on a >= 1 GB BF16 model (not run in CI).

Each step changes ~2% of the BF16 elements by one ulp (what RL steps at lr ~1e-6 look like),
calls publish(), and measures (a) how long publish() blocked the trainer and (b) how long the
upload of that step took afterwards (until its ready marker is written: flush()). publish()
returning before the upload is the point of the design: the ratio a/(a+b) is the share of the
step's shipping time the trainer waits for.

    python bench/bench_publish.py --size-gb 1 --steps 5                  # file:// temp dir
    python bench/bench_publish.py --url s3://testbucket/bench --endpoint http://127.0.0.1:8333 --allow-http

Baselines printed from the same run: memcpy of the model (numpy copy) and a dense upload of
one anchor (step 0).
"""

import argparse
import os
import tempfile
import time
import uuid

import numpy as np

import driftless

try:
    import ml_dtypes

    BF16 = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover
    BF16 = np.uint16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--url")
    ap.add_argument("--endpoint")
    ap.add_argument("--allow-http", action="store_true")
    a = ap.parse_args()

    tmp = None
    url = a.url
    if url is None:
        tmp = tempfile.TemporaryDirectory(prefix="driftless-bench-")
        url = f"file://{tmp.name}/bucket"
    elif url.startswith("s3://"):
        url = f"{url.rstrip('/')}/{uuid.uuid4().hex[:8]}"
    kw = {}
    if a.endpoint:
        kw = {"endpoint": a.endpoint, "allow_http": a.allow_http, "region": "us-east-1"}

    n_tensors = 16
    per = int(a.size_gb * (1 << 30) / 2 / n_tensors)
    rng = np.random.default_rng(0)
    print(f"model: {n_tensors} x {per:,} BF16 = {n_tensors * per * 2 / 1e9:.2f} GB; url {url}")
    tensors = {}
    for i in range(n_tensors):
        t = (rng.standard_normal(per, dtype=np.float32) * 0.02).astype(BF16)
        tensors[f"model.layers.{i}.mlp.weight"] = t
    t0 = time.perf_counter()
    for t in tensors.values():
        t.copy()
    memcpy = time.perf_counter() - t0
    print(f"baseline: memcpy of the model {memcpy:.3f} s")

    with driftless.Publisher(url, anchor_every=1000, **kw) as pub:
        t0 = time.perf_counter()
        pub.publish(0, tensors)
        call0 = time.perf_counter() - t0
        t1 = time.perf_counter()
        pub.flush()
        up0 = time.perf_counter() - t1
        print(f"step 0 (anchor): publish() {call0:.3f} s, upload+encode after return {up0:.3f} s")
        rows = []
        for step in range(1, a.steps + 1):
            for t in tensors.values():
                u = t.view(np.uint16)
                idx = rng.integers(0, u.size, int(u.size * a.density))
                u[idx] += 1
            t0 = time.perf_counter()
            r = pub.publish(step, tensors)
            call = time.perf_counter() - t0
            t1 = time.perf_counter()
            pub.flush()
            up = time.perf_counter() - t1
            rows.append((call, up))
            st = pub.status()  # flushed: the delta's size is known
            print(
                f"step {step}: publish() {call:.3f} s, encode+upload after return {up:.3f} s, "
                f"delta {st['last_delta_bytes'] / 1e6:.1f} MB (ratio {st['last_ratio']:.1f}x), outcome {r['outcome']}"
            )
        calls = np.array([c for c, _ in rows])
        ups = np.array([u for _, u in rows])
        print(
            f"deltas: publish() median {np.median(calls):.3f} s, upload median {np.median(ups):.3f} s, "
            f"call/(call+upload) = {np.median(calls / (calls + ups)):.2f}"
        )
        print("status:", pub.status())
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
