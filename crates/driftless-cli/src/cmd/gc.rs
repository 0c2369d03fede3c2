use anyhow::Result;
use driftless_gc::GcPolicy;

/// `driftless gc --bucket URL [--keep-deltas N] [--keep-anchors M] [--grace DURATION] [--trust KEY.pub]... [--dry-run] [--json]`
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    bucket: super::bucket::BucketArgs,
    /// Newest ready deltas to keep.
    #[arg(long, default_value_t = driftless_gc::DEFAULT_KEEP_DELTAS)]
    keep_deltas: usize,
    /// Newest ready anchors to keep.
    #[arg(long, default_value_t = driftless_gc::DEFAULT_KEEP_ANCHORS)]
    keep_anchors: usize,
    /// Never delete anything younger than this (e.g. 10m, 1h).
    #[arg(long, default_value = "10m")]
    grace: String,
    /// Bound on total bytes (trims oldest first, honouring reachability): 10GB, 512MiB, or
    /// a plain number of bytes.
    #[arg(long, value_parser = driftless_format::units::parse_bytes)]
    max_bytes: Option<u64>,
    /// Trusted public key (SPKI PEM), repeatable: the manifests of the steps GC keeps as the
    /// newest must be signed by one, as agents check them. Without it GC checks what it can
    /// without keys (the manifest matches its marker), which catches corruption but not a
    /// marker planted with a manifest of its own.
    #[arg(long)]
    trust: Vec<std::path::PathBuf>,
    /// Print the plan without deleting.
    #[arg(long)]
    dry_run: bool,
    /// JSON output.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let policy = GcPolicy::new()
        .with_keep_deltas(a.keep_deltas)
        .with_keep_anchors(a.keep_anchors)
        .with_grace(driftless_gc::parse_duration(&a.grace)?)
        .with_max_bytes(a.max_bytes)
        .with_trust(Some(super::trust_set(&a.trust, false)?));
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let bucket = a.bucket.open_existing()?;
    let report = rt.block_on(driftless_gc::run(&bucket, &policy, a.dry_run))?;
    if a.json {
        println!("{}", serde_json::json!({"type": "gc", "data": report}));
    } else {
        println!("{}", report.to_string().trim_end());
    }
    Ok(())
}
