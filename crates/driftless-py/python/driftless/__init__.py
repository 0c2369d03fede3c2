"""driftless: ship RL policy weights from a trainer to inference workers as signed,
bit-exact sparse deltas through object storage.

Trainer side::

    with driftless.Publisher("s3://bucket/run-7", signing_key="key.pem") as pub:
        for step in range(steps):
            train_step()
            pub.publish(step, {"model.embed_tokens.weight": bf16_array, ...})

Inference side::

    f = driftless.Follower("s3://bucket/run-7", trusted_keys=["key.pub.pem"])
    f.apply_to(my_arrays)      # in place, weights root verified

The heavy work runs in Rust with the GIL released. Tensors are borrowed, not copied: anything
exposing the buffer protocol (NumPy, including ``ml_dtypes.bfloat16``) or ``__dlpack__``
(PyTorch CPU tensors, JAX, NumPy) that is C-contiguous and in CPU memory.
"""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Tuple

from . import _native
from .errors import (
    ClosedError,
    CorruptError,
    DriftlessError,
    InternalError,
    InvalidInputError,
    LayoutChangedError,
    NothingReadyError,
    RetryableError,
    UntrustedError,
    WrongBaseError,
)

__version__ = _native.__version__

generate_key = _native.generate_key
public_key = _native.public_key


# Publishers not closed yet: closed at interpreter exit, while the background threads still
# run (a script that ends without close() lost its last steps, silently).
_open_publishers: "weakref.WeakSet[Any]" = weakref.WeakSet()


@atexit.register
def _close_open_publishers() -> None:
    for p in list(_open_publishers):
        if getattr(p, "_pid", None) != os.getpid():
            continue  # inherited through fork(): its steps are its creator's to publish
        try:
            if not getattr(p, "closed", False):
                p.close()  # idempotent
        except Exception as e:  # nothing else can report it now
            print(f"driftless: at exit, a {type(p).__name__} that was not closed could not publish its last "
                  f"steps: they were NOT published: {e}", file=sys.stderr)


def _close_on_exit(pub: Any, exc: Optional[BaseException]) -> None:
    """``__exit__`` of a publisher: closes it. A failed close is never silent: raised when the
    block ended normally, or by ``SystemExit``/``KeyboardInterrupt`` (chained to them, so the
    process does not end with a success status while its newest steps are not in the bucket);
    added as a note to an exception of the block (which stays the one raised)."""
    try:
        pub.close()
    except DriftlessError as e:
        if exc is None or not isinstance(exc, Exception):
            raise e from exc
        note = f"driftless: closing the {type(pub).__name__} failed too; its newest steps may NOT be published: {e}"
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        else:
            print(note, file=sys.stderr)


class Publisher(_native.Publisher):
    """Publishes the weights of successive training steps to a stream in a bucket.

    Args:
        bucket_url: ``s3://bucket/prefix``, ``gs://...``, ``az://...``, ``hf://buckets/...``,
            ``file:///abs/dir`` or ``memory://name``.
        signing_key: Ed25519 private key, PKCS#8 PEM text or a path to a PEM file
            (``driftless keygen`` or :func:`generate_key` makes one). ``None`` publishes an
            unsigned stream that followers only read with ``allow_unsigned=True``.
        anchor_every: a full checkpoint (anchor) every this many steps (default 50); anchors
            are also written early when the deltas since the last one grow large.
        queue_depth: steps waiting for upload before further steps are coalesced (skipped:
            the next delta then covers them) instead of blocking the trainer (default 4).
        new_stream: create the stream even when the prefix holds other objects.
        endpoint, allow_http, region: S3-compatible server settings (else the usual
            ``AWS_*`` environment variables apply).
        takeover: continue a stream signed by another key, re-signing its descriptor.
        max_retries, retry_timeout: per-request retry budget (defaults 5 and 60 s).
        spool_dir: directory for anchor spool files (default: the system temp dir).
        value_mode: ``"ulp"`` (default, smallest) or ``"overwrite"``.
        max_shard_bytes: largest shard file of the checkpoint layout (default 2 GiB).

    ``publish`` returns once the step's changes are found and the publisher's snapshot is
    updated (one pass over the tensors); encoding, compression, signing and uploads run on
    background threads. Use as a context manager, or call :meth:`close`, so the last steps are uploaded
    and a failure is raised. A publisher that is garbage-collected, or still open when the
    interpreter exits, is flushed then (a failure is printed on stderr). A process killed by a
    signal Python does not handle (SIGTERM's default) runs neither: install a handler that
    raises ``SystemExit``, e.g. ``signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._pid = os.getpid()
        _open_publishers.add(self)

    def publish(self, step: int, tensors: Mapping[str, Any]) -> Dict[str, Any]:
        """Publishes the weights of ``step`` (strictly increasing).

        ``tensors`` maps checkpoint names to C-contiguous CPU arrays (buffer protocol or
        ``__dlpack__``). They are read in place, without a copy, with the GIL released; do not
        modify them until the call returns. On a delta step the call is one pass over them and
        the publisher's snapshot (it finds the changes and updates the snapshot); packing,
        compression, hashing and signing run in the background after it returns and never
        read ``tensors`` again, so the trainer may change them at once. The tensor set may change between steps (new or
        reshaped tensors travel dense). The order of the mapping is the checkpoint's order.

        Returns a receipt: ``step``, ``outcome`` (``"delta"``, ``"delta_and_anchor"``,
        ``"anchor"``, ``"coalesced"`` when uploads are behind, or ``"already_published"`` for a
        step at or before the newest one that the bucket holds with these very weights),
        ``delta_bytes``
        and ``ratio`` (dense/delta bytes; ``None`` when not known as the call returns, which
        is the case for a delta encoded in the background: ``status()["last_delta_bytes"]``
        and ``["last_ratio"]`` have them once it is encoded), ``density`` (changed fraction),
        ``encode_secs`` (time the call blocked).

        Raises TypeError (not an array, unsupported dtype), ValueError (non-contiguous, not on
        the CPU), InvalidInputError (step not after the last one, bad names), ClosedError.
        """
        return super().publish(step, tensors)

    def flush(self) -> None:
        """Publishes the newest coalesced step (if any), then waits for every upload. A newest
        step that did not reach the bucket is published again, once, as an anchor. Returns
        when the newest published step is in the bucket; raises when it is still not
        (:class:`RetryableError` when calling ``flush``, or ``publish`` of that step, again
        later may help). Failures of steps a newer one superseded are counted in
        ``status()``, not raised. Ctrl-C (``KeyboardInterrupt``) ends the wait within 100 ms;
        the uploads go on in the background."""
        return super().flush()

    def close(self) -> None:
        """Flushes, then stops the uploader. Idempotent; ``publish`` afterwards raises
        :class:`ClosedError`. Ctrl-C ends the wait; the uploads then go on in the background
        only as long as the process lives."""
        return super().close()

    def status(self) -> Dict[str, Any]:
        """Counters: ``stream_id``, ``last_published``, ``next_step``, ``last_delta_ready``,
        ``last_anchor_ready``, ``queue_depth``, ``anchors_in_flight``, ``bytes_uploaded``,
        ``coalesced``, ``failures``, ``last_error``, ``last_ratio``, ``last_delta_bytes``."""
        return super().status()

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _close_on_exit(self, exc)

    def __repr__(self) -> str:
        if self.closed:
            return "<driftless.Publisher closed>"
        s = self.status()
        return f"<driftless.Publisher stream={s['stream_id']} last_published={s['last_published']}>"


class Follower(_native.Follower):
    """Follows a stream from the inference side.

    Args:
        bucket_url: the stream's URL, as given to the :class:`Publisher`.
        trusted_keys: public keys (SPKI PEM text or paths) whose signatures are accepted.
        allow_unsigned: accept an unsigned stream (no ``trusted_keys`` needed).
        endpoint, allow_http, region, max_retries, retry_timeout: as for :class:`Publisher`.
        refuse_for: seconds a step that failed verification is left out of plans (doubling
            on each repeat; default 30, as for the agent). Meanwhile the next best route is
            taken, and the bad step is not downloaded again at every call.
        chain_memory: bytes of a delta chain :meth:`apply_to` holds in memory between checking
            it and writing it (default 256 MiB); the rest waits in a ``TMPDIR`` spool.

    Three ways to consume the stream:

    - :meth:`sync_dir`: a Hugging Face checkpoint directory kept on the newest step (what
      ``driftless agent --once`` does), for engines that reload from disk.
    - :meth:`apply_to`: CPU arrays you own, patched in place.
    - :meth:`iter_patches`: (name, positions, values) per tensor, for engines that scatter the
      changed elements into GPU memory themselves.
    """

    def poll(self) -> Optional[int]:
        """The newest step with a ready marker of this stream, or None when the stream is
        empty. Markers that do not parse, are another stream's or name a manifest that does
        not pass the agents' check (signature, SHA-256) are passed over (each read once; a
        poll reads at most 4,096, and a first poll that finds only those raises
        :class:`NothingReadyError`, the next goes on).

        One conditional GET of the signed ``latest.json``; every 10th call, or when there is
        no valid hint and ``latest.json`` changed (or was deleted) since the last listing, the
        ready markers are listed too (they are the source of truth).
        Ctrl-C (``KeyboardInterrupt``) stops it within 100 ms. The calls that write (``sync_dir``,
        ``apply_to``) are not interrupted mid-way: each ends within the store's retry and
        listing budgets (``retry_timeout``, 300 s per listing; a request that hangs is cut
        after the HTTP client's 30 s request timeout, which ``retry_timeout`` does not
        shorten)."""
        return super().poll()

    def sync_dir(self, path: str) -> Dict[str, Any]:
        """Brings the checkpoint directory under ``path`` (``path/current``) to the newest
        step, verified. Returns ``step``, ``root`` (hex), ``route`` (``"up_to_date"``,
        ``"fast"``, ``"catchup"``, ``"anchor"``), ``bytes``, ``deltas`` and ``path`` (the
        checkpoint directory to load)."""
        return super().sync_dir(str(path))

    def apply_to(self, tensors: Mapping[str, Any], step: Optional[int] = None) -> Dict[str, Any]:
        """Brings caller-owned CPU arrays to ``step`` (default: the newest reachable) in place.

        The Follower remembers the step and weights root of the arrays it last verified, and
        which objects they were (weak references, plus their addresses). The first call (or
        after :meth:`reset`, or with arrays of another shape) loads the newest anchor into
        them and applies the deltas after it; later calls apply only the deltas since. Other
        objects at the same addresses (a new view of the same buffer, ``state_dict()``
        tensors, or new arrays placed where freed ones were) are hashed once: they keep the
        step only if they hold its bytes, and otherwise it is loaded into them. The weights root of the result is checked before returning, so a call that
        returns has produced exactly the publisher's bits. On a first load an anchor is
        streamed into the arrays as it downloads (ranged GETs decoded as they arrive, a few
        16 MiB parts in flight), so memory beyond the arrays does not grow with the model.

        Arrays that hold a verified step keep it when the bucket is at fault: delta objects
        are checked before the first write, and an anchor is first copied to a temporary
        directory (``TMPDIR``), checked against its signed hashes and weights root, and only
        then written. A bad step raises with the arrays untouched and still tracked. Only a
        delta whose objects match a trusted signature but whose signed result root is wrong
        (a publisher bug or a stolen key) can fail after the first write; the Follower then
        forgets their step, so the next call reloads an anchor. You never get a silently wrong
        result: an exception raised after the arrays were written (that one, a local I/O
        error while copying a proven anchor in, or the first load of arrays that held
        nothing verified) has ``arrays_modified = True`` and a note saying so.

        A step that fails verification is refused (see ``refuse_for``) and the next best
        route taken, as the agent does: an older step, or staying on the arrays' verified
        step (``"up_to_date"``). With nothing verified and nothing else to reach, the call
        raises the refused step's error.

        Returns ``step``, ``root``, ``route`` (``"up_to_date"``, ``"fast"``, ``"catchup"``,
        ``"anchor"``), ``bytes`` downloaded, ``deltas`` applied and ``refused``: the newer
        steps left out, as ``(kind, step, reason)``.

        Raises :class:`NothingReadyError` when nothing is reachable yet,
        :class:`InvalidInputError` when the arrays are not the stream's tensors (names, dtypes,
        shapes) or two of them share memory (tied weights: pass each tensor once),
        :class:`LayoutChangedError` when the stream's tensor set changed,
        :class:`CorruptError` / :class:`UntrustedError` / :class:`WrongBaseError` on bad data,
        :class:`RetryableError` on storage trouble.
        """
        return super().apply_to(tensors, step)

    def iter_patches(self, step: Optional[int] = None) -> Iterator[Tuple[str, Optional[Any], Any]]:
        """Advances the Follower's host mirror to ``step`` (default newest) and yields
        ``(name, positions, values)`` per changed tensor.

        ``positions`` is an ``int64`` array of flat element indices, ``values`` the new raw bit
        patterns at those indices (``uint16`` for BF16/F16, ``uint8``/``uint32``/``uint64`` by
        width): ``flat_view_as_uint16[positions] = values``. On the first call (and when the
        route needs an anchor) every tensor is yielded whole with ``positions=None`` and
        ``values`` shaped like the tensor; so is a tensor whose changes along the route pass
        an eighth of its elements (its positions would cost as much as the tensor, and are
        not held).

        Everything is applied to the mirror and its weights root verified *before* the first
        patch is yielded, so a consumer never scatters unverified data. The mirror costs one
        host copy of the model; a tensor yielded whole is copied out of it when the loop
        reaches it. Nothing is yielded when already up to date. After the iterator ends,
        :attr:`patch_step` is the step the patches lead to. Until then (and whenever the
        consumer stops part way: its scatter raised, it left the loop, an interrupt came
        before the first patch, or another ``iter_patches`` call began) :attr:`patch_step` is
        ``None`` and the next call yields every tensor whole, at the newest step: the engine
        may hold some of the step's tensors and not others.
        """
        import numpy as np

        r = self._patches(step)
        if r is None:
            return
        delivery, _step, _root, patches = r
        for name, dtype, shape, pos, vals in patches:
            width = _WIDTH[dtype]
            if vals is None:
                vals = self._mirror_tensor(delivery, name)
            else:
                self._check_delivery(delivery)
            v = np.frombuffer(vals, dtype=_UINT[width])
            if pos is None:
                yield name, None, v.reshape(tuple(shape))
            else:
                yield name, np.frombuffer(pos, dtype="<i8"), v
        # Only a consumer that took every patch comes back here; anything else leaves the
        # delivery unfinished, and the next call yields every tensor whole.
        self._confirm_patches(delivery)

    def reset(self) -> None:
        """Forgets the step of the arrays given to :meth:`apply_to` and the patch mirror."""
        return super().reset()

    def __repr__(self) -> str:
        return f"<driftless.Follower applied_step={self.applied_step} patch_step={self.patch_step}>"


def shard(
    data: Any,
    shape: Sequence[int],
    offsets: Optional[Sequence[int]] = None,
    flat_offset: Optional[int] = None,
    replica: int = 0,
) -> Dict[str, Any]:
    """Describes the part of a tensor a rank holds, for :meth:`ShardedPublisher.publish`.

    Args:
        data: the rank's local, C-contiguous CPU array (buffer protocol or ``__dlpack__``).
        shape: the global shape of the tensor.
        offsets: for a block (row block, column block, any hyper-rectangle), the global index
            of the local array's first element in every dimension; the local array's shape
            gives the lengths. Default: all zeros (the rank holds the tensor whole).
        flat_offset: for an FSDP-style flat shard instead, the element offset of ``data``
            (any shape; its element count is the length) in the tensor viewed as 1-D.
        replica: data-parallel replica index of this shard; only replica 0 publishes
            (replicas hold the same bytes), so other replicas' shards are skipped.
    """
    d: Dict[str, Any] = {"data": data, "shape": tuple(int(x) for x in shape), "replica": int(replica)}
    if offsets is not None:
        d["offsets"] = tuple(int(x) for x in offsets)
    if flat_offset is not None:
        d["flat_offset"] = int(flat_offset)
    return d


class ShardedPublisher(_native.ShardedPublisher):
    """One rank of a trainer whose parameters are sharded: every rank publishes the slices it
    holds, and rank 0 commits each step through the bucket (no gather of the model, no side
    channel between ranks). Agents read the steps like any other.

    Args:
        bucket_url: as for :class:`Publisher`.
        rank: this rank's index in ``range(world_size)``.
        world_size: number of ranks whose parts make a step. Every rank calls ``publish`` for
            every step, with whatever it holds (possibly nothing: a data-parallel replica
            passes its shards with ``replica=1``, or none).
        signing_key: the stream's signing key; all ranks use the same one.
        anchor_every: a full checkpoint every this many steps (default 50; rank 0's value
            counts). The step stays a delta, and rank 0 gathers its anchor afterwards.
        commit_timeout: seconds rank 0 waits for the other ranks' parts (default 120); a step
            missing a part after it is not committed, and the next step is an anchor.
        new_stream, endpoint, allow_http, region, takeover, max_retries, retry_timeout,
        spool_dir, max_shard_bytes: as for :class:`Publisher` (stream creation is rank 0's).

    Rank 0 creates the stream and takes a publisher generation; the other ranks wait up to
    ``commit_timeout`` for both. See ``docs/sharded.md`` for the protocol. Closed at exit
    when still open, as :class:`Publisher` is.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._pid = os.getpid()
        _open_publishers.add(self)

    def publish(self, step: int, shards: Mapping[str, Dict[str, Any]]) -> Dict[str, Any]:
        """Publishes this rank's shards of ``step`` (strictly increasing, the same step on
        every rank). ``shards`` maps global tensor names to :func:`shard` descriptions.

        Blocks for the previous step (its part uploaded and its outcome known: this step's
        part is taken against the last committed one) and while the shards are copied, then
        returns; the shards may change at once. The diff against this rank's copy of the last
        committed step, the encode, the upload and, on rank 0, the commit run in the
        background; a scheduled anchor is gathered by rank 0 after its step's outcome, so no
        ``publish`` waits for it.

        Returns ``step``, ``part`` (``"delta"`` or ``"anchor"``), ``slices`` (whether the
        part also carries the shard bytes, for an anchor of the step), ``blocked_secs`` (time
        the call blocked), ``previous`` (the outcome of this rank's previous step: ``step``,
        ``committed``, ``of``, ``root``, ``reason``, ``next_anchor``, ``slices_next``,
        ``retryable``: whether publishing again may commit a step that was not) and
        ``previous_part`` (this rank's part of it: ``step``, ``part``, ``slices``, ``bytes``,
        ``secs``, ``commit_secs``; None when it was not sent).
        """
        return super().publish(step, shards)

    def flush(self) -> Dict[str, Any]:
        """Waits until this rank's last step is uploaded and its outcome known, and returns
        that outcome; raises when the step was not committed (:class:`RetryableError` when
        publishing again may commit, else :class:`DriftlessError`). Ctrl-C
        ends the wait (as it does the constructor's wait for the committer and ``publish``'s
        wait for the previous step's outcome)."""
        return super().flush()

    def wait_sent(self) -> Optional[Dict[str, Any]]:
        """Waits until this rank's part of its last step is uploaded (not for the commit);
        returns its report (``step``, ``part``, ``slices``, ``bytes``, ``secs``, ``commit_secs``), or
        None when it could not be sent or nothing is in flight."""
        return super().wait_sent()

    def last_outcome(self) -> Optional[Dict[str, Any]]:
        """The outcome of this rank's last step once known (after :meth:`flush` or the next
        :meth:`publish`), else None."""
        return super().last_outcome()

    def last_part(self) -> Optional[Dict[str, Any]]:
        """This rank's part of its last step once resolved (after :meth:`flush`), else None."""
        return super().last_part()

    def close(self) -> None:
        """Flushes, then releases the rank. Idempotent."""
        return super().close()

    def __enter__(self) -> "ShardedPublisher":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _close_on_exit(self, exc)


_WIDTH = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "F64": 8, "I64": 8, "U64": 8,
}
_UINT = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}

__all__ = [
    "Publisher",
    "ShardedPublisher",
    "shard",
    "Follower",
    "generate_key",
    "public_key",
    "DriftlessError",
    "RetryableError",
    "NothingReadyError",
    "CorruptError",
    "UntrustedError",
    "WrongBaseError",
    "InvalidInputError",
    "ClosedError",
    "LayoutChangedError",
    "InternalError",
]
