//! `driftless publish`: one checkpoint per call (`--step N CKPT`) or follow a directory
//! (`--watch DIR`). The snapshot of the last published state is the checkpoint itself, copied
//! into `--state DIR` between calls so a later call diffs against it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use driftless_format::Checkpoint;
use driftless_publisher::PublisherBuilder;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    bucket: super::bucket::BucketArgs,
    /// Signing key (PKCS#8 PEM).
    #[arg(long)]
    key: Option<PathBuf>,
    /// State directory (keeps the last published checkpoint between calls).
    #[arg(long)]
    state: PathBuf,
    /// Step number of CKPT.
    #[arg(long, requires = "ckpt")]
    step: Option<u64>,
    /// Anchor every K steps.
    #[arg(long, default_value_t = 50)]
    anchor_every: u64,
    /// Follow DIR: publish each `step_N` (file or directory) in order once complete.
    #[arg(long, conflicts_with = "ckpt")]
    watch: Option<PathBuf>,
    /// Prefix of the step entries in --watch (followed by the step number).
    #[arg(long, default_value = "step_")]
    pattern: String,
    /// Exit after publishing what is in --watch now.
    #[arg(long)]
    once: bool,
    /// Create the stream even if the prefix holds other objects.
    #[arg(long)]
    new_stream: bool,
    /// Continue a stream signed by another key (key rotation, a replaced trainer): re-signs
    /// its descriptor with --key. Agents must trust the new key.
    #[arg(long)]
    takeover: bool,
    /// Run retention every N published steps (0 = never), with the gc defaults.
    #[arg(long, default_value_t = 0)]
    gc_every: u64,
    /// JSON lines on stdout (one `{"type":"published","data":{...}}` per step).
    #[arg(long)]
    json: bool,
    /// Checkpoint to publish (file or directory).
    ckpt: Option<PathBuf>,
}

impl Args {
    /// Whether this follows a directory (a long-running command).
    pub fn watching(&self) -> bool {
        self.watch.is_some() && !self.once
    }
}

pub fn run(a: Args) -> Result<()> {
    std::fs::create_dir_all(&a.state).with_context(|| format!("creating state directory {}", a.state.display()))?;
    let key = super::signing_key(a.key.as_deref())?;
    if key.is_none() {
        eprintln!("driftless: warning: no --key: the stream is unsigned; agents need --allow-unsigned");
    }
    let mut b = PublisherBuilder::new(a.bucket.bucket.clone())
        .with_bucket(a.bucket.open()?)
        .with_anchor_every(a.anchor_every)
        .with_new_stream(a.new_stream)
        .with_takeover(a.takeover)
        .with_spool_dir(a.state.join("spool"));
    if let Some(k) = key {
        b = b.with_key(k);
    }
    if let Some(c) = a.ckpt.as_deref() {
        b = b.with_extra_files(extra_files(c));
    }
    let mut p = b.build()?;
    let mut published = 0u64;
    let mut seeded = false;
    let mut one = |p: &mut driftless_publisher::Publisher, step: u64, ckpt: &Path| -> Result<()> {
        let prev = a.state.join("last");
        let ck = super::open(ckpt)?;
        // The publisher restarts with no snapshot in a new process: seed it from the state dir.
        if let (Ok(prev_ck), true) = (Checkpoint::open(&prev), !seeded) {
            seeded = true;
            if let Ok(s) = std::fs::read_to_string(a.state.join("last.step")) {
                let ps: u64 = s.trim().parse()?;
                if ps < step {
                    p.seed(ps, &prev_ck.views(), &prev_ck.layout())?;
                }
            }
        }
        let before = p.status().bytes_uploaded;
        let r = p.publish_with_layout(step, &ck.views(), &ck.layout())?;
        flush_with_progress(p, a.json)?;
        // Everything this step put in the bucket (delta, anchor, markers): an anchor's size
        // is only known once its background upload is done.
        let uploaded = p.status().bytes_uploaded.saturating_sub(before);
        copy_checkpoint(ckpt, &prev)?;
        std::fs::write(a.state.join("last.step"), step.to_string())?;
        // The summary is the command's data: stdout. Progress and warnings go to stderr.
        let outcome = super::snake(&r.outcome);
        if a.json {
            let mut data = serde_json::to_value(&r)?;
            data["bytes_uploaded"] = uploaded.into();
            println!("{}", serde_json::json!({"type": "published", "data": data}));
        } else if r.delta_bytes > 0 {
            println!(
                "step {step}: {outcome}, {uploaded} bytes uploaded (delta {} bytes, {:.1}x smaller than dense, {:.3}% changed)",
                r.delta_bytes,
                r.ratio,
                100.0 * r.density
            );
        } else {
            println!("step {step}: {outcome}, {uploaded} bytes uploaded");
        }
        published += 1;
        if a.gc_every > 0 && published % a.gc_every == 0 {
            let bucket = a.bucket.open()?;
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(driftless_gc::run(&bucket, &driftless_gc::GcPolicy::new(), false))?;
        }
        Ok(())
    };
    if let (Some(step), Some(ckpt)) = (a.step, a.ckpt.as_deref()) {
        one(&mut p, step, ckpt)?;
        return Ok(p.close()?);
    }
    let Some(dir) = a.watch.clone() else { bail!("give --step N CKPT or --watch DIR") };
    stop::install();
    let mut last_done: Option<u64> = None;
    loop {
        let mut steps: Vec<(u64, PathBuf)> = std::fs::read_dir(&dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let n = e.file_name().to_string_lossy().to_string();
                let rest = n.strip_prefix(&a.pattern)?;
                let num: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
                Some((num.parse().ok()?, e.path()))
            })
            .collect();
        steps.sort();
        for (s, path) in steps {
            if p.status().last_published.is_some_and(|l| s <= l)
                || std::fs::read_to_string(a.state.join("last.step"))
                    .ok()
                    .and_then(|x| x.trim().parse::<u64>().ok())
                    .is_some_and(|l| s <= l)
            {
                continue;
            }
            // Complete when it opens as a valid checkpoint (the trainer writes, then renames).
            if Checkpoint::open(&path).is_err() {
                break;
            }
            // A signal during `one` lets the step finish (publish, upload, marker); it is
            // acted on here, between steps.
            one(&mut p, s, &path)?;
            last_done = Some(s);
            if stop::requested().is_some() {
                break;
            }
        }
        if let Some(sig) = stop::requested() {
            p.close()?;
            match last_done {
                Some(s) => eprintln!("driftless publish: {sig}: step {s} was completed and is ready; stopped cleanly"),
                None => eprintln!("driftless publish: {sig}: no step was in flight; stopped cleanly"),
            }
            return Ok(());
        }
        if a.once {
            return Ok(p.close()?);
        }
        for _ in 0..10 {
            if stop::requested().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// SIGINT/SIGTERM for `publish --watch`: the first signal asks to stop after the step in
/// flight (so the stream never holds a half-written step from us); the handler then resets
/// itself, so a second signal kills the process at once (the step in flight is abandoned: it
/// has no ready marker, agents never see it, and the next run publishes an anchor).
mod stop {
    use std::sync::atomic::{AtomicI32, Ordering};

    static SIGNAL: AtomicI32 = AtomicI32::new(0);

    extern "C" fn on_signal(sig: libc::c_int) {
        SIGNAL.store(sig, Ordering::SeqCst);
        let msg: &[u8] = b"driftless publish: stopping after the step in flight (signal again to abandon it)\n";
        // SAFETY: write(2) is async-signal-safe; the buffer is a static string.
        unsafe {
            libc::write(2, msg.as_ptr().cast(), msg.len());
        }
    }

    pub fn install() {
        #[cfg(unix)]
        for sig in [libc::SIGINT, libc::SIGTERM] {
            // SAFETY: a plain sigaction with a handler that only touches an atomic and calls
            // write(2); SA_RESETHAND restores the default action after the first delivery.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
                sa.sa_flags = libc::SA_RESETHAND | libc::SA_RESTART;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(sig, &sa, std::ptr::null_mut());
            }
        }
    }

    /// The name of the signal received, if any.
    pub fn requested() -> Option<&'static str> {
        match SIGNAL.load(Ordering::SeqCst) {
            0 => None,
            libc::SIGINT => Some("SIGINT"),
            libc::SIGTERM => Some("SIGTERM"),
            _ => Some("signal"),
        }
    }
}

fn extra_files(ckpt: &Path) -> Vec<(String, Vec<u8>)> {
    let Ok(rd) = std::fs::read_dir(ckpt) else { return vec![] };
    rd.filter_map(|e| e.ok())
        .filter(|e| {
            let n = e.file_name().to_string_lossy().to_string();
            !n.ends_with(".safetensors")
                && n != driftless_format::checkpoint::INDEX_FILE
                && e.metadata().map(|m| m.is_file() && m.len() < (64 << 20)).unwrap_or(false)
        })
        .filter_map(|e| Some((e.file_name().to_string_lossy().to_string(), std::fs::read(e.path()).ok()?)))
        .collect()
}

fn copy_checkpoint(src: &Path, dst: &Path) -> Result<()> {
    if dst.exists() {
        if dst.is_dir() {
            std::fs::remove_dir_all(dst)?;
        } else {
            std::fs::remove_file(dst)?;
        }
    }
    if src.is_file() {
        std::fs::copy(src, dst)?;
        return Ok(());
    }
    std::fs::create_dir_all(dst)?;
    for e in std::fs::read_dir(src)? {
        let e = e?;
        if e.metadata()?.is_file() {
            std::fs::copy(e.path(), dst.join(e.file_name()))?;
        }
    }
    Ok(())
}

/// Waits for the uploads; on a terminal (and without --json) shows a progress line on stderr.
fn flush_with_progress(p: &driftless_publisher::Publisher, json: bool) -> Result<()> {
    use std::io::{IsTerminal, Write};
    use std::sync::atomic::{AtomicBool, Ordering};
    if json || !std::io::stderr().is_terminal() {
        return Ok(p.flush()?);
    }
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let t = std::time::Instant::now();
            while !done.load(Ordering::Relaxed) {
                let st = p.status();
                eprint!(
                    "\r  uploading: {} queued, {} anchor(s) in flight, {:.1} MiB sent, {:.1} s   ",
                    st.queue_depth,
                    st.anchors_in_flight,
                    st.bytes_uploaded as f64 / 1048576.0,
                    t.elapsed().as_secs_f64()
                );
                let _ = std::io::stderr().flush();
                std::thread::sleep(Duration::from_millis(200));
            }
            eprint!("\r{:80}\r", "");
        });
        let r = p.flush();
        done.store(true, Ordering::Relaxed);
        r
    })?;
    Ok(())
}
