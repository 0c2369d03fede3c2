"""The torch hook for sharded trainers (`driftless.torch.attach_sharded`) with real
torch.distributed processes (gloo on the CPU, a 2x2 device mesh, DTensor parameters): every
committed step, read back by a Follower, equals the gathered `full_tensor()` bit for bit.

Runs where PyTorch is installed; CI does not install it (the PyPI wheel pulls several GB of
CUDA libraries), so there this test reports as skipped. It was run with torch 2.15.0 (CPU,
gloo) when the hook was written; the README says so."""

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import driftless  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def test_dtensor_ranks_publish_what_full_tensor_gathers(file_bucket, keys, tmp_path):
    url, _ = file_bucket
    private, public = keys
    key = tmp_path / "key.pem"
    key.write_text(private)
    out = tmp_path / "out"
    out.mkdir()
    steps, world = 3, 4
    procs = [
        subprocess.Popen([sys.executable, os.path.join(HERE, "torch_rank.py"), str(r), str(world), url,
                          str(tmp_path / "init"), str(key), str(out), str(steps)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for r in range(world)
    ]
    for p in procs:
        o, _ = p.communicate(timeout=300)
        assert p.returncode == 0, o.decode()[-3000:]
    import ml_dtypes

    for step in range(1, steps + 1):
        want = dict(np.load(out / f"step-{step}.npz"))
        arrays = {n: np.zeros(a.shape, np.uint16) for n, a in want.items()}
        f = driftless.Follower(url, trusted_keys=[public])
        r = f.apply_to({n: a.view(ml_dtypes.bfloat16) for n, a in arrays.items()}, step=step)
        assert r["step"] == step
        for n, a in want.items():
            assert np.array_equal(arrays[n], a), f"{n} at step {step}"
