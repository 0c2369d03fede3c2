//! The agent at the limit (issue 12): the `driftless` CLI (`agent --once`) on a `file://`
//! bucket, each figure next to a baseline measured in the same run on the same files:
//!
//! - fast path (one delta onto the previous step) next to `driftless hash` of the agent's
//!   `current` directory, run right after it;
//! - catch-up (k deltas) and cold start (anchor, anchor + k deltas) next to reading the anchor
//!   objects and hashing the model, with the agent's peak RSS;
//! - each of those also next to the disk's share: as many bytes as the model written and made
//!   durable (`fdatasync`) in the same run, in place for a fast path or catch-up (the inactive
//!   slot is rewritten: at 1% density every 4 KiB page changes), into a new file for a cold
//!   start. The agent must make the slot durable before its state names it, so on a disk
//!   slower than the hash this, not the hash, is the floor. `BENCH_AGENT_DIR=/dev/shm/x` puts
//!   the agents' directories (and that file) elsewhere, e.g. on a tmpfs;
//! - requests per step (GET / LIST counts of the store are not visible to a `file://` bucket:
//!   see `speed_bench requests` on S3 instead).
//!
//! ```text
//! cargo build --release -p driftless-cli
//! cargo run --release -p driftless-agent --example speed_bench -- gen  /tmp/sb   # once: 1 GiB model, anchor + 8 deltas
//! cargo run --release -p driftless-agent --example speed_bench -- run  /tmp/sb target/release/driftless
//! BENCH_BYTES=268435456 ...   # another model size (gen)
//! ```
//!
//! `rewrite DIR BIN` builds its own stream in DIR (removed first): an anchor, then
//! `BENCH_DELTAS` (default 4) steps. Step 1 adds a 4 MiB tensor, so its delta changes the
//! layout and the agent takes the rewrite route; the next step brings the other slot over the
//! same change; after that the steps are the fast path again. With `BENCH_ALTERNATE=1` every
//! step adds or removes the tensor (two rewrite passes per step, the worst case). Each step is
//! timed next to a hash.
//!
//! `coldmem DIR BIN` publishes an anchor of a 1 GiB and of a 4 GiB model (`BENCH_SIZES_GIB`,
//! default `1,4`; synthetic BF16-like bytes, so no generator holding several times the model)
//! and cold-starts an agent on each: the agent's peak anonymous memory must not grow with
//! the model (anchor parts are streamed into the slot, a few in flight). `BENCH_SHARD_BYTES`
//! cuts the model into shards of at most that many bytes (shards stream side by side);
//! `BENCH_KEEP=1` keeps the bucket for profiling.
//!
//! `live DIR BIN` (after `gen`) runs one continuous `driftless agent`, as a deployment does,
//! and reveals the steps one at a time: each step's sync (the agent's own `synced step ...
//! secs`, from the start of the sync to the switch, poll wait excluded) next to a `driftless
//! hash` of its `current` directory run while the agent idles. Unlike `run`'s one process per
//! step, the agent keeps what it holds in memory between steps. Step 1 is revealed
//! `BENCH_GAP_MS` (default 3000) after the cold start, as a trainer's next step comes seconds
//! later: the agent rebuilds its empty inactive slot in that gap (a row when its log says so).
//!
//! `gen` publishes the whole chain, then moves the delta ready markers aside (`held/`); `run`
//! reveals them one at a time, so every step is measured as a follower sees it live.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use driftless_format::gen::{ModelSpec, RlChain};
use driftless_format::{Keypair, StepKind};
use driftless_publisher::PublisherBuilder;
use driftless_store::{layout, Bucket, StoreOptions};

fn env<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("gen") => gen(Path::new(&args[2])),
        Some("run") => run(Path::new(&args[2]), Path::new(&args[3])),
        Some("proc") => processing(Path::new(&args[2])),
        Some("rewrite") => rewrite(Path::new(&args[2]), Path::new(&args[3])),
        Some("coldmem") => cold_memory(Path::new(&args[2]), Path::new(&args[3])),
        Some("live") => live(Path::new(&args[2]), Path::new(&args[3])),
        _ => eprintln!(
            "usage: speed_bench gen DIR | run DIR DRIFTLESS_BIN | live DIR DRIFTLESS_BIN | proc DIR | rewrite DIR DRIFTLESS_BIN | coldmem DIR DRIFTLESS_BIN"
        ),
    }
}

fn gen(dir: &Path) {
    let bytes: u64 = env("BENCH_BYTES", 1u64 << 30);
    let n: u64 = env("BENCH_DELTAS", 8);
    let lr: f32 = env("BENCH_LR", 4e-7);
    std::fs::create_dir_all(dir).unwrap();
    let (_, mut p) = new_stream(dir);
    let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(bytes), lr, 11);
    for s in 0..=n {
        if s > 0 {
            chain.step();
        }
        let r = p.publish(s, &chain.views()).unwrap();
        p.flush().unwrap();
        eprintln!("published step {s}: {r:?}");
        // Each step's signed latest.json, put back by `reveal` with the step's marker: a
        // follower one step behind then plans from it as it would live (no listing).
        let latest = dir.join("bucket").join(layout::LATEST);
        if latest.exists() {
            std::fs::create_dir_all(dir.join("held")).unwrap();
            std::fs::copy(&latest, dir.join("held").join(format!("latest-{s}.json"))).unwrap();
        }
    }
    p.close().unwrap();
    // The newest weights, to check the agent's result bit for bit.
    let layout =
        driftless_format::Layout::for_tensors(&chain.views().iter().map(|v| v.meta()).collect::<Vec<_>>(), 5 << 30)
            .unwrap();
    driftless_format::checkpoint::write_checkpoint(&dir.join("last"), &layout, &chain.views()).unwrap();
    hide(dir, n);
}

/// A new stream in `dir/bucket` (file://), signed with the bench's key (its public half in
/// `dir/key.pub`), anchors only when asked: (url, publisher).
fn new_stream(dir: &Path) -> (String, driftless_publisher::Publisher) {
    let key = Keypair::from_seed([3; 32]);
    std::fs::write(dir.join("key.pub"), key.public_pem().unwrap()).unwrap();
    let url = format!("file://{}", dir.join("bucket").display());
    let bucket = Bucket::open(&url, &StoreOptions::default()).unwrap();
    let p =
        PublisherBuilder::new("unused").with_bucket(bucket).with_key(key).with_anchor_every(1_000_000).build().unwrap();
    (url, p)
}

/// Moves the delta ready markers (and latest.json) aside: `run` reveals them one by one.
fn hide(dir: &Path, n: u64) {
    let held = dir.join("held");
    std::fs::create_dir_all(&held).unwrap();
    for s in 1..=n {
        let from = dir.join("bucket").join(layout::ready(StepKind::Delta, s));
        if from.exists() {
            std::fs::rename(&from, held.join(s.to_string())).unwrap();
        }
    }
    let _ = std::fs::remove_file(dir.join("bucket").join(layout::LATEST));
}

fn reveal(dir: &Path, s: u64) {
    let to = dir.join("bucket").join(layout::ready(StepKind::Delta, s));
    std::fs::rename(dir.join("held").join(s.to_string()), to).unwrap();
    // The step's latest.json after its marker, as the publisher writes them (directories
    // generated before `gen` kept them have none: followers then list).
    let latest = dir.join("held").join(format!("latest-{s}.json"));
    if latest.exists() {
        let tmp = dir.join("bucket").join(".latest.tmp");
        std::fs::copy(&latest, &tmp).unwrap();
        std::fs::rename(&tmp, dir.join("bucket").join(layout::LATEST)).unwrap();
    }
}

/// Peak anonymous memory (RssAnon, KiB) of the last command run by [`timed`], sampled every
/// 2 ms from /proc (file pages the agent maps while hashing are page cache, not counted).
static PEAK_ANON_KIB: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn rss_anon_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let l = s.lines().find(|l| l.starts_with("RssAnon:"))?;
    l.split_whitespace().nth(1)?.parse().ok()
}

/// Runs a command, returns (seconds, stdout).
fn timed(cmd: &mut Command) -> (f64, String) {
    let t = Instant::now();
    let child = cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let st = stop.clone();
    let sampler = std::thread::spawn(move || {
        let mut peak = 0;
        while !st.load(std::sync::atomic::Ordering::Relaxed) {
            peak = peak.max(rss_anon_kib(pid).unwrap_or(0));
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        peak
    });
    let out = child.wait_with_output().unwrap();
    let secs = t.elapsed().as_secs_f64();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    PEAK_ANON_KIB.store(sampler.join().unwrap(), std::sync::atomic::Ordering::Relaxed);
    assert!(out.status.success(), "{:?} failed: {}", cmd, String::from_utf8_lossy(&out.stderr));
    if std::env::var_os("BENCH_VERBOSE").is_some() {
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
    }
    (secs, String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Peak RSS of the waited-for children so far (KiB).
fn children_maxrss() -> u64 {
    // SAFETY: getrusage fills a plain struct.
    unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_CHILDREN, &mut u);
        u.ru_maxrss as u64
    }
}

struct Ctx {
    dir: PathBuf,
    bin: PathBuf,
    url: String,
}

/// Where the agents' directories live: `BENCH_AGENT_DIR` (e.g. a tmpfs, to take the disk out
/// of the figures), else the bench directory.
fn agent_root(dir: &Path) -> PathBuf {
    std::env::var_os("BENCH_AGENT_DIR").map(PathBuf::from).unwrap_or_else(|| dir.to_path_buf())
}

/// Bytes of the `*.safetensors` files of `d`.
fn model_bytes(d: &Path) -> u64 {
    std::fs::read_dir(d)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

/// The disk's share of a step: writes `bytes` into a file next to the agents' directories and
/// waits for them to be durable (`fdatasync`), as the agent must before its state names the
/// slot. `fresh`: a new file (a cold start writes new shard files), else the bytes overwrite
/// the file a previous call left (the fast path rewrites the inactive slot in place: at 1%
/// density every 4 KiB page of a BF16 model changes). Written in 8 MiB `pwrite`s of bytes
/// that differ per call.
fn durable_write(dir: &Path, bytes: u64, fresh: bool) -> f64 {
    use std::os::unix::fs::FileExt;
    static ROUND: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    let p = agent_root(dir).join("write-floor.bin");
    if fresh {
        let _ = std::fs::remove_file(&p);
    }
    assert!(bytes > 0, "no *.safetensors files to size the write by");
    // Pseudo-random bytes, new each call: a compressing file system must not shrink the floor.
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ ROUND.fetch_add(1, std::sync::atomic::Ordering::Relaxed) as u64;
    let buf: Vec<u8> = (0..1usize << 20)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect();
    let t = Instant::now();
    let f = std::fs::OpenOptions::new().create(true).write(true).truncate(false).open(&p).unwrap();
    let mut at = 0;
    while at < bytes {
        let n = (bytes - at).min(buf.len() as u64) as usize;
        f.write_all_at(&buf[..n], at).unwrap();
        at += n as u64;
    }
    f.sync_data().unwrap();
    t.elapsed().as_secs_f64()
}

impl Ctx {
    fn agent(&self, d: &str) -> (f64, String) {
        self.agent_perf(d, None)
    }
    /// `agent --once`, under `perf record -g -o PERF` when given.
    fn agent_perf(&self, d: &str, perf: Option<&str>) -> (f64, String) {
        self.agent_env(d, perf, None)
    }
    /// `agent --once` with one extra environment variable `K=V` (A/B experiments).
    fn agent_env(&self, d: &str, perf: Option<&str>, kv: Option<&str>) -> (f64, String) {
        let mut c = match perf {
            Some(out) => {
                let mut c = Command::new("perf");
                c.args(["record", "-F", "2000", "-g", "-o", out, "--"]).arg(&self.bin);
                c
            }
            None => Command::new(&self.bin),
        };
        if let Some((k, v)) = kv.and_then(|kv| kv.split_once('=')) {
            c.env(k, v);
        }
        c.args(["agent", "--once", "--bucket", &self.url, "--trust"])
            .arg(self.dir.join("key.pub"))
            .arg("--dir")
            .arg(agent_root(&self.dir).join(d));
        timed(&mut c)
    }
    fn hash(&self, d: &str) -> (f64, String) {
        timed(Command::new(&self.bin).arg("hash").arg(agent_root(&self.dir).join(d).join("current")))
    }
    /// [`durable_write`] of as many bytes as agent `d`'s served model.
    fn write_floor(&self, d: &str, fresh: bool) -> f64 {
        durable_write(&self.dir, model_bytes(&agent_root(&self.dir).join(d).join("current")), fresh)
    }
    /// Reads every anchor object of step 0 (the bytes a cold start must read from the bucket).
    fn read_anchor(&self) -> f64 {
        let d = self.dir.join("bucket").join(layout::anchor_dir(0));
        let t = Instant::now();
        let mut n = 0u64;
        for e in std::fs::read_dir(&d).unwrap() {
            n += std::fs::read(e.unwrap().path()).unwrap().len() as u64;
        }
        assert!(n > 0);
        t.elapsed().as_secs_f64()
    }
}

/// The rewrite route (a real layout change) next to a hash of the result: see the module docs.
fn rewrite(dir: &Path, bin: &Path) {
    let bytes: u64 = env("BENCH_BYTES", 1u64 << 30);
    let n: u64 = env("BENCH_DELTAS", 4);
    let lr: f32 = env("BENCH_LR", 4e-7);
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let (url, mut p) = new_stream(dir);
    let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(bytes), lr, 11);
    let extra: Vec<u8> = (0..4u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let shape = [2u64 << 20];
    for s in 0..=n {
        if s > 0 {
            chain.step();
        }
        let mut views = chain.views();
        let alternate = std::env::var_os("BENCH_ALTERNATE").is_some();
        if (alternate && s % 2 == 1) || (!alternate && s >= 1) {
            views.push(
                driftless_format::TensorView::new("zz.extra.weight", driftless_format::DType::BF16, &shape, &extra)
                    .unwrap(),
            );
        }
        let r = p.publish(s, &views).unwrap();
        p.flush().unwrap();
        eprintln!("published step {s}: {:?}", r.outcome);
    }
    p.close().unwrap();
    // The generator holds several times the model (FP32 weights and Adam moments): free it
    // before the agent runs, as `gen` and `run` are separate processes.
    drop(chain);
    hide(dir, n);
    let cx = Ctx { dir: dir.to_path_buf(), bin: bin.to_path_buf(), url };
    println!("| operation (CLI) | s | baseline (same run) | s | ratio |\n|---|---|---|---|---|");
    cx.agent("A");
    for s in 1..=n {
        reveal(dir, s);
        let perf = std::env::var("BENCH_PERF").ok().filter(|_| s == env("BENCH_PERF_STEP", 3));
        let (t, out) = cx.agent_perf("A", perf.as_deref());
        let (h, _) = cx.hash("A");
        let what = match (std::env::var_os("BENCH_ALTERNATE").is_some(), s) {
            (true, _) => "layout change every step",
            (false, 1) => "layout change (rewrite from the served slot)",
            (false, 2) => "next step (work slot rewritten + 1 delta)",
            _ => "fast path after the change",
        };
        row(&format!("{what}, step {s}"), t, "driftless hash of A/current", h);
        eprintln!("  {out}");
    }
}

/// Cold-start memory against model size: see the module docs.
fn cold_memory(dir: &Path, bin: &Path) {
    let sizes: Vec<u64> = std::env::var("BENCH_SIZES_GIB")
        .unwrap_or_else(|_| "1,4".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    println!("| operation (CLI) | s | baseline (same run) | s | ratio |\n|---|---|---|---|---|");
    for gib in sizes {
        let d = dir.join(format!("g{gib}"));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let url = {
            // 64 tensors of BF16-like values: a narrow high byte (sign and exponent of small
            // weights), a random low byte; compresses about as real weights do.
            let per = (gib << 30) / 64;
            let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ gib;
            let tensors: Vec<Vec<u8>> = (0..64)
                .map(|_| {
                    (0..per / 8)
                        .flat_map(|_| {
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            let b = x.to_le_bytes();
                            [b[0], 0x3c | (b[1] & 0x81), b[2], 0xbc ^ (b[3] & 0x01), b[4], 0x3b, b[6], 0x3c]
                        })
                        .collect()
                })
                .collect();
            let names: Vec<String> = (0..64).map(|i| format!("model.layers.{i:02}.weight")).collect();
            let shape = [per / 2];
            let views: Vec<driftless_format::TensorView<'_>> = tensors
                .iter()
                .zip(&names)
                .map(|(t, n)| driftless_format::TensorView::new(n, driftless_format::DType::BF16, &shape, t).unwrap())
                .collect();
            let key = Keypair::from_seed([3; 32]);
            std::fs::write(d.join("key.pub"), key.public_pem().unwrap()).unwrap();
            let url = format!("file://{}", d.join("bucket").display());
            let bucket = Bucket::open(&url, &StoreOptions::default()).unwrap();
            let mut p = PublisherBuilder::new("unused").with_bucket(bucket).with_key(key);
            if let Ok(n) = std::env::var("BENCH_SHARD_BYTES") {
                p = p.with_max_shard_bytes(n.parse().expect("BENCH_SHARD_BYTES: bytes"));
            }
            let mut p = p.build().unwrap();
            p.publish(0, &views).unwrap();
            p.close().unwrap();
            url
        };
        let cx = Ctx { dir: d.clone(), bin: bin.to_path_buf(), url: url.clone() };
        cx.read_anchor();
        // Variants, each round in the same order: `BENCH_BASE_BIN` (another build, its
        // defaults), then this build with each `BENCH_PARTS` value as DRIFTLESS_ANCHOR_PARTS
        // (or its default).
        let base = std::env::var_os("BENCH_BASE_BIN").map(PathBuf::from);
        let parts: Vec<Option<String>> = match std::env::var("BENCH_PARTS") {
            Ok(v) => v.split(',').map(|p| Some(p.trim().to_string())).collect(),
            Err(_) => vec![None],
        };
        for round in 0..env("BENCH_COLD_ROUNDS", 1u32) {
            let mut runs: Vec<(String, Ctx, Option<String>)> = vec![];
            if let Some(b) = &base {
                runs.push(("base build".into(), Ctx { dir: d.clone(), bin: b.clone(), url: url.clone() }, None));
            }
            for p in &parts {
                let what = p.as_ref().map_or("default parts".to_string(), |p| format!("{p} parts"));
                let kv = p.as_ref().map(|p| format!("DRIFTLESS_ANCHOR_PARTS={p}"));
                runs.push((what, Ctx { dir: d.clone(), bin: bin.to_path_buf(), url: url.clone() }, kv));
            }
            for (what, c, kv) in runs {
                let _ = std::fs::remove_dir_all(agent_root(&d).join("A"));
                let (t, _) = c.agent_env("A", None, kv.as_deref());
                let anon = PEAK_ANON_KIB.load(std::sync::atomic::Ordering::Relaxed);
                let ra = cx.read_anchor();
                let (h, _) = cx.hash("A");
                row(&format!("cold start, {gib} GiB, {what}, round {round}"), t, "max(read anchor, hash)", ra.max(h));
                println!("|   peak anonymous memory of the agent: {} MiB | | | | |", anon >> 10);
            }
        }
        // The one serial stage of a shard's stream: its object's SHA-256, one thread (the sum
        // over all shards).
        let t = Instant::now();
        for e in std::fs::read_dir(d.join("bucket").join(layout::anchor_dir(0))).unwrap() {
            std::hint::black_box(driftless_format::Digest::of(&std::fs::read(e.unwrap().path()).unwrap()));
        }
        println!(
            "|   SHA-256 of the anchor objects, one thread (read included): {:.3} s | | | | |",
            t.elapsed().as_secs_f64()
        );
        if std::env::var_os("BENCH_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&d);
        }
    }
}

fn row(what: &str, secs: f64, base_what: &str, base: f64) {
    println!("| {what:<44} | {secs:>7.3} | {base_what:<34} | {base:>7.3} | {:>5.2}x |", secs / base);
}

/// Prints the median, min and max of `v` (ratios) as a summary row, unless it is empty.
fn spread(label: &str, v: &mut [f64]) {
    v.sort_by(f64::total_cmp);
    if !v.is_empty() {
        println!("|   {label}: median {:.2}x, min {:.2}x, max {:.2}x | | | | |", v[v.len() / 2], v[0], v[v.len() - 1]);
    }
}

/// The newest step of the chain `gen` wrote in `dir`: its delta markers held aside or revealed.
fn chain_len(dir: &Path) -> u64 {
    let held = std::fs::read_dir(dir.join("held"))
        .map(|r| r.flatten().filter_map(|e| e.file_name().to_str()?.parse::<u64>().ok()).max())
        .unwrap_or_default();
    let revealed = (1..).take_while(|s| dir.join("bucket").join(layout::ready(StepKind::Delta, *s)).exists()).last();
    held.max(revealed).expect("gen first")
}

/// Asserts that agent `d`'s `current` holds the trainer's weights of step `n` (`gen`'s `last`),
/// bit for bit (same weights root).
fn bit_exact(cx: &Ctx, d: &str, n: u64) {
    let (_, want) = timed(Command::new(&cx.bin).arg("hash").arg(cx.dir.join("last")));
    let (_, got) = cx.hash(d);
    assert_eq!(want, got, "agent result differs from the trainer's weights");
    println!("|   bit-exact against the trainer's step {n}: yes | | | | |");
}

fn run(dir: &Path, bin: &Path) {
    let reps: u64 = env("BENCH_REPS", 7);
    let n = chain_len(dir);
    // Start over: everything hidden, agent directories removed.
    hide(dir, n);
    for d in ["A", "B", "C", "D"] {
        let _ = std::fs::remove_dir_all(agent_root(dir).join(d));
    }
    // The write floor's file holds a model's worth of page cache (of RAM on a tmpfs).
    let floor_file = agent_root(dir).join("write-floor.bin");
    let _ = std::fs::remove_file(&floor_file);
    let cx =
        Ctx { dir: dir.to_path_buf(), bin: bin.to_path_buf(), url: format!("file://{}", dir.join("bucket").display()) };
    println!("| operation (CLI) | s | baseline (same run) | s | ratio |\n|---|---|---|---|---|");
    // Cold start, anchor only (page cache warm for the bucket files: read them once first).
    cx.read_anchor();
    let (t, out) = cx.agent_perf("A", std::env::var("BENCH_PERF_COLD").ok().as_deref());
    let rss = children_maxrss();
    let anon = PEAK_ANON_KIB.load(std::sync::atomic::Ordering::Relaxed);
    let ra = cx.read_anchor();
    let (h, _) = cx.hash("A");
    let w = cx.write_floor("A", true);
    row("cold start: anchor only", t, "max(read anchor, hash)", ra.max(h));
    row("  the same", t, &format!("max(.., durable new file {w:.3} s)"), ra.max(h).max(w));
    println!("|   peak RSS of the agent: {} MiB (anonymous: {} MiB) ({out}) | | | | |", rss >> 10, anon >> 10);
    // B also starts on the anchor (for the catch-up).
    cx.agent("B");
    // With BENCH_AB=K=V, D follows like A with that variable set, measured step by step beside A.
    let ab = std::env::var("BENCH_AB").ok();
    if ab.is_some() {
        cx.agent("D");
    }
    let mut ratios_b = vec![];
    // Fast path: one delta at a time, each next to a hash of the same directory.
    let k = 5.min(n.saturating_sub(1));
    let (mut ratios, mut ratios_w) = (vec![], vec![]);
    for s in 1..=(1 + reps).min(n) {
        reveal(dir, s);
        let perf = std::env::var("BENCH_PERF").ok().filter(|_| s == 4);
        let (t, out) = cx.agent_perf("A", perf.as_deref());
        let (h, _) = cx.hash("A");
        let what = if s == 1 { "fast path (first after anchor: slot copy)" } else { "fast path: 1 delta" };
        row(&format!("{what}, step {s}"), t, "driftless hash of A/current", h);
        let w = cx.write_floor("A", false);
        row("  the same", t, &format!("max(hash, durable rewrite {w:.3} s)"), h.max(w));
        if s > 1 {
            ratios.push(t / h);
            ratios_w.push(t / h.max(w));
        }
        if let Some(kv) = &ab {
            let (t, _) = cx.agent_env("D", None, Some(kv));
            let (h, _) = cx.hash("D");
            row(&format!("  {kv}: step {s}"), t, "driftless hash of D/current", h);
            if s > 1 {
                ratios_b.push(t / h);
            }
        }
        eprintln!("  {out}");
    }
    spread("fast path / hash", &mut ratios);
    spread("fast path / max(hash, durable rewrite)", &mut ratios_w);
    spread(&format!("with {}", ab.as_deref().unwrap_or("")), &mut ratios_b);
    if std::env::var_os("BENCH_FAST_ONLY").is_some() {
        let _ = std::fs::remove_file(&floor_file);
        return;
    }
    let shown = (1 + reps).min(n);
    // Catch-up: B is on step 0 (both slots hold the anchor after... one copy); bring it k steps.
    let (t, _) = cx.agent("B");
    let (h, _) = cx.hash("B");
    let w = cx.write_floor("B", false);
    row(&format!("catch-up: {shown} deltas (B from step 0)"), t, "driftless hash of B/current", h);
    row("  the same", t, &format!("max(hash, durable rewrite {w:.3} s)"), h.max(w));
    // Cold start, anchor + deltas.
    let _ = k;
    let before = children_maxrss();
    let (t, _) = cx.agent("C");
    let rss = children_maxrss();
    let anon = PEAK_ANON_KIB.load(std::sync::atomic::Ordering::Relaxed);
    let ra = cx.read_anchor();
    let (h, _) = cx.hash("C");
    let w = cx.write_floor("C", true);
    row(&format!("cold start: anchor + {shown} deltas"), t, "max(read anchor, hash)", ra.max(h));
    row("  the same", t, &format!("max(.., durable new file {w:.3} s)"), ra.max(h).max(w));
    let _ = before;
    println!(
        "|   peak anonymous memory of the agent: {} MiB (peak RSS of all agents so far {} MiB) | | | | |",
        anon >> 10,
        rss >> 10
    );
    let _ = std::fs::remove_file(&floor_file);
    // Bit-exact check against the trainer's weights at the last revealed step, when it is n.
    if shown == n {
        bit_exact(&cx, "A", n);
    }
}

/// See the module docs: one continuous agent, the steps revealed one at a time.
fn live(dir: &Path, bin: &Path) {
    use std::io::BufRead;
    let n = chain_len(dir);
    hide(dir, n);
    let ad = agent_root(dir).join("L");
    let _ = std::fs::remove_dir_all(&ad);
    let cx =
        Ctx { dir: dir.to_path_buf(), bin: bin.to_path_buf(), url: format!("file://{}", dir.join("bucket").display()) };
    cx.read_anchor();
    let mut child = Command::new(bin)
        .env("DRIFTLESS_LOG", std::env::var("BENCH_AGENT_LOG").unwrap_or_else(|_| "info".into()))
        .args(["agent", "--poll-min", "50ms", "--poll-max", "50ms", "--bucket", &cx.url, "--trust"])
        .arg(dir.join("key.pub"))
        .arg("--dir")
        .arg(&ad)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // (step, route, secs) of each "synced step" line of the agent's log.
    let (tx, rx) = std::sync::mpsc::channel::<(u64, String, f64)>();
    // Seconds of each idle rebuild of the inactive slot the agent logs.
    let (idle_tx, idle) = std::sync::mpsc::channel::<f64>();
    let err = child.stderr.take().unwrap();
    let verbose = std::env::var_os("BENCH_VERBOSE").is_some();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(err).lines().map_while(Result::ok) {
            if verbose {
                eprintln!("{l}");
            }
            let field = |k: &str| l.split_whitespace().find_map(|w| w.strip_prefix(k)).map(str::to_string);
            if l.contains("while idle") {
                if let Some(t) = field("secs=") {
                    let _ = idle_tx.send(t.parse().unwrap());
                }
            }
            if !l.contains("synced step") {
                continue;
            }
            if let (Some(s), Some(r), Some(t)) = (field("step="), field("route="), field("secs=")) {
                let _ = tx.send((s.parse().unwrap(), r, t.parse().unwrap()));
            }
        }
    });
    let wait = |want: u64| loop {
        let (s, r, t) = rx.recv_timeout(std::time::Duration::from_secs(120)).expect("the agent synced no step");
        if s == want {
            return (r, t);
        }
    };
    println!("| operation (one continuous agent) | s | baseline (same run) | s | ratio |\n|---|---|---|---|---|");
    // CPU-seconds (user + system) the agent used so far: on a machine where the step is
    // CPU-bound, the work a change saves shows here with less noise than in the wall time.
    let pid = child.id();
    let cpu = move || -> f64 {
        let st = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        // Fields after the command name (which may hold spaces): utime, stime are 14 and 15.
        let rest = &st[st.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        // SAFETY: sysconf reads a constant.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / hz
    };
    let (r, t) = wait(0);
    let (h, _) = cx.hash("L");
    row(&format!("step 0 ({r}, {:.2} CPU-s)", cpu()), t, "driftless hash of L/current", h);
    // The trainer's next step comes `BENCH_GAP_MS` (default 3000) after the cold start, as in
    // a run whose steps are seconds apart: an agent that rebuilds its inactive slot while idle
    // does it in that gap (its log line is shown as a row when seen).
    std::thread::sleep(std::time::Duration::from_millis(env("BENCH_GAP_MS", 3000)));
    if let Ok(t) = idle.try_recv() {
        println!("| inactive slot rebuilt while idle (off the step path) | {t:.3} | | | |");
    }
    let (mut ratios, mut cpus) = (vec![], vec![]);
    for s in 1..=n {
        let c0 = cpu();
        reveal(dir, s);
        let (r, t) = wait(s);
        let c = cpu() - c0;
        let (h, _) = cx.hash("L");
        row(&format!("step {s} ({r}, {c:.2} CPU-s)"), t, "driftless hash of L/current", h);
        if s > 1 {
            ratios.push(t / h);
            cpus.push(c);
        }
    }
    cpus.sort_by(f64::total_cmp);
    if !cpus.is_empty() {
        println!(
            "|   steps 2-{n}: median {:.2} CPU-s of the agent per step (polls during the step included) | | | | |",
            cpus[cpus.len() / 2]
        );
    }
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success(), "the agent did not stop cleanly");
    spread(&format!("steps 2-{n} / hash"), &mut ratios);
    bit_exact(&cx, "L", n);
    let _ = std::fs::remove_dir_all(&ad);
}

/// Processing only (no process start, no planning, no download), in one process, rounds
/// interleaved so that load from other processes hits every variant alike: the work of a
/// steady-state fast path (deltas 2 and 3 onto a copy of step 1: the inactive slot brought
/// forward) done the way main did it (each delta applied segment by segment, then the model
/// hashed) and in one fused pass, each followed by the msync; next to hashing the same files.
fn processing(dir: &Path) {
    use driftless_format::delta::decode_segment;
    use driftless_format::{fused, CheckpointFiles, CheckpointMut, DeltaManifest};
    let rounds: usize = env("BENCH_ROUNDS", 7);
    let bucket = dir.join("bucket");
    let seg = |s: u64| -> Vec<driftless_format::delta::DecodedSegment> {
        // The manifest carries its publisher generation's name (`g<gen>-manifest.json`).
        let sdir = bucket.join(layout::delta_dir(s));
        let name = std::fs::read_dir(&sdir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.to_string_lossy().ends_with("manifest.json"))
            .expect("a manifest in the step directory");
        let env = std::fs::read(name).unwrap();
        let trust =
            driftless_format::TrustSet::new().with_pem(&std::fs::read_to_string(dir.join("key.pub")).unwrap()).unwrap();
        let (payload, _) = trust.open(&env).unwrap();
        let m = DeltaManifest::from_slice(&payload).unwrap();
        m.segments
            .iter()
            .map(|r| {
                let b = std::fs::read(bucket.join(layout::object(StepKind::Delta, s, &r.object.object))).unwrap();
                decode_segment(&b, r.raw_size).unwrap()
            })
            .collect()
    };
    let chain = [seg(2), seg(3)];
    // A scratch checkpoint: the newest weights written by `gen` (beside the agents'
    // directories: `BENCH_AGENT_DIR=/dev/shm/x` takes the disk out of the figures).
    let scratch = agent_root(dir).join("scratch");
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    for e in std::fs::read_dir(dir.join("last")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), scratch.join(e.file_name())).unwrap();
    }
    let time = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        t.elapsed().as_secs_f64()
    };
    let refs: Vec<&[driftless_format::delta::DecodedSegment]> = chain.iter().map(|c| &c[..]).collect();
    let (mut h, mut old, mut map, mut map_sync, mut files, mut files_sync) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    // The pass's parts: reading and hashing alone (no changes: nothing written), and reading,
    // applying and writing without the hash.
    let (mut read_hash, mut no_hash) = (vec![], vec![]);
    for _ in 0..rounds {
        h.push(time(&mut || {
            let ck = driftless_format::Checkpoint::open(&scratch).unwrap();
            std::hint::black_box(driftless_format::weights_root(&ck.views()));
        }));
        old.push(time(&mut || {
            let mut ck = CheckpointMut::open(&scratch).unwrap();
            for d in &chain {
                let tm = ck.tensors_mut();
                for s in d {
                    driftless_format::delta::apply_segment(s, &tm).unwrap();
                }
            }
            std::hint::black_box(driftless_format::weights_root(&ck.views()));
            ck.flush().unwrap();
        }));
        // The fused pass on a writable map, then one msync (the agent before pwrite).
        map.push(time(&mut || {
            let mut ck = CheckpointMut::open(&scratch).unwrap();
            let metas = ck.metas();
            {
                let tm = ck.tensors_mut();
                std::hint::black_box(fused::apply_and_hash(fused::Target::Memory(&tm), &metas, &refs, true).unwrap());
            }
            let t = Instant::now();
            ck.flush().unwrap();
            map_sync.push(t.elapsed().as_secs_f64());
        }));
        // The fused pass with pread/pwrite, each piece's writeback started at once, then
        // fdatasync (what the agent does).
        files.push(time(&mut || {
            let f = CheckpointFiles::open(&scratch).unwrap();
            std::hint::black_box(fused::apply_and_hash(fused::Target::Files(&f), &f.metas(), &refs, true).unwrap());
            let t = Instant::now();
            f.sync().unwrap();
            files_sync.push(t.elapsed().as_secs_f64());
        }));
        read_hash.push(time(&mut || {
            let f = CheckpointFiles::open(&scratch).unwrap();
            std::hint::black_box(fused::apply_and_hash(fused::Target::Files(&f), &f.metas(), &[], true).unwrap());
        }));
        no_hash.push(time(&mut || {
            let f = CheckpointFiles::open(&scratch).unwrap();
            std::hint::black_box(fused::apply_and_hash(fused::Target::Files(&f), &f.metas(), &refs, false).unwrap());
        }));
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mh = med(&mut h);
    println!("processing, {rounds} interleaved rounds, medians (2 deltas onto a 1-step-old copy, made durable):");
    println!("| hash the model (weights root)                          | {mh:.3} s | 1.00x |");
    for (what, v) in [
        ("apply delta by delta, then hash, msync", &mut old),
        ("fused pass on a writable map, then msync", &mut map),
        ("  of which the msync", &mut map_sync),
        ("fused pass with pread/pwrite + early writeback, fdatasync", &mut files),
        ("  of which the fdatasync", &mut files_sync),
        ("  its read and hash alone (pread, no changes)", &mut read_hash),
        ("  its read, apply and write alone (no hash)", &mut no_hash),
    ] {
        let m = med(v);
        println!("| {what:<54} | {m:.3} s | {:.2}x |", m / mh);
    }
    let _ = std::fs::remove_dir_all(&scratch);
}
