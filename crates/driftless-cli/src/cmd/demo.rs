//! `driftless demo`: a simulated trainer publishes a realistic chain into a `file://` bucket
//! in a temporary directory while an agent follows it; prints sizes, ratios, paths, timings,
//! and checks the agent ends bit-identical to the trainer.

use std::time::Instant;

use anyhow::{ensure, Result};
use driftless_agent::{Agent, AgentConfig};
use driftless_format::gen::{ModelSpec, RlChain};
use driftless_format::{Checkpoint, Keypair, TrustSet};
use driftless_publisher::PublisherBuilder;
use driftless_store::{Bucket, StoreOptions};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model size in MiB of BF16 weights.
    #[arg(long, default_value_t = 64)]
    mb: u64,
    /// Steps to publish.
    #[arg(long, default_value_t = 24)]
    steps: u64,
    /// Anchor every K steps.
    #[arg(long, default_value_t = 10)]
    anchor_every: u64,
    /// Learning rate of the simulated trainer.
    #[arg(long, default_value_t = 5e-7)]
    lr: f32,
}

pub fn run(a: Args) -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let url = format!("file://{}", tmp.path().join("bucket").display());
    let bucket = Bucket::open(&url, &StoreOptions::default())?;
    let key = Keypair::generate();
    let trust = TrustSet::new().with_key(key.public());
    let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(a.mb << 20), a.lr, 42);
    println!(
        "driftless demo: bucket {url}, model {:.1} MiB BF16 ({} tensors), lr {}, anchor every {}",
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
    println!(
        "{:>5} {:>10} {:>12} {:>8} {:>9} {:>10} {:>9} {:>9}",
        "step", "publish", "delta bytes", "ratio", "changed", "agent path", "bytes", "agent s"
    );
    for step in 0..a.steps {
        if step > 0 {
            chain.step();
        }
        let r = p.publish(step, &chain.views())?;
        p.flush()?;
        let t = Instant::now();
        let o = rt.block_on(agent.sync_once())?;
        println!(
            "{:>5} {:>10} {:>12} {:>7.1}x {:>8.3}% {:>10} {:>9} {:>9.3}",
            step,
            format!("{:?}", r.outcome).to_lowercase(),
            r.delta_bytes,
            r.ratio,
            100.0 * r.density,
            o.route.to_string(),
            o.bytes,
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
    println!(
        "uploaded {} bytes in all for {} steps of a {:.1} MiB model",
        s.bytes_uploaded,
        a.steps,
        chain.bytes() as f64 / 1048576.0
    );
    println!("OK: the agent's checkpoint is bit-identical to the trainer's weights (root {root})");
    Ok(())
}
