use std::path::PathBuf;

use anyhow::{Context, Result};
use driftless_format::{container, ops, sign, Codec, DeltaOptions, ValueMode};

/// `driftless diff BASE TARGET -o DELTA [--key KEY] [--values overwrite|ulp]`
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Base checkpoint (file or directory).
    base: PathBuf,
    /// Target checkpoint (file or directory).
    target: PathBuf,
    /// Output delta file.
    #[arg(short, long)]
    out: PathBuf,
    /// Signing key (PKCS#8 PEM). Without it the delta is unsigned.
    #[arg(long)]
    key: Option<PathBuf>,
    /// Value encoding: ulp (integer difference of bit patterns, smaller; needs the exact
    /// base) or overwrite (new bit patterns).
    #[arg(long, default_value = "ulp", value_parser = value_modes())]
    values: ValueMode,
    /// zstd level; 0 stores the payload raw.
    #[arg(long, default_value_t = 1)]
    zstd_level: i32,
    /// Step number recorded in the manifest.
    #[arg(long, default_value_t = 1)]
    step: u64,
    /// Base step recorded in the manifest.
    #[arg(long, default_value_t = 0)]
    base_step: u64,
}

pub fn run(a: Args) -> Result<()> {
    let base = super::open(&a.base)?;
    let target = super::open(&a.target)?;
    let key = super::signing_key(a.key.as_deref())?;
    let layout = target.layout();
    let opts = DeltaOptions {
        values: a.values,
        codec: if a.zstd_level == 0 { Codec::Raw } else { Codec::Zstd { level: a.zstd_level } },
        ..Default::default()
    };
    let spec =
        ops::DeltaSpec { stream_id: "offline", step: a.step, base_step: a.base_step, base_root: None, layout: &layout };
    let (m, enc) = ops::make_delta(spec, &base.views(), &target.views(), &opts)?;
    let payload = serde_json::to_vec(&m)?;
    let env = match &key {
        Some(k) => k.seal(&payload)?,
        None => sign::seal_unsigned(&payload)?,
    };
    let segs: Vec<&[u8]> = enc.segments.iter().map(|s| s.bytes.as_slice()).collect();
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(&a.out).with_context(|| format!("creating {}", a.out.display()))?,
    );
    container::write_delta_file(&mut f, &env, &segs)?;
    use std::io::Write;
    f.flush()?;
    let s = &m.stats;
    eprintln!(
        "{} -> {}: {} of {} elements changed ({:.4}%), {} bytes ({:.1}x smaller than dense){}",
        a.base.display(),
        a.target.display(),
        s.changed,
        s.elements,
        100.0 * s.changed as f64 / s.elements.max(1) as f64,
        s.payload_bytes,
        s.dense_bytes as f64 / s.payload_bytes.max(1) as f64,
        if key.is_none() { ", UNSIGNED" } else { "" }
    );
    Ok(())
}

/// `--values`: the modes by name, listed in `--help` and in the error for another value.
fn value_modes() -> impl clap::builder::TypedValueParser<Value = ValueMode> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(["ulp", "overwrite"]).try_map(|s| s.parse::<ValueMode>())
}
