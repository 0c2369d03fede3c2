use std::path::PathBuf;

use anyhow::Result;

/// `driftless hash CKPT`
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A safetensors file or a checkpoint directory.
    ckpt: PathBuf,
}

pub fn run(a: Args) -> Result<()> {
    let ck = super::open(&a.ckpt)?;
    let (_, root) = driftless_format::weights_root(&ck.views());
    println!("{root}");
    Ok(())
}
