"""A vLLM worker extension that applies verified driftless patches into the live weights,
driven by the agent (``--notify vllm=URL,patch=on``), with no reload from disk.

The agent verifies step N on its own copy (weights root, signed), then writes one safetensors
file with, per changed tensor, the flat indices every delta since the engine's step wrote and
the step-N values at them, read from the verified copy (format: ``crates/driftless-agent/src/
patch.rs``). It then calls, inside its usual pause::

    POST /collective_rpc {"method": "driftless_apply_patch",
                          "kwargs": {"path": PATCH, "weights_path": VERIFIED_DIR,
                                     "sha256": HEX}}

Each worker checks the file's SHA-256 (``sha256``, from the agent that wrote it) before it
reads anything of it, and checks every sparse tensor's indices (sorted, unique, inside the
tensor) and uploads every tensor to the device before the first one is written, so a patch
damaged on disk, or one vLLM would refuse part way, touches no parameter.

Every worker (tensor-parallel rank) reads the file and hands the patches to vLLM's own loader,
``load_checkpoint_weight_patches`` (``vllm/model_executor/model_loader/
checkpoint_weight_patch.py`` in vLLM 0.33.0, the one its ``sparse_nccl`` backend uses): the
model's ``load_weights`` maps checkpoint names, keeps the rank's slice and fills fused
projections (``qkv_proj``, ``gate_up_proj``), so nothing here is architecture-specific. Each
worker answers the step; the agent requires all of them to, then resets the prefix cache and
bumps the engine's weight version as for a reload.

Tensors the sparse loader cannot take are sent dense, read whole from the verified directory:
a value that is NaN (NaN is the loader's "unchanged" sentinel), a non-floating dtype, or a
tensor the patch marks dense (more than half its elements changed).

If anything fails the worker raises (HTTP 500 from the route); the agent then marks the
engine's version unknown and reloads in full (``reload_weights``) in the same pause, since
vLLM has no rollback of a partial patch.

Launch (the package must be importable by the workers, and the agent's directory mounted at
the same path in the engine's container)::

    VLLM_SERVER_DEV_MODE=1 vllm serve /weights/current \\
        --worker-extension-cls driftless.vllm_ext.DriftlessWorkerExtension

Tested in CI on vLLM's real HTTP routes with a stub engine whose worker runs this class, its
last step (``_driftless_load``) replaced by a numpy scatter with the loader's checks
(``integration/engines``). The torch step below has **not been run** in this repository: it
needs torch (no CPU build is reachable from CI's package registries) and the GPU check
``integration/engines/gpu_patch_check.py`` (vLLM's unchanged ``checkpoint_weight_patch.py``,
bit-exact comparison, timing) found no GPU lent when it was written.
"""

import hashlib
import json
import os
from typing import Dict, List, Tuple

FORMAT = "driftless-patch-1"
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"})


class Patch:
    """A patch file read with the reference safetensors reader (``framework`` "pt" or "np")."""

    def __init__(self, path: str, framework: str = "pt"):
        from safetensors import safe_open

        if framework == "np":
            import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
        with safe_open(path, framework) as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path}: not a {FORMAT} file (format {meta.get('format')!r})")
            self.base = int(meta["base_step"])
            self.step = int(meta["step"])
            self.weights_root = meta["weights_root"]
            self.shapes: Dict[str, Tuple[int, ...]] = {k: tuple(v) for k, v in json.loads(meta["shapes"]).items()}
            self.dense: List[str] = list(json.loads(meta["dense"]))
            # name -> (indices, values, safetensors dtype string)
            self.sparse: Dict[str, tuple] = {}
            for name in self.shapes:
                if name in self.dense:
                    continue
                dtype = f.get_slice(f"val/{name}").get_dtype()
                self.sparse[name] = (f.get_tensor(f"idx/{name}"), f.get_tensor(f"val/{name}"), dtype)

    def split(self, isnan_any) -> Tuple[List[str], List[str]]:
        """(sparse names, dense names): a tensor goes dense when the sparse loader cannot take
        it (non-floating dtype, or a NaN among its new values)."""
        sparse, dense = [], list(self.dense)
        for name, (_, vals, dtype) in self.sparse.items():
            if dtype not in FLOAT_DTYPES or isnan_any(vals):
                dense.append(name)
            else:
                sparse.append(name)
        return sparse, dense


def check_sha256(path: str, want: str) -> None:
    """Raises unless the file at ``path`` has SHA-256 ``want`` (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != str(want).lower():
        raise ValueError(f"{path}: SHA-256 {h.hexdigest()} is not the agent's {want}: damaged or replaced on disk")


def check_indices(patch: Patch) -> None:
    """Raises unless every sparse tensor's indices are strictly increasing and inside its
    tensor, with one value each: what vLLM's loader checks too, but per call, after the
    tensors of an earlier call were written."""
    for name, (idx, vals, _) in patch.sparse.items():
        numel = 1
        for d in patch.shapes[name]:
            numel *= int(d)
        n = len(idx)
        if len(vals) != n or tuple(idx.shape) != (n,):
            raise ValueError(f"{name}: {n} indices for {len(vals)} values")
        if n == 0:
            continue
        steps = idx[1:] - idx[:-1]
        if int(idx[0]) < 0 or int(idx[-1]) >= numel or (n > 1 and not bool((steps > 0).all())):
            raise ValueError(f"{name}: indices not strictly increasing inside its {numel} elements")


def read_tensors(weights_path: str, names: List[str], framework: str = "pt") -> Dict[str, object]:
    """Whole tensors by name from the safetensors files of a checkpoint directory."""
    from safetensors import safe_open

    want, out = set(names), {}
    if not want:
        return out
    for fname in sorted(os.listdir(weights_path)):
        if not fname.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(weights_path, fname), framework) as f:
            for k in f.keys():
                if k in want:
                    out[k] = f.get_tensor(k)
    missing = want - set(out)
    if missing:
        raise ValueError(f"{weights_path}: tensors {sorted(missing)[:3]} not found")
    return out


class DriftlessWorkerExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``)."""

    _driftless_framework = "pt"

    def driftless_apply_patch(self, path: str, weights_path: str, sha256: str) -> int:
        """Applies the patch at ``path`` (SHA-256 ``sha256``, hex) to the live weights;
        returns the step it leads to."""
        check_sha256(path, sha256)
        fw = self._driftless_framework
        patch = Patch(path, fw)
        check_indices(patch)
        sparse, dense = patch.split(self._driftless_isnan_any)
        full = read_tensors(weights_path, dense, fw)
        self._driftless_load(patch, sparse, full)
        return patch.step

    @staticmethod
    def _driftless_isnan_any(values) -> bool:
        import torch

        return bool(torch.isnan(values).any().item())

    def _driftless_load(self, patch: Patch, sparse: List[str], full: Dict[str, object]) -> None:
        """Hands the patches to vLLM's checkpoint-patch loader (dense first: one call may not
        mix them)."""
        import torch
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        model = self.model_runner.get_model()
        device = next(model.parameters()).device
        # Everything on the device before the first write: running out of device memory
        # part way through the uploads then costs no parameter.
        dense_patches = [
            CheckpointWeightPatch(n, tuple(t.shape), t.dtype, t.reshape(-1).to(device)) for n, t in full.items()
        ]
        sparse_patches = []
        for n in sparse:
            idx, vals, _ = patch.sparse[n]
            sparse_patches.append(CheckpointWeightPatch(n, patch.shapes[n], vals.dtype, vals.to(device), idx.to(device)))
        if dense_patches:
            load_checkpoint_weight_patches(model, dense_patches)
        if sparse_patches:
            # Indices are sorted and unique by construction (checked by check_indices); vLLM
            # checks them again.
            load_checkpoint_weight_patches(model, sparse_patches)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
