"""End to end with an independent reader: `driftless publish --step N` 30 times into the
S3-compatible server (SeaweedFS from .ci/services.sh), then every step read back with boto3
and checked with `cryptography` (Ed25519) and hashlib, sharing no code with the Rust side:

- stream.json and every manifest envelope: Ed25519 signature over
  b"driftless.manifest.v1\\0" + payload, by the key in the SPKI PEM `driftless keygen` wrote,
  with the key id `ed25519:` + hex(SHA-256(raw key)[:16]);
- every ready marker pins the SHA-256 of its manifest envelope, names its step and kind, and
  its payload size is the sum of its objects;
- every object a manifest lists exists with the listed size and SHA-256;
- markers exist only for complete steps: every step is ready (the CLI flushes), each delta's
  base is the previous step, and step directories without a marker hold nothing but the
  claim that an anchor-only step writes into its delta slot.

Weights are a realistic RL chain made here with numpy: FP32 master weights, Adam at an RL
learning rate, the published BF16 view rounded with ml_dtypes.

Env: DRIFTLESS_TEST_S3_SEAWEED="ENDPOINT BUCKET" and AWS_* credentials (from
.ci-work/services.env); without them the test skips, or fails when DRIFTLESS_REQUIRE_SERVERS=1.
DRIFTLESS_BIN is the CLI (default target/debug/driftless).
Needs: pytest numpy ml_dtypes boto3 cryptography.
"""

import base64
import hashlib
import json
import os
import struct
import subprocess
import uuid

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 30
ANCHOR_EVERY = 10
DOMAIN = b"driftless.manifest.v1\0"


def require(cond, why):
    if cond:
        return
    if os.environ.get("DRIFTLESS_REQUIRE_SERVERS") == "1":
        pytest.fail(why + " (DRIFTLESS_REQUIRE_SERVERS=1)")
    pytest.skip(why)


def driftless_bin():
    return os.environ.get("DRIFTLESS_BIN") or os.path.join(ROOT, "target", "debug", "driftless")


# --- a realistic chain ---------------------------------------------------------------------

TENSORS = [
    ("model.embed_tokens.weight", (2048, 256), 0.02),
    ("model.layers.0.self_attn.q_proj.weight", (256, 256), 0.02),
    ("model.layers.0.self_attn.k_proj.weight", (256, 256), 0.02),
    ("model.layers.0.mlp.up_proj.weight", (704, 256), 0.02),
    ("model.layers.0.mlp.down_proj.weight", (256, 704), 0.02),
    ("model.layers.0.input_layernorm.weight", (256,), None),
    ("model.norm.weight", (256,), None),
    ("lm_head.weight", (2048, 256), 0.02),
]


class Chain:
    """Adam on FP32 master weights; gradient = persistent direction + noise."""

    def __init__(self, lr=6e-7, seed=0):
        import ml_dtypes

        self.bf16 = ml_dtypes.bfloat16
        rng = np.random.default_rng(seed)
        self.rng = rng
        self.lr, self.b1, self.b2, self.eps, self.t = lr, 0.9, 0.999, 1e-8, 0
        self.w, self.d, self.m, self.v = {}, {}, {}, {}
        for name, shape, std in TENSORS:
            w = rng.normal(0, std, shape) if std else 1.0 + rng.normal(0, 0.02, shape)
            self.w[name] = w.astype(np.float32)
            self.d[name] = rng.normal(0, 1, shape).astype(np.float32)
            self.m[name] = np.zeros(shape, np.float32)
            self.v[name] = np.zeros(shape, np.float32)

    def step(self):
        self.t += 1
        for name in self.w:
            g = 0.5 * self.d[name] + self.rng.normal(0, 1, self.w[name].shape).astype(np.float32)
            self.m[name] = self.b1 * self.m[name] + (1 - self.b1) * g
            self.v[name] = self.b2 * self.v[name] + (1 - self.b2) * g * g
            mh = self.m[name] / (1 - self.b1**self.t)
            vh = self.v[name] / (1 - self.b2**self.t)
            self.w[name] -= (self.lr * mh / (np.sqrt(vh) + self.eps)).astype(np.float32)

    def save(self, path):
        """BF16 view as a safetensors file (written by hand: header JSON + raw bytes)."""
        header, blobs, off = {}, [], 0
        for name, shape, _ in TENSORS:
            b = self.w[name].astype(self.bf16).tobytes()
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + len(b)]}
            blobs.append(b)
            off += len(b)
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * ((8 - len(h) % 8) % 8)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(h)))
            f.write(h)
            for b in blobs:
                f.write(b)
        os.replace(tmp, path)


# --- the independent reader ------------------------------------------------------------------


class Reader:
    def __init__(self, s3, bucket, prefix, pub_pem):
        from cryptography.hazmat.primitives import serialization

        self.s3, self.bucket, self.prefix = s3, bucket, prefix
        self.pub = serialization.load_pem_public_key(pub_pem)
        raw = self.pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.key_id = "ed25519:" + hashlib.sha256(raw).digest()[:16].hex()

    def get(self, key):
        return self.s3.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read()

    def keys(self):
        out, token = [], None
        while True:
            kw = {"Bucket": self.bucket, "Prefix": self.prefix + "/"}
            if token:
                kw["ContinuationToken"] = token
            r = self.s3.list_objects_v2(**kw)
            out += [(o["Key"][len(self.prefix) + 1 :], o["Size"]) for o in r.get("Contents", [])]
            if not r.get("IsTruncated"):
                return dict(out)
            token = r["NextContinuationToken"]

    def open_envelope(self, raw):
        """Payload of a signed envelope, after checking the signature by our key."""
        env = json.loads(raw)
        sigs = [s for s in env["signatures"] if s["key_id"] == self.key_id]
        assert sigs, f"not signed by {self.key_id}: {[s['key_id'] for s in env['signatures']]}"
        payload = env["payload"].encode("utf-8")
        self.pub.verify(base64.b64decode(sigs[0]["sig"]), DOMAIN + payload)  # raises InvalidSignature
        return json.loads(payload)


def sha_hex(b):
    return hashlib.sha256(b).hexdigest()


def digest_hex(d):
    """Digests in documents are hex strings (tolerate a 'sha256:' prefix)."""
    assert isinstance(d, str), d
    return d.split(":", 1)[-1].lower()


def test_thirty_steps_read_back_with_boto3(tmp_path):
    spec = os.environ.get("DRIFTLESS_TEST_S3_SEAWEED")
    require(spec, "DRIFTLESS_TEST_S3_SEAWEED not set (run: bash .ci/services.sh start; source .ci-work/services.env)")
    exe = driftless_bin()
    require(os.path.exists(exe), f"{exe} not built (cargo build -p driftless-cli)")
    try:
        import boto3
        from cryptography.exceptions import InvalidSignature  # noqa: F401
    except ImportError as e:
        pytest.fail(f"needs boto3 and cryptography: {e}")
    endpoint, bucket = spec.split()[:2]
    prefix = f"pytest-publisher-{uuid.uuid4().hex[:12]}"
    env = dict(os.environ)
    env.setdefault("AWS_ACCESS_KEY_ID", "test")
    env.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    env.setdefault("AWS_REGION", "us-east-1")
    env["AWS_ENDPOINT_URL"] = endpoint
    key = tmp_path / "key"
    subprocess.run([exe, "keygen", "--out", str(key)], check=True, env=env)
    pub_pem = (tmp_path / "key.pub").read_bytes()

    chain = Chain()
    ckdir = tmp_path / "ckpts"
    ckdir.mkdir()
    state = tmp_path / "state"
    for step in range(STEPS):
        if step:
            chain.step()
        ck = str(ckdir / f"step_{step}.safetensors")
        chain.save(ck)
        r = subprocess.run(
            [exe, "publish", "--bucket", f"s3://{bucket}/{prefix}", "--endpoint", endpoint, "--allow-http",
             "--key", str(key), "--state", str(state), "--step", str(step),
             "--anchor-every", str(ANCHOR_EVERY), "--json", ck],
            env=env, capture_output=True, text=True, timeout=300,
        )
        assert r.returncode == 0, f"publish {step}: {r.stderr}"
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["type"] == "published" and out["data"]["step"] == step
        os.remove(ck) if step < STEPS - 1 else None

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name=env["AWS_REGION"],
                      aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    rd = Reader(s3, bucket, prefix, pub_pem)
    keys = rd.keys()

    desc = rd.open_envelope(rd.get("stream.json"))
    assert desc["kind"] == "stream" and rd.key_id in desc["trusted_keys"]
    stream_id = desc["stream_id"]

    dirs, markers = {}, set()
    for k, size in keys.items():
        parts = k.split("/")
        if parts[0] == "ready" and len(parts) == 3:
            markers.add((parts[1], int(parts[2])))
        elif parts[0] in ("deltas", "anchors") and len(parts) == 3:
            dirs.setdefault((parts[0], int(parts[1])), {})[parts[2]] = size
        elif parts[0] in ("claims", "writers") and len(parts) == 2:
            pass  # step claims and publisher leases (checked below)
        else:
            assert k in ("stream.json", "latest.json"), f"stray key {k}"

    ready = {"deltas": {}, "anchors": {}}
    for kind, step in sorted(markers):
        d = f"{kind}/{step:012d}"
        marker = json.loads(rd.get(f"ready/{d}"))
        assert marker["step"] == step and marker["stream_id"] == stream_id
        assert marker["of"] == kind[:-1], marker
        # The marker names the committed manifest (each publisher generation writes its own).
        raw = rd.get(f"{d}/{marker.get('manifest', 'manifest.json')}")
        assert sha_hex(raw) == digest_hex(marker["manifest_sha256"]), f"{d}: marker does not pin its manifest"
        m = rd.open_envelope(raw)
        assert m["step"] == step and m["stream_id"] == stream_id and m["kind"] == kind[:-1]
        if kind == "deltas":
            objs = list(m["segments"])  # {object, size, sha256, raw_size, entries}
            assert marker["base_step"] == m["base_step"]
        else:
            objs = list(m["objects"]) + list(m.get("files", []))  # {object, size, sha256, ...}
        total = 0
        for o in objs:
            b = rd.get(f"{d}/{o['object']}")
            assert len(b) == o["size"], f"{d}/{o['object']}: size"
            assert sha_hex(b) == digest_hex(o["sha256"]), f"{d}/{o['object']}: SHA-256"
            total += len(b)
        if kind == "deltas":
            assert marker["payload_bytes"] == total, (marker, total)
        ready[kind][step] = m

    # Markers only for complete steps, and every step complete.
    for (kind, step), objs in dirs.items():
        if (kind, step) in markers:
            continue
        raise AssertionError(f"incomplete {kind}/{step}: {objs}")
    # Every ready step has a write-once claim naming the same weights root.
    for kind, steps in ready.items():
        for step, m in steps.items():
            claim = json.loads(rd.get(f"claims/{step:012d}"))
            root = m["result_root"] if kind == "deltas" else m["weights_root"]
            assert claim["root"] == root, f"claim of {kind} {step} names other weights"
    assert 0 in ready["anchors"], "the first publish is an anchor"
    for step in range(1, STEPS):
        assert step in ready["deltas"], f"delta {step} not ready"
        assert ready["deltas"][step]["base_step"] == step - 1
        assert ready["deltas"][step]["base_root"] == (
            ready["deltas"][step - 1]["result_root"] if step - 1 in ready["deltas"] else ready["anchors"][step - 1]["weights_root"]
        ), f"delta {step}: base root is not the previous step's root"
    for a in range(ANCHOR_EVERY, STEPS, ANCHOR_EVERY):
        assert a in ready["anchors"], f"anchor every {ANCHOR_EVERY}: {a} missing ({sorted(ready['anchors'])})"
        assert ready["anchors"][a]["weights_root"] == ready["deltas"][a]["result_root"]
    dens = [m["stats"]["changed"] / m["stats"]["elements"] for m in ready["deltas"].values()]
    assert 0.0005 < float(np.median(dens)) < 0.2, f"unrealistic density {np.median(dens)}"

    latest = rd.open_envelope(rd.get("latest.json"))
    assert latest["delta"] == STEPS - 1, latest
