"""`driftless.torch.BF16View` with real torch tensors: floating-point parameters are published
as BF16, integer and bool buffers (``include_buffers=True``) as they are, and a Follower reads
back the same bits.

Runs where PyTorch is installed; CI does not install it (see test_torch_sharded.py), so there
it reports as skipped."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import driftless  # noqa: E402
import driftless.torch  # noqa: E402


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(64, 33, generator=g))  # FP32 master weights
        # 4099 and 257 are not representable in BF16: a cast would round them.
        self.register_buffer("position_ids", torch.arange(4099, dtype=torch.int64) + 257)
        self.register_buffer("mask", torch.arange(300) % 3 == 0)


def bits(t):
    """The raw bytes of a CPU tensor, as uint8 (a bit pattern, never a value)."""
    return t.contiguous().view(-1).view(torch.uint8).numpy().copy()


def test_integer_and_bool_buffers_keep_their_dtype(file_bucket, keys):
    url, _ = file_bucket
    private, public = keys
    m = M()
    view = driftless.torch.BF16View(m, include_buffers=True)
    t = view.tensors()
    assert t["w"].dtype == torch.bfloat16
    assert t["position_ids"].dtype == torch.int64
    assert t["mask"].dtype == torch.bool
    assert torch.equal(t["position_ids"], m.position_ids), "the int64 buffer is published as it is"
    with driftless.Publisher(url, signing_key=private, anchor_every=100) as pub:
        pub.publish(1, t)
        with torch.no_grad():
            m.w.add_(1e-3)
        t2 = view.tensors()
        assert t2["w"] is t["w"], "the BF16 buffer is allocated once and reused"
        pub.publish(2, t2)
        want = {n: (tuple(x.shape), bits(x)) for n, x in t2.items()}
    import ml_dtypes

    dt = {"w": ml_dtypes.bfloat16, "position_ids": np.int64, "mask": np.bool_}
    got = {n: np.zeros(shape, dt[n]) for n, (shape, _) in want.items()}
    f = driftless.Follower(url, trusted_keys=[public])
    r = f.apply_to(got, step=2)
    assert r["step"] == 2
    for n, (_, b) in want.items():
        assert np.array_equal(got[n].view(np.uint8).ravel(), b), n
