#!/usr/bin/env python3
"""A runnable RL-style trainer in NumPy that publishes its BF16 weights with driftless, and a
follower that applies every step into its own arrays and checks them bit for bit.

    pip install ./crates/driftless-py ml_dtypes
    python examples/python/trainer_numpy.py                       # file:// temp bucket
    python examples/python/trainer_numpy.py s3://bucket/run-1     # AWS_* env for S3

Adam on FP32 master weights; the published tensors are their BF16 view, updated in place
after each step (what a trainer's bf16 copy is).
"""

import sys
import tempfile

import ml_dtypes
import numpy as np

import driftless

SHAPES = {
    "model.embed_tokens.weight": (2048, 256),
    "model.layers.0.self_attn.q_proj.weight": (256, 256),
    "model.layers.0.mlp.up_proj.weight": (1024, 256),
    "model.norm.weight": (256,),
}


def main():
    url = sys.argv[1] if len(sys.argv) > 1 else f"file://{tempfile.mkdtemp()}/bucket"
    steps, lr = 10, 1e-6
    rng = np.random.default_rng(0)
    master = {n: (rng.standard_normal(s, np.float32) * 0.02) for n, s in SHAPES.items()}
    m = {n: np.zeros_like(w) for n, w in master.items()}
    v = {n: np.zeros_like(w) for n, w in master.items()}
    bf16 = {n: w.astype(ml_dtypes.bfloat16) for n, w in master.items()}

    private, public, key_id = driftless.generate_key()
    follower = driftless.Follower(url, trusted_keys=[public])
    mine = {n: np.zeros_like(a) for n, a in bf16.items()}

    with driftless.Publisher(url, signing_key=private, anchor_every=5, new_stream=True) as pub:
        for step in range(steps):
            if step:
                for n, w in master.items():  # one Adam step on random gradients
                    g = rng.standard_normal(w.shape, np.float32)
                    m[n] = 0.9 * m[n] + 0.1 * g
                    v[n] = 0.999 * v[n] + 0.001 * g * g
                    w -= lr * (m[n] / (1 - 0.9**step)) / (np.sqrt(v[n] / (1 - 0.999**step)) + 1e-8)
                    bf16[n][...] = w.astype(ml_dtypes.bfloat16)
            r = pub.publish(step, bf16)  # returns after the diff; encodes and uploads in the background
            pub.flush()  # only so the follower below sees it at once
            st = pub.status()  # flushed: the delta's size is known
            o = follower.apply_to(mine)
            same = all(np.array_equal(mine[n].view(np.uint16), bf16[n].view(np.uint16)) for n in bf16)
            print(
                f"step {step}: {r['outcome']:>16} {st['last_delta_bytes']:>8} B (ratio {st['last_ratio']:6.1f}x) "
                f"-> follower {o['route']:>6} step {o['step']} bit-exact={same}"
            )
            assert same
        print("publisher:", pub.status())


if __name__ == "__main__":
    main()
