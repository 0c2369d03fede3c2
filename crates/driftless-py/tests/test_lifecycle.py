"""The newest weights reach the bucket, or the trainer is told, however a publisher ends:
closed, dropped without close, still open at interpreter exit, or left through an exception
or ``sys.exit`` (found by review: the last three lost the newest steps silently)."""

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import driftless
from conftest import BF16, bits

# Large enough that a step's delta is still encoding or uploading when the publisher goes.
SHAPE = (4096, 4096)  # 32 MiB of BF16


def _steps(n, seed=5):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(SHAPE, np.float32) * 0.02).astype(BF16)
    out = [x.copy()]
    for _ in range(n - 1):
        u = bits(x).copy()
        idx = rng.choice(u.size, u.size // 100, replace=False)
        u.reshape(-1)[idx] ^= 1
        x = u.view(BF16)
        out.append(x.copy())
    return out


def _follower_has(url, public, step, want):
    f = driftless.Follower(url, trusted_keys=[public])
    assert f.poll() == step
    arrays = {"w": np.zeros(SHAPE, BF16)}
    assert f.apply_to(arrays)["step"] == step
    assert np.array_equal(bits(arrays["w"]), bits(want))


def test_a_publisher_dropped_without_close_flushes_its_steps(file_bucket, keys):
    url, _ = file_bucket
    private, public = keys
    steps = _steps(3)
    pub = driftless.Publisher(url, signing_key=private, anchor_every=100)
    for s, x in enumerate(steps):
        pub.publish(s, {"w": x})
    del pub
    gc.collect()
    _follower_has(url, public, 2, steps[2])


SCRIPT = """
import os, sys
import numpy as np
import ml_dtypes
import driftless

url, key, mode = sys.argv[1], sys.argv[2], sys.argv[3]
rng = np.random.default_rng(5)
x = (rng.standard_normal((4096, 4096), np.float32) * 0.02).astype(ml_dtypes.bfloat16)

def step(s):
    u = x.view(np.uint16).copy()
    u.reshape(-1)[rng.choice(u.size, u.size // 100, replace=False)] ^= 1
    return u.view(ml_dtypes.bfloat16)

def block_step_2():
    # Every write of step 2 fails: a path component of its objects is a file.
    root = url.removeprefix("file://")
    for k in ("deltas", "anchors"):
        os.makedirs(f"{root}/{k}", exist_ok=True)
        open(f"{root}/{k}/000000000002", "w").close()

if mode == "no_close":
    pub = driftless.Publisher(url, signing_key=key, anchor_every=100)
    for s in range(3):
        pub.publish(s, {"w": step(s)})
    print("script done", flush=True)
elif mode in ("exit_0", "error"):
    with driftless.Publisher(url, signing_key=key, anchor_every=100, max_retries=0, retry_timeout=1) as pub:
        for s in range(3):
            if s == 2:
                block_step_2()
            pub.publish(s, {"w": step(s)})
        if mode == "exit_0":
            sys.exit(0)
        raise RuntimeError("the trainer failed")
"""


def _run(tmp_path, url, private, mode):
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(SCRIPT))
    return subprocess.run([sys.executable, str(script), url, private, mode], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.path.dirname(__file__)})


def test_a_script_that_ends_without_close_publishes_its_last_step(file_bucket, keys, tmp_path):
    url, _ = file_bucket
    private, public = keys
    r = _run(tmp_path, url, private, "no_close")
    assert r.returncode == 0, r.stderr
    assert driftless.Follower(url, trusted_keys=[public]).poll() == 2, r.stderr


def test_sys_exit_with_the_newest_step_unpublished_is_not_a_success(file_bucket, keys, tmp_path):
    url, _ = file_bucket
    private, public = keys
    r = _run(tmp_path, url, private, "exit_0")
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "RetryableError" in r.stderr and "step 2" in r.stderr, r.stderr
    assert driftless.Follower(url, trusted_keys=[public]).poll() == 1


def test_an_exception_of_the_block_carries_the_failed_close(file_bucket, keys, tmp_path):
    url, _ = file_bucket
    private, _ = keys
    r = _run(tmp_path, url, private, "error")
    assert r.returncode == 1, r.stderr
    # The trainer's own exception is the one raised, with a note that step 2 is not published.
    assert "RuntimeError: the trainer failed" in r.stderr, r.stderr
    assert "closing the Publisher failed too; its newest steps may NOT be published" in r.stderr, r.stderr


def test_the_torch_hook_publishes_the_final_weights_on_finish(file_bucket, keys):
    """``every=3`` over 7 optimizer steps publishes after steps 3 and 6; ``finish`` publishes
    the weights of step 7 (the hook's view is a stand-in: torch is not installed in CI)."""
    from driftless.torch import PublishHook

    url, _ = file_bucket
    private, public = keys
    weights = _steps(8, seed=9)

    class View:  # what BF16View.tensors() returns, from a list of weights
        now = 0

        def tensors(self):
            return {"w": weights[self.now]}

    with driftless.Publisher(url, signing_key=private, anchor_every=100) as pub:
        hook = PublishHook.__new__(PublishHook)
        hook.publisher, hook.view, hook.every, hook.step = pub, View(), 3, 0
        hook.on_receipt, hook._calls, hook._unpublished, hook._handle = None, 0, False, None
        for t in range(1, 8):
            hook.view.now = t
            hook()
        assert hook.step == 2  # published weights of optimizer steps 3 and 6
        assert hook.finish()["step"] == 2
        assert hook.finish() is None
    _follower_has(url, public, 2, weights[7])


def test_the_torch_hook_finish_publishes_what_a_failed_publish_left(file_bucket, keys):
    """every=1, the publish after optimizer step 3 raises and the trainer trains on: finish()
    publishes step 3's weights (found by review: it returned None, "already published", with
    them in no bucket)."""
    from driftless.torch import PublishHook

    url, _ = file_bucket
    private, public = keys
    weights = _steps(4, seed=11)

    class View:
        now = 0

        def tensors(self):
            return {"w": weights[self.now]}

    class Flaky:  # the publisher, whose publish raises once
        def __init__(self, pub):
            self.pub, self.fail = pub, False

        def publish(self, step, tensors):
            if self.fail:
                self.fail = False
                raise driftless.RetryableError("the bucket is down")
            return self.pub.publish(step, tensors)

    with driftless.Publisher(url, signing_key=private, anchor_every=100) as pub:
        flaky = Flaky(pub)
        hook = PublishHook.__new__(PublishHook)
        hook.publisher, hook.view, hook.every, hook.step = flaky, View(), 1, 0
        hook.on_receipt, hook._calls, hook._unpublished, hook._handle = None, 0, False, None
        for t in range(1, 4):
            hook.view.now = t
            flaky.fail = t == 3
            try:
                hook()
            except driftless.RetryableError:
                pass
        r = hook.finish()
        assert r is not None and r["step"] == 3, r
        assert hook.finish() is None
    _follower_has(url, public, 3, weights[3])


def test_the_sharded_torch_hook_keeps_ranks_on_one_step_number_after_a_failed_publish(file_bucket, keys):
    """Two ranks (threads, each with its own ShardedPublisher) behind the torch hook; rank 1's
    publish after optimizer step 2 raises (a bad shard) and the trainer carries on. Every step
    that becomes ready holds one optimizer step's weights on both ranks. Found by review: the
    hook published the failed number again at the next optimizer step, so rank 1 sent the
    weights of step t+1 under number t, which rank 0 committed beside its own weights of step
    t: a model that never existed, signed and verified."""
    import threading

    from driftless.torch import PublishHook, ShardedBF16View

    url, _ = file_bucket
    private, public = keys
    rows, cols, steps = 2, 4096, 4

    def model(t):  # the full model after optimizer step t; rank r holds row r
        rng = np.random.default_rng(t)
        return (rng.standard_normal((rows, cols), np.float32)).astype(BF16)

    class View(ShardedBF16View):  # its shards() from a list of models, without torch
        def __init__(self, rank):
            self.rank, self.now = rank, 0

        def shards(self):
            if self.rank == 1 and self.now == 2:  # a bad geometry: publish raises
                return {"w": driftless.shard(model(self.now)[1:2].copy(), (rows, cols), offsets=(2, 0))}
            return {"w": driftless.shard(model(self.now)[self.rank:self.rank + 1].copy(), (rows, cols),
                                         offsets=(self.rank, 0))}

    barrier = threading.Barrier(2)
    errors = {0: [], 1: []}

    def rank(r):
        pub = driftless.ShardedPublisher(url, r, 2, signing_key=private, anchor_every=100, commit_timeout=3.0)
        hook = PublishHook.__new__(PublishHook)
        hook.publisher, hook.view, hook.every, hook.step = pub, View(r), 1, 1
        hook.on_receipt, hook._calls, hook._unpublished, hook._handle = None, 0, False, None
        for t in range(1, steps + 1):
            barrier.wait()  # the trainer's collective of each optimizer step
            hook.view.now = t
            try:
                hook()
            except Exception as e:  # a trainer that logs a failed publish and trains on
                errors[r].append((t, str(e)))
        try:
            pub.flush()
        except Exception as e:
            errors[r].append(("flush", str(e)))
        try:
            pub.close()
        except Exception:
            pass

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [t for t, _ in errors[1]][:1] == [2], errors
    f = driftless.Follower(url, trusted_keys=[public])
    newest = f.poll()
    assert newest is not None and newest >= 3, (newest, errors)
    arrays = {"w": np.zeros((rows, cols), BF16)}
    assert f.apply_to(arrays)["step"] == newest
    assert np.array_equal(bits(arrays["w"]), bits(model(newest))), f"step {newest} is not one optimizer step's model"


FORK_SCRIPT = """
import os, sys
import numpy as np
import ml_dtypes
import driftless

url, key, public = sys.argv[1], sys.argv[2], sys.argv[3]
w = {"w": np.zeros((64, 64), ml_dtypes.bfloat16)}
p = driftless.Publisher(url, signing_key=key)
p.publish(0, w)
p.flush()
f = driftless.Follower(url, trusted_keys=[public])
assert f.poll() == 0
pid = os.fork()
if pid == 0:
    print("child closed", p.closed, flush=True)  # closed for this process, lock untouched
    for call in (f.poll, lambda: f.apply_to({"w": np.zeros((64, 64), ml_dtypes.bfloat16)}),
                 lambda: p.publish(1, w), p.flush, p.status, f.reset):
        try:
            call()
            print("child: a call returned", flush=True)
            os._exit(3)
        except driftless.InvalidInputError as e:
            print("child:", e, flush=True)
    sys.exit(0)  # the exit hook and the drops of the inherited objects must not hang
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
p.publish(1, {"w": np.ones((64, 64), ml_dtypes.bfloat16)})
p.close()
print("parent poll", f.poll(), flush=True)
"""


def test_objects_used_after_fork_raise_instead_of_hanging(file_bucket, keys, tmp_path):
    """A Follower and a Publisher inherited through fork() (gunicorn --preload, multiprocessing
    with fork): every call in the child raises InvalidInputError at once, and the child exits
    (exit hook, drops) without touching them. Found by review: their tokio runtime has no
    threads in the child, so every call, and the exit hook's close(), waited forever,
    deaf to Ctrl-C. The parent goes on publishing."""
    url, _ = file_bucket
    private, public = keys
    script = tmp_path / "fork.py"
    script.write_text(FORK_SCRIPT)
    r = subprocess.run([sys.executable, str(script), url, private, public], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert sum("cannot be used after fork()" in x for x in lines) == 6, r.stdout + r.stderr
    assert "child closed True" in lines, r.stdout
    assert "child exit 0" in lines and "parent poll 1" in lines, r.stdout + r.stderr
    assert "NOT published" not in r.stderr, r.stderr


def test_ctrl_c_ends_the_waits_of_a_sharded_rank(file_bucket, keys):
    """Ctrl-C ends the sharded calls that wait up to the commit timeout: a rank waiting for
    its committer, rank 0's flush waiting for a part that never comes, and its next publish
    waiting for that step's outcome. Found by review: each ignored Ctrl-C for the whole
    commit timeout (2 minutes by default)."""
    import signal
    import threading
    import time

    url, _ = file_bucket
    private, _ = keys

    def interrupted(call):
        timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        t = time.monotonic()
        try:
            with pytest.raises(KeyboardInterrupt):
                call()
        finally:
            timer.join()
        return time.monotonic() - t

    # Python leaves SIGINT ignored when it started ignored (a background job): install the
    # handler Ctrl-C has in a terminal.
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        took = interrupted(lambda: driftless.ShardedPublisher(url, 1, 2, signing_key=private, commit_timeout=8))
        assert took < 4, took
        p0 = driftless.ShardedPublisher(url, 0, 2, signing_key=private, commit_timeout=8)
        x = np.zeros((2, 64), BF16)
        p0.publish(0, {"w": driftless.shard(x[0:1].copy(), (2, 64), offsets=(0, 0))})
        assert interrupted(p0.flush) < 4
        assert interrupted(lambda: p0.publish(1, {"w": driftless.shard(x[0:1].copy(), (2, 64), offsets=(0, 0))})) < 4
    finally:
        signal.signal(signal.SIGINT, old)
    # The step that missed a part is refused once the wait ends (a retry can help).
    with pytest.raises(driftless.RetryableError, match="no part from ranks"):
        p0.flush()
    with pytest.raises(driftless.RetryableError, match="no part from ranks"):
        p0.close()
    assert p0.generation is None  # closed
