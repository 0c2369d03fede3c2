//! A simulated trainer publishing an RL chain into a bucket.
//!
//! `cargo run --release -p driftless-publisher --example trainer -- file:///tmp/stream 20`
//! then follow it with `driftless agent --once --allow-unsigned --bucket file:///tmp/stream --dir /tmp/agent`.

use driftless_format::gen::{ModelSpec, RlChain};
use driftless_publisher::PublisherBuilder;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args.next().unwrap_or_else(|| "file:///tmp/driftless-stream".into());
    let steps: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(20);
    let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(32 << 20), 5e-7, 0);
    // Unsigned for the example; real trainers pass .with_key(Keypair::read(path)?).
    let mut p = PublisherBuilder::new(&url).with_anchor_every(10).with_new_stream(true).build()?;
    let first = p.next_step();
    for step in first..first + steps {
        let r = p.publish(step, &chain.views())?;
        // A delta's size is known once its background encode is done: the next step reports it.
        println!(
            "step {step}: {:?}, {:.2}% changed; last delta {} bytes",
            r.outcome,
            100.0 * r.density,
            p.status().last_delta_bytes
        );
        chain.step(); // the optimizer step
    }
    p.close()?;
    Ok(())
}
