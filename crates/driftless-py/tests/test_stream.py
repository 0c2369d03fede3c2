"""A NumPy trainer publishes 20 steps; followers reproduce every step bit for bit, through
apply_to (caller-owned arrays), iter_patches (scatter themselves) and sync_dir (a checkpoint
directory read back with the safetensors package)."""

import glob
import hashlib
import json
import os
import shutil
import tempfile
import time

import numpy as np
import pytest
import safetensors

import driftless
from conftest import BF16, Raw, SimTrainer, bits


def load_dir_raw(path):
    """{name: (dtype, shape, bytes)} of every safetensors file under path (safetensors'
    NumPy loader has no BF16; deserialize gives raw bytes)."""
    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with open(f, "rb") as fh:
            for name, t in safetensors.deserialize(fh.read()):
                out[name] = (t["dtype"], tuple(t["shape"]), bytes(t["data"]))
    return out


def bit_chain(seed, shape, n):
    """n + 1 uint16 arrays: random bits, then 1% of the elements' lowest bit flipped per step."""
    rng = np.random.default_rng(seed)
    steps = [rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)]
    for _ in range(n):
        x = steps[-1].copy()
        x.flat[rng.integers(0, x.size, x.size // 100)] ^= 1
        steps.append(x)
    return steps


def flip_largest_object(root, kind, step):
    """Flips one byte in the middle of the largest object of a step (`kind`: "deltas" or
    "anchors"); returns its path and its good bytes."""
    d = os.path.join(root, kind, f"{step:012d}")
    obj = max((os.path.join(d, n) for n in os.listdir(d) if "manifest" not in n), key=os.path.getsize)
    good = open(obj, "rb").read()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    open(obj, "wb").write(bytes(bad))
    return obj, good


def test_twenty_steps_bit_exact(bucket, keys, tmp_path):
    url, kw = bucket
    private, public = keys
    tr = SimTrainer(seed=1)
    mine = {n: np.zeros_like(a) for n, a in tr.bf16().items()}
    engine = {n: np.zeros(a.size, np.uint16) for n, a in tr.bf16().items()}  # a "GPU" copy
    follower = driftless.Follower(url, trusted_keys=[public], **kw)
    patcher = driftless.Follower(url, trusted_keys=[public], **kw)
    assert follower.poll() is None
    routes = []
    with driftless.Publisher(url, signing_key=private, anchor_every=8, **kw) as pub:
        for step in range(20):
            if step:
                tr.step()
            r = pub.publish(step, tr.bf16())
            assert r["step"] == step
            if step:
                assert r["outcome"] in ("delta", "delta_and_anchor")
                assert 0 < r["density"] < 0.5, r
            pub.flush()
            assert follower.poll() == step
            o = follower.apply_to(mine)
            assert o["step"] == step and follower.applied_step == step
            routes.append(o["route"])
            for n, a in tr.bf16().items():
                assert np.array_equal(bits(mine[n]), bits(a)), (step, n)
            for name, pos, vals in patcher.iter_patches():
                if pos is None:
                    engine[name][:] = vals.reshape(-1)
                else:
                    assert pos.dtype == np.int64 and vals.dtype == np.uint16
                    engine[name][pos] = vals
            assert patcher.patch_step == step
            for n, a in tr.bf16().items():
                assert np.array_equal(engine[n], bits(a).reshape(-1)), (step, n)
        st = pub.status()
        assert st["last_published"] == 19 and st["failures"] == 0
    assert routes[0] == "anchor" and set(routes[1:]) == {"fast"}, routes
    # Up to date: nothing to do.
    assert follower.apply_to(mine)["route"] == "up_to_date"
    assert list(patcher.iter_patches()) == []

    # A directory sync (agent --once) from nothing, read back with the safetensors package.
    out = follower.sync_dir(str(tmp_path / "agent"))
    assert out["step"] == 19 and out["route"] == "anchor"
    got = load_dir_raw(out["path"])
    assert set(got) == set(tr.bf16())
    for n, a in tr.bf16().items():
        dtype, shape, data = got[n]
        assert dtype == "bf16" or dtype == "BF16"
        assert shape == a.shape
        assert data == a.tobytes(), n


def test_follower_catches_up_and_starts_late(file_bucket, keys):
    url, kw = file_bucket
    private, public = keys
    tr = SimTrainer(seed=2)
    f = driftless.Follower(url, trusted_keys=[public])
    arrays = {n: np.zeros_like(a) for n, a in tr.bf16().items()}
    with driftless.Publisher(url, signing_key=private, anchor_every=5) as pub:
        for step in range(12):
            if step:
                tr.step()
            pub.publish(step, tr.bf16())
            if step == 3:
                pub.flush()
                assert f.apply_to(arrays)["step"] == 3
        pub.flush()
    o = f.apply_to(arrays)  # several deltas at once
    assert o["step"] == 11 and o["route"] in ("catchup", "anchor")
    for n, a in tr.bf16().items():
        assert np.array_equal(bits(arrays[n]), bits(a))
    # A new follower starts from the newest anchor plus the deltas after it.
    late = {n: np.zeros_like(a) for n, a in tr.bf16().items()}
    o = driftless.Follower(url, trusted_keys=[public]).apply_to(late)
    assert o["route"] == "anchor" and o["step"] == 11
    for n, a in tr.bf16().items():
        assert np.array_equal(bits(late[n]), bits(a))
    # An explicit older step (anchor route backwards).
    o = f.apply_to(arrays, step=5)
    assert o["step"] == 5


def test_dtypes_roundtrip(file_bucket):
    """Every supported NumPy dtype travels bit for bit (NaN payloads and -0.0 included)."""
    url, _ = file_bucket
    rng = np.random.default_rng(3)
    t = {
        "f32": rng.standard_normal((64, 3)).astype(np.float32),
        "f16": rng.standard_normal(100).astype(np.float16),
        "f64": rng.standard_normal(10),
        "i64": rng.integers(-5, 5, 33).astype(np.int64),
        "u8": rng.integers(0, 255, 17).astype(np.uint8),
        "b": rng.integers(0, 2, 9).astype(bool),
        "bf16": rng.standard_normal(50).astype(BF16),
        "scalar": np.array(3.5, np.float32),
    }
    t["f32"].view(np.uint32)[0, 0] = 0x7FC01234  # NaN with payload
    t["f32"][1, 1] = -0.0
    with driftless.Publisher(url) as pub:
        pub.publish(0, t)
        t["f32"][2, 2] += 1
        t["bf16"][7] = BF16(9.0)
        pub.publish(1, t)
    f = driftless.Follower(url, allow_unsigned=True)
    got = {n: np.zeros_like(a) for n, a in t.items()}
    assert f.apply_to(got)["step"] == 1
    for n in t:
        assert got[n].tobytes() == t[n].tobytes(), n


def test_extra_files_and_idempotent_republish(bucket, keys, tmp_path):
    """Issue 10: the Python publisher ships non-weight files (config.json, tokenizer) and a
    re-run of a committed step with the same weights is a no-op, other weights an error."""
    url, kw = bucket
    private, public = keys
    tr = SimTrainer(seed=3)
    cfg = tmp_path / "config.json"
    cfg.write_bytes(b'{"model_type": "llama"}')
    with driftless.Publisher(url, signing_key=private, extra_files=[str(cfg)], **kw) as pub:
        pub.publish(0, tr.bf16())
        tr.step()
        pub.publish(1, tr.bf16())
        pub.flush()
        assert pub.publish(1, tr.bf16())["outcome"] == "already_published"
        other = {n: a.copy() for n, a in tr.bf16().items()}
        name = next(iter(other))
        other[name].view(np.uint16).reshape(-1)[0] ^= 1
        with pytest.raises(driftless.DriftlessError, match="already published with other weights"):
            pub.publish(1, other)
        # New files: the next step is an anchor-only step, so every reader gets them.
        changed = pub.set_extra_files({"config.json": b'{"model_type": "llama", "v": 2}', "tokenizer.json": b"{}"})
        assert changed == ["config.json", "tokenizer.json"]
        tr.step()
        assert pub.publish(2, tr.bf16())["outcome"] == "anchor"
    out = driftless.Follower(url, trusted_keys=[public], **kw).sync_dir(str(tmp_path / "agent"))
    assert out["step"] == 2
    assert (tmp_path / "agent" / "current" / "config.json").read_bytes() == b'{"model_type": "llama", "v": 2}'
    assert (tmp_path / "agent" / "current" / "tokenizer.json").read_bytes() == b"{}"


def test_follower_streams_an_anchor_into_arrays_and_refuses_a_corrupt_one(file_bucket, keys, tmp_path):
    """apply_to streams a byte-plane anchor into the arrays (a 21 MB tensor: two 16 MiB parts
    written into one array at once); a flipped byte or a truncated object is a CorruptError,
    and the restored object loads bit for bit."""
    url, _ = file_bucket
    private, public = keys
    rng = np.random.default_rng(5)
    tensors = {
        "a.big": rng.integers(0, 1 << 16, size=(5000, 2100), dtype=np.uint16).view(BF16),
        "b.small": rng.integers(0, 1 << 16, size=(64,), dtype=np.uint16).view(BF16),
    }
    with driftless.Publisher(url, signing_key=private) as pub:
        assert pub.publish(0, tensors)["outcome"] == "anchor"
    root = url.removeprefix("file://")
    shards = [p for p in glob.glob(f"{root}/anchors/**/*", recursive=True) if os.path.isfile(p)]
    obj = max(shards, key=os.path.getsize)
    good = open(obj, "rb").read()
    # refuse_for=0: a refused step is tried again at the next call (the default waits 30 s).
    f = driftless.Follower(url, trusted_keys=[public], refuse_for=0)
    arrays = {n: np.zeros_like(a) for n, a in tensors.items()}
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    for broken in (bytes(bad), good[:-100]):
        with open(obj, "wb") as fh:
            fh.write(broken)
        with pytest.raises(driftless.CorruptError) as e:
            f.apply_to(arrays)
        assert f.applied_step is None
        # Streamed as it downloads (nothing verified to lose): the error says it wrote.
        assert e.value.arrays_modified is True
    with open(obj, "wb") as fh:
        fh.write(good)
    o = f.apply_to(arrays)
    assert o["route"] == "anchor" and o["step"] == 0
    for n, a in tensors.items():
        assert np.array_equal(bits(arrays[n]), bits(a)), n


def _publish_bits(url, private, seed, shape, n, **publisher):
    """Publishes ``bit_chain(seed, shape, n)`` as tensor "x.w" (BF16), steps 0..n, each flushed
    (a step due an anchor while the previous one still encodes is a delta alone); returns the
    chain."""
    steps = bit_chain(seed, shape, n)
    with driftless.Publisher(url, signing_key=private, **publisher) as pub:
        for s, x in enumerate(steps):
            pub.publish(s, {"x.w": x.view(BF16)})
            pub.flush()
    return steps


def _resign(root, kind, step, private, edit):
    """Re-signs the manifest of step ``step`` (``kind``: "anchors" or "deltas") with the trusted
    key after ``edit(manifest_dict)``: what a publisher bug or a stolen key produces. The
    envelope as driftless seals it: Ed25519 over a domain tag and the payload text; the marker
    then names the new manifest's SHA-256."""
    import base64
    import hashlib
    import json

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    name = f"{step:012d}"
    marker_path = os.path.join(root, "ready", kind, name)
    marker = json.load(open(marker_path))
    env_path = os.path.join(root, kind, name, marker.get("manifest", "manifest.json"))
    env = json.load(open(env_path))
    m = json.loads(env["payload"])
    edit(m)
    payload = json.dumps(m, separators=(",", ":"))
    # The key's PKCS#8 (v2, with the public key, which `cryptography` does not parse): the
    # 32-byte seed follows the OCTET STRING tags 04 22 04 20.
    der = base64.b64decode("".join(l for l in private.splitlines() if not l.startswith("-----")))
    seed = der[der.index(b"\x04\x22\x04\x20") + 4 :][:32]
    sig = Ed25519PrivateKey.from_private_bytes(seed).sign(b"driftless.manifest.v1\0" + payload.encode())
    forged = json.dumps(
        {"payload": payload, "signatures": [{"key_id": env["signatures"][0]["key_id"], "sig": base64.b64encode(sig).decode()}]}
    ).encode()
    open(env_path, "wb").write(forged)
    marker["manifest_sha256"] = hashlib.sha256(forged).hexdigest()
    open(marker_path, "w").write(json.dumps(marker))


def _another_root(m, field="weights_root"):
    import hashlib

    m[field] = hashlib.sha256(b"another model").hexdigest()


def _forge_anchor_root(root, step, private):
    """Anchor ``step`` re-signed with a weights root that is not its bytes' root (its object
    hashes still match)."""
    _resign(root, "anchors", step, private, _another_root)


def test_follower_refuses_a_signed_anchor_whose_bytes_are_not_its_root(file_bucket, keys):
    """A manifest signed by the trusted key, with object hashes that match, but a weights root
    that is not its bytes' root (a publisher bug, or a stolen key): the Follower hashes the
    anchor as it streams it into the arrays and refuses it (CorruptError, nothing applied)."""
    url, _ = file_bucket
    private, public = keys
    rng = np.random.default_rng(9)
    tensors = {"a.w": rng.integers(0, 1 << 16, size=(3000, 1500), dtype=np.uint16).view(BF16)}
    with driftless.Publisher(url, signing_key=private) as pub:
        assert pub.publish(0, tensors)["outcome"] == "anchor"
    _forge_anchor_root(url.removeprefix("file://"), 0, private)

    f = driftless.Follower(url, trusted_keys=[public])
    arrays = {n: np.zeros_like(a) for n, a in tensors.items()}
    with pytest.raises(driftless.CorruptError, match="weights root"):
        f.apply_to(arrays)
    assert f.applied_step is None


def test_a_bad_anchor_never_costs_the_arrays_their_verified_weights(file_bucket, keys):
    """Arrays holding verified step 1, and the only route to the newest step 3 is its anchor
    (the deltas' markers are gone). That anchor corrupt (one stored byte flipped, in a 48 MiB
    shard of three chunks), or signed with a root that is not its bytes': each is refused
    with the arrays still bit for bit step 1 and still tracked as step 1; the call returns
    "up_to_date" at step 1 and names the refused step, as the agent does. A refused step is
    not downloaded again within refuse_for (the object removed: no error). The genuine anchor
    loads into arrays that hold a verified step (the checked route) bit for bit."""
    url, _ = file_bucket
    root = url.removeprefix("file://")
    private, public = keys
    shape = (4096, 6144)
    steps = bit_chain(11, shape, 3)
    with driftless.Publisher(url, signing_key=private, anchor_every=3) as pub:
        outcomes = []
        for s, x in enumerate(steps):
            if s == 3:
                pub.flush()  # an anchor is not started while one is still encoding
            outcomes.append(pub.publish(s, {"x.w": x.view(BF16)})["outcome"])
    assert outcomes == ["anchor", "delta", "delta", "delta_and_anchor"], outcomes
    f = driftless.Follower(url, trusted_keys=[public])
    arrays = {"x.w": np.zeros(shape, BF16)}
    assert f.apply_to(arrays, step=1)["step"] == 1
    delta_markers = {s: open(os.path.join(root, "ready", "deltas", f"{s:012d}"), "rb").read() for s in (2, 3)}
    for s in (2, 3):
        os.remove(os.path.join(root, "ready", "deltas", f"{s:012d}"))
    adir = os.path.join(root, "anchors", f"{3:012d}")
    obj = max((os.path.join(adir, n) for n in os.listdir(adir)), key=os.path.getsize)
    good = open(obj, "rb").read()
    assert len(good) > 40 << 20
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x5A
    open(obj, "wb").write(bytes(bad))

    def kept_step_1(f, arrays, o, reason):
        assert (o["step"], o["route"]) == (1, "up_to_date"), o
        assert [(k, s) for k, s, _ in o["refused"]] == [("anchor", 3)], o
        assert reason in o["refused"][0][2], o
        assert np.array_equal(bits(arrays["x.w"]), steps[1]), "the verified arrays were written"
        assert f.applied_step == 1

    kept_step_1(f, arrays, f.apply_to(arrays), "does not match its manifest")
    # Refused for refuse_for: not fetched again (gone, it would be a RetryableError).
    os.remove(obj)
    kept_step_1(f, arrays, f.apply_to(arrays), "does not match its manifest")
    open(obj, "wb").write(good)
    # Signed with a root that is not its bytes': refused for its root (another Follower: f
    # keeps the marker it read, markers being write-once).
    h = driftless.Follower(url, trusted_keys=[public])
    theirs = {"x.w": np.zeros(shape, BF16)}
    assert h.apply_to(theirs, step=1)["step"] == 1
    manifests = {n: open(os.path.join(adir, n), "rb").read() for n in os.listdir(adir) if "manifest" in n}
    marker_path = os.path.join(root, "ready", "anchors", f"{3:012d}")
    marker = open(marker_path, "rb").read()
    _forge_anchor_root(root, 3, private)
    kept_step_1(h, theirs, h.apply_to(theirs), "weights root")
    # The genuine anchor back, and a Follower whose arrays hold verified step 1: the anchor is
    # proven, then written.
    for n, b in manifests.items():
        open(os.path.join(adir, n), "wb").write(b)
    open(marker_path, "wb").write(marker)
    g = driftless.Follower(url, trusted_keys=[public])
    mine = {"x.w": np.zeros(shape, BF16)}
    assert g.apply_to(mine, step=1)["step"] == 1
    o = g.apply_to(mine)
    assert (o["step"], o["route"], o["refused"]) == (3, "anchor", []), o
    assert np.array_equal(bits(mine["x.w"]), steps[3])
    # The proving spool (TMPDIR, the decoded anchor) went with the calls that made it.
    mine_spools = [n for n in os.listdir(tempfile.gettempdir()) if "driftless-spool-" in n and f"-{os.getpid()}-" in n]
    assert mine_spools == [], mine_spools
    # With the deltas back, the refused Follower moves on by them (the anchor is still
    # refused). latest.json did not change, so, as for the agent, it is the listing of every
    # 10th call that finds them (not every call: a Follower up to date does not list).
    for s, b in delta_markers.items():
        open(os.path.join(root, "ready", "deltas", f"{s:012d}"), "wb").write(b)
    got = [f.apply_to(arrays) for _ in range(10)]
    moved = [o for o in got if o["step"] == 3]
    assert moved and moved[0]["route"] == "catchup", got
    assert np.array_equal(bits(arrays["x.w"]), steps[3])


def test_a_bad_delta_in_a_chain_is_refused_before_any_write(file_bucket, keys):
    """Arrays at verified step 1, deltas 2 and 3 ready, delta 3's object corrupt: the whole
    chain is checked before the first write, so delta 3 is refused with nothing written and
    the next best route (delta 2 alone) taken; the arrays are bit for bit step 2."""
    url, _ = file_bucket
    root = url.removeprefix("file://")
    private, public = keys
    steps = bit_chain(5, (512, 512), 3)
    with driftless.Publisher(url, signing_key=private, anchor_every=100) as pub:
        for s, x in enumerate(steps):
            pub.publish(s, {"x.w": x.view(BF16)})
    # chain_memory=0: the checked chain waits in the TMPDIR spool.
    f = driftless.Follower(url, trusted_keys=[public], chain_memory=0)
    arrays = {"x.w": np.zeros((512, 512), BF16)}
    assert f.apply_to(arrays, step=1)["step"] == 1
    obj, good = flip_largest_object(root, "deltas", 3)
    o = f.apply_to(arrays)
    assert (o["step"], o["route"]) == (2, "fast"), o
    assert [(k, s) for k, s, _ in o["refused"]] == [("delta", 3)], o
    assert np.array_equal(bits(arrays["x.w"]), steps[2])
    assert f.applied_step == 2
    # Repaired: the refused delta's marker is read again, and the chain applies from the spool.
    open(obj, "wb").write(bytes(good))
    g = driftless.Follower(url, trusted_keys=[public], chain_memory=0)
    theirs = {"x.w": np.zeros((512, 512), BF16)}
    assert g.apply_to(theirs, step=1)["step"] == 1
    o = g.apply_to(theirs)
    assert (o["step"], o["route"], o["deltas"]) == (3, "catchup", 2), o
    assert np.array_equal(bits(theirs["x.w"]), steps[3])


def test_an_object_larger_than_its_manifest_says_is_a_bad_step(file_bucket, keys):
    """Delta 3's segment 100 bytes longer than its signed size: the step is refused like a
    corrupt one and the next route taken (found by review: the Follower raised a plain
    DriftlessError at every call while the agent moved on)."""
    url, _ = file_bucket
    root = url.removeprefix("file://")
    private, public = keys
    steps = bit_chain(6, (512, 512), 3)
    with driftless.Publisher(url, signing_key=private, anchor_every=100) as pub:
        for s, x in enumerate(steps):
            pub.publish(s, {"x.w": x.view(BF16)})
    f = driftless.Follower(url, trusted_keys=[public])
    arrays = {"x.w": np.zeros((512, 512), BF16)}
    assert f.apply_to(arrays, step=1)["step"] == 1
    d = os.path.join(root, "deltas", f"{3:012d}")
    seg = max((os.path.join(d, n) for n in os.listdir(d) if "manifest" not in n), key=os.path.getsize)
    with open(seg, "ab") as fh:
        fh.write(b"\0" * 100)
    o = f.apply_to(arrays)
    assert (o["step"], o["route"]) == (2, "fast"), o
    assert [(k, s) for k, s, _ in o["refused"]] == [("delta", 3)], o
    assert np.array_equal(bits(arrays["x.w"]), steps[2])


def test_a_follower_one_step_behind_plans_from_latest_json_alone(file_bucket, keys):
    """A Follower on step 2 with delta 3 announced reads only the signed latest.json, delta 3's
    manifest and its segments: with stream.json and every ready marker out of the bucket it
    still reaches step 3 bit for bit, then stays up to date, and poll() names step 3. A
    latest.json that is not a valid signed hint is never trusted: the markers decide."""
    url, _ = file_bucket
    root = url.removeprefix("file://")
    private, public = keys
    steps = bit_chain(9, (256, 256), 4)
    with driftless.Publisher(url, signing_key=private, anchor_every=100) as pub:
        for s in range(4):
            pub.publish(s, {"x.w": steps[s].view(BF16)})
        pub.flush()
        f = driftless.Follower(url, trusted_keys=[public])
        arrays = {"x.w": np.zeros((256, 256), BF16)}
        assert f.apply_to(arrays, step=2)["step"] == 2
        hidden = [os.path.join(root, "stream.json"), os.path.join(root, "ready")]
        for p in hidden:
            os.rename(p, p + ".hidden")
        try:
            # Without the hint there is nothing to plan from: the hiding is real.
            cold = {"x.w": np.zeros((256, 256), BF16)}
            with pytest.raises(driftless.NothingReadyError):
                driftless.Follower(url, trusted_keys=[public]).apply_to(cold)
            o = f.apply_to(arrays)
            assert (o["step"], o["route"], o["deltas"]) == (3, "fast", 1), o
            assert np.array_equal(bits(arrays["x.w"]), steps[3])
            o = f.apply_to(arrays)
            assert (o["step"], o["route"], o["bytes"]) == (3, "up_to_date", 0), o
        finally:
            for p in hidden:
                os.rename(p + ".hidden", p)
        assert f.poll() == 3
        pub.publish(4, {"x.w": steps[4].view(BF16)})
        pub.flush()
    # A latest.json that does not open with a trusted key is ignored, not followed.
    latest = os.path.join(root, "latest.json")
    open(latest, "wb").write(b'{"kind": "latest", "stream_id": "x", "delta": 99}')
    o = f.apply_to(arrays)
    assert (o["step"], o["route"]) == (4, "fast"), o
    assert np.array_equal(bits(arrays["x.w"]), steps[4])
    assert f.poll() == 4


def test_a_bad_delta_in_a_chain_costs_the_patch_mirror_nothing(file_bucket, keys):
    """iter_patches' host mirror at verified step 1, deltas 2 and 3 ready, delta 3 corrupt:
    the chain is checked before the mirror is touched, so delta 3 is refused and the patches
    of step 2 alone are yielded (positions, not whole tensors: the mirror was kept)."""
    url, _ = file_bucket
    root = url.removeprefix("file://")
    private, public = keys
    steps = bit_chain(14, (256, 256), 3)
    with driftless.Publisher(url, signing_key=private, anchor_every=100) as pub:
        for s, x in enumerate(steps):
            pub.publish(s, {"x.w": x.view(BF16)})
    f = driftless.Follower(url, trusted_keys=[public])
    gpu = np.zeros(256 * 256, np.uint16)
    for name, pos, vals in f.iter_patches(step=1):
        gpu[:] = vals.reshape(-1)
    flip_largest_object(root, "deltas", 3)
    patches = list(f.iter_patches())
    assert patches and all(pos is not None for _, pos, _ in patches), "the mirror was reloaded"
    for name, pos, vals in patches:
        gpu[pos] = vals
    assert f.patch_step == 2
    assert np.array_equal(gpu.reshape(256, 256), steps[2])


def test_a_tensor_changed_past_an_eighth_along_a_route_is_patched_whole(file_bucket, keys):
    """Positions are kept for at most an eighth of a tensor's elements along one route (8
    bytes each; found by review: a dense step of a 7B model meant about 56 GB of them). "a"
    changes wholly at step 1 and "c" 7% at each of steps 1 and 2: from step 0, "a" and "c" come
    whole, "b" (1% per step) as positions; from step 1, "c" (7%) as positions again. The engine
    ends bit for bit at each step."""
    url, _ = file_bucket
    private, public = keys
    rng = np.random.default_rng(17)
    n = 128 * 128
    a, b, c = (bit_chain(s, (128, 128), 2) for s in (18, 19, 20))
    a[1] = a[0] ^ 1
    a[2] = a[1].copy()
    for s in (1, 2):
        c[s] = c[s - 1].copy()
        c[s].flat[rng.choice(n, n * 7 // 100, replace=False)] ^= 1
    with driftless.Publisher(url, signing_key=private, anchor_every=100) as pub:
        for s in range(3):
            pub.publish(s, {"a": a[s].view(BF16), "b": b[s].view(BF16), "c": c[s].view(BF16)})
    engine = {k: np.zeros(n, np.uint16) for k in "abc"}

    def scatter(f, step):
        kinds = {}
        for name, pos, vals in f.iter_patches(step=step):
            kinds[name] = pos is None
            if pos is None:
                engine[name][:] = vals.reshape(-1)
            else:
                assert len(pos) <= n // 8, (name, len(pos))
                engine[name][pos] = vals
        return kinds

    f = driftless.Follower(url, trusted_keys=[public])
    assert scatter(f, 0) == {"a": True, "b": True, "c": True}
    assert scatter(f, 2) == {"a": True, "b": False, "c": True}
    for k, x in (("a", a), ("b", b), ("c", c)):
        assert np.array_equal(engine[k], x[2].reshape(-1)), k
    g = driftless.Follower(url, trusted_keys=[public])
    scatter(g, 1)
    assert scatter(g, 2) == {"b": False, "c": False}
    for k, x in (("a", a), ("b", b), ("c", c)):
        assert np.array_equal(engine[k], x[2].reshape(-1)), k


def two_tensor_engine(url, keys, seeds, steps):
    """Publishes ``steps`` steps of two 128x128 BF16 chains ("a", "b") and returns the chains, a
    Follower, the engine's host arrays (uint16) and its scatter of one patch into them."""
    private, public = keys
    a, b = bit_chain(seeds[0], (128, 128), steps), bit_chain(seeds[1], (128, 128), steps)
    with driftless.Publisher(url, signing_key=private, anchor_every=100) as pub:
        for s in range(steps + 1):
            pub.publish(s, {"a": a[s].view(BF16), "b": b[s].view(BF16)})
    f = driftless.Follower(url, trusted_keys=[public])
    engine = {"a": np.zeros(128 * 128, np.uint16), "b": np.zeros(128 * 128, np.uint16)}

    def scatter(name, pos, vals):
        if pos is None:
            engine[name][:] = vals.reshape(-1)
        else:
            engine[name][pos] = vals

    return a, b, f, engine, scatter


def test_a_consumer_that_fails_part_way_gets_whole_tensors_next_time(file_bucket, keys):
    """Two tensors changed at step 1; the consumer's scatter raises on the second patch (a
    CUDA OOM). Found by review: the mirror had already moved to step 1, the next call yielded
    nothing, and the engine kept tensor a at step 1 and b at step 0. Now the next call yields
    both whole, and the engine ends bit for bit at step 1."""
    a, b, f, engine, scatter = two_tensor_engine(file_bucket[0], keys, (15, 16), 1)
    for patch in f.iter_patches(step=0):
        scatter(*patch)
    with pytest.raises(MemoryError):
        for n, (name, pos, vals) in enumerate(f.iter_patches(step=1)):
            if n == 1:
                raise MemoryError("CUDA out of memory")
            scatter(name, pos, vals)
    patches = list(f.iter_patches(step=1))
    assert sorted(name for name, _, _ in patches) == ["a", "b"]
    assert all(pos is None for _, pos, _ in patches), "whole tensors after a partial consumer"
    for patch in patches:
        scatter(*patch)
    assert f.patch_step == 1
    assert np.array_equal(engine["a"], a[1].reshape(-1)) and np.array_equal(engine["b"], b[1].reshape(-1))


def test_a_first_load_takes_the_next_route_after_a_bad_anchor(file_bucket, keys):
    """Arrays that hold nothing verified yet, newest anchor corrupt: the anchor is refused
    after it was streamed into them, and the same call goes on to the next best route (the
    older anchor and the deltas after it), bit for bit the newest step."""
    url, _ = file_bucket
    root = url.removeprefix("file://")
    private, public = keys
    steps = bit_chain(13, (512, 512), 5)
    with driftless.Publisher(url, signing_key=private, anchor_every=3) as pub:
        for s, x in enumerate(steps):
            pub.publish(s, {"x.w": x.view(BF16)})
            pub.flush()  # each step's anchor, if any, lands before the next step
    anchors = sorted(int(d) for d in os.listdir(os.path.join(root, "ready", "anchors")))
    assert anchors == [0, 3], anchors
    newest = anchors[-1]
    flip_largest_object(root, "anchors", newest)
    f = driftless.Follower(url, trusted_keys=[public])
    arrays = {"x.w": np.zeros((512, 512), BF16)}
    o = f.apply_to(arrays)
    # From anchor 0 and the five deltas after it; the refused anchor's route applies two.
    assert (o["step"], o["route"], o["deltas"]) == (5, "anchor", 5), o
    assert np.array_equal(bits(arrays["x.w"]), steps[5])
    assert f.applied_step == 5


def _publish_keeping_hints(url, private, steps, kw=None):
    """Publishes `steps` one by one; returns the bytes of latest.json after each step."""
    kw = kw or {}
    raw = Raw(url, kw)
    hints = []
    with driftless.Publisher(url, signing_key=private, anchor_every=100, **kw) as pub:
        for s, x in enumerate(steps):
            pub.publish(s, {"x.w": x.view(BF16)})
            pub.flush()
            hints.append(raw.read("latest.json"))
    return hints


# The hostile-hint tests run on every backend: on S3 the Follower's conditional GETs of a
# rewritten latest.json are answered by a real server (new ETag, or 404 once deleted).


def test_poll_takes_hints_of_its_own_stream_only_and_never_goes_back(bucket, keys):
    """poll() reads latest.json, but a validly signed hint of another stream (same key, another
    run) is not this stream's newest step, and a replayed older hint of this stream does not
    move the answer back."""
    url, kw = bucket
    private, public = keys
    ours, theirs = url + "-ours", url + "-theirs"
    raw = Raw(ours, kw)
    hints = _publish_keeping_hints(ours, private, bit_chain(21, (64, 64), 3), kw)
    foreign = _publish_keeping_hints(theirs, private, bit_chain(22, (64, 64), 9), kw)
    f = driftless.Follower(ours, trusted_keys=[public], **kw)
    assert f.poll() == 3
    raw.write("latest.json", foreign[-1])
    assert [f.poll() for _ in range(12)] == [3] * 12
    raw.write("latest.json", hints[1])
    assert [f.poll() for _ in range(12)] == [3] * 12
    g = driftless.Follower(ours, trusted_keys=[public], **kw)
    raw.write("latest.json", foreign[-1])
    assert g.poll() == 3
    # The prefix emptied for a new run whose hint writes failed: the markers answer.
    raw.delete_prefix()
    _publish_keeping_hints(ours, private, bit_chain(25, (64, 64), 1), kw)
    raw.delete("latest.json")
    assert f.poll() == 1


def test_a_stale_hint_delays_each_consumer_by_at_most_ten_calls(bucket, keys):
    """latest.json stuck on step 3 (a failed write, or a bucket answering 'not modified')
    while steps 4 and 5 are ready: apply_to and iter_patches, called in turn on one Follower,
    each list the markers within ten calls and reach step 5 bit for bit."""
    url, kw = bucket
    private, public = keys
    raw = Raw(url, kw)
    steps = bit_chain(23, (64, 64), 5)
    with driftless.Publisher(url, signing_key=private, anchor_every=100, **kw) as pub:
        for s in range(4):
            pub.publish(s, {"x.w": steps[s].view(BF16)})
        pub.flush()
        stuck = raw.read("latest.json")
        f = driftless.Follower(url, trusted_keys=[public], **kw)
        arrays = {"x.w": np.zeros((64, 64), BF16)}
        mirror = np.zeros(64 * 64, np.uint16)
        assert f.apply_to(arrays)["step"] == 3
        for name, pos, vals in f.iter_patches():
            mirror[:] = vals.reshape(-1)
        assert f.patch_step == 3
        for s in (4, 5):
            pub.publish(s, {"x.w": steps[s].view(BF16)})
        pub.flush()
    raw.write("latest.json", stuck)
    for _ in range(10):
        a = f.apply_to(arrays)["step"]
        for name, pos, vals in f.iter_patches():
            if pos is None:
                mirror[:] = vals.reshape(-1)
            else:
                mirror[pos] = vals
        if (a, f.patch_step) == (5, 5):
            break
    assert (f.applied_step, f.patch_step) == (5, 5)
    assert np.array_equal(bits(arrays["x.w"]), steps[5])
    assert np.array_equal(mirror.reshape(64, 64), steps[5])


def test_a_hint_naming_a_step_that_is_gone_is_refused_not_raised(bucket, keys):
    """latest.json names delta 3, whose marker and objects are gone (collected, or a hostile
    bucket): the Follower refuses it as missing, as the agent does, and stays up to date on
    step 2 at every call instead of raising. A deleted latest.json is no longer trusted: the
    next call lists and finds what is ready."""
    url, kw = bucket
    private, public = keys
    raw = Raw(url, kw)
    steps = bit_chain(24, (64, 64), 4)
    f = driftless.Follower(url, trusted_keys=[public], **kw)
    arrays = {"x.w": np.zeros((64, 64), BF16)}
    with driftless.Publisher(url, signing_key=private, anchor_every=100, **kw) as pub:
        for s in range(3):
            pub.publish(s, {"x.w": steps[s].view(BF16)})
        pub.flush()
        hint_2 = raw.read("latest.json")
        assert f.apply_to(arrays)["step"] == 2
        assert pub.publish(3, {"x.w": steps[3].view(BF16)})["outcome"] == "delta"
    raw.delete_prefix(f"deltas/{3:012d}/")
    raw.delete(f"ready/deltas/{3:012d}")
    for _ in range(12):
        o = f.apply_to(arrays)
        assert (o["step"], o["route"]) == (2, "up_to_date"), o
        assert [(k, s) for k, s, _ in o["refused"]] == [("delta", 3)], o
    assert np.array_equal(bits(arrays["x.w"]), steps[2])
    # A Follower whose held hint names its own step: a deleted latest.json is not "not
    # modified" (that would keep it up to date on step 2 until its 10th call).
    raw.write("latest.json", hint_2)
    g = driftless.Follower(url, trusted_keys=[public], **kw)
    theirs = {"x.w": np.zeros((64, 64), BF16)}
    assert g.apply_to(theirs)["step"] == 2
    assert g.apply_to(theirs)["route"] == "up_to_date"
    assert g.apply_to(theirs)["route"] == "up_to_date"
    with driftless.Publisher(url, signing_key=private, anchor_every=100, **kw) as pub:
        pub.publish(4, {"x.w": steps[4].view(BF16)})
    raw.delete("latest.json")
    o = g.apply_to(theirs)
    assert o["step"] == 4, o
    assert np.array_equal(bits(theirs["x.w"]), steps[4])


def test_a_new_run_at_the_same_prefix_replaces_the_old_runs_weights(tmp_path, keys):
    """Arrays verified at step 4 of one run; the prefix is emptied and a new run (a new stream)
    publishes steps 0-2 there. The old run's step is no base and not 'up to date' against the
    new stream: the next call loads the new run's step 2, bit for bit."""
    import shutil

    private, public = keys
    url = f"file://{tmp_path}/b"
    old = bit_chain(31, (64, 64), 4)
    _publish_keeping_hints(url, private, old)
    f = driftless.Follower(url, trusted_keys=[public])
    arrays = {"x.w": np.zeros((64, 64), BF16)}
    assert f.apply_to(arrays)["step"] == 4
    shutil.rmtree(tmp_path / "b")
    new = bit_chain(32, (64, 64), 2)
    _publish_keeping_hints(url, private, new)
    o = f.apply_to(arrays)
    assert (o["step"], o["route"]) == (2, "anchor"), o
    assert np.array_equal(bits(arrays["x.w"]), new[2])


def test_an_older_run_replayed_into_the_prefix_is_not_followed(tmp_path, keys):
    """Arrays verified at step 2 of a new run; the prefix is then put back as an older run left
    it (its signed stream.json and objects copied back, signed by the same key). The older run
    is refused ('an older run is not followed', as the agent refuses it): the arrays keep the
    new run's step 2, bit for bit. reset() follows it on purpose."""
    import shutil
    import time

    private, public = keys
    url = f"file://{tmp_path}/b"
    old = bit_chain(41, (64, 64), 4)
    _publish_keeping_hints(url, private, old)
    shutil.copytree(tmp_path / "b", tmp_path / "old")
    shutil.rmtree(tmp_path / "b")
    time.sleep(0.01)  # the new run's descriptor is created later
    new = bit_chain(42, (64, 64), 2)
    _publish_keeping_hints(url, private, new)
    f = driftless.Follower(url, trusted_keys=[public])
    arrays = {"x.w": np.zeros((64, 64), BF16)}
    assert f.apply_to(arrays)["step"] == 2
    shutil.rmtree(tmp_path / "b")
    shutil.copytree(tmp_path / "old", tmp_path / "b")
    for _ in range(2):
        with pytest.raises(driftless.CorruptError, match="an older run is not followed"):
            f.apply_to(arrays)
        assert f.applied_step == 2
        assert np.array_equal(bits(arrays["x.w"]), new[2])
    f.reset()
    o = f.apply_to(arrays)
    assert (o["step"], o["route"]) == (4, "anchor"), o
    assert np.array_equal(bits(arrays["x.w"]), old[4])


def test_a_step_signed_for_another_stream_is_refused(tmp_path, keys):
    """Two runs signed with one key: run B's anchor copied into run A's bucket as A's newest
    step (its marker rewritten to A's stream id) verifies against B's own root, but is B's.
    The Follower refuses it before touching the arrays, as the agent does."""
    import json
    import shutil

    private, public = keys
    a_root, b_root = tmp_path / "a", tmp_path / "b"
    rng = np.random.default_rng(3)
    shape = (256, 128)
    w = {"x.w": rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(BF16)}
    with driftless.Publisher(f"file://{a_root}", signing_key=private) as pub:
        pub.publish(0, w)
        w1 = {"x.w": (w["x.w"].view(np.uint16) ^ 1).view(BF16)}
        pub.publish(1, w1)
    other = {"x.w": rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(BF16)}
    with driftless.Publisher(f"file://{b_root}", signing_key=private) as pub:
        assert pub.publish(5, other)["outcome"] == "anchor"
    step = "000000000005"
    shutil.copytree(b_root / "anchors" / step, a_root / "anchors" / step)
    marker = json.loads((b_root / "ready" / "anchors" / step).read_text())
    a_marker = json.loads((a_root / "ready" / "anchors" / "000000000000").read_text())
    assert marker["stream_id"] != a_marker["stream_id"]
    marker["stream_id"] = a_marker["stream_id"]
    (a_root / "ready" / "anchors" / step).write_text(json.dumps(marker))

    f = driftless.Follower(f"file://{a_root}", trusted_keys=[public])
    arrays = {"x.w": np.zeros(shape, BF16)}
    with pytest.raises(driftless.CorruptError, match="another stream") as e:
        f.apply_to(arrays, step=5)
    assert f.applied_step is None
    assert not arrays["x.w"].view(np.uint16).any(), "nothing written into the arrays"
    assert not hasattr(e.value, "arrays_modified")
    # The newest step refused, the next best route is taken: the run's own step 1.
    o = f.apply_to(arrays)
    assert o["step"] == 1 and [(k, s) for k, s, _ in o["refused"]] == [("anchor", 5)], o
    assert "another stream" in o["refused"][0][2]
    assert np.array_equal(arrays["x.w"].view(np.uint16), w1["x.w"].view(np.uint16))


def test_new_arrays_at_a_verified_address_are_not_taken_for_its_step(file_bucket, keys):
    """apply_to tracks the arrays it verified by their objects, not by their addresses alone:
    new arrays over the same memory (a new view, or new arrays the allocator placed where
    freed ones were) are hashed once. Holding the verified step, they keep it (nothing
    downloaded); holding anything else, the step is loaded into them (it used to answer
    "up_to_date" over zeros)."""
    url, _ = file_bucket
    private, public = keys
    rng = np.random.default_rng(11)
    shape = (512, 256)
    w = {"x.w": rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(BF16)}
    with driftless.Publisher(url, signing_key=private) as pub:
        pub.publish(0, w)
    f = driftless.Follower(url, trusted_keys=[public])
    buf = bytearray(w["x.w"].nbytes)

    def fresh():
        return {"x.w": np.frombuffer(buf, dtype=BF16).reshape(shape)}

    assert f.apply_to(fresh())["route"] == "anchor"
    o = f.apply_to(fresh())
    assert (o["route"], o["bytes"], o["step"]) == ("up_to_date", 0, 0), o
    buf[:] = bytes(len(buf))
    arrays = fresh()
    o = f.apply_to(arrays)
    assert (o["route"], o["step"]) == ("anchor", 0), o
    assert np.array_equal(arrays["x.w"].view(np.uint16), w["x.w"].view(np.uint16))
    # The same objects again: tracked, up to date.
    assert f.apply_to(arrays)["route"] == "up_to_date"


def test_a_failed_call_on_other_arrays_keeps_the_verified_ones_tracked(file_bucket, keys):
    """A call on other arrays that fails before writing anything (here: a step that does not
    exist) leaves the arrays verified before tracked: the next call on them is up to date, with
    nothing downloaded (not an anchor reload, which a second fault could leave half done)."""
    url, _ = file_bucket
    private, public = keys
    rng = np.random.default_rng(12)
    w = {"x.w": rng.integers(0, 1 << 16, size=(256, 128), dtype=np.uint16).view(BF16)}
    with driftless.Publisher(url, signing_key=private) as pub:
        pub.publish(0, w)
    f = driftless.Follower(url, trusted_keys=[public])
    a = {"x.w": np.zeros((256, 128), BF16)}
    b = {"x.w": np.zeros((256, 128), BF16)}
    assert f.apply_to(a)["route"] == "anchor"
    with pytest.raises(driftless.NothingReadyError) as e:
        f.apply_to(b, step=99)
    assert not hasattr(e.value, "arrays_modified") and not b["x.w"].view(np.uint16).any()
    o = f.apply_to(a)
    assert (o["route"], o["bytes"], o["step"]) == ("up_to_date", 0, 0), o


def test_an_unparsable_key_under_ready_does_not_stop_a_cold_start(file_bucket, keys, tmp_path):
    # One key the store cannot parse (a non-UTF-8 name here; `//`, `.`, `..` on S3) fails
    # every listing of ready/: the planner shared with the agent plans from latest.json.
    url, kw = file_bucket
    private, public = keys
    tr = SimTrainer(seed=4)
    with driftless.Publisher(url, signing_key=private, anchor_every=5) as pub:
        for step in range(8):
            if step:
                tr.step()
            pub.publish(step, tr.bf16())
    root = url[len("file://"):]
    for d in ("ready/deltas", "ready/anchors"):
        with open(os.path.join(os.fsencode(root), os.fsencode(d), b"planted\xff"), "wb") as fh:
            fh.write(b"x")
    late = {n: np.zeros_like(a) for n, a in tr.bf16().items()}
    o = driftless.Follower(url, trusted_keys=[public]).apply_to(late)
    assert (o["step"], o["route"]) == (7, "anchor")
    for n, a in tr.bf16().items():
        assert np.array_equal(bits(late[n]), bits(a))
    o = driftless.Follower(url, trusted_keys=[public]).sync_dir(str(tmp_path / "dir"))
    assert o["step"] == 7
    # Without latest.json nothing plans around the key: the listing's error, nothing written.
    os.remove(os.path.join(root, "latest.json"))
    fresh = {n: np.zeros_like(a) for n, a in tr.bf16().items()}
    with pytest.raises(driftless.DriftlessError, match="invalid object key"):
        driftless.Follower(url, trusted_keys=[public]).apply_to(fresh)
    assert all(not a.any() for a in fresh.values())


def test_poll_answers_from_the_hint_while_the_store_refuses_listings(file_bucket, keys):
    # Found by review: poll() listed ready/ at every 10th call and raised the listing's error
    # while one planted key the store cannot parse failed every listing, although the signed
    # latest.json named the newest step. The hint answers, and a new step is still found.
    url, _ = file_bucket
    private, public = keys
    tr = SimTrainer(seed=5)
    root = url[len("file://"):]
    with driftless.Publisher(url, signing_key=private, anchor_every=50) as pub:
        for step in range(4):
            if step:
                tr.step()
            pub.publish(step, tr.bf16())
        pub.flush()
        for d in ("ready/deltas", "ready/anchors"):
            with open(os.path.join(os.fsencode(root), os.fsencode(d), b"planted\xff"), "wb") as fh:
                fh.write(b"x")
        f = driftless.Follower(url, trusted_keys=[public])
        assert [f.poll() for _ in range(45)] == [3] * 45
        tr.step()
        pub.publish(4, tr.bf16())
        pub.flush()
        assert f.poll() == 4
    late = {n: np.zeros_like(a) for n, a in tr.bf16().items()}
    assert f.apply_to(late)["step"] == 4
    for n, a in tr.bf16().items():
        assert np.array_equal(bits(late[n]), bits(a))
    # Without latest.json the listing alone could answer, and it fails: its error, each poll.
    os.remove(os.path.join(root, "latest.json"))
    g = driftless.Follower(url, trusted_keys=[public])
    with pytest.raises(driftless.DriftlessError, match="invalid object key"):
        g.poll()


def test_sync_dir_raises_corrupt_error_for_a_corrupt_anchor(file_bucket, keys, tmp_path, monkeypatch):
    # sync_dir raised a plain DriftlessError where apply_to raises CorruptError (found by review).
    url, _ = file_bucket
    private, public = keys
    tr = SimTrainer(seed=6)
    with driftless.Publisher(url, signing_key=private) as pub:
        pub.publish(0, tr.bf16())
    flip_largest_object(url.removeprefix("file://"), "anchors", 0)
    with pytest.raises(driftless.CorruptError):
        driftless.Follower(url, trusted_keys=[public]).sync_dir(str(tmp_path / "d"))
    # An http:// endpoint means plain HTTP, as for the CLI: no "URL scheme is not allowed"
    # error that looked temporary (nothing listens on port 9: a connection error).
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.delenv("AWS_ALLOW_HTTP", raising=False)
    f = driftless.Follower("s3://b/p", trusted_keys=[public], endpoint="http://127.0.0.1:9", max_retries=0)
    with pytest.raises(driftless.RetryableError) as e:
        f.poll()
    assert "scheme" not in str(e.value), e.value


def test_ctrl_c_interrupts_a_poll_of_a_bucket_that_hangs(keys, monkeypatch):
    # A poll waited out the whole retry budget (60 s and more) on a bucket that accepts
    # connections and never answers, Ctrl-C or not (found by review).
    import signal
    import socket
    import threading
    import time

    _, public = keys
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held = []
    threading.Thread(target=lambda: [held.append(srv.accept()) for _ in range(16)], daemon=True).start()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    f = driftless.Follower(
        "s3://b/p", trusted_keys=[public], endpoint=f"http://127.0.0.1:{srv.getsockname()[1]}"
    )
    # Python leaves SIGINT ignored when it started ignored (a job started in the background by
    # a non-interactive shell, as CI may be): install the handler Ctrl-C has in a terminal.
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    t = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            f.poll()
    finally:
        took = time.monotonic() - t
        timer.join()
        signal.signal(signal.SIGINT, old)
    srv.close()
    assert 0.9 < took < 5, took


def test_planted_markers_do_not_stop_a_cold_apply_to(file_bucket, keys):
    # Found by review: 40 ready markers planted above the real newest step (the stream's id,
    # a manifest that does not exist) used up the 32 attempts of one call, and a cold
    # apply_to failed; they are refused from their manifests alone, on a budget of their own.
    url, kw = file_bucket
    private, public = keys
    tr = SimTrainer(seed=9)
    with driftless.Publisher(url, signing_key=private, anchor_every=5) as pub:
        for step in range(3):
            if step:
                tr.step()
            pub.publish(step, tr.bf16())
    root = url[len("file://"):]
    with open(os.path.join(root, "ready/anchors", f"{0:012d}")) as fh:
        sid = json.load(fh)["stream_id"]
    for s in range(100, 140):
        m = {"kind": "ready", "stream_id": sid, "of": "anchor", "step": s, "manifest_sha256": "00" * 32,
             "payload_bytes": 10, "manifest": "g1-manifest.json"}
        with open(os.path.join(root, "ready/anchors", f"{s:012d}"), "w") as fh:
            json.dump(m, fh)
    late = {n: np.zeros_like(a) for n, a in tr.bf16().items()}
    o = driftless.Follower(url, trusted_keys=[public]).apply_to(late)
    assert (o["step"], o["route"]) == (2, "anchor"), o
    for n, a in tr.bf16().items():
        assert np.array_equal(bits(late[n]), bits(a))


def test_poll_does_not_count_junk_or_foreign_markers(file_bucket, keys, tmp_path):
    """poll() answers from ready markers that parse, belong to this stream and name a manifest
    that passes the agents' check (found by review: it took the newest key under ready/, so
    one junk key planted at step 999,999 made poll() name a step that never existed, for
    good). Each marker is read once."""
    url, _ = file_bucket
    root = url.removeprefix("file://")
    private, public = keys
    other = f"file://{tmp_path}/other"
    for u, seed, n in ((other, 46, 7), (url, 47, 3)):
        with driftless.Publisher(u, signing_key=private, anchor_every=100) as pub:
            for s, x in enumerate(bit_chain(seed, (64, 64), n)):
                pub.publish(s, {"x.w": x.view(BF16)})
    # No latest.json: the listing answers at every change.
    os.remove(os.path.join(root, "latest.json"))
    f = driftless.Follower(url, trusted_keys=[public])
    assert f.poll() == 3
    for kind, s in (("deltas", 999_999), ("anchors", 888_888), ("deltas", 5000)):
        with open(os.path.join(root, "ready", kind, f"{s:012d}"), "wb") as fh:
            fh.write(b"\x00junk" * 10)
    # Well-formed markers with this stream's id (markers are not signed), naming a manifest
    # that is not there, or one that is junk under the SHA-256 they name.
    with open(os.path.join(root, "ready", "anchors", f"{0:012d}")) as fh:
        sid = json.load(fh)["stream_id"]
    junk = b"junk, not a manifest"
    for s, sha in ((7000, "00" * 32), (7001, hashlib.sha256(junk).hexdigest())):
        m = {"kind": "ready", "stream_id": sid, "of": "delta", "step": s, "base_step": 3,
             "manifest_sha256": sha, "payload_bytes": 10, "manifest": "g1-manifest.json"}
        os.makedirs(os.path.join(root, "deltas", f"{s:012d}"), exist_ok=True)
        with open(os.path.join(root, "deltas", f"{s:012d}", "g1-manifest.json"), "wb") as fh:
            fh.write(junk)
        with open(os.path.join(root, "ready", "deltas", f"{s:012d}"), "w") as fh:
            json.dump(m, fh)
    # Another stream's real markers, at their own step numbers (a copied-in run).
    theirs = os.path.join(tmp_path, "other", "ready", "deltas")
    above = [n for n in os.listdir(theirs) if int(n) > 3]
    assert above
    for n in above:
        shutil.copy(os.path.join(theirs, n), os.path.join(root, "ready", "deltas", n))
    assert [f.poll() for _ in range(12)] == [3] * 12
    # A fresh Follower (its first poll lists) agrees.
    assert driftless.Follower(url, trusted_keys=[public]).poll() == 3
    # More junk than one poll reads (4,096): the answer stands until the polls after have
    # read past it; a fresh Follower, with no answer to stand on, says "not ready" (retryable)
    # once, then answers.
    for s in range(10_000, 14_200):
        with open(os.path.join(root, "ready", "anchors", f"{s:012d}"), "wb") as fh:
            fh.write(b"junk")
    assert [f.poll() for _ in range(12)] == [3] * 12
    g = driftless.Follower(url, trusted_keys=[public])
    with pytest.raises(driftless.NothingReadyError, match="junk"):
        g.poll()
    assert g.poll() == 3


def test_a_plan_for_the_local_step_does_not_hide_newer_steps(file_bucket, keys):
    """apply_to(step=local) on arrays already at local, then apply_to(): the second call moves
    on to the newest step at once (found by review: the first was remembered as "up to date"
    and, with a latest.json the hint could not plan from, the second said so too)."""
    url, _ = file_bucket
    private, public = keys
    steps = bit_chain(48, (64, 64), 3)
    with driftless.Publisher(url, signing_key=private, anchor_every=100) as pub:
        for s, x in enumerate(steps):
            pub.publish(s, {"x.w": x.view(BF16)})
            pub.flush()
    f = driftless.Follower(url, trusted_keys=[public])
    arrays = {"x.w": np.zeros((64, 64), BF16)}
    assert f.apply_to(arrays, step=1)["step"] == 1
    assert f.apply_to(arrays, step=1)["route"] == "up_to_date"
    o = f.apply_to(arrays)
    assert (o["step"], o["route"]) == (3, "catchup"), o
    assert np.array_equal(bits(arrays["x.w"]), steps[3])


def test_an_unfinished_delivery_is_yielded_whole_next_time(file_bucket, keys):
    """The mirror moves to a step before its patches reach the consumer. A delivery left
    unfinished (a first iterator kept part way while a second one starts, an interrupt between
    the native call and the first patch) leaves patch_step None, and the next call yields every
    tensor whole, bit for bit at its step, even when up to date (found by review: it yielded
    nothing, and the engine kept half a step for good). A stale iterator cannot take a tensor
    of a later delivery."""
    a, b, f, engine, scatter = two_tensor_engine(file_bucket[0], keys, (21, 22), 2)
    for patch in f.iter_patches(step=0):
        scatter(*patch)
    assert f.patch_step == 0
    first = f.iter_patches(step=1)
    scatter(*next(first))
    assert f.patch_step is None, "part of step 1 taken"
    patches = list(f.iter_patches(step=1))
    assert sorted(name for name, _, _ in patches) == ["a", "b"]
    assert all(pos is None for _, pos, _ in patches), "whole tensors after an unfinished delivery"
    for patch in patches:
        scatter(*patch)
    assert f.patch_step == 1
    with pytest.raises(driftless.InvalidInputError, match="moved the host mirror"):
        for patch in first:
            scatter(*patch)
    assert f.patch_step == 1, "a stale iterator changes nothing"
    assert np.array_equal(engine["a"], a[1].reshape(-1)) and np.array_equal(engine["b"], b[1].reshape(-1))

    native = f._patches

    def interrupted(step=None):
        native(step)
        raise KeyboardInterrupt

    f._patches = interrupted
    with pytest.raises(KeyboardInterrupt):
        list(f.iter_patches(step=2))
    del f._patches
    assert f.patch_step is None
    patches = list(f.iter_patches())
    assert sorted(name for name, _, _ in patches) == ["a", "b"]
    assert all(pos is None for _, pos, _ in patches), "up to date, the unfinished delivery yielded whole"
    for patch in patches:
        scatter(*patch)
    assert f.patch_step == 2
    assert np.array_equal(engine["a"], a[2].reshape(-1)) and np.array_equal(engine["b"], b[2].reshape(-1))
    assert list(f.iter_patches()) == []


def test_whole_tensors_are_copied_out_of_the_mirror_one_at_a_time(file_bucket, keys):
    """A first iter_patches yields every tensor whole; each is copied out of the mirror when
    the loop reaches it (found by review: all of them were copied up front, twice, so a first
    call held three copies of the model in host memory). 16 tensors of 1 MiB: the Python heap
    (tracemalloc, which sees every bytes object) peaks at a few tensors, not 16."""
    import tracemalloc

    url, _ = file_bucket
    private, public = keys
    rng = np.random.default_rng(5)
    weights = {f"t{i}": rng.integers(0, 1 << 16, size=(512, 1024), dtype=np.uint16) for i in range(16)}
    with driftless.Publisher(url, signing_key=private) as pub:
        pub.publish(0, {n: w.view(BF16) for n, w in weights.items()})
    f = driftless.Follower(url, trusted_keys=[public])
    tracemalloc.start()
    try:
        seen = {}
        for name, pos, vals in f.iter_patches():
            assert pos is None
            seen[name] = hashlib.sha256(vals.tobytes()).hexdigest()
            del vals
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seen == {n: hashlib.sha256(w.tobytes()).hexdigest() for n, w in weights.items()}
    assert peak < 6 << 20, f"the Python heap peaked at {peak} bytes for 16 MiB of tensors"


def test_a_bad_anchor_costs_the_patch_mirror_nothing(file_bucket, keys):
    """The mirror at verified step 1, and the only route to step 3 its anchor, corrupt: the
    anchor is refused, nothing is yielded and the mirror stays on step 1 (found by review: the
    mirror was replaced before the anchor was streamed, so the call raised CorruptError and
    the next one re-sent the whole model). The anchor repaired and its refusal run out, the
    step arrives whole, bit for bit."""
    url, _ = file_bucket
    root = url.removeprefix("file://")
    private, public = keys
    steps = bit_chain(23, (256, 256), 3)
    with driftless.Publisher(url, signing_key=private, anchor_every=3) as pub:
        for s, x in enumerate(steps):
            if s == 3:
                pub.flush()
            pub.publish(s, {"x.w": x.view(BF16)})
    f = driftless.Follower(url, trusted_keys=[public], refuse_for=0.5)
    gpu = np.zeros(256 * 256, np.uint16)
    for name, pos, vals in f.iter_patches(step=1):
        gpu[:] = vals.reshape(-1)
    assert f.patch_step == 1
    for s in (2, 3):
        os.remove(os.path.join(root, "ready", "deltas", f"{s:012d}"))
    obj, good = flip_largest_object(root, "anchors", 3)
    assert list(f.iter_patches()) == []
    assert f.patch_step == 1
    assert list(f.iter_patches()) == [], "refused: not fetched again"
    open(obj, "wb").write(good)
    import time

    # The refusal runs out (0.5 s, doubled per repeat): until then nothing, the mirror kept.
    deadline = time.monotonic() + 10
    while True:
        time.sleep(0.1)
        patches = list(f.iter_patches())
        if patches or time.monotonic() > deadline:
            break
        assert f.patch_step == 1
    assert [(n, p) for n, p, _ in patches] == [("x.w", None)]
    gpu[:] = patches[0][2].reshape(-1)
    assert f.patch_step == 3
    assert np.array_equal(gpu.reshape(256, 256), steps[3])


def test_a_step_whose_objects_are_missing_stays_retryable_while_left_out(file_bucket, keys):
    """The only anchor's shard is gone (a lifecycle rule, a GC race): every call raises
    RetryableError, also while the step is left out of plans (found by review: the calls
    within refuse_for raised CorruptError, "failed verification")."""
    url, _ = file_bucket
    root = url.removeprefix("file://")
    private, public = keys
    x = bit_chain(24, (256, 256), 0)[0]
    with driftless.Publisher(url, signing_key=private) as pub:
        pub.publish(0, {"x.w": x.view(BF16)})
    adir = os.path.join(root, "anchors", f"{0:012d}")
    for n in os.listdir(adir):
        if "manifest" not in n:
            os.remove(os.path.join(adir, n))
    f = driftless.Follower(url, trusted_keys=[public])
    for _ in range(3):
        with pytest.raises(driftless.RetryableError) as e:
            f.apply_to({"x.w": np.zeros((256, 256), BF16)})
        assert not isinstance(e.value, driftless.CorruptError), e.value


def test_a_layout_change_is_refused_from_its_manifest_alone(file_bucket):
    """Arrays cannot follow a change of the tensor set: the call says so from the delta's
    manifest, before any segment is downloaded (found by review: the segments, possibly a
    large new tensor, were downloaded at every call). The segments removed, the call still
    raises LayoutChangedError."""
    url, _ = file_bucket
    root = url.removeprefix("file://")
    a = np.arange(1000, dtype=np.float32).astype(BF16)
    f = driftless.Follower(url, allow_unsigned=True)
    with driftless.Publisher(url) as pub:
        pub.publish(0, {"a": a})
        pub.flush()
        arrays = {"a": np.zeros_like(a)}
        f.apply_to(arrays)
        assert pub.publish(1, {"a": a, "c": np.full(7, 3, np.int32)})["outcome"] in ("delta", "delta_and_anchor")
    ddir = os.path.join(root, "deltas", f"{1:012d}")
    segments = [n for n in os.listdir(ddir) if "manifest" not in n]
    assert segments
    for n in segments:
        os.remove(os.path.join(ddir, n))
    for _ in range(2):
        with pytest.raises(driftless.LayoutChangedError):
            f.apply_to(arrays)


def test_a_step_signed_by_an_untrusted_key_is_untrusted_while_refused(tmp_path, keys):
    """Run B, signed with a key the follower does not trust, has its delta 2 copied into run
    A's bucket (marker rewritten to A's stream id). The Follower raises UntrustedError for it,
    on the call that finds it bad and on the calls that find it still refused (found by review:
    the refusal was reported as CorruptError, "failed verification", from the second call on,
    and the agent's Python class was picked from the refusal's text)."""
    import json
    import shutil

    private, public = keys
    other_private, _, _ = driftless.generate_key()
    a_root, b_root = tmp_path / "a", tmp_path / "b"
    rng = np.random.default_rng(5)
    shape = (128, 64)
    w0 = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    steps = [w0, w0 ^ 1, w0 ^ 3]
    with driftless.Publisher(f"file://{a_root}", signing_key=private) as pub:
        for s in (0, 1):
            pub.publish(s, {"x.w": steps[s].view(BF16)})
    with driftless.Publisher(f"file://{b_root}", signing_key=other_private) as pub:
        for s in (0, 1, 2):
            pub.publish(s, {"x.w": steps[s].view(BF16)})
    step = "000000000002"
    shutil.copytree(b_root / "deltas" / step, a_root / "deltas" / step)
    marker = json.loads((b_root / "ready" / "deltas" / step).read_text())
    a_marker = json.loads((a_root / "ready" / "deltas" / "000000000001").read_text())
    marker["stream_id"] = a_marker["stream_id"]
    (a_root / "ready" / "deltas" / step).write_text(json.dumps(marker))

    f = driftless.Follower(f"file://{a_root}", trusted_keys=[public])
    arrays = {"x.w": np.zeros(shape, BF16)}
    assert f.apply_to(arrays, step=1)["step"] == 1
    for _ in range(2):
        with pytest.raises(driftless.UntrustedError):
            f.apply_to(arrays, step=2)
        assert f.applied_step == 1
        assert np.array_equal(arrays["x.w"].view(np.uint16), steps[1])
    o = f.apply_to(arrays)
    assert o["step"] == 1 and [(k, s) for k, s, _ in o["refused"]] == [("delta", 2)], o


def test_an_anchor_disagreeing_with_the_next_delta_is_the_one_refused(file_bucket, keys):
    """A cold load of anchor 0 and deltas 1-2, anchor 0 re-signed with a root that is not its
    bytes' (delta 1's base root disagrees with it). Which is wrong is only known once the
    anchor is hashed: the anchor is refused, never delta 1 (found by review: delta 1 was refused
    on a wrong base before the anchor was looked at, and the call raised WrongBaseError for
    delta 1, held for ``refuse_for``). The same for ``iter_patches``. Repaired, a Follower
    reaches step 2 through both, bit for bit."""
    import shutil

    url, _ = file_bucket
    root = url.removeprefix("file://")
    private, public = keys
    shape = (256, 512)
    steps = _publish_bits(url, private, 13, shape, 2)
    saved = os.path.join(os.path.dirname(root), "saved")
    shutil.copytree(root, saved)
    _forge_anchor_root(root, 0, private)

    f = driftless.Follower(url, trusted_keys=[public])
    arrays = {"x.w": np.zeros(shape, BF16)}
    # The first call raises the anchor's own error, the next ones its refusal.
    with pytest.raises(driftless.CorruptError, match="weights root"):
        f.apply_to(arrays)
    assert f.applied_step is None
    with pytest.raises(driftless.CorruptError, match="anchor 0 is refused for now .*weights root"):
        f.apply_to(arrays)
    mirror = driftless.Follower(url, trusted_keys=[public])
    with pytest.raises(driftless.CorruptError, match="weights root"):
        list(mirror.iter_patches())
    with pytest.raises(driftless.CorruptError, match="anchor 0 is refused for now .*weights root"):
        list(mirror.iter_patches())
    assert mirror.patch_step is None
    for sub in ("ready/anchors", "anchors"):
        shutil.rmtree(os.path.join(root, sub))
        shutil.copytree(os.path.join(saved, sub), os.path.join(root, sub))
    f = driftless.Follower(url, trusted_keys=[public])
    o = f.apply_to(arrays)
    assert (o["step"], o["route"], o["deltas"], o["refused"]) == (2, "anchor", 2, []), o
    assert np.array_equal(bits(arrays["x.w"]), steps[2])
    mirror = driftless.Follower(url, trusted_keys=[public])
    got = {n: (pos, bits(np.array(v)).copy()) for n, pos, v in mirror.iter_patches()}
    assert got["x.w"][0] is None and np.array_equal(got["x.w"][1], steps[2])
    assert mirror.patch_step == 2


@pytest.mark.parametrize("field", ["base_root", "result_root"])
def test_a_bad_delta_after_a_good_anchor_is_the_one_refused(tmp_path, keys, field):
    """The other way round: anchor 0 as published, delta 1 re-signed with a base root that is
    not step 0's, or a result root that is not its result's (so delta 2's base disagrees with
    it). The careful retry hashes the anchor, finds it good, and names delta 1, never delta 2
    (found by review: delta 2 was refused, on a wrong base); the call then serves anchor 0
    alone, verified. The same for ``iter_patches``."""
    url = f"file://{tmp_path}/bucket"
    root = url.removeprefix("file://")
    private, public = keys
    shape = (256, 512)
    steps = _publish_bits(url, private, 14, shape, 2)
    _resign(root, "deltas", 1, private, lambda m: _another_root(m, field))
    f = driftless.Follower(url, trusted_keys=[public])
    arrays = {"x.w": np.zeros(shape, BF16)}
    o = f.apply_to(arrays)
    assert (o["step"], o["route"]) == (0, "anchor"), o
    assert [(k, s) for k, s, _ in o["refused"]] == [("delta", 1)], o
    assert ("wrong base" if field == "base_root" else "weights root") in o["refused"][0][2], o
    assert np.array_equal(bits(arrays["x.w"]), steps[0])
    cls = driftless.WrongBaseError if field == "base_root" else driftless.CorruptError
    with pytest.raises(cls, match="delta 1 is refused for now"):
        f.apply_to(arrays, step=1)
    mirror = driftless.Follower(url, trusted_keys=[public])
    got = {n: (pos, bits(np.array(v)).copy()) for n, pos, v in mirror.iter_patches()}
    assert got["x.w"][0] is None and np.array_equal(got["x.w"][1], steps[0])
    assert mirror.patch_step == 0


def test_a_warm_follower_refuses_the_bad_anchor_not_its_delta(file_bucket, keys):
    """Arrays holding verified step 1; the only route to step 4 is anchor 3 and delta 4 (the
    markers of deltas 2 and 3 gone), anchor 3 signed with a root that is not its bytes'. The
    careful retry proves the anchor in a spool before the arrays are touched: anchor 3 is
    refused, delta 4 is not, and the arrays stay bit for bit step 1 (found by review: delta 4
    was refused on a wrong base for a Follower whose arrays held verified weights)."""
    url, _ = file_bucket
    root = url.removeprefix("file://")
    private, public = keys
    shape = (256, 512)
    steps = _publish_bits(url, private, 15, shape, 4, anchor_every=3)
    assert sorted(os.listdir(os.path.join(root, "ready", "anchors"))) == [f"{s:012d}" for s in (0, 3)]
    f = driftless.Follower(url, trusted_keys=[public])
    arrays = {"x.w": np.zeros(shape, BF16)}
    assert f.apply_to(arrays, step=1)["step"] == 1
    for s in (2, 3):
        os.remove(os.path.join(root, "ready", "deltas", f"{s:012d}"))
    _forge_anchor_root(root, 3, private)
    o = f.apply_to(arrays)
    assert (o["step"], o["route"]) == (1, "up_to_date"), o
    assert [(k, s) for k, s, _ in o["refused"]] == [("anchor", 3)], o
    assert f.applied_step == 1
    assert np.array_equal(bits(arrays["x.w"]), steps[1])


def _copy_step(root, kind, step, to):
    """Saves (``to`` a new directory) or restores (from it) step ``step``'s manifest folder and
    marker."""
    name = f"{step:012d}"
    for sub in (kind, os.path.join("ready", kind)):
        src, dst = os.path.join(root, sub, name), os.path.join(to, sub, name)
        if os.path.isdir(src):
            shutil.copytree(src, dst)
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy(src, dst)


def _restore_step(root, kind, step, saved):
    name = f"{step:012d}"
    shutil.rmtree(os.path.join(root, kind, name))
    shutil.copytree(os.path.join(saved, kind, name), os.path.join(root, kind, name))
    shutil.copy(os.path.join(saved, "ready", kind, name), os.path.join(root, "ready", kind, name))


def test_a_delta_with_a_wrong_result_root_costs_held_weights_nothing(tmp_path, keys):
    """Arrays and the host mirror hold verified step 0; delta 1 is signed with a result root
    that is not its result's (a publisher bug, or a stolen key). The fast path applies it, the
    root does not verify, and the delta is taken back out: the arrays are step 0 again bit for
    bit and still tracked (no ``arrays_modified``), delta 1 is refused, the mirror is kept
    (found by review: the arrays were left untracked with nothing refused, the mirror
    dropped, and the next call reloaded the anchor into both). Once the step is repaired
    the fast path takes it, and the mirror yields sparse patches, not whole tensors."""
    url = f"file://{tmp_path}/bucket"
    root = url.removeprefix("file://")
    private, public = keys
    shape = (256, 512)
    steps = _publish_bits(url, private, 16, shape, 1)
    saved = str(tmp_path / "saved")
    _copy_step(root, "deltas", 1, saved)
    f = driftless.Follower(url, trusted_keys=[public], refuse_for=0.5)
    arrays = {"x.w": np.zeros(shape, BF16)}
    assert f.apply_to(arrays, step=0)["step"] == 0
    mirror = driftless.Follower(url, trusted_keys=[public], refuse_for=0.5)
    assert [n for n, _, _ in mirror.iter_patches(step=0)] == ["x.w"] and mirror.patch_step == 0
    _resign(root, "deltas", 1, private, lambda m: _another_root(m, "result_root"))
    # Up to date at step 0 with delta 1 refused; asked for step 1, its refusal is the error.
    o = f.apply_to(arrays)
    assert (o["step"], o["route"]) == (0, "up_to_date"), o
    assert [(k, s) for k, s, _ in o["refused"]] == [("delta", 1)] and "weights root" in o["refused"][0][2], o
    with pytest.raises(driftless.CorruptError, match="delta 1 is refused for now .*weights root") as e:
        f.apply_to(arrays, step=1)
    assert not hasattr(e.value, "arrays_modified")
    assert f.applied_step == 0
    assert np.array_equal(bits(arrays["x.w"]), steps[0])
    assert list(mirror.iter_patches()) == []
    with pytest.raises(driftless.CorruptError, match="delta 1 is refused for now .*weights root"):
        list(mirror.iter_patches(step=1))
    assert mirror.patch_step == 0
    _restore_step(root, "deltas", 1, saved)
    # Once the refusal runs out (it doubles on repeats: both manifests were refused).
    deadline = time.monotonic() + 10
    while (o := f.apply_to(arrays))["step"] == 0 and time.monotonic() < deadline:
        assert np.array_equal(bits(arrays["x.w"]), steps[0])
        time.sleep(0.1)
    assert (o["step"], o["route"], o["refused"]) == (1, "fast", []), o
    assert np.array_equal(bits(arrays["x.w"]), steps[1])
    while mirror.patch_step == 0 and time.monotonic() < deadline:
        got = [(n, pos, bits(np.array(v)).copy()) for n, pos, v in mirror.iter_patches()]
        time.sleep(0.1)
    assert mirror.patch_step == 1
    [(name, pos, vals)] = got
    changed = np.flatnonzero(steps[0].reshape(-1) != steps[1].reshape(-1))
    assert name == "x.w" and pos is not None, "a kept mirror yields the changed elements only"
    assert np.array_equal(np.asarray(pos), changed)
    assert np.array_equal(vals, steps[1].reshape(-1)[changed])


def test_a_catch_up_with_a_bad_last_delta_serves_the_good_one(tmp_path, keys):
    """Arrays and the mirror hold verified step 0; delta 2 of the chain 1, 2 is signed with a
    wrong result root. The final root fails, names neither delta, and the chain is taken back
    out; the careful retry checks delta 1's result, then delta 2's, takes them back out again
    and refuses delta 2; the call then serves step 1 by the fast path. Bit for bit, never
    untracked."""
    url = f"file://{tmp_path}/bucket"
    root = url.removeprefix("file://")
    private, public = keys
    shape = (256, 512)
    steps = _publish_bits(url, private, 17, shape, 2)
    f = driftless.Follower(url, trusted_keys=[public])
    arrays = {"x.w": np.zeros(shape, BF16)}
    assert f.apply_to(arrays, step=0)["step"] == 0
    mirror = driftless.Follower(url, trusted_keys=[public])
    list(mirror.iter_patches(step=0))
    _resign(root, "deltas", 2, private, lambda m: _another_root(m, "result_root"))
    o = f.apply_to(arrays)
    assert (o["step"], o["route"], o["deltas"]) == (1, "fast", 1), o
    assert [(k, s) for k, s, _ in o["refused"]] == [("delta", 2)], o
    assert f.applied_step == 1
    assert np.array_equal(bits(arrays["x.w"]), steps[1])
    got = [(n, pos, bits(np.array(v)).copy()) for n, pos, v in mirror.iter_patches()]
    assert mirror.patch_step == 1
    [(name, pos, vals)] = got
    assert pos is not None, "a kept mirror yields the changed elements only"
    flat = np.zeros(shape, np.uint16).reshape(-1)
    flat[:] = steps[0].reshape(-1)
    flat[np.asarray(pos)] = vals
    assert np.array_equal(flat, steps[1].reshape(-1))


def test_arrays_changed_by_the_caller_are_not_blamed_on_the_delta(tmp_path, keys):
    """Arrays verified at step 0, then one element changed by the caller in place. The good
    delta 1 applied onto them does not give its root; taken back out, they still do not hash to
    step 0, so they are the cause: nothing is refused, the error says the arrays were
    modified and the Follower no longer tracks them; the next call loads anchor 0 and delta 1
    into them, bit for bit."""
    url = f"file://{tmp_path}/bucket"
    private, public = keys
    shape = (256, 512)
    steps = _publish_bits(url, private, 18, shape, 1)
    f = driftless.Follower(url, trusted_keys=[public])
    arrays = {"x.w": np.zeros(shape, BF16)}
    assert f.apply_to(arrays, step=0)["step"] == 0
    arrays["x.w"].view(np.uint16).reshape(-1)[7] ^= 0x40
    with pytest.raises(driftless.CorruptError, match="weights root") as e:
        f.apply_to(arrays)
    assert e.value.arrays_modified is True
    assert f.applied_step is None
    o = f.apply_to(arrays)
    assert (o["step"], o["route"], o["refused"]) == (1, "anchor", []), o
    assert np.array_equal(bits(arrays["x.w"]), steps[1])
