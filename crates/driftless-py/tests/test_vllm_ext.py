"""The worker extension's patch planning, without torch or vLLM (the loader call itself needs
both and a GPU, and is not run here)."""

import numpy as np
import pytest

from driftless.vllm_ext import _split_pems, has_nan_bf16, plan_patches


def test_nan_detection_on_bf16_bits():
    assert has_nan_bf16(np.array([0x7FC1], dtype=np.uint16))
    assert not has_nan_bf16(np.array([0x7F80, 0xFF80, 0x8000, 0x3F80], dtype=np.uint16))  # +-inf, -0, 1


def test_plan_splits_sparse_dense_and_routes_nan_to_dense():
    full = {"b": np.array([1, 0x7FC1, 3, 4], dtype=np.uint16)}
    items = [
        ("a", np.array([0, 5], dtype=np.int64), np.array([0x3F80, 0x4000], dtype=np.uint16)),
        ("b", np.array([1], dtype=np.int64), np.array([0x7FC1], dtype=np.uint16)),
        ("c", None, np.zeros(6, dtype=np.uint16)),
    ]
    sparse, dense = plan_patches(items, {"a": (2, 3), "b": (4,), "c": (2, 3)}, full)
    assert [p[0] for p in sparse] == ["a"] and sparse[0][2].dtype == np.int32
    assert [p[0] for p in dense] == ["b", "c"]
    assert dense[0][3].tolist() == full["b"].tolist()
    with pytest.raises(ValueError, match="NaN"):
        plan_patches(items[1:2], {"b": (4,)})


def test_split_pems():
    pem = "-----BEGIN PUBLIC KEY-----\nAAA\n-----END PUBLIC KEY-----"
    assert _split_pems(pem + "\n" + pem) == [pem + "\n", pem + "\n"]
