//! An S3 endpoint that misbehaves at the HTTP level, served from this test (a real socket, the
//! real S3 client): a listing whose pages are empty but say "more to come" forever, a
//! throttling storm, and a body longer than the object's declared size. Each must end within
//! its bound, with a bounded number of requests and bounded memory.

use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

use driftless_store::{Bucket, Error, StoreOptions};
#[path = "support/hostile_s3.rs"]
mod hostile_s3;
use hostile_s3::{serve, serve_streaming};

fn open(endpoint: &str, opts: StoreOptions) -> Bucket {
    // Credentials are only signed with; the server never checks them. Every test of this
    // binary sets the same values.
    std::env::set_var("AWS_ACCESS_KEY_ID", "test");
    std::env::set_var("AWS_SECRET_ACCESS_KEY", "test");
    Bucket::open("s3://bkt/run", &opts.with_endpoint(endpoint).with_allow_http(true)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_of_endless_empty_pages_ends_at_its_deadline() {
    let (url, n) = serve(|line| match line.contains("list-type=2") {
        true => (
            200,
            "<ListBucketResult><IsTruncated>true</IsTruncated>\
             <NextContinuationToken>t</NextContinuationToken></ListBucketResult>"
                .into(),
        ),
        false => (404, "<Error><Code>NoSuchKey</Code></Error>".into()),
    })
    .await;
    let b = open(&url, StoreOptions::default().with_list_timeout(Duration::from_secs(2)));
    let t = Instant::now();
    let e = b.list("ready/deltas/").await.unwrap_err();
    let secs = t.elapsed().as_secs_f64();
    assert!(matches!(e, Error::ListTimeout { secs: 2, .. }), "{e}");
    assert!(e.is_retryable(), "{e}");
    // Not started again by the retry layer: one deadline for the whole call.
    assert!((1.9..6.0).contains(&secs), "ended after {secs} s");
    assert!(n.load(SeqCst) > 2, "the server was asked for more pages");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttling_storm_costs_one_request_per_retry() {
    let (url, n) =
        serve(|_| (503, "<Error><Code>SlowDown</Code><Message>Reduce your request rate.</Message></Error>".into()))
            .await;
    let b = open(&url, StoreOptions::default().with_max_retries(3).with_retry_timeout(Duration::from_secs(30)));
    let e = b.get_limited("stream.json", 1 << 16).await.unwrap_err();
    assert!(e.is_retryable(), "{e}");
    // One retry layer: 1 + 3 requests (two layers made it 4 x 4).
    assert_eq!(n.load(SeqCst), 4, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_longer_than_the_declared_object_is_cut_off() {
    // The HEAD says 16 bytes; the GET sends 8 MiB (an object replaced in between, or a lying
    // endpoint). The read stops after one part instead of holding whatever arrives.
    let (url, n) = serve(|line| match line.starts_with("HEAD ") {
        true => (200, "x".repeat(16)),
        false => (200, "x".repeat(8 << 20)),
    })
    .await;
    let b = open(&url, StoreOptions::default().with_part_size(1 << 20).with_max_retries(1));
    let e = b.get("deltas/000000000001/manifest.json").await.unwrap_err();
    assert!(e.is_retryable(), "{e}");
    assert!(e.to_string().contains("more than one part"), "{e}");
    // One HEAD, then the GET and its one retry.
    assert_eq!(n.load(SeqCst), 3, "{e}");
}

/// Found by review: a request the HTTP client refuses to build (here a plain `http://`
/// endpoint without allow-http, as `--endpoint HTTP://...` was before its scheme was compared
/// case-insensitively) was retried for seconds and then called temporary. It never reaches the
/// server: one permanent error at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_client_refuses_to_build_is_permanent() {
    let (url, n) = serve(|_| (404, "<Error><Code>NoSuchKey</Code></Error>".into())).await;
    std::env::remove_var("AWS_ALLOW_HTTP");
    std::env::remove_var("ALLOW_HTTP");
    std::env::set_var("AWS_ACCESS_KEY_ID", "test");
    std::env::set_var("AWS_SECRET_ACCESS_KEY", "test");
    let opts =
        StoreOptions::default().with_endpoint(url).with_max_retries(3).with_retry_timeout(Duration::from_secs(30));
    let b = Bucket::open("s3://bkt/run", &opts).unwrap();
    let t = Instant::now();
    let e = b.get_limited("stream.json", 1 << 16).await.unwrap_err();
    assert!(!e.is_retryable(), "{e}");
    assert!(e.to_string().contains("builder error"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(1), "retried: {:?}", t.elapsed());
    assert_eq!(n.load(SeqCst), 0, "{e}");
}

/// An endpoint that answers every request with an error whose body is 16 MiB: the error
/// reported (kept and logged by agents at every poll) is one bounded line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_with_a_huge_body_is_one_bounded_line() {
    let (url, _) = serve(|_| {
        (500, format!("<Error><Code>InternalError</Code><Message>{}\n</Message></Error>", "m".repeat(16 << 20)))
    })
    .await;
    let b = open(&url, StoreOptions::default().with_max_retries(1).with_retry_timeout(Duration::from_secs(30)));
    let e = b.get_limited("stream.json", 1 << 16).await.unwrap_err();
    let s = e.to_string();
    assert!(s.len() < 4096, "{} bytes of error", s.len());
    assert!(!s.contains('\n'), "more than one line");
}

/// The client collects an error response's body before it fails (for the message, at every
/// retry): a 256 MiB error body is read only up to its bound (`http_bounds::MAX_ERROR_BODY`)
/// and the connection dropped, so a request holds kilobytes, not the body. Fails without the
/// bound: every byte is sent and held, twice (the retry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_error_body_is_not_read() {
    let (url, sent) = serve_streaming(|_| (500, 256 << 20)).await;
    let b = open(&url, StoreOptions::default().with_max_retries(1).with_retry_timeout(Duration::from_secs(30)));
    let e = b.get_limited("stream.json", 1 << 16).await.unwrap_err();
    assert!(e.is_retryable(), "{e}");
    assert!(e.to_string().len() < 4096, "{e}");
    let sent = sent.load(SeqCst);
    assert!(sent < 64 << 20, "{sent} bytes of error body sent for two requests");
}

/// A listing page is collected whole by the client too: one of 256 MiB fails at 16 MiB
/// (`http_bounds::MAX_SMALL_BODY`) instead of being held, once: not retryable, since the
/// endpoint would send it again. Fails without the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_listing_page_is_refused() {
    let (url, sent) = serve_streaming(|line| match line.contains("list-type=2") {
        true => (200, 256 << 20),
        false => (404, 16),
    })
    .await;
    let b = open(&url, StoreOptions::default().with_max_retries(1).with_retry_timeout(Duration::from_secs(30)));
    let e = b.list("ready/deltas/").await.unwrap_err();
    assert!(e.to_string().len() < 4096, "{e}");
    assert!(e.to_string().contains("response body over"), "{e}");
    assert!(!e.is_retryable(), "{e}");
    let sent = sent.load(SeqCst);
    assert!(sent < 48 << 20, "{sent} bytes of listing sent");
}
