//! Sharded publishing: every trainer rank publishes the slices of the model it holds, and one
//! commit through the bucket makes a signed step that agents read like any other
//! (`docs/sharded.md`).
//!
//! Per step `S`, with `G` the group's generation (the committer's lease), `k` the rank and `N`
//! the rank process's nonce:
//!
//! ```text
//! deltas/S/gG-rk-N-seg-0000.dls rank k's delta segments, positions in global coordinates
//! deltas/S/gG-rk-N-edges.bin    the bytes of the leaves rank k's runs only partly cover
//! deltas/S/gG-rk-N-slices.bin   anchor parts and scheduled-anchor steps: rank k's slice bytes
//! deltas/S/gG-rk-N-part.json    rank k's signed part manifest (written after its objects)
//! deltas/S/gG-manifest.json     the committer's delta manifest over all parts
//! anchors/S/...                 anchor steps: the anchor the committer assembled
//! deltas/S/gG-outcome.json      the committer's signed verdict, written last
//! ```
//!
//! Rank 0 is the committer: it takes a generation with `world_size` in its lease; the other
//! ranks find the group's generation as the newest lease naming their `world_size`. Every rank
//! diffs its slices against its copy of the last *committed* step and uploads its part; the
//! committer waits up to `commit_timeout` for all `world_size` parts, checks their
//! signatures, that every part has the same kind and base, and that the slices cover every
//! tensor exactly once (`slice::assemble`); it computes the weights root from the parts'
//! chunk digests, writes the manifest and the ready marker through the same commit as the
//! single-process publisher (claim, confirmation listing, lease check, marker), then the
//! outcome. A step missing a part, or with parts that disagree, gets an outcome saying so and
//! no ready marker; after a missing part, two parts of one rank, or a kind or base
//! disagreement the next step is an anchor (a rank that died lost its copy).
//!
//! `publish` blocks for one copy of the rank's slices (and for the previous step, see below),
//! then returns: the diff, the encode, the digests, the upload of the part and, on rank 0, the
//! commit (an anchor's assembly and compression included) run on a background thread while
//! the trainer computes its next step. Every rank, rank 0 included, learns the outcome of a
//! step at the start of its next `publish` (or in `flush`), because the next step's part is
//! taken against the last committed one: one step in flight per rank.
//!
//! Anchors are gathered by the committer through the bucket (each rank uploads its slice
//! bytes; the committer assembles the safetensors files in a spool directory, checks them
//! against the parts' digests and encodes the anchor). Anchors are the one place a sharded
//! step costs a gather; deltas never do. A part is an anchor part only when there is no
//! committed base (the first step, a restarted rank, after a failure). Scheduled anchors
//! (`anchor_every`, the committer's setting) keep the chain going: the outcome of the step
//! before asks for slices (`slices_next`), every rank sends its delta part with its slices,
//! the committer commits the step as a delta, writes the outcome, and only then gathers the
//! anchor on the same thread, after the ranks have moved on.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use driftless_format::delta::{encode_runs, DeltaStats, Run};
use driftless_format::hash::{combine_root, finish_tensor};
use driftless_format::manifest::{self, DeltaManifest, ObjectRef, SegmentRef, StepKind};
use driftless_format::slice::{assemble, part_digest, PartDigest, Slice};
use driftless_format::{CheckpointMut, DType, Digest, Layout, TensorMeta, TrustSet};
use driftless_store::stream::StreamReader;
use driftless_store::{layout, Bucket};
use futures::StreamExt;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::publisher::{encode_spooled, spool_dir, PublisherBuilder, SpooledStep};
use crate::upload::{self, commit_step_unmarked, delete_all, Commit, CommitError, Ctx};
use crate::{Error, Result};

/// Largest number of ranks a step may have.
pub const MAX_WORLD_SIZE: u64 = 1 << 16;

/// The longest `commit_timeout` a sharded publisher takes: a day. The deadlines built from it
/// (twice it, plus the outcome wait's hours) must stay inside what an `Instant` holds (found
/// by review: a huge timeout from Python panicked on the first wait).
pub const MAX_COMMIT_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// Bytes of a slices object fetched per request when the committer gathers an anchor.
const GATHER_WINDOW: u64 = 64 << 20;
/// Bound on the edge bytes of one step's parts together, checked before they are fetched
/// (row and flat cuts send under a leaf per cut; column-sharded tensors send their bytes, so
/// this is also the largest column-sharded share of a model a step can carry).
const MAX_EDGE_BYTES: u64 = 4 << 30;
/// Bound on the part manifests of one step together (they list 1 MiB chunk digests: this
/// covers models of several TB).
const MAX_PARTS_BYTES: u64 = 256 << 20;

/// The part of a tensor a rank holds: the global tensor (name, dtype, shape) and the slice's
/// elements in row-major order of the slice.
#[derive(Debug, Clone)]
pub struct Shard<'a> {
    /// Global tensor name.
    pub name: &'a str,
    /// Element type.
    pub dtype: DType,
    /// Global shape of the tensor.
    pub shape: &'a [u64],
    /// Which part of the tensor: a block of `shape` ([`Slice::block`], or any hyper-rectangle)
    /// or a flat range of the tensor viewed as 1-D ([`Slice::flat`]).
    pub slice: Slice,
    /// The slice's bytes, row-major within the slice.
    pub data: &'a [u8],
}

/// What a rank's part of a step holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PartKind {
    /// Delta segments against the last committed step.
    Delta,
    /// The slice bytes themselves.
    Anchor,
}

/// One contiguous byte run of a rank's slice and its digest part (see `slice::PartDigest`);
/// the head and tail bytes are in the part's edges object, in run order.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PartRun {
    start: u64,
    len: u64,
    head: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    head_leaves: Vec<Digest>,
    chunks: Vec<Digest>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    tail_leaves: Vec<Digest>,
    tail: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct PartTensor {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    offsets: Vec<u64>,
    lengths: Vec<u64>,
    runs: Vec<PartRun>,
}

/// A rank's signed description of its part of a step.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PartManifest {
    kind: String,
    version: u32,
    stream_id: String,
    step: u64,
    generation: u64,
    rank: u64,
    world_size: u64,
    part: PartKind,
    /// The committed step and root a delta part was taken against.
    base_step: Option<u64>,
    base_root: Option<Digest>,
    tensors: Vec<PartTensor>,
    segments: Vec<SegmentRef>,
    edges: ObjectRef,
    slices: Option<ObjectRef>,
    stats: DeltaStats,
}

/// The committer's verdict on a step, written last; ranks read it to know which copy of
/// their slices is the committed one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepOutcome {
    /// Step.
    pub step: u64,
    /// Whether the step was committed (has a ready marker).
    pub committed: bool,
    /// The kind it was committed as.
    pub of: Option<StepKind>,
    /// Its weights root.
    pub root: Option<Digest>,
    /// Why it was not committed.
    pub reason: Option<String>,
    /// Whether the next step must be an anchor (a part was missing or disagreed).
    pub next_anchor: bool,
    /// SHA-256 of each rank's part manifest the commit used, by rank: a rank adopts its copy
    /// as the new base only when its own part is listed (not a predecessor's of that step).
    #[serde(default)]
    pub parts: Vec<Digest>,
    /// The committer asks every rank to send its slice bytes with its next delta part: an
    /// anchor is due, and the committer gathers it from those slices after committing that
    /// step as a delta (no rank waits for the anchor, and followers take the step's delta).
    #[serde(default)]
    pub slices_next: bool,
    /// Whether publishing again may commit (see [`crate::Error::is_retryable`]); false when
    /// every later step would be refused the same way (parts overlapping, ranks disagreeing
    /// on a tensor, a size cap, a newer committer). Outcomes written before this field are
    /// read as retryable.
    #[serde(default = "yes")]
    pub retryable: bool,
}

fn yes() -> bool {
    true
}

impl StepOutcome {
    fn aborted(step: u64, reason: String, next_anchor: bool) -> Self {
        StepOutcome {
            step,
            committed: false,
            of: None,
            root: None,
            reason: Some(reason),
            next_anchor,
            parts: vec![],
            slices_next: false,
            retryable: true,
        }
    }
}

/// Returned by [`ShardedPublisher::publish`]. The step's part is built and sent, and on rank
/// 0 committed, after the call returns: its report and outcome come with the next call's
/// receipt (`previous_part`, `previous`) or from [`ShardedPublisher::flush`].
#[derive(Debug, Clone, Serialize)]
pub struct ShardedReceipt {
    /// Step.
    pub step: u64,
    /// What this rank's part holds.
    pub part: PartKind,
    /// Whether the part also carries this rank's slice bytes: an anchor of the step (a delta
    /// step whose anchor the committer gathers after committing the delta, when `part` is
    /// [`PartKind::Delta`]).
    pub slices: bool,
    /// Time `publish` blocked: waiting for the previous step (its part sent, its outcome
    /// known), then copying this rank's slices.
    pub blocked_secs: f64,
    /// The committer's outcome of the previous step this rank published.
    pub previous: Option<StepOutcome>,
    /// This rank's part of the previous step it published (`None` when it was not sent).
    pub previous_part: Option<PartReport>,
}

/// A rank's part of one step, built and sent in the background.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PartReport {
    /// Step.
    pub step: u64,
    /// What the part holds.
    pub part: PartKind,
    /// Whether it also carried the slice bytes (see [`ShardedReceipt::slices`]).
    pub slices: bool,
    /// Bytes this rank uploaded for the step.
    pub bytes: u64,
    /// Diff, encode, digests and upload of the part.
    pub secs: f64,
    /// Rank 0: time spent waiting for the other parts and committing the step.
    pub commit_secs: f64,
}

/// A rank's copy of its slices at a step.
struct Copy {
    step: u64,
    /// (tensor, slice, where its bytes lie in `data`), in the order passed.
    shards: Vec<(TensorMeta, Slice, std::ops::Range<usize>)>,
    /// Every shard's bytes back to back: an anchor part's slices object as it is, so that
    /// uploading it takes no second copy of the rank's slices.
    data: Vec<u8>,
}

impl Copy {
    /// The bytes of shard `i`.
    fn bytes(&self, i: usize) -> &[u8] {
        &self.data[self.shards[i].2.clone()]
    }
}

/// An anchor part's slices object: the bytes of a shared [`Copy`].
struct CopyBytes(Arc<Copy>);

impl AsRef<[u8]> for CopyBytes {
    fn as_ref(&self) -> &[u8] {
        &self.0.data
    }
}

/// The last committed step's slices (shared with the background thread of the next step)
/// and weights root.
type Committed = (Arc<Copy>, Digest);

/// The step whose part is being built, sent (and on rank 0 committed) in the background.
struct InFlight {
    step: u64,
    copy: Arc<Copy>,
    /// The part's fate, sent by the thread as soon as it is known (before a commit).
    sent_rx: std::sync::mpsc::Receiver<Sent>,
    sent: Option<Sent>,
    /// Rank 0: the commit's outcome and seconds, sent as soon as the outcome is written (the
    /// thread may go on gathering an anchor). Nothing when the part was not sent.
    done_rx: std::sync::mpsc::Receiver<(StepOutcome, f64)>,
    thread: std::thread::JoinHandle<()>,
}

impl InFlight {
    /// Waits until the part is uploaded (or failed).
    fn sent(&mut self) -> &Sent {
        let step = self.step;
        let rx = &self.sent_rx;
        self.sent.get_or_insert_with(|| {
            rx.recv().unwrap_or_else(|_| Err((None, format!("step {step}: the thread sending the part panicked"))))
        })
    }
}

/// A part sent: the SHA-256 of its manifest and its report; or why it was not.
/// (On a failure, the part manifest's SHA-256 when the part was built: an upload reported
/// failed may still have landed, and be committed.)
type Sent = std::result::Result<(Digest, PartReport), (Option<Digest>, String)>;

/// The committer's side of a step (rank 0).
struct CommitJob {
    ctx: Arc<Ctx>,
    trust: TrustSet,
    world_size: u64,
    timeout: Duration,
    /// The committer's last committed step, whatever slices it had.
    committed: Option<Committed>,
    schedule: Arc<std::sync::Mutex<AnchorSchedule>>,
    /// The newest step the stream held when this committer started (its ready markers).
    resumed_after: Option<u64>,
}

/// The committer's anchor schedule, shared by the threads that commit steps and gather
/// anchors. Anchors are due every `anchor_every` steps; at most one is gathered at a time.
#[derive(Debug, Default)]
struct AnchorSchedule {
    /// The newest anchor step committed, or being gathered.
    last: Option<u64>,
    /// The step whose anchor is being gathered.
    busy: Option<u64>,
    /// The newest delta the parts made was one readers refuse (`DeltaManifest::validate`):
    /// every step asks for slices until a delta passes, so that each is committed whole as an
    /// anchor instead of refused (found by review: with slices only on scheduled steps, every
    /// other step of such a layout was refused for the rest of the run).
    unreadable: bool,
    /// The last step refused before its marker's request, its parts removed once: swept again
    /// at the next commit, for a part that landed after the refusal (a rank later than the
    /// commit timeout, whose upload ends after the outcome).
    refused: Option<u64>,
    /// The rank and the two part names (step prefix removed) of the last step refused for a
    /// rank with two parts: the same two processes again at the next step are two processes
    /// given one rank, which no retry mends.
    twice: Option<(u64, [String; 2])>,
}

/// What the committer gathers an anchor from: the parts of a step (each with its slices
/// object) and what the commit computed from them.
struct AnchorParts {
    step: u64,
    parts: Vec<PartManifest>,
    layout: Layout,
    digests: Vec<Digest>,
    root: Digest,
}

/// An anchor the committer gathers after committing its step as a delta.
struct LaterAnchor {
    anchor: AnchorParts,
    /// The schedule's `last` before this anchor (restored when it fails, so the next
    /// outcome asks for slices again).
    previous: Option<u64>,
}

/// The background work of one step: build the part, upload it, and on rank 0 commit.
struct PartJob {
    cfg: PublisherBuilder,
    stream_id: String,
    bucket: Bucket,
    handle: tokio::runtime::Handle,
    who: Who,
    copy: Arc<Copy>,
    /// The base of a delta part (this rank's copy of the same slices at the committed step).
    base: Option<Committed>,
    kind: PartKind,
    /// Send the slice bytes too (always for an anchor part).
    slices: bool,
    commit: Option<CommitJob>,
}

impl PartJob {
    /// Builds and sends the part (its fate on `tx`); on rank 0 then commits the step (the
    /// outcome on `done`, once written) and, when the step carried every rank's slices for
    /// an anchor, gathers and commits that anchor before returning.
    fn run(mut self, tx: std::sync::mpsc::Sender<Sent>, done: std::sync::mpsc::Sender<(StepOutcome, f64)>) {
        let step = self.copy.step;
        let t = Instant::now();
        if let Some(c) = &self.commit {
            // At work on the step from its own part on: the other ranks wait on while the
            // lease says so. Set only at the commit, a slow upload of rank 0's part (the
            // largest, under the torch hook) made them give up on a step that then committed,
            // and disagree about it (found by review).
            c.ctx.shared.update(|s| s.committing = Some(step));
        }
        // A panic is a failure like any other: rank 0 must still tell the others.
        let mut built_sha = None;
        let sent = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<(Digest, u64)> {
            let built = build_part(
                &self.cfg,
                &self.stream_id,
                self.who,
                &self.copy,
                self.base.as_ref(),
                self.kind,
                self.slices,
            )?;
            built_sha = Some(built.sha);
            let bytes = built.objects.iter().map(|(_, b)| b.len() as u64).sum::<u64>();
            self.handle.block_on(upload_part(&self.bucket, step, &built))?;
            Ok((built.sha, bytes))
        }))
        .unwrap_or_else(|_| {
            Err(Error::Upload { step, detail: "building or sending the part panicked".into(), retryable: false })
        });
        let secs = t.elapsed().as_secs_f64();
        let (sha, bytes) = match (sent, &self.commit) {
            (Ok(s), _) => s,
            (Err(e), c) => {
                if let Some(c) = c {
                    // The other ranks wait for an outcome: tell them at once there is none.
                    let o = StepOutcome::aborted(step, format!("rank 0's part was not sent: {e}"), true);
                    self.handle.block_on(write_outcome(&self.cfg, &c.ctx, &o));
                    c.ctx.shared.update(|s| s.committing = None);
                }
                let _ = tx.send(Err((built_sha, e.to_string())));
                return;
            }
        };
        info!(step, rank = self.who.rank, kind = ?self.kind, slices = self.slices, bytes, secs, "part uploaded");
        let report = PartReport { step, part: self.kind, slices: self.slices, bytes, secs, commit_secs: 0.0 };
        let _ = tx.send(Ok((sha, report)));
        // The slices are uploaded: this thread must not keep this rank's copies alive through
        // a commit and an anchor's gather (the publisher reuses the freed buffer).
        drop(self.copy);
        drop(self.base);
        let Some(mut c) = self.commit.take() else { return };
        let t1 = Instant::now();
        let committed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.handle.block_on(commit(&self.cfg, &c, (step, c.world_size, c.timeout)))
        }));
        let (o, later, sweep) = committed.unwrap_or_else(|_| {
            // The other ranks wait for an outcome: "not committed" (at worst of a step that
            // was, which costs an anchor), never silence. An anchor the commit had scheduled
            // is not gathered: let the schedule ask for the next one.
            let mut s = c.schedule.lock().unwrap_or_else(|e| e.into_inner());
            if s.busy == Some(step) {
                s.busy = None;
            }
            drop(s);
            let o = StepOutcome::aborted(step, "the commit panicked".into(), true);
            self.handle.block_on(write_outcome(&self.cfg, &c.ctx, &o));
            c.ctx.shared.update(|s| s.committing = None);
            (o, None, vec![])
        });
        c.committed = None;
        let _ = done.send((o, t1.elapsed().as_secs_f64()));
        // Refused steps' parts, removed once the outcome is out and this rank's `publish` may
        // go on (this thread is joined by `flush` and `close`).
        for refused in sweep {
            let removed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.handle.block_on(remove_refused(&c.ctx, refused))
            }));
            if removed.is_err() {
                warn!(step = refused, "removing a refused step's parts panicked; GC removes them later");
            }
        }
        if let Some(later) = later {
            let previous = later.previous;
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.handle.block_on(commit_anchor(&self.cfg, &c.ctx, &later.anchor))
            }))
            .unwrap_or_else(|_| Err(Refusal::from(("gathering the anchor panicked".to_string(), true))));
            let mut s = c.schedule.lock().unwrap_or_else(|e| e.into_inner());
            s.busy = None;
            match r {
                Ok(()) => info!(step, secs = t1.elapsed().as_secs_f64(), "sharded anchor committed after its delta"),
                Err(Refusal { reason, .. }) => {
                    // The delta is committed; readers lose nothing but this anchor. The next
                    // outcome asks for slices again (unless an anchor step came since).
                    if s.last == Some(step) {
                        s.last = previous;
                    }
                    drop(s);
                    warn!(step, reason, "anchor of a delta step not committed");
                    self.handle.block_on(remove_slices(&c.ctx, &later.anchor));
                }
            }
        }
    }
}

/// One rank of a sharded publisher. Build with [`PublisherBuilder::build_sharded`].
///
/// Dropping it (or `close`) waits for the step in flight: its upload, and on rank 0 its commit
/// (up to `commit_timeout` for the other parts), so that no step is left half-sent. A drop
/// without `close` says on stderr when that step was not published (rank 0) or this rank's
/// part of it was not sent (other ranks): `close` returns it as an error instead.
pub struct ShardedPublisher {
    cfg: PublisherBuilder,
    rt: Option<tokio::runtime::Runtime>,
    bucket: Bucket,
    trust: TrustSet,
    stream_id: String,
    rank: u64,
    world_size: u64,
    commit_timeout: Duration,
    /// The committer's context (rank 0).
    ctx: Option<Arc<Ctx>>,
    /// The group generation this rank last published under.
    generation: Option<u64>,
    /// The slices of the last committed step and its weights root.
    committed: Option<Committed>,
    /// The step published last, until its part is sent and its outcome known.
    in_flight: Option<InFlight>,
    /// The buffer of a copy no longer needed (the base a newer commit replaced, or a copy
    /// not adopted), reused by the next copy of the same size: its pages are already
    /// faulted in, so `publish` costs one memcpy instead of a fresh allocation's page faults.
    spare: Option<Vec<u8>>,
    /// This process's nonce in its object names.
    nonce: u32,
    next_anchor: bool,
    /// The committer asked for this rank's slices with its next delta part.
    slices_next: bool,
    /// Rank 0: the anchor schedule its commits follow.
    schedule: Arc<std::sync::Mutex<AnchorSchedule>>,
    /// Threads of earlier steps still running: on rank 0, one that gathers an anchor after
    /// its step's outcome. Joined when finished, and by `flush` and `close`.
    background: Vec<std::thread::JoinHandle<()>>,
    last_step: Option<u64>,
    /// Rank 0: the newest step the stream held when it started ([`CommitJob::resumed_after`]).
    resumed_after: Option<u64>,
    last_outcome: Option<StepOutcome>,
    last_part: Option<PartReport>,
    /// The previous step's outcome and part, when the `publish` that resolved them failed
    /// after it: the next receipt carries them (they would be lost to its caller otherwise).
    unreported: Option<(Option<StepOutcome>, Option<PartReport>)>,
}

impl std::fmt::Debug for ShardedPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedPublisher").field("rank", &self.rank).field("world_size", &self.world_size).finish()
    }
}

/// `r<rank>-<nonce>-<name>`: the nonce is drawn by each process, so a restarted rank never
/// writes (or is taken for) its predecessor's objects of the same step.
fn part_name(rank: u64, nonce: u32, name: &str) -> String {
    format!("r{rank:05}-{nonce:08x}-{name}")
}

/// The rank of a part manifest named `g<gen>-r<rank>-<nonce>-part.json`.
fn part_rank(name: &str, generation: u64) -> Option<u64> {
    let rest = name.strip_prefix(&format!("g{generation}-r"))?.strip_suffix("-part.json")?;
    let (rank, nonce) = rest.split_once('-')?;
    let ok = rank.len() == 5
        && rank.bytes().all(|b| b.is_ascii_digit())
        && nonce.len() == 8
        && nonce.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase());
    ok.then(|| rank.parse().ok()).flatten()
}

impl PublisherBuilder {
    /// Builds rank `rank` of a sharded publisher whose steps have `world_size` parts (see
    /// [`ShardedPublisher`]). Rank 0 opens (or creates) the stream and commits; the others
    /// wait up to `commit_timeout` for the stream to exist. Every rank of a step must pass
    /// the same `world_size`; a data-parallel replica of a rank's slices is a rank of its own
    /// that passes no shards (or `replica > 0` shards in Python, which are skipped).
    pub fn build_sharded(self, rank: u64, world_size: u64, commit_timeout: Duration) -> Result<ShardedPublisher> {
        if world_size == 0 || world_size > MAX_WORLD_SIZE || rank >= world_size {
            return Err(Error::Refused(format!("rank {rank} of world size {world_size}")));
        }
        if commit_timeout > MAX_COMMIT_TIMEOUT {
            return Err(Error::Refused(format!(
                "commit timeout {commit_timeout:?} is longer than {MAX_COMMIT_TIMEOUT:?}"
            )));
        }
        let (rt, bucket) = self.start()?;
        let trust = self.trust();
        let reader = StreamReader::new(bucket.clone(), trust.clone());
        let mut resumed_after = None;
        let (stream_id, ctx) = if rank == 0 {
            let (ctx, last_delta, last_anchor) = self.context(&rt, &bucket, Some(world_size))?;
            resumed_after = last_delta.max(last_anchor);
            rt.spawn(upload::lease_loop(ctx.clone()));
            info!(
                stream_id = ctx.stream_id,
                generation = ctx.generation,
                world_size,
                "sharded publisher: committer ready"
            );
            (ctx.stream_id.clone(), Some(ctx))
        } else {
            let deadline = Instant::now() + commit_timeout;
            let id = rt.block_on(async {
                loop {
                    match reader.descriptor().await {
                        Ok(Some(d)) => return Ok(d.stream_id),
                        Ok(None) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(200)).await,
                        Ok(None) => {
                            return Err(Error::Waited(format!(
                                "no stream at {} after {commit_timeout:?}: rank 0 creates it",
                                bucket.url()
                            )))
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
            })?;
            (id, None)
        };
        Ok(ShardedPublisher {
            cfg: self,
            rt: Some(rt),
            bucket,
            trust,
            stream_id,
            rank,
            world_size,
            commit_timeout,
            generation: ctx.as_ref().map(|c| c.generation),
            ctx,
            committed: None,
            in_flight: None,
            spare: None,
            nonce: rand::random(),
            next_anchor: false,
            slices_next: false,
            schedule: Arc::default(),
            background: vec![],
            last_step: None,
            resumed_after,
            last_outcome: None,
            last_part: None,
            unreported: None,
        })
    }
}

impl ShardedPublisher {
    /// The stream id.
    pub fn stream_id(&self) -> &str {
        &self.stream_id
    }

    /// The group generation this rank publishes under (rank 0: its own).
    pub fn generation(&self) -> Option<u64> {
        self.generation
    }

    /// Publishes this rank's part of `step`; on rank 0, also commits the step (waiting up to
    /// `commit_timeout` for the other parts). Blocks for the previous step (its part sent, its
    /// outcome known: the part of this step is taken against the last committed one) and for
    /// one copy of `shards`; the diff, the encode, the upload and the commit run after it
    /// returns, so `shards` may change at once.
    pub fn publish(&mut self, step: u64, shards: &[Shard<'_>]) -> Result<ShardedReceipt> {
        let t0 = Instant::now();
        if let Some(last) = self.last_step {
            if step <= last {
                return Err(Error::StepOrder { step, last });
            }
        }
        // Refused input leaves the step in flight (and its outcome) for the next call.
        check_shards(shards)?;
        let (previous, previous_part) = match self.resolve()? {
            (None, None) => self.unreported.take().unwrap_or_default(),
            resolved => resolved,
        };
        match self.send(step, shards) {
            Ok((part, slices)) => {
                let blocked_secs = t0.elapsed().as_secs_f64();
                info!(
                    step,
                    rank = self.rank,
                    ?part,
                    slices,
                    secs = blocked_secs,
                    "slices copied; part sent in the background"
                );
                Ok(ShardedReceipt { step, part, slices, blocked_secs, previous, previous_part })
            }
            Err(e) => {
                // Finding the group failed (an outage, no committer): the previous step is
                // resolved, and its outcome goes with the next receipt.
                self.unreported = Some((previous, previous_part));
                Err(e)
            }
        }
    }

    /// Waits for the step in flight, as `publish` does first, keeping its outcome for the next
    /// receipt: a binding can wait here interruptibly, before `publish` reads the caller's
    /// memory.
    pub fn wait_previous(&mut self) -> Result<()> {
        let resolved = self.resolve()?;
        if resolved.0.is_some() || resolved.1.is_some() {
            self.unreported = Some(resolved);
        }
        Ok(())
    }

    /// Copies `shards` and starts the thread that builds, uploads and (rank 0) commits the
    /// part of `step`; returns its kind and whether it carries slices.
    fn send(&mut self, step: u64, shards: &[Shard<'_>]) -> Result<(PartKind, bool)> {
        let copy = Arc::new(copy_shards(step, shards, self.spare.take()));
        let rt = self.rt.as_ref().ok_or(Error::Closed)?;
        let g = match &self.ctx {
            Some(c) => c.generation,
            None => rt.block_on(group_generation(&self.bucket, self.world_size, self.commit_timeout))?,
        };
        if self.generation.is_some_and(|old| old != g) {
            // A new committer: whatever this rank knew was committed under another generation.
            info!(rank = self.rank, old = self.generation, new = g, "joined a new sharded publisher generation");
            self.next_anchor = true;
        }
        self.generation = Some(g);
        // A delta needs this rank's copy of the same slices at the committed base.
        let base = self.committed.clone().filter(|(c, _)| {
            c.shards.len() == copy.shards.len()
                && c.shards.iter().zip(&copy.shards).all(|(a, b)| a.0 == b.0 && a.1 == b.1)
        });
        // Scheduled anchors are the committer's call (`slices_next` of the last outcome):
        // the step stays a delta, and its slices travel with it for the anchor.
        let kind = match base {
            Some(_) if !self.next_anchor => PartKind::Delta,
            _ => PartKind::Anchor,
        };
        let slices = kind == PartKind::Anchor || self.slices_next;
        let job = PartJob {
            cfg: self.cfg.clone(),
            stream_id: self.stream_id.clone(),
            bucket: self.bucket.clone(),
            handle: rt.handle().clone(),
            who: Who { g, rank: self.rank, nonce: self.nonce, world_size: self.world_size },
            copy: copy.clone(),
            base: base.filter(|_| kind == PartKind::Delta),
            kind,
            slices,
            commit: self.ctx.clone().map(|ctx| CommitJob {
                ctx,
                trust: self.trust.clone(),
                world_size: self.world_size,
                timeout: self.commit_timeout,
                committed: self.committed.clone(),
                schedule: self.schedule.clone(),
                resumed_after: self.resumed_after,
            }),
        };
        let (tx, sent_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new().name("driftless-part".into()).spawn(move || job.run(tx, done_tx))?;
        self.in_flight = Some(InFlight { step, copy, sent_rx, sent: None, done_rx, thread });
        self.last_step = Some(step);
        Ok((kind, slices))
    }

    /// Waits until the step this rank published last is sent and its outcome known, and
    /// returns that outcome (an error when it was not committed). On rank 0 it also waits for
    /// an anchor being gathered after its delta was committed (whose failure is logged: the
    /// step itself is committed, and the next outcome asks for slices again).
    pub fn flush(&mut self) -> Result<StepOutcome> {
        self.resolve()?;
        // Returned here: the next receipt must not report it again.
        self.unreported = None;
        for h in self.background.drain(..) {
            let _ = h.join();
        }
        match self.last_outcome.clone() {
            Some(o) if o.committed => Ok(o),
            Some(o) => {
                Err(Error::Upload { step: o.step, detail: o.reason.unwrap_or_default(), retryable: o.retryable })
            }
            None => Err(Error::Refused("nothing published yet".into())),
        }
    }

    /// Flushes, then releases the committer's lease.
    pub fn close(mut self) -> Result<()> {
        let r = self.flush().map(|_| ());
        self.shutdown();
        r
    }

    /// The outcome of the last step this rank published, once known (after [`Self::flush`]
    /// or the next `publish`).
    pub fn last_outcome(&self) -> Option<&StepOutcome> {
        self.last_outcome.as_ref()
    }

    /// This rank's part of the last step it published, once sent (after [`Self::flush`]).
    pub fn last_part(&self) -> Option<&PartReport> {
        self.last_part.as_ref()
    }

    fn shutdown(&mut self) {
        // The step in flight uses the runtime: let it finish first (bounded by the commit
        // timeout and the store's timeouts).
        if let Some(f) = self.in_flight.take() {
            let _ = f.thread.join();
        }
        for h in self.background.drain(..) {
            let _ = h.join();
        }
        if let Some(rt) = self.rt.take() {
            if let Some(ctx) = &self.ctx {
                rt.block_on(upload::release_lease(ctx));
            }
            rt.shutdown_timeout(Duration::from_secs(5));
        }
    }

    /// Records an outcome: a committed step's slices become the base of the next delta, when
    /// the commit used this process's part (`sent`, its manifest's SHA-256).
    fn settle(&mut self, copy: Arc<Copy>, sent: Option<Digest>, o: &StepOutcome) {
        let mine = sent.is_some_and(|s| o.parts.get(self.rank as usize) == Some(&s));
        // The copy that is not kept as the base (the old base or this step's copy).
        let unused = if o.committed && !mine {
            warn!(
                step = o.step,
                rank = self.rank,
                "the step was committed with another part of this rank; next step is an anchor"
            );
            self.next_anchor = true;
            self.committed.take().map(|(c, _)| c)
        } else if o.committed {
            // (Set on a committed step when its outcome could not be written: the other
            // ranks send anchors next.)
            self.next_anchor = o.next_anchor;
            self.committed.replace((copy, o.root.unwrap_or_default())).map(|(c, _)| c)
        } else {
            warn!(step = o.step, rank = self.rank, reason = o.reason.as_deref().unwrap_or(""), "step not committed");
            self.next_anchor |= o.next_anchor;
            Some(copy)
        };
        self.slices_next = o.committed && o.slices_next;
        // The part is uploaded, so usually nothing else holds it (a store that keeps what was
        // uploaded, like `memory://`, may: then there is no spare).
        self.spare = unused.and_then(|c| Arc::try_unwrap(c).ok()).map(|c| c.data);
        self.last_outcome = Some(o.clone());
    }

    /// Waits until this rank's part of the step published last is built and uploaded, not
    /// for its commit, and returns its report (`None` when it could not be sent, or nothing
    /// is in flight: the step's outcome then says why).
    pub fn wait_sent(&mut self) -> Option<PartReport> {
        self.in_flight.as_mut().and_then(|f| f.sent().as_ref().ok().map(|(_, r)| r.clone()))
    }

    /// Waits for the step in flight: its part sent, then its outcome (rank 0 committed it
    /// itself; the other ranks read the committer's, also when their upload reported a
    /// failure). A rank adopts its copy as the base only when the outcome lists its part.
    fn resolve(&mut self) -> Result<(Option<StepOutcome>, Option<PartReport>)> {
        let Some(mut f) = self.in_flight.take() else { return Ok((None, None)) };
        let rt = self.rt.as_ref().ok_or(Error::Closed)?;
        let sent = f.sent().clone();
        // Rank 0: the outcome, sent once written; the thread may go on gathering an anchor.
        // The other ranks' threads end after the upload (and send nothing).
        let committed = f.done_rx.recv().ok();
        self.background.push(f.thread);
        let (done, running): (Vec<_>, Vec<_>) = self.background.drain(..).partition(|h| h.is_finished());
        self.background = running;
        for h in done {
            let _ = h.join();
        }
        let (o, sha, report) = match (sent, committed) {
            (Ok((sha, mut report)), Some((o, secs))) => {
                report.commit_secs = secs;
                (o, Some(sha), Some(report))
            }
            (sent, None) if self.ctx.is_none() => {
                // The committer's verdict, even when this rank's upload reported a failure
                // (a write that timed out may have landed, and the step be committed with it:
                // the part's digest, when it was built, still lets the copy be adopted).
                if let Err((_, e)) = &sent {
                    warn!(step = f.step, rank = self.rank, error = %e, "part not sent");
                }
                let g = self.generation.expect("published under a generation");
                // The committer waits `commit_timeout` for parts, then commits: allow for both.
                let deadline = Instant::now() + self.commit_timeout * 2 + Duration::from_secs(30);
                let o = rt.block_on(wait_outcome(
                    &self.bucket,
                    &self.trust,
                    &self.stream_id,
                    f.step,
                    g,
                    self.world_size,
                    deadline,
                ));
                let (sha, report) = match sent {
                    Ok((sha, report)) => (Some(sha), Some(report)),
                    Err((sha, _)) => (sha, None),
                };
                (o, sha, report)
            }
            (Ok((_, report)), None) => {
                let reason = format!("step {}: the committing thread panicked", f.step);
                (StepOutcome::aborted(f.step, reason, true), None, Some(report))
            }
            (Err((_, e)), _) => {
                warn!(step = f.step, rank = self.rank, error = %e, "part not sent");
                let reason = format!("rank {}'s part was not sent: {e}", self.rank);
                (StepOutcome::aborted(f.step, reason, true), None, None)
            }
        };
        self.settle(f.copy, sha, &o);
        self.last_part = report.clone();
        Ok((Some(o), report))
    }
}

impl Drop for ShardedPublisher {
    /// Dropped without [`ShardedPublisher::close`]: the step in flight is still finished (as
    /// before), and now its fate is said on stderr when it did not reach the bucket, as the
    /// single-process publisher's drop does (found in review: a failed last step was joined and
    /// forgotten, so a trainer that ended without `close` never learned its final weights were
    /// not published). Rank 0 knows the outcome; another rank knows only whether its part was
    /// sent (waiting for the committer's outcome could take minutes).
    fn drop(&mut self) {
        if self.rt.is_some() && !std::thread::panicking() {
            if let Some(reason) = self.dropped_unpublished() {
                tracing::error!(rank = self.rank, reason = %reason, "sharded publisher dropped without close");
                eprintln!("driftless: sharded publisher (rank {}) dropped without close(): {reason}", self.rank);
            }
        }
        self.shutdown();
    }
}

impl ShardedPublisher {
    /// What the drop of a publisher not closed must report: the last step not committed (rank
    /// 0) or this rank's last part not sent (other ranks); `None` when there is nothing to say.
    fn dropped_unpublished(&mut self) -> Option<String> {
        let not_committed = |o: &StepOutcome| {
            (!o.committed).then(|| {
                format!("step {} was NOT published: {}", o.step, o.reason.as_deref().unwrap_or("not committed"))
            })
        };
        // An outcome already known and never handed to the caller (a `publish` that failed
        // after resolving the step before it, or `wait_previous`), on any rank.
        let unreported = |p: &Self| p.unreported.as_ref().and_then(|(o, _)| o.as_ref()).and_then(not_committed);
        if self.ctx.is_none() {
            let Some(f) = self.in_flight.as_mut() else { return unreported(self) };
            let step = f.step;
            return f.sent().as_ref().err().map(|(_, e)| format!("this rank's part of step {step} was NOT sent: {e}"));
        }
        match self.resolve() {
            Ok((Some(o), _)) => not_committed(&o),
            Ok((None, _)) => unreported(self),
            Err(e) => Some(format!("the last step's outcome is unknown: {e}")),
        }
    }
}

/// Checks a rank's shards (names, slices, sizes) without copying them.
fn check_shards(shards: &[Shard<'_>]) -> Result<()> {
    let mut names = BTreeSet::new();
    for s in shards {
        driftless_format::validate_tensor_name(s.name)?;
        if !names.insert(s.name) {
            return Err(Error::Refused(format!("tensor {} is passed twice", s.name)));
        }
        // The fields are public: check them as the constructors do.
        Slice::new(&s.slice.shape, &s.slice.offsets, &s.slice.lengths)?;
        let n = driftless_format::numel(s.shape)?;
        if s.slice.shape != s.shape && s.slice.shape != [n] {
            return Err(driftless_format::Error::InvalidInput(format!(
                "the slice of {} is over shape {:?}, the tensor's is {:?}",
                s.name, s.slice.shape, s.shape
            ))
            .into());
        }
        let want = s.slice.numel().checked_mul(s.dtype.size() as u64);
        if want != Some(s.data.len() as u64) {
            return Err(driftless_format::Error::InvalidInput(format!(
                "shard of {} holds {} bytes; its slice needs {want:?}",
                s.name,
                s.data.len()
            ))
            .into());
        }
    }
    Ok(())
}

/// Copies a rank's shards, already checked by [`check_shards`] (whose sizes this relies on).
fn copy_shards(step: u64, shards: &[Shard<'_>], spare: Option<Vec<u8>>) -> Copy {
    let total = shards.iter().map(|s| s.data.len()).sum();
    // Every byte is overwritten below: a spare buffer of the same size needs no clearing.
    let mut data = spare.filter(|b| b.len() == total).unwrap_or_else(|| vec![0u8; total]);
    let mut out = Vec::with_capacity(shards.len());
    let mut pieces: Vec<(&mut [u8], &[u8])> = vec![];
    let (mut rest, mut at) = (data.as_mut_slice(), 0usize);
    for s in shards {
        let meta = TensorMeta { name: s.name.to_string(), dtype: s.dtype, shape: s.shape.to_vec() };
        out.push((meta, s.slice.clone(), at..at + s.data.len()));
        at += s.data.len();
        let (dst, tail) = std::mem::take(&mut rest).split_at_mut(s.data.len());
        rest = tail;
        // Pieces of 16 MiB: one large shard is copied on every core, not one.
        pieces.extend(dst.chunks_mut(16 << 20).zip(s.data.chunks(16 << 20)));
    }
    pieces.into_par_iter().for_each(|(d, s)| d.copy_from_slice(s));
    Copy { step, shards: out, data }
}

struct BuiltPart {
    /// (object name with generation, bytes); the part manifest last.
    objects: Vec<(String, Bytes)>,
    /// SHA-256 of the part manifest.
    sha: Digest,
}

/// Which process of which group writes a part.
#[derive(Clone, Copy)]
struct Who {
    g: u64,
    rank: u64,
    nonce: u32,
    world_size: u64,
}

/// Diffs a rank's slices (a delta part) and builds its objects and signed part manifest; with
/// `slices` (always for an anchor part) the slice bytes are one more object.
fn build_part(
    cfg: &PublisherBuilder,
    stream_id: &str,
    who: Who,
    copy: &Arc<Copy>,
    base: Option<&Committed>,
    kind: PartKind,
    slices: bool,
) -> Result<BuiltPart> {
    let Who { g, rank, nonce, world_size } = who;
    let name = |n: &str| layout::generation_name(g, &part_name(rank, nonce, n));
    // Runs of every shard: (shard index, byte offset in the tensor, offset in the slice data, length).
    let mut runs: Vec<(usize, u64, usize, usize)> = vec![];
    for (i, (m, sl, _)) in copy.shards.iter().enumerate() {
        let mut at = 0usize;
        for (start, len) in sl.byte_runs(m.dtype) {
            runs.push((i, start, at, len as usize));
            at += len as usize;
        }
    }
    let digests: Vec<PartDigest> = runs
        .par_iter()
        .map(|&(i, start, at, len)| {
            let (m, d) = (&copy.shards[i].0, copy.bytes(i));
            part_digest(m.nbytes()?, start, &d[at..at + len])
        })
        .collect::<driftless_format::Result<_>>()?;
    let mut edges = Vec::new();
    for d in &digests {
        edges.extend_from_slice(&d.head);
        edges.extend_from_slice(&d.tail);
    }
    let mut objects: Vec<(String, Bytes)> = vec![];
    let mut segments = vec![];
    let mut stats = DeltaStats::default();
    if kind == PartKind::Delta {
        {
            let (b, _) = base.expect("a delta part has a base");
            let delta_runs: Vec<Run<'_>> = runs
                .iter()
                .map(|&(i, start, at, len)| {
                    let (m, d) = (&copy.shards[i].0, copy.bytes(i));
                    Run {
                        name: &m.name,
                        dtype: m.dtype,
                        at: start / m.dtype.size() as u64,
                        base: Some(&b.bytes(i)[at..at + len]),
                        target: &d[at..at + len],
                    }
                })
                .collect();
            let enc = encode_runs(&delta_runs, &cfg.delta)?;
            stats = enc.stats;
            for (i, s) in enc.segments.into_iter().enumerate() {
                let n = name(&format!("seg-{i:04}.dls"));
                segments.push(SegmentRef {
                    object: ObjectRef { object: n.clone(), size: s.bytes.len() as u64, sha256: s.sha256 },
                    raw_size: s.raw_size,
                    entries: s.entries,
                });
                objects.push((n, Bytes::from(s.bytes)));
            }
        }
    }
    let slices = (slices || kind == PartKind::Anchor).then(|| {
        // The copy's own bytes, shared with the upload: no second copy of the slices.
        let all = Bytes::from_owner(CopyBytes(copy.clone()));
        let n = name("slices.bin");
        let r = ObjectRef { object: n.clone(), size: all.len() as u64, sha256: Digest::of(&all) };
        objects.push((n, all));
        r
    });
    let edges_ref = ObjectRef { object: name("edges.bin"), size: edges.len() as u64, sha256: Digest::of(&edges) };
    objects.push((edges_ref.object.clone(), Bytes::from(edges)));
    let mut di = digests.into_iter();
    let mut tensors: Vec<PartTensor> = copy
        .shards
        .iter()
        .map(|(m, sl, _)| PartTensor {
            name: m.name.clone(),
            dtype: m.dtype,
            shape: m.shape.clone(),
            offsets: sl.offsets.clone(),
            lengths: sl.lengths.clone(),
            runs: vec![],
        })
        .collect();
    for &(i, ..) in &runs {
        let d = di.next().expect("one digest per run");
        tensors[i].runs.push(PartRun {
            start: d.start,
            len: d.len,
            head: d.head.len() as u64,
            head_leaves: d.head_leaves,
            chunks: d.chunks,
            tail_leaves: d.tail_leaves,
            tail: d.tail.len() as u64,
        });
    }
    let m = PartManifest {
        kind: "part".into(),
        version: manifest::FORMAT_VERSION,
        stream_id: stream_id.to_string(),
        step: copy.step,
        generation: g,
        rank,
        world_size,
        part: kind,
        base_step: base.filter(|_| kind == PartKind::Delta).map(|(c, _)| c.step),
        base_root: base.filter(|_| kind == PartKind::Delta).map(|(_, r)| *r),
        tensors,
        segments,
        edges: edges_ref,
        slices,
        stats,
    };
    let env = cfg.seal(&serde_json::to_vec(&m).expect("part serializes"))?;
    let sha = Digest::of(&env);
    objects.push((name("part.json"), Bytes::from(env)));
    Ok(BuiltPart { objects, sha })
}

/// Write-once uploads of a part's objects, the part manifest last.
async fn upload_part(bucket: &Bucket, step: u64, part: &BuiltPart) -> Result<()> {
    // The same write-once puts as a step's own objects: this process's nonce is in every
    // name, so an existing object of the right size is a retried request of this process.
    let (manifest, payload) = part.objects.split_last().expect("a part has a manifest");
    let conc = bucket.options().concurrency.max(1);
    let put = |objects| upload::put_own(bucket, StepKind::Delta, step, objects, conc, None);
    let r = match put(payload).await {
        Ok(()) => put(std::slice::from_ref(manifest)).await,
        Err(e) => Err(e),
    };
    r.map_err(|e| match e {
        CommitError::Store(e) => Error::Store(e),
        CommitError::Conflict(detail) | CommitError::Claimed(detail) => Error::Conflict { step, detail },
        CommitError::Taken(detail) => Error::StepTaken { step, detail },
        CommitError::Unconfirmed(detail) => Error::Upload { step, detail, retryable: true },
    })
}

/// The generation of the newest lease, which must be a sharded committer's with this world
/// size; waits up to `timeout` for one (rank 0 may start later than this rank).
async fn group_generation(bucket: &Bucket, world_size: u64, timeout: Duration) -> Result<u64> {
    group_lease(bucket, world_size, timeout).await.map(|(g, _)| g)
}

/// [`group_generation`] and the lease read (to tell whether its committer is still renewing
/// it).
async fn group_lease(bucket: &Bucket, world_size: u64, timeout: Duration) -> Result<(u64, upload::Lease)> {
    let deadline = Instant::now() + timeout;
    loop {
        let newest = bucket
            .list(layout::leases_prefix())
            .await?
            .iter()
            .filter_map(|o| layout::parse_claim_or_lease(&o.key))
            .max();
        if let Some(g) = newest {
            let read = match bucket.get_limited(&layout::lease(g), 64 << 10).await {
                Ok(b) => serde_json::from_slice::<upload::Lease>(&b).ok(),
                // An outage is not "no committer": at the deadline it is the (retryable) error.
                Err(e) if e.is_retryable() && Instant::now() >= deadline => return Err(e.into()),
                Err(_) => None,
            };
            // A sharded committer that stopped cleanly (its lease released): a retry once rank 0
            // is back succeeds (found by review: it was refused as a conflict, "retrying will
            // not help").
            let stopped = read.as_ref().is_some_and(|l| l.ttl_ms == 0 && l.world_size.is_some());
            // A released lease (TTL 0) is a committer that stopped: wait for the next one
            // (joined, its part was never read and the step was lost; found by review).
            let lease = read.filter(|l| l.ttl_ms > 0);
            match lease.as_ref().and_then(|l| l.world_size) {
                Some(w) if w == world_size => return Ok((g, lease.expect("has a world size"))),
                // The lease of a group that crashed (an elastic restart with fewer ranks) until
                // this group's rank 0 takes its generation: waited out like no lease (it failed
                // at once, found by review), refused at the deadline.
                Some(w) if Instant::now() >= deadline => {
                    return Err(Error::Refused(format!(
                        "the stream's committer (generation {g}) expects {w} ranks, this rank was given {world_size}"
                    )))
                }
                Some(_) => {}
                None if stopped && Instant::now() >= deadline => {
                    return Err(Error::Waited(format!(
                        "the stream's sharded committer (generation {g}) stopped and no newer one started in time: \
                         retry once rank 0 is running"
                    )))
                }
                None if Instant::now() >= deadline => {
                    return Err(Error::Conflict {
                        step: 0,
                        detail: format!(
                        "the newest publisher generation {g} is not a live sharded committer (stopped, or not sharded)"
                    ),
                    })
                }
                None => {}
            }
        } else if Instant::now() >= deadline {
            return Err(Error::Waited(format!("no committer (rank 0) on the stream after {timeout:?}")));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn outcome_key(step: u64, g: u64) -> String {
    layout::object(StepKind::Delta, step, &layout::generation_name(g, "outcome.json"))
}

/// Bytes of a signed outcome of a group of `world_size` ranks: its fields, a reason, and one
/// part digest per rank (about 70 bytes each once signed). An outcome read with a fixed cap
/// could not list the parts of ~900 ranks: the other ranks then took every committed step as
/// lost and the group fell into an anchor-refusal cycle.
fn max_outcome_bytes(world_size: u64) -> u64 {
    (64 << 10) + 128 * world_size.min(MAX_WORLD_SIZE)
}

/// How long past its first deadline a rank keeps waiting for an outcome while the committer
/// renews its lease naming the step as the one it is committing. A committer that gathers and
/// encodes an anchor works as long as the model's bytes take to cross the bucket twice (tens
/// of minutes for a 70B model on a slow link): the other ranks must not take that step as
/// lost. Bounded, so that a bucket that fakes renewals cannot hold a rank forever.
const MAX_OUTCOME_WAIT: Duration = Duration::from_secs(6 * 3600);

/// Whether step `step` has a ready marker of either kind (a failed read counts as one: the
/// answer then asks for an anchor, which is always safe).
async fn has_marker(bucket: &Bucket, step: u64) -> bool {
    for kind in [StepKind::Delta, StepKind::Anchor] {
        match bucket.head(&layout::ready(kind, step)).await {
            Err(e) if e.is_not_found() => {}
            _ => return true,
        }
    }
    false
}

/// Polls for the committer's outcome of `step`. No outcome by `deadline` (moved on by the
/// window before it each time the committer's lease is seen renewed while it names `step` as
/// the step being committed, up to [`MAX_OUTCOME_WAIT`] past it), or a newer committer
/// generation, means "not committed, anchor next": the only safe reading, since this rank
/// cannot know which of its copies readers have. A committer that is alive but done with the
/// step (its outcome write failed, or it never committed it) stops naming it, so the ranks
/// give up within the first window, as before.
async fn wait_outcome(
    bucket: &Bucket,
    trust: &TrustSet,
    stream_id: &str,
    step: u64,
    g: u64,
    world_size: u64,
    mut deadline: Instant,
) -> StepOutcome {
    let key = outcome_key(step, g);
    let start = Instant::now();
    let mut window = deadline.saturating_duration_since(start);
    let cap = deadline + MAX_OUTCOME_WAIT;
    let mut wait = Duration::from_millis(50);
    let mut checked_lease = Instant::now();
    // The committer's last renewal seen (its own clock): a later one is a sign of life.
    let mut renewed: Option<u64> = None;
    // The outcome, once there; `Ok(None)` while not (yet); `Err(())` on a transient error (not
    // a sign that there is none).
    let read = || async {
        match bucket.get_limited(&key, max_outcome_bytes(world_size)).await {
            Ok(b) => {
                Ok(Some(match trust.open(&b).ok().and_then(|(p, _)| serde_json::from_slice::<BoundOutcome>(&p).ok()) {
                    Some(o) if o.outcome.step == step && o.stream_id == stream_id && o.generation == g => o.outcome,
                    _ => StepOutcome::aborted(
                        step,
                        format!("{key} is not a valid signed outcome of this step, stream and generation"),
                        true,
                    ),
                }))
            }
            Err(driftless_store::Error::TooLarge { size, max, .. }) => {
                let reason = format!("{key} is {size} bytes, more than an outcome of {world_size} ranks ({max})");
                Ok(Some(StepOutcome::aborted(step, reason, true)))
            }
            Err(e) if e.is_not_found() => Ok(None),
            Err(_) => Err(()),
        }
    };
    loop {
        if let Ok(Some(o)) = read().await {
            return o;
        }
        if Instant::now() >= deadline {
            let reason = format!("no outcome from the committer in time (its lease not renewed for {window:?})");
            return StepOutcome::aborted(step, reason, true);
        }
        if checked_lease.elapsed() > Duration::from_secs(2) {
            checked_lease = Instant::now();
            if let Ok((newer, lease)) = group_lease(bucket, world_size, Duration::ZERO).await {
                if newer != g {
                    return StepOutcome::aborted(step, format!("a new committer (generation {newer}) took over"), true);
                }
                // At work on a later step: it wrote this step's outcome before (read once
                // more: it may have landed since the read above), or never will (rank 0 did
                // not publish this step). Found by review: the other ranks waited out their
                // whole deadline, and their parts of the later step came too late for it.
                if let Some(later) = lease.committing.filter(|&s| s > step) {
                    match read().await {
                        Ok(Some(o)) => return o,
                        // Committed, and its outcome never written (the committer's write
                        // failed): which parts it used is not known, so the next step is an
                        // anchor, as the committer's is then (found by review: this rank kept
                        // its older base while rank 0 built on this step, and the next step
                        // was refused for their bases).
                        Ok(None) if has_marker(bucket, step).await => {
                            return StepOutcome::aborted(
                                step,
                                format!(
                                    "step {step} has a ready marker but the committer wrote no outcome for it: whether \
                                     this rank's part is in it is not known, so the next step is an anchor"
                                ),
                                true,
                            )
                        }
                        // No anchor asked for: this rank's base is still the last committed
                        // step, the one rank 0 builds its next part against too.
                        Ok(None) => {
                            return StepOutcome::aborted(
                                step,
                                format!("the committer went on to step {later} without committing this one"),
                                false,
                            )
                        }
                        // Unreadable (an outage), not absent: wait on (found by review: taken
                        // for "not committed", this rank kept its older base while rank 0's
                        // next part built on this step, and the next step was refused). Out
                        // of time, the anchor asked for is the safe answer.
                        Err(()) => {}
                    }
                }
                // The window holds two renewals of the committer's lease (every TTL/4: one
                // may fail, or land late) and a check after them: found by review, with a
                // 10 min TTL and a short commit timeout the ranks never saw two renewals in
                // it, never waited on, and gave up on anchor steps the committer did commit.
                // A dead committer's lease holds its TTL anyway, so the ranks wait at most
                // TTL/2 more.
                let period = Duration::from_millis(lease.ttl_ms).min(layout::MAX_LEASE_TTL) / 2;
                if period + Duration::from_secs(5) > window {
                    window = period + Duration::from_secs(5);
                    deadline = deadline.max((start + window).min(cap));
                }
                // Still at work on this step (an anchor's gather and encode): wait on.
                if renewed.is_some_and(|r| lease.renewed_at_ms > r) && lease.committing == Some(step) {
                    deadline = (Instant::now() + window).min(cap).max(deadline);
                }
                renewed = renewed.max(Some(lease.renewed_at_ms));
            }
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_millis(500));
    }
}

/// The committer: waits for every part, checks and assembles them, commits the step, and
/// writes the outcome. Never errors: every failure is an outcome the ranks read. Returns the
/// anchor to gather next when the step was committed as a delta with every rank's slices,
/// and the refused steps whose parts to remove once the outcome is handed over.
async fn commit(
    cfg: &PublisherBuilder,
    c: &CommitJob,
    (step, world_size, timeout): (u64, u64, Duration),
) -> (StepOutcome, Option<LaterAnchor>, Vec<u64>) {
    let ctx = &c.ctx;
    ctx.shared.update(|s| s.committing = Some(step));
    let job = (step, world_size, timeout);
    let mut unmarked = false;
    let (mut outcome, later) =
        match try_commit(cfg, ctx, &c.trust, job, &c.committed, &c.schedule, c.resumed_after).await {
            // A step the stream held before this committer started, committed with these weights
            // by an earlier generation: this generation's parts of it serve no reader (swept, as
            // a refused step's are).
            Ok(r) if c.resumed_after.is_some_and(|n| step <= n) => {
                unmarked = true;
                r
            }
            Ok(r) => r,
            Err(r) => {
                unmarked = r.unmarked;
                (StepOutcome { retryable: r.retryable, ..StepOutcome::aborted(step, r.reason, r.next_anchor) }, None)
            }
        };
    let (later, dropped) = {
        let mut s = c.schedule.lock().unwrap_or_else(|e| e.into_inner());
        if outcome.of == Some(StepKind::Anchor) {
            s.last = Some(step);
        }
        // Slices are only asked for while no anchor is being gathered; those of a step that
        // came in while one was are not gathered (removed below).
        let (later, dropped) = match later {
            Some(mut l) if s.busy.is_none() => {
                l.previous = s.last.replace(step);
                s.busy = Some(step);
                (Some(l), None)
            }
            l => (None, l),
        };
        outcome.slices_next = outcome.committed
            && s.busy.is_none()
            && (s.unreadable || s.last.is_none_or(|a| step.saturating_add(1) >= a.saturating_add(cfg.anchor_every)));
        (later, dropped)
    };
    if !write_outcome(cfg, ctx, &outcome).await {
        // The other ranks take the step as not committed with their parts, so they send
        // anchors next: so does this one (found by review: it sent a delta on this step,
        // the kinds disagreed, and the next step was lost too).
        outcome.next_anchor = true;
    }
    ctx.shared.update(|s| s.committing = None);
    // Removed after the outcome (by the caller, once it handed the outcome over): the ranks
    // go on at once (a rank never publishes a step again, and a restarted one names its parts
    // anew, so nothing is written under these names after it). The step refused before is
    // swept once more: a late rank's part of it has landed by now, unless the rank is more
    // than a step late (then GC removes it once the generation's lease lapses).
    let before = {
        let mut s = c.schedule.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::replace(&mut s.refused, unmarked.then_some(step))
    };
    let sweep: Vec<u64> = before.into_iter().chain(unmarked.then_some(step)).collect();
    if let Some(d) = dropped {
        info!(step, "an anchor is being gathered; this step's slices are not: removed");
        remove_slices(ctx, &d.anchor).await;
    }
    if outcome.committed {
        info!(step, of = ?outcome.of, "sharded step committed");
    } else {
        warn!(step, reason = outcome.reason.as_deref().unwrap_or(""), "sharded step not committed");
    }
    (outcome, later, sweep)
}

/// Removes this generation's objects of refused step `step` but its outcome (the ranks'
/// parts: an anchor step's carry a model's worth of slices). GC keeps an unmarked step of a
/// live generation (an upload may be in progress), so left there they stayed for the
/// group's whole life. Best effort, within [`upload::CLEANUP_BUDGET`] (an outage must not
/// hold the committer's next step): a part that lands after the listing (a rank later than
/// the commit timeout), and what the budget did not cover, are left for GC once the
/// generation's lease lapses.
async fn remove_refused(ctx: &Ctx, step: u64) {
    let outcome = outcome_key(step, ctx.generation);
    // One budget for the listing and the removal together (the removal's own bound, and
    // one warning, not two, when it runs out).
    let start = Instant::now();
    let listed = match tokio::time::timeout(upload::CLEANUP_BUDGET, ctx.bucket.list(&layout::delta_dir(step))).await {
        Ok(Ok(l)) => l,
        Ok(Err(e)) => {
            warn!(step, error = %e, "could not list the refused step's parts to remove them; GC removes them later");
            return;
        }
        Err(_) => {
            warn!(step, "listing the refused step's parts took too long; GC removes them later");
            return;
        }
    };
    let keys: Vec<String> = listed
        .into_iter()
        .filter(|o| {
            o.key != outcome
                && layout::parse_step_key(&o.key)
                    .and_then(|(_, _, n)| n)
                    .is_some_and(|n| layout::name_generation(&n) == Some(ctx.generation))
        })
        .map(|o| o.key)
        .collect();
    if !keys.is_empty() {
        info!(step, objects = keys.len(), "removing the refused step's parts");
        let budget = upload::CLEANUP_BUDGET.saturating_sub(start.elapsed());
        if !upload::delete_within(&ctx.bucket, keys, budget).await {
            warn!(step, "removing the refused step's parts took too long; GC removes the rest later");
        }
    }
}

/// Writes the committer's signed verdict on a step (write-once).
/// Writes the signed outcome of a step, bound to its stream and generation; whether it was
/// written.
async fn write_outcome(cfg: &PublisherBuilder, ctx: &Ctx, outcome: &StepOutcome) -> bool {
    let step = outcome.step;
    let bound = BoundOutcome { stream_id: ctx.stream_id.clone(), generation: ctx.generation, outcome: outcome.clone() };
    let payload = serde_json::to_vec(&bound).expect("outcome serializes");
    match cfg.seal(&payload) {
        Ok(env) => match ctx.bucket.put_create(&outcome_key(step, ctx.generation), Bytes::from(env)).await {
            Ok(()) => true,
            Err(e) => {
                // The ranks then find no outcome: "not committed, anchor next".
                warn!(step, error = %e, "could not write the step's outcome");
                false
            }
        },
        Err(e) => {
            warn!(step, error = %e, "could not seal the step's outcome");
            false
        }
    }
}

/// What an outcome object holds: the outcome, bound to the stream and the committer
/// generation it is of (found by review: a signed outcome of another stream signed with the
/// same key, or of an earlier generation, copied under this step, was taken as this step's).
#[derive(Serialize, Deserialize)]
struct BoundOutcome {
    stream_id: String,
    generation: u64,
    #[serde(flatten)]
    outcome: StepOutcome,
}

/// Why the committer did not commit a step.
#[derive(Debug)]
struct Refusal {
    reason: String,
    /// The next step must be an anchor (a part was missing or disagreed).
    next_anchor: bool,
    /// Publishing again may commit: a part late, missing or disagreeing this step, an outage.
    /// Not for what every later step repeats (parts overlapping, ranks disagreeing on a
    /// tensor's dtype or shape, a size cap, a newer committer): reported as retryable, the
    /// trainer's retries went on for ever (found by review).
    retryable: bool,
    /// No marker of the step can exist (refused before its commit sent one): the parts of
    /// this generation under the step serve no reader, and are removed.
    unmarked: bool,
}

impl From<(String, bool)> for Refusal {
    /// (reason, next anchor): a refusal that asks for an anchor is one of this step's parts
    /// (retryable); one that does not is of the parts' geometry or sizes, which the next
    /// step repeats (not retryable).
    fn from((reason, next_anchor): (String, bool)) -> Self {
        Refusal { reason, next_anchor, retryable: next_anchor, unmarked: true }
    }
}

async fn try_commit(
    cfg: &PublisherBuilder,
    ctx: &Arc<Ctx>,
    trust: &TrustSet,
    (step, world_size, timeout): (u64, u64, Duration),
    committed: &Option<Committed>,
    schedule: &std::sync::Mutex<AnchorSchedule>,
    resumed_after: Option<u64>,
) -> std::result::Result<(StepOutcome, Option<LaterAnchor>), Refusal> {
    let g = ctx.generation;
    let bucket = &ctx.bucket;
    let store = |e: driftless_store::Error| (format!("bucket: {e}"), true);
    // 1. Every rank's part manifest.
    let deadline = Instant::now() + timeout;
    let mut wait = Duration::from_millis(50);
    let names: BTreeMap<u64, String> = loop {
        let listed = match bucket.list(&layout::delta_dir(step)).await {
            Ok(l) => l,
            // An outage past the store's own retries, with time left: listed again (found by
            // review: one failed listing refused the step, and the next one was an anchor).
            Err(e) if e.is_retryable() && Instant::now() + wait < deadline => {
                warn!(step, error = %e, "listing the step's parts failed; listing again");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_millis(500));
                continue;
            }
            Err(e) => return Err(store(e).into()),
        };
        let mut found: BTreeMap<u64, String> = BTreeMap::new();
        for o in &listed {
            let Some((_, _, Some(n))) = layout::parse_step_key(&o.key) else { continue };
            let Some(r) = part_rank(&n, g).filter(|&r| r < world_size) else { continue };
            if let Some(other) = found.insert(r, n.clone()) {
                // A restarted rank next to its predecessor's part: which is current is not
                // knowable, so neither is used. The same two processes at two steps in a row
                // are two processes given one rank: every later step repeats it (found by
                // review: reported as retryable for ever).
                let mut pair = [other.clone(), n.clone()];
                pair.sort();
                let mut sched = schedule.lock().unwrap_or_else(|e| e.into_inner());
                let again = sched.twice.as_ref().is_some_and(|(rr, p)| *rr == r && *p == pair);
                sched.twice = Some((r, pair));
                drop(sched);
                if again {
                    return Err(Refusal {
                        reason: format!(
                            "step {step}: rank {r} has two parts ({other}, {n}), from the same two processes as the step before: two processes publish as rank {r}; not committed"
                        ),
                        next_anchor: true,
                        retryable: false,
                        unmarked: true,
                    });
                }
                return Err(Refusal::from((
                    format!("step {step}: rank {r} has two parts ({other}, {n}); not committed"),
                    true,
                )));
            }
        }
        if found.len() as u64 == world_size {
            break found;
        }
        if Instant::now() >= deadline {
            let missing: Vec<u64> = (0..world_size).filter(|r| !found.contains_key(r)).collect();
            return Err(Refusal::from((
                format!("step {step}: no part from ranks {missing:?} in time; not committed"),
                true,
            )));
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_millis(500));
    };
    let mut parts = Vec::with_capacity(names.len());
    let mut shas = Vec::with_capacity(names.len());
    let mut total = 0u64;
    // Fetched several at a time, taken in rank order (a group of 1,024 ranks read one by one
    // costs a thousand round trips per step). In flight beyond the bound: at most as many
    // manifests as the bound itself holds at their largest, so the memory stays within twice it.
    let conc = bucket.options().concurrency.max(1);
    let in_flight = conc.min((MAX_PARTS_BYTES / manifest::MAX_MANIFEST_BYTES as u64).max(1) as usize);
    let mut fetched = futures::stream::iter(&names)
        .map(|(&r, n)| async move {
            let key = layout::object(StepKind::Delta, step, n);
            (r, n, bucket.get_limited(&key, manifest::MAX_MANIFEST_BYTES as u64).await)
        })
        .buffered(in_flight);
    while let Some((r, n, b)) = fetched.next().await {
        let b = b.map_err(store)?;
        total += b.len() as u64;
        if total > MAX_PARTS_BYTES {
            return Err(Refusal::from((
                format!("step {step}: part manifests exceed {MAX_PARTS_BYTES} bytes together"),
                false,
            )));
        }
        let bad = |d: String| Refusal::from((format!("step {step}: part of rank {r}: {d}"), true));
        let (payload, _) = trust.open(&b).map_err(|e| bad(e.to_string()))?;
        let p: PartManifest = serde_json::from_slice(&payload).map_err(|e| bad(e.to_string()))?;
        if p.kind != "part"
            || p.version != manifest::FORMAT_VERSION
            || p.stream_id != ctx.stream_id
            || p.step != step
            || p.generation != g
            || p.rank != r
            || p.world_size != world_size
        {
            return Err(bad("names another stream, step, generation or rank".into()));
        }
        // A part names only its own objects (a rank cannot make readers fetch another's).
        let own = n.strip_suffix("part.json").expect("a part manifest name");
        let names = p
            .segments
            .iter()
            .map(|s| &s.object.object)
            .chain([&p.edges.object])
            .chain(p.slices.as_ref().map(|s| &s.object));
        if let Some(n) = names.into_iter().find(|n| !n.starts_with(own)) {
            return Err(bad(format!("names object {n}, which is not its own")));
        }
        check_part(&p).map_err(bad)?;
        shas.push(Digest::of(&b));
        parts.push(p);
    }
    // 2. One kind and one base for all parts.
    let kind = parts[0].part;
    if parts.iter().any(|p| p.part != kind) {
        return Err(Refusal::from((
            format!("step {step}: some ranks sent deltas, others anchors; the next step is an anchor"),
            true,
        )));
    }
    let base = match kind {
        PartKind::Delta => {
            let Some((c, root)) = committed else {
                return Err(Refusal::from((format!("step {step}: delta parts but no committed base"), true)));
            };
            if parts.iter().any(|p| p.base_step != Some(c.step) || p.base_root != Some(*root)) {
                return Err(Refusal::from((format!("step {step}: parts were taken against different bases"), true)));
            }
            Some((c.step, *root))
        }
        PartKind::Anchor => None,
    };
    // 3. Edges, then every tensor's chunk digests from all parts.
    let edges: u64 = parts.iter().fold(0u64, |a, p| a.saturating_add(p.edges.size));
    if edges > MAX_EDGE_BYTES {
        return Err(Refusal::from((
            format!("step {step}: parts send {edges} edge bytes, over the committer's {MAX_EDGE_BYTES} (column-sharded tensors send all their bytes: shard them by rows)"),
            false,
        )));
    }
    let mut per_tensor: BTreeMap<String, (DType, Vec<u64>, Vec<PartDigest>)> = BTreeMap::new();
    // Bounded together above; fetched `conc` at a time, taken in rank order.
    let mut fetched = futures::stream::iter(&parts)
        .map(|p| async move {
            let e = &p.edges;
            (p, ctx.reader.object(StepKind::Delta, step, &e.object, e.size, e.sha256).await)
        })
        .buffered(conc);
    while let Some((p, bytes)) = fetched.next().await {
        let bytes = bytes.map_err(|x| (format!("step {step}: edges of rank {}: {x}", p.rank), true))?;
        let mut at = 0usize;
        let mut take = |n: u64| -> std::result::Result<Vec<u8>, Refusal> {
            let end = usize::try_from(n).ok().and_then(|n| at.checked_add(n)).filter(|&x| x <= bytes.len());
            let end = end.ok_or_else(|| (format!("step {step}: edges of rank {} are short", p.rank), false))?;
            let v = bytes[at..end].to_vec();
            at = end;
            Ok(v)
        };
        for t in &p.tensors {
            let entry = per_tensor.entry(t.name.clone()).or_insert_with(|| (t.dtype, t.shape.clone(), vec![]));
            if entry.0 != t.dtype || entry.1 != t.shape {
                return Err(Refusal::from((
                    format!("step {step}: ranks disagree on the dtype or shape of {}", t.name),
                    false,
                )));
            }
            for run in &t.runs {
                let head = take(run.head)?;
                let tail = take(run.tail)?;
                entry.2.push(PartDigest {
                    start: run.start,
                    len: run.len,
                    head,
                    head_leaves: run.head_leaves.clone(),
                    chunks: run.chunks.clone(),
                    tail_leaves: run.tail_leaves.clone(),
                    tail,
                });
            }
        }
        if at != bytes.len() {
            return Err(Refusal::from((
                format!("step {step}: edges of rank {} are longer than its runs", p.rank),
                false,
            )));
        }
    }
    drop(fetched);
    let mut metas = vec![];
    let mut digests: BTreeMap<String, Digest> = BTreeMap::new();
    for (name, (dtype, shape, pd)) in &per_tensor {
        let meta = TensorMeta { name: name.clone(), dtype: *dtype, shape: shape.clone() };
        meta.validate().map_err(|e| (format!("step {step}: {e}"), false))?;
        let len = meta.nbytes().map_err(|e| (format!("step {step}: {e}"), false))?;
        let chunks = assemble(len, pd).map_err(|e| (format!("step {step}: tensor {name}: {e}"), false))?;
        digests.insert(name.clone(), finish_tensor(name, *dtype, shape, len, &chunks));
        metas.push(meta);
    }
    let root = combine_root(digests.iter().map(|(n, d)| (n.as_str(), *d)));
    let layout = Layout::for_tensors(&metas, cfg.max_shard_bytes).map_err(|e| (format!("step {step}: {e}"), false))?;
    let ordered: Vec<Digest> = layout.tensors().map(|m| digests[&m.name]).collect();
    let shards = manifest::shard_records(&layout, &ordered).map_err(|e| (format!("step {step}: {e}"), false))?;
    let a = AnchorParts { step, parts, layout, digests: ordered, root };
    // A step at or before the newest the stream held when this committer started (a group
    // restarted from an older checkpoint): committed already with these very weights, it is
    // this step again (the ranks adopt their copies, as the single-process publisher's
    // `republish` does); otherwise no publish of it can commit. Found by review: every such
    // step was gathered and encoded as an anchor (minutes for a large model) before its
    // claim was found taken, and refused as retryable, up to the stream's newest step.
    if resumed_after.is_some_and(|n| step <= n) {
        let newest = resumed_after.unwrap_or_default();
        let refused = |why: String| Refusal { reason: why, next_anchor: true, retryable: false, unmarked: true };
        return match ctx.committed_kind(step, root).await {
            Ok(Some(kind)) => {
                info!(step, "step is already published with these weights");
                Ok((committed_outcome(step, kind, root, shas), None))
            }
            Ok(None) => Err(refused(format!(
                "step {step} is not after step {newest}, the newest this stream held when this committer started; publish a later step"
            ))),
            Err(upload::CommitError::Conflict(why)) => Err(refused(format!("step {step}: {why}; publish a later step"))),
            Err(e) => Err(Refusal { reason: format!("step {step}: {e}"), next_anchor: true, retryable: true, unmarked: true }),
        };
    }
    // 4. Commit.
    let done = match base {
        Some((base_step, base_root)) => {
            let mut stats = DeltaStats::default();
            let mut segments = vec![];
            for p in &a.parts {
                // Saturating: the numbers come from other processes through the bucket.
                let s = &p.stats;
                stats.elements = stats.elements.saturating_add(s.elements);
                stats.dense_bytes = stats.dense_bytes.saturating_add(s.dense_bytes);
                stats.changed = stats.changed.saturating_add(s.changed);
                stats.dense_chunks = stats.dense_chunks.saturating_add(s.dense_chunks);
                stats.new_tensors = stats.new_tensors.saturating_add(s.new_tensors);
                stats.removed_tensors = stats.removed_tensors.saturating_add(s.removed_tensors);
                stats.payload_bytes = stats.payload_bytes.saturating_add(s.payload_bytes);
                segments.extend(p.segments.iter().cloned());
            }
            let m = DeltaManifest {
                kind: "delta".into(),
                version: manifest::FORMAT_VERSION,
                stream_id: ctx.stream_id.clone(),
                step,
                base_step,
                base_root,
                result_root: root,
                value_mode: cfg.delta.values,
                codec: cfg.delta.codec,
                shards,
                segments,
                stats,
                created_at_ms: manifest::now_ms(),
            };
            // What every reader checks, checked before sealing: a step that readers refuse is
            // a lost step (found by review: ranks holding tensors split along a later dimension
            // into runs of a few elements send one entry per run, and a delta of millions of
            // entries is over what a reader holds decoded). Such a step is committed whole as
            // an anchor when the ranks sent their slices, and otherwise refused with the next
            // step an anchor.
            let valid = m.validate();
            schedule.lock().unwrap_or_else(|e| e.into_inner()).unreadable = valid.is_err();
            if let Err(e) = valid {
                if !a.parts.iter().all(|p| p.slices.is_some()) {
                    return Err(Refusal::from((format!("step {step}: {e}; the next step is an anchor"), true)));
                }
                warn!(step, "{e}: this step is committed as an anchor instead");
                commit_anchor(cfg, ctx, &a).await?;
                // The parts' delta objects are no committed step's: removed, as slices are.
                delete_all(&ctx.bucket, delta_keys(&a)).await;
                return Ok((committed_outcome(step, StepKind::Anchor, root, shas), None));
            }
            let env =
                cfg.seal(&serde_json::to_vec(&m).expect("manifest serializes")).map_err(|e| (e.to_string(), true))?;
            let uploaded: Vec<(String, u64)> =
                m.segments.iter().map(|s| (s.object.object.clone(), s.object.size)).collect();
            let c = Commit {
                kind: StepKind::Delta,
                step,
                base_step: Some(base_step),
                root,
                envelope: env.into(),
                objects: &[],
                attempt: 0,
                uploaded: &uploaded,
            };
            commit_step_unmarked(ctx, c).await.map_err(|(e, unmarked)| commit_refusal(step, e, unmarked))?;
            ctx.write_latest(Some(step), None).await;
            StepKind::Delta
        }
        None => {
            commit_anchor(cfg, ctx, &a).await?;
            StepKind::Anchor
        }
    };
    // A delta step with every rank's slices: its anchor is gathered after the outcome.
    let later = match done {
        StepKind::Delta if a.parts.iter().all(|p| p.slices.is_some()) => {
            Some(LaterAnchor { anchor: a, previous: None })
        }
        StepKind::Delta if a.parts.iter().any(|p| p.slices.is_some()) => {
            warn!(step, "only some parts carry slices; no anchor of this step");
            // In the background: the outcome the ranks wait for does not wait for the deletes.
            let keys = slice_keys(&a);
            let bucket = ctx.bucket.clone();
            tokio::spawn(async move { delete_all(&bucket, keys).await });
            None
        }
        _ => None,
    };
    Ok((committed_outcome(step, done, root, shas), later))
}

fn committed_outcome(step: u64, of: StepKind, root: Digest, parts: Vec<Digest>) -> StepOutcome {
    StepOutcome {
        step,
        committed: true,
        of: Some(of),
        root: Some(root),
        reason: None,
        next_anchor: false,
        parts,
        slices_next: false,
        retryable: true,
    }
}

/// Gathers an anchor from the ranks' slices, commits it, and removes the slices.
async fn commit_anchor(cfg: &PublisherBuilder, ctx: &Ctx, a: &AnchorParts) -> std::result::Result<(), Refusal> {
    let (step, root) = (a.step, a.root);
    let job = gather_anchor(cfg, ctx, a).await?;
    let c = Commit {
        kind: StepKind::Anchor,
        step,
        base_step: None,
        root,
        envelope: job.envelope.clone(),
        objects: &job.objects,
        attempt: job.attempt,
        uploaded: &[],
    };
    commit_step_unmarked(ctx, c).await.map_err(|(e, unmarked)| commit_refusal(step, e, unmarked))?;
    ctx.write_latest(None, Some(step)).await;
    remove_slices(ctx, a).await;
    Ok(())
}

/// Deletes the ranks' slice objects of a step (best effort): once its anchor is committed, or
/// given up on while its delta is committed, they serve nothing, and GC would only remove
/// them with the step (a model's worth per attempt, kept for the whole retention).
async fn remove_slices(ctx: &Ctx, a: &AnchorParts) {
    delete_all(&ctx.bucket, slice_keys(a)).await;
}

/// The keys of the ranks' delta segment and edge objects of a step.
fn delta_keys(a: &AnchorParts) -> Vec<String> {
    let names = a.parts.iter().flat_map(|p| p.segments.iter().map(|s| &s.object).chain([&p.edges]));
    names.map(|o| layout::object(StepKind::Delta, a.step, &o.object)).collect()
}

/// The keys of the ranks' slice objects of a step.
fn slice_keys(a: &AnchorParts) -> Vec<String> {
    a.parts
        .iter()
        .filter_map(|p| p.slices.as_ref())
        .map(|s| layout::object(StepKind::Delta, a.step, &s.object))
        .collect()
}

/// Bounds on what a part declares, checked before anything it names is fetched: every run
/// lies inside its tensor and is split as `slice::split` splits it (so its edge bytes are
/// under a leaf at each end), the runs of a tensor hold no more than its bytes, and the edges
/// and slices objects are exactly as long as the runs say. Memory for the edges is then
/// bounded by the tensors' sizes.
fn check_part(p: &PartManifest) -> std::result::Result<(), String> {
    let mut edges = 0u64;
    let mut held = 0u64;
    for t in &p.tensors {
        let meta = TensorMeta { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone() };
        meta.validate().map_err(|e| e.to_string())?;
        let len = meta.nbytes().map_err(|e| e.to_string())?;
        let mut in_tensor = 0u64;
        for r in &t.runs {
            let Some(end) = r.start.checked_add(r.len).filter(|&e| e <= len) else {
                return Err(format!("run {}+{} of {} is not a part of the tensor", r.start, r.len, t.name));
            };
            let want = driftless_format::slice::split(len, r.start, end);
            let got = driftless_format::slice::Split {
                head: r.head,
                head_leaves: r.head_leaves.len() as u64,
                chunks: r.chunks.len() as u64,
                tail_leaves: r.tail_leaves.len() as u64,
                tail: r.tail,
            };
            if want != got {
                return Err(format!(
                    "run {}+{} of {} is not split at leaf and chunk boundaries",
                    r.start, r.len, t.name
                ));
            }
            edges += r.head + r.tail;
            in_tensor += r.len;
            if in_tensor > len {
                return Err(format!("runs of {} hold more than the tensor's {len} bytes", t.name));
            }
        }
        held += in_tensor;
    }
    if p.edges.size != edges {
        return Err(format!("edges object of {} bytes, runs say {edges}", p.edges.size));
    }
    if p.slices.as_ref().is_some_and(|s| s.size != held) {
        return Err(format!("slices object does not hold the {held} bytes of its runs"));
    }
    Ok(())
}

fn commit_refusal(step: u64, e: CommitError, unmarked: bool) -> Refusal {
    let retryable = match &e {
        CommitError::Store(e) => e.is_retryable(),
        // A newer committer took the stream, or the step's objects conflict: publishing again
        // cannot help.
        CommitError::Conflict(_) => false,
        // An older generation (most often this group's killed committer, its lease live or
        // run out) claimed this step with other weights: this step is lost, the next commits
        // (found by review: reported as not retryable, a trainer following the docs stopped).
        CommitError::Taken(_) | CommitError::Claimed(_) => true,
        CommitError::Unconfirmed(_) => true,
    };
    Refusal { reason: format!("step {step}: commit failed: {e}"), next_anchor: true, retryable, unmarked }
}

/// Builds the anchor of an anchor step from the ranks' slice objects: the safetensors files
/// are created in a spool directory, every slice is scattered into place window by window
/// (bounded memory, each object's SHA-256 checked as it streams), and the files are hashed
/// against the root the parts' digests gave before the anchor is encoded.
async fn gather_anchor(
    cfg: &PublisherBuilder,
    ctx: &Ctx,
    a: &AnchorParts,
) -> std::result::Result<upload::AnchorJob, Refusal> {
    let AnchorParts { step, parts, layout, digests, root } = a;
    let (step, root) = (*step, *root);
    use sha2::Digest as _;
    let local = |e: String| Refusal::from((format!("step {step}: gathering the anchor: {e}"), true));
    let dir = spool_dir(cfg).map_err(|e| local(e.to_string()))?;
    let files = dir.path().join("files");
    let mut ck = CheckpointMut::create(&files, layout).map_err(|e| local(e.to_string()))?;
    {
        let tm = ck.tensors_mut();
        for p in parts {
            let Some(obj) = &p.slices else {
                return Err(Refusal::from((
                    format!("step {step}: anchor part of rank {} has no slices", p.rank),
                    true,
                )));
            };
            // (offset in the object, tensor, byte offset in the tensor, length), in object order.
            let mut pieces = vec![];
            let mut at = 0u64;
            for t in &p.tensors {
                for r in &t.runs {
                    pieces.push((at, t.name.as_str(), r.start, r.len));
                    at = at.saturating_add(r.len);
                }
            }
            if at != obj.size {
                return Err(Refusal::from((
                    format!("step {step}: slices of rank {} do not match its runs", p.rank),
                    true,
                )));
            }
            let key = layout::object(StepKind::Delta, step, &obj.object);
            let mut sha = sha2::Sha256::new();
            let mut next = 0usize;
            let mut w = 0u64;
            while w < obj.size {
                let end = (w + GATHER_WINDOW).min(obj.size);
                let b = ctx.bucket.get_range_of(&key, w..end).await.map_err(|e| (format!("bucket: {e}"), true))?;
                if b.len() as u64 != end - w {
                    return Err(Refusal::from((format!("step {step}: {key} is shorter than its part says"), true)));
                }
                sha.update(&b);
                // Pieces overlapping [w, end).
                while next < pieces.len() {
                    let (o, name, start, len) = pieces[next];
                    let (s, e) = (o.max(w), (o + len).min(end));
                    if s < e {
                        let src = &b[(s - w) as usize..(e - w) as usize];
                        tm.with_range_mut(name, start + (s - o), e - s, |dst| dst.copy_from_slice(src))
                            .map_err(|e| local(e.to_string()))?;
                    }
                    if o + len > end {
                        break;
                    }
                    next += 1;
                }
                w = end;
            }
            if Digest(sha.finalize().into()) != obj.sha256 {
                return Err(Refusal::from((format!("step {step}: {key} does not match its part's SHA-256"), true)));
            }
        }
    }
    ck.flush().map_err(|e| local(e.to_string()))?;
    let (_, got) = driftless_format::weights_root(&ck.views());
    if got != root {
        return Err(Refusal::from((format!("step {step}: the ranks' slice bytes do not match their digests"), true)));
    }
    drop(ck);
    // The spooled files are in `files/`; the encoder wants them at the spool's top.
    for s in &layout.shards {
        std::fs::rename(files.join(&s.file), dir.path().join(&s.file)).map_err(|e| local(e.to_string()))?;
    }
    let spooled = SpooledStep { step, root, layout: layout.clone(), digests: digests.clone(), attempt: 0 };
    let stream_id = ctx.stream_id.clone();
    encode_spooled(cfg, &stream_id, ctx.generation, spooled, dir).map_err(|e| local(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A builder of a new stream in a `file://` bucket under `td`, signed with a fresh key.
    fn new_stream(td: &tempfile::TempDir) -> PublisherBuilder {
        let url = format!("file://{}", td.path().join("b").display());
        PublisherBuilder::new(url).with_key(driftless_format::Keypair::generate()).with_new_stream(true)
    }

    fn part(runs: Vec<PartRun>, edges: u64, slices: Option<u64>) -> PartManifest {
        let obj = |size| ObjectRef { object: "x".into(), size, sha256: Digest::default() };
        PartManifest {
            kind: "part".into(),
            version: manifest::FORMAT_VERSION,
            stream_id: "s".into(),
            step: 1,
            generation: 1,
            rank: 0,
            world_size: 1,
            part: PartKind::Anchor,
            base_step: None,
            base_root: None,
            tensors: vec![PartTensor {
                name: "w".into(),
                dtype: DType::BF16,
                shape: vec![3 << 20],
                offsets: vec![0],
                lengths: vec![3 << 20],
                runs,
            }],
            segments: vec![],
            edges: obj(edges),
            slices: slices.map(obj),
            stats: DeltaStats::default(),
        }
    }

    /// A run split as `slice::split` splits it.
    fn run(start: u64, len: u64) -> PartRun {
        let s = driftless_format::slice::split(6 << 20, start, start + len);
        let d = |n: u64| vec![Digest::default(); n as usize];
        PartRun {
            start,
            len,
            head: s.head,
            head_leaves: d(s.head_leaves),
            chunks: d(s.chunks),
            tail_leaves: d(s.tail_leaves),
            tail: s.tail,
        }
    }

    /// The outcome of a group of 1,024 ranks lists 1,024 part digests (~70 KB signed): the
    /// other ranks read it (a fixed 64 KiB cap made them take every committed step as lost),
    /// and an outcome larger than its group can have is refused at once, not polled for.
    #[test]
    fn outcomes_are_read_up_to_what_the_group_size_allows() {
        let td = tempfile::tempdir().unwrap();
        let cfg = new_stream(&td);
        let ws = 1024u64;
        let p0 = cfg.clone().build_sharded(0, ws, Duration::from_secs(1)).unwrap();
        let (ctx, rt) = (p0.ctx.clone().unwrap(), p0.rt.as_ref().unwrap());
        let outcome = |step, parts| StepOutcome {
            step,
            committed: true,
            of: Some(StepKind::Anchor),
            root: Some(Digest::default()),
            reason: None,
            next_anchor: false,
            parts: vec![Digest::of(b"x"); parts],
            slices_next: false,
            retryable: true,
        };
        let wait = |step, ws, secs| {
            let t = Instant::now();
            let deadline = t + Duration::from_secs(secs);
            (
                rt.block_on(wait_outcome(&p0.bucket, &p0.trust, &ctx.stream_id, step, ctx.generation, ws, deadline)),
                t.elapsed(),
            )
        };
        let o = outcome(1, ws as usize);
        rt.block_on(write_outcome(&cfg, &ctx, &o));
        assert!(rt.block_on(p0.bucket.head(&outcome_key(1, ctx.generation))).unwrap().size > 64 << 10);
        assert_eq!(wait(1, ws, 1).0, o);
        // 64 Ki digests for a group of 2: refused without waiting for the deadline.
        rt.block_on(write_outcome(&cfg, &ctx, &outcome(2, 1 << 16)));
        let (got, took) = wait(2, 2, 30);
        assert!(!got.committed && got.reason.as_deref().unwrap().contains("more than an outcome"), "{got:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
    }

    /// A ready marker at a step that is not this stream's (junk planted in the bucket, or
    /// another run's) is a conflict, not worth retrying: the marker is write-once. (A read of
    /// it that fails, an outage or a refusal by the store, is that failure: `committed_root`.)
    #[test]
    fn a_foreign_marker_at_a_step_is_a_conflict_not_a_retry() {
        let td = tempfile::tempdir().unwrap();
        let cfg = new_stream(&td);
        let p0 = cfg.build_sharded(0, 1, Duration::from_secs(1)).unwrap();
        let (ctx, rt) = (p0.ctx.clone().unwrap(), p0.rt.as_ref().unwrap());
        assert!(rt.block_on(ctx.committed_kind(5, Digest::of(b"w"))).unwrap().is_none(), "no marker: not committed");
        rt.block_on(p0.bucket.put(&layout::ready(StepKind::Delta, 5), Bytes::from_static(b"{\"junk\": 1}"))).unwrap();
        let e = rt.block_on(ctx.committed_kind(5, Digest::of(b"w"))).unwrap_err();
        assert!(matches!(e, upload::CommitError::Conflict(_)) && !e.is_retryable(), "{e}");
        assert!(e.to_string().contains("is not this stream's"), "{e}");
    }

    /// A marker removed between the HEAD that saw it and the read (GC at work) leaves the step
    /// unknown, worth a retry. Before, the empty read was taken for another writer's marker: a
    /// conflict, which stops the publisher for good on a race. The reads of the marker are
    /// slowed so that the removal lands between them.
    #[test]
    fn a_marker_gone_between_head_and_read_is_not_a_conflict() {
        use driftless_store::{FaultKind, FaultOp, FaultyStore, StoreOptions};
        let faulty = Arc::new(FaultyStore::new(Arc::new(driftless_store::object_store::memory::InMemory::new())));
        let bucket = Bucket::from_store(faulty.clone(), "s", &StoreOptions::default());
        let cfg = PublisherBuilder::new("unused")
            .with_bucket(bucket.clone())
            .with_key(driftless_format::Keypair::generate())
            .with_new_stream(true);
        let p0 = cfg.build_sharded(0, 1, Duration::from_secs(1)).unwrap();
        let (ctx, rt) = (p0.ctx.clone().unwrap(), p0.rt.as_ref().unwrap());
        let key = layout::ready(StepKind::Delta, 5);
        rt.block_on(bucket.put(&key, Bytes::from_static(b"{\"junk\": 1}"))).unwrap();
        faulty.inject(FaultOp::Get, &key, 1, FaultKind::Slow(Duration::from_millis(300)));
        faulty.inject(FaultOp::Get, &key, 1, FaultKind::Slow(Duration::from_millis(1500)));
        let (b, k) = (bucket.clone(), key.clone());
        let gc = rt.spawn(async move {
            tokio::time::sleep(Duration::from_millis(800)).await;
            b.delete(&k).await.unwrap();
        });
        let e = rt.block_on(ctx.committed_kind(5, Digest::of(b"w"))).unwrap_err();
        rt.block_on(gc).unwrap();
        assert!(matches!(e, upload::CommitError::Unconfirmed(_)) && e.is_retryable(), "{e}");
        assert!(e.to_string().contains("went away"), "{e}");
        assert!(faulty.injected() >= 2, "the reads were not the ones slowed");
    }

    /// A claim of this publisher's own generation with other weights is its own failed try
    /// (`Taken`: the step is lost, later ones go on) only when this process made it. One it
    /// did not make is another process under the same generation, which a store without
    /// atomic create can let happen: a conflict, as before (found by review).
    #[test]
    fn a_claim_of_this_generation_is_its_own_only_when_this_process_made_it() {
        let td = tempfile::tempdir().unwrap();
        let cfg = new_stream(&td);
        let p0 = cfg.build_sharded(0, 1, Duration::from_secs(1)).unwrap();
        let (ctx, rt) = (p0.ctx.clone().unwrap(), p0.rt.as_ref().unwrap());
        let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
        rt.block_on(upload::claim_step(&ctx, 7, a)).unwrap();
        rt.block_on(upload::claim_step(&ctx, 7, a)).unwrap();
        let e = rt.block_on(upload::claim_step(&ctx, 7, b)).unwrap_err();
        assert!(matches!(e, upload::CommitError::Taken(_)), "{e}");
        let other = upload::Claim {
            kind: "claim".into(),
            stream_id: ctx.stream_id.clone(),
            step: 8,
            generation: ctx.generation,
            root: a,
        };
        rt.block_on(p0.bucket.put(&layout::claim(8), serde_json::to_vec(&other).unwrap().into())).unwrap();
        let e = rt.block_on(upload::claim_step(&ctx, 8, b)).unwrap_err();
        assert!(matches!(e, upload::CommitError::Conflict(_)), "{e}");
    }

    /// A committer whose lease has a long TTL renews it seldom (every TTL/4): the ranks wait
    /// long enough to see it renewed while it commits their step. Found by review: with a
    /// window shorter than TTL/4 they never saw two renewals, and gave up on a step the
    /// committer then committed (16 s TTL and a 3 s window here; 10 min and 90 s in use).
    #[test]
    fn ranks_see_a_slowly_renewed_lease_at_work() {
        let td = tempfile::tempdir().unwrap();
        let url = format!("file://{}", td.path().join("b").display());
        let cfg = PublisherBuilder::new(url)
            .with_key(driftless_format::Keypair::generate())
            .with_new_stream(true)
            .with_lease_ttl(Duration::from_secs(16));
        let p0 = cfg.clone().build_sharded(0, 2, Duration::from_secs(1)).unwrap();
        let (ctx, rt) = (p0.ctx.clone().unwrap(), p0.rt.as_ref().unwrap());
        ctx.shared.update(|s| s.committing = Some(5));
        let o = StepOutcome {
            committed: true,
            of: Some(StepKind::Delta),
            root: Some(Digest::default()),
            reason: None,
            ..StepOutcome::aborted(5, String::new(), false)
        };
        let writer = {
            let (cfg, ctx, o) = (cfg.clone(), ctx.clone(), o.clone());
            let h = rt.handle().clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_secs(9));
                h.block_on(write_outcome(&cfg, &ctx, &o));
            })
        };
        let deadline = Instant::now() + Duration::from_secs(3);
        let got = rt.block_on(wait_outcome(&p0.bucket, &p0.trust, &ctx.stream_id, 5, ctx.generation, 2, deadline));
        writer.join().unwrap();
        assert_eq!(got, o, "the rank gave up on a step its committer was seen committing");
    }

    /// A committer that stopped releases its lease (TTL 0): ranks wait for the next committer
    /// instead of joining the stopped one (found by review: a rank joined it at once, its part
    /// was never read and the step was lost; with another world size it was refused outright).
    #[test]
    fn a_released_committer_is_waited_for_not_joined() {
        let td = tempfile::tempdir().unwrap();
        let cfg = new_stream(&td);
        let p0 = cfg.clone().build_sharded(0, 2, Duration::from_secs(1)).unwrap();
        let (g_old, bucket) = (p0.generation().unwrap(), p0.bucket.clone());
        drop(p0);
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        for world_size in [2, 4] {
            let t = Instant::now();
            let r = rt.block_on(group_lease(&bucket, world_size, Duration::from_millis(600)));
            // Retryable: the group's rank 0 may be restarting (found by review: a conflict).
            assert!(matches!(&r, Err(Error::Waited(detail)) if detail.contains("committer (generation")), "{r:?}");
            assert!(r.as_ref().unwrap_err().is_retryable());
            assert!(t.elapsed() >= Duration::from_millis(600), "gave up before its deadline");
        }
        // A new committer with the new world size is joined.
        let p0 = cfg.build_sharded(0, 4, Duration::from_secs(1)).unwrap();
        let (g, lease) = rt.block_on(group_lease(&bucket, 4, Duration::from_secs(5))).unwrap();
        assert!(g > g_old && lease.ttl_ms > 0 && lease.world_size == Some(4));
        drop(p0);
    }

    #[test]
    fn parts_are_bounded_before_anything_is_fetched() {
        // A 6 MiB tensor; a run of bytes 1.5 MiB + 100 .. 4.5 MiB + 7: edge bytes at both ends.
        let (h, start, len) = (1u64 << 19, (3u64 << 19) + 100, (6u64 << 19) - 93);
        let good = run(start, len);
        let edges = good.head + good.tail;
        assert!(good.head > 0 && good.tail > 0 && !good.head_leaves.is_empty() && good.chunks.len() == 2);
        assert_eq!(check_part(&part(vec![good.clone()], edges, Some(len))), Ok(()));
        let e = check_part(&part(vec![good.clone(); 3], 3 * edges, None)).unwrap_err();
        assert!(e.contains("hold more than"), "{e}");
        let e = check_part(&part(vec![good.clone()], edges + 1, None)).unwrap_err();
        assert!(e.contains("edges object"), "{e}");
        let e = check_part(&part(vec![good.clone()], edges, Some(u64::MAX))).unwrap_err();
        assert!(e.contains("slices object"), "{e}");
        let mut bad = vec![];
        let mut r = run(0, 1);
        r.start = 12 * h; // outside the tensor
        bad.push(r);
        let mut r = run(0, 2);
        r.start = u64::MAX; // offset overflow
        bad.push(r);
        let mut r = good.clone();
        r.head += 1 << 20; // an edge of a whole chunk
        bad.push(r);
        let mut r = good.clone();
        r.chunks.pop(); // too few chunks for its length
        bad.push(r);
        let mut r = good.clone();
        r.tail_leaves.push(Digest::default()); // a leaf too many
        bad.push(r);
        for b in bad {
            assert!(check_part(&part(vec![b.clone()], b.head.saturating_add(b.tail), None)).is_err(), "{b:?}");
        }
    }

    #[test]
    fn part_names_parse_only_for_their_generation() {
        let n = layout::generation_name(7, &part_name(3, 0xab, "part.json"));
        assert_eq!(n, "g7-r00003-000000ab-part.json");
        assert_eq!(part_rank(&n, 7), Some(3));
        assert_eq!(part_rank(&n, 8), None);
        assert_eq!(part_rank("g7-r3-000000ab-part.json", 7), None);
        assert_eq!(part_rank("g7-r00003-part.json", 7), None);
        assert_eq!(part_rank("g7-r00003-000000AB-part.json", 7), None);
        assert_eq!(part_rank("g7-r00003-000000ab-seg-0000.dls", 7), None);
    }

    /// A committer with world size 2 and a forged part of rank 1 (signed with the stream's key,
    /// so only the committer's own checks stand between it and a commit).
    fn commit_against(forge: impl FnOnce(&mut PartManifest, &str)) -> StepOutcome {
        let td = tempfile::tempdir().unwrap();
        let url = format!("file://{}", td.path().join("b").display());
        let key = driftless_format::Keypair::generate();
        let cfg = PublisherBuilder::new(url).with_key(key).with_new_stream(true);
        let mut p0 = cfg.clone().build_sharded(0, 2, Duration::from_secs(2)).unwrap();
        let g = p0.generation().unwrap();
        let data = vec![7u8; 4 << 20];
        let shape = [2u64 << 20];
        let shard = |start: u64| Shard {
            name: "w",
            dtype: DType::BF16,
            shape: &shape,
            slice: Slice::flat(&shape, start, 1 << 20).unwrap(),
            data: &data[..2 << 20],
        };
        // Rank 1's honest part of step 1, then forged and signed again.
        let copy = Arc::new(copy_shards(1, &[shard(1 << 20)], None));
        let who = Who { g, rank: 1, nonce: 9, world_size: 2 };
        let built = build_part(&cfg, p0.stream_id(), who, &copy, None, PartKind::Anchor, true).unwrap();
        let (name, env) = built.objects.last().unwrap().clone();
        let e: driftless_format::sign::Envelope = serde_json::from_slice(&env).unwrap();
        let mut m: PartManifest = serde_json::from_str(&e.payload).unwrap();
        let own = name.strip_suffix("part.json").unwrap().to_string();
        forge(&mut m, &own);
        let forged = cfg.seal(&serde_json::to_vec(&m).unwrap()).unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let bucket = Bucket::open(&cfg.url, &cfg.store).unwrap();
        rt.block_on(async {
            for (n, b) in &built.objects[..built.objects.len() - 1] {
                bucket.put(&layout::object(StepKind::Delta, 1, n), b.clone()).await.unwrap();
            }
            bucket.put(&layout::object(StepKind::Delta, 1, &name), Bytes::from(forged)).await.unwrap();
        });
        p0.publish(1, &[shard(0)]).unwrap();
        // The commit runs after publish returns; flush reports it (an error when refused).
        let _ = p0.flush();
        p0.last_outcome().cloned().expect("the step was resolved")
    }

    /// Dropping rank 0 without `close` while its step cannot commit (rank 1 never sends) says
    /// so; after a committed step it says nothing. The drop itself only reports: the step's
    /// fate is the committer's either way.
    #[test]
    fn a_dropped_committer_reports_a_last_step_that_did_not_commit() {
        let td = tempfile::tempdir().unwrap();
        let cfg = new_stream(&td);
        let data = vec![7u8; 2 << 20];
        let shape = [1u64 << 20];
        let whole = Shard {
            name: "w",
            dtype: DType::BF16,
            shape: &shape,
            slice: Slice::flat(&shape, 0, 1 << 20).unwrap(),
            data: &data,
        };
        let mut p0 = cfg.clone().build_sharded(0, 2, Duration::from_secs(1)).unwrap();
        p0.publish(1, std::slice::from_ref(&whole)).unwrap();
        let said = p0.dropped_unpublished().expect("a step without rank 1's part is not published");
        assert!(said.starts_with("step 1 was NOT published"), "{said}");
        drop(p0);

        let mut solo = cfg.with_new_stream(true).build_sharded(0, 1, Duration::from_secs(1)).unwrap();
        solo.publish(1, &[whole]).unwrap();
        assert_eq!(solo.dropped_unpublished(), None, "a committed step is not reported");
        assert!(solo.last_outcome().is_some_and(|o| o.committed));
    }

    /// A rank other than 0 with nothing in flight still reports an outcome it learned and never
    /// handed over (found by review: a `publish` that failed after resolving the step before
    /// it kept that step's failure in `unreported`, and the drop said nothing).
    #[test]
    fn a_dropped_rank_reports_an_outcome_it_never_handed_over() {
        let td = tempfile::tempdir().unwrap();
        let cfg = new_stream(&td);
        let _p0 = cfg.clone().build_sharded(0, 2, Duration::from_secs(1)).unwrap();
        let mut p1 = cfg.with_new_stream(false).build_sharded(1, 2, Duration::from_secs(1)).unwrap();
        assert_eq!(p1.dropped_unpublished(), None, "nothing published, nothing to say");
        p1.unreported = Some((Some(StepOutcome::aborted(4, "rank 1's part was late".into(), true)), None));
        assert_eq!(p1.dropped_unpublished().as_deref(), Some("step 4 was NOT published: rank 1's part was late"));
    }

    #[test]
    fn an_honest_pair_of_parts_commits() {
        let o = commit_against(|_, _| {});
        assert!(o.committed, "{:?}", o.reason);
    }

    #[test]
    fn a_part_naming_another_ranks_object_is_refused() {
        let o = commit_against(|m, own| {
            let other = own.replace("-r00001-", "-r00000-");
            m.slices.as_mut().unwrap().object = format!("{other}slices.bin");
        });
        assert!(!o.committed);
        assert!(o.reason.as_deref().unwrap().contains("which is not its own"), "{:?}", o.reason);
    }

    #[test]
    fn edge_bytes_over_the_cap_are_refused_before_any_is_fetched() {
        // 2^19 runs of 16382 bytes, each only edge bytes (no whole leaf): 8 GiB declared by a
        // manifest of a few tens of MB, over a tensor declared large enough to hold them.
        let o = commit_against(|m, _| {
            let t = &mut m.tensors[0];
            t.shape = vec![1 << 40];
            t.lengths = vec![1 << 40];
            t.runs = (0..1u64 << 19)
                .map(|k| PartRun {
                    start: 1 + k * 16384,
                    len: 16382,
                    head: 16382,
                    head_leaves: vec![],
                    chunks: vec![],
                    tail_leaves: vec![],
                    tail: 0,
                })
                .collect();
            m.edges.size = (1u64 << 19) * 16382;
            m.slices = None;
        });
        assert!(!o.committed);
        assert!(o.reason.as_deref().unwrap().contains("edge bytes, over the committer's"), "{:?}", o.reason);
    }
}

#[cfg(test)]
mod bound_tests {
    use super::*;

    /// Found by review: two ranks holding a tensor split along dimension 1 into runs of one
    /// element send one delta entry per run; 900k entries decode to more memory than any
    /// reader holds for a 1.8 MB result (`max_delta_heap`), so every agent refused the step
    /// the committer sealed and reported as published, and every delta after it until the next
    /// anchor. The committer now checks its manifest as readers do. Step 1 (no slices) is
    /// refused, retryable, and step 2 is an anchor; from then on every step carries the ranks'
    /// slices and is committed whole as an anchor (a second review: with slices only on
    /// scheduled steps, every other step was refused), its delta objects removed.
    #[test]
    fn a_delta_readers_would_refuse_is_not_sealed() {
        let td = tempfile::tempdir().unwrap();
        let o = steps_of_one_element_runs(td.path(), 5);
        assert_eq!(o[0].of, Some(StepKind::Anchor), "{:?}", o[0]);
        assert!(!o[1].committed && o[1].next_anchor && o[1].retryable, "{:?}", o[1]);
        assert!(o[1].reason.as_deref().unwrap().contains("more than a reader holds"), "{:?}", o[1]);
        for o in &o[2..] {
            assert!(o.committed && o.of == Some(StepKind::Anchor), "{o:?}");
        }
        for step in 3..5u64 {
            let dir = td.path().join(format!("b/deltas/{step:012}"));
            let left: Vec<String> = std::fs::read_dir(&dir)
                .map(|d| d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
                .unwrap_or_default();
            assert!(!left.iter().any(|n| n.contains("-seg-")), "step {step}: {left:?}");
        }
    }

    /// A commit timeout past what the deadlines built from it can hold is refused, by every
    /// rank, before anything waits on it.
    #[test]
    fn a_commit_timeout_past_a_day_is_refused() {
        let td = tempfile::tempdir().unwrap();
        let url = format!("file://{}", td.path().join("b").display());
        let cfg = PublisherBuilder::new(url).with_key(driftless_format::Keypair::generate()).with_new_stream(true);
        let p0 = cfg.clone().build_sharded(0, 2, Duration::from_secs(1)).unwrap();
        for rank in [0, 1] {
            let e = cfg.clone().build_sharded(rank, 2, Duration::MAX).unwrap_err();
            assert!(matches!(e, Error::Refused(_)) && e.to_string().contains("longer than"), "{e}");
        }
        assert!(cfg.build_sharded(1, 2, MAX_COMMIT_TIMEOUT).is_ok());
        drop(p0);
    }

    /// A two-rank group on `cfg`'s stream publishing `(step, weights seed)` in order, rank 1
    /// in a thread of its own (it waits for outcomes that rank 0 writes as it goes on). Each
    /// rank's outcome of each step, and whether the publish was refused at once.
    fn group_steps(cfg: PublisherBuilder, steps: &[(u64, u64)]) -> [Vec<Result<StepOutcome>>; 2] {
        let timeout = Duration::from_secs(60);
        let rows = 4096u64;
        let steps = steps.to_vec();
        let column = move |r: u64, seed: u64| -> Vec<u8> {
            (0..rows).flat_map(|i| ((i * 2 + r) as u16 ^ (seed as u16).wrapping_mul(0x0101)).to_le_bytes()).collect()
        };
        let run = move |rank: u64, cfg: PublisherBuilder, steps: Vec<(u64, u64)>| {
            let mut p = cfg.build_sharded(rank, 2, timeout).unwrap();
            let shape = [rows, 2];
            let mut out = vec![];
            for (step, seed) in steps {
                let c = column(rank, seed);
                let shard = Shard {
                    name: "w",
                    dtype: DType::BF16,
                    shape: &shape,
                    slice: Slice::block(&shape, 1, rank, 1).unwrap(),
                    data: &c,
                };
                out.push(match p.publish(step, &[shard]) {
                    Ok(_) => {
                        let _ = p.flush();
                        Ok(p.last_outcome().cloned().expect("the step was resolved"))
                    }
                    Err(e) => Err(e),
                });
            }
            p.close().ok();
            out
        };
        let (c1, s1) = (cfg.clone(), steps.clone());
        let r1 = std::thread::spawn(move || run(1, c1, s1));
        let r0 = run(0, cfg, steps);
        [r0, r1.join().unwrap()]
    }

    /// Found by review: a group restarted on a stream (resumed from an older checkpoint)
    /// gathered and encoded every step up to the stream's newest as an anchor, found its claim
    /// taken only then, and refused it as retryable. Now a step at or before the newest the
    /// stream held is this step again when it holds these very weights (the ranks adopt it as
    /// their base: the next step is a delta), and otherwise refused as not retryable, without
    /// a marker of its own; a later step commits.
    #[test]
    fn a_group_restarted_on_a_stream_with_steps_takes_up_after_its_newest() {
        let td = tempfile::tempdir().unwrap();
        let url = format!("file://{}", td.path().join("b").display());
        let cfg = PublisherBuilder::new(url.clone()).with_key(driftless_format::Keypair::generate());
        let first = group_steps(cfg.clone().with_new_stream(true), &[(0, 0), (1, 1), (2, 2), (5, 5)]);
        for o in first.iter().flatten() {
            assert!(o.as_ref().unwrap().committed, "{o:?}");
        }
        let second = group_steps(cfg, &[(2, 2), (4, 4), (5, 9), (6, 6), (7, 7)]);
        for (rank, outcomes) in second.iter().enumerate() {
            let o: Vec<&StepOutcome> = outcomes.iter().map(|o| o.as_ref().unwrap()).collect();
            assert!(o[0].committed, "rank {rank}: step 2 with its weights is step 2: {:?}", o[0]);
            for (i, why) in [(1, "not after step 5"), (2, "already committed with other weights")] {
                assert!(!o[i].committed && !o[i].retryable, "rank {rank}: {:?}", o[i]);
                assert!(o[i].reason.as_deref().unwrap().contains(why), "rank {rank}: {:?}", o[i]);
            }
            assert!(o[3].committed && o[3].of == Some(StepKind::Anchor), "rank {rank}: {:?}", o[3]);
            assert!(o[4].committed && o[4].of == Some(StepKind::Delta), "rank {rank}: {:?}", o[4]);
        }
        // Step 4 left nothing a reader sees, and step 5 is still the first run's.
        let rt = tokio::runtime::Runtime::new().unwrap();
        let bucket = Bucket::open(&url, &driftless_store::StoreOptions::default()).unwrap();
        rt.block_on(async {
            for kind in [StepKind::Delta, StepKind::Anchor] {
                assert!(bucket.head(&layout::ready(kind, 4)).await.unwrap_err().is_not_found());
            }
            // Of the second group's generation (2), only the outcomes remain under steps 2, 4
            // and 5 (the first group's parts of 2 and 5 are the committed deltas' segments).
            for step in [2, 4, 5] {
                let left: Vec<String> = bucket
                    .list(&layout::delta_dir(step))
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|o| o.key)
                    .filter(|k| k.contains("/g2-"))
                    .collect();
                assert_eq!(left, [format!("deltas/{step:012}/g2-outcome.json")], "step {step}");
            }
        });
    }

    /// Found by review: when the committer's outcome write failed, the other ranks (seeing it
    /// go on) kept their older base while it built on the step, and the next step was refused
    /// for its bases. Now both sides send anchors next, and that step commits.
    #[test]
    fn a_lost_outcome_costs_no_further_step() {
        use driftless_store::{FaultKind, FaultOp, FaultyStore, StoreOptions};
        let faulty = Arc::new(FaultyStore::new(Arc::new(driftless_store::object_store::memory::InMemory::new())));
        let bucket = Bucket::from_store(faulty.clone(), "s", &StoreOptions::default());
        let cfg = PublisherBuilder::new("unused")
            .with_bucket(bucket.clone())
            .with_key(driftless_format::Keypair::generate())
            .with_new_stream(true)
            .with_lease_ttl(Duration::from_secs(2));
        faulty.inject(FaultOp::Put, &format!("{:012}/g1-outcome.json", 1), 1, FaultKind::Permanent);
        let [r0, r1] = group_steps(cfg, &[(0, 0), (1, 1), (2, 2), (3, 3)]);
        let (r0, r1): (Vec<StepOutcome>, Vec<StepOutcome>) =
            (r0.into_iter().map(Result::unwrap).collect(), r1.into_iter().map(Result::unwrap).collect());
        assert!(r0[1].committed && r0[1].next_anchor, "{:?}", r0[1]);
        assert!(!r1[1].committed && r1[1].next_anchor, "{:?}", r1[1]);
        assert!(r1[1].reason.as_deref().unwrap().contains("has a ready marker"), "{:?}", r1[1]);
        for r in [&r0, &r1] {
            assert!(r[2].committed && r[2].of == Some(StepKind::Anchor), "{:?}", r[2]);
            assert!(r[3].committed && r[3].of == Some(StepKind::Delta), "{:?}", r[3]);
        }
    }

    /// Two processes given rank 1: the step with both their parts is refused as retryable
    /// (it may be a restarted rank beside its predecessor's part), and the same two again at
    /// the next step as not retryable (found by review: retryable for ever).
    #[test]
    fn two_processes_of_one_rank_are_refused_as_not_retryable() {
        let td = tempfile::tempdir().unwrap();
        let url = format!("file://{}", td.path().join("b").display());
        let cfg = PublisherBuilder::new(url).with_key(driftless_format::Keypair::generate());
        let timeout = Duration::from_secs(60);
        let mut p0 = cfg.clone().with_new_stream(true).build_sharded(0, 2, timeout).unwrap();
        let shape = [64u64, 2];
        let col = vec![7u8; 128];
        let (sent_tx, sent_rx) = std::sync::mpsc::channel();
        let mut twins = vec![];
        for _ in 0..2 {
            let (cfg, col, sent) = (cfg.clone(), col.clone(), sent_tx.clone());
            twins.push(std::thread::spawn(move || {
                let mut p = cfg.build_sharded(1, 2, timeout).unwrap();
                for step in 0..2 {
                    let slice = Slice::block(&shape, 1, 1, 1).unwrap();
                    p.publish(step, &[Shard { name: "w", dtype: DType::BF16, shape: &shape, slice, data: &col }])
                        .unwrap();
                    p.wait_sent().expect("sent");
                    sent.send(step).unwrap();
                }
                let _ = p.flush();
                p.close().ok();
            }));
        }
        let mut outcomes = vec![];
        for step in 0..2 {
            // Both twins' parts are in before rank 0's, so the committer lists them together.
            for _ in 0..2 {
                assert_eq!(sent_rx.recv().unwrap(), step);
            }
            let slice = Slice::block(&shape, 1, 0, 1).unwrap();
            p0.publish(step, &[Shard { name: "w", dtype: DType::BF16, shape: &shape, slice, data: &col }]).unwrap();
            let _ = p0.flush();
            outcomes.push(p0.last_outcome().cloned().unwrap());
        }
        for t in twins {
            t.join().unwrap();
        }
        p0.close().ok();
        assert!(!outcomes[0].committed && outcomes[0].retryable, "{:?}", outcomes[0]);
        assert!(!outcomes[1].committed && !outcomes[1].retryable, "{:?}", outcomes[1]);
        assert!(
            outcomes[1].reason.as_deref().unwrap().contains("two processes publish as rank 1"),
            "{:?}",
            outcomes[1]
        );
    }

    /// A listing of the step's parts that fails past the store's retries, with time left
    /// before the commit timeout, is made again: the step commits (it was refused, and the next
    /// step was an anchor).
    #[test]
    fn a_failed_listing_of_the_parts_is_made_again() {
        use driftless_store::{FaultKind, FaultOp, FaultyStore, StoreOptions};
        let faulty = Arc::new(FaultyStore::new(Arc::new(driftless_store::object_store::memory::InMemory::new())));
        // One retry in the store: two faults fail the listing past it.
        let bucket = Bucket::from_store(faulty.clone(), "s", &StoreOptions::default().with_max_retries(1));
        let cfg = PublisherBuilder::new("unused")
            .with_bucket(bucket)
            .with_key(driftless_format::Keypair::generate())
            .with_new_stream(true);
        faulty.inject(FaultOp::List, &format!("deltas/{:012}", 1), 2, FaultKind::Transient);
        let [r0, r1] = group_steps(cfg, &[(0, 0), (1, 1), (2, 2)]);
        assert!(faulty.injected() >= 2, "the faults were hit");
        for r in [r0, r1] {
            let r: Vec<StepOutcome> = r.into_iter().map(Result::unwrap).collect();
            assert!(r[1].committed && r[1].of == Some(StepKind::Delta), "{:?}", r[1]);
            assert!(r[2].committed && r[2].of == Some(StepKind::Delta), "{:?}", r[2]);
        }
    }

    /// A signed outcome of another stream (same key), copied under this step before the
    /// committer writes its own, is not this step's (found by review: it was, and a rank took
    /// a step as committed that was not).
    #[test]
    fn an_outcome_of_another_stream_is_not_this_steps() {
        let td = tempfile::tempdir().unwrap();
        let key = driftless_format::Keypair::generate();
        let cfg = |d: &str| {
            let url = format!("file://{}", td.path().join(d).display());
            PublisherBuilder::new(url).with_key(key.clone()).with_new_stream(true)
        };
        let (a, b) = (cfg("a"), cfg("b"));
        let pa = a.clone().build_sharded(0, 2, Duration::from_secs(1)).unwrap();
        let pb = b.build_sharded(0, 2, Duration::from_secs(1)).unwrap();
        let (ca, rt) = (pa.ctx.clone().unwrap(), pa.rt.as_ref().unwrap());
        let cb = pb.ctx.clone().unwrap();
        assert_eq!(ca.generation, cb.generation);
        let o = committed_outcome(3, StepKind::Anchor, Digest::of(b"w"), vec![Digest::of(b"p"); 2]);
        // Written by stream b's committer, then copied into stream a's step 3.
        assert!(rt.block_on(write_outcome(&a, &cb, &o)));
        let moved = rt.block_on(pb.bucket.get(&outcome_key(3, cb.generation))).unwrap();
        rt.block_on(pa.bucket.put(&outcome_key(3, ca.generation), moved)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(2);
        let got = rt.block_on(wait_outcome(&pa.bucket, &pa.trust, &ca.stream_id, 3, ca.generation, 2, deadline));
        assert!(!got.committed && got.reason.as_deref().unwrap().contains("not a valid signed outcome"), "{got:?}");
        // Its own committer's outcome is read.
        rt.block_on(pa.bucket.delete(&outcome_key(3, ca.generation))).unwrap();
        assert!(rt.block_on(write_outcome(&a, &ca, &o)));
        let got = rt.block_on(wait_outcome(&pa.bucket, &pa.trust, &ca.stream_id, 3, ca.generation, 2, deadline));
        assert_eq!(got, o);
    }

    /// Steps `0..steps` of a (450000, 2) BF16 tensor in a bucket under `dir`, ranks 0 and 1
    /// holding one column each; every element changes at every step. Rank 0's outcome of each.
    fn steps_of_one_element_runs(dir: &std::path::Path, steps: u64) -> Vec<StepOutcome> {
        let url = format!("file://{}", dir.join("b").display());
        let key = driftless_format::Keypair::generate();
        let timeout = Duration::from_secs(120);
        let cfg = PublisherBuilder::new(url).with_key(key).with_anchor_every(1000);
        let mut p0 = cfg.clone().with_new_stream(true).build_sharded(0, 2, timeout).unwrap();
        let mut p1 = cfg.build_sharded(1, 2, timeout).unwrap();
        let rows = 450_000u64;
        let shape = [rows, 2];
        let column = |r: u64, s: u64| -> Vec<u8> {
            (0..rows).flat_map(|i| ((i * 2 + r) as u16 ^ (s as u16 * 0x0101)).to_le_bytes()).collect()
        };
        let mut outcomes = vec![];
        for s in 0..steps {
            let (c0, c1) = (column(0, s), column(1, s));
            let shard = |r: u64, data| Shard {
                name: "w",
                dtype: DType::BF16,
                shape: &shape,
                slice: Slice::block(&shape, 1, r, 1).unwrap(),
                data,
            };
            p1.publish(s, &[shard(1, &c1)]).unwrap();
            p1.wait_sent().expect("rank 1's part sent");
            p0.publish(s, &[shard(0, &c0)]).unwrap();
            let _ = p0.flush();
            outcomes.push(p0.last_outcome().cloned().expect("the step was resolved"));
        }
        outcomes
    }
}

#[cfg(test)]
mod claimed_tests {
    use super::*;

    /// Found by review: step 1 claimed with other weights by an older generation (the group's
    /// killed committer: its lease still live, or run out) was reported as not retryable,
    /// although step 2 commits; a trainer following the docs ("RetryableError only then")
    /// stopped publishing over one lost step. Both cases are now retryable, and step 2 commits.
    #[test]
    fn a_step_claimed_by_a_killed_committer_is_retryable_and_the_next_commits() {
        for ttl in [Duration::from_secs(60), Duration::ZERO] {
            let td = tempfile::tempdir().unwrap();
            let url = format!("file://{}", td.path().join("b").display());
            let cfg = PublisherBuilder::new(url).with_key(driftless_format::Keypair::generate()).with_new_stream(true);
            let rt = tokio::runtime::Runtime::new().unwrap();
            let bucket = Bucket::open(&cfg.url, &cfg.store).unwrap();
            let mut p0 = cfg.clone().build_sharded(0, 1, Duration::from_secs(2)).unwrap();
            let g = p0.generation().unwrap();
            rt.block_on(async {
                let claim = upload::Claim {
                    kind: "claim".into(),
                    stream_id: p0.stream_id().to_string(),
                    step: 1,
                    generation: g - 1,
                    root: Digest::of(b"other weights"),
                };
                bucket.put(&layout::claim(1), Bytes::from(serde_json::to_vec(&claim).unwrap())).await.unwrap();
                let lease = upload::lease_bytes(p0.stream_id(), g - 1, ttl, Some(1), None);
                bucket.put(&layout::lease(g - 1), lease).await.unwrap();
            });
            let data: &'static [u8] = Box::leak(vec![3u8; 1 << 20].into_boxed_slice());
            let shape = [1u64 << 19];
            let sh = || Shard {
                name: "w",
                dtype: DType::BF16,
                shape: &shape,
                slice: Slice::flat(&shape, 0, 1 << 19).unwrap(),
                data,
            };
            p0.publish(1, &[sh()]).unwrap();
            let e = p0.flush().unwrap_err();
            let o1 = p0.last_outcome().cloned().unwrap();
            assert!(!o1.committed && o1.retryable, "lease ttl {ttl:?}: {e}: {o1:?}");
            p0.publish(2, &[sh()]).unwrap();
            assert!(p0.flush().unwrap().committed, "lease ttl {ttl:?}");
        }
    }
}
