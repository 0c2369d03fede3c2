"""A vLLM worker extension: applies verified driftless patches into the live model through
vLLM's own checkpoint-patch loader (``vllm/model_executor/model_loader/checkpoint_weight_patch.py``
in vLLM 0.33.0, the loader its ``sparse_nccl`` backend uses). The model's ``load_weights``
does the checkpoint-name mapping, tensor-parallel slicing and fused projections (``qkv_proj``,
``gate_up_proj``), so nothing here is architecture-specific.

Launch (the module must be importable by the workers)::

    VLLM_SERVER_DEV_MODE=1 vllm serve /weights/current \\
        --worker-extension-cls driftless.vllm_ext.DriftlessWorkerExtension

Drive it over HTTP (``collective_rpc`` passes string args/kwargs only)::

    POST /pause?mode=keep
    POST /collective_rpc {"method": "driftless_init",
                          "kwargs": {"url": "s3://bucket/run", "trusted_keys": "<PEM>\\n<PEM>"}}
    POST /collective_rpc {"method": "driftless_update"}      # -> {"results": [STEP, ...]}
    POST /reset_prefix_cache?reset_running_requests=true
    POST /update_weight_version {"new_version": "STEP"}
    POST /resume

``driftless_update`` calls ``Follower.iter_patches()``, which applies each delta to the
follower's host mirror and checks the weights root *before* yielding anything, so the engine
only receives patches whose result was verified. Each worker (TP rank) runs the same follower
and hands the full checkpoint-coordinate patch to ``load_checkpoint_weight_patches``, which
keeps the rank's own slice.

Limits (from the loader's contract): sparse patches use NaN as the "unchanged" sentinel, so a
patch value that *is* a NaN cannot be sent sparsely; such a tensor is sent as a dense patch
from the follower's verified host mirror. Loaders that do more than a same-shaped
floating-point ``copy_`` (quantized weights) are refused by vLLM; use ``reload_weights`` from
the agent's directory for those models.

Not run in this repository's CI (needs vLLM with torch and a GPU); the patch conversion is
unit-tested without torch in ``tests/test_vllm_ext.py``.
"""

from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

import driftless

_BF16_EXP = 0x7F80


def has_nan_bf16(bits: np.ndarray) -> bool:
    """Whether BF16 bit patterns (uint16/int16) contain a NaN."""
    b = bits.view(np.uint16)
    return bool(np.any(((b & _BF16_EXP) == _BF16_EXP) & ((b & 0x007F) != 0)))


def plan_patches(
    items: Iterable[Tuple[str, Optional[np.ndarray], np.ndarray]],
    shapes: Dict[str, Tuple[int, ...]],
    full: Optional[Dict[str, np.ndarray]] = None,
) -> Tuple[List[tuple], List[tuple]]:
    """Splits ``iter_patches`` output into (sparse, dense) lists of
    ``(name, shape, indices int32 | None, values as BF16 bit patterns)``.

    A tensor whose new values hold a NaN goes dense (``full[name]``, the verified mirror)."""
    sparse, dense = [], []
    for name, positions, values in items:
        bits = np.ascontiguousarray(values).view(np.uint16).reshape(-1)
        shape = tuple(shapes[name])
        if positions is None:
            dense.append((name, shape, None, bits))
        elif has_nan_bf16(bits):
            if full is None or name not in full:
                raise ValueError(f"{name}: NaN in a sparse patch and no verified full tensor to send densely")
            dense.append((name, shape, None, np.ascontiguousarray(full[name]).view(np.uint16).reshape(-1)))
        else:
            if positions.size and int(positions.max()) >= 2**31:
                raise ValueError(f"{name}: position beyond int32")
            sparse.append((name, shape, positions.astype(np.int32), bits))
    return sparse, dense


class DriftlessWorkerExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``)."""

    def driftless_init(self, url: str, trusted_keys: str, **store: str) -> None:
        self._follower = driftless.Follower(url, trusted_keys=_split_pems(trusted_keys), **store)

    def driftless_update(self) -> int:
        """Brings the live weights to the newest verified step; returns it (-1: nothing yet)."""
        import torch
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        model = self.model_runner.get_model()
        items = list(self._follower.iter_patches())
        if not items:
            step = self._follower.patch_step
            return -1 if step is None else int(step)
        shapes = {name: tuple(self._follower_shape(name, values, pos)) for name, pos, values in items}
        sparse, dense = plan_patches(items, shapes)
        device = next(model.parameters()).device

        def to_patch(name, shape, idx, bits):
            vals = torch.from_numpy(bits.view(np.int16)).to(device).view(torch.bfloat16)
            ind = None if idx is None else torch.from_numpy(idx).to(device)
            return CheckpointWeightPatch(name=name, shape=shape, dtype=torch.bfloat16, values=vals, indices=ind)

        # A call takes either dense or sparse patches, not both.
        if dense:
            load_checkpoint_weight_patches(model, [to_patch(*p) for p in dense])
        if sparse:
            load_checkpoint_weight_patches(model, [to_patch(*p) for p in sparse])
        torch.cuda.synchronize()
        return int(self._follower.patch_step)

    def _follower_shape(self, name, values, positions):
        shapes = getattr(self._follower, "shapes", None)
        if callable(shapes):
            return shapes()[name]
        if positions is None:
            return values.shape
        raise RuntimeError(f"{name}: checkpoint shape unknown (Follower.shapes() missing)")


def _split_pems(text: str) -> List[str]:
    out, cur = [], []
    for line in text.splitlines():
        cur.append(line)
        if line.startswith("-----END"):
            out.append("\n".join(cur) + "\n")
            cur = []
    return out
