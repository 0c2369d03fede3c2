//! A TCP proxy that limits the bandwidth from the server to the clients, shared by all
//! connections (a token bucket refilled at the given rate), for network-shaped benchmarks
//! (`integration/network_bench.py`) in front of a local S3 server.
//!
//! ```text
//! cargo run --release -p driftless-store --example rate_proxy -- LISTEN_ADDR UPSTREAM_ADDR MBIT_PER_S
//! ```
//!
//! Uploads (client to server) are not limited: the benchmarks measure what a reader pays.
//! Each connection copies in 64 KiB reads; a read's bytes are sent once the bucket holds them,
//! so the aggregate rate never exceeds the limit and a single connection can reach it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Tokens (bytes) available and when they were last refilled.
struct Bucket {
    rate: f64,
    state: Mutex<(f64, Instant)>,
}

impl Bucket {
    /// How long to wait before `n` bytes may go (taking them now).
    fn take(&self, n: usize) -> Duration {
        let mut s = self.state.lock().expect("bucket lock");
        let now = Instant::now();
        // Burst of at most 1 ms of traffic (or one read).
        let cap = (self.rate / 1000.0).max(n as f64);
        s.0 = (s.0 + now.duration_since(s.1).as_secs_f64() * self.rate).min(cap);
        s.1 = now;
        s.0 -= n as f64;
        if s.0 >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-s.0 / self.rate)
        }
    }
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    limit: Option<Arc<Bucket>>,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(b) = &limit {
            let wait = b.take(n);
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 4 {
        eprintln!("usage: rate_proxy LISTEN_ADDR UPSTREAM_ADDR MBIT_PER_S");
        std::process::exit(2);
    }
    let mbit: f64 = a[3].parse().expect("MBIT_PER_S is a number");
    let limit = Arc::new(Bucket { rate: mbit * 1e6 / 8.0, state: Mutex::new((0.0, Instant::now())) });
    let listener = TcpListener::bind(&a[1]).await?;
    // Announce readiness on stdout (the bench waits for this line).
    println!("listening on {} -> {} at {mbit} Mbit/s", listener.local_addr()?, a[2]);
    loop {
        let (client, _) = listener.accept().await?;
        let (upstream, limit) = (a[2].clone(), limit.clone());
        tokio::spawn(async move {
            let Ok(server) = TcpStream::connect(&upstream).await else { return };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            tokio::join!(pipe(cr, sw, None), pipe(sr, cw, Some(limit)));
        });
    }
}
