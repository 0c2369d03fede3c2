//! The crate's error type.

/// Everything that can go wrong planning or running a collection.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum Error {
    /// Listing, reading or deleting an object failed (after the bucket layer's retries).
    /// Nothing is left half-done that a re-run cannot finish: see the crate docs.
    #[error(transparent)]
    Store(#[from] driftless_store::Error),
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
            Error::InvalidDuration { .. } => false,
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
