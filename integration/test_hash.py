"""The Rust weights root equals the independent Python reference (integration/hash_reference.py).

The Rust side is `driftless hash PATH` (binary from $DRIFTLESS_BIN, default
target/debug/driftless), or any command given in $DRIFTLESS_HASH_CMD that takes the path as
its last argument and prints the hex root, for example:

    DRIFTLESS_HASH_CMD="cargo run -q -p driftless-format --example hash --" pytest integration/test_hash.py

Without either, and when target/debug/driftless does not exist, the example is used.
Needs: pytest numpy ml_dtypes safetensors.
"""

import json
import os
import shlex
import struct
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hash_reference  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The root of the worked example of schemas/weights-root.md, pinned once for Rust and Python.
with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "crates", "driftless-format", "tests", "example_root.txt")) as _f:
    EXAMPLE_ROOT = _f.read().strip()


def rust_cmd():
    cmd = os.environ.get("DRIFTLESS_HASH_CMD")
    if cmd:
        return shlex.split(cmd)
    binary = os.environ.get("DRIFTLESS_BIN", os.path.join(ROOT, "target", "debug", "driftless"))
    if os.path.exists(binary) or "DRIFTLESS_BIN" in os.environ:
        return [binary, "hash"]
    return ["cargo", "run", "-q", "-p", "driftless-format", "--example", "hash", "--"]


def rust_root(path):
    out = subprocess.run(rust_cmd() + [str(path)], cwd=ROOT, check=True, capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    assert lines, f"no output; stderr: {out.stderr}"
    return lines[-1].strip()


def specials(dtype_bits, width):
    """NaN payloads, -0.0, +-inf, subnormals, all ones as raw little-endian bytes."""
    return b"".join(struct.pack("<" + {1: "B", 2: "H", 4: "I", 8: "Q"}[width], v) for v in dtype_bits)


def mixed_tensors(seed=0):
    import ml_dtypes

    rng = np.random.default_rng(seed)
    t = {
        "model.embed.weight": rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16),
        "model.norm.weight": rng.standard_normal(8).astype(np.float32),
        "model.f16": rng.standard_normal((2, 3, 4)).astype(np.float16),
        "model.f64": rng.standard_normal(5).astype(np.float64),
        "model.fp8_e4m3": rng.standard_normal(7).astype(ml_dtypes.float8_e4m3fn),
        "model.fp8_e5m2": rng.standard_normal(7).astype(ml_dtypes.float8_e5m2),
        "model.mask": rng.integers(0, 2, 9).astype(np.bool_),
        "model.i8": rng.integers(-128, 127, 4, dtype=np.int8),
        "model.u8": rng.integers(0, 255, 4, dtype=np.uint8),
        "model.i16": rng.integers(-1000, 1000, 4, dtype=np.int16),
        "model.u16": rng.integers(0, 1000, 4, dtype=np.uint16),
        "model.i32": rng.integers(-(2**31), 2**31 - 1, 4, dtype=np.int32),
        "model.u32": rng.integers(0, 2**32 - 1, 4, dtype=np.uint32),
        "model.i64": rng.integers(-(2**62), 2**62, (2, 2), dtype=np.int64),
        "model.u64": rng.integers(0, 2**63, 3, dtype=np.uint64),
        "model.scalar": np.array(0.25, dtype=np.float32),
        "model.empty": np.zeros((0, 3), dtype=ml_dtypes.bfloat16),
        "ünïcode.name": np.arange(3, dtype=np.uint8),
    }
    # Special bit patterns must be hashed verbatim.
    t["model.bf16_specials"] = np.frombuffer(
        specials([0x7FC1, 0xFF81, 0x8000, 0x7F80, 0xFF80, 0x0001, 0xFFFF], 2), dtype=ml_dtypes.bfloat16
    )
    t["model.f32_specials"] = np.frombuffer(
        specials([0x7FC00001, 0x7F800001, 0x80000000, 0x7F800000, 0x00000001, 0xFFFFFFFF], 4), dtype=np.float32
    )
    return t


def write_safetensors(path, tensors, metadata=None):
    """Writes a safetensors file by hand (raw bytes), so no framework can touch the values."""
    names = {
        "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "bool": "BOOL",
        "int8": "I8", "uint8": "U8", "int16": "I16", "uint16": "U16", "float16": "F16",
        "int32": "I32", "uint32": "U32", "float32": "F32", "float64": "F64", "int64": "I64", "uint64": "U64",
    }
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    data = b""
    for name, a in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": names[a.dtype.name], "shape": list(a.shape), "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def test_example_from_spec(tmp_path):
    """The worked example of schemas/weights-root.md."""
    import ml_dtypes

    w = np.frombuffer(bytes([0x80, 0x3F, 0x00, 0xC0, 0x00, 0x80, 0xC1, 0x7F]), dtype=ml_dtypes.bfloat16).reshape(2, 2)
    p = tmp_path / "model.safetensors"
    write_safetensors(p, {"w": w, "bias": np.array(0.5, dtype=np.float32)}, {"format": "pt"})
    assert hash_reference.weights_root(str(p)) == EXAMPLE_ROOT
    assert rust_root(p) == EXAMPLE_ROOT


def test_mixed_dtypes_file(tmp_path):
    p = tmp_path / "mixed.safetensors"
    write_safetensors(p, mixed_tensors())
    want = hash_reference.weights_root(str(p))
    assert len(want) == 64
    assert rust_root(p) == want


def test_file_written_by_safetensors_package(tmp_path):
    from safetensors.numpy import save_file

    t = {k: v for k, v in mixed_tensors(1).items() if v.dtype.name not in ("bfloat16", "float8_e4m3fn", "float8_e5m2")}
    p = tmp_path / "model.safetensors"
    save_file(t, str(p), metadata={"format": "np"})
    assert rust_root(p) == hash_reference.weights_root(str(p))


def test_sharded_dir_equals_single_file(tmp_path):
    tensors = mixed_tensors(2)
    single = tmp_path / "single.safetensors"
    write_safetensors(single, tensors)
    d = tmp_path / "sharded"
    d.mkdir()
    names = sorted(tensors)
    shards = [names[::2], names[1::2]]
    weight_map = {}
    for i, part in enumerate(shards):
        f = f"model-{i + 1:05d}-of-00002.safetensors"
        # Reverse the order inside each file: the root must not care.
        write_safetensors(d / f, {n: tensors[n] for n in reversed(part)}, {"format": "pt"})
        weight_map.update({n: f for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    want = hash_reference.weights_root(str(single))
    assert hash_reference.weights_root(str(d)) == want
    assert rust_root(d) == want
    assert rust_root(single) == want


def test_multi_chunk_tensors(tmp_path):
    """Tensors of exactly one chunk, one byte over, one leaf and a byte, and several chunks
    with a short tail; the root changes when a byte changes on either side of a leaf or a
    chunk boundary."""
    rng = np.random.default_rng(4)
    chunk, leaf = hash_reference.CHUNK, hash_reference.LEAF
    tensors = {
        "one": rng.integers(0, 255, chunk, dtype=np.uint8),
        "one_and_a_byte": rng.integers(0, 255, chunk + 1, dtype=np.uint8),
        "leaf_and_a_byte": rng.integers(0, 255, leaf + 1, dtype=np.uint8),
        "several": rng.standard_normal((5, (chunk // 4) // 2 + 3)).astype(np.float32),
    }
    p = tmp_path / "big.safetensors"
    write_safetensors(p, tensors)
    want = hash_reference.weights_root(str(p))
    assert rust_root(p) == want
    seen = {want}
    for off in (leaf - 1, leaf, chunk - 1, chunk):
        t = dict(tensors)
        b = bytearray(t["several"].tobytes())
        b[off] ^= 0x80
        t["several"] = np.frombuffer(bytes(b), dtype=np.float32).reshape(tensors["several"].shape)
        write_safetensors(p, t)
        got = hash_reference.weights_root(str(p))
        assert got not in seen
        seen.add(got)
        assert rust_root(p) == got


def test_bit_flip_changes_root(tmp_path):
    p = tmp_path / "a.safetensors"
    write_safetensors(p, mixed_tensors(3))
    before = rust_root(p)
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 0x01
    p.write_bytes(bytes(raw))
    after = rust_root(p)
    assert after != before
    assert after == hash_reference.weights_root(str(p))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
