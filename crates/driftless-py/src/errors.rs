//! Rust errors to Python exceptions. The exception classes live in `driftless/errors.py` (so
//! they can inherit from both `DriftlessError` and a builtin such as `ValueError`); this module
//! picks the class from the error's kind, never from its text.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyType;

/// Every failure of the binding, kept typed until it crosses into Python.
#[derive(Debug)]
pub(crate) enum BindError {
    Format(driftless_format::Error),
    Store(driftless_store::Error),
    Stream(driftless_store::stream::StreamError),
    Publisher(driftless_publisher::Error),
    Agent(driftless_agent::Error),
    /// The stream changed its tensor set: caller-owned arrays cannot follow in place.
    LayoutChanged {
        step: u64,
        detail: String,
    },
    /// Nothing reachable yet.
    NothingReady(String),
    /// The only route left goes through a step whose objects are missing: retrying can help.
    Missing(String),
    /// The only route left goes through a step refused for now (its class from its fault).
    Refused(driftless_agent::Fault, String),
    /// Bad arguments.
    Input(String),
    /// A panic caught at the boundary: a bug, reported as a `DriftlessError` so that
    /// `except Exception` (and `except DriftlessError`) in a trainer catches it.
    Internal(String),
}

impl From<driftless_format::Error> for BindError {
    fn from(e: driftless_format::Error) -> Self {
        BindError::Format(e)
    }
}
impl From<driftless_store::Error> for BindError {
    fn from(e: driftless_store::Error) -> Self {
        BindError::Store(e)
    }
}
impl From<driftless_store::stream::StreamError> for BindError {
    fn from(e: driftless_store::stream::StreamError) -> Self {
        BindError::Stream(e)
    }
}
impl From<driftless_publisher::Error> for BindError {
    fn from(e: driftless_publisher::Error) -> Self {
        BindError::Publisher(e)
    }
}
impl From<driftless_agent::Error> for BindError {
    fn from(e: driftless_agent::Error) -> Self {
        BindError::Agent(e)
    }
}

pub(crate) type BindResult<T> = Result<T, BindError>;

/// The exception classes of `driftless/errors.py` the binding raises, typed so that what is
/// decided from an error's class (a refused step's fault) is never decided from a name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    Driftless,
    Retryable,
    Corrupt,
    Untrusted,
    WrongBase,
    InvalidInput,
    NothingReady,
    Closed,
    LayoutChanged,
    Internal,
}

impl Class {
    /// The Python class name.
    fn name(self) -> &'static str {
        match self {
            Class::Driftless => "DriftlessError",
            Class::Retryable => "RetryableError",
            Class::Corrupt => "CorruptError",
            Class::Untrusted => "UntrustedError",
            Class::WrongBase => "WrongBaseError",
            Class::InvalidInput => "InvalidInputError",
            Class::NothingReady => "NothingReadyError",
            Class::Closed => "ClosedError",
            Class::LayoutChanged => "LayoutChangedError",
            Class::Internal => "InternalError",
        }
    }
}

fn format_class(e: &driftless_format::Error) -> Class {
    use driftless_format::ErrorKind as K;
    match e.kind() {
        K::Io if e.is_retryable() => Class::Retryable,
        K::Corrupt => Class::Corrupt,
        K::Untrusted => Class::Untrusted,
        K::WrongBase => Class::WrongBase,
        K::InvalidInput => Class::InvalidInput,
        _ => Class::Driftless,
    }
}

fn store_class(e: &driftless_store::Error) -> Class {
    use driftless_store::Error as E;
    if e.is_retryable() {
        return Class::Retryable;
    }
    match e {
        E::InvalidUrl(_) | E::InvalidKey { .. } | E::InvalidEndpoint { .. } | E::MissingCredentials(_) => {
            Class::InvalidInput
        }
        // An object larger than its signed manifest (or a reader's bound) allows: the step is
        // bad, as for the agent (found by review: a Follower raised a plain DriftlessError at
        // every call instead of refusing the step and taking the next route).
        E::TooLarge { .. } => Class::Corrupt,
        _ => Class::Driftless,
    }
}

/// A store error while reading the stream: a missing object under a plan is eventual
/// consistency or a GC race, retryable as for the agent (found by review: a NotFound out of
/// the anchor stream was a plain DriftlessError). (For a publisher a 404 may be a missing
/// bucket: [`store_class`] alone.)
fn read_class(e: &driftless_store::Error) -> Class {
    if e.is_not_found() {
        return Class::Retryable;
    }
    store_class(e)
}

/// The class of a refused step's fault: the class its refusing error had.
fn fault_class(f: driftless_agent::Fault) -> Class {
    use driftless_agent::Fault as F;
    match f {
        F::Missing => Class::Retryable,
        F::Corrupt => Class::Corrupt,
        F::Untrusted => Class::Untrusted,
        F::WrongBase => Class::WrongBase,
    }
}

fn stream_class(e: &driftless_store::stream::StreamError) -> Class {
    use driftless_store::stream::StreamError as S;
    match e {
        S::Format(f) => format_class(f),
        S::Store(s) => read_class(s),
        _ if e.is_retryable() => Class::Retryable,
        _ => Class::Driftless,
    }
}

impl BindError {
    /// What is wrong with the step being loaded, when the step is at fault (it is refused, not
    /// retried): its objects missing ([`Self::is_missing`]), or a verification failure
    /// (corrupt, untrusted, another base) by its class.
    pub(crate) fn fault(&self) -> Option<driftless_agent::Fault> {
        use driftless_agent::Fault as F;
        if self.is_missing() {
            return Some(F::Missing);
        }
        match self.class_and_message().0 {
            Class::Corrupt => Some(F::Corrupt),
            Class::Untrusted => Some(F::Untrusted),
            Class::WrongBase => Some(F::WrongBase),
            _ => None,
        }
    }

    /// Whether the step's manifest or objects are missing (GC collected them after they were
    /// planned, or a stale `latest.json` names a step that is gone). Refused like a bad step,
    /// flagged missing, so the next best route is taken: the agent's rule.
    pub(crate) fn is_missing(&self) -> bool {
        use driftless_agent::Error as A;
        use driftless_store::stream::StreamError as S;
        let stream = |e: &S| match e {
            S::NotReady { .. } => true,
            S::Store(s) => s.is_not_found() || s.is_unreadable(),
            _ => false,
        };
        match self {
            // (Unreadable: there, but refused by the store for good; the agent's rule.)
            BindError::Store(s) | BindError::Agent(A::Store(s)) => s.is_not_found() || s.is_unreadable(),
            BindError::Stream(e) | BindError::Agent(A::Stream(e)) => stream(e),
            _ => false,
        }
    }

    /// The message the Python exception carries.
    pub(crate) fn message(&self) -> String {
        self.class_and_message().1
    }

    fn class_and_message(&self) -> (Class, String) {
        use driftless_agent::Error as A;
        use driftless_publisher::Error as P;
        match self {
            BindError::Format(e) => (format_class(e), e.to_string()),
            BindError::Store(e) => (read_class(e), e.to_string()),
            BindError::Stream(e) => (stream_class(e), e.to_string()),
            BindError::Publisher(e) => {
                let class = match e {
                    P::Format(f) => format_class(f),
                    P::Store(s) => store_class(s),
                    P::Stream(s) => stream_class(s),
                    P::Closed => Class::Closed,
                    P::StepOrder { .. } | P::StepTaken { .. } => Class::InvalidInput,
                    _ if e.is_retryable() => Class::Retryable,
                    _ => Class::Driftless,
                };
                (class, e.to_string())
            }
            BindError::Agent(e) => {
                let class = match e {
                    A::Format(f) => format_class(f),
                    A::Store(s) => read_class(s),
                    A::Stream(s) => stream_class(s),
                    A::NothingReady => Class::NothingReady,
                    // No route left but through a step that failed its checks: bad data (the
                    // CLI's exit 1), never a plain DriftlessError (found by review).
                    A::Refused { fault, .. } => fault_class(*fault),
                    _ if e.is_retryable() => Class::Retryable,
                    _ => Class::Driftless,
                };
                (class, e.to_string())
            }
            BindError::LayoutChanged { step, detail } => {
                (Class::LayoutChanged, format!("the tensor set changed at step {step}: {detail}"))
            }
            BindError::NothingReady(m) => (Class::NothingReady, m.clone()),
            BindError::Missing(m) => (Class::Retryable, m.clone()),
            BindError::Refused(f, m) => (fault_class(*f), m.clone()),
            BindError::Input(m) => (Class::InvalidInput, m.clone()),
            BindError::Internal(m) => (
                Class::Internal,
                format!("internal error in driftless (a bug; please report it with this message): {m}"),
            ),
        }
    }
}

/// The exception class `name` of `driftless.errors`.
fn class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyType>> {
    let m = py.import("driftless.errors")?;
    Ok(m.getattr(name)?.downcast_into::<PyType>()?)
}

impl From<BindError> for PyErr {
    fn from(e: BindError) -> PyErr {
        let (c, msg) = e.class_and_message();
        let name = c.name();
        Python::with_gil(|py| match class(py, name) {
            Ok(c) => PyErr::from_type(c, msg),
            Err(_) => PyRuntimeError::new_err(format!("{name}: {msg}")),
        })
    }
}

/// The process an object was created in. Its tokio runtime's threads do not exist in a
/// child made by `fork()`: there every blocking call waited forever, and Ctrl-C could not
/// stop it (found by review; gunicorn `--preload`, multiprocessing's fork start method). Such
/// calls now raise `InvalidInputError`, and the object is leaked, not shut down, when the
/// child drops it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Origin(u32);

impl Origin {
    pub(crate) fn here() -> Origin {
        Origin(std::process::id())
    }

    /// Whether this is a forked child of the creating process.
    pub(crate) fn forked(&self) -> bool {
        self.0 != std::process::id()
    }

    /// An error in a forked child of the creating process.
    pub(crate) fn check(&self, what: &str) -> Result<(), BindError> {
        if self.forked() {
            return Err(BindError::Input(format!(
                "this {what} was created in process {} and cannot be used after fork() (process {}): create one in this process",
                self.0,
                std::process::id()
            )));
        }
        Ok(())
    }
}

/// `InvalidInputError(msg)` (a `ValueError`).
pub(crate) fn invalid(msg: impl Into<String>) -> PyErr {
    BindError::Input(msg.into()).into()
}

/// Runs the body of a Python entry point, turning a Rust panic into `InternalError` (a
/// `DriftlessError`) instead of pyo3's `PanicException`, a `BaseException` that
/// `except Exception` does not catch and that would kill a trainer. Every `#[pymethods]`
/// method and `#[pyfunction]` of this crate goes through it.
pub(crate) fn guard<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panic with a non-string payload".into());
            Err(BindError::Internal(msg).into())
        }
    }
}
