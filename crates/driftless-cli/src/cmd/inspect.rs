use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use driftless_format::{container, delta, TrustSet};

/// `driftless inspect DELTA [--json]`
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A delta file.
    delta: PathBuf,
    /// Trusted public key to verify the signature with; without one the signature is shown
    /// but not checked.
    #[arg(long)]
    trust: Vec<PathBuf>,
    /// JSON output.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let bytes = std::fs::read(&a.delta).with_context(|| format!("reading {}", a.delta.display()))?;
    let verify = !a.trust.is_empty();
    let mut trust = TrustSet::new().allow_unsigned(!verify);
    for t in &a.trust {
        trust = trust.with_file(t)?;
    }
    // Without keys, read the manifest without checking who signed it: inspect is a viewer.
    let bytes = if verify { bytes } else { strip_signatures(&bytes)? };
    let d = container::read_delta_file(&bytes, &trust)?;
    let signer = d.signer.clone();
    report(&a, &d.segments, d.manifest, signer)
}

fn strip_signatures(bytes: &[u8]) -> Result<Vec<u8>> {
    anyhow::ensure!(bytes.len() >= 32, "not a delta file");
    let elen = u64::from_le_bytes(bytes[24..32].try_into()?) as usize;
    anyhow::ensure!(32 + elen <= bytes.len(), "truncated delta file");
    let mut env: driftless_format::sign::Envelope = serde_json::from_slice(&bytes[32..32 + elen])?;
    env.signatures.clear();
    let e = serde_json::to_vec(&env)?;
    let mut out = bytes[..24].to_vec();
    out.extend_from_slice(&(e.len() as u64).to_le_bytes());
    out.extend_from_slice(&e);
    out.extend_from_slice(&bytes[32 + elen..]);
    Ok(out)
}

#[derive(serde::Serialize, Default)]
struct TensorRow {
    elements: u64,
    changed: u64,
    dense_chunks: u64,
    dtype: String,
}

fn report(a: &Args, segs: &[&[u8]], m: driftless_format::DeltaManifest, signer: Option<String>) -> Result<()> {
    let mut rows: BTreeMap<String, TensorRow> = BTreeMap::new();
    for s in m.shards.iter().flat_map(|s| &s.tensors) {
        let r = rows.entry(s.name.clone()).or_default();
        r.elements = s.shape.iter().product();
        r.dtype = s.dtype.to_string();
    }
    for (s, seg) in m.segments.iter().zip(segs) {
        let d = delta::decode_segment(seg, s.raw_size)?;
        for e in &d.entries {
            let r = rows.entry(e.name.clone()).or_default();
            r.changed += e.count;
            r.dense_chunks += e.dense as u64;
        }
    }
    let signature = match (&signer, a.trust.is_empty()) {
        (Some(k), _) => format!("verified, {k}"),
        (None, true) => "not checked (pass --trust KEY.pub)".into(),
        (None, false) => "unsigned".into(),
    };
    if a.json {
        let v = serde_json::json!({"type": "delta", "data": {
            "step": m.step, "base_step": m.base_step, "base_root": m.base_root, "result_root": m.result_root,
            "value_mode": m.value_mode, "codec": m.codec, "signature": signature, "stats": m.stats,
            "segments": m.segments.len(), "tensors": rows}});
        println!("{v}");
        return Ok(());
    }
    let s = &m.stats;
    println!("step {} (base {}), value mode {:?}, codec {:?}, signature: {}", m.step, m.base_step, m.value_mode, m.codec, signature);
    println!("base root   {}\nresult root {}", m.base_root, m.result_root);
    println!(
        "{} segments, {} bytes; {} of {} elements changed ({:.4}%); ratio {:.1}x vs dense {} bytes",
        m.segments.len(),
        s.payload_bytes,
        s.changed,
        s.elements,
        100.0 * s.changed as f64 / s.elements.max(1) as f64,
        s.dense_bytes as f64 / s.payload_bytes.max(1) as f64,
        s.dense_bytes
    );
    println!("{:<60} {:>6} {:>12} {:>10} {:>6}", "tensor", "dtype", "elements", "density", "dense");
    for (n, r) in &rows {
        println!(
            "{:<60} {:>6} {:>12} {:>9.4}% {:>6}",
            n,
            r.dtype,
            r.elements,
            100.0 * r.changed as f64 / r.elements.max(1) as f64,
            r.dense_chunks
        );
    }
    Ok(())
}
