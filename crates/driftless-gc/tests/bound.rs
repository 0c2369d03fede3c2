//! The storage bound: with the default policy a 1,000-step run with an anchor every 50 steps
//! keeps at most 10 anchors plus 100 deltas (plus what the grace period holds). Also the
//! README's worked example, on `file://` and (when configured) SeaweedFS.

mod common;

use std::time::{Duration, SystemTime};

use common::*;
use driftless_format::StepKind;
use driftless_gc::{plan_inventory, GcPolicy, KeepReason, StepId};

fn count(plan: &driftless_gc::GcPlan, kind: StepKind) -> usize {
    plan.kept.iter().filter(|k| k.kind == kind && k.ready).count()
}

#[test]
fn thousand_steps_default_policy() {
    let now = SystemTime::now();
    let policy = GcPolicy::default();
    // All older than grace.
    let steps = regular(1000, 50, now - Duration::from_secs(3600), Duration::from_secs(1));
    let plan = plan_inventory(&inventory(&steps), &policy, now);
    assert_eq!(count(&plan, StepKind::Anchor), 10, "{plan}");
    assert_eq!(count(&plan, StepKind::Delta), 100, "{plan}");
    let size = |kind: StepKind| {
        steps
            .iter()
            .filter(|s| s.id.kind == kind)
            .map(|s| step_objects(s).iter().map(|(_, b)| b.len() as u64).sum::<u64>())
            .max()
            .unwrap()
    };
    let (anchor_bytes, delta_bytes) = (size(StepKind::Anchor), size(StepKind::Delta));
    assert!(plan.bytes_kept <= 10 * anchor_bytes + 100 * delta_bytes);
    assert_eq!(plan.newest_step, Some(1000));

    // The newest 600 s within grace (one step a second): those are held on top.
    let steps = regular(1000, 50, now, Duration::from_secs(1));
    let plan = plan_inventory(&inventory(&steps), &policy, now);
    let young = steps.iter().filter(|s| s.written > now - policy.grace).count();
    let held = plan.kept.iter().filter(|k| k.reasons.contains(&KeepReason::WithinGrace)).count();
    // And anchor 400: the newest anchor (and step) 600 s ago, which a reader may still be on.
    assert_eq!(held, young + 1);
    assert!(plan.kept.iter().any(|k| k.kind == StepKind::Anchor && k.step == 400), "{plan}");
    assert!(plan.kept.len() <= 10 + 100 + young + 1, "{}", plan.kept.len());
}

/// The same run written to real buckets, collected, and listed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousand_steps_on_buckets() {
    for tb in buckets("bound") {
        let b = &tb.bucket;
        let steps = regular(1000, 50, SystemTime::now(), Duration::ZERO);
        write_steps(b, &steps).await;
        let foreign = write_foreign(b).await;
        // An hour later, everything is past grace.
        let later = SystemTime::now() + Duration::from_secs(3600);
        let plan = driftless_gc::plan(b, &GcPolicy::default(), later).await.unwrap();
        driftless_gc::execute(b, &plan).await.unwrap();
        let markers = assert_markers_complete(b).await;
        let anchors = markers.keys().filter(|id| id.kind == StepKind::Anchor).count();
        let deltas = markers.keys().filter(|id| id.kind == StepKind::Delta).count();
        assert_eq!((anchors, deltas), (10, 100), "{}", tb.name);
        assert!(markers.contains_key(&StepId::anchor(550)) && markers.contains_key(&StepId::delta(901)));
        assert_foreign_intact(b, &foreign).await;
    }
}

/// The README's worked example: anchors every 5 steps, 23 steps, keep 4 deltas and 1 anchor.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn worked_example() {
    for tb in buckets("example") {
        let b = &tb.bucket;
        let mut steps = regular(23, 5, SystemTime::now(), Duration::ZERO);
        // Step 12's delta crashed half-way (no marker).
        steps.iter_mut().find(|s| s.id == StepId::delta(12)).unwrap().ready = false;
        write_steps(b, &steps).await;
        let later = SystemTime::now() + Duration::from_secs(3600);
        let policy = GcPolicy::new().with_keep_deltas(4).with_keep_anchors(1);
        let plan = driftless_gc::plan(b, &policy, later).await.unwrap();
        let kept: Vec<String> =
            plan.kept.iter().map(|k| format!("{}", StepId { kind: k.kind, step: k.step })).collect();
        // Deltas 20..23 by count; delta 20 applies to 19, so 16..19 and anchor 15 stay for it;
        // anchor 20 is the newest anchor.
        assert_eq!(
            kept,
            [
                "anchor 15",
                "delta 16",
                "delta 17",
                "delta 18",
                "delta 19",
                "delta 20",
                "anchor 20",
                "delta 21",
                "delta 22",
                "delta 23"
            ],
            "{plan}"
        );
        assert_eq!(plan.incomplete.iter().map(|d| d.id()).collect::<Vec<_>>(), [StepId::delta(12)]);
        let r = driftless_gc::execute(b, &plan).await.unwrap();
        assert_eq!((r.deleted_steps, r.deleted_incomplete), (plan.deleted.len(), 1));
        // A second run finds nothing to do.
        let again = driftless_gc::plan(b, &policy, later).await.unwrap();
        assert!(again.deleted.is_empty() && again.incomplete.is_empty(), "{again}");
        assert_markers_complete(b).await;
        // Dry run through the public entry point.
        let dry = driftless_gc::run(b, &GcPolicy::new().with_keep_deltas(0), true).await.unwrap();
        assert!(dry.dry_run && dry.deleted_objects == 0);
        serde_json::to_string(&dry).unwrap();
    }
}

/// One anchor and 50,000 chained deltas, all kept (within grace): every delta's chain is the
/// whole stream. Walking each chain anew was quadratic (8,000 deltas: 5 s optimized; this:
/// minutes); one pass down the base links plans it at once.
#[test]
fn a_long_chain_is_planned_in_one_pass() {
    let now = SystemTime::now();
    let n = 50_000;
    let steps = regular(n, n + 1, now, Duration::from_millis(1));
    let plan = plan_inventory(&inventory(&steps), &GcPolicy::default().with_keep_deltas(n as usize), now);
    assert_eq!(plan.kept.len(), n as usize + 1);
    assert!(plan.deleted.is_empty());
    let a0 = plan.kept.iter().find(|k| k.kind == StepKind::Anchor).unwrap();
    assert!(
        a0.reasons.contains(&KeepReason::NewestAnchorChain) && a0.reasons.contains(&KeepReason::NeededForReachability)
    );
}
