//! A bucket written by someone else: markers planted beside manifests of their own, a garbled
//! manifest under the newest anchor, a flood of unverifiable markers. GC must keep the steps
//! agents can verify, and never let unverifiable ones take their places (found by review:
//! four planted markers made a collection delete every real step).

mod common;

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use common::*;
use driftless_format::sign::Keypair;
use driftless_format::{StepKind, TrustSet};
use driftless_gc::{execute, plan, GcPolicy, KeepReason, StepId};
use driftless_store::layout;

/// Junk under a marker whose SHA-256 names it (the one check a marker alone allows).
async fn plant_junk(b: &driftless_store::Bucket, id: StepId, base: Option<u64>) {
    let junk = Bytes::from_static(b"junk, not a manifest");
    b.put(&layout::manifest(id.kind, id.step), junk.clone()).await.unwrap();
    b.put(&layout::ready(id.kind, id.step), marker_for(id, base, &junk, 0)).await.unwrap();
}

fn later() -> SystemTime {
    SystemTime::now() + Duration::from_secs(3600)
}

#[tokio::test]
async fn planted_markers_do_not_take_the_real_steps_places() {
    for tb in buckets("planted") {
        let b = &tb.bucket;
        write_steps(b, &regular(33, 10, SystemTime::now(), Duration::from_secs(1))).await;
        write_stream_json(b).await;
        plant_junk(b, StepId::anchor(1000), None).await;
        for s in 2000..2003 {
            plant_junk(b, StepId::delta(s), Some(s - 1)).await;
        }
        let policy = GcPolicy::new().with_keep_deltas(3).with_keep_anchors(1).with_grace(Duration::from_secs(60));
        let p = plan(b, &policy, later()).await.unwrap();
        assert_eq!((p.newest_anchor, p.newest_step), (Some(30), Some(33)), "{}: {p}", tb.name);
        execute(b, &p).await.unwrap();
        let ready = assert_markers_complete(b).await;
        for id in [StepId::anchor(30), StepId::delta(31), StepId::delta(32), StepId::delta(33)] {
            assert!(ready.contains_key(&id), "{}: {id} deleted", tb.name);
        }
        for s in [1000, 2000, 2001, 2002] {
            let k = p.kept.iter().find(|k| k.step == s).unwrap_or_else(|| panic!("{}: {s} not kept: {p}", tb.name));
            assert_eq!(k.reasons, [KeepReason::UnreadableMarker], "{}: {p}", tb.name);
        }
        // Retention still applies to the real steps.
        assert!(!ready.contains_key(&StepId::anchor(20)), "{}", tb.name);
    }
}

/// A marker planted beside a well-formed manifest of its own passes every check but the
/// signature: with `--trust`, GC checks that too.
#[tokio::test]
async fn with_trusted_keys_an_unsigned_planted_step_is_not_the_newest() {
    for tb in buckets("planted-signed") {
        let b = &tb.bucket;
        let key = Keypair::generate();
        write_stream_json(b).await;
        write_step_signed(b, StepId::anchor(0), None, Some(&key)).await;
        for s in 1..=5 {
            write_step_signed(b, StepId::delta(s), Some(s - 1), Some(&key)).await;
        }
        // Well-formed, unsigned: an agent trusting `key` refuses them.
        write_step_signed(b, StepId::anchor(100), None, None).await;
        write_step_signed(b, StepId::delta(101), Some(100), None).await;
        let policy = GcPolicy::new()
            .with_keep_deltas(1)
            .with_keep_anchors(1)
            .with_grace(Duration::from_secs(60))
            .with_trust(Some(TrustSet::new().with_key(key.public())));
        let p = plan(b, &policy, later()).await.unwrap();
        assert_eq!((p.newest_anchor, p.newest_step), (Some(0), Some(5)), "{}: {p}", tb.name);
        assert!(p.deleted.is_empty(), "{}: the real chain is anchor 0 + deltas 1..5: {p}", tb.name);
        assert!(p.to_string().contains(&format!("manifests checked against {}", key.id())), "{p}");
        // A key that signed nothing here: every step fails, nothing is deleted.
        let other = GcPolicy::new()
            .with_keep_deltas(1)
            .with_keep_anchors(1)
            .with_grace(Duration::from_secs(60))
            .with_trust(Some(TrustSet::new().with_key(Keypair::generate().public())));
        let p = plan(b, &other, later()).await.unwrap();
        assert!(p.deleted.is_empty() && p.newest_anchor.is_none(), "{}: {p}", tb.name);
    }
}

/// Writes this stream's anchor 0 + deltas 1..5 and another run's anchor 100 + delta 101, all
/// signed by one key, the other run's markers carrying `marker_stream`. Returns a policy that
/// trusts the key and keeps one step of each kind.
async fn chain_and_another_run(b: &driftless_store::Bucket, marker_stream: &str) -> GcPolicy {
    let key = Keypair::generate();
    write_step_signed(b, StepId::anchor(0), None, Some(&key)).await;
    for s in 1..=5 {
        write_step_signed(b, StepId::delta(s), Some(s - 1), Some(&key)).await;
    }
    for (id, base) in [(StepId::anchor(100), None), (StepId::delta(101), Some(100))] {
        let objects = vec![(payload_name(id.kind, 0), Bytes::from(vec![7u8; 20]))];
        let m = manifest_of_stream(id, base, &objects, Some(&key), "another-run");
        let mut marker: serde_json::Value = serde_json::from_slice(&marker_for(id, base, &m, 20)).unwrap();
        marker["stream_id"] = marker_stream.into();
        b.put(&layout::object(id.kind, id.step, &objects[0].0), objects[0].1.clone()).await.unwrap();
        b.put(&layout::manifest(id.kind, id.step), m.clone()).await.unwrap();
        b.put(&layout::ready(id.kind, id.step), Bytes::from(serde_json::to_vec(&marker).unwrap())).await.unwrap();
    }
    GcPolicy::new()
        .with_keep_deltas(1)
        .with_keep_anchors(1)
        .with_grace(Duration::from_secs(60))
        .with_trust(Some(TrustSet::new().with_key(key.public())))
}

/// A run's manifest (signed by the same key, as a team's runs often are) replayed under a
/// marker forged with this stream's id: agents refuse it ("signed for another stream"), so GC
/// must not count it either. Found by review: the check compared the marker with stream.json
/// and the manifest with the marker's step, base and size, never the manifest's stream.
#[tokio::test]
async fn a_manifest_of_another_run_under_a_forged_marker_takes_no_place() {
    for tb in buckets("replayed-run") {
        let b = &tb.bucket;
        write_stream_json(b).await;
        let policy = chain_and_another_run(b, "test-stream").await;
        let p = plan(b, &policy, later()).await.unwrap();
        assert_eq!((p.newest_anchor, p.newest_step), (Some(0), Some(5)), "{}: {p}", tb.name);
        assert!(p.deleted.is_empty(), "{}: the real chain is anchor 0 + deltas 1..5: {p}", tb.name);
    }
}

/// Found by review: anchor 30's manifest no longer matched its marker (bit rot, a bad copy);
/// agents refuse it and fall back to anchor 20 + deltas 21..33, but GC took anchor 30 for the
/// newest anchor and deleted anchor 20 and its deltas: no cold reader could start.
#[tokio::test]
async fn a_garbled_newest_anchor_keeps_the_route_agents_fall_back_to() {
    for tb in buckets("garbled-anchor") {
        let b = &tb.bucket;
        write_steps(b, &regular(33, 10, SystemTime::now(), Duration::from_secs(1))).await;
        write_stream_json(b).await;
        b.put(&layout::manifest(StepKind::Anchor, 30), Bytes::from(vec![b'x'; 64])).await.unwrap();
        let policy = GcPolicy::new().with_keep_deltas(3).with_keep_anchors(1).with_grace(Duration::from_secs(60));
        let p = plan(b, &policy, later()).await.unwrap();
        assert_eq!((p.newest_anchor, p.newest_step), (Some(20), Some(33)), "{}: {p}", tb.name);
        execute(b, &p).await.unwrap();
        let ready = assert_markers_complete(b).await;
        let mut route = vec![StepId::anchor(20)];
        route.extend((21..=33).map(StepId::delta));
        for id in route {
            assert!(ready.contains_key(&id), "{}: {id} deleted", tb.name);
        }
        assert!(ready.contains_key(&StepId::anchor(30)), "{}: left for a human", tb.name);
    }
}

/// More unverifiable markers than a collection checks: it stops, deleting nothing, and says
/// retrying will not help.
#[tokio::test]
async fn a_flood_of_unverifiable_markers_stops_the_collection() {
    let tb = file_bucket();
    let b = &tb.bucket;
    write_steps(b, &regular(12, 10, SystemTime::now(), Duration::from_secs(1))).await;
    for s in 0..=driftless_gc::MAX_UNVERIFIED as u64 {
        plant_junk(b, StepId::anchor(1000 + s), None).await;
    }
    let e = plan(b, &GcPolicy::new().with_grace(Duration::ZERO), later()).await.unwrap_err();
    assert!(!e.is_retryable(), "{e}");
    assert!(e.to_string().contains("ready markers fail the manifest check"), "{e}");
    let e = driftless_gc::run(b, &GcPolicy::new().with_grace(Duration::ZERO), false).await.unwrap_err();
    assert!(matches!(e, driftless_gc::Error::Unverifiable { kind: StepKind::Anchor, .. }), "{e}");
    assert!(assert_markers_complete(b).await.contains_key(&StepId::anchor(0)));
}

/// Another run's steps (markers and manifests of its own stream, signed by the same key)
/// copied into a prefix whose `stream.json` is gone or garbled: GC cannot tell them from this
/// stream's, and on the old code they took the newest and kept places and the real chain was
/// deleted. Now the collection stops with nothing deleted, and says why.
#[tokio::test]
async fn without_a_readable_stream_json_nothing_is_deleted() {
    for (case, stream_json) in [("missing", None), ("garbled", Some(Bytes::from_static(b"{\"kind\":\"stream\"")))] {
        for tb in buckets(&format!("no-stream-{case}")) {
            let b = &tb.bucket;
            let policy = chain_and_another_run(b, "another-run").await;
            if let Some(body) = &stream_json {
                b.put(layout::STREAM, body.clone()).await.unwrap();
            }
            let err = plan(b, &policy, later()).await.unwrap_err();
            assert!(matches!(err, driftless_gc::Error::NoStream { .. }), "{}: {err}", tb.name);
            assert!(!err.is_retryable(), "{}: {err}", tb.name);
            assert!(err.to_string().contains("stream.json") && err.to_string().contains("nothing deleted"), "{err}");
            let err = driftless_gc::run(b, &policy, false).await.unwrap_err();
            assert!(matches!(err, driftless_gc::Error::NoStream { .. }), "{}: {err}", tb.name);
            let ready = assert_markers_complete(b).await;
            assert_eq!(ready.len(), 8, "{}: every step is still there", tb.name);

            // The same bucket once stream.json is back: the real chain is this stream's.
            write_stream_json(b).await;
            let p = plan(b, &policy, later()).await.unwrap();
            assert_eq!((p.newest_anchor, p.newest_step), (Some(0), Some(5)), "{}: {p}", tb.name);
            assert!(p.deleted.is_empty(), "{}: {p}", tb.name);
        }
    }
}

/// A prefix with neither markers nor `stream.json` (a publisher's first start) is not an
/// error: there is nothing to tell apart.
#[tokio::test]
async fn an_empty_prefix_without_stream_json_is_collected() {
    for tb in buckets("no-stream-empty") {
        let p = plan(&tb.bucket, &GcPolicy::new(), later()).await.unwrap();
        assert!(p.deleted.is_empty() && p.newest_step.is_none(), "{}: {p}", tb.name);
    }
}
