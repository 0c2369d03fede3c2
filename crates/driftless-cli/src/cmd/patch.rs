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
    // A directory OUT is new or empty, and is put in place whole by one rename (found by
    // review: files were moved into an existing directory one by one, so stale shards and an
    // old index stayed beside the result, which then read as the base, after "verified";
    // and a failed move left it half new).
    let as_file = a.out.extension().is_some_and(|e| e == "safetensors");
    if !as_file {
        if let Ok(mut entries) = std::fs::read_dir(&a.out) {
            if entries.next().is_some() {
                bail!("{} exists and is not empty: give a new or empty directory as --out", a.out.display());
            }
        }
    }
    let bytes = container::read_delta_path(&a.delta)?;
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
    if as_file && d.manifest.shards.len() != 1 {
        bail!("the result has {} shards; give a directory as --out", d.manifest.shards.len());
    }
    let parent = a.out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    let tmp = tempfile::Builder::new().prefix(".driftless-patch-").tempdir_in(parent)?;
    let root = ops::apply_rewrite(&base.views(), &d.manifest, &d.segments, tmp.path())?;
    drop(base);
    let placed = if as_file {
        std::fs::rename(tmp.path().join(&d.manifest.shards[0].file), &a.out)
    } else {
        // Onto a missing or empty directory, rename(2) is atomic.
        std::fs::set_permissions(tmp.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .and_then(|()| std::fs::rename(tmp.path(), &a.out))
    };
    placed.with_context(|| format!("putting the result in place at {}", a.out.display()))?;
    eprintln!(
        "verified weights root {root}{}",
        match &d.signer {
            Some(k) => format!(", signed by {k}"),
            None => ", UNSIGNED".into(),
        }
    );
    Ok(())
}
