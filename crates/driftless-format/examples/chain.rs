//! Runs the RL-chain generator on a real safetensors model (or a synthetic one) and prints the
//! per-step density and the share of +-1 ulp changes, to compare with the reference generator
//! (`make_chain.py` in the brief's corpus). Optionally writes each step as a safetensors file.
//!
//! `cargo run --release -p driftless-format --example chain -- [--model FILE | --mb N] [--steps N] [--lr X] [--out DIR]`

use driftless_format::gen::{change_stats, ModelSpec, RlChain};
use driftless_format::{checkpoint, Checkpoint, Layout};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |k: &str| args.iter().position(|a| a == k).and_then(|i| args.get(i + 1)).cloned();
    let steps: u64 = get("--steps").map(|s| s.parse()).transpose()?.unwrap_or(5);
    let lr: f32 = get("--lr").map(|s| s.parse()).transpose()?.unwrap_or(1e-6);
    let out = get("--out").map(std::path::PathBuf::from);
    let mut chain = match get("--model") {
        Some(m) => {
            let ck = Checkpoint::open(&m)?;
            RlChain::from_checkpoint(&ck.views(), lr, 0)?
        }
        None => RlChain::new(
            &ModelSpec::with_bf16_bytes(get("--mb").map(|s| s.parse()).transpose()?.unwrap_or(16) << 20),
            lr,
            0,
        ),
    };
    let layout = Layout::for_tensors(chain.metas(), u64::MAX)?;
    let save = |c: &RlChain, step: u64| -> Result<(), Box<dyn std::error::Error>> {
        if let Some(o) = &out {
            let d = o.join(format!("step_{step:06}"));
            checkpoint::write_checkpoint(&d, &layout, &c.views())?;
        }
        Ok(())
    };
    save(&chain, 0)?;
    for step in 1..=steps {
        let prev: Vec<_> = chain.views().iter().map(|v| (v.meta(), v.data.to_vec())).collect();
        chain.step();
        let pv: Vec<_> = prev
            .iter()
            .map(|(m, d)| driftless_format::TensorView { name: &m.name, dtype: m.dtype, shape: &m.shape, data: d })
            .collect();
        let (total, changed, one) = change_stats(&pv, &chain.views());
        println!(
            "{{\"step\": {step}, \"density\": {:.5}, \"one_ulp_share\": {:.4}}}",
            changed as f64 / total as f64,
            one as f64 / changed.max(1) as f64
        );
        save(&chain, step)?;
    }
    Ok(())
}
