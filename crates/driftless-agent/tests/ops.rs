//! The operations endpoint on a real socket: `/healthz`, `/readyz` (503 before the first
//! verified step, 200 after), `/metrics` (Prometheus text), `/v1/status` (JSON) and
//! `POST /v1/poll` (wakes the poll loop).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use driftless_agent::Agent;
use driftless_format::gen::{ModelSpec, RlChain};
use driftless_format::{Keypair, TrustSet};
use driftless_publisher::PublisherBuilder;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ops_endpoints() {
    let tb = file_bucket();
    let key = Keypair::from_seed([8; 32]);
    let trust = TrustSet::new().with_key(key.public());
    let mut a = Agent::new(tb.bucket.clone(), config(tb.dir.path().join("a"), trust)).unwrap();
    let poke = Arc::new(tokio::sync::Notify::new());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(driftless_agent::server::serve(l, a.metrics(), poke.clone()));
    let http = reqwest::Client::new();
    let get = |p: &str| {
        let (http, url) = (http.clone(), format!("{base}{p}"));
        async move {
            let r = http.get(url).send().await.unwrap();
            let ctype = r.headers().get("content-type").map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
            (r.status().as_u16(), ctype, r.text().await.unwrap())
        }
    };
    assert_eq!(get("/healthz").await.0, 200);
    assert_eq!(get("/readyz").await.0, 503, "not ready before a verified step");
    assert_eq!(get("/nope").await.0, 404);
    let (_, _, m) = get("/metrics").await;
    assert!(m.contains("\ndriftless_step -1\n"), "{m}");
    let (_, ctype, s) = get("/v1/status").await;
    assert_eq!(ctype, "application/json");
    let v: serde_json::Value = serde_json::from_str(&s).unwrap();
    assert!(v["step"].is_null() && v["ready"] == false, "{v}");

    // Publish two steps (anchor + delta), sync once.
    let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(128 << 10), 2e-6, 1);
    let (b, k) = (tb.bucket.clone(), key.clone());
    let mut p = tokio::task::block_in_place(|| {
        PublisherBuilder::new("x").with_bucket(b).with_key(k).with_anchor_every(100).build().unwrap()
    });
    for step in 0..2 {
        if step > 0 {
            chain.step();
        }
        tokio::task::block_in_place(|| {
            p.publish(step, &chain.views()).unwrap();
            p.flush().unwrap();
        });
    }
    let o = a.sync_once().await.unwrap();
    assert_eq!(o.step, 1);
    assert_bits(&a, &snapshot(&chain));
    let (code, _, body) = get("/readyz").await;
    assert_eq!((code, body.as_str()), (200, "ready\n"));
    let (code, ctype, m) = get("/metrics").await;
    assert_eq!(code, 200);
    assert!(ctype.starts_with("text/plain"), "{ctype}");
    // Prometheus text: every sample has HELP and TYPE, and the values are the agent's.
    for (name, value) in [
        ("driftless_step", "1"),
        ("driftless_lag_steps", "0"),
        ("driftless_anchor_downloads_total", "1"),
        ("driftless_syncs_total", "1"),
        ("driftless_verify_failures_total", "0"),
    ] {
        assert!(m.contains(&format!("# TYPE {name} ")), "{name} TYPE missing:\n{m}");
        assert!(m.contains(&format!("# HELP {name} ")), "{name} HELP missing");
        assert!(m.lines().any(|l| l == format!("{name} {value}")), "{name} != {value}:\n{m}");
    }
    let anchor_bytes: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("driftless_bytes_downloaded_total{path=\"anchor\"} "))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(anchor_bytes, o.bytes);
    for l in m.lines().filter(|l| !l.starts_with('#')) {
        let (_, v) = l.rsplit_once(' ').unwrap();
        assert!(v.parse::<f64>().is_ok(), "not a sample: {l}");
    }
    let v: serde_json::Value = serde_json::from_str(&get("/v1/status").await.2).unwrap();
    assert_eq!(v["step"], 1);
    assert_eq!(v["newest_ready"], 1);
    assert_eq!(v["ready"], true);
    assert_eq!(v["bytes"]["anchor"], o.bytes);
    // POST /v1/poll wakes whoever waits on the poke.
    let woke = tokio::spawn({
        let poke = poke.clone();
        async move { tokio::time::timeout(Duration::from_secs(5), poke.notified()).await.is_ok() }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let r = http.post(format!("{base}/v1/poll")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 202);
    assert!(woke.await.unwrap(), "POST /v1/poll did not wake the poller");
    assert_eq!(http.get(format!("{base}/v1/poll")).send().await.unwrap().status().as_u16(), 404, "poll is POST only");
    tokio::task::block_in_place(|| p.close().unwrap());
}

/// A client that sends its request head a byte every second is cut off at the head deadline
/// (the 5 s timeout was per read, so such a client held its connection for
/// hours), and a crowd of silent clients does not keep `/healthz` from answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_silent_clients_are_bounded() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let metrics = Arc::new(driftless_agent::metrics::Metrics::new());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(driftless_agent::server::serve(l, metrics, Arc::new(tokio::sync::Notify::new())));

    let t = std::time::Instant::now();
    let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
    let trickle = async {
        for b in b"GET /healthz HTTP/1.1\r\nx-padding: aaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n" {
            if slow.write_all(&[*b]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(20), trickle).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), slow.read_to_end(&mut answer)).await;
    assert!(t.elapsed() < Duration::from_secs(15), "a trickling client held its connection for {:?}", t.elapsed());

    // 100 silent clients (more than are served at once), then a real request.
    let mut silent = Vec::new();
    for _ in 0..100 {
        silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    let t = std::time::Instant::now();
    let r = reqwest::Client::new().get(format!("http://{addr}/healthz")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
}
