//! Publisher latency and memory on a large model, next to a plain full upload.
//!
//! ```text
//! cargo run --release -p driftless-publisher --example publish_bench -- [--mb 1024] [--lr 4e-7] [--steps 5] [--coalesce-only]
//! ```
//!
//! For each bucket (`file://` in a temp dir, and SeaweedFS when `DRIFTLESS_TEST_S3_SEAWEED` is
//! set, as `.ci/services.sh` exports it) it prints, on one generated RL chain (Adam, BF16 view):
//! - the time to upload the full BF16 checkpoint as one object (the baseline),
//! - the first publish (anchor only) and the time until its anchor is ready,
//! - per delta step: the time `publish()` takes to return, and to delta-ready (`flush()`),
//!   with the delta's size and density,
//! - the publisher's memory: peak anonymous RSS above the trainer's own (sampled every 2 ms),
//!   and peak file-backed RSS (the anchor's spool maps), both relative to the model size;
//! - the same while the bucket is slower than the trainer (a `file://` bucket behind a
//!   per-request delay of 2 s, queue depth 1), so that steps are coalesced: the peak over the run,
//!   next to the snapshot the publisher holds anyway (1.0x the model).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use driftless_format::gen::{ModelSpec, RlChain};
use driftless_format::{Keypair, Layout};
use driftless_publisher::PublisherBuilder;
use driftless_store::{Bucket, FaultyStore, StoreOptions};

/// The baseline of `publish()`'s blocking time on a delta step: one copy of the BF16 view
/// into memory already touched, on one thread (median of 3).
fn memcpy_secs(chain: &RlChain) -> f64 {
    let views = chain.views();
    let mut dst: Vec<Vec<u8>> = views.iter().map(|v| vec![1u8; v.data.len()]).collect();
    let mut t = vec![];
    for _ in 0..3 {
        let s = Instant::now();
        for (d, v) in dst.iter_mut().zip(&views) {
            d.copy_from_slice(v.data);
        }
        t.push(s.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    median(t)
}

fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let a: Vec<String> = std::env::args().collect();
    a.iter().position(|x| x == name).and_then(|i| a.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// (RssAnon, RssFile) in bytes from /proc/self/status.
fn rss() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |k: &str| {
        s.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    (field("RssAnon:"), field("RssFile:"))
}

struct Sampler {
    stop: Arc<AtomicBool>,
    anon: Arc<AtomicU64>,
    file: Arc<AtomicU64>,
    h: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    fn start() -> Sampler {
        let (stop, anon, file) =
            (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (s, a, f) = (stop.clone(), anon.clone(), file.clone());
        let h = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let (x, y) = rss();
                a.fetch_max(x, Ordering::Relaxed);
                f.fetch_max(y, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        Sampler { stop, anon, file, h: Some(h) }
    }
    fn finish(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        self.h.take().unwrap().join().unwrap();
        (self.anon.load(Ordering::Relaxed), self.file.load(Ordering::Relaxed))
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mb: u64 = arg("--mb", 1024);
    let lr: f32 = arg("--lr", 4e-7);
    let steps: u64 = arg("--steps", 5);
    let t = Instant::now();
    let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(mb << 20), lr, 1);
    let model = chain.bytes();
    eprintln!(
        "model: {:.1} MiB of BF16 in {} tensors (generated in {:.1}s)",
        model as f64 / (1 << 20) as f64,
        chain.metas().len(),
        t.elapsed().as_secs_f64()
    );
    let key = Keypair::generate();
    if std::env::args().any(|a| a == "--coalesce-only") {
        return coalesce_memory(&mut chain, &key, steps.max(6));
    }
    let tmp = tempfile::tempdir()?;
    let mut targets: Vec<(String, Bucket)> = vec![];
    let url = format!("file://{}", tmp.path().join("bucket").display());
    targets.push(("file://".into(), Bucket::open(&url, &StoreOptions::default())?));
    if let Ok(spec) = std::env::var("DRIFTLESS_TEST_S3_SEAWEED") {
        let mut it = spec.split_whitespace();
        let (endpoint, bucket) = (it.next().unwrap_or_default().to_string(), it.next().unwrap_or_default().to_string());
        let o = StoreOptions::default()
            .with_endpoint(endpoint)
            .with_allow_http(true)
            .with_region("us-east-1")
            .with_path_style(true);
        let url = format!("s3://{bucket}/publish-bench-{}", std::process::id());
        targets.push(("S3 (SeaweedFS, loopback)".into(), Bucket::open(&url, &o)?));
    }
    println!("| bucket | full upload (baseline) | first publish -> return | anchor ready | delta publish() -> return | memcpy of the model (baseline) | publish -> delta-ready | delta size | density | ratio vs full upload |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut mem_report = None;
    for (name, bucket) in targets {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        // Baseline: the full checkpoint (safetensors bytes) as one object in the same bucket.
        let layout = Layout::for_tensors(chain.metas(), u64::MAX)?;
        let (header, _) = Layout::shard_header(&layout.shards[0])?;
        let mut full = Vec::with_capacity(header.len() + model as usize);
        full.extend_from_slice(&header);
        for v in chain.views() {
            full.extend_from_slice(v.data);
        }
        let full = bytes::Bytes::from(full);
        let t = Instant::now();
        rt.block_on(bucket.put("baseline/model.safetensors", full.clone()))?;
        let full_secs = t.elapsed().as_secs_f64();
        drop(full);
        rt.block_on(bucket.delete("baseline/model.safetensors"))?;
        drop(rt);

        let spool = tempfile::tempdir()?;
        let (anon0, file0) = rss();
        let sampler = Sampler::start();
        let mut p = PublisherBuilder::new("unused")
            .with_bucket(bucket.clone())
            .with_key(key.clone())
            .with_new_stream(true)
            .with_anchor_every(steps + 1)
            .with_anchor_chain_fraction(1e9)
            .with_spool_dir(spool.path())
            .build()?;
        let first = p.next_step();
        let t = Instant::now();
        p.publish(first, &chain.views())?;
        let anchor_ret = t.elapsed().as_secs_f64();
        p.flush()?;
        let anchor_ready = t.elapsed().as_secs_f64();
        let (anchor_anon, _) = sampler.finish();
        // What the publisher keeps between steps (the snapshot), before the trainer's first
        // optimizer step touches its own lazily zeroed Adam state.
        let held = rss().0.saturating_sub(anon0);
        let mut delta_anon = 0u64;
        let (mut ret, mut ready, mut sizes, mut dens) = (vec![], vec![], vec![], vec![]);
        for s in 1..=steps {
            chain.step();
            // The trainer's own step is not the publisher's memory: sample publish + flush only,
            // against the resident size right before.
            let (before, _) = rss();
            let sm = Sampler::start();
            let t = Instant::now();
            let r = p.publish(first + s, &chain.views())?;
            ret.push(t.elapsed().as_secs_f64());
            p.flush()?;
            ready.push(t.elapsed().as_secs_f64());
            delta_anon = delta_anon.max(sm.finish().0.saturating_sub(before));
            // Encoded after publish() returned: its size is known once flushed.
            sizes.push(r.delta_bytes.unwrap_or(p.status().last_delta_bytes) as f64);
            dens.push(r.density);
        }
        // A scheduled anchor step (a delta, and an anchor encoded in the background), then a
        // delta step at once (its weights made beforehand, as a trainer with a short step
        // has them): its `publish()` must not wait for the anchor's compression.
        chain.step();
        let at_anchor: Vec<(driftless_format::TensorMeta, Vec<u8>)> =
            chain.views().iter().map(|v| (v.meta(), v.data.to_vec())).collect();
        let views: Vec<_> = at_anchor
            .iter()
            .map(|(m, d)| driftless_format::TensorView { name: &m.name, dtype: m.dtype, shape: &m.shape, data: d })
            .collect();
        chain.step();
        let anchor_step = p.publish(first + steps + 1, &views)?.outcome;
        let t = Instant::now();
        let after = p.publish(first + steps + 2, &chain.views())?.outcome;
        let after_anchor = t.elapsed().as_secs_f64();
        p.flush()?;
        drop(views);
        drop(at_anchor);
        p.close()?;
        println!(
            "  {name}: delta publish() right after a scheduled anchor step ({anchor_step:?}, then {after:?}): {after_anchor:.3} s, plain delta steps {:.3} s (median)",
            median(ret.clone())
        );
        if mem_report.is_none() {
            let _ = file0;
            mem_report = Some((anchor_anon.saturating_sub(anon0), held, delta_anon));
        }
        let (r, d) = (median(ret), median(ready));
        let copy = memcpy_secs(&chain);
        println!(
            "| {name} | {full_secs:.2} s | {anchor_ret:.2} s | {anchor_ready:.2} s | {r:.3} s (median of {steps}) | {copy:.3} s | {d:.3} s | {:.2} MiB | {:.2}% | {:.1}x faster to ready |",
            median(sizes) / (1 << 20) as f64,
            100.0 * median(dens),
            full_secs / d
        );
    }
    coalesce_memory(&mut chain, &key, steps.max(6))?;
    if let Some((anchor, held, delta)) = mem_report {
        println!();
        println!(
            "publisher memory over the trainer's (file:// run, anonymous RSS, sampled every 2 ms): first publish + anchor peak +{:.0} MiB = {:.3}x the model; held between steps +{:.0} MiB = {:.3}x; delta step peak (held + transient) {:.3}x (transient +{:.0} MiB)",
            anchor as f64 / (1 << 20) as f64,
            anchor as f64 / model as f64,
            held as f64 / (1 << 20) as f64,
            held as f64 / model as f64,
            (held + delta) as f64 / model as f64,
            delta as f64 / (1 << 20) as f64
        );
    }
    Ok(())
}

/// Steps published faster than a slow bucket takes them: most are coalesced, and the newest
/// coalesced step is held until a later one is queued or `flush` publishes it. Prints the
/// peak anonymous memory above the trainer's own, next to the snapshot alone.
fn coalesce_memory(chain: &mut RlChain, key: &Keypair, steps: u64) -> Result<(), Box<dyn std::error::Error>> {
    let model = chain.bytes();
    let tmp = tempfile::tempdir()?;
    let url = format!("file://{}", tmp.path().join("bucket").display());
    let plain = Bucket::open(&url, &StoreOptions::default())?;
    let slow = Arc::new(FaultyStore::new(plain.store().clone()));
    let bucket = Bucket::from_store(slow.clone(), plain.prefix(), plain.options());
    let spool = tempfile::tempdir()?;
    let mut p = PublisherBuilder::new("unused")
        .with_bucket(bucket)
        .with_key(key.clone())
        .with_new_stream(true)
        .with_queue_depth(1)
        .with_anchor_every(1000)
        .with_anchor_chain_fraction(1e9)
        .with_spool_dir(spool.path())
        .build()?;
    let first = p.next_step();
    p.publish(first, &chain.views())?;
    p.flush()?;
    // The trainer's first step allocates its optimizer state: not the publisher's memory.
    chain.step();
    p.publish(first + 1, &chain.views())?;
    p.flush()?;
    // Slower per step than the generator's optimizer step on 2 cores (~6 s at 1 GiB): a
    // delta takes 5-6 requests.
    slow.set_delay(Duration::from_millis(2000));
    let (anon0, _) = rss();
    let sampler = Sampler::start();
    let t = Instant::now();
    let mut coalesced = 0;
    for s in 2..=steps {
        chain.step();
        let r = p.publish(first + s, &chain.views())?;
        coalesced += usize::from(r.outcome == driftless_publisher::Outcome::Coalesced);
    }
    slow.set_delay(Duration::ZERO);
    p.flush()?;
    let secs = t.elapsed().as_secs_f64();
    let (peak, _) = sampler.finish();
    p.close()?;
    let held = peak.saturating_sub(anon0) as f64;
    println!();
    println!(
        "coalescing (file:// with 2 s per request, queue depth 1, {steps} steps, {coalesced} coalesced, {secs:.1} s): peak anonymous memory over the trainer's and the snapshot already held: +{:.0} MiB = {:.3}x the model (baseline: a dense copy of a coalesced step is +1.0x)",
        held / (1 << 20) as f64,
        held / model as f64
    );
    Ok(())
}
