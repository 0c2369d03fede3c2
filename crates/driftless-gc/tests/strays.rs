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

/// The manifest `g..-manifest.json` of anchor 4, naming its try's `g..-w.dla`.
fn manifest(name: &str) -> Bytes {
    let obj = name.replace("manifest.json", "w.dla");
    manifest_of(StepId::anchor(4), None, &[(obj, Bytes::from_static(b"12345"))])
}

fn marker(manifest_name: &str) -> Bytes {
    Bytes::from(
        serde_json::to_vec(&ReadyMarker {
            kind: "ready".into(),
            stream_id: "test-stream".into(),
            of: StepKind::Anchor,
            step: 4,
            base_step: None,
            manifest_sha256: Digest::of(&manifest(manifest_name)),
            payload_bytes: 5,
            manifest: Some(manifest_name.into()),
        })
        .unwrap(),
    )
}

/// Anchor 4 committed by try 2 of generation 3; tries 0, 1 and 3 left objects.
async fn write(b: &Bucket) {
    write_stream_json(b).await;
    for name in [
        "g3-manifest.json",
        "g3-w.dla",
        "g3r1-w.dla",
        "g3r2-manifest.json",
        "g3r2-w.dla",
        "g3r3-manifest.json",
        "g3r3-w.dla",
    ] {
        let body = if name.ends_with("manifest.json") { manifest(name) } else { Bytes::from_static(b"12345") };
        b.put(&layout::object(StepKind::Anchor, 4, name), body).await.unwrap();
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

/// Markers agents would not use (another stream's, one naming a manifest that is not there,
/// an anchor marker with a base step) are left for a human and never taken as the newest
/// anchor or step: found by review, a foreign anchor marker at step 1000 became GC's newest
/// anchor, and with one anchor kept every real step went, the newest anchor and chain
/// included ("never deleted, whatever the other settings").
#[tokio::test]
async fn markers_agents_would_not_use_never_displace_the_newest_steps() {
    for tb in buckets("unusable-markers") {
        let b = &tb.bucket;
        write_steps(b, &regular(25, 10, SystemTime::now(), Duration::from_secs(1))).await;
        write_stream_json(b).await;
        let bad = |stream: &str, step: u64, base: Option<u64>| {
            Bytes::from(
                serde_json::to_vec(&ReadyMarker {
                    kind: "ready".into(),
                    stream_id: stream.into(),
                    of: StepKind::Anchor,
                    step,
                    base_step: base,
                    manifest_sha256: Digest([7; 32]),
                    payload_bytes: 5,
                    manifest: None,
                })
                .unwrap(),
            )
        };
        // Another stream's anchor, whole; this stream's anchor without objects; a malformed one.
        b.put(&layout::manifest(StepKind::Anchor, 1000), Bytes::from_static(b"m")).await.unwrap();
        b.put(&layout::ready(StepKind::Anchor, 1000), bad("other-stream", 1000, None)).await.unwrap();
        b.put(&layout::ready(StepKind::Anchor, 1001), bad("test-stream", 1001, None)).await.unwrap();
        b.put(&layout::manifest(StepKind::Anchor, 1002), Bytes::from_static(b"m")).await.unwrap();
        b.put(&layout::ready(StepKind::Anchor, 1002), bad("test-stream", 1002, Some(1))).await.unwrap();
        let policy = GcPolicy::new().with_keep_deltas(0).with_keep_anchors(1).with_grace(Duration::from_secs(60));
        // An hour later: every object is past grace (written now, whatever `regular` says).
        let p = plan(b, &policy, SystemTime::now() + Duration::from_secs(3600)).await.unwrap();
        assert_eq!((p.newest_anchor, p.newest_step), (Some(20), Some(25)), "{}: {p}", tb.name);
        let deleted: Vec<StepId> = p.deleted.iter().map(|d| d.id()).collect();
        for keep in
            [StepId::anchor(20), StepId::delta(25), StepId::anchor(1000), StepId::anchor(1001), StepId::anchor(1002)]
        {
            assert!(!deleted.contains(&keep), "{}: {keep:?} deleted: {p}", tb.name);
        }
        for s in [1000, 1001, 1002] {
            let k = p.kept.iter().find(|k| k.step == s).unwrap_or_else(|| panic!("{}: {s} not kept: {p}", tb.name));
            assert!(k.reasons.contains(&driftless_gc::KeepReason::UnreadableMarker), "{}: {p}", tb.name);
        }
        // And the real retention still applies: anchor 10 and delta 15 go.
        assert!(deleted.contains(&StepId::anchor(10)) && deleted.contains(&StepId::delta(15)), "{}: {p}", tb.name);
    }
}

/// GC takes "now" from the bucket's clock: leases and object ages are stamped by the bucket.
/// Found by review: with this host's clock two minutes ahead of the bucket's, a lease renewed
/// seconds ago looked expired and the upload it protects (grace 0) was deleted under it.
#[tokio::test]
async fn a_bucket_clock_behind_this_host_does_not_expire_a_live_lease() {
    use driftless_store::object_store::memory::InMemory;
    use driftless_store::FaultyStore;
    let faulty = std::sync::Arc::new(FaultyStore::new(std::sync::Arc::new(InMemory::new())));
    faulty.set_clock_offset_ms(-120_000);
    let b = Bucket::from_store(faulty.clone(), "stream", &test_opts());
    write_stream_json(&b).await;
    // Anchor 30 being uploaded by generation 4, whose lease (TTL 60 s) was just renewed.
    for n in ["g4-manifest.json", "g4-model-00001.safetensors.dla"] {
        b.put(&layout::object(StepKind::Anchor, 30, n), Bytes::from_static(b"x")).await.unwrap();
    }
    b.put(&layout::lease(4), Bytes::from_static(br#"{"kind":"lease","ttl_ms":60000}"#)).await.unwrap();
    let policy = GcPolicy::new().with_grace(Duration::ZERO);
    // By this host's clock the lease expired a minute ago: that plan deletes the upload.
    let by_host = plan(&b, &policy, SystemTime::now()).await.unwrap();
    assert_eq!(by_host.incomplete.len(), 1, "{by_host}");
    // By the bucket's, it is live: nothing is deleted.
    let r = driftless_gc::run(&b, &policy, false).await.unwrap();
    assert_eq!((r.deleted_objects, r.deleted_incomplete), (0, 0), "{r}");
    assert_eq!(b.list(&layout::anchor_dir(30)).await.unwrap().len(), 2);
}
