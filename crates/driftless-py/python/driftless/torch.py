"""PyTorch helpers: publish a model's BF16 weights after every optimizer step.

Imports torch only when used; PyTorch is not a dependency of driftless::

    import driftless, driftless.torch
    pub = driftless.Publisher("s3://bucket/run-7", signing_key="key.pem")
    hook = driftless.torch.attach(pub, model, optimizer)     # publishes after optimizer.step()
    ...
    hook.remove(); pub.close()

Names are those of a Hugging Face checkpoint (``model.layers.0.self_attn.q_proj.weight``):
``named_parameters()`` of a ``PreTrainedModel`` already uses them; the prefixes added by
wrappers (DDP ``module.``, ``torch.compile`` ``_orig_mod.``, FSDP ``_fsdp_wrapped_module.``,
activation checkpointing ``_checkpoint_wrapped_module.``) are removed. Tied weights appear
once, as in ``save_pretrained`` output.

Parameters already in BF16 on the CPU are read in place. Others (FP32 master weights, GPU
parameters) are converted into persistent CPU BF16 buffers allocated once, so each step costs
one device-to-host copy of the model and no allocation. Under FSDP/ZeRO-3 the parameters are
sharded: gather full parameters (``FSDP.summon_full_params`` on rank 0) before publishing, or
publish from a process that holds them.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

_WRAPPERS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def hf_name(name: str) -> str:
    """Removes wrapper components (``module``, ``_orig_mod``, FSDP and checkpoint wrappers)
    from a parameter name, at any depth."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPERS)


class BF16View:
    """The BF16 CPU view of a model's parameters, with reusable buffers."""

    def __init__(self, model: Any, dtype: Any = None, include_buffers: bool = False):
        import torch

        self.torch = torch
        self.model = model
        self.dtype = dtype or torch.bfloat16
        self.include_buffers = include_buffers
        self._bufs: Dict[str, Any] = {}

    def _items(self):
        yield from self.model.named_parameters()
        if self.include_buffers:
            yield from self.model.named_buffers()

    def tensors(self) -> Dict[str, Any]:
        """``{hf_name: contiguous CPU tensor}`` of the current weights."""
        torch = self.torch
        out: Dict[str, Any] = {}
        with torch.no_grad():
            for name, p in self._items():
                n = hf_name(name)
                t = p.detach()
                if t.device.type == "cpu" and t.dtype == self.dtype and t.is_contiguous():
                    out[n] = t
                    continue
                buf = self._bufs.get(n)
                if buf is None or buf.shape != t.shape:
                    buf = torch.empty(t.shape, dtype=self.dtype, device="cpu", pin_memory=t.is_cuda)
                    self._bufs[n] = buf
                buf.copy_(t)  # synchronous: the copy is complete when publish reads it
                out[n] = buf
        return out


class PublishHook:
    """Publishes after every ``every``-th optimizer step. Returned by :func:`attach`."""

    def __init__(self, publisher: Any, model: Any, every: int = 1, start_step: Optional[int] = None,
                 dtype: Any = None, on_receipt: Optional[Callable[[Dict[str, Any]], None]] = None):
        self.publisher = publisher
        self.view = BF16View(model, dtype)
        self.every = max(1, int(every))
        self.step = publisher.status()["next_step"] if start_step is None else int(start_step)
        self.on_receipt = on_receipt
        self._calls = 0
        self._handle = None

    def __call__(self, optimizer: Any = None, args: Any = None, kwargs: Any = None) -> None:
        self._calls += 1
        if self._calls % self.every:
            return
        r = self.publisher.publish(self.step, self.view.tensors())
        self.step += 1
        if self.on_receipt is not None:
            self.on_receipt(r)

    def remove(self) -> None:
        """Detaches the hook from the optimizer."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def attach(publisher: Any, model: Any, optimizer: Any, every: int = 1, start_step: Optional[int] = None,
           dtype: Any = None, on_receipt: Optional[Callable[[Dict[str, Any]], None]] = None) -> PublishHook:
    """Hooks ``optimizer.register_step_post_hook`` to publish ``model``'s BF16 weights.

    Steps are numbered from ``start_step`` (default: the publisher's next step) and advance
    by one per publish. ``on_receipt`` receives each publish receipt (for logging).
    """
    hook = PublishHook(publisher, model, every=every, start_step=start_step, dtype=dtype, on_receipt=on_receipt)
    hook._handle = optimizer.register_step_post_hook(hook)
    return hook


__all__ = ["attach", "PublishHook", "BF16View", "hf_name"]
