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
one device-to-host copy of the model and no allocation. Only floating-point tensors are
converted: integer and bool ones (buffers, with ``include_buffers=True``) keep their dtype.

Sharded trainers (FSDP2, tensor parallel: parameters are ``DTensor``) publish without a
gather: every rank attaches a :class:`driftless.ShardedPublisher` with
:func:`attach_sharded`, which publishes each rank's local shard with the slice geometry
taken from the ``DTensor`` placements (``Shard(d)``: a block of dimension ``d``;
``Replicate()``: only the rank at coordinate 0 of that mesh dimension publishes)::

    pub = driftless.ShardedPublisher(url, rank=dist.get_rank(), world_size=dist.get_world_size(),
                                     signing_key="key.pem")
    hook = driftless.torch.attach_sharded(pub, model, optimizer, start_step=global_step + 1)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

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
        out: Dict[str, Any] = {}
        with self.torch.no_grad():
            for name, p in self._items():
                n = hf_name(name)
                out[n] = self._bf16(n, p.detach())
        return out

    def dtype_of(self, t: Any) -> Any:
        """The dtype ``t`` is published in: ``dtype`` (BF16) for floating-point tensors, its
        own for the others. An integer or bool buffer (``position_ids``, a causal mask) is
        published as it is: cast to BF16, 257 would become 256 (found by review)."""
        return self.dtype if t.is_floating_point() else t.dtype

    def _bf16(self, n: str, t: Any) -> Any:
        """``t`` as a contiguous CPU tensor of :meth:`dtype_of`: itself when it already is one,
        else a persistent buffer it is copied into."""
        dtype = self.dtype_of(t)
        if t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous():
            return t
        buf = self._bufs.get(n)
        if buf is None or buf.shape != t.shape or buf.dtype != dtype:
            buf = self.torch.empty(t.shape, dtype=dtype, device="cpu", pin_memory=t.is_cuda)
            self._bufs[n] = buf
        buf.copy_(t)  # synchronous: the copy is complete when publish reads it
        return buf


def dtensor_geometry(p: Any) -> Tuple[Tuple[int, ...], Tuple[int, ...], int]:
    """``(global offsets, local shape, replica)`` of this rank's local shard of ``DTensor``
    ``p``. The offsets come from PyTorch's own ``compute_local_shape_and_global_offset``
    (what ``to_local()`` holds, uneven shards included); ``replica`` is 0 when this rank is
    at coordinate 0 of every mesh dimension the tensor is replicated over, else 1."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = p.device_mesh, p.placements
    for pl in placements:
        if not isinstance(pl, (Shard, Replicate)) or type(pl) not in (Shard, Replicate):
            raise ValueError(f"placement {pl} is not supported (Shard(d) and Replicate() are)")
    local_shape, offsets = compute_local_shape_and_global_offset(p.shape, mesh, placements)
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("this rank is not part of the parameter's device mesh")
    replica = int(any(c != 0 for c, pl in zip(coord, placements) if isinstance(pl, Replicate)))
    return tuple(int(x) for x in offsets), tuple(int(x) for x in local_shape), replica


class ShardedBF16View(BF16View):
    """The BF16 CPU view of this rank's shards of a model's parameters, as
    :func:`driftless.shard` descriptions (``DTensor`` parameters by their placements; plain
    tensors are taken as replicated on every rank, published by global rank 0)."""

    def shards(self) -> Dict[str, Any]:
        import driftless

        torch = self.torch
        rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        out: Dict[str, Any] = {}
        with torch.no_grad():
            for name, p in self._items():
                n = hf_name(name)
                if hasattr(p, "to_local") and hasattr(p, "placements"):
                    offsets, local_shape, replica = dtensor_geometry(p)
                    t = p.to_local().detach()
                    if tuple(t.shape) != local_shape:
                        raise ValueError(f"{n}: local shard {tuple(t.shape)} is not the {local_shape} its placements give")
                    shape = tuple(p.shape)
                else:
                    t, offsets, replica, shape = p.detach(), None, 0 if rank0 else 1, tuple(p.shape)
                if replica:
                    out[n] = driftless.shard(None, shape, replica=replica)
                    continue
                out[n] = driftless.shard(self._bf16(n, t), shape, offsets=offsets)
        return out


class PublishHook:
    """Publishes after every ``every``-th optimizer step. Returned by :func:`attach`."""

    def __init__(self, publisher: Any, model: Any, every: int = 1, start_step: Optional[int] = None,
                 dtype: Any = None, on_receipt: Optional[Callable[[Dict[str, Any]], None]] = None,
                 sharded: bool = False):
        self.publisher = publisher
        self.view = ShardedBF16View(model, dtype) if sharded else BF16View(model, dtype)
        self.every = max(1, int(every))
        self.step = publisher.status()["next_step"] if start_step is None else int(start_step)
        self.on_receipt = on_receipt
        self._calls = 0
        # Optimizer steps ran since the last publish that worked: `finish` publishes them.
        self._unpublished = False
        self._handle = None

    def __call__(self, optimizer: Any = None, args: Any = None, kwargs: Any = None) -> None:
        self._calls += 1
        self._unpublished = True
        if self._calls % self.every:
            return
        self._publish()

    def _publish(self) -> Any:
        # The number is taken before anything can fail: it names this optimizer step, the
        # same on every rank whether or not this rank's publish works. Published again under
        # the same number at the next optimizer step, a sharded rank's newer weights would be
        # committed beside the other ranks' older ones (found by review), and a single
        # publisher would label step t+1's weights as step t.
        step = self.step
        self.step += 1
        weights = self.view.shards() if isinstance(self.view, ShardedBF16View) else self.view.tensors()
        r = self.publisher.publish(step, weights)
        self._unpublished = False
        if self.on_receipt is not None:
            self.on_receipt(r)
        return r

    def finish(self) -> Optional[Dict[str, Any]]:
        """Publishes the current weights when optimizer steps ran since the last publish
        (with ``every > 1`` the last ones of a run usually did), so that the final weights
        reach the bucket; call it at the end of training, before the publisher's ``close``.
        Returns the receipt, or None when the newest weights were already published."""
        # A single publisher: not the call count, since a due publish that raised (and a
        # trainer that trained on) left the newest weights unpublished (found by review:
        # `finish` said they were). Sharded ranks all decide by the call count, which is the
        # same on every rank: a rank's own failure must not make it publish a step alone (its
        # part would wait for the others' to the commit timeout and be refused).
        if isinstance(self.view, ShardedBF16View):
            if self._calls % self.every == 0:
                return None
        elif not self._unpublished:
            return None
        r = self._publish()
        self._calls = 0
        return r

    def remove(self) -> None:
        """Detaches the hook from the optimizer."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def attach(publisher: Any, model: Any, optimizer: Any, every: int = 1, start_step: Optional[int] = None,
           dtype: Any = None, on_receipt: Optional[Callable[[Dict[str, Any]], None]] = None) -> PublishHook:
    """Hooks ``optimizer.register_step_post_hook`` to publish ``model``'s BF16 weights.

    Steps are numbered from ``start_step`` (default: the publisher's next step) and advance
    by one per publish, a failed one included (its exception reaches ``optimizer.step()``;
    a trainer that catches it and trains on publishes the next step under the next number,
    as the publisher's anchor after a failure). ``on_receipt`` receives each publish receipt
    (for logging).
    """
    hook = PublishHook(publisher, model, every=every, start_step=start_step, dtype=dtype, on_receipt=on_receipt)
    hook._handle = optimizer.register_step_post_hook(hook)
    return hook


def attach_sharded(publisher: Any, model: Any, optimizer: Any, start_step: int, every: int = 1,
                   dtype: Any = None, on_receipt: Optional[Callable[[Dict[str, Any]], None]] = None) -> PublishHook:
    """Like :func:`attach`, for one rank of a sharded trainer and its
    :class:`driftless.ShardedPublisher`: publishes this rank's local shards after every
    ``every``-th ``optimizer.step()``. ``start_step`` is required: every rank must publish the
    same step numbers (the trainer's global step is the natural choice)."""
    hook = PublishHook(publisher, model, every=every, start_step=int(start_step), dtype=dtype,
                       on_receipt=on_receipt, sharded=True)
    hook._handle = optimizer.register_step_post_hook(hook)
    return hook


__all__ = ["attach", "attach_sharded", "PublishHook", "BF16View", "ShardedBF16View", "dtensor_geometry", "hf_name"]
