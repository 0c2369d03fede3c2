//! A minimal HTTP/1.1 endpoint for operations: `/healthz`, `/readyz`, `/metrics`,
//! `/v1/status`, and `POST /v1/poll` (trigger an immediate poll). Hand-rolled on tokio to keep
//! the sidecar small; it reads at most 8 KiB of request head within 5 s, serves 64 connections
//! at a time, and ignores bodies.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::metrics::Metrics;

/// Connections served at once; more wait in the listen backlog.
const MAX_CONNECTIONS: usize = 64;

/// Time a client has to send its request head, in all (a per-read timeout let a client that
/// sends a byte every few seconds hold a connection for hours).
const HEAD_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// Serves until the task is dropped. `poll` is notified on `POST /v1/poll`.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, poll: Arc<tokio::sync::Notify>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else { return };
        let mut sock = match listener.accept().await {
            Ok((sock, _)) => sock,
            Err(e) => {
                // Out of descriptors (EMFILE) fails every accept at once: retrying without a
                // pause spun a core.
                tracing::debug!(error = %e, "ops endpoint: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let metrics = metrics.clone();
        let poll = poll.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let mut buf = vec![0u8; 8192];
            let mut n = 0;
            // Read until the end of the head, the buffer is full or the deadline.
            let read = async {
                while n < buf.len() {
                    match sock.read(&mut buf[n..]).await {
                        Ok(0) | Err(_) => break,
                        Ok(k) => n += k,
                    }
                    if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
            };
            let _ = tokio::time::timeout(HEAD_DEADLINE, read).await;
            let head = String::from_utf8_lossy(&buf[..n]);
            let mut parts = head.split_whitespace();
            let method = parts.next().unwrap_or("");
            let path = parts.next().unwrap_or("");
            let (code, ctype, body) = route(method, path, &metrics, &poll);
            let resp = format!(
                "HTTP/1.1 {code}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            // A client that does not read its answer is not waited on for long either.
            let write = async {
                let _ = sock.write_all(resp.as_bytes()).await;
                let _ = sock.shutdown().await;
            };
            let _ = tokio::time::timeout(HEAD_DEADLINE, write).await;
        });
    }
}

fn route(method: &str, path: &str, m: &Metrics, poll: &tokio::sync::Notify) -> (&'static str, &'static str, String) {
    match (method, path) {
        ("GET", "/healthz") => ("200 OK", "text/plain", "ok\n".into()),
        ("GET", "/readyz") => {
            if m.ready.load(Relaxed) == 1 {
                ("200 OK", "text/plain", "ready\n".into())
            } else {
                (
                    "503 Service Unavailable",
                    "text/plain",
                    "no verified step loaded (yet, or since a load failed)\n".into(),
                )
            }
        }
        ("GET", "/metrics") => ("200 OK", "text/plain; version=0.0.4", m.render()),
        ("GET", "/v1/status") => {
            let g = |a: &std::sync::atomic::AtomicU64| {
                let v = a.load(Relaxed);
                if v == u64::MAX {
                    serde_json::Value::Null
                } else {
                    v.into()
                }
            };
            let v = serde_json::json!({
                "step": g(&m.step), "newest_ready": g(&m.newest), "ready": m.ready.load(Relaxed) == 1,
                "bytes": {"fast": g(&m.bytes_fast), "catchup": g(&m.bytes_catchup), "anchor": g(&m.bytes_anchor)},
                "verify_failures": g(&m.verify_failures), "notify_failures": g(&m.notify_failures),
                "anchor_downloads": g(&m.anchor_downloads), "slot_rebuilds": g(&m.slot_rebuilds), "idle_rebuilds": g(&m.idle_rebuilds), "refused_steps": g(&m.refusals),
                "verify_seconds": m.verify_seconds(),
                // {"message", "at_ms"} of the last failed sync, null after a successful one.
                "last_error": m.last_error(),
            });
            ("200 OK", "application/json", v.to_string())
        }
        ("POST", "/v1/poll") => {
            poll.notify_one();
            ("202 Accepted", "text/plain", "polling\n".into())
        }
        _ => ("404 Not Found", "text/plain", "not found\n".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_reports_the_last_error() {
        let m = Metrics::new();
        let poll = tokio::sync::Notify::new();
        let status = |m: &Metrics| -> serde_json::Value {
            let (code, _, body) = route("GET", "/v1/status", m, &poll);
            assert_eq!(code, "200 OK");
            serde_json::from_str(&body).unwrap()
        };
        assert!(status(&m)["last_error"].is_null());
        m.set_last_error(Some("transient storage error on stream.json: timed out".into()));
        let v = status(&m);
        assert_eq!(v["last_error"]["message"], "transient storage error on stream.json: timed out");
        assert!(v["last_error"]["at_ms"].as_u64().unwrap() > 0);
        m.set_last_error(None);
        assert!(status(&m)["last_error"].is_null());
    }
}
