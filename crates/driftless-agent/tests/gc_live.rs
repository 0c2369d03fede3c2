//! Garbage collection under live agents (issue 5's concurrency test, issue 4's "objects deleted
//! by the garbage collector while the agent reads them"): a publisher publishing with an anchor
//! every 5 steps, `driftless_gc::run` in a loop keeping 3 deltas, 1 anchor and no grace, and
//! agents syncing in a loop, one of them starting cold in the middle. The agents may fail only
//! with retryable errors, never on unverified weights, and all end on the last step bit for bit.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use driftless_agent::Agent;
use driftless_format::gen::{ModelSpec, RlChain};
use driftless_format::{Keypair, TrustSet};
use driftless_gc::GcPolicy;
use driftless_publisher::PublisherBuilder;

const STEPS: u64 = 40;

#[derive(Debug, Default)]
struct Tally {
    ok: u64,
    retryable: u64,
    steps_seen: Vec<u64>,
}

/// Syncs until `done`, checking the invariant after every call.
async fn follow(mut agent: Agent, name: String, done: Arc<AtomicBool>) -> (Agent, Tally) {
    let mut t = Tally::default();
    while !done.load(SeqCst) {
        match agent.sync_once().await {
            Ok(o) => {
                t.ok += 1;
                // Never backwards.
                assert!(
                    t.steps_seen.last().is_none_or(|&l| o.step >= l),
                    "{name}: went back from {:?} to {}",
                    t.steps_seen.last(),
                    o.step
                );
                t.steps_seen.push(o.step);
                // GC deleting what a sync was reading: the step is planned around for now.
                for r in &o.refused {
                    assert!(r.fault.is_missing(), "{name}: GC must only make objects missing, got {r:?}");
                    t.retryable += 1;
                }
            }
            Err(e) => {
                assert!(
                    e.is_retryable() && !e.is_integrity() && !e.is_refused(),
                    "{name}: GC must only cause retryable errors, got {e}"
                );
                t.retryable += 1;
            }
        }
        assert_verified(&agent, &name);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (agent, t)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gc_under_live_agents() {
    let backends = buckets("gc-live").len();
    for i in 0..backends {
        // Whether GC deletes something an agent is about to read depends on timing; a run
        // where it did not happen proves nothing, so such a run is repeated (fresh bucket) up
        // to 4 times, and the test fails if it never happens.
        let mut raced = 0;
        for attempt in 0..4 {
            let tb = buckets("gc-live").swap_remove(i);
            raced = scenario(tb, attempt).await;
            if raced > 0 {
                break;
            }
        }
        assert!(
            raced > 0,
            "backend {i}: the GC never deleted anything an agent was reading in 4 runs; the test proves nothing"
        );
    }
}

/// One run; returns how many agent syncs failed because GC removed what they were reading.
async fn scenario(tb: TestBucket, attempt: u64) -> u64 {
    {
        let key = Keypair::from_seed([9; 32]);
        let trust = TrustSet::new().with_key(key.public());
        let published = Arc::new(AtomicU64::new(u64::MAX));
        let done = Arc::new(AtomicBool::new(false));
        let publisher = {
            let (b, key, published) = (tb.bucket.clone(), key.clone(), published.clone());
            std::thread::spawn(move || {
                let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(256 << 10), 2e-6, 4);
                let mut p =
                    PublisherBuilder::new("unused").with_bucket(b).with_key(key).with_anchor_every(5).build().unwrap();
                for step in 0..STEPS {
                    if step > 0 {
                        chain.step();
                    }
                    p.publish(step, &chain.views()).unwrap();
                    p.flush().unwrap();
                    published.store(step, SeqCst);
                    // Later attempts publish faster, so agents fall further behind the GC.
                    std::thread::sleep(Duration::from_millis(60 / (attempt + 1)));
                }
                p.close().unwrap();
                snapshot(&chain)
            })
        };
        // Wait for the first anchor.
        while published.load(SeqCst) == u64::MAX {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let gc = {
            let (b, done) = (tb.bucket.clone(), done.clone());
            tokio::spawn(async move {
                let policy = GcPolicy::new().with_keep_deltas(3).with_keep_anchors(1).with_grace(Duration::ZERO);
                let (mut runs, mut deleted) = (0u64, 0usize);
                while !done.load(SeqCst) {
                    let r = driftless_gc::run(&b, &policy, false).await.unwrap();
                    deleted += r.deleted_steps;
                    runs += 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                (runs, deleted)
            })
        };
        // The agents read through a slow link (every call delayed), so that the GC deletes what
        // they are reading: an agent that falls 3 deltas or 1 anchor behind loses its route.
        let slow = Arc::new(
            driftless_store::FaultyStore::new(tb.faults.inner().clone())
                .delay(Duration::from_millis(15 * (attempt + 1))),
        );
        let agent_bucket = driftless_store::Bucket::from_store(slow, tb.bucket.prefix(), tb.bucket.options())
            .with_conditional_create(tb.bucket.supports_conditional_create());
        let mk = |n: &str| Agent::new(agent_bucket.clone(), config(tb.dir.path().join(n), trust.clone())).unwrap();
        let mut tasks = vec![];
        for n in ["a", "b"] {
            tasks.push(tokio::spawn(follow(mk(n), format!("{}/{n}", tb.name), done.clone())));
        }
        // The cold starter joins in the middle.
        while published.load(SeqCst) < STEPS / 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tasks.push(tokio::spawn(follow(mk("cold"), format!("{}/cold", tb.name), done.clone())));
        let want = tokio::task::spawn_blocking(move || publisher.join().unwrap()).await.unwrap();
        // Let them all run against the final bucket (and the GC) for a moment.
        tokio::time::sleep(Duration::from_millis(500)).await;
        done.store(true, SeqCst);
        let (runs, deleted) = gc.await.unwrap();
        assert!(
            runs >= 3 && deleted > 0,
            "{}: the GC must actually have run and deleted ({runs} runs, {deleted} steps)",
            tb.name
        );
        let mut raced = 0;
        for t in tasks {
            let (mut agent, tally) = t.await.unwrap();
            raced += tally.retryable + agent.metrics().refusals.load(SeqCst);
            // Whatever happened, the newest step is reachable: the agent lands on it.
            let mut last = None;
            // Bounded: each sync is bounded; on a loaded machine a few may still race the
            // last GC deletions, so allow a short settling period.
            for _ in 0..60 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                match agent.sync_once().await {
                    Ok(o) if o.step == STEPS - 1 => {
                        last = Some(o);
                        break;
                    }
                    Ok(o) => eprintln!("{}: not yet: {o:?}", tb.name),
                    Err(e) => {
                        eprintln!("{}: not yet: {e}", tb.name);
                        assert!(e.is_retryable(), "{e}")
                    }
                }
            }
            let o = last.unwrap_or_else(|| panic!("{}: agent never reached step {}: {tally:?}", tb.name, STEPS - 1));
            assert_eq!(o.step, STEPS - 1);
            assert_bits(&agent, &want);
            let m = agent.metrics();
            assert_eq!(m.verify_failures.load(SeqCst), 0, "{}: GC is not corruption", tb.name);
            assert!(tally.ok > 0, "{}: {tally:?}", tb.name);
            eprintln!("{}: {tally:?} anchors={}", tb.name, m.anchor_downloads.load(SeqCst));
        }
        eprintln!("{} attempt {attempt}: {raced} syncs raced the GC", tb.name);
        raced
    }
}
