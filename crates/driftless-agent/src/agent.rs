//! The sync loop: plan (see [`crate::plan`]), build the next step in the inactive slot,
//! verify it, make it durable, switch `current` to it, notify.
//!
//! The promise: `current` only ever names a complete step whose weights root was verified; a
//! fault in the bucket (corrupt, missing, forged, replayed, foreign object) refuses that step
//! and keeps the verified weights; nothing read from the bucket can make the agent hang or
//! grow without bound. See `state.rs` for the directory layout and the durability order.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use driftless_format::checkpoint::write_index;
use driftless_format::delta::{self, DecodedSegment};
use driftless_format::manifest::{now_ms, DeltaManifest, LatestHint, ReadyMarker, StepKind};
use driftless_format::{anchor, fused, ops, Checkpoint, CheckpointFiles, Digest, Layout, TensorMeta, TrustSet};
use driftless_store::stream::{LatestPoll, LatestVersion, LatestWatch, StreamError, StreamReader};
use driftless_store::Bucket;
use futures::{StreamExt, TryStreamExt};
use tracing::{debug, error, info, info_span, warn, Instrument};

use crate::anchor_stream::{digests_of, hashed, stream_anchor, FileSink, ShardJob};
use crate::metrics::Metrics;
use crate::notify::Notifier;
use crate::patch::{PatchBuilder, PatchFile};
use crate::plan::{self, Candidates, Fault, MarkerCache, Refusals, Route};
use crate::plan::{MAX_REFUSED_ROUNDS, MAX_UNUSABLE_ROUNDS};
use crate::state::{sync_dir, sync_tree, AgentDir, Held, LocalState, Slot};
use crate::{Error, Result};

/// Agent settings.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Local directory (see the crate docs for its layout).
    pub dir: PathBuf,
    /// Accepted signing keys.
    pub trust: TrustSet,
    /// Inference servers to notify.
    pub notify: Vec<Notifier>,
    /// Fastest poll interval (while steps arrive). Default 500 ms.
    pub poll_min: Duration,
    /// Slowest poll interval (idle). Default 10 s.
    pub poll_max: Duration,
    /// Concurrent object downloads. Default 8.
    pub download_concurrency: usize,
    /// Chunks of an anchor (16 MiB decoded each) downloaded and decoded at once during a cold
    /// start, shared by the shards streaming side by side (`anchor_stream::share_parts`: 4
    /// parts are two shards of two): the memory of a cold start is about 25-30 MiB per part
    /// (the chunk as stored and its decoded planes; its bytes are interleaved 1 MiB at a time)
    /// on top of about 100 MiB, whatever the model size. Default [`default_anchor_parts`]: half
    /// the cores, 4 to 8.
    pub anchor_parts: usize,
    /// How long a refused step stays out of plans before it is tried again (doubling on each
    /// repeated failure). Default 30 s.
    pub refuse_for: Duration,
    /// Bytes of tensors an idle rebuild copies between two looks for a new step (the pass
    /// gives way at its next group). Default [`IDLE_GROUP_BYTES`]. Smaller groups give way
    /// sooner; each group ends on one tensor's tail, where cores may wait.
    pub idle_group_bytes: u64,
}

impl AgentConfig {
    /// Defaults for a directory and trust set.
    pub fn new(dir: impl Into<PathBuf>, trust: TrustSet) -> Self {
        AgentConfig {
            dir: dir.into(),
            trust,
            notify: vec![],
            poll_min: Duration::from_millis(500),
            poll_max: Duration::from_secs(10),
            download_concurrency: 8,
            anchor_parts: default_anchor_parts(),
            refuse_for: Duration::from_secs(30),
            idle_group_bytes: IDLE_GROUP_BYTES,
        }
    }
}

/// Anchor parts in flight by default: half the cores the process may use, at least 4 and at
/// most 8. With signed parts (each checked as it arrives, no serial stage), a cold start is
/// bounded by the parts in flight times each one's turn (fetch, check beside decode, write,
/// hash). Measured on a 16-core host (`speed_bench coldmem`, one-shard anchors, two rounds,
/// next to the build before signed parts at its 4 parts: 2.56-2.93 s, 269-310 MiB): 4 GiB at
/// 4 parts 2.61-2.68 s (263-272 MiB), at 8 parts 1.70-1.71 s (1.08-1.10x max(read, hash);
/// 477 MiB; 1.89-2.31 s, 1.33x, in a noisier later run), at 16 parts 1.48-1.88 s (867-886
/// MiB): past 8, memory doubles for little. (Those figures are of a build whose parts held
/// their decoded bytes too; a part now holds about 26 MiB: README, "A part without its decoded
/// bytes".) On 2 cores (this project's VM) a cold start is CPU-bound, and more parts only add
/// memory.
pub fn default_anchor_parts() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get() / 2).clamp(4, 8)
}

/// Which route a sync took.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SyncPath {
    /// Already on the newest usable step.
    UpToDate,
    /// One delta onto the local step.
    Fast,
    /// Several deltas from the local step.
    Catchup,
    /// An anchor, then deltas.
    Anchor,
}

impl std::fmt::Display for SyncPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SyncPath::UpToDate => "up_to_date",
            SyncPath::Fast => "fast",
            SyncPath::Catchup => "catchup",
            SyncPath::Anchor => "anchor",
        })
    }
}

/// A step the agent refused (reported with the outcome of a sync).
#[derive(Debug, Clone, serde::Serialize)]
pub struct RefusedStep {
    /// Delta or anchor.
    pub kind: StepKind,
    /// The step.
    pub step: u64,
    /// Why.
    pub reason: String,
    /// What was wrong with it ([`Fault::Missing`]: its objects were missing, not ready yet
    /// or collected; retrying may help, not a verification failure).
    pub fault: Fault,
}

/// Result of a sync.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SyncOutcome {
    /// Verified local step.
    pub step: u64,
    /// Its weights root.
    pub root: Digest,
    /// Route taken.
    pub route: SyncPath,
    /// Bytes downloaded.
    pub bytes: u64,
    /// Deltas applied.
    pub deltas: u32,
    /// Whether the inactive slot had to be rebuilt from the active one (first delta after an
    /// anchor, or after a crash in the middle of building it).
    pub rebuilt: bool,
    /// Seconds spent.
    pub secs: f64,
    /// Steps newer than `step` that are refused (bad, missing or foreign objects): the agent
    /// kept its verified weights and planned around them.
    pub refused: Vec<RefusedStep>,
}

/// The agent.
pub struct Agent {
    cfg: AgentConfig,
    reader: StreamReader,
    metrics: Arc<Metrics>,
    client: reqwest::Client,
    dir: AgentDir,
    state: Option<LocalState>,
    /// The active slot's bytes are known to match `state` (false after an unclean shutdown
    /// until re-verified, or when a re-hash showed them wrong: then nothing is notified and the
    /// next step is rebuilt without using them).
    active_ok: bool,
    /// Re-hash the active slot before using it (set after an unclean shutdown).
    reverify: bool,
    loaded: Option<(u64, Digest)>,
    refused: Refusals,
    markers: MarkerCache,
    stream_id: Option<String>,
    /// When the stream of the local weights (the state's) was created, its signed descriptor's
    /// `created_at_ms`: a descriptor of another stream is followed only when it is not older
    /// (see `stream_id`).
    stream_created: Option<u64>,
    /// The stream id and creation time of the descriptor last read.
    descriptor_created: Option<(String, u64)>,
    /// The slot the build in progress writes, until it stores the state that names it (see
    /// `drop_partial_work`).
    building: Option<Slot>,
    /// Delta segment objects kept in `cache/` (step, SHA-256s), to bring the inactive slot
    /// forward without a second download.
    cached: Vec<(u64, Vec<Digest>)>,
    /// The signed `latest.json` this sync plans from: read by the poll loop, or once at the
    /// start of the sync, and kept for all its rounds.
    hint: Option<LatestHint>,
    /// The poll loop read `latest.json` for the next sync (`hint` is its answer).
    hint_polled: bool,
    /// Plan the next sync from a listing even if a hint would do (the periodic full check).
    list_next: bool,
    /// This build has not yet written the work slot, nor told `state.json` that the slot no
    /// longer holds the inactive step ([`Agent::release_work_slot`]).
    release_pending: bool,
    /// The patch from the step the engine was last told to load to the current step, written
    /// after a delta-only sync when a notifier applies patches; used at most once.
    patch: Option<PatchFile>,
    /// Decoded bytes of segments decoded ahead of their delta being received (permits are
    /// bytes, [`DECODE_AHEAD_BYTES`] in all); see `start_fetch`.
    decode_ahead: Arc<tokio::sync::Semaphore>,
    /// The last delta this agent applied, decoded, when it was at most [`KEEP_DECODED_BYTES`]:
    /// the next step brings the other slot over it ([`Agent::start_fetch`] hands it over
    /// instead of reading its manifest from the bucket and its segments from the cache).
    kept: Option<KeptDelta>,
    /// Set while the servers are being told to load: [`Agent::run`] lets that finish before
    /// it stops (an engine paused for a load must be resumed).
    notifying: Arc<std::sync::atomic::AtomicBool>,
    /// Set once [`Agent::run`] was asked to stop: no new notify starts after it.
    stopping: Arc<std::sync::atomic::AtomicBool>,
    /// The served step for which [`Agent::prepare_inactive`] last ran (done or failed): not
    /// tried again for that step, so a disk without room for a second slot costs one try per
    /// step, not a model's worth of writes at every poll.
    prepared: Option<u64>,
    /// The served step (stream, step) at which the poll loop last stopped an idle rebuild:
    /// at most one stop per served step (see `poll`).
    idle_stopped: Option<(String, u64)>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent").field("dir", &self.cfg.dir).field("state", &self.state).finish()
    }
}

/// Why building a step failed in a way the agent plans around.
enum BuildError {
    /// A step of the stream is at fault: refuse it.
    Step(StepKind, u64, String, Fault),
    /// The same, found from its marker and manifest alone, before any of its payload was
    /// read: cheap to find, so many of them do not end a sync (planted markers).
    Unusable(StepKind, u64, String, Fault),
    /// The final root of a multi-delta chain differs: retry step by step to name the culprit.
    ChainMismatch,
    /// The stream's own signed manifest of the local step gives it another root than the
    /// local copy's: the local files are not this stream's step.
    LocalMismatch(String),
    /// A pinpointed delta's result does not verify: the delta is at fault unless the slot the
    /// pass read (the active slot, on a route without an anchor) no longer holds its step.
    SuspectResult(u64, String),
    /// Anything else (bucket unreachable, local disk): give up this sync, keep state.
    Other(Error),
}

impl From<Error> for BuildError {
    fn from(e: Error) -> Self {
        BuildError::Other(e)
    }
}

impl From<std::io::Error> for BuildError {
    fn from(e: std::io::Error) -> Self {
        BuildError::Other(e.into())
    }
}

/// Whether an error while reading or applying a step is the step's fault (so the step is
/// refused) rather than the bucket's availability or the local machine's.
fn step_fault(e: &Error) -> bool {
    use driftless_format::ErrorKind as K;
    match e {
        Error::Stream(StreamError::NotReady { .. }) | Error::Refused { .. } => true,
        Error::Stream(StreamError::Format(f)) | Error::Format(f) => {
            matches!(f.kind(), K::Corrupt | K::Untrusted | K::WrongBase)
        }
        Error::Stream(StreamError::Store(s)) | Error::Store(s) => {
            s.is_not_found() || s.is_unreadable() || matches!(s, driftless_store::Error::TooLarge { .. })
        }
        _ => false,
    }
}

/// What a step fault is. Only missing (or unreadable) objects can be cured by retrying, once
/// the objects arrive or are made readable, so such a refusal is a "not ready" one that expires.
fn fault(e: &Error) -> Fault {
    match e {
        Error::Stream(StreamError::NotReady { .. }) => Fault::Missing,
        Error::Stream(StreamError::Store(s)) | Error::Store(s) if s.is_not_found() || s.is_unreadable() => {
            Fault::Missing
        }
        Error::Stream(StreamError::Format(f)) | Error::Format(f) => Fault::of_format(f),
        Error::Refused { fault, .. } => *fault,
        _ => Fault::Corrupt,
    }
}

/// "Step not ready" (retryable) for a step refused because objects were missing.
fn not_ready(step: u64, reason: String) -> Error {
    // The reason is often a NotReady's own text: say "not ready" once.
    let prefix = format!("step {step} not ready yet: ");
    let detail = reason.strip_prefix(&prefix).map(str::to_string).unwrap_or(reason);
    Error::Stream(StreamError::NotReady { step, detail })
}

/// What a delta of a chain is applied onto, for who is at fault when its base root disagrees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Base {
    /// A step the agent holds (its state's, either slot): its local files may be at fault.
    Held,
    /// A state of this build not verified yet: either side may be at fault.
    Unproven,
    /// A state this build verified: the delta is at fault.
    Verified,
}

/// A step fault found from the step's manifest, before any payload was read.
fn unusable(e: BuildError) -> BuildError {
    match e {
        BuildError::Step(kind, step, reason, fault) => BuildError::Unusable(kind, step, reason, fault),
        e => e,
    }
}

fn attribute(kind: StepKind, step: u64) -> impl Fn(Error) -> BuildError {
    move |e| {
        if step_fault(&e) {
            BuildError::Step(kind, step, e.to_string(), fault(&e))
        } else {
            BuildError::Other(e)
        }
    }
}

pub(crate) fn corrupt(what: &'static str, detail: impl Into<String>) -> Error {
    driftless_format::Error::corrupt(what, detail).into()
}

impl Agent {
    /// An agent on `bucket`: creates and locks the directory (one agent per directory) and
    /// loads its state.
    pub fn new(bucket: Bucket, cfg: AgentConfig) -> Result<Self> {
        let dir = AgentDir::open(&cfg.dir)?;
        let state = LocalState::load(&cfg.dir)?;
        let metrics = Arc::new(Metrics::new());
        if let Some(s) = &state {
            metrics.step.store(s.step, Relaxed);
        }
        let reverify = dir.unclean && state.is_some();
        let stream_created = state.as_ref().and_then(|s| s.stream_created_ms);
        Ok(Agent {
            reader: StreamReader::new(bucket, cfg.trust.clone()),
            refused: Refusals::new(cfg.refuse_for),
            cfg,
            metrics,
            client: reqwest::Client::new(),
            active_ok: state.is_some(),
            reverify,
            state,
            dir,
            loaded: None,
            markers: MarkerCache::default(),
            stream_id: None,
            stream_created,
            descriptor_created: None,
            building: None,
            cached: vec![],
            hint: None,
            hint_polled: false,
            list_next: false,
            release_pending: false,
            patch: None,
            decode_ahead: Arc::new(tokio::sync::Semaphore::new(DECODE_AHEAD_BYTES)),
            kept: None,
            notifying: Arc::default(),
            stopping: Arc::default(),
            prepared: None,
            idle_stopped: None,
        })
    }

    /// Metrics shared with the HTTP endpoint.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// Local state.
    pub fn state(&self) -> Option<&LocalState> {
        self.state.as_ref()
    }

    /// The checkpoint directory the inference server loads (`DIR/current`, a symlink to the
    /// active slot).
    pub fn current_dir(&self) -> PathBuf {
        self.dir.current()
    }

    /// Refused steps newer than the local one.
    fn refused_newer(&self) -> Vec<RefusedStep> {
        let local = self.state.as_ref().filter(|_| self.active_ok).map(|s| s.step);
        self.refused
            .list()
            .into_iter()
            .filter(|(_, s, _)| local.is_none_or(|l| *s > l))
            .map(|(kind, step, r)| RefusedStep { kind, step, reason: r.reason.clone(), fault: r.fault })
            .collect()
    }

    /// Reaches the newest usable step, verifies it, switches `current` to it and notifies.
    ///
    /// - A verified step the servers have not loaded yet (a failed or interrupted notify) is
    ///   notified first.
    /// - A step whose marker, manifest or objects fail (forged, replayed, foreign, corrupt,
    ///   missing) or whose result does not verify is refused: left out of plans for
    ///   `refuse_for`, the verified local state kept, and the next best route taken (an older
    ///   anchor, an older step). Refusals are listed in [`SyncOutcome::refused`].
    /// - Bucket outages and local I/O errors (disk full) return an error; the verified state
    ///   and `current` are untouched.
    pub async fn sync_once(&mut self) -> Result<SyncOutcome> {
        let t0 = Instant::now();
        // Taken first: a sync that ends early must not leave it for the next one.
        let polled = std::mem::take(&mut self.hint_polled);
        if self.reverify {
            self.reverify_active().await?;
        }
        if !self.cfg.notify.is_empty() && self.active_ok {
            self.notify_if_needed().await?;
        }
        self.refused.begin_round();
        self.markers.begin_sync();
        // A refused step's marker is read again once its refusal runs out (a repaired step
        // has a new one), not at every listing: 40 planted markers cost 40 GETs per listing.
        for (kind, step) in self.refused.expired() {
            self.markers.forget(kind, step);
        }
        // latest.json once per sync (found by review: a sync read it again although the poll
        // had, twice when it did not verify, and once more per refused step). Not when this
        // sync lists anyway, nor without a verified local step for it to plan from.
        if !polled {
            let useful = !self.list_next && self.active_ok && self.state.is_some();
            self.hint = if useful { self.reader.latest(None).await.ok().flatten().map(|(h, _)| h) } else { None };
        }
        let mut careful = false;
        // Steps refused in this sync: after their payload was read (each costs a download),
        // and from their manifest alone (each costs one GET; a bucket can plant thousands,
        // and 32 of them stopped every sync that listed: found by review).
        let (mut rounds, mut unusable) = (0, 0);
        let out = loop {
            match self.sync_inner(careful, t0).await {
                Ok(o) => break o,
                // Already refused by `sync_inner` (bound to the marker it planned with): replan.
                Err(BuildError::Step(..)) if rounds < MAX_REFUSED_ROUNDS => rounds += 1,
                Err(BuildError::Unusable(..)) if unusable < MAX_UNUSABLE_ROUNDS => unusable += 1,
                Err(BuildError::ChainMismatch) if !careful => {
                    warn!("result of the chain does not verify; retrying step by step");
                    careful = true;
                }
                Err(BuildError::Step(kind, step, reason, fault) | BuildError::Unusable(kind, step, reason, fault)) => {
                    // Out of rounds: a missing object is still "not ready" (retryable), not a
                    // verification failure (found by review: it exited 1, "retrying will not help").
                    return Err(if fault.is_missing() {
                        not_ready(step, reason)
                    } else {
                        Error::Refused { kind, step, detail: reason, fault }
                    });
                }
                // (`sync_inner` settles it into one of the others.)
                Err(BuildError::SuspectResult(step, reason)) => {
                    return Err(Error::Refused { kind: StepKind::Delta, step, detail: reason, fault: Fault::Corrupt });
                }
                Err(BuildError::ChainMismatch) => return Err(corrupt("result", "chain does not verify")),
                Err(BuildError::LocalMismatch(why)) if self.active_ok => {
                    // The local files are not this stream's step. Build the newest step from an
                    // anchor instead (beside them: they are replaced by the switch, never
                    // deleted first).
                    self.metrics.verify_failures.fetch_add(1, Relaxed);
                    error!(reason = %why, "local weights are not the stream's step; rebuilding from an anchor");
                    self.active_ok = false;
                    self.metrics.step.store(u64::MAX, Relaxed);
                }
                Err(BuildError::LocalMismatch(why)) => return Err(corrupt("local checkpoint", why)),
                Err(BuildError::Other(Error::NothingReady)) => {
                    // Nothing usable, because of refusals: report the newest refused step.
                    return Err(match self.refused_newer().pop() {
                        Some(r) if r.fault.is_missing() => not_ready(r.step, r.reason),
                        Some(r) => Error::Refused { kind: r.kind, step: r.step, detail: r.reason, fault: r.fault },
                        None => Error::NothingReady,
                    });
                }
                Err(BuildError::Other(e)) => return Err(e),
            }
        };
        let mut out = out;
        out.refused = self.refused_newer();
        self.notify_if_needed().await?;
        Ok(out)
    }

    /// Who is at fault for delta `step`'s wrong result: the delta, or, on a route without an
    /// anchor (the pass read the active slot), the active slot's files when they no longer
    /// hash to their state (found by review: one flipped byte in the served slot had every
    /// later delta refused as corrupt until the next anchor, while the agent reported the
    /// damaged files as the verified step). Then `current` is removed, as after a crash whose
    /// slots do not verify, and the newest step is built from an anchor.
    async fn blame(&mut self, step: u64, reason: String, from_active: bool) -> BuildError {
        let refuse = |reason| BuildError::Step(StepKind::Delta, step, reason, Fault::Corrupt);
        let Some(st) = self.state.clone().filter(|_| from_active) else { return refuse(reason) };
        let why = match self.slot_root(st.active).await {
            Ok(r) if r == st.root => return refuse(reason),
            Ok(r) => format!("the served slot's weights root is {r}, not step {}'s {}", st.step, st.root),
            Err(e) if e.is_retryable() => return BuildError::Other(e),
            Err(e) => format!("the served slot cannot be read: {e}"),
        };
        if let Err(e) = self.dir.unlink() {
            // The files are known bad whether or not `current` could be removed: never link,
            // announce or report them again, and have the next start re-verify them (found by
            // review: `active_ok` stayed set, so the next sync re-linked the damaged slot and
            // a clean stop removed `running`, skipping the re-verification).
            self.active_ok = false;
            self.metrics.step.store(u64::MAX, Relaxed);
            return BuildError::Other(e.into());
        }
        error!(step = st.step, reason = %why, "the served weights changed on disk: current removed until a verified step is built");
        BuildError::LocalMismatch(why)
    }

    /// Leaves a failed step out of plans (bound to the manifest SHA-256 its marker names).
    fn refuse_step(&mut self, cands: &Candidates, kind: StepKind, step: u64, reason: &str, fault: Fault) {
        self.metrics.refusals.fetch_add(1, Relaxed);
        if !fault.is_missing() {
            self.metrics.verify_failures.fetch_add(1, Relaxed);
        }
        // Kept while the marker is listed and logged again at every poll: one line, bounded,
        // whatever the bucket made an error quote (details inside are cut at 1 KiB already;
        // this bounds what wraps them without cutting them again).
        let reason = &driftless_format::one_line_within(reason, 4 * driftless_format::MAX_DETAIL);
        warn!(kind = %kind, step, reason = %reason, "refusing step; keeping the verified weights");
        let sha = cands.marker(kind, step).map(|m| m.manifest_sha256);
        // Its manifest did not match (or was missing): the marker we hold may have been
        // replaced (a store without conditional create); read it again, once, next round.
        // Otherwise it is read again when the refusal runs out.
        if fault.is_missing() {
            self.markers.forget(kind, step);
        }
        self.refused.refuse(kind, step, sha, reason.to_string(), fault);
    }

    async fn notify_if_needed(&mut self) -> Result<()> {
        let Some(st) = self.state.clone() else { return Ok(()) };
        // Step and root: another stream's step of the same number is other weights. Once the
        // agent is stopping, nothing new is announced (found by review: the shutdown wait for
        // one load drove the poll on into the next sync and its load).
        if self.loaded == Some((st.step, st.root)) || !self.active_ok || self.stopping.load(Relaxed) {
            return Ok(());
        }
        // The directory sent is `current` resolved: it must name the state's slot (a link that
        // failed after the state was written would send the previous step's files as this one).
        self.dir.ensure_linked(st.active)?;
        // A patch is offered once: whatever happens, the next attempt reloads in full.
        let patch = self.patch.take().filter(|p| p.step == st.step);
        let result = {
            let _notifying = Flag::raise(&self.notifying);
            self.notify_all(&st, patch.as_ref()).await
        };
        if let Some(p) = &patch {
            let _ = std::fs::remove_file(&p.path);
        }
        if result.is_err() {
            // What the server holds is not known now (a vLLM reload that failed leaves it
            // paused on a mix of two steps): not ready until a load succeeds (found by review:
            // once set, ready stayed 1 for good).
            self.metrics.ready.store(0, Relaxed);
        }
        result?;
        self.loaded = Some((st.step, st.root));
        self.metrics.ready.store(1, Relaxed);
        Ok(())
    }

    async fn notify_all(&self, st: &LocalState, patch: Option<&PatchFile>) -> Result<()> {
        for n in &self.cfg.notify {
            let t = Instant::now();
            if let Err(e) = n.notify(&self.client, st.step, st.root, &self.current_dir(), patch).await {
                self.metrics.notify_failures.fetch_add(1, Relaxed);
                warn!(target = %n, error = %e, "notify failed");
                return Err(e);
            }
            info!(target = %n, step = st.step, secs = t.elapsed().as_secs_f64(), "inference server loaded step");
        }
        Ok(())
    }

    /// After an unclean shutdown: re-hashes the active slot before anything is notified, and
    /// only then points `current` at it (finishing a switch the crash interrupted). When it
    /// does not verify, the inactive slot is served if it holds the verified step the state
    /// names for it; when neither does, `current` is removed (a server restarted now must not
    /// load unverified bytes) and the next sync builds a step beside them. Files that do not
    /// match are not deleted: they stay until a newly built, verified step replaces them.
    async fn reverify_active(&mut self) -> Result<()> {
        let Some(st) = self.state.clone() else {
            self.reverify = false;
            return Ok(());
        };
        let why = match self.slot_root(st.active).await {
            Ok(r) if r == st.root => {
                // The state names a slot that was made durable before the state was written.
                self.dir.ensure_linked(st.active)?;
                info!(step = st.step, "re-verified the local weights after an unclean shutdown");
                self.reverify = false;
                self.active_ok = true;
                return Ok(());
            }
            Ok(r) => format!("weights root {r} != recorded {}", st.root),
            // A local error that may pass (EIO, too many open files): nothing is concluded
            // from it; the next sync re-verifies (`reverify` stays set, nothing is notified).
            Err(e) if e.is_retryable() => return Err(e),
            Err(e) => e.to_string(),
        };
        error!(step = st.step, error = %why, "local weights do not match their state");
        if let Some(h) = st.inactive {
            let other = st.active.other();
            let held = match self.slot_root(other).await {
                Err(e) if e.is_retryable() => return Err(e),
                r => r.is_ok_and(|r| r == h.root),
            };
            if held {
                // `current` first: it may name the slot that just failed, and the other one
                // is verified now. A crash between the two leaves the state naming the bad
                // slot, which the next start re-verifies and rolls back again (found by
                // review: state first left `current` on the bad slot in between).
                self.dir.link(other)?;
                let back = LocalState { step: h.step, root: h.root, active: other, inactive: None, ..st };
                back.store(self.dir.path())?;
                self.state = Some(back);
                warn!(step = h.step, "serving the previous verified step from the other slot");
                self.reverify = false;
                self.active_ok = true;
                self.metrics.step.store(h.step, Relaxed);
                return Ok(());
            }
        }
        self.dir.unlink()?;
        error!("no local slot verifies: current removed until a verified step is built");
        self.reverify = false;
        self.active_ok = false;
        self.metrics.step.store(u64::MAX, Relaxed);
        Ok(())
    }

    /// The weights root of a slot's files.
    async fn slot_root(&self, slot: Slot) -> Result<Digest> {
        let dir = self.dir.slot(slot);
        tokio::task::spawn_blocking(move || -> Result<Digest> {
            Ok(driftless_format::weights_root(&Checkpoint::open(&dir)?.views()).1)
        })
        .await
        .map_err(|e| Error::Io(std::io::Error::other(format!("hash task: {e}"))))?
    }

    /// The stream id of the verified descriptor (read once).
    async fn stream_id(&mut self) -> Result<String> {
        // A signed latest.json of another stream (a new run in this prefix, or a replayed
        // one): stream.json decides, read again. Found by review: read once, a continuous
        // agent never followed a new run and reported the old run's step as up to date.
        let other = matches!((&self.stream_id, &self.hint), (Some(s), Some(h)) if *s != h.stream_id);
        if let Some(s) = self.stream_id.as_ref().filter(|_| !other) {
            return Ok(s.clone());
        }
        match self.reader.descriptor().await? {
            Some(d) => {
                // Another stream than the one whose step the agent holds: a new run in this
                // prefix, followed only when created no earlier ([`plan::older_run`]).
                let local = self.state.as_ref().map(|s| s.stream_id.clone());
                match (local, self.stream_created) {
                    (Some(l), Some(c)) => {
                        if let Err(e) =
                            plan::older_run(&l, c, &d, "to follow it anyway, start the agent on an empty --dir")
                        {
                            self.hint = None;
                            return Err(e.into());
                        }
                    }
                    // The local weights' own stream, in a state written before the time was
                    // kept: learnt now.
                    (Some(l), None) if l == d.stream_id => self.stream_created = Some(d.created_at_ms),
                    _ => {}
                }
                // Kept with the state once a step of this stream is stored (not before: a newer
                // run seen and gone again must not make the agent refuse its own stream).
                self.descriptor_created = Some((d.stream_id.clone(), d.created_at_ms));
                if let Some(old) = self.stream_id.as_ref().filter(|s| **s != d.stream_id) {
                    info!(old = %old, new = %d.stream_id, "the bucket holds a new stream: following it");
                    self.markers = MarkerCache::default();
                    self.refused = Refusals::new(self.cfg.refuse_for);
                }
                // A hint of another stream plans nothing here; dropped, so that the next round
                // of this sync does not read stream.json again for it.
                if self.hint.as_ref().is_some_and(|h| h.stream_id != d.stream_id) {
                    self.hint = None;
                }
                self.stream_id = Some(d.stream_id.clone());
                Ok(d.stream_id)
            }
            None => Err(Error::NothingReady),
        }
    }

    fn up_to_date(&self, t0: Instant) -> Option<SyncOutcome> {
        self.state.as_ref().filter(|_| self.active_ok).map(|s| SyncOutcome {
            step: s.step,
            root: s.root,
            route: SyncPath::UpToDate,
            bytes: 0,
            deltas: 0,
            rebuilt: false,
            secs: t0.elapsed().as_secs_f64(),
            refused: vec![],
        })
    }

    /// Candidates from the signed `latest.json` when it announces a delta on the local step: that
    /// delta's marker, plus the markers linking the inactive slot's step to the local one (from
    /// the cache, or one GET each), so the inactive slot is brought forward as usual. `None`
    /// when the hint cannot plan this sync alone.
    async fn hinted_candidates(&mut self, sid: &str, local: Option<u64>) -> Option<Candidates> {
        if std::mem::take(&mut self.list_next) {
            return None;
        }
        let local = local?;
        let inactive = self.state.as_ref()?.inactive;
        let mut c = plan::from_hint(self.hint.as_ref()?, sid, local)?;
        for m in c.deltas.values() {
            self.markers.insert(m.clone());
        }
        if let Some(h) = inactive.filter(|h| h.step < local) {
            let mut s = local;
            for _ in 0..64 {
                if s <= h.step {
                    break;
                }
                let m: ReadyMarker = self.markers.get(&self.reader, StepKind::Delta, s).await.ok()?;
                if m.stream_id != sid {
                    return None;
                }
                let b = m.base_step.filter(|&b| b < s)?;
                c.deltas.insert(s, m);
                s = b;
            }
        }
        Some(c)
    }

    async fn sync_inner(&mut self, careful: bool, t0: Instant) -> Result<SyncOutcome, BuildError> {
        let sid = self.stream_id().await?;
        // A switch that was interrupted (a failed link, a crash after the state was written).
        if let Some(st) = self.state.as_ref().filter(|_| self.active_ok) {
            self.dir.ensure_linked(st.active)?;
        }
        // Local weights of another stream (a new run in the same bucket prefix) are never a
        // base; they keep being served until the new stream's first step replaces them.
        let local = self.state.as_ref().filter(|s| self.active_ok && s.stream_id == sid).map(|s| s.step);
        // A follower one step behind plans from the signed latest.json alone (no listing, no
        // marker reads); anything else (cold start, a gap, a newer anchor, a refusal) lists.
        let hinted = match self.hinted_candidates(&sid, local).await {
            Some(c) => plan::route(local, &c, &self.refused, None).map(|r| (c, r)),
            None => None,
        };
        let (cands, route) = match hinted {
            Some((c, r)) => (c, Some(r)),
            None => {
                let cands = self
                    .markers
                    .candidates(&self.reader, &sid, None, &self.refused, local)
                    .await
                    .map_err(Error::from)?;
                self.refused.retain_listed(&cands, self.hint.as_ref());
                let route = plan::route(local, &cands, &self.refused, None);
                (cands, route)
            }
        };
        if let Some(n) = cands.newest() {
            self.metrics.newest.store(n, Relaxed);
            if self.metrics.newest_seen_ms.load(Relaxed) == 0 || local != Some(n) {
                self.metrics.newest_seen_ms.store(now_ms(), Relaxed);
            }
        }
        let Some(route) = route else {
            return self.up_to_date(t0).ok_or(BuildError::Other(Error::NothingReady));
        };
        info!(
            target = route.target,
            anchor = route.anchor,
            deltas = route.deltas.len(),
            bytes = route.bytes,
            "sync plan"
        );
        let path = match (route.anchor, route.deltas.len()) {
            (Some(_), _) => SyncPath::Anchor,
            (None, 1) => SyncPath::Fast,
            _ => SyncPath::Catchup,
        };
        let built = match self.build(&sid, &route, &cands, careful).await {
            Err(BuildError::SuspectResult(step, reason)) => Err(self.blame(step, reason, route.anchor.is_none()).await),
            built => built,
        };
        if let Err(BuildError::Step(kind, step, reason, fault) | BuildError::Unusable(kind, step, reason, fault)) =
            &built
        {
            self.refuse_step(&cands, *kind, *step, reason, *fault);
        }
        match &built {
            // A reader holds the slot open: its files stay as they are for it.
            Err(BuildError::Other(Error::SlotInUse { .. })) => self.building = None,
            Err(_) => self.drop_partial_work().await,
            Ok(_) => {}
        }
        let (bytes, rebuilt) = built?;
        let ctr = match path {
            SyncPath::Fast => &self.metrics.bytes_fast,
            SyncPath::Catchup => &self.metrics.bytes_catchup,
            _ => &self.metrics.bytes_anchor,
        };
        ctr.fetch_add(bytes, Relaxed);
        self.metrics.syncs.fetch_add(1, Relaxed);
        let s = self.state.as_ref().expect("built");
        let o = SyncOutcome {
            step: s.step,
            root: s.root,
            route: path,
            bytes,
            deltas: route.deltas.len() as u32,
            rebuilt,
            secs: t0.elapsed().as_secs_f64(),
            refused: vec![],
        };
        info!(step = o.step, route = %o.route, bytes = o.bytes, secs = o.secs, "synced step");
        Ok(o)
    }

    /// Builds `route` in the inactive slot, verifies it, makes it durable and switches to it.
    /// Returns the bytes downloaded and whether the slot was rebuilt by a local copy.
    async fn build(
        &mut self,
        sid: &str,
        route: &Route,
        cands: &Candidates,
        careful: bool,
    ) -> Result<(u64, bool), BuildError> {
        let prev = self.state.clone();
        let active = prev.as_ref().map(|s| s.active);
        // Without a state (a cold start, or a `state.json` that could not be read), never the
        // slot `current` names: a server may be reading it.
        let work = match active {
            Some(a) => a.other(),
            None => self.dir.linked().map_or(Slot::A, Slot::other),
        };
        let wdir = self.dir.slot(work);
        self.building = Some(work);
        // Its reader would load a mix of two steps: wait (the next poll tries again).
        if let Some(file) = self.dir.open_elsewhere(work)? {
            return Err(Error::SlotInUse { file }.into());
        }
        let held_before =
            prev.as_ref().and_then(|s| s.inactive).filter(|_| prev.as_ref().is_some_and(|s| s.stream_id == sid));
        // The inactive slot is about to change, but only once a manifest has verified and its
        // objects have arrived: every write to it goes through `release_work_slot` first.
        // (Also without a state: the release probes the slot for readers before its first write.)
        self.release_pending = true;
        let mut bytes = 0u64;
        let mut rebuilt = false;
        // The previous sync's last delta, kept decoded, is of no use to an anchor route (whose
        // memory is bounded by its parts in flight) nor to a careful retry (which reads
        // everything again): freed before anything is loaded.
        if careful || route.anchor.is_some() {
            self.kept = None;
        }
        // The slot the work slot is rebuilt from, by its first pass (`apply_group`).
        let mut seed: Option<PathBuf> = None;
        // (step, root) the work slot holds as the chain starts.
        let (mut at, deltas): (Held, Vec<u64>) = match route.anchor {
            Some(a) => {
                // With deltas after it, the anchor's root is not checked on its own: the final
                // root (signed) proves the result; a mismatch is retried carefully, anchor first.
                let alone = route.deltas.is_empty();
                let marker = cands.marker(StepKind::Anchor, a);
                let (b, h) = self.load_anchor(sid, a, marker, &wdir, careful || alone, alone).await?;
                bytes += b;
                self.metrics.anchor_downloads.fetch_add(1, Relaxed);
                (h, route.deltas.clone())
            }
            None => {
                let base = prev.as_ref().expect("a local route has local state").held();
                // Bring the inactive slot forward (two sparse applies per step in the steady
                // state, segments from the local cache) unless it is unknown, unreachable by
                // a chain, or this is a careful retry: then copy the active slot.
                let private = wdir.is_dir() && crate::state::slot_files_private(&wdir).map_err(Error::from)?;
                if wdir.is_dir() && !private {
                    warn!(slot = %wdir.display(), "the work slot holds links (symlinks or hard links); rebuilding it");
                }
                let prefix = held_before
                    .filter(|h| !careful && h.step <= base.step && private)
                    .and_then(|h| plan::chain(cands, &self.refused, h.step, base.step).map(|(v, _)| (h, v)));
                match prefix {
                    Some((h, v)) => {
                        let mut d = v;
                        d.extend_from_slice(&route.deltas);
                        (h, d)
                    }
                    None => {
                        // The first pass reads the active slot and writes the work slot (no
                        // separate copy: the model is read once and written once).
                        seed = Some(self.dir.slot(prev.as_ref().expect("local state").active));
                        rebuilt = true;
                        self.metrics.slot_rebuilds.fetch_add(1, Relaxed);
                        (base, route.deltas.clone())
                    }
                }
            }
        };
        let t = Instant::now();
        let n = deltas.len();
        // Patches are built for engines that apply them in place, from the active step along a
        // route of deltas only. The notifier uses one only when the engine reports that step.
        self.patch = None;
        // Consecutive deltas of one layout are applied together in one pass over the model,
        // verified once at the end (every result root is signed, so the final check proves the final state;
        // a mismatch is retried `careful`ly, one verified delta at a time, to name the step).
        let mut layout = if deltas.is_empty() {
            None
        } else {
            Some(Checkpoint::open(seed.as_deref().unwrap_or(&wdir)).map_err(Error::from)?.layout())
        };
        let mut patch = match (&prev, route.anchor, &layout) {
            (Some(p), None, Some(l)) if self.cfg.notify.iter().any(Notifier::wants_patch) => {
                PatchBuilder::new(p.step, p.root, l.tensors())
                    .inspect_err(|e| warn!(error = %e, "no patch for this step"))
                    .ok()
            }
            _ => None,
        };
        let mut group: Vec<(DeltaManifest, Vec<DecodedSegment>)> = vec![];
        // The previous sync's last delta, decoded, when this route brings the work slot over
        // it (else it was dropped before an anchor could be loaded, above). `keep`: this
        // sync's last delta, once applied.
        let mut kept = self.kept.take().filter(|k| deltas.contains(&k.manifest.step));
        let mut keep: Option<(DeltaManifest, Vec<DecodedSegment>)> = None;
        let mut group_raw = 0u64;
        // A wrong final root names one step only when it is the only unverified one.
        // A single delta names its step only when its pass reads the active slot, whose bytes
        // are then checked if the result is wrong (`SuspectResult`); read from the inactive
        // slot (never re-checked), a wrong result is retried carefully, from the active slot.
        let pinpoint = careful || (n == 1 && route.anchor.is_none() && seed.is_some());
        // Up to FETCH_AHEAD deltas download and decode at once (on the blocking pool) while
        // earlier ones are received: a catch-up is not a sequence of round trips.
        let marker = |d: u64| cands.marker(StepKind::Delta, d).cloned();
        let payload = |d: u64| cands.marker(StepKind::Delta, d).map_or(u64::MAX, |m| m.payload_bytes);
        // The downloads of deltas[k..next] (`None`: a delta skipped after a re-seed, never
        // fetched); at most FETCH_AHEAD of them and FETCH_AHEAD_BYTES of payload.
        let mut ahead: std::collections::VecDeque<Option<Fetch>> = Default::default();
        let mut next = 0usize;
        // Deltas at or before this step are skipped: the served slot already holds it and the
        // work slot is rebuilt from there (see the layout change below).
        let mut skip_to: Option<u64> = None;
        let skipped = |skip_to: Option<u64>, d: u64| skip_to.is_some_and(|s| d <= s);
        for (k, &d) in deltas.iter().enumerate() {
            while next < n && next - k < FETCH_AHEAD {
                let window = deltas[k..=next].iter().map(|&x| payload(x)).fold(0u64, u64::saturating_add);
                if next > k && window > FETCH_AHEAD_BYTES {
                    break;
                }
                let x = deltas[next];
                let onto = layout.as_ref().map(|l| Arc::new(l.clone()));
                ahead.push_back((!skipped(skip_to, x)).then(|| self.start_fetch(x, marker(x), onto, &mut kept)));
                next += 1;
            }
            let fetch = ahead.pop_front().expect("a fetch per delta");
            if skipped(skip_to, d) {
                continue;
            }
            // Only skipped deltas have no download (a missing one would be a bug here, not a
            // step to pass over).
            let fetch = fetch.ok_or_else(|| Error::Io(std::io::Error::other(format!("no download of delta {d}"))))?;
            let last = k + 1 == n;
            let verify = careful || last;
            // What the delta's base is: the step the agent holds (its state), a state not
            // verified yet (an anchor route's anchor, loaded unhashed, or an earlier delta of
            // the chain, whose result only the final root proves), or one verified in this
            // build (`careful` hashes the anchor and verifies each delta's result before the
            // next is received).
            let base = if prev.as_ref().is_some_and(|p| p.held() == at || p.inactive == Some(at)) {
                Base::Held
            } else if !careful && (k > 0 || route.anchor.is_some()) {
                Base::Unproven
            } else {
                Base::Verified
            };
            let (m, segs, b) = self.receive_delta(sid, d, fetch, at, base).await?;
            if let Some(pb) = patch.as_mut().filter(|pb| d > pb.base()) {
                if let Err(e) = segs.iter().try_for_each(|s| pb.add(s)) {
                    warn!(error = %e, "no patch for this step");
                    patch = None;
                }
            }
            bytes += b;
            at = Held { step: d, root: m.result_root };
            let shas: Vec<Digest> = m.segments.iter().map(|s| s.object.sha256).collect();
            if layout.as_ref().is_some_and(|l| ops::needs_rewrite(l, &m)) {
                let served = prev.as_ref().filter(|p| route.anchor.is_none() && seed.is_none() && d <= p.step);
                if let Some(p) = served {
                    // Bringing the work slot over a layout change the served slot already
                    // holds: rebuild it from the served slot instead (one pass that reads it
                    // and applies the deltas after it), not a rewrite and then a catch-up.
                    let from = self.dir.slot(p.active);
                    info!(step = d, from = %from.display(), "rebuilding the work slot from the served slot");
                    let served_layout = Checkpoint::open(&from).map_err(Error::from)?.layout();
                    // A patch is relative to the served step: its tensors are the served slot's.
                    if patch.is_some() {
                        patch = PatchBuilder::new(p.step, p.root, served_layout.tensors())
                            .inspect_err(|e| warn!(error = %e, "no patch for this step"))
                            .ok();
                    }
                    layout = Some(served_layout);
                    seed = Some(from);
                    group.clear();
                    group_raw = 0;
                    at = p.held();
                    skip_to = Some(p.step);
                    // Downloads already started for the skipped deltas stop here (dropped).
                    for (j, f) in ahead.iter_mut().enumerate() {
                        if deltas.get(k + 1 + j).is_some_and(|&x| skipped(skip_to, x)) {
                            *f = None;
                        }
                    }
                    rebuilt = true;
                    self.metrics.slot_rebuilds.fetch_add(1, Relaxed);
                    self.cached.push((d, shas));
                    continue;
                }
                let pending = std::mem::take(&mut group);
                group_raw = 0;
                if !pending.is_empty() {
                    self.apply_group(&wdir, pending, false, careful, seed.take()).await?;
                }
                // A layout change is no patch: the engine reloads from the directory.
                patch = None;
                // Still unbuilt, the work slot is written from the active slot by the
                // rewrite pass itself.
                self.rewrite_delta(&wdir, seed.take(), &m, segs, verify, pinpoint).await?;
                layout = Some(m.layout());
            } else {
                group_raw += m.segments.iter().map(|s| s.raw_size).sum::<u64>();
                group.push((m, segs));
                if verify || group_raw > GROUP_RAW_BYTES {
                    let pending = std::mem::take(&mut group);
                    group_raw = 0;
                    let applied = self.apply_group(&wdir, pending, verify, pinpoint, seed.take()).await?;
                    keep = applied.filter(|_| last);
                }
            }
            self.cached.push((d, shas));
        }
        if seed.take().is_some() {
            self.copy_active(&wdir).await?;
        }
        self.metrics.apply_ms.store(t.elapsed().as_millis() as u64, Relaxed);
        // Durable before announced: data, then state, then the link, then notify.
        let w2 = wdir.clone();
        // The slot directory may be new (an anchor, a rebuild): its entry in `slots/` too.
        self.blocking(move || sync_tree(&w2).and_then(|()| w2.parent().map_or(Ok(()), sync_dir)))
            .await
            .map_err(|e| Error::Io(std::io::Error::other(format!("sync task: {e}"))))??;
        let inactive = prev.as_ref().filter(|s| self.active_ok && s.stream_id == sid).map(|s| s.held());
        let created = match &self.descriptor_created {
            Some((id, c)) if id == sid => Some(*c),
            _ => self.stream_created.filter(|_| prev.as_ref().is_some_and(|p| p.stream_id == sid)),
        };
        let st = LocalState {
            version: 2,
            stream_id: sid.to_string(),
            stream_created_ms: created,
            step: at.step,
            root: at.root,
            active: work,
            inactive,
        };
        // From here the work slot may be named on disk (a store whose rename landed and whose
        // fsync failed), whatever memory says: a failure is no longer the build's to clean up.
        self.building = None;
        st.store(self.dir.path())?;
        self.stream_created = created;
        // Memory follows the disk at once: if the link fails (or this future is dropped), the
        // next sync links `current` to the slot the state names instead of rebuilding it as
        // the work slot while `state.json` vouches for it.
        self.state = Some(st);
        self.active_ok = true;
        // A new served slot: an idle rebuild of the other one may be tried again (also at the
        // same step, rebuilt from an anchor after its served files failed).
        self.prepared = None;
        self.metrics.step.store(at.step, Relaxed);
        self.dir.link(work)?;
        self.kept = keep.and_then(|(m, segs)| {
            let marker = cands.marker(StepKind::Delta, m.step)?.clone();
            let held = segs.iter().map(DecodedSegment::heap_bytes).fold(0u64, u64::saturating_add);
            let fits = held <= KEEP_DECODED_BYTES && m.stream_id == sid;
            fits.then_some(KeptDelta { marker, manifest: m, segs })
        });
        if let Some(pb) = patch {
            self.patch = self.write_patch(pb, &wdir, at).await;
        }
        for &d in &deltas {
            self.refused.clear(StepKind::Delta, d);
        }
        if let Some(a) = route.anchor {
            self.refused.clear(StepKind::Anchor, a);
        }
        self.prune_cache();
        Ok((bytes, rebuilt))
    }

    /// After a failed build: the work slot (and a layout rewrite's `.new` beside it) is removed
    /// when nothing names it, neither the state (released before its first write, or no state)
    /// nor `current`. Found by review: an anchor or rebuild that ran out of space on ext4 left
    /// its partly written (and allocated) files, and every later sync then failed at its first
    /// write, the state's, before it reached the code that would have replaced them; the agent
    /// served its verified step but never advanced until the slot was deleted by hand. A slot
    /// that still holds the inactive verified step is kept (a download failed before any
    /// write, a slot in use). Best effort: a failure is logged.
    async fn drop_partial_work(&mut self) {
        // Only the slot the failed build chose, and only when it failed before storing the
        // state that names it (found by review: computed afresh from memory, it was the
        // served slot after a link whose rename landed and whose fsync failed, and the
        // built slot after a state store whose fsync failed).
        let Some(work) = self.building.take() else { return };
        let names = |s: &LocalState| s.active == work || (s.inactive.is_some() && s.active.other() == work);
        // The disk too, not memory alone (found by review): a `store` whose rename landed and
        // whose fsync failed may have left `state.json` naming the slot while memory does not.
        // A state that cannot be read keeps the slot.
        let on_disk = LocalState::peek(self.dir.path()).map(|s| s.as_ref().is_some_and(names)).unwrap_or(true);
        if self.state.as_ref().is_some_and(names) || on_disk || self.dir.linked() == Some(work) {
            return;
        }
        let wdir = self.dir.slot(work);
        let r = self.blocking(move || remove_slot(&wdir)).await;
        match r {
            Ok(Ok(true)) => info!(slot = ?work, "removed the failed build's partial slot"),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => warn!(error = %e, "could not remove the failed build's partial slot"),
            Err(e) => warn!(error = %e, "could not remove the failed build's partial slot"),
        }
    }

    /// Runs `f` on the blocking pool holding a share of the directory's lock
    /// ([`AgentDir::guard`]): everything that writes under `DIR` goes through here.
    fn blocking<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> tokio::task::JoinHandle<T> {
        let guard = self.dir.guard();
        tokio::task::spawn_blocking(move || {
            let _guard = guard;
            f()
        })
    }

    /// Called before anything writes the work slot: from then on it holds no verified step
    /// until the switch, so `state.json` stops naming it as the inactive step first.
    ///
    /// Not at the start of a build (found by review: a planted marker, a forged manifest or a
    /// 5xx then cost the rollback step although the slot was never touched, and the next step
    /// a whole-model rewrite; 200 planted markers cost 200 state rewrites in one sync).
    /// Written whenever there is a state, not only when it names an inactive step: after a
    /// failed `store` (renamed, then the fsync of `DIR` failed) the disk may say that the work
    /// slot is active; this puts the disk back in step with memory before the slot is touched.
    ///
    /// The slot is probed for readers here again, right before its first write: the probe at
    /// the start of the build is seconds older (the download and checks came between), and a
    /// server that opened a file of the slot meanwhile would read a mix of two steps.
    fn release_work_slot(&mut self) -> Result<()> {
        if !self.release_pending {
            return Ok(());
        }
        if let Some(work) = self.building {
            if let Some(file) = self.dir.open_elsewhere(work)? {
                return Err(Error::SlotInUse { file });
            }
        }
        self.release_pending = false;
        if let Some(mut s) = self.state.clone() {
            s.inactive = None;
            s.store(self.dir.path())?;
            self.state = Some(s);
        }
        Ok(())
    }

    /// Writes the patch of this sync into `DIR/patch` (replacing any earlier one). A failure
    /// costs only the patch: the engine then reloads from the directory.
    async fn write_patch(&self, pb: PatchBuilder, wdir: &Path, at: Held) -> Option<PatchFile> {
        let pdir = self.dir.patches();
        let wdir = wdir.to_path_buf();
        // The smallest bound of the targets that take patches.
        let max = self.cfg.notify.iter().filter_map(Notifier::patch_max).min().unwrap_or(0);
        let t = Instant::now();
        let r = self
            .blocking(move || -> Result<PatchFile> {
                if pdir.exists() {
                    std::fs::remove_dir_all(&pdir)?;
                }
                std::fs::create_dir_all(&pdir)?;
                // Absolute: the engine's workers resolve the path in their own working
                // directory (found by review: a relative --dir made every patch a reload).
                let out = pdir.canonicalize()?.join(format!("{}-{}.safetensors", pb.base(), at.step));
                pb.write(&wdir, at.step, at.root, &out, max)
            })
            .await;
        match r {
            Ok(Ok(p)) => {
                info!(base = p.base, step = p.step, bytes = p.bytes, secs = t.elapsed().as_secs_f64(), "patch written");
                Some(p)
            }
            Ok(Err(e)) => {
                warn!(error = %e, "could not write the patch; the engine will reload in full");
                None
            }
            Err(e) => {
                warn!(error = %e, "patch task failed; the engine will reload in full");
                None
            }
        }
    }

    /// Replaces the inactive slot with a copy of the active one (copy_file_range: a reflink
    /// where the filesystem has them). Space runs out as an error here, never as a signal.
    async fn copy_active(&mut self, wdir: &Path) -> Result<()> {
        self.release_work_slot()?;
        let st = self.state.as_ref().expect("active state");
        let from = self.dir.slot(st.active);
        let to = wdir.to_path_buf();
        self.blocking(move || -> std::io::Result<()> {
            remove_slot(&to)?;
            std::fs::create_dir_all(&to)?;
            for e in std::fs::read_dir(&from)? {
                let e = e?;
                if e.file_type()?.is_file() {
                    std::fs::copy(e.path(), to.join(e.file_name()))?;
                }
            }
            Ok(())
        })
        .await
        .map_err(|e| Error::Io(std::io::Error::other(format!("copy task: {e}"))))??;
        info!(from = %self.dir.slot(st.active).display(), "inactive slot rebuilt from the active one");
        Ok(())
    }

    /// Rebuilds the inactive slot from the served one while nothing else is to be done, when
    /// it holds no verified step (after a cold start, a rollback, a stream change): one pass
    /// reads the served slot (opened read-only), hashes it and writes every block into a fresh
    /// frame (`fused::Target::Copy`, no deltas); once the root is the served step's and the
    /// frame is durable, `state.json` names it as the inactive step. The next step is then one
    /// delta applied in place (the fast path) instead of a rebuild of the whole slot on that
    /// step's path (issue 12: the first step after a cold start took 1.0-2.0 s against 0.5 s
    /// for a fast path, 1 GiB on 2 cores).
    ///
    /// Returns whether it rebuilt the slot. Nothing is done when the inactive slot already
    /// holds a step, the served slot is not known to be verified, `current` does not name it,
    /// or this served step was tried already (a failure is not repeated at every poll: a disk
    /// without room for a second slot costs one try per step). A slot another process has open
    /// is left alone and tried again at a later poll. The poll loop stops the pass when a new
    /// step is announced ([`Agent::prepare_inactive_until`]). Served files that no longer hash to
    /// their step are an error: `current` is removed at once, and the next poll re-verifies
    /// them ([`Agent::reverify_active`]: re-linked if they hash to their step again; otherwise,
    /// the other slot holding no step, the newest step is built from an anchor).
    pub async fn prepare_inactive(&mut self) -> Result<bool> {
        self.prepare_inactive_until(std::future::pending()).await
    }

    /// [`Agent::prepare_inactive`], given up when `stop` resolves first (the poll loop's
    /// `stop` is a change of `latest.json`: a new step is not made to wait for a rebuild that
    /// its own build would redo). The pass stops at its next group of tensors (about
    /// [`AgentConfig::idle_group_bytes`]), its partial slot is removed, nothing names it, and `Ok(false)` is
    /// returned; the rebuild is tried again at a later idle poll if still needed.
    ///
    /// Not cancel-safe: stop it with `stop`, and drop the future only with the agent (as
    /// [`Agent::run`] does on shutdown). Dropped mid-pass, the pass on the blocking pool goes
    /// on to its next look at its stop, and a build started meanwhile would write the same
    /// slot.
    pub async fn prepare_inactive_until(&mut self, stop: impl std::future::Future<Output = ()>) -> Result<bool> {
        let Some(st) = self.idle_rebuild_due().cloned() else { return Ok(false) };
        let work = st.active.other();
        self.prepared = Some(st.step);
        self.building = Some(work);
        self.release_pending = true;
        let t = Instant::now();
        let r = self.prepare_slot(&st, work, stop).await;
        self.release_pending = false;
        match r {
            Ok(true) => {
                self.metrics.idle_rebuilds.fetch_add(1, Relaxed);
                info!(step = st.step, slot = ?work, secs = t.elapsed().as_secs_f64(), "inactive slot rebuilt from the served one while idle");
                Ok(true)
            }
            Ok(false) => {
                info!(
                    step = st.step,
                    secs = t.elapsed().as_secs_f64(),
                    "idle rebuild of the inactive slot given up: a new step is announced"
                );
                self.prepared = None;
                self.drop_partial_work().await;
                Ok(false)
            }
            Err(e) => {
                if matches!(e, Error::SlotInUse { .. }) {
                    // Nothing was written: try again once its reader is done.
                    self.prepared = None;
                    self.building = None;
                } else {
                    self.drop_partial_work().await;
                }
                Err(e)
            }
        }
    }

    /// The served state, when [`Agent::prepare_inactive`] has work: its inactive slot holds no
    /// step, the served slot is verified and named by `current`, and this step was not tried.
    fn idle_rebuild_due(&self) -> Option<&LocalState> {
        let st = self.state.as_ref()?;
        let due = self.active_ok && !self.reverify && st.inactive.is_none() && self.prepared != Some(st.step);
        (due && self.dir.linked() == Some(st.active)).then_some(st)
    }

    /// The rebuild of [`Agent::prepare_inactive_until`]: `Ok(false)` when `stop` came first.
    async fn prepare_slot(
        &mut self,
        st: &LocalState,
        work: Slot,
        stop: impl std::future::Future<Output = ()>,
    ) -> Result<bool> {
        tokio::pin!(stop);
        // A stop already there (a step announced before the rebuild began): nothing written,
        // `state.json` included.
        if futures::FutureExt::now_or_never(&mut stop).is_some() {
            self.building = None;
            return Ok(false);
        }
        // Probes the slot for readers, then writes it.
        self.release_work_slot()?;
        let (from, to, root, group) =
            (self.dir.slot(st.active), self.dir.slot(work), st.root, self.cfg.idle_group_bytes);
        let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = cancel.clone();
        // Dropped with this future (the agent stopped mid-rebuild): the pass stops too, at its
        // next group, instead of copying the rest of the model under the directory's lock.
        let _stop_on_drop = RaiseOnDrop(cancel.clone());
        let mut task = self.blocking(move || copy_slot(&from, &to, root, group, &|| flag.load(Relaxed)));
        let done = tokio::select! {
            biased;
            r = &mut task => r,
            _ = &mut stop => {
                cancel.store(true, Relaxed);
                task.await
            }
        };
        let got = done.map_err(|e| Error::Io(std::io::Error::other(format!("rebuild task: {e}"))))??;
        let Some(got) = got else { return Ok(false) };
        if got != root {
            // The served files changed under the agent (a disk fault, a hand edit). `current`
            // goes at once, as in `blame` (found by review: it stayed linked until the next
            // poll's re-verification, so a server restarted in between loaded files the agent
            // knew did not verify). That re-verification re-links them if they hash to their
            // step again (a fault that passed); otherwise the next sync builds from an anchor.
            self.reverify = true;
            self.active_ok = false;
            self.metrics.step.store(u64::MAX, Relaxed);
            self.metrics.verify_failures.fetch_add(1, Relaxed);
            let e = corrupt("local checkpoint", format!("served slot hashes to {got}, its step {} is {root}", st.step));
            self.metrics.set_last_error(Some(e.to_string()));
            self.dir.unlink()?;
            error!(
                step = st.step,
                "the served weights changed on disk: current removed until a verified step is built"
            );
            return Err(e);
        }
        self.building = None;
        let mut next = st.clone();
        next.inactive = Some(st.held());
        next.store(self.dir.path())?;
        self.state = Some(next);
        Ok(true)
    }

    /// Downloads, decodes and verifies an anchor into the work slot (replacing it).
    async fn load_anchor(
        &mut self,
        sid: &str,
        step: u64,
        marker: Option<&ReadyMarker>,
        wdir: &Path,
        verify: bool,
        alone: bool,
    ) -> Result<(u64, Held), BuildError> {
        let at = attribute(StepKind::Anchor, step);
        // The manifest of the marker the route was planned with (no second marker GET).
        let m = match marker {
            Some(mk) => self.reader.anchor_at(step, mk).await,
            None => self.reader.anchor(step).await,
        };
        let (m, _) = m.map_err(|e| unusable(at(e.into())))?;
        if m.stream_id != sid {
            return Err(BuildError::Unusable(
                StepKind::Anchor,
                step,
                "signed for another stream".into(),
                Fault::Corrupt,
            ));
        }
        // Every object there at its signed size before the rollback slot is given up (found by
        // review: it was given up once the manifest checked out, so a signed anchor whose
        // shards had not arrived, a replicator that copied the marker first or a GC race, cost
        // the verified inactive step at every try, and the next fast path a whole-model
        // rebuild). One HEAD each; the stream does not HEAD them again (`ShardJob::sized`).
        crate::anchor_stream::check_sizes(self.reader.bucket(), step, &m).await.map_err(|e| unusable(at(e)))?;
        self.release_work_slot()?;
        remove_slot(wdir)?;
        std::fs::create_dir_all(wdir)?;
        let t0 = Instant::now();
        let r = &self.reader;
        let layout = m.layout();
        if layout.shards.len() != m.objects.len() {
            return Err(BuildError::Unusable(
                StepKind::Anchor,
                step,
                "shard count differs from the layout".into(),
                Fault::Corrupt,
            ));
        }
        // Shards stream (ranged GETs, byte-plane chunks decoded, written once with `pwrite`
        // into a file created on its header's write, `checkpoint::create_sized`), side by side
        // where the parts in flight allow, which bound the memory. They are hashed as they are
        // written (when the anchor is verified on its own): the model is not read back. Bytes
        // decoded before an object is checked (an object without signed parts) only ever
        // reach the inactive slot, which is not trusted until its weights root is verified.
        // Early writeback only when
        // the anchor is the result (`alone`): with deltas after it, the pass rewrites every
        // page (a careful retry verifies the anchor, then applies).
        let mut jobs = Vec::with_capacity(m.objects.len());
        let mut hashing = Vec::new();
        for (o, shard) in m.objects.iter().zip(&layout.shards) {
            if o.file != shard.file {
                let why = format!("shard {} is not the layout's {}", o.file, shard.file);
                return Err(BuildError::Unusable(StepKind::Anchor, step, why, Fault::Corrupt));
            }
            if o.decoded_size > anchor::MAX_SHARD {
                return Err(at(corrupt("anchor manifest", "shard too large")));
            }
            let file = FileSink::new(wdir.join(&o.file), o.decoded_size, alone).holding(self.dir.guard());
            let sink = hashed(file, o.decoded_size, verify, &mut hashing);
            jobs.push(ShardJob { object: o, tensors: &shard.tensors, sink, sized: true });
        }
        // Each shard file is checked for room on its own as it is created (sparse on a tmpfs):
        // the whole anchor first.
        let total = m.objects.iter().map(|o| o.decoded_size).fold(0u64, u64::saturating_add);
        driftless_format::checkpoint::check_room(wdir, total).map_err(Error::from)?;
        let streamed = stream_anchor(self.reader.bucket(), step, m.encoding, jobs, self.cfg.anchor_parts)
            .instrument(info_span!("stream_anchor", step, shards = m.objects.len()))
            .await
            .map_err(&at)?;
        let digests = digests_of(hashing).map_err(&at)?;
        let keys: Vec<(String, u64, Digest)> = m.files.iter().map(|o| (o.object.clone(), o.size, o.sha256)).collect();
        let files: Vec<Bytes> = futures::stream::iter(keys)
            .map(|(k, n, sha)| async move { r.object(StepKind::Anchor, step, &k, n, sha).await })
            .buffered(4)
            .try_collect()
            .await
            .map_err(|e| at(e.into()))?;
        let bytes: u64 = streamed + files.iter().map(|b| b.len() as u64).sum::<u64>();
        debug!(step, secs = t0.elapsed().as_secs_f64(), "anchor objects read");
        let dir = wdir.to_path_buf();
        let m2 = m.clone();
        let tv = Instant::now();
        self.blocking(move || -> Result<()> {
            for (o, b) in m2.files.iter().zip(&files) {
                let bare = driftless_store::layout::strip_generation(&o.object);
                let name = bare.strip_prefix("extra-").unwrap_or(bare);
                // An extra file must not replace a shard (hashed as it was streamed) or the
                // index, nor be read as weights later (a `*.safetensors` file left in a slot
                // whose next layout has no index would be taken for a shard).
                driftless_format::validate_extra_file_name(name)
                    .map_err(|e| corrupt("anchor manifest", e.to_string()))?;
                std::fs::write(dir.join(name), b)?;
            }
            write_index(&dir, &layout)?;
            let ck = Checkpoint::open(&dir)?;
            if ck.layout() != layout {
                return Err(corrupt("anchor", "decoded files do not match the manifest layout"));
            }
            if verify {
                let (metas, d): (Vec<TensorMeta>, Vec<Digest>) = digests.into_iter().unzip();
                ops::check_root(&metas, &d, &m2.shards, m2.weights_root)?;
            }
            Ok(())
        })
        .await
        .map_err(|e| Error::Io(std::io::Error::other(format!("anchor task: {e}"))))?
        .map_err(&at)?;
        self.metrics.record_verify(tv.elapsed());
        info!(step, bytes, verified = verify, verify_secs = tv.elapsed().as_secs_f64(), "anchor loaded");
        Ok((bytes, Held { step, root: m.weights_root }))
    }

    /// Starts downloading delta `step` in the background: its manifest, then its segments
    /// (from the local cache when present), each checked against the manifest and decoded as
    /// soon as it arrives while the decoded bytes waiting to be received (of every delta
    /// fetched ahead) fit in [`DECODE_AHEAD_BYTES`]; a segment that does not fit is handed over
    /// as stored and decoded when its delta is received. A manifest whose segments decode to
    /// more than a reader holds for a delta of `onto` (the layout it is applied to, as the
    /// route stands when the fetch starts: [`DeltaManifest::check_onto`]) is refused before any
    /// segment is downloaded. Nothing local changes; dropping the handle stops it.
    fn start_fetch(
        &self,
        step: u64,
        marker: Option<ReadyMarker>,
        onto: Option<Arc<Layout>>,
        kept: &mut Option<KeptDelta>,
    ) -> Fetch {
        // The delta this agent applied last, if it is this one (the same signed manifest the
        // marker names): its manifest and segments were checked when they were downloaded.
        let same = |k: &mut KeptDelta| k.manifest.step == step && marker.as_ref() == Some(&k.marker);
        if let Some(k) = kept.take_if(same) {
            debug!(step, "the delta applied last, kept decoded");
            let (mtx, manifest) = tokio::sync::oneshot::channel();
            let (stx, segments) = tokio::sync::mpsc::unbounded_channel();
            let _ = mtx.send(Ok((k.manifest, k.marker.manifest_sha256)));
            for (i, seg) in k.segs.into_iter().enumerate() {
                let _ = stx.send(Ok((i, Got::Kept(seg), 0)));
            }
            return Fetch { manifest, segments, _abort: None };
        }
        let reader = self.reader.clone();
        let budget = self.decode_ahead.clone();
        let conc = self.cfg.download_concurrency.max(1);
        let cache = self.dir.cache();
        let (mtx, manifest) = tokio::sync::oneshot::channel();
        let (stx, segments) = tokio::sync::mpsc::unbounded_channel();
        let task = tokio::spawn(
            async move {
                let got = match &marker {
                    Some(mk) => reader.delta_at(step, mk).await,
                    None => reader.delta(step).await,
                };
                let (m, sha) = match got {
                    Ok(x) => x,
                    Err(e) => {
                        let _ = mtx.send(Err(Error::from(e)));
                        return;
                    }
                };
                if let Some(e) = onto.and_then(|l| m.check_onto(&l).err()) {
                    let _ = mtx.send(Err(Error::from(e)));
                    return;
                }
                let _ = mtx.send(Ok((m.clone(), sha)));
                let mode = m.value_mode;
                let mut s = futures::stream::iter(m.segments.clone().into_iter().enumerate())
                    .map(move |(i, s)| {
                        let r = reader.clone();
                        let cache = cache.clone();
                        let budget = budget.clone();
                        async move {
                            // File reads, writes and hashes on the blocking pool, as the store
                            // hashes downloads: this task polls every segment of the delta, and
                            // work done on its thread runs one segment at a time.
                            let (size, sha) = (s.object.size, s.object.sha256);
                            let c = cache.clone();
                            let cached =
                                tokio::task::spawn_blocking(move || cached_object(&c, size, sha)).await.ok().flatten();
                            let (b, downloaded) = match cached {
                                Some(b) => (b, 0),
                                None => {
                                    let b = r.object(StepKind::Delta, step, &s.object.object, size, sha).await?;
                                    let (c, k) = (cache.clone(), b.clone());
                                    let _ = tokio::task::spawn_blocking(move || keep_object(&c, sha, &k)).await;
                                    (b, size)
                                }
                            };
                            // Capped by the manifest (`MAX_SEGMENT_RAW` < 2^32).
                            let permits = u32::try_from(s.raw_size).unwrap_or(u32::MAX);
                            let got = match budget.try_acquire_many_owned(permits) {
                                Ok(permit) => Got::Decoded(decode_blocking(b, s, mode).await?, permit),
                                Err(_) => Got::Stored(b, s),
                            };
                            Ok::<_, Error>((i, got, downloaded))
                        }
                    })
                    .buffered(conc);
                while let Some(r) = s.next().await {
                    let stop = r.is_err();
                    if stx.send(r).is_err() || stop {
                        return;
                    }
                }
            }
            .instrument(info_span!("download_delta", step)),
        );
        Fetch { manifest, segments, _abort: Some(AbortOnDrop(task.abort_handle())) }
    }

    /// The weights root the stream's own signed manifest gives `step` (its delta's result, else
    /// its anchor's), when it can be read.
    async fn stream_root(&self, sid: &str, step: u64) -> Option<Digest> {
        if let Ok((m, _)) = self.reader.delta(step).await {
            if m.stream_id == sid && m.step == step {
                return Some(m.result_root);
            }
        }
        match self.reader.anchor(step).await {
            Ok((m, _)) if m.stream_id == sid && m.step == step => Some(m.weights_root),
            _ => None,
        }
    }

    /// Waits for one delta of a chain whose previous state is `at`: checks its stream, base
    /// and chain link, and its segments (hash-checked and decoded by the fetch). Nothing local
    /// changes. Returns the manifest, the decoded segments and the bytes downloaded.
    /// `base` says what `at` is ([`Base`]): a base root that disagrees with a state not verified
    /// yet may be that step's fault as well as this delta's: `ChainMismatch`, which retries
    /// carefully, each step checked on its own (found by review: the delta was refused, and the
    /// anchor never looked at). Only against the held step may the local files be at fault.
    async fn receive_delta(
        &mut self,
        sid: &str,
        step: u64,
        fetch: Fetch,
        at: Held,
        base: Base,
    ) -> Result<(DeltaManifest, Vec<DecodedSegment>, u64), BuildError> {
        let att = attribute(StepKind::Delta, step);
        let Fetch { manifest, mut segments, _abort } = fetch;
        let (m, _env_sha) = manifest
            .await
            .map_err(|_| BuildError::Other(Error::Io(std::io::Error::other("delta download stopped"))))?
            .map_err(|e| unusable(att(e)))?;
        if m.stream_id != sid {
            return Err(BuildError::Unusable(
                StepKind::Delta,
                step,
                "signed for another stream".into(),
                Fault::Corrupt,
            ));
        }
        if base == Base::Unproven && m.base_step == at.step && m.base_root != at.root {
            warn!(
                step,
                base = at.step,
                "the delta's base root is not its base's signed root; checking each step alone"
            );
            return Err(BuildError::ChainMismatch);
        }
        if base == Base::Held && m.base_step == at.step && m.base_root != at.root {
            // This delta says the step we hold has another root. The stream's own signed
            // manifest of that step decides. When it agrees with our copy (or cannot be read),
            // the delta is refused like any bad step and the verified weights stay: a bucket
            // can hold a forged or another run's delta, and refusing it costs nothing. Only
            // when it agrees with the delta are the local files not this stream's step (changed
            // on disk along with `state.json`): then the newest step is built from an anchor.
            let why = format!(
                "delta {step} (signed) says step {} has root {}, the local copy has {}",
                m.base_step, m.base_root, at.root
            );
            return Err(match self.stream_root(sid, at.step).await {
                Some(r) if r == m.base_root => {
                    BuildError::LocalMismatch(format!("{why}, as does step {}'s own manifest", at.step))
                }
                _ => BuildError::Unusable(StepKind::Delta, step, why, Fault::Corrupt),
            });
        }
        if m.base_root != at.root || m.base_step != at.step {
            return Err(att(driftless_format::Error::WrongBase {
                expected: format!("step {} root {}", m.base_step, m.base_root),
                actual: format!("step {} root {}", at.step, at.root),
            }
            .into()));
        }
        let mut segs: Vec<Option<DecodedSegment>> = (0..m.segments.len()).map(|_| None).collect();
        let mut bytes = 0u64;
        // Segments handed over stored (the decode-ahead budget was full) decode now, in parallel.
        let (mut late, mode) = (futures::stream::FuturesUnordered::new(), m.value_mode);
        while let Some(r) = segments.recv().await {
            let (i, got, n) = r.map_err(&att)?;
            bytes += n;
            match got {
                // Received: its bytes leave the decode-ahead budget (the permit is dropped).
                Got::Decoded(seg, _permit) => segs[i] = Some(seg),
                Got::Kept(seg) => segs[i] = Some(seg),
                Got::Stored(b, r) => late.push(async move { (i, decode_blocking(b, r, mode).await) }),
            }
        }
        while let Some((i, r)) = late.next().await {
            segs[i] = Some(r.map_err(&att)?);
        }
        let segs: Vec<DecodedSegment> = segs
            .into_iter()
            .collect::<Option<_>>()
            .ok_or_else(|| BuildError::Other(Error::Io(std::io::Error::other("delta download stopped"))))?;
        Ok((m, segs, bytes))
    }

    /// Applies a group of consecutive same-layout deltas in place onto the work slot in one
    /// pass over the model ([`fused::apply_and_hash`]: each region is applied by every delta of
    /// the group and hashed while it is in cache) and, when `verify`, checks the root of the
    /// result against the last delta's signed result root. The writes are made durable (fdatasync).
    /// With `seed`, the work slot is first replaced by a frame of that slot and the pass reads
    /// `seed` and writes every block of the work slot (a rebuild and an apply in one pass).
    /// Returns the group's last delta, decoded, once applied.
    async fn apply_group(
        &mut self,
        wdir: &Path,
        group: Vec<(DeltaManifest, Vec<DecodedSegment>)>,
        verify: bool,
        pinpoint: bool,
        seed: Option<PathBuf>,
    ) -> Result<Option<(DeltaManifest, Vec<DecodedSegment>)>, BuildError> {
        let Some(step) = group.last().map(|(m, _)| m.step) else { return Ok(None) };
        self.release_work_slot()?;
        // Several unverified deltas in one pass: a fault names no single step (retried carefully).
        let pinpoint = pinpoint && group.len() == 1;
        let dir = wdir.to_path_buf();
        let t = Instant::now();
        let n = group.len();
        let (verify_ms, mut group) = self
            .blocking(move || {
                let r = pass_group(&dir, seed.as_deref(), &group, verify);
                (r, group)
            })
            .await
            .map_err(|e| Error::Io(std::io::Error::other(format!("apply task: {e}"))))?;
        let verify_ms = verify_ms.map_err(|e| {
            if n > 1 && step_fault(&e) {
                BuildError::ChainMismatch
            } else {
                classify_apply(e, step, pinpoint)
            }
        })?;
        if verify {
            self.metrics.record_verify(Duration::from_millis(verify_ms.max(1)));
        }
        info!(deltas = n, step, secs = t.elapsed().as_secs_f64(), verified = verify, "deltas applied");
        Ok(group.pop())
    }

    /// Applies a layout-changing delta (tensors added, removed, reshaped or retyped): one
    /// pass reads the source (`seed`, the active slot, when the work slot is still unbuilt;
    /// else the work slot itself) and writes every tensor of the new layout into a fresh frame,
    /// applying the delta and hashing each block while it is in cache, as the fast path does
    /// (`fused::Target::Copy`). From the work slot, the frame is built beside it and replaces it.
    async fn rewrite_delta(
        &mut self,
        wdir: &Path,
        seed: Option<PathBuf>,
        m: &DeltaManifest,
        segs: Vec<DecodedSegment>,
        verify: bool,
        pinpoint: bool,
    ) -> Result<(), BuildError> {
        self.release_work_slot()?;
        let dir = wdir.to_path_buf();
        let m2 = m.clone();
        let step = m.step;
        let verify_ms = self
            .blocking(move || -> Result<u64> { rewrite_slot(&dir, seed, &m2, &segs, verify) })
            .await
            .map_err(|e| Error::Io(std::io::Error::other(format!("rewrite task: {e}"))))?
            .map_err(|e| classify_apply(e, step, pinpoint))?;
        if verify {
            self.metrics.record_verify(Duration::from_millis(verify_ms.max(1)));
        }
        Ok(())
    }

    /// Keeps in `cache/` only the segments of deltas the inactive slot may still need.
    fn prune_cache(&mut self) {
        let Some(st) = &self.state else { return };
        let keep_after = st.inactive.map(|h| h.step).unwrap_or(st.step);
        self.cached.retain(|(s, _)| *s > keep_after);
        let keep: std::collections::HashSet<String> =
            self.cached.iter().flat_map(|(_, v)| v.iter().map(|d| d.to_hex())).collect();
        if let Ok(rd) = std::fs::read_dir(self.dir.cache()) {
            for e in rd.flatten() {
                if !keep.contains(&e.file_name().to_string_lossy().to_string()) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }

    /// Follows the stream until `shutdown` resolves: adaptive, jittered polling; an immediate
    /// poll when `poke` is notified; exponential backoff after failures.
    ///
    /// `shutdown` is watched during a sync too: a sync in flight (say one retrying an
    /// unreachable bucket) is abandoned at once. That is safe at any point: a step is built in
    /// the inactive slot, which `state.json` marks as holding nothing before it is touched, and
    /// the switch (state, then link) has no await point inside it; `DIR/current` keeps naming
    /// the verified step. Blocking work already handed to tokio's blocking pool (an apply, a
    /// hash) finishes on its own or dies with the process; it only ever writes that slot.
    pub async fn run(
        mut self,
        poke: Arc<tokio::sync::Notify>,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<Stopped> {
        tokio::pin!(shutdown);
        let mut p = PollState {
            interval: self.cfg.poll_min,
            failures: 0,
            polls: 0,
            latest: LatestWatch::default(),
            listing: plan::ListCadence::default(),
        };
        let (notifying, stopping) = (self.notifying.clone(), self.stopping.clone());
        // The longest a load in flight is waited for at shutdown: the notifiers' own timeouts,
        // one target after another (they are notified in turn), plus the control calls around
        // a load.
        let grace = self.cfg.notify.iter().map(Notifier::longest_load).sum::<Duration>() + Duration::from_secs(90);
        loop {
            let polled = {
                let poll = self.poll(&mut p);
                tokio::pin!(poll);
                let stopped = tokio::select! {
                    biased;
                    _ = &mut shutdown => true,
                    _ = &mut poll => false,
                };
                // A notify in flight is finished first (bounded by the notifier's own
                // timeouts): dropped midway, it left an engine paused for its load with no one
                // to resume it (found by review). The rest of the poll is abandoned.
                if stopped {
                    stopping.store(true, Relaxed);
                }
                if stopped && notifying.load(Relaxed) {
                    info!(max_secs = grace.as_secs(), "stopping once the inference server's load in flight has ended");
                    let end = tokio::time::Instant::now() + grace;
                    loop {
                        tokio::select! {
                            _ = &mut poll => break,
                            _ = tokio::time::sleep_until(end) => {
                                warn!("the load in flight did not end in time; stopping anyway");
                                break;
                            }
                            _ = tokio::time::sleep(Duration::from_millis(20)) => {
                                if !notifying.load(Relaxed) {
                                    break;
                                }
                            }
                        }
                    }
                }
                !stopped
            };
            if !polled {
                debug!(step = self.state.as_ref().map(|s| s.step), "shutting down; sync in flight abandoned");
                return Ok(self.stopped(true));
            }
            let jitter = 0.8 + 0.4 * rand::random::<f64>();
            // A zero poll interval (a library caller's config) must not become a busy loop
            // against the bucket; after a failure, at least MIN_RETRY.
            let floor = if p.failures > 0 { MIN_RETRY } else { MIN_POLL };
            tokio::select! {
                _ = tokio::time::sleep(p.interval.max(floor).mul_f64(jitter)) => {}
                _ = poke.notified() => { p.interval = self.cfg.poll_min; }
                _ = &mut shutdown => {
                    debug!(step = self.state.as_ref().map(|s| s.step), "shutting down");
                    return Ok(self.stopped(false));
                }
            }
        }
    }

    fn stopped(&self, abandoned_sync: bool) -> Stopped {
        let verified = self.active_ok && !self.reverify;
        Stopped { abandoned_sync, step: self.state.as_ref().filter(|_| verified).map(|s| s.step) }
    }

    /// One poll of [`Agent::run`]: sets `p.interval` to the wait before the next one.
    async fn poll(&mut self, p: &mut PollState) {
        p.polls += 1;
        if self.reverify {
            // After an unclean shutdown, re-hash the local weights before anything that needs
            // the bucket (which may hang): a failure here is retried by `sync_once`.
            if let Err(e) = self.reverify_active().await {
                warn!(error = %e, "re-verifying the local weights failed");
            }
        }
        // Weights verified before this start (a clean stop, or re-hashed just now) are
        // announced before anything that needs the bucket: a bucket that hangs or is down must
        // not keep the server (or `/readyz`) from the step already on disk. A failed notify is
        // tried again after the sync, as always.
        if self.loaded.is_none() && self.active_ok && !self.reverify {
            if let Err(e) = self.notify_if_needed().await {
                warn!(error = %e, "announcing the verified local step failed; trying again after the sync");
            }
        }
        // Cheap check first: one conditional GET of latest.json. Unchanged and on a step:
        // nothing to do. Changed: the next sync plans from it (a follower one step behind
        // neither lists nor reads markers). Every 10th poll lists anyway (markers stay the
        // source of truth), less often while the store refuses listings (`plan::ListCadence`).
        let polled = p.latest.poll(&self.reader).await;
        let list = p.listing.due(p.polls);
        // After a failed sync, sync again even when latest.json did not change (its change was
        // taken by the poll whose sync failed). Not modified (or still absent, or still not
        // verifying) and on a step: nothing new.
        let on_step = self.state.is_some() && self.loaded.is_some();
        if on_step && !list && p.failures == 0 && matches!(&polled, Ok(w) if !w.changed) {
            p.interval = p.interval.saturating_mul(2).min(self.cfg.poll_max);
            // Nothing new: the time to bring an empty inactive slot up (a cold start's next
            // step is then a fast path). Given up when `latest.json` changes meanwhile: that
            // step is polled for at once, and its own build rebuilds the slot as before.
            // One stop per served step: a bucket that keeps announcing a step the agent then
            // refuses must not make it start and drop a rebuild at every idle poll.
            let Some(served) = self.idle_rebuild_due().map(|s| (s.stream_id.clone(), s.step)) else { return };
            let held = p.latest.version().filter(|_| self.idle_stopped.as_ref() != Some(&served));
            let fired = std::sync::atomic::AtomicBool::new(false);
            let changed =
                latest_changes(self.reader.clone(), held, served.clone(), self.cfg.poll_min, self.cfg.poll_max);
            let stop = async {
                changed.await;
                fired.store(true, Relaxed);
            };
            match self.prepare_inactive_until(stop).await {
                // (A stop that came during the last group: the copy is kept, and the step is
                // polled for at once all the same.)
                Ok(true) => p.interval = if fired.load(Relaxed) { Duration::ZERO } else { self.cfg.poll_min },
                Ok(false) if fired.load(Relaxed) => {
                    self.idle_stopped = Some(served.clone());
                    p.interval = Duration::ZERO;
                }
                Ok(false) => {}
                // A reader of the slot (a server still loading an older step): tried again at
                // the next idle poll, which backs off as usual.
                Err(e @ Error::SlotInUse { .. }) => debug!(error = %e, "idle rebuild of the inactive slot waits"),
                Err(e) => {
                    p.interval = self.cfg.poll_min;
                    warn!(error = %e, "idle rebuild of the inactive slot failed; not tried again for this step");
                }
            }
            return;
        }
        match polled {
            Ok(w) => {
                if let Some(why) = &w.invalid {
                    warn!(reason = %why, "latest.json does not verify; planning from the listing");
                }
                // Deleted or not verifying: the hint held before is no longer trusted.
                self.hint = w.hint.cloned();
                self.hint_polled = true;
            }
            Err(e) => {
                // The sync reads it once more (a transient error may have passed).
                debug!(error = %e, "reading latest.json failed");
                self.hint_polled = false;
            }
        }
        self.list_next = list;
        let synced = self.sync_once().await;
        p.listing.after(p.polls, self.markers.listing_failed());
        match synced {
            Ok(o) => {
                p.failures = 0;
                // A refused newer step is the last error until the stream moves on.
                self.metrics.set_last_error(
                    o.refused
                        .iter()
                        .find(|r| !r.fault.is_missing())
                        .map(|r| format!("{} step {} refused: {}", r.kind, r.step, r.reason)),
                );
                p.interval = if o.route == SyncPath::UpToDate {
                    p.interval.saturating_mul(2).min(self.cfg.poll_max)
                } else {
                    self.cfg.poll_min
                };
                for r in &o.refused {
                    warn!(kind = %r.kind, step = r.step, reason = %r.reason, "step refused; serving step {}", o.step);
                }
            }
            Err(e) => {
                p.failures += 1;
                p.interval = self
                    .cfg
                    .poll_min
                    .saturating_mul(2u32.saturating_pow(p.failures.min(6)))
                    .min(self.cfg.poll_max.saturating_mul(3));
                warn!(error = %e, failures = p.failures, retry_in_s = p.interval.as_secs_f64(), "sync failed");
                self.metrics.set_last_error(Some(e.to_string()));
            }
        }
    }
}

/// Shortest wait between two polls of [`Agent::run`], whatever `poll_min` says.
pub const MIN_POLL: Duration = Duration::from_millis(10);
/// Shortest wait before a poll after a failed one.
const MIN_RETRY: Duration = Duration::from_millis(100);

/// Resolves once `latest.json` announces a step the agent does not serve: a step newer than
/// `served` of its stream, or another stream (a new run in the prefix). The stop of an idle
/// rebuild. Polled every `every` from the version `held` (a conditional GET each; a rewrite
/// that announces nothing new, junk, a deletion or a replayed older hint of this stream is not
/// a stop: a bucket that rewrites it all the time must not keep the rebuild from ever ending;
/// another stream's hint, even an old one, is, once per served step: see `poll`); errors
/// back off, doubling up to `max`. Never resolves when the version held is not known (no
/// ETag from the backend).
async fn latest_changes(
    reader: StreamReader,
    held: Option<LatestVersion>,
    served: (String, u64),
    every: Duration,
    max: Duration,
) {
    let Some(held) = held else { return std::future::pending().await };
    let mut etag = match held {
        LatestVersion::Tagged(t) => Some(t),
        LatestVersion::Absent => None,
    };
    let every = every.max(MIN_POLL);
    let mut wait = every;
    loop {
        tokio::time::sleep(wait).await;
        let polled = reader.poll_latest(etag.as_deref()).await;
        wait = if polled.is_ok() { every } else { wait.saturating_mul(2).min(max.max(every)) };
        match polled {
            Ok(LatestPoll::Changed(h, tag)) => {
                let newest = h.delta.max(h.anchor);
                if h.stream_id != served.0 || newest.is_some_and(|s| s > served.1) {
                    return;
                }
                etag = tag;
            }
            Ok(LatestPoll::Invalid(tag, _)) => etag = tag,
            Ok(LatestPoll::Absent) => etag = None,
            Ok(LatestPoll::Unchanged) => {}
            Err(e) => debug!(error = %e, "reading latest.json during an idle rebuild failed"),
        }
    }
}

/// Raises its flag when dropped.
struct RaiseOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for RaiseOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Relaxed);
    }
}

/// The polling state of [`Agent::run`] between polls.
struct PollState {
    interval: Duration,
    failures: u32,
    polls: u64,
    /// `latest.json` as the last poll read it.
    latest: LatestWatch,
    /// When a poll lists although `latest.json` is unchanged.
    listing: plan::ListCadence,
}

/// How [`Agent::run`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stopped {
    /// A sync was in flight when `shutdown` resolved and was abandoned: nothing it wrote is
    /// used (it built in the inactive slot, which holds no step until the next sync).
    pub abandoned_sync: bool,
    /// The verified step `DIR/current` names (`None`: none yet, or the local weights did not
    /// verify).
    pub step: Option<u64>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        // Local weights not (yet) known to match state.json: leave `running` behind, so that
        // the next agent on this directory re-hashes them before it notifies anything, as
        // after a crash. (An agent stopped during that re-hash, or one that found the weights
        // wrong and could not rebuild them yet, would otherwise hand them over as verified.)
        self.dir.set_keep_running(self.reverify || (self.state.is_some() && !self.active_ok));
    }
}

/// Raises a flag for as long as it lives (also when the future holding it is dropped).
struct Flag<'a>(&'a std::sync::atomic::AtomicBool);

impl<'a> Flag<'a> {
    fn raise(f: &'a std::sync::atomic::AtomicBool) -> Flag<'a> {
        f.store(true, Relaxed);
        Flag(f)
    }
}

impl Drop for Flag<'_> {
    fn drop(&mut self) {
        self.0.store(false, Relaxed);
    }
}

/// Tensors an idle rebuild copies between two looks at its stop flag: a stop waits for at most
/// one group's pass (a few tenths of a second on 2 cores; a single larger tensor is a group of
/// its own).
pub const IDLE_GROUP_BYTES: u64 = 256 << 20;

/// The pass of an idle rebuild (`Agent::prepare_slot`): `to` becomes a fresh frame of `from`
/// (read-only) with every tensor copied and hashed block by block, a group of tensors at a time
/// (`fused::Target::Copy`, no deltas). Returns the root of what was written, made durable only
/// when it is `root`; `None` when `stop` was raised (looked at before the frame is made and
/// before each group).
fn copy_slot(
    from: &Path,
    to: &Path,
    root: Digest,
    group_bytes: u64,
    stop: &dyn Fn() -> bool,
) -> Result<Option<Digest>> {
    // (What `to` holds is unnamed: after a stop here, the caller removes it.)
    if stop() {
        return Ok(None);
    }
    let files = PassFiles::copy_of(from, to)?;
    let metas = files.written().metas();
    let mut digests = Vec::with_capacity(metas.len());
    let mut rest = &metas[..];
    while !rest.is_empty() {
        if stop() {
            return Ok(None);
        }
        let (mut n, mut bytes) = (0, 0u64);
        while n < rest.len() && (n == 0 || bytes < group_bytes) {
            bytes = bytes.saturating_add(rest[n].nbytes().unwrap_or(u64::MAX));
            n += 1;
        }
        let d = fused::apply_and_hash(files.target(), &rest[..n], &[], true)?
            .ok_or_else(|| Error::Io(std::io::Error::other("the pass returned no digests")))?;
        digests.extend(d);
        rest = &rest[n..];
    }
    // Done: a stop now would only throw away a finished copy (and, when the root is wrong,
    // the finding that the served slot changed).
    let got = driftless_format::hash::combine_root(metas.iter().map(|t| t.name.as_str()).zip(digests));
    if got == root {
        files.written().sync()?;
        sync_tree(to)?;
        to.parent().map_or(Ok(()), sync_dir)?;
    }
    Ok(Some(got))
}

/// [`Agent::apply_group`]'s pass, on the blocking pool: applies `group` (not empty) to the work
/// slot `dir` (rebuilt from `seed` by the same pass when given), checks the result against the
/// last delta's signed result root when `verify`, and makes it durable. Returns the
/// milliseconds of the pass.
fn pass_group(
    dir: &Path,
    seed: Option<&Path>,
    group: &[(DeltaManifest, Vec<DecodedSegment>)],
    verify: bool,
) -> Result<u64> {
    // Blocks are read, changed and written back with pread/pwrite (no writable map),
    // and each finished piece's writeback starts at once, so that the disk writes
    // while the pass goes on and the fdatasync after it waits for the tail only.
    // `speed_bench proc`, 1 GiB model, 2 cores: hash alone 0.32 s; the pass on a
    // writable map then msync 0.59 s (writeback could not start earlier there: see
    // `CheckpointFiles`); this way 0.40 s.
    // With a seed (the active slot, when the work slot cannot be brought forward), the
    // pass reads the seed and writes every block into a fresh frame of it: the rebuild
    // and the apply are one pass, not a copy then a pass.
    let files = match seed {
        Some(from) => PassFiles::copy_of(from, dir)?,
        None => PassFiles::InPlace(CheckpointFiles::open(dir)?),
    };
    let metas = files.written().metas();
    let tv = Instant::now();
    let chain: Vec<&[DecodedSegment]> = group.iter().map(|(_, s)| &s[..]).collect();
    let digests = fused::apply_and_hash(files.target(), &metas, &chain, verify)?;
    if let (Some(d), Some((last, _))) = (digests, group.last()) {
        ops::check_root(&metas, &d, &last.shards, last.result_root)?;
    }
    let verified = tv.elapsed();
    let tf = Instant::now();
    files.written().sync()?;
    debug!(pass_secs = verified.as_secs_f64(), flush_secs = tf.elapsed().as_secs_f64(), "pass and flush");
    Ok(verified.as_millis() as u64)
}

/// A delta being downloaded in the background (see `Agent::start_fetch`).
struct Fetch {
    manifest: tokio::sync::oneshot::Receiver<Result<(DeltaManifest, Digest)>>,
    segments: tokio::sync::mpsc::UnboundedReceiver<Result<(usize, Got, u64)>>,
    /// None when nothing runs in the background (a kept delta).
    _abort: Option<AbortOnDrop>,
}

/// The last delta an agent applied, decoded, and the ready marker it was read through (which
/// names the digest of its signed manifest envelope). Kept in memory for the next sync, which
/// brings the other slot over the same delta (two sparse applies per step in the steady state)
/// and takes it when that sync's marker for the step is the same: it then reads neither the
/// manifest from the bucket nor the segments from the local cache, nor decodes them again.
struct KeptDelta {
    marker: ReadyMarker,
    manifest: DeltaManifest,
    segs: Vec<DecodedSegment>,
}

/// A segment of a delta being fetched: decoded ahead (holding its bytes of the decode-ahead
/// budget until received), or stored, with its manifest entry, to be decoded when received.
enum Got {
    Decoded(DecodedSegment, tokio::sync::OwnedSemaphorePermit),
    Stored(Bytes, driftless_format::manifest::SegmentRef),
    /// Kept from the previous sync (see [`KeptDelta`]).
    Kept(DecodedSegment),
}

/// Decodes a segment (at most its `raw_size`, exactly its `entries`) on the blocking pool,
/// checking its value mode against the manifest's.
async fn decode_blocking(
    b: Bytes,
    r: driftless_format::manifest::SegmentRef,
    mode: delta::ValueMode,
) -> Result<DecodedSegment> {
    tokio::task::spawn_blocking(move || -> Result<DecodedSegment> {
        let seg = delta::decode_segment_of(&b, &r)?;
        if seg.mode != mode {
            return Err(corrupt("segment", "value mode differs from the manifest"));
        }
        Ok(seg)
    })
    .await
    .map_err(|e| Error::Io(std::io::Error::other(format!("decode task: {e}"))))?
}

/// Stops a background download when its consumer goes away (a failed apply, a dropped sync).
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A root mismatch after the last delta of a chain that was not verified step by step cannot
/// be pinned on one step: the caller retries carefully. Otherwise the step is at fault.
/// Deltas of a chain downloaded and decoded ahead of the one being received.
const FETCH_AHEAD: usize = 4;

/// Payload bytes (as their ready markers state them, which their signed manifests must match
/// before a segment is read) of the deltas downloading at once, the one being received
/// included; one delta always downloads, whatever its size. Their segments wait as stored
/// bytes when the decode budget is spent, so this bounds that memory (found by review: four
/// deltas of any size were fetched ahead).
const FETCH_AHEAD_BYTES: u64 = 2 << 30;

/// Decoded segment bytes held ahead of their delta being received, all fetches together: what
/// the download overlap may cost in memory, whatever the (signed, still hostile) manifests
/// claim. Beyond it segments wait stored (their compressed bytes) and decode when received.
const DECODE_AHEAD_BYTES: usize = 1 << 30;

/// Decoded delta bytes applied in one pass at most (bounds the memory of a long catch-up; a
/// pass is one read of the model, so this also bounds how often it is read).
const GROUP_RAW_BYTES: u64 = 512 << 20;

/// The most decoded bytes of a delta an agent keeps in memory between syncs ([`KeptDelta`]).
/// Counted by [`DecodedSegment::heap_bytes`]. Deltas of `speed_bench`'s 1 GiB chain decode to
/// 9.3-20.2 MiB (0.77-1.9% of elements changed): about 12 MiB per GiB of BF16 at 1%, so a 7B
/// model's (13 GiB) about 160 MiB; past about 20 GiB of weights (10B parameters) at 1% the
/// delta is read from the local cache again, and the step costs one manifest GET more. Held
/// while the agent idles between steps.
const KEEP_DECODED_BYTES: u64 = 256 << 20;

fn classify_apply(e: Error, step: u64, pinpoint: bool) -> BuildError {
    let is_result = matches!(&e, Error::Format(driftless_format::Error::Corrupt { what: "result", .. }));
    if is_result {
        return if pinpoint { BuildError::SuspectResult(step, e.to_string()) } else { BuildError::ChainMismatch };
    }
    if step_fault(&e) {
        let f = fault(&e);
        BuildError::Step(StepKind::Delta, step, e.to_string(), f)
    } else {
        BuildError::Other(e)
    }
}

/// The files a fused pass works on: the work slot changed in place, or a source (opened
/// read-only) read into a fresh frame written whole.
enum PassFiles {
    InPlace(CheckpointFiles),
    Copy { from: CheckpointFiles, to: CheckpointFiles },
}

impl PassFiles {
    /// A fresh frame of `from` (opened read-only, never written) at the slot `to`, once what
    /// `to` held is removed ([`remove_slot`]): a pass over it reads the one and writes every
    /// block of the other, so the pass is also the copy.
    fn copy_of(from: &Path, to: &Path) -> Result<Self> {
        let from = CheckpointFiles::open_read_only(from)?;
        remove_slot(to)?;
        Ok(PassFiles::Copy { to: from.frame_copy(to)?, from })
    }

    fn target(&self) -> fused::Target<'_, '_> {
        match self {
            PassFiles::InPlace(f) => fused::Target::Files(f),
            PassFiles::Copy { from, to } => fused::Target::Copy { from, to },
        }
    }

    /// The files the pass writes (to hash, check and sync).
    fn written(&self) -> &CheckpointFiles {
        match self {
            PassFiles::InPlace(f) | PassFiles::Copy { to: f, .. } => f,
        }
    }
}

/// Removes the slot `dir` and the layout rewrite's frame `dir.new` a crash may have left
/// beside it (its space counts too); returns whether either was there.
fn remove_slot(dir: &Path) -> std::io::Result<bool> {
    let mut removed = false;
    for d in [dir.with_extension("new"), dir.to_path_buf()] {
        if d.exists() {
            std::fs::remove_dir_all(&d)?;
            removed = true;
        }
    }
    Ok(removed)
}

/// The pass of [`Agent::rewrite_delta`]. Returns the milliseconds of the pass.
fn rewrite_slot(
    dir: &Path,
    seed: Option<PathBuf>,
    m: &DeltaManifest,
    segs: &[DecodedSegment],
    verify: bool,
) -> Result<u64> {
    let (src, out) = match seed {
        Some(active) => (active, dir.to_path_buf()),
        None => (dir.to_path_buf(), dir.with_extension("new")),
    };
    if out.exists() {
        std::fs::remove_dir_all(&out)?;
    }
    let tv = Instant::now();
    info!(step = m.step, from = %src.display(), "rewriting the layout");
    {
        // The source is never written: the active slot is served.
        let from = CheckpointFiles::open_read_only(&src)?;
        let files = PassFiles::Copy { to: from.frame_layout(&out, &m.layout())?, from };
        let framed = tv.elapsed();
        let metas = files.written().metas();
        let digests = fused::apply_and_hash(files.target(), &metas, &[segs], verify)?;
        if let Some(d) = digests {
            ops::check_root(&metas, &d, &m.shards, m.result_root)?;
        }
        let passed = tv.elapsed();
        files.written().sync()?;
        debug!(
            frame_secs = framed.as_secs_f64(),
            pass_secs = (passed - framed).as_secs_f64(),
            flush_secs = (tv.elapsed() - passed).as_secs_f64(),
            "rewrite pass and flush"
        );
    }
    let ms = tv.elapsed().as_millis() as u64;
    if out != dir {
        std::fs::remove_dir_all(dir)?;
        std::fs::rename(&out, dir)?;
        if let Some(p) = dir.parent() {
            sync_dir(p)?;
        }
    }
    info!(step = m.step, secs = tv.elapsed().as_secs_f64(), "layout rewritten");
    Ok(ms)
}

fn cached_object(cache: &Path, size: u64, sha: Digest) -> Option<Bytes> {
    let p = cache.join(sha.to_hex());
    let md = std::fs::metadata(&p).ok()?;
    if md.len() != size {
        return None;
    }
    let b = std::fs::read(&p).ok()?;
    (Digest::of(&b) == sha).then(|| Bytes::from(b))
}

/// Keeps a verified object in the cache (best effort: the cache is an optimisation, checked by
/// hash on every read, so it needs no fsync).
fn keep_object(cache: &Path, sha: Digest, b: &[u8]) {
    let _ = std::fs::create_dir_all(cache);
    let tmp = cache.join(format!("{}.tmp", sha.to_hex()));
    if std::fs::write(&tmp, b).is_ok() {
        let _ = std::fs::rename(&tmp, cache.join(sha.to_hex()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use driftless_format::checkpoint::write_checkpoint;
    use driftless_format::{DType, TensorView};

    /// A checkpoint of `n` BF16 tensors of `bytes` each, in two shard files; its root.
    fn model(dir: &Path, n: usize, bytes: usize) -> Digest {
        let data: Vec<Vec<u8>> = (0..n).map(|i| (0..bytes).map(|j| (j * 31 + i * 7) as u8).collect()).collect();
        let names: Vec<String> = (0..n).map(|i| format!("t{i}")).collect();
        let shape = [bytes as u64 / 2];
        let views: Vec<TensorView<'_>> =
            names.iter().zip(&data).map(|(m, d)| TensorView::new(m, DType::BF16, &shape, d).unwrap()).collect();
        let metas: Vec<TensorMeta> = views.iter().map(|v| v.meta()).collect();
        let layout = Layout::for_tensors(&metas, (bytes * n / 2) as u64).unwrap();
        assert_eq!(layout.shards.len(), 2);
        write_checkpoint(dir, &layout, &views).unwrap();
        driftless_format::weights_root(&views).1
    }

    fn files(dir: &Path) -> std::collections::BTreeMap<std::ffi::OsString, Vec<u8>> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap())
            .map(|e| (e.file_name(), std::fs::read(e.path()).unwrap()))
            .collect()
    }

    #[test]
    fn an_idle_rebuild_copies_every_file_and_returns_its_root() {
        let d = tempfile::tempdir().unwrap();
        let (from, to) = (d.path().join("a"), d.path().join("b"));
        let root = model(&from, 6, 3 << 20);
        // Groups of about one tensor: several passes, one digest list.
        let calls = std::cell::Cell::new(0);
        let got = copy_slot(&from, &to, root, 1 << 20, &|| {
            calls.set(calls.get() + 1);
            false
        })
        .unwrap();
        assert_eq!(got, Some(root));
        assert_eq!(calls.get(), 1 + 6, "a look before the frame and before each group");
        assert_eq!(files(&from), files(&to));
    }

    #[test]
    fn an_idle_rebuild_stops_at_the_next_group() {
        let d = tempfile::tempdir().unwrap();
        let (from, to) = (d.path().join("a"), d.path().join("b"));
        let root = model(&from, 6, 3 << 20);
        for stop_at in [1, 2, 4, 7] {
            let calls = std::cell::Cell::new(0);
            let got = copy_slot(&from, &to, root, 1 << 20, &|| {
                calls.set(calls.get() + 1);
                calls.get() >= stop_at
            })
            .unwrap();
            assert_eq!(got, None, "stopped at look {stop_at}");
            assert_eq!(calls.get(), stop_at, "no look after the stop");
        }
        // A stop after the last group is too late to matter: the finished copy is kept.
        let calls = std::cell::Cell::new(0);
        let late = copy_slot(&from, &to, root, 1 << 20, &|| {
            calls.set(calls.get() + 1);
            calls.get() > 7
        });
        assert_eq!(late.unwrap(), Some(root));
        // A wrong root: the copy is returned with the root it has, never made to look right.
        let wrong = Digest::of(b"another step");
        assert_eq!(copy_slot(&from, &to, wrong, 1 << 20, &|| false).unwrap(), Some(root));
    }

    /// The poll loop's stop of an idle rebuild: pending while `latest.json` is the version the
    /// poll held or announces nothing the agent does not serve, resolved once it announces a
    /// newer step or another stream.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_idle_rebuilds_stop_is_a_new_latest_json() {
        let d = tempfile::tempdir().unwrap();
        let url = format!("file://{}", d.path().join("bucket").display());
        let bucket = Bucket::open(&url, &driftless_store::StoreOptions::default()).unwrap();
        let key = driftless_format::Keypair::from_seed([3; 32]);
        let trust = TrustSet::new().with_key(key.public());
        let mut chain =
            driftless_format::gen::RlChain::new(&driftless_format::gen::ModelSpec::with_bf16_bytes(64 << 10), 2e-6, 1);
        let b = bucket.clone();
        let mut p = tokio::task::spawn_blocking(move || {
            let mut p = driftless_publisher::PublisherBuilder::new("x").with_bucket(b).with_key(key).build().unwrap();
            p.publish(0, &chain.views()).unwrap();
            p.flush().unwrap();
            chain.step();
            (p, chain)
        })
        .await
        .unwrap();
        let reader = StreamReader::new(bucket, trust);
        let mut w = LatestWatch::default();
        assert!(w.poll(&reader).await.unwrap().hint.is_some());
        let sid = w.hint().unwrap().stream_id.clone();
        let ms = Duration::from_millis(10);
        let stop = latest_changes(reader.clone(), w.version(), (sid.clone(), 0), ms, ms);
        tokio::pin!(stop);
        // The same change seen by an agent that serves step 1 already: no stop.
        let served = latest_changes(reader.clone(), w.version(), (sid.clone(), 1), ms, ms);
        tokio::pin!(served);
        assert!(tokio::time::timeout(Duration::from_millis(300), &mut stop).await.is_err(), "unchanged: no stop");
        p = tokio::task::spawn_blocking(move || {
            let (pb, chain) = &mut p;
            pb.publish(1, &chain.views()).unwrap();
            pb.flush().unwrap();
            p
        })
        .await
        .unwrap();
        tokio::time::timeout(Duration::from_secs(10), &mut stop).await.expect("a new step stops it");
        assert!(tokio::time::timeout(Duration::from_millis(300), &mut served).await.is_err(), "nothing new for it");
        // Another stream's hint (a new run in the prefix) is a stop, whatever its steps.
        let other = latest_changes(reader.clone(), w.version(), ("another run".into(), 5), ms, ms);
        tokio::time::timeout(Duration::from_secs(10), other).await.expect("another stream stops it");
        // Not known (no ETag held): never a stop.
        let never = latest_changes(reader, None, (sid, 0), ms, ms);
        assert!(tokio::time::timeout(Duration::from_millis(100), never).await.is_err());
        tokio::task::spawn_blocking(move || p.0.close().unwrap()).await.unwrap();
    }
}
