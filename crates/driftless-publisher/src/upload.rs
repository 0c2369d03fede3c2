//! Background uploads: the ordered delta queue and anchor uploads, on the publisher's own
//! runtime. Commit order per step: claim, payload objects, manifest, confirmation listing,
//! lease check, ready marker, latest hint (see [`commit_step`]).

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use driftless_format::manifest::{now_ms, LatestHint, ReadyMarker, StepKind};
use driftless_format::{Digest, Keypair};
use driftless_store::stream::StreamReader;
use driftless_store::{layout, Bucket};
use futures::stream::{self, StreamExt, TryStreamExt};
use tracing::{info, info_span, warn, Instrument};

/// A queued job.
pub(crate) enum Job {
    /// Upload a delta.
    Delta(DeltaJob),
    /// The state of `step` reaches the bucket only as an anchor (first publish, restart,
    /// recovery): deltas based on it wait until the anchor is ready, and are dropped if it
    /// fails, so no ready delta ever hangs off a state readers cannot get. The receiver says
    /// whether the anchor became ready.
    AnchorScheduled(u64, tokio::sync::oneshot::Receiver<bool>),
}

pub(crate) struct DeltaJob {
    pub(crate) step: u64,
    pub(crate) base_step: u64,
    pub(crate) root: Digest,
    pub(crate) envelope: Bytes,
    pub(crate) segments: Vec<(String, Bytes)>,
}

/// A spooled anchor ready to upload.
pub(crate) struct AnchorJob {
    pub(crate) step: u64,
    /// The try of this step its object names carry ([`layout::attempt_name`]).
    pub(crate) attempt: u32,
    pub(crate) root: Digest,
    pub(crate) envelope: Bytes,
    /// (object name, bytes) — bytes are usually a map of a spool file.
    pub(crate) objects: Vec<(String, Bytes)>,
    pub(crate) _spool: Option<driftless_store::spool::Spool>,
    /// Told whether the anchor became ready (anchor-only steps: the delta queue waits on it).
    pub(crate) done: Option<tokio::sync::oneshot::Sender<bool>>,
}

/// State shared by the trainer-side API and the uploaders.
#[derive(Debug, Default)]
pub(crate) struct State {
    /// Newest step whose state is (or is being made) reachable in the bucket.
    pub(crate) tip: Option<u64>,
    /// Set after a failure: the next publish must be an anchor.
    pub(crate) need_anchor: bool,
    pub(crate) queued: usize,
    pub(crate) anchors_in_flight: usize,
    pub(crate) last_delta: Option<u64>,
    pub(crate) last_anchor: Option<u64>,
    pub(crate) bytes_uploaded: u64,
    pub(crate) failures: u64,
    /// Failures `wait` has returned (each is returned once).
    pub(crate) reported: u64,
    pub(crate) dropped: u64,
    pub(crate) last_error: Option<String>,
    /// Whether the cause of `last_error` may pass by itself.
    pub(crate) last_error_retryable: bool,
    /// Dense bytes / payload bytes of the newest encoded delta, and its payload bytes.
    pub(crate) last_ratio: f64,
    pub(crate) last_delta_bytes: u64,
    /// Set on a conflict: another writer owns the stream; the publisher stops.
    pub(crate) conflict: Option<(u64, String)>,
    /// The newest step found claimed by an older generation ([`CommitError::Taken`]): it
    /// cannot be published, so `flush` does not publish it again.
    pub(crate) taken: Option<(u64, String)>,
    /// Until when the lease is known to be live (last successful renewal + TTL).
    pub(crate) lease_until: Option<Instant>,
    /// The step a sharded committer is at work on now: building and sending its own part,
    /// then committing (announced in its lease renewals; the other ranks wait on while it is).
    pub(crate) committing: Option<u64>,
    /// The lease was released (the publisher stopped): no renewal may make it live again.
    pub(crate) released: bool,
    /// Claims this process made (step, root), the newest [`CLAIMS_KEPT`]: a claim of this
    /// generation with other weights is this process's own failed try only when it is here;
    /// otherwise another process shares the generation (a store without atomic create).
    pub(crate) claimed: std::collections::BTreeMap<u64, Digest>,
}

/// How many of its own claims a publisher remembers.
const CLAIMS_KEPT: usize = 256;

#[derive(Debug, Default)]
pub(crate) struct Shared {
    pub(crate) state: Mutex<State>,
    pub(crate) changed: Condvar,
}

/// Why a commit failed.
#[derive(Debug)]
pub(crate) enum CommitError {
    /// Bucket trouble (retryable or not, as the store says).
    Store(driftless_store::Error),
    /// The step is committed, or claimed, with other weights, or a newer publisher generation
    /// owns the stream: this publisher must stop.
    Conflict(String),
    /// Objects could not be confirmed present, or the lease lapsed: nothing was committed;
    /// a later attempt may succeed.
    Unconfirmed(String),
    /// The step is claimed, with other weights, by an older generation (a killed publisher
    /// of this stream; a live one is fenced by this newer generation): this step cannot be
    /// published, the publisher goes on with later ones.
    Taken(String),
    /// The step is claimed, with other weights, by an older generation whose lease is still
    /// live: for a plain publisher a second publisher (a conflict); for a sharded group, most
    /// often the group's own killed committer, whose lease runs out within its TTL, and whose
    /// claim costs this step only.
    Claimed(String),
}

impl std::fmt::Display for CommitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CommitError::Store(e) => write!(f, "{e}"),
            CommitError::Conflict(d)
            | CommitError::Unconfirmed(d)
            | CommitError::Taken(d)
            | CommitError::Claimed(d) => f.write_str(d),
        }
    }
}

impl CommitError {
    /// Whether a later attempt may succeed without anyone acting.
    pub(crate) fn is_retryable(&self) -> bool {
        match self {
            CommitError::Store(e) => e.is_retryable(),
            CommitError::Conflict(_) | CommitError::Taken(_) | CommitError::Claimed(_) => false,
            CommitError::Unconfirmed(_) => true,
        }
    }
}

impl From<driftless_store::Error> for CommitError {
    fn from(e: driftless_store::Error) -> Self {
        CommitError::Store(e)
    }
}

impl State {
    /// Records a failed commit: counts it, and fences the publisher on a conflict.
    fn record_failure(&mut self, what: &str, step: u64, e: &CommitError) {
        self.need_anchor = true;
        self.failures += 1;
        self.last_error = Some(format!("{what} {step}: {e}"));
        self.last_error_retryable = e.is_retryable();
        match e {
            CommitError::Conflict(d) | CommitError::Claimed(d) if self.conflict.is_none() => {
                self.conflict = Some((step, d.clone()))
            }
            CommitError::Taken(d) => self.taken = Some((step, d.clone())),
            _ => {}
        }
    }
}

impl Shared {
    pub(crate) fn update<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let r = f(&mut self.state.lock().expect("state lock"));
        self.changed.notify_all();
        r
    }
}

/// The write-once claim of a step: who committed it and with which weights. Every commit of
/// step N (delta or anchor, by any publisher) creates `claims/N` first or finds it holding
/// the same weights root; so one step number never means two different weights, whichever
/// kinds two writers use, and a restart can re-commit what its killed predecessor started.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Claim {
    pub(crate) kind: String,
    pub(crate) stream_id: String,
    pub(crate) step: u64,
    pub(crate) generation: u64,
    pub(crate) root: Digest,
}

/// What one step commit writes.
pub(crate) struct Commit<'a> {
    pub(crate) kind: StepKind,
    pub(crate) step: u64,
    pub(crate) base_step: Option<u64>,
    /// The weights root of the step (delta: result root; anchor: weights root).
    pub(crate) root: Digest,
    pub(crate) envelope: Bytes,
    /// (name, bytes); names carry this generation's prefix (the manifest names them so).
    pub(crate) objects: &'a [(String, Bytes)],
    /// The try of this step the manifest's name carries ([`layout::attempt_name`]).
    pub(crate) attempt: u32,
    /// (name, size) of payload objects other processes uploaded (the ranks of a sharded
    /// step): confirmed by the listing like the others, but never re-sent.
    pub(crate) uploaded: &'a [(String, u64)],
}

/// Commits one step. Order: claim, payload objects (parallel, bounded), manifest, a listing
/// that confirms every object is present with its size (re-uploading what is missing), a
/// check that this generation's lease is live and no newer generation exists, then the ready
/// marker. Every object name carries this generation, so nothing collides with a killed
/// predecessor's late writes; the claim and the marker are the only shared keys, and both
/// accept an existing object that holds the same weights root (an idempotent re-commit).
///
/// A try that failed before its marker's request was sent (its uploads or their listing
/// failed, or the lease lapsed) is removed here: no marker can name its objects, whose names
/// are this generation's and try's alone, and GC would keep them for as long as this
/// generation's lease is live (an incomplete step of a live publisher may be an upload in
/// progress): for a trainer that runs for days, a model's worth per failed anchor. A try that
/// failed at or after its marker's request is left alone (the marker may have landed: GC
/// removes its objects as strays or as an incomplete step once it can tell), and so is one
/// that found objects of its names holding other bytes (not provably this process's).
pub(crate) async fn commit_step(ctx: &Ctx, c: Commit<'_>) -> Result<u64, CommitError> {
    commit_step_unmarked(ctx, c).await.map_err(|(e, _)| e)
}

/// [`commit_step`], its error paired with whether no marker of this try can exist (it failed
/// before the marker's request was sent, and not on objects of its names holding other
/// bytes): then nothing of this generation under the step serves a reader, and a sharded
/// committer removes its ranks' parts of the step too.
pub(crate) async fn commit_step_unmarked(ctx: &Ctx, c: Commit<'_>) -> Result<u64, (CommitError, bool)> {
    let mut stage = Stage::Claim;
    let created = Mutex::new(Vec::new());
    let r = commit_try(ctx, &c, &mut stage, &created).await;
    let unmarked = stage != Stage::Marker && !matches!(r, Err(CommitError::Conflict(_)));
    if r.is_err() && unmarked && stage == Stage::Upload {
        // Only what this try created: an existing object it took for its own (a retried
        // request's, by its bytes) could be another process's of the same generation, on a
        // store without conditional writes (found by review). A lost response's object is
        // left for GC.
        let keys = created.into_inner().unwrap_or_else(|e| e.into_inner());
        let n = keys.len();
        if delete_within(&ctx.bucket, keys, CLEANUP_BUDGET).await {
            info!(step = c.step, objects = n, "removed the objects of the failed try (no marker names them)");
        } else {
            warn!(step = c.step, "the failed try's objects were not all removed in time; GC removes the rest later");
        }
    }
    r.map_err(|e| (e, unmarked))
}

/// Longest one removal of objects no step uses may take ([`delete_all`] or
/// [`delete_within`]: a failed try's objects, a refused sharded step's parts, slices once their anchor is committed or given up,
/// a sharded step's delta objects once it is committed as an anchor): it runs before the
/// uploader's next step (and a sharded committer's), and in an outage each delete may retry
/// for the store's whole budget. What is left, GC removes once the lease lapses.
pub(crate) const CLEANUP_BUDGET: Duration = Duration::from_secs(10);

/// How far a commit got: what its failure leaves in the bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Claiming the step: nothing of this try uploaded yet.
    Claim,
    /// Uploading and confirming the payload and manifest: no marker request sent.
    Upload,
    /// The marker's request was sent (it may have landed whatever its response said).
    Marker,
}

/// Deletes `keys`, `concurrency` at a time (best effort: what is left, e.g. where a request
/// given up on lands after its delete, GC collects once this generation's lease lapses).
/// At most [`CLEANUP_BUDGET`] (before, only the failed try's and the refused step's removals
/// were bounded, and an outage held a sharded committer at the others); returns whether it
/// finished within it, and warns when it did not.
pub(crate) async fn delete_all(bucket: &Bucket, keys: Vec<String>) -> bool {
    let n = keys.len();
    let done = delete_within(bucket, keys, CLEANUP_BUDGET).await;
    if !done {
        warn!(objects = n, "removing objects no step uses took too long; GC removes the rest later");
    }
    done
}

/// [`delete_all`] within `budget`, silent when that runs out (the caller's warning names
/// what was left).
pub(crate) async fn delete_within(bucket: &Bucket, keys: Vec<String>, budget: Duration) -> bool {
    let conc = bucket.options().concurrency.max(1);
    let run = stream::iter(keys).for_each_concurrent(conc, |k| async move {
        if let Err(e) = bucket.delete(&k).await {
            if !e.is_not_found() {
                warn!(key = %k, error = %e, "could not delete an object no step uses; GC removes it later");
            }
        }
    });
    tokio::time::timeout(budget, run).await.is_ok()
}

async fn commit_try(
    ctx: &Ctx,
    c: &Commit<'_>,
    stage: &mut Stage,
    created: &Mutex<Vec<String>>,
) -> Result<u64, CommitError> {
    let bucket = &ctx.bucket;
    let g = ctx.generation;
    claim_step(ctx, c.step, c.root).await?;
    *stage = Stage::Upload;
    let conc = bucket.options().concurrency.max(1);
    let manifest_name = layout::attempt_name(g, c.attempt, "manifest.json");
    let mut all: Vec<(String, Bytes)> = c.objects.to_vec();
    // Saturating: the sizes of `uploaded` come from other processes through the bucket.
    let payload: u64 = all
        .iter()
        .map(|(_, b)| b.len() as u64)
        .chain(c.uploaded.iter().map(|(_, n)| *n))
        .fold(0u64, u64::saturating_add);
    let env_sha = Digest::of(&c.envelope);
    // Payload first, the manifest after it, so a listed manifest implies its payload was sent.
    let mut pending: Vec<(String, Bytes)> = std::mem::take(&mut all);
    for round in 0..3 {
        put_own(bucket, c.kind, c.step, &pending, conc, Some(created)).await?;
        put_own(bucket, c.kind, c.step, &[(manifest_name.clone(), c.envelope.clone())], 1, Some(created)).await?;
        let listed: std::collections::HashMap<String, u64> = bucket
            .list(&layout::object(c.kind, c.step, ""))
            .await?
            .into_iter()
            .filter_map(|o| layout::parse_step_key(&o.key).and_then(|(_, _, n)| n).map(|n| (n, o.size)))
            .collect();
        if let Some((n, _)) = c.uploaded.iter().find(|(n, size)| listed.get(n) != Some(size)) {
            return Err(CommitError::Unconfirmed(format!(
                "step {}: {n} of a rank is not in the bucket with its size; not committed",
                c.step
            )));
        }
        let expected = c.objects.iter().cloned();
        let missing: Vec<(String, Bytes)> = expected
            .chain(std::iter::once((manifest_name.clone(), c.envelope.clone())))
            .filter(|(n, b)| listed.get(n) != Some(&(b.len() as u64)))
            .collect();
        if missing.is_empty() {
            pending.clear();
            break;
        }
        warn!(
            step = c.step,
            round,
            missing = missing.len(),
            "objects of the step are not in the bucket; uploading them again"
        );
        pending = missing.into_iter().filter(|(n, _)| *n != manifest_name).collect();
        // A deleted manifest is re-created by the next round's put_own.
        let _ = bucket.delete(&layout::object(c.kind, c.step, &manifest_name)).await;
        if round == 2 {
            return Err(CommitError::Unconfirmed(format!(
                "step {}: {} objects could not be confirmed in the bucket; not committed",
                c.step,
                pending.len()
            )));
        }
    }
    let lease_until = ctx.check_lease(c.step)?;
    let marker = ReadyMarker {
        kind: "ready".into(),
        stream_id: ctx.stream_id.clone(),
        of: c.kind,
        step: c.step,
        base_step: c.base_step,
        manifest_sha256: env_sha,
        payload_bytes: payload,
        manifest: Some(manifest_name),
    };
    let mb = Bytes::from(serde_json::to_vec(&marker).expect("marker serializes"));
    // The marker lands while the lease is live, or its request is given up (found by review:
    // its retries could run for `retry_timeout`, past the lease, and a GC with a short grace
    // could then delete the step's objects as an abandoned upload just before the marker
    // naming them landed). GC counts a lease live for its TTL from its `Last-Modified` and a
    // second (stores round that down to the second), which is never before `lease_until`,
    // measured from before the renewal was sent. Given up, the step is unconfirmed, as after
    // a lost response: `flush` looks for the marker and publishes the step again if it is
    // not there.
    let left = lease_until.saturating_duration_since(Instant::now());
    *stage = Stage::Marker;
    let put = tokio::time::timeout(left, bucket.put_create(&layout::ready(c.kind, c.step), mb)).await;
    let put = put.map_err(|_| {
        CommitError::Unconfirmed(format!(
            "step {}: the ready marker was not written before the publisher's lease ran out; not confirmed",
            c.step
        ))
    })?;
    match put {
        Ok(()) => {}
        Err(e) if e.is_already_exists() => {
            // Committed before: by this process's own retried request, or by a killed
            // predecessor whose marker landed late. Same weights: done; else a conflict.
            let theirs = ctx.committed_root(c.kind, c.step).await?;
            if theirs != Some(c.root) {
                return Err(CommitError::Conflict(format!(
                    "{} {} is already committed with other weights",
                    kind_name(c.kind),
                    c.step
                )));
            }
            info!(step = c.step, "step was already committed with the same weights");
        }
        Err(e) => return Err(e.into()),
    }
    Ok(payload.saturating_add(c.envelope.len() as u64))
}

fn kind_name(k: StepKind) -> &'static str {
    match k {
        StepKind::Delta => "delta",
        StepKind::Anchor => "anchor",
    }
}

/// Largest object `put_own` compares byte for byte with an existing one of its name.
const OWN_COMPARE_MAX: u64 = 64 << 20;

/// Write-once puts of this generation's objects. An object that already exists carries this
/// generation's name, so only this process wrote it (a retried request that landed): it is
/// accepted when its size matches. The keys this call created (not those it accepted) are
/// added to `created`.
pub(crate) async fn put_own(
    bucket: &Bucket,
    kind: StepKind,
    step: u64,
    objects: &[(String, Bytes)],
    conc: usize,
    created: Option<&Mutex<Vec<String>>>,
) -> Result<(), CommitError> {
    stream::iter(objects.iter().map(Ok::<_, CommitError>))
        .try_for_each_concurrent(conc, |(name, bytes)| async move {
            let key = layout::object(kind, step, name);
            match bucket.put_create(&key, bytes.clone()).await {
                Ok(()) => {
                    if let Some(c) = created {
                        c.lock().unwrap_or_else(|e| e.into_inner()).push(key);
                    }
                    Ok(())
                }
                // Ours, from a retried PUT whose response was lost, only if it holds these
                // bytes: an object of the same name and size may be another process's (its
                // manifest differs in its creation time alone), which readers would then
                // check against this commit's marker and refuse for good. Compared whole up
                // to OWN_COMPARE_MAX (manifests, segments); larger shards by size, as their
                // names are this generation's and try's alone.
                Err(e) if e.is_already_exists() => match bucket.head(&key).await {
                    Ok(info) if info.size != bytes.len() as u64 => {
                        Err(CommitError::Conflict(format!("{key} exists with another size")))
                    }
                    Ok(_) if bytes.len() as u64 > OWN_COMPARE_MAX => Ok(()),
                    Ok(_) => match bucket.get_limited(&key, OWN_COMPARE_MAX).await {
                        Ok(b) if b == *bytes => Ok(()),
                        Ok(_) => Err(CommitError::Conflict(format!(
                            "{key} exists with other bytes (another process wrote under this generation's names)"
                        ))),
                        Err(e) => Err(e.into()),
                    },
                    Err(e) => Err(e.into()),
                },
                Err(e) => Err(e.into()),
            }
        })
        .await
}

/// Creates `claims/N`, or accepts an existing claim for the same weights root.
pub(crate) async fn claim_step(ctx: &Ctx, step: u64, root: Digest) -> Result<(), CommitError> {
    let claim =
        Claim { kind: "claim".into(), stream_id: ctx.stream_id.clone(), step, generation: ctx.generation, root };
    let key = layout::claim(step);
    let mine = |root: Digest| {
        ctx.shared.update(|s| {
            s.claimed.insert(step, root);
            while s.claimed.len() > CLAIMS_KEPT {
                s.claimed.pop_first();
            }
        })
    };
    match ctx.bucket.put_create(&key, Bytes::from(serde_json::to_vec(&claim).expect("claim serializes"))).await {
        Ok(()) => {
            mine(root);
            Ok(())
        }
        Err(e) if e.is_already_exists() => {
            let b = ctx.bucket.get_limited(&key, 64 << 10).await?;
            match serde_json::from_slice::<Claim>(&b) {
                Ok(c) if c.root == root && c.step == step && c.stream_id == ctx.stream_id => {
                    // Its own claim whose create response was lost counts as made here.
                    if c.generation == ctx.generation {
                        mine(root);
                    }
                    Ok(())
                }
                // Found by review: a follower killed after its claim, restarted on a checkpoint
                // saved again with other weights, stopped at this step for good (every restart
                // hit the same claim). An older generation whose lease ran out (killed, or
                // stopped) cannot commit it any more; a live one is a second publisher.
                Ok(c) if c.generation < ctx.generation
                    && c.stream_id == ctx.stream_id
                    && !lease_live(ctx, c.generation).await? =>
                {
                    Err(CommitError::Taken(format!(
                        "step {step} was claimed by an earlier publisher (generation {}, stopped before committing it) with other weights (root {})",
                        c.generation,
                        &c.root.to_hex()[..12]
                    )))
                }
                // This process's own earlier try, with other weights (a lost step published
                // again with the caller's new weights; found by review: taken for a second
                // publisher, it stopped this one for good). The claim is write-once, so the step
                // cannot be published with these weights; later steps can. A claim of this
                // generation that this process did not make is another process's: a conflict.
                Ok(c) if c.generation == ctx.generation
                    && c.stream_id == ctx.stream_id
                    && ctx.shared.state.lock().expect("state lock").claimed.get(&step) == Some(&c.root) =>
                {
                    Err(CommitError::Taken(format!(
                        "step {step} was claimed by this publisher's failed try with other weights (root {}); publish a later step",
                        &c.root.to_hex()[..12]
                    )))
                }
                Ok(c) if c.generation < ctx.generation && c.stream_id == ctx.stream_id => Err(CommitError::Claimed(format!(
                    "step {step} is already claimed by publisher generation {} with other weights (root {}); publish a later step",
                    c.generation,
                    &c.root.to_hex()[..12]
                ))),
                Ok(c) => Err(CommitError::Conflict(format!(
                    "step {step} is already claimed by publisher generation {} with other weights (root {}); publish a later step",
                    c.generation,
                    &c.root.to_hex()[..12]
                ))),
                Err(_) => Err(CommitError::Conflict(format!("{key} exists and is not a claim"))),
            }
        }
        Err(e) => Err(e.into()),
    }
}

/// Whether generation `g`'s lease is live: its last write plus its TTL is after this
/// generation's own last lease write (the bucket's clock on both sides; ours is at most a
/// quarter TTL old, which only makes theirs look live longer).
async fn lease_live(ctx: &Ctx, g: u64) -> Result<bool, CommitError> {
    let key = layout::lease(g);
    let theirs = match ctx.bucket.head(&key).await {
        Ok(i) => i,
        Err(e) if e.is_not_found() => return Ok(false),
        Err(e) => return Err(e.into()),
    };
    let ttl = match ctx.bucket.get_limited(&key, 64 << 10).await {
        Ok(b) => layout::lease_ttl(&b),
        // Over-sized: says no TTL that counts, as for GC.
        Err(driftless_store::Error::TooLarge { .. }) => Duration::ZERO,
        Err(e) if e.is_not_found() => return Ok(false),
        Err(e) => return Err(e.into()),
    };
    let now = ctx.bucket.head(&layout::lease(ctx.generation)).await?.last_modified;
    Ok(theirs.last_modified + ttl > now)
}

pub(crate) struct Ctx {
    pub(crate) bucket: Bucket,
    pub(crate) stream_id: String,
    pub(crate) key: Option<Keypair>,
    pub(crate) shared: Arc<Shared>,
    /// This publisher's generation (its lease is `writers/<generation>`).
    pub(crate) generation: u64,
    pub(crate) lease_ttl: Duration,
    /// Reads this stream's own committed steps (idempotent re-commits, seeding).
    pub(crate) reader: StreamReader,
    /// Ranks of a sharded publisher this generation commits for (`None`: a plain publisher).
    pub(crate) world_size: Option<u64>,
    /// Serializes latest.json writes so an older hint never overwrites a newer one.
    pub(crate) latest: tokio::sync::Mutex<(Option<u64>, Option<u64>)>,
}

/// The lease object of a publisher generation: GC leaves the objects of steps this
/// generation is writing alone while `renewed_at_ms + ttl_ms` is in the future.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Lease {
    /// Always `"lease"`.
    pub kind: String,
    /// Stream id.
    pub stream_id: String,
    /// Generation.
    pub generation: u64,
    /// Host name and process id, for operators.
    pub holder: String,
    /// When it was last renewed (publisher clock).
    pub renewed_at_ms: u64,
    /// How long it stays live after a renewal.
    pub ttl_ms: u64,
    /// Set by the committer of a sharded publisher: the number of ranks whose parts make a
    /// step. The other ranks of the group find their generation by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<u64>,
    /// Set by a sharded committer while it commits a step (renewals carry it): the other
    /// ranks wait for that step's outcome past their first deadline only while a renewed
    /// lease names the step (an anchor step's gather and encode can take many minutes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub committing: Option<u64>,
}

/// The lease object of `generation`, renewed now.
pub(crate) fn lease_bytes(
    stream_id: &str,
    generation: u64,
    ttl: Duration,
    world_size: Option<u64>,
    committing: Option<u64>,
) -> Bytes {
    let l = Lease {
        kind: "lease".into(),
        stream_id: stream_id.to_string(),
        generation,
        holder: format!("{}:{}", hostname(), std::process::id()),
        renewed_at_ms: now_ms(),
        ttl_ms: ttl.as_millis() as u64,
        world_size,
        committing,
    };
    Bytes::from(serde_json::to_vec(&l).expect("lease serializes"))
}

impl Ctx {
    pub(crate) fn lease_bytes(&self) -> Bytes {
        let committing = self.shared.state.lock().map(|s| s.committing).unwrap_or(None);
        lease_bytes(&self.stream_id, self.generation, self.lease_ttl, self.world_size, committing)
    }

    /// Fails unless this generation's lease is live (renewed within its TTL, with a margin of
    /// a quarter TTL for the marker write) and no newer generation was seen.
    /// Returns when the lease runs out, by this host's clock.
    fn check_lease(&self, step: u64) -> Result<Instant, CommitError> {
        let s = self.shared.state.lock().expect("state lock");
        if let Some((_, d)) = &s.conflict {
            return Err(CommitError::Conflict(d.clone()));
        }
        // Released (the publisher stopped): GC may already be removing this generation's
        // uncommitted objects, so no marker of it may land now.
        match s.lease_until.filter(|&t| !s.released && t > Instant::now() + self.lease_ttl / 4) {
            Some(t) => Ok(t),
            None => Err(CommitError::Unconfirmed(format!(
                "step {step}: the publisher's lease could not be renewed in time; not committed"
            ))),
        }
    }

    /// The weights root of a committed step as its manifest says (`None` when it is not
    /// readable as this stream's step).
    pub(crate) async fn committed_root(&self, kind: StepKind, step: u64) -> Result<Option<Digest>, CommitError> {
        let r = match kind {
            StepKind::Delta => self.reader.delta(step).await.map(|(m, _)| (m.stream_id, m.result_root)),
            StepKind::Anchor => self.reader.anchor(step).await.map(|(m, _)| (m.stream_id, m.weights_root)),
        };
        match r {
            Ok((sid, root)) if sid == self.stream_id => Ok(Some(root)),
            Ok(_) => Ok(None),
            // No marker: not committed (the common case for a step never published).
            Err(driftless_store::stream::StreamError::Store(e)) if e.is_not_found() => Ok(None),
            Err(e) if e.is_retryable() => Err(CommitError::Unconfirmed(format!("reading committed step {step}: {e}"))),
            // The bucket refused the read (credentials, a size cap): unknown, not "another
            // writer's" (found by review: callers take `None` at an existing marker for a
            // conflict, which stops the publisher for good).
            Err(driftless_store::stream::StreamError::Store(e)) => Err(CommitError::Store(e)),
            // Read, and not this stream's step: corrupt, forged, another run's.
            Err(_) => Ok(None),
        }
    }

    /// The weights root step `step` is committed with, as a delta or as an anchor. A delta
    /// that could not be read (an outage) is "not known", never "not committed": found by
    /// review, `seed` then said a committed step was not one, as an error not worth retrying.
    pub(crate) async fn committed_root_of_step(&self, step: u64) -> Result<Option<Digest>, CommitError> {
        match self.committed_root(StepKind::Delta, step).await {
            Ok(Some(r)) => Ok(Some(r)),
            Ok(None) => self.committed_root(StepKind::Anchor, step).await,
            Err(e) => match self.committed_root(StepKind::Anchor, step).await {
                Ok(Some(r)) => Ok(Some(r)),
                _ => Err(e),
            },
        }
    }

    /// Whether lost step `step` (weights root `root`) is committed after all (its marker
    /// landed, the response was lost), and as which kind; an error when it is committed with
    /// other weights. Only a marker that is not there means "not committed": any other read
    /// failure is an error, and nothing is published again on a guess.
    pub(crate) async fn committed_kind(&self, step: u64, root: Digest) -> Result<Option<StepKind>, CommitError> {
        for kind in [StepKind::Delta, StepKind::Anchor] {
            match self.bucket.head(&layout::ready(kind, step)).await {
                Ok(_) => {}
                Err(e) if e.is_not_found() => continue,
                Err(e) => return Err(CommitError::Unconfirmed(format!("reading the marker of step {step}: {e}"))),
            }
            return match self.committed_root(kind, step).await? {
                Some(r) if r == root => Ok(Some(kind)),
                Some(_) => Err(CommitError::Conflict(format!(
                    "{} {step} is already committed with other weights",
                    kind_name(kind)
                ))),
                // Read as "not this stream's" or "not there": look again. Gone since the HEAD
                // (GC removed it): not known, and a retry reads again; a conflict here would
                // stop the publisher for good on a race. Unreadable now: that failure, retried.
                None => match self.bucket.head(&layout::ready(kind, step)).await {
                    Err(e) if e.is_not_found() => Err(CommitError::Unconfirmed(format!(
                        "the marker of {} {step} went away while it was read; not known whether committed",
                        kind_name(kind)
                    ))),
                    Err(e) => Err(CommitError::Unconfirmed(format!("reading the marker of step {step}: {e}"))),
                    // Readable, and not this stream's step (another run's marker, junk, a bad
                    // signature): the marker is write-once, so no retry commits the step (found
                    // by review: reported as retryable, a trainer's retries went on for ever). A
                    // conflict, as at the marker's write ([`commit_step`]).
                    Ok(_) => Err(CommitError::Conflict(format!(
                        "the marker of {} {step} is there and is not this stream's (another writer's, or corrupt)",
                        kind_name(kind)
                    ))),
                },
            };
        }
        Ok(None)
    }

    pub(crate) async fn write_latest(&self, delta: Option<u64>, anchor: Option<u64>) {
        let mut cur = self.latest.lock().await;
        cur.0 = cur.0.max(delta);
        cur.1 = cur.1.max(anchor);
        // The newest markers, read back as agents would read them (two small GETs per step),
        // so a follower one step behind plans from the hint alone.
        let marker = |kind, step: Option<u64>| async move {
            let b = self.bucket.get_limited(&layout::ready(kind, step?), 64 << 10).await.ok()?;
            ReadyMarker::from_slice(&b).ok().filter(|m| m.stream_id == self.stream_id && m.of == kind)
        };
        let hint = LatestHint {
            kind: "latest".into(),
            stream_id: self.stream_id.clone(),
            delta: cur.0,
            anchor: cur.1,
            updated_at_ms: now_ms(),
            delta_marker: marker(StepKind::Delta, cur.0).await,
            anchor_marker: marker(StepKind::Anchor, cur.1).await,
        };
        let payload = serde_json::to_vec(&hint).expect("hint serializes");
        let env = match &self.key {
            Some(k) => k.seal(&payload),
            None => driftless_format::sign::seal_unsigned(&payload),
        };
        if let Ok(env) = env {
            // The hint is advisory: readers fall back to listing markers, so a failed write is
            // logged, not fatal.
            if let Err(e) = self.bucket.put(layout::LATEST, Bytes::from(env)).await {
                warn!(error = %e, "could not update latest.json");
            }
        }
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_else(|_| "?".into())
}

/// Renews the lease every quarter TTL, and fences this publisher when a newer generation
/// appears (a second publisher started on the stream: the newer one owns it).
pub(crate) async fn lease_loop(ctx: Arc<Ctx>) {
    loop {
        tokio::time::sleep(ctx.lease_ttl / 4).await;
        if ctx.shared.state.lock().expect("state lock").released {
            return;
        }
        let sent = Instant::now();
        match ctx.bucket.put(&layout::lease(ctx.generation), ctx.lease_bytes()).await {
            Ok(()) => ctx.shared.update(|s| s.lease_until = Some(sent + ctx.lease_ttl)),
            Err(e) => warn!(error = %e, "could not renew the publisher lease"),
        }
        if let Ok(list) = ctx.bucket.list(layout::leases_prefix()).await {
            if let Some(newer) =
                list.iter().filter_map(|o| layout::parse_claim_or_lease(&o.key)).filter(|&g| g > ctx.generation).max()
            {
                warn!(generation = ctx.generation, newer, "a newer publisher generation exists; this publisher stops");
                ctx.shared.update(|s| {
                    if s.conflict.is_none() {
                        s.conflict = Some((
                            s.tip.unwrap_or(0),
                            format!(
                                "publisher generation {newer} started on this stream after this one ({})",
                                ctx.generation
                            ),
                        ));
                    }
                });
                return;
            }
        }
    }
}

/// Releases this generation's lease when the publisher stops (closed, aborted or dropped):
/// rewritten with a TTL of zero, so it is expired at once and GC may clean up after the
/// generation, but never deleted. Generations are numbered one past the newest lease (GC
/// keeps the newest), and a deleted newest lease let the next publisher take the same
/// generation again, whose same-named objects it then took for its own: found by review, an
/// anchor committed over a dead process's manifest of the same name, unreadable for good.
pub(crate) async fn release_lease(ctx: &Ctx) {
    ctx.shared.update(|s| s.released = true);
    let bytes = lease_bytes(&ctx.stream_id, ctx.generation, Duration::ZERO, ctx.world_size, None);
    let key = layout::lease(ctx.generation);
    let put = ctx.bucket.put(&key, bytes);
    if let Ok(Err(e)) = tokio::time::timeout(Duration::from_secs(5), put).await {
        warn!(error = %e, generation = ctx.generation, "could not release the publisher lease; it expires after its TTL");
    }
}

/// The ordered delta uploader: one job at a time, so markers appear in step order.
pub(crate) async fn delta_loop(ctx: Arc<Ctx>, mut rx: tokio::sync::mpsc::Receiver<Job>) {
    while let Some(job) = rx.recv().await {
        match job {
            Job::AnchorScheduled(step, ready) => {
                let ok = ready.await.unwrap_or(false);
                ctx.shared.update(|s| {
                    // Deltas queued on this state are dropped if its anchor failed.
                    s.tip = if ok { Some(step) } else { None };
                    s.queued -= 1;
                });
            }
            Job::Delta(d) => {
                let (reachable, fenced) = {
                    let s = ctx.shared.state.lock().expect("state lock");
                    (s.tip == Some(d.base_step), s.conflict.is_some())
                };
                if fenced {
                    ctx.shared.update(|s| s.queued -= 1);
                    continue;
                }
                if !reachable {
                    // Its base never reached the bucket: readers could not use it.
                    warn!(step = d.step, base = d.base_step, "dropping delta whose base is not in the bucket");
                    ctx.shared.update(|s| {
                        s.dropped += 1;
                        s.need_anchor = true;
                        s.queued -= 1;
                    });
                    continue;
                }
                let t = Instant::now();
                let span = info_span!("upload_delta", step = d.step, base = d.base_step);
                let c = Commit {
                    kind: StepKind::Delta,
                    step: d.step,
                    base_step: Some(d.base_step),
                    root: d.root,
                    envelope: d.envelope,
                    objects: &d.segments,
                    attempt: 0,
                    uploaded: &[],
                };
                let r = commit_caught(&ctx, c).instrument(span).await;
                match r {
                    Ok(bytes) => {
                        info!(step = d.step, bytes, secs = t.elapsed().as_secs_f64(), "delta ready");
                        ctx.shared.update(|s| {
                            s.tip = Some(d.step);
                            s.last_delta = Some(d.step);
                            s.bytes_uploaded += bytes;
                        });
                        ctx.write_latest(Some(d.step), None).await;
                        ctx.shared.update(|s| s.queued -= 1);
                    }
                    Err(e) => {
                        warn!(step = d.step, error = %e, "delta upload failed; next publish will anchor");
                        ctx.shared.update(|s| {
                            s.tip = None;
                            s.record_failure("delta", d.step, &e);
                            s.queued -= 1;
                        });
                    }
                }
            }
        }
    }
}

/// [`commit_step`], a panic in it taken for a failed step (found by review: a panic ended the
/// upload task with the step still counted as queued, and `flush`, `close` and drop of the
/// publisher then waited for it for ever). A later attempt (`flush` publishes the newest
/// step again) may succeed.
async fn commit_caught(ctx: &Ctx, c: Commit<'_>) -> Result<u64, CommitError> {
    use futures::FutureExt;
    let step = c.step;
    std::panic::AssertUnwindSafe(commit_step(ctx, c)).catch_unwind().await.unwrap_or_else(|_| {
        Err(CommitError::Unconfirmed(format!("step {step}: the upload panicked (a bug: please report it)")))
    })
}

/// Uploads one spooled anchor.
pub(crate) async fn anchor_upload(ctx: Arc<Ctx>, mut job: AnchorJob) {
    let t = Instant::now();
    let done = job.done.take();
    let span = info_span!("upload_anchor", step = job.step);
    let c = Commit {
        kind: StepKind::Anchor,
        step: job.step,
        base_step: None,
        root: job.root,
        envelope: job.envelope.clone(),
        objects: &job.objects,
        attempt: job.attempt,
        uploaded: &[],
    };
    let r = commit_caught(&ctx, c).instrument(span).await;
    match r {
        Ok(bytes) => {
            info!(step = job.step, bytes, secs = t.elapsed().as_secs_f64(), "anchor ready");
            ctx.shared.update(|s| {
                // Two anchors can be in flight: an older one finishing last does not lower it.
                s.last_anchor = s.last_anchor.max(Some(job.step));
                s.bytes_uploaded += bytes;
            });
            ctx.write_latest(None, Some(job.step)).await;
            if let Some(d) = done {
                let _ = d.send(true);
            }
        }
        Err(e) => {
            warn!(step = job.step, error = %e, "anchor upload failed; next publish will anchor");
            ctx.shared.update(|s| s.record_failure("anchor", job.step, &e));
            if let Some(d) = done {
                let _ = d.send(false);
            }
        }
    }
    ctx.shared.update(|s| s.anchors_in_flight -= 1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use driftless_store::object_store::memory::InMemory;
    use driftless_store::{FaultKind, FaultOp, FaultyStore, StoreOptions};

    /// A removal of objects no step uses ends at its budget when a delete hangs (an outage), and
    /// says so; the deletes that answer are done meanwhile.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_removal_ends_at_its_budget() {
        let faults = Arc::new(FaultyStore::new(Arc::new(InMemory::new())));
        let bucket = Bucket::from_store(faults.clone(), "", &StoreOptions::default());
        for k in ["a", "b"] {
            bucket.put(k, Bytes::from_static(b"x")).await.unwrap();
        }
        faults.inject(FaultOp::Delete, "a", 1, FaultKind::Slow(Duration::from_secs(3600)));
        let t = std::time::Instant::now();
        let budget = Duration::from_millis(300);
        assert!(!delete_within(&bucket, vec!["a".into(), "b".into()], budget).await);
        assert!(t.elapsed() >= budget && t.elapsed() < budget * 10, "{:?}", t.elapsed());
        assert!(bucket.head("b").await.unwrap_err().is_not_found(), "the answered delete was done");
        assert!(delete_within(&bucket, vec!["a".into()], budget).await, "no hang: within the budget");
        assert!(bucket.head("a").await.unwrap_err().is_not_found());
    }
}
