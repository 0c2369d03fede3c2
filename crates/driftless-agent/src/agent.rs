//! Planning and executing syncs.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use driftless_format::checkpoint::write_index;
use driftless_format::delta::{self, DecodedSegment};
use driftless_format::manifest::{now_ms, ReadyMarker, StepKind};
use driftless_format::{anchor, ops, AnchorEncoding, Checkpoint, CheckpointMut, Digest, Journal, TrustSet, ValueMode};
use driftless_store::stream::{StreamError, StreamReader};
use driftless_store::Bucket;
use futures::{StreamExt, TryStreamExt};
use rayon::prelude::*;
use tracing::{info, info_span, warn, Instrument};

use crate::metrics::Metrics;
use crate::notify::Notifier;
use crate::state::LocalState;
use crate::{Error, Result};

/// Agent settings.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Local directory (holds `current/`, `state.json`, `journal`, `staging/`).
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
        }
    }
}

/// Which route a sync took.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SyncPath {
    /// Already on the newest step.
    UpToDate,
    /// One delta onto the local step.
    Fast,
    /// Several deltas from the local step.
    Catchup,
    /// An anchor, then deltas.
    Anchor,
}

/// Result of a sync.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SyncOutcome {
    /// Verified local step.
    pub step: u64,
    /// Its weights root.
    pub root: Digest,
    /// Route taken.
    pub path: SyncPath,
    /// Bytes downloaded.
    pub bytes: u64,
    /// Deltas applied.
    pub deltas: u32,
    /// Whether an interrupted apply was finished from the journal first.
    pub recovered: bool,
    /// Seconds spent.
    pub secs: f64,
}

/// The agent.
pub struct Agent {
    cfg: AgentConfig,
    reader: StreamReader,
    metrics: Arc<Metrics>,
    client: reqwest::Client,
    state: Option<LocalState>,
    loaded: Option<u64>,
    /// Steps whose marker or manifest failed verification (forged, replayed, swapped), keyed
    /// by the manifest SHA-256 their marker names: left out of plans until the marker changes.
    refused: std::collections::HashSet<(StepKind, u64, Digest)>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent").field("dir", &self.cfg.dir).field("state", &self.state).finish()
    }
}

type Plan = (u64, Option<u64>, Vec<u64>, u64); // (target, anchor, deltas, bytes)

/// A delta being downloaded in the background (see `Agent::start_fetch`).
struct Fetch {
    manifest: tokio::sync::oneshot::Receiver<Result<(driftless_format::DeltaManifest, Digest)>>,
    segments: tokio::sync::mpsc::UnboundedReceiver<Result<(usize, DecodedSegment, u64)>>,
    _abort: AbortOnDrop,
}

/// Stops a background download when its consumer goes away (a failed apply, a dropped sync).
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Agent {
    /// An agent on `bucket`. Creates the directory and loads its state.
    pub fn new(bucket: Bucket, cfg: AgentConfig) -> Result<Self> {
        std::fs::create_dir_all(&cfg.dir)?;
        let state = LocalState::load(&cfg.dir);
        let metrics = Arc::new(Metrics::new());
        if let Some(s) = &state {
            metrics.step.store(s.step, Relaxed);
        }
        Ok(Agent {
            reader: StreamReader::new(bucket, cfg.trust.clone()),
            cfg,
            metrics,
            client: reqwest::Client::new(),
            state,
            loaded: None,
            refused: Default::default(),
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

    /// The checkpoint directory the inference server loads.
    pub fn current_dir(&self) -> PathBuf {
        self.cfg.dir.join("current")
    }

    fn journal_path(&self) -> PathBuf {
        self.cfg.dir.join("journal")
    }

    /// Reaches the newest reachable step, verifies it, and notifies the servers.
    ///
    /// - A verified step the servers have not loaded yet (a failed or interrupted notify) is
    ///   notified first; nothing under `current/` changes until that succeeds, so a server
    ///   still loading step t never sees t+1 being written.
    /// - A step whose marker or manifest fails verification (forged, replayed) is refused: left
    ///   out of planning, local state kept, and the next best step planned.
    /// - On any other integrity failure (bad object, wrong base, result root) local state is
    ///   discarded and the sync is retried once from an anchor.
    pub async fn sync_once(&mut self) -> Result<SyncOutcome> {
        if !self.cfg.notify.is_empty() && self.state.as_ref().is_some_and(|s| s.applying.is_none()) {
            self.notify_if_needed().await?;
        }
        let mut refusal = None;
        let mut discarded = false;
        let mut attempts = 0;
        let r = loop {
            attempts += 1;
            match self.sync_inner().await {
                Err(e @ Error::Refused { .. }) if attempts < 8 => {
                    self.metrics.verify_failures.fetch_add(1, Relaxed);
                    warn!(error = %e, "refusing step; planning without it");
                    refusal = Some(e);
                }
                Err(e) if e.is_integrity() && !discarded => {
                    self.metrics.verify_failures.fetch_add(1, Relaxed);
                    warn!(error = %e, "verification failed; discarding local state and recovering from an anchor");
                    self.discard()?;
                    discarded = true;
                }
                Err(Error::NothingReady) if refusal.is_some() => break Err(refusal.take().expect("refusal")),
                r => break r,
            }
        };
        if let Err(e) = &r {
            if e.is_integrity() {
                self.metrics.verify_failures.fetch_add(1, Relaxed);
                self.discard()?;
            }
            return r;
        }
        let out = r?;
        self.notify_if_needed().await?;
        Ok(out)
    }

    async fn notify_if_needed(&mut self) -> Result<()> {
        let Some(st) = self.state.clone() else { return Ok(()) };
        if self.loaded == Some(st.step) {
            return Ok(());
        }
        for n in &self.cfg.notify {
            let t = Instant::now();
            if let Err(e) = n.notify(&self.client, st.step, st.root, &self.current_dir()).await {
                self.metrics.notify_failures.fetch_add(1, Relaxed);
                warn!(target = %n, error = %e, "notify failed");
                return Err(e);
            }
            info!(target = %n, step = st.step, secs = t.elapsed().as_secs_f64(), "inference server loaded step");
        }
        self.loaded = Some(st.step);
        self.metrics.ready.store(1, Relaxed);
        Ok(())
    }

    fn discard(&mut self) -> Result<()> {
        LocalState::clear(&self.cfg.dir)?;
        Journal::remove(&self.journal_path())?;
        let cur = self.current_dir();
        if cur.exists() {
            std::fs::remove_dir_all(&cur)?;
        }
        self.state = None;
        self.loaded = None;
        self.metrics.step.store(u64::MAX, Relaxed);
        Ok(())
    }

    fn set_state(&mut self, s: LocalState) -> Result<()> {
        s.store(&self.cfg.dir)?;
        self.metrics.step.store(s.step, Relaxed);
        self.state = Some(s);
        Ok(())
    }

    /// The outcome of a sync that found nothing newer than the local state, if there is one.
    fn up_to_date(&self, recovered: bool, t0: Instant) -> Option<SyncOutcome> {
        self.state.as_ref().map(|s| SyncOutcome {
            step: s.step,
            root: s.root,
            path: SyncPath::UpToDate,
            bytes: 0,
            deltas: 0,
            recovered,
            secs: t0.elapsed().as_secs_f64(),
        })
    }

    async fn sync_inner(&mut self) -> Result<SyncOutcome> {
        let t0 = Instant::now();
        let mut recovered = false;
        if self.state.as_ref().is_some_and(|s| s.applying.is_some()) {
            self.recover().await?;
            recovered = true;
        }
        let anchors = self.reader.ready_steps(StepKind::Anchor, None).await?;
        let local = self.state.as_ref().map(|s| s.step);
        let from = match (local, anchors.first()) {
            (Some(l), Some(&a)) => Some(l.min(a)),
            (Some(l), None) => Some(l),
            (None, Some(&a)) => Some(a),
            (None, None) => None,
        };
        let deltas = self.reader.ready_steps(StepKind::Delta, from).await?;
        let mut markers = self.delta_markers(&deltas).await?;
        markers.retain(|&s, m| !self.refused.contains(&(StepKind::Delta, s, m.manifest_sha256)));
        let anchor_markers = self.anchor_markers(&anchors).await?;
        let anchor_shas: BTreeMap<u64, Digest> = anchor_markers.iter().map(|(&s, m)| (s, m.manifest_sha256)).collect();
        let anchor_bytes: BTreeMap<u64, u64> = anchor_markers
            .iter()
            .filter(|(&s, m)| !self.refused.contains(&(StepKind::Anchor, s, m.manifest_sha256)))
            .map(|(&s, m)| (s, m.payload_bytes))
            .collect();
        let anchors: Vec<u64> =
            anchors.into_iter().filter(|a| !anchor_shas.contains_key(a) || anchor_bytes.contains_key(a)).collect();
        let Some((target, anchor, chain, bytes)) = plan(local, &anchors, &anchor_bytes, &markers) else {
            return self.up_to_date(recovered, t0).ok_or(Error::NothingReady);
        };
        self.metrics.newest.store(target, Relaxed);
        if self.metrics.newest_seen_ms.load(Relaxed) == 0 || local != Some(target) {
            self.metrics.newest_seen_ms.store(now_ms(), Relaxed);
        }
        if local == Some(target) {
            return Ok(self.up_to_date(recovered, t0).expect("local state"));
        }
        info!(target, ?anchor, deltas = chain.len(), bytes, "sync plan");
        let path = match (anchor, chain.len()) {
            (Some(_), _) => SyncPath::Anchor,
            (None, 1) => SyncPath::Fast,
            _ => SyncPath::Catchup,
        };
        let mut got = 0;
        if let Some(a) = anchor {
            let b = match self.load_anchor(a).await {
                Err(e @ Error::Refused { .. }) => {
                    return Err(self.refuse(StepKind::Anchor, a, anchor_shas.get(&a).copied(), e))
                }
                r => r?,
            };
            got += b;
            self.metrics.bytes_anchor.fetch_add(b, Relaxed);
            self.metrics.anchor_downloads.fetch_add(1, Relaxed);
        }
        // Pipelined: delta k+1 downloads (and decodes) while delta k is applied.
        let mut next = chain.first().map(|&d| self.start_fetch(d));
        for (k, &d) in chain.iter().enumerate() {
            let fetch = next.take().expect("a fetch per delta");
            next = chain.get(k + 1).map(|&d| self.start_fetch(d));
            let b = match self.apply_delta(d, fetch).await {
                Err(e @ Error::Refused { .. }) => {
                    return Err(self.refuse(StepKind::Delta, d, markers.get(&d).map(|m| m.manifest_sha256), e))
                }
                r => r?,
            };
            got += b;
            let ctr = match path {
                SyncPath::Fast => &self.metrics.bytes_fast,
                SyncPath::Catchup => &self.metrics.bytes_catchup,
                _ => &self.metrics.bytes_anchor,
            };
            ctr.fetch_add(b, Relaxed);
        }
        self.metrics.syncs.fetch_add(1, Relaxed);
        let s = self.state.as_ref().expect("synced");
        Ok(SyncOutcome {
            step: s.step,
            root: s.root,
            path,
            bytes: got,
            deltas: chain.len() as u32,
            recovered,
            secs: t0.elapsed().as_secs_f64(),
        })
    }

    async fn delta_markers(&self, steps: &[u64]) -> Result<BTreeMap<u64, ReadyMarker>> {
        let r = &self.reader;
        let v: Vec<Option<(u64, ReadyMarker)>> = futures::stream::iter(steps.iter().copied())
            .map(|s| async move {
                match r.marker(StepKind::Delta, s).await {
                    Ok(m) => Ok(Some((s, m))),
                    // Deleted by GC between list and get: skip it.
                    Err(StreamError::Store(e)) if e.is_not_found() => Ok(None),
                    // A marker that does not parse or names another step (copied, forged):
                    // never a reason to touch local state; the step is simply not ready.
                    Err(StreamError::Format(e)) => {
                        warn!(step = s, error = %e, "ignoring an unreadable delta marker");
                        Ok(None)
                    }
                    Err(e) => Err(e),
                }
            })
            .buffered(16)
            .try_collect()
            .await?;
        Ok(v.into_iter().flatten().collect())
    }

    async fn anchor_markers(&self, steps: &[u64]) -> Result<BTreeMap<u64, ReadyMarker>> {
        let mut out = BTreeMap::new();
        // Only the newest few matter for planning.
        for &s in steps.iter().rev().take(3) {
            match self.reader.marker(StepKind::Anchor, s).await {
                Ok(m) => {
                    out.insert(s, m);
                }
                Err(StreamError::Store(e)) if e.is_not_found() => {}
                Err(StreamError::Format(e)) => warn!(step = s, error = %e, "ignoring an unreadable anchor marker"),
                Err(e) => return Err(e.into()),
            }
        }
        Ok(out)
    }

    /// Records a refused step so that plans leave it out until its marker changes.
    fn refuse(&mut self, kind: StepKind, step: u64, sha: Option<Digest>, e: Error) -> Error {
        if let Some(sha) = sha {
            self.refused.insert((kind, step, sha));
        }
        e
    }

    /// Downloads, decodes and verifies an anchor into `staging/`, then swaps it in.
    async fn load_anchor(&mut self, step: u64) -> Result<u64> {
        let (m, _) = self.reader.anchor(step).await.map_err(|e| Error::manifest(StepKind::Anchor, step, e))?;
        let staging = self.cfg.dir.join("staging");
        if staging.exists() {
            std::fs::remove_dir_all(&staging)?;
        }
        std::fs::create_dir_all(&staging)?;
        let r = &self.reader;
        // Owned keys: closures over borrowed items make the future not provably `Send`.
        let keys: Vec<(String, u64, Digest)> =
            m.objects.iter().map(|o| (o.object.object.clone(), o.object.size, o.object.sha256)).collect();
        let objs: Vec<Bytes> = futures::stream::iter(keys)
            .map(|(k, n, sha)| async move { r.object(StepKind::Anchor, step, &k, n, sha).await })
            .buffered(self.cfg.download_concurrency.max(1))
            .try_collect()
            .instrument(info_span!("download_anchor", step))
            .await?;
        let keys: Vec<(String, u64, Digest)> = m.files.iter().map(|o| (o.object.clone(), o.size, o.sha256)).collect();
        let files: Vec<Bytes> = futures::stream::iter(keys)
            .map(|(k, n, sha)| async move { r.object(StepKind::Anchor, step, &k, n, sha).await })
            .buffered(4)
            .try_collect()
            .await?;
        let bytes: u64 = objs.iter().chain(&files).map(|b| b.len() as u64).sum();
        let dir = staging.clone();
        let m2 = m.clone();
        tokio::task::spawn_blocking(move || -> Result<()> {
            for (o, b) in m2.objects.iter().zip(&objs) {
                let p = dir.join(&o.file);
                match m2.encoding {
                    AnchorEncoding::Safetensors => std::fs::write(&p, b)?,
                    AnchorEncoding::PlanesZstd => {
                        if o.decoded_size > anchor::MAX_SHARD {
                            return Err(driftless_format::Error::Corrupt {
                                what: "anchor manifest",
                                detail: "shard too large".into(),
                            }
                            .into());
                        }
                        let f =
                            std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&p)?;
                        f.set_len(o.decoded_size)?;
                        // SAFETY: a file we just created in our private staging directory.
                        let mut map = unsafe { memmap2::MmapMut::map_mut(&f)? };
                        anchor::decode_shard(b, &mut map)?;
                        map.flush()?;
                    }
                }
            }
            for (o, b) in m2.files.iter().zip(&files) {
                let name = o.object.strip_prefix("extra-").unwrap_or(&o.object);
                driftless_format::validate_file_name(name)?;
                std::fs::write(dir.join(name), b)?;
            }
            write_index(&dir, &m2.layout())?;
            let ck = Checkpoint::open(&dir)?;
            if ck.layout() != m2.layout() {
                return Err(driftless_format::Error::Corrupt {
                    what: "anchor",
                    detail: "decoded files do not match the manifest layout".into(),
                }
                .into());
            }
            ops::verify_views(&ck.views(), &m2.shards, m2.weights_root)?;
            Ok(())
        })
        .await
        .expect("anchor task")?;
        // Swap: a crash between these renames leaves no state.json, hence a cold start.
        LocalState::clear(&self.cfg.dir)?;
        let cur = self.current_dir();
        if cur.exists() {
            std::fs::remove_dir_all(&cur)?;
        }
        std::fs::rename(&staging, &cur)?;
        self.set_state(LocalState { stream_id: m.stream_id.clone(), step, root: m.weights_root, applying: None })?;
        info!(step, bytes, "anchor loaded and verified");
        Ok(bytes)
    }

    async fn fetch_segments(&self, m: &driftless_format::DeltaManifest, skip: &[u32]) -> Result<Vec<Option<Bytes>>> {
        let r = &self.reader;
        let step = m.step;
        let keys: Vec<(usize, String, u64, Digest)> = m
            .segments
            .iter()
            .enumerate()
            .map(|(i, s)| (i, s.object.object.clone(), s.object.size, s.object.sha256))
            .collect();
        Ok(futures::stream::iter(keys)
            .map(|(i, k, n, sha)| async move {
                if skip.contains(&(i as u32)) {
                    return Ok(None);
                }
                r.object(StepKind::Delta, step, &k, n, sha).await.map(Some)
            })
            .buffered(self.cfg.download_concurrency.max(1))
            .try_collect()
            .await?)
    }

    /// Starts downloading delta `step` in the background: its manifest, then its segments,
    /// each checked against the manifest and decoded as soon as it arrives (decoding segment i
    /// overlaps downloading segment i+1). Nothing local is touched; dropping the handle stops it.
    fn start_fetch(&self, step: u64) -> Fetch {
        let reader = self.reader.clone();
        let conc = self.cfg.download_concurrency.max(1);
        let (mtx, manifest) = tokio::sync::oneshot::channel();
        let (stx, segments) = tokio::sync::mpsc::unbounded_channel();
        let task = tokio::spawn(
            async move {
                let (m, sha) = match reader.delta(step).await {
                    Ok(x) => x,
                    Err(e) => {
                        let _ = mtx.send(Err(Error::manifest(StepKind::Delta, step, e)));
                        return;
                    }
                };
                let _ = mtx.send(Ok((m.clone(), sha)));
                let mode = m.value_mode;
                let mut s = futures::stream::iter(m.segments.clone().into_iter().enumerate())
                    .map(move |(i, s)| {
                        let r = reader.clone();
                        async move {
                            let b = r
                                .object(StepKind::Delta, step, &s.object.object, s.object.size, s.object.sha256)
                                .await?;
                            let raw = s.raw_size;
                            let seg = tokio::task::spawn_blocking(move || -> Result<DecodedSegment> {
                                let seg = delta::decode_segment(&b, raw)?;
                                if seg.mode != mode {
                                    return Err(driftless_format::Error::Corrupt {
                                        what: "segment",
                                        detail: "value mode differs from the manifest".into(),
                                    }
                                    .into());
                                }
                                Ok(seg)
                            })
                            .await
                            .expect("decode task")?;
                            Ok::<_, Error>((i, seg, s.object.size))
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
        Fetch { manifest, segments, _abort: AbortOnDrop(task.abort_handle()) }
    }

    /// Applies one delta being fetched: checks its base, waits for all its segments (each
    /// already checked and decoded), then applies them in place (journaled) or by rewrite, and
    /// verifies. Local files are written only once every segment is in, so a download failure
    /// (GC, bucket outage) leaves the verified state untouched.
    async fn apply_delta(&mut self, step: u64, fetch: Fetch) -> Result<u64> {
        let Fetch { manifest, mut segments, _abort } = fetch;
        let (m, env_sha) = manifest.await.map_err(|_| Error::Io(std::io::Error::other("delta download stopped")))??;
        let st = self.state.clone().expect("a base state");
        if m.base_root != st.root {
            return Err(driftless_format::Error::WrongBase {
                expected: m.base_root.to_hex(),
                actual: st.root.to_hex(),
            }
            .into());
        }
        let mut segs: Vec<Option<DecodedSegment>> = (0..m.segments.len()).map(|_| None).collect();
        let mut bytes = 0u64;
        while let Some(r) = segments.recv().await {
            let (i, seg, n) = r?;
            bytes += n;
            segs[i] = Some(seg);
        }
        let segs: Vec<DecodedSegment> = segs
            .into_iter()
            .collect::<Option<_>>()
            .ok_or_else(|| Error::Io(std::io::Error::other("delta download stopped")))?;
        let cur = self.current_dir();
        let local_layout = Checkpoint::open(&cur)?.layout();
        let t = Instant::now();
        if ops::needs_rewrite(&local_layout, &m) {
            // Rare (layout changes): re-fetch the raw segments for the rewrite.
            let raw = self.fetch_segments(&m, &[]).await?;
            drop(segs);
            let staging = self.cfg.dir.join("staging");
            if staging.exists() {
                std::fs::remove_dir_all(&staging)?;
            }
            let (m2, cur2, st2) = (m.clone(), cur.clone(), staging.clone());
            tokio::task::spawn_blocking(move || -> Result<()> {
                let base = Checkpoint::open(&cur2)?;
                let segs: Vec<&[u8]> = raw.iter().flatten().map(|b| &b[..]).collect();
                ops::apply_rewrite(&base.views(), &m2, &segs, &st2)?;
                Ok(())
            })
            .await
            .expect("rewrite task")?;
            LocalState::clear(&self.cfg.dir)?;
            std::fs::remove_dir_all(&cur)?;
            std::fs::rename(&staging, &cur)?;
        } else {
            self.set_state(LocalState { applying: Some((step, m.base_step)), ..st.clone() })?;
            let (m2, jp) = (m.clone(), self.journal_path());
            let verify_ms = tokio::task::spawn_blocking(move || -> Result<u64> {
                let mut ck = CheckpointMut::open(&cur)?;
                {
                    let tm = ck.tensors_mut();
                    let j = Journal::create(&jp, env_sha, st.root)?;
                    let ap = ops::Applier::new(&tm, &m2, Some(j));
                    // Same protocol as `Applier::apply`: a `ulp` segment's redo record is
                    // journaled (fsync) before its cells are written; `overwrite` is idempotent.
                    segs.par_iter().enumerate().try_for_each(|(i, seg)| -> Result<()> {
                        match seg.mode {
                            ValueMode::Ulp => {
                                let redo = delta::to_redo(seg, &tm)?;
                                ap.replay(&[(i as u32, redo)])?;
                            }
                            _ => delta::apply_segment(seg, &tm)?,
                        }
                        Ok(())
                    })?;
                }
                let tv = Instant::now();
                ops::verify_result(&ck.views(), &m2)?;
                Journal::remove(&jp)?;
                Ok(tv.elapsed().as_millis() as u64)
            })
            .await
            .expect("apply task")?;
            self.metrics.verify_ms.store(verify_ms, Relaxed);
        }
        self.metrics.apply_ms.store(t.elapsed().as_millis() as u64, Relaxed);
        self.set_state(LocalState { stream_id: m.stream_id.clone(), step, root: m.result_root, applying: None })?;
        info!(step, bytes, secs = t.elapsed().as_secs_f64(), "delta applied and verified");
        Ok(bytes)
    }

    /// Finishes an apply interrupted by a crash: from the journal when there is one, else by
    /// hashing the local files to see whether the delta had been applied or not at all.
    async fn recover(&mut self) -> Result<()> {
        let st = self.state.clone().expect("state");
        let (step, base_step) = st.applying.expect("applying");
        let _ = base_step;
        let jp = self.journal_path();
        let cur = self.current_dir();
        let (m, env_sha) = match self.reader.delta(step).await {
            Ok(x) => x,
            Err(e) if e.is_retryable() => {
                // The delta is gone (GC) or unreadable: fall back to hashing what we have.
                warn!(step, error = %e, "delta of the interrupted apply is not readable");
                return self.recover_by_hash(None).await;
            }
            Err(e) => return Err(e.into()),
        };
        let rec = Journal::recover(&jp)?;
        let Some(rec) = rec.filter(|r| r.delta_id == env_sha && r.base_root == st.root) else {
            return self.recover_by_hash(Some(&m)).await;
        };
        let done: Vec<u32> = rec.records.iter().map(|(i, _)| *i).collect();
        let segs = self.fetch_segments(&m, &done).await?;
        let m2 = m.clone();
        tokio::task::spawn_blocking(move || -> Result<()> {
            let mut ck = CheckpointMut::open(&cur)?;
            {
                let tm = ck.tensors_mut();
                // The records are already in the journal file: replay them without journaling
                // again, then journal only the segments applied now.
                ops::Applier::new(&tm, &m2, None).replay(&rec.records)?;
                let j = Journal::reopen(&jp, rec.valid_len)?;
                let ap = ops::Applier::new(&tm, &m2, Some(j));
                for (i, s) in segs.iter().enumerate() {
                    if let Some(b) = s {
                        ap.apply(i, b)?;
                    }
                }
            }
            ops::verify_result(&ck.views(), &m2)?;
            Journal::remove(&jp)?;
            Ok(())
        })
        .await
        .expect("recover task")?;
        self.metrics.journal_recoveries.fetch_add(1, Relaxed);
        info!(step, replayed = done.len(), "finished interrupted apply from the journal");
        self.set_state(LocalState { stream_id: m.stream_id.clone(), step, root: m.result_root, applying: None })
    }

    async fn recover_by_hash(&mut self, m: Option<&driftless_format::DeltaManifest>) -> Result<()> {
        let st = self.state.clone().expect("state");
        let cur = self.current_dir();
        let root = tokio::task::spawn_blocking(move || -> Result<Digest> {
            Ok(driftless_format::weights_root(&Checkpoint::open(&cur)?.views()).1)
        })
        .await
        .expect("hash task")?;
        Journal::remove(&self.journal_path())?;
        if root == st.root {
            // The apply never wrote anything.
            return self.set_state(LocalState { applying: None, ..st });
        }
        if let Some(m) = m.filter(|m| m.result_root == root) {
            return self.set_state(LocalState { stream_id: st.stream_id, step: m.step, root, applying: None });
        }
        Err(driftless_format::Error::Corrupt {
            what: "local checkpoint",
            detail: "interrupted apply cannot be recovered".into(),
        }
        .into())
    }

    /// Follows the stream until `shutdown` resolves: adaptive, jittered polling; an immediate
    /// poll when `poke` is notified; exponential backoff after failures.
    pub async fn run(
        mut self,
        poke: Arc<tokio::sync::Notify>,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<()> {
        tokio::pin!(shutdown);
        let mut interval = self.cfg.poll_min;
        let mut failures = 0u32;
        let mut etag: Option<String> = None;
        let mut polls = 0u64;
        loop {
            polls += 1;
            // Cheap check first: when latest.json did not change and we are on a step, skip the
            // listing (markers stay the source of truth: list anyway every 10th poll).
            let unchanged = self.state.is_some()
                && self.loaded.is_some()
                && polls % 10 != 0
                && matches!(self.reader.latest(etag.as_deref()).await, Ok(None));
            if !unchanged {
                if let Ok(Some((_, tag))) = self.reader.latest(None).await {
                    etag = tag;
                }
                match self.sync_once().await {
                    Ok(o) => {
                        failures = 0;
                        interval = if o.path == SyncPath::UpToDate {
                            (interval * 2).min(self.cfg.poll_max)
                        } else {
                            self.cfg.poll_min
                        };
                        if o.path != SyncPath::UpToDate {
                            info!(step = o.step, path = ?o.path, bytes = o.bytes, secs = o.secs, "synced");
                        }
                    }
                    Err(e) => {
                        failures += 1;
                        interval =
                            (self.cfg.poll_min * 2u32.saturating_pow(failures.min(6))).min(self.cfg.poll_max * 3);
                        warn!(error = %e, failures, retry_in = ?interval, "sync failed");
                    }
                }
            } else {
                interval = (interval * 2).min(self.cfg.poll_max);
            }
            let jitter = 0.8 + 0.4 * rand::random::<f64>();
            tokio::select! {
                _ = tokio::time::sleep(interval.mul_f64(jitter)) => {}
                _ = poke.notified() => { interval = self.cfg.poll_min; }
                _ = &mut shutdown => { info!("shutting down"); return Ok(()); }
            }
        }
    }
}

/// Picks the cheapest route to the newest reachable step. Returns (target, anchor to load,
/// deltas to apply, bytes), or `None` when nothing is reachable or needed.
fn plan(
    local: Option<u64>,
    anchors: &[u64],
    anchor_bytes: &BTreeMap<u64, u64>,
    markers: &BTreeMap<u64, ReadyMarker>,
) -> Option<Plan> {
    // Walks base links back from `target` to `start`.
    let chain = |start: u64, target: u64| -> Option<(Vec<u64>, u64)> {
        let mut v = vec![];
        let mut bytes = 0;
        let mut s = target;
        while s != start {
            let m = markers.get(&s)?;
            v.push(s);
            bytes += m.payload_bytes;
            s = m.base_step?;
            if s < start {
                return None;
            }
        }
        v.reverse();
        Some((v, bytes))
    };
    let mut candidates: Vec<u64> = markers.keys().copied().chain(anchors.iter().copied()).collect();
    candidates.sort_unstable();
    candidates.dedup();
    for &target in candidates.iter().rev() {
        if local.is_some_and(|l| target <= l) {
            return None;
        }
        let mut best: Option<Plan> = None;
        if let Some(l) = local {
            if let Some((v, b)) = chain(l, target) {
                best = Some((target, None, v, b));
            }
        }
        for (&a, &ab) in anchor_bytes.iter().rev() {
            if a > target {
                continue;
            }
            if let Some((v, b)) = chain(a, target) {
                let cost = ab + b;
                if best.as_ref().is_none_or(|p| cost < p.3) {
                    best = Some((target, Some(a), v, cost));
                }
            }
        }
        if best.is_some() {
            return best;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marker(step: u64, base: u64, bytes: u64) -> ReadyMarker {
        ReadyMarker {
            kind: "ready".into(),
            stream_id: "s".into(),
            of: StepKind::Delta,
            step,
            base_step: Some(base),
            manifest_sha256: Digest::default(),
            payload_bytes: bytes,
        }
    }

    #[test]
    fn plans_cheapest_route() {
        let mut ms = BTreeMap::new();
        for s in 1..=20 {
            ms.insert(s, marker(s, s - 1, 10));
        }
        let anchors = vec![0, 10];
        let ab = BTreeMap::from([(0, 1000), (10, 1000)]);
        // Fast path.
        assert_eq!(plan(Some(19), &anchors, &ab, &ms), Some((20, None, vec![20], 10)));
        // A few behind: replay.
        assert_eq!(plan(Some(15), &anchors, &ab, &ms).unwrap().1, None);
        // Cold: newest anchor plus the deltas after it.
        assert_eq!(plan(None, &anchors, &ab, &ms), Some((20, Some(10), (11..=20).collect(), 1100)));
        // Far behind with cheap anchors: anchor wins.
        let cheap = BTreeMap::from([(0, 5), (10, 5)]);
        assert_eq!(plan(Some(1), &anchors, &cheap, &ms).unwrap().1, Some(10));
        // Up to date.
        assert_eq!(plan(Some(20), &anchors, &ab, &ms), None);
    }

    #[test]
    fn follows_declared_base_and_skips_broken_tips() {
        let mut ms = BTreeMap::new();
        ms.insert(1, marker(1, 0, 10));
        ms.insert(4, marker(4, 1, 10)); // coalesced 2..3
        ms.insert(6, marker(6, 5, 10)); // base 5 never made it
        let p = plan(Some(0), &[0], &BTreeMap::from([(0, 1000)]), &ms).unwrap();
        assert_eq!(p, (4, None, vec![1, 4], 20));
    }
}
