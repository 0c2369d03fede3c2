//! The crate's error type.

/// Everything that can go wrong planning or running a collection.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum Error {
    /// Listing, reading or deleting an object failed (after the bucket layer's retries).
    /// Nothing is left half-done that a re-run cannot finish: see the crate docs.
    #[error(transparent)]
    Store(#[from] driftless_store::Error),
    /// More than [`crate::MAX_UNVERIFIED`] ready markers of one kind, newest first, announce a
    /// manifest that fails the check agents make (planted, corrupt, or signed by another key
    /// than `--trust` names). Nothing is deleted: such markers would otherwise take the newest
    /// and kept places and let the real steps go.
    #[error(
        "{count} {kind} ready markers fail the manifest check (the oldest of them, step {step}: {reason}); \
         nothing deleted: remove them, or check --trust"
    )]
    Unverifiable {
        /// Delta or anchor.
        kind: driftless_format::StepKind,
        /// How many failed.
        count: usize,
        /// The last one checked.
        step: u64,
        /// Why it failed.
        reason: String,
    },
    /// The prefix holds ready markers but no readable `stream.json`, so GC cannot tell this
    /// stream's markers from another's. Nothing is deleted.
    #[error(
        "{}: {reason}; nothing deleted: restore it from the publisher (markers of any stream would be believed)",
        driftless_store::layout::STREAM
    )]
    NoStream {
        /// Why it could not be read.
        reason: String,
    },
    /// A duration setting could not be parsed (`--grace 10m`).
    #[error("invalid duration {input:?}: {reason}")]
    InvalidDuration {
        /// The rejected text.
        input: String,
        /// Why it was rejected.
        reason: String,
    },
}

impl Error {
    /// Whether running the collection again later may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Store(e) => e.is_retryable(),
            Error::InvalidDuration { .. } | Error::Unverifiable { .. } | Error::NoStream { .. } => false,
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
