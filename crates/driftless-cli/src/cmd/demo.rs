//! `driftless demo`: a simulated trainer publishes a realistic chain into a `file://` bucket
//! in a temporary directory while an agent follows it; prints sizes, ratios, paths, timings,
//! and checks the agent ends bit-identical to the trainer.

use std::time::Instant;

use anyhow::{ensure, Result};
use driftless_agent::{Agent, AgentConfig};
use driftless_format::gen::{ModelSpec, RlChain};
use driftless_format::{Checkpoint, Keypair, TrustSet};
use driftless_publisher::{Outcome, PublisherBuilder};
use driftless_store::{Bucket, StoreOptions};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model size in MiB of BF16 weights.
    #[arg(long, default_value_t = 64)]
    mb: u64,
    /// Steps to publish.
    #[arg(long, default_value_t = 24, value_parser = clap::value_parser!(u64).range(1..))]
    steps: u64,
    /// Anchor every K steps.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    anchor_every: u64,
    /// Learning rate of the simulated trainer.
    #[arg(long, default_value_t = 5e-7)]
    lr: f32,
    /// Keep the bucket, the agent's directory and the publisher's public key afterwards (their
    /// paths are printed), to look at them with `driftless inspect --bucket file://... --trust KEY.pub`.
    #[arg(long)]
    keep: bool,
}

/// Bytes as a short human size, fixed width friendly.
fn size(b: u64) -> String {
    const K: f64 = 1024.0;
    let b = b as f64;
    if b < K {
        format!("{b:.0} B")
    } else if b < K * K {
        format!("{:.1} KiB", b / K)
    } else if b < K * K * K {
        format!("{:.1} MiB", b / (K * K))
    } else {
        format!("{:.2} GiB", b / (K * K * K))
    }
}

pub fn run(a: Args) -> Result<()> {
    let tmp = tempfile::Builder::new().prefix("driftless-demo-").tempdir()?;
    let url = format!("file://{}", tmp.path().join("bucket").display());
    let bucket = Bucket::open(&url, &StoreOptions::default())?;
    let key = Keypair::generate();
    let trust = TrustSet::new().with_key(key.public());
    let public_pem = key.public_pem()?;
    let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(a.mb << 20), a.lr, 42);
    println!(
        "driftless demo: bucket {url}, model {:.1} MiB BF16 ({} tensors), lr {:e}, anchor every {}",
        chain.bytes() as f64 / 1048576.0,
        chain.metas().len(),
        a.lr,
        a.anchor_every
    );
    let mut p = PublisherBuilder::new(&url)
        .with_bucket(bucket.clone())
        .with_key(key)
        .with_anchor_every(a.anchor_every)
        .build()?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mut agent = Agent::new(bucket, AgentConfig::new(tmp.path().join("agent"), trust))?;
    // "uploaded" is everything the step put in the bucket (an anchor's size included);
    // "ratio" is the full checkpoint over that.
    println!(
        "{:>5}  {:<16} {:>11} {:>8} {:>8}  {:<8} {:>11} {:>8}",
        "step", "published", "uploaded", "ratio", "changed", "agent", "downloaded", "agent s"
    );
    let full = chain.bytes();
    let mut downloaded = 0u64;
    for step in 0..a.steps {
        if step > 0 {
            chain.step();
        }
        let before = p.status().bytes_uploaded;
        let r = p.publish(step, &chain.views())?;
        p.flush()?;
        let uploaded = p.status().bytes_uploaded - before;
        let t = Instant::now();
        let o = rt.block_on(agent.sync_once())?;
        downloaded += o.bytes;
        println!(
            "{:>5}  {:<16} {:>11} {:>7.1}x {:>8}  {:<8} {:>11} {:>8.3}",
            step,
            super::snake(&r.outcome),
            size(uploaded),
            full as f64 / uploaded.max(1) as f64,
            if matches!(r.outcome, Outcome::Delta | Outcome::DeltaAndAnchor) {
                format!("{:.3}%", 100.0 * r.density)
            } else {
                "-".into()
            },
            super::snake(&o.route),
            size(o.bytes),
            t.elapsed().as_secs_f64()
        );
        ensure!(o.step == step, "agent is on step {} instead of {step}", o.step);
    }
    let s = p.status();
    p.close()?;
    let ck = Checkpoint::open(agent.current_dir())?;
    let got = ck.views();
    for w in chain.views() {
        let g = got.iter().find(|g| g.name == w.name).ok_or_else(|| anyhow::anyhow!("tensor {} missing", w.name))?;
        ensure!(g.data == w.data, "tensor {} differs", w.name);
    }
    let (_, root) = driftless_format::weights_root(&got);
    let naive = full * a.steps;
    println!(
        "moved: {} uploaded and {} downloaded by the agent for {} steps; sending every full checkpoint \
         ({} each) would have moved {} each way: {:.1}x less uploaded, {:.1}x less downloaded",
        size(s.bytes_uploaded),
        size(downloaded),
        a.steps,
        size(full),
        size(naive),
        naive as f64 / s.bytes_uploaded.max(1) as f64,
        naive as f64 / downloaded.max(1) as f64,
    );
    println!("OK: the agent's checkpoint is bit-identical to the trainer's weights (root {root})");
    drop(agent);
    if a.keep {
        // The publisher's public key too: without it the kept stream can be listed but not
        // verified (`inspect --trust`) or followed by another agent.
        let key_pub = tmp.path().join("key.pub");
        std::fs::write(&key_pub, &public_pem)?;
        let dir = tmp.keep();
        println!(
            "kept: bucket {url} (driftless inspect --bucket {url} --trust {}), agent directory {}",
            key_pub.display(),
            dir.join("agent").display()
        );
    }
    Ok(())
}
