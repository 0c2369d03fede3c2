//! Requests per step (issue 12): a follower one step behind reads the signed `latest.json`, the
//! manifests and the segments, and nothing else: no listing, no marker reads, whatever the
//! retention. Counted on a store wrapper that sees every call.

use std::sync::Arc;

use driftless_agent::{Agent, AgentConfig, SyncPath};
use driftless_format::gen::{ModelSpec, RlChain};
use driftless_format::{Keypair, TrustSet};
use driftless_publisher::PublisherBuilder;
use driftless_store::{Bucket, FaultOp, FaultyStore, StoreOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_one_step_behind_makes_constant_requests() {
    let counting = Arc::new(FaultyStore::new(Arc::new(driftless_store::object_store::memory::InMemory::new())));
    let bucket = Bucket::from_store(counting.clone(), "stream", &StoreOptions::default());
    let key = Keypair::from_seed([5; 32]);
    let trust = TrustSet::new().with_key(key.public());
    let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(1 << 20), 2e-6, 3);
    let b2 = bucket.clone();
    let mut p = tokio::task::spawn_blocking(move || {
        PublisherBuilder::new("unused").with_bucket(b2).with_key(key).with_anchor_every(1_000_000).build().unwrap()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::new(bucket.clone(), AgentConfig::new(dir.path(), trust)).unwrap();
    let mut per_step = vec![];
    for step in 0..25u64 {
        if step > 0 {
            chain.step();
        }
        let views: Vec<(driftless_format::TensorMeta, Vec<u8>)> =
            chain.views().iter().map(|v| (v.meta(), v.data.to_vec())).collect();
        p = tokio::task::spawn_blocking(move || {
            let vs: Vec<_> = views
                .iter()
                .map(|(m, d)| driftless_format::TensorView { name: &m.name, dtype: m.dtype, shape: &m.shape, data: d })
                .collect();
            p.publish(step, &vs).unwrap();
            p.flush().unwrap();
            p
        })
        .await
        .unwrap();
        let (g0, l0) = (counting.calls(FaultOp::Get), counting.calls(FaultOp::List));
        let o = agent.sync_once().await.unwrap();
        assert_eq!(o.step, step);
        let (gets, lists) = (counting.calls(FaultOp::Get) - g0, counting.calls(FaultOp::List) - l0);
        if step >= 2 {
            assert_eq!(o.route, SyncPath::Fast);
            per_step.push((gets, lists));
        }
    }
    eprintln!("requests per step (GET, LIST): {per_step:?}");
    // Segments per delta step (1 MiB model: one segment).
    for (i, &(gets, lists)) in per_step.iter().enumerate() {
        assert_eq!(lists, 0, "step {}: a follower one step behind lists nothing", i + 2);
        // latest.json, this delta's manifest, its one segment. The previous delta, which
        // brings the inactive slot forward, is the one this agent applied last: kept decoded
        // in memory, it costs no request (a new process reads its manifest again, and its
        // segments from the local cache).
        assert_eq!(gets, 3, "step {}: {gets} GETs", i + 2);
    }
    tokio::task::spawn_blocking(move || p.close().unwrap()).await.unwrap();
}

/// `latest.json` put again with the same bytes (a new ETag on the same content, as from a
/// backend that ignores `If-None-Match` or whose ETags change at every read) is not a change
/// for the watch that decides whether an up-to-date agent plans and lists (found by review:
/// every poll then listed the bucket). A new step still is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latest_json_put_again_unchanged_is_no_change() {
    use driftless_store::stream::{LatestWatch, StreamReader};
    let bucket = Bucket::from_store(
        Arc::new(driftless_store::object_store::memory::InMemory::new()),
        "s",
        &StoreOptions::default(),
    );
    let key = Keypair::from_seed([6; 32]);
    let trust = TrustSet::new().with_key(key.public());
    let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(64 << 10), 2e-6, 4);
    let b2 = bucket.clone();
    let mut p = tokio::task::spawn_blocking(move || {
        let mut p = PublisherBuilder::new("unused").with_bucket(b2).with_key(key).build().unwrap();
        p.publish(0, &chain.views()).unwrap();
        p.flush().unwrap();
        chain.step();
        (p, chain)
    })
    .await
    .unwrap();
    let reader = StreamReader::new(bucket.clone(), trust);
    let mut w = LatestWatch::default();
    assert!(w.poll(&reader).await.unwrap().changed, "the first poll");
    assert!(!w.poll(&reader).await.unwrap().changed, "not modified");
    let bytes = bucket.get(driftless_store::layout::LATEST).await.unwrap();
    bucket.put(driftless_store::layout::LATEST, bytes).await.unwrap();
    let polled = w.poll(&reader).await.unwrap();
    assert!(!polled.changed, "the same content under a new ETag");
    assert_eq!(polled.hint.map(|h| h.anchor), Some(Some(0)));
    p = tokio::task::spawn_blocking(move || {
        let (pb, chain) = &mut p;
        pb.publish(1, &chain.views()).unwrap();
        pb.flush().unwrap();
        p
    })
    .await
    .unwrap();
    assert!(w.poll(&reader).await.unwrap().changed, "a new step");
    tokio::task::spawn_blocking(move || p.0.close().unwrap()).await.unwrap();
}

/// A cold start HEADs each anchor object once: the agent checks every object at its signed
/// size before it gives up its rollback slot, and the stream does not HEAD them again (it
/// did, one more HEAD per object).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_start_heads_each_anchor_object_once() {
    let counting = Arc::new(FaultyStore::new(Arc::new(driftless_store::object_store::memory::InMemory::new())));
    let bucket = Bucket::from_store(counting.clone(), "stream", &StoreOptions::default());
    let key = Keypair::from_seed([7; 32]);
    let trust = TrustSet::new().with_key(key.public());
    let chain = RlChain::new(&ModelSpec::with_bf16_bytes(1 << 20), 2e-6, 5);
    let b2 = bucket.clone();
    tokio::task::spawn_blocking(move || {
        let mut p = PublisherBuilder::new("unused")
            .with_bucket(b2)
            .with_key(key)
            .with_max_shard_bytes(256 << 10)
            .with_extra_files(vec![("config.json".into(), b"{}".to_vec())])
            .build()
            .unwrap();
        p.publish(0, &chain.views()).unwrap();
        p.close().unwrap();
    })
    .await
    .unwrap();
    let objects =
        bucket.list("anchors/").await.unwrap().iter().filter(|o| !o.key.ends_with("manifest.json")).count() as u64;
    assert!(objects >= 4, "{objects} objects: the anchor is split into shards, plus its file");
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::new(bucket.clone(), AgentConfig::new(dir.path(), trust)).unwrap();
    let h0 = counting.heads();
    let o = agent.sync_once().await.unwrap();
    assert_eq!((o.step, o.route), (0, SyncPath::Anchor));
    assert_eq!(counting.heads() - h0, objects, "one HEAD per anchor object");
}
