//! `driftless._native.Publisher`: the trainer side.

use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use driftless_format::{Keypair, TensorView, ValueMode};
use driftless_publisher::{Outcome, Publisher, PublisherBuilder};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{invalid, BindError};
use crate::store_options;
use crate::tensors::{borrow_mapping, Raw};

/// Reads a signing key given as PEM text or as a path to a PEM file.
pub(crate) fn read_key(s: &str) -> Result<Keypair, BindError> {
    // A missing or malformed key is a configuration error, not a retryable I/O failure.
    let r = if s.contains("-----BEGIN") { Keypair::from_pem(s) } else { Keypair::read(Path::new(s)) };
    r.map_err(|e| BindError::Input(format!("signing key: {e}")))
}

/// The arguments both publisher classes take.
pub(crate) struct Common {
    pub(crate) bucket_url: String,
    pub(crate) signing_key: Option<String>,
    pub(crate) anchor_every: u64,
    pub(crate) new_stream: bool,
    pub(crate) takeover: bool,
    pub(crate) spool_dir: Option<String>,
    pub(crate) max_shard_bytes: Option<u64>,
}

impl Common {
    /// A publisher builder from the common arguments and store options.
    pub(crate) fn builder(self, opts: driftless_store::StoreOptions) -> Result<PublisherBuilder, BindError> {
        let mut b = PublisherBuilder::new(self.bucket_url)
            .with_store_options(opts)
            .with_anchor_every(self.anchor_every)
            .with_new_stream(self.new_stream)
            .with_takeover(self.takeover);
        if let Some(k) = self.signing_key {
            b = b.with_key(read_key(&k)?);
        }
        if let Some(d) = self.spool_dir {
            b = b.with_spool_dir(d);
        }
        if let Some(n) = self.max_shard_bytes {
            b = b.with_max_shard_bytes(n);
        }
        Ok(b)
    }
}

/// Low-level publisher; use `driftless.Publisher`.
#[pyclass(module = "driftless._native", name = "Publisher", subclass)]
pub(crate) struct PyPublisher {
    /// Shared with a flush or close still running after Ctrl-C (see `wait_interruptible`).
    inner: crate::held::Held<Publisher>,
    /// Addresses of the tensors the last `publish` read, for the zero-copy test.
    last_addrs: Mutex<Vec<(String, usize)>>,
}

#[pymethods]
impl PyPublisher {
    #[new]
    #[pyo3(signature = (bucket_url, signing_key=None, anchor_every=50, queue_depth=4, new_stream=false,
        endpoint=None, allow_http=false, region=None, takeover=false, max_retries=None, retry_timeout=None,
        spool_dir=None, value_mode=None, max_shard_bytes=None, anchor_chain_fraction=None, extra_files=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        bucket_url: String,
        signing_key: Option<String>,
        anchor_every: u64,
        queue_depth: usize,
        new_stream: bool,
        endpoint: Option<String>,
        allow_http: bool,
        region: Option<String>,
        takeover: bool,
        max_retries: Option<usize>,
        retry_timeout: Option<f64>,
        spool_dir: Option<String>,
        value_mode: Option<String>,
        max_shard_bytes: Option<u64>,
        anchor_chain_fraction: Option<f64>,
        extra_files: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        crate::errors::guard(|| {
            let opts = store_options(endpoint, allow_http, region, max_retries, retry_timeout)?;
            let common =
                Common { bucket_url, signing_key, anchor_every, new_stream, takeover, spool_dir, max_shard_bytes };
            let mut b = common.builder(opts)?.with_queue_depth(queue_depth);
            if let Some(v) = value_mode {
                let mode: ValueMode = v.parse().map_err(BindError::Format)?;
                b = b.with_delta_options(driftless_format::DeltaOptions { values: mode, ..Default::default() });
            }
            if let Some(f) = anchor_chain_fraction {
                b = b.with_anchor_chain_fraction(f);
            }
            if let Some(files) = extra_files {
                b = b.with_extra_files(read_extra_files(&files)?);
            }
            let p = py.allow_threads(|| b.build()).map_err(BindError::from)?;
            Ok(PyPublisher { inner: crate::held::Held::new(p, "Publisher"), last_addrs: Mutex::new(vec![]) })
        })
    }

    /// Replaces the small non-weight files shipped with anchors (`{name: bytes}` or a list
    /// of paths). A change makes the next step an anchor-only step. Returns the names that
    /// changed (added, removed or rewritten), sorted.
    fn set_extra_files(&self, py: Python<'_>, files: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
        crate::errors::guard(|| {
            self.inner.check()?;
            let f = read_extra_files(files)?;
            // The lock is held as long as another thread's `flush` blocks: wait without the GIL.
            let r = py.allow_threads(|| {
                let mut g = self.inner.lock();
                g.as_mut().ok_or(driftless_publisher::Error::Closed)?.set_extra_files(f)
            });
            Ok(r.map_err(BindError::from)?)
        })
    }

    /// Publishes the weights of `step`. Returns the receipt as a dict.
    fn publish<'py>(&self, py: Python<'py>, step: u64, tensors: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
        crate::errors::guard(|| {
            self.inner.check()?;
            let borrowed = borrow_mapping(tensors, false)?;
            let parts: Vec<(driftless_format::TensorMeta, Raw)> =
                borrowed.iter().map(|b| (b.meta.clone(), b.raw)).collect();
            *self.last_addrs.lock().unwrap_or_else(|e| e.into_inner()) =
                parts.iter().map(|(m, r)| (m.name.clone(), r.addr)).collect();
            let r = py.allow_threads(|| {
                // SAFETY: `borrowed` keeps every buffer alive until after this closure returns.
                let views: Vec<TensorView<'_>> = parts
                    .iter()
                    .map(|(m, r)| TensorView {
                        name: &m.name,
                        dtype: m.dtype,
                        shape: &m.shape,
                        data: unsafe { r.slice() },
                    })
                    .collect();
                let mut g = self.inner.lock();
                let p = g.as_mut().ok_or(driftless_publisher::Error::Closed)?;
                p.publish(step, &views)
            });
            drop(borrowed);
            let r = r.map_err(BindError::from)?;
            let d = PyDict::new(py);
            d.set_item("step", r.step)?;
            d.set_item(
                "outcome",
                match r.outcome {
                    Outcome::Delta => "delta",
                    Outcome::DeltaAndAnchor => "delta_and_anchor",
                    Outcome::Anchor => "anchor",
                    Outcome::Coalesced => "coalesced",
                    Outcome::AlreadyPublished => "already_published",
                },
            )?;
            d.set_item("delta_bytes", r.delta_bytes)?;
            d.set_item("ratio", r.ratio)?;
            d.set_item("density", r.density)?;
            d.set_item("encode_secs", r.encode_secs)?;
            Ok(d)
        })
    }

    /// Waits until every queued step and anchor is in the bucket.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        crate::errors::guard(|| {
            self.inner.check()?;
            let inner = self.inner.shared();
            crate::wait_interruptible(py, move || {
                let mut g = inner.lock().unwrap_or_else(|e| e.into_inner());
                g.as_mut().ok_or(driftless_publisher::Error::Closed)?.flush()
            })?
            .map_err(BindError::from)?;
            Ok(())
        })
    }

    /// Flushes and stops the uploader. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.close(py, |p| p.close())
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self, py: Python<'_>) -> PyResult<bool> {
        self.inner.closed(py)
    }

    /// Counters as a dict.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        crate::errors::guard(|| {
            self.inner.check()?;
            let s = py.allow_threads(|| self.inner.lock().as_ref().map(|p| (p.status(), p.next_step())));
            let Some((s, next)) = s else {
                return Err(BindError::Publisher(driftless_publisher::Error::Closed).into());
            };
            let d = PyDict::new(py);
            d.set_item("stream_id", s.stream_id)?;
            d.set_item("last_published", s.last_published)?;
            d.set_item("next_step", next)?;
            d.set_item("last_delta_ready", s.last_delta_ready)?;
            d.set_item("last_anchor_ready", s.last_anchor_ready)?;
            d.set_item("queue_depth", s.queue_depth)?;
            d.set_item("anchors_in_flight", s.anchors_in_flight)?;
            d.set_item("bytes_uploaded", s.bytes_uploaded)?;
            d.set_item("coalesced", s.coalesced)?;
            d.set_item("failures", s.failures)?;
            d.set_item("last_error", s.last_error)?;
            d.set_item("last_ratio", s.last_ratio)?;
            d.set_item("last_delta_bytes", s.last_delta_bytes)?;
            Ok(d)
        })
    }

    /// Test hook: `{name: address}` of the memory the last `publish` call read.
    fn _last_input_addresses<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        crate::errors::guard(|| {
            let d = PyDict::new(py);
            for (n, a) in self.last_addrs.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                d.set_item(n, *a)?;
            }
            Ok(d)
        })
    }
}

/// Seconds to a `Duration`, rejecting negatives and NaN.
pub(crate) fn secs(s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|_| invalid(format!("invalid duration {s}")))
}

/// `extra_files=`: a dict `{file name: bytes}` or a list of paths (shipped under their
/// base names).
fn read_extra_files(obj: &Bound<'_, PyAny>) -> Result<Vec<(String, Vec<u8>)>, BindError> {
    let invalid = BindError::Input;
    if let Ok(d) = obj.downcast::<PyDict>() {
        let mut out = vec![];
        for (k, v) in d.iter() {
            let name: String = k.extract().map_err(|_| invalid("extra_files keys must be file names (str)".into()))?;
            let data: Vec<u8> = v.extract().map_err(|_| invalid(format!("extra_files[{name:?}] must be bytes")))?;
            out.push((name, data));
        }
        return Ok(out);
    }
    let paths: Vec<std::path::PathBuf> =
        obj.extract().map_err(|_| invalid("extra_files must be a dict of name -> bytes or a list of paths".into()))?;
    paths
        .into_iter()
        .map(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            let data = std::fs::read(&p).map_err(|e| invalid(format!("reading extra file {}: {e}", p.display())))?;
            Ok((name, data))
        })
        .collect()
}
