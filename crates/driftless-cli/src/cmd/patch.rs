use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use driftless_format::{container, ops};

/// `driftless patch BASE DELTA -o OUT (--trust KEY.pub... | --allow-unsigned)`
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Base checkpoint (file or directory).
    base: PathBuf,
    /// Delta file from `driftless diff`.
    delta: PathBuf,
    /// Output: a directory, or a `.safetensors` file when the result has one shard.
    #[arg(short, long)]
    out: PathBuf,
    /// Trusted public key (SPKI PEM); repeatable.
    #[arg(long)]
    trust: Vec<PathBuf>,
    /// Accept an unsigned delta.
    #[arg(long)]
    allow_unsigned: bool,
}

pub fn run(a: Args) -> Result<()> {
    let trust = super::verifying_trust_set(&a.trust, a.allow_unsigned)?;
    let bytes = std::fs::read(&a.delta).with_context(|| format!("reading {}", a.delta.display()))?;
    let d = container::read_delta_file(&bytes, &trust)?;
    let base = super::open(&a.base)?;
    let (_, base_root) = driftless_format::weights_root(&base.views());
    if base_root != d.manifest.base_root {
        return Err(driftless_format::Error::WrongBase {
            expected: d.manifest.base_root.to_hex(),
            actual: base_root.to_hex(),
        }
        .into());
    }
    let as_file = a.out.extension().is_some_and(|e| e == "safetensors");
    if as_file && d.manifest.shards.len() != 1 {
        bail!("the result has {} shards; give a directory as --out", d.manifest.shards.len());
    }
    let parent = a.out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    let tmp = tempfile::Builder::new().prefix(".driftless-patch-").tempdir_in(parent)?;
    let root = ops::apply_rewrite(&base.views(), &d.manifest, &d.segments, tmp.path())?;
    drop(base);
    if as_file {
        std::fs::rename(tmp.path().join(&d.manifest.shards[0].file), &a.out)?;
    } else {
        std::fs::create_dir_all(&a.out)?;
        for e in std::fs::read_dir(tmp.path())? {
            let e = e?;
            std::fs::rename(e.path(), a.out.join(e.file_name()))?;
        }
    }
    eprintln!(
        "verified weights root {root}{}",
        match &d.signer {
            Some(k) => format!(", signed by {k}"),
            None => ", UNSIGNED".into(),
        }
    );
    Ok(())
}
