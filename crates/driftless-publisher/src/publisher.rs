//! The trainer-facing API.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use driftless_format::manifest::{
    self, AnchorManifest, AnchorShardRef, DeltaManifest, ObjectRef, StepKind, StreamDescriptor,
};
use driftless_format::{anchor, ops, AnchorEncoding, DeltaOptions, Digest, Keypair, Layout, TensorView, TrustSet};
use driftless_store::spool::Spool;
use driftless_store::stream::StreamReader;
use driftless_store::{layout, Bucket, StoreOptions};
use tracing::{info, info_span, warn};

use crate::snapshot::Snapshot;
use crate::upload::{self, AnchorJob, Ctx, DeltaJob, Job, Shared};
use crate::{Error, Result};

/// Configuration of a [`Publisher`].
#[derive(Debug, Clone)]
pub struct PublisherBuilder {
    pub(crate) url: String,
    pub(crate) store: StoreOptions,
    pub(crate) bucket: Option<Bucket>,
    pub(crate) key: Option<Keypair>,
    pub(crate) anchor_every: u64,
    pub(crate) anchor_chain_fraction: f64,
    pub(crate) delta: DeltaOptions,
    pub(crate) anchor_encoding: AnchorEncoding,
    pub(crate) anchor_zstd_level: i32,
    pub(crate) queue_depth: usize,
    pub(crate) new_stream: bool,
    pub(crate) takeover: bool,
    pub(crate) max_shard_bytes: u64,
    pub(crate) spool_dir: Option<PathBuf>,
    pub(crate) extra_files: Vec<(String, Vec<u8>)>,
    pub(crate) lease_ttl: Duration,
    /// Test-only: the step whose background encode fails, and whether by a panic.
    #[cfg(feature = "fault-hooks")]
    pub(crate) encode_fault: Option<(u64, bool)>,
    #[cfg(feature = "fault-hooks")]
    pub(crate) anchor_spool_delay: Duration,
    /// Test-only: the step whose encode thread panics halfway through applying its changes
    /// to a snapshot handed over after an anchor step.
    #[cfg(feature = "fault-hooks")]
    pub(crate) apply_panic: Option<u64>,
}

impl PublisherBuilder {
    /// A publisher for the stream at `url` (see `driftless-store` for URL forms).
    pub fn new(url: impl Into<String>) -> Self {
        PublisherBuilder {
            url: url.into(),
            store: StoreOptions::default(),
            bucket: None,
            key: None,
            anchor_every: 50,
            anchor_chain_fraction: 0.5,
            delta: DeltaOptions::default(),
            anchor_encoding: AnchorEncoding::PlanesZstd,
            anchor_zstd_level: 1,
            queue_depth: 4,
            new_stream: false,
            takeover: false,
            max_shard_bytes: 2 << 30,
            spool_dir: None,
            extra_files: vec![],
            lease_ttl: Duration::from_secs(60),
            #[cfg(feature = "fault-hooks")]
            encode_fault: None,
            #[cfg(feature = "fault-hooks")]
            anchor_spool_delay: Duration::ZERO,
            #[cfg(feature = "fault-hooks")]
            apply_panic: None,
        }
    }
    /// Uses an already opened bucket (tests, fault injection) instead of the URL.
    pub fn with_bucket(mut self, b: Bucket) -> Self {
        self.bucket = Some(b);
        self
    }
    /// Store options (endpoint, retries, concurrency).
    pub fn with_store_options(mut self, o: StoreOptions) -> Self {
        self.store = o;
        self
    }
    /// Signing key. Without one the stream is unsigned and readers need `--allow-unsigned`.
    pub fn with_key(mut self, k: Keypair) -> Self {
        self.key = Some(k);
        self
    }
    /// Anchor every k steps (default 50).
    pub fn with_anchor_every(mut self, k: u64) -> Self {
        self.anchor_every = k.max(1);
        self
    }
    /// Anchor early once the deltas since the last anchor exceed this fraction of the model's
    /// dense size (default 0.5).
    pub fn with_anchor_chain_fraction(mut self, f: f64) -> Self {
        self.anchor_chain_fraction = f;
        self
    }
    /// Delta encoding options.
    pub fn with_delta_options(mut self, d: DeltaOptions) -> Self {
        self.delta = d;
        self
    }
    /// Anchor storage form (default byte planes + zstd).
    pub fn with_anchor_encoding(mut self, e: AnchorEncoding) -> Self {
        self.anchor_encoding = e;
        self
    }
    /// Upload queue depth before steps are coalesced (default 4).
    pub fn with_queue_depth(mut self, n: usize) -> Self {
        self.queue_depth = n.max(1);
        self
    }
    /// Create the stream even if the prefix holds other objects.
    pub fn with_new_stream(mut self, yes: bool) -> Self {
        self.new_stream = yes;
        self
    }
    /// Continue a stream whose descriptor does not list this key, re-signing the descriptor
    /// with it (an operator's explicit decision).
    pub fn with_takeover(mut self, yes: bool) -> Self {
        self.takeover = yes;
        self
    }
    /// Largest shard file of the layout chosen for plain tensor lists (default 2 GiB).
    pub fn with_max_shard_bytes(mut self, n: u64) -> Self {
        self.max_shard_bytes = n;
        self
    }
    /// Directory for anchor spool files (default: the system temp dir).
    pub fn with_spool_dir(mut self, d: impl Into<PathBuf>) -> Self {
        self.spool_dir = Some(d.into());
        self
    }
    /// Small files shipped with every anchor (config.json, tokenizer files). See
    /// [`Publisher::set_extra_files`] for changing them later.
    pub fn with_extra_files(mut self, files: Vec<(String, Vec<u8>)>) -> Self {
        self.extra_files = files;
        self
    }
    /// How long this publisher's lease stays live without renewal (default 60 s; renewed
    /// every quarter of it; between 400 ms and [`driftless_store::layout::MAX_LEASE_TTL`], the
    /// longest GC honours). GC never removes objects of a step under a live lease, and the
    /// publisher never commits a step unless its lease is live.
    pub fn with_lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl.clamp(Duration::from_millis(400), driftless_store::layout::MAX_LEASE_TTL);
        self
    }

    /// Test-only (feature `fault-hooks`): the background encode of a deferred delta of
    /// `step` fails with an error, or panics. Nothing outside the encode can fail there (the
    /// store's faults come from `FaultyStore`), so this is how tests reach that path.
    #[cfg(feature = "fault-hooks")]
    #[doc(hidden)]
    pub fn with_encode_fault(mut self, step: u64, panic: bool) -> Self {
        self.encode_fault = Some((step, panic));
        self
    }

    /// Test-only (feature `fault-hooks`): an anchor thread holds the snapshot this much longer
    /// before it writes the spool, as a large model on a slow disk does, so that tests reach
    /// the publish of a delta while an anchor still reads the snapshot.
    #[cfg(feature = "fault-hooks")]
    #[doc(hidden)]
    pub fn with_anchor_spool_delay(mut self, delay: Duration) -> Self {
        self.anchor_spool_delay = delay;
        self
    }

    /// Test-only (feature `fault-hooks`): the encode thread of `step`, handed the snapshot
    /// after an anchor step, panics halfway through applying the step's changes to it (one
    /// byte of the snapshot changed first), so tests reach a half-changed snapshot.
    #[cfg(feature = "fault-hooks")]
    #[doc(hidden)]
    pub fn with_apply_panic(mut self, step: u64) -> Self {
        self.apply_panic = Some(step);
        self
    }

    /// Opens the bucket, reads or creates the stream descriptor and starts the uploader.
    pub fn build(self) -> Result<Publisher> {
        for (n, _) in &self.extra_files {
            driftless_format::validate_extra_file_name(n)?;
        }
        driftless_format::check_extra_file_sizes(self.extra_files.iter().map(|(n, b)| (n.clone(), b.len() as u64)))?;
        let (rt, bucket) = self.start()?;
        if !bucket.supports_conditional_create() {
            warn!(
                url = bucket.url(),
                "backend has no conditional create: two publishers on this stream would not be detected"
            );
        }
        let (ctx, last_delta, last_anchor) = self.context(&rt, &bucket, None)?;
        let (stream_id, generation, shared) = (ctx.stream_id.clone(), ctx.generation, ctx.shared.clone());
        // Numbering resumes after the newest *committed* step: objects of a step without a
        // marker (a killed predecessor's) carry that generation's names and collide with
        // nothing, so the step can be committed again.
        let last_step = last_delta.max(last_anchor);
        info!(stream_id, last_step, generation, url = bucket.url(), "publisher ready");
        rt.block_on(bucket.put(&layout::lease(generation), ctx.lease_bytes()))?;
        let (tx, rx) = tokio::sync::mpsc::channel(self.queue_depth);
        rt.spawn(upload::delta_loop(ctx.clone(), rx));
        rt.spawn(upload::lease_loop(ctx.clone()));
        Ok(Publisher {
            cfg: self,
            rt: Some(rt),
            tx: Some(tx),
            ctx,
            shared,
            snapshot: None,
            stream_id,
            last_step,
            last_anchor_step: last_anchor,
            pending: None,
            extra_changed: false,
            chain_bytes: 0,
            published: 0,
            coalesced: 0,
            encoding: None,
            handed_over: None,
            retries: 0,
            input_check: None,
        })
    }

    /// The runtime uploads run on, and the bucket.
    pub(crate) fn start(&self) -> Result<(tokio::runtime::Runtime, Bucket)> {
        // Spools of earlier publishers that were killed (a restart after SIGKILL or
        // preemption) are removed now, not at this publisher's first anchor.
        driftless_store::spool::sweep_in(self.spool_dir.as_deref());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("driftless-upload")
            .enable_all()
            .build()?;
        let bucket = match self.bucket.clone() {
            Some(b) => b,
            None => Bucket::open(&self.url, &self.store)?,
        };
        Ok((rt, bucket))
    }

    /// The keys this publisher reads its own stream back with.
    pub(crate) fn trust(&self) -> TrustSet {
        let trust = TrustSet::new().allow_unsigned(self.key.is_none());
        match &self.key {
            Some(k) => trust.with_key(k.public()),
            None => trust,
        }
    }

    /// Opens (or creates) the stream and takes a publisher generation (`world_size`: a
    /// sharded committer's); returns the upload context and the newest ready delta and anchor.
    pub(crate) fn context(
        &self,
        rt: &tokio::runtime::Runtime,
        bucket: &Bucket,
        world_size: Option<u64>,
    ) -> Result<(Arc<Ctx>, Option<u64>, Option<u64>)> {
        let stream_id = rt.block_on(self.open_stream(bucket))?;
        // Signed by this publisher's key, unless it is taking the stream over (the newest
        // steps are then another key's): checked for what can be checked without keys.
        let trust = (!self.takeover).then(|| self.trust());
        let (last_delta, last_anchor) = rt.block_on(async {
            let d = newest_checked(bucket, trust.as_ref(), StepKind::Delta).await?;
            let a = newest_checked(bucket, trust.as_ref(), StepKind::Anchor).await?;
            Ok::<_, Error>((d, a))
        })?;
        // The lease runs from before its first write was sent, as every renewal's does: never
        // later than the bucket's `Last-Modified` + TTL that GC goes by (found by review:
        // taken after the write and its retries, it could be up to a minute later).
        let sent = Instant::now();
        let generation = rt.block_on(acquire_generation(bucket, &stream_id, self.lease_ttl, world_size))?;
        let shared = Arc::new(Shared::default());
        shared.update(|s| {
            s.last_delta = last_delta;
            s.last_anchor = last_anchor;
            s.lease_until = Some(sent + self.lease_ttl);
        });
        let ctx = Arc::new(Ctx {
            bucket: bucket.clone(),
            stream_id,
            key: self.key.clone(),
            shared,
            generation,
            lease_ttl: self.lease_ttl,
            world_size,
            reader: StreamReader::new(bucket.clone(), self.trust()),
            // Start the hint from what the bucket holds, so the first hint after a restart
            // does not forget the ready steps of the previous run.
            latest: tokio::sync::Mutex::new((last_delta, last_anchor)),
        });
        Ok((ctx, last_delta, last_anchor))
    }

    pub(crate) async fn open_stream(&self, bucket: &Bucket) -> Result<String> {
        let reader = StreamReader::new(bucket.clone(), self.trust());
        let my_id = self.key.as_ref().map(|k| k.id().to_string());
        // Stream id of a descriptor taken over: kept, so the chain stays one stream.
        let mut taken_id = None;
        let desc = match reader.descriptor().await {
            Ok(d) => d,
            Err(driftless_store::stream::StreamError::Format(e))
                if e.kind() == driftless_format::ErrorKind::Untrusted =>
            {
                if !self.takeover {
                    return Err(Error::Refused(format!(
                        "the stream at {} is signed by another key ({e}); to continue it, pass --takeover (Python: takeover=True; Rust: with_takeover(true))",
                        bucket.url()
                    )));
                }
                taken_id = unverified_stream_id(bucket).await;
                None
            }
            Err(e) => return Err(e.into()),
        };
        if let Some(d) = desc {
            let mine = match &my_id {
                Some(id) => d.trusted_keys.iter().any(|k| k == id),
                None => d.trusted_keys.is_empty(),
            };
            if mine || !self.takeover {
                if !mine {
                    return Err(Error::Refused(format!(
                        "stream {} does not list this publisher's key; to continue it, pass --takeover (Python: takeover=True; Rust: with_takeover(true))",
                        d.stream_id
                    )));
                }
                return Ok(d.stream_id);
            }
            taken_id = Some(d.stream_id);
        } else if !self.new_stream && !self.takeover {
            // Listed only without a stream.json (found by review: every reopen listed the
            // whole stream, and one with more keys than a listing may return could not be
            // reopened at all).
            let held = match bucket.list("").await {
                Ok(v) => (!v.is_empty()).then(|| v.len().to_string()),
                Err(driftless_store::Error::TooManyKeys { max, .. }) => Some(format!("more than {max}")),
                Err(driftless_store::Error::ListTooLarge { .. }) => Some("too many".into()),
                Err(e) => return Err(e.into()),
            };
            if let Some(n) = held {
                return Err(Error::Refused(format!(
                    "{} holds {n} objects but no stream.json; to create a stream there anyway, pass --new-stream (Python: new_stream=True; Rust: with_new_stream(true))",
                    bucket.url(),
                )));
            }
        }
        let stream_id = taken_id.unwrap_or_else(|| format!("{:016x}", rand::random::<u64>()));
        let desc = StreamDescriptor {
            kind: "stream".into(),
            version: manifest::FORMAT_VERSION,
            stream_id: stream_id.clone(),
            trusted_keys: my_id.into_iter().collect(),
            created_at_ms: manifest::now_ms(),
        };
        let env = self.seal(&serde_json::to_vec(&desc).expect("serializes"))?;
        let r = if self.takeover {
            bucket.put(layout::STREAM, env.into()).await
        } else {
            bucket.put_create(layout::STREAM, env.into()).await
        };
        match r {
            Ok(()) => Ok(stream_id),
            Err(e) if e.is_already_exists() => {
                Err(Error::Refused("another publisher created this stream at the same time".into()))
            }
            Err(e) => Err(e.into()),
        }
    }

    pub(crate) fn seal(&self, payload: &[u8]) -> Result<Vec<u8>> {
        Ok(match &self.key {
            Some(k) => k.seal(payload)?,
            None => driftless_format::sign::seal_unsigned(payload)?,
        })
    }
}

/// What happened to a published step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// A delta was queued.
    Delta,
    /// A delta was queued and an anchor of the same step is being prepared in the background.
    DeltaAndAnchor,
    /// Only an anchor (first publish, restart, or recovery after a failed upload).
    Anchor,
    /// Uploads are behind: this step was held back; the next publish covers it, and
    /// `flush`/`close` publish it if it is still the newest.
    Coalesced,
    /// This step is already committed in the bucket with these very weights (a re-run after
    /// a crash): nothing was uploaded.
    AlreadyPublished,
}

/// Returned by [`Publisher::publish`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct PublishReceipt {
    /// Step.
    pub step: u64,
    /// What was done.
    pub outcome: Outcome,
    /// Delta payload bytes, when known as `publish` returns: `None` without a delta, and for
    /// a delta whose encoding runs after `publish` returned (every step in the snapshot's
    /// layout that starts no anchor). [`Status::last_delta_bytes`] has it once encoded.
    pub delta_bytes: Option<u64>,
    /// Dense bytes / delta bytes, when known (as `delta_bytes`; see [`Status::last_ratio`]).
    pub ratio: Option<f64>,
    /// Changed elements / elements.
    pub density: f64,
    /// Time `publish` blocked the caller.
    pub encode_secs: f64,
}

/// Counters for logs and metrics.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Status {
    /// Stream id.
    pub stream_id: String,
    /// Last step accepted by `publish` (delta or anchor).
    pub last_published: Option<u64>,
    /// Newest delta with a ready marker.
    pub last_delta_ready: Option<u64>,
    /// Newest anchor with a ready marker.
    pub last_anchor_ready: Option<u64>,
    /// Jobs waiting for upload.
    pub queue_depth: usize,
    /// Anchors encoding or uploading.
    pub anchors_in_flight: usize,
    /// Bytes written to the bucket.
    pub bytes_uploaded: u64,
    /// Steps skipped because uploads were behind.
    pub coalesced: u64,
    /// Failed uploads.
    pub failures: u64,
    /// Last failure.
    pub last_error: Option<String>,
    /// Dense bytes / payload bytes of the newest encoded delta.
    pub last_ratio: f64,
    /// Payload bytes of the newest encoded delta.
    pub last_delta_bytes: u64,
}

/// The publisher. See the crate docs.
pub struct Publisher {
    cfg: PublisherBuilder,
    rt: Option<tokio::runtime::Runtime>,
    tx: Option<tokio::sync::mpsc::Sender<Job>>,
    ctx: Arc<Ctx>,
    shared: Arc<Shared>,
    snapshot: Option<Arc<Snapshot>>,
    stream_id: String,
    last_step: Option<u64>,
    last_anchor_step: Option<u64>,
    /// The newest coalesced step (held as its changes against the snapshot, or copied):
    /// published by `flush` unless a newer step comes.
    pending: Option<Pending>,
    /// Extra files changed since the last anchor: the next step is an anchor-only step, so
    /// no reader reaches it through a delta that would keep the old files.
    extra_changed: bool,
    chain_bytes: u64,
    published: u64,
    coalesced: u64,
    /// The delta being encoded after `publish` returned (see [`Publisher::publish`]).
    encoding: Option<std::thread::JoinHandle<Finished>>,
    /// The step of the snapshot while it is handed to that encode (`snapshot` is `None`
    /// then): see [`Publisher::encode_in_background`].
    handed_over: Option<u64>,
    /// Lost steps published again so far: each try's objects carry its own attempt tag.
    retries: u32,
    /// The caller's check of [`Publisher::publish_checked`], while one runs.
    input_check: Option<Box<dyn FnMut() -> bool + Send + Sync>>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher").field("stream_id", &self.stream_id).field("last_step", &self.last_step).finish()
    }
}

impl Publisher {
    /// The stream id.
    pub fn stream_id(&self) -> &str {
        &self.stream_id
    }

    /// The smallest step `publish` accepts next.
    pub fn next_step(&self) -> u64 {
        self.last_step.map_or(0, |s| s.saturating_add(1))
    }

    /// Restores the snapshot after a process restart from a copy of the weights of `step`
    /// (the CLI keeps one in its state directory), so the next publish is a delta again
    /// instead of a forced anchor. The copy is trusted only after checking it against the
    /// bucket: its weights root must equal the signed root of committed step `step`. When the
    /// stream has moved on (the process was killed after a commit but before saving its
    /// copy), the ready deltas after `step` are downloaded, checked and applied to bring the
    /// snapshot to the newest committed step, verified once at the end. Any mismatch is an
    /// error and leaves the publisher unseeded: its next publish is an anchor, never a delta
    /// on a base readers do not have.
    pub fn seed(&mut self, step: u64, tensors: &[TensorView<'_>], layout: &Layout) -> Result<()> {
        self.finish_encoding();
        self.hold_pending_as_copy()?;
        let ordered = order(tensors, layout)?;
        let mut snap = Snapshot::copy_from(step, layout.clone(), &ordered);
        let saved = snap.root;
        let rt = self.rt.as_ref().ok_or(Error::Closed)?;
        let ctx = self.ctx.clone();
        let newest = self.last_step;
        let snap = rt.block_on(async move {
            let committed = ctx.committed_root_of_step(step).await.map_err(|e| Error::Upload {
                step,
                detail: e.to_string(),
                retryable: e.is_retryable(),
            })?;
            match committed {
                Some(r) if Some(r) == saved => {}
                Some(r) => {
                    return Err(Error::Seed(format!(
                        "the saved weights of step {step} differ from the committed step (root {} vs {})",
                        saved.map_or("none".into(), |d| d.to_hex()[..12].to_string()),
                        &r.to_hex()[..12]
                    )))
                }
                None => return Err(Error::Seed(format!("step {step} is not a committed step of this stream"))),
            }
            let Some(newest) = newest.filter(|&n| n > step) else { return Ok(snap) };
            roll_forward(&ctx, &mut snap, newest).await?;
            Ok(snap)
        })?;
        info!(step = snap.step, from = step, "publisher seeded from saved weights");
        self.shared.update(|s| s.tip = Some(snap.step));
        self.last_step = Some(self.last_step.map_or(snap.step, |l| l.max(snap.step)));
        self.snapshot = Some(Arc::new(snap));
        Ok(())
    }

    /// The step of the snapshot deltas are taken against (after `seed` or a publish).
    pub fn snapshot_step(&self) -> Option<u64> {
        self.snapshot.as_ref().map(|s| s.step).or(self.handed_over)
    }

    /// Replaces the small files shipped with anchors. When they differ from the current
    /// ones, the next step is published as an anchor-only step (no delta), so every reader
    /// that reaches it gets the new files. Returns the names added, removed or changed
    /// (sorted), so a caller can say why a step became an anchor.
    pub fn set_extra_files(&mut self, files: Vec<(String, Vec<u8>)>) -> Result<Vec<String>> {
        for (n, _) in &files {
            driftless_format::validate_extra_file_name(n)?;
        }
        driftless_format::check_extra_file_sizes(files.iter().map(|(n, b)| (n.clone(), b.len() as u64)))?;
        let new: std::collections::BTreeMap<&str, &[u8]> = files.iter().map(|(n, b)| (n.as_str(), &b[..])).collect();
        let old: std::collections::BTreeMap<&str, &[u8]> =
            self.cfg.extra_files.iter().map(|(n, b)| (n.as_str(), &b[..])).collect();
        let changed: std::collections::BTreeSet<&str> =
            new.keys().chain(old.keys()).copied().filter(|n| new.get(n) != old.get(n)).collect();
        let changed: Vec<String> = changed.into_iter().map(str::to_string).collect();
        if !changed.is_empty() {
            self.cfg.extra_files = files;
            self.extra_changed = self.snapshot_step().is_some();
        }
        Ok(changed)
    }

    /// Publishes the weights of `step` with a layout derived from the tensor order.
    pub fn publish(&mut self, step: u64, tensors: &[TensorView<'_>]) -> Result<PublishReceipt> {
        // The snapshot's layout decides below: take it back from an encode it was handed to
        // (found by review: read as absent, a stable custom layout became a layout change).
        self.finish_encoding();
        let metas: Vec<_> = tensors.iter().map(|t| t.meta()).collect();
        let layout = match &self.snapshot {
            // Keep the file layout stable while the tensor set is, so agents patch in place.
            Some(s) if s.layout.tensors().eq(metas.iter()) => s.layout.clone(),
            _ => Layout::for_tensors(&metas, self.cfg.max_shard_bytes)?,
        };
        self.publish_with_layout(step, tensors, &layout)
    }

    /// [`Publisher::publish_with_layout`] of weights that someone else may change while they
    /// are read (files a trainer can rewrite in place, mapped by the caller): `unchanged` is
    /// called once the publisher has read `tensors` for the last time (diffed or copied into
    /// its own snapshot), before anything of the step is queued. `false` refuses the step with
    /// [`Error::InputChanged`] (retryable: read them again) and nothing of it reaches the
    /// bucket; when that read had replaced the publisher's snapshot, the snapshot is dropped
    /// (it may mix two writes of the input: never a base) and the next step is an anchor.
    /// A coalesced step this one was to supersede is kept only when it was copied.
    pub fn publish_checked(
        &mut self,
        step: u64,
        tensors: &[TensorView<'_>],
        layout: &Layout,
        unchanged: impl FnMut() -> bool + Send + Sync + 'static,
    ) -> Result<PublishReceipt> {
        self.input_check = Some(Box::new(unchanged));
        let r = self.publish_with_layout(step, tensors, layout);
        self.input_check = None;
        r
    }

    /// The check of [`Publisher::publish_checked`], after the last read of the caller's
    /// tensors. `replaced`: that read changed or replaced the snapshot.
    fn input_unchanged(&mut self, step: u64, replaced: bool) -> Result<()> {
        if self.input_check.as_mut().is_none_or(|unchanged| unchanged()) {
            return Ok(());
        }
        warn!(step, "the weights changed while they were read; the step is not published");
        if replaced {
            self.snapshot = None;
        }
        Err(Error::InputChanged { step })
    }

    /// Publishes the weights of `step` with an explicit shard layout (a checkpoint's own).
    pub fn publish_with_layout(
        &mut self,
        step: u64,
        tensors: &[TensorView<'_>],
        layout: &Layout,
    ) -> Result<PublishReceipt> {
        if self.tx.is_none() {
            return Err(Error::Closed);
        }
        self.finish_encoding();
        self.check_conflict()?;
        layout.validate()?;
        if let Some(last) = self.last_step {
            if step <= last {
                return self.republish(step, last, tensors, layout);
            }
        }
        if self.pending.as_ref().is_some_and(|p| p.step >= step) {
            let last = self.pending.as_ref().map_or(step, |p| p.step);
            if step < last {
                return Err(Error::StepOrder { step, last });
            }
        }
        // Checked before a coalesced step is superseded: a call refused here keeps it (found
        // by review: it was dropped, and the newest accepted weights never published).
        order(tensors, layout)?;
        let superseded = self.pending.take();
        let r = self.publish_newer(step, tensors, layout);
        if r.is_err() && self.pending.is_none() {
            // This step failed (an internal error: the publisher closed, a thread that could
            // not start): the coalesced step it was to supersede is still the newest accepted
            // weights, kept for `flush` while its base still holds (a copy always does).
            self.pending = superseded.filter(|p| match &p.weights {
                Held::Copy(_) => true,
                Held::Changes { base, .. } => self.snapshot.as_ref().is_some_and(|s| s.step == *base),
            });
        }
        r
    }

    /// [`Publisher::publish_with_layout`] of a step newer than any accepted, once checked.
    fn publish_newer(&mut self, step: u64, tensors: &[TensorView<'_>], layout: &Layout) -> Result<PublishReceipt> {
        let _span = info_span!("publish", step).entered();
        let t0 = Instant::now();
        let (need_anchor, queued) = {
            let s = self.shared.state.lock().expect("state lock");
            (s.need_anchor, s.queued)
        };
        let Some(snap) = self.snapshot.clone() else {
            return self.anchor_only(step, Some((tensors, layout)), t0);
        };
        // No root: a background encode did not finish (it records the failure and sets
        // need_anchor too); the snapshot's step never reached the bucket.
        let Some(base_root) = snap.root.filter(|_| !need_anchor && !self.extra_changed) else {
            drop(snap);
            return self.anchor_only(step, Some((tensors, layout)), t0);
        };
        if queued >= self.cfg.queue_depth {
            self.coalesced += 1;
            warn!(step, queued, "uploads are behind; coalescing this step into the next");
            // Kept so that `flush` can publish it if no newer step comes: the newest weights
            // always reach the bucket. Held as its changes against the snapshot (a read-only
            // diff: about 1.5% of the model at RL densities), so the publisher keeps its
            // memory bound while the bucket is slower than the trainer; a dense copy held
            // 2x the model in all (found by review). Another layout is copied.
            let ordered = order(tensors, layout)?;
            let weights = if snap.layout == *layout {
                let _s = info_span!("diff_coalesced").entered();
                Held::Changes {
                    base: snap.step,
                    diff: driftless_format::diff(&snap.bufs(), &ordered, &self.cfg.delta)?,
                }
            } else {
                Held::Copy(ordered.iter().map(|v| (v.meta(), v.data.to_vec())).collect())
            };
            drop(snap);
            self.input_unchanged(step, false)?;
            self.pending = Some(Pending { step, layout: layout.clone(), weights });
            return Ok(PublishReceipt {
                step,
                outcome: Outcome::Coalesced,
                delta_bytes: None,
                ratio: None,
                density: 0.0,
                encode_secs: t0.elapsed().as_secs_f64(),
            });
        }
        let dense: u64 = snap.tensors.iter().map(|(_, d)| d.len() as u64).sum();
        if snap.layout == *layout {
            let anchor = self.anchor_due(step, dense);
            drop(snap);
            let r = self.deferred_delta(step, tensors, base_root, t0)?;
            return self.anchor_after_delta(anchor, r, t0);
        }
        // A new layout: the delta is encoded here, and the snapshot replaced by the tensors.
        let spec = ops::DeltaSpec {
            stream_id: &self.stream_id,
            step,
            base_step: snap.step,
            base_root: Some(base_root),
            layout,
        };
        let (m, enc) = {
            let _s = info_span!("diff_encode").entered();
            ops::make_delta(spec, &snap.views(), tensors, &self.cfg.delta)?
        };
        // Readers hold a delta decoded within a bound taken from the model they apply it to
        // (`DeltaManifest::check_onto`): a layout change that grows the model by more than a
        // quarter is refused by them, so the step is published as an anchor too, at once.
        let grown = m.check_onto(&snap.layout).is_err();
        drop(snap);
        let (m, job) = seal_delta(&self.cfg, self.ctx.generation, m, enc)?;
        let delta_bytes = m.payload_bytes();
        // Update the snapshot before queueing so the job order matches the snapshot order.
        // The manifest holds the new tensors' digests and root: no second hash of the model.
        let ordered = order(tensors, layout)?;
        let digests = m.shards.iter().flat_map(|s| s.tensors.iter().map(|t| t.digest)).collect();
        self.replace_snapshot(step, layout, &ordered, Some((digests, m.result_root)))?;
        self.input_unchanged(step, true)?;
        self.shared.update(|s| s.queued += 1);
        self.send(Job::Delta(job))?;
        self.chain_bytes += delta_bytes;
        self.last_step = Some(step);
        self.published += 1;
        let dense = m.stats.dense_bytes;
        let ratio = dense as f64 / delta_bytes.max(1) as f64;
        self.shared.update(|s| {
            s.last_ratio = ratio;
            s.last_delta_bytes = delta_bytes;
        });
        let outcome = if grown || self.anchor_due(step, dense) {
            if grown {
                info!(step, "a layout change past what readers hold as a delta: an anchor of this step too");
            }
            self.start_anchor(None, 0)?;
            Outcome::DeltaAndAnchor
        } else {
            Outcome::Delta
        };
        let r = PublishReceipt {
            step,
            outcome,
            delta_bytes: Some(delta_bytes),
            ratio: Some(ratio),
            density: m.stats.changed as f64 / m.stats.elements.max(1) as f64,
            encode_secs: t0.elapsed().as_secs_f64(),
        };
        info!(step, bytes = delta_bytes, ratio, secs = r.encode_secs, "delta encoded");
        Ok(r)
    }

    /// Starts the anchor of the delta step just queued (`r`) when `due`. The anchor is encoded
    /// from the snapshot at this step, and its manifest needs the step's root: this waits for
    /// the delta's encode (never for the anchor's).
    fn anchor_after_delta(&mut self, due: bool, mut r: PublishReceipt, t0: Instant) -> Result<PublishReceipt> {
        let step = r.step;
        if due {
            self.finish_encoding();
            if self.snapshot.as_ref().is_some_and(|s| s.step == step && s.root.is_some()) {
                self.start_anchor(None, 0)?;
                let s = self.shared.state.lock().expect("state lock");
                r.outcome = Outcome::DeltaAndAnchor;
                r.delta_bytes = Some(s.last_delta_bytes);
                r.ratio = Some(s.last_ratio);
                r.encode_secs = t0.elapsed().as_secs_f64();
            }
        }
        Ok(r)
    }

    /// Whether `step` should start an anchor: `anchor_every` steps since the last one, or the
    /// deltas since then past `anchor_chain_fraction` of the model (`dense` bytes), and no
    /// anchor already encoding.
    fn anchor_due(&self, step: u64, dense: u64) -> bool {
        let due = self.last_anchor_step.is_none_or(|a| step >= a.saturating_add(self.cfg.anchor_every))
            || self.chain_bytes as f64 > self.cfg.anchor_chain_fraction * dense as f64;
        due && self.shared.state.lock().expect("state lock").anchors_in_flight == 0
    }

    /// The common delta step: one pass over the caller's tensors and the snapshot finds the
    /// changes and brings the snapshot to this step ([`driftless_format::diff_update`]:
    /// it reads both models once and writes only changed words, less than one copy), then
    /// returns. Packing, compression, the hash of the new state, the manifest and its
    /// signature run on a background thread that reads only the snapshot and the found
    /// changes, never the caller's tensors, so the trainer may change them at once. The next
    /// `publish` (or `flush`) waits for that thread first. A failure there counts as a failed
    /// upload: the step never gets a marker and the next publish is an anchor.
    fn deferred_delta(
        &mut self,
        step: u64,
        tensors: &[TensorView<'_>],
        base_root: Digest,
        t0: Instant,
    ) -> Result<PublishReceipt> {
        if self.tx.is_none() {
            return Err(Error::Closed);
        }
        let opts = self.cfg.delta;
        if self.input_check.is_some() || self.snapshot.as_ref().is_some_and(|s| Arc::strong_count(s) > 1) {
            // An anchor thread is still writing the snapshot to its spool (the step before
            // was a scheduled anchor): rather than wait for it (1.6-2.2 s at 1 GiB here,
            // against 0.08 s for a delta step), the changes are found by a read-only diff
            // (both threads only read), and the snapshot is handed to the encode thread,
            // which applies them once the anchor thread has let go of it. So is a checked
            // input's (`publish_checked`): refused after its read, it leaves the snapshot as
            // it was, still the base of the next step.
            let snap = self.snapshot.as_ref().expect("checked");
            let ordered = order(tensors, &snap.layout)?;
            let diff = {
                let _s = info_span!("diff_beside_anchor").entered();
                driftless_format::diff(&snap.bufs(), &ordered, &opts)?
            };
            let base_step = snap.step;
            self.input_unchanged(step, false)?;
            return self.encode_in_background(step, base_step, base_root, diff, t0, true);
        }
        let snap = self.snapshot_mut();
        let ordered = order(tensors, &snap.layout)?;
        let base_step = snap.step;
        let diff = {
            let _s = info_span!("diff_update").entered();
            let mut bufs: Vec<&mut [u8]> = snap.tensors.iter_mut().map(|(_, d)| d.as_mut_slice()).collect();
            driftless_format::diff_update(&mut bufs, &ordered, &opts)?
        };
        // The snapshot now holds this step; its root is known once the background hash is
        // done (finish_encoding).
        snap.step = step;
        snap.root = None;
        snap.digests.clear();
        self.encode_in_background(step, base_step, base_root, diff, t0, false)
    }

    /// Queues the delta of `step` and starts its background encode: packing, compression, the
    /// hash of the snapshot, the manifest. The changes `diff` are in the snapshot already, or,
    /// with `hand_over`, not yet: the publisher then gives its snapshot to the job, which
    /// applies them first, once no anchor thread reads it, and gives it back
    /// ([`Publisher::finish_encoding`]; until then [`Publisher::snapshot_step`] answers from
    /// `handed_over`).
    fn encode_in_background(
        &mut self,
        step: u64,
        base_step: u64,
        base_root: Digest,
        diff: driftless_format::DeltaDiff,
        t0: Instant,
        hand_over: bool,
    ) -> Result<PublishReceipt> {
        let tx = self.tx.clone().ok_or(Error::Closed)?;
        let stats = diff.stats();
        // A snapshot handed over is let go only once the thread runs (below): the job waits
        // to be its only holder, and a failed spawn keeps it here.
        let snap = self.snapshot.clone().expect("present");
        let job = EncodeJob {
            cfg: self.cfg.clone(),
            stream_id: self.stream_id.clone(),
            generation: self.ctx.generation,
            shared: self.shared.clone(),
            tx,
            snap,
            apply_first: hand_over,
            mid_apply: false,
            step,
            base_step,
            base_root,
            sent: Default::default(),
        };
        self.shared.update(|s| s.queued += 1);
        let spawned = std::thread::Builder::new().name("driftless-encode".into()).spawn(move || job.run(diff));
        match spawned {
            Ok(h) => {
                self.encoding = Some(h);
                if hand_over {
                    self.handed_over = Some(step);
                    self.snapshot = None;
                }
            }
            Err(e) => {
                self.shared.update(|s| {
                    s.queued -= 1;
                    s.need_anchor = true;
                });
                return Err(e.into());
            }
        }
        self.last_step = Some(step);
        self.published += 1;
        let r = PublishReceipt {
            step,
            outcome: Outcome::Delta,
            delta_bytes: None,
            ratio: None,
            density: stats.changed as f64 / stats.elements.max(1) as f64,
            encode_secs: t0.elapsed().as_secs_f64(),
        };
        info!(step, changed = stats.changed, secs = r.encode_secs, "delta diffed; encoding in the background");
        Ok(r)
    }

    /// Waits for the background encode of the last deferred delta and takes its root into
    /// the snapshot (and its size into the anchor schedule).
    fn finish_encoding(&mut self) {
        let Some(h) = self.encoding.take() else { return };
        // The job catches the panics of its work and records its failures itself; a join error
        // (a panic while recording one) still makes the next publish an anchor.
        let handed_over = self.handed_over.take();
        let done = match h.join() {
            Ok(Finished { snap, done }) => {
                if let Some(snap) = snap {
                    self.snapshot = Some(snap);
                } else if handed_over.is_some() {
                    // It panicked while applying the changes: the snapshot may be half new
                    // and was dropped. The next publish is an anchor of the caller's weights.
                    self.shared.update(|s| s.need_anchor = true);
                }
                match done {
                    Some(done) => done,
                    None => return,
                }
            }
            Err(_) => {
                // A snapshot handed over is lost with the thread (no panic is known to reach
                // here): the next publish is an anchor of the caller's weights.
                self.shared.update(|s| s.need_anchor = true);
                return;
            }
        };
        self.chain_bytes += done.delta_bytes;
        if self.snapshot.is_none() {
            return;
        }
        let snap = self.snapshot_mut();
        if snap.step == done.step {
            snap.root = Some(done.root);
            snap.digests = done.digests;
        }
    }

    /// `publish` of a step at or before the newest one: a no-op success when that step is
    /// committed (or queued) with these very weights (a supervisor re-running the command
    /// after a crash), an anchor of these weights when it is the newest step and was lost (a
    /// caller retrying after `flush` reported it), an error when it holds other weights or
    /// is an older step not committed.
    fn republish(
        &mut self,
        step: u64,
        last: u64,
        tensors: &[TensorView<'_>],
        layout: &Layout,
    ) -> Result<PublishReceipt> {
        let t0 = Instant::now();
        if step == last && self.newest_lost() == Some(step) {
            // It never reached the bucket (a failed upload that `flush` reported): these
            // weights are published as its anchor, not taken for the lost snapshot's.
            info!(step, "the newest step is not in the bucket; publishing it as an anchor");
            let outcome = match self.republish_lost(step, Some((tensors, layout)))? {
                true => Outcome::Anchor,
                false => Outcome::AlreadyPublished,
            };
            let secs = t0.elapsed().as_secs_f64();
            let r = PublishReceipt { step, outcome, delta_bytes: None, ratio: None, density: 0.0, encode_secs: secs };
            return Ok(r);
        }
        let ordered = order(tensors, layout)?;
        let (digests, root) = driftless_format::weights_root(&ordered);
        // (A change found after the snapshot's copy below would leave a snapshot that does not
        // hash to its root: checked here, and again after that copy.)
        self.input_unchanged(step, false)?;
        let queued_same = self.snapshot.as_ref().is_some_and(|s| s.step == step && s.root == Some(root));
        let committed = if queued_same {
            Some(root)
        } else {
            let ctx = self.ctx.clone();
            self.rt
                .as_ref()
                .ok_or(Error::Closed)?
                .block_on(async move { ctx.committed_root_of_step(step).await })
                .map_err(|e| Error::Upload { step, detail: e.to_string(), retryable: e.is_retryable() })?
        };
        match committed {
            Some(r) if r == root => {
                if step == last && self.snapshot.as_ref().is_none_or(|s| s.step < step) {
                    // The newest committed step: deltas can be taken against it again.
                    self.replace_snapshot(step, layout, &ordered, Some((digests, root)))?;
                    self.input_unchanged(step, true)?;
                    self.shared.update(|s| s.tip = Some(step));
                }
                info!(step, "step is already published with these weights; nothing to do");
                Ok(PublishReceipt {
                    step,
                    outcome: Outcome::AlreadyPublished,
                    delta_bytes: None,
                    ratio: None,
                    density: 0.0,
                    encode_secs: t0.elapsed().as_secs_f64(),
                })
            }
            Some(r) => Err(Error::StepTaken {
                step,
                detail: format!(
                    "it is already published with other weights (root {}, these are {})",
                    &r.to_hex()[..12],
                    &root.to_hex()[..12]
                ),
            }),
            None => Err(Error::StepOrder { step, last }),
        }
    }

    fn anchor_only(
        &mut self,
        step: u64,
        weights: Option<(&[TensorView<'_>], &Layout)>,
        t0: Instant,
    ) -> Result<PublishReceipt> {
        match weights {
            Some((tensors, layout)) => {
                let ordered = order(tensors, layout)?;
                self.replace_snapshot(step, layout, &ordered, None)?;
                self.input_unchanged(step, true)?;
            }
            // The snapshot holds the step (a coalesced one rebuilt in it): hashed in place.
            None => {
                let snap = self.snapshot_mut();
                let (digests, root) = driftless_format::weights_root(&snap.views());
                (snap.root, snap.digests) = (Some(root), digests);
            }
        }
        self.schedule_anchor(step, 0)?;
        self.last_step = Some(step);
        self.published += 1;
        Ok(PublishReceipt {
            step,
            outcome: Outcome::Anchor,
            delta_bytes: None,
            ratio: None,
            density: 0.0,
            encode_secs: t0.elapsed().as_secs_f64(),
        })
    }

    fn send(&self, job: Job) -> Result<()> {
        let tx = self.tx.as_ref().ok_or(Error::Closed)?;
        tx.blocking_send(job).map_err(|_| Error::Closed)
    }

    /// Replaces the snapshot with a copy of `ordered`, freeing the old one first so memory
    /// never holds two snapshots (after waiting for an anchor still encoding from it).
    /// Replaces the snapshot by a copy of `ordered`, hashed unless its tensor digests and
    /// root are given (`hashed`).
    fn replace_snapshot(
        &mut self,
        step: u64,
        layout: &Layout,
        ordered: &[TensorView<'_>],
        hashed: Option<(Vec<Digest>, Digest)>,
    ) -> Result<()> {
        self.hold_pending_as_copy()?;
        if self.snapshot.is_some() {
            let _ = self.snapshot_mut();
            self.snapshot = None;
        }
        let snap = match hashed {
            Some((digests, root)) => Snapshot::copy_hashed(step, layout.clone(), ordered, digests, root),
            None => Snapshot::copy_from(step, layout.clone(), ordered),
        };
        self.snapshot = Some(Arc::new(snap));
        Ok(())
    }

    /// Exclusive access to the snapshot: waits while an anchor is still being encoded from it.
    fn snapshot_mut(&mut self) -> &mut Snapshot {
        sole_holder(&self.shared, self.snapshot.as_mut().expect("snapshot present"))
    }

    /// Encodes an anchor of the current snapshot on a background thread into spool files,
    /// then uploads it on the runtime.
    fn start_anchor(&mut self, done: Option<tokio::sync::oneshot::Sender<bool>>, attempt: u32) -> Result<()> {
        let snap = self.snapshot.clone().expect("snapshot present");
        let step = snap.step;
        self.last_anchor_step = Some(step);
        self.chain_bytes = 0;
        self.shared.update(|s| s.anchors_in_flight += 1);
        let cfg = self.cfg.clone();
        let ctx = self.ctx.clone();
        let handle = self.rt.as_ref().expect("runtime").handle().clone();
        let stream_id = self.stream_id.clone();
        let shared = self.shared.clone();
        let spawned = std::thread::Builder::new().name("driftless-anchor".into()).spawn(move || {
            let _s = info_span!("encode_anchor", step).entered();
            // The snapshot is needed only until its bytes are in the spool: released before
            // the encode, so the next delta step's `publish` does not wait for the anchor's
            // compression (found by review: it waited 1.9 s at 256 MiB, against 0.25-0.5 s
            // for a plain delta step).
            // A panic is a failed anchor like any other (noted by review: it left the anchor
            // counted in flight, and `flush` waited for it for ever).
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let spooled = spool_plain(&cfg, &snap, attempt);
                drop(snap);
                ctx.shared.changed.notify_all();
                spooled.and_then(|(dir, step)| encode_spooled(&cfg, &stream_id, ctx.generation, step, dir))
            }))
            .unwrap_or_else(|_| {
                Err(Error::Upload { step, detail: "anchor encoding panicked".into(), retryable: false })
            });
            ctx.shared.changed.notify_all();
            match r {
                Ok(mut job) => {
                    job.done = done;
                    handle.spawn(upload::anchor_upload(ctx, job));
                }
                Err(e) => {
                    warn!(step, error = %e, "anchor encoding failed");
                    ctx.shared.update(|s| {
                        s.anchors_in_flight -= 1;
                        s.need_anchor = true;
                        s.failures += 1;
                        s.last_error = Some(format!("anchor {step}: {e}"));
                        s.last_error_retryable = e.is_retryable();
                    });
                }
            }
        });
        if let Err(e) = spawned {
            // The step itself is queued: the anchor is what failed. Count it as a failed
            // anchor (the next publish is one), and never leave it counted as in flight.
            warn!(step, error = %e, "could not start the anchor's encoding");
            shared.update(|s| {
                s.anchors_in_flight -= 1;
                s.need_anchor = true;
                s.failures += 1;
                s.last_error = Some(format!("anchor {step}: {e}"));
                s.last_error_retryable = driftless_format::io_is_retryable(&e);
            });
        }
        Ok(())
    }

    /// Publishes the newest coalesced step if no newer step superseded it, then waits until
    /// every queued step and anchor is in the bucket. When the newest step did not get there
    /// (its upload or its encode failed), it is published again, once, as an anchor of the
    /// snapshot (which holds its weights: no copy), and waited for.
    ///
    /// `Ok` means the newest published step is committed in the bucket. A failure of a step
    /// that a newer committed step superseded, or of an anchor whose step is committed as a
    /// delta, is logged and counted ([`Status::failures`], [`Status::last_error`]), not
    /// returned: readers skip to the newest step, and the next publish is an anchor. Errors
    /// when the newest step is still not in the bucket (the anchor failed too; the next
    /// `flush`, or `publish` of the same step, tries again) and when another publisher took
    /// the stream.
    pub fn flush(&mut self) -> Result<()> {
        self.finish_encoding();
        if let Some(p) = self.pending.take() {
            {
                let mut s = self.shared.state.lock().expect("state lock");
                while s.queued >= self.cfg.queue_depth {
                    s = self.shared.changed.wait_timeout(s, Duration::from_millis(50)).expect("state lock").0;
                }
            }
            info!(step = p.step, "publishing the coalesced newest step");
            if let Err(e) = self.publish_pending(p) {
                // The steps queued before it still finish before this returns (found by review:
                // `close` and drop then released the lease under them and cancelled the
                // queue). The newest step's failure is the one reported; an older step's is
                // logged by its upload and kept in `status()`.
                if let Err(older) = self.wait() {
                    warn!(error = %older, "an earlier queued step failed too");
                }
                return Err(e);
            }
        }
        let r = self.wait();
        let Some(step) = self.newest_lost() else {
            return match r {
                Err(Error::Upload { detail, .. }) => {
                    warn!(error = %detail, "a step failed, but the newest published step is in the bucket");
                    Ok(())
                }
                r => r,
            };
        };
        let taken = self.shared.state.lock().expect("state lock").taken.clone();
        if let Some((_, detail)) = taken.filter(|(t, _)| *t == step) {
            // Claimed by a killed predecessor: no try of this step can commit.
            return Err(Error::StepTaken { step, detail });
        }
        let why = r.err().map_or_else(|| "no marker".to_string(), |e| e.to_string());
        warn!(step, error = %why, "the newest step did not reach the bucket; publishing it again as an anchor");
        self.republish_lost(step, None)?;
        self.wait()
    }

    /// Publishes a coalesced step (`flush`). Held as a copy, it is published as any step is;
    /// on an error it is kept for the next `flush`. Held as changes, they are applied to the
    /// snapshot (their base: every change of the snapshot's bytes turns a pending step into a
    /// copy first, see [`Publisher::hold_pending_as_copy`]), and the step is published from
    /// the snapshot as the delta of those changes, or as an anchor when one is needed. From
    /// there on the snapshot holds the step and it is the newest accepted one, so a failure
    /// leaves it lost, and `flush` publishes it again as an anchor of the snapshot.
    fn publish_pending(&mut self, p: Pending) -> Result<PublishReceipt> {
        let (step, layout) = (p.step, p.layout);
        let (base, diff) = match p.weights {
            Held::Copy(tensors) => {
                let r = self.publish_with_layout(step, &crate::snapshot::views_of(&tensors), &layout);
                if r.is_err() {
                    // Still the newest weights: the next `flush` tries again.
                    self.pending = Some(Pending { step, layout, weights: Held::Copy(tensors) });
                }
                return r;
            }
            Held::Changes { base, diff } => (base, diff),
        };
        if let Err(e) = self.check_conflict().and_then(|()| self.tx.as_ref().map(|_| ()).ok_or(Error::Closed)) {
            self.pending = Some(Pending { step, layout, weights: Held::Changes { base, diff } });
            return Err(e);
        }
        let t0 = Instant::now();
        let (need_anchor, extra_changed) =
            (self.shared.state.lock().expect("state lock").need_anchor, self.extra_changed);
        if self.snapshot.as_ref().is_none_or(|s| s.step != base || s.layout != layout) {
            // Not reached (every change of the snapshot turns the pending step into a copy
            // first; a snapshot lost with a panicked encode thread is the one way here): the
            // step stays pending and every `flush` reports it; `publish` of it again with its
            // weights recovers it.
            let detail = format!("the coalesced step's base, step {base}, is no longer held");
            self.pending = Some(Pending { step, layout, weights: Held::Changes { base, diff } });
            return Err(Error::Upload { step, detail, retryable: false });
        }
        let snap = self.snapshot_mut();
        let applied = {
            let _s = info_span!("apply_coalesced").entered();
            diff.apply(&snap.tensors_mut())
        };
        if let Err(e) = applied {
            // Not reached: the changes were taken against these very bytes. The snapshot may
            // be half changed: it is dropped, so the next publish is an anchor of the caller's
            // weights, never of these bytes. The step is the newest accepted one and lost, so
            // every later `flush` reports it (its weights are no longer held).
            self.snapshot = None;
            self.last_step = Some(step);
            self.shared.update(|s| s.need_anchor = true);
            return Err(Error::Upload {
                step,
                detail: format!("the coalesced step could not be rebuilt: {e}"),
                retryable: false,
            });
        }
        let base_root = snap.root;
        let dense: u64 = snap.tensors.iter().map(|(_, d)| d.len() as u64).sum();
        snap.step = step;
        snap.root = None;
        snap.digests.clear();
        self.last_step = Some(step);
        match base_root.filter(|_| !need_anchor && !extra_changed) {
            Some(base_root) => {
                let due = self.anchor_due(step, dense);
                let r = self.encode_in_background(step, base, base_root, diff, t0, false)?;
                self.anchor_after_delta(due, r, t0)
            }
            None => {
                drop(diff);
                self.anchor_only(step, None, t0)
            }
        }
    }

    /// Turns a pending step held as changes against the snapshot into a copy (the snapshot
    /// plus the changes), before the snapshot's bytes change under them: a `publish` of a lost
    /// step again or a `seed` while a newer step is coalesced. Costs one copy of the model,
    /// only on those paths.
    fn hold_pending_as_copy(&mut self) -> Result<()> {
        let Some(Pending { step, weights: Held::Changes { base, diff }, .. }) = &self.pending else { return Ok(()) };
        // Checked before anything is taken: on an error the pending step stays as it was, and
        // `flush` reports it (found by review: taken first, it vanished on an error).
        let Some(snap) = self.snapshot.as_ref().filter(|s| s.step == *base) else {
            return Err(Error::Upload {
                step: *step,
                detail: "the coalesced step's base is no longer held".into(),
                retryable: false,
            });
        };
        let mut copy: Vec<(driftless_format::TensorMeta, Vec<u8>)> = snap.tensors.clone();
        diff.apply(&crate::snapshot::tensors_mut_of(&mut copy))?;
        let p = self.pending.as_mut().expect("matched above");
        p.weights = Held::Copy(copy);
        Ok(())
    }

    /// The newest accepted step when it is lost: every job is done and it has no ready marker
    /// (its upload or its encode failed, and no newer step superseded it).
    fn newest_lost(&self) -> Option<u64> {
        let step = self.last_step?;
        let s = self.shared.state.lock().expect("state lock");
        let idle = s.queued == 0 && s.anchors_in_flight == 0;
        let committed = s.last_delta == Some(step) || s.last_anchor == Some(step);
        (idle && !committed && s.conflict.is_none()).then_some(step)
    }

    /// Publishes lost step `step` again as an anchor: of `given` weights (a caller's
    /// `publish` of that step), else of the snapshot, which holds its weights (a step's
    /// snapshot stays until the next publish, whether its upload worked or not: no copy, and
    /// a hash first when its delta's encode failed before hashing it). First asks the bucket
    /// whether the step is committed after all (a marker whose response was lost): then it
    /// is taken as such, and `Ok(false)` returned. The new try's objects carry a new attempt
    /// tag ([`layout::attempt_name`]): they never take the name of one the failed try left.
    fn republish_lost(&mut self, step: u64, given: Option<(&[TensorView<'_>], &Layout)>) -> Result<bool> {
        // The weights to publish, and their root: the caller's (hashed here; they replace the
        // snapshot only once the bucket said the step is free or theirs), or the snapshot's.
        let given = match given {
            Some((tensors, layout)) => {
                let ordered = order(tensors, layout)?;
                let (digests, root) = driftless_format::weights_root(&ordered);
                // Before the claim of this root (checked again after the snapshot's copy).
                self.input_unchanged(step, false)?;
                Some((ordered, layout, digests, root))
            }
            None => None,
        };
        let root = match &given {
            Some((.., root)) => *root,
            None => {
                if self.snapshot.as_ref().is_none_or(|s| s.step != step) {
                    return Err(Error::Upload {
                        step,
                        detail: "lost, and its weights are no longer held".into(),
                        retryable: false,
                    });
                }
                let snap = self.snapshot_mut();
                match snap.root {
                    Some(r) => r,
                    None => {
                        let (digests, root) = driftless_format::weights_root(&snap.views());
                        (snap.root, snap.digests) = (Some(root), digests);
                        root
                    }
                }
            }
        };
        let ctx = self.ctx.clone();
        let fresh = given.is_some();
        let settled = self.rt.as_ref().ok_or(Error::Closed)?.block_on(async move {
            let kind = ctx.committed_kind(step, root).await?;
            // The caller's weights: claimed now, so that a claim holding other weights (the
            // failed try's own, or a killed predecessor's) refuses them here, not at the
            // anchor's commit (found by review: there this publisher's own claim was taken
            // for a second publisher's, and it stopped for good).
            if kind.is_none() && fresh {
                upload::claim_step(&ctx, step, root).await?;
            }
            if let Some(kind) = kind {
                ctx.shared.update(|s| {
                    s.tip = Some(step);
                    match kind {
                        StepKind::Delta => s.last_delta = s.last_delta.max(Some(step)),
                        StepKind::Anchor => s.last_anchor = s.last_anchor.max(Some(step)),
                    }
                });
                let (d, a) = match kind {
                    StepKind::Delta => (Some(step), None),
                    StepKind::Anchor => (None, Some(step)),
                };
                ctx.write_latest(d, a).await;
            }
            Ok::<_, upload::CommitError>(kind)
        });
        let committed = match settled {
            Ok(kind) => kind.is_some(),
            // The caller's weights differ from the step's committed ones: refused as any
            // `publish` of a taken step is (the publisher goes on).
            Err(
                upload::CommitError::Conflict(detail)
                | upload::CommitError::Claimed(detail)
                | upload::CommitError::Taken(detail),
            ) if given.is_some() => return Err(Error::StepTaken { step, detail }),
            // Claimed by a killed predecessor: this step cannot be published; later ones can.
            Err(upload::CommitError::Taken(detail)) => return Err(Error::StepTaken { step, detail }),
            // The weights this publisher published as the step differ from the committed ones:
            // another writer committed it. This publisher stops, as on any conflict.
            Err(upload::CommitError::Conflict(detail) | upload::CommitError::Claimed(detail)) => {
                self.shared.update(|s| {
                    s.conflict.get_or_insert((step, detail.clone()));
                });
                return Err(Error::Conflict { step, detail });
            }
            Err(e) => return Err(Error::Upload { step, detail: e.to_string(), retryable: e.is_retryable() }),
        };
        if let Some((ordered, layout, digests, root)) = given {
            if self.snapshot.as_ref().is_none_or(|s| (s.step, s.root) != (step, Some(root))) {
                self.replace_snapshot(step, layout, &ordered, Some((digests, root)))?;
                self.input_unchanged(step, true)?;
            }
        }
        if committed {
            info!(step, "the lost step is committed after all (its marker's response was lost)");
            return Ok(false);
        }
        self.retries += 1;
        self.schedule_anchor(step, self.retries)?;
        Ok(true)
    }

    /// Makes step `step` (the snapshot's) an anchor-only step: queued so that the deltas
    /// after it wait for it, and encoded from the snapshot in the background, its objects
    /// named for try `attempt` of the step.
    fn schedule_anchor(&mut self, step: u64, attempt: u32) -> Result<()> {
        self.extra_changed = false;
        self.shared.update(|s| {
            s.need_anchor = false;
            s.queued += 1;
        });
        let (done, ready) = tokio::sync::oneshot::channel();
        self.send(Job::AnchorScheduled(step, ready))?;
        self.start_anchor(Some(done), attempt)
    }

    /// Waits until every queued step and anchor is in the bucket (without publishing a
    /// coalesced step or a lost one again; see [`Publisher::flush`]). Errors with the last
    /// failure when one happened since the previous `wait` or `flush` (each once).
    pub fn wait(&self) -> Result<()> {
        let mut s = self.shared.state.lock().expect("state lock");
        while s.queued > 0 || s.anchors_in_flight > 0 {
            s = self.shared.changed.wait_timeout(s, Duration::from_millis(50)).expect("state lock").0;
        }
        if let Some((step, detail)) = s.conflict.clone() {
            return Err(Error::Conflict { step, detail });
        }
        // Each failure is returned once; `status()` keeps the last one.
        if s.failures > s.reported {
            s.reported = s.failures;
            if let Some(e) = s.last_error.clone() {
                let retryable = s.last_error_retryable;
                return Err(Error::Upload { step: self.last_step.unwrap_or(0), detail: e, retryable });
            }
        }
        Ok(())
    }

    /// Fails once a write-once conflict showed that another publisher writes this stream.
    fn check_conflict(&self) -> Result<()> {
        match self.shared.state.lock().expect("state lock").conflict.clone() {
            Some((step, detail)) => Err(Error::Conflict { step, detail }),
            None => Ok(()),
        }
    }

    /// Flushes and stops the uploader.
    pub fn close(mut self) -> Result<()> {
        let r = self.flush();
        self.shutdown();
        r
    }

    /// Stops at once, without flushing: steps not committed yet are not published (what they
    /// wrote is an incomplete step GC removes), as if the process had died. For a trainer torn
    /// down in a hurry; dropping the publisher flushes instead.
    pub fn abort(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        // A delta still encoding sends its job on the runtime's channel: let it finish first.
        if let Some(h) = self.encoding.take() {
            let _ = h.join();
        }
        self.tx = None;
        if let Some(rt) = self.rt.take() {
            // Release the lease (GC may then clean up after this generation at once), but only
            // with no commit in flight: one may be writing its ready marker, and a released
            // lease has GC take its step for an incomplete one and delete its objects, so the
            // marker would land naming deleted objects (found by review: `abort()`, and a drop
            // while a panic unwinds, released it at once). Then it expires after its TTL, as
            // after a kill.
            let busy = {
                let s = self.shared.state.lock().expect("state lock");
                s.queued > 0 || s.anchors_in_flight > 0
            };
            if busy {
                warn!(
                    generation = self.ctx.generation,
                    "stopped with uploads in flight: the publisher lease is left to expire after its TTL"
                );
            } else {
                rt.block_on(upload::release_lease(&self.ctx));
            }
            rt.shutdown_timeout(Duration::from_secs(5));
        }
    }

    /// Counters.
    pub fn status(&self) -> Status {
        let s = self.shared.state.lock().expect("state lock");
        Status {
            stream_id: self.stream_id.clone(),
            last_published: self.last_step.max(self.pending.as_ref().map(|p| p.step)),
            last_delta_ready: s.last_delta,
            last_anchor_ready: s.last_anchor,
            queue_depth: s.queued,
            anchors_in_flight: s.anchors_in_flight,
            bytes_uploaded: s.bytes_uploaded,
            coalesced: self.coalesced,
            failures: s.failures,
            last_error: s.last_error.clone(),
            last_ratio: s.last_ratio,
            last_delta_bytes: s.last_delta_bytes,
        }
    }
}

impl Drop for Publisher {
    /// Dropped without [`Publisher::close`] (a script that ends, an exception, a publisher
    /// replaced): the steps still queued are flushed first, as `close` would (it cancelled
    /// their uploads, silently). What still did not reach the bucket is said on stderr, where a
    /// trainer's operator sees it whatever logging is set up: nothing else can report it.
    fn drop(&mut self) {
        // Not while a panic unwinds: the state it left may not be one to publish from.
        if self.rt.is_some() && self.tx.is_some() && !std::thread::panicking() {
            if let Err(e) = self.flush() {
                tracing::error!(error = %e, "publisher dropped without close: the newest step did not reach the bucket");
                let newest = self.last_step.max(self.pending.as_ref().map(|p| p.step));
                let step = newest.map_or_else(|| "the newest step".to_string(), |s| format!("step {s}"));
                eprintln!("driftless: publisher dropped without close(): {step} was NOT published: {e}");
            }
        }
        self.shutdown();
    }
}

/// Waits until `snap` has no other holder (an anchor thread writing it to its spool lets go,
/// then notifies `shared.changed`) and gives write access to it.
fn sole_holder<'s>(shared: &Shared, snap: &'s mut Arc<Snapshot>) -> &'s mut Snapshot {
    let mut guard = shared.state.lock().expect("state lock");
    while Arc::strong_count(snap) > 1 {
        guard = shared.changed.wait_timeout(guard, Duration::from_millis(50)).expect("state lock").0;
    }
    drop(guard);
    Arc::get_mut(snap).expect("the only holder")
}

/// Views in layout order, checked against it.
fn order<'a>(tensors: &[TensorView<'a>], layout: &Layout) -> Result<Vec<TensorView<'a>>> {
    let by: BTreeMap<&str, &TensorView<'a>> = tensors.iter().map(|t| (t.name, t)).collect();
    if by.len() != tensors.len() || by.len() != layout.tensors().count() {
        return Err(driftless_format::Error::InvalidInput("tensor set does not match the layout".into()).into());
    }
    layout
        .tensors()
        .map(|m| {
            by.get(m.name.as_str())
                .filter(|t| t.dtype == m.dtype && t.shape == m.shape.as_slice())
                .map(|t| **t)
                .ok_or_else(|| {
                    driftless_format::Error::InvalidInput(format!(
                        "tensor {} missing or differs from the layout",
                        m.name
                    ))
                    .into()
                })
        })
        .collect()
}

/// A fresh spool directory for an anchor: in `spool_dir`, or `TMPDIR`. Spools of processes
/// that are gone (a SIGKILLed trainer) are swept first ([`Spool`]).
pub(crate) fn spool_dir(cfg: &PublisherBuilder) -> Result<Spool> {
    Ok(Spool::new(cfg.spool_dir.as_deref(), "anchor")?)
}

/// Writes the snapshot's shards as plain safetensors files into a new spool directory: what
/// the anchor's encode (try `attempt`) needs of the snapshot, which can go once this returns.
fn spool_plain(cfg: &PublisherBuilder, snap: &Snapshot, attempt: u32) -> Result<(Spool, SpooledStep)> {
    #[cfg(feature = "fault-hooks")]
    std::thread::sleep(cfg.anchor_spool_delay);
    // Anchors start from a hashed snapshot only (a fresh copy, or a deferred delta's encode
    // waited for).
    let root = snap.root.ok_or_else(|| Error::Refused(format!("the snapshot of step {} is not hashed", snap.step)))?;
    let dir = spool_dir(cfg)?;
    let by: BTreeMap<&str, &[u8]> = snap.tensors.iter().map(|(m, d)| (m.name.as_str(), d.as_slice())).collect();
    for shard in &snap.layout.shards {
        let (header, _) = Layout::shard_header(shard)?;
        let mut f = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(dir.path().join(&shard.file))?);
        f.write_all(&header)?;
        for t in &shard.tensors {
            f.write_all(by.get(t.name.as_str()).expect("snapshot has every layout tensor"))?;
        }
        f.flush()?;
    }
    let step =
        SpooledStep { step: snap.step, root, layout: snap.layout.clone(), digests: snap.digests.clone(), attempt };
    Ok((dir, step))
}

/// A step whose safetensors files lie in a spool directory.
pub(crate) struct SpooledStep {
    pub(crate) step: u64,
    pub(crate) root: Digest,
    pub(crate) layout: Layout,
    pub(crate) digests: Vec<Digest>,
    /// The try of this step its object names carry ([`layout::attempt_name`]).
    pub(crate) attempt: u32,
}

/// Turns the plain safetensors files of `step` in `dir` (one per layout shard) into an
/// anchor job: encoded (streamed, bounded memory) and mapped for upload, manifest sealed.
pub(crate) fn encode_spooled(
    cfg: &PublisherBuilder,
    stream_id: &str,
    generation: u64,
    step: SpooledStep,
    dir: Spool,
) -> Result<AnchorJob> {
    let mut objects = vec![];
    let mut refs = vec![];
    for shard in &step.layout.shards {
        let plain = dir.path().join(&shard.file);
        let map = map_file(&plain)?;
        let decoded_size = map.len() as u64;
        let decoded_sha256 = Digest::of(&map);
        let (name, bytes) = match cfg.anchor_encoding {
            AnchorEncoding::Safetensors => {
                (layout::attempt_name(generation, step.attempt, &shard.file), Bytes::from_owner(map))
            }
            AnchorEncoding::PlanesZstd => {
                // Streamed to the spool file: bounded memory whatever the shard size.
                let p = dir.path().join(format!("{}.dla", shard.file));
                {
                    let mut w = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(&p)?);
                    anchor::encode_shard_to(&map, cfg.anchor_zstd_level, &mut w)??;
                    w.flush()?;
                }
                drop(map);
                std::fs::remove_file(&plain)?;
                (
                    layout::attempt_name(generation, step.attempt, &format!("{}.dla", shard.file)),
                    Bytes::from_owner(map_file(&p)?),
                )
            }
        };
        // The whole object's SHA-256 (for readers before signed parts) beside its parts'.
        let (sha256, parts) =
            rayon::join(|| Digest::of(&bytes), || anchor::part_refs(&bytes, decoded_size, cfg.anchor_encoding));
        refs.push(AnchorShardRef {
            file: shard.file.clone(),
            object: ObjectRef { object: name.clone(), size: bytes.len() as u64, sha256 },
            decoded_size,
            decoded_sha256,
            parts: parts?,
        });
        objects.push((name, bytes));
    }
    let mut files = vec![];
    for (n, b) in &cfg.extra_files {
        let name = layout::attempt_name(generation, step.attempt, &format!("extra-{n}"));
        files.push(ObjectRef { object: name.clone(), size: b.len() as u64, sha256: Digest::of(b) });
        objects.push((name, Bytes::from(b.clone())));
    }
    let m = AnchorManifest {
        kind: "anchor".into(),
        version: manifest::FORMAT_VERSION,
        stream_id: stream_id.to_string(),
        step: step.step,
        weights_root: step.root,
        encoding: cfg.anchor_encoding,
        shards: manifest::shard_records(&step.layout, &step.digests)?,
        objects: refs,
        files,
        created_at_ms: manifest::now_ms(),
    };
    let envelope = cfg.seal(&serde_json::to_vec(&m).expect("serializes"))?;
    Ok(AnchorJob {
        step: step.step,
        attempt: step.attempt,
        root: step.root,
        envelope: envelope.into(),
        objects,
        _spool: Some(dir),
        done: None,
    })
}

fn map_file(p: &std::path::Path) -> Result<memmap2::Mmap> {
    let f = std::fs::File::open(p)?;
    // SAFETY: spool files are private to this process and never modified after writing.
    Ok(unsafe { memmap2::Mmap::map(&f)? })
}

/// The stream id of `stream.json` read without checking its signature (for takeover only).
async fn unverified_stream_id(bucket: &Bucket) -> Option<String> {
    let b = bucket.get_limited(layout::STREAM, manifest::MAX_MANIFEST_BYTES as u64).await.ok()?;
    let env: driftless_format::sign::Envelope = serde_json::from_slice(&b).ok()?;
    StreamDescriptor::from_slice(env.payload.as_bytes()).ok().map(|d| d.stream_id)
}

/// Gives a delta's segments this generation's object names (see `driftless_store::layout`),
/// seals the manifest and makes the upload job. Returns the named manifest with the job.
fn seal_delta(
    cfg: &PublisherBuilder,
    generation: u64,
    mut m: DeltaManifest,
    enc: driftless_format::delta::EncodedDelta,
) -> Result<(DeltaManifest, DeltaJob)> {
    for r in &mut m.segments {
        r.object.object = layout::generation_name(generation, &r.object.object);
    }
    let envelope = cfg.seal(&serde_json::to_vec(&m).expect("manifest serializes"))?;
    let segments: Vec<(String, Bytes)> =
        m.segments.iter().zip(enc.segments).map(|(r, s)| (r.object.object.clone(), Bytes::from(s.bytes))).collect();
    let job =
        DeltaJob { step: m.step, base_step: m.base_step, root: m.result_root, envelope: envelope.into(), segments };
    Ok((m, job))
}

/// What a deferred delta's background thread needs: it owns everything it reads.
struct EncodeJob {
    cfg: PublisherBuilder,
    stream_id: String,
    generation: u64,
    shared: Arc<Shared>,
    tx: tokio::sync::mpsc::Sender<Job>,
    snap: Arc<Snapshot>,
    /// The changes are not in `snap` yet: it is the publisher's own, handed over, and this job
    /// applies them once it is the only holder (an anchor thread may still be spooling it),
    /// then gives it back in [`Finished`].
    apply_first: bool,
    /// Set while the changes are being applied: a panic then leaves the snapshot half new.
    mid_apply: bool,
    step: u64,
    base_step: u64,
    base_root: Digest,
    /// Set once the job is in the upload queue.
    sent: std::sync::atomic::AtomicBool,
}

/// What a deferred delta's thread returns: the snapshot, when it was handed over (`None`
/// otherwise, and when the job panicked while changing it), and the results.
struct Finished {
    snap: Option<Arc<Snapshot>>,
    done: Option<Encoded>,
}

/// A deferred delta's results the publisher keeps.
struct Encoded {
    step: u64,
    root: Digest,
    digests: Vec<Digest>,
    delta_bytes: u64,
}

impl EncodeJob {
    /// Encodes, hashes, seals and queues the delta. A failure (or a panic) is recorded like a
    /// failed upload: the step gets no marker and the next publish is an anchor.
    fn run(mut self, diff: driftless_format::DeltaDiff) -> Finished {
        let _s = info_span!("encode_delta", step = self.step).entered();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if self.apply_first {
                self.apply(&diff)?;
            }
            self.encode(diff)
        }))
        .unwrap_or_else(|_| {
            if self.mid_apply {
                // Possibly half applied: never given back.
                self.apply_first = false;
            }
            Err(Error::Upload { step: self.step, detail: "delta encoding panicked".into(), retryable: false })
        });
        let (step, shared, sent) =
            (self.step, self.shared.clone(), self.sent.load(std::sync::atomic::Ordering::SeqCst));
        let snap = self.apply_first.then(|| self.snap.clone());
        // Let the publisher's next snapshot_mut see this thread's reference gone.
        drop(self);
        let done = match r {
            Ok(done) => {
                shared.changed.notify_all();
                Some(done)
            }
            Err(e) => {
                warn!(step, error = %e, "delta encoding failed; next publish will anchor");
                shared.update(|s| {
                    // A job already queued is the uploader's to count down.
                    if !sent {
                        s.queued -= 1;
                    }
                    s.need_anchor = true;
                    s.failures += 1;
                    s.last_error = Some(format!("delta {step}: {e}"));
                    s.last_error_retryable = e.is_retryable();
                });
                None
            }
        };
        Finished { snap, done }
    }

    /// Waits until no anchor thread reads the snapshot, then applies the changes to it: the
    /// snapshot then holds this step, as [`driftless_format::diff_update`] would have left it.
    fn apply(&mut self, diff: &driftless_format::DeltaDiff) -> Result<()> {
        let _s = info_span!("apply_after_anchor").entered();
        let snap = sole_holder(&self.shared, &mut self.snap);
        self.mid_apply = true;
        #[cfg(feature = "fault-hooks")]
        if self.cfg.apply_panic == Some(self.step) {
            if let Some(b) = snap.tensors.iter_mut().find_map(|(_, d)| d.first_mut()) {
                *b ^= 0x40;
            }
            panic!("injected panic applying delta {}", self.step);
        }
        if let Err(e) = diff.apply(&snap.tensors_mut()) {
            // Not reached: the changes were taken against these bytes. The snapshot may be
            // half changed: never given back, so the next publish is an anchor.
            self.apply_first = false;
            return Err(Error::Upload {
                step: self.step,
                detail: format!("applying the delta: {e}"),
                retryable: false,
            });
        }
        snap.step = self.step;
        snap.root = None;
        snap.digests.clear();
        self.mid_apply = false;
        Ok(())
    }

    fn encode(&self, diff: driftless_format::DeltaDiff) -> Result<Encoded> {
        #[cfg(feature = "fault-hooks")]
        match self.cfg.encode_fault {
            Some((step, true)) if step == self.step => panic!("injected panic encoding delta {step}"),
            Some((step, false)) if step == self.step => {
                return Err(Error::Upload { step, detail: "injected encode failure".into(), retryable: true })
            }
            _ => {}
        }
        let snap = &self.snap;
        let opts = self.cfg.delta;
        let (enc, (digests, root)) = rayon::join(|| diff.encode(), || driftless_format::weights_root(&snap.views()));
        let enc = enc?;
        let spec = ops::DeltaSpec {
            stream_id: &self.stream_id,
            step: self.step,
            base_step: self.base_step,
            base_root: Some(self.base_root),
            layout: &snap.layout,
        };
        let m = ops::delta_manifest(spec, self.base_root, root, &digests, &enc, &opts)?;
        let (m, job) = seal_delta(&self.cfg, self.generation, m, enc)?;
        let delta_bytes = m.payload_bytes();
        let ratio = m.stats.dense_bytes as f64 / delta_bytes.max(1) as f64;
        let job = Job::Delta(job);
        // Before the job is queued: `wait` returns once it is uploaded, and the CLI then reads
        // this step's size from the status.
        self.shared.update(|s| {
            s.last_ratio = ratio;
            s.last_delta_bytes = delta_bytes;
        });
        self.tx.blocking_send(job).map_err(|_| Error::Closed)?;
        self.sent.store(true, std::sync::atomic::Ordering::SeqCst);
        info!(step = self.step, bytes = delta_bytes, ratio, "delta encoded");
        Ok(Encoded { step: self.step, root, digests, delta_bytes })
    }
}

/// A coalesced step: published by `flush` unless a newer step comes.
struct Pending {
    step: u64,
    layout: Layout,
    weights: Held,
}

/// How a coalesced step's weights are held.
enum Held {
    /// Its changes against the snapshot of step `base`, found by a read-only diff.
    Changes { base: u64, diff: driftless_format::DeltaDiff },
    /// A copy in layout order: another layout than the snapshot's, or the snapshot was about
    /// to change under the changes ([`Publisher::hold_pending_as_copy`]).
    Copy(Vec<(driftless_format::TensorMeta, Vec<u8>)>),
}

/// Takes the next free publisher generation: one more than any lease in the bucket, created
/// write-once so two starting publishers never share one.
/// Most ready markers of one kind a restarting publisher passes over as not its own before it
/// stops (each costs two GETs).
const MAX_FOREIGN_MARKERS: usize = 256;

/// The newest ready step of `kind` whose manifest passes the check agents make
/// ([`driftless_store::stream::check_step`], signed by a key of `trust` when given). Others
/// are passed over with a warning: a marker planted at step 10^12 beside a manifest of its own
/// made the publisher refuse every later step as "not after the last published step" for good.
async fn newest_checked(bucket: &Bucket, trust: Option<&TrustSet>, kind: StepKind) -> Result<Option<u64>> {
    let reader = StreamReader::new(bucket.clone(), TrustSet::new());
    let steps = reader.ready_steps(kind, None).await?;
    let mut passed_over = 0;
    for &step in steps.iter().rev() {
        let why = match reader.marker(kind, step).await {
            Ok(m) => driftless_store::stream::check_step(bucket, trust, kind, step, &m).await?,
            // An outage; anything else (a marker deleted since the listing, one that does not
            // parse) is passed over.
            Err(driftless_store::stream::StreamError::Store(e)) if e.is_retryable() => return Err(e.into()),
            Err(e) => Some(e.to_string()),
        };
        let Some(why) = why else { return Ok(Some(step)) };
        warn!(step, kind = %kind, reason = %why, "a ready marker this publisher did not write is passed over");
        passed_over += 1;
        if passed_over > MAX_FOREIGN_MARKERS {
            return Err(Error::Refused(format!(
                "more than {MAX_FOREIGN_MARKERS} {kind} ready markers fail the manifest check (the oldest of them, step {step}: {why}); remove them"
            )));
        }
    }
    Ok(None)
}

async fn acquire_generation(bucket: &Bucket, stream_id: &str, ttl: Duration, world_size: Option<u64>) -> Result<u64> {
    let list = bucket.list(layout::leases_prefix()).await?;
    let newest = list.iter().filter_map(|o| layout::parse_claim_or_lease(&o.key)).max().unwrap_or(0);
    // A planted `writers/<u64::MAX>` must not wrap the numbering back to generation 0.
    let exhausted = || {
        Error::Refused(format!("no publisher generation after {newest} (a lease in writers/ is not this stream's?)"))
    };
    let mut g = newest.checked_add(1).ok_or_else(exhausted)?;
    for _ in 0..16 {
        match bucket.put_create(&layout::lease(g), upload::lease_bytes(stream_id, g, ttl, world_size, None)).await {
            Ok(()) => return Ok(g),
            Err(e) if e.is_already_exists() => g = g.checked_add(1).ok_or_else(exhausted)?,
            Err(e) => return Err(e.into()),
        }
    }
    Err(Error::Refused("could not take a publisher generation: other publishers keep starting on this stream".into()))
}

/// Applies the committed deltas after the snapshot's step, in order, up to `newest`, then
/// verifies the final root once (every result root is signed, so the final check proves the
/// final state). Fails when the deltas do not chain from the snapshot to `newest` in place.
async fn roll_forward(ctx: &Ctx, snap: &mut Snapshot, newest: u64) -> Result<()> {
    let deltas = ctx.reader.ready_steps(StepKind::Delta, Some(snap.step)).await?;
    let mut expect_root = snap.root.ok_or_else(|| Error::Seed("the saved weights are not hashed".into()))?;
    for s in deltas.into_iter().filter(|&s| s <= newest) {
        let (m, _) = ctx.reader.delta(s).await?;
        if m.base_step != snap.step {
            continue;
        }
        if m.stream_id != ctx.stream_id || m.base_root != expect_root || ops::needs_rewrite(&snap.layout, &m) {
            return Err(Error::Seed(format!(
                "committed delta {s} does not apply to the saved weights of step {}",
                snap.step
            )));
        }
        let mut segs = Vec::with_capacity(m.segments.len());
        for r in &m.segments {
            let b = ctx.reader.object(StepKind::Delta, s, &r.object.object, r.object.size, r.object.sha256).await?;
            segs.push((b, r.raw_size));
        }
        {
            let tm = snap.tensors_mut();
            let refs: Vec<(&[u8], u64)> = segs.iter().map(|(b, n)| (&b[..], *n)).collect();
            driftless_format::delta::apply_all(&refs, &tm)?;
        }
        snap.step = s;
        expect_root = m.result_root;
        info!(step = s, "applied committed delta to the saved weights");
    }
    if snap.step != newest {
        return Err(Error::Seed(format!(
            "the committed deltas do not lead from the saved weights to the newest committed step {newest}"
        )));
    }
    let (digests, root) = driftless_format::weights_root(&snap.views());
    if root != expect_root {
        return Err(Error::Seed(format!("the saved weights brought to step {newest} do not match its signed root")));
    }
    snap.root = Some(root);
    snap.digests = digests;
    Ok(())
}
