"""Shared fixtures: a bucket per backend (file:// always; SeaweedFS S3 when
DRIFTLESS_TEST_S3_SEAWEED="ENDPOINT BUCKET" is set), and a small NumPy trainer."""

import os
import uuid

import numpy as np
import pytest

import ml_dtypes

BF16 = ml_dtypes.bfloat16


def _seaweed(monkeypatch):
    var = os.environ.get("DRIFTLESS_TEST_S3_SEAWEED")
    if not var:
        if os.environ.get("DRIFTLESS_REQUIRE_SERVERS") == "1":
            pytest.fail("DRIFTLESS_TEST_S3_SEAWEED is not set and DRIFTLESS_REQUIRE_SERVERS=1")
        pytest.skip("DRIFTLESS_TEST_S3_SEAWEED not set")
    endpoint, bucket = var.split()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", os.environ.get("AWS_ACCESS_KEY_ID", "test"))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", os.environ.get("AWS_SECRET_ACCESS_KEY", "test"))
    url = f"s3://{bucket}/pytest-{uuid.uuid4().hex[:12]}"
    return url, {"endpoint": endpoint, "allow_http": True, "region": "us-east-1"}


@pytest.fixture(params=["file", "seaweed"])
def bucket(request, tmp_path, monkeypatch):
    """(url, store keyword arguments) of an empty stream location."""
    if request.param == "file":
        return f"file://{tmp_path}/bucket", {}
    return _seaweed(monkeypatch)


class Raw:
    """The objects of a stream location as a hostile bucket would change them, under the
    Follower's feet: through the file system for file://, through boto3 for S3 (so a real
    S3 server answers the Follower's conditional GETs of what was rewritten)."""

    def __init__(self, url, kw):
        self.url = url
        if url.startswith("file://"):
            self.root, self.s3 = url.removeprefix("file://"), None
        else:
            import boto3

            bucket, _, prefix = url.removeprefix("s3://").partition("/")
            self.bucket, self.prefix = bucket, prefix
            self.s3 = boto3.client(
                "s3",
                endpoint_url=kw["endpoint"],
                region_name=kw.get("region", "us-east-1"),
                aws_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                aws_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
            )

    def _key(self, key):
        return f"{self.prefix}/{key}"

    def read(self, key):
        if self.s3 is None:
            with open(os.path.join(self.root, key), "rb") as f:
                return f.read()
        return self.s3.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

    def write(self, key, data):
        if self.s3 is None:
            with open(os.path.join(self.root, key), "wb") as f:
                f.write(data)
        else:
            self.s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def keys(self, prefix=""):
        if self.s3 is None:
            out = []
            base = os.path.join(self.root, prefix)
            for d, _, files in os.walk(base):
                out += [os.path.relpath(os.path.join(d, f), self.root) for f in files]
            return sorted(out)
        out = []
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
        for page in pages:
            out += [o["Key"].removeprefix(self.prefix + "/") for o in page.get("Contents", [])]
        return sorted(out)

    def delete(self, key):
        if self.s3 is None:
            os.remove(os.path.join(self.root, key))
        else:
            self.s3.delete_object(Bucket=self.bucket, Key=self._key(key))

    def delete_prefix(self, prefix=""):
        for k in self.keys(prefix):
            self.delete(k)


@pytest.fixture
def file_bucket(tmp_path):
    return f"file://{tmp_path}/bucket", {}


@pytest.fixture(scope="session")
def keys():
    import driftless

    private, public, key_id = driftless.generate_key()
    return private, public


class SimTrainer:
    """Adam on FP32 master weights; the published weights are their BF16 view, as an RL
    trainer with a tiny learning rate produces them (most BF16 values do not move)."""

    SHAPES = {
        "model.embed_tokens.weight": (1024, 512),
        "model.layers.0.self_attn.q_proj.weight": (512, 512),
        "model.layers.0.mlp.up_proj.weight": (1024, 512),
        "model.layers.0.input_layernorm.weight": (512,),
        "lm_head.weight": (1024, 512),
    }  # 2.1 M parameters, ~4 MB in BF16

    def __init__(self, seed=0, lr=1e-6, shapes=None):
        self.rng = np.random.default_rng(seed)
        self.lr = lr
        self.master = {}
        for n, s in (shapes or self.SHAPES).items():
            if n.endswith("norm.weight"):
                self.master[n] = np.ones(s, np.float32)
            else:
                self.master[n] = (self.rng.standard_normal(s, np.float32) * 0.02).astype(np.float32)
        self.m = {n: np.zeros_like(w) for n, w in self.master.items()}
        self.v = {n: np.zeros_like(w) for n, w in self.master.items()}
        self.t = 0
        self._bf16 = {n: w.astype(BF16) for n, w in self.master.items()}

    def step(self):
        b1, b2, eps = 0.9, 0.999, 1e-8
        self.t += 1
        for n, w in self.master.items():
            g = self.rng.standard_normal(w.shape, np.float32)
            self.m[n] = b1 * self.m[n] + (1 - b1) * g
            self.v[n] = b2 * self.v[n] + (1 - b2) * g * g
            mh = self.m[n] / (1 - b1**self.t)
            vh = self.v[n] / (1 - b2**self.t)
            w -= (self.lr * mh / (np.sqrt(vh) + eps)).astype(np.float32)
            # The BF16 view is rewritten in place, as a trainer's bf16 copy would be.
            self._bf16[n][...] = w.astype(BF16)

    def bf16(self):
        return self._bf16


@pytest.fixture
def trainer():
    return SimTrainer()


def bits(a):
    return np.ascontiguousarray(a).view(np.uint16 if a.dtype.itemsize == 2 else f"u{a.dtype.itemsize}")
