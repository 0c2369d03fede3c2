//! Stray objects of a committed step (what a failed try, or another generation, left in its
//! directory) on real buckets: removed once past grace, except when the step's marker has
//! changed since planning (a late marker of the try the plan took for a stray).

mod common;

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use common::*;
use driftless_format::{Digest, ReadyMarker, StepKind};
use driftless_gc::{execute, plan, GcPolicy, StepId};
use driftless_store::{layout, Bucket};

fn marker(manifest: &str) -> Bytes {
    Bytes::from(
        serde_json::to_vec(&ReadyMarker {
            kind: "ready".into(),
            stream_id: "test-stream".into(),
            of: StepKind::Anchor,
            step: 4,
            base_step: None,
            manifest_sha256: Digest([7; 32]),
            payload_bytes: 5,
            manifest: Some(manifest.into()),
        })
        .unwrap(),
    )
}

/// Anchor 4 committed by try 2 of generation 3; tries 0, 1 and 3 left objects.
async fn write(b: &Bucket) {
    for name in [
        "g3-manifest.json",
        "g3-w.dla",
        "g3r1-w.dla",
        "g3r2-manifest.json",
        "g3r2-w.dla",
        "g3r3-manifest.json",
        "g3r3-w.dla",
    ] {
        b.put(&layout::object(StepKind::Anchor, 4, name), Bytes::from_static(b"12345")).await.unwrap();
    }
    b.put(&layout::ready(StepKind::Anchor, 4), marker("g3r2-manifest.json")).await.unwrap();
}

async fn names(b: &Bucket) -> Vec<String> {
    let listed = b.list(&layout::anchor_dir(4)).await.unwrap();
    listed.into_iter().map(|o| o.key.rsplit('/').next().unwrap().to_string()).collect()
}

#[tokio::test]
async fn strays_of_a_committed_step_are_removed_past_grace() {
    for tb in buckets("strays") {
        let b = &tb.bucket;
        write(b).await;
        let policy = GcPolicy::new().with_grace(Duration::from_secs(600));
        // Within grace: nothing.
        let p = plan(b, &policy, SystemTime::now()).await.unwrap();
        assert!(p.strays.is_empty(), "{}: {p}", tb.name);

        let later = SystemTime::now() + Duration::from_secs(3600);
        let p = plan(b, &policy, later).await.unwrap();
        assert_eq!(p.strays.len(), 1, "{}: {p}", tb.name);
        let r = execute(b, &p).await.unwrap();
        assert_eq!(r.deleted_strays, 5, "{}: {r}", tb.name);
        assert_eq!(names(b).await, ["g3r2-manifest.json", "g3r2-w.dla"], "{}", tb.name);
        assert!(b.get(&layout::ready(StepKind::Anchor, 4)).await.is_ok(), "{}", tb.name);
    }
}

#[tokio::test]
async fn strays_are_left_when_the_marker_changed_since_planning() {
    for tb in buckets("strays-changed") {
        let b = &tb.bucket;
        write(b).await;
        let policy = GcPolicy::new().with_grace(Duration::from_secs(600));
        let p = plan(b, &policy, SystemTime::now() + Duration::from_secs(3600)).await.unwrap();
        assert_eq!(p.strays.len(), 1, "{}: {p}", tb.name);
        // Try 3's marker lands late (a store without conditional create): its objects are no
        // longer strays.
        b.put(&layout::ready(StepKind::Anchor, 4), marker("g3r3-manifest.json")).await.unwrap();
        let r = execute(b, &p).await.unwrap();
        assert_eq!(r.deleted_strays, 0, "{}: {r}", tb.name);
        assert_eq!(r.skipped, [StepId::anchor(4)], "{}: {r}", tb.name);
        assert_eq!(names(b).await.len(), 7, "{}", tb.name);
    }
}

/// A publisher generation's lease (what `driftless_publisher` writes), renewed now.
async fn lease(b: &Bucket, generation: u64) {
    let body = serde_json::json!({
        "kind": "lease", "stream_id": "test-stream", "generation": generation, "holder": "test:1",
        "renewed_at_ms": 0, "ttl_ms": 600_000, "world_size": null
    });
    b.put(&layout::lease(generation), Bytes::from(body.to_string())).await.unwrap();
}

#[tokio::test]
async fn a_lease_taken_since_planning_keeps_its_newer_try() {
    for tb in buckets("strays-leased") {
        let b = &tb.bucket;
        assert!(b.supports_conditional_create(), "{}", tb.name);
        write(b).await;
        let policy = GcPolicy::new().with_grace(Duration::from_secs(600));
        let p = plan(b, &policy, SystemTime::now() + Duration::from_secs(3600)).await.unwrap();
        assert_eq!(p.strays[0].objects.len(), 5, "{}: {p}", tb.name);
        // Generation 3 is live again by the time the plan runs: its newer try (which could
        // still be committing) stays; its older tries go.
        lease(b, 3).await;
        let r = execute(b, &p).await.unwrap();
        assert_eq!(r.deleted_strays, 3, "{}: {r}", tb.name);
        assert_eq!(
            names(b).await,
            ["g3r2-manifest.json", "g3r2-w.dla", "g3r3-manifest.json", "g3r3-w.dla"],
            "{}",
            tb.name
        );
    }
}
