//! Retry behaviour, driven by FaultyStore over an in-memory store.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use driftless_store::{Bucket, Error, FaultKind, FaultOp, FaultyStore, StoreOptions};
use object_store::memory::InMemory;

fn opts() -> StoreOptions {
    StoreOptions::default().with_max_retries(4).with_retry_timeout(Duration::from_secs(10))
}

fn faulty() -> (Arc<FaultyStore>, Bucket) {
    let store = Arc::new(FaultyStore::new(Arc::new(InMemory::new())));
    let bucket = Bucket::from_store(store.clone(), "p", &opts());
    (store, bucket)
}

#[tokio::test]
async fn transient_put_faults_are_retried() {
    let (store, b) = faulty();
    store.inject(FaultOp::Put, "manifest", 2, FaultKind::Transient);
    b.put_create("deltas/000000000001/manifest.json", Bytes::from_static(b"m")).await.unwrap();
    assert_eq!(store.injected(), 2);
    assert_eq!(b.get("deltas/000000000001/manifest.json").await.unwrap(), Bytes::from_static(b"m"));
}

/// Found by review: on a store without conditional create (`hf://`) the write-once put was sent
/// once, so one 503 on a marker or manifest failed the step (and `flush` republished it as an
/// anchor). Both modes retry it.
#[tokio::test]
async fn transient_put_create_faults_are_retried_without_conditional_create_too() {
    for conditional in [true, false] {
        let (store, b) = faulty();
        let b = b.with_conditional_create(conditional);
        store.inject(FaultOp::Put, "ready/", 2, FaultKind::Transient);
        b.put_create("ready/deltas/000000000001", Bytes::from_static(b"r")).await.unwrap();
        assert_eq!(store.injected(), 2, "conditional create {conditional}");
        assert_eq!(b.get("ready/deltas/000000000001").await.unwrap(), Bytes::from_static(b"r"));
        // Still write-once: the HEAD before the put finds it.
        let err = b.put_create("ready/deltas/000000000001", Bytes::from_static(b"x")).await.unwrap_err();
        assert!(matches!(err, Error::AlreadyExists { .. }), "conditional create {conditional}: {err:?}");
    }
}

#[tokio::test]
async fn retries_are_bounded_by_count() {
    let (store, b) = faulty();
    store.inject(FaultOp::Get, "x", 100, FaultKind::Transient);
    b.put("x", Bytes::from_static(b"1")).await.unwrap();
    let err = b.get_limited("x", 10).await.unwrap_err();
    assert!(err.is_retryable(), "{err:?}");
    assert_eq!(store.injected(), 5, "1 attempt + 4 retries");
}

#[tokio::test]
async fn retries_are_bounded_by_time() {
    let store = Arc::new(FaultyStore::new(Arc::new(InMemory::new())));
    let o = opts().with_max_retries(1000).with_retry_timeout(Duration::from_millis(700));
    let b = Bucket::from_store(store.clone(), "", &o);
    store.inject(FaultOp::Put, "", 1000, FaultKind::Transient);
    let t = Instant::now();
    assert!(b.put("k", Bytes::from_static(b"v")).await.unwrap_err().is_retryable());
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert!(store.injected() >= 2);
}

#[tokio::test]
async fn permanent_faults_are_not_retried() {
    let (store, b) = faulty();
    store.inject(FaultOp::Put, "k", 5, FaultKind::Permanent);
    let err = b.put("k", Bytes::from_static(b"v")).await.unwrap_err();
    assert!(matches!(err, Error::Permanent { .. }), "{err:?}");
    assert!(!err.is_retryable());
    assert_eq!(store.injected(), 1);
}

/// A put_create whose response was lost must not report AlreadyExists on its own retry.
#[tokio::test]
async fn lost_put_create_response_is_success() {
    let (store, b) = faulty();
    store.inject(FaultOp::Put, "ready/", 1, FaultKind::LostResponse);
    b.put_create("ready/deltas/000000000001", Bytes::from_static(b"r")).await.unwrap();
    assert_eq!(store.injected(), 1);
    // A real competitor with other bytes still loses.
    let err = b.put_create("ready/deltas/000000000001", Bytes::from_static(b"other")).await.unwrap_err();
    assert!(err.is_already_exists());
}

#[tokio::test]
async fn list_and_delete_faults_are_retried() {
    let (store, b) = faulty();
    b.put("a/1", Bytes::from_static(b"1")).await.unwrap();
    store.inject(FaultOp::List, "p", 2, FaultKind::Transient);
    store.inject(FaultOp::Delete, "a/1", 2, FaultKind::Transient);
    assert_eq!(b.list("a/").await.unwrap().len(), 1);
    b.delete("a/1").await.unwrap();
    assert!(b.list("a/").await.unwrap().is_empty());
    assert_eq!(store.injected(), 4);
}

#[tokio::test]
async fn ranged_get_part_faults_are_retried() {
    let store = Arc::new(FaultyStore::new(Arc::new(InMemory::new())));
    let o = opts().with_part_size(1000).with_multipart_threshold(4000);
    let b = Bucket::from_store(store.clone(), "", &o);
    let data = Bytes::from((0..10_000u32).map(|i| (i % 251) as u8).collect::<Vec<_>>());
    b.put("big", data.clone()).await.unwrap();
    store.inject(FaultOp::Get, "big", 3, FaultKind::Transient);
    assert_eq!(b.get("big").await.unwrap(), data);
    assert_eq!(store.injected(), 3);
}

#[tokio::test]
async fn builder_style_and_delay() {
    let inner = Arc::new(InMemory::new());
    let store = Arc::new(
        FaultyStore::new(inner).fail_puts_matching("a", 1).fail_gets_matching("a", 1).delay(Duration::from_millis(20)),
    );
    let b = Bucket::from_store(store.clone(), "", &opts());
    let t = Instant::now();
    b.put("a", Bytes::from_static(b"1")).await.unwrap();
    assert_eq!(b.get("a").await.unwrap(), Bytes::from_static(b"1"));
    assert!(t.elapsed() >= Duration::from_millis(60));
    assert_eq!(store.injected(), 2);
    store.clear();
}

#[tokio::test]
async fn concurrency_is_bounded() {
    // 40 parallel GETs of 50 ms each through a bucket limited to 4 in flight: >= 10 rounds.
    let store = Arc::new(FaultyStore::new(Arc::new(InMemory::new())));
    let b = Bucket::from_store(store.clone(), "", &opts().with_concurrency(4));
    b.put("k", Bytes::from_static(b"v")).await.unwrap();
    store.set_delay(Duration::from_millis(50));
    let t = Instant::now();
    let reads = (0..40).map(|_| b.get_limited("k", 10));
    futures::future::try_join_all(reads).await.unwrap();
    assert!(t.elapsed() >= Duration::from_millis(450), "{:?}", t.elapsed());
}

/// Compile-time check: every call's future can be handed to `tokio::spawn`.
#[allow(dead_code)]
fn futures_are_spawnable(b: Bucket) {
    tokio::spawn(async move {
        b.put_create("k", Bytes::new()).await.ok();
        b.put("k", Bytes::new()).await.ok();
        b.get("k").await.ok();
        b.get_limited("k", 1).await.ok();
        b.get_if_changed("k", Some("e")).await.ok();
        b.head("k").await.ok();
        b.list("").await.ok();
        b.list_after("", "k").await.ok();
        b.delete("k").await.ok();
    });
}

/// A GET whose body runs past the range asked (64 MiB for 100 bytes, as a hostile endpoint
/// may send with a matching Content-Range): the read stops at the first chunk past the bound
/// (it collected the whole body before), the retry reads the real bytes. The same for a
/// bounded whole-object read, refused as too large.
#[tokio::test]
async fn a_body_longer_than_asked_is_cut_off_not_collected() {
    let (store, b) = faulty();
    b.put("x", Bytes::from(vec![7u8; 4096])).await.unwrap();
    store.inject(FaultOp::Get, "x", 1, FaultKind::LongBody(64));
    assert_eq!(b.get_range_of("x", 0..100).await.unwrap(), Bytes::from(vec![7u8; 100]));
    assert!(store.body_mib_sent() <= 1, "{} MiB pulled for 100 bytes", store.body_mib_sent());
    store.inject(FaultOp::Get, "x", 1, FaultKind::LongBody(64));
    let e = b.get_limited("x", 8192).await.unwrap_err();
    assert!(matches!(e, Error::TooLarge { .. }), "{e:?}");
    assert!(store.body_mib_sent() <= 2, "{} MiB pulled for 4 KiB", store.body_mib_sent());
}

/// Found by review: one FIFO pool for every request queued a lease renewal (a small put)
/// behind every part of an anchor's uploads, so on a slow link the lease lapsed and commits
/// failed. Small requests have a pool of their own: with the bulk pool full of slow puts and
/// more queued, a small put, a listing, a head and a delete each finish before any bulk put.
#[tokio::test]
async fn small_requests_do_not_queue_behind_bulk_transfers() {
    let store = Arc::new(FaultyStore::new(Arc::new(InMemory::new())));
    let b = Bucket::from_store(store.clone(), "p", &opts().with_concurrency(2));
    store.inject(FaultOp::Put, "bulk/", 6, FaultKind::Slow(Duration::from_millis(800)));
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut bulk = Vec::new();
    for i in 0..6 {
        let (b, done) = (b.clone(), done.clone());
        bulk.push(tokio::spawn(async move {
            b.put(&format!("bulk/{i}"), Bytes::from(vec![7u8; (1 << 20) + 1])).await.unwrap();
            done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }));
    }
    // Let the bulk puts take both permits and queue the rest.
    tokio::time::sleep(Duration::from_millis(100)).await;
    b.put("leases/g1", Bytes::from_static(b"lease")).await.unwrap();
    b.put_create("ready/deltas/000000000001", Bytes::from_static(b"r")).await.unwrap();
    b.list("leases/").await.unwrap();
    b.head("leases/g1").await.unwrap();
    b.delete("leases/g1").await.unwrap();
    assert_eq!(done.load(std::sync::atomic::Ordering::SeqCst), 0, "a small request waited for a bulk put");
    for h in bulk {
        h.await.unwrap();
    }
    assert_eq!(done.load(std::sync::atomic::Ordering::SeqCst), 6);
}
