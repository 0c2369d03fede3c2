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
    #[error("nothing to sync yet: no stream or no ready anchor at this URL (not published yet, or a wrong URL)")]
    NothingReady,
    /// The inference server did not take the new weights.
    #[error("notify {target} failed: {detail}")]
    Notify {
        /// Adapter.
        target: String,
        /// Cause.
        detail: String,
    },
    /// A step failed (forged, replayed, foreign, corrupt objects, a result that does not
    /// verify) and no other route was left: the step is left out of plans for a while and
    /// the verified local state is kept.
    #[error("{kind} step {step} refused: {detail}")]
    Refused {
        /// Delta or anchor.
        kind: driftless_format::StepKind,
        /// The step.
        step: u64,
        /// Why.
        detail: String,
        /// What was wrong (never [`Fault::Missing`](crate::plan::Fault::Missing): a step
        /// refused for missing objects is reported "not ready", which is retryable).
        fault: crate::plan::Fault,
    },
    /// The slot the next step must be built in is open by another process (a server still
    /// loading an older step from it): it is not rewritten until it is closed.
    #[error("{} is open by another process (a server still loading an older step?): not rewriting its slot until it is closed; serving the verified step meanwhile", file.display())]
    SlotInUse {
        /// The first open file found.
        file: std::path::PathBuf,
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
            Error::NothingReady | Error::Notify { .. } | Error::SlotInUse { .. } => true,
            // A full disk, a read-only slot directory: someone must act first.
            Error::Io(e) => driftless_format::io_is_retryable(e),
            Error::Refused { .. } => false,
        }
    }

    /// Whether a step of the stream was refused as forged or replayed (see [`Error::Refused`]).
    pub fn is_refused(&self) -> bool {
        matches!(self, Error::Refused { .. })
    }

    /// Whether verification failed (bad signature, corrupt object, wrong base, result root,
    /// refused step): exit code 1 in the CLI. The agent never discards verified weights for
    /// these; it refuses the step.
    pub fn is_integrity(&self) -> bool {
        use driftless_format::ErrorKind as K;
        if self.is_refused() {
            return true;
        }
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
