"""The real agent binary against the pinned engines' own route code.

Each test starts ``stub_engines.py`` (vLLM 0.33.0 or SGLang 0.5.23 route modules, unchanged,
stub engine underneath; see that file), publishes a small checkpoint with ``driftless
publish`` into a file:// bucket and runs ``driftless agent --once --notify ...``. The assertions
read the calls the engine's app recorded (path, query, body, status) and the state the stub
engine ends in.

Run by ``.ci/engines.sh`` (which fetches the engines and sets PYTHONPATH). Without the engine
sources or the binary the tests skip, unless DRIFTLESS_REQUIRE_SERVERS=1.
"""

import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BIN = os.environ.get("DRIFTLESS_BIN", os.path.join(ROOT, "target", "debug", "driftless"))
REQUIRE = os.environ.get("DRIFTLESS_REQUIRE_SERVERS") == "1"


def need(cond, why):
    if not cond:
        if REQUIRE:
            pytest.fail(f"{why} (DRIFTLESS_REQUIRE_SERVERS=1)")
        pytest.skip(why)


def have_engine(mod):
    try:
        import importlib.util

        return importlib.util.find_spec(mod) is not None
    except Exception:
        return False


class Engine:
    def __init__(self, kind, tmp, *args):
        need(have_engine(kind), f"{kind} sources not on PYTHONPATH (run .ci/engines.sh)")
        self.kind, self.args, self.tmp = kind, args, tmp
        # The /_stub routes sit behind the engine's own auth middleware too.
        self.stub_token = args[args.index("--api-key") + 1] if "--api-key" in args else None
        self.start()

    def start(self, port=0):
        ready = os.path.join(self.tmp, f"{self.kind}.port")
        if os.path.exists(ready):
            os.unlink(ready)
        self.log = open(os.path.join(self.tmp, f"{self.kind}.log"), "a")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "stub_engines.py"), self.kind, "--port", str(port),
             "--ready-file", ready, *self.args],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while not os.path.exists(ready):
            assert self.proc.poll() is None, open(self.log.name).read()[-3000:]
            assert time.time() < deadline, "stub engine did not start"
            time.sleep(0.05)
        self.port = int(open(ready).read())
        self.url = f"http://127.0.0.1:{self.port}"

    def restart(self):
        self.proc.wait(timeout=30)
        self.start(self.port)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def _req(self, method, path, body=None, token=None):
        data = json.dumps(body).encode() if body is not None else None
        r = urllib.request.Request(self.url + path, data=data, method=method,
                                   headers={"content-type": "application/json"})
        if token:
            r.add_header("authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(r, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            text = e.read().decode()
            try:
                return e.code, json.loads(text)
            except ValueError:
                return e.code, text

    def faults(self, **kw):
        assert self._req("POST", "/_stub/faults", kw, token=self.stub_token)[0] == 200

    def state(self):
        return self._req("GET", "/_stub/calls", token=self.stub_token)[1]

    def calls(self):
        return [(c["method"], c["path"] + ("?" + c["query"] if c["query"] else ""), c.get("status"))
                for c in self.state()["calls"]]

    def bodies(self, path):
        return [json.loads(c["body"]) for c in self.state()["calls"] if c["path"] == path and c["body"]]


@pytest.fixture
def stream(tmp_path):
    need(os.path.exists(BIN), f"{BIN} not built (cargo build -p driftless-cli)")
    s = Stream(tmp_path)
    yield s


class Stream:
    """A file:// bucket with signed steps and an agent directory."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.bucket = f"file://{tmp / 'bucket'}"
        self.key = tmp / "key.pem"
        self.dir = tmp / "agent"
        self.run("keygen", "--out", self.key)
        self.rng = np.random.default_rng(7)
        self.roots = {}
        self.w = {"model.embed_tokens.weight": self.rng.standard_normal((64, 32), dtype=np.float32),
                  "lm_head.weight": self.rng.standard_normal((64, 32), dtype=np.float32)}

    def run(self, *args, check=True, env=None):
        r = subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, timeout=300,
                           env={**os.environ, **(env or {})})
        if check:
            assert r.returncode == 0, f"{args[0]} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
        return r

    def version(self, step):
        """The weight_version an engine holding published step `step` reports: STEP-ROOT16."""
        return f"{step}-{self.roots[step][:16]}"

    def publish(self, step):
        if step:
            for t in self.w.values():
                t.reshape(-1)[self.rng.choice(t.size, 20, replace=False)] += 1e-3
        ck = self.tmp / f"step_{step}"
        ck.mkdir()
        save_file(self.w, str(ck / "model.safetensors"), metadata={"format": "pt"})
        self.run("publish", "--bucket", self.bucket, "--state", self.tmp / "pub", "--key", self.key,
                 "--step", step, ck)
        self.roots[step] = self.run("hash", ck).stdout.strip()

    def agent(self, *notify, check=True, env=None):
        args = ["agent", "--bucket", self.bucket, "--trust", f"{self.key}.pub", "--dir", self.dir, "--once"]
        for n in notify:
            args += ["--notify", n]
        return self.run(*args, check=check, env=env)


def vllm_versions(e):
    """The versions the agent set through POST /update_weight_version, in order."""
    return [b["new_version"] for b in e.bodies("/update_weight_version")]


@pytest.fixture
def vllm(tmp_path):
    e = Engine("vllm", str(tmp_path))
    yield e
    e.stop()


@pytest.fixture
def sglang(tmp_path):
    e = Engine("sglang", str(tmp_path))
    yield e
    e.stop()


# ------------------------------------------------------------------------ the engines' own rules
def test_vllm_routes_reject_what_the_old_adapter_sent(vllm):
    """The pinned route code, not a stand-in: the pre-fix requests fail as the issue says."""
    status, body = vllm._req("POST", "/update_weights", {"backend": "disk", "model_path": "/w/current"})
    assert status == 400 and "update_info" in json.dumps(body)
    # /pause ignores a JSON body: the mode comes from the query string only (default abort).
    vllm.faults(running=3)
    assert vllm._req("POST", "/pause", {"mode": "keep"})[0] == 200
    assert vllm.state()["running"] == 0, "a JSON body did not select keep: in-flight requests were aborted"
    assert vllm._req("POST", "/pause?mode=sideways")[0] == 400
    status, body = vllm._req("POST", "/collective_rpc", {"method": "reload_weights",
                                                         "kwargs": {"weights_path": "/no/such/dir"}})
    assert status == 500, body


def test_sglang_routes_validate_bodies(sglang):
    assert sglang._req("POST", "/pause_generation", {"mode": "sideways"})[0] == 400
    status, body = sglang._req("POST", "/update_weights_from_disk", {"weight_version": "1"})
    assert status == 400, body  # model_path is required
    status, body = sglang._req("POST", "/update_weights_from_disk", {"model_path": "org/not-a-dir"})
    assert status == 400 and body["success"] is False and "Hub" in body["message"]


# ------------------------------------------------------------------------------ full sequence
def test_vllm_full_sequence(stream, vllm):
    stream.publish(0)
    vllm.faults(running=2)
    stream.agent(f"vllm={vllm.url}")
    cur = os.path.realpath(stream.dir / "current")
    assert [c[1] for c in vllm.calls()] == [
        "/weight_info", "/pause?mode=keep", "/collective_rpc",
        "/reset_prefix_cache?reset_running_requests=true", "/update_weight_version", "/resume", "/weight_info"]
    assert all(c[2] == 200 for c in vllm.calls()), vllm.calls()
    assert vllm.bodies("/collective_rpc") == [{"method": "reload_weights", "kwargs": {"weights_path": cur}}]
    assert vllm.bodies("/update_weight_version") == [{"new_version": stream.version(0)}]
    st = vllm.state()
    assert st["paused"] is False and st["model_path"] == cur and os.path.isabs(cur)
    assert vllm._req("GET", "/weight_info")[1] == {"weight_version": stream.version(0)}
    # Next step: the same sequence, version 1.
    vllm.faults(clear_calls=True)
    stream.publish(1)
    stream.agent(f"vllm={vllm.url},mode=wait")
    assert ("POST", "/pause?mode=wait", 200) in vllm.calls()
    assert vllm._req("GET", "/weight_info")[1] == {"weight_version": stream.version(1)}


def test_sglang_full_sequence(stream, sglang):
    stream.publish(0)
    stream.agent(f"sglang={sglang.url}")
    cur = os.path.realpath(stream.dir / "current")
    assert [c[1] for c in sglang.calls()] == [
        "/model_info", "/pause_generation", "/update_weights_from_disk", "/continue_generation", "/model_info"]
    assert all(c[2] == 200 for c in sglang.calls()), sglang.calls()
    assert sglang.bodies("/pause_generation") == [{"mode": "retract"}]
    (load,) = sglang.bodies("/update_weights_from_disk")
    assert load == {"model_path": cur, "weight_version": stream.version(0), "flush_cache": True, "abort_all_requests": False}
    assert sglang.state()["paused"] is False
    assert sglang._req("GET", "/model_info")[1]["weight_version"] == stream.version(0)


# ------------------------------------------------------------------------------ failure paths
@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_failed_load_resumes_and_reports(stream, tmp_path, kind):
    e = Engine(kind, str(tmp_path))
    try:
        stream.publish(0)
        e.faults(fail_load=True)
        r = stream.agent(f"{kind}={e.url}", check=False)
        assert r.returncode != 0 and "notify" in r.stderr, r.stderr
        assert "out of memory" in r.stderr
        paths = [c[1] for c in e.calls()]
        info = "/weight_info" if kind == "vllm" else "/model_info"
        if kind == "vllm":
            # vLLM has no rollback: after a failed reload the version names no step (found by
            # review: the engine resumed reporting the step it held, which a patch could build
            # on), and the engine is not resumed on weights that may mix two steps (found by
            # review: it generated from them until the next load succeeded).
            assert vllm_versions(e) == ["driftless-unknown"], e.calls()
            assert e._req("GET", info)[1]["weight_version"] == "driftless-unknown"
            assert "/resume" not in paths, paths
            assert e.state()["paused"] is True
            assert "left paused until a reload succeeds" in r.stderr, r.stderr
        else:
            # SGLang's loader puts the weights it held back when a load fails: resumed on them.
            assert paths[-1] == "/continue_generation", paths
            assert e.state()["paused"] is False
            assert not any(p.startswith("/update_weight_version") for p in paths), "version bumped after a failed load"
        # The next run notifies the verified step again and succeeds (and resumes).
        e.faults(clear_calls=True)
        stream.agent(f"{kind}={e.url}")
        assert e._req("GET", info)[1]["weight_version"] == stream.version(0)
        assert e.state()["paused"] is False
    finally:
        e.stop()


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_timed_out_load_is_not_resent(stream, tmp_path, kind):
    e = Engine(kind, str(tmp_path))
    try:
        stream.publish(0)
        e.faults(load_delay=3.0)
        r = stream.agent(f"{kind}={e.url},timeout=1", check=False)
        loads = [c for c in e.calls() if c[1] in ("/collective_rpc", "/update_weights_from_disk")]
        assert len(loads) == 1, e.calls()
        paths = [c[1] for c in e.calls()]
        assert "/resume" in paths or "/continue_generation" in paths
        if kind == "sglang":
            # It waited for /model_info to report the version instead of re-sending: success.
            assert r.returncode == 0, r.stderr
            assert e.state()["max_concurrent_loads"] == 1
        else:
            # vLLM's version is set by the agent after the reload: reported, retried next run.
            assert r.returncode != 0 and "not re-sent" in r.stderr, r.stderr
            time.sleep(3)
            e.faults(load_delay=0.0, clear_calls=True)
            stream.agent(f"{kind}={e.url}")
            assert e._req("GET", "/weight_info")[1] == {"weight_version": stream.version(0)}
    finally:
        e.stop()


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_engine_restarts_mid_sequence(stream, tmp_path, kind):
    e = Engine(kind, str(tmp_path))
    try:
        stream.publish(0)
        e.faults(die_on_load=True)
        r = stream.agent(f"{kind}={e.url}", check=False)
        assert r.returncode != 0 and "notify" in r.stderr
        e.restart()  # fresh engine on the same port, initial weights, no version
        stream.agent(f"{kind}={e.url}")
        info = "/weight_info" if kind == "vllm" else "/model_info"
        assert e._req("GET", info)[1]["weight_version"] == stream.version(0)
        assert e.state()["paused"] is False
    finally:
        e.stop()


def test_sglang_in_place_flush_refused_is_not_success(stream, sglang):
    stream.publish(0)
    sglang.faults(running=2)
    r = stream.agent(f"sglang={sglang.url},mode=in_place", check=False)
    assert r.returncode != 0 and "flush" in r.stderr, r.stderr
    assert sglang.calls()[-1][1] in ("/continue_generation", "/model_info")
    assert sglang.state()["paused"] is False
    # The weights were updated, the version (set only on success) was not: the engine must
    # not go on reporting the step it held (found by review: it served the new weights under
    # the old version). Set to driftless-unknown, without aborting the running requests.
    assert sglang.bodies("/update_weight_version") == [{"new_version": "driftless-unknown", "abort_all_requests": False}]
    assert sglang._req("GET", "/model_info")[1]["weight_version"] == "driftless-unknown"
    assert "version set to driftless-unknown" in r.stderr, r.stderr
    # Once the requests are done, the next run loads the step and labels it.
    sglang.faults(running=0)
    stream.agent(f"sglang={sglang.url},mode=in_place")
    assert sglang._req("GET", "/model_info")[1]["weight_version"] == stream.version(0)


def test_vllm_cache_not_reset_after_a_reload_is_not_labelled_as_either_step(stream, vllm):
    """The reload worked, /reset_prefix_cache keeps answering success=false: the engine holds
    the new step's weights (and, in mode=keep, requests with KV of the old ones). Found by
    review: it was resumed reporting the step it held. Now its version names no step, it is
    resumed (the weights are a whole verified step), and the next run labels it."""
    stream.publish(0)
    vllm.faults(fail_reset=True)
    r = stream.agent(f"vllm={vllm.url}", check=False)
    assert r.returncode != 0 and "reset_prefix_cache" in r.stderr, r.stderr
    assert vllm_versions(vllm) == ["driftless-unknown"], vllm.calls()
    assert vllm._req("GET", "/weight_info")[1]["weight_version"] == "driftless-unknown"
    assert vllm.state()["paused"] is False
    vllm.faults(fail_reset=False)
    stream.agent(f"vllm={vllm.url}")
    assert vllm._req("GET", "/weight_info")[1]["weight_version"] == stream.version(0)


def test_sglang_auth_required(stream, tmp_path):
    token = "s3cr3t-token-value"
    e = Engine("sglang", str(tmp_path), "--api-key", token)
    try:
        stream.publish(0)
        r = stream.agent(f"sglang={e.url}", check=False)
        assert r.returncode != 0 and "401" in r.stderr, r.stderr
        assert e.state()["paused"] is False  # refused before anything was paused
        tf = tmp_path / "token"
        tf.write_text(token + "\n")
        r = stream.agent(f"sglang={e.url},token_file={tf}")
        assert token not in r.stderr + r.stdout
        assert all(c["auth"] for c in e.state()["calls"][-5:])
        assert e._req("GET", "/model_info", token=token)[1]["weight_version"] == stream.version(0)
        # token_env works too, and a token in clear is refused before anything is sent.
        e.faults(clear_calls=True)
        stream.publish(1)
        stream.agent(f"sglang={e.url},token_env=ENGINE_KEY", env={"ENGINE_KEY": token})
        assert e._req("GET", "/model_info", token=token)[1]["weight_version"] == stream.version(1)
        r = stream.agent(f"sglang={e.url},token={token}", check=False)
        assert r.returncode != 0 and token not in r.stderr
    finally:
        e.stop()


def test_vllm_api_key_does_not_guard_dev_routes(stream, tmp_path):
    """vLLM 0.33.0's AuthenticationMiddleware guards only /v1, /v2, /inference, /cohere: with
    --api-key the dev/RL routes still answer without a token (documented in docs/engines/vllm.md).
    A configured token is sent anyway (for an auth proxy in front)."""
    token = "s3cr3t-token-value"
    e = Engine("vllm", str(tmp_path), "--api-key", token)
    try:
        stream.publish(0)
        stream.agent(f"vllm={e.url}")
        assert e._req("GET", "/weight_info")[1] == {"weight_version": stream.version(0)}
        e.faults(clear_calls=True)
        stream.publish(1)
        r = stream.agent(f"vllm={e.url},token_env=ENGINE_KEY", env={"ENGINE_KEY": token})
        assert token not in r.stderr + r.stdout
        assert all(c["auth"] for c in e.state()["calls"])
    finally:
        e.stop()


# ------------------------------------------------------------------- in-place patches (vLLM)
def engine_matches_dir(engine, path):
    """The stub engine's live weights are bit-identical to the checkpoint in ``path``."""
    import hashlib

    import ml_dtypes  # noqa: F401
    from safetensors.numpy import load_file

    want = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            want.update({k: hashlib.sha256(v.tobytes()).hexdigest()
                         for k, v in load_file(os.path.join(path, f)).items()})
    got = engine._req("GET", "/_stub/weights", token=engine.stub_token)[1]
    return got == want


def test_vllm_patch_applies_in_place(stream, vllm):
    """patch=on: after a full load, each delta step reaches the engine as a patch through the
    worker extension (no reload), and the engine's weights are the verified step bit for bit."""
    import ml_dtypes

    stream.w["model.layers.0.mlp.gate_proj.weight"] = stream.rng.standard_normal((48, 40)).astype(
        ml_dtypes.bfloat16)
    target = f"vllm={vllm.url},patch=on"
    stream.publish(0)
    stream.agent(target)
    assert [b["method"] for b in vllm.bodies("/collective_rpc")] == ["reload_weights"]
    assert engine_matches_dir(vllm, stream.dir / "current")
    for step in (1, 2):
        vllm.faults(clear_calls=True)
        stream.publish(step)
        trainer = stream.tmp / f"step_{step}"
        assert not engine_matches_dir(vllm, trainer)  # the step changed something
        stream.agent(target)
        cur = os.path.realpath(stream.dir / "current")
        # (--once first checks that the engine holds the agent's step: /weight_info, /is_paused)
        assert [c[1] for c in vllm.calls()] == [
            "/weight_info", "/is_paused", "/weight_info", "/pause?mode=keep", "/collective_rpc",
            "/reset_prefix_cache?reset_running_requests=true", "/update_weight_version", "/resume", "/weight_info"]
        assert all(c[2] == 200 for c in vllm.calls()), vllm.calls()
        (rpc,) = vllm.bodies("/collective_rpc")
        assert rpc["method"] == "driftless_apply_patch" and rpc["kwargs"]["weights_path"] == cur
        assert rpc["kwargs"]["path"].startswith(str(stream.dir / "patch"))
        assert not os.path.exists(rpc["kwargs"]["path"]), "a patch is used once, then removed"
        assert engine_matches_dir(vllm, cur) and engine_matches_dir(vllm, trainer)
        assert vllm._req("GET", "/weight_info")[1] == {"weight_version": stream.version(step)}


def test_vllm_patch_past_patch_max_is_a_reload(stream, vllm):
    """A patch that would have each worker put more than ``patch_max`` on its device at once is
    not written: the step reaches the engine through reload_weights, bit for bit; under the
    default bound the same kind of step is a patch."""
    stream.publish(0)
    stream.agent(f"vllm={vllm.url},patch=on")
    for step, spec, method in ((1, ",patch_max=1", "reload_weights"), (2, "", "driftless_apply_patch")):
        vllm.faults(clear_calls=True)
        stream.publish(step)
        r = stream.agent(f"vllm={vllm.url},patch=on{spec}")
        assert [b["method"] for b in vllm.bodies("/collective_rpc")] == [method], vllm.calls()
        if method == "reload_weights":
            assert "over patch_max" in r.stderr, r.stderr
        assert engine_matches_dir(vllm, os.path.realpath(stream.dir / "current"))
        assert vllm._req("GET", "/weight_info")[1] == {"weight_version": stream.version(step)}


def test_vllm_failed_patch_falls_back_to_a_full_reload(stream, vllm):
    """A patch that fails after writing part of the weights: the version is marked unknown
    first, then reload_weights restores the verified step in the same pause."""
    target = f"vllm={vllm.url},patch=on"
    stream.publish(0)
    stream.agent(target)
    stream.publish(1)
    vllm.faults(clear_calls=True, fail_patch=True)
    stream.agent(target)
    cur = os.path.realpath(stream.dir / "current")
    methods = [b.get("method") or b.get("new_version") for b in
               vllm.bodies("/collective_rpc") + vllm.bodies("/update_weight_version")]
    assert methods == ["driftless_apply_patch", "reload_weights", "driftless-unknown", stream.version(1)], vllm.calls()
    assert engine_matches_dir(vllm, cur)
    assert vllm._req("GET", "/weight_info")[1] == {"weight_version": stream.version(1)}
    assert vllm.state()["paused"] is False


def test_vllm_failed_patch_then_an_unconfirmed_reload_leaves_the_engine_paused(stream, vllm):
    """A patch that failed part way, then a reload the agent got no answer to in time: the
    weights may mix two steps, so the engine is left paused, reporting no step, until a
    reload succeeds (found by review: it was resumed on the mix, since only a reload that vLLM
    answered as failed kept it paused)."""
    target = f"vllm={vllm.url},patch=on,timeout=3"
    stream.publish(0)
    stream.agent(target)
    stream.publish(1)
    vllm.faults(clear_calls=True, fail_patch=True, load_delay=5)
    r = stream.agent(target, check=False)
    assert r.returncode != 0 and "left paused until a reload succeeds" in r.stderr, r.stderr
    assert vllm.state()["paused"] is True
    assert "/resume" not in [c[1] for c in vllm.calls()], vllm.calls()
    assert vllm._req("GET", "/weight_info")[1] == {"weight_version": "driftless-unknown"}
    # The next run reloads the verified step and resumes the engine on it.
    vllm.faults(clear_calls=True, load_delay=0)
    stream.agent(target)
    assert engine_matches_dir(vllm, os.path.realpath(stream.dir / "current"))
    assert vllm._req("GET", "/weight_info")[1] == {"weight_version": stream.version(1)}
    assert vllm.state()["paused"] is False


def test_vllm_timed_out_patch_is_followed_by_a_reload(stream, vllm):
    """A patch that outlives the notifier's timeout (the engine still runs it): the version is
    marked unknown, and reload_weights, queued behind the patch in the engine core, restores
    the verified step; the engine ends bit-exact on it."""
    target = f"vllm={vllm.url},patch=on,timeout=3"
    stream.publish(0)
    stream.agent(target)
    stream.publish(1)
    vllm.faults(clear_calls=True, patch_delay=4)
    stream.agent(target)
    methods = [b.get("method") or b.get("new_version") for b in
               vllm.bodies("/collective_rpc") + vllm.bodies("/update_weight_version")]
    assert methods == ["driftless_apply_patch", "reload_weights", "driftless-unknown", stream.version(1)], vllm.calls()
    assert engine_matches_dir(vllm, os.path.realpath(stream.dir / "current"))
    assert vllm._req("GET", "/weight_info")[1] == {"weight_version": stream.version(1)}
    assert vllm.state()["paused"] is False


def test_vllm_patch_only_onto_its_base(stream, vllm):
    """An engine that does not report the agent's step (restarted, loaded elsewhere) is
    brought back to a known state by a full reload before any patch is applied onto it."""
    target = f"vllm={vllm.url},patch=on"
    stream.publish(0)
    stream.agent(target)
    assert vllm._req("POST", "/update_weight_version", {"new_version": "something-else"})[0] == 200
    stream.publish(1)
    vllm.faults(clear_calls=True)
    stream.agent(target)
    assert [b["method"] for b in vllm.bodies("/collective_rpc")] == ["reload_weights", "driftless_apply_patch"]
    assert [b["new_version"] for b in vllm.bodies("/update_weight_version")] == [stream.version(0), stream.version(1)]
    assert engine_matches_dir(vllm, os.path.realpath(stream.dir / "current"))


@pytest.mark.parametrize("patch", ["off", "on"])
def test_vllm_loads_another_streams_step_of_the_same_number(stream, vllm, tmp_path, patch):
    """An agent directory moved to a new stream whose steps reuse the numbers it served (a new
    run in the same prefix): the engine loads the new stream's weights. Found by review: the
    version was the bare step, so the engine's "1" (the old stream's step 1) was taken for
    loaded and nothing was sent (patch=on would then have applied the new stream's next patch
    onto the old stream's weights)."""
    target = f"vllm={vllm.url},patch={patch}"
    stream.publish(0)
    stream.agent(target)
    stream.publish(1)
    stream.agent(target)
    other_tmp = tmp_path / "other"
    other_tmp.mkdir()
    other = Stream(other_tmp)
    other.dir = stream.dir
    for t in other.w.values():
        t += 0.5  # other weights under the same step numbers
    other.publish(0)
    other.publish(1)
    assert other.roots[1] != stream.roots[1]
    vllm.faults(clear_calls=True)
    r = other.agent(target)
    assert engine_matches_dir(vllm, os.path.realpath(other.dir / "current")), (vllm.calls(), r.stdout, r.stderr)
    assert engine_matches_dir(vllm, other_tmp / "step_1")
    assert vllm._req("GET", "/weight_info")[1] == {"weight_version": other.version(1)}
    # The next delta of the new stream patches (or reloads) onto its own step 1.
    other.publish(2)
    other.agent(target)
    assert engine_matches_dir(vllm, other_tmp / "step_2")
    assert vllm._req("GET", "/weight_info")[1] == {"weight_version": other.version(2)}


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_sigterm_during_a_load_resumes_the_engine_before_the_agent_stops(stream, tmp_path, kind):
    """A continuous agent stopped (SIGTERM, as Kubernetes does) while the engine is paused for
    its load: the load in flight is finished, the engine resumed, then the agent exits 0.
    Found by review: the notify was dropped midway and the engine stayed paused."""
    import signal

    e = Engine(kind, str(tmp_path))
    try:
        stream.publish(0)
        e.faults(load_delay=3.0)
        args = ["agent", "--bucket", stream.bucket, "--trust", f"{stream.key}.pub", "--dir", stream.dir,
                "--notify", f"{kind}={e.url}"]
        p = subprocess.Popen([BIN, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        load = "/collective_rpc" if kind == "vllm" else "/update_weights_from_disk"
        deadline = time.time() + 60
        while not any(c[1] == load for c in e.calls()):
            assert p.poll() is None and time.time() < deadline, p.communicate()
            time.sleep(0.05)
        time.sleep(0.5)
        assert e.state()["paused"] is True  # mid-load
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert e.state()["paused"] is False, (e.calls(), err)
        info = "/weight_info" if kind == "vllm" else "/model_info"
        assert e._req("GET", info)[1]["weight_version"] == stream.version(0)
    finally:
        e.stop()
