use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use driftless_format::Keypair;

/// `driftless keygen --out KEY`
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Path of the secret key; the public key goes to KEY.pub.
    #[arg(long, short)]
    out: PathBuf,
    /// Overwrite existing files.
    #[arg(long)]
    force: bool,
}

pub fn run(a: Args) -> Result<()> {
    let pub_path = PathBuf::from(format!("{}.pub", a.out.display()));
    if !a.force && (a.out.exists() || pub_path.exists()) {
        bail!("{} or {} exists (use --force to overwrite)", a.out.display(), pub_path.display());
    }
    let k = Keypair::generate();
    write_secret(&a.out, k.to_pem()?.as_bytes()).with_context(|| format!("writing {}", a.out.display()))?;
    std::fs::write(&pub_path, k.public_pem()?).with_context(|| format!("writing {}", pub_path.display()))?;
    println!("{}", k.id());
    Ok(())
}

fn write_secret(p: &std::path::Path, b: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(0o600);
    }
    let mut f = o.open(p)?;
    // An existing file (--force) keeps its mode through open(2): make it private before
    // the key is written into it (a 0644 file stayed world-readable; found by review).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    }
    f.write_all(b)
}
