//! A misbehaving S3 endpoint served from a test: a real socket for the real S3 client, each
//! request answered by a function of its request line. Shared by the store's and the CLI's
//! tests (`#[path]`-included), so hostile listings and bodies are tested at both levels.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

/// Serves every request with `answer(request line)` -> (status, body); counts requests. A HEAD
/// is answered with the headers only (its Content-Length is the body's length).
pub async fn serve(answer: fn(&str) -> (u16, String)) -> (String, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let n = Arc::new(AtomicUsize::new(0));
    let count = n.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = l.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let mut r = BufReader::new(sock);
                loop {
                    let mut line = String::new();
                    if r.read_line(&mut line).await.unwrap_or(0) == 0 {
                        return;
                    }
                    let mut len = 0usize;
                    loop {
                        let mut h = String::new();
                        if r.read_line(&mut h).await.unwrap_or(0) == 0 {
                            return;
                        }
                        if h == "\r\n" {
                            break;
                        }
                        if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                            len = v.trim().parse().unwrap_or(0);
                        }
                    }
                    let mut body = vec![0u8; len];
                    if r.read_exact(&mut body).await.is_err() {
                        return;
                    }
                    count.fetch_add(1, SeqCst);
                    let (status, b) = answer(&line);
                    let head = format!(
                        "HTTP/1.1 {status} X\r\nContent-Type: application/xml\r\nETag: \"e\"\r\n\
                         Last-Modified: Tue, 24 Nov 2026 00:00:00 GMT\r\nContent-Length: {}\r\n\r\n",
                        b.len()
                    );
                    let resp = if line.starts_with("HEAD ") { head } else { head + &b };
                    if r.get_mut().write_all(resp.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, n)
}
