//! Property tests: random chains (anchor cadence, failed, coalesced and incomplete steps),
//! random policies and clocks. After GC every retained step that was reachable is still
//! reachable, the newest step stays reachable, what is kept is what the policy asks for and
//! no more, and nothing outside the layout changes.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use common::*;
use driftless_format::StepKind;
use driftless_gc::{plan_inventory, GcPlan, GcPolicy, KeepReason, StepId};
use proptest::prelude::*;

const T0: u64 = 1_700_000_000;
const SPACING: u64 = 10;

#[derive(Debug, Clone)]
struct Case {
    steps: Vec<Step>,
    policy: GcPolicy,
    now: SystemTime,
}

fn at(step: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(T0 + step * SPACING)
}

/// Per step: 0..=6 normal delta, 7 failed (nothing), 8 coalesced (base skips back),
/// 9 incomplete (objects, no marker). Anchors: 0..=7 ready, 8 missing, 9 incomplete.
fn case() -> impl Strategy<Value = Case> {
    (2u64..70, 1u64..15).prop_flat_map(|(n, every)| {
        (
            proptest::collection::vec((0u8..10, 0u8..10, 2u64..5, 1u64..4), n as usize),
            0usize..40,
            0usize..6,
            prop_oneof![Just(0u64), Just(30), Just(100), Just(2000)],
            0u64..400,
            proptest::option::of(0u64..6000),
        )
            .prop_map(move |(kinds, keep_deltas, keep_anchors, grace, late, max_bytes)| {
                let mut steps = Vec::new();
                for (s, &(dk, ak, skip, segs)) in (0..n).zip(&kinds) {
                    let written = at(s);
                    if s % every == 0 && ak != 8 {
                        let payload = vec![300; 2];
                        steps.push(Step { id: StepId::anchor(s), base: None, ready: ak != 9, payload, written });
                    }
                    if s == 0 || dk == 7 {
                        continue;
                    }
                    let base = if dk == 8 { s.saturating_sub(skip) } else { s - 1 };
                    let payload = vec![10 + s % 7; segs as usize];
                    steps.push(Step { id: StepId::delta(s), base: Some(base), ready: dk != 9, payload, written });
                }
                let policy = GcPolicy::new()
                    .with_keep_deltas(keep_deltas)
                    .with_keep_anchors(keep_anchors)
                    .with_grace(Duration::from_secs(grace))
                    .with_max_bytes(max_bytes);
                Case { steps, policy, now: at(n) + Duration::from_secs(late) }
            })
    })
}

fn ready_map(steps: &[Step]) -> BTreeMap<StepId, Option<u64>> {
    steps.iter().filter(|s| s.ready).map(|s| (s.id, s.base)).collect()
}

fn newest_state(reach: &BTreeSet<StepId>) -> Option<StepId> {
    // Max step; the anchor wins a tie (ordering puts anchors after deltas of a step).
    reach.iter().next_back().copied()
}

/// Check a plan against the model; return the ready map after it is carried out.
fn check_plan(case: &Case, plan: &GcPlan) -> BTreeMap<StepId, Option<u64>> {
    let before = ready_map(&case.steps);
    let reach_before = reachable(&before);
    let by_id: BTreeMap<StepId, &Step> = case.steps.iter().map(|s| (s.id, s)).collect();
    let kept: BTreeMap<StepId, &Vec<KeepReason>> =
        plan.kept.iter().map(|k| (StepId { kind: k.kind, step: k.step }, &k.reasons)).collect();
    let deleted: BTreeSet<StepId> = plan.deleted.iter().map(|d| d.id()).collect();
    let incomplete: BTreeSet<StepId> = plan.incomplete.iter().map(|d| d.id()).collect();

    // Every step is in exactly one list.
    assert_eq!(kept.len() + deleted.len() + incomplete.len(), by_id.len());
    for id in by_id.keys() {
        let n = kept.contains_key(id) as u8 + deleted.contains(id) as u8 + incomplete.contains(id) as u8;
        assert_eq!(n, 1, "{id}");
    }
    let grace_cutoff = case.now.checked_sub(case.policy.grace).unwrap();
    for id in deleted.iter().chain(&incomplete) {
        let s = by_id[id];
        assert!(s.written <= grace_cutoff, "{id} deleted within grace");
        assert_eq!(s.ready, deleted.contains(id), "{id} in the wrong list");
    }
    for s in case.steps.iter().filter(|s| !s.ready) {
        assert_eq!(s.written <= grace_cutoff, incomplete.contains(&s.id), "incomplete {}", s.id);
    }

    let after: BTreeMap<StepId, Option<u64>> =
        before.iter().filter(|(id, _)| !deleted.contains(id)).map(|(k, v)| (*k, *v)).collect();
    let reach_after = reachable(&after);
    for id in kept.keys() {
        if reach_before.contains(id) {
            assert!(reach_after.contains(id), "{id} was reachable and kept, now stranded");
        }
    }
    if let Some(newest) = newest_state(&reach_before) {
        assert!(reach_after.contains(&newest), "newest step {newest} stranded");
        assert_eq!(plan.newest_step, Some(newest.step));
    }
    let anchors: Vec<StepId> = before.keys().filter(|id| id.kind == StepKind::Anchor).copied().collect();
    if let Some(a) = anchors.last() {
        assert!(after.contains_key(a), "newest anchor deleted");
    }

    // The count rules (max_bytes may only trim them).
    let deltas: Vec<StepId> = before.keys().filter(|id| id.kind == StepKind::Delta).copied().collect();
    let top_d: BTreeSet<StepId> = deltas.iter().rev().take(case.policy.keep_deltas).copied().collect();
    let top_a: BTreeSet<StepId> = anchors.iter().rev().take(case.policy.keep_anchors).copied().collect();
    if case.policy.max_bytes.is_none() {
        for id in top_d.iter().chain(&top_a) {
            assert!(after.contains_key(id), "{id} is within the newest N/M but was deleted");
        }
    }
    // Nothing kept without a reason: young, newest N/M, newest anchor/step, or on the chain
    // of another kept step.
    let mut justified: BTreeSet<StepId> = BTreeSet::new();
    for id in kept.keys() {
        let s = by_id[id];
        if s.written > grace_cutoff
            || !s.ready
            || top_d.contains(id)
            || top_a.contains(id)
            || Some(id) == anchors.last()
            || Some(*id) == newest_state(&reach_before)
        {
            justified.insert(*id);
        }
    }
    // What a reader saw `grace` ago: the newest anchor then, and the newest step then with
    // its chain as it stood (a newer anchor ends chains; the route planned before it did not).
    let then: BTreeMap<StepId, Option<u64>> =
        before.iter().filter(|(id, _)| by_id[*id].written <= grace_cutoff).map(|(k, v)| (*k, *v)).collect();
    let mut route_then: Vec<StepId> =
        then.keys().rfind(|id| id.kind == StepKind::Anchor).into_iter().copied().collect();
    if let Some(n) = newest_state(&reachable(&then)) {
        route_then.push(n);
        if n.kind == StepKind::Delta {
            route_then.extend(chain(&then, n.step));
        }
    }
    for id in route_then {
        assert!(after.contains_key(&id), "{id}, on the route a reader planned grace ago, was deleted");
        justified.insert(id);
    }
    for id in justified.clone() {
        if id.kind == StepKind::Delta && reach_before.contains(&id) {
            justified.extend(chain(&before, id.step));
        }
    }
    for id in kept.keys() {
        assert!(justified.contains(id), "{id} kept without a reason ({:?})", kept[id]);
    }

    // Bytes.
    let total: u64 = case.steps.iter().map(|s| step_objects(s).iter().map(|(_, b)| b.len() as u64).sum::<u64>()).sum();
    assert_eq!(plan.bytes_kept + plan.bytes_freed, total);
    if let Some(max) = case.policy.max_bytes {
        if !plan.over_budget {
            assert!(plan.bytes_kept <= max);
        } else {
            assert!(plan.kept.iter().all(
                |k| !k.reasons.contains(&KeepReason::NewestDelta) && !k.reasons.contains(&KeepReason::NewestAnchor)
            ));
        }
    } else {
        assert!(!plan.over_budget);
    }
    after
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// The planner alone, on many random streams.
    #[test]
    fn plans_keep_policy_and_reachability(case in case()) {
        let inv = inventory(&case.steps);
        let plan = plan_inventory(&inv, &case.policy, case.now);
        check_plan(&case, &plan);

        // Collecting again at the same time finds nothing to do.
        let deleted: BTreeSet<StepId> =
            plan.deleted.iter().chain(&plan.incomplete).map(|d| d.id()).collect();
        let rest: Vec<Step> = case.steps.iter().filter(|s| !deleted.contains(&s.id)).cloned().collect();
        let again = plan_inventory(&inventory(&rest), &case.policy, case.now);
        prop_assert!(again.deleted.is_empty() && again.incomplete.is_empty(), "not a fixed point: {again}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// End to end on `file://`: list, plan, execute, re-list.
    #[test]
    fn collects_file_bucket(case in case()) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let tb = file_bucket();
            let b = &tb.bucket;
            write_steps(b, &case.steps).await;
            tb.backdate(&case.steps);
            let foreign = write_foreign(b).await;

            let plan = driftless_gc::plan(b, &case.policy, case.now).await.unwrap();
            let pure = plan_inventory(&inventory(&case.steps), &case.policy, case.now);
            assert_eq!(plan.kept, pure.kept);
            assert_eq!(plan.deleted, pure.deleted);
            assert_eq!(plan.incomplete, pure.incomplete);
            let after = check_plan(&case, &plan);

            let report = driftless_gc::execute(b, &plan).await.unwrap();
            assert_eq!(report.bytes_freed, plan.bytes_freed);
            assert!(report.skipped.is_empty());
            // Interrupted or concurrent re-runs of the same plan are harmless.
            driftless_gc::execute(b, &plan).await.unwrap();

            let markers = assert_markers_complete(b).await;
            let left: BTreeMap<StepId, Option<u64>> = markers.iter().map(|(id, m)| (*id, m.base_step)).collect();
            assert_eq!(left, after);
            assert_foreign_intact(b, &foreign).await;
            for d in &plan.incomplete {
                let dir = match d.kind {
                    StepKind::Delta => driftless_store::layout::delta_dir(d.step),
                    StepKind::Anchor => driftless_store::layout::anchor_dir(d.step),
                };
                let left = b.list(&dir).await.unwrap();
                assert!(
                    left.iter().all(|o| driftless_store::layout::parse_step_key(&o.key).is_none()),
                    "incomplete {} left: {left:?}",
                    d.id()
                );
            }
        });
    }
}
