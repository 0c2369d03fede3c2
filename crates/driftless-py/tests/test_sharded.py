"""Sharded publishing with real rank processes (4 and 8) on file:// and SeaweedFS: row-,
column- and flat-sharded tensors, a tensor one rank holds whole and a replicated one. The
steps the ranks commit are read by a cold and by a following agent (`Follower.sync_dir`, the
agent's own code) and checked bit for bit against the gathered model with the reference
`safetensors` reader. A rank killed with SIGKILL mid-step leaves no ready step, and the next
step (with the rank restarted) becomes ready."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

import driftless

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import sharded_rank  # noqa: E402


class Group:
    """Rank processes driven step by step through files in a control directory."""

    def __init__(self, tmp_path, url, store, key_path, world):
        self.url, self.store, self.key, self.world = url, store, key_path, world
        self.control = tmp_path / "control"
        self.control.mkdir()
        self.procs = {}
        self.logs = tmp_path

    def start(self, rank, first, last):
        out = open(self.logs / f"rank{rank}-{first}.out", "w")
        err = open(self.logs / f"rank{rank}-{first}.err", "w")
        args = [sys.executable, os.path.join(HERE, "sharded_rank.py"), self.url, str(rank), str(self.world),
                str(first), str(last), str(self.control), json.dumps(self.store), str(self.key)]
        self.procs[rank] = (subprocess.Popen(args, stdout=out, stderr=err), rank, first)

    def wait_files(self, names, timeout=120):
        t = time.time()
        while not all((self.control / n).exists() for n in names):
            for p, rank, first in self.procs.values():
                if p.poll() not in (None, 0, -signal.SIGKILL):
                    raise AssertionError(f"rank {rank} exited {p.returncode}: "
                                         + (self.logs / f"rank{rank}-{first}.err").read_text()[-3000:])
            if time.time() - t > timeout:
                raise AssertionError(f"timed out waiting for {names}")
            time.sleep(0.05)

    def step_done(self, step, ranks=None):
        self.wait_files([f"done-{step}-{r}" for r in (ranks if ranks is not None else range(self.world))])

    def go(self, step):
        (self.control / f"go-{step}").touch()

    def finish(self):
        for p, rank, first in self.procs.values():
            if p.returncode == -signal.SIGKILL:
                continue
            assert p.wait(timeout=120) == 0, (self.logs / f"rank{rank}-{first}.err").read_text()[-3000:]

    def receipts(self, rank, first):
        lines = (self.logs / f"rank{rank}-{first}.out").read_text().splitlines()
        return [json.loads(x) for x in lines if x.strip()]

    def kill_all(self):
        for p, _, _ in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def assert_matches(path, step):
    """The checkpoint at `path` holds the gathered model of `step`, bit for bit."""
    want = sharded_rank.model_at(step)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    got = {}
    for f in files:
        got.update(load_file(os.path.join(path, f)))
    assert sorted(got) == sorted(want)
    for name, a in want.items():
        g = got[name]
        assert g.shape == a.shape, name
        assert str(g.dtype) == "bfloat16", (name, g.dtype)
        assert np.array_equal(g.view(np.uint16), a), f"{name} differs from the gathered model at step {step}"


def follower(url, store, public):
    return driftless.Follower(url, trusted_keys=[public], **store)


@pytest.fixture
def key_files(keys, tmp_path):
    private, public = keys
    p = tmp_path / "key.pem"
    p.write_text(private)
    return p, public


@pytest.mark.parametrize("world", [4, 8])
def test_ranks_publish_a_chain_agents_read_bit_exact(bucket, key_files, tmp_path, world):
    url, store = bucket
    key_path, public = key_files
    g = Group(tmp_path, url, store, key_path, world)
    steps = 5  # anchors at 1 and 4 (anchor_every=3), deltas 2-5
    try:
        for r in range(world):
            g.start(r, 1, steps)
        follow = tmp_path / "follow"
        for step in range(1, steps + 1):
            g.step_done(step)
            o = follower(url, store, public).sync_dir(str(follow))
            assert o["step"] == step, o
            assert_matches(o["path"], step)
            if step == 3:
                cold = follower(url, store, public).sync_dir(str(tmp_path / "cold3"))
                assert cold["step"] == 3 and cold["route"] in ("anchor", "catchup"), cold
                assert_matches(cold["path"], 3)
            g.go(step)
        g.finish()
    finally:
        g.kill_all()
    # Step 4's anchor is scheduled: the step is a delta whose parts carry the shard bytes, and
    # rank 0 gathers anchor 4 after committing it.
    parts = [[(r["part"], r["slices"]) for r in g.receipts(rank, 1) if "part" in r] for rank in range(world)]
    want = [("anchor", True), ("delta", False), ("delta", False), ("delta", True), ("delta", False)]
    assert all(p == want for p in parts), parts
    commits = [r["outcome"] for r in g.receipts(0, 1)]
    assert [c["committed"] for c in commits] == [True] * steps
    assert [c["of"] for c in commits] == ["anchor", "delta", "delta", "delta", "delta"]
    assert [c["slices_next"] for c in commits] == [False, False, True, False, False]
    # Every other rank learned each outcome: the root it names is rank 0's.
    for rank in range(1, world):
        rs = [r for r in g.receipts(rank, 1) if "part" in r]
        assert [r["outcome"]["root"] for r in rs] == [c["root"] for c in commits]
        # Each part was uploaded in the background, after publish returned.
        assert [r["sent"]["step"] for r in rs] == list(range(1, steps + 1))
        assert all(r["sent"]["bytes"] > 0 for r in rs)
        # wait_sent() returned the same part before the outcome was known.
        assert [(r["uploaded"]["step"], r["uploaded"]["bytes"]) for r in rs] == [
            (r["sent"]["step"], r["sent"]["bytes"]) for r in rs
        ]
    # A cold agent at the end (anchor 4 + delta 5), and the Python follower in place.
    cold = follower(url, store, public).sync_dir(str(tmp_path / "cold5"))
    assert cold["step"] == steps
    assert_matches(cold["path"], steps)
    arrays = {n: np.zeros(s, np.uint16) for n, s in sharded_rank.SHAPES.items()}
    import ml_dtypes

    views = {n: a.view(ml_dtypes.bfloat16) for n, a in arrays.items()}
    r = follower(url, store, public).apply_to(views)
    assert r["step"] == steps
    for n, a in sharded_rank.model_at(steps).items():
        assert np.array_equal(arrays[n], a), n


def test_a_rank_killed_mid_step_leaves_no_ready_step(bucket, key_files, tmp_path):
    url, store = bucket
    key_path, public = key_files
    world = 4
    g = Group(tmp_path, url, store, key_path, world)
    (g.control / "pause-2-2").touch()
    try:
        for r in range(world):
            g.start(r, 1, 4)
        g.step_done(1)
        g.go(1)
        # Rank 2 stops in step 2 while the others upload their parts; SIGKILL it there.
        g.wait_files(["paused-2-2"])
        p, _, _ = g.procs[2]
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        g.step_done(2, ranks=[0, 1, 3])
        before = follower(url, store, public)
        assert before.poll() == 1
        g.start(2, 3, 4)  # restarted with nothing kept
        g.go(2)
        g.step_done(3)
        g.go(3)
        g.step_done(4)
        g.go(4)
        g.finish()
    finally:
        g.kill_all()
    commits = [r["outcome"] for r in g.receipts(0, 1)]
    assert [c["step"] for c in commits] == [1, 2, 3, 4]
    assert not commits[1]["committed"] and "ranks [2]" in commits[1]["reason"] and commits[1]["next_anchor"]
    assert commits[1]["retryable"] and commits[2]["retryable"]
    assert commits[2]["committed"] and commits[2]["of"] == "anchor"
    assert commits[3]["committed"] and commits[3]["of"] == "delta"
    f = follower(url, store, public)
    o = f.sync_dir(str(tmp_path / "a"))
    assert o["step"] == 4
    assert_matches(o["path"], 4)
    # Step 2 never became ready: a reader asked for it gets nothing.
    import ml_dtypes

    arrays = {n: np.zeros(s, np.uint16).view(ml_dtypes.bfloat16) for n, s in sharded_rank.SHAPES.items()}
    with pytest.raises(driftless.DriftlessError):
        follower(url, store, public).apply_to(arrays, step=2)
