from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, TypedDict, Union

import numpy as np
import numpy.typing as npt

from .errors import (
    ClosedError as ClosedError,
    CorruptError as CorruptError,
    DriftlessError as DriftlessError,
    InvalidInputError as InvalidInputError,
    LayoutChangedError as LayoutChangedError,
    InternalError as InternalError,
    NothingReadyError as NothingReadyError,
    RetryableError as RetryableError,
    UntrustedError as UntrustedError,
    WrongBaseError as WrongBaseError,
)

__version__: str

class PublishReceipt(TypedDict):
    step: int
    outcome: str  # "delta" | "delta_and_anchor" | "anchor" | "coalesced" | "already_published"
    delta_bytes: Optional[int]  # None until encoded (see publish())
    ratio: Optional[float]
    density: float
    encode_secs: float

class PublisherStatus(TypedDict):
    stream_id: str
    last_published: Optional[int]
    next_step: int
    last_delta_ready: Optional[int]
    last_anchor_ready: Optional[int]
    queue_depth: int
    anchors_in_flight: int
    bytes_uploaded: int
    coalesced: int
    failures: int
    last_error: Optional[str]
    last_ratio: float
    last_delta_bytes: int

class SyncResult(TypedDict, total=False):
    step: int
    root: str
    route: str  # "up_to_date" | "fast" | "catchup" | "anchor"
    bytes: int
    deltas: int
    refused: List[Tuple[str, int, str]]  # (kind, step, reason) of newer steps left out
    path: str  # sync_dir only

def generate_key() -> Tuple[str, str, str]:
    """(private PKCS#8 PEM, public SPKI PEM, key id)."""

def public_key(signing_key: str) -> str: ...

class Publisher:
    def __init__(
        self,
        bucket_url: str,
        signing_key: Optional[str] = None,
        anchor_every: int = 50,
        queue_depth: int = 4,
        new_stream: bool = False,
        endpoint: Optional[str] = None,
        allow_http: bool = False,
        region: Optional[str] = None,
        takeover: bool = False,
        max_retries: Optional[int] = None,
        retry_timeout: Optional[float] = None,
        spool_dir: Optional[str] = None,
        value_mode: Optional[str] = None,
        max_shard_bytes: Optional[int] = None,
        anchor_chain_fraction: Optional[float] = None,
        extra_files: Optional[Union[Mapping[str, bytes], Sequence[str]]] = None,
    ) -> None: ...
    def publish(self, step: int, tensors: Mapping[str, Any]) -> PublishReceipt: ...
    def set_extra_files(self, files: Union[Mapping[str, bytes], Sequence[str]]) -> List[str]:
        """Replace the non-weight files shipped with anchors; a change makes the next step an
        anchor-only step."""
    def flush(self) -> None:
        """Publish the newest coalesced step (if any), then wait for every upload. A newest
        step that did not reach the bucket is published again, once, as an anchor. Returns
        when the newest published step is in the bucket; raises when it is still not (call
        ``flush`` or ``publish`` of that step again later). Failures of steps a newer one
        superseded are counted in ``status()``, not raised."""
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def status(self) -> PublisherStatus: ...
    def __enter__(self) -> "Publisher": ...
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None: ...
    def _last_input_addresses(self) -> Dict[str, int]: ...

class Follower:
    def __init__(
        self,
        bucket_url: str,
        trusted_keys: Optional[Sequence[str]] = None,
        allow_unsigned: bool = False,
        endpoint: Optional[str] = None,
        allow_http: bool = False,
        region: Optional[str] = None,
        max_retries: Optional[int] = None,
        retry_timeout: Optional[float] = None,
        refuse_for: float = 30.0,
        chain_memory: int = 268435456,
    ) -> None: ...
    def poll(self) -> Optional[int]: ...
    def sync_dir(self, path: str) -> SyncResult: ...
    def apply_to(self, tensors: Mapping[str, Any], step: Optional[int] = None) -> SyncResult: ...
    def iter_patches(
        self, step: Optional[int] = None
    ) -> Iterator[Tuple[str, Optional[npt.NDArray[np.int64]], npt.NDArray[Any]]]: ...
    def reset(self) -> None: ...
    @property
    def applied_step(self) -> Optional[int]: ...
    @property
    def patch_step(self) -> Optional[int]: ...

def shard(
    data: Any,
    shape: Sequence[int],
    offsets: Optional[Sequence[int]] = None,
    flat_offset: Optional[int] = None,
    replica: int = 0,
) -> Dict[str, Any]: ...

class ShardedPublisher:
    def __init__(
        self,
        bucket_url: str,
        rank: int,
        world_size: int,
        signing_key: Optional[str] = None,
        anchor_every: int = 50,
        commit_timeout: float = 120.0,
        new_stream: bool = False,
        endpoint: Optional[str] = None,
        allow_http: bool = False,
        region: Optional[str] = None,
        takeover: bool = False,
        max_retries: Optional[int] = None,
        retry_timeout: Optional[float] = None,
        spool_dir: Optional[str] = None,
        max_shard_bytes: Optional[int] = None,
    ) -> None: ...
    def publish(self, step: int, shards: Mapping[str, Dict[str, Any]]) -> Dict[str, Any]: ...
    def flush(self) -> Dict[str, Any]: ...
    def wait_sent(self) -> Optional[Dict[str, Any]]: ...
    def last_outcome(self) -> Optional[Dict[str, Any]]: ...
    def last_part(self) -> Optional[Dict[str, Any]]: ...
    def close(self) -> None: ...
    @property
    def generation(self) -> Optional[int]: ...
    def __enter__(self) -> "ShardedPublisher": ...
    def __exit__(self, *args: Any) -> None: ...
