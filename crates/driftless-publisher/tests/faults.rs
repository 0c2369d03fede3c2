//! Fault injection: the publisher over a `FaultyStore` wrapping a real store (memory,
//! `file://`, and SeaweedFS / moto over S3 when `.ci/services.sh` exported them).
//!
//! Every scenario ends in either a correct chain or a clear error, and then the bucket is
//! scanned independently of the publisher ([`scan`]): every ready marker pins a manifest whose
//! signature verifies and whose objects exist with the recorded size and SHA-256 and decode;
//! the chain replays from its anchors with `ops::apply_rewrite` to the weights roots the
//! trainer published; no ready delta hangs off a state readers cannot reach; an anchor and a
//! delta of the same step agree.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use driftless_format::gen::{ModelSpec, RlChain};
use driftless_format::manifest::{AnchorEncoding, StepKind};
use driftless_format::{
    anchor, checkpoint, delta, ops, Checkpoint, DType, Digest, Keypair, TensorMeta, TensorView, TrustSet,
};
use driftless_publisher::{Error, Outcome, PublisherBuilder};
use driftless_store::object_store::{self, ObjectStore};
use driftless_store::stream::StreamReader;
use driftless_store::{layout, Bucket, FaultKind, FaultOp, FaultyStore, StoreOptions};

// ---------------------------------------------------------------------------------------------
// Backends

fn opts() -> StoreOptions {
    StoreOptions::default().with_max_retries(2).with_retry_timeout(Duration::from_secs(3))
}

/// One real store; `bucket()` wraps it in a fresh `FaultyStore` (a "process" with its own
/// faults) over the same data, so a restarted publisher sees what the first one wrote.
struct Backend {
    name: String,
    store: Arc<dyn ObjectStore>,
    prefix: String,
    opts: StoreOptions,
    conditional: bool,
    _dir: Option<tempfile::TempDir>,
}

impl Backend {
    fn bucket(&self) -> (Arc<FaultyStore>, Bucket) {
        let f = Arc::new(FaultyStore::new(self.store.clone()));
        let b = Bucket::from_store(f.clone(), &self.prefix, &self.opts).with_conditional_create(self.conditional);
        (f, b)
    }

    /// The same store under its own stream prefix (one scenario of a test).
    fn sub(&self, name: String, prefix: &str) -> Backend {
        Backend {
            name,
            store: self.store.clone(),
            prefix: format!("{}/{prefix}", self.prefix),
            opts: self.opts.clone(),
            conditional: self.conditional,
            _dir: None,
        }
    }
}

/// A publisher on `bucket` that anchors only when asked to (or every `anchor_every` steps).
fn publisher(bucket: &Bucket, anchor_every: u64) -> PublisherBuilder {
    PublisherBuilder::new("unused")
        .with_bucket(bucket.clone())
        .with_key(key())
        .with_anchor_every(anchor_every)
        .with_anchor_chain_fraction(1e9)
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
    h.finish()
}

fn s3(var: &str, test: &str) -> Option<Backend> {
    let spec = match std::env::var(var) {
        Ok(s) => s,
        Err(_) if std::env::var("DRIFTLESS_REQUIRE_SERVERS").as_deref() == Ok("1") => {
            panic!("{var} not set and DRIFTLESS_REQUIRE_SERVERS=1")
        }
        Err(_) => return None,
    };
    let mut it = spec.split_whitespace();
    let (endpoint, bucket) = (it.next().unwrap().to_string(), it.next().unwrap().to_string());
    let o = opts().with_endpoint(endpoint).with_allow_http(true).with_region("us-east-1").with_path_style(true);
    let url = format!("s3://{bucket}/publisher-faults-{test}-{:016x}", rand_u64());
    let b = Bucket::open(&url, &o).unwrap();
    Some(Backend {
        name: format!("{var}:{url}"),
        store: b.store().clone(),
        prefix: b.prefix().to_string(),
        opts: o,
        conditional: b.supports_conditional_create(),
        _dir: None,
    })
}

/// memory, file://, SeaweedFS (when set up). `moto` adds moto's S3 server (exact
/// conditional-write semantics) for the races.
fn backends(test: &str, moto: bool) -> Vec<Backend> {
    let mut v = vec![Backend {
        name: "memory".into(),
        store: Arc::new(object_store::memory::InMemory::new()),
        prefix: "stream".into(),
        opts: opts(),
        conditional: true,
        _dir: None,
    }];
    let d = tempfile::tempdir().unwrap();
    let url = format!("file://{}", d.path().join("bucket").display());
    let b = Bucket::open(&url, &opts()).unwrap();
    v.push(Backend {
        name: url,
        store: b.store().clone(),
        prefix: b.prefix().to_string(),
        opts: opts(),
        conditional: b.supports_conditional_create(),
        _dir: Some(d),
    });
    v.extend(s3("DRIFTLESS_TEST_S3_SEAWEED", test));
    if moto {
        v.extend(s3("DRIFTLESS_TEST_S3_MOTO", test));
    }
    v
}

/// A runtime for direct bucket calls. Multi-threaded on purpose: pooled HTTP connections
/// belong to the runtime that opened them, and a current-thread runtime left idle would stall
/// the publisher's later requests on those connections until they time out.
fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap()
}

fn key() -> Keypair {
    Keypair::from_seed([42; 32])
}

fn trust() -> TrustSet {
    TrustSet::new().with_key(key().public())
}

fn chain() -> RlChain {
    RlChain::new(&ModelSpec::with_bf16_bytes(192 << 10), 2e-5, 11)
}

fn root_of(views: &[TensorView<'_>]) -> Digest {
    driftless_format::weights_root(views).1
}

// ---------------------------------------------------------------------------------------------
// The independent scan

type Tensors = Vec<(TensorMeta, Vec<u8>)>;

fn views(t: &Tensors) -> Vec<TensorView<'_>> {
    t.iter().map(|(m, d)| TensorView { name: &m.name, dtype: m.dtype, shape: &m.shape, data: d }).collect()
}

/// What the scan found.
#[derive(Debug, Default)]
struct Scan {
    ready_deltas: BTreeMap<u64, u64>,
    ready_anchors: BTreeSet<u64>,
    /// Steps with objects but no ready marker.
    incomplete: BTreeSet<(String, u64)>,
    /// Delta slots claimed by anchor-only steps (a claim manifest, never ready).
    /// Steps with a claim (`claims/N`): every committed step has one.
    claims: BTreeSet<u64>,
    /// Weights root of every state the chain reaches, by step.
    roots: BTreeMap<u64, Digest>,
    /// The newest reachable state.
    last: Option<(u64, Tensors)>,
}

impl Scan {
    fn last_step(&self) -> Option<u64> {
        self.last.as_ref().map(|l| l.0)
    }
}

fn decode_anchor_tensors(shards: &[(String, Vec<u8>)]) -> Tensors {
    let mut out = vec![];
    for (_, file) in shards {
        let (start, ts, _) = checkpoint::parse_safetensors_header(file).unwrap();
        for (m, r) in ts {
            out.push((m, file[start + r.start..start + r.end].to_vec()));
        }
    }
    out
}

/// Scans the bucket as a reader would, panicking on any violation of the invariants.
fn scan(bucket: &Bucket, trust: &TrustSet) -> Scan {
    let rt = rt();
    rt.block_on(scan_async(bucket, trust))
}

async fn scan_async(bucket: &Bucket, trust: &TrustSet) -> Scan {
    let r = StreamReader::new(bucket.clone(), trust.clone());
    let desc = r.descriptor().await.unwrap().expect("stream.json present and signed by a trusted key");
    let keys = bucket.list("").await.unwrap();
    // StepKind is not Ord: key the maps by (is_anchor, step).
    let kind = |a: bool| if a { StepKind::Anchor } else { StepKind::Delta };
    let mut dirs: BTreeMap<(bool, u64), BTreeSet<String>> = BTreeMap::new();
    let mut scan = Scan::default();
    let mut markers: BTreeSet<(bool, u64)> = BTreeSet::new();
    for o in &keys {
        match layout::parse_step_key(&o.key) {
            Some((k, s, Some(name))) => {
                dirs.entry((k == StepKind::Anchor, s)).or_default().insert(name);
            }
            Some((k, s, None)) => {
                markers.insert((k == StepKind::Anchor, s));
            }
            None => {
                if let Some(step) = o.key.strip_prefix("claims/").and_then(layout::parse_step) {
                    scan.claims.insert(step);
                } else {
                    assert!(
                        o.key == layout::STREAM || o.key == layout::LATEST || o.key.starts_with("writers/"),
                        "stray key {}",
                        o.key
                    );
                }
            }
        }
    }
    for (a, s) in dirs.keys() {
        if markers.contains(&(*a, *s)) {
            continue;
        }
        let k = &kind(*a);
        scan.incomplete.insert((format!("{k:?}"), *s));
    }
    // Every marker: manifest pinned and signed; every object present, matching, decodable.
    let mut deltas = BTreeMap::new();
    let mut anchors = BTreeMap::new();
    for (a, s) in &markers {
        let k = &kind(*a);
        let marker = r.marker(*k, *s).await.unwrap();
        assert_eq!(marker.stream_id, desc.stream_id, "marker {k:?} {s} of another stream");
        match k {
            StepKind::Delta => {
                let (m, _) = r.delta(*s).await.unwrap_or_else(|e| panic!("ready delta {s}: {e}"));
                assert_eq!(m.stream_id, desc.stream_id);
                let mut segs = vec![];
                for seg in &m.segments {
                    let b = r
                        .object(StepKind::Delta, *s, &seg.object.object, seg.object.size, seg.object.sha256)
                        .await
                        .unwrap_or_else(|e| panic!("delta {s} {}: {e}", seg.object.object));
                    delta::decode_segment(&b, seg.raw_size).unwrap();
                    segs.push(b.to_vec());
                }
                assert_eq!(marker.payload_bytes, m.payload_bytes(), "delta {s}: marker payload size");
                scan.ready_deltas.insert(*s, m.base_step);
                deltas.insert(*s, (m, segs));
            }
            StepKind::Anchor => {
                let (m, _) = r.anchor(*s).await.unwrap_or_else(|e| panic!("ready anchor {s}: {e}"));
                let mut shards = vec![];
                for o in &m.objects {
                    let b = r
                        .object(StepKind::Anchor, *s, &o.object.object, o.object.size, o.object.sha256)
                        .await
                        .unwrap_or_else(|e| panic!("anchor {s} {}: {e}", o.object.object));
                    let file = match m.encoding {
                        AnchorEncoding::Safetensors => b.to_vec(),
                        AnchorEncoding::PlanesZstd => {
                            let mut out = vec![0u8; o.decoded_size as usize];
                            anchor::decode_shard(&b, &mut out).unwrap();
                            out
                        }
                    };
                    assert_eq!(Digest::of(&file), o.decoded_sha256, "anchor {s} {}: decoded SHA-256", o.file);
                    shards.push((o.file.clone(), file));
                }
                for f in &m.files {
                    r.object(StepKind::Anchor, *s, &f.object, f.size, f.sha256).await.unwrap();
                }
                let t = decode_anchor_tensors(&shards);
                assert_eq!(root_of(&views(&t)), m.weights_root, "anchor {s}: weights root");
                scan.ready_anchors.insert(*s);
                anchors.insert(*s, t);
            }
        }
    }
    // Replay: every ready delta applies onto a reachable state with its base root and yields
    // its result root; an anchor and a delta of one step agree.
    let steps: BTreeSet<u64> = deltas.keys().chain(anchors.keys()).copied().collect();
    let mut states: BTreeMap<u64, Tensors> = BTreeMap::new();
    for s in steps {
        let mut here: Option<Tensors> = None;
        if let Some((m, segs)) = deltas.get(&s) {
            let base = states
                .get(&m.base_step)
                .unwrap_or_else(|| panic!("ready delta {s} hangs off step {} that no reader can reach", m.base_step));
            let bv = views(base);
            assert_eq!(root_of(&bv), m.base_root, "delta {s}: base root");
            let dir = tempfile::tempdir().unwrap();
            let refs: Vec<&[u8]> = segs.iter().map(|v| v.as_slice()).collect();
            let got = ops::apply_rewrite(&bv, m, &refs, &dir.path().join("out"))
                .unwrap_or_else(|e| panic!("delta {s}: apply: {e}"));
            assert_eq!(got, m.result_root);
            let ck = Checkpoint::open(dir.path().join("out")).unwrap();
            here = Some(ck.views().iter().map(|v| (v.meta(), v.data.to_vec())).collect());
        }
        if let Some(t) = anchors.get(&s) {
            if let Some(h) = &here {
                assert_eq!(root_of(&views(h)), root_of(&views(t)), "step {s}: anchor and delta disagree");
            } else {
                here = Some(t.clone());
            }
        }
        let t = here.expect("step has a delta or an anchor");
        scan.roots.insert(s, root_of(&views(&t)));
        states.insert(s, t);
    }
    // latest.json, when present, verifies and names ready steps only.
    if let Some((hint, _)) = r.latest(None).await.unwrap() {
        if let Some(d) = hint.delta {
            assert!(scan.ready_deltas.contains_key(&d), "latest.json names delta {d} that is not ready");
        }
        if let Some(a) = hint.anchor {
            assert!(scan.ready_anchors.contains(&a), "latest.json names anchor {a} that is not ready");
        }
    }
    scan.last = states.into_iter().next_back();
    scan
}

/// The trainer's side: weights root of every step it handed to `publish`.
#[derive(Default)]
struct Trainer {
    published: BTreeMap<u64, Digest>,
}

impl Trainer {
    /// Each reachable state in the bucket is exactly what was published at that step.
    fn check(&self, s: &Scan, ctx: &str) {
        for (step, root) in &s.roots {
            assert_eq!(
                self.published.get(step),
                Some(root),
                "{ctx}: bucket state at step {step} is not what the trainer published"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Upload failures and timeouts at each write

/// Fault targets: (what, pattern). Step 3 is a plain delta, step 5 a delta + anchor (anchor
/// every 5), step 0 the anchor-only first publish.
const TARGETS: &[(&str, &str)] = &[
    ("step claim", "claims/000000000003"),
    ("delta segment", "deltas/000000000003/g1-seg-"),
    ("delta manifest", "deltas/000000000003/g1-manifest.json"),
    ("delta marker", "ready/deltas/000000000003"),
    ("latest.json", "latest.json"),
    ("anchor shard (delta+anchor step)", "anchors/000000000005/g1-model"),
    ("anchor manifest", "anchors/000000000005/g1-manifest.json"),
    ("anchor marker", "ready/anchors/000000000005"),
    ("first anchor shard (anchor-only step)", "anchors/000000000000/g1-model"),
    ("first anchor marker", "ready/anchors/000000000000"),
];

#[derive(Debug, Clone, Copy)]
enum Fault {
    /// One retryable failure: retried inside the bucket layer, invisible to the chain.
    Blip,
    /// The write keeps failing until the retry budget (count and time) runs out: a timeout.
    Timeout,
    /// A permanent refusal (403).
    Permanent,
    /// The write lands but its response is lost.
    LostResponse,
}

fn run_fault(be: &Backend, target: &str, what: &str, fault: Fault) {
    let ctx = format!("{} / {what} / {fault:?}", be.name);
    let (faulty, bucket) = be.bucket();
    match fault {
        Fault::Blip => faulty.inject(FaultOp::Put, target, 1, FaultKind::Transient),
        Fault::Timeout => faulty.inject(FaultOp::Put, target, 1000, FaultKind::Transient),
        Fault::Permanent => faulty.inject(FaultOp::Put, target, 1, FaultKind::Permanent),
        Fault::LostResponse => faulty.inject(FaultOp::Put, target, 1, FaultKind::LostResponse),
    }
    let spool = tempfile::tempdir().unwrap();
    let mut p = publisher(&bucket, 5).with_spool_dir(spool.path()).build().unwrap();
    let mut c = chain();
    let mut t = Trainer::default();
    let mut errors = 0;
    for step in 0..9u64 {
        if step > 0 {
            c.step();
        }
        let r = p.publish(step, &c.views()).unwrap_or_else(|e| panic!("{ctx}: publish {step}: {e}"));
        assert_ne!(r.outcome, Outcome::Coalesced, "{ctx}: flushed every step, nothing to coalesce");
        t.published.insert(step, root_of(&c.views()));
        if let Err(e) = p.flush() {
            assert!(matches!(e, Error::Upload { .. }), "{ctx}: step {step}: {e}");
            // Whether it may pass by itself is its cause's (it was always "retryable").
            assert_eq!(e.is_retryable(), !matches!(fault, Fault::Permanent), "{ctx}: step {step}: {e}");
            errors += 1;
        }
    }
    let failures = p.status().failures;
    // The trainer's final weights reach the bucket.
    p.close().unwrap_or_else(|e| panic!("{ctx}: close: {e}"));
    let s = scan(&bucket, &trust());
    t.check(&s, &ctx);
    assert_eq!(s.last_step(), Some(8), "{ctx}: final state reaches the bucket ({s:?})");
    let fails = matches!(fault, Fault::Timeout | Fault::Permanent) && target != "latest.json";
    if fails {
        assert!(faulty.injected() >= 1);
        assert!(failures >= 1, "{ctx}: the failure is counted");
        let (kind, step) = match target {
            t if t.contains("deltas/000000000003") || t.contains("claims/000000000003") => ("delta", 3),
            t if t.contains("000000000005") => ("anchor", 5),
            _ => ("anchor", 0),
        };
        // `flush` publishes a lost newest step again, as an anchor of its own step, and
        // reports an error only when that failed too: a fault that lasts on a key the new
        // try writes as well (the step's claim, the first anchor's marker; not the failed
        // try's objects: the new try names its own). A failed anchor of a step committed as
        // a delta (step 5) is not a lost step: counted, not reported.
        let lost = kind == "delta" || step == 0;
        let lasting =
            matches!(fault, Fault::Timeout) && (target.contains("claims/") || target == "ready/anchors/000000000000");
        assert_eq!(errors >= 1, lasting, "{ctx}: flush reports a failure only when the newest step stays lost");
        // The failed try (generation 1, try 0) left nothing when it failed before its
        // marker's request (its objects are removed with the failure, the publisher's lease
        // live: GC would have kept them for its whole life); at its marker it is left for GC.
        let k = if kind == "delta" { StepKind::Delta } else { StepKind::Anchor };
        let left: Vec<String> = rt()
            .block_on(bucket.list(&layout::object(k, step, "")))
            .unwrap()
            .into_iter()
            .filter_map(|o| layout::parse_step_key(&o.key).and_then(|(_, _, n)| n))
            .filter(|n| layout::name_tag(n) == Some((1, 0)))
            .collect();
        if target.contains("ready/") {
            assert!(!left.is_empty(), "{ctx}: the try whose marker failed is left for GC");
        } else {
            assert_eq!(left, Vec::<String>::new(), "{ctx}: the failed try's objects are removed");
        }
        if kind == "delta" {
            assert!(!s.ready_deltas.contains_key(&step), "{ctx}: the failed delta has no marker: {s:?}");
        }
        if lost && !lasting {
            assert!(s.ready_anchors.contains(&step), "{ctx}: republished as an anchor of step {step}: {s:?}");
        } else {
            assert!(!s.ready_anchors.contains(&step), "{ctx}: {s:?}");
            // Recovery: the next publish after the failure was an anchor.
            assert!(s.ready_anchors.range(step + 1..).next().is_some(), "{ctx}: recovered through an anchor: {s:?}");
        }
    } else {
        assert_eq!(errors, 0, "{ctx}");
        assert_eq!(s.ready_deltas.keys().copied().collect::<Vec<_>>(), (1..9).collect::<Vec<_>>(), "{ctx}");
        assert!(s.ready_anchors.contains(&0) && s.ready_anchors.contains(&5), "{ctx}: {s:?}");
        assert!(s.incomplete.is_empty(), "{ctx}: {s:?}");
    }
}

#[test]
fn upload_failures_and_timeouts_at_each_write() {
    for be in backends("each-write", false) {
        for (i, (what, target)) in TARGETS.iter().enumerate() {
            for fault in [Fault::Blip, Fault::Timeout, Fault::Permanent, Fault::LostResponse] {
                // Each scenario on its own stream under the backend.
                let sub = be.sub(be.name.clone(), &format!("t{i}-{fault:?}"));
                run_fault(&sub, target, what, fault);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A failure inside the background encode of a deferred delta

/// The background encode of a deferred delta fails (an error, or a panic): a failed step, as
/// for a failed upload. The job gives its queue place back (the queue drains: `flush` cannot
/// wait forever) and the step gets no delta marker. A `flush` right after it publishes the
/// lost step again as an anchor of the snapshot (hashed there: the failed encode never hashed
/// it) and returns `Ok`; without one, the next publish is an anchor and the superseded
/// failure is counted, not returned. Every committed step holds the trainer's weights.
#[test]
fn failed_background_encode_is_a_failed_step() {
    for be in backends("encode", false) {
        for (panic, flush_it) in [(false, true), (true, true), (false, false)] {
            let what =
                format!("encode {}{}", if panic { "panics" } else { "fails" }, if flush_it { ", flushed" } else { "" });
            let sub = be.sub(format!("{} / {what}", be.name), &format!("panic-{panic}-{flush_it}"));
            let ctx = sub.name.clone();
            let (_, bucket) = sub.bucket();
            let mut p = publisher(&bucket, 100).with_encode_fault(3, panic).build().unwrap();
            let mut c = chain();
            let mut t = Trainer::default();
            for step in 0..7u64 {
                if step > 0 {
                    c.step();
                }
                let r = p.publish(step, &c.views()).unwrap_or_else(|e| panic!("{ctx}: publish {step}: {e}"));
                t.published.insert(step, root_of(&c.views()));
                let anchor = step == 0 || step == 4 && !flush_it;
                let want = if anchor { Outcome::Anchor } else { Outcome::Delta };
                assert_eq!(r.outcome, want, "{ctx}: step {step}");
                // The queue drains by itself (checked before flush, which would hang otherwise).
                let deadline = std::time::Instant::now() + Duration::from_secs(30);
                while p.status().queue_depth > 0 {
                    assert!(std::time::Instant::now() < deadline, "{ctx}: step {step}: the queue never drains");
                    std::thread::sleep(Duration::from_millis(5));
                }
                if step == 3 {
                    let st = p.status();
                    assert_eq!(st.failures, 1, "{ctx}");
                    assert!(st.last_error.as_deref().is_some_and(|e| e.contains("delta 3")), "{ctx}: {st:?}");
                    if !flush_it {
                        continue;
                    }
                }
                p.flush().unwrap_or_else(|e| panic!("{ctx}: flush {step}: {e}"));
            }
            assert_eq!(p.status().failures, 1, "{ctx}");
            p.close().unwrap();
            let s = scan(&bucket, &trust());
            t.check(&s, &ctx);
            let (anchors, deltas) = match flush_it {
                true => (vec![0, 3], vec![1, 2, 4, 5, 6]),
                false => (vec![0, 4], vec![1, 2, 5, 6]),
            };
            assert_eq!(s.ready_anchors.iter().copied().collect::<Vec<_>>(), anchors, "{ctx}: {s:?}");
            assert_eq!(s.ready_deltas.keys().copied().collect::<Vec<_>>(), deltas, "{ctx}: {s:?}");
        }
    }
}

/// `publish_checked` (the CLI's `--watch`, whose files a trainer may rewrite while they are
/// read): a step whose check fails after its read puts nothing in the bucket, whichever
/// route it took, and the publisher goes on: a delta step refused keeps its base (the step
/// read again is still a delta), a step that had replaced the snapshot (the first anchor, a
/// layout change) leaves none (the step read again is an anchor, never a delta against
/// weights that may mix two writes).
#[test]
fn a_checked_step_refused_after_its_read_publishes_nothing() {
    for be in backends("checked", false) {
        let ctx = be.name.clone();
        let (_, bucket) = be.bucket();
        let mut p = publisher(&bucket, 100).build().unwrap();
        let mut c = chain();
        let mut t = Trainer::default();
        let metas: Vec<TensorMeta> = c.views().iter().map(|v| v.meta()).collect();
        let one = driftless_format::Layout::for_tensors(&metas, u64::MAX).unwrap();
        let split = driftless_format::Layout::for_tensors(&metas, 64 << 10).unwrap();
        assert_ne!(one, split, "{ctx}");
        let refused = |p: &mut driftless_publisher::Publisher, step, views: &[TensorView<'_>], layout| {
            let checks = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let n = checks.clone();
            let e = p
                .publish_checked(step, views, layout, move || {
                    n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    false
                })
                .unwrap_err();
            assert!(matches!(e, Error::InputChanged { step: s } if s == step), "{ctx}: {e:?}");
            assert!(e.is_retryable(), "{ctx}: {e}");
            assert_eq!(checks.load(std::sync::atomic::Ordering::SeqCst), 1, "{ctx}: step {step}");
            p.flush().unwrap();
            assert!(p.status().last_published.is_none_or(|l| l < step), "{ctx}: step {step}: {:?}", p.status());
        };
        for (step, layout, want) in [
            (0, &one, Outcome::Anchor),
            (1, &one, Outcome::Delta),
            (2, &split, Outcome::Anchor),
            (3, &split, Outcome::Delta),
        ] {
            if step > 0 {
                c.step();
            }
            // Step 2 is read first under a new layout (a delta's route that replaces the
            // snapshot), then again as the checkpoint was written.
            let first = if step == 2 { &split } else { layout };
            refused(&mut p, step, &c.views(), first);
            let r =
                p.publish_checked(step, &c.views(), layout, || true).unwrap_or_else(|e| panic!("{ctx}: {step}: {e}"));
            assert_eq!(r.outcome, want, "{ctx}: step {step}");
            t.published.insert(step, root_of(&c.views()));
            p.flush().unwrap();
            assert_eq!(p.status().last_published, Some(step), "{ctx}");
        }
        p.close().unwrap();
        let s = scan(&bucket, &trust());
        t.check(&s, &ctx);
        assert_eq!(s.ready_anchors.iter().copied().collect::<Vec<_>>(), vec![0, 2], "{ctx}: {s:?}");
        assert_eq!(s.ready_deltas.keys().copied().collect::<Vec<_>>(), vec![1, 3], "{ctx}: {s:?}");
        assert!(s.incomplete.is_empty(), "{ctx}: {s:?}");
    }
}

/// Publishes steps 0-2 of a chain, flushing each, with `faults` injected before step 2:
/// only step 2's flush fails. Returns the publisher, the chain at step 2 and what was published.
fn lose_step_2(
    bucket: &Bucket,
    ctx: &str,
    faults: impl FnOnce(),
) -> (driftless_publisher::Publisher, RlChain, Trainer) {
    let mut p = publisher(bucket, 100).build().unwrap();
    let (mut c, mut t, mut faults) = (chain(), Trainer::default(), Some(faults));
    for step in 0..3u64 {
        if step > 0 {
            c.step();
        }
        if step == 2 {
            faults.take().expect("once")();
        }
        assert_ne!(p.publish(step, &c.views()).unwrap().outcome, Outcome::Coalesced, "{ctx}");
        t.published.insert(step, root_of(&c.views()));
        let r = p.flush();
        assert_eq!(r.is_err(), step == 2, "{ctx}: flush {step}: {r:?}");
    }
    (p, c, t)
}

/// The newest step stays lost: its delta's marker keeps failing, and so does every try of
/// its anchor, at its shard (nothing of a try's manifest is left) or at its marker (each try
/// leaves a manifest: same size, other bytes, so a retry that reused its name would keep the
/// old bytes under a marker naming the new ones). `flush` reports it; once the bucket is
/// back, `flush`, or `publish` of the same step with the same weights, publishes it again as
/// an anchor (never "already published": the publisher still holds its weights), and that
/// anchor verifies.
#[test]
fn a_lost_newest_step_is_published_again_by_flush_or_publish() {
    for be in backends("lost-newest", false) {
        // Every try's shard or marker (each try names its objects anew: `g1-`, `g1r1-`, ...).
        for (at, pattern) in [("shard", "anchors/000000000002/g1"), ("marker", "ready/anchors/000000000002")] {
            for retry_by_publish in [false, true] {
                let by = if retry_by_publish { "publish" } else { "flush" };
                let sub = be.sub(format!("{} / anchor {at} fails / retried by {by}", be.name), &format!("{at}-{by}"));
                let ctx = sub.name.clone();
                let (faulty, bucket) = sub.bucket();
                let (mut p, c, t) = lose_step_2(&bucket, &ctx, || {
                    faulty.inject(FaultOp::Put, "ready/deltas/000000000002", 1000, FaultKind::Transient);
                    faulty.inject(FaultOp::Put, pattern, 1000, FaultKind::Transient);
                });
                let s = scan(&bucket, &trust());
                assert_eq!(s.last_step(), Some(1), "{ctx}: step 2 is not in the bucket yet: {s:?}");
                faulty.clear();
                if retry_by_publish {
                    let r = p.publish(2, &c.views()).unwrap();
                    assert_eq!(r.outcome, Outcome::Anchor, "{ctx}: the lost step is not \"already published\"");
                }
                p.flush().unwrap_or_else(|e| panic!("{ctx}: flush after the bucket is back: {e}"));
                let got = rt().block_on(StreamReader::new(bucket.clone(), trust()).anchor(2));
                assert!(got.is_ok(), "{ctx}: ready anchor 2 does not verify: {:?}", got.err());
                let s = scan(&bucket, &trust());
                t.check(&s, &ctx);
                assert!(s.ready_anchors.contains(&2) && !s.ready_deltas.contains_key(&2), "{ctx}: {s:?}");
                assert_eq!(s.last_step(), Some(2), "{ctx}: {s:?}");
                collect_failed_tries(&bucket, &ctx);
                p.close().unwrap();
            }
        }
    }
}

/// GC (grace 0, while the publisher's lease is live) removes what the failed tries of anchor
/// 2 left in its directory, and nothing else: every object left there carries the tag of the
/// manifest the marker names, and the anchor still verifies.
fn collect_failed_tries(bucket: &Bucket, ctx: &str) {
    let dir = layout::anchor_dir(2);
    let tags = |b: &Bucket| -> BTreeSet<(u64, u32)> {
        rt().block_on(b.list(&dir))
            .unwrap()
            .iter()
            .filter_map(|o| layout::parse_step_key(&o.key).and_then(|(_, _, n)| n))
            .filter_map(|n| layout::name_tag(&n))
            .collect()
    };
    let before = tags(bucket);
    let policy = driftless_gc::GcPolicy::new().with_grace(Duration::ZERO);
    let report = rt().block_on(driftless_gc::run(bucket, &policy, false)).unwrap();
    let marker = rt().block_on(bucket.get(&layout::ready(StepKind::Anchor, 2))).unwrap();
    let marker: driftless_format::ReadyMarker = serde_json::from_slice(&marker).unwrap();
    let committed = layout::name_tag(marker.manifest_name()).unwrap();
    assert!(committed.1 > 0, "{ctx}: a retry committed the step: {committed:?}");
    let after = tags(bucket);
    assert_eq!(after, BTreeSet::from([committed]), "{ctx}: before GC {before:?}; {report}");
    if before.len() > 1 {
        assert!(report.deleted_strays > 0, "{ctx}: {report}");
    }
    let got = rt().block_on(StreamReader::new(bucket.clone(), trust()).anchor(2));
    assert!(got.is_ok(), "{ctx}: anchor 2 after GC: {:?}", got.err());
}

/// Anchor 0's marker lands but its response is lost, and its retries fail. `flush` asks the
/// bucket whether the step is committed, and that read is refused (403): it reports the
/// failure and touches nothing (deleting or rewriting the committed step's objects would break
/// it for good). The next `flush` finds the step committed and takes it as such.
#[test]
fn a_lost_step_whose_marker_cannot_be_read_is_left_alone() {
    for be in backends("lost-marker-403", false) {
        let ctx = be.name.clone();
        let (faulty, bucket) = be.bucket();
        let mut p = publisher(&bucket, 100).build().unwrap();
        let c = chain();
        faulty.inject(FaultOp::Put, "ready/anchors/000000000000", 1, FaultKind::LostResponse);
        faulty.inject(FaultOp::Put, "ready/anchors/000000000000", 1000, FaultKind::Transient);
        faulty.inject(FaultOp::Get, "ready/anchors/000000000000", 1, FaultKind::Permanent);
        assert_eq!(p.publish(0, &c.views()).unwrap().outcome, Outcome::Anchor, "{ctx}");
        assert!(p.flush().is_err(), "{ctx}: the marker could not be read: not settled");
        faulty.clear();
        p.flush().unwrap_or_else(|e| panic!("{ctx}: {e}"));
        let got = rt().block_on(StreamReader::new(bucket.clone(), trust()).anchor(0));
        assert!(got.is_ok(), "{ctx}: ready anchor 0 does not verify: {:?}", got.err());
        assert_eq!(p.status().failures, 1, "{ctx}: committed after all: not published again");
        assert!(p.status().last_error.is_some(), "{ctx}: status keeps the last failure");
        p.close().unwrap();
    }
}

/// Step 2 is lost, and the caller publishes it again with other weights: refused as a taken
/// step (`StepTaken`, not retryable), and the publisher goes on with step 3. Two ways:
/// - committed after all: delta 2's marker lands but its response is lost, its retries fail,
///   and `flush` cannot read the marker (403), so it reports the step;
/// - never committed: the marker of its delta and of its anchor fail, after both claimed the
///   step, and the claim is write-once. Found by review: the anchor of the new weights found
///   the publisher's own claim, took it for a second publisher's, and every later `publish`
///   and `flush` failed with a conflict.
#[test]
fn republishing_a_lost_step_with_other_weights_is_refused_not_fenced() {
    for be in backends("lost-other-weights", false) {
        for committed in [true, false] {
            let sub = be.sub(format!("{} / committed {committed}", be.name), &format!("committed-{committed}"));
            let ctx = sub.name.clone();
            let (faulty, bucket) = sub.bucket();
            let (mut p, mut c, mut t) = lose_step_2(&bucket, &ctx, || {
                if committed {
                    faulty.inject(FaultOp::Put, "ready/deltas/000000000002", 1, FaultKind::LostResponse);
                    faulty.inject(FaultOp::Get, "ready/deltas/000000000002", 1, FaultKind::Permanent);
                } else {
                    faulty.inject(FaultOp::Put, "ready/anchors/000000000002", 1000, FaultKind::Transient);
                }
                faulty.inject(FaultOp::Put, "ready/deltas/000000000002", 1000, FaultKind::Transient);
            });
            faulty.clear();
            c.step();
            match p.publish(2, &c.views()) {
                Err(e @ Error::StepTaken { step: 2, .. }) => assert!(!e.is_retryable(), "{ctx}: {e}"),
                r => panic!("{ctx}: step 2 is committed or claimed with other weights: {r:?}"),
            }
            c.step();
            p.publish(3, &c.views()).unwrap_or_else(|e| panic!("{ctx}: the publisher goes on: {e}"));
            t.published.insert(3, root_of(&c.views()));
            p.flush().unwrap_or_else(|e| panic!("{ctx}: {e}"));
            let s = scan(&bucket, &trust());
            t.check(&s, &ctx);
            assert_eq!(s.ready_deltas.contains_key(&2), committed, "{ctx}: {s:?}");
            assert!(!s.ready_anchors.contains(&2), "{ctx}: {s:?}");
            assert_eq!(s.last_step(), Some(3), "{ctx}: {s:?}");
            p.close().unwrap();
        }
    }
}

/// A restarted publisher seeds its snapshot from saved weights of committed step 2 while the
/// bucket fails its reads: a retryable error, not "not a committed step" (found by review: an
/// outage was reported as a step that was never published, not worth retrying). Once the
/// bucket is back the same call seeds.
#[test]
fn seeding_during_an_outage_is_retryable() {
    for be in backends("seed-outage", false) {
        let ctx = be.name.clone();
        let (faulty, bucket) = be.bucket();
        let mut p = publisher(&bucket, 100).build().unwrap();
        let mut c = chain();
        for step in 0..3u64 {
            if step > 0 {
                c.step();
            }
            p.publish(step, &c.views()).unwrap();
            p.flush().unwrap();
        }
        p.close().unwrap();
        let mut p = publisher(&bucket, 100).build().unwrap();
        let views = c.views();
        let layout =
            driftless_format::Layout::for_tensors(&views.iter().map(|v| v.meta()).collect::<Vec<_>>(), 2 << 30)
                .unwrap();
        faulty.inject(FaultOp::Get, "000000000002", 1000, FaultKind::Transient);
        let e = p.seed(2, &views, &layout).unwrap_err();
        assert!(e.is_retryable(), "{ctx}: an outage is reported as {e}");
        faulty.clear();
        p.seed(2, &views, &layout).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        assert_eq!(p.snapshot_step(), Some(2), "{ctx}");
        p.close().unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// Killed between manifest and marker

#[test]
fn trainer_killed_between_manifest_and_marker_republishes_the_step() {
    for be in backends("killed", false) {
        let ctx = be.name.clone();
        let mut c = chain();
        let mut t = Trainer::default();
        {
            let (faulty, bucket) = be.bucket();
            let mut p = PublisherBuilder::new("x")
                .with_bucket(bucket.clone())
                .with_key(key())
                .with_anchor_every(100)
                .with_anchor_chain_fraction(1e9)
                .build()
                .unwrap();
            for step in 0..5u64 {
                if step > 0 {
                    c.step();
                }
                p.publish(step, &c.views()).unwrap();
                t.published.insert(step, root_of(&c.views()));
                p.flush().unwrap();
            }
            // The marker of step 5 can never be written; the process dies after the manifest.
            faulty.inject(FaultOp::Put, "ready/deltas/000000000005", usize::MAX, FaultKind::Permanent);
            c.step();
            p.publish(5, &c.views()).unwrap();
            let rt = rt();
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while rt.block_on(bucket.head(&layout::object(StepKind::Delta, 5, "g1-manifest.json"))).is_err() {
                assert!(std::time::Instant::now() < deadline, "{ctx}: manifest of step 5 never written");
                std::thread::sleep(Duration::from_millis(10));
            }
            p.abort(); // killed (dropping it would flush)
        }
        let (_, bucket) = be.bucket();
        let s = scan(&bucket, &trust());
        assert!(s.incomplete.contains(&("Delta".into(), 5)), "{ctx}: {s:?}");
        assert!(!s.ready_deltas.contains_key(&5));
        assert_eq!(s.last_step(), Some(4));
        // Restart: a new process with no snapshot.
        let mut p = PublisherBuilder::new("x")
            .with_bucket(bucket.clone())
            .with_key(key())
            .with_anchor_every(100)
            .with_anchor_chain_fraction(1e9)
            .build()
            .unwrap();
        // Numbering resumes after the newest committed step: the killed step is published
        // again (the claim its predecessor left names the same weights), under new names.
        assert_eq!(p.next_step(), 5, "{ctx}: numbering resumes after the last committed step");
        let r = p.publish(5, &c.views()).unwrap();
        assert_eq!(r.outcome, Outcome::Anchor, "{ctx}: first publish after a restart without a seed is an anchor");
        t.published.insert(5, root_of(&c.views()));
        // Other weights under the claimed step are refused: one step number, one state.
        p.flush().unwrap();
        let mut other = c.views().iter().map(|v| (v.meta(), v.data.to_vec())).collect::<Vec<_>>();
        other[0].1[0] ^= 1;
        let e = p.publish(5, &views(&other)).unwrap_err();
        assert!(matches!(e, Error::StepTaken { step: 5, .. }), "{ctx}: {e}");
        // The same weights again: a no-op success.
        assert_eq!(p.publish(5, &c.views()).unwrap().outcome, Outcome::AlreadyPublished);
        c.step();
        let r = p.publish(6, &c.views()).unwrap();
        assert_eq!(r.outcome, Outcome::Delta, "{ctx}");
        t.published.insert(6, root_of(&c.views()));
        for step in 7..10u64 {
            c.step();
            let r = p.publish(step, &c.views()).unwrap();
            assert_eq!(r.outcome, Outcome::Delta);
            t.published.insert(step, root_of(&c.views()));
        }
        p.close().unwrap();
        let s = scan(&bucket, &trust());
        t.check(&s, &ctx);
        assert_eq!(s.last_step(), Some(9));
        assert!(s.ready_anchors.contains(&5));
        assert_eq!(s.ready_deltas.get(&6), Some(&5), "{ctx}: the new chain hangs off the restart anchor");
        assert!(!s.ready_deltas.contains_key(&5));
        // The killed generation's objects of step 5 are leftovers GC may remove; none is ready.
        assert!(s.incomplete.contains(&("Delta".into(), 5)), "{ctx}: {s:?}");
    }
}

#[test]
fn killed_during_an_anchor_upload_leaves_no_ready_anchor() {
    for be in backends("killed-anchor", false) {
        let (faulty, bucket) = be.bucket();
        // Shard uploads of the first anchor hang (slow store) while the process dies.
        let mut p = PublisherBuilder::new("x").with_bucket(bucket.clone()).with_key(key()).build().unwrap();
        faulty.set_delay(Duration::from_millis(300));
        let c = chain();
        p.publish(0, &c.views()).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        // As a death: no flush (dropping the publisher would flush and commit the anchor).
        p.abort();
        let (_, bucket) = be.bucket();
        let s = scan(&bucket, &trust());
        assert!(s.ready_anchors.is_empty() && s.ready_deltas.is_empty(), "{}: {s:?}", be.name);
        let mut p = PublisherBuilder::new("x").with_bucket(bucket.clone()).with_key(key()).build().unwrap();
        let n = p.next_step();
        assert_eq!(p.publish(n, &c.views()).unwrap().outcome, Outcome::Anchor);
        p.close().unwrap();
        let s = scan(&bucket, &trust());
        assert_eq!(s.last_step(), Some(n));
    }
}

/// `abort()` with a commit in flight (its ready marker's PUT slow) leaves the lease live, to
/// expire after its TTL as after a kill: released, GC would take the step for an incomplete
/// one and delete its objects under the marker about to land (found by review). Closed with
/// nothing in flight, the lease is released (TTL 0).
#[test]
fn a_publisher_stopped_mid_commit_leaves_its_lease_live() {
    for be in backends("abort-lease", false) {
        let c = chain();
        let rt = rt();
        let ttl = |b: &Bucket, g: u64| -> u64 {
            let v: serde_json::Value = serde_json::from_slice(&rt.block_on(b.get(&layout::lease(g))).unwrap()).unwrap();
            v["ttl_ms"].as_u64().unwrap()
        };
        let (f, b) = be.bucket();
        let mut p = PublisherBuilder::new("x").with_bucket(b.clone()).with_key(key()).build().unwrap();
        f.inject(FaultOp::Put, "ready/anchors/000000000000", 1, FaultKind::Slow(Duration::from_secs(2)));
        p.publish(0, &c.views()).unwrap();
        let manifest = layout::object(StepKind::Anchor, 0, "g1-manifest.json");
        let t0 = std::time::Instant::now();
        while rt.block_on(b.head(&manifest)).is_err() {
            assert!(t0.elapsed() < Duration::from_secs(30), "{}: the manifest was never written", be.name);
            std::thread::sleep(Duration::from_millis(10));
        }
        p.abort();
        assert!(ttl(&b, 1) > 0, "{}: released with its marker in flight", be.name);
        let (_, b) = be.sub(format!("{}/closed", be.name), "closed").bucket();
        let mut p = PublisherBuilder::new("x").with_bucket(b.clone()).with_key(key()).build().unwrap();
        p.publish(0, &c.views()).unwrap();
        p.close().unwrap();
        assert_eq!(ttl(&b, 1), 0, "{}: not released after a clean close", be.name);
    }
}

/// A publisher that stops (closed, aborted, dropped) releases its lease without deleting it,
/// so the next one never takes its generation again. Found by review: the lease was deleted,
/// the restart got the same generation, found the dead process's `g1-manifest.json` of anchor
/// 0 (same size: manifests differ in their creation time alone), took it for its own, and
/// committed a marker pinning its own manifest's SHA-256: anchor 0 unreadable for good.
#[test]
fn a_restarted_publisher_never_reuses_a_generation() {
    for be in backends("generation", false) {
        let c = chain();
        // Process 1 (generation 1) dies after writing anchor 0's manifest, before its marker.
        let (f1, b1) = be.bucket();
        let mut p = PublisherBuilder::new("x").with_bucket(b1.clone()).with_key(key()).build().unwrap();
        f1.inject(FaultOp::Put, "ready/anchors/000000000000", usize::MAX, FaultKind::Permanent);
        p.publish(0, &c.views()).unwrap();
        let manifest = layout::object(StepKind::Anchor, 0, "g1-manifest.json");
        let rt = rt();
        let t0 = std::time::Instant::now();
        while rt.block_on(b1.head(&manifest)).is_err() {
            assert!(t0.elapsed() < Duration::from_secs(30), "{}: the manifest was never written", be.name);
            std::thread::sleep(Duration::from_millis(10));
        }
        p.abort();
        let leases: Vec<String> =
            rt.block_on(b1.list(layout::leases_prefix())).unwrap().into_iter().map(|o| o.key).collect();
        assert_eq!(leases, [layout::lease(1)], "{}: the stopped generation's lease is kept (released)", be.name);
        // Process 2 publishes the same weights as step 0 under a new generation.
        std::thread::sleep(Duration::from_millis(5));
        let (_, b2) = be.bucket();
        let mut p = PublisherBuilder::new("x").with_bucket(b2.clone()).with_key(key()).build().unwrap();
        assert_eq!(p.next_step(), 0);
        assert_eq!(p.publish(0, &c.views()).unwrap().outcome, Outcome::Anchor);
        p.close().unwrap();
        let s = scan(&b2, &trust());
        assert_eq!(s.last_step(), Some(0), "{}: {s:?}", be.name);
        let reader = StreamReader::new(b2.clone(), trust());
        rt.block_on(reader.anchor(0)).unwrap_or_else(|e| panic!("{}: anchor 0 is unreadable: {e}", be.name));

        // The lease deleted anyway (by an older release, by hand): the restart takes the
        // generation again, and what it finds under its names is not its own. It fails loudly
        // instead of committing a marker readers refuse.
        let be = be.sub(format!("{}/lease-deleted", be.name), "lease-deleted");
        let (f1, b1) = be.bucket();
        let mut p = PublisherBuilder::new("x").with_bucket(b1.clone()).with_key(key()).build().unwrap();
        f1.inject(FaultOp::Put, "ready/anchors/000000000000", usize::MAX, FaultKind::Permanent);
        p.publish(0, &c.views()).unwrap();
        let t0 = std::time::Instant::now();
        while rt.block_on(b1.head(&manifest)).is_err() {
            assert!(t0.elapsed() < Duration::from_secs(30), "{}: the manifest was never written", be.name);
            std::thread::sleep(Duration::from_millis(10));
        }
        p.abort();
        rt.block_on(b1.delete(&layout::lease(1))).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        let (_, b2) = be.bucket();
        let mut p = PublisherBuilder::new("x").with_bucket(b2.clone()).with_key(key()).build().unwrap();
        p.publish(0, &c.views()).unwrap();
        let e = p.close().unwrap_err();
        assert!(e.to_string().contains("exists with other bytes"), "{}: {e}", be.name);
        let s = scan(&b2, &trust());
        assert!(s.ready_anchors.is_empty(), "{}: an anchor readers refuse was committed: {s:?}", be.name);
    }
}

/// A planted `writers/<u64::MAX>` (hostile or garbage) is refused with a clear error; the
/// numbering wrapped to generation 0 in a release build (a panic in a debug one).
#[test]
fn a_planted_newest_lease_does_not_wrap_the_generations() {
    for be in backends("planted-lease", false) {
        let (_, b) = be.bucket();
        let mut p = PublisherBuilder::new("x").with_bucket(b.clone()).with_key(key()).build().unwrap();
        p.publish(0, &chain().views()).unwrap();
        p.close().unwrap();
        let rt = rt();
        rt.block_on(b.put(&layout::lease(u64::MAX), bytes::Bytes::from_static(b"{}"))).unwrap();
        let e = PublisherBuilder::new("x").with_bucket(b).with_key(key()).build().unwrap_err();
        assert!(e.to_string().contains("no publisher generation after 18446744073709551615"), "{}: {e}", be.name);
        assert!(!e.is_retryable(), "{}: {e}", be.name);
    }
}

// ---------------------------------------------------------------------------------------------
// Two publishers, other keys, foreign buckets

#[test]
fn second_publisher_on_the_same_stream_fails_loudly() {
    for be in backends("second", true) {
        let ctx = be.name.clone();
        let (_, b1) = be.bucket();
        let (_, b2) = be.bucket();
        let mut c1 = chain();
        let mut p1 = PublisherBuilder::new("x")
            .with_bucket(b1.clone())
            .with_key(key())
            .with_anchor_every(100)
            .with_anchor_chain_fraction(1e9)
            .build()
            .unwrap();
        let mut t = Trainer::default();
        for step in 0..3u64 {
            if step > 0 {
                c1.step();
            }
            p1.publish(step, &c1.views()).unwrap();
            t.published.insert(step, root_of(&c1.views()));
            p1.flush().unwrap();
        }
        // A second trainer (same key, other weights) starts on the same stream, and both go
        // on publishing the same step numbers.
        let mut c2 = RlChain::new(&ModelSpec::with_bf16_bytes(192 << 10), 2e-5, 99);
        let mut p2 = PublisherBuilder::new("x")
            .with_bucket(b2.clone())
            .with_key(key())
            .with_anchor_every(100)
            .with_anchor_chain_fraction(1e9)
            .build()
            .unwrap();
        assert_eq!(p2.next_step(), 3);
        let mut t2 = Trainer::default();
        let mut failed = [None, None];
        for step in 3..8u64 {
            c1.step();
            c2.step();
            for (i, (p, c, tt)) in [(&mut p1, &c1, &mut t), (&mut p2, &c2, &mut t2)].into_iter().enumerate() {
                if failed[i].is_some() {
                    continue;
                }
                match p.publish(step, &c.views()).and_then(|_| {
                    tt.published.insert(step, root_of(&c.views()));
                    p.flush()
                }) {
                    Ok(()) => {}
                    Err(e) => failed[i] = Some(e),
                }
            }
        }
        let loser = failed
            .iter()
            .position(|e| e.is_some())
            .unwrap_or_else(|| panic!("{ctx}: two publishers on one stream went unnoticed"));
        let e = failed[loser].as_ref().unwrap();
        assert!(matches!(e, Error::Conflict { .. }), "{ctx}: {e}");
        assert!(!e.is_retryable());
        assert!(failed[1 - loser].is_none(), "{ctx}: only one of them stops: {failed:?}");
        // The loser stays stopped.
        let (pl, cl) = if loser == 0 { (&mut p1, &c1) } else { (&mut p2, &c2) };
        assert!(matches!(pl.publish(100, &cl.views()), Err(Error::Conflict { .. })));
        assert!(matches!(pl.flush(), Err(Error::Conflict { .. })));
        let winner_trainer = if loser == 0 { &t2 } else { &t };
        let (pw, _) = if loser == 0 { (&mut p1, &c1) } else { (&mut p2, &c2) };
        let _ = pw; // dropped below
        drop(p1);
        drop(p2);
        // What is ready is one consistent chain; past the fork it is the winner's.
        let s = scan(&b1, &trust());
        let fork = 3;
        for (step, root) in s.roots.range(fork..) {
            assert_eq!(
                winner_trainer.published.get(step),
                Some(root),
                "{ctx}: step {step} in the bucket is not the winner's"
            );
        }
    }
}

#[test]
fn stream_of_another_key_is_refused_unless_takeover() {
    for be in backends("other-key", false) {
        let (_, b) = be.bucket();
        let c = chain();
        let mut p = PublisherBuilder::new("x").with_bucket(b.clone()).with_key(key()).build().unwrap();
        p.publish(0, &c.views()).unwrap();
        p.close().unwrap();
        let other = Keypair::from_seed([9; 32]);
        let e = PublisherBuilder::new("x").with_bucket(b.clone()).with_key(other.clone()).build().unwrap_err();
        assert!(matches!(e, Error::Refused(_)), "{}: {e}", be.name);
        assert!(e.to_string().contains("takeover"), "{e}");
        // Unsigned publishers are refused too.
        assert!(matches!(PublisherBuilder::new("x").with_bucket(b.clone()).build().unwrap_err(), Error::Refused(_)));
        // Takeover: same stream id, the new key signs, numbering continues with an anchor.
        let before = scan(&b, &trust());
        let mut p = PublisherBuilder::new("x")
            .with_bucket(b.clone())
            .with_key(other.clone())
            .with_takeover(true)
            .build()
            .unwrap();
        assert_eq!(p.next_step(), 1);
        let rt = rt();
        let old_id =
            rt.block_on(StreamReader::new(b.clone(), trust().with_key(other.public())).descriptor()).ok().flatten();
        assert_eq!(old_id.map(|d| d.stream_id).as_deref(), Some(p.stream_id()), "takeover keeps the stream id");
        assert_eq!(p.publish(1, &c.views()).unwrap().outcome, Outcome::Anchor);
        p.close().unwrap();
        let after = scan(&b, &TrustSet::new().with_key(other.public()).with_key(key().public()));
        assert_eq!(after.last_step(), Some(1));
        assert!(before.ready_anchors.is_subset(&after.ready_anchors));
    }
}

#[test]
fn bucket_that_is_not_a_stream_is_refused_unless_new_stream() {
    for be in backends("not-a-stream", false) {
        let (_, b) = be.bucket();
        let rt = rt();
        rt.block_on(b.put("checkpoints/model.safetensors", bytes::Bytes::from_static(b"someone else's data"))).unwrap();
        let e = PublisherBuilder::new("x").with_bucket(b.clone()).with_key(key()).build().unwrap_err();
        assert!(matches!(e, Error::Refused(_)), "{}: {e}", be.name);
        assert!(e.to_string().contains("new_stream"), "{e}");
        let mut p =
            PublisherBuilder::new("x").with_bucket(b.clone()).with_key(key()).with_new_stream(true).build().unwrap();
        let c = chain();
        p.publish(0, &c.views()).unwrap();
        p.close().unwrap();
        // The foreign object is untouched.
        assert_eq!(&rt.block_on(b.get("checkpoints/model.safetensors")).unwrap()[..], b"someone else's data");
        let keys = rt.block_on(b.list("")).unwrap();
        assert!(keys.iter().any(|o| o.key == layout::STREAM));
        // A second start finds a stream it owns.
        assert!(PublisherBuilder::new("x").with_bucket(b.clone()).with_key(key()).build().is_ok());
        // Even when the prefix holds more keys than a listing may return (found by review:
        // every start listed the whole prefix, and this one failed with TooManyKeys).
        let small =
            Bucket::from_store(b.store().clone(), b.prefix(), &be.opts.clone().with_max_list_keys(keys.len() - 1))
                .with_conditional_create(b.supports_conditional_create());
        assert!(rt.block_on(small.list("")).is_err(), "{}: the listing must fail", be.name);
        let p = PublisherBuilder::new("x").with_bucket(small.clone()).with_key(key()).build();
        assert!(p.is_ok(), "{}: {:?}", be.name, p.err());
        // Without a stream.json, such a prefix is refused as not empty.
        rt.block_on(b.delete(layout::STREAM)).unwrap();
        let e = PublisherBuilder::new("x").with_bucket(small).with_key(key()).build().unwrap_err();
        assert!(matches!(e, Error::Refused(_)) && e.to_string().contains("more than"), "{}: {e}", be.name);
    }
}

/// An extra file a reader would take for weights (a `*.safetensors` file: without an index,
/// every one in a directory is a shard; or the index) is refused as input, before anything
/// is written, at build and on a later change.
#[test]
fn extra_files_that_look_like_weights_are_refused() {
    let be = backends("extra-names", false).into_iter().next().expect("file backend");
    let (_, b) = be.bucket();
    for name in ["more.safetensors", "model.safetensors.index.json"] {
        let e = PublisherBuilder::new("x")
            .with_bucket(b.clone())
            .with_key(key())
            .with_extra_files(vec![(name.into(), b"{}".to_vec())])
            .build()
            .unwrap_err();
        assert!(e.to_string().contains("would be read as weights"), "{name}: {e}");
        assert!(!e.is_retryable(), "{name}: {e}");
    }
    let mut p = PublisherBuilder::new("x").with_bucket(b.clone()).with_key(key()).build().unwrap();
    let e = p.set_extra_files(vec![("x.safetensors".into(), vec![1])]).unwrap_err();
    assert!(e.to_string().contains("would be read as weights"), "{e}");
    // Readers hold extra files in memory: over 64 MiB is refused here, not by every agent.
    let e = p.set_extra_files(vec![("big.bin".into(), vec![0; (64 << 20) + 1])]).unwrap_err();
    assert!(e.to_string().contains("over the 64 MiB limit"), "{e}");
    // What changed is named (the CLI says why a step became an anchor).
    let set = |p: &mut driftless_publisher::Publisher, f: &[(&str, &[u8])]| {
        p.set_extra_files(f.iter().map(|(n, b)| (n.to_string(), b.to_vec())).collect()).unwrap()
    };
    assert_eq!(set(&mut p, &[("config.json", b"{}")]), ["config.json"]);
    assert!(set(&mut p, &[("config.json", b"{}")]).is_empty());
    assert_eq!(set(&mut p, &[("tok.json", b"t"), ("config.json", b"{1}")]), ["config.json", "tok.json"]);
    assert!(set(&mut p, &[("config.json", b"{1}"), ("tok.json", b"t")]).is_empty(), "order is not a change");
    assert_eq!(set(&mut p, &[("tok.json", b"t")]), ["config.json"]);
    p.close().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Tensor set and shapes change between steps

#[test]
fn tensors_that_change_shape_or_set_are_carried_densely() {
    for be in backends("reshape", false) {
        let ctx = be.name.clone();
        let (_, b) = be.bucket();
        let mut p = PublisherBuilder::new("x")
            .with_bucket(b.clone())
            .with_key(key())
            .with_anchor_every(100)
            .with_anchor_chain_fraction(1e9)
            .build()
            .unwrap();
        let mut t = Trainer::default();
        let mk = |n: usize, seed: u8| -> Vec<u8> {
            (0..n * 2).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
        };
        let (a, bb, cc) = (mk(4096, 1), mk(1024, 2), mk(2048, 3));
        type Step<'a> = Vec<(&'a str, Vec<u64>, Vec<u8>)>;
        let steps: Vec<Step<'_>> = vec![
            vec![("a", vec![64, 64], a.clone()), ("b", vec![1024], bb.clone())],
            // a unchanged; b reshaped (same bytes); c added
            vec![("a", vec![64, 64], a.clone()), ("b", vec![32, 32], bb.clone()), ("c", vec![2048], cc.clone())],
            // b removed; a grows; c changes a little
            vec![
                ("a", vec![128, 64], mk(8192, 1)),
                ("c", vec![2048], {
                    let mut x = cc.clone();
                    x[10] ^= 1;
                    x
                }),
            ],
            // same set again: a steady-state sparse delta
            vec![
                ("a", vec![128, 64], {
                    let mut x = mk(8192, 1);
                    x[100] ^= 1;
                    x
                }),
                ("c", vec![2048], cc.clone()),
            ],
        ];
        for (step, ts) in steps.iter().enumerate() {
            let views: Vec<TensorView<'_>> =
                ts.iter().map(|(n, s, d)| TensorView::new(n, DType::BF16, s, d).unwrap()).collect();
            let r = p.publish(step as u64, &views).unwrap_or_else(|e| panic!("{ctx}: step {step}: {e}"));
            if step > 0 {
                assert_eq!(r.outcome, Outcome::Delta, "{ctx}: step {step}");
            }
            p.flush().unwrap();
            t.published.insert(step as u64, root_of(&views));
        }
        p.close().unwrap();
        let s = scan(&b, &trust());
        t.check(&s, &ctx);
        assert_eq!(s.last_step(), Some(3));
        assert_eq!(s.ready_deltas.keys().copied().collect::<Vec<_>>(), vec![1, 2, 3]);
        // The final state is the last tensor set, bit for bit.
        let (_, last) = s.last.as_ref().unwrap();
        let names: Vec<&str> = last.iter().map(|(m, _)| m.name.as_str()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
        let rt = rt();
        let (m2, _) = rt.block_on(StreamReader::new(b.clone(), trust()).delta(2)).unwrap();
        assert!(
            ops::needs_rewrite(&m2.layout(), &rt.block_on(StreamReader::new(b.clone(), trust()).delta(1)).unwrap().0),
            "step 2 changes the layout"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The deferred encode: publish() returns after the diff

/// `publish` returns after one pass that diffs and updates the snapshot; the delta is encoded,
/// hashed and signed in the background. The trainer overwrites its tensors the moment each
/// call returns (and publishes the next step without a flush in between): every step in the
/// bucket must still be exactly what was passed, anchors included.
#[test]
fn tensors_changed_right_after_publish_returns_do_not_leak_into_the_step() {
    for be in backends("deferred", false) {
        let ctx = be.name.clone();
        let (_, b) = be.bucket();
        let mut p = PublisherBuilder::new("x")
            .with_bucket(b.clone())
            .with_key(key())
            .with_anchor_every(4)
            .with_anchor_chain_fraction(1e9)
            // No step coalesced: every step's delta must reach the bucket.
            .with_queue_depth(64)
            .build()
            .unwrap();
        let mut c = chain();
        let mut t = Trainer::default();
        let mut anchored = vec![0];
        let mut buf: Tensors = c.views().iter().map(|v| (v.meta(), v.data.to_vec())).collect();
        let mut deferred = 0;
        for step in 0..=9u64 {
            for ((_, d), v) in buf.iter_mut().zip(c.views()) {
                d.copy_from_slice(v.data);
            }
            t.published.insert(step, root_of(&views(&buf)));
            let r = p.publish(step, &views(&buf)).unwrap_or_else(|e| panic!("{ctx}: step {step}: {e}"));
            // What a trainer does next: its optimizer writes the same memory.
            for (_, d) in buf.iter_mut() {
                d.iter_mut().for_each(|x| *x = x.wrapping_add(0x5b));
            }
            match r.outcome {
                Outcome::Delta => {
                    assert!(r.delta_bytes.is_none() && r.ratio.is_none(), "{ctx}: step {step}: {r:?}");
                    assert!(r.density > 0.0, "{ctx}: step {step}: {r:?}");
                    deferred += 1;
                }
                Outcome::DeltaAndAnchor => {
                    assert!(r.delta_bytes.is_some_and(|n| n > 0), "{ctx}: {r:?}");
                    anchored.push(step);
                }
                Outcome::Anchor => assert_eq!(step, 0, "{ctx}"),
                o => panic!("{ctx}: step {step}: unexpected {o:?}"),
            }
            c.step();
        }
        p.flush().unwrap();
        let st = p.status();
        assert!(st.last_delta_bytes > 0 && st.last_ratio > 1.0, "{ctx}: {st:?}");
        p.close().unwrap();
        assert!(deferred >= 6, "{ctx}: only {deferred} deferred steps");
        let s = scan(&b, &trust());
        t.check(&s, &ctx);
        assert_eq!(s.ready_deltas.keys().copied().collect::<Vec<_>>(), (1..=9).collect::<Vec<_>>(), "{ctx}");
        // An anchor is due every 4 steps, started only when none is still encoding.
        assert_eq!(s.ready_anchors.iter().copied().collect::<Vec<_>>(), anchored, "{ctx}");
        assert_eq!(s.roots.len(), 10, "{ctx}: every step reachable and checked");
    }
}

/// A delta step published while the anchor of the step before still reads the snapshot (its
/// spool write held 1.5 s by a hook, as a large model on a slow disk takes): `publish` returns
/// without waiting for it (the changes are found by a read-only diff and applied by the encode
/// thread once the anchor let the snapshot go), and every step, anchors included, reaches the
/// bucket with the trainer's weights. Before, `publish` waited for the whole spool write.
#[test]
fn a_delta_right_after_an_anchor_step_does_not_wait_for_its_spool() {
    for be in backends("after-anchor", false) {
        let ctx = be.name.clone();
        let (_, b) = be.bucket();
        let hold = Duration::from_millis(1500);
        let mut p = publisher(&b, 3).with_anchor_spool_delay(hold).build().unwrap();
        let mut c = chain();
        let mut t = Trainer::default();
        let mut kinds = vec![];
        for step in 0..8u64 {
            if step > 0 {
                c.step();
            }
            let t0 = std::time::Instant::now();
            let r = p.publish(step, &c.views()).unwrap_or_else(|e| panic!("{ctx}: publish {step}: {e}"));
            let secs = t0.elapsed();
            t.published.insert(step, root_of(&c.views()));
            kinds.push(r.outcome);
            if step == 0 {
                // The first anchor out of the way: step 3's is due on schedule.
                p.flush().unwrap();
            }
            if step == 4 {
                // Step 3 started an anchor, whose thread holds the snapshot for `hold`.
                assert_eq!(kinds[3], Outcome::DeltaAndAnchor, "{ctx}: {kinds:?}");
                assert_eq!(r.outcome, Outcome::Delta, "{ctx}");
                assert!(secs < hold / 2, "{ctx}: publish of step 4 waited {secs:?} for the anchor's spool");
                assert_eq!(p.snapshot_step(), Some(4), "{ctx}");
            }
        }
        p.flush().unwrap_or_else(|e| panic!("{ctx}: flush: {e}"));
        p.close().unwrap();
        let s = scan(&b, &trust());
        t.check(&s, &ctx);
        assert_eq!(s.last_step(), Some(7), "{ctx}");
        assert!(s.ready_anchors.contains(&3), "{ctx}: {s:?}");
        for step in 1..8u64 {
            assert!(s.ready_deltas.contains_key(&step), "{ctx}: delta {step} missing: {s:?}");
        }
        assert!(s.incomplete.is_empty(), "{ctx}: {s:?}");
    }
}

/// The encode thread of the delta right after an anchor step (handed the snapshot while the
/// anchor thread still read it) panics halfway through applying the step's changes: the
/// half-changed snapshot is never used again. That step is lost, the next step is an anchor
/// of the trainer's weights, the chain goes on as deltas from there, and every state in the
/// bucket is what the trainer published.
#[test]
fn a_panic_while_applying_after_an_anchor_step_loses_only_that_step() {
    for be in backends("apply-panic", false) {
        let ctx = be.name.clone();
        let (_, b) = be.bucket();
        let mut p =
            publisher(&b, 3).with_anchor_spool_delay(Duration::from_millis(800)).with_apply_panic(4).build().unwrap();
        let (mut c, mut t, mut kinds) = (chain(), Trainer::default(), vec![]);
        for step in 0..8u64 {
            if step > 0 {
                c.step();
            }
            let r = p.publish(step, &c.views()).unwrap_or_else(|e| panic!("{ctx}: publish {step}: {e}"));
            t.published.insert(step, root_of(&c.views()));
            kinds.push(r.outcome);
            if step == 0 {
                p.flush().unwrap();
            }
            if step == 4 {
                // Lost, and its weights are not held: the half-changed snapshot was dropped
                // (given back, it would still claim to be step 3's weights).
                let e = p.flush().expect_err("step 4 is lost");
                assert!(!e.is_retryable(), "{ctx}: {e}");
                assert_eq!(p.snapshot_step(), None, "{ctx}: the half-changed snapshot is dropped");
            }
        }
        assert_eq!(kinds[3], Outcome::DeltaAndAnchor, "{ctx}: {kinds:?}");
        assert_eq!(kinds[5], Outcome::Anchor, "{ctx}: the step after the lost one anchors: {kinds:?}");
        assert!(p.status().failures >= 1, "{ctx}");
        p.flush().unwrap_or_else(|e| panic!("{ctx}: flush: {e}"));
        p.close().unwrap();
        let s = scan(&b, &trust());
        t.check(&s, &ctx);
        assert!(!s.roots.contains_key(&4), "{ctx}: the panicked step never reached the bucket: {s:?}");
        assert!(s.ready_anchors.contains(&5), "{ctx}: {s:?}");
        assert!(s.ready_deltas.contains_key(&6) && s.ready_deltas.contains_key(&7), "{ctx}: {s:?}");
        assert_eq!(s.last_step(), Some(7), "{ctx}");
    }
}

// ---------------------------------------------------------------------------------------------
// Backpressure

/// Peak anonymous memory of this process so far is not measurable per publisher in a test
/// binary that runs tests in parallel; instead the queue bound is checked directly.
#[test]
fn slow_store_coalesces_steps_and_the_final_state_arrives() {
    for be in backends("backpressure", false) {
        let ctx = be.name.clone();
        let (faulty, b) = be.bucket();
        let mut p = PublisherBuilder::new("x")
            .with_bucket(b.clone())
            .with_key(key())
            .with_queue_depth(2)
            .with_anchor_every(1000)
            .build()
            .unwrap();
        faulty.set_delay(Duration::from_millis(60));
        let mut c = chain();
        let mut t = Trainer::default();
        let mut outcomes = vec![];
        let mut max_queue = 0;
        for step in 0..40u64 {
            if step > 0 {
                c.step();
            }
            let r = p.publish(step, &c.views()).unwrap();
            // Coalesced steps too: the newest one is published by `flush`.
            t.published.insert(step, root_of(&c.views()));
            outcomes.push(r.outcome);
            max_queue = max_queue.max(p.status().queue_depth);
            std::thread::sleep(Duration::from_millis(5));
        }
        let coalesced = outcomes.iter().filter(|o| **o == Outcome::Coalesced).count();
        assert!(coalesced > 0, "{ctx}: a slow store coalesces: {outcomes:?}");
        assert!(max_queue <= 2, "{ctx}: queue bounded at its depth, saw {max_queue}");
        assert_eq!(p.status().coalesced, coalesced as u64);
        faulty.set_delay(Duration::ZERO);
        p.flush().unwrap();
        // `flush` published the newest step even if it was coalesced: nothing is lost at the
        // end of a run.
        let s = scan(&b, &trust());
        t.check(&s, &ctx);
        assert_eq!(s.last_step(), Some(39), "{ctx}: the newest step reached the bucket after flush");
        assert_eq!(p.status().last_delta_ready.max(p.status().last_anchor_ready), Some(39));
        c.step();
        let r = p.publish(40, &c.views()).unwrap();
        assert_ne!(r.outcome, Outcome::Coalesced);
        t.published.insert(40, root_of(&c.views()));
        p.close().unwrap();
        let s = scan(&b, &trust());
        t.check(&s, &ctx);
        assert_eq!(s.last_step(), Some(40), "{ctx}");
        // Deltas skip the coalesced steps: each ready delta's base is the previous ready state.
        let ready: Vec<u64> = s.roots.keys().copied().collect();
        for (step, base) in &s.ready_deltas {
            let prev = ready.iter().copied().filter(|x| x < step).max().unwrap();
            assert_eq!(*base, prev, "{ctx}: delta {step}");
        }
        assert!(s.incomplete.is_empty(), "{ctx}: {s:?}");
    }
}

/// A coalesced step held as its changes against the snapshot survives the snapshot changing
/// under it. Step 2's claim never lands (so the step is lost and free), step 3 finds the
/// upload queue full and is coalesced as its changes against step 2's weights, then the
/// trainer publishes step 2 again with other weights: they replace the snapshot, so the held
/// changes must first become a copy of step 3 (`hold_pending_as_copy`). Applied to the new
/// step 2 instead, they would publish weights the trainer never had as step 3.
#[test]
fn a_coalesced_step_survives_its_base_being_replaced() {
    for be in backends("coalesced-base-replaced", false) {
        let ctx = be.name.clone();
        let (faulty, bucket) = be.bucket();
        let mut p = publisher(&bucket, 100).with_queue_depth(1).build().unwrap();
        let (mut c, mut t) = (chain(), Trainer::default());
        for step in 0..2u64 {
            if step > 0 {
                c.step();
            }
            p.publish(step, &c.views()).unwrap();
            t.published.insert(step, root_of(&c.views()));
            p.flush().unwrap();
        }
        faulty.inject(FaultOp::Put, "claims/000000000002", 1000, FaultKind::Transient);
        c.step();
        let step2: Tensors = c.views().iter().map(|v| (v.meta(), v.data.to_vec())).collect();
        assert_ne!(p.publish(2, &c.views()).unwrap().outcome, Outcome::Coalesced, "{ctx}");
        c.step();
        let r = p.publish(3, &c.views()).unwrap();
        assert_eq!(r.outcome, Outcome::Coalesced, "{ctx}: step 2's upload is still being retried");
        t.published.insert(3, root_of(&c.views()));
        assert!(p.wait().is_err(), "{ctx}: step 2's claim never landed");
        // Step 3 is still only held (as its changes: the same layout), not in the bucket.
        let st = p.status();
        assert_eq!((st.coalesced, st.last_delta_ready, st.last_anchor_ready), (1, Some(1), Some(0)), "{ctx}");
        faulty.clear();
        // Other weights for step 2 (one element changed): the step is free, so they are
        // published as its anchor, and they replace the snapshot step 3 was held against.
        let mut other = step2.clone();
        other[0].1[1] ^= 0x01;
        let r = p.publish(2, &views(&other)).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        assert_eq!(r.outcome, Outcome::Anchor, "{ctx}");
        t.published.insert(2, root_of(&views(&other)));
        p.flush().unwrap_or_else(|e| panic!("{ctx}: flush: {e}"));
        let s = scan(&bucket, &trust());
        t.check(&s, &ctx);
        assert_eq!(s.roots.get(&3), Some(&t.published[&3]), "{ctx}: step 3 as the trainer had it: {s:?}");
        assert_eq!(s.roots.get(&2), Some(&t.published[&2]), "{ctx}: {s:?}");
        assert_eq!(s.last_step(), Some(3), "{ctx}: {s:?}");
        p.close().unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// Sharded publishing: failures of a part sent in the background

/// A two-rank group on one backend, each rank over its own `FaultyStore` of the same data.
/// Each rank publishes the whole of half the chain's tensors.
fn sharded_pair(
    be: &Backend,
    timeout: Duration,
    anchor_every: u64,
) -> (
    (Arc<FaultyStore>, driftless_publisher::ShardedPublisher),
    (Arc<FaultyStore>, driftless_publisher::ShardedPublisher),
) {
    let (f0, b0) = be.bucket();
    let p0 = PublisherBuilder::new("x")
        .with_bucket(b0)
        .with_key(key())
        .with_new_stream(true)
        .with_anchor_every(anchor_every)
        .build_sharded(0, 2, timeout)
        .unwrap();
    let (f1, b1) = be.bucket();
    let p1 = PublisherBuilder::new("x").with_bucket(b1).with_key(key()).build_sharded(1, 2, timeout).unwrap();
    ((f0, p0), (f1, p1))
}

/// Rank `r`'s shards of the chain's current weights: every other tensor, whole.
fn halves(c: &RlChain, r: usize) -> Vec<(driftless_format::TensorMeta, Vec<u8>)> {
    c.views().iter().skip(r).step_by(2).map(|v| (v.meta(), v.data.to_vec())).collect()
}

fn shards_of(h: &[(driftless_format::TensorMeta, Vec<u8>)]) -> Vec<driftless_publisher::Shard<'_>> {
    h.iter()
        .map(|(m, d)| driftless_publisher::Shard {
            name: &m.name,
            dtype: m.dtype,
            shape: &m.shape,
            slice: driftless_format::slice::Slice::block(&m.shape, 0, 0, m.shape[0]).unwrap(),
            data: d,
        })
        .collect()
}

/// A rank whose part cannot be uploaded (a permanent error on its part manifest) learns the
/// step's fate from the committer, not from its own failure; rank 0's failure is announced at
/// once (the other rank does not wait for the commit timeout); a refused `publish` (a tensor
/// passed twice) leaves the previous step's outcome to the next receipt; and the group goes on
/// with an anchor.
#[test]
fn sharded_part_failures_are_outcomes() {
    for be in backends("sharded-parts", false) {
        let ctx = be.name.clone();
        let timeout = Duration::from_secs(3);
        let ((f0, mut p0), (f1, mut p1)) = sharded_pair(&be, timeout, 50);
        let mut c = chain();
        let publish = |p: &mut _, c: &RlChain, r, step| rank_publish(&ctx, p, c, r, step);
        publish(&mut p0, &c, 0, 1);
        publish(&mut p1, &c, 1, 1);
        assert!(p0.flush().unwrap().committed, "{ctx}");
        assert!(p1.flush().unwrap().committed, "{ctx}");
        // Step 2: rank 1's part manifest cannot be written.
        c.step();
        f1.inject(FaultOp::Put, "r00001", 1000, FaultKind::Permanent);
        publish(&mut p0, &c, 0, 2);
        publish(&mut p1, &c, 1, 2);
        assert!(p1.wait_sent().is_none(), "{ctx}: the part was not sent");
        let e = p1.flush().unwrap_err();
        let o = p1.last_outcome().unwrap().clone();
        assert!(!o.committed && o.next_anchor, "{ctx}: {o:?}");
        // The committer's verdict (it waited for the part), not the rank's own guess.
        assert!(o.reason.as_deref().unwrap().contains("ranks [1]"), "{ctx}: {o:?} ({e})");
        assert!(p0.flush().unwrap_err().to_string().contains("ranks [1]"), "{ctx}");
        f1.clear();
        // Step 3 (an anchor after the missing part), left in flight on both ranks.
        c.step();
        publish(&mut p0, &c, 0, 3);
        publish(&mut p1, &c, 1, 3);
        // Step 4: a refused call (a tensor passed twice) leaves step 3 in flight; then rank
        // 0's part cannot be written, and rank 1 hears it at once.
        c.step();
        let h = halves(&c, 0);
        let mut twice = shards_of(&h);
        twice.push(twice[0].clone());
        assert!(p0.publish(4, &twice).is_err(), "{ctx}: a tensor passed twice");
        assert!(p0.wait_sent().is_some_and(|r| r.step == 3), "{ctx}");
        f0.inject(FaultOp::Put, "r00000", 1000, FaultKind::Permanent);
        let rc = publish(&mut p0, &c, 0, 4);
        let prev = rc.previous.as_ref().unwrap_or_else(|| panic!("{ctx}: step 3's outcome was lost"));
        assert!(prev.step == 3 && prev.committed && prev.of == Some(StepKind::Anchor), "{ctx}: {prev:?}");
        let rc = publish(&mut p1, &c, 1, 4);
        assert!(rc.previous.as_ref().is_some_and(|o| o.step == 3 && o.committed), "{ctx}: {rc:?}");
        let t = std::time::Instant::now();
        assert!(p1.flush().is_err(), "{ctx}");
        assert!(t.elapsed() < timeout, "{ctx}: rank 1 waited {:?} for a step rank 0 could not send", t.elapsed());
        let o = p1.last_outcome().unwrap();
        assert!(o.reason.as_deref().unwrap().contains("rank 0's part was not sent"), "{ctx}: {o:?}");
        assert!(p0.flush().is_err(), "{ctx}");
        f0.clear();
        // Step 5 commits again (an anchor).
        c.step();
        publish(&mut p0, &c, 0, 5);
        publish(&mut p1, &c, 1, 5);
        let o = p0.flush().unwrap();
        assert!(o.committed && o.of == Some(StepKind::Anchor), "{ctx}: {o:?}");
        assert!(p1.flush().unwrap().committed, "{ctx}");
        p0.close().unwrap();
        p1.close().unwrap();
        let (_, b) = be.bucket();
        let s = scan(&b, &trust());
        let mut ready: Vec<u64> = s.ready_anchors.iter().copied().chain(s.ready_deltas.keys().copied()).collect();
        ready.sort();
        assert_eq!(ready, vec![1, 3, 5], "{ctx}");
        // The committer removed rank 0's part of refused step 2 once it wrote the outcome
        // (the publisher's lease live: GC would have kept it for the group's whole life).
        let left = delta_names(&b, 2);
        assert!(left.iter().all(|n| n.ends_with("-outcome.json")), "{ctx}: left of refused step 2: {left:?}");
    }
}

/// A sharded step refused at its ready marker (the marker's write failed: it may have landed,
/// as after a lost response) keeps every part its manifest names: only a step refused before
/// its marker's request was sent loses them. Removing them here would leave a marker that
/// lands late naming objects that are gone.
#[test]
fn a_sharded_step_refused_at_its_marker_keeps_its_parts() {
    for be in backends("sharded-marker", false) {
        let ctx = be.name.clone();
        let ((f0, mut p0), (_f1, mut p1)) = sharded_pair(&be, Duration::from_secs(3), 50);
        let mut c = chain();
        both_publish(&ctx, &mut p0, &mut p1, &mut c, 1);
        assert!(p0.flush().unwrap().committed && p1.flush().unwrap().committed, "{ctx}");
        f0.inject(FaultOp::Put, "ready/deltas/000000000002", 1000, FaultKind::Permanent);
        both_publish(&ctx, &mut p0, &mut p1, &mut c, 2);
        let e = p1.flush().map(|_| ()).unwrap_err();
        assert!(e.to_string().contains("commit failed"), "{ctx}: {e}");
        assert!(p0.flush().is_err(), "{ctx}");
        f0.clear();
        let (_, b) = be.bucket();
        let names = delta_names(&b, 2);
        for r in ["r00000", "r00001"] {
            assert!(
                names.iter().any(|n| n.contains(r) && n.ends_with("part.json")),
                "{ctx}: rank {r}'s part of step 2 was removed: {names:?}"
            );
            assert!(names.iter().any(|n| n.contains(r) && n.ends_with(".dls")), "{ctx}: {names:?}");
        }
        // The group goes on (an anchor next), and its next commit does not sweep step 2
        // either (only steps refused before their marker's request are swept again).
        both_publish(&ctx, &mut p0, &mut p1, &mut c, 3);
        assert!(p0.flush().unwrap().committed, "{ctx}");
        p0.close().unwrap();
        p1.close().unwrap();
        assert_eq!(delta_names(&b, 2), names, "{ctx}: step 2's parts after the next commit");
    }
}

/// A rank later than the commit timeout: its part of step 2 lands after the committer refused
/// the step and removed what was there. The next commit sweeps step 2 again, so nothing of it
/// but the outcome is left (GC keeps an unmarked step of a live generation).
#[test]
fn a_part_that_lands_after_its_refusal_is_removed_at_the_next_commit() {
    for be in backends("sharded-late", false) {
        let ctx = be.name.clone();
        let ((_f0, mut p0), (f1, mut p1)) = sharded_pair(&be, Duration::from_secs(2), 50);
        let mut c = chain();
        both_publish(&ctx, &mut p0, &mut p1, &mut c, 1);
        assert!(p0.flush().unwrap().committed && p1.flush().unwrap().committed, "{ctx}");
        // Each of rank 1's objects 5 s late, past the 2 s the committer waits.
        f1.inject(FaultOp::Put, "deltas/000000000002/g1-r00001", 1000, FaultKind::Slow(Duration::from_secs(5)));
        both_publish(&ctx, &mut p0, &mut p1, &mut c, 2);
        let e = p0.flush().unwrap_err();
        assert!(e.to_string().contains("in time"), "{ctx}: {e}");
        assert!(p1.flush().is_err(), "{ctx}: step 2 was refused");
        f1.clear();
        let (_, b) = be.bucket();
        let late = delta_names(&b, 2);
        assert!(
            late.iter().any(|n| n.contains("r00001") && n.ends_with("part.json")),
            "{ctx}: rank 1's part landed after the refusal: {late:?}"
        );
        both_publish(&ctx, &mut p0, &mut p1, &mut c, 3);
        assert!(p0.flush().unwrap().committed && p1.flush().unwrap().committed, "{ctx}");
        let left = delta_names(&b, 2);
        assert!(left.iter().all(|n| n.ends_with("-outcome.json")), "{ctx}: left of refused step 2: {left:?}");
        p0.close().unwrap();
        p1.close().unwrap();
    }
}

/// A rank whose part manifest lands but whose upload reports a failure (the response lost,
/// every retry failed) still takes the committer's verdict: the step is committed with its part,
/// the rank adopts its copy, and its next part is a delta against it (a rank that did not
/// adopt would diff against the step before, and the group would need an anchor).
#[test]
fn sharded_part_that_landed_despite_an_error_is_adopted() {
    for be in backends("sharded-lost", false) {
        let ctx = be.name.clone();
        let ((_f0, mut p0), (f1, mut p1)) = sharded_pair(&be, Duration::from_secs(3), 50);
        let mut c = chain();
        let publish = |p: &mut _, c: &RlChain, r, step| rank_publish(&ctx, p, c, r, step);
        publish(&mut p0, &c, 0, 1);
        publish(&mut p1, &c, 1, 1);
        assert!(p0.flush().unwrap().committed, "{ctx}");
        assert!(p1.flush().unwrap().committed, "{ctx}");
        // Step 2: rank 1's part manifest lands but its response is lost, and every retry
        // fails, so the upload reports a failure. (Only rank 1 writes through `f1`.)
        c.step();
        f1.inject(FaultOp::Put, "part.json", 1, FaultKind::LostResponse);
        f1.inject(FaultOp::Put, "part.json", usize::MAX, FaultKind::Transient);
        publish(&mut p0, &c, 0, 2);
        publish(&mut p1, &c, 1, 2);
        assert!(p1.wait_sent().is_none(), "{ctx}: the upload reported a failure");
        f1.clear();
        let o1 = p1.flush().unwrap_or_else(|e| panic!("{ctx}: the committer used the part: {e}"));
        assert!(p1.last_part().is_none(), "{ctx}: no report of a part whose upload failed");
        assert!(o1.committed && o1.of == Some(StepKind::Delta), "{ctx}: {o1:?}");
        assert_eq!(p0.flush().unwrap(), o1, "{ctx}: one verdict");
        // Step 3 is a delta on both ranks: rank 1's base is the copy of step 2 it adopted.
        c.step();
        publish(&mut p0, &c, 0, 3);
        publish(&mut p1, &c, 1, 3);
        let o = p0.flush().unwrap();
        assert!(o.committed && o.of == Some(StepKind::Delta), "{ctx}: {o:?}");
        assert!(p1.flush().unwrap().committed, "{ctx}");
        p0.close().unwrap();
        p1.close().unwrap();
        let (_, b) = be.bucket();
        let s = scan(&b, &trust());
        assert_eq!(s.ready_anchors.iter().copied().collect::<Vec<_>>(), vec![1], "{ctx}");
        assert_eq!(s.ready_deltas.keys().copied().collect::<Vec<_>>(), vec![2, 3], "{ctx}");
    }
}

/// Rank `r`'s half of the chain's current weights published as `step`.
fn rank_publish(
    ctx: &str,
    p: &mut driftless_publisher::ShardedPublisher,
    c: &RlChain,
    r: usize,
    step: u64,
) -> driftless_publisher::ShardedReceipt {
    p.publish(step, &shards_of(&halves(c, r))).unwrap_or_else(|e| panic!("{ctx}: rank {r}, step {step}: {e}"))
}

/// The object names in delta step `step`'s directory.
fn delta_names(b: &Bucket, step: u64) -> Vec<String> {
    rt().block_on(b.list(&layout::delta_dir(step)))
        .unwrap()
        .into_iter()
        .filter_map(|o| layout::parse_step_key(&o.key).and_then(|(_, _, n)| n))
        .collect()
}

/// Step `step` of the chain published by both ranks of a pair (rank 0 first); both must send
/// the same kind of part. Returns (kind, with the slices).
fn both_publish(
    ctx: &str,
    p0: &mut driftless_publisher::ShardedPublisher,
    p1: &mut driftless_publisher::ShardedPublisher,
    c: &mut RlChain,
    step: u64,
) -> (driftless_publisher::PartKind, bool) {
    if step > 1 {
        c.step();
    }
    let r0 = rank_publish(ctx, p0, c, 0, step);
    let r1 = rank_publish(ctx, p1, c, 1, step);
    assert_eq!((r0.part, r0.slices), (r1.part, r1.slices), "{ctx}: step {step}: one schedule");
    (r0.part, r0.slices)
}

/// A scheduled anchor of a sharded group: the step is committed as a delta (followers take
/// it), the ranks send their slices with it, and the committer gathers the anchor afterwards.
/// No rank waits for the gather: with rank 0's anchor writes slowed down, the next step is
/// committed while the anchor is still being written. An anchor that fails leaves its delta
/// committed, and the committer asks for slices again.
#[test]
fn sharded_scheduled_anchor_is_gathered_after_its_delta() {
    for be in backends("sharded-later-anchor", false) {
        let ctx = be.name.clone();
        let ((f0, mut p0), (_f1, mut p1)) = sharded_pair(&be, Duration::from_secs(10), 3);
        let mut c = chain();
        let step_both = |p0: &mut _, p1: &mut _, c: &mut RlChain, step| both_publish(&ctx, p0, p1, c, step);
        let (_, b) = be.bucket();
        let ready = |kind: StepKind, step: u64| rt().block_on(b.head(&layout::ready(kind, step))).is_ok();
        use driftless_publisher::PartKind::*;
        assert_eq!(step_both(&mut p0, &mut p1, &mut c, 1), (Anchor, true), "{ctx}");
        for step in 2..=3 {
            assert_eq!(step_both(&mut p0, &mut p1, &mut c, step), (Delta, false), "{ctx}");
            assert!(p1.flush().unwrap().committed, "{ctx}");
        }
        assert!(p1.last_outcome().unwrap().slices_next, "{ctx}: an anchor is due at step 4");
        // Rank 0's writes of anchor 4's objects take 4 s each.
        f0.inject(FaultOp::Put, "anchors/000000000004/", usize::MAX, FaultKind::Slow(Duration::from_secs(4)));
        assert_eq!(step_both(&mut p0, &mut p1, &mut c, 4), (Delta, true), "{ctx}: a delta with the slices");
        let o = p1.flush().unwrap();
        assert!(o.committed && o.of == Some(StepKind::Delta) && !o.slices_next, "{ctx}: {o:?}");
        assert_eq!(step_both(&mut p0, &mut p1, &mut c, 5), (Delta, false), "{ctx}");
        assert!(p1.flush().unwrap().committed, "{ctx}");
        assert!(ready(StepKind::Delta, 5), "{ctx}");
        assert!(!ready(StepKind::Anchor, 4), "{ctx}: step 5 was committed while anchor 4 was still being written");
        // Rank 0's flush waits for the anchor.
        assert!(p0.flush().unwrap().committed, "{ctx}");
        assert!(ready(StepKind::Anchor, 4), "{ctx}");
        f0.clear();
        // Step 7's anchor cannot be written: its delta stays committed, and the outcome of
        // step 8 asks for slices again (step 9).
        assert_eq!(step_both(&mut p0, &mut p1, &mut c, 6), (Delta, false), "{ctx}");
        assert!(p0.flush().unwrap().committed && p1.flush().unwrap().committed, "{ctx}");
        f0.inject(FaultOp::Put, "anchors/000000000007/", usize::MAX, FaultKind::Permanent);
        assert_eq!(step_both(&mut p0, &mut p1, &mut c, 7), (Delta, true), "{ctx}");
        assert!(p0.flush().unwrap().committed && p1.flush().unwrap().committed, "{ctx}");
        f0.clear();
        assert_eq!(step_both(&mut p0, &mut p1, &mut c, 8), (Delta, false), "{ctx}");
        assert_eq!(step_both(&mut p0, &mut p1, &mut c, 9), (Delta, true), "{ctx}: slices asked for again");
        p0.close().unwrap();
        p1.close().unwrap();
        let s = scan(&b, &trust());
        assert_eq!(s.ready_anchors.iter().copied().collect::<Vec<_>>(), vec![1, 4, 9], "{ctx}");
        assert_eq!(s.ready_deltas.keys().copied().collect::<Vec<_>>(), (2..=9).collect::<Vec<_>>(), "{ctx}");
        // The slices are gone once their anchor is committed, or given up on (step 7).
        let slices_in = |step: u64| {
            rt().block_on(b.list(&layout::delta_dir(step)))
                .unwrap()
                .iter()
                .filter(|o| o.key.ends_with("slices.bin"))
                .count()
        };
        assert_eq!((slices_in(4), slices_in(7), slices_in(9)), (0, 0, 0), "{ctx}");
    }
}

/// A scheduled anchor that fails after an anchor step was committed (while it was still being
/// gathered) does not make the schedule forget that newer anchor: the next one is due
/// `anchor_every` steps after it, not at once.
#[test]
fn sharded_failed_later_anchor_keeps_a_newer_anchor_step() {
    let be = backends("review-last", false).into_iter().next().unwrap();
    let ctx = be.name.clone();
    let ((f0, mut p0), (f1, mut p1)) = sharded_pair(&be, Duration::from_secs(2), 3);
    let mut c = chain();
    let step_both = |p0: &mut _, p1: &mut _, c: &mut RlChain, step| both_publish(&ctx, p0, p1, c, step);
    use driftless_publisher::PartKind::*;
    assert_eq!(step_both(&mut p0, &mut p1, &mut c, 1), (Anchor, true));
    step_both(&mut p0, &mut p1, &mut c, 2);
    step_both(&mut p0, &mut p1, &mut c, 3);
    // Anchor 4: a slow gather (reads of step 4's objects take 5 s each), then its writes fail.
    f0.inject(FaultOp::Get, "deltas/000000000004/", usize::MAX, FaultKind::Slow(Duration::from_secs(5)));
    f0.inject(FaultOp::Put, "anchors/000000000004/", usize::MAX, FaultKind::Permanent);
    assert_eq!(step_both(&mut p0, &mut p1, &mut c, 4), (Delta, true));
    // Step 5: rank 1's part cannot be written -> not committed, next is an anchor.
    f1.inject(FaultOp::Put, "deltas/000000000005/", usize::MAX, FaultKind::Permanent);
    step_both(&mut p0, &mut p1, &mut c, 5);
    let _ = p1.flush();
    f1.clear();
    // Step 6: anchor parts, committed inline as anchor 6 while anchor 4 is still gathered.
    assert_eq!(step_both(&mut p0, &mut p1, &mut c, 6).0, Anchor);
    let o = p1.flush().unwrap();
    assert!(o.committed && o.of == Some(StepKind::Anchor), "{ctx}: {o:?}");
    // Rank 0's flush waits for anchor 4, which fails.
    assert!(p0.flush().unwrap().committed, "{ctx}");
    f0.clear();
    assert_eq!(step_both(&mut p0, &mut p1, &mut c, 7), (Delta, false), "{ctx}");
    let r8 = step_both(&mut p0, &mut p1, &mut c, 8);
    let r9 = step_both(&mut p0, &mut p1, &mut c, 9);
    p0.close().unwrap();
    p1.close().unwrap();
    let (_, b) = be.bucket();
    let s = scan(&b, &trust());
    // Anchor 6 was committed; the next is due at 9, so step 8 carries no slices.
    assert_eq!((r8, r9), ((Delta, false), (Delta, true)), "{ctx}");
    assert_eq!(s.ready_anchors.iter().copied().collect::<Vec<_>>(), vec![1, 6, 9], "{ctx}");
}

/// An anchor step whose commit outlasts the other ranks' first deadline (twice the commit
/// timeout plus 30 s; a 70B model's gather and encode takes many minutes): while the committer renews
/// its lease the other rank waits on, takes the step as committed, and the next step is a
/// delta from both ranks. Before, rank 1 gave up at the deadline, sent an anchor part next
/// while rank 0 sent a delta, and the group fell into an anchor-refusal cycle.
#[test]
fn a_slow_anchor_commit_is_waited_for_while_the_committer_renews_its_lease() {
    let be = backends("sharded-slow-anchor", false).into_iter().next().expect("memory");
    let timeout = Duration::from_secs(1);
    let ((f0, mut p0), (_f1, mut p1)) = sharded_pair(&be, timeout, 50);
    let mut c = chain();
    // The anchor's first upload stalls past rank 1's first deadline (32 s here).
    f0.inject(FaultOp::Put, "anchors/000000000001/", 1, FaultKind::Slow(Duration::from_secs(40)));
    rank_publish("slow", &mut p0, &c, 0, 1);
    rank_publish("slow", &mut p1, &c, 1, 1);
    let t = std::time::Instant::now();
    let o1 = p1.flush().unwrap_or_else(|e| panic!("rank 1 gave up on step 1 after {:?}: {e}", t.elapsed()));
    assert!(f0.injected() >= 1 && t.elapsed() > Duration::from_secs(32), "the commit was not slow: {:?}", t.elapsed());
    assert!(o1.committed && o1.of == Some(StepKind::Anchor), "{o1:?}");
    assert!(p0.flush().unwrap().committed);
    c.step();
    let r0 = rank_publish("slow", &mut p0, &c, 0, 2);
    let r1 = rank_publish("slow", &mut p1, &c, 1, 2);
    use driftless_publisher::PartKind::Delta;
    assert_eq!((r0.part, r1.part), (Delta, Delta));
    let o2 = p0.flush().unwrap();
    assert!(o2.committed && o2.of == Some(StepKind::Delta), "{o2:?}");
    assert!(p1.flush().unwrap().committed);
}

/// The committer is alive but done with a step whose outcome it could not write: found by
/// review, the other ranks kept waiting (for up to 6 hours) because its lease kept being
/// renewed. They wait on only while the renewed lease names the step being committed: rank 1
/// gives up at its first deadline, as when the committer is dead.
#[test]
fn a_lost_outcome_is_given_up_on_at_the_first_deadline() {
    let be = backends("sharded-lost-outcome", false).into_iter().next().expect("memory");
    let timeout = Duration::from_secs(1);
    let ((f0, mut p0), (_f1, mut p1)) = sharded_pair(&be, timeout, 50);
    let c = chain();
    f0.inject(FaultOp::Put, "outcome.json", 1000, FaultKind::Permanent);
    rank_publish("lost", &mut p0, &c, 0, 1);
    rank_publish("lost", &mut p1, &c, 1, 1);
    assert!(p0.flush().unwrap().committed);
    let t = std::time::Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let r = p1.flush().map(|o| o.committed).map_err(|e| e.to_string());
        tx.send(r).unwrap();
        p1
    });
    let r = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| panic!("rank 1 still waits after 60 s"));
    let e = r.expect_err("no outcome: rank 1 cannot know the step was committed");
    assert!(e.contains("no outcome from the committer in time"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(45), "{:?}", t.elapsed());
    drop(waiter.join().unwrap());
}

/// Refusals that every later step repeats are not retryable (found by review: all were, and
/// Python raised `RetryableError`, so a trainer retried for ever): two ranks sending the same
/// slices (two data-parallel replicas both given replica 0), and a committer fenced by a newer
/// one. A part missing this step stays retryable.
#[test]
fn sharded_refusals_say_whether_retrying_helps() {
    let be = backends("sharded-retryable", false).into_iter().next().expect("memory");
    let ((_f0, mut p0), (_f1, mut p1)) = sharded_pair(&be, Duration::from_secs(3), 50);
    let mut c = chain();
    let both = halves(&c, 0);
    p0.publish(1, &shards_of(&both)).unwrap();
    p1.publish(1, &shards_of(&both)).unwrap();
    let e = p0.flush().unwrap_err();
    assert!(e.to_string().contains("overlap"), "{e}");
    assert!(!e.is_retryable(), "{e}");
    assert!(!p1.flush().unwrap_err().is_retryable());
    // Rank 1 sends nothing for step 2: missing this step only.
    c.step();
    p0.publish(2, &shards_of(&halves(&c, 0))).unwrap();
    let e = p0.flush().unwrap_err();
    assert!(e.to_string().contains("no part from ranks [1]"), "{e}");
    assert!(e.is_retryable(), "{e}");
    drop(p1);

    // A second rank 0 on the stream (a newer generation) fences this one (a group of one
    // rank, its lease renewed every 100 ms so that it sees the newer one soon).
    let one = |ttl: Duration| {
        let (_f, b) = be.bucket();
        PublisherBuilder::new("x")
            .with_bucket(b)
            .with_key(key())
            .with_lease_ttl(ttl)
            .build_sharded(0, 1, Duration::from_secs(3))
            .unwrap()
    };
    let mut older = one(Duration::from_millis(400));
    let all = |c: &RlChain| c.views().iter().map(|v| (v.meta(), v.data.to_vec())).collect::<Vec<_>>();
    c.step();
    older.publish(3, &shards_of(&all(&c))).unwrap();
    assert!(older.flush().unwrap().committed);
    let _newer = one(Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(500));
    let mut fenced = None;
    for step in 4..=6 {
        c.step();
        older.publish(step, &shards_of(&all(&c))).unwrap();
        let e = older.flush().unwrap_err();
        if e.to_string().contains("started on this stream after this one") {
            fenced = Some(e);
            break;
        }
    }
    let e = fenced.expect("the older committer never saw the newer generation");
    assert!(!e.is_retryable(), "{e}");
}

/// A rank that starts before rank 0 and gives up at its deadline says a retry can help (found
/// by review: "no stream yet" was a refusal, not retryable, and exited 2 like a bad key).
#[test]
fn a_rank_without_its_committer_yet_is_told_to_retry() {
    let be = backends("sharded-early-rank", false).into_iter().next().expect("memory");
    let (_f, b) = be.bucket();
    let e = PublisherBuilder::new("x").with_bucket(b).with_key(key()).build_sharded(1, 2, Duration::from_millis(500));
    let e = e.expect_err("no stream, no committer");
    assert!(e.is_retryable(), "{e}");
    assert!(e.to_string().contains("rank 0 creates it"), "{e}");
}

/// A `publish` that fails after it resolved the previous step (rank 1 cannot list the
/// committer's lease: an outage) hands that step's outcome and part to the next receipt.
/// Found by review: they were dropped, so a caller logging receipts never learned the fate of
/// the step before the failure.
#[test]
fn a_failed_publish_keeps_the_previous_outcome_for_the_next_receipt() {
    let be = backends("sharded-unreported", false).into_iter().next().expect("memory");
    let ((_f0, mut p0), (f1, mut p1)) = sharded_pair(&be, Duration::from_secs(3), 50);
    let mut c = chain();
    p0.publish(1, &shards_of(&halves(&c, 0))).unwrap();
    p1.publish(1, &shards_of(&halves(&c, 1))).unwrap();
    c.step();
    p0.publish(2, &shards_of(&halves(&c, 0))).unwrap();
    f1.inject(FaultOp::List, "writers", 1000, FaultKind::Transient);
    let e = p1.publish(2, &shards_of(&halves(&c, 1))).unwrap_err();
    assert!(e.is_retryable(), "{e}");
    assert_eq!(p1.last_outcome().map(|o| (o.step, o.committed)), Some((1, true)));
    f1.clear();
    let r = p1.publish(2, &shards_of(&halves(&c, 1))).unwrap();
    let previous = r.previous.expect("the outcome of step 1 comes with the next receipt");
    assert_eq!((previous.step, previous.committed), (1, true));
    assert_eq!(r.previous_part.map(|p| p.step), Some(1));
    assert!(p0.flush().unwrap().committed);
    assert!(p1.flush().unwrap().committed);
    // Reported once: the receipt after it carries step 2's outcome.
    c.step();
    p0.publish(3, &shards_of(&halves(&c, 0))).unwrap();
    let r = p1.publish(3, &shards_of(&halves(&c, 1))).unwrap();
    assert_eq!(r.previous.map(|o| o.step), None, "step 2's outcome was returned by flush");
    assert!(p0.flush().unwrap().committed);
}

/// An outcome kept for the next receipt (after a failed `publish`) that `flush` then returns
/// is reported once: found by review, the next receipt repeated it as its `previous`, and a
/// caller counting receipts and flushes saw step 1 committed twice.
#[test]
fn an_outcome_flush_returned_is_not_repeated_by_the_next_receipt() {
    let be = backends("sharded-flushed-unreported", false).into_iter().next().expect("memory");
    let ((_f0, mut p0), (f1, mut p1)) = sharded_pair(&be, Duration::from_secs(3), 50);
    let mut c = chain();
    p0.publish(1, &shards_of(&halves(&c, 0))).unwrap();
    p1.publish(1, &shards_of(&halves(&c, 1))).unwrap();
    c.step();
    p0.publish(2, &shards_of(&halves(&c, 0))).unwrap();
    f1.inject(FaultOp::List, "writers", 1000, FaultKind::Transient);
    p1.publish(2, &shards_of(&halves(&c, 1))).unwrap_err();
    f1.clear();
    assert_eq!(p1.flush().map(|o| (o.step, o.committed)).unwrap(), (1, true));
    let r = p1.publish(2, &shards_of(&halves(&c, 1))).unwrap();
    assert_eq!(r.previous.map(|o| o.step), None, "step 1's outcome was returned by flush");
    assert_eq!(r.previous_part.map(|p| p.step), None);
    assert!(p0.flush().unwrap().committed);
    assert!(p1.flush().unwrap().committed);
}

/// Ranks 0 and 1 of a new stream, each on its own view of `be` (its fault store returned),
/// with a 30 s commit timeout; rank 0's lease is renewed every 500 ms, so that it soon says
/// which step rank 0 is at.
type Rank = (Arc<FaultyStore>, driftless_publisher::ShardedPublisher);
fn pair_with_a_short_lease(be: &Backend) -> (Rank, Rank) {
    let timeout = Duration::from_secs(30);
    let (f0, b0) = be.bucket();
    let p0 = PublisherBuilder::new("x")
        .with_bucket(b0)
        .with_key(key())
        .with_new_stream(true)
        .with_lease_ttl(Duration::from_secs(2))
        .build_sharded(0, 2, timeout)
        .unwrap();
    let (f1, b1) = be.bucket();
    let p1 = PublisherBuilder::new("x").with_bucket(b1).with_key(key()).build_sharded(1, 2, timeout).unwrap();
    ((f0, p0), (f1, p1))
}

/// A step rank 0 does not publish (its `publish` raised, or the trainer skipped it there) is
/// given up on by the other ranks as soon as the committer's lease names a later step (found
/// by review: rank 1 waited out its whole deadline, 270 s with the default timeout, and its
/// part of the next step came too late: that step was lost too).
#[test]
fn a_step_rank_0_skips_does_not_stall_the_others() {
    let be = backends("sharded-skipped", false).into_iter().next().expect("memory");
    let ((_f0, mut p0), (_f1, mut p1)) = pair_with_a_short_lease(&be);
    let mut c = chain();
    rank_publish("skip", &mut p0, &c, 0, 1);
    rank_publish("skip", &mut p1, &c, 1, 1);
    assert!(p0.flush().unwrap().committed);
    assert!(p1.flush().unwrap().committed);
    c.step();
    rank_publish("skip", &mut p1, &c, 1, 2);
    c.step();
    rank_publish("skip", &mut p0, &c, 0, 3);
    let t = std::time::Instant::now();
    let r = rank_publish("skip", &mut p1, &c, 1, 3);
    assert!(t.elapsed() < Duration::from_secs(15), "rank 1 waited {:?} for step 2", t.elapsed());
    let previous = r.previous.expect("step 2's outcome");
    assert!(!previous.committed, "{previous:?}");
    assert!(previous.reason.as_deref().unwrap_or("").contains("went on to step 3"), "{previous:?}");
    let o3 = p0.flush().unwrap();
    assert!(o3.committed, "{o3:?}");
    assert!(p1.flush().unwrap().committed);
}

/// Found by review: rank 0 committed step 2 and went on to step 3, and rank 1 could not read
/// step 2's outcome for a while (an outage, not an absent outcome). It took that for "not
/// committed, no anchor": it kept step 1 as its base while rank 0 built on step 2, and step 3
/// was refused for mixed bases. It now waits on and reads the outcome once it can.
#[test]
fn an_outcome_unreadable_for_a_while_is_not_taken_for_not_committed() {
    let be = backends("sharded-outcome-outage", false).into_iter().next().expect("memory");
    let ((_f0, mut p0), (f1, mut p1)) = pair_with_a_short_lease(&be);
    let mut c = chain();
    rank_publish("outage", &mut p0, &c, 0, 1);
    rank_publish("outage", &mut p1, &c, 1, 1);
    assert!(p0.flush().unwrap().committed);
    assert!(p1.flush().unwrap().committed);
    c.step();
    f1.inject(FaultOp::Get, "outcome.json", 1_000_000, FaultKind::Transient);
    rank_publish("outage", &mut p0, &c, 0, 2);
    rank_publish("outage", &mut p1, &c, 1, 2);
    assert!(p0.flush().unwrap().committed);
    c.step();
    rank_publish("outage", &mut p0, &c, 0, 3);
    // Rank 0's lease soon names step 3; rank 1's reads of step 2's outcome fail until then.
    let clear = {
        let f1 = f1.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(6));
            f1.clear();
        })
    };
    let r = rank_publish("outage", &mut p1, &c, 1, 3);
    clear.join().unwrap();
    let previous = r.previous.expect("step 2's outcome");
    assert!(previous.committed, "{previous:?}");
    let o3 = p0.flush().unwrap();
    assert!(o3.committed, "{o3:?}");
    assert!(p1.flush().unwrap().committed);
}

/// Rank 0's own part is slow to upload (the largest part, under the torch hook): the other
/// ranks wait on while its lease says it is at work on the step, from its part on (found by
/// review: rank 1 gave up at its first deadline, 32 s here, on a step that then committed,
/// and sent an anchor part for the next step while rank 0 sent a delta: that step was lost).
#[test]
fn a_slow_part_of_rank_0_is_waited_for() {
    let be = backends("sharded-slow-part", false).into_iter().next().expect("memory");
    let ((f0, mut p0), (_f1, mut p1)) = sharded_pair(&be, Duration::from_secs(1), 50);
    let mut c = chain();
    f0.inject(FaultOp::Put, "slices.bin", 1, FaultKind::Slow(Duration::from_secs(36)));
    rank_publish("slow-part", &mut p0, &c, 0, 1);
    rank_publish("slow-part", &mut p1, &c, 1, 1);
    let o1 = p1.flush().unwrap_or_else(|e| panic!("rank 1 gave up on step 1: {e}"));
    assert!(o1.committed, "{o1:?}");
    assert!(f0.injected() >= 1);
    assert!(p0.flush().unwrap().committed);
    c.step();
    let r0 = rank_publish("slow-part", &mut p0, &c, 0, 2);
    let r1 = rank_publish("slow-part", &mut p1, &c, 1, 2);
    assert_eq!(r0.part, r1.part);
    assert!(p0.flush().unwrap().committed);
    assert!(p1.flush().unwrap().committed);
}

/// A ready marker planted at a huge step (here a copy of delta 1's marker and signed manifest,
/// renumbered) is passed over by a restarting publisher: it took it for its own newest step
/// and refused every later step as "not after the last published step" for good.
#[test]
fn a_planted_newest_marker_does_not_stop_the_publisher() {
    for be in backends("planted-marker", false) {
        let mut c = chain();
        let (_, b) = be.bucket();
        let mut p = publisher(&b, 50).build().unwrap();
        p.publish(0, &c.views()).unwrap();
        c.step();
        p.publish(1, &c.views()).unwrap();
        p.close().unwrap();
        let rt = rt();
        let huge = 1_000_000_000_000u64;
        let mut m: driftless_format::ReadyMarker =
            serde_json::from_slice(&rt.block_on(b.get(&layout::ready(StepKind::Delta, 1))).unwrap()).unwrap();
        let manifest = rt.block_on(b.get(&layout::object(StepKind::Delta, 1, m.manifest_name()))).unwrap();
        (m.step, m.base_step) = (huge, Some(huge - 1));
        rt.block_on(b.put(&layout::object(StepKind::Delta, huge, m.manifest_name()), manifest)).unwrap();
        rt.block_on(b.put(&layout::ready(StepKind::Delta, huge), serde_json::to_vec(&m).unwrap().into())).unwrap();

        let (_, b2) = be.bucket();
        let mut p = publisher(&b2, 50).build().unwrap();
        c.step();
        p.publish(2, &c.views()).unwrap_or_else(|e| panic!("{}: {e}", be.name));
        p.close().unwrap();
        let reader = StreamReader::new(b2.clone(), trust());
        // Unseeded, the restart publishes an anchor.
        let (a, _) = rt.block_on(reader.anchor(2)).unwrap_or_else(|e| panic!("{}: step 2: {e}", be.name));
        assert_eq!(a.weights_root, root_of(&c.views()), "{}", be.name);
    }
}

/// An elastic restart: the newest lease is an older group's rank 0 (4 ranks) when a rank of
/// the new 2-rank group publishes, before its own rank 0 has started. The rank waits for its
/// committer as when there is none yet (it failed at once, not retryable; found by review).
#[test]
fn a_rank_waits_out_the_lease_of_another_group() {
    let be = backends("sharded-elastic", false).into_iter().next().expect("memory");
    let timeout = Duration::from_secs(20);
    let builder = |rank: u64, world: u64| {
        let (_, b) = be.bucket();
        PublisherBuilder::new("x")
            .with_bucket(b)
            .with_key(key())
            .with_new_stream(true)
            .build_sharded(rank, world, timeout)
    };
    let _old = builder(0, 4).unwrap();
    let mut p1 = builder(1, 2).unwrap();
    let c = chain();
    std::thread::scope(|s| {
        let rank0 = s.spawn(|| {
            std::thread::sleep(Duration::from_secs(1));
            let mut p0 = builder(0, 2).unwrap();
            rank_publish("elastic", &mut p0, &c, 0, 1);
            p0.flush()
        });
        let t = std::time::Instant::now();
        p1.publish(1, &shards_of(&halves(&c, 1))).unwrap_or_else(|e| panic!("after {:?}: {e}", t.elapsed()));
        assert!(p1.flush().unwrap().committed);
        assert!(rank0.join().unwrap().unwrap().committed);
    });
}

/// Found by review: nothing bounded a ready marker's write by the publisher's lease. Its retries
/// could run past the lease, and a GC with a short grace could take the step for an abandoned
/// upload and delete its objects just before the marker naming them landed. A marker request
/// that outlives the lease (held here for 12 s against a TTL of 6 s) is now given up: the delta
/// step is never committed late, and `flush`, finding no marker, publishes the step again as
/// an anchor, which lands.
#[test]
fn a_marker_write_that_outlives_the_lease_is_given_up() {
    let be = backends("marker-past-lease", false).into_iter().next().expect("memory");
    let (faulty, bucket) = be.bucket();
    // (A TTL that tolerates renewals seconds late on a loaded machine.)
    let mut p = publisher(&bucket, 100).with_lease_ttl(Duration::from_secs(6)).build().unwrap();
    let mut c = chain();
    p.publish(0, &c.views()).unwrap();
    p.flush().unwrap();
    c.step();
    let held = Duration::from_secs(12);
    faulty.inject(FaultOp::Put, "ready/deltas/000000000001", 1, FaultKind::Slow(held));
    let t = std::time::Instant::now();
    p.publish(1, &c.views()).unwrap();
    p.flush().unwrap();
    assert!(t.elapsed() < held, "the marker's write was waited for: {:?}", t.elapsed());
    // Past the held request's end: it never landed.
    std::thread::sleep((held + Duration::from_secs(1)).saturating_sub(t.elapsed()));
    let s = scan(&bucket, &trust());
    assert!(!s.ready_deltas.contains_key(&1), "the marker landed after the lease: {s:?}");
    assert!(s.ready_anchors.contains(&1), "{s:?}");
    assert_eq!(s.roots.get(&1), Some(&root_of(&c.views())), "{s:?}");
    p.close().unwrap();
}

/// Found by review: a panic in an upload task (a bug on the request's path) ended the task with
/// its step still counted as queued, and `flush`, `close` and drop then waited for ever. It is
/// a failed step now: `flush` returns, publishing the newest step again as an anchor.
#[test]
fn a_panic_in_an_upload_is_a_failed_step_not_a_hang() {
    let be = backends("upload-panic", false).into_iter().next().expect("memory");
    let (faulty, bucket) = be.bucket();
    let mut p = publisher(&bucket, 100).build().unwrap();
    let mut c = chain();
    p.publish(0, &c.views()).unwrap();
    p.flush().unwrap();
    c.step();
    faulty.inject(FaultOp::Put, "ready/deltas/000000000001", 1, FaultKind::Panic);
    p.publish(1, &c.views()).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let r = p.flush();
        tx.send(r.as_ref().map_err(|e| e.to_string()).map(|_| ()).clone()).unwrap();
        p
    });
    let r = rx.recv_timeout(Duration::from_secs(60)).expect("flush hung after a panic in an upload");
    r.unwrap_or_else(|e| panic!("flush: {e}"));
    let p = waiter.join().unwrap();
    let s = scan(&bucket, &trust());
    assert!(s.ready_anchors.contains(&1) && !s.ready_deltas.contains_key(&1), "{s:?}");
    assert_eq!(s.roots.get(&1), Some(&root_of(&c.views())), "{s:?}");
    p.close().unwrap();
}
