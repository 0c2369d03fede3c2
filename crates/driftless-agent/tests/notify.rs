//! The generic notify adapters (webhook, exec) against a small recording HTTP server. The
//! SGLang and vLLM adapters are tested against the engines' own route code instead
//! (`integration/engines/`, run by `.ci/engines.sh`): a server written here that answers 200 to
//! anything proves nothing about them.

use std::sync::{Arc, Mutex};

use driftless_agent::notify::Notifier;
use driftless_format::Digest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

type Calls = Arc<Mutex<Vec<(String, String)>>>;

/// Serves HTTP/1.1, records (path, body), answers 200 — or `fail_status` for `fail_path`.
async fn server(fail_path: Option<&'static str>, fail_status: u16) -> (String, Calls) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let calls: Calls = Arc::default();
    let c2 = calls.clone();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = l.accept().await.unwrap();
            let calls = c2.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut tmp = [0u8; 4096];
                loop {
                    let n = s.read(&mut tmp).await.unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    buf.extend_from_slice(&tmp[..n]);
                    let text = String::from_utf8_lossy(&buf).to_string();
                    if let Some(h) = text.find("\r\n\r\n") {
                        let len = text[..h]
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse::<usize>().unwrap())
                            })
                            .unwrap_or(0);
                        if buf.len() >= h + 4 + len {
                            break;
                        }
                    }
                }
                let text = String::from_utf8_lossy(&buf).to_string();
                let path = text.split_whitespace().nth(1).unwrap_or("").to_string();
                let body = text.split_once("\r\n\r\n").map(|x| x.1.to_string()).unwrap_or_default();
                let status = if Some(path.as_str()) == fail_path { fail_status } else { 200 };
                calls.lock().unwrap().push((path, body));
                let resp = format!("HTTP/1.1 {status} X\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}");
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    (url, calls)
}

#[tokio::test]
async fn http_and_exec_and_server_errors() {
    let (url, calls) = server(None, 200).await;
    let root = Digest::of(b"x");
    let n: Notifier = format!("http={url}/hook").parse().unwrap();
    n.notify(&reqwest::Client::new(), 9, root, std::path::Path::new("/w"), None).await.unwrap();
    let body: serde_json::Value = serde_json::from_str(&calls.lock().unwrap()[0].1).unwrap();
    assert_eq!(body["step"], 9);
    assert_eq!(body["weights_root"], root.to_hex());
    // A 5xx is retried (3 attempts) and then reported.
    let (url, calls) = server(Some("/hook"), 503).await;
    let n: Notifier = format!("http={url}/hook").parse().unwrap();
    assert!(n.notify(&reqwest::Client::new(), 1, root, std::path::Path::new("/w"), None).await.is_err());
    assert_eq!(calls.lock().unwrap().len(), 3);
    // exec gets the facts in its environment.
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("o");
    let n: Notifier = format!("exec=echo $DRIFTLESS_STEP $DRIFTLESS_WEIGHTS_ROOT $DRIFTLESS_DIR > {}", out.display())
        .parse()
        .unwrap();
    n.notify(&reqwest::Client::new(), 5, root, std::path::Path::new("/w"), None).await.unwrap();
    assert_eq!(std::fs::read_to_string(&out).unwrap().trim(), format!("5 {} /w", root.to_hex()));
    let n: Notifier = "exec=exit 3".parse().unwrap();
    assert!(n.notify(&reqwest::Client::new(), 5, root, std::path::Path::new("/w"), None).await.is_err());
    // A target that is down.
    let n: Notifier = "http=http://127.0.0.1:9/".parse().unwrap();
    assert!(n.notify(&reqwest::Client::new(), 5, root, std::path::Path::new("/w"), None).await.is_err());
}

/// A target whose answer never ends (a proxy, a webhook gone wrong) costs the agent at most
/// the first MiB of it: the notify returns, and the rest is never read (found by review: the
/// whole body was read into memory, bounded only by the load timeout).
#[tokio::test]
async fn an_answer_that_never_ends_is_read_only_in_part() {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", l.local_addr().unwrap());
    let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let s2 = sent.clone();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut tmp = [0u8; 65536];
        let _ = s.read(&mut tmp).await;
        s.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n").await.unwrap();
        let chunk = [b'x'; 65536];
        loop {
            let head = format!("{:x}\r\n", chunk.len());
            let ok = s.write_all(head.as_bytes()).await.is_ok()
                && s.write_all(&chunk).await.is_ok()
                && s.write_all(b"\r\n").await.is_ok();
            if !ok {
                break;
            }
            s2.fetch_add(chunk.len() as u64, std::sync::atomic::Ordering::SeqCst);
        }
    });
    let n: Notifier = format!("http={url}").parse().unwrap();
    let done = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        n.notify(&reqwest::Client::new(), 1, Digest::of(b"x"), std::path::Path::new("/w"), None),
    )
    .await;
    assert!(matches!(done, Ok(Ok(()))), "{done:?}");
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let sent = sent.load(std::sync::atomic::Ordering::SeqCst);
    // (The first MiB, and what the sockets' buffers held when the agent let go.)
    assert!(sent < 64 << 20, "{sent} bytes sent: read on");
}
