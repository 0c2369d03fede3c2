"""The worker extension's patch reading and dense/sparse split, without torch or vLLM (the
loader call needs both; the whole path runs in integration/engines on vLLM's routes, and on a
GPU in integration/engines/gpu_patch_check.py)."""

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from driftless.vllm_ext import FORMAT, Patch, check_indices, check_sha256, read_tensors


def write_patch(path, fmt=FORMAT):
    bf = ml_dtypes.bfloat16
    tensors = {
        "idx/a": np.array([0, 5], dtype=np.int32),
        "val/a": np.array([1.0, 2.0], dtype=np.float32).astype(bf),
        "idx/b": np.array([1], dtype=np.int32),
        "val/b": np.array([0x7FC1], dtype=np.uint16).view(bf),  # a NaN
        "idx/i": np.array([2], dtype=np.int64),
        "val/i": np.array([7], dtype=np.int32),
    }
    meta = {"format": fmt, "base_step": "3", "step": "4", "weights_root": "00" * 32,
            "shapes": json.dumps({"a": [2, 3], "b": [4], "c": [2], "i": [3]}), "dense": json.dumps(["c"])}
    save_file(tensors, str(path), metadata=meta)


def isnan_any(v):
    return bool(np.isnan(v.astype(np.float32)).any())


def test_nan_and_integer_tensors_go_dense(tmp_path):
    write_patch(tmp_path / "p.safetensors")
    p = Patch(str(tmp_path / "p.safetensors"), "np")
    assert (p.base, p.step, p.shapes["a"]) == (3, 4, (2, 3))
    sparse, dense = p.split(isnan_any)
    assert sparse == ["a"] and sorted(dense) == ["b", "c", "i"]
    idx, vals, dtype = p.sparse["a"]
    assert dtype == "BF16" and idx.tolist() == [0, 5]
    assert vals.view(np.uint16).tolist() == [0x3F80, 0x4000]  # bit patterns, not floats


def test_other_files_are_refused(tmp_path):
    write_patch(tmp_path / "p.safetensors", fmt="something")
    with pytest.raises(ValueError, match="not a driftless-patch-1"):
        Patch(str(tmp_path / "p.safetensors"), "np")


def test_dense_tensors_come_from_the_verified_directory(tmp_path):
    save_file({"c": np.array([1, 2], dtype=np.float32)}, str(tmp_path / "model-1.safetensors"))
    save_file({"d": np.array([3], dtype=np.float32)}, str(tmp_path / "model-2.safetensors"))
    got = read_tensors(str(tmp_path), ["c", "d"], "np")
    assert got["c"].tolist() == [1, 2] and got["d"].tolist() == [3]
    with pytest.raises(ValueError, match="not found"):
        read_tensors(str(tmp_path), ["zz"], "np")


def test_a_patch_damaged_on_disk_is_refused_before_it_is_read(tmp_path):
    # Found by review: the worker loaded whatever the file held; a flipped byte went into
    # the live weights under step N's version.
    import hashlib

    path = tmp_path / "p.safetensors"
    write_patch(path)
    good = hashlib.sha256(path.read_bytes()).hexdigest()
    check_sha256(str(path), good)
    check_sha256(str(path), good.upper())
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="damaged or replaced"):
        check_sha256(str(path), good)


@pytest.mark.parametrize("idx", [[0, 0], [5, 0], [0, 6], [-1, 2]])
def test_bad_sparse_indices_are_refused_before_any_write(tmp_path, idx):
    # vLLM's loader checks indices per call, after an earlier call's tensors were written:
    # the extension checks every tensor's first (found by review).
    write_patch(tmp_path / "p.safetensors")
    p = Patch(str(tmp_path / "p.safetensors"), "np")
    check_indices(p)
    _, vals, dtype = p.sparse["a"]
    p.sparse["a"] = (np.array(idx, dtype=np.int32), vals, dtype)
    with pytest.raises(ValueError, match="indices"):
        check_indices(p)
