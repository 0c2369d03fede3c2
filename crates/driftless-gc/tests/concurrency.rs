//! Two collections at once, looping with aggressive settings, while a writer publishes new
//! steps (one of them left incomplete) and a reader keeps checking that no marker it can see
//! points to a step whose manifest is gone.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use common::*;
use driftless_format::StepKind;
use driftless_gc::{GcPolicy, StepId};
use driftless_store::{layout, Bucket};

const GRACE: Duration = Duration::from_secs(2);

async fn reader_check(b: &Bucket) -> Vec<String> {
    let mut violations = Vec::new();
    let Ok(markers) = b.list("ready/").await else {
        return violations;
    };
    for m in markers {
        let Some((kind, step, None)) = layout::parse_step_key(&m.key) else {
            continue;
        };
        match b.head(&layout::manifest(kind, step)).await {
            Ok(_) => {}
            Err(e) if e.is_not_found() => {
                // Gone: fine only if the marker went first.
                if b.head(&m.key).await.is_ok() {
                    violations.push(format!("{} present, manifest gone", m.key));
                }
            }
            Err(e) => panic!("{e}"),
        }
    }
    violations
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_collections_and_a_writer() {
    for tb in buckets("concurrency") {
        let b = tb.bucket.clone();
        let old = regular(60, 10, SystemTime::now() - Duration::from_secs(60), Duration::from_millis(100));
        write_steps(&b, &old).await;
        let foreign = write_foreign(&b).await;
        if tb.root.is_some() {
            tb.backdate(&old);
        } else {
            tokio::time::sleep(GRACE + Duration::from_secs(1)).await;
        }

        let done = Arc::new(AtomicBool::new(false));
        let policy = GcPolicy::new().with_keep_deltas(3).with_keep_anchors(1).with_grace(GRACE);
        let mut gcs = Vec::new();
        for _ in 0..2 {
            let (b, done, policy) = (b.clone(), done.clone(), policy.clone());
            gcs.push(tokio::spawn(async move {
                let mut runs = 0;
                while !done.load(Ordering::SeqCst) || runs == 0 {
                    driftless_gc::run(&b, &policy, false).await.unwrap();
                    runs += 1;
                }
                runs
            }));
        }
        let reader = {
            let (b, done) = (b.clone(), done.clone());
            tokio::spawn(async move {
                let mut violations = Vec::new();
                while !done.load(Ordering::SeqCst) {
                    violations.extend(reader_check(&b).await);
                }
                violations
            })
        };
        // The writer: steps 61..=120, an anchor every 10; delta 75 crashes (no marker) and
        // delta 76 is coalesced onto 74.
        for s in 61..=120u64 {
            let written = SystemTime::now();
            if s % 10 == 0 {
                write_step(
                    &b,
                    &Step { id: StepId::anchor(s), base: None, ready: true, payload: vec![300, 300], written },
                )
                .await;
            }
            let base = if s == 76 { 74 } else { s - 1 };
            let step = Step { id: StepId::delta(s), base: Some(base), ready: s != 75, payload: vec![20], written };
            write_step(&b, &step).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        done.store(true, Ordering::SeqCst);
        for g in gcs {
            assert!(g.await.unwrap() >= 1);
        }
        let violations = reader.await.unwrap();
        assert!(violations.is_empty(), "{}: {violations:?}", tb.name);

        let markers = assert_markers_complete(&b).await;
        assert_foreign_intact(&b, &foreign).await;
        let ready = markers.iter().map(|(id, m)| (*id, m.base_step)).collect();
        let reach = reachable(&ready);
        assert!(reach.contains(&StepId::delta(120)) && reach.contains(&StepId::anchor(120)));
        assert!(reach.contains(&StepId::delta(76)) || !markers.contains_key(&StepId::delta(76)));
        for id in markers.keys() {
            assert!(reach.contains(id), "{}: {id} stranded", tb.name);
        }
        // Old steps are gone (only grace could hold them, and they are past it).
        assert!(!markers.contains_key(&StepId::delta(10)), "{}: old steps kept", tb.name);

        // Once the grace period has passed, the policy alone decides.
        let later = SystemTime::now() + Duration::from_secs(3600);
        let plan = driftless_gc::plan(&b, &policy, later).await.unwrap();
        driftless_gc::execute(&b, &plan).await.unwrap();
        let markers = assert_markers_complete(&b).await;
        let kept: Vec<StepId> = markers.keys().copied().collect();
        assert_eq!(
            kept,
            [StepId::delta(118), StepId::delta(119), StepId::delta(120), StepId::anchor(120)]
                .into_iter()
                .chain(std::iter::once(StepId::anchor(110)))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .chain((111..=117).map(StepId::delta))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect::<Vec<_>>(),
            "{}",
            tb.name
        );
        assert!(b.list(&layout::delta_dir(75)).await.unwrap().is_empty(), "incomplete 75 left");
        assert_eq!(markers.keys().filter(|id| id.kind == StepKind::Anchor).count(), 2);
    }
}
