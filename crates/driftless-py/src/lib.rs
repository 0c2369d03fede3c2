//! Python bindings of driftless (`driftless._native`). The Python package `driftless` wraps
//! these classes; see `python/driftless/__init__.py` for the documented API.
//!
//! Every call that touches tensor memory or the network releases the GIL. Tensor memory is
//! borrowed (buffer protocol or DLPack), never copied by the binding.

mod errors;
mod follower;
mod held;
mod publisher;
mod sharded;
mod tensors;

use driftless_store::StoreOptions;
use pyo3::prelude::*;

/// Runs `fut` (on a runtime, without the GIL) until it ends or a signal handler of the main
/// thread raises (Ctrl-C's `KeyboardInterrupt`), checked every 100 ms; the future is then
/// dropped. Only for work that may be abandoned at any point: reads of the bucket, never
/// writes into a caller's arrays or a directory.
pub(crate) async fn interruptible<T>(fut: impl std::future::Future<Output = T>) -> Result<T, PyErr> {
    let signals = async {
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            if let Err(e) = Python::with_gil(|py| py.check_signals()) {
                return e;
            }
        }
    };
    tokio::pin!(fut);
    tokio::pin!(signals);
    std::future::poll_fn(|cx| {
        use std::future::Future;
        use std::task::Poll;
        if let Poll::Ready(v) = fut.as_mut().poll(cx) {
            return Poll::Ready(Ok(v));
        }
        signals.as_mut().poll(cx).map(Err)
    })
    .await
}

/// Runs blocking `f` on a thread of its own and waits for it without the GIL, checking for a
/// signal every 100 ms: Ctrl-C raises `KeyboardInterrupt` at once while `f` goes on in the
/// background (found by review: a flush or a commit wait ignored Ctrl-C for up to its whole
/// retry budget or commit timeout). Only for work that may be left running and reads no
/// caller memory: a flush, a close (whose uploads then end with the process).
pub(crate) fn wait_interruptible<T: Send + 'static>(
    py: Python<'_>,
    f: impl FnOnce() -> T + Send + 'static,
) -> PyResult<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("driftless-wait".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| errors::BindError::Internal(format!("cannot start a thread: {e}")))?;
    let mut rx = rx;
    loop {
        // (The receiver crosses `allow_threads` by value: it is not `Sync`.)
        let (r, back) = py.allow_threads(move || (rx.recv_timeout(std::time::Duration::from_millis(100)), rx));
        rx = back;
        match r {
            Ok(v) => return Ok(v),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => py.check_signals()?,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(errors::BindError::Internal("the waiting thread panicked".into()).into())
            }
        }
    }
}

/// Store options from the keyword arguments both classes take.
pub(crate) fn store_options(
    endpoint: Option<String>,
    allow_http: bool,
    region: Option<String>,
    max_retries: Option<usize>,
    retry_timeout: Option<f64>,
) -> PyResult<StoreOptions> {
    // An `http://` endpoint says plain HTTP is meant, as the CLI takes it; without this the
    // client refused every request and the error looked temporary (found by review).
    let http = endpoint.as_deref().is_some_and(driftless_store::is_plain_http);
    let mut o = StoreOptions::new().with_allow_http(allow_http || http);
    if let Some(e) = endpoint {
        o = o.with_endpoint(e);
    }
    if let Some(r) = region {
        o = o.with_region(r);
    }
    if let Some(n) = max_retries {
        o = o.with_max_retries(n);
    }
    if let Some(t) = retry_timeout {
        o = o.with_retry_timeout(publisher::secs(t)?);
    }
    Ok(o)
}

/// Generates a signing key: returns `(private_pkcs8_pem, public_spki_pem, key_id)`.
#[pyfunction]
fn generate_key() -> PyResult<(String, String, String)> {
    crate::errors::guard(|| {
        let k = driftless_format::Keypair::generate();
        let private = k.to_pem().map_err(errors::BindError::from)?;
        let public = k.public_pem().map_err(errors::BindError::from)?;
        Ok((private, public, k.id().to_string()))
    })
}

/// Public key (SPKI PEM) of a private key given as PEM text or a path.
#[pyfunction]
fn public_key(signing_key: &str) -> PyResult<String> {
    crate::errors::guard(|| {
        let k = publisher::read_key(signing_key)?;
        Ok(k.public_pem().map_err(errors::BindError::from)?)
    })
}

/// Test hook: panics inside the boundary guard, to prove a panic surfaces as
/// `driftless.errors.InternalError` (tests/test_inputs.py).
#[pyfunction]
fn _panic_for_tests(message: &str) -> PyResult<()> {
    crate::errors::guard(|| panic!("{message}"))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<publisher::PyPublisher>()?;
    m.add_class::<follower::PyFollower>()?;
    m.add_class::<sharded::PyShardedPublisher>()?;
    m.add_function(wrap_pyfunction!(generate_key, m)?)?;
    m.add_function(wrap_pyfunction!(public_key, m)?)?;
    m.add_function(wrap_pyfunction!(_panic_for_tests, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
