//! Subcommands, one file each.

pub mod agent;
pub mod bench;
pub mod bucket;
pub mod demo;
pub mod diff;
pub mod gc;
pub mod hash;
pub mod inspect;
pub mod keygen;
pub mod patch;
pub mod publish;

/// A local checkpoint named on the command line. A file that is not a safetensors checkpoint
/// is bad input (exit 2), not a verification failure.
pub fn open(path: &std::path::Path) -> anyhow::Result<driftless_format::Checkpoint> {
    driftless_format::Checkpoint::open(path).map_err(|e| {
        // Name the path unless the cause already does (it names the shard file).
        let context = if e.to_string().contains(&path.display().to_string()) {
            "opening checkpoint".to_string()
        } else {
            format!("opening checkpoint {}", path.display())
        };
        crate::exit::BadInput { context, source: e.into() }.into()
    })
}

/// The trust set from `--trust` files and `--allow-unsigned`. A key file that cannot be read
/// or parsed is bad input (exit 2).
pub fn trust_set(files: &[std::path::PathBuf], allow_unsigned: bool) -> anyhow::Result<driftless_format::TrustSet> {
    let mut trust = driftless_format::TrustSet::new().allow_unsigned(allow_unsigned);
    for t in files {
        trust = trust.with_file(t).map_err(|e| crate::exit::BadInput {
            context: format!("reading trusted key {}", t.display()),
            source: e.into(),
        })?;
    }
    Ok(trust)
}

/// The keys a verifying command (`agent`, `patch`) checks signatures with: `--trust` keys, or
/// `--allow-unsigned`, exactly one of the two. With neither, every signed step would be refused
/// as "untrusted" (exit 1, read as forged data) when the user only forgot a flag: a usage error.
pub fn verifying_trust_set(
    files: &[std::path::PathBuf],
    allow_unsigned: bool,
) -> anyhow::Result<driftless_format::TrustSet> {
    let trust = trust_set(files, allow_unsigned)?;
    if trust.is_empty() && !allow_unsigned {
        anyhow::bail!("give --trust KEY.pub (or --allow-unsigned for unsigned data)");
    }
    if !trust.is_empty() && allow_unsigned {
        // With a key configured, an unsigned manifest is a stripped signature: never accepted.
        anyhow::bail!(
            "--allow-unsigned cannot be combined with --trust (unsigned manifests are refused when a key is trusted)"
        );
    }
    Ok(trust)
}

/// A serde enum's name (`delta_and_anchor`, `up_to_date`): the one spelling used in text
/// output, JSON and the Python binding.
pub fn snake<T: serde::Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => "?".into(),
    }
}

/// The signing key of `--key`, if given. A key file that cannot be read or parsed is bad input
/// (exit 2).
pub fn signing_key(path: Option<&std::path::Path>) -> anyhow::Result<Option<driftless_format::Keypair>> {
    path.map(|k| {
        driftless_format::Keypair::read(k).map_err(|e| {
            crate::exit::BadInput { context: format!("reading signing key {}", k.display()), source: e.into() }.into()
        })
    })
    .transpose()
}
