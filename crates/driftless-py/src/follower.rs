//! `driftless._native.Follower`: the inference side. Plans a route from a known step (delta
//! chain, or the newest anchor plus the deltas after it), downloads and checks every object
//! against its signed manifest, applies into caller-owned arrays (`apply_to`) or into a host
//! mirror (`iter_patches`), and checks the weights root of the result before returning.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use bytes::Bytes;
use driftless_agent::anchor_stream::{
    digests_of, hashed, shard_tensors, stream_anchor, FileSink, ShardJob, ShardSink, ShardTensors,
};
use driftless_agent::plan::Newest;
use driftless_agent::{plan, Agent, AgentConfig};
use driftless_format::manifest::{AnchorManifest, DeltaManifest, StepKind};
use driftless_format::{ops, DType, Digest, Layout, TensorMeta, TensorView, TensorsMut, TrustSet};
use driftless_store::spool::Spool;
use driftless_store::stream::{LatestVersion, LatestWatch, StreamError, StreamReader};
use driftless_store::Bucket;
use futures::{StreamExt, TryStreamExt};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyWeakrefMethods, PyWeakrefReference};
use rayon::prelude::*;

use crate::errors::{BindError, BindResult};
use crate::store_options;
use crate::tensors::{borrow_mapping, Borrowed, Raw};

/// A verified state: step, root and the layout of its tensors, and the stream it is a step of
/// (weights of another run at the same prefix are never a base: the new stream's anchor
/// replaces them, as the agent does).
#[derive(Clone, Debug)]
struct Tracked {
    step: u64,
    root: Digest,
    layout: Layout,
    stream: String,
    /// When that stream was created (its signed `created_at_ms`): an older run's descriptor,
    /// replayed into the prefix, is refused ([`plan::older_run`], as the agent refuses it).
    created: Option<u64>,
}

/// The host copy `iter_patches` keeps to turn ulp deltas into absolute values.
struct Mirror {
    at: Tracked,
    tensors: Vec<(TensorMeta, Vec<u8>)>,
    /// The delivery of the patches that lead to `at`, while the consumer has not taken all of
    /// them (`_confirm_patches`). While one is pending the engine may hold part of a step, so
    /// the next `iter_patches` yields every tensor whole (found by review: the mirror moved
    /// before the patches reached the consumer, and an interrupt, an out-of-memory error or a
    /// second iterator in between left the next call with nothing to yield and the engine on
    /// half a step for good).
    pending: Option<u64>,
}

struct State {
    /// What the arrays last passed to `apply_to` hold, and where they are: other arrays of
    /// the same shapes are not assumed to hold it.
    applied: Option<(Tracked, Placement)>,
    mirror: Option<Mirror>,
    /// The last delivery number handed out by `_patches` (see [`Mirror::pending`]).
    deliveries: u64,
    /// Steps that failed verification, left out of plans for a while (the agent's
    /// [`plan::Refusals`]): a bad step costs one download per `refuse_for`, not one per call,
    /// and the next best route is taken meanwhile.
    plans: Plans,
}

/// What planning keeps between calls.
struct Plans {
    refused: plan::Refusals,
    /// Ready markers already read (write-once: each is read once, not at every call; those of
    /// refused steps are read again at each call, so a repaired step is seen).
    markers: plan::MarkerCache,
    /// The stream the cached markers belong to (a new stream at the prefix starts over).
    stream: Option<String>,
    /// When `stream` was created (its descriptor's signed `created_at_ms`).
    created: Option<u64>,
    /// The signed `latest.json` last read, with its ETag: a Follower on a step polls it with
    /// one conditional GET and, one step behind, plans from it alone ([`plan::from_hint`]),
    /// as the agent does.
    latest: LatestWatch,
    /// Per consumer ([`Who`]): the step a plan from the listing found up to date, and the
    /// `latest.json` it was made at. While that `latest.json` stays (not modified, still
    /// absent or still not verifying) and the hint cannot plan, that consumer is still up to
    /// date there, as the agent does not sync while `latest.json` is unchanged (found by
    /// review: a hint that did not verify, was deleted or named an older step made every
    /// call list the bucket).
    settled: [Option<(u64, LatestVersion)>; 2],
    /// Plans made from a step, per consumer ([`Who`]): every 10th lists the markers anyway
    /// (they are the source of truth; a stale hint only delays a step by that much), less
    /// often while the store refuses listings ([`plan::ListCadence`], the agent's). One count
    /// each, so that `apply_to` and `iter_patches` called in turn both list.
    calls: [u64; 2],
    listing: [plan::ListCadence; 2],
}

/// Who plans: the caller's arrays (`apply_to`) or the host mirror (`iter_patches`).
#[derive(Clone, Copy)]
enum Who {
    Arrays = 0,
    Mirror = 1,
}

/// The route to a target: (target, anchor to load first, deltas in order, the stream's id),
/// and the markers it was planned with.
type Route = (u64, Option<u64>, Vec<u64>, String, plan::Candidates);

/// What planning reads and keeps between calls: the refusals and the marker cache.
type Planning<'a> = &'a mut Plans;

/// One attempt at a route: whether it wrote into its target, and the step it was loading
/// (with its marker's manifest SHA-256), to which a verification failure belongs.
#[derive(Default)]
struct Attempt {
    touched: bool,
    at: Option<(StepKind, u64, Option<Digest>)>,
    /// In: check every step of the route on its own (the anchor hashed before any delta is
    /// looked at, each delta's result root), so a fault names its step. The agent's careful
    /// retry.
    careful: bool,
    /// Out: the route failed in a way that does not name a step (a chain's final root, or the
    /// first delta's base root against an anchor not hashed yet): retry it carefully.
    recheck: bool,
}

impl Attempt {
    fn on(&mut self, cands: &plan::Candidates, kind: StepKind, step: u64) {
        self.at = Some((kind, step, cands.marker(kind, step).map(|m| m.manifest_sha256)));
    }
}

/// Which broken links of a chain ([`PyFollower::fetch_chain`]) name neither side, because the
/// state before the link is not verified yet and a careful retry overwrites nothing verified.
#[derive(Debug, Clone, Copy)]
struct Recheck {
    /// The first link: the chain starts at an anchor not hashed yet. (A careful retry proves
    /// the anchor before anything is written: in a spool while the arrays hold verified
    /// weights.)
    first: bool,
    /// The later links, to an earlier delta whose result only the final root proves: only
    /// when the target holds nothing verified, since a careful retry checks them as it writes
    /// (from verified weights they are checked before anything is written and name the later
    /// delta: a delta with a wrong result root then has the next one refused instead).
    later: bool,
}

fn wrong_base(m: &DeltaManifest, root: Digest) -> BindError {
    driftless_format::Error::WrongBase { expected: m.base_root.to_hex(), actual: root.to_hex() }.into()
}

/// A manifest signed for another stream (the same key signs several runs: one copied into this
/// bucket verifies against its own root) is refused, as the agent refuses it.
fn same_stream(sid: &str, got: &str, what: &'static str, step: u64) -> BindResult<()> {
    if got == sid {
        return Ok(());
    }
    Err(driftless_format::Error::corrupt(what, format!("step {step} is signed for another stream ({got})")).into())
}

/// Low-level follower; use `driftless.Follower`.
#[pyclass(module = "driftless._native", name = "Follower", subclass)]
pub(crate) struct PyFollower {
    rt: tokio::runtime::Runtime,
    origin: crate::errors::Origin,
    bucket: Bucket,
    trust: TrustSet,
    reader: StreamReader,
    state: Mutex<State>,
    refuse_for: std::time::Duration,
    /// Bytes of a checked delta chain held in memory until its writing pass; beyond, the
    /// segments wait in a TMPDIR spool.
    chain_memory: u64,
    /// What `poll` keeps between calls.
    polls: Mutex<Polls>,
    /// Weak references to the objects whose memory `apply_to` last verified, by name. Held
    /// only briefly and with the GIL (never across `allow_threads`).
    owners: Mutex<Option<Owners>>,
}

impl Drop for PyFollower {
    /// In a forked child the runtime's threads do not exist: shutting it down could wait for
    /// them forever. It is leaked there (a runtime without threads takes its place).
    fn drop(&mut self) {
        if self.origin.forked() {
            if let Ok(idle) = tokio::runtime::Builder::new_current_thread().build() {
                std::mem::forget(std::mem::replace(&mut self.rt, idle));
            }
        }
    }
}

/// `(name, weak reference to the exporting object)`; `None` for an object that takes no weak
/// references (it is then never taken for the same object).
type Owners = Vec<(String, Option<Py<PyWeakrefReference>>)>;

/// Weak references to the objects of `borrowed`, by name.
fn owners_of(py: Python<'_>, borrowed: &[Borrowed]) -> Owners {
    let mut o: Owners = borrowed
        .iter()
        .map(|b| (b.meta.name.clone(), PyWeakrefReference::new(b.obj.bind(py)).ok().map(|w| w.unbind())))
        .collect();
    o.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    o
}

/// Whether `borrowed` are the very objects of `owners` (alive: a dead object's address may
/// have been given to new arrays).
fn same_objects(py: Python<'_>, owners: &Owners, borrowed: &[Borrowed]) -> bool {
    owners.len() == borrowed.len()
        && borrowed.iter().all(|b| {
            owners.binary_search_by(|o| o.0.as_str().cmp(&b.meta.name)).is_ok_and(|i| {
                owners[i].1.as_ref().and_then(|w| w.bind(py).upgrade()).is_some_and(|o| o.is(b.obj.bind(py)))
            })
        })
}

/// `poll`'s state: its own `latest.json` (polled without waiting for a plan's lock), the
/// newest step a hint of this stream named, and the newest step the last listing found.
#[derive(Default)]
struct Polls {
    calls: u64,
    /// When the periodic listing is due (the agent's cadence: every 10th poll, backing off
    /// while the store refuses listings).
    cadence: plan::ListCadence,
    /// The stream of the verified `stream.json`, whose hints are taken.
    stream: Option<String>,
    latest: LatestWatch,
    /// The newest step a hint of `stream` named (never lowered within the stream).
    hinted: Option<u64>,
    listed: Option<u64>,
    /// The `latest.json` the last listing was made at: without a valid hint, the listing is
    /// made again when `latest.json` changes (or at every 10th poll), not at every poll.
    listed_at: Option<LatestVersion>,
    /// The markers the listings of `poll` read (each once).
    markers: plan::MarkerCache,
}

/// Most ready markers one `poll` reads (a sync's budget of markers refused from their marker
/// alone): planted junk above the newest step costs a poll at most this many GETs (16 at a
/// time), and the polls after it go on where it stopped.
const POLL_READS: usize = plan::MAX_UNUSABLE_ROUNDS as usize;

fn outcome_dict<'py>(
    py: Python<'py>,
    step: u64,
    root: Digest,
    route: &str,
    bytes: u64,
    deltas: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("step", step)?;
    d.set_item("root", root.to_hex())?;
    d.set_item("route", route)?;
    d.set_item("bytes", bytes)?;
    d.set_item("deltas", deltas)?;
    Ok(d)
}

#[pymethods]
impl PyFollower {
    #[new]
    #[pyo3(signature = (bucket_url, trusted_keys=None, allow_unsigned=false, endpoint=None, allow_http=false,
        region=None, max_retries=None, retry_timeout=None, refuse_for=30.0, chain_memory=CHAIN_IN_MEMORY))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        bucket_url: String,
        trusted_keys: Option<Vec<String>>,
        allow_unsigned: bool,
        endpoint: Option<String>,
        allow_http: bool,
        region: Option<String>,
        max_retries: Option<usize>,
        retry_timeout: Option<f64>,
        refuse_for: f64,
        chain_memory: u64,
    ) -> PyResult<Self> {
        crate::errors::guard(|| {
            // At most a day: the refusal's doubling must not overflow.
            let refuse_for = std::time::Duration::try_from_secs_f64(if refuse_for.is_nan() {
                -1.0
            } else {
                refuse_for.min(86_400.0)
            })
            .map_err(|_| BindError::Input(format!("refuse_for must be a number of seconds >= 0, not {refuse_for}")))?;
            let mut trust = TrustSet::new().allow_unsigned(allow_unsigned);
            for k in trusted_keys.unwrap_or_default() {
                trust = if k.contains("-----BEGIN") {
                    trust.with_pem(&k)
                } else {
                    trust.with_file(std::path::Path::new(&k))
                }
                .map_err(|e| BindError::Input(format!("trusted key: {e}")))?;
            }
            if trust.is_empty() && !allow_unsigned {
                return Err(BindError::Input(
                    "no trusted_keys given; pass the publisher's public key(s) or allow_unsigned=True".into(),
                )
                .into());
            }
            let opts = store_options(endpoint, allow_http, region, max_retries, retry_timeout)?;
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("driftless-follow")
                .enable_all()
                .build()
                .map_err(|e| BindError::Input(format!("cannot start runtime: {e}")))?;
            let bucket = {
                let _g = rt.enter();
                Bucket::open(&bucket_url, &opts).map_err(BindError::from)?
            };
            let reader = StreamReader::new(bucket.clone(), trust.clone());
            // Spools of killed Followers (and publishers) in TMPDIR go now.
            driftless_store::spool::sweep_in(None);
            let state = State {
                applied: None,
                mirror: None,
                deliveries: 0,
                plans: Plans {
                    refused: plan::Refusals::new(refuse_for),
                    markers: plan::MarkerCache::default(),
                    stream: None,
                    created: None,
                    latest: LatestWatch::default(),
                    settled: Default::default(),
                    calls: [0; 2],
                    listing: Default::default(),
                },
            };
            Ok(PyFollower {
                rt,
                origin: crate::errors::Origin::here(),
                bucket,
                trust,
                reader,
                state: Mutex::new(state),
                refuse_for,
                chain_memory,
                polls: Mutex::default(),
                owners: Mutex::default(),
            })
        })
    }

    /// Newest step with a ready marker (delta or anchor), or None. One conditional GET of the
    /// signed `latest.json`; every 10th poll, or with no valid hint of this stream, the ready
    /// markers are listed as well (they are the source of truth: a hint left behind by a
    /// failed write only delays the answer by that much). A hint is taken only from the stream
    /// of the verified `stream.json` (read at the first poll and when a hint names another
    /// stream), and the answer never goes down within a stream (a replayed older hint).
    fn poll(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        crate::errors::guard(|| {
            self.origin.check("Follower")?;
            let r: Result<BindResult<Option<u64>>, PyErr> = py.allow_threads(|| {
                let mut ps = self.polls.lock().unwrap_or_else(|e| e.into_inner());
                // Reads only: safe to abandon when Ctrl-C arrives (a bucket that hangs held
                // the caller for the whole retry budget; found by review).
                self.rt.block_on(crate::interruptible(self.poll_inner(&mut ps)))
            });
            Ok(r??)
        })
    }

    /// Does what `driftless agent --once` does for directory `path`.
    fn sync_dir<'py>(&self, py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyDict>> {
        crate::errors::guard(|| {
            self.origin.check("Follower")?;
            let r: BindResult<(driftless_agent::SyncOutcome, PathBuf)> = py.allow_threads(|| {
                let _g = self.rt.enter();
                // A new agent per call: it holds DIR's lock only for the call, so other
                // processes and Followers may use the directory between calls.
                let mut cfg = AgentConfig::new(&path, self.trust.clone());
                cfg.refuse_for = self.refuse_for;
                let mut agent = Agent::new(self.bucket.clone(), cfg)?;
                let o = self.rt.block_on(agent.sync_once())?;
                Ok((o, agent.current_dir()))
            });
            let (o, dir) = r?;
            let route = o.route.to_string();
            let d = outcome_dict(py, o.step, o.root, &route, o.bytes, o.deltas as usize)?;
            // Newer steps refused (bad or missing objects): the verified step above was kept.
            let refused = PyList::empty(py);
            for r in &o.refused {
                let kind = match r.kind {
                    StepKind::Delta => "delta",
                    StepKind::Anchor => "anchor",
                };
                refused.append((kind, r.step, r.reason.clone()))?;
            }
            d.set_item("refused", refused)?;
            d.set_item("path", dir.to_string_lossy().to_string())?;
            Ok(d)
        })
    }

    /// Brings caller-owned arrays to `step` (default: the newest reachable) in place.
    #[pyo3(signature = (tensors, step=None))]
    fn apply_to<'py>(
        &self,
        py: Python<'py>,
        tensors: &Bound<'py, PyAny>,
        step: Option<u64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        crate::errors::guard(|| {
            self.origin.check("Follower")?;
            let borrowed = borrow_mapping(tensors, true)?;
            let parts: Vec<(TensorMeta, Raw)> = borrowed.iter().map(|b| (b.meta.clone(), b.raw)).collect();
            let same = {
                let owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
                owners.as_ref().is_some_and(|o| same_objects(py, o, &borrowed))
            };
            let r = py.allow_threads(|| {
                let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                let here = placement(&parts);
                // Other arrays than those we verified, or of another shape: start over from an
                // anchor.
                let mut local =
                    st.applied.clone().filter(|(t, p)| *p == here && same_set(&t.layout, &parts)).map(|(t, _)| t);
                if let (Some(t), false) = (&local, same) {
                    // The same memory through other objects (a new view of the same buffer,
                    // `state_dict()` builds new tensors every call), or new arrays that were
                    // given a freed address: only their bytes can tell. One hash, not a reload.
                    if root_of(&t.layout, &parts) != t.root {
                        local = None;
                    }
                }
                let st = &mut *st;
                // Out while the arrays may be written: a panic leaves them untracked.
                let prev = st.applied.take();
                let (r, touched) = with_refusals(&mut st.plans, local.as_ref().map(|t| t.step), step, |pl, at| {
                    self.rt.block_on(self.apply(local.as_ref(), step, &parts, pl, at))
                });
                let (applied, tracked) = match (&r, &local) {
                    (Ok(Some((t, _, _, _))), _) => (Some((t.clone(), here)), Tracking::These),
                    (Err(_), _) if touched => (None, Tracking::Nothing),
                    (_, Some(t)) => (Some((t.clone(), here)), Tracking::These),
                    (_, None) => (prev, Tracking::Unchanged),
                };
                st.applied = applied;
                let out = r.map(|o| {
                    o.map(|(t, route, bytes, n)| (t.step, t.root, route, bytes, n))
                        .or_else(|| local.map(|t| (t.step, t.root, "up_to_date", 0, 0)))
                });
                (out.map(|o| (o, refused_after(&st.plans.refused, o.map(|o| o.0)))), touched, tracked)
            });
            let (r, touched, tracked) = r;
            match tracked {
                Tracking::These => {
                    *self.owners.lock().unwrap_or_else(|e| e.into_inner()) = Some(owners_of(py, &borrowed))
                }
                Tracking::Nothing => *self.owners.lock().unwrap_or_else(|e| e.into_inner()) = None,
                Tracking::Unchanged => {}
            }
            drop(borrowed);
            let r = match r {
                Err(e) if touched => {
                    // Say it where the caller catches it: the arrays hold neither the old
                    // step nor the new one.
                    let err = PyErr::from(e);
                    let v = err.value(py);
                    v.setattr("arrays_modified", true)?;
                    let note = "the arrays may have been partly written before this error and hold no verified \
                                step; the Follower no longer tracks them: the next apply_to loads an anchor into them";
                    if v.hasattr("add_note")? {
                        v.call_method1("add_note", (note,))?;
                    }
                    return Err(err);
                }
                r => r?,
            };
            match r {
                (Some((s, root, route, bytes, n)), refused) => {
                    let d = outcome_dict(py, s, root, route, bytes, n)?;
                    d.set_item("refused", refused)?;
                    Ok(d)
                }
                (None, _) => Err(BindError::NothingReady(
                    "nothing to sync yet: no stream or no ready anchor at this URL (not published yet, or a wrong URL)"
                        .into(),
                )
                .into()),
            }
        })
    }

    /// Step and root of the arrays `apply_to` last verified, or None.
    #[getter]
    fn applied_step(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        crate::errors::guard(|| {
            // Without the GIL: a sync in another thread holds the lock for its whole download.
            Ok(py.allow_threads(|| {
                self.state.lock().unwrap_or_else(|e| e.into_inner()).applied.as_ref().map(|(t, _)| t.step)
            }))
        })
    }

    /// The consumer took every patch of `delivery`: the engine holds the mirror's step.
    fn _confirm_patches(&self, py: Python<'_>, delivery: u64) -> PyResult<()> {
        crate::errors::guard(|| {
            self.origin.check("Follower")?;
            py.allow_threads(|| {
                let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(m) = st.mirror.as_mut().filter(|m| m.pending == Some(delivery)) {
                    m.pending = None;
                }
            });
            Ok(())
        })
    }

    /// Raises `InvalidInputError` unless `delivery` is the one pending: an iterator left
    /// behind by a later `iter_patches` call stops at its next patch (found by review: it went
    /// on scattering its older step's values over the newer step the engine then held).
    fn _check_delivery(&self, py: Python<'_>, delivery: u64) -> PyResult<()> {
        crate::errors::guard(|| {
            self.origin.check("Follower")?;
            py.allow_threads(|| current(&self.state.lock().unwrap_or_else(|e| e.into_inner()), delivery).map(|_| ()))?;
            Ok(())
        })
    }

    /// The bytes of the mirror's tensor `name` for `delivery`, copied one tensor at a time as
    /// the consumer reaches it (found by review: every whole tensor was copied twice up front,
    /// so a first call held three copies of the model in host memory). Raises
    /// `InvalidInputError` when another `iter_patches` call moved the mirror since.
    fn _mirror_tensor<'py>(&self, py: Python<'py>, delivery: u64, name: &str) -> PyResult<Bound<'py, PyBytes>> {
        crate::errors::guard(|| {
            self.origin.check("Follower")?;
            let data = py.allow_threads(|| {
                let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                let m = current(&st, delivery)?;
                let (_, d) = m
                    .tensors
                    .iter()
                    .find(|(t, _)| t.name == name)
                    .ok_or_else(|| BindError::Input(format!("no tensor {name:?} in the host mirror")))?;
                // Out of memory is an error, as for the mirror itself (`zeroed`), not an abort.
                let mut v = zeroed(d.len() as u64)?;
                v.copy_from_slice(d);
                Ok::<_, BindError>(v)
            })?;
            Ok(PyBytes::new(py, &data))
        })
    }

    /// Forgets what `apply_to` tracked (the next call loads an anchor into the arrays).
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        crate::errors::guard(|| {
            self.origin.check("Follower")?;
            py.allow_threads(|| {
                let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                st.applied = None;
                st.mirror = None;
            });
            *self.owners.lock().unwrap_or_else(|e| e.into_inner()) = None;
            Ok(())
        })
    }

    /// Advances the host mirror to `step` (default newest) and returns `(delivery, step, root,
    /// [(name, dtype, shape, positions_le_i64 | None, values | None)])`; `values` is None for a
    /// tensor yielded whole, whose bytes `_mirror_tensor(delivery, name)` copies when the
    /// consumer reaches it. The delivery stays pending until `_confirm_patches(delivery)`.
    #[pyo3(signature = (step=None))]
    fn _patches<'py>(&self, py: Python<'py>, step: Option<u64>) -> PyResult<Option<Delivery<'py>>> {
        crate::errors::guard(|| {
            self.origin.check("Follower")?;
            type Patch = (String, DType, Vec<u64>, Option<(Vec<u8>, Vec<u8>)>);
            let r: BindResult<Option<(u64, Tracked, Vec<Patch>)>> = py.allow_threads(|| {
                let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
                let st = &mut *guard;
                let mut mirror = st.mirror.take();
                let local = mirror.as_ref().map(|m| m.at.clone());
                // A delivery the consumer did not finish: the engine may hold part of it.
                let unfinished = mirror.as_ref().is_some_and(|m| m.pending.is_some());
                let mut indices: BTreeMap<String, Option<Vec<u64>>> = BTreeMap::new();
                let (r, touched) = with_refusals(&mut st.plans, local.as_ref().map(|t| t.step), step, |pl, at| {
                    indices.clear();
                    self.rt.block_on(self.apply_mirror(local.as_ref(), step, &mut mirror, pl, at, &mut indices))
                });
                let out = match r {
                    Ok(r) if r.is_some() || unfinished => {
                        let (t, full) = match r {
                            Some((t, full)) => (t, full || unfinished),
                            None => (local.clone().expect("an unfinished delivery has a mirror"), true),
                        };
                        let m = mirror.as_mut().expect("mirror loaded");
                        m.at = t.clone();
                        st.deliveries += 1;
                        m.pending = Some(st.deliveries);
                        let mut patches = vec![];
                        for (meta, data) in &m.tensors {
                            let w = meta.dtype.size();
                            let whole = matches!(indices.get(&meta.name), Some(None));
                            if full || whole {
                                patches.push((meta.name.clone(), meta.dtype, meta.shape.clone(), None));
                            } else if let Some(Some(idx)) = indices.get_mut(&meta.name) {
                                idx.sort_unstable();
                                idx.dedup();
                                let mut pos = Vec::with_capacity(idx.len() * 8);
                                let mut vals = Vec::with_capacity(idx.len() * w);
                                for &i in idx.iter() {
                                    pos.extend_from_slice(&(i as i64).to_le_bytes());
                                    let at = i as usize * w;
                                    vals.extend_from_slice(&data[at..at + w]);
                                }
                                patches.push((meta.name.clone(), meta.dtype, meta.shape.clone(), Some((pos, vals))));
                            }
                        }
                        Ok(Some((st.deliveries, t, patches)))
                    }
                    Ok(_) => Ok(None),
                    Err(e) => {
                        if touched {
                            mirror = None;
                        }
                        Err(e)
                    }
                };
                st.mirror = mirror;
                out
            });
            let Some((delivery, t, patches)) = r? else {
                return Ok(None);
            };
            let list = PyList::empty(py);
            for (name, dtype, shape, sparse) in patches {
                let (pos, vals) = match sparse {
                    Some((p, v)) => (Some(PyBytes::new(py, &p)), Some(PyBytes::new(py, &v))),
                    None => (None, None),
                };
                list.append((name, dtype.as_str(), shape, pos, vals))?;
            }
            Ok(Some((delivery, t.step, t.root.to_hex(), list)))
        })
    }

    /// Step the `iter_patches` consumer last took whole, or None: before the first call, and
    /// while a delivery is unfinished (the engine may hold part of a step).
    #[getter]
    fn patch_step(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        crate::errors::guard(|| {
            Ok(py.allow_threads(|| {
                let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                st.mirror.as_ref().filter(|m| m.pending.is_none()).map(|m| m.at.step)
            }))
        })
    }
}

/// Most element indices `iter_patches` records for a tensor of `elements` along one route:
/// an eighth of them (8 bytes each, so at most the tensor's elements in bytes: half a BF16
/// tensor). Past it the tensor is yielded whole, which is then no larger than its positions
/// and values (found by review: the indices of every delta of the route were held, 8 bytes per
/// changed element, so a dense step of a 7B model meant about 56 GB).
fn max_recorded(elements: u64) -> u64 {
    elements / 8
}

/// Where caller arrays are: (name, address, length), by name.
type Placement = Vec<(String, usize, usize)>;

fn placement(parts: &[(TensorMeta, Raw)]) -> Placement {
    let mut p: Placement = parts.iter().map(|(m, r)| (m.name.clone(), r.addr, r.len)).collect();
    p.sort_unstable();
    p
}

/// The weights root of caller arrays laid out as `layout` (names checked by [`same_set`]).
fn root_of(layout: &Layout, parts: &[(TensorMeta, Raw)]) -> Digest {
    let by: HashMap<&str, Raw> = parts.iter().map(|(m, r)| (m.name.as_str(), *r)).collect();
    // SAFETY: arrays borrowed by the caller for the whole call, not written during it.
    driftless_format::weights_root(&unsafe { views_of(layout, &by) }).1
}

/// Read-only views of caller arrays (`by` name) laid out as `layout`.
///
/// # Safety
/// The arrays must stay borrowed, and unwritten, while the views live.
unsafe fn views_of<'a>(layout: &'a Layout, by: &HashMap<&str, Raw>) -> Vec<TensorView<'a>> {
    layout
        .tensors()
        .map(|t| TensorView { name: &t.name, dtype: t.dtype, shape: &t.shape, data: by[t.name.as_str()].slice() })
        .collect()
}

/// Whether caller arrays are exactly the tensors of `layout` (names, dtypes, shapes).
fn same_set(layout: &Layout, parts: &[(TensorMeta, Raw)]) -> bool {
    let by: HashMap<&str, &TensorMeta> = parts.iter().map(|(m, _)| (m.name.as_str(), m)).collect();
    by.len() == parts.len()
        && layout.tensors().count() == parts.len()
        && layout.tensors().all(|t| by.get(t.name.as_str()) == Some(&t))
}

fn check_set(layout: &Layout, parts: &[(TensorMeta, Raw)], step: u64) -> BindResult<()> {
    // Arrays that share memory (tied weights passed under two names) would be written by
    // several threads at once and hold only the last write.
    let mut spans: Vec<(usize, usize, &str)> =
        parts.iter().filter(|(_, r)| r.len > 0).map(|(m, r)| (r.addr, r.addr + r.len, m.name.as_str())).collect();
    spans.sort_unstable();
    if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
        return Err(BindError::Input(format!("arrays {} and {} share memory; pass each tensor once", w[0].2, w[1].2)));
    }
    if same_set(layout, parts) {
        return Ok(());
    }
    let want: Vec<String> = layout.tensors().map(|t| format!("{} {} {:?}", t.name, t.dtype, t.shape)).collect();
    let by: HashMap<&str, &TensorMeta> = parts.iter().map(|(m, _)| (m.name.as_str(), m)).collect();
    let first = layout
        .tensors()
        .find(|t| by.get(t.name.as_str()) != Some(t))
        .map(|t| match by.get(t.name.as_str()) {
            Some(g) => format!("{}: stream has {} {:?}, array is {} {:?}", t.name, t.dtype, t.shape, g.dtype, g.shape),
            None => format!("{} is missing", t.name),
        })
        .unwrap_or_else(|| "arrays include tensors the stream does not have".into());
    // The cause first, then at most 8 of the stream's tensors (found by review: 300 tensors
    // made a 15,000-character message with the cause at its end).
    const SHOWN: usize = 8;
    let more = if want.len() > SHOWN { format!(", and {} more", want.len() - SHOWN) } else { String::new() };
    Err(BindError::Input(format!(
        "the arrays do not match the tensors of step {step}: {first} (the stream has {} tensors: {}{more})",
        want.len(),
        want[..want.len().min(SHOWN)].join(", ")
    )))
}

impl PyFollower {
    /// Plans from `local` to `want` (or the newest reachable step) with the agent's planner
    /// (`driftless_agent::plan`: validated markers bound to the stream, bounded walks, the
    /// cheapest route by bytes). `Ok(None)`: up to date.
    async fn plan(
        &self,
        local: Option<&Tracked>,
        want: Option<u64>,
        pl: Planning<'_>,
        who: Who,
    ) -> BindResult<Option<Route>> {
        let of_stream = |sid: &str| local.filter(|t| t.stream == sid).map(|t| t.step);
        let hinted = match pl.stream.as_deref() {
            Some(sid) => of_stream(sid),
            None => None,
        };
        if let Some(planned) = self.plan_from_hint(hinted, want, pl, who).await {
            return Ok(planned);
        }
        // The `latest.json` this listing is made at (polled by `plan_from_hint` just now).
        let at = pl.latest.version();
        pl.settled[who as usize] = None;
        let Some(desc) = self.reader.descriptor().await? else {
            return Err(BindError::NothingReady("the bucket holds no stream yet".into()));
        };
        if let Some((t, c)) = local.and_then(|t| t.created.map(|c| (t, c))) {
            plan::older_run(&t.stream, c, &desc, "to follow it anyway, call reset() first")?;
        }
        if pl.stream.as_deref() != Some(desc.stream_id.as_str()) {
            pl.markers = plan::MarkerCache::default();
            pl.stream = Some(desc.stream_id.clone());
            pl.latest = LatestWatch::default();
        }
        pl.created = Some(desc.created_at_ms);
        let local = of_stream(&desc.stream_id);
        let cands = pl.markers.candidates(&self.reader, &desc.stream_id, None, &pl.refused, local).await?;
        pl.listing[who as usize].after(pl.calls[who as usize], pl.markers.listing_failed());
        // Refusals of steps no longer listed, or before the oldest anchor, go (as the agent's).
        pl.refused.retain_listed(&cands, pl.latest.hint());
        let refused = &pl.refused;
        if cands.anchors.is_empty() && local.is_none() {
            return Err(BindError::NothingReady("no anchor is ready in the stream yet".into()));
        }
        if let Some(r) = plan::route(local, &cands, refused, want) {
            return Ok(Some((r.target, r.anchor, r.deltas, desc.stream_id, cands)));
        }
        // Only a plan for the newest step settles: one for the local step itself is up to date
        // whatever is newer (found by review: `apply_to(step=local)` then `apply_to()` said "up
        // to date" past newer steps for up to 9 calls).
        if let (Some(l), Some(at), None) = (local, at, want) {
            pl.settled[who as usize] = Some((l, at));
        }
        match want {
            Some(w) if local != Some(w) && cands.partial => Err(BindError::NothingReady(format!(
                "step {w} is not reachable from the steps planned: the bucket's ready/ listing failed or holds more \
                 than {} ready markers not read yet (planted keys? remove them), so only the signed latest.json's \
                 newest anchor and chain, or the newest markers, were planned (a later call reads on)",
                plan::MAX_MARKER_READS
            ))),
            Some(w) if local != Some(w) => Err(BindError::NothingReady(format!(
                "step {w} is not reachable in the stream (no ready delta chain or anchor leads to it)"
            ))),
            Some(_) => Ok(None),
            None if local.is_some() => Ok(None),
            None => Err(BindError::NothingReady(
                "nothing to sync yet: no stream or no ready anchor at this URL (not published yet, or a wrong URL)"
                    .into(),
            )),
        }
    }

    async fn poll_inner(&self, ps: &mut Polls) -> BindResult<Option<u64>> {
        ps.calls += 1;
        let (hint, changed) = match ps.latest.poll(&self.reader).await {
            Ok(w) => (w.hint.cloned(), w.changed),
            Err(_) => (None, true),
        };
        let mut valid = false;
        let mut described = false;
        match hint {
            // No valid hint (deleted, or the prefix emptied for a new run): the listing alone
            // answers, not the newest step an earlier hint named.
            None => ps.hinted = None,
            Some(h) => {
                if changed && ps.stream.as_deref() != Some(h.stream_id.as_str()) {
                    // First poll, or a new hint naming another stream: which one is this
                    // bucket's? (Read once per hint: an unchanged foreign hint costs nothing.)
                    let sid = self.reader.descriptor().await?.map(|d| d.stream_id);
                    described = true;
                    if sid != ps.stream {
                        let latest = std::mem::take(&mut ps.latest);
                        *ps = Polls { calls: ps.calls, stream: sid, latest, ..Polls::default() };
                    }
                }
                // Another stream's hint (copied in, or left by an old run) is not this one's.
                if ps.stream.as_deref() == Some(h.stream_id.as_str()) {
                    ps.hinted = ps.hinted.max(h.delta.max(h.anchor));
                    valid = true;
                }
            }
        }
        // Without a valid hint of this stream, the listing answers; it is made again when
        // latest.json changes (a publisher writes it after every step), not at every poll.
        let at = ps.latest.version();
        let stale = !valid && (at.is_none() || at != ps.listed_at);
        if !stale && !ps.cadence.due(ps.calls) {
            ps.cadence.after(ps.calls, None);
        } else {
            // Without a valid hint of this stream, which stream the markers must belong to is
            // read again (the prefix may have been emptied for a new run whose hint is gone).
            if !valid && !described {
                let sid = self.reader.descriptor().await?.map(|d| d.stream_id);
                if sid != ps.stream {
                    let latest = std::mem::take(&mut ps.latest);
                    *ps = Polls { calls: ps.calls, stream: sid, latest, ..Polls::default() };
                }
            }
            let Some(sid) = ps.stream.clone() else {
                // No stream.json: nothing is ready (markers alone are no stream's).
                ps.listed = None;
                return Ok(ps.hinted);
            };
            // The newest listed markers that are this stream's (junk and other streams'
            // markers are passed over, each read once), at most POLL_READS reads per poll.
            let mut budget = POLL_READS;
            let listed = async {
                let a = self.reader.ready_steps(StepKind::Anchor, None).await?;
                let anchor = ps.markers.newest_valid(&self.reader, &sid, StepKind::Anchor, &a, &mut budget).await?;
                Ok::<_, StreamError>(match anchor {
                    Newest::OutOfReads => (None, true),
                    anchor => {
                        let anchor = anchor.step();
                        let d = self.reader.ready_steps(StepKind::Delta, anchor).await?;
                        match ps.markers.newest_valid(&self.reader, &sid, StepKind::Delta, &d, &mut budget).await? {
                            Newest::OutOfReads => (anchor, true),
                            delta => (anchor.max(delta.step()), false),
                        }
                    }
                })
            }
            .await;
            let (found, out) = match listed {
                // A listing the store refuses (a planted key it cannot parse, more keys than a
                // listing holds): the valid signed hint answers, and the periodic listing backs
                // off as the agent's does (found by review: every 10th poll raised the
                // listing's error although the hint named the newest step).
                Err(StreamError::Store(e)) if valid && e.is_listing_refused() => {
                    ps.cadence.after(ps.calls, Some(true));
                    return Ok(ps.hinted.max(ps.listed));
                }
                Err(e) => return Err(e.into()),
                Ok(l) => {
                    ps.cadence.after(ps.calls, Some(false));
                    l
                }
            };
            if !out {
                ps.listed = found;
                ps.listed_at = at;
            } else {
                // Out of reads: the answer stands as it was (or the anchor found), and the
                // next poll lists again and goes on from what is cached.
                ps.listed = ps.listed.max(found);
                ps.listed_at = None;
                if ps.listed.is_none() && ps.hinted.is_none() {
                    return Err(BindError::NothingReady(format!(
                        "more than {POLL_READS} ready markers at the top of the listing are junk or another \
                         stream's; this poll read {POLL_READS} of them, the next goes on"
                    )));
                }
            }
        }
        Ok(ps.hinted.max(ps.listed))
    }

    /// The fast poll of a Follower on `local` (a step of the stream planned before): one
    /// conditional GET of the signed `latest.json`. Unchanged, or announcing `local` itself:
    /// up to date. Announcing one delta on `local`: that route, from the hint alone (no
    /// `stream.json`, no listing, no marker reads). `None` for anything else (a cold start, a
    /// gap, a newer anchor, a refusal in the way, no or an unreadable hint, every 10th plan):
    /// the listing decides.
    async fn plan_from_hint(
        &self,
        local: Option<u64>,
        want: Option<u64>,
        pl: Planning<'_>,
        who: Who,
    ) -> Option<Option<Route>> {
        let local = local?;
        let sid = pl.stream.clone()?;
        let calls = &mut pl.calls[who as usize];
        *calls += 1;
        if pl.listing[who as usize].due(*calls) {
            return None;
        }
        let h = pl.latest.poll(&self.reader).await.ok()?.hint.filter(|h| h.stream_id == sid).cloned();
        if let Some(h) = h {
            if plan::hint_is_current(&h, &sid, local) && want.is_none_or(|w| w == local) {
                return Some(None);
            }
            if let Some(c) = plan::from_hint(&h, &sid, local) {
                if let Some(r) = plan::route(Some(local), &c, &pl.refused, want) {
                    for m in c.deltas.values() {
                        pl.markers.insert(m.clone());
                    }
                    return Some(Some((r.target, r.anchor, r.deltas, sid, c)));
                }
            }
        }
        // The hint cannot plan (it does not verify, is gone, is another stream's or names an
        // older step): still up to date where the last listing found this consumer, as long
        // as latest.json is the same object.
        let settled = pl.settled[who as usize].as_ref().zip(pl.latest.version());
        if settled.is_some_and(|((s, at), now)| *s == local && *at == now) && want.is_none_or(|w| w == local) {
            return Some(None);
        }
        None
    }

    /// Loads anchor `step` (manifest `m`) into the arrays `by` (already checked to be exactly
    /// the layout's tensors): byte-plane shards stream as for the agent
    /// ([`driftless_agent::anchor_stream`]: ranged GETs decoded as they arrive, written once
    /// into the arrays, memory bounded by the parts in flight; plain safetensors shards the
    /// same way, undecoded; shards side by side). With `hash` (the anchor is the result, checked alone) every tensor is hashed
    /// as it is written (`Hashing`: the arrays are not read back); otherwise the root of the
    /// chain's result checks it. Returns the bytes read and the digests (empty without `hash`).
    async fn stream_anchor(
        &self,
        step: u64,
        m: &AnchorManifest,
        by: &HashMap<&str, Raw>,
        hash: bool,
    ) -> BindResult<(u64, Vec<(TensorMeta, Digest)>)> {
        stream_anchor_from(self.reader.bucket(), step, m, by, hash, None).await
    }

    /// The first half of loading an anchor into arrays that hold verified weights: nothing is
    /// written into them before the whole anchor is proven. Each shard is streamed out of the
    /// bucket once, as for a cold start (object checked by its signed SHA-256s, every tensor hashed as it
    /// passes, its header checked against the arrays), but its decoded bytes go to a local
    /// spool ([`Spool`]: `TMPDIR`, one decoded shard file per anchor object, at most the size
    /// of the arrays; swept if this process is killed); the digests are then checked against
    /// the signed weights root. Returns the spool, the bytes read and the digests;
    /// [`fill_from_spool`] then copies the proven bytes into the arrays. A corrupt,
    /// truncated, swapped or wrongly signed anchor is refused with the arrays untouched. The
    /// cost over a cold start is the spool's write and one copy out of it (no second download
    /// or decode); a cold start streams directly.
    async fn prove_anchor(
        &self,
        step: u64,
        m: &AnchorManifest,
        by: &HashMap<&str, Raw>,
    ) -> BindResult<(Spool, u64, Vec<(TensorMeta, Digest)>)> {
        let dir = Spool::new(None, "anchor").map_err(spool_io)?;
        let (bytes, digests) = stream_anchor_from(self.reader.bucket(), step, m, by, true, Some(dir.path())).await?;
        let (metas, d): (Vec<TensorMeta>, Vec<Digest>) = digests.iter().cloned().unzip();
        ops::check_root(&metas, &d, &m.shards, m.weights_root)?;
        Ok((dir, bytes, digests))
    }

    /// The verified manifest of anchor `a` (with its planned marker), signed for stream `sid`.
    async fn anchor_manifest(
        &self,
        a: u64,
        cands: &plan::Candidates,
        sid: &str,
        at: &mut Attempt,
    ) -> BindResult<AnchorManifest> {
        at.on(cands, StepKind::Anchor, a);
        let (m, _) = match cands.marker(StepKind::Anchor, a) {
            Some(marker) => self.reader.anchor_at(a, marker).await?,
            None => self.reader.anchor(a).await?,
        };
        same_stream(sid, &m.stream_id, "anchor manifest", a)?;
        Ok(m)
    }

    /// Fetches and checks every delta of `chain` from `from` before anything is written: signed
    /// manifest, objects against their SHA-256, stream, each base the previous result, layout
    /// (`LayoutChanged` with `detail`). A fault in any of them is that step's, with the target
    /// untouched. The checked segments wait in memory up to `chain_memory` bytes, beyond that
    /// in a TMPDIR spool: a long catch-up does not hold an anchor's worth of deltas in RAM.
    /// `recheck` says which broken links name neither side ([`Recheck`]): then `at.recheck`
    /// is set and the route is retried carefully (the agent's rule).
    #[allow(clippy::too_many_arguments)]
    async fn fetch_chain(
        &self,
        chain: &[u64],
        cands: &plan::Candidates,
        sid: &str,
        from: &Tracked,
        recheck: Recheck,
        at: &mut Attempt,
        detail: &str,
    ) -> BindResult<CheckedChain> {
        let mut out = CheckedChain { deltas: Vec::with_capacity(chain.len()), bytes: 0, _spool: None };
        let mut root = from.root;
        for (k, &d) in chain.iter().enumerate() {
            at.on(cands, StepKind::Delta, d);
            let m = self.delta_manifest(d, cands).await?;
            same_stream(sid, &m.stream_id, "delta manifest", d)?;
            // A link to a state not verified yet (the anchor not hashed, or an earlier delta of
            // the chain, whose result only the final root proves) names neither side: retried
            // carefully, where the links after the first are checked as each delta is applied,
            // its base verified.
            if m.base_root != root && !at.careful && if k == 0 { recheck.first } else { recheck.later } {
                at.at = None;
                at.recheck = true;
            }
            // (Careful, on a chain that may be rechecked, the links after the first are checked
            // as the deltas are applied, each base verified first.)
            if m.base_root != root && (k == 0 || !(at.careful && recheck.later)) {
                return Err(wrong_base(&m, root));
            }
            // From the manifest, before any segment is downloaded (found by review: a layout
            // change, possibly a large new tensor, was downloaded at every call only to be
            // refused here).
            if ops::needs_rewrite(&from.layout, &m) {
                return Err(BindError::LayoutChanged { step: d, detail: detail.into() });
            }
            let (segs, b) = self.delta_segments(d, &m).await?;
            out.bytes += b;
            root = m.result_root;
            let segs = if out.bytes <= self.chain_memory {
                Held::Mem(segs)
            } else {
                if out._spool.is_none() {
                    out._spool = Some(Spool::new(None, "chain").map_err(spool_io)?);
                }
                let dir = out._spool.as_ref().expect("created").path();
                let mut paths = Vec::with_capacity(segs.len());
                for (i, b) in segs.iter().enumerate() {
                    let p = dir.join(format!("{d}-{i}"));
                    std::fs::write(&p, b).map_err(spool_io)?;
                    paths.push(p);
                }
                Held::Spooled(paths)
            };
            out.deltas.push((d, m, segs));
        }
        Ok(out)
    }

    /// A delta's manifest, from its planned marker (no second marker GET).
    async fn delta_manifest(&self, step: u64, cands: &plan::Candidates) -> BindResult<DeltaManifest> {
        let (m, _) = match cands.marker(StepKind::Delta, step) {
            Some(marker) => self.reader.delta_at(step, marker).await?,
            None => self.reader.delta(step).await?,
        };
        Ok(m)
    }

    /// The segments of delta `step`, each checked against its manifest `m`, and their bytes.
    async fn delta_segments(&self, step: u64, m: &DeltaManifest) -> BindResult<(Vec<Bytes>, u64)> {
        let r = &self.reader;
        let segs: Vec<Bytes> = futures::stream::iter(m.segments.iter())
            .map(|s| r.object(StepKind::Delta, step, &s.object.object, s.object.size, s.object.sha256))
            .buffered(8)
            .try_collect()
            .await?;
        let bytes = segs.iter().map(|b| b.len() as u64).sum();
        Ok((segs, bytes))
    }

    /// Applies the planned route onto `parts` (caller arrays). Returns the new tracked state,
    /// the route's name, bytes downloaded and deltas applied; `None` when up to date.
    async fn apply(
        &self,
        local: Option<&Tracked>,
        want: Option<u64>,
        parts: &[(TensorMeta, Raw)],
        pl: Planning<'_>,
        at: &mut Attempt,
    ) -> BindResult<Option<(Tracked, &'static str, u64, usize)>> {
        let Some((target, anchor_step, chain, sid, cands)) = self.plan(local, want, pl, Who::Arrays).await? else {
            return Ok(None);
        };
        let mut bytes = 0;
        let by: HashMap<&str, Raw> = parts.iter().map(|(m, r)| (m.name.as_str(), *r)).collect();
        // The anchor's manifest and the arrays' layout first, then every delta of the chain is
        // fetched and checked (signed manifest, objects against their SHA-256, stream, each
        // base the previous result, layout) before anything is written: a fault in any of them
        // is that step's, refused with the arrays untouched. The checked segments wait in
        // memory up to `chain_memory`, in a TMPDIR spool beyond.
        let anchor = match anchor_step {
            Some(a) => {
                let m = self.anchor_manifest(a, &cands, &sid, at).await?;
                let layout = m.layout();
                check_set(&layout, parts, a)?;
                Some((a, m, layout))
            }
            None => None,
        };
        let mut cur = match &anchor {
            Some((a, m, layout)) => Tracked {
                step: *a,
                root: m.weights_root,
                layout: layout.clone(),
                stream: sid.clone(),
                created: pl.created,
            },
            None => {
                let l = local.expect("a delta route starts from a local state").clone();
                check_set(&l.layout, parts, l.step)?;
                l
            }
        };
        let detail = "arrays cannot follow in place; load the new checkpoint (sync_dir) and start a new Follower state with reset()";
        let careful = at.careful;
        // The anchor is loaded after the chain is checked (a bad delta then costs the arrays
        // nothing), except when careful: proven first, so that the chain's base check and its
        // result name the anchor or the delta, never the wrong one.
        let mut early = None;
        if let Some((a, m, _)) = anchor.as_ref().filter(|_| careful) {
            early = Some(self.load_anchor(*a, m, &by, local.is_some(), true, &cands, at).await?);
        }
        // The first link is against the anchor, not hashed unless careful (which proves it
        // before anything is written); the later ones may be rechecked only when the arrays
        // hold nothing verified (a careful pass checks them as it writes).
        let recheck = Recheck { first: anchor.is_some(), later: local.is_none() };
        let CheckedChain { deltas, bytes: fetched, _spool } =
            self.fetch_chain(&chain, &cands, &sid, &cur, recheck, at, detail).await?;
        bytes += fetched;
        if let Some((a, m, _)) = &anchor {
            let (b, spool) = match early {
                Some(l) => l,
                None => self.load_anchor(*a, m, &by, local.is_some(), chain.is_empty(), &cands, at).await?,
            };
            bytes += b;
            if let Some(spool) = spool {
                at.on(&cands, StepKind::Anchor, *a);
                at.touched = true;
                fill_from_spool(spool.path(), m, &by)?;
            }
        }
        // Steps whose result the final root alone proves: more than one, and a wrong final
        // root names none of them.
        let unproven_steps = chain.len() + usize::from(anchor.is_some() && local.is_none() && !careful);
        // From the caller's verified arrays, each delta is applied with what takes it back out
        // (`ops::Undo`: nothing for ulp changes, the bytes dense entries write over, within
        // `chain_memory`): a result that does not verify is taken back out and the arrays,
        // hashed again, are the verified step they were (found by review: a delta with a wrong
        // result root cost the arrays their verified weights, refused nothing, and the next
        // call reloaded an anchor).
        let from_arrays = match (&anchor, local) {
            (None, Some(l)) => Some(l.root),
            _ => None,
        };
        let mut undo_budget = self.chain_memory;
        let mut done: Vec<(DeltaManifest, Held, Option<ops::Undo>)> = Vec::with_capacity(chain.len());
        for (d, m, held) in deltas {
            at.on(&cands, StepKind::Delta, d);
            let segs = held.get()?;
            at.touched = true;
            if careful {
                if let Some((prev, _, _)) = done.last() {
                    // SAFETY: as below; read-only views of the borrowed arrays between writes.
                    let views = unsafe { views_of(&cur.layout, &by) };
                    at.on(&cands, StepKind::Delta, prev.step);
                    if let Err(e) = ops::verify_result(&views, prev) {
                        // Its base was proven by a hash (the anchor's, or the previous link's),
                        // except for the first delta onto the caller's arrays: they may be at
                        // fault, as for the final root below, unless they hold their step again.
                        let proven = anchor.is_some() || chain.first() != Some(&prev.step);
                        return Err(self.take_back(e.into(), from_arrays, proven, &cur.layout, &by, &done, at));
                    }
                    at.on(&cands, StepKind::Delta, d);
                }
                if m.base_root != cur.root {
                    return Err(wrong_base(&m, cur.root));
                }
            }
            let undoable = from_arrays.is_some() && done.iter().all(|(_, _, u)| u.is_some());
            let undo = (|| -> BindResult<Option<ops::Undo>> {
                let mut tm = TensorsMut::new();
                for t in cur.layout.tensors() {
                    // SAFETY: the arrays are borrowed writable by the caller of `apply` for the
                    // whole call, and nothing else references them while `tm` lives.
                    tm.insert(&t.name, t.dtype, unsafe { by[t.name.as_str()].slice_mut() });
                }
                // Decoded within the agent's budget (found by review: every segment at once).
                let refs: Vec<&[u8]> = segs.iter().map(|b| &b[..]).collect();
                let ap = ops::Applier::new(&tm, &m, None);
                if undoable {
                    return Ok(ap.apply_all_undoable(&refs, &mut undo_budget)?);
                }
                ap.apply_all(&refs)?;
                Ok(None)
            })()?;
            cur = Tracked { step: d, root: m.result_root, ..cur };
            done.push((m, held, undo));
        }
        let named = anchor.is_none() || careful || unproven_steps <= 1;
        let verified = (|| -> BindResult<()> {
            // SAFETY: writes are done; read-only views of the borrowed arrays.
            let views = unsafe { views_of(&cur.layout, &by) };
            // (The anchor alone was checked as it was loaded.)
            if let Some((m, _, _)) = done.last() {
                ops::verify_result(&views, m)?;
            }
            Ok(())
        })();
        if let Err(e) = verified {
            if from_arrays.is_some() {
                // One delta: its base was the arrays' verified root, so once they hold it
                // again the wrong result is the delta's own. Several: a careful retry names it
                // (careful, the last one's base was proven by the previous link's hash).
                let proven = careful && chain.len() > 1;
                let e = self.take_back(e, from_arrays, proven, &cur.layout, &by, &done, at);
                if !at.touched && chain.len() > 1 && !careful {
                    at.at = None;
                    at.recheck = true;
                }
                return Err(e);
            }
            if !named {
                at.at = None;
                at.recheck = true;
            }
            return Err(e);
        }
        debug_assert_eq!(cur.step, target);
        let route = match (anchor_step, chain.len()) {
            (Some(_), _) => "anchor",
            (None, 1) => "fast",
            _ => "catchup",
        };
        Ok(Some((cur, route, bytes, chain.len())))
    }

    /// After the deltas `done` failed verification with `e`: when they were applied onto the
    /// caller's arrays verified at `root`, takes them back out, newest first, and hashes the
    /// arrays. Holding `root` again, they are untouched for [`with_refusals`] (the verified
    /// step is kept, the next best route taken). Otherwise (an anchor route; no undo: past the
    /// budget; or the arrays changed under the call, which only their bytes show) they stay
    /// touched: the caller is told, and the next call loads an anchor into them. The failing
    /// step, the one `at` names, is refused when its base was `proven` by a hash in this call
    /// or is the restored arrays' root; otherwise nothing is. Returns `e`.
    #[allow(clippy::too_many_arguments)]
    fn take_back(
        &self,
        e: BindError,
        root: Option<Digest>,
        proven: bool,
        layout: &Layout,
        by: &HashMap<&str, Raw>,
        done: &[(DeltaManifest, Held, Option<ops::Undo>)],
        at: &mut Attempt,
    ) -> BindError {
        let restored = root.is_some_and(|root| {
            let undone = done.iter().rev().try_for_each(|(m, held, undo)| -> BindResult<()> {
                let undo = undo.as_ref().ok_or_else(|| corrupt("delta", "no undo"))?;
                let segs = held.get()?;
                let refs: Vec<&[u8]> = segs.iter().map(|b| &b[..]).collect();
                let mut tm = TensorsMut::new();
                for t in layout.tensors() {
                    // SAFETY: as in `apply`: borrowed writable for the call, no other reference.
                    tm.insert(&t.name, t.dtype, unsafe { by[t.name.as_str()].slice_mut() });
                }
                Ok(ops::undo(&tm, m, &refs, undo)?)
            });
            // SAFETY: writes are done; read-only views of the borrowed arrays.
            undone.is_ok() && driftless_format::weights_root(&unsafe { views_of(layout, by) }).1 == root
        });
        if restored {
            at.touched = false;
        }
        if !(restored || proven) {
            at.at = None;
        }
        e
    }

    /// Loads anchor `a` for the arrays `by`. While they hold verified weights (`verified`) it
    /// is proven whole into a spool ([`Self::prove_anchor`]), returned to be copied in once
    /// the route's chain checked out; otherwise it is streamed straight into them, and with
    /// `hash` (the anchor is the result, or a careful retry) checked against its signed root.
    /// Returns the bytes read and the spool.
    #[allow(clippy::too_many_arguments)]
    async fn load_anchor(
        &self,
        a: u64,
        m: &AnchorManifest,
        by: &HashMap<&str, Raw>,
        verified: bool,
        hash: bool,
        cands: &plan::Candidates,
        at: &mut Attempt,
    ) -> BindResult<(u64, Option<Spool>)> {
        at.on(cands, StepKind::Anchor, a);
        if verified {
            let (spool, b, _) = self.prove_anchor(a, m, by).await?;
            return Ok((b, Some(spool)));
        }
        at.touched = true;
        let (b, d) = self.stream_anchor(a, m, by, hash).await?;
        if hash {
            let (metas, d): (Vec<TensorMeta>, Vec<Digest>) = d.into_iter().unzip();
            ops::check_root(&metas, &d, &m.shards, m.weights_root)?;
        }
        Ok((b, None))
    }

    /// Anchor `a` streamed into new host buffers of `from`'s layout, hashed as written and
    /// checked against its signed root.
    async fn mirror_anchor(
        &self,
        a: u64,
        m: &AnchorManifest,
        from: &Tracked,
        cands: &plan::Candidates,
        at: &mut Attempt,
    ) -> BindResult<Vec<(TensorMeta, Vec<u8>)>> {
        at.on(cands, StepKind::Anchor, a);
        let mut tensors: Vec<(TensorMeta, Vec<u8>)> =
            from.layout.tensors().map(|t| Ok((t.clone(), zeroed(t.nbytes()?)?))).collect::<BindResult<_>>()?;
        let by: HashMap<&str, Raw> = tensors
            .iter_mut()
            .map(|(t, d)| (t.name.as_str(), Raw { addr: d.as_mut_ptr() as usize, len: d.len() }))
            .collect();
        let (_, d) = self.stream_anchor(a, m, &by, true).await?;
        let (metas, d): (Vec<TensorMeta>, Vec<Digest>) = d.into_iter().unzip();
        ops::check_root(&metas, &d, &m.shards, m.weights_root)?;
        Ok(tensors)
    }

    /// Like [`Self::apply`] on the host mirror, recording the element indices every delta
    /// writes (`None` for a tensor past [`max_recorded`]: it is yielded whole). Returns the new
    /// state and whether the mirror was (re)loaded from an anchor.
    async fn apply_mirror(
        &self,
        local: Option<&Tracked>,
        want: Option<u64>,
        mirror: &mut Option<Mirror>,
        pl: Planning<'_>,
        at: &mut Attempt,
        indices: &mut BTreeMap<String, Option<Vec<u64>>>,
    ) -> BindResult<Option<(Tracked, bool)>> {
        let Some((_, anchor_step, chain, sid, cands)) = self.plan(local, want, pl, Who::Mirror).await? else {
            return Ok(None);
        };
        let full = anchor_step.is_some();
        // The anchor's manifest, then the whole chain fetched and checked, before the mirror
        // is touched: a bad step in the route costs it nothing (as for `apply`).
        let anchor = match anchor_step {
            Some(a) => {
                let m = self.anchor_manifest(a, &cands, &sid, at).await?;
                Some((a, m))
            }
            None => None,
        };
        let from = match &anchor {
            Some((a, m)) => {
                Tracked { step: *a, root: m.weights_root, layout: m.layout(), stream: sid.clone(), created: pl.created }
            }
            None => mirror.as_ref().expect("a mirror to apply onto").at.clone(),
        };
        let detail = "patches cannot express it; reload the model (sync_dir) and call reset()";
        let careful = at.careful;
        // An anchor route builds a new mirror beside the one held, which is replaced only once
        // the whole route verified (found by review: it was replaced before the anchor was
        // streamed, so a bad anchor or a dropped connection cost the verified mirror, and the
        // next call re-sent the whole model). A delta route changes the mirror held.
        // The anchor is loaded once the chain checked out, or, careful, first (as `apply`).
        let mut fresh: Option<Vec<(TensorMeta, Vec<u8>)>> = None;
        if careful {
            if let Some((a, m)) = &anchor {
                fresh = Some(self.mirror_anchor(*a, m, &from, &cands, at).await?);
            }
        }
        // From an anchor the mirror is built in new buffers: any link may be rechecked.
        let recheck = Recheck { first: anchor.is_some(), later: anchor.is_some() };
        let CheckedChain { deltas, _spool, .. } =
            self.fetch_chain(&chain, &cands, &sid, &from, recheck, at, detail).await?;
        if let Some((a, m)) = anchor.as_ref().filter(|_| !careful) {
            fresh = Some(self.mirror_anchor(*a, m, &from, &cands, at).await?);
        }
        let onto_held = fresh.is_none();
        let tensors = match &mut fresh {
            Some(t) => t,
            None => &mut mirror.as_mut().expect("a mirror to apply onto").tensors,
        };
        let mut cur = from;
        // What each tensor may record along the route ([`max_recorded`]), and what it has.
        let most: HashMap<String, u64> =
            tensors.iter().map(|(t, _)| Ok((t.name.clone(), max_recorded(t.numel()?)))).collect::<BindResult<_>>()?;
        let recorded = Mutex::new((std::mem::take(indices), HashMap::<String, u64>::new()));
        // Onto the mirror held, each delta is applied with what takes it back out, as `apply`
        // does onto verified arrays: a result that does not verify is taken back out and the
        // mirror is kept (found by review: it was dropped, and the next call reloaded an
        // anchor and yielded the whole model).
        let held_root = onto_held.then_some(cur.root);
        let mut undo_budget = self.chain_memory;
        let mut done: Vec<(DeltaManifest, Held, Option<ops::Undo>)> = Vec::with_capacity(deltas.len());
        let n = deltas.len();
        for (d, m, held) in deltas {
            if let Some((prev, _, _)) = done.last().filter(|_| careful) {
                at.on(&cands, StepKind::Delta, prev.step);
                if let Err(e) = ops::verify_result(&host_views(tensors), prev) {
                    // (The mirror is only ever written here: every base is proven.)
                    return Err(self.take_back(e.into(), held_root, true, &cur.layout, &raws_of(tensors), &done, at));
                }
            }
            at.on(&cands, StepKind::Delta, d);
            if careful && m.base_root != cur.root {
                return Err(wrong_base(&m, cur.root));
            }
            let segs = held.get()?;
            at.touched |= onto_held;
            let mut tm = TensorsMut::new();
            for (t, data) in tensors.iter_mut() {
                tm.insert(&t.name, t.dtype, data);
            }
            let refs: Vec<&[u8]> = segs.iter().map(|b| &b[..]).collect();
            let undoable = onto_held && done.iter().all(|(_, _, u)| u.is_some());
            // Decoded within the budget the agent and `driftless patch` keep (found by review:
            // every segment was decoded at once, up to a core's worth of 2 GiB segments).
            let budget = undoable.then_some(&mut undo_budget);
            let undo = ops::Applier::new(&tm, &m, None).apply_all_then(&refs, budget, |seg| {
                for (i, e) in seg.entries.iter().enumerate() {
                    let n = if e.dense { e.len } else { e.count };
                    // Counted before the indices are made: what is held stays within the
                    // bound whatever the entries claim.
                    let record = {
                        let mut g = recorded.lock().unwrap_or_else(|e| e.into_inner());
                        let (idx, counted) = &mut *g;
                        let c = counted.entry(e.name.clone()).or_default();
                        let whole = matches!(idx.get(&e.name), Some(None));
                        let fits = !whole && c.saturating_add(n) <= most.get(&e.name).copied().unwrap_or(0);
                        if fits {
                            *c += n;
                        } else {
                            idx.insert(e.name.clone(), None);
                        }
                        fits
                    };
                    if record {
                        let v = seg.entry_indices(i)?;
                        let mut g = recorded.lock().unwrap_or_else(|e| e.into_inner());
                        if let Some(l) = g.0.entry(e.name.clone()).or_insert_with(|| Some(vec![])) {
                            l.extend(v);
                        }
                    }
                }
                Ok(())
            })?;
            drop(tm);
            cur = Tracked { step: d, root: m.result_root, ..cur };
            done.push((m, held, undo));
        }
        // One hash for the route, as for `apply` and the agent: every result root is signed,
        // so the last one proves the final state.
        // More than one delta: a wrong final root names none of them (`recheck`).
        if let Some((m, _, _)) = done.last() {
            if let Err(e) = ops::verify_result(&host_views(tensors), m) {
                let e = self.take_back(e.into(), held_root, true, &cur.layout, &raws_of(tensors), &done, at);
                if n > 1 && !careful {
                    at.at = None;
                    at.recheck = true;
                }
                return Err(e);
            }
        }
        *indices = recorded.into_inner().unwrap_or_else(|e| e.into_inner()).0;
        if let Some(tensors) = fresh {
            *mirror = Some(Mirror { at: cur.clone(), tensors, pending: None });
        }
        Ok(Some((cur, full)))
    }
}

/// Host buffers as the raw parts [`PyFollower::take_back`] writes through (nothing else may
/// reference them meanwhile).
fn raws_of(tensors: &mut [(TensorMeta, Vec<u8>)]) -> HashMap<&str, Raw> {
    tensors.iter_mut().map(|(t, d)| (t.name.as_str(), Raw { addr: d.as_mut_ptr() as usize, len: d.len() })).collect()
}

fn host_views(tensors: &[(TensorMeta, Vec<u8>)]) -> Vec<TensorView<'_>> {
    tensors.iter().map(|(t, d)| TensorView { name: &t.name, dtype: t.dtype, shape: &t.shape, data: d }).collect()
}

/// Runs `attempt` (one planned route from `local` toward `want`) until it succeeds, fails
/// after writing over a verified target, or fails for a reason that is not its step's own (storage
/// trouble, local I/O, bad arguments). A step that fails verification is refused, bound to
/// its marker, for `refuse_for`; when no verified state was written over (nothing written
/// yet, or a first load: `local` is `None`), the route is planned again
/// without it (as often as the agent does: `plan::MAX_REFUSED_ROUNDS`,
/// `plan::MAX_UNUSABLE_ROUNDS`): the verified state is kept and the next
/// best route taken. When nothing is left to reach because of a refusal between `local` and
/// `want`, that refusal is the error, not "nothing ready". Returns the result and whether any
/// attempt wrote into its target.
fn with_refusals<T>(
    plans: &mut Plans,
    local: Option<u64>,
    want: Option<u64>,
    mut attempt: impl FnMut(Planning<'_>, &mut Attempt) -> BindResult<T>,
) -> (BindResult<T>, bool) {
    plans.refused.begin_round();
    // The markers of refused steps are read again once their refusal runs out (a repaired
    // step has a new one), as the agent does.
    for (k, s) in plans.refused.expired() {
        plans.markers.forget(k, s);
    }
    plans.markers.begin_sync();
    let mut fault: Option<BindError> = None;
    // Whether any attempt wrote into the target (a first load goes on after a touched one).
    let mut touched = false;
    // Refused steps, as the agent counts them: those that failed before anything was written
    // (a planted marker costs one GET) have a budget of their own (found by review: 40
    // planted markers used up the 32 attempts and failed a cold `apply_to`).
    let (mut written, mut unwritten) = (0, 0);
    // Every step checked on its own, once a route failed without naming one (for the rest of
    // the call, as the agent's careful retry).
    let mut careful = false;
    loop {
        let mut at = Attempt { careful, ..Attempt::default() };
        let r = attempt(plans, &mut at);
        touched |= at.touched;
        // (A step fault is refused with its fault; `if let` guards need a newer Rust.)
        let r = r.map_err(|e| (e.fault(), e));
        match (r, at.at) {
            // The same route again, carefully: nothing refused yet. (Not over a target that
            // held verified weights and was written: the caller must know first.)
            (Err(_), None) if at.recheck && !careful && !(touched && local.is_some()) => careful = true,
            (Err((Some(f), e)), Some((kind, step, sha))) => {
                plans.refused.refuse(kind, step, sha, e.message(), f);
                // As the agent: a marker whose manifest did not match is read again next round.
                if e.is_missing() {
                    plans.markers.forget(kind, step);
                }
                if touched && local.is_some() {
                    // The target is no longer the verified state: the caller must know.
                    return (Err(e), true);
                }
                let n = if at.touched { &mut written } else { &mut unwritten };
                *n += 1;
                if written >= plan::MAX_REFUSED_ROUNDS || unwritten >= plan::MAX_UNUSABLE_ROUNDS {
                    return (Err(e), touched);
                }
                // Untouched, or a first load (the target held nothing verified to lose): the
                // next best route, in this call. (The error told is the gravest: a step's
                // manifest gone is not what the caller needs to hear of a corrupt one.)
                if !(e.is_missing() && fault.as_ref().is_some_and(|f| !f.is_missing())) {
                    fault = Some(e);
                }
            }
            (Err((_, BindError::NothingReady(m))), _) => {
                // Nothing to reach because of refusals: say which step, not "nothing ready".
                if let Some(e) = fault {
                    return (Err(e), touched);
                }
                // Only a refusal that stands between `local` and `want` explains it.
                let newest = plans
                    .refused
                    .list()
                    .into_iter()
                    .filter(|(_, s, _)| local.is_none_or(|l| *s > l) && want.is_none_or(|w| *s <= w))
                    .max_by_key(|(_, s, _)| *s);
                let e = match newest {
                    // Objects missing (not there yet, or collected under a stale plan): storage
                    // trouble that retrying can cure, not bad data (found by review: it raised
                    // CorruptError, "failed verification", for the whole refusal).
                    Some((kind, step, r)) if r.fault.is_missing() => {
                        BindError::Missing(driftless_format::one_line_within(
                            &format!("{kind} {step} is left out for now: its objects are missing ({})", r.reason),
                            5 * driftless_format::MAX_DETAIL,
                        ))
                    }
                    // The class of the error that refused it (found by review: always
                    // CorruptError, an untrusted step's refusal too).
                    Some((kind, step, r)) => BindError::Refused(
                        r.fault,
                        driftless_format::one_line_within(
                            &format!("{kind} {step} is refused for now (it failed verification: {})", r.reason),
                            5 * driftless_format::MAX_DETAIL,
                        ),
                    ),
                    None => BindError::NothingReady(m),
                };
                return (Err(e), touched);
            }
            (r, _) => return (r.map_err(|(_, e)| e), touched),
        }
    }
}

/// What `apply_to` tracks after a call, and so whose objects `owners` must hold.
enum Tracking {
    /// The arrays of this call: they hold the verified step.
    These,
    /// Nothing: the arrays were written and hold no verified step.
    Nothing,
    /// What was tracked before: a call on other arrays failed before writing them.
    Unchanged,
}

/// The refusals of steps after `step` still in force, as `(kind, step, reason)`.
fn refused_after(refused: &plan::Refusals, step: Option<u64>) -> Vec<(&'static str, u64, String)> {
    refused
        .list()
        .into_iter()
        .filter(|(_, s, _)| step.is_none_or(|l| *s > l))
        .map(|(k, s, r)| {
            let kind = match k {
                StepKind::Delta => "delta",
                StepKind::Anchor => "anchor",
            };
            (kind, s, r.reason.clone())
        })
        .collect()
}

/// [`PyFollower::stream_anchor`] out of `bucket`. With `spool`, nothing is written into the
/// arrays: every shard is checked against them and its decoded file written to
/// `spool/<index>` instead ([`PyFollower::prove_anchor`]).
async fn stream_anchor_from(
    bucket: &Bucket,
    step: u64,
    m: &AnchorManifest,
    by: &HashMap<&str, Raw>,
    hash: bool,
    spool: Option<&std::path::Path>,
) -> BindResult<(u64, Vec<(TensorMeta, Digest)>)> {
    let layout = m.layout();
    if m.objects.len() != layout.shards.len() {
        return Err(corrupt("anchor", "shard count differs from the manifest"));
    }
    let (mut jobs, mut hashing) = (Vec::with_capacity(m.objects.len()), Vec::new());
    for (i, (o, shard)) in m.objects.iter().zip(&layout.shards).enumerate() {
        if o.file != shard.file {
            return Err(corrupt("anchor", format!("shard {} is not the manifest's {}", o.file, shard.file)));
        }
        let spool = spool.map(|d| FileSink::new(spooled(d, i), o.decoded_size, false));
        let arrays = ArraySink::new(o.decoded_size, shard, by, spool);
        let sink = hashed(arrays, o.decoded_size, hash, &mut hashing);
        jobs.push(ShardJob { object: o, tensors: &shard.tensors, sink, sized: false });
    }
    if let Some(d) = spool {
        // Each spooled file is checked for room on its own (sparse on a tmpfs): all of them first.
        let total = m.objects.iter().map(|o| o.decoded_size).fold(0u64, u64::saturating_add);
        driftless_format::checkpoint::check_room(d, total)?;
    }
    let bytes = stream_anchor(bucket, step, m.encoding, jobs, default_anchor_parts()).await?;
    Ok((bytes, digests_of(hashing)?))
}

/// A zeroed buffer of `n` bytes for the host mirror, or an error when it cannot be had: the
/// size comes from a (signed, still hostile) manifest, and a failed `vec![0; n]` aborts the
/// process. Zeroed by the allocator (calloc), so pages are only faulted in when written.
/// What `_patches` hands to `iter_patches`: `(delivery, step, root, patches)`.
type Delivery<'py> = (u64, u64, String, Bound<'py, PyList>);

/// The mirror, while `delivery` is the one pending.
fn current(st: &State, delivery: u64) -> BindResult<&Mirror> {
    st.mirror.as_ref().filter(|m| m.pending == Some(delivery)).ok_or_else(|| {
        BindError::Input(
            "another iter_patches call moved the host mirror while this iterator ran: \
             the next call yields every tensor whole"
                .into(),
        )
    })
}

fn zeroed(n: u64) -> BindResult<Vec<u8>> {
    let too_big = || driftless_format::Error::Io {
        path: "host mirror".into(),
        source: std::io::Error::new(std::io::ErrorKind::OutOfMemory, format!("cannot allocate a tensor of {n} bytes")),
    };
    let n = usize::try_from(n).map_err(|_| too_big())?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(n).map_err(|_| too_big())?;
    // SAFETY: the layout has a nonzero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return Err(too_big().into());
    }
    // SAFETY: `p` comes from the global allocator with the layout of `[u8; n]` (alignment 1,
    // size n = capacity), and its n bytes are initialized (zero).
    Ok(unsafe { Vec::from_raw_parts(p, n, n) })
}

/// The spool file of shard `i` of a proven anchor.
fn spooled(dir: &std::path::Path, i: usize) -> PathBuf {
    dir.join(format!("{i}.safetensors"))
}

/// The second half of [`PyFollower::prove_anchor`]: copies the decoded shard files it proved
/// out of `dir` into the arrays: the header first (it maps the tensors to the arrays again),
/// then every tensor read straight into its array ([`FILL_PIECE`] per read, on all cores; no
/// buffer in between). The files are this process's own, written from bytes that were hashed
/// on their way in (local disk, trusted as the chain's spool is).
fn fill_from_spool(dir: &std::path::Path, m: &AnchorManifest, by: &HashMap<&str, Raw>) -> BindResult<()> {
    use std::os::unix::fs::FileExt;
    let layout = m.layout();
    for (i, (o, shard)) in m.objects.iter().zip(&layout.shards).enumerate() {
        let f = std::fs::File::open(spooled(dir, i)).map_err(spool_io)?;
        let sink = ArraySink::new(o.decoded_size, shard, by, None);
        let mut n = [0u8; 8];
        f.read_exact_at(&mut n, 0).map_err(spool_io)?;
        let head_end = Some(u64::from_le_bytes(n))
            .filter(|&n| n <= driftless_format::checkpoint::MAX_HEADER as u64)
            .and_then(|n| n.checked_add(8))
            .filter(|&e| e <= o.decoded_size)
            .ok_or_else(|| spool_io(std::io::Error::other("spooled shard has a bad header")))?;
        let mut head = vec![0u8; head_end as usize];
        f.read_exact_at(&mut head, 0).map_err(spool_io)?;
        sink.write_at(0, &head)?;
        let (Some(tensors), Some(arrays)) = (sink.tensors.get(), sink.arrays.get()) else {
            return Err(spool_io(std::io::Error::other("spooled shard has no header")));
        };
        // (array, offset in it, offset in the file, length) of every read.
        let mut reads = vec![];
        for ((_, a, b), dst) in tensors.tensors().iter().zip(arrays) {
            reads.extend((*a..*b).step_by(FILL_PIECE).map(|at| (*dst, at - a, at, (b - at).min(FILL_PIECE as u64))));
        }
        reads.into_par_iter().try_for_each(|(dst, off, at, len)| {
            // SAFETY: `dst` is borrowed writable for the whole load; [off, off + len) lies
            // inside it (a tensor's range is its array's length, checked by the header's
            // write), and the reads never overlap.
            let buf = unsafe { std::slice::from_raw_parts_mut((dst.addr as *mut u8).add(off as usize), len as usize) };
            f.read_exact_at(buf, at).map_err(spool_io)
        })?;
    }
    Ok(())
}

/// Bytes of a spooled shard read into an array per call.
const FILL_PIECE: usize = 4 << 20;

/// Default bytes of a checked delta chain held in memory until its writing pass (`apply`).
const CHAIN_IN_MEMORY: u64 = 256 << 20;

/// The checked segments of one delta of a chain.
/// A delta chain fetched and checked, waiting for its writing pass ([`PyFollower::fetch_chain`]).
struct CheckedChain {
    deltas: Vec<(u64, DeltaManifest, Held)>,
    /// Bytes downloaded.
    bytes: u64,
    /// Where segments beyond `chain_memory` wait (removed on drop).
    _spool: Option<Spool>,
}

enum Held {
    Mem(Vec<Bytes>),
    /// In the chain's TMPDIR spool (local disk: not checked again).
    Spooled(Vec<PathBuf>),
}

impl Held {
    /// The segments (those in memory are shared, not copied; spooled ones are read again).
    fn get(&self) -> BindResult<Vec<Bytes>> {
        match self {
            Held::Mem(v) => Ok(v.clone()),
            Held::Spooled(p) => p.iter().map(|p| std::fs::read(p).map(Bytes::from).map_err(spool_io)).collect(),
        }
    }
}

fn spool_io(e: std::io::Error) -> BindError {
    driftless_agent::Error::Io(std::io::Error::new(e.kind(), format!("spool: {e}"))).into()
}

// Anchor parts in flight (all shards together): the agent's default `anchor_parts`.
use driftless_agent::default_anchor_parts;

fn corrupt(what: &'static str, detail: impl Into<String>) -> BindError {
    driftless_format::Error::corrupt(what, detail).into()
}

/// One anchor shard going into arrays: its header (the first write) must list exactly the
/// manifest's tensors of that shard and says where each lies in the file; every later byte is
/// copied into the array whose range holds it (header bytes are not kept).
struct ArraySink {
    file: String,
    size: u64,
    expect: Vec<TensorMeta>,
    by: HashMap<String, Raw>,
    /// The shard's tensors, set by the header.
    tensors: OnceLock<ShardTensors>,
    /// The array of each of them, in the same order, set with them.
    arrays: OnceLock<Vec<Raw>>,
    /// Check every part against the arrays but write none of them: the decoded bytes go to
    /// this spool file instead (the first pass of a checked load).
    spool: Option<FileSink>,
}

impl ArraySink {
    /// Shard `shard` (of `size` decoded bytes) going into the arrays `by`, or, with `spool`,
    /// checked against them and written to that file.
    fn new(size: u64, shard: &driftless_format::ShardLayout, by: &HashMap<&str, Raw>, spool: Option<FileSink>) -> Self {
        ArraySink {
            size,
            file: shard.file.clone(),
            expect: shard.tensors.clone(),
            by: shard.tensors.iter().filter_map(|t| Some((t.name.clone(), *by.get(t.name.as_str())?))).collect(),
            tensors: OnceLock::new(),
            arrays: OnceLock::new(),
            spool,
        }
    }

    /// The array of every tensor of the header, checked against the manifest's tensors.
    fn map_arrays(&self, tensors: &ShardTensors) -> driftless_agent::Result<Vec<Raw>> {
        let bad = |d: String| -> driftless_agent::Error { driftless_format::Error::corrupt("anchor", d).into() };
        if tensors.tensors().len() != self.expect.len() {
            return Err(bad(format!("{} has other tensors than its manifest", self.file)));
        }
        tensors
            .tensors()
            .iter()
            .map(|(meta, a, b)| {
                if !self.expect.contains(meta) {
                    return Err(bad(format!("{}: tensor {} not in its manifest", self.file, meta.name)));
                }
                // The arrays were checked against the manifest's tensors (`check_set`).
                let dst = *self.by.get(&meta.name).ok_or_else(|| bad(format!("no array for tensor {}", meta.name)))?;
                if dst.len as u64 != b - a {
                    return Err(bad(format!("tensor {} has {} bytes, its array {}", meta.name, b - a, dst.len)));
                }
                Ok(dst)
            })
            .collect()
    }
}

impl ShardSink for ArraySink {
    fn write_at(&self, at: u64, bytes: &[u8]) -> driftless_agent::Result<()> {
        let tensors = shard_tensors(&self.tensors, at, bytes, self.size)?;
        let arrays = match self.arrays.get() {
            Some(a) => a,
            None => {
                let a = self.map_arrays(tensors)?;
                self.arrays.get_or_init(|| a)
            }
        };
        if let Some(f) = &self.spool {
            // Only after the header was checked against the arrays (`map_arrays`): the
            // spool's size is then theirs, however large the manifest says the shard is.
            return f.write_at(at, bytes);
        }
        for (i, lo, hi) in tensors.overlaps(at, at + bytes.len() as u64) {
            let (a, dst) = (tensors.tensors()[i].1, arrays[i]);
            let src = &bytes[(lo - at) as usize..(hi - at) as usize];
            // SAFETY: `dst` is borrowed writable for the whole load; [lo - a, hi - a) lies
            // inside it (a tensor's range is its array's length, checked above), and chunks
            // never overlap, so no two writers touch the same bytes. Raw pointers, not
            // slices of the whole array: several threads write one array at once.
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr(), (dst.addr as *mut u8).add((lo - a) as usize), src.len())
            };
        }
        Ok(())
    }
}
