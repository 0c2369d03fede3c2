//! Synthetic streams for the GC tests: a model of steps, written to buckets directly (real
//! `ReadyMarker` JSON, unsigned manifests that agree with them, placeholder payloads) or turned
//! into an `Inventory`.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use driftless_format::{Digest, ReadyMarker, StepKind};
use driftless_gc::{Inventory, MarkerState, StepId};
use driftless_store::{layout, Bucket, ObjectInfo, StoreOptions};

/// One step of a synthetic stream.
#[derive(Debug, Clone)]
pub struct Step {
    pub id: StepId,
    /// Base of a delta.
    pub base: Option<u64>,
    /// Whether the marker was written (false: a crashed publisher's leftovers).
    pub ready: bool,
    /// Payload object sizes (besides the manifest).
    pub payload: Vec<u64>,
    /// When its objects were written.
    pub written: SystemTime,
}

/// Keys outside the layout that GC must never touch.
pub const FOREIGN: &[&str] = &[
    "stream.json",
    "latest.json",
    "notes/readme.txt",
    "deltas/000000000003.bak",
    "deltas/12/manifest.json",
    "ready/deltas/12",
    "ready/other/000000000001",
    "anchors/000000000000/nested/x.bin",
];

pub fn payload_name(kind: StepKind, i: usize) -> String {
    match kind {
        StepKind::Delta => format!("seg-{i:05}.dls"),
        StepKind::Anchor => format!("model-{:05}.safetensors", i + 1),
    }
}

pub fn marker_bytes(s: &Step) -> Bytes {
    Bytes::from(
        serde_json::to_vec(&ReadyMarker {
            kind: "ready".into(),
            stream_id: "test-stream".into(),
            of: s.id.kind,
            step: s.id.step,
            base_step: s.base,
            manifest_sha256: Digest::of(&manifest_bytes(s)),
            payload_bytes: s.payload.iter().sum(),
            manifest: None,
        })
        .unwrap(),
    )
}

fn payload_bytes(i: usize, size: u64) -> Bytes {
    Bytes::from(vec![(i % 251) as u8; size as usize])
}

/// An unsigned manifest that passes the checks agents (and GC) make against the marker: one
/// object per payload entry, no tensors.
pub fn manifest_bytes(s: &Step) -> Bytes {
    let objects: Vec<(String, Bytes)> =
        s.payload.iter().enumerate().map(|(i, &size)| (payload_name(s.id.kind, i), payload_bytes(i, size))).collect();
    manifest_of(s.id, s.base, &objects)
}

/// An unsigned manifest of step `id` (base `base`) naming `objects` (name, bytes).
pub fn manifest_of(id: StepId, base: Option<u64>, objects: &[(String, Bytes)]) -> Bytes {
    signed_manifest_of(id, base, objects, None)
}

/// The ready marker of step `id` (base `base`) announcing `manifest`, which names objects of
/// `payload` bytes in all.
pub fn marker_for(id: StepId, base: Option<u64>, manifest: &[u8], payload: u64) -> Bytes {
    Bytes::from(
        serde_json::to_vec(&ReadyMarker {
            kind: "ready".into(),
            stream_id: "test-stream".into(),
            of: id.kind,
            step: id.step,
            base_step: base,
            manifest_sha256: Digest::of(manifest),
            payload_bytes: payload,
            manifest: None,
        })
        .unwrap(),
    )
}

/// Writes step `id` as a publisher does (one payload object, manifest signed by `key` when
/// given, marker last).
pub async fn write_step_signed(
    b: &Bucket,
    id: StepId,
    base: Option<u64>,
    key: Option<&driftless_format::sign::Keypair>,
) {
    let objects = vec![(payload_name(id.kind, 0), payload_bytes(0, 20))];
    let m = signed_manifest_of(id, base, &objects, key);
    b.put(&layout::object(id.kind, id.step, &objects[0].0), objects[0].1.clone()).await.unwrap();
    b.put(&layout::manifest(id.kind, id.step), m.clone()).await.unwrap();
    b.put(&layout::ready(id.kind, id.step), marker_for(id, base, &m, 20)).await.unwrap();
}

/// An unsigned `stream.json` of the stream `test-stream` (the id the test markers carry).
pub async fn write_stream_json(b: &Bucket) {
    b.put(layout::STREAM, stream_json()).await.unwrap();
}

fn stream_json() -> Bytes {
    let desc = driftless_format::manifest::StreamDescriptor {
        kind: "stream".into(),
        version: driftless_format::manifest::FORMAT_VERSION,
        stream_id: "test-stream".into(),
        trusted_keys: vec![],
        created_at_ms: 0,
    };
    let env = driftless_format::sign::seal_unsigned(&serde_json::to_vec(&desc).unwrap()).unwrap();
    Bytes::from(env)
}

/// [`manifest_of`], signed by `key` when given.
pub fn signed_manifest_of(
    id: StepId,
    base: Option<u64>,
    objects: &[(String, Bytes)],
    key: Option<&driftless_format::sign::Keypair>,
) -> Bytes {
    manifest_of_stream(id, base, objects, key, "test-stream")
}

/// [`signed_manifest_of`] for the stream `stream_id`.
pub fn manifest_of_stream(
    id: StepId,
    base: Option<u64>,
    objects: &[(String, Bytes)],
    key: Option<&driftless_format::sign::Keypair>,
    stream_id: &str,
) -> Bytes {
    use driftless_format::manifest::{AnchorEncoding, AnchorManifest, AnchorShardRef, DeltaManifest, ObjectRef};
    use driftless_format::manifest::{SegmentRef, ShardRecord, FORMAT_VERSION};
    let obj =
        |(name, b): &(String, Bytes)| ObjectRef { object: name.clone(), size: b.len() as u64, sha256: Digest::of(b) };
    let payload = match id.kind {
        StepKind::Delta => serde_json::to_vec(&DeltaManifest {
            kind: "delta".into(),
            version: FORMAT_VERSION,
            stream_id: stream_id.into(),
            step: id.step,
            base_step: base.unwrap_or(0),
            base_root: Digest([0; 32]),
            result_root: Digest([0; 32]),
            value_mode: Default::default(),
            codec: driftless_format::Codec::Raw,
            shards: vec![],
            segments: objects.iter().map(|o| SegmentRef { object: obj(o), raw_size: 0, entries: 0 }).collect(),
            stats: Default::default(),
            created_at_ms: 0,
        }),
        StepKind::Anchor => serde_json::to_vec(&AnchorManifest {
            kind: "anchor".into(),
            version: FORMAT_VERSION,
            stream_id: stream_id.into(),
            step: id.step,
            weights_root: Digest([0; 32]),
            encoding: AnchorEncoding::Safetensors,
            shards: (0..objects.len())
                .map(|i| ShardRecord {
                    file: format!("model-{:05}.safetensors", i + 1),
                    tensors: vec![],
                    metadata: None,
                })
                .collect(),
            objects: objects
                .iter()
                .enumerate()
                .map(|(i, o)| AnchorShardRef {
                    file: format!("model-{:05}.safetensors", i + 1),
                    object: obj(o),
                    decoded_size: 16,
                    decoded_sha256: Digest([0; 32]),
                    parts: vec![],
                })
                .collect(),
            files: vec![],
            created_at_ms: 0,
        }),
    };
    let payload = payload.unwrap();
    Bytes::from(match key {
        Some(k) => k.seal(&payload).unwrap(),
        None => driftless_format::sign::seal_unsigned(&payload).unwrap(),
    })
}

/// The objects of a step: (key, bytes), marker last.
pub fn step_objects(s: &Step) -> Vec<(String, Bytes)> {
    let mut out = vec![(layout::manifest(s.id.kind, s.id.step), manifest_bytes(s))];
    for (i, &size) in s.payload.iter().enumerate() {
        out.push((layout::object(s.id.kind, s.id.step, &payload_name(s.id.kind, i)), payload_bytes(i, size)));
    }
    if s.ready {
        out.push((layout::ready(s.id.kind, s.id.step), marker_bytes(s)));
    }
    out
}

/// The model as the planner sees it after listing.
pub fn inventory(steps: &[Step]) -> Inventory {
    let mut inv = Inventory::default();
    for s in steps {
        for (key, bytes) in step_objects(s) {
            let info = ObjectInfo { key: key.clone(), size: bytes.len() as u64, last_modified: s.written, etag: None };
            if layout::parse_step_key(&key).is_some_and(|(_, _, name)| name.is_none()) {
                let m: ReadyMarker = serde_json::from_slice(&bytes).unwrap();
                inv.add_marker(info, MarkerState::Ready(m));
            } else {
                inv.add_object(info);
            }
        }
    }
    inv
}

/// Write every step (payload, manifest, marker last) and the foreign keys.
pub async fn write_steps(b: &Bucket, steps: &[Step]) {
    write_stream_json(b).await;
    for s in steps {
        write_step(b, s).await;
    }
}

pub async fn write_step(b: &Bucket, s: &Step) {
    let objs = step_objects(s);
    let (last, rest) = objs.split_last().unwrap();
    futures_join(b, rest).await;
    b.put(&last.0, last.1.clone()).await.unwrap();
}

async fn futures_join(b: &Bucket, objs: &[(String, Bytes)]) {
    let mut set = tokio::task::JoinSet::new();
    for (k, v) in objs {
        let (b, k, v) = (b.clone(), k.clone(), v.clone());
        set.spawn(async move { b.put(&k, v).await.unwrap() });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
}

pub async fn write_foreign(b: &Bucket) -> BTreeMap<String, Bytes> {
    let mut out = BTreeMap::new();
    for k in FOREIGN {
        // GC must not touch stream.json, and needs a real one to collect at all.
        let v = if *k == layout::STREAM { stream_json() } else { Bytes::from(format!("foreign {k}")) };
        b.put(k, v.clone()).await.unwrap();
        out.insert(k.to_string(), v);
    }
    out
}

pub async fn assert_foreign_intact(b: &Bucket, foreign: &BTreeMap<String, Bytes>) {
    for (k, v) in foreign {
        assert_eq!(&b.get(k).await.unwrap_or_else(|e| panic!("{k}: {e}")), v, "{k} changed");
    }
}

/// Every marker in the bucket: its manifest exists and its payload adds up to
/// `payload_bytes` (no marker ever points to a step whose objects are gone).
pub async fn assert_markers_complete(b: &Bucket) -> BTreeMap<StepId, ReadyMarker> {
    let mut out = BTreeMap::new();
    for info in b.list("ready/").await.unwrap() {
        let Some((kind, step, None)) = layout::parse_step_key(&info.key) else {
            continue;
        };
        let m: ReadyMarker = serde_json::from_slice(&b.get(&info.key).await.unwrap()).unwrap();
        let dir = match kind {
            StepKind::Delta => layout::delta_dir(step),
            StepKind::Anchor => layout::anchor_dir(step),
        };
        let objs: Vec<ObjectInfo> =
            b.list(&dir).await.unwrap().into_iter().filter(|o| layout::parse_step_key(&o.key).is_some()).collect();
        let manifest = layout::manifest(kind, step);
        assert!(objs.iter().any(|o| o.key == manifest), "{} without manifest", info.key);
        let payload: u64 = objs.iter().filter(|o| o.key != manifest).map(|o| o.size).sum();
        assert_eq!(payload, m.payload_bytes, "{}: payload objects missing", info.key);
        out.insert(StepId { kind, step }, m);
    }
    out
}

/// Reachable steps of a set of ready markers: anchors, and deltas whose base is reachable.
pub fn reachable(ready: &BTreeMap<StepId, Option<u64>>) -> BTreeSet<StepId> {
    let mut states: BTreeSet<u64> = BTreeSet::new();
    let mut out = BTreeSet::new();
    for (id, base) in ready {
        let ok = match id.kind {
            StepKind::Anchor => true,
            StepKind::Delta => base.is_some_and(|b| b < id.step && states.contains(&b)),
        };
        if ok {
            states.insert(id.step);
            out.insert(*id);
        }
    }
    out
}

/// The chain of reachable delta `s` in `ready`: deltas down the base links to the first step
/// with an anchor, and that anchor.
pub fn chain(ready: &BTreeMap<StepId, Option<u64>>, s: u64) -> Vec<StepId> {
    let mut out = Vec::new();
    let mut cur = s;
    while let Some(Some(b)) = ready.get(&StepId::delta(cur)) {
        if ready.contains_key(&StepId::anchor(*b)) {
            out.push(StepId::anchor(*b));
            break;
        }
        out.push(StepId::delta(*b));
        cur = *b;
    }
    out
}

/// A stream of `n` steps: an anchor at 0 and every `every` steps, a delta (base s-1) at
/// every step from 1, written `spacing` apart ending at `end`.
pub fn regular(n: u64, every: u64, end: SystemTime, spacing: Duration) -> Vec<Step> {
    let mut out = Vec::new();
    for s in 0..=n {
        let written = end - spacing * (n - s) as u32;
        if s % every == 0 {
            out.push(Step { id: StepId::anchor(s), base: None, ready: true, payload: vec![300, 300], written });
        }
        if s > 0 {
            out.push(Step { id: StepId::delta(s), base: Some(s - 1), ready: true, payload: vec![20], written });
        }
    }
    out
}

// ---- buckets ----

pub fn test_opts() -> StoreOptions {
    StoreOptions::default().with_max_retries(3).with_retry_timeout(Duration::from_secs(20))
}

pub struct TestBucket {
    pub name: &'static str,
    pub bucket: Bucket,
    /// Local root for `file://` (mtimes can be set there).
    pub root: Option<PathBuf>,
    _dir: Option<tempfile::TempDir>,
}

impl TestBucket {
    /// Set the modification time of every object of the model's steps (file:// only; on
    /// S3 objects are as old as they are).
    pub fn backdate(&self, steps: &[Step]) {
        let Some(root) = &self.root else { return };
        for s in steps {
            for (k, _) in step_objects(s) {
                let f = std::fs::File::options().write(true).open(root.join(&k)).unwrap();
                f.set_modified(s.written).unwrap();
            }
        }
    }
}

pub fn file_bucket() -> TestBucket {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("stream");
    let bucket = Bucket::open(&format!("file://{}", root.display()), &test_opts()).unwrap();
    TestBucket { name: "file", bucket, root: Some(root), _dir: Some(dir) }
}

/// The SeaweedFS bucket from `DRIFTLESS_TEST_S3_SEAWEED` ("ENDPOINT BUCKET"), under a random
/// prefix; None to skip (a failure with `DRIFTLESS_REQUIRE_SERVERS=1`).
pub fn s3_bucket(test: &str) -> Option<TestBucket> {
    const VAR: &str = "DRIFTLESS_TEST_S3_SEAWEED";
    let v = match std::env::var(VAR) {
        Ok(v) => v,
        Err(_) => {
            if std::env::var("DRIFTLESS_REQUIRE_SERVERS").as_deref() == Ok("1") {
                panic!("{VAR} is not set but DRIFTLESS_REQUIRE_SERVERS=1 (run `source .ci/services.sh start`)");
            }
            eprintln!("skipping S3: {VAR} not set (see .ci/services.sh)");
            return None;
        }
    };
    let mut it = v.split_whitespace();
    let endpoint = it.next().expect("endpoint").to_string();
    let bucket = it.next().expect("ENDPOINT BUCKET").to_string();
    let opts = test_opts().with_endpoint(endpoint).with_allow_http(true).with_region("us-east-1");
    let prefix = format!("gc-tests/{test}-{:016x}", rand::random::<u64>());
    let bucket = Bucket::open(&format!("s3://{bucket}/{prefix}"), &opts).unwrap();
    Some(TestBucket { name: "s3-seaweed", bucket, root: None, _dir: None })
}

/// file:// always, plus SeaweedFS when configured.
pub fn buckets(test: &str) -> Vec<TestBucket> {
    let mut out = vec![file_bucket()];
    out.extend(s3_bucket(test));
    out
}
