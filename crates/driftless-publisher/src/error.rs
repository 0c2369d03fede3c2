//! Errors of the publisher.

/// Publisher errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Bucket trouble.
    #[error(transparent)]
    Store(#[from] driftless_store::Error),
    /// Reading the existing stream failed.
    #[error(transparent)]
    Stream(#[from] driftless_store::stream::StreamError),
    /// Encoding or input problem.
    #[error(transparent)]
    Format(#[from] driftless_format::Error),
    /// The bucket holds a stream this publisher may not continue (another key), or objects
    /// that are not a stream.
    #[error("refusing to publish: {0}")]
    Refused(String),
    /// A sharded rank waited until its deadline for another rank's work (rank 0's stream or
    /// committer lease): that rank may still be starting, so trying again can help.
    #[error("gave up waiting: {0}")]
    Waited(String),
    /// A write-once object of the stream already exists: another publisher is writing this
    /// stream (or wrote this step before). The publisher stops: every later `publish` and
    /// `flush` returns this error, so two trainers never interleave one chain.
    #[error("conflict at step {step}: {detail}; another publisher is writing this stream")]
    Conflict {
        /// Step whose object existed.
        step: u64,
        /// The key and cause.
        detail: String,
    },
    /// Steps must increase.
    #[error("step {step} is not after the last published step {last}")]
    StepOrder {
        /// Offered step.
        step: u64,
        /// Last step published.
        last: u64,
    },
    /// A step at or before the newest one that is committed with other weights.
    #[error("step {step} cannot be published: {detail}; publish a later step")]
    StepTaken {
        /// Step.
        step: u64,
        /// What the bucket holds.
        detail: String,
    },
    /// Saved weights offered to `seed` do not match the bucket; the next step is an anchor.
    #[error("saved publisher state not used: {0}")]
    Seed(String),
    /// The weights given to [`Publisher::publish_checked`](crate::Publisher::publish_checked)
    /// changed while they were read: the step was not published. Reading them again can help.
    #[error("the weights of step {step} changed while they were read; it was not published")]
    InputChanged {
        /// Step.
        step: u64,
    },
    /// The publisher was closed.
    #[error("publisher is closed")]
    Closed,
    /// A background upload failed; the chain recovers with an anchor at the next publish.
    #[error("upload of step {step} failed: {detail}")]
    Upload {
        /// Step.
        step: u64,
        /// Cause.
        detail: String,
        /// Whether the cause may pass by itself (bucket trouble, a lapsed lease), as opposed
        /// to one that needs someone to act (a full or capped spool disk, a denied write).
        retryable: bool,
    },
    /// Local I/O (spool files).
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// Whether retrying may help.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Store(e) => e.is_retryable(),
            Error::Stream(e) => e.is_retryable(),
            Error::Format(e) => e.is_retryable(),
            Error::Upload { retryable, .. } => *retryable,
            Error::Waited(_) | Error::InputChanged { .. } => true,
            // A full spool disk or quota needs someone to act first.
            Error::Io(e) => driftless_format::io_is_retryable(e),
            Error::Refused(_)
            | Error::Conflict { .. }
            | Error::StepOrder { .. }
            | Error::StepTaken { .. }
            | Error::Seed(_)
            | Error::Closed => false,
        }
    }
}

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
