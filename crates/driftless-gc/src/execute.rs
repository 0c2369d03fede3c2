//! Carrying out a [`GcPlan`]: markers first, newest first; then manifests; then payloads.

use std::time::{Duration, SystemTime};

use driftless_store::{layout, Bucket};
use futures::{StreamExt, TryStreamExt};
use serde::Serialize;

use crate::error::Result;
use crate::inventory::MarkerState;
use crate::inventory::StepId;
use crate::plan::{DeletedStep, GcPlan, StrayObjects};

/// Steps whose objects are deleted at once.
const STEPS_IN_FLIGHT: usize = 8;

/// What a collection did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GcReport {
    /// Whether this was a dry run (nothing deleted).
    pub dry_run: bool,
    /// The plan that was carried out (or would have been).
    pub plan: GcPlan,
    /// Ready steps removed.
    pub deleted_steps: usize,
    /// Incomplete steps removed.
    pub deleted_incomplete: usize,
    /// Delete requests sent (markers, manifests, payloads; deleting a missing key counts).
    pub deleted_objects: usize,
    /// Bytes freed (as listed when planning).
    pub bytes_freed: u64,
    /// Stray objects of kept steps removed.
    pub deleted_strays: usize,
    /// Incomplete steps left alone because they changed since planning (a marker appeared or
    /// an object was rewritten), and steps whose strays were left alone because their marker
    /// no longer names the planned manifest: a publisher is at work there.
    pub skipped: Vec<StepId>,
}

impl GcReport {
    fn new(plan: &GcPlan, dry_run: bool) -> GcReport {
        GcReport {
            dry_run,
            plan: plan.clone(),
            deleted_steps: 0,
            deleted_incomplete: 0,
            deleted_strays: 0,
            deleted_objects: 0,
            bytes_freed: 0,
            skipped: Vec::new(),
        }
    }

    /// The report of a dry run: the plan and nothing done.
    pub fn dry_run(plan: GcPlan) -> GcReport {
        GcReport::new(&plan, true)
    }
}

impl std::fmt::Display for GcReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{}", self.plan)?;
        if self.dry_run {
            return write!(f, "dry run: nothing deleted");
        }
        for s in &self.skipped {
            writeln!(f, "skipped {s}: changed since planning")?;
        }
        write!(
            f,
            "deleted {} steps, {} incomplete and {} stray objects ({} objects, {} bytes)",
            self.deleted_steps, self.deleted_incomplete, self.deleted_strays, self.deleted_objects, self.bytes_freed
        )
    }
}

/// Carry out `plan`.
///
/// 1. The ready markers of every deleted step, newest step first, one at a time: at every
///    moment each remaining marker's chain is intact (a chain only points to older steps,
///    and kept steps never depend on deleted ones), so an interrupted run leaves a valid
///    stream.
/// 2. Then, per step, the manifest, then the payload objects. A step whose marker is gone
///    is invisible to readers; if interrupted here its leftovers are an incomplete step that
///    the next run removes.
/// 3. Incomplete steps, each re-checked first (marker still absent, nothing written since the
///    grace cutoff); otherwise skipped.
/// 4. Stray objects of kept steps, once the step's marker is read again and still names the
///    manifest it named when planning, and the leases read again still cover none of them.
///
/// Deleting a missing key succeeds, so re-running a plan, or two collections at once, is
/// harmless.
pub async fn execute(bucket: &Bucket, plan: &GcPlan) -> Result<GcReport> {
    let mut report = GcReport::new(plan, false);

    let mut by_step: Vec<&DeletedStep> = plan.deleted.iter().collect();
    by_step.sort_by_key(|d| std::cmp::Reverse(d.id()));
    for d in &by_step {
        if let Some(marker) = &d.marker {
            bucket.delete(marker).await?;
            report.deleted_objects += 1;
            tracing::debug!(step = %d.id(), "deleted marker");
        }
    }
    let owned: Vec<DeletedStep> = by_step.into_iter().cloned().collect();
    let counts: Vec<usize> = futures::stream::iter(owned)
        .map(|d| {
            let bucket = bucket.clone();
            async move { delete_objects(&bucket, d.manifest.as_deref(), &d.objects).await }
        })
        .buffer_unordered(STEPS_IN_FLIGHT)
        .try_collect()
        .await?;
    for (d, n) in plan.deleted.iter().zip(&counts) {
        report.deleted_steps += 1;
        report.deleted_objects += n;
        report.bytes_freed += d.bytes;
    }

    let cutoff = SystemTime::UNIX_EPOCH + Duration::from_millis(plan.now_ms);
    let cutoff = cutoff.checked_sub(plan.policy.grace);
    for d in &plan.incomplete {
        if !still_incomplete(bucket, d, cutoff, plan).await? {
            tracing::info!(step = %d.id(), "incomplete step changed since planning; left alone");
            report.skipped.push(d.id());
            continue;
        }
        report.deleted_objects += delete_objects(bucket, d.manifest.as_deref(), &d.objects).await?;
        report.deleted_incomplete += 1;
        report.bytes_freed += d.bytes;
    }
    if !plan.strays.is_empty() {
        let leases = crate::inventory::load_leases(bucket).await?;
        let clock = bucket_clock(plan);
        let live = |g: u64| leases.get(&g).is_some_and(|l| l.live_at(clock));
        let conditional = bucket.supports_conditional_create();
        for d in &plan.strays {
            let Some(committed) = still_committed(bucket, d).await? else {
                tracing::info!(step = %d.id(), "marker changed since planning; strays left alone");
                report.skipped.push(d.id());
                continue;
            };
            // Those a lease read now covers are left for a later run.
            let keys: Vec<String> = d
                .objects
                .iter()
                .filter(|k| crate::inventory::is_stray_key(committed, k, live, conditional))
                .cloned()
                .collect();
            if keys.len() < d.objects.len() {
                tracing::info!(step = %d.id(), left = d.objects.len() - keys.len(), "a live lease covers strays now");
            }
            let n = keys.len();
            report.deleted_objects += delete_objects(bucket, None, &keys).await?;
            report.deleted_strays += n;
            if n == d.objects.len() {
                report.bytes_freed += d.bytes;
            }
        }
    }
    for key in plan.stale_claims.iter().chain(&plan.stale_leases) {
        bucket.delete(key).await?;
        report.deleted_objects += 1;
    }
    tracing::info!(
        steps = report.deleted_steps,
        incomplete = report.deleted_incomplete,
        strays = report.deleted_strays,
        bytes = report.bytes_freed,
        "collection done"
    );
    Ok(report)
}

/// The manifest first (if any), then the payload objects in parallel; returns how many.
async fn delete_objects(bucket: &Bucket, manifest: Option<&str>, objects: &[String]) -> Result<usize> {
    let mut n = 0;
    if let Some(m) = manifest {
        bucket.delete(m).await?;
        n += 1;
    }
    futures::stream::iter(objects.to_vec())
        .map(|k| {
            let bucket = bucket.clone();
            async move { bucket.delete(&k).await }
        })
        .buffer_unordered(STEPS_IN_FLIGHT)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(n + objects.len())
}

/// No marker now, and nothing in the step directory newer than the grace cutoff.
async fn still_incomplete(bucket: &Bucket, d: &DeletedStep, cutoff: Option<SystemTime>, plan: &GcPlan) -> Result<bool> {
    match bucket.head(&layout::ready(d.kind, d.step)).await {
        Ok(_) => return Ok(false),
        Err(e) if e.is_not_found() => {}
        Err(e) => return Err(e.into()),
    }
    let Some(cutoff) = cutoff else {
        return Ok(false);
    };
    let dir = match d.kind {
        driftless_format::StepKind::Delta => layout::delta_dir(d.step),
        driftless_format::StepKind::Anchor => layout::anchor_dir(d.step),
    };
    let now = bucket.list(&dir).await?;
    // A generation may have started (re-)uploading this step since planning: its lease,
    // read now, protects the step.
    let leases = crate::inventory::load_leases(bucket).await?;
    let clock = bucket_clock(plan);
    let leased = now
        .iter()
        .filter_map(|o| layout::parse_step_key(&o.key).and_then(|(_, _, n)| n))
        .filter_map(|n| layout::name_generation(&n))
        .any(|g| leases.get(&g).is_some_and(|l| l.live_at(clock)));
    Ok(!leased && now.iter().filter(|o| layout::parse_step_key(&o.key).is_some()).all(|o| o.last_modified <= cutoff))
}

/// The bucket's clock now, as the plan measured its offset from this host's (leases are
/// stamped by the bucket).
fn bucket_clock(plan: &GcPlan) -> SystemTime {
    let local = SystemTime::now();
    let off = Duration::from_millis(plan.clock_offset_ms.unsigned_abs());
    if plan.clock_offset_ms >= 0 {
        local + off
    } else {
        local.checked_sub(off).unwrap_or(local)
    }
}

/// The committed tag of a stray group's step, read again now: `None` unless its marker still
/// names the manifest it named when planning.
async fn still_committed(bucket: &Bucket, d: &StrayObjects) -> Result<Option<(u64, u32)>> {
    let key = layout::ready(d.kind, d.step);
    let bytes = match bucket.get_limited(&key, crate::inventory::MAX_MARKER_BYTES).await {
        Ok(b) => b,
        Err(e) if e.is_not_found() => return Ok(None),
        Err(driftless_store::Error::TooLarge { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let tag = match crate::inventory::parse_marker(&key, &bytes) {
        MarkerState::Ready(m) if m.manifest_name() == d.manifest => layout::name_tag(m.manifest_name()),
        _ => None,
    };
    // The manifest it names is there (a marker naming a missing one is left for a human).
    match (tag, bucket.head(&layout::object(d.kind, d.step, &d.manifest)).await) {
        (Some(t), Ok(_)) => Ok(Some(t)),
        (_, Err(e)) if !e.is_not_found() => Err(e.into()),
        _ => Ok(None),
    }
}
