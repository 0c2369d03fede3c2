//! A misbehaving S3 endpoint served from a test: a real socket for the real S3 client, each
//! request answered by a function of its request line. Shared by the store's and the CLI's
//! tests (`#[path]`-included), so hostile listings and bodies are tested at both levels.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

/// What a request is answered with.
enum Body {
    /// This text.
    Text(String),
    /// This many bytes, streamed in 64 KiB writes.
    Stream(usize),
}

/// Serves every request with `answer(request line)` -> (status, body); counts requests. A HEAD
/// is answered with the headers only (its Content-Length is the body's length).
pub async fn serve(answer: fn(&str) -> (u16, String)) -> (String, Arc<AtomicUsize>) {
    let (url, n, _) = serve_bodies(move |l| {
        let (status, b) = answer(l);
        (status, Body::Text(b))
    })
    .await;
    (url, n)
}

/// Serves every request with `answer(request line)` -> (status, body length), the body
/// streamed in 64 KiB writes; returns the number of body bytes the sockets accepted. A client
/// that stops reading and closes the connection ends the writes (after the socket buffers
/// fill).
#[allow(dead_code)] // the store's tests use it, the CLI's do not
pub async fn serve_streaming(answer: fn(&str) -> (u16, usize)) -> (String, Arc<AtomicUsize>) {
    let (url, _, sent) = serve_bodies(move |l| {
        let (status, len) = answer(l);
        (status, Body::Stream(len))
    })
    .await;
    (url, sent)
}

/// The server: (URL, requests answered, body bytes sent).
async fn serve_bodies(
    answer: impl Fn(&str) -> (u16, Body) + Send + Sync + 'static,
) -> (String, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let (n, sent) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (count, bytes) = (n.clone(), sent.clone());
    let answer = Arc::new(answer);
    tokio::spawn(async move {
        while let Ok((sock, _)) = l.accept().await {
            let (count, bytes, answer) = (count.clone(), bytes.clone(), answer.clone());
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
                    let blen = match &b {
                        Body::Text(t) => t.len(),
                        Body::Stream(n) => *n,
                    };
                    let head = format!(
                        "HTTP/1.1 {status} X\r\nContent-Type: application/xml\r\nETag: \"e\"\r\n\
                         Last-Modified: Tue, 24 Nov 2026 00:00:00 GMT\r\nContent-Length: {blen}\r\n\r\n"
                    );
                    if r.get_mut().write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                    if line.starts_with("HEAD ") {
                        continue;
                    }
                    let ok = match b {
                        Body::Text(t) => r.get_mut().write_all(t.as_bytes()).await.is_ok(),
                        Body::Stream(mut left) => {
                            let piece = vec![b'm'; 64 << 10];
                            let mut ok = true;
                            while left > 0 && ok {
                                let k = left.min(piece.len());
                                ok = r.get_mut().write_all(&piece[..k]).await.is_ok();
                                if ok {
                                    bytes.fetch_add(k, SeqCst);
                                    left -= k;
                                }
                            }
                            ok
                        }
                    };
                    if !ok {
                        return;
                    }
                }
            });
        }
    });
    (url, n, sent)
}
