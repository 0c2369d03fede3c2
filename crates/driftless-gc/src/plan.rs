//! The planner: from an [`Inventory`] and a [`GcPolicy`] to a [`GcPlan`]. Pure: no I/O, the
//! clock is a parameter.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::{Duration, SystemTime};

use driftless_format::StepKind;
use serde::Serialize;

use crate::inventory::{Inventory, MarkerState, StepEntry, StepId};
use crate::policy::GcPolicy;
use driftless_store::ObjectInfo;

/// Why a step is kept. A step may have several reasons. Spelled the same in the text report
/// and in `--json` (kebab-case), so one grep finds both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum KeepReason {
    /// One of the newest [`GcPolicy::keep_deltas`] ready deltas.
    NewestDelta,
    /// One of the newest [`GcPolicy::keep_anchors`] ready anchors.
    NewestAnchor,
    /// On the chain (base links down to an anchor) of a step kept for another reason.
    NeededForReachability,
    /// Some object of the step (marker included) is younger than [`GcPolicy::grace`].
    WithinGrace,
    /// The newest anchor, or on the chain that reaches the newest reachable step: never deleted.
    NewestAnchorChain,
    /// The marker could not be parsed or names another step: left for a human.
    UnreadableMarker,
    /// An incomplete step written by a publisher generation whose lease is live: an upload
    /// in progress, however long it takes. Or a sharded delta step holding slice bytes of a
    /// live generation: its committer may still be gathering the step's scheduled anchor from
    /// them (a long gather outlived the delta's retention, and the slices went under it).
    Leased,
}

impl KeepReason {
    fn as_str(self) -> &'static str {
        match self {
            KeepReason::NewestDelta => "newest-delta",
            KeepReason::NewestAnchor => "newest-anchor",
            KeepReason::NeededForReachability => "needed-for-reachability",
            KeepReason::WithinGrace => "within-grace",
            KeepReason::NewestAnchorChain => "newest-anchor-chain",
            KeepReason::UnreadableMarker => "unreadable-marker",
            KeepReason::Leased => "leased",
        }
    }
}

/// A step the plan keeps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeptStep {
    /// Delta or anchor.
    pub kind: StepKind,
    /// Step number.
    pub step: u64,
    /// Whether it has a ready marker (false: an incomplete step still within grace).
    pub ready: bool,
    /// Bytes of its marker and objects.
    pub bytes: u64,
    /// Why it is kept, sorted.
    pub reasons: Vec<KeepReason>,
}

/// A step the plan deletes, with the keys to delete in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeletedStep {
    /// Delta or anchor.
    pub kind: StepKind,
    /// Step number.
    pub step: u64,
    /// The ready marker, deleted first (`None` for an incomplete step).
    pub marker: Option<String>,
    /// The manifest, deleted second (when listed).
    pub manifest: Option<String>,
    /// Payload objects, deleted last.
    pub objects: Vec<String>,
    /// Bytes freed.
    pub bytes: u64,
}

impl DeletedStep {
    fn of(entry: &StepEntry) -> DeletedStep {
        let manifest = entry.manifest_key().map(str::to_string);
        DeletedStep {
            kind: entry.id.kind,
            step: entry.id.step,
            marker: entry.marker.as_ref().map(|(info, _)| info.key.clone()),
            objects: entry.objects.iter().map(|o| o.key.clone()).filter(|k| Some(k) != manifest.as_ref()).collect(),
            manifest,
            bytes: entry.bytes(),
        }
    }

    /// The step's id.
    pub fn id(&self) -> StepId {
        StepId { kind: self.kind, step: self.step }
    }
}

/// Objects of a kept ready step that no reader will ever read: those of a try or a
/// generation that did not commit it (a failed upload the publisher retried under new names,
/// or a step a later generation took over). Up to a model's worth per failed anchor try, so
/// they are not kept for the step's whole retention.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StrayObjects {
    /// Delta or anchor.
    pub kind: StepKind,
    /// Step number.
    pub step: u64,
    /// The manifest name the ready marker named when planning: the objects are deleted only
    /// if it still does.
    pub manifest: String,
    /// The stray keys.
    pub objects: Vec<String>,
    /// Bytes freed.
    pub bytes: u64,
}

impl StrayObjects {
    /// The step's id.
    pub fn id(&self) -> StepId {
        StepId { kind: self.kind, step: self.step }
    }
}

/// What a collection will do. Serializes to the `--json` output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GcPlan {
    /// The policy it was made with.
    pub policy: GcPolicy,
    /// The clock it was made at (milliseconds since the Unix epoch).
    pub now_ms: u64,
    /// The bucket's clock minus this host's when the plan was made (see [`crate::run`]):
    /// what execution adds to this host's clock when it reads leases again.
    pub clock_offset_ms: i64,
    /// Newest step reachable from a ready anchor before collection (kept reachable).
    pub newest_step: Option<u64>,
    /// Newest ready anchor (always kept).
    pub newest_anchor: Option<u64>,
    /// Steps kept, oldest first.
    pub kept: Vec<KeptStep>,
    /// Ready steps removed, oldest first.
    pub deleted: Vec<DeletedStep>,
    /// Incomplete steps (objects but no marker) older than the grace period, removed.
    pub incomplete: Vec<DeletedStep>,
    /// Objects of kept ready steps that their committed manifest does not name, older than
    /// the grace period and not covered by a live lease, removed.
    pub strays: Vec<StrayObjects>,
    /// Keys under the layout's directories that are not part of it (never touched).
    pub foreign: Vec<String>,
    /// Claims of steps older than every kept step (no publisher can commit those again).
    pub stale_claims: Vec<String>,
    /// Leases expired for longer than the grace period, except the newest generation's
    /// (kept so that generation numbers never repeat).
    pub stale_leases: Vec<String>,
    /// Bytes of everything kept.
    pub bytes_kept: u64,
    /// Bytes of everything deleted.
    pub bytes_freed: u64,
    /// `max_bytes` is set and could not be met without breaking grace or reachability.
    pub over_budget: bool,
}

/// Longest a sharded committer is taken to gather a delta step's scheduled anchor from the
/// ranks' slices (what its ranks wait for an outcome at most).
const MAX_GATHER: Duration = Duration::from_secs(6 * 3600);

/// Make a plan from a listing. See the crate docs for the rules.
pub fn plan_inventory(inv: &Inventory, policy: &GcPolicy, now: SystemTime) -> GcPlan {
    let cutoff = now.checked_sub(policy.grace);
    let young = |e: &StepEntry| cutoff.is_none_or(|c| e.last_modified() > c);
    let graph = Graph::new(inv, None);

    // Roots that max_bytes may not trim, and roots it may (oldest first).
    let mut fixed: BTreeMap<StepId, BTreeSet<KeepReason>> = BTreeMap::new();
    let add = |map: &mut BTreeMap<StepId, BTreeSet<KeepReason>>, id: StepId, r: KeepReason| {
        map.entry(id).or_default().insert(r);
    };
    let live: BTreeSet<u64> = inv.leases.iter().filter(|(_, l)| l.live_at(now)).map(|(&g, _)| g).collect();
    for e in inv.steps.values() {
        if matches!(e.marker, Some((_, MarkerState::Unreadable(_)))) {
            add(&mut fixed, e.id, KeepReason::UnreadableMarker);
        } else if young(e) {
            add(&mut fixed, e.id, KeepReason::WithinGrace);
        }
        if e.marker.is_none() && e.generations().iter().any(|g| live.contains(g)) {
            add(&mut fixed, e.id, KeepReason::Leased);
        }
        let gathering = |o: &ObjectInfo| {
            let name = o.key.rsplit('/').next().unwrap_or_default();
            crate::inventory::slices_generation(name).is_some_and(|g| live.contains(&g))
        };
        // Bounded: slices a committer failed to delete would otherwise pin the step and its
        // chain for the generation's whole life.
        let recent = e.marker.as_ref().is_some_and(|(m, _)| m.last_modified + MAX_GATHER > now);
        if recent && e.id.kind == StepKind::Delta && e.objects.iter().any(gathering) {
            add(&mut fixed, e.id, KeepReason::Leased);
        }
    }
    let newest_anchor = graph.anchors.iter().next_back().copied();
    if let Some(a) = newest_anchor {
        add(&mut fixed, StepId::anchor(a), KeepReason::NewestAnchorChain);
    }
    let newest_state = graph.newest_state();
    if let Some(id) = newest_state {
        add(&mut fixed, id, KeepReason::NewestAnchorChain);
    }
    // The newest anchor and the newest reachable step as they stood `grace` ago, with the
    // chain between them: a reader that planned its route then may still be on it. Otherwise
    // a new anchor ended the previous one's chain at once, and a cold reader downloading the
    // previous anchor lost it and its deltas within a second (found by review).
    if let Some(c) = cutoff {
        let then = Graph::new(inv, Some(c));
        if let Some(&a) = then.anchors.iter().next_back() {
            add(&mut fixed, StepId::anchor(a), KeepReason::WithinGrace);
        }
        if let Some(id) = then.newest_state() {
            add(&mut fixed, id, KeepReason::WithinGrace);
            let chain = if id.kind == StepKind::Delta { then.chain(id.step) } else { Vec::new() };
            for dep in chain {
                add(&mut fixed, dep, KeepReason::WithinGrace);
            }
        }
    }
    let mut trimmable: BTreeMap<StepId, BTreeSet<KeepReason>> = BTreeMap::new();
    for &d in graph.deltas.keys().rev().take(policy.keep_deltas) {
        add(&mut trimmable, StepId::delta(d), KeepReason::NewestDelta);
    }
    for &a in graph.anchors.iter().rev().take(policy.keep_anchors) {
        add(&mut trimmable, StepId::anchor(a), KeepReason::NewestAnchor);
    }
    let trimmable: Vec<(StepId, BTreeSet<KeepReason>)> = trimmable.into_iter().collect();

    // Stray objects of steps past grace: removed from whichever of them is kept (a step
    // younger than the grace period is left whole: an upload may be going on).
    let strays: BTreeMap<StepId, Vec<&ObjectInfo>> = inv
        .steps
        .values()
        .filter(|e| !young(e))
        .map(|e| (e.id, e.strays(|g| live.contains(&g), inv.conditional_create)))
        .filter(|(_, s)| !s.is_empty())
        .collect();
    let stray_bytes = |id: &StepId| strays.get(id).map_or(0, |s| s.iter().fold(0u64, |a, o| a.saturating_add(o.size)));
    let kept_bytes = |kept: &BTreeMap<StepId, BTreeSet<KeepReason>>| -> u64 {
        kept.keys()
            .filter_map(|id| inv.steps.get(id))
            .fold(0u64, |acc, e| acc.saturating_add(e.bytes().saturating_sub(stray_bytes(&e.id))))
    };
    let mut kept = graph.closure(&fixed, &trimmable);
    let mut over_budget = false;
    if let Some(max) = policy.max_bytes.filter(|&m| kept_bytes(&kept) > m) {
        // The fewest oldest trimmable roots to drop for the bound to hold. Dropping roots only
        // shrinks the closure, so the kept bytes fall as more are dropped: a binary search
        // (dropping one at a time recomputed the closure per root).
        let (mut lo, mut hi) = (1, trimmable.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if kept_bytes(&graph.closure(&fixed, &trimmable[mid..])) > max {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        kept = graph.closure(&fixed, &trimmable[lo.min(trimmable.len())..]);
        over_budget = kept_bytes(&kept) > max;
    }

    let mut plan = GcPlan {
        policy: policy.clone(),
        now_ms: now
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
            .as_millis()
            .try_into()
            .unwrap_or(u64::MAX),
        clock_offset_ms: 0,
        newest_step: newest_state.map(|id| id.step),
        newest_anchor,
        kept: Vec::new(),
        deleted: Vec::new(),
        incomplete: Vec::new(),
        strays: Vec::new(),
        foreign: inv.foreign.clone(),
        stale_claims: Vec::new(),
        stale_leases: Vec::new(),
        bytes_kept: 0,
        bytes_freed: 0,
        over_budget,
    };
    for e in inv.steps.values() {
        let bytes = e.bytes();
        if let Some(reasons) = kept.get(&e.id) {
            let freed = stray_bytes(&e.id);
            if let (Some(s), Some(m)) = (strays.get(&e.id), e.ready()) {
                plan.strays.push(StrayObjects {
                    kind: e.id.kind,
                    step: e.id.step,
                    manifest: m.manifest_name().to_string(),
                    objects: s.iter().map(|o| o.key.clone()).collect(),
                    bytes: freed,
                });
                plan.bytes_freed = plan.bytes_freed.saturating_add(freed);
            }
            let bytes = bytes.saturating_sub(freed);
            plan.bytes_kept = plan.bytes_kept.saturating_add(bytes);
            plan.kept.push(KeptStep {
                kind: e.id.kind,
                step: e.id.step,
                ready: e.marker.is_some(),
                bytes,
                reasons: reasons.iter().copied().collect(),
            });
        } else {
            plan.bytes_freed = plan.bytes_freed.saturating_add(bytes);
            if e.marker.is_some() {
                plan.deleted.push(DeletedStep::of(e));
            } else {
                plan.incomplete.push(DeletedStep::of(e));
            }
        }
    }
    if let Some(oldest) = plan.kept.iter().filter(|k| k.ready).map(|k| k.step).min() {
        plan.stale_claims = inv.claims.range(..oldest).map(|(_, i)| i.key.clone()).collect();
    }
    let newest_gen = inv.leases.keys().next_back().copied();
    plan.stale_leases = inv
        .leases
        .iter()
        .filter(|(&g, l)| {
            Some(g) != newest_gen && !l.live_at(now) && cutoff.is_some_and(|c| l.info.last_modified + l.ttl <= c)
        })
        .map(|(_, l)| l.info.key.clone())
        .collect();
    plan
}

/// The ready steps and their base links.
struct Graph {
    /// Ready anchors.
    anchors: BTreeSet<u64>,
    /// Ready deltas and their base step (`None`: no usable base, never reachable).
    deltas: BTreeMap<u64, Option<u64>>,
    /// Ready deltas reachable from a ready anchor.
    reachable: BTreeSet<u64>,
}

impl Graph {
    /// The graph of the ready markers, of those written by `as_of` when given.
    fn new(inv: &Inventory, as_of: Option<SystemTime>) -> Graph {
        let mut anchors = BTreeSet::new();
        let mut deltas = BTreeMap::new();
        for e in inv.steps.values() {
            if let (Some(m), Some((info, _))) = (e.ready(), &e.marker) {
                if as_of.is_some_and(|c| info.last_modified > c) {
                    continue;
                }
                match e.id.kind {
                    StepKind::Anchor => {
                        anchors.insert(e.id.step);
                    }
                    StepKind::Delta => {
                        deltas.insert(e.id.step, m.base_step.filter(|&b| b < e.id.step));
                    }
                }
            }
        }
        // Bases are strictly older, so one pass in step order settles reachability.
        let mut reachable = BTreeSet::new();
        for (&s, &base) in &deltas {
            if let Some(b) = base {
                if anchors.contains(&b) || reachable.contains(&b) {
                    reachable.insert(s);
                }
            }
        }
        Graph { anchors, deltas, reachable }
    }

    /// The newest step a reader can reach (an anchor wins a tie: its chain is itself).
    fn newest_state(&self) -> Option<StepId> {
        let a = self.anchors.iter().next_back().map(|&s| StepId::anchor(s));
        let d = self.reachable.iter().next_back().map(|&s| StepId::delta(s));
        match (a, d) {
            (Some(a), Some(d)) => Some(if d.step > a.step { d } else { a }),
            (a, d) => a.or(d),
        }
    }

    /// The steps a reader needs below reachable delta `s`: the deltas down its base links to
    /// the first step that has a ready anchor, and that anchor. Empty when `s` is unreachable.
    fn chain(&self, s: u64) -> Vec<StepId> {
        let mut out = Vec::new();
        if !self.reachable.contains(&s) {
            return out;
        }
        let mut cur = s;
        while let Some(Some(base)) = self.deltas.get(&cur) {
            if self.anchors.contains(base) {
                out.push(StepId::anchor(*base));
                break;
            }
            out.push(StepId::delta(*base));
            cur = *base;
        }
        out
    }

    /// Roots plus everything their chains need: the chain of a root on the newest anchor's
    /// chain is `newest-anchor-chain`, of any other root `needed-for-reachability`.
    fn closure(
        &self,
        fixed: &BTreeMap<StepId, BTreeSet<KeepReason>>,
        trimmable: &[(StepId, BTreeSet<KeepReason>)],
    ) -> BTreeMap<StepId, BTreeSet<KeepReason>> {
        let mut kept = fixed.clone();
        for (id, reasons) in trimmable {
            kept.entry(*id).or_default().extend(reasons.iter().copied());
        }
        // What each reachable delta passes down its base link: (newest chain, needed). One
        // pass, newest first: bases are strictly older, so a delta has received all it will
        // when it is reached. (A walk per kept delta was quadratic in the chain's length: 8,000
        // chained deltas took 5 s to plan; found by review.)
        let mut pass: BTreeMap<u64, (bool, bool)> = BTreeMap::new();
        for (id, r) in &kept {
            if id.kind == StepKind::Delta && self.reachable.contains(&id.step) {
                let newest = r.contains(&KeepReason::NewestAnchorChain);
                pass.insert(id.step, (newest, !newest));
            }
        }
        while let Some((s, (newest, needed))) = pass.pop_last() {
            let Some(&Some(base)) = self.deltas.get(&s) else { continue };
            let dep = if self.anchors.contains(&base) { StepId::anchor(base) } else { StepId::delta(base) };
            let reasons = kept.entry(dep).or_default();
            if newest {
                reasons.insert(KeepReason::NewestAnchorChain);
            }
            if needed {
                reasons.insert(KeepReason::NeededForReachability);
            }
            if dep.kind == StepKind::Delta {
                let p = pass.entry(base).or_default();
                p.0 |= newest;
                p.1 |= needed;
            }
        }
        kept
    }
}

impl fmt::Display for GcPlan {
    /// The human-readable plan printed by `driftless gc` (and `--dry-run`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.policy;
        writeln!(
            f,
            "policy: keep {} deltas, {} anchors, grace {}{}; {}",
            p.keep_deltas,
            p.keep_anchors,
            humantime::format_duration(p.grace),
            p.max_bytes.map(|m| format!(", max {m} bytes")).unwrap_or_default(),
            match &p.trust {
                Some(t) => format!("manifests checked against {}", t.key_ids().join(", ")),
                None => "manifest signatures not checked (give --trust)".into(),
            }
        )?;
        let opt = |v: Option<u64>| v.map_or("none".to_string(), |s| s.to_string());
        writeln!(f, "newest step: {}, newest anchor: {}", opt(self.newest_step), opt(self.newest_anchor))?;
        for k in &self.kept {
            let reasons: Vec<&str> = k.reasons.iter().map(|r| r.as_str()).collect();
            let id = StepId { kind: k.kind, step: k.step };
            let incomplete = if k.ready { "" } else { " (incomplete)" };
            writeln!(f, "keep   {id}{incomplete}: {} bytes [{}]", k.bytes, reasons.join(", "))?;
        }
        for d in &self.deleted {
            writeln!(f, "delete {}: {} bytes", d.id(), d.bytes)?;
        }
        for d in &self.incomplete {
            writeln!(f, "delete {} (incomplete): {} bytes", d.id(), d.bytes)?;
        }
        for d in &self.strays {
            writeln!(
                f,
                "delete {} objects of {} that its manifest {} does not name: {} bytes",
                d.objects.len(),
                d.id(),
                d.manifest,
                d.bytes
            )?;
        }
        for k in &self.foreign {
            writeln!(f, "ignore {k} (not part of the layout)")?;
        }
        write!(
            f,
            "kept {} steps ({} bytes), deleting {} steps, {} incomplete and {} stray objects ({} bytes)",
            self.kept.len(),
            self.bytes_kept,
            self.deleted.len(),
            self.incomplete.len(),
            self.strays.iter().map(|s| s.objects.len()).sum::<usize>(),
            self.bytes_freed
        )?;
        if self.over_budget {
            write!(f, "\nwarning: over max_bytes; grace and reachability of the newest step keep more")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod reason_tests {
    use super::KeepReason;

    #[test]
    fn reasons_are_spelled_alike_in_text_and_json() {
        for r in [
            KeepReason::NewestDelta,
            KeepReason::NewestAnchor,
            KeepReason::NeededForReachability,
            KeepReason::WithinGrace,
            KeepReason::NewestAnchorChain,
            KeepReason::UnreadableMarker,
            KeepReason::Leased,
        ] {
            assert_eq!(serde_json::to_value(r).unwrap(), serde_json::Value::String(r.as_str().into()));
        }
    }
}

#[cfg(test)]
mod stray_tests {
    use std::time::{Duration, SystemTime};

    use driftless_format::{Digest, ReadyMarker, StepKind};
    use driftless_store::{layout, ObjectInfo};

    use super::{plan_inventory, KeepReason};
    use crate::inventory::{Inventory, LeaseEntry, MarkerState, StepId};
    use crate::policy::GcPolicy;

    fn info(key: String, size: u64, at: SystemTime) -> ObjectInfo {
        ObjectInfo { key, size, last_modified: at, etag: None }
    }

    /// The ready marker of a step committed by the try whose manifest is `manifest`.
    fn marker(of: StepKind, step: u64, base_step: Option<u64>, manifest: &str) -> MarkerState {
        MarkerState::Ready(ReadyMarker {
            kind: "ready".into(),
            stream_id: "s".into(),
            of,
            step,
            base_step,
            manifest_sha256: Digest([1; 32]),
            payload_bytes: 100,
            manifest: Some(manifest.into()),
        })
    }

    /// Anchor 5 committed by generation 3's second retry (`g3r2-`), next to what failed tries
    /// and other generations left, generation 4's lease live.
    fn inventory(at: SystemTime) -> Inventory {
        let mut inv = Inventory { conditional_create: true, ..Default::default() };
        let names = [
            "g3r2-manifest.json",
            "g3r2-model.safetensors.dla",
            "g3-manifest.json",           // try 0 of the committer: stray
            "g3-model.safetensors.dla",   // stray
            "g3r1-model.safetensors.dla", // try 1: stray
            "g3r3-model.safetensors.dla", // a newer try, lease of 3 not live: stray
            "g2-model.safetensors.dla",   // generation 2, lease dead: stray
            "g4-model.safetensors.dla",   // generation 4, lease live: kept
            "model.safetensors.dla",      // untagged: kept
        ];
        for n in names {
            inv.add_object(info(layout::object(StepKind::Anchor, 5, n), 100, at));
        }
        inv.add_marker(
            info(layout::ready(StepKind::Anchor, 5), 10, at),
            marker(StepKind::Anchor, 5, None, "g3r2-manifest.json"),
        );
        for (g, ttl) in [(2, 1), (4, 3600)] {
            let lease = info(layout::lease(g), 10, at);
            inv.leases.insert(g, LeaseEntry { info: lease, ttl: Duration::from_secs(ttl) });
        }
        inv
    }

    #[test]
    fn strays_are_other_tries_and_generations_not_leased() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let policy = GcPolicy { grace: Duration::from_secs(600), ..GcPolicy::default() };
        let inv = inventory(at);

        // Within grace: nothing of the step is touched.
        let plan = plan_inventory(&inv, &policy, at + Duration::from_secs(60));
        assert!(plan.strays.is_empty(), "{plan:?}");

        // Past grace (generation 4's lease, TTL an hour, still live).
        let plan = plan_inventory(&inv, &policy, at + Duration::from_secs(900));
        assert_eq!(plan.strays.len(), 1, "{plan:?}");
        let s = &plan.strays[0];
        assert_eq!((s.kind, s.step, s.manifest.as_str()), (StepKind::Anchor, 5, "g3r2-manifest.json"));
        let names: Vec<&str> = s.objects.iter().map(|k| k.rsplit('/').next().unwrap()).collect();
        assert_eq!(
            names,
            [
                "g2-model.safetensors.dla",
                "g3-manifest.json",
                "g3-model.safetensors.dla",
                "g3r1-model.safetensors.dla",
                "g3r3-model.safetensors.dla"
            ]
        );
        assert_eq!(s.bytes, 500);
        let total: u64 = inv.steps.values().map(|e| e.bytes()).sum();
        assert_eq!(plan.bytes_kept + plan.bytes_freed, total);
        assert!(plan.deleted.is_empty() && plan.incomplete.is_empty(), "{plan:?}");
        // `max_bytes` counts what stays: the strays are not held against it.
        let tight = policy.clone().with_max_bytes(Some(plan.bytes_kept));
        assert!(!plan_inventory(&inv, &tight, at + Duration::from_secs(900)).over_budget);

        // Generation 3's lease live: its newer try is kept (it may still commit), its older
        // tries are not (a store with conditional create: their late markers cannot land).
        let mut inv = inv;
        let lease = info(layout::lease(3), 10, at + Duration::from_secs(850));
        inv.leases.insert(3, LeaseEntry { info: lease, ttl: Duration::from_secs(60) });
        let names = |inv: &Inventory| -> Vec<String> {
            let plan = plan_inventory(inv, &policy, at + Duration::from_secs(900));
            plan.strays
                .iter()
                .flat_map(|s| s.objects.iter().map(|k| k.rsplit('/').next().unwrap().to_string()))
                .collect()
        };
        assert_eq!(
            names(&inv),
            ["g2-model.safetensors.dla", "g3-manifest.json", "g3-model.safetensors.dla", "g3r1-model.safetensors.dla"]
        );
        // Without conditional create a late marker of an older try could replace the one there:
        // its objects wait for the lease too.
        inv.conditional_create = false;
        assert_eq!(names(&inv), ["g2-model.safetensors.dla"]);

        // A marker naming a manifest that is not listed: the step is left whole.
        let mut inv = inventory(at);
        let key = layout::object(StepKind::Anchor, 5, "g3r2-manifest.json");
        inv.steps.values_mut().for_each(|e| e.objects.retain(|o| o.key != key));
        assert!(names(&inv).is_empty());
    }

    /// A sharded delta step committed by generation 5 whose scheduled anchor was never
    /// gathered: the ranks' slice bytes serve no reader. Kept while generation 5's lease is
    /// live (its committer may be gathering them), collected once it is not; the parts,
    /// segments, manifest and outcome stay.
    #[test]
    fn spent_slices_of_a_sharded_delta_go_once_its_committer_is_gone() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let policy = GcPolicy { grace: Duration::from_secs(600), ..GcPolicy::default() };
        let mut inv = Inventory { conditional_create: true, ..Default::default() };
        let names = [
            "g5-manifest.json",
            "g5-outcome.json",
            "g5-r00000-0000abcd-seg-0000.dls",
            "g5-r00000-0000abcd-edges.bin",
            "g5-r00000-0000abcd-part.json",
            "g5-r00000-0000abcd-slices.bin",
            "g5-r00001-00001234-slices.bin",
            "r00001-00001234-slices.bin", // untagged: kept
        ];
        for n in names {
            inv.add_object(info(layout::object(StepKind::Delta, 7, n), 100, at));
        }
        inv.add_marker(
            info(layout::ready(StepKind::Delta, 7), 10, at),
            marker(StepKind::Delta, 7, Some(6), "g5-manifest.json"),
        );
        let later = at + Duration::from_secs(900);
        let strays = |inv: &Inventory| -> Vec<String> {
            plan_inventory(inv, &policy, later)
                .strays
                .iter()
                .flat_map(|s| s.objects.iter().map(|k| k.rsplit('/').next().unwrap().to_string()))
                .collect()
        };
        let lease = |inv: &mut Inventory, renewed: SystemTime| {
            inv.leases
                .insert(5, LeaseEntry { info: info(layout::lease(5), 10, renewed), ttl: Duration::from_secs(60) });
        };
        lease(&mut inv, later - Duration::from_secs(10));
        assert!(strays(&inv).is_empty());
        lease(&mut inv, at);
        assert_eq!(strays(&inv), ["g5-r00000-0000abcd-slices.bin", "g5-r00001-00001234-slices.bin"]);
        // Within grace nothing is touched, lease or not.
        assert!(plan_inventory(&inv, &policy, at + Duration::from_secs(60)).strays.is_empty());

        // Out of retention (newer deltas and an anchor after it) while generation 5, live, may
        // still be gathering anchor 7 from the slices: the step stays whole (found by review:
        // it was deleted, slices included, under the gather); once the lease lapses it goes.
        for s in 8..=12u64 {
            let name = format!("g5-seg-{s}.dls");
            inv.add_object(info(layout::object(StepKind::Delta, s, &name), 100, at));
            inv.add_object(info(layout::object(StepKind::Delta, s, "g5-manifest.json"), 10, at));
            inv.add_marker(
                info(layout::ready(StepKind::Delta, s), 10, at),
                marker(StepKind::Delta, s, Some(s - 1), "g5-manifest.json"),
            );
        }
        inv.add_object(info(layout::object(StepKind::Anchor, 10, "g5-manifest.json"), 10, at));
        inv.add_marker(
            info(layout::ready(StepKind::Anchor, 10), 10, at),
            marker(StepKind::Anchor, 10, None, "g5-manifest.json"),
        );
        let tight = GcPolicy { keep_deltas: 2, keep_anchors: 1, ..policy.clone() };
        lease(&mut inv, later - Duration::from_secs(10));
        let p = plan_inventory(&inv, &tight, later);
        assert!(p.kept.iter().any(|k| k.step == 7 && k.reasons.contains(&KeepReason::Leased)), "{p}");
        assert!(!p.deleted.iter().any(|d| d.id() == StepId::delta(7)), "{p}");
        assert!(p.deleted.iter().any(|d| d.id() == StepId::delta(8)), "retention still applies: {p}");
        // Not for ever: slices the committer failed to delete pin the step for 6 hours at most.
        let much_later = at + Duration::from_secs(6 * 3600 + 60);
        lease(&mut inv, much_later - Duration::from_secs(10));
        let p = plan_inventory(&inv, &tight, much_later);
        assert!(p.deleted.iter().any(|d| d.id() == StepId::delta(7)), "{p}");
        lease(&mut inv, at);
        let p = plan_inventory(&inv, &tight, later);
        assert!(p.deleted.iter().any(|d| d.id() == StepId::delta(7)), "{p}");
    }
}
