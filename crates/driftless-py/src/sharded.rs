//! `driftless._native.ShardedPublisher`: one rank of a sharded trainer.

use driftless_format::numel;
use driftless_format::slice::Slice;
use driftless_publisher::{PartKind, PartReport, Shard, ShardedPublisher, StepOutcome};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{invalid, BindError};
use crate::publisher::{secs, Common};
use crate::store_options;
use crate::tensors::{borrow, Borrowed};

/// Low-level sharded publisher; use `driftless.ShardedPublisher`.
#[pyclass(module = "driftless._native", name = "ShardedPublisher", subclass)]
pub(crate) struct PyShardedPublisher {
    /// Shared with a flush or close still running after Ctrl-C (see `wait_interruptible`).
    inner: crate::held::Held<ShardedPublisher>,
}

/// A shard as passed from Python: borrowed local data, global shape, its slice.
struct PyShard {
    data: Borrowed,
    shape: Vec<u64>,
    slice: Slice,
}

fn extract_shard(name: &str, spec: &Bound<'_, PyAny>) -> PyResult<Option<PyShard>> {
    let d = spec.downcast::<PyDict>().map_err(|_| invalid(format!("shard {name}: use driftless.shard(...)")))?;
    let get = |k: &str| d.get_item(k);
    let replica: u64 = get("replica")?.map(|v| v.extract()).transpose()?.unwrap_or(0);
    if replica > 0 {
        // Replicas hold the same bytes as replica 0, which publishes them.
        return Ok(None);
    }
    let data = get("data")?.ok_or_else(|| invalid(format!("shard {name}: no data")))?;
    let data = borrow(name, &data, false)?;
    let shape: Vec<u64> = get("shape")?.ok_or_else(|| invalid(format!("shard {name}: no global shape")))?.extract()?;
    let offsets: Option<Vec<u64>> = get("offsets")?.map(|v| v.extract()).transpose()?;
    let flat: Option<u64> = get("flat_offset")?.map(|v| v.extract()).transpose()?;
    let err = |e: driftless_format::Error| invalid(format!("shard {name}: {e}"));
    let slice = match (offsets, flat) {
        (Some(_), Some(_)) => return Err(invalid(format!("shard {name}: give offsets or flat_offset, not both"))),
        (None, Some(start)) => {
            let len = numel(&data.meta.shape).map_err(err)?;
            Slice::flat(&shape, start, len).map_err(err)?
        }
        (offsets, None) => {
            let offsets = offsets.unwrap_or_else(|| vec![0; shape.len()]);
            if data.meta.shape.len() != shape.len() || offsets.len() != shape.len() {
                return Err(invalid(format!(
                    "shard {name}: local shape {:?} and offsets {offsets:?} must have one entry per dimension of {shape:?} (use flat_offset for a flat range)",
                    data.meta.shape
                )));
            }
            Slice::new(&shape, &offsets, &data.meta.shape).map_err(err)?
        }
    };
    Ok(Some(PyShard { data, shape, slice }))
}

fn outcome_dict<'py>(py: Python<'py>, o: &StepOutcome) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("step", o.step)?;
    d.set_item("committed", o.committed)?;
    d.set_item("of", o.of.map(|k| format!("{k:?}").to_lowercase()))?;
    d.set_item("root", o.root.map(|r| r.to_hex()))?;
    d.set_item("reason", o.reason.clone())?;
    d.set_item("next_anchor", o.next_anchor)?;
    d.set_item("slices_next", o.slices_next)?;
    // Whether publishing again may commit (found by review: left out, a trainer reading the
    // receipts could not tell a lost step from one every later step repeats).
    d.set_item("retryable", o.retryable)?;
    Ok(d)
}

fn kind_name(k: PartKind) -> &'static str {
    match k {
        PartKind::Delta => "delta",
        PartKind::Anchor => "anchor",
    }
}

fn part_dict<'py>(py: Python<'py>, r: &PartReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("step", r.step)?;
    d.set_item("part", kind_name(r.part))?;
    d.set_item("slices", r.slices)?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("secs", r.secs)?;
    d.set_item("commit_secs", r.commit_secs)?;
    Ok(d)
}

#[pymethods]
impl PyShardedPublisher {
    #[new]
    #[pyo3(signature = (bucket_url, rank, world_size, signing_key=None, anchor_every=50, commit_timeout=120.0,
        new_stream=false, endpoint=None, allow_http=false, region=None, takeover=false, max_retries=None,
        retry_timeout=None, spool_dir=None, max_shard_bytes=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        bucket_url: String,
        rank: u64,
        world_size: u64,
        signing_key: Option<String>,
        anchor_every: u64,
        commit_timeout: f64,
        new_stream: bool,
        endpoint: Option<String>,
        allow_http: bool,
        region: Option<String>,
        takeover: bool,
        max_retries: Option<usize>,
        retry_timeout: Option<f64>,
        spool_dir: Option<String>,
        max_shard_bytes: Option<u64>,
    ) -> PyResult<Self> {
        crate::errors::guard(|| {
            let opts = store_options(endpoint, allow_http, region, max_retries, retry_timeout)?;
            let common =
                Common { bucket_url, signing_key, anchor_every, new_stream, takeover, spool_dir, max_shard_bytes };
            let b = common.builder(opts)?;
            let timeout = secs(commit_timeout)?;
            if timeout > driftless_publisher::MAX_COMMIT_TIMEOUT {
                return Err(crate::errors::invalid(format!(
                    "commit_timeout {commit_timeout} s is longer than a day ({} s)",
                    driftless_publisher::MAX_COMMIT_TIMEOUT.as_secs()
                )));
            }
            // Ranks other than 0 wait for the committer (up to the commit timeout): Ctrl-C may end it.
            let p = crate::wait_interruptible(py, move || b.build_sharded(rank, world_size, timeout))?
                .map_err(BindError::from)?;
            Ok(PyShardedPublisher { inner: crate::held::Held::new(p, "ShardedPublisher") })
        })
    }

    /// Publishes this rank's shards of `step`; returns the receipt as a dict.
    fn publish<'py>(&self, py: Python<'py>, step: u64, shards: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
        crate::errors::guard(|| {
            self.inner.check()?;
            // The wait for the previous step's outcome (up to the commit timeout) reads no
            // caller memory: Ctrl-C may end it.
            let inner = self.inner.shared();
            crate::wait_interruptible(py, move || {
                inner.lock().unwrap_or_else(|e| e.into_inner()).as_mut().map_or(Ok(()), |p| p.wait_previous())
            })?
            .map_err(BindError::from)?;
            let items = shards
                .call_method0("items")
                .map_err(|_| invalid("shards must be a dict of name -> driftless.shard(...)"))?;
            let mut parts: Vec<PyShard> = vec![];
            for item in items.try_iter()? {
                let (k, v): (String, Bound<'_, PyAny>) = item?.extract()?;
                parts.extend(extract_shard(&k, &v)?);
            }
            // Plain data crosses `allow_threads`; the borrows stay in `parts` on this side.
            let plain: Vec<(driftless_format::TensorMeta, Vec<u64>, Slice, crate::tensors::Raw)> =
                parts.iter().map(|p| (p.data.meta.clone(), p.shape.clone(), p.slice.clone(), p.data.raw)).collect();
            let r = py.allow_threads(|| {
                // SAFETY: `parts` keeps every buffer borrowed until after this closure returns.
                let views: Vec<Shard<'_>> = plain
                    .iter()
                    .map(|(m, shape, slice, raw)| Shard {
                        name: &m.name,
                        dtype: m.dtype,
                        shape,
                        slice: slice.clone(),
                        data: unsafe { raw.slice() },
                    })
                    .collect();
                let mut g = self.inner.lock();
                let p = g.as_mut().ok_or(driftless_publisher::Error::Closed)?;
                p.publish(step, &views)
            });
            drop(parts);
            let r = r.map_err(BindError::from)?;
            let d = PyDict::new(py);
            d.set_item("step", r.step)?;
            d.set_item("part", kind_name(r.part))?;
            d.set_item("slices", r.slices)?;
            d.set_item("blocked_secs", r.blocked_secs)?;
            d.set_item("previous", r.previous.as_ref().map(|o| outcome_dict(py, o)).transpose()?)?;
            d.set_item("previous_part", r.previous_part.as_ref().map(|p| part_dict(py, p)).transpose()?)?;
            Ok(d)
        })
    }

    /// Waits for the outcome of this rank's last step; returns it, or raises when the step
    /// was not committed.
    fn flush<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        crate::errors::guard(|| {
            self.inner.check()?;
            let inner = self.inner.shared();
            let o = crate::wait_interruptible(py, move || {
                let mut g = inner.lock().unwrap_or_else(|e| e.into_inner());
                g.as_mut().ok_or(driftless_publisher::Error::Closed)?.flush()
            })?
            .map_err(BindError::from)?;
            outcome_dict(py, &o)
        })
    }

    /// Waits until this rank's part of its last step is uploaded (not for the commit); returns
    /// its report as a dict, or None when it could not be sent or nothing is in flight.
    fn wait_sent<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        crate::errors::guard(|| {
            self.inner.check()?;
            let r = py.allow_threads(|| {
                let mut g = self.inner.lock();
                g.as_mut().and_then(|p| p.wait_sent())
            });
            r.as_ref().map(|p| part_dict(py, p)).transpose()
        })
    }

    /// The outcome of this rank's last step, once known (after `flush` or the next
    /// `publish`), as a dict; None before.
    fn last_outcome<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let o = py.allow_threads(|| self.with(|p| p.last_outcome().cloned()));
        o.as_ref().map(|o| outcome_dict(py, o)).transpose()
    }

    /// This rank's part of its last step, once sent and resolved (after `flush`), as a dict.
    fn last_part<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let r = py.allow_threads(|| self.with(|p| p.last_part().cloned()));
        r.as_ref().map(|p| part_dict(py, p)).transpose()
    }

    /// Flushes and releases the rank. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.close(py, |p| p.close())
    }

    /// The group generation this rank publishes under.
    #[getter]
    fn generation(&self, py: Python<'_>) -> Option<u64> {
        py.allow_threads(|| self.with(|p| p.generation()))
    }
}

impl PyShardedPublisher {
    /// Reads the publisher under its lock. Callers release the GIL first: the lock is held
    /// for as long as another thread's `publish` or `flush` blocks.
    fn with<T>(&self, f: impl FnOnce(&ShardedPublisher) -> Option<T>) -> Option<T> {
        // Nothing in a forked child (its lock may never be free there).
        if self.inner.forked() {
            return None;
        }
        self.inner.lock().as_ref().and_then(f)
    }
}
