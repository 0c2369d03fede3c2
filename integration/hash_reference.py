#!/usr/bin/env python3
"""Independent reference implementation of the driftless weights root.

Written from the specification in schemas/weights-root.md with nothing but hashlib and the
`safetensors` package (only to parse files: `safetensors.deserialize` hands back raw bytes, so
BF16 and FP8 need no numpy or torch support).

Usage: python integration/hash_reference.py PATH
PATH is a .safetensors file, or a directory holding model.safetensors.index.json (its
weight_map names the shards) or else every *.safetensors file in it. Prints the hex root.
"""

import hashlib
import json
import os
import struct
import sys

LEAF = 8 << 10
CHUNK = 1 << 20
LEAF_DOMAIN = b"driftless.leaf.v3\0"
CHUNK_DOMAIN = b"driftless.chunk.v3\0"
TENSOR_DOMAIN = b"driftless.tensor.v3\0"
ROOT_DOMAIN = b"driftless.root.v3\0"
INDEX_FILE = "model.safetensors.index.json"

# safetensors spellings, as the Python package may report them in another case.
DTYPES = {
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16",
    "I32", "U32", "F32", "F64", "I64", "U64",
}


def u64(n):
    return struct.pack("<Q", n)


def chunk_digest(chunk):
    """SHA-256 over the domain and the digests of the chunk's 8 KiB leaves in order."""
    h = hashlib.sha256(CHUNK_DOMAIN)
    for off in range(0, len(chunk), LEAF):
        h.update(hashlib.sha256(LEAF_DOMAIN + chunk[off:off + LEAF]).digest())
    return h.digest()


def tensor_digest(name, dtype, shape, data):
    """SHA-256 over the domain, the length-prefixed name and dtype, ndim, dims, the data length
    and the digests of the data's 1 MiB chunks in order."""
    dtype = dtype.upper()
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} for tensor {name!r}")
    nb = name.encode("utf-8")
    db = dtype.encode("ascii")
    h = hashlib.sha256()
    h.update(TENSOR_DOMAIN)
    h.update(u64(len(nb)) + nb)
    h.update(u64(len(db)) + db)
    h.update(u64(len(shape)))
    for d in shape:
        h.update(u64(d))
    h.update(u64(len(data)))
    view = memoryview(data)
    for off in range(0, len(data), CHUNK):
        h.update(chunk_digest(view[off:off + CHUNK]))
    return h.digest()


def combine(digests):
    """digests: {name: 32-byte digest}. Sorted by the UTF-8 bytes of the name."""
    h = hashlib.sha256()
    h.update(ROOT_DOMAIN)
    h.update(u64(len(digests)))
    for nb, d in sorted((n.encode("utf-8"), d) for n, d in digests.items()):
        h.update(u64(len(nb)) + nb)
        h.update(d)
    return h.hexdigest()


def shard_files(path):
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index, "rb") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors") and not f.startswith("."))
    if not files:
        raise ValueError(f"no .safetensors files in {path}")
    return [os.path.join(path, f) for f in files]


def weights_root(path):
    from safetensors import deserialize

    digests = {}
    for file in shard_files(path):
        with open(file, "rb") as f:
            raw = f.read()
        for name, t in deserialize(raw):
            if name in digests:
                raise ValueError(f"tensor {name!r} appears twice")
            digests[name] = tensor_digest(name, t["dtype"], list(t["shape"]), bytes(t["data"]))
    return combine(digests)


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    print(weights_root(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
