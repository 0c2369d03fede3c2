#!/usr/bin/env python3
"""Network-shaped end-to-end run of the agent (issue 12): SeaweedFS behind a rate-limiting
proxy (`rate_proxy`, a shared token bucket on the server-to-client direction), at 400 Mbit/s
and 10 Gbit/s, each figure a separate `driftless agent --once` process:

- cold start, anchor only; catch-up of 7 deltas from it; the fast path (1 delta); cold start
  to the newest step (anchor + 8 deltas);
- next to a full-checkpoint download through the same proxy in the same run (the BF16
  safetensors bytes of the model as one object, boto3 with its default parallel ranged GETs).

Then the per-GiB figures scaled to a 7B and a 70B BF16 model next to PULSESync's published 7B
fast path at 400 Mbit/s. Not part of CI (minutes of transfers); run by hand:

    cargo build --release -p driftless-cli -p driftless-store --example rate_proxy
    cargo run --release -p driftless-agent --example speed_bench -- gen /tmp/sb
    bash .ci/services.sh start; source .ci-work/services.env
    .ci-work/pyvenv/bin/python integration/network_bench.py /tmp/sb target/release/driftless
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROXY = os.path.join(ROOT, "target", "release", "examples", "rate_proxy")
RATES = [400, 10_000]  # Mbit/s
GIB = 1 << 30
PULSESYNC_7B_400MBIT = {"download": 2.2, "decompress": 0.6, "apply": 0.3, "hash": 0.8}


def s3(endpoint):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "test"),
                        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "test"),
                        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}))


def start_proxy(upstream, mbit):
    p = subprocess.Popen([PROXY, "127.0.0.1:0", upstream, str(mbit)], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    port = line.split()[2].rsplit(":", 1)[1]
    return p, f"http://127.0.0.1:{port}"


def upload_tree(client, bucket, prefix, root, skip=()):
    for dirpath, _, files in os.walk(root):
        for f in files:
            path = os.path.join(dirpath, f)
            key = os.path.relpath(path, root)
            if any(key.startswith(s) for s in skip):
                continue
            client.upload_file(path, bucket, f"{prefix}/{key}")


def agent(binary, url, endpoint, key, d):
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint, AWS_ALLOW_HTTP="true", AWS_REGION="us-east-1")
    # Start each measurement without the previous one's dirty pages still being written back
    # (a catch-up right after a cold start otherwise waits for the anchor's writeback).
    os.sync()
    t = time.perf_counter()
    o = subprocess.run([binary, "agent", "--once", "--json", "--bucket", url, "--endpoint", endpoint,
                        "--allow-http", "--trust", key, "--dir", d], capture_output=True, text=True, env=env)
    secs = time.perf_counter() - t
    if o.returncode != 0:
        raise SystemExit(f"agent failed: {o.stderr[-2000:]}")
    r = json.loads(o.stdout.strip().splitlines()[-1])["data"]
    return secs, r


def main():
    sb, binary = sys.argv[1], sys.argv[2]
    endpoint, bucket = os.environ["DRIFTLESS_TEST_S3_SEAWEED"].split()
    upstream = endpoint.split("//", 1)[1]
    direct = s3(endpoint)
    key = os.path.join(sb, "key.pub")
    model = os.path.join(sb, "last", "model.safetensors")
    size = os.path.getsize(model)
    prefix_ck = f"netbench-{uuid.uuid4().hex[:8]}-checkpoint"
    direct.upload_file(model, bucket, f"{prefix_ck}/model.safetensors")
    rows = {}
    for mbit in RATES:
        proxy, purl = start_proxy(upstream, mbit)
        try:
            via = s3(purl)
            prefix = f"netbench-{uuid.uuid4().hex[:8]}"
            url = f"s3://{bucket}/{prefix}"
            upload_tree(direct, bucket, prefix, os.path.join(sb, "bucket"), skip=("latest.json",))
            work = tempfile.mkdtemp(prefix="netbench-")
            r = {}
            os.sync()
            t = time.perf_counter()
            via.download_file(bucket, f"{prefix_ck}/model.safetensors", os.path.join(work, "full.safetensors"),
                              Config=TransferConfig(max_concurrency=8))
            r["full checkpoint download"] = (time.perf_counter() - t, size)
            os.remove(os.path.join(work, "full.safetensors"))
            a = os.path.join(work, "a")
            secs, o = agent(binary, url, purl, key, a)
            r["cold start, anchor only"] = (secs, o["bytes"])
            for s in range(1, 8):
                direct.upload_file(os.path.join(sb, "held", str(s)), bucket, f"{prefix}/ready/deltas/{s:012d}")
            secs, o = agent(binary, url, purl, key, a)
            assert o["step"] == 7, o
            r["catch-up, 7 deltas"] = (secs, o["bytes"])
            direct.upload_file(os.path.join(sb, "held", "8"), bucket, f"{prefix}/ready/deltas/{8:012d}")
            secs, o = agent(binary, url, purl, key, a)
            assert o["step"] == 8 and o["route"] == "fast", o
            r["fast path, 1 delta"] = (secs, o["bytes"])
            secs, o = agent(binary, url, purl, key, os.path.join(work, "b"))
            assert o["step"] == 8, o
            r["cold start, anchor + 8 deltas"] = (secs, o["bytes"])
            rows[mbit] = r
            shutil.rmtree(work, ignore_errors=True)
        finally:
            proxy.kill()
    gib = size / GIB
    print(f"model {size / 1e6:.0f} MB BF16 ({gib:.2f} GiB); SeaweedFS on loopback behind rate_proxy")
    for mbit, r in rows.items():
        print(f"\n{mbit} Mbit/s                       secs      MB   s/GiB    7B (13.0 GiB)  70B (130.4 GiB)")
        for what, (secs, b) in r.items():
            per = secs / gib
            print(f"  {what:32} {secs:7.2f} {b / 1e6:8.1f} {per:7.2f} {per * 13.04:12.1f} {per * 130.4:14.1f}")
    p = PULSESYNC_7B_400MBIT
    print(f"\nPULSESync, 7B fast path at 400 Mbit/s (published): download {p['download']} s + decompress "
          f"{p['decompress']} + apply {p['apply']} + hash {p['hash']} = {sum(p.values()):.1f} s")


if __name__ == "__main__":
    main()
