//! Publisher -> bucket -> agents, end to end, on `file://` and (when the CI starts it) on
//! SeaweedFS over S3. Weights are compared as bytes, never as floats.

use std::time::Duration;

use driftless_agent::{Agent, AgentConfig, SyncPath};
use driftless_format::gen::{ModelSpec, RlChain};
use driftless_format::{Checkpoint, Keypair, TrustSet};
use driftless_publisher::PublisherBuilder;
use driftless_store::{Bucket, StoreOptions};

fn buckets() -> Vec<(String, Bucket, tempfile::TempDir)> {
    let mut v = vec![];
    let d = tempfile::tempdir().unwrap();
    let url = format!("file://{}", d.path().join("bucket").display());
    v.push((url.clone(), Bucket::open(&url, &StoreOptions::default()).unwrap(), d));
    match std::env::var("DRIFTLESS_TEST_S3_SEAWEED") {
        Ok(spec) => {
            let mut it = spec.split_whitespace();
            let (endpoint, bucket) = (it.next().unwrap().to_string(), it.next().unwrap().to_string());
            let url = format!("s3://{bucket}/e2e-{:016x}", rand_u64());
            let opts = StoreOptions::default()
                .with_endpoint(endpoint)
                .with_allow_http(true)
                .with_region("us-east-1")
                .with_max_retries(2);
            v.push((url.clone(), Bucket::open(&url, &opts).unwrap(), tempfile::tempdir().unwrap()));
        }
        Err(_) if std::env::var("DRIFTLESS_REQUIRE_SERVERS").as_deref() == Ok("1") => {
            panic!("DRIFTLESS_TEST_S3_SEAWEED not set")
        }
        Err(_) => {}
    }
    v
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
    h.finish()
}

/// The agent's checkpoint holds exactly the trainer's bytes.
fn assert_same(agent: &Agent, chain: &RlChain) {
    let ck = Checkpoint::open(agent.current_dir()).unwrap();
    let got = ck.views();
    let want = chain.views();
    assert_eq!(got.len(), want.len());
    for w in &want {
        let g = got.iter().find(|g| g.name == w.name).expect("tensor present");
        assert!(g.data == w.data, "tensor {} differs", w.name);
    }
    let (_, root) = driftless_format::weights_root(&got);
    assert_eq!(root, agent.state().unwrap().root);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_agents_follow_fifty_steps() {
    for (url, bucket, dir) in buckets() {
        let key = Keypair::from_seed([7; 32]);
        let trust = TrustSet::new().with_key(key.public());
        let chain_model = ModelSpec::with_bf16_bytes(2 << 20);
        let (b2, k2) = (bucket.clone(), key.clone());
        // Publisher on a blocking thread (it owns a runtime).
        let (tx, mut rx) = tokio::sync::mpsc::channel::<(u64, Vec<u8>)>(64);
        // Lock-step: the publisher waits until the agents have looked at each step.
        let (ack_tx, ack_rx) = std::sync::mpsc::channel::<()>();
        let publisher = std::thread::spawn(move || {
            let mut chain = RlChain::new(&chain_model, 1e-6, 3);
            let mut p = PublisherBuilder::new("unused")
                .with_bucket(b2)
                .with_key(k2)
                .with_anchor_every(10)
                .with_queue_depth(64)
                .build()
                .unwrap();
            for step in 0..50u64 {
                if step > 0 {
                    chain.step();
                }
                p.publish(step, &chain.views()).unwrap();
                p.flush().unwrap();
                tx.blocking_send((step, vec![])).unwrap();
                ack_rx.recv().unwrap();
            }
            p.close().unwrap();
            chain
        });
        let mk =
            |name: &str| Agent::new(bucket.clone(), AgentConfig::new(dir.path().join(name), trust.clone())).unwrap();
        let mut a = mk("a");
        let mut b = mk("b");
        let mut c = mk("c");
        let mut paths = vec![];
        while let Some((step, _)) = rx.recv().await {
            let o = a.sync_once().await.unwrap();
            assert_eq!(o.step, step, "{url}: agent a follows every step");
            paths.push(o.route);
            if step == 25 {
                let o = b.sync_once().await.unwrap();
                assert_eq!(o.route, SyncPath::Anchor, "cold start goes through an anchor");
            }
            if step == 12 {
                c.sync_once().await.unwrap();
            }
            ack_tx.send(()).unwrap();
        }
        let chain = publisher.join().unwrap();
        assert!(
            paths.iter().filter(|p| **p == SyncPath::Fast).count() >= 45,
            "{url}: steady state is the fast path: {paths:?}"
        );
        assert_same(&a, &chain);
        let ob = b.sync_once().await.unwrap();
        assert_eq!(ob.step, 49);
        assert_same(&b, &chain);
        // c paused at 12: anchors at 40 are cheaper than 37 deltas only if deltas are big; either
        // way it must land on 49 bit-exact.
        let oc = c.sync_once().await.unwrap();
        assert_eq!(oc.step, 49);
        assert!(matches!(oc.route, SyncPath::Catchup | SyncPath::Anchor));
        assert_same(&c, &chain);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_and_forged_objects_never_reach_the_checkpoint() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("bucket");
    let url = format!("file://{}", root.display());
    let bucket = Bucket::open(&url, &StoreOptions::default()).unwrap();
    let key = Keypair::from_seed([1; 32]);
    let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(1 << 20), 2e-6, 5);
    let (b2, k2) = (bucket.clone(), key.clone());
    let mut p = tokio::task::spawn_blocking(move || {
        PublisherBuilder::new("x").with_bucket(b2).with_key(k2).with_anchor_every(100).build().unwrap()
    })
    .await
    .unwrap();
    let views = chain.views().iter().map(|v| (v.meta(), v.data.to_vec())).collect::<Vec<_>>();
    let _ = views;
    p = tokio::task::block_in_place(|| {
        p.publish(0, &chain.views()).unwrap();
        p.flush().unwrap();
        p
    });
    let trust = TrustSet::new().with_key(key.public());
    let mut cfg = AgentConfig::new(d.path().join("a"), trust.clone());
    cfg.refuse_for = Duration::ZERO;
    let mut a = Agent::new(bucket.clone(), cfg).unwrap();
    assert_eq!(a.sync_once().await.unwrap().step, 0);
    chain.step();
    tokio::task::block_in_place(|| {
        p.publish(1, &chain.views()).unwrap();
        p.flush().unwrap();
    });
    // Flip one byte of the segment in the bucket.
    let seg = root.join("deltas/000000000001/g1-seg-00000.dls");
    let mut b = std::fs::read(&seg).unwrap();
    let n = b.len();
    b[n / 2] ^= 0x40;
    std::fs::write(&seg, &b).unwrap();
    let before = a.state().cloned();
    // Regression (issue 9.1): a corrupt segment used to discard the verified weights and leave
    // an empty directory. The step is refused; step 0 stays, verified, under `current`.
    let o = a.sync_once().await.unwrap();
    assert_eq!(o.step, 0, "a corrupt segment must not be applied");
    assert_eq!(o.refused.iter().map(|r| r.step).collect::<Vec<_>>(), vec![1], "{o:?}");
    assert_eq!(a.state().cloned(), before);
    let (_, got) = driftless_format::weights_root(&Checkpoint::open(a.current_dir()).unwrap().views());
    assert_eq!(Some(got), before.map(|s| s.root));
    assert!(a.metrics().verify_failures.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    // An agent trusting another key refuses the stream entirely.
    let other = TrustSet::new().with_key(Keypair::from_seed([2; 32]).public());
    let mut x = Agent::new(bucket.clone(), AgentConfig::new(d.path().join("x"), other)).unwrap();
    let e = x.sync_once().await.unwrap_err();
    // Forged, not corrupt: a verification failure, not worth retrying.
    assert!(e.is_integrity() && !e.is_retryable(), "{e}");
    assert!(x.state().is_none());
    // Repair the object (as a re-upload would): the agent recovers by itself.
    b[n / 2] ^= 0x40;
    std::fs::write(&seg, &b).unwrap();
    let o = a.sync_once().await.unwrap();
    assert_eq!(o.step, 1);
    assert_same(&a, &chain);
    tokio::task::block_in_place(|| p.close().unwrap());
    let _ = Duration::from_secs(0);
}
