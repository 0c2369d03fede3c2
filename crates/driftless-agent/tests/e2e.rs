//! Publisher -> bucket -> agents, end to end, on `file://` and (when the CI starts it) on
//! SeaweedFS over S3. Weights are compared as bytes, never as floats.

use std::time::Duration;

use driftless_agent::{Agent, AgentConfig, LocalState, SyncPath};
use driftless_format::gen::{ModelSpec, RlChain};
use driftless_format::{Checkpoint, DType, Keypair, TensorView, TrustSet};
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

/// One step's weights as the trainer handed them over: (name, shape, bytes).
type StepWeights = Vec<(String, Vec<u64>, Vec<u8>)>;

/// The agent's checkpoint holds exactly these tensors (names, shapes, bytes), the extra file
/// shipped with the anchor, and the root it recorded.
fn assert_step(agent: &Agent, want: &StepWeights, ctx: &str) {
    let ck = Checkpoint::open(agent.current_dir()).unwrap();
    let got = ck.views();
    let mut names: Vec<&str> = got.iter().map(|g| g.name).collect();
    names.sort();
    let mut want_names: Vec<&str> = want.iter().map(|w| w.0.as_str()).collect();
    want_names.sort();
    assert_eq!(names, want_names, "{ctx}: tensor set");
    for (n, shape, data) in want {
        let g = got.iter().find(|g| g.name == n).unwrap();
        assert_eq!(g.shape, shape.as_slice(), "{ctx}: shape of {n}");
        assert!(g.data == data.as_slice(), "{ctx}: bytes of {n}");
    }
    assert_eq!(driftless_format::weights_root(&got).1, agent.state().unwrap().root, "{ctx}: root");
    let cfg = std::fs::read(agent.current_dir().join("config.json")).expect("config.json carried over");
    assert_eq!(cfg, b"{\"model_type\": \"test\"}", "{ctx}");
}

/// Steps that add, remove and reshape tensors take the rewrite route: from the served slot
/// when the work slot is not built yet, from the work slot when it is brought forward over a
/// layout change, for an agent on every step and for agents that skip steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layout_changes_reach_the_agent_bit_for_bit() {
    for (url, bucket, dir) in buckets() {
        let key = Keypair::from_seed([8; 32]);
        let trust = TrustSet::new().with_key(key.public());
        let (b2, k2) = (bucket.clone(), key.clone());
        let (tx, mut rx) = tokio::sync::mpsc::channel::<(u64, StepWeights)>(64);
        let (ack_tx, ack_rx) = std::sync::mpsc::channel::<()>();
        let steps = 9u64;
        let publisher = std::thread::spawn(move || {
            let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(1 << 20), 1e-5, 5);
            let mut p = PublisherBuilder::new("unused")
                .with_bucket(b2)
                .with_key(k2)
                .with_anchor_every(1000)
                .with_anchor_chain_fraction(1e9)
                .with_extra_files(vec![("config.json".into(), b"{\"model_type\": \"test\"}".to_vec())])
                .build()
                .unwrap();
            let new: Vec<u8> = (0..2048u32).map(|i| (i * 7 + 3) as u8).collect();
            for step in 0..steps {
                if step > 0 {
                    chain.step();
                }
                let mut w: StepWeights =
                    chain.views().iter().map(|v| (v.name.to_string(), v.shape.to_vec(), v.data.to_vec())).collect();
                // 2: a tensor is added; 3: it changes a little; 4: removed; 5: back with
                // another shape; 6-7: same set; 8: the first tensor is reshaped.
                match step {
                    2 => w.push(("zz.new".into(), vec![1024], new.clone())),
                    3 => w.push(("zz.new".into(), vec![1024], new.iter().map(|b| b ^ 1).collect())),
                    5..=8 => w.push(("zz.new".into(), vec![32, 32], new.clone())),
                    _ => {}
                }
                if step == 8 {
                    let n = w[0].2.len() as u64 / 2;
                    w[0].1 = vec![n];
                }
                let views: Vec<TensorView<'_>> =
                    w.iter().map(|(n, s, d)| TensorView::new(n, DType::BF16, s, d).unwrap()).collect();
                p.publish(step, &views).unwrap();
                p.flush().unwrap();
                tx.blocking_send((step, w)).unwrap();
                ack_rx.recv().unwrap();
            }
            p.close().unwrap();
        });
        let mk =
            |name: &str| Agent::new(bucket.clone(), AgentConfig::new(dir.path().join(name), trust.clone())).unwrap();
        // a: every step; b: every other step; c: step 1, then the end.
        let (mut a, mut b, mut c) = (mk("a"), mk("b"), mk("c"));
        let mut last = None;
        while let Some((step, want)) = rx.recv().await {
            let o = a.sync_once().await.unwrap();
            assert_eq!(o.step, step, "{url}: a");
            assert_step(&a, &want, &format!("{url}: a at step {step} ({:?})", o.route));
            if step % 2 == 1 {
                let o = b.sync_once().await.unwrap();
                assert_step(&b, &want, &format!("{url}: b at step {step} ({:?})", o.route));
            }
            if step == 1 {
                c.sync_once().await.unwrap();
            }
            last = Some(want);
            ack_tx.send(()).unwrap();
        }
        publisher.join().unwrap();
        // a rebuilds its work slot from the served one after the cold start, and each time
        // the step it must bring that slot over changed the layout (steps 2, 4 and 5), never
        // rewriting it to a step the served slot already holds.
        let rebuilds = a.metrics().slot_rebuilds.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(rebuilds, 4, "{url}: slot rebuilds of a");
        let want = last.unwrap();
        for (n, ag) in [("b", &mut b), ("c", &mut c)] {
            let o = ag.sync_once().await.unwrap();
            assert_eq!(o.step, steps - 1, "{url}: {n}");
            assert_step(ag, &want, &format!("{url}: {n} at the end ({:?})", o.route));
        }
        // Served slots are the agent's only two directories besides its state: no frame left.
        let slots: Vec<String> = std::fs::read_dir(dir.path().join("a").join("slots"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        assert!(slots.iter().all(|s| !s.ends_with(".new")), "{url}: leftover {slots:?}");
    }
}

/// A layout change that grows the model by more than a reader holds as a delta (a quarter,
/// plus 64 MiB: here a 72 MiB tensor added to a 256 KiB model) is published as a delta and,
/// at once, as an anchor of the same step; an agent refuses the delta from its manifest and
/// reaches the step through the anchor, bit for bit, then follows the next step's delta.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layout_change_past_what_readers_hold_as_a_delta_comes_with_an_anchor() {
    for (url, bucket, dir) in buckets() {
        let key = Keypair::from_seed([8; 32]);
        let trust = TrustSet::new().with_key(key.public());
        let (b2, k2) = (bucket.clone(), key.clone());
        let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(256 << 10), 1e-5, 5);
        let mut p = tokio::task::block_in_place(|| {
            PublisherBuilder::new("unused")
                .with_bucket(b2)
                .with_key(k2)
                .with_anchor_every(1000)
                .with_extra_files(vec![("config.json".into(), b"{\"model_type\": \"test\"}".to_vec())])
                .build()
                .unwrap()
        });
        let big: Vec<u8> = (0..72u32 << 20).map(|i| (i.wrapping_mul(7) >> 9) as u8).collect();
        let mut agent = Agent::new(bucket.clone(), AgentConfig::new(dir.path().join("a"), trust.clone())).unwrap();
        for step in 0..4u64 {
            if step > 0 {
                chain.step();
            }
            let mut w: StepWeights =
                chain.views().iter().map(|v| (v.name.to_string(), v.shape.to_vec(), v.data.to_vec())).collect();
            if step >= 2 {
                w.push(("zz.big".into(), vec![36 << 20], big.clone()));
            }
            let views: Vec<TensorView<'_>> =
                w.iter().map(|(n, s, d)| TensorView::new(n, DType::BF16, s, d).unwrap()).collect();
            let r = tokio::task::block_in_place(|| {
                let r = p.publish(step, &views).unwrap();
                p.flush().unwrap();
                r
            });
            assert_eq!(
                r.outcome == driftless_publisher::Outcome::DeltaAndAnchor,
                step == 2,
                "{url}: step {step}: {:?}",
                r.outcome
            );
            let o = agent.sync_once().await.unwrap();
            let route = match step {
                0 | 2 => SyncPath::Anchor,
                _ => SyncPath::Fast,
            };
            assert_eq!((o.step, o.route), (step, route), "{url}: {o:?}");
            assert_step(&agent, &w, &format!("{url}: step {step}"));
        }
        tokio::task::block_in_place(|| p.close().unwrap());
    }
}

/// A continuous agent (one `Agent`, many syncs) at step 4 of one run; the prefix is emptied
/// and a new run (a new stream) publishes steps 0-2 there. Found by review: the agent read the
/// stream id once, so it never followed the new run and reported the old run's step 4 as up
/// to date. Now the new run's signed latest.json makes it read stream.json again, and it loads
/// the new run's step 2 from its anchor, bit for bit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_agent_follows_a_new_run_in_its_prefix() {
    let d = tempfile::tempdir().unwrap();
    let url = format!("file://{}", d.path().join("bucket").display());
    let key = Keypair::from_seed([9; 32]);
    let trust = TrustSet::new().with_key(key.public());
    let publish = |seed: u64, steps: u64| {
        let url = url.clone();
        let key = Keypair::from_seed([9; 32]);
        tokio::task::spawn_blocking(move || {
            let b = Bucket::open(&url, &StoreOptions::default()).unwrap();
            let mut p = PublisherBuilder::new("x").with_bucket(b).with_key(key).with_new_stream(true).build().unwrap();
            let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(1 << 20), 1e-5, seed);
            for step in 0..=steps {
                if step > 0 {
                    chain.step();
                }
                p.publish(step, &chain.views()).unwrap();
            }
            p.close().unwrap();
            chain
        })
    };
    let old = publish(1, 4).await.unwrap();
    let bucket = Bucket::open(&url, &StoreOptions::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::new(bucket, AgentConfig::new(dir.path(), trust)).unwrap();
    assert_eq!(agent.sync_once().await.unwrap().step, 4);
    assert_same(&agent, &old);
    std::fs::rename(d.path().join("bucket"), d.path().join("old-run")).unwrap();
    // (Created at a later millisecond than the old run.)
    std::thread::sleep(Duration::from_millis(5));
    let new = publish(2, 2).await.unwrap();
    let o = agent.sync_once().await.unwrap();
    assert_eq!((o.step, o.route), (2, SyncPath::Anchor));
    assert_same(&agent, &new);
    // The old run put back in the prefix (its signed stream.json and objects, replayed): not
    // followed, by the running agent nor by one restarted on its directory (found by review:
    // agents went back to the older run's weights). The new run's step 2 is kept and served.
    std::fs::remove_dir_all(d.path().join("bucket")).unwrap();
    std::fs::rename(d.path().join("old-run"), d.path().join("bucket")).unwrap();
    let before = LocalState::load(dir.path()).unwrap().unwrap();
    assert!(before.stream_created_ms.is_some(), "{before:?}");
    for restarted in [false, true] {
        if restarted {
            drop(agent);
            let bucket = Bucket::open(&url, &StoreOptions::default()).unwrap();
            let trust = TrustSet::new().with_key(key.public());
            agent = Agent::new(bucket, AgentConfig::new(dir.path(), trust)).unwrap();
        }
        let e = agent.sync_once().await.unwrap_err();
        assert!(e.to_string().contains("an older run is not followed"), "restarted {restarted}: {e}");
        assert!(e.is_integrity() && !e.is_retryable(), "{e}");
        assert_eq!(LocalState::load(dir.path()).unwrap().unwrap(), before);
        assert_same(&agent, &new);
    }
}
