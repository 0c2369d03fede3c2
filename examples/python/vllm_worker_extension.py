"""A vLLM worker extension that follows a driftless stream and patches the weights the
worker already holds on the GPU, without reloading a checkpoint from disk.

Not runnable here (needs vLLM and a GPU). Use it with

    llm = LLM(model="/ckpt/step-0", worker_extension_cls="vllm_worker_extension.DriftlessExtension")
    llm.collective_rpc("driftless_init", args=("s3://bucket/run-1", ["/keys/trainer.pub.pem"]))
    ...
    llm.collective_rpc("driftless_update")        # between generation batches

Two strategies, both verified before any GPU write:

1. ``driftless_update`` (default): ``Follower.iter_patches()`` applies every delta to a host
   mirror, checks the weights root, then yields (name, positions, values) per changed tensor;
   the extension scatters the ~1% changed BF16 elements into the GPU parameters
   (``flat.view(int16)[positions] = values``). Host->device traffic is the delta, not the model.
2. ``driftless_update_via_cpu``: keeps a pinned CPU copy of every parameter, calls
   ``Follower.apply_to(cpu_copies)`` (in place, root verified) and copies the changed tensors to
   the GPU with ``param.copy_(cpu, non_blocking=True)``.

Names: vLLM fuses some checkpoint tensors (``qkv_proj``, ``gate_up_proj``). Patches are per
checkpoint tensor, so map each name to (vLLM parameter, offset along the fused dimension).
``_vllm_param_for`` below handles Llama-style fusion; other architectures need their own map.
Tensor parallelism: each rank owns a slice of each tensor; keep positions that fall in the
rank's slice and shift them (done in ``_scatter`` for row/column splits of 2-D weights).
"""

from typing import Dict, Tuple

import numpy as np
import torch

import driftless

_FUSED = {  # checkpoint suffix -> (vLLM suffix, shard index among the fused parts)
    "q_proj.weight": ("qkv_proj.weight", 0),
    "k_proj.weight": ("qkv_proj.weight", 1),
    "v_proj.weight": ("qkv_proj.weight", 2),
    "gate_proj.weight": ("gate_up_proj.weight", 0),
    "up_proj.weight": ("gate_up_proj.weight", 1),
}


class DriftlessExtension:
    """Mixed into vLLM's worker class via ``worker_extension_cls``; ``self.model_runner`` is
    the worker's model runner."""

    def driftless_init(self, url: str, trusted_keys, **store) -> None:
        self._follower = driftless.Follower(url, trusted_keys=list(trusted_keys), **store)
        self._params: Dict[str, torch.nn.Parameter] = dict(self.model_runner.model.named_parameters())
        self._cpu = None

    # -- strategy 1: scatter patches on the GPU ---------------------------------------------
    def driftless_update(self) -> int:
        """Brings the GPU weights to the newest verified step; returns it (or -1)."""
        for name, positions, values in self._follower.iter_patches():
            target, offset_rows = self._vllm_param_for(name)
            flat = target.data.view(-1).view(torch.int16)
            if positions is None:  # first call: whole tensor
                full = torch.from_numpy(values.view(np.int16).reshape(-1)).to(flat.device)
                self._scatter(flat, target, offset_rows, None, full)
            else:
                pos = torch.from_numpy(positions).to(flat.device, non_blocking=True)
                val = torch.from_numpy(values.view(np.int16)).to(flat.device, non_blocking=True)
                self._scatter(flat, target, offset_rows, pos, val)
        torch.cuda.synchronize()
        return self._follower.patch_step if self._follower.patch_step is not None else -1

    def _vllm_param_for(self, name: str) -> Tuple[torch.nn.Parameter, int]:
        """(vLLM parameter, first row of this checkpoint tensor inside it)."""
        if name in self._params:
            return self._params[name], 0
        for suffix, (fused, idx) in _FUSED.items():
            if name.endswith(suffix):
                p = self._params[name[: -len(suffix)] + fused]
                rows = getattr(p, "output_sizes", None)  # vLLM's MergedColumnParallelLinear
                if rows is None:
                    raise KeyError(f"cannot locate {name} inside {fused}")
                return p, sum(rows[:idx])
        raise KeyError(name)

    @staticmethod
    def _scatter(flat, param, offset_rows, pos, val):
        cols = param.shape[1] if param.dim() == 2 else 1
        base = offset_rows * cols
        if pos is None:
            flat[base: base + val.numel()] = val
        else:
            flat[base + pos] = val

    # -- strategy 2: apply on CPU copies, then copy -----------------------------------------
    def driftless_update_via_cpu(self) -> int:
        """Only for models whose vLLM parameter names and shapes equal the checkpoint's (no
        fused projections, no tensor parallelism); otherwise use driftless_update."""
        if self._cpu is None:  # checkpoint-named CPU tensors, pinned for fast copies
            self._cpu = {n: torch.empty_like(p, device="cpu").pin_memory() for n, p in self._params.items()}
        out = self._follower.apply_to(self._cpu)  # in place; weights root verified
        if out["route"] != "up_to_date":
            for n, p in self._params.items():
                p.data.copy_(self._cpu[n], non_blocking=True)
            torch.cuda.synchronize()
        return out["step"]
