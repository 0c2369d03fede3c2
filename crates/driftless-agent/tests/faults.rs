//! Bad input and faults (issue 4): the bucket unreachable for a while, a marker before its
//! objects, a replayed older manifest presented as newer, a delta whose base root does not
//! match, truncated objects, and the notify target down or slow. In every case the agent never
//! claims unverified weights, and recovers by itself once the cause is gone.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use driftless_agent::notify::Notifier;
use driftless_agent::{Agent, Error, Fault, LocalState, SyncPath};
use driftless_format::gen::{ModelSpec, RlChain};
use driftless_format::{Checkpoint, Keypair, StepKind, TrustSet};
use driftless_publisher::{Publisher, PublisherBuilder};
use driftless_store::{layout, Bucket, FaultKind, FaultOp};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A trainer: a chain and a publisher (anchor every `anchor_every`).
struct Trainer {
    chain: RlChain,
    p: Option<Publisher>,
    step: Option<u64>,
}

impl Trainer {
    fn new(b: &Bucket, key: &Keypair, anchor_every: u64) -> Trainer {
        let (b, k) = (b.clone(), key.clone());
        let p = tokio::task::block_in_place(|| {
            PublisherBuilder::new("unused").with_bucket(b).with_key(k).with_anchor_every(anchor_every).build().unwrap()
        });
        Trainer { chain: RlChain::new(&ModelSpec::with_bf16_bytes(256 << 10), 2e-6, 21), p: Some(p), step: None }
    }

    /// Publishes the next step and returns its tensors.
    fn publish(&mut self) -> Vec<(String, Vec<u8>)> {
        let step = self.step.map_or(0, |s| s + 1);
        if step > 0 {
            self.chain.step();
        }
        let p = self.p.as_mut().unwrap();
        tokio::task::block_in_place(|| {
            p.publish(step, &self.chain.views()).unwrap();
            p.flush().unwrap();
        });
        self.step = Some(step);
        snapshot(&self.chain)
    }
}

impl Drop for Trainer {
    fn drop(&mut self) {
        if let Some(p) = self.p.take() {
            tokio::task::block_in_place(|| p.close().unwrap());
        }
    }
}

fn keys() -> (Keypair, TrustSet) {
    let key = Keypair::from_seed([5; 32]);
    let trust = TrustSet::new().with_key(key.public());
    (key, trust)
}

fn agent(tb: &TestBucket, name: &str, trust: &TrustSet) -> Agent {
    Agent::new(tb.bucket.clone(), config(tb.dir.path().join(name), trust.clone())).unwrap()
}

/// A trainer that published steps 0..n, and agent "a" synced to step n - 1.
async fn following(tb: &TestBucket, key: &Keypair, trust: &TrustSet, n: u64) -> (Trainer, Agent) {
    let mut t = Trainer::new(&tb.bucket, key, 100);
    for _ in 0..n {
        t.publish();
    }
    let mut a = agent(tb, "a", trust);
    assert_eq!(a.sync_once().await.unwrap().step, n - 1, "{}", tb.name);
    (t, a)
}

/// Plants ready markers of delta steps `steps` on `base`: this stream's id (read from anchor
/// 0's marker), a manifest that is not there.
async fn plant_delta_markers(b: &Bucket, steps: std::ops::Range<u64>, base: u64) {
    let real: serde_json::Value =
        serde_json::from_slice(&b.get(&layout::ready(StepKind::Anchor, 0)).await.unwrap()).unwrap();
    for s in steps {
        let m = serde_json::json!({"kind": "ready", "stream_id": real["stream_id"], "of": "delta", "step": s,
            "base_step": base, "manifest_sha256": "00".repeat(32), "payload_bytes": 10, "manifest": "g1-manifest.json"});
        b.put(&layout::ready(StepKind::Delta, s), Bytes::from(m.to_string())).await.unwrap();
    }
}

/// Puts objects (key, body) through the bucket, 64 at a time (thousands of planted markers,
/// on SeaweedFS too).
async fn plant_many(b: &Bucket, objects: impl Iterator<Item = (String, Bytes)>) {
    use futures::StreamExt;
    futures::stream::iter(objects).for_each_concurrent(64, |(k, v)| async move { b.put(&k, v).await.unwrap() }).await;
}

/// Plants 50 more junk delta markers (steps 1000 on) than one plan reads
/// (`plan::MAX_MARKER_READS`).
async fn plant_junk_past_the_read_bound(b: &Bucket) {
    let n = driftless_agent::plan::MAX_MARKER_READS as u64 + 50;
    plant_many(b, (1000..1000 + n).map(|s| (layout::ready(StepKind::Delta, s), Bytes::from_static(b"junk")))).await;
}

/// Commits delta manifest `m` (crafted by a test, signed with `key`) at its step: the manifest
/// at its step's `manifest.json`, then its ready marker.
async fn put_signed_delta(b: &Bucket, key: &Keypair, m: &driftless_format::DeltaManifest) {
    let env = key.seal(&serde_json::to_vec(m).unwrap()).unwrap();
    b.put(&layout::object(StepKind::Delta, m.step, "manifest.json"), Bytes::from(env.clone())).await.unwrap();
    let marker = driftless_format::manifest::ReadyMarker {
        kind: "ready".into(),
        stream_id: m.stream_id.clone(),
        of: StepKind::Delta,
        step: m.step,
        base_step: Some(m.base_step),
        manifest_sha256: driftless_format::Digest::of(&env),
        payload_bytes: m.payload_bytes(),
        manifest: None,
    };
    b.put(&layout::ready(StepKind::Delta, m.step), Bytes::from(serde_json::to_vec(&marker).unwrap())).await.unwrap();
}

fn counter(a: &Agent, f: impl Fn(&driftless_agent::metrics::Metrics) -> &AtomicU64) -> u64 {
    f(&a.metrics()).load(SeqCst)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bucket_unreachable_for_a_while() {
    for tb in buckets("unreachable") {
        let (key, trust) = keys();
        let (mut t, mut a) = following(&tb, &key, &trust, 2).await;
        let want = t.publish();
        // The bucket goes away: every GET and listing fails.
        tb.faults.inject(FaultOp::Get, "", usize::MAX, FaultKind::Transient);
        tb.faults.inject(FaultOp::List, "", usize::MAX, FaultKind::Transient);
        let before = a.state().cloned();
        for _ in 0..3 {
            let e = a.sync_once().await.unwrap_err();
            assert!(e.is_retryable() && !e.is_integrity(), "{}: {e}", tb.name);
            assert_eq!(a.state().cloned(), before, "{}: no state change while the bucket is down", tb.name);
            assert_verified(&a, &tb.name);
        }
        // A cold agent cannot start either, and has nothing.
        let mut cold = agent(&tb, "cold", &trust);
        assert!(cold.sync_once().await.unwrap_err().is_retryable());
        assert!(cold.state().is_none());
        assert_eq!(counter(&a, |m| &m.verify_failures), 0);
        // Back: both recover by themselves, a on the fast path.
        tb.faults.clear();
        let o = a.sync_once().await.unwrap();
        assert_eq!((o.step, o.route), (2, SyncPath::Fast), "{}", tb.name);
        assert_bits(&a, &want);
        assert_eq!(cold.sync_once().await.unwrap().step, 2);
        assert_bits(&cold, &want);
        assert_eq!(
            counter(&a, |m| &m.anchor_downloads),
            1,
            "{}: one anchor at the first sync, none after the outage",
            tb.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bucket_failing_mid_download_leaves_state_untouched() {
    // A GET of a segment fails after the manifest was read: nothing local may have changed.
    let tb = file_bucket();
    let (key, trust) = keys();
    let mut t = Trainer::new(&tb.bucket, &key, 100);
    t.publish();
    let mut a = agent(&tb, "a", &trust);
    a.sync_once().await.unwrap();
    t.publish();
    let want = t.publish();
    // (Transient, a 503 past the store's retries: a permanent answer is the step's problem,
    // refused as not ready: an_unreadable_marker_or_manifest_does_not_stop_syncs.)
    tb.faults.inject(FaultOp::Get, "deltas/000000000002/g1-seg-", usize::MAX, FaultKind::Transient);
    let before = a.state().cloned();
    let e = a.sync_once().await.unwrap_err();
    assert!(!e.is_integrity(), "{e}");
    // Delta 1 may have been applied (it was complete); delta 2 never half-applied.
    let s = a.state().unwrap();
    assert!(Some(s) == before.as_ref() || s.step == 1, "{s:?}");
    assert_verified(&a, "mid-download");
    tb.faults.clear();
    assert_eq!(a.sync_once().await.unwrap().step, 2);
    assert_bits(&a, &want);
    assert_eq!(counter(&a, |m| &m.anchor_downloads), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marker_before_its_objects_is_not_ready() {
    for tb in buckets("marker-first") {
        let (key, trust) = keys();
        let (mut t, mut a) = following(&tb, &key, &trust, 2).await;
        let want = t.publish();
        let b = &tb.bucket;
        // As a replicator copying the marker first: take the manifest away, then a segment.
        let mkey = layout::object(StepKind::Delta, 2, "g1-manifest.json");
        let skey = layout::object(
            StepKind::Delta,
            2,
            &layout::generation_name(1, &driftless_format::ops::segment_object_name(0)),
        );
        let manifest = b.get(&mkey).await.unwrap();
        let seg = b.get(&skey).await.unwrap();
        b.delete(&mkey).await.unwrap();
        b.delete(&skey).await.unwrap();
        let before = a.state().cloned();
        for round in 0..2 {
            // Missing objects: the step is refused for now (planned around), state kept.
            let o = a.sync_once().await.unwrap();
            assert_eq!(o.step, 1, "{}: round {round}", tb.name);
            assert_eq!(
                o.refused.iter().map(|r| (r.step, r.fault)).collect::<Vec<_>>(),
                vec![(2, Fault::Missing)],
                "{}: {o:?}",
                tb.name
            );
            assert!(o.refused[0].reason.contains("not ready"), "{}: {o:?}", tb.name);
            assert_eq!(a.state().cloned(), before);
            assert_verified(&a, &tb.name);
            if round == 0 {
                b.put(&mkey, manifest.clone()).await.unwrap(); // manifest arrives, segment not yet
            }
        }
        b.put(&skey, seg).await.unwrap();
        let o = a.sync_once().await.unwrap();
        assert_eq!((o.step, o.route), (2, SyncPath::Fast));
        assert_bits(&a, &want);
        assert_eq!(counter(&a, |m| &m.anchor_downloads), 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_older_manifest_presented_as_newer_is_refused() {
    for tb in buckets("replay") {
        let (key, trust) = keys();
        let (mut t, mut a) = following(&tb, &key, &trust, 4).await;
        let want3 = snapshot(&t.chain);
        let b = &tb.bucket;
        // Replay delta 1 (a genuine, signed manifest) as step 10 on top of 3: its objects, its
        // manifest, and a marker rewritten to announce step 10.
        for o in b.list(&layout::delta_dir(1)).await.unwrap() {
            let name = o.key.rsplit('/').next().unwrap().to_string();
            b.put(&layout::object(StepKind::Delta, 10, &name), b.get(&o.key).await.unwrap()).await.unwrap();
        }
        let mut marker: serde_json::Value =
            serde_json::from_slice(&b.get(&layout::ready(StepKind::Delta, 1)).await.unwrap()).unwrap();
        marker["step"] = 10.into();
        marker["base_step"] = 3.into();
        b.put(&layout::ready(StepKind::Delta, 10), Bytes::from(serde_json::to_vec(&marker).unwrap())).await.unwrap();
        // And a verbatim copy of the marker of step 2 at step 11 (names another step).
        b.put(&layout::ready(StepKind::Delta, 11), b.get(&layout::ready(StepKind::Delta, 2)).await.unwrap())
            .await
            .unwrap();
        let before = a.state().cloned();
        for _ in 0..2 {
            let o = a.sync_once().await.unwrap();
            assert_eq!((o.step, o.route), (3, SyncPath::UpToDate), "{}", tb.name);
            assert_eq!(a.state().cloned(), before, "{}: local state kept", tb.name);
            assert_verified(&a, &tb.name);
        }
        assert_bits(&a, &want3);
        assert!(counter(&a, |m| &m.verify_failures) >= 1, "{}: the refusal is reported", tb.name);
        assert_eq!(counter(&a, |m| &m.anchor_downloads), 1, "{}: a forged step never costs an anchor", tb.name);
        // A cold agent refuses it too and lands on 3.
        let mut c = agent(&tb, "cold", &trust);
        assert_eq!(c.sync_once().await.unwrap().step, 3);
        assert_bits(&c, &want3);
        // Genuine steps keep flowing.
        let want4 = t.publish();
        assert_eq!(a.sync_once().await.unwrap().step, 4);
        assert_bits(&a, &want4);
    }
}

/// A delta signed with the stream's key whose base is the agent's step with another root
/// (forged, or another run's) is refused like any bad step: the verified weights stay served
/// and vouched for, no anchor is fetched for it, and the genuine next step is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_delta_contradicting_the_verified_base_is_refused() {
    for tb in buckets("contradicts") {
        let (key, trust) = keys();
        let (mut t, mut a) = following(&tb, &key, &trust, 4).await;
        let want3 = snapshot(&t.chain);
        let b = &tb.bucket;
        let reader = driftless_store::stream::StreamReader::new(b.clone(), trust.clone());
        let (mut m, _) = reader.delta(3).await.unwrap();
        (m.step, m.base_step, m.base_root, m.segments) = (1000, 3, driftless_format::Digest([7; 32]), vec![]);
        put_signed_delta(b, &key, &m).await;
        let before = a.state().cloned();
        for _ in 0..2 {
            let o = a.sync_once().await.unwrap();
            assert_eq!((o.step, o.route), (3, SyncPath::UpToDate), "{}", tb.name);
            let r = o.refused.iter().find(|r| r.step == 1000);
            assert!(r.is_some_and(|r| r.reason.contains("local copy has")), "{}: {o:?}", tb.name);
            assert_eq!(a.state().cloned(), before, "{}: local state kept", tb.name);
            assert_verified(&a, &tb.name);
        }
        assert_bits(&a, &want3);
        assert_eq!(counter(&a, |m| &m.anchor_downloads), 1, "{}: a contradicting delta never costs an anchor", tb.name);
        // Genuine steps keep flowing, through the fast path.
        let want4 = t.publish();
        let o = a.sync_once().await.unwrap();
        assert_eq!((o.step, o.route), (4, SyncPath::Fast), "{}", tb.name);
        assert_bits(&a, &want4);
    }
}

/// A delta signed by a key the agent does not trust is refused as untrusted (the fault carried
/// from the signature check, not guessed from the reason's words), and the verified weights
/// stay served. Then genuine steps flow through the fast path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delta_signed_by_an_unknown_key_is_refused_as_untrusted() {
    for tb in buckets("unknown-key") {
        let (key, trust) = keys();
        let (mut t, mut a) = following(&tb, &key, &trust, 3).await;
        let want2 = snapshot(&t.chain);
        let reader = driftless_store::stream::StreamReader::new(tb.bucket.clone(), trust.clone());
        let (mut m, _) = reader.delta(2).await.unwrap();
        // On the step the agent holds, so it is planned as the fast path.
        (m.step, m.base_step, m.base_root) = (1000, 2, a.state().unwrap().root);
        put_signed_delta(&tb.bucket, &Keypair::from_seed([6; 32]), &m).await;
        let before = a.state().cloned();
        for _ in 0..2 {
            let o = a.sync_once().await.unwrap();
            assert_eq!((o.step, o.route), (2, SyncPath::UpToDate), "{}", tb.name);
            let r: Vec<_> = o.refused.iter().map(|r| (r.step, r.fault)).collect();
            assert_eq!(r, vec![(1000, Fault::Untrusted)], "{}: {o:?}", tb.name);
            assert_eq!(a.state().cloned(), before, "{}: local state kept", tb.name);
        }
        assert_bits(&a, &want2);
        assert_eq!(counter(&a, |m| &m.anchor_downloads), 1, "{}", tb.name);
        let want3 = t.publish();
        let o = a.sync_once().await.unwrap();
        assert_eq!((o.step, o.route), (3, SyncPath::Fast), "{}", tb.name);
        assert_bits(&a, &want3);
    }
}

/// A signed layout change whose result layout claims 8 GiB more tensors, with segments that
/// decode to 4 GiB (within what its own result allows): refused from its manifest, before a
/// segment is downloaded (the segments are not even in the bucket, so a download would make
/// the step "not ready", never this refusal), since a reader holds a delta decoded and the
/// model it applies it to is 256 KiB. The verified weights stay served; genuine steps flow.
/// (Found by review: decoded whole, such a delta had agents killed for memory at every start.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_delta_decoding_past_the_local_model_is_refused_from_its_manifest() {
    for tb in buckets("grown") {
        let (key, trust) = keys();
        let (mut t, mut a) = following(&tb, &key, &trust, 3).await;
        let want = snapshot(&t.chain);
        let st = a.state().cloned().unwrap();
        let reader = driftless_store::stream::StreamReader::new(tb.bucket.clone(), trust.clone());
        let (mut m, _) = reader.delta(st.step).await.unwrap();
        (m.step, m.base_step, m.base_root) = (1000, st.step, st.root);
        m.shards[0].tensors.push(driftless_format::manifest::TensorRecord {
            name: "grown".into(),
            dtype: driftless_format::DType::U8,
            shape: vec![8 << 30],
            digest: driftless_format::Digest([0; 32]),
        });
        let one = m.segments[0].clone();
        m.segments = (0..2)
            .map(|i| driftless_format::manifest::SegmentRef {
                object: driftless_format::manifest::ObjectRef {
                    object: format!("huge-{i}.dls"),
                    size: 4096,
                    ..one.object.clone()
                },
                raw_size: 2 << 30,
                entries: 1,
            })
            .collect();
        m.validate().expect("within what its own result allows");
        put_signed_delta(&tb.bucket, &key, &m).await;
        for _ in 0..2 {
            let o = a.sync_once().await.unwrap();
            assert_eq!((o.step, o.route), (st.step, SyncPath::UpToDate), "{}", tb.name);
            let r = o.refused.iter().find(|r| r.step == 1000);
            assert!(
                r.is_some_and(|r| r.fault == Fault::Corrupt && r.reason.contains("wait for the next anchor")),
                "{}: {o:?}",
                tb.name
            );
            assert_eq!(a.state().cloned(), Some(st.clone()), "{}: local state kept", tb.name);
            assert_verified(&a, &tb.name);
        }
        assert_bits(&a, &want);
        tb.bucket.delete(&layout::ready(StepKind::Delta, 1000)).await.unwrap();
        let want = t.publish();
        let o = a.sync_once().await.unwrap();
        assert_eq!((o.step, o.route), (st.step + 1, SyncPath::Fast), "{}", tb.name);
        assert_bits(&a, &want);
    }
}

/// A ready marker (unsigned) that understates its step's payload, to steer a planner onto a
/// route it would not take, is refused once the step's signed manifest is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marker_understating_its_payload_is_refused() {
    for tb in buckets("payload-lie") {
        let (key, trust) = keys();
        let (mut t, mut a) = following(&tb, &key, &trust, 3).await;
        let want3 = t.publish();
        let b = &tb.bucket;
        let key3 = layout::ready(StepKind::Delta, 3);
        let honest = b.get(&key3).await.unwrap();
        let mut marker: serde_json::Value = serde_json::from_slice(&honest).unwrap();
        marker["payload_bytes"] = 1.into();
        b.put(&key3, Bytes::from(serde_json::to_vec(&marker).unwrap())).await.unwrap();
        // (Without the signed latest.json, whose copy of the marker would be used instead.)
        b.delete(layout::LATEST).await.unwrap();
        let before = a.state().cloned();
        let o = a.sync_once().await.unwrap();
        assert_eq!((o.step, o.route), (2, SyncPath::UpToDate), "{}", tb.name);
        let r = o.refused.iter().find(|r| r.step == 3);
        assert!(r.is_some_and(|r| r.reason.contains("declares 1 payload bytes")), "{}: {o:?}", tb.name);
        assert_eq!(a.state().cloned(), before, "{}", tb.name);
        // The honest marker back: an agent takes the step (this one once its refusal of the
        // step expires, 30 s and doubling, as for any refusal).
        b.put(&key3, honest).await.unwrap();
        let mut c = agent(&tb, "c", &trust);
        assert_eq!(c.sync_once().await.unwrap().step, 3, "{}", tb.name);
        assert_bits(&c, &want3);
    }
}

/// An anchor written as plain safetensors (not byte planes) streams like any other: 16 MiB
/// ranged parts, each checked against its signed SHA-256 and written as it arrives, hashed as
/// written. A flipped byte in it is refused and costs nothing served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_safetensors_anchor_streams_and_is_checked() {
    for tb in buckets("plain-anchor") {
        let (key, trust) = keys();
        let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(40 << 20), 2e-6, 21);
        let (b, k) = (tb.bucket.clone(), key.clone());
        tokio::task::block_in_place(|| {
            let mut p = PublisherBuilder::new("unused")
                .with_bucket(b)
                .with_key(k)
                .with_anchor_every(100)
                .with_anchor_encoding(driftless_format::manifest::AnchorEncoding::Safetensors)
                .build()
                .unwrap();
            for step in 0..3 {
                if step > 0 {
                    chain.step();
                }
                p.publish(step, &chain.views()).unwrap();
                p.flush().unwrap();
            }
            p.close().unwrap();
        });
        let want = snapshot(&chain);
        let mut a = agent(&tb, "a", &trust);
        let o = a.sync_once().await.unwrap();
        assert_eq!((o.step, o.route), (2, SyncPath::Anchor), "{}", tb.name);
        assert_bits(&a, &want);
        // One flipped byte in the anchor object (same size): a cold agent refuses the step.
        let objs = tb.bucket.list(&layout::anchor_dir(0)).await.unwrap();
        let obj = objs.iter().find(|o| o.key.ends_with(".safetensors")).unwrap_or_else(|| panic!("{objs:?}"));
        let mut bytes = tb.bucket.get(&obj.key).await.unwrap().to_vec();
        let n = bytes.len();
        bytes[n / 2] ^= 0x10;
        tb.bucket.put(&obj.key, Bytes::from(bytes)).await.unwrap();
        let mut c = agent(&tb, "c", &trust);
        assert!(c.sync_once().await.is_err(), "{}", tb.name);
        assert!(c.state().is_none(), "{}", tb.name);
        assert!(counter(&c, |m| &m.verify_failures) >= 1, "{}", tb.name);
        // The first agent keeps serving its verified step.
        assert_eq!(a.sync_once().await.unwrap().step, 2, "{}", tb.name);
        assert_bits(&a, &want);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_on_a_wrong_base_is_never_applied() {
    let tb = file_bucket();
    let (key, trust) = keys();
    let mut t = Trainer::new(&tb.bucket, &key, 100);
    t.publish();
    t.publish();
    let dir = tb.dir.path().join("a");
    {
        let mut a = Agent::new(tb.bucket.clone(), config(&dir, trust.clone())).unwrap();
        assert_eq!(a.sync_once().await.unwrap().step, 1);
    }
    // The local checkpoint diverged (a bit flipped by someone else) and its state file was
    // rewritten to match: consistent, verified-looking, but not the stream's step 1.
    let cur = dir.join("current");
    let shard = std::fs::read_dir(&cur)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = bytes.len();
    bytes[n - 2] ^= 0x01;
    std::fs::write(&shard, &bytes).unwrap();
    let mut st = LocalState::load(&dir).unwrap().unwrap();
    st.root = driftless_format::weights_root(&Checkpoint::open(&cur).unwrap().views()).1;
    st.store(&dir).unwrap();
    let want = t.publish();
    let mut a = Agent::new(tb.bucket.clone(), config(&dir, trust.clone())).unwrap();
    // WrongBase -> discard -> anchor + delta, in the same sync.
    let o = a.sync_once().await.unwrap();
    assert_eq!((o.step, o.route), (2, SyncPath::Anchor));
    assert_bits(&a, &want);
    assert_eq!(counter(&a, |m| &m.verify_failures), 1);
    assert_eq!(counter(&a, |m| &m.anchor_downloads), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_objects() {
    for tb in buckets("truncated") {
        let (key, trust) = keys();
        let mut t = Trainer::new(&tb.bucket, &key, 100);
        t.publish();
        let mut a = agent(&tb, "a", &trust);
        a.sync_once().await.unwrap();
        let want = t.publish();
        let b = &tb.bucket;
        // A truncated manifest: its SHA-256 no longer matches the marker: not ready, state kept.
        let mkey = layout::object(StepKind::Delta, 1, "g1-manifest.json");
        let manifest = b.get(&mkey).await.unwrap();
        b.put(&mkey, manifest.slice(..manifest.len() / 2)).await.unwrap();
        let before = a.state().cloned();
        let o = a.sync_once().await.unwrap();
        assert_eq!((o.step, o.refused.len()), (0, 1), "{}: {o:?}", tb.name);
        assert_eq!(a.state().cloned(), before);
        b.put(&mkey, manifest).await.unwrap();
        // A truncated segment: an integrity failure; never applied.
        let skey = layout::object(
            StepKind::Delta,
            1,
            &layout::generation_name(1, &driftless_format::ops::segment_object_name(0)),
        );
        let seg = b.get(&skey).await.unwrap();
        b.put(&skey, seg.slice(..seg.len() - 7)).await.unwrap();
        let o = a.sync_once().await.unwrap();
        assert_eq!((o.step, o.refused.len()), (0, 1), "{}: {o:?}", tb.name);
        assert!(o.refused[0].reason.contains("does not match its manifest"), "{}: {o:?}", tb.name);
        assert_verified(&a, &tb.name);
        assert_eq!(a.state().cloned(), before);
        // A truncated anchor shard: a cold agent gets nothing.
        let anchor = b.list(&layout::anchor_dir(0)).await.unwrap();
        let akey = anchor
            .iter()
            .map(|o| o.key.clone())
            .find(|k| !k.ends_with("manifest.json") && !k.contains("extra-"))
            .unwrap();
        let shard = b.get(&akey).await.unwrap();
        b.put(&akey, shard.slice(..shard.len() / 3)).await.unwrap();
        let mut c = agent(&tb, "cold", &trust);
        let e = c.sync_once().await.unwrap_err();
        assert!(e.is_refused() && e.is_integrity(), "{}: {e}", tb.name);
        assert!(c.state().is_none());
        assert!(!c.current_dir().exists() || c.state().is_none());
        // Repaired: both land on step 1 bit for bit.
        b.put(&akey, shard).await.unwrap();
        b.put(&skey, seg).await.unwrap();
        assert_eq!(a.sync_once().await.unwrap().step, 1);
        assert_bits(&a, &want);
        assert_eq!(c.sync_once().await.unwrap().step, 1);
        assert_bits(&c, &want);
    }
}

/// What the recording inference server saw of one load.
#[derive(Debug, Clone)]
struct Load {
    step: u64,
    /// Files under `dir` hashed to the announced root when the load began and when it ended.
    stable: bool,
    ok: bool,
}

#[derive(Default)]
struct Server {
    down: AtomicBool,
    delay_ms: AtomicU64,
    loads: Mutex<Vec<Load>>,
}

/// An `http` notify target that "loads" the checkpoint: hashes the directory at the start and
/// at the end of a (configurable) delay, and records whether it stayed equal to the root.
async fn inference_server() -> (String, Arc<Server>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/load", l.local_addr().unwrap());
    let srv = Arc::new(Server::default());
    let s2 = srv.clone();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = l.accept().await.unwrap();
            let srv = s2.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut tmp = [0u8; 4096];
                let body = loop {
                    let n = s.read(&mut tmp).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&tmp[..n]);
                    let text = String::from_utf8_lossy(&buf).to_string();
                    if let Some(h) = text.find("\r\n\r\n") {
                        let len = text[..h]
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse::<usize>().unwrap())
                            })
                            .unwrap_or(0);
                        if buf.len() >= h + 4 + len {
                            break text[h + 4..].to_string();
                        }
                    }
                };
                let v: serde_json::Value = serde_json::from_str(&body).unwrap();
                let step = v["step"].as_u64().unwrap();
                let (root, dir) =
                    (v["weights_root"].as_str().unwrap().to_string(), v["dir"].as_str().unwrap().to_string());
                let down = srv.down.load(SeqCst);
                let status = if down {
                    srv.loads.lock().unwrap().push(Load { step, stable: true, ok: false });
                    503
                } else {
                    let hash = |d: String| {
                        tokio::task::spawn_blocking(move || {
                            driftless_format::weights_root(&Checkpoint::open(&d).unwrap().views()).1.to_hex()
                        })
                    };
                    let a = hash(dir.clone()).await.unwrap();
                    tokio::time::sleep(Duration::from_millis(srv.delay_ms.load(SeqCst))).await;
                    let b = hash(dir).await.unwrap();
                    srv.loads.lock().unwrap().push(Load { step, stable: a == root && b == root, ok: true });
                    200
                };
                let resp = format!("HTTP/1.1 {status} X\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}");
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    (url, srv)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_target_down_then_back() {
    let tb = file_bucket();
    let (key, trust) = keys();
    let (url, srv) = inference_server().await;
    let mut cfg = config(tb.dir.path().join("a"), trust.clone());
    cfg.notify = vec![format!("http={url}").parse::<Notifier>().unwrap()];
    let mut a = Agent::new(tb.bucket.clone(), cfg).unwrap();
    let mut t = Trainer::new(&tb.bucket, &key, 100);
    let want0 = t.publish();
    srv.down.store(true, SeqCst);
    let e = a.sync_once().await.unwrap_err();
    assert!(matches!(e, Error::Notify { .. }) && e.is_retryable(), "{e}");
    assert_eq!(a.state().unwrap().step, 0, "the verified step is kept");
    assert_eq!(a.metrics().ready.load(SeqCst), 0, "not ready: the server has not loaded it");
    assert!(a.metrics().notify_failures.load(SeqCst) >= 1);
    // A new step arrives while the server is still down: the agent does not touch the files the
    // server has not loaded yet.
    let want1 = t.publish();
    let e = a.sync_once().await.unwrap_err();
    assert!(matches!(e, Error::Notify { .. }), "{e}");
    assert_eq!(a.state().unwrap().step, 0);
    assert_bits(&a, &want0);
    // Back: step 0 is loaded first, then 1.
    srv.down.store(false, SeqCst);
    let o = a.sync_once().await.unwrap();
    assert_eq!(o.step, 1);
    assert_bits(&a, &want1);
    let ok: Vec<u64> = srv.loads.lock().unwrap().iter().filter(|l| l.ok).map(|l| l.step).collect();
    assert_eq!(ok, [0, 1]);
    assert!(srv.loads.lock().unwrap().iter().all(|l| l.stable));
    assert_eq!(a.metrics().ready.load(SeqCst), 1);
    // Nothing new: no second load of 1.
    assert_eq!(a.sync_once().await.unwrap().route, SyncPath::UpToDate);
    assert_eq!(srv.loads.lock().unwrap().iter().filter(|l| l.ok).count(), 2);
    // A load of step 2 that fails: what the server holds is not known (a vLLM reload that
    // failed leaves it paused on a mix of two steps), so not ready until a load succeeds
    // (found by review: ready stayed 1 for good once set).
    let want2 = t.publish();
    srv.down.store(true, SeqCst);
    a.sync_once().await.unwrap_err();
    assert_eq!(a.metrics().ready.load(SeqCst), 0, "ready after a failed load");
    srv.down.store(false, SeqCst);
    assert_eq!(a.sync_once().await.unwrap().step, 2);
    assert_bits(&a, &want2);
    assert_eq!(a.metrics().ready.load(SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_notify_target_never_sees_files_change_under_it() {
    let tb = file_bucket();
    let (key, trust) = keys();
    let (url, srv) = inference_server().await;
    srv.delay_ms.store(300, SeqCst);
    let mut cfg = config(tb.dir.path().join("a"), trust.clone());
    cfg.notify = vec![format!("http={url}").parse::<Notifier>().unwrap()];
    cfg.poll_min = Duration::from_millis(10);
    cfg.poll_max = Duration::from_millis(20);
    let a = Agent::new(tb.bucket.clone(), cfg).unwrap();
    let metrics = a.metrics();
    // The trainer publishes faster than the server loads while the agent follows with `run`.
    let mut t = Trainer::new(&tb.bucket, &key, 4);
    t.publish();
    let stop = Arc::new(tokio::sync::Notify::new());
    let poke = Arc::new(tokio::sync::Notify::new());
    let run = {
        let stop = stop.clone();
        tokio::spawn(a.run(poke, async move { stop.notified().await }))
    };
    let mut want = vec![];
    for _ in 0..8 {
        want = t.publish();
        tokio::time::sleep(Duration::from_millis(120)).await;
    }
    let last = t.step.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while metrics.step.load(SeqCst) != last || srv.loads.lock().unwrap().last().map(|l| l.step) != Some(last) {
        assert!(std::time::Instant::now() < deadline, "agent did not reach step {last}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.notify_one();
    run.await.unwrap().unwrap();
    let loads = srv.loads.lock().unwrap().clone();
    assert!(loads.len() >= 2, "{loads:?}");
    assert!(loads.iter().all(|l| l.ok && l.stable), "files changed under a loading server: {loads:?}");
    assert!(loads.windows(2).all(|w| w[0].step < w[1].step), "loads in step order: {loads:?}");
    let ck = Checkpoint::open(tb.dir.path().join("a/current")).unwrap();
    for (name, data) in &want {
        assert!(ck.views().iter().any(|v| v.name == name && v.data == &data[..]), "{name}");
    }
}

// A key the store's client cannot parse (here a non-UTF-8 file name; on S3 `//`, `.`, `..` or
// a control character) fails every listing of its prefix. Planted under `ready/`, it stopped
// every cold start and every poll that lists; now they plan from the signed latest.json.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unparsable_key_under_ready_does_not_stop_syncs() {
    use std::os::unix::ffi::OsStrExt;
    let tb = file_bucket();
    let (key, trust) = keys();
    let mut t = Trainer::new(&tb.bucket, &key, 4);
    for _ in 0..5 {
        t.publish();
    }
    let mut a = agent(&tb, "a", &trust);
    assert_eq!(a.sync_once().await.unwrap().step, 4);
    let root = tb.root.clone().unwrap();
    for kind in [StepKind::Anchor, StepKind::Delta] {
        let d = root.join(layout::ready_prefix(kind));
        std::fs::write(d.join(std::ffi::OsStr::from_bytes(b"planted\xff")), b"x").unwrap();
    }
    assert!(tb.bucket.list(layout::ready_prefix(StepKind::Delta)).await.is_err(), "the planted key fails the listing");
    t.publish();
    let want = t.publish();
    // Two steps behind: the hint alone cannot plan it (the walk from latest.json does).
    let o = a.sync_once().await.unwrap();
    assert_eq!((o.step, o.route, o.deltas), (6, SyncPath::Catchup, 2), "{o:?}");
    assert_bits(&a, &want);
    assert_eq!(a.sync_once().await.unwrap().route, SyncPath::UpToDate);
    // A cold start: the newest anchor (4) and the chain after it.
    let mut b = agent(&tb, "b", &trust);
    let o = b.sync_once().await.unwrap();
    assert_eq!((o.step, o.route, o.deltas), (6, SyncPath::Anchor, 2), "{o:?}");
    assert_bits(&b, &want);
    assert_verified(&b, "cold start");
    // Without a latest.json there is nothing to plan from: the listing's error, state kept.
    tb.bucket.delete(layout::LATEST).await.unwrap();
    let mut c = agent(&tb, "c", &trust);
    let e = c.sync_once().await.unwrap_err();
    assert!(e.to_string().contains("invalid object key"), "{e}");
    assert!(c.state().is_none());
}

// Found by review: ready markers planted above the real newest step (the public stream id,
// a manifest that does not exist) each took a round of their own (a listing, a failed
// manifest GET, a refusal) and a sync gave up after 32: 40 of them stopped every cold start,
// reported as a verification failure. Junk markers were read again at every listing. Now the
// planted steps are refused in one sync from one listing, junk markers are read once, and a
// running agent two steps behind pays no GET for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_markers_do_not_stop_a_cold_start_and_are_read_once() {
    for tb in buckets("planted") {
        let (key, trust) = keys();
        let mut t = Trainer::new(&tb.bucket, &key, 4);
        let mut want = vec![];
        for _ in 0..3 {
            want = t.publish();
        }
        let real: serde_json::Value =
            serde_json::from_slice(&tb.bucket.get(&layout::ready(StepKind::Anchor, 0)).await.unwrap()).unwrap();
        // 20 naming a manifest that is not there, 20 junk under the SHA-256 they name.
        let junk = Bytes::from_static(b"junk, not a manifest");
        for s in 100..140u64 {
            let sha = if s < 120 { "00".repeat(32) } else { driftless_format::Digest::of(&junk).to_hex() };
            let m = serde_json::json!({"kind": "ready", "stream_id": real["stream_id"], "of": "anchor", "step": s,
            "manifest_sha256": sha, "payload_bytes": 10, "manifest": "g1-manifest.json"});
            if s >= 120 {
                tb.bucket.put(&layout::object(StepKind::Anchor, s, "g1-manifest.json"), junk.clone()).await.unwrap();
            }
            tb.bucket.put(&layout::ready(StepKind::Anchor, s), Bytes::from(m.to_string())).await.unwrap();
        }
        for s in 1000..1050u64 {
            tb.bucket.put(&layout::ready(StepKind::Delta, s), Bytes::from_static(b"junk")).await.unwrap();
        }
        // Refusals that hold (the default 30 s; the tests' default is none).
        let mut cfg = config(tb.dir.path().join("a"), trust.clone());
        cfg.refuse_for = Duration::from_secs(30);
        let mut a = Agent::new(tb.bucket.clone(), cfg).unwrap();
        let l0 = tb.faults.calls(FaultOp::List);
        let o = a.sync_once().await.unwrap();
        assert_eq!(o.step, 2, "{o:?}");
        assert_bits(&a, &want);
        assert_verified(&a, "cold start past 40 planted markers");
        assert_eq!(o.refused.len(), 40, "{:?}", o.refused);
        let lists = tb.faults.calls(FaultOp::List) - l0;
        assert!(lists <= 2, "one listing (anchors, deltas) for the whole sync: {lists} LIST calls");

        // Two steps behind: a listing again. Of the 90 planted markers only the 20 whose manifest
        // was missing are read again (a marker whose manifest does not match may have been
        // replaced); the 20 refused for their manifest and the 50 junk ones are not.
        t.publish();
        let want = t.publish();
        let g0 = tb.faults.calls(FaultOp::Get);
        let o = a.sync_once().await.unwrap();
        assert_eq!(o.step, 4, "{o:?}");
        assert_bits(&a, &want);
        let gets = tb.faults.calls(FaultOp::Get) - g0;
        assert!(gets < 20 + 20, "{gets} GETs: planted markers read again");
    }
}

// Found by review: a key under ready/ that the store refuses to serve (an object encrypted
// with a customer key or archived to a cold storage class on S3, a directory at the key of a
// file:// bucket: a permanent error, not a 404) failed every listing sync for good, and so did
// a marker naming a manifest the store refuses. Both are now passed over as not ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_marker_or_manifest_does_not_stop_syncs() {
    let tb = file_bucket();
    let (key, trust) = keys();
    let mut t = Trainer::new(&tb.bucket, &key, 100);
    let mut want = vec![];
    for _ in 0..3 {
        want = t.publish();
    }
    // 1000: the marker cannot be read. 1001: its manifest cannot be read.
    plant_delta_markers(&tb.bucket, 1000..1002, 2).await;
    tb.faults.inject(FaultOp::Get, &layout::ready(StepKind::Delta, 1000), usize::MAX, FaultKind::Permanent);
    tb.faults.inject(FaultOp::Get, "deltas/000000001001/", usize::MAX, FaultKind::Permanent);
    let mut a = agent(&tb, "a", &trust);
    let o = a.sync_once().await.unwrap();
    assert_eq!(o.step, 2, "{o:?}");
    assert_bits(&a, &want);
    assert_verified(&a, "cold start past unreadable keys");
    // A running agent goes on too, through a listing (two steps behind).
    t.publish();
    let want = t.publish();
    let o = a.sync_once().await.unwrap();
    assert_eq!(o.step, 4, "{o:?}");
    assert_bits(&a, &want);
    assert_verified(&a, "caught up past unreadable keys");
}

// Found by review: more keys under ready/ than a listing may return (1 M by default; 200
// here) failed every cold start, although the signed latest.json names the route, as it does
// for a key the store cannot parse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_keys_under_ready_do_not_stop_a_cold_start() {
    for tb in buckets("keys") {
        let (key, trust) = keys();
        let mut t = Trainer::new(&tb.bucket, &key, 4);
        let mut want = vec![];
        for _ in 0..7 {
            want = t.publish();
        }
        for i in 0..200 {
            tb.bucket.put(&format!("{}x{i:04}", layout::ready_prefix(StepKind::Delta)), Bytes::new()).await.unwrap();
        }
        let opts = driftless_store::StoreOptions::default().with_max_list_keys(200);
        let small = Bucket::from_store(tb.faults.clone(), tb.bucket.prefix(), &opts)
            .with_conditional_create(tb.bucket.supports_conditional_create());
        assert!(small.list(layout::ready_prefix(StepKind::Delta)).await.is_err(), "the listing fails");
        let mut b = Agent::new(small, config(tb.dir.path().join("b"), trust.clone())).unwrap();
        let o = b.sync_once().await.unwrap();
        assert_eq!((o.step, o.route, o.deltas), (6, SyncPath::Anchor, 2), "{o:?}");
        assert_bits(&b, &want);
        assert_verified(&b, "cold start past too many keys");
    }
}

// Found by review: a running agent repeated a listing the store refused (more keys than a
// listing holds) at every 10th poll, each one up to a million keys of LIST pages, although
// each sync then planned from the signed latest.json. The periodic listing now backs off,
// doubling its gap (10, 20, 40, ... polls, at most `MAX_LIST_GAP`), and steps still arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_the_store_refuses_is_not_repeated_every_tenth_poll() {
    for tb in buckets("list-gap") {
        let (key, trust) = keys();
        let mut t = Trainer::new(&tb.bucket, &key, 4);
        t.publish();
        for i in 0..250 {
            tb.bucket.put(&format!("{}x{i:04}", layout::ready_prefix(StepKind::Delta)), Bytes::new()).await.unwrap();
        }
        let opts = driftless_store::StoreOptions::default().with_max_list_keys(200);
        let small = Bucket::from_store(tb.faults.clone(), tb.bucket.prefix(), &opts)
            .with_conditional_create(tb.bucket.supports_conditional_create());
        let mut cfg = config(tb.dir.path().join("a"), trust.clone());
        (cfg.poll_min, cfg.poll_max) = (Duration::from_millis(1), Duration::from_millis(1));
        let a = Agent::new(small, cfg).unwrap();
        let metrics = a.metrics();
        let lists = || tb.faults.calls_to(FaultOp::List, layout::ready_prefix(StepKind::Delta).trim_end_matches('/'));
        let polls = || tb.faults.calls_to(FaultOp::Get, layout::LATEST);
        let (l0, p0) = (lists(), polls());
        let stop = Arc::new(tokio::sync::Notify::new());
        let run = {
            let stop = stop.clone();
            tokio::spawn(a.run(Arc::new(tokio::sync::Notify::new()), async move { stop.notified().await }))
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let mut want = vec![];
        while polls() - p0 < 400 {
            assert!(std::time::Instant::now() < deadline, "{}: only {} polls", tb.name, polls() - p0);
            if polls() - p0 > 200 && want.is_empty() {
                want = t.publish();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let last = t.step.unwrap();
        while metrics.step.load(SeqCst) != last {
            assert!(std::time::Instant::now() < deadline, "{}: step {last} never arrived", tb.name);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.notify_one();
        run.await.unwrap().unwrap();
        let (listings, polls) = (lists() - l0, polls() - p0);
        // Every 10th poll: 40 or more in 400 polls. Backing off: polls 1, 21, 61, 141, 301
        // (and the new step's sync, planned from latest.json, lists nothing).
        eprintln!("{}: {listings} listings of ready/deltas/ in {polls} polls", tb.name);
        assert!((2..=8).contains(&listings), "{}: {listings} listings in {polls} polls", tb.name);
        let ck = Checkpoint::open(tb.dir.path().join("a/current")).unwrap();
        for (name, data) in &want {
            assert!(ck.views().iter().any(|v| v.name == name && v.data == &data[..]), "{}: {name}", tb.name);
        }
    }
}

// More planted markers than one sync goes past (4,096): without a latest.json, that sync
// ends "not ready" (retryable: found by review, running out of rounds reported a missing
// manifest as a verification failure, exit 1), and the next one goes on past the rest while
// the refusals hold, to the real step. With one, more unknown markers than one plan reads
// (`MAX_MARKER_READS`) are not read at all: the plan comes from the signed latest.json (found
// in the thirty-seventh session: every cold start read every planted marker, up to the
// listing's million, one GET each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_planted_markers_than_a_sync_refuses_are_passed_by_the_next_sync() {
    for (tb, with_latest) in buckets("many-planted").into_iter().map(|tb| (tb, true)).chain([(file_bucket(), false)]) {
        let (key, trust) = keys();
        let mut t = Trainer::new(&tb.bucket, &key, 4);
        let want = t.publish();
        if !with_latest {
            tb.bucket.delete(layout::LATEST).await.unwrap();
        }
        let real: serde_json::Value =
            serde_json::from_slice(&tb.bucket.get(&layout::ready(StepKind::Anchor, 0)).await.unwrap()).unwrap();
        let n = driftless_agent::plan::MAX_UNUSABLE_ROUNDS as u64 + 50;
        assert!(n as usize > driftless_agent::plan::MAX_MARKER_READS);
        let planted = (100..100 + n).map(|s| {
            let m = serde_json::json!({"kind": "ready", "stream_id": real["stream_id"], "of": "anchor", "step": s,
            "manifest_sha256": "00".repeat(32), "payload_bytes": 10, "manifest": "g1-manifest.json"});
            (layout::ready(StepKind::Anchor, s), Bytes::from(m.to_string()))
        });
        plant_many(&tb.bucket, planted).await;
        let mut cfg = config(tb.dir.path().join("a"), trust.clone());
        cfg.refuse_for = Duration::from_secs(600);
        let mut a = Agent::new(tb.bucket.clone(), cfg).unwrap();
        let g0 = tb.faults.calls(FaultOp::Get);
        if with_latest {
            let o = a.sync_once().await.unwrap();
            assert_eq!((o.step, o.route), (0, SyncPath::Anchor), "{o:?}");
            let gets = tb.faults.calls(FaultOp::Get) - g0;
            assert!(gets < 100, "{gets} GETs: the planted markers were read");
            assert!(o.refused.is_empty(), "{:?}", o.refused);
        } else {
            let e = a.sync_once().await.unwrap_err();
            assert!(e.is_retryable(), "{e}");
            assert!(e.to_string().contains("not ready"), "{e}");
            assert!(a.state().is_none());
            let o = a.sync_once().await.unwrap();
            assert_eq!(o.step, 0, "{o:?}");
        }
        assert_bits(&a, &want);
        assert_verified(&a, "past the planted markers");
    }
}

// Found in the thirty-eighth session: past more unknown markers than one plan reads, the plan
// came from the signed latest.json's newest anchor and chain alone, so when that anchor was
// corrupt every sync refused it again and no agent fell back to an older anchor. A refused
// hinted anchor now widens the plan to the listing's newest markers (anchors first), in the
// same sync; the next sync reads on and catches up from the older anchor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_newest_anchor_behind_planted_markers_falls_back_to_an_older_one() {
    for tb in buckets("planted-corrupt-anchor") {
        let (key, trust) = keys();
        let mut t = Trainer::new(&tb.bucket, &key, 4);
        let want0 = t.publish();
        let mut want = vec![];
        for _ in 1..6 {
            want = t.publish();
        }
        // Anchor 4 corrupt: one byte of a shard object flipped (its size unchanged).
        let akey = tb
            .bucket
            .list(&layout::anchor_dir(4))
            .await
            .unwrap()
            .into_iter()
            .map(|o| o.key)
            .find(|k| !k.ends_with("manifest.json") && !k.contains("extra-"))
            .unwrap();
        let mut shard = tb.bucket.get(&akey).await.unwrap().to_vec();
        let mid = shard.len() / 2;
        shard[mid] ^= 0x55;
        tb.bucket.put(&akey, Bytes::from(shard)).await.unwrap();
        plant_junk_past_the_read_bound(&tb.bucket).await;
        let mut cfg = config(tb.dir.path().join("a"), trust.clone());
        cfg.refuse_for = Duration::from_secs(600);
        let mut a = Agent::new(tb.bucket.clone(), cfg).unwrap();
        let g0 = tb.faults.calls(FaultOp::Get);
        let o = a.sync_once().await.unwrap();
        // The newest markers read: anchor 0 and the newest planted ones; deltas 1-4 not yet.
        assert_eq!((o.step, o.route), (0, SyncPath::Anchor), "{o:?}");
        assert!(o.refused.iter().any(|r| r.step == 4), "{:?}", o.refused);
        assert_bits(&a, &want0);
        assert_verified(&a, "the older anchor");
        let gets = tb.faults.calls(FaultOp::Get) - g0;
        // (Fewer than the planted markers: the read is cut at its bound.)
        assert!(gets <= driftless_agent::plan::MAX_MARKER_READS as u64 + 100, "{}: {gets} GETs", tb.name);
        // The next sync reads the rest (all fit one plan) and reaches step 5 past the corrupt
        // anchor (step 4 is also published as a delta).
        let o = a.sync_once().await.unwrap();
        assert_eq!((o.step, o.deltas), (5, 5), "{o:?}");
        assert_bits(&a, &want);
        assert_verified(&a, "caught up from the older anchor");
    }
}

// Found in the thirty-eighth session: past more unknown markers than one plan reads, a replayed
// older latest.json (signed, so it verifies) planned an agent that had a newer step up to date
// for good, while newer steps were listed. A latest.json older than the agent's verified step
// now makes the plan read the listing's newest markers, and later plans read on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_latest_json_behind_planted_markers_does_not_hold_an_agent_back() {
    for tb in buckets("planted-replay") {
        let (key, trust) = keys();
        let mut t = Trainer::new(&tb.bucket, &key, 100);
        t.publish();
        t.publish();
        let old = tb.bucket.get(layout::LATEST).await.unwrap();
        t.publish();
        t.publish();
        let mut a = agent(&tb, "a", &trust);
        assert_eq!(a.sync_once().await.unwrap().step, 3);
        t.publish();
        let want = t.publish();
        tb.bucket.put(layout::LATEST, old).await.unwrap();
        plant_junk_past_the_read_bound(&tb.bucket).await;
        // The first sync reads the newest 4,096 unknown markers (planted), the second the rest.
        let mut step = 0;
        for _ in 0..2 {
            step = a.sync_once().await.unwrap().step;
            assert!(step >= 3, "{}: went back to step {step}", tb.name);
            assert_verified(&a, &tb.name);
        }
        assert_eq!(step, 5, "{}: held back by the replayed latest.json", tb.name);
        assert_bits(&a, &want);
    }
}

// Found by review: a latest.json that does not verify (or is deleted) made an up-to-date agent
// read it and list the bucket at every poll (116 listings in 6 s), against one conditional GET
// per poll and a listing every 10th. Its ETag is kept; a deleted one that stays deleted is
// "unchanged" too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_or_missing_latest_json_does_not_make_every_poll_list() {
    for tb in buckets("latest") {
        let (key, trust) = keys();
        let mut t = Trainer::new(&tb.bucket, &key, 100);
        t.publish();
        t.publish();
        let (metrics, stop, run) = running(&tb, &trust, Duration::from_millis(10));
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while metrics.step.load(SeqCst) != 1 {
            assert!(std::time::Instant::now() < deadline, "agent did not reach step 1");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Over-sized: refused before it is read, its ETag kept all the same (found by review:
        // it lost its ETag, and the agent read it and listed at every poll).
        let big = Bytes::from(vec![b' '; driftless_store::stream::MAX_MARKER_BYTES as usize + 1]);
        for (case, body) in [
            ("invalid", Some(Bytes::from_static(br#"{"payload":"x","signatures":[]}"#))),
            ("oversized", Some(big)),
            ("deleted", None),
        ] {
            match body {
                Some(b) => tb.bucket.put(layout::LATEST, b).await.unwrap(),
                None => tb.bucket.delete(layout::LATEST).await.unwrap(),
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            let (g0, l0) = (tb.faults.calls(FaultOp::Get), tb.faults.calls(FaultOp::List));
            tokio::time::sleep(Duration::from_secs(2)).await;
            let (gets, lists) = (tb.faults.calls(FaultOp::Get) - g0, tb.faults.calls(FaultOp::List) - l0);
            // About 100 polls in 2 s: a listing (2 LIST calls) every 10th, besides a GET or more per poll.
            assert!(gets > 20, "{case}: the agent stopped polling ({gets} GETs)");
            assert!(lists * 3 <= gets, "{case}: {lists} LIST calls for {gets} GETs: a listing at every poll");
        }
        stop.notify_one();
        run.await.unwrap().unwrap();
    }
}

// Found by review: a sync read latest.json again although the poll had just read it, twice
// when it did not verify or was deleted (once for the stream it names, once to plan), and
// once more for every step it refused: past 10 planted markers an up-to-date sync read it 11
// times. Now a sync reads it at most once (none when the poll loop read it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_reads_latest_json_at_most_once() {
    for tb in buckets("latest-once") {
        let (key, trust) = keys();
        let mut t = Trainer::new(&tb.bucket, &key, 100);
        t.publish();
        t.publish();
        let mut a = Agent::new(tb.bucket.clone(), config(tb.dir.path().join("a"), trust.clone())).unwrap();
        assert_eq!(a.sync_once().await.unwrap().step, 1);
        plant_delta_markers(&tb.bucket, 100..110, 1).await;
        let latest_gets = || tb.faults.calls_to(FaultOp::Get, layout::LATEST);
        // Up to date, a valid latest.json, ten planted steps refused in one sync.
        let g0 = latest_gets();
        let o = a.sync_once().await.unwrap();
        assert_eq!((o.step, o.refused.len()), (1, 10), "{o:?}");
        assert_eq!(latest_gets() - g0, 1, "latest.json read more than once in one sync");
        // One step behind, latest.json not verifying, then deleted: planned from the listing.
        for (case, body) in
            [("invalid", Some(Bytes::from_static(br#"{"payload":"x","signatures":[]}"#))), ("deleted", None)]
        {
            let want = t.publish();
            match body {
                Some(b) => tb.bucket.put(layout::LATEST, b).await.unwrap(),
                None => tb.bucket.delete(layout::LATEST).await.unwrap(),
            }
            let g0 = latest_gets();
            let o = a.sync_once().await.unwrap();
            assert_bits(&a, &want);
            assert_eq!(latest_gets() - g0, 1, "{case}: latest.json read more than once in one sync ({o:?})");
        }
    }
}

// Found by review: every build first rewrote `state.json` without the inactive step, before
// anything was read, so a planted marker, a forged manifest or a failed download cost the
// rollback step although its slot was never touched (the next step then rewrote the whole
// model instead of two sparse applies), and each planted marker cost a state rewrite. The
// state now changes only when the work slot is about to be written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_or_failed_step_keeps_the_rollback_step() {
    for tb in buckets("rollback") {
        let (key, trust) = keys();
        let mut t = Trainer::new(&tb.bucket, &key, 100);
        let dir = tb.dir.path().join("a");
        let mut cfg = config(&dir, trust.clone());
        cfg.refuse_for = Duration::from_secs(30);
        let mut a = Agent::new(tb.bucket.clone(), cfg).unwrap();
        for _ in 0..3 {
            t.publish();
            a.sync_once().await.unwrap();
        }
        let before = LocalState::load(&dir).unwrap().unwrap();
        assert_eq!((before.step, before.inactive.map(|h| h.step)), (2, Some(1)), "{}: the steady state", tb.name);
        let inode = || std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(dir.join("state.json")).unwrap());
        let (ino, rebuilds) = (inode(), counter(&a, |m| &m.slot_rebuilds));
        // 20 planted delta markers on the served step, naming manifests that are not there.
        plant_delta_markers(&tb.bucket, 1000..1020, 2).await;
        let o = a.sync_once().await.unwrap();
        assert_eq!((o.step, o.refused.len()), (2, 20), "{}: {o:?}", tb.name);
        assert_eq!(LocalState::load(&dir).unwrap().unwrap(), before, "{}", tb.name);
        assert_eq!(inode(), ino, "{}: state.json rewritten for refused steps", tb.name);
        // A real step whose segment fails to download: nothing written, the state kept.
        let want = t.publish();
        tb.faults.inject(FaultOp::Get, "deltas/000000000003/g1-seg-", usize::MAX, FaultKind::Transient);
        assert!(a.sync_once().await.is_err(), "{}", tb.name);
        assert_eq!(LocalState::load(&dir).unwrap().unwrap(), before, "{}", tb.name);
        assert_eq!(inode(), ino, "{}", tb.name);
        assert_verified(&a, &tb.name);
        // Back: the step is two sparse applies onto the kept slot, not a rebuild.
        tb.faults.clear();
        let o = a.sync_once().await.unwrap();
        assert_eq!((o.step, o.route, o.rebuilt), (3, SyncPath::Fast, false), "{}: {o:?}", tb.name);
        assert_bits(&a, &want);
        assert_eq!(counter(&a, |m| &m.slot_rebuilds), rebuilds, "{}", tb.name);
    }
}

// Found by review: an anchor route gave up the rollback slot (the verified inactive step) as
// soon as the anchor's manifest checked out, before any of its objects was looked at: a signed
// anchor whose shards had not arrived (a replicator that copies the marker first, a GC race)
// cost the slot at every try, and the next fast path a rebuild of the whole model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anchor_whose_objects_are_missing_keeps_the_rollback_slot() {
    let tb = file_bucket();
    let (key, trust) = keys();
    let mut t = Trainer::new(&tb.bucket, &key, 4);
    let dir = tb.dir.path().join("a");
    let mut a = Agent::new(tb.bucket.clone(), config(&dir, trust.clone())).unwrap();
    for _ in 0..3 {
        t.publish();
        a.sync_once().await.unwrap();
    }
    let before = LocalState::load(&dir).unwrap().unwrap();
    assert_eq!((before.step, before.inactive.map(|h| h.step)), (2, Some(1)), "the steady state");
    let other = dir.join("slots").join(before.active.other().name());
    let kept = slot_files(&other);
    t.publish();
    let want = t.publish();
    // Step 4's only route is its anchor (delta 3 is gone), whose objects are not there yet.
    tb.bucket.delete(&layout::ready(StepKind::Delta, 3)).await.unwrap();
    let mut held = vec![];
    for o in tb.bucket.list(&layout::anchor_dir(4)).await.unwrap() {
        if !o.key.ends_with("manifest.json") {
            held.push((o.key.clone(), tb.bucket.get(&o.key).await.unwrap()));
            tb.bucket.delete(&o.key).await.unwrap();
        }
    }
    assert!(!held.is_empty());
    let o = a.sync_once().await;
    assert!(o.as_ref().map_or(true, |o| o.step == 2), "{o:?}");
    assert_eq!(LocalState::load(&dir).unwrap().unwrap(), before, "the state, rollback slot included, kept");
    assert_eq!(slot_files(&other), kept, "the rollback slot's files kept");
    assert_verified(&a, "anchor objects missing");
    // They arrive: the anchor is taken, bit for bit.
    for (k, b) in held {
        tb.bucket.put(&k, b).await.unwrap();
    }
    let o = a.sync_once().await.unwrap();
    assert_eq!((o.step, o.route), (4, SyncPath::Anchor), "{o:?}");
    assert_bits(&a, &want);
}

// Found by review: refusals were dropped only when a step was used or fell below the oldest
// anchor, so markers planted at new step numbers and then removed grew the agent's refusals
// (its memory, and the work of every sync) without bound. A listing now drops the refusals
// of steps it no longer holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_of_steps_no_longer_listed_are_dropped() {
    let tb = file_bucket();
    let (key, trust) = keys();
    let mut t = Trainer::new(&tb.bucket, &key, 100);
    let mut cfg = config(tb.dir.path().join("a"), trust.clone());
    cfg.refuse_for = Duration::from_secs(600);
    let mut a = Agent::new(tb.bucket.clone(), cfg).unwrap();
    t.publish();
    a.sync_once().await.unwrap();
    for round in 0..4u64 {
        let planted = 10_000 + round * 1000..10_000 + round * 1000 + 50;
        plant_delta_markers(&tb.bucket, planted.clone(), 0).await;
        let o = a.sync_once().await.unwrap();
        assert_eq!(o.step, 0);
        assert_eq!(o.refused.len(), 50, "round {round}: only this round's planted steps: {:?}", o.refused.len());
        assert!(o.refused.iter().all(|r| planted.contains(&r.step)), "round {round}");
        for s in planted {
            tb.bucket.delete(&layout::ready(StepKind::Delta, s)).await.unwrap();
        }
    }
    let o = a.sync_once().await.unwrap();
    assert!(o.refused.is_empty(), "{} refusals of steps no longer in the bucket", o.refused.len());
    assert_verified(&a, "after planted markers came and went");
}

/// Found by review: a build that failed after writing the work slot (an anchor or a rebuild
/// that ran out of space on ext4) left its partly written files, so every later sync failed at
/// its first write and the agent never advanced. A failed build now removes the work slot
/// when nothing names it any more (released before the first write). Here the write is a
/// real pass over the work slot, refused at the end: a signed delta whose result root is wrong.
/// The served step is kept, the partial slot is gone, and the next genuine step rebuilds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_that_fails_after_writing_removes_its_partial_slot() {
    let tb = file_bucket();
    let (key, trust) = keys();
    let (mut t, mut a) = following(&tb, &key, &trust, 3).await;
    t.publish();
    assert_eq!(a.sync_once().await.unwrap().step, 3);
    let dir = tb.dir.path().join("a");
    let before = LocalState::load(&dir).unwrap().unwrap();
    let work = dir.join("slots").join(format!("{:?}", before.active.other()).to_lowercase());
    assert!(before.inactive.is_some() && work.is_dir(), "{before:?} {}", work.display());
    let want3 = snapshot(&t.chain);
    // Step 4 is published, its marker taken away; its delta comes back as step 1000 on base 3,
    // signed, with a result root that is not what it produces.
    let want4 = t.publish();
    let b = &tb.bucket;
    let reader = driftless_store::stream::StreamReader::new(b.clone(), trust.clone());
    let (mut m, _) = reader.delta(4).await.unwrap();
    let marker4 = b.get(&layout::ready(StepKind::Delta, 4)).await.unwrap();
    b.delete(&layout::ready(StepKind::Delta, 4)).await.unwrap();
    b.delete(layout::LATEST).await.unwrap();
    for s in &m.segments {
        let body = b.get(&layout::object(StepKind::Delta, 4, &s.object.object)).await.unwrap();
        b.put(&layout::object(StepKind::Delta, 1000, &s.object.object), body).await.unwrap();
    }
    (m.step, m.result_root) = (1000, driftless_format::Digest([9; 32]));
    put_signed_delta(b, &key, &m).await;
    let o = a.sync_once().await.unwrap();
    assert_eq!(o.step, 3, "{o:?}");
    assert!(o.refused.iter().any(|r| r.step == 1000), "{o:?}");
    assert_verified(&a, "after the refused step");
    assert_bits(&a, &want3);
    let after = LocalState::load(&dir).unwrap().unwrap();
    assert_eq!((after.step, after.active, after.inactive), (3, before.active, None));
    assert!(!work.exists(), "the refused build's partial slot was left at {}", work.display());
    // The genuine step 4: the work slot rebuilt from the served one in its pass.
    b.put(&layout::ready(StepKind::Delta, 4), marker4).await.unwrap();
    let o = a.sync_once().await.unwrap();
    assert_eq!((o.step, o.rebuilt), (4, true), "{o:?}");
    assert_bits(&a, &want4);
}

/// A server that opens a file of the work slot after the build started, while the step's
/// objects download (found in review: the slot was probed for readers only at the start of the
/// build, seconds before its first write). It is probed again right before that write: the
/// step is refused for now (retryable), the file is not written under the reader, the served
/// step is kept, and the step is built once the reader is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_opens_the_work_slot_during_the_download_is_not_written_under() {
    let tb = file_bucket();
    let (key, trust) = keys();
    let mut t = Trainer::new(&tb.bucket, &key, 100);
    let mut a = agent(&tb, "a", &trust);
    for _ in 0..3 {
        t.publish();
        a.sync_once().await.unwrap();
    }
    let dir = tb.dir.path().join("a");
    let st = LocalState::load(&dir).unwrap().unwrap();
    assert_eq!((st.step, st.inactive.map(|h| h.step)), (2, Some(1)), "the steady state: both slots hold a step");
    let work = dir.join("slots").join(st.active.other().name());
    let shard = std::fs::read_dir(&work)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .expect("a shard in the inactive slot");
    let before = std::fs::read(&shard).unwrap();
    let want = t.publish();
    // Every GET of step 3's objects (its manifest, its segment) takes 1.5 s; the reader opens
    // the shard 0.5 s in, after the build started and its first probe found the slot free.
    tb.faults.inject(FaultOp::Get, "deltas/000000000003/", usize::MAX, FaultKind::Slow(Duration::from_millis(1500)));
    let opener = {
        let shard = shard.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            std::fs::File::open(shard).unwrap()
        })
    };
    let r = a.sync_once().await;
    let reader = opener.join().unwrap();
    match &r {
        Err(e @ Error::SlotInUse { file }) => {
            assert_eq!(file, &shard);
            assert!(e.is_retryable(), "{e}");
        }
        other => panic!("the slot was written under its reader: {other:?}"),
    }
    assert_eq!(std::fs::read(&shard).unwrap(), before, "the file under the reader changed");
    assert_eq!(LocalState::load(&dir).unwrap().unwrap().step, 2);
    assert_verified(&a, "a reader in the work slot");
    drop(reader);
    tb.faults.clear();
    let o = a.sync_once().await.unwrap();
    assert_eq!(o.step, 3);
    assert_bits(&a, &want);
}

/// The bytes of every file of a slot, by name.
fn slot_files(dir: &std::path::Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap()))
        .collect()
}

/// Issue 12: after a cold start the inactive slot holds nothing, and the first step used to
/// rebuild it from the served slot on that step's path (1.0-2.0 s against 0.5 s for a fast
/// path at 1 GiB). A running agent now rebuilds it while idle: `state.json` names it as the
/// served step only once its files are durable and hash to that step, and the next step is a
/// fast path (one delta applied in place, no rebuild), bit for bit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_start_rebuilds_its_inactive_slot_while_idle() {
    for tb in buckets("idle-rebuild") {
        let (key, trust) = keys();
        let mut t = Trainer::new(&tb.bucket, &key, 100);
        t.publish();
        let mut want = t.publish();
        let dir = tb.dir.path().join("a");
        let (metrics, stop, run) = running(&tb, &trust, Duration::from_millis(40));
        let wait_for = |what: &str, f: &dyn Fn(&LocalState) -> bool| {
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            loop {
                if let Some(s) = LocalState::load(&dir).unwrap().filter(|s| f(s)) {
                    return s;
                }
                assert!(std::time::Instant::now() < deadline, "{}: {what}", tb.name);
                std::thread::sleep(Duration::from_millis(20));
            }
        };
        // The counter moves once `state.json` names the slot (after its rename and the fsync
        // of `DIR`): waited for first, so the file read next is the one that names it.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while counter_of(&metrics, |m| &m.idle_rebuilds) == 0 {
            assert!(std::time::Instant::now() < deadline, "{}: no idle rebuild", tb.name);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let st = tokio::task::block_in_place(|| wait_for("inactive slot named", &|s| s.inactive.is_some()));
        assert_eq!(st.step, 1, "{}", tb.name);
        assert_eq!(st.inactive, Some(st.held()), "{}: the inactive slot holds the served step", tb.name);
        assert_eq!(counter_of(&metrics, |m| &m.idle_rebuilds), 1, "{}", tb.name);
        let (served, other) =
            (dir.join("slots").join(st.active.name()), dir.join("slots").join(st.active.other().name()));
        assert_eq!(
            slot_files(&served),
            slot_files(&other),
            "{}: the rebuilt slot is the served one, byte for byte",
            tb.name
        );
        // The next steps are fast paths onto that slot: no rebuild on their path.
        for step in 2..4 {
            want = t.publish();
            tokio::task::block_in_place(|| wait_for("the next step", &|s| s.step == step));
        }
        stop.notify_one();
        run.await.unwrap().unwrap();
        assert_eq!(counter_of(&metrics, |m| &m.slot_rebuilds), 0, "{}: a step rebuilt the slot", tb.name);
        assert_eq!(counter_of(&metrics, |m| &m.idle_rebuilds), 1, "{}: rebuilt once", tb.name);
        let ck = Checkpoint::open(dir.join("current")).unwrap();
        assert_eq!(ck.views().len(), want.len());
        for (name, data) in &want {
            assert!(ck.views().iter().any(|v| v.name == name && v.data == &data[..]), "{}: {name}", tb.name);
        }
    }
}

fn counter_of(
    m: &driftless_agent::metrics::Metrics,
    f: impl Fn(&driftless_agent::metrics::Metrics) -> &AtomicU64,
) -> u64 {
    f(m).load(SeqCst)
}

/// A served slot whose files changed under the agent (a disk fault) is not copied into the
/// inactive slot as the served step: the idle rebuild is refused (not retryable), nothing
/// names the other slot, its partial files are removed, and the next sync re-verifies the
/// served slot, removes `current` and rebuilds the newest step from an anchor, bit for bit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_rebuild_never_copies_a_served_slot_that_changed() {
    let tb = file_bucket();
    let (t, mut a, st) = cold_started(&tb, 2).await;
    let want = snapshot(&t.chain);
    flip_first_weight_bit(&tb, &st);
    let e = a.prepare_inactive().await.unwrap_err();
    assert!(!e.is_retryable(), "{e}");
    // Known bad: no longer linked for a server that restarts now.
    assert!(
        std::fs::symlink_metadata(tb.dir.path().join("a/current")).is_err(),
        "current still names the damaged slot"
    );
    assert_eq!(a.state().unwrap().inactive, None);
    assert_eq!(LocalState::load(&tb.dir.path().join("a")).unwrap().unwrap().inactive, None, "state.json");
    assert!(!tb.dir.path().join("a/slots").join(st.active.other().name()).exists(), "partial slot removed");
    assert_eq!(counter(&a, |m| &m.verify_failures), 1);
    let o = a.sync_once().await.unwrap();
    assert_eq!((o.step, o.route), (1, SyncPath::Anchor));
    assert_bits(&a, &want);
    assert_verified(&a, "after the rebuild from an anchor");
    // A new served slot (the same step, from the anchor): the other slot is rebuilt again.
    assert_eq!(a.state().unwrap().inactive, None);
    assert!(a.prepare_inactive().await.unwrap());
    let st = a.state().unwrap().clone();
    assert_eq!(st.inactive, Some(st.held()));
}

/// A served slot that failed an idle rebuild's check but hashes to its step again (the fault
/// passed, or was repaired) is linked again by the next sync's re-verification: nothing is
/// downloaded again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_served_slot_that_verifies_again_is_linked_again() {
    let tb = file_bucket();
    let (t, mut a, st) = cold_started(&tb, 2).await;
    let want = snapshot(&t.chain);
    let path = flip_first_weight_bit(&tb, &st);
    a.prepare_inactive().await.unwrap_err();
    let current = tb.dir.path().join("a/current");
    assert!(std::fs::symlink_metadata(&current).is_err(), "current still names the damaged slot");
    flip_first_weight_bit(&tb, &st);
    let o = a.sync_once().await.unwrap();
    assert_eq!(o.step, 1);
    assert_eq!(o.route, SyncPath::UpToDate, "rebuilt what was on disk");
    assert_eq!(std::fs::read_link(&current).unwrap(), std::path::Path::new("slots").join(st.active.name()));
    assert_bits(&a, &want);
    assert_verified(&a, "re-verified");
    // (The failed rebuild is not tried again for the same served step.)
    assert!(!a.prepare_inactive().await.unwrap());
    assert!(path.exists());
}

/// Flips one bit of the first tensor's first byte in the served slot's first shard file (its
/// path returned); a second call flips it back.
fn flip_first_weight_bit(tb: &TestBucket, st: &LocalState) -> std::path::PathBuf {
    let slot = tb.dir.path().join("a/slots").join(st.active.name());
    let shard = Checkpoint::open(&slot).unwrap().layout().shards[0].file.clone();
    let path = slot.join(&shard);
    let mut bytes = std::fs::read(&path).unwrap();
    let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap());
    bytes[header as usize] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    path
}

/// An idle rebuild whose stop has come (the poll loop's stop: `latest.json` announced a new
/// step, whose own build rebuilds the slot) gives up: `Ok(false)`, nothing names the slot, not
/// counted, and it is tried again at a later idle time. (Where the pass looks at its stop, and
/// what fires it, are unit tests in `agent.rs`; a stop in the middle of a real pass was seen in
/// `speed_bench live` with `BENCH_GAP_MS=200`: README.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_rebuild_gives_way_to_a_new_step() {
    let tb = file_bucket();
    let (mut t, mut a, st) = cold_started(&tb, 1).await;
    let other = tb.dir.path().join("a/slots").join(st.active.other().name());
    assert!(!a.prepare_inactive_until(async {}).await.unwrap(), "stopped");
    assert_eq!(a.state().unwrap().inactive, None);
    assert_eq!(LocalState::load(&tb.dir.path().join("a")).unwrap().unwrap().inactive, None, "state.json");
    assert_eq!(counter(&a, |m| &m.idle_rebuilds), 0);
    // Tried again later, and then done.
    assert!(a.prepare_inactive().await.unwrap());
    assert_eq!(a.state().unwrap().inactive, Some(st.held()));
    assert_eq!(slot_files(&other), slot_files(&a.current_dir()));
    let want = t.publish();
    let o = a.sync_once().await.unwrap();
    assert_eq!((o.step, o.route, o.rebuilt), (1, SyncPath::Fast, false));
    assert_bits(&a, &want);
}

/// A rebuild that failed for a local reason (here the slot's path taken by a file it cannot
/// remove as a directory) is not tried again for the same served step, even once it could
/// succeed: a disk without room for two slots costs one try per step, not a model's worth of
/// writes at every poll. (A new served slot tries again: the end of
/// `an_idle_rebuild_never_copies_a_served_slot_that_changed`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_idle_rebuild_is_tried_once_per_step() {
    let tb = file_bucket();
    let (_t, mut a, st) = cold_started(&tb, 1).await;
    let other = tb.dir.path().join("a/slots").join(st.active.other().name());
    std::fs::write(&other, b"in the way").unwrap();
    assert!(a.prepare_inactive().await.is_err());
    assert_eq!(LocalState::load(&tb.dir.path().join("a")).unwrap().unwrap().inactive, None, "state.json");
    std::fs::remove_file(&other).unwrap();
    assert!(!a.prepare_inactive().await.unwrap(), "tried again at the same step");
    assert!(!other.exists());
    assert_eq!(counter(&a, |m| &m.idle_rebuilds), 0);
}

/// A trainer that published `n` steps (anchor at step 0) and agent "a" cold-started on the
/// last: its state, with nothing in the inactive slot.
async fn cold_started(tb: &TestBucket, n: u64) -> (Trainer, Agent, LocalState) {
    let (key, trust) = keys();
    let mut t = Trainer::new(&tb.bucket, &key, 100);
    for _ in 0..n {
        t.publish();
    }
    let mut a = agent(tb, "a", &trust);
    assert_eq!(a.sync_once().await.unwrap().route, SyncPath::Anchor);
    let st = a.state().unwrap().clone();
    assert_eq!(st.inactive, None);
    (t, a, st)
}

/// Agent "a" on `tb` under [`Agent::run`], polling every 10 ms up to `poll_max`: its metrics,
/// the notify that stops it, and its task.
#[allow(clippy::type_complexity)]
fn running(
    tb: &TestBucket,
    trust: &TrustSet,
    poll_max: Duration,
) -> (
    Arc<driftless_agent::metrics::Metrics>,
    Arc<tokio::sync::Notify>,
    tokio::task::JoinHandle<driftless_agent::Result<driftless_agent::Stopped>>,
) {
    let mut cfg = config(tb.dir.path().join("a"), trust.clone());
    cfg.poll_min = Duration::from_millis(10);
    cfg.poll_max = poll_max;
    let a = Agent::new(tb.bucket.clone(), cfg).unwrap();
    let metrics = a.metrics();
    let stop = Arc::new(tokio::sync::Notify::new());
    let s = stop.clone();
    let run = tokio::spawn(a.run(Arc::new(tokio::sync::Notify::new()), async move { s.notified().await }));
    (metrics, stop, run)
}
