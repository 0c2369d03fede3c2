//! One conformance suite, run against every backend: memory and file always; SeaweedFS, moto,
//! Azurite and fake-gcs-server when `.ci/services.sh start` exported their variables.
//! With `DRIFTLESS_REQUIRE_SERVERS=1` a missing variable fails the test instead of skipping.

use std::sync::Arc;

use bytes::Bytes;
use driftless_format::StepKind;
use driftless_store::{layout, Bucket, Error, StoreOptions};

/// Options small enough that a 40 MiB object goes through multipart upload (8 parts of
/// 5 MiB, S3's minimum) and parallel ranged GETs.
fn test_opts() -> StoreOptions {
    StoreOptions::default()
        .with_multipart_threshold(8 << 20)
        .with_part_size(5 << 20)
        .with_max_retries(3)
        .with_retry_timeout(std::time::Duration::from_secs(20))
}

fn unique_prefix(test: &str) -> String {
    format!("conformance/{test}-{:016x}", rand::random::<u64>())
}

/// `(endpoint, bucket)` from a `DRIFTLESS_TEST_*` variable, or None to skip.
fn server(var: &str) -> Option<(String, String)> {
    match std::env::var(var) {
        Ok(v) => {
            let mut it = v.split_whitespace();
            let endpoint = it.next().unwrap_or_else(|| panic!("{var} is empty")).to_string();
            let bucket = it.next().unwrap_or_else(|| panic!("{var}: expected \"ENDPOINT BUCKET\"")).to_string();
            Some((endpoint, bucket))
        }
        Err(_) => {
            if std::env::var("DRIFTLESS_REQUIRE_SERVERS").as_deref() == Ok("1") {
                panic!("{var} is not set but DRIFTLESS_REQUIRE_SERVERS=1 (run `source .ci/services.sh start`)");
            }
            eprintln!("skipping: {var} not set (see .ci/services.sh)");
            None
        }
    }
}

/// Deterministic pseudo-random bytes (no two parts alike, so misordered parts are caught).
fn pattern(len: usize, seed: u64) -> Bytes {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    Bytes::from(v)
}

struct Caps {
    /// 8 concurrent `put_create` on one key have exactly one winner.
    exact_create_race: bool,
}

async fn conformance(b: &Bucket, caps: Caps) {
    // --- put_create: write-once ---
    let stream = Bytes::from_static(b"{\"kind\":\"stream\"}");
    b.put_create(layout::STREAM, stream.clone()).await.expect("first put_create");
    let err = b.put_create(layout::STREAM, Bytes::from_static(b"other")).await.unwrap_err();
    assert!(matches!(err, Error::AlreadyExists { ref key } if key == layout::STREAM), "{err:?}");
    assert_eq!(b.get(layout::STREAM).await.unwrap(), stream);

    // --- put overwrites ---
    b.put(layout::LATEST, Bytes::from_static(b"one")).await.unwrap();
    b.put(layout::LATEST, Bytes::from_static(b"two")).await.unwrap();
    assert_eq!(b.get(layout::LATEST).await.unwrap(), Bytes::from_static(b"two"));

    // --- missing keys ---
    assert!(b.get("missing/key").await.unwrap_err().is_not_found());
    assert!(b.head("missing/key").await.unwrap_err().is_not_found());
    assert!(b.get_limited("missing/key", 10).await.unwrap_err().is_not_found());
    assert!(b.get_if_changed("missing/key", None).await.unwrap_err().is_not_found());

    // --- head ---
    let info = b.head(layout::STREAM).await.unwrap();
    assert_eq!(info.key, layout::STREAM);
    assert_eq!(info.size, stream.len() as u64);

    // --- get_limited ---
    let m = layout::manifest(StepKind::Delta, 12);
    let manifest = pattern(1000, 7);
    b.put_create(&m, manifest.clone()).await.unwrap();
    assert_eq!(b.get_limited(&m, 1000).await.unwrap(), manifest);
    match b.get_limited(&m, 999).await.unwrap_err() {
        Error::TooLarge { key, size, max } => {
            assert_eq!((key.as_str(), size, max), (m.as_str(), 1000, 999));
        }
        e => panic!("expected TooLarge, got {e:?}"),
    }

    // --- 40 MiB: multipart upload, parallel ranged get ---
    let big_key = layout::object(StepKind::Anchor, 10, "weights.bin");
    let big = pattern(40 << 20, 42);
    b.put_create(&big_key, big.clone()).await.expect("multipart put_create");
    assert_eq!(b.head(&big_key).await.unwrap().size, big.len() as u64);
    let got = b.get(&big_key).await.unwrap();
    assert!(got == big, "40 MiB round trip differs");
    assert!(b.put_create(&big_key, big.clone()).await.unwrap_err().is_already_exists());
    // Overwrite through multipart too.
    let big2 = pattern((40 << 20) + 123, 43);
    b.put(&big_key, big2.clone()).await.unwrap();
    assert!(b.get(&big_key).await.unwrap() == big2);

    // --- get_if_changed ---
    let (bytes, etag) = b.get_if_changed(layout::LATEST, None).await.unwrap().expect("unconditional");
    assert_eq!(bytes, Bytes::from_static(b"two"));
    let etag = etag.expect("backend reports an ETag");
    assert_eq!(b.get_if_changed(layout::LATEST, Some(&etag)).await.unwrap(), None);
    b.put(layout::LATEST, Bytes::from_static(b"three")).await.unwrap();
    let (bytes, etag2) = b.get_if_changed(layout::LATEST, Some(&etag)).await.unwrap().expect("changed after overwrite");
    assert_eq!(bytes, Bytes::from_static(b"three"));
    assert_ne!(etag2.as_deref(), Some(etag.as_str()));

    // --- list / list_after with zero-padded steps ---
    // Lexicographic order is step order for steps below 10^12 (12 digits).
    let steps = [1000u64, 2, 100, 1, 10, 999_999_999_999];
    for s in steps {
        b.put_create(&layout::ready(StepKind::Delta, s), Bytes::from(format!("{s}"))).await.unwrap();
    }
    b.put_create(&layout::ready(StepKind::Anchor, 10), Bytes::from_static(b"a")).await.unwrap();
    let mut sorted = steps.to_vec();
    sorted.sort();
    let listed = b.list(layout::ready_prefix(StepKind::Delta)).await.unwrap();
    let listed_steps: Vec<u64> = listed
        .iter()
        .map(|o| match layout::parse_step_key(&o.key) {
            Some((StepKind::Delta, s, None)) => s,
            other => panic!("unexpected key {} -> {other:?}", o.key),
        })
        .collect();
    assert_eq!(listed_steps, sorted);
    assert!(listed.iter().all(|o| o.size > 0));
    let after = b.list_after(layout::ready_prefix(StepKind::Delta), &layout::ready(StepKind::Delta, 10)).await.unwrap();
    let after: Vec<String> = after.into_iter().map(|o| o.key).collect();
    let expect: Vec<String> = sorted.iter().filter(|s| **s > 10).map(|s| layout::ready(StepKind::Delta, *s)).collect();
    assert_eq!(after, expect);
    // Offset need not exist; string prefixes need not end at a '/'.
    let after = b.list_after("ready/", "ready/deltas/000000000050").await.unwrap();
    assert_eq!(after.first().map(|o| o.key.as_str()), Some("ready/deltas/000000000100"));
    assert_eq!(after.len(), 3);
    let partial = b.list("ready/deltas/00000000001").await.unwrap();
    assert_eq!(partial.len(), 1, "{partial:?}");
    let all = b.list("").await.unwrap();
    let keys: Vec<&str> = all.iter().map(|o| o.key.as_str()).collect();
    let mut keys_sorted = keys.clone();
    keys_sorted.sort();
    assert_eq!(keys, keys_sorted);
    assert!(keys.contains(&layout::STREAM) && keys.contains(&big_key.as_str()));
    assert_eq!(all.len(), 4 + steps.len() + 1, "{keys:?}");
    // Listings are bounded: one key over the limit fails the listing, whatever the backend.
    let n = all.len();
    let capped = |max| Bucket::from_store(b.store().clone(), b.prefix(), &b.options().clone().with_max_list_keys(max));
    let e = capped(n - 1).list("").await.unwrap_err();
    assert!(matches!(e, Error::TooManyKeys { max, .. } if max == n - 1), "{e:?}");
    assert!(!e.is_retryable(), "{e:?}");
    assert_eq!(capped(n).list("").await.unwrap().len(), n);
    // And in the bytes of what they keep: entries the prefix filter drops are not held, so a
    // cap that the whole listing overflows still holds one key of it.
    let entry = |o: &driftless_store::ObjectInfo| {
        std::mem::size_of::<driftless_store::ObjectInfo>() + o.key.len() + o.etag.as_ref().map_or(0, String::len)
    };
    let total: usize = all.iter().map(entry).sum();
    let bytes_capped =
        |max| Bucket::from_store(b.store().clone(), b.prefix(), &b.options().clone().with_max_list_bytes(max));
    let e = bytes_capped(total - 1).list("").await.unwrap_err();
    assert!(matches!(e, Error::ListTooLarge { max_bytes, .. } if max_bytes == total - 1), "{e:?}");
    assert!(!e.is_retryable(), "{e:?}");
    assert_eq!(bytes_capped(total).list("").await.unwrap().len(), n);
    let one = all.iter().find(|o| o.key == layout::ready(StepKind::Delta, 1000)).expect("listed");
    let held = bytes_capped(entry(one)).list(&layout::ready(StepKind::Delta, 1000)).await.unwrap();
    assert_eq!(held.len(), 1, "{held:?}");

    // --- delete ---
    b.delete(layout::LATEST).await.unwrap();
    assert!(b.get(layout::LATEST).await.unwrap_err().is_not_found());
    b.delete(layout::LATEST).await.expect("deleting a missing key is ok");
    b.delete("never/existed").await.expect("deleting a missing key is ok");

    // --- invalid keys ---
    assert!(matches!(b.get("a//b").await, Err(Error::InvalidKey { .. })));
    assert!(matches!(b.get("../x").await, Err(Error::InvalidKey { .. })));

    // --- race: 8 concurrent put_create on one key ---
    if caps.exact_create_race {
        let key = "race/marker";
        let tasks: Vec<_> = (0..8u8)
            .map(|i| {
                let b = b.clone();
                tokio::spawn(async move { b.put_create(key, Bytes::from(vec![i; 16])).await })
            })
            .collect();
        let mut winners = Vec::new();
        for (i, t) in tasks.into_iter().enumerate() {
            match t.await.unwrap() {
                Ok(()) => winners.push(i as u8),
                Err(e) => assert!(e.is_already_exists(), "{e:?}"),
            }
        }
        assert_eq!(winners.len(), 1, "winners: {winners:?}");
        assert_eq!(b.get(key).await.unwrap(), Bytes::from(vec![winners[0]; 16]));
    }

    // Leave the shared servers clean.
    for o in b.list("").await.unwrap() {
        b.delete(&o.key).await.unwrap();
    }
    assert!(b.list("").await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory() {
    let b = Bucket::open(&format!("memory:///{}", unique_prefix("mem")), &test_opts()).unwrap();
    assert!(b.supports_conditional_create());
    conformance(&b, Caps { exact_create_race: true }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn file() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("does/not/exist/yet");
    let b = Bucket::open(&format!("file://{}", root.display()), &test_opts()).unwrap();
    assert!(root.is_dir());
    conformance(&b, Caps { exact_create_race: true }).await;
}

fn s3_bucket(var: &str, test: &str) -> Option<Bucket> {
    let (endpoint, bucket) = server(var)?;
    let opts = test_opts().with_endpoint(endpoint).with_allow_http(true).with_region("us-east-1");
    Some(Bucket::open(&format!("s3://{bucket}/{}", unique_prefix(test)), &opts).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3_seaweedfs() {
    let Some(b) = s3_bucket("DRIFTLESS_TEST_S3_SEAWEED", "seaweed") else {
        return;
    };
    // Conditional create works, but races take seconds there: skip the race.
    conformance(&b, Caps { exact_create_race: false }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3_moto() {
    let Some(b) = s3_bucket("DRIFTLESS_TEST_S3_MOTO", "moto") else {
        return;
    };
    conformance(&b, Caps { exact_create_race: true }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn azurite() {
    let Some((endpoint, container)) = server("DRIFTLESS_TEST_AZURITE") else {
        return;
    };
    let opts = test_opts().with_endpoint(endpoint).with_allow_http(true);
    let b = Bucket::open(&format!("az://{container}/{}", unique_prefix("azurite")), &opts).unwrap();
    conformance(&b, Caps { exact_create_race: true }).await;
}

/// fake-gcs-server rejects object_store's uploads, so objects are seeded through its JSON API
/// and only the read path (get, ranged get, get_limited, head, list, delete) is checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gcs_read_path() {
    let Some((endpoint, bucket)) = server("DRIFTLESS_TEST_GCS") else {
        return;
    };
    let prefix = unique_prefix("gcs");
    let http = reqwest::Client::new();
    let seed = |key: String, body: Bytes| {
        let http = http.clone();
        let url = format!("{endpoint}/upload/storage/v1/b/{bucket}/o");
        async move {
            let resp = http
                .post(url)
                .query(&[("uploadType", "media"), ("name", key.as_str())])
                .body(body)
                .send()
                .await
                .unwrap();
            assert!(resp.status().is_success(), "seeding {key}: {}", resp.status());
        }
    };
    let big = pattern((12 << 20) + 5, 9);
    let manifest = pattern(500, 3);
    seed(format!("{prefix}/{}", layout::manifest(StepKind::Delta, 3)), manifest.clone()).await;
    seed(format!("{prefix}/{}", layout::object(StepKind::Delta, 3, "w.bin")), big.clone()).await;
    for s in [3u64, 20, 100] {
        seed(format!("{prefix}/{}", layout::ready(StepKind::Delta, s)), Bytes::from_static(b"r")).await;
    }

    let opts = test_opts().with_endpoint(endpoint.clone()).with_allow_http(true);
    let b = Bucket::open(&format!("gs://{bucket}/{prefix}"), &opts).unwrap();
    let m = layout::manifest(StepKind::Delta, 3);
    assert_eq!(b.get(&m).await.unwrap(), manifest);
    assert_eq!(b.get_limited(&m, 500).await.unwrap(), manifest);
    assert!(matches!(b.get_limited(&m, 499).await, Err(Error::TooLarge { size: 500, .. })));
    let w = layout::object(StepKind::Delta, 3, "w.bin");
    assert_eq!(b.head(&w).await.unwrap().size, big.len() as u64);
    assert!(b.get(&w).await.unwrap() == big, "ranged read differs");
    assert!(b.get("missing").await.unwrap_err().is_not_found());
    let (bytes, _) = b.get_if_changed(&m, None).await.unwrap().unwrap();
    assert_eq!(bytes, manifest);
    let ready = b.list(layout::ready_prefix(StepKind::Delta)).await.unwrap();
    let keys: Vec<String> = ready.iter().map(|o| o.key.clone()).collect();
    assert_eq!(keys, [3u64, 20, 100].map(|s| layout::ready(StepKind::Delta, s)).to_vec());
    // start-after is ignored by fake-gcs-server; the client-side filter keeps this right.
    let after = b.list_after(layout::ready_prefix(StepKind::Delta), &layout::ready(StepKind::Delta, 3)).await.unwrap();
    assert_eq!(after.len(), 2);
    for o in b.list("").await.unwrap() {
        b.delete(&o.key).await.unwrap();
    }
    b.delete("missing").await.unwrap();
    assert!(b.list("").await.unwrap().is_empty());
}

/// Two buckets on one store with different prefixes do not see each other's keys.
#[tokio::test]
async fn prefixes_isolate() {
    let store: Arc<dyn driftless_store::ObjectStore> = Arc::new(object_store::memory::InMemory::new());
    let a = Bucket::from_store(store.clone(), "streams/a", &test_opts());
    let b2 = Bucket::from_store(store.clone(), "streams/ab", &test_opts());
    a.put("k", Bytes::from_static(b"a")).await.unwrap();
    b2.put("k", Bytes::from_static(b"b")).await.unwrap();
    assert_eq!(a.list("").await.unwrap().len(), 1);
    assert_eq!(a.get("k").await.unwrap(), Bytes::from_static(b"a"));
    assert_eq!(b2.list("").await.unwrap()[0].key, "k");
}

/// Ready steps after a step, across the 12-digit width of step keys (found by review: steps
/// of 10^12 and more are accepted, but their 13-digit keys sort before 12-digit ones that
/// start with 2..9, so a start-after listing from step 2*10^11 never saw step 10^12 + 5 and a
/// stream crossing the width stopped for its agents). On a local directory and on S3.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ready_steps_after_a_step_cross_the_key_width() {
    use driftless_store::stream::StreamReader;
    let dir = tempfile::tempdir().unwrap();
    let mut buckets = vec![Bucket::open(&format!("file://{}", dir.path().display()), &test_opts()).unwrap()];
    buckets.extend(s3_bucket("DRIFTLESS_TEST_S3_SEAWEED", "width"));
    for b in buckets {
        let steps = [7u64, 200_000_000_000, 999_999_999_999, 1_000_000_000_005, 12_345_678_901_234];
        for s in steps {
            b.put_create(&layout::ready(StepKind::Delta, s), Bytes::from_static(b"m")).await.unwrap();
        }
        let r = StreamReader::new(b.clone(), driftless_format::TrustSet::new().allow_unsigned(true));
        for after in [None, Some(7), Some(200_000_000_000), Some(999_999_999_999), Some(1_000_000_000_005)] {
            let want: Vec<u64> = steps.iter().copied().filter(|s| after.is_none_or(|a| *s > a)).collect();
            assert_eq!(r.ready_steps(StepKind::Delta, after).await.unwrap(), want, "after {after:?} on {}", b.url());
        }
    }
}
