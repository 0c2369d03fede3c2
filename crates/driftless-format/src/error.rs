//! One error type for the format crate.
//!
//! Callers (the agent above all) must tell "try again later" from "this object is bad" from
//! "this object is forged" without parsing text, so every variant maps to an [`ErrorKind`].

use std::path::PathBuf;

/// What kind of failure an [`Error`] is, for callers that decide between retrying,
/// discarding state and alarming.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Local I/O failed (disk full, permission, ...). Retrying may help.
    Io,
    /// Bytes that claim to be driftless data are malformed, truncated or exceed a limit.
    /// Retrying the same object will not help; fetching another copy might.
    Corrupt,
    /// A signature is missing, unknown or wrong. Never retry, never apply.
    Untrusted,
    /// A delta was offered to a base it was not made for.
    WrongBase,
    /// The caller passed something unusable (bad name, bad shape, unsupported option).
    InvalidInput,
}

/// Errors of the format crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// I/O on a local path.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Malformed, truncated or oversized input.
    #[error("corrupt {what}: {detail}")]
    Corrupt {
        /// What was being decoded ("segment", "manifest", "anchor shard", ...).
        what: &'static str,
        /// What exactly is wrong.
        detail: String,
    },
    /// Signature checks failed.
    #[error("untrusted {what}: {detail}")]
    Untrusted {
        /// What was being verified.
        what: &'static str,
        /// Why it is refused.
        detail: String,
    },
    /// The delta's declared base does not match the local state.
    #[error("wrong base: delta expects base root {expected}, local state has {actual}")]
    WrongBase {
        /// Base root declared by the delta.
        expected: String,
        /// Root of the state it was offered.
        actual: String,
    },
    /// The caller passed something unusable.
    #[error("invalid input: {0}")]
    InvalidInput(String),
}

impl Error {
    /// The kind of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Io { .. } => ErrorKind::Io,
            Error::Corrupt { .. } => ErrorKind::Corrupt,
            Error::Untrusted { .. } => ErrorKind::Untrusted,
            Error::WrongBase { .. } => ErrorKind::WrongBase,
            Error::InvalidInput(_) => ErrorKind::InvalidInput,
        }
    }

    /// Whether retrying the same operation may succeed. Only local I/O qualifies (and not all
    /// of it, see [`io_is_retryable`]): a corrupt or forged object stays corrupt or forged.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Io { source, .. } => io_is_retryable(source),
            _ => false,
        }
    }

    /// A [`Error::Corrupt`] whose detail is made one bounded line ([`one_line`]): every crate
    /// that reports bad bucket bytes builds its error here, so none quotes them unbounded.
    pub fn corrupt(what: &'static str, detail: impl Into<String>) -> Self {
        Error::Corrupt { what, detail: one_line(&detail.into()) }
    }

    pub(crate) fn untrusted(what: &'static str, detail: impl Into<String>) -> Self {
        Error::Untrusted { what, detail: one_line(&detail.into()) }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }

    pub(crate) fn invalid(detail: impl Into<String>) -> Self {
        Error::InvalidInput(one_line(&detail.into()))
    }
}

/// Most bytes of an error's detail kept by [`one_line`].
pub const MAX_DETAIL: usize = 1024;

/// `detail` made fit for one line of a log or a status page: control characters (a newline
/// above all) escaped, and cut after [`MAX_DETAIL`] bytes with the full length said. Error
/// details quote what was read, and what was read from a bucket is hostile: a parser's error
/// quoted a planted 60 MB string whole, which the agent then kept in its list of refused steps
/// and logged again at every poll (found by review).
pub fn one_line(detail: &str) -> String {
    one_line_within(detail, MAX_DETAIL)
}

/// [`one_line`] cut after `max` bytes instead (for text that wraps details already cut, which a
/// second cut at the same length would cut again and misreport).
pub fn one_line_within(detail: &str, max: usize) -> String {
    let mut out = String::with_capacity(detail.len().min(max + 32));
    for (i, c) in detail.char_indices() {
        if out.len() >= max {
            out.push_str(&format!("... ({} bytes in all, {} more)", detail.len(), detail.len() - i));
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Result alias of the format crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Whether a local I/O error may go away by itself. A full disk or quota, a read-only file
/// system, a permission, a missing or existing path, an unsupported operation or bad input
/// needs someone to act first (free space, fix the mount, point at another directory):
/// retrying the same call as it is only repeats the failure, often after a full download.
pub fn io_is_retryable(e: &std::io::Error) -> bool {
    use std::io::ErrorKind as K;
    !matches!(
        e.kind(),
        K::StorageFull
            | K::QuotaExceeded
            | K::ReadOnlyFilesystem
            | K::FileTooLarge
            | K::PermissionDenied
            | K::NotFound
            | K::AlreadyExists
            | K::InvalidInput
            | K::InvalidData
            | K::Unsupported
            | K::NotADirectory
            | K::IsADirectory
            | K::DirectoryNotEmpty
            | K::InvalidFilename
            | K::CrossesDevices
            | K::TooManyLinks
            | K::NotSeekable
    )
}

#[cfg(test)]
mod tests {
    use std::io::{Error as IoError, ErrorKind as K};

    use super::{io_is_retryable, Error};

    /// A full disk is not "try again": retrying a sync that spools a model into it only
    /// downloads the model again and fails again.
    #[test]
    fn local_io_errors_that_need_someone_to_act_are_not_retryable() {
        // A path through a regular file, or a directory where a file goes (found by review:
        // "this looks temporary" for a typo'd --dir or --state).
        for k in [
            K::StorageFull,
            K::QuotaExceeded,
            K::ReadOnlyFilesystem,
            K::PermissionDenied,
            K::NotFound,
            K::NotADirectory,
            K::IsADirectory,
            K::FileTooLarge,
        ] {
            assert!(!io_is_retryable(&IoError::from(k)), "{k:?}");
            assert!(!Error::io("/x", IoError::from(k)).is_retryable(), "{k:?}");
        }
        for k in [K::Interrupted, K::TimedOut, K::WouldBlock, K::Other] {
            assert!(io_is_retryable(&IoError::from(k)), "{k:?}");
        }
    }
}
