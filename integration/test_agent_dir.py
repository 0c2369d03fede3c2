"""The agent's directory is a checkpoint any safetensors reader loads, bit for bit the trainer's.

A "trainer" (numpy + ml_dtypes) writes a sharded Hugging Face checkpoint per step (BF16 and
F32 tensors, `model.safetensors.index.json`), `driftless publish` publishes each step into a
file:// bucket, and `driftless agent --once` syncs a directory. The Python `safetensors` package
then loads `DIR/current` and every tensor is compared with the trainer's as raw bit patterns.

Binary: $DRIFTLESS_BIN, default target/debug/driftless (build it with `cargo build -p driftless-cli`).
Needs: pytest numpy ml_dtypes safetensors.
"""

import json
import os
import subprocess

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("DRIFTLESS_BIN", os.path.join(ROOT, "target", "debug", "driftless"))

SHARDS = {
    "model-00001-of-00002.safetensors": {
        "model.embed_tokens.weight": ((512, 64), ml_dtypes.bfloat16),
        "model.layers.0.mlp.up_proj.weight": ((256, 64), ml_dtypes.bfloat16),
        "model.layers.0.input_layernorm.weight": ((64,), np.float32),
    },
    "model-00002-of-00002.safetensors": {
        "model.layers.1.mlp.up_proj.weight": ((256, 64), ml_dtypes.bfloat16),
        "lm_head.weight": ((512, 64), ml_dtypes.bfloat16),
    },
}


def run(*args, **kw):
    r = subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, f"{args[0]} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


def initial(rng):
    out = {}
    for shard in SHARDS.values():
        for name, (shape, dtype) in shard.items():
            out[name] = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)
    return out


def train_step(tensors, rng):
    """An RL-like step: a small fraction of elements moves by a few ulps (by bit pattern, so
    nothing is lost to rounding), plus one NaN/negative-zero edge case to prove bit exactness."""
    out = {}
    for name, t in tensors.items():
        bits = t.view(np.uint16 if t.dtype == ml_dtypes.bfloat16 else np.uint32).copy()
        flat = bits.reshape(-1)
        idx = rng.choice(flat.size, size=max(1, flat.size // 100), replace=False)
        flat[idx] = flat[idx] + rng.integers(-3, 4, size=idx.size).astype(flat.dtype)
        out[name] = bits.view(t.dtype)
    first = next(iter(out))
    out[first].reshape(-1).view(np.uint16)[:2] = [0x7FC1, 0x8000]  # a NaN payload, -0.0
    return out


def write_checkpoint(tensors, path):
    os.makedirs(path, exist_ok=True)
    weight_map = {}
    for file, names in SHARDS.items():
        save_file({n: tensors[n] for n in names}, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    total = sum(t.nbytes for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)


def load_dir(path):
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        out.update(load_file(os.path.join(path, file)))
    return index, out


def assert_bit_identical(got, want):
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert g.tobytes() == w.tobytes(), f"{name} differs"


@pytest.fixture(scope="module")
def binary():
    if not os.path.exists(BIN):
        pytest.skip(f"{BIN} not built (cargo build -p driftless-cli)")
    return BIN


def test_agent_dir_loads_with_safetensors_bit_for_bit(binary, tmp_path):
    rng = np.random.default_rng(1234)
    bucket = f"file://{tmp_path / 'bucket'}"
    key = tmp_path / "key.pem"
    run("keygen", "--out", key)
    pub = f"{key}.pub"
    state = tmp_path / "pub-state"
    agent_dir = tmp_path / "agent"

    def agent_once():
        out = run("agent", "--bucket", bucket, "--trust", pub, "--dir", agent_dir, "--once", "--json")
        lines = [json.loads(line) for line in out.splitlines() if line.strip()]
        assert lines, "agent --once --json printed nothing"
        return lines[-1]

    tensors = initial(rng)
    steps = []
    for step in range(6):
        if step > 0:
            tensors = train_step(tensors, rng)
        ck = tmp_path / f"step_{step}"
        write_checkpoint(tensors, ck)
        run("publish", "--bucket", bucket, "--state", state, "--key", key, "--step", step, "--anchor-every", 4, ck)
        steps.append(tensors)
        if step in (1, 2, 5):
            # Cold start at 1, fast path at 2, catch-up 3..5 across the anchor at 4.
            res = agent_once()
            assert res["type"] == "synced" and res["data"]["step"] == step, res
            assert res["data"]["route"] == {1: "anchor", 2: "fast", 5: res["data"]["route"]}[step], res
            assert res["data"]["route"] in ("anchor", "fast", "catchup"), res
            index, got = load_dir(agent_dir / "current")
            assert_bit_identical(got, tensors)
            # Same shard layout and names as the trainer's.
            with open(ck / "model.safetensors.index.json") as f:
                want_index = json.load(f)
            assert index["weight_map"] == want_index["weight_map"]
            for file in SHARDS:
                assert (agent_dir / "current" / file).exists(), file
    # Nothing new: still the last step, still identical.
    res = agent_once()
    assert (res["data"]["step"], res["data"]["route"], res["data"]["bytes"]) == (5, "up_to_date", 0), res
    _, got = load_dir(agent_dir / "current")
    assert_bit_identical(got, steps[-1])
    # And not identical to an earlier step (the comparison can fail).
    with pytest.raises(AssertionError):
        assert_bit_identical(got, steps[-2])
