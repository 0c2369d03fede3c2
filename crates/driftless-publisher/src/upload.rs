//! Background uploads: the ordered delta queue and anchor uploads, on the publisher's own
//! runtime. Commit order per step: payload objects, manifest, ready marker, latest hint.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use bytes::Bytes;
use driftless_format::manifest::{now_ms, LatestHint, ReadyMarker, StepKind};
use driftless_format::{Digest, Keypair};
use driftless_store::{layout, Bucket};
use futures::stream::{self, TryStreamExt};
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
    pub(crate) envelope: Bytes,
    pub(crate) segments: Vec<(String, Bytes)>,
}

/// A spooled anchor ready to upload.
pub(crate) struct AnchorJob {
    pub(crate) step: u64,
    pub(crate) envelope: Bytes,
    /// (object name, bytes) — bytes are usually a map of a spool file.
    pub(crate) objects: Vec<(String, Bytes)>,
    pub(crate) _spool: Option<tempfile::TempDir>,
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
    pub(crate) dropped: u64,
    pub(crate) last_error: Option<String>,
    /// Set on a write-once conflict: another writer owns the stream; the publisher stops.
    pub(crate) conflict: Option<(u64, String)>,
}

#[derive(Debug, Default)]
pub(crate) struct Shared {
    pub(crate) state: Mutex<State>,
    pub(crate) changed: Condvar,
}

impl State {
    /// Records a failed commit: counts it, and fences the publisher on a write-once conflict.
    fn record_failure(&mut self, what: &str, step: u64, e: &driftless_store::Error) {
        self.need_anchor = true;
        self.failures += 1;
        self.last_error = Some(format!("{what} {step}: {e}"));
        if e.is_already_exists() && self.conflict.is_none() {
            self.conflict = Some((step, e.to_string()));
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

/// Writes a step's objects (in parallel, bounded), then its manifest, then its marker.
async fn commit_step(
    bucket: &Bucket,
    kind: StepKind,
    step: u64,
    base_step: Option<u64>,
    stream_id: &str,
    envelope: Bytes,
    objects: &[(String, Bytes)],
) -> driftless_store::Result<u64> {
    let conc = bucket.options().concurrency.max(1);
    let payload: u64 = objects.iter().map(|(_, b)| b.len() as u64).sum();
    stream::iter(objects.iter().map(Ok::<_, driftless_store::Error>))
        .try_for_each_concurrent(conc, |(name, bytes)| async move {
            bucket.put_create(&layout::object(kind, step, name), bytes.clone()).await
        })
        .await?;
    let env_sha = Digest::of(&envelope);
    bucket.put_create(&layout::manifest(kind, step), envelope.clone()).await?;
    let marker = ReadyMarker {
        kind: "ready".into(),
        stream_id: stream_id.to_string(),
        of: kind,
        step,
        base_step,
        manifest_sha256: env_sha,
        payload_bytes: payload,
    };
    let mb = Bytes::from(serde_json::to_vec(&marker).expect("marker serializes"));
    bucket.put_create(&layout::ready(kind, step), mb).await?;
    Ok(payload + envelope.len() as u64)
}

pub(crate) struct Ctx {
    pub(crate) bucket: Bucket,
    pub(crate) stream_id: String,
    pub(crate) key: Option<Keypair>,
    pub(crate) shared: Arc<Shared>,
    /// Serializes latest.json writes so an older hint never overwrites a newer one.
    pub(crate) latest: tokio::sync::Mutex<(Option<u64>, Option<u64>)>,
}

impl Ctx {
    async fn write_latest(&self, delta: Option<u64>, anchor: Option<u64>) {
        let mut cur = self.latest.lock().await;
        cur.0 = cur.0.max(delta);
        cur.1 = cur.1.max(anchor);
        // The newest markers, read back as agents would read them (two small GETs per step),
        // so a follower one step behind plans from the hint alone.
        let marker = |kind, step: Option<u64>| async move {
            let b = self.bucket.get(&layout::ready(kind, step?)).await.ok()?;
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
                let r = commit_step(
                    &ctx.bucket,
                    StepKind::Delta,
                    d.step,
                    Some(d.base_step),
                    &ctx.stream_id,
                    d.envelope,
                    &d.segments,
                )
                .instrument(span)
                .await;
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

/// An anchor-only step (first publish, restart, recovery) has no delta, so nothing else
/// would collide with a second publisher's delta of the same step: the anchor and that delta
/// would both become ready with different weights. Creating the step's delta manifest key
/// first (a small claim, never covered by a ready marker) makes the two writers collide on
/// one write-once key, so one of them stops with a conflict.
async fn claim_delta_slot(ctx: &Ctx, step: u64) -> driftless_store::Result<()> {
    let claim = serde_json::json!({"kind": "claim", "stream_id": ctx.stream_id, "step": step, "by": "anchor"});
    ctx.bucket.put_create(&layout::manifest(StepKind::Delta, step), Bytes::from(claim.to_string())).await
}

/// Uploads one spooled anchor.
pub(crate) async fn anchor_upload(ctx: Arc<Ctx>, mut job: AnchorJob) {
    let t = Instant::now();
    let done = job.done.take();
    let span = info_span!("upload_anchor", step = job.step);
    let r = async {
        if done.is_some() {
            claim_delta_slot(&ctx, job.step).await?;
        }
        commit_step(&ctx.bucket, StepKind::Anchor, job.step, None, &ctx.stream_id, job.envelope, &job.objects).await
    }
    .instrument(span)
    .await;
    match r {
        Ok(bytes) => {
            info!(step = job.step, bytes, secs = t.elapsed().as_secs_f64(), "anchor ready");
            ctx.shared.update(|s| {
                s.last_anchor = Some(job.step);
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
