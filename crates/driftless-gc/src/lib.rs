#![doc = include_str!("../README.md")]
#![warn(missing_docs, unreachable_pub, rustdoc::broken_intra_doc_links)]

mod error;
mod execute;
mod inventory;
mod plan;
mod policy;

use std::time::SystemTime;

use driftless_store::Bucket;

pub use error::{Error, Result};
pub use execute::{execute, GcReport};
pub use inventory::{Inventory, LeaseEntry, MarkerState, StepEntry, StepId, MAX_LEASE_TTL, MAX_UNVERIFIED};
pub use plan::{plan_inventory, DeletedStep, GcPlan, KeepReason, KeptStep, StrayObjects};
pub use policy::{parse_duration, GcPolicy, DEFAULT_GRACE, DEFAULT_KEEP_ANCHORS, DEFAULT_KEEP_DELTAS};

/// List the bucket and plan a collection as of `now` (nothing is deleted).
///
/// `now` is a parameter so that tests and dry runs can ask "what would happen later".
pub async fn plan(bucket: &Bucket, policy: &GcPolicy, now: SystemTime) -> Result<GcPlan> {
    let mut inv = Inventory::load(bucket).await?;
    inv.verify_newest(bucket, policy).await?;
    Ok(plan_inventory(&inv, policy, now))
}

/// Plan at the current time and, unless `dry_run`, carry the plan out.
///
/// This is the entry point for `driftless gc` and for a publisher that runs retention
/// itself on a schedule. It is safe to run while publishers and agents are active and
/// concurrently with other collections; an error or an interruption leaves the stream
/// valid, and the next run finishes the job.
pub async fn run(bucket: &Bucket, policy: &GcPolicy, dry_run: bool) -> Result<GcReport> {
    let mut inv = Inventory::load(bucket).await?;
    inv.verify_newest(bucket, policy).await?;
    // Leases and object ages are stamped by the bucket's clock: "now" must be the bucket's
    // too. With this host's, minutes ahead, a live publisher's lease looked expired and its
    // upload was deleted under it (found by review). Only for an existing stream, so that an
    // empty prefix stays empty for a publisher's first start, and not for a dry run, which
    // writes nothing. Where it cannot be written (a role allowed to list, read and delete
    // only), this host's clock, with a warning.
    let local = SystemTime::now();
    let now = match inv.stream_id {
        Some(_) if !dry_run => match bucket_now(bucket).await {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "could not read the bucket's clock (write {}); planning with this host's", driftless_store::layout::GC_CLOCK);
                local
            }
        },
        _ => local,
    };
    let mut plan = plan_inventory(&inv, policy, now);
    plan.clock_offset_ms = match now.duration_since(local) {
        Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_millis()).unwrap_or(i64::MAX),
    };
    if dry_run {
        return Ok(GcReport::dry_run(plan));
    }
    execute(bucket, &plan).await
}

/// The bucket's clock: the modification time it gives an empty object GC rewrites
/// ([`driftless_store::layout::GC_CLOCK`]; S3 stamps whole seconds, so this is up to a second
/// early, which only makes leases look younger).
pub async fn bucket_now(bucket: &Bucket) -> Result<SystemTime> {
    bucket.put(driftless_store::layout::GC_CLOCK, bytes::Bytes::new()).await?;
    Ok(bucket.head(driftless_store::layout::GC_CLOCK).await?.last_modified)
}

#[cfg(test)]
mod tests {
    /// The publisher spawns collections on its runtime: the futures must be `Send`.
    #[allow(dead_code)]
    fn futures_are_send(b: &driftless_store::Bucket, p: &super::GcPolicy, plan: &super::GcPlan) {
        fn send<T: Send>(_: T) {}
        send(super::run(b, p, false));
        send(super::plan(b, p, std::time::SystemTime::now()));
        send(super::execute(b, plan));
    }
}
