//! Agent errors.

/// Errors of the agent.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading the stream failed.
    #[error(transparent)]
    Stream(#[from] driftless_store::stream::StreamError),
    /// Bucket trouble.
    #[error(transparent)]
    Store(#[from] driftless_store::Error),
    /// Format, verification or local I/O.
    #[error(transparent)]
    Format(#[from] driftless_format::Error),
    /// Nothing to sync from: the stream has no ready anchor reachable.
    #[error("no reachable state in the stream yet")]
    NothingReady,
    /// The inference server did not take the new weights.
    #[error("notify {target} failed: {detail}")]
    Notify {
        /// Adapter.
        target: String,
        /// Cause.
        detail: String,
    },
    /// A step's ready marker or signed manifest failed verification (forged, replayed from
    /// another step, swapped): the step is left out of planning until its marker changes; the
    /// local state is kept.
    #[error("{kind:?} step {step} refused: {detail}")]
    Refused {
        /// Delta or anchor.
        kind: driftless_format::StepKind,
        /// The step.
        step: u64,
        /// Why.
        detail: String,
    },
    /// Local I/O.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// Whether trying again later may help (as opposed to discarding state).
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Stream(e) => e.is_retryable(),
            Error::Store(e) => e.is_retryable() || e.is_not_found(),
            Error::Format(e) => e.is_retryable(),
            Error::NothingReady | Error::Notify { .. } | Error::Io(_) => true,
            Error::Refused { .. } => false,
        }
    }

    /// Whether a step of the stream was refused as forged or replayed (see [`Error::Refused`]).
    pub fn is_refused(&self) -> bool {
        matches!(self, Error::Refused { .. })
    }

    /// A manifest read failed: integrity failures refuse the step, the rest pass through.
    pub(crate) fn manifest(
        kind: driftless_format::StepKind,
        step: u64,
        e: driftless_store::stream::StreamError,
    ) -> Error {
        let e = Error::from(e);
        if e.is_integrity() {
            Error::Refused { kind, step, detail: e.to_string() }
        } else {
            e
        }
    }
    /// Whether local state may be bad or an object was bad: the agent discards local state
    /// and recovers from an anchor.
    pub fn is_integrity(&self) -> bool {
        use driftless_format::ErrorKind as K;
        let f = match self {
            Error::Format(e) => Some(e),
            Error::Stream(driftless_store::stream::StreamError::Format(e)) => Some(e),
            _ => None,
        };
        f.is_some_and(|e| matches!(e.kind(), K::Corrupt | K::Untrusted | K::WrongBase))
    }
}

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
