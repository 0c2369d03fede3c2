//! What a Python publisher class holds until `close`: the Rust publisher behind a lock shared
//! with a flush or close still running after Ctrl-C (see [`crate::wait_interruptible`]), and
//! the process it was created in ([`Origin`]). One implementation of `close`, `closed` and
//! the drop for `Publisher` and `ShardedPublisher` (they were copies).

use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::Python;

use crate::errors::{BindError, Origin};

pub(crate) struct Held<T: Send + 'static> {
    inner: Arc<Mutex<Option<T>>>,
    origin: Origin,
    /// The Python class, for errors.
    what: &'static str,
}

impl<T: Send + 'static> Held<T> {
    pub(crate) fn new(t: T, what: &'static str) -> Self {
        Held { inner: Arc::new(Mutex::new(Some(t))), origin: Origin::here(), what }
    }

    /// An error in a forked child of the creating process.
    pub(crate) fn check(&self) -> Result<(), BindError> {
        self.origin.check(self.what)
    }

    /// Whether this is a forked child of the creating process.
    pub(crate) fn forked(&self) -> bool {
        self.origin.forked()
    }

    /// The lock (a panic while it was held does not make it unusable). Callers holding the
    /// GIL take it inside `allow_threads`: a flush in another thread may hold it for the
    /// store's retry budget.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Option<T>> {
        lock(&self.inner)
    }

    /// The lock itself, for work that may outlive the call (`wait_interruptible`).
    pub(crate) fn shared(&self) -> Arc<Mutex<Option<T>>> {
        self.inner.clone()
    }

    /// Takes the object out and runs `close` on it, Ctrl-C stopping the wait (not the close).
    /// Idempotent: closed already, nothing to do.
    pub(crate) fn close<E>(
        &self,
        py: Python<'_>,
        close: impl FnOnce(T) -> Result<(), E> + Send + 'static,
    ) -> pyo3::PyResult<()>
    where
        E: Send + 'static,
        BindError: From<E>,
    {
        crate::errors::guard(|| {
            self.check()?;
            let inner = self.shared();
            crate::wait_interruptible(py, move || lock(&inner).take().map_or(Ok(()), close))?
                .map_err(BindError::from)?;
            Ok(())
        })
    }

    /// Whether `close` was called. Without the GIL: another thread's `flush` may hold the lock
    /// for the store's retry budget (found by review: `closed`, read by `repr` and the exit
    /// hook, froze every Python thread for a minute). In a forked child it is closed for this
    /// process (and its lock may never be free).
    pub(crate) fn closed(&self, py: Python<'_>) -> pyo3::PyResult<bool> {
        if self.forked() {
            return Ok(true);
        }
        crate::errors::guard(|| Ok(py.allow_threads(|| self.lock().is_none())))
    }
}

impl<T: Send + 'static> Drop for Held<T> {
    /// A publisher garbage-collected without `close` flushes its queued steps, or waits for
    /// its step in flight (see the publishers' own `Drop`): without the GIL, so that the rest
    /// of the interpreter runs meanwhile; leaked in a forked child.
    fn drop(&mut self) {
        if self.origin.forked() {
            // Leaked whole, lock untouched: its runtime's threads, and whoever held the lock
            // at fork time, are the parent's (see `Origin`).
            std::mem::forget(self.inner.clone());
            return;
        }
        // The lock is taken without the GIL too: a flush left running by Ctrl-C may hold it
        // (found by review: every Python thread froze until it ended).
        let inner = self.inner.clone();
        Python::with_gil(|py| py.allow_threads(move || drop(lock(&inner).take())));
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
