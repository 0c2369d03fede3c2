"""Exceptions raised by driftless.

Callers decide on the class, never on the message text:

- :class:`RetryableError`: storage trouble or a step not fully visible yet; try again later.
- :class:`CorruptError`: an object is malformed or does not match its signed manifest, or a
  result's weights root differs; the data is bad, retrying the same object will not help.
- :class:`UntrustedError`: a signature is missing, unknown or wrong. Never apply.
- :class:`WrongBaseError`: a delta was offered to weights it was not made for.
"""


class DriftlessError(Exception):
    """Base class of every driftless error."""


class RetryableError(DriftlessError):
    """Trying again later may succeed (network, throttling, eventual consistency, local I/O)."""


class NothingReadyError(RetryableError):
    """The stream has no reachable step yet (no ready anchor), or not the one asked for."""


class CorruptError(DriftlessError):
    """Bytes are malformed or do not match what a signed manifest says."""


class UntrustedError(DriftlessError):
    """A signature check failed: the object is not from a trusted publisher."""


class WrongBaseError(DriftlessError):
    """A delta does not apply to the weights it was offered."""


class InvalidInputError(DriftlessError, ValueError):
    """The caller passed something unusable (bad tensor set, step order, key, URL)."""


class ClosedError(DriftlessError, RuntimeError):
    """The publisher was closed."""


class InternalError(DriftlessError, RuntimeError):
    """A bug inside driftless (a Rust panic caught at the binding's boundary). Retrying will
    not help; please report the message."""


class LayoutChangedError(DriftlessError):
    """The stream's tensor set changed; arrays held by the caller cannot follow in place."""


__all__ = [
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
