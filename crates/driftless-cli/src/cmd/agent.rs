use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Result;
use driftless_agent::notify::Notifier;
use driftless_agent::{Agent, AgentConfig};

/// `driftless agent --bucket URL --trust KEY.pub --dir DIR [--once] [--notify KIND=TARGET]... [--listen ADDR]`
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    bucket: super::bucket::BucketArgs,
    /// Trusted public key (SPKI PEM); repeatable. Also DRIFTLESS_TRUST (comma-separated).
    #[arg(long, env = "DRIFTLESS_TRUST", value_delimiter = ',')]
    trust: Vec<PathBuf>,
    /// Accept unsigned streams (private buckets only).
    #[arg(long, env = "DRIFTLESS_ALLOW_UNSIGNED")]
    allow_unsigned: bool,
    /// Local directory; the checkpoint is DIR/current.
    #[arg(long, env = "DRIFTLESS_DIR")]
    dir: PathBuf,
    /// Sync to the newest step, notify, and exit 0.
    #[arg(long)]
    once: bool,
    /// Inference server to notify: sglang=URL[,mode=retract|in_place|abort],
    /// vllm=URL[,mode=keep|wait|abort][,patch=on[,patch_max=SIZE]], options token_file=PATH | token_env=VAR,
    /// timeout=SECS; http=URL, exec=COMMAND (run with sh -c, its output on stderr); repeatable
    /// (see docs/engines/). DRIFTLESS_NOTIFY holds one target per line.
    // Parsed after clap, so that a refused value (say a token in clear) is not echoed back.
    // Targets are split on newlines only: a `;` belongs to an exec= command (found by review:
    // `exec=a; b` was split into two targets and refused).
    #[arg(long, env = "DRIFTLESS_NOTIFY", value_delimiter = '\n')]
    notify: Vec<String>,
    /// Address of the ops endpoint (/healthz, /readyz, /metrics, /v1/status, POST /v1/poll).
    #[arg(long, env = "DRIFTLESS_LISTEN")]
    listen: Option<SocketAddr>,
    /// Fastest poll interval.
    #[arg(long, env = "DRIFTLESS_POLL_MIN", default_value = "500ms")]
    poll_min: humantime::Duration,
    /// Slowest poll interval.
    #[arg(long, env = "DRIFTLESS_POLL_MAX", default_value = "10s")]
    poll_max: humantime::Duration,
    /// Anchor chunks (16 MiB decoded each) downloaded, checked and decoded at once during a
    /// cold start: its memory is about 25-30 MiB per part, whatever the model's size. Default:
    /// half the cores, 4 to 8 (see the README's "On 16 cores").
    #[arg(long, env = "DRIFTLESS_ANCHOR_PARTS", value_parser = clap::value_parser!(u16).range(1..=64))]
    anchor_parts: Option<u16>,
    /// JSON output (with --once: a running agent's output is its log).
    #[arg(long, requires = "once")]
    json: bool,
    /// Bytes of tensors an idle rebuild of the inactive slot copies between two looks for a
    /// new step (default 256 MiB). Hidden: the tests' knob for a rebuild that gives way
    /// mid-pass on a small model.
    #[arg(long, hide = true, env = "DRIFTLESS_IDLE_GROUP", value_parser = driftless_format::units::parse_bytes)]
    idle_group: Option<u64>,
    /// JSON config file with these long flag names as keys: bucket, endpoint, region, trust,
    /// allow_unsigned, dir, notify, listen, poll_min, poll_max, anchor_parts, log
    /// (`{"bucket": "s3://b/p", "trust": ["k.pub"], "dir": "/w", "notify": ["sglang=http://..."]}`).
    /// Precedence: flag > environment variable (RUST_LOG too, for `log`) > config file > default.
    // Read before clap parses (`crate::config`): declared here for --help and so that other
    // commands refuse it (found by review: it was global, `gc --config` took the file's bucket
    // and silently dropped its trust keys).
    #[arg(long, env = "DRIFTLESS_CONFIG")]
    config: Option<PathBuf>,
}

impl Args {
    /// Whether this is a one-shot sync (the default log level depends on it).
    pub fn once(&self) -> bool {
        self.once
    }
}

pub fn run(a: Args) -> Result<()> {
    let trust = super::verifying_trust_set(&a.trust, a.allow_unsigned)?;
    let mut cfg = AgentConfig::new(&a.dir, trust);
    // Blank lines are no targets: a Kubernetes `value: |` block ends with a newline (found
    // by review: the empty last target stopped the agent at every start).
    cfg.notify = a
        .notify
        .iter()
        .map(|s| s.trim_end_matches('\r'))
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.parse::<Notifier>().map_err(|e| anyhow::anyhow!("--notify: {e}")))
        .collect::<Result<_>>()?;
    cfg.poll_min = a.poll_min.into();
    cfg.poll_max = a.poll_max.into();
    if let Some(n) = a.anchor_parts {
        cfg.anchor_parts = n.into();
    }
    if let Some(n) = a.idle_group {
        cfg.idle_group_bytes = n;
    }
    // --poll-max at most a day: intervals and deadlines are computed from it (found by review:
    // `300000000000y` overflowed one, a panic at the first failed sync).
    const DAY: std::time::Duration = std::time::Duration::from_secs(86_400);
    if cfg.poll_min < driftless_agent::MIN_POLL || cfg.poll_max < cfg.poll_min || cfg.poll_max > DAY {
        anyhow::bail!(
            "--poll-min must be at least {:?}, --poll-max at least --poll-min and at most a day (got {} and {})",
            driftless_agent::MIN_POLL,
            a.poll_min,
            a.poll_max
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let r = rt.block_on(async move {
        // Catch SIGINT/SIGTERM from the start (a handler installed only at the first sleep
        // lets the first sync die on the default disposition, with no word and `running` left
        // behind; a signal during a later sync would wait for it to give up).
        let signals = if a.once { None } else { Some(Signals::new()?) };
        // A one-shot sync only reads: a file:// URL naming no directory is a typo, not a
        // bucket to create. A continuous agent may start before its publisher and waits.
        let bucket = if a.once { a.bucket.open_existing()? } else { a.bucket.open()? };
        let mut agent = Agent::new(bucket, cfg)?;
        if a.once {
            let o = agent.sync_once().await?;
            // One spelling with the Python Follower: `route`, snake_case names.
            if a.json {
                println!("{}", serde_json::json!({"type": "synced", "data": o}));
            } else {
                println!("step {} root {} via {} ({} bytes, {:.3} s)", o.step, o.root, o.route, o.bytes, o.secs);
            }
            if let Some(r) = o.refused.iter().find(|r| !r.fault.is_missing()) {
                // The verified step above is kept and served; a newer one was refused: exit 1.
                return Err(driftless_agent::Error::Refused {
                    kind: r.kind,
                    step: r.step,
                    detail: format!("{} (serving verified step {})", r.reason, o.step),
                    fault: r.fault,
                }
                .into());
            }
            return Ok(());
        }
        let poke = Arc::new(tokio::sync::Notify::new());
        if let Some(addr) = a.listen {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| anyhow::anyhow!("cannot listen on --listen {addr}: {e}"))?;
            eprintln!("driftless agent: ops endpoint on http://{}", l.local_addr()?);
            tokio::spawn(driftless_agent::server::serve(l, agent.metrics(), poke.clone()));
        }
        let mut signals = signals.expect("installed for a continuous agent");
        let received = std::sync::OnceLock::new();
        let shutdown = async {
            let _ = received.set(signals.recv().await);
            // The agent may wait for an inference server's load in flight: a second signal
            // stops at once (what a SIGKILL would do; the directory is safe at any point).
            tokio::spawn(async move {
                let name = signals.recv().await;
                eprintln!(
                    "driftless agent: {name} again: stopping now, without waiting for the inference server's load \
                     (it may stay paused until the next agent announces its step)"
                );
                driftless_agent::notify::kill_running_hooks();
                std::process::exit(2);
            });
        };
        let stopped = agent.run(poke, shutdown).await?;
        let name = received.get().copied().unwrap_or("signal");
        let dir = a.dir.join("current");
        let serving = match stopped.step {
            Some(s) => format!("{} stays on verified step {s}", dir.display()),
            None => format!("no verified step in {} yet", dir.display()),
        };
        if stopped.abandoned_sync {
            eprintln!(
                "driftless agent: {name}: stopped, abandoning the sync in flight (it only wrote the inactive slot); {serving}"
            );
        } else {
            eprintln!("driftless agent: {name}: stopped; {serving}");
        }
        Ok(())
    });
    // Blocking work of an abandoned sync (an apply or hash into the inactive slot) is not
    // waited for: it writes nothing the directory relies on.
    rt.shutdown_background();
    r
}

/// SIGINT and SIGTERM, caught from the moment this is created.
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals { int: signal(SignalKind::interrupt())?, term: signal(SignalKind::terminate())? })
    }

    /// Waits for one; returns its name.
    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.int.recv() => "SIGINT",
            _ = self.term.recv() => "SIGTERM",
        }
    }
}
