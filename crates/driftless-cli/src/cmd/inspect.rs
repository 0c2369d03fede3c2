use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use driftless_format::{container, delta, TrustSet};

/// `driftless inspect DELTA [--json]` or `driftless inspect --bucket URL [--json]`
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A delta file (omit with --bucket to describe a whole stream).
    #[arg(required_unless_present = "bucket")]
    delta: Option<PathBuf>,
    /// Describe the stream at this URL instead of a delta file.
    #[arg(long, conflicts_with = "delta")]
    bucket: Option<String>,
    /// S3 endpoint (S3-compatible servers); also AWS_ENDPOINT_URL.
    #[arg(long, requires = "bucket", conflicts_with = "delta")]
    endpoint: Option<String>,
    /// Region; also AWS_REGION.
    #[arg(long, requires = "bucket", conflicts_with = "delta")]
    region: Option<String>,
    /// Allow plain HTTP endpoints.
    #[arg(long, requires = "bucket", conflicts_with = "delta")]
    allow_http: bool,
    /// Trusted public key to verify the signature with; without one the signature is shown
    /// but not checked.
    #[arg(long)]
    trust: Vec<PathBuf>,
    /// JSON output.
    #[arg(long)]
    json: bool,
    /// With --bucket: read the manifests of at most this many ready steps, the newest (the
    /// counts cover every step). Bounds the time a bucket with planted markers takes.
    #[arg(long, default_value_t = 1000, requires = "bucket", conflicts_with = "delta")]
    max_steps: usize,
}

pub fn run(a: Args) -> Result<()> {
    let Some(path) = a.delta.as_deref() else {
        return stream(&a);
    };
    let bytes = container::read_delta_path(path)?;
    let verify = !a.trust.is_empty();
    let trust = super::trust_set(&a.trust, !verify)?;
    // Without keys, read the manifest without checking who signed it: inspect is a viewer.
    let bytes = if verify { bytes } else { strip_signatures(&bytes)? };
    let d = container::read_delta_file(&bytes, &trust)?;
    let signer = d.signer.clone();
    report(&a, &d.segments, d.manifest, signer)
}

fn strip_signatures(bytes: &[u8]) -> Result<Vec<u8>> {
    anyhow::ensure!(bytes.len() >= 32, "not a delta file");
    let elen = u64::from_le_bytes(bytes[24..32].try_into()?) as usize;
    anyhow::ensure!(elen <= bytes.len() - 32, "truncated delta file");
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
            // Saturating, like every sum of sizes read here (a delta file may come from a bucket).
            r.changed = r.changed.saturating_add(e.count);
            r.dense_chunks = r.dense_chunks.saturating_add(e.dense as u64);
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
    println!(
        "step {} (base {}), value mode {}, codec {}, signature: {}",
        m.step, m.base_step, m.value_mode, m.codec, signature
    );
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

/// One step of the stream as `inspect --bucket` shows it.
#[derive(serde::Serialize, Debug)]
struct StepRow {
    kind: &'static str,
    step: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    base_step: Option<u64>,
    /// Payload bytes in the bucket (segments, or anchor shards and files).
    bytes: u64,
    /// Dense BF16 size / delta bytes (deltas), dense size / stored size (anchors).
    ratio: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    density: Option<f64>,
    /// `verified` (signature by a --trust key), `unchecked` (no --trust), or the error.
    manifest: String,
}

/// `inspect --bucket`: the chain at a glance.
fn stream(a: &Args) -> Result<()> {
    use driftless_format::StepKind;
    use driftless_store::{layout, stream::StreamReader};
    let url = a.bucket.clone().context("--bucket is required without a DELTA file")?;
    // Not a flattened BucketArgs: its environment fallbacks would make `inspect DELTA` demand
    // --bucket whenever AWS_ENDPOINT_URL is set.
    let b = &super::bucket::BucketArgs {
        bucket: url,
        endpoint: a.endpoint.clone().or_else(|| std::env::var("AWS_ENDPOINT_URL").ok()),
        region: a.region.clone().or_else(|| std::env::var("AWS_REGION").ok()),
        allow_http: a.allow_http,
    };
    let bucket = b.open_existing()?;
    let verify = !a.trust.is_empty();
    let trust = super::trust_set(&a.trust, true)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        // Without keys, read signed documents without checking who signed them: a viewer.
        let open = |bytes: &[u8]| -> Result<(Vec<u8>, Vec<String>)> {
            // With keys, the signer that verified, not every key id the envelope lists (found
            // by review: a junk signature appended under any key id was shown as verified); a
            // junk envelope is then the format's corrupt error (exit 1), as for an agent.
            if verify {
                let (payload, signer) = trust.open(bytes)?;
                return Ok((payload, signer.into_iter().collect()));
            }
            let env: driftless_format::sign::Envelope = serde_json::from_slice(bytes).context("not an envelope")?;
            let signers = env.signatures.iter().map(|s| s.key_id.clone()).collect();
            Ok((env.payload.into_bytes(), signers))
        };
        // Without keys (a viewer), a stream.json that cannot be read or parsed is shown as such
        // and the steps are still listed: a viewer of a damaged bucket shows the damage (it
        // stopped at a junk stream.json). With keys the stream must verify: an error, as
        // before. A latest.json that cannot be read, checked or parsed is shown either way (it
        // was hidden); it is a hint, agents list the bucket without it.
        let desc = match bucket.get_limited(layout::STREAM, 1 << 20).await {
            Ok(b) => Some(open(&b).and_then(|(p, signers)| {
                Ok((driftless_format::StreamDescriptor::from_slice(&p).context("not a stream descriptor")?, signers))
            })),
            Err(e) if e.is_not_found() => None,
            Err(e) if e.is_retryable() => return Err(e.into()),
            Err(e) => Some(Err(anyhow::Error::from(e))),
        };
        let desc_error = match desc {
            Some(Err(e)) if verify => return Err(e),
            Some(Err(ref e)) => Some(format!("{e:#}")),
            _ => None,
        };
        let desc = desc.and_then(Result::ok);
        let keys = bucket.list("").await?;
        if desc.is_none() && keys.is_empty() {
            anyhow::bail!("no stream at {}: no stream.json and no objects (check the URL)", bucket.url());
        }
        let mut dirs: BTreeMap<(u8, u64), (u64, usize)> = BTreeMap::new();
        let mut ready: BTreeMap<(u8, u64), ()> = BTreeMap::new();
        let mut other = 0usize;
        // The largest manifest object listed in each step directory: what reading its row may
        // fetch (bounded by the manifest limit), to bound the bytes in flight below.
        let mut manifest_bytes: BTreeMap<(u8, u64), u64> = BTreeMap::new();
        let kid = |k: StepKind| if k == StepKind::Anchor { 1u8 } else { 0u8 };
        for o in &keys {
            match layout::parse_step_key(&o.key) {
                Some((k, s, Some(name))) => {
                    let e = dirs.entry((kid(k), s)).or_default();
                    // Listed sizes are whatever the bucket says (found by review: two objects
                    // listed at u64::MAX overflowed the sum, a panic in a debug build).
                    e.0 = e.0.saturating_add(o.size);
                    e.1 += 1;
                    if name.ends_with("manifest.json") {
                        let m = manifest_bytes.entry((kid(k), s)).or_insert(0u64);
                        *m = (*m).max(o.size);
                    }
                }
                Some((k, s, None)) => {
                    ready.insert((kid(k), s), ());
                }
                // The stream's own files and its publishers' claims and leases are the layout.
                None if o.key == layout::STREAM
                    || o.key == layout::LATEST
                    || o.key == layout::GC_CLOCK
                    || o.key.starts_with(layout::claims_prefix())
                    || o.key.starts_with(layout::leases_prefix()) => {}
                None => other += 1,
            }
        }
        let reader = StreamReader::new(
            bucket.clone(),
            if verify { trust.clone() } else { TrustSet::new().allow_unsigned(true) },
        );
        // The newest `max_steps` ready steps, read 16 at a time (they were read one by one:
        // a bucket with a million planted markers took hours over S3).
        let shown: Vec<(u8, u64)> = {
            let mut all: Vec<(u8, u64)> = ready.keys().copied().collect();
            all.sort_by_key(|&(k, s)| std::cmp::Reverse((s, k)));
            all.truncate(a.max_steps);
            all
        };
        let (reader, bucket) = (&reader, &bucket);
        // At most 16 reads, and at most 256 MiB of listed manifest bytes, in flight: planted
        // manifests near the 64 MiB limit are then read a few at a time, not 16.
        const IN_FLIGHT_MIB: u32 = 256;
        let budget = tokio::sync::Semaphore::new(IN_FLIGHT_MIB as usize);
        let (budget, manifest_bytes) = (&budget, &manifest_bytes);
        let read_row = |(k, s): (u8, u64)| async move {
            let mib =
                manifest_bytes.get(&(k, s)).map_or(1, |b| (b >> 20).saturating_add(1).min(IN_FLIGHT_MIB.into()) as u32);
            let _permit = budget.acquire_many(mib).await.expect("never closed");
            if k == 0 {
                match read_delta(reader, bucket, verify, s).await {
                    Ok((m, state)) => StepRow {
                        kind: "delta",
                        step: s,
                        base_step: Some(m.base_step),
                        bytes: m.payload_bytes(),
                        ratio: m.stats.dense_bytes as f64 / m.payload_bytes().max(1) as f64,
                        density: Some(m.stats.changed as f64 / m.stats.elements.max(1) as f64),
                        manifest: state,
                    },
                    Err(e) => StepRow {
                        kind: "delta",
                        step: s,
                        base_step: None,
                        bytes: 0,
                        ratio: 0.0,
                        density: None,
                        manifest: format!("{e:#}"),
                    },
                }
            } else {
                match read_anchor(reader, bucket, verify, s).await {
                    Ok((m, state)) => {
                        // Saturating: sizes of an unsigned manifest are whatever a bucket says
                        // (found by review: a planted one overflowed the sum, a panic).
                        let stored = m
                            .objects
                            .iter()
                            .map(|o| o.object.size)
                            .chain(m.files.iter().map(|f| f.size))
                            .fold(0u64, u64::saturating_add);
                        let decoded = m.objects.iter().map(|o| o.decoded_size).fold(0u64, u64::saturating_add);
                        StepRow {
                            kind: "anchor",
                            step: s,
                            base_step: None,
                            bytes: stored,
                            ratio: decoded as f64 / stored.max(1) as f64,
                            density: None,
                            manifest: state,
                        }
                    }
                    Err(e) => StepRow {
                        kind: "anchor",
                        step: s,
                        base_step: None,
                        bytes: 0,
                        ratio: 0.0,
                        density: None,
                        manifest: format!("{e:#}"),
                    },
                }
            }
        };
        use futures::StreamExt;
        let mut rows: Vec<StepRow> = futures::stream::iter(shown).map(read_row).buffer_unordered(16).collect().await;
        rows.sort_by_key(|r| (r.step, r.kind == "anchor"));
        let unread = ready.len() - rows.len();
        // Step directories without a ready marker: in flight (under a publisher's lease),
        // failed, or a killed writer's leftovers that GC removes once its lease expired.
        let mut incomplete = vec![];
        for (&(k, s), &(bytes, objects)) in &dirs {
            if ready.contains_key(&(k, s)) {
                continue;
            }
            let kind = if k == 1 { "anchor" } else { "delta" };
            incomplete.push(serde_json::json!({"kind": kind, "step": s, "objects": objects, "bytes": bytes}));
        }
        let latest: Option<Result<driftless_format::LatestHint, String>> = match bucket
            .get_limited(layout::LATEST, 1 << 20)
            .await
        {
            Ok(b) => Some(
                open(&b)
                    .and_then(|(p, _)| driftless_format::LatestHint::from_slice(&p).context("not a latest.json hint"))
                    .map_err(|e| format!("{e:#}")),
            ),
            Err(e) if e.is_not_found() => None,
            Err(e) => Some(Err(e.to_string())),
        };
        let latest_json = |l: &Result<driftless_format::LatestHint, String>| match l {
            Ok(l) => serde_json::json!({"delta": l.delta, "anchor": l.anchor}),
            Err(e) => serde_json::json!({"error": e}),
        };
        // Counted over every ready marker; bytes over the steps read.
        let deltas = ready.keys().filter(|(k, _)| *k == 0).count();
        let anchors = ready.len() - deltas;
        let delta_bytes = rows.iter().filter(|r| r.kind == "delta").map(|r| r.bytes).fold(0u64, u64::saturating_add);
        let signature = if verify { "verified against --trust keys" } else { "not checked (pass --trust KEY.pub)" };
        if a.json {
            let (id, keys_, created) = match &desc {
                Some((d, _)) => (Some(d.stream_id.clone()), d.trusted_keys.clone(), Some(d.created_at_ms)),
                None => (None, vec![], None),
            };
            println!(
                "{}",
                serde_json::json!({"type": "stream", "data": {
                "url": bucket.url(), "stream_id": id, "keys": keys_, "created_at_ms": created,
                "signer": desc.as_ref().map(|d| d.1.clone()), "signature": signature,
                "stream_error": desc_error,
                "ready_deltas": deltas, "ready_anchors": anchors, "delta_bytes": delta_bytes,
                "incomplete": incomplete.len(), "other_objects": other, "unread_steps": unread,
                "latest": latest.as_ref().map(latest_json)}})
            );
            for r in &rows {
                println!("{}", serde_json::json!({"type": "step", "data": r}));
            }
            for i in &incomplete {
                println!("{}", serde_json::json!({"type": "incomplete", "data": i}));
            }
            return Ok(());
        }
        match &desc {
            Some((d, signers)) => {
                println!("stream {} at {}", d.stream_id, bucket.url());
                println!(
                    "keys: {} (descriptor signed by {}; signatures {signature})",
                    if d.trusted_keys.is_empty() { "none (unsigned stream)".into() } else { d.trusted_keys.join(", ") },
                    if signers.is_empty() { "nobody".into() } else { signers.join(", ") }
                );
            }
            None => match &desc_error {
                Some(e) => println!("unreadable stream.json at {}: {e} ({} objects)", bucket.url(), keys.len()),
                None => println!("no stream.json at {} ({} objects)", bucket.url(), keys.len()),
            },
        }
        println!(
            "{deltas} ready deltas ({:.2} MiB), {anchors} ready anchors, {} incomplete step directories{}",
            delta_bytes as f64 / (1 << 20) as f64,
            incomplete.len(),
            if other > 0 { format!(", {other} objects outside the layout") } else { String::new() }
        );
        if unread > 0 {
            println!(
                "the {unread} oldest ready steps are not read (--max-steps {}); sizes cover the newest",
                a.max_steps
            );
        }
        match &latest {
            Some(Ok(l)) => {
                let opt = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_else(|| "none".into());
                println!("latest.json: delta {}, anchor {}", opt(l.delta), opt(l.anchor));
            }
            Some(Err(e)) => println!("latest.json: unreadable: {e}"),
            None => {}
        }
        println!(
            "{:<7} {:>12} {:>8} {:>14} {:>9} {:>9}  manifest",
            "kind", "step", "base", "bytes", "ratio", "density"
        );
        for r in &rows {
            println!(
                "{:<7} {:>12} {:>8} {:>14} {:>8.1}x {:>9}  {}",
                r.kind,
                r.step,
                r.base_step.map(|b| b.to_string()).unwrap_or_else(|| "-".into()),
                r.bytes,
                r.ratio,
                r.density.map(|d| format!("{:.3}%", 100.0 * d)).unwrap_or_else(|| "-".into()),
                r.manifest
            );
        }
        for i in &incomplete {
            println!(
                "incomplete {:<7} {:>12} {:>3} objects {:>12} bytes",
                i["kind"].as_str().unwrap_or(""),
                i["step"],
                i["objects"],
                i["bytes"],
            );
        }
        Ok(())
    })
}

/// Payload of a ready step's manifest. With keys: the verified reader. Without: the marker's
/// SHA-256 pin is still checked, the signature is not.
async fn manifest_payload(
    r: &driftless_store::stream::StreamReader,
    b: &driftless_store::Bucket,
    kind: driftless_format::StepKind,
    step: u64,
) -> Result<Vec<u8>> {
    use driftless_store::layout;
    let marker = r.marker(kind, step).await?;
    let bytes = b
        .get_limited(
            &layout::object(kind, step, marker.manifest_name()),
            driftless_format::manifest::MAX_MANIFEST_BYTES as u64,
        )
        .await?;
    anyhow::ensure!(
        driftless_format::Digest::of(&bytes) == marker.manifest_sha256,
        "manifest does not match the SHA-256 in its ready marker"
    );
    let env: driftless_format::sign::Envelope =
        serde_json::from_slice(&bytes).context("manifest is not an envelope")?;
    Ok(env.payload.into_bytes())
}

async fn read_delta(
    r: &driftless_store::stream::StreamReader,
    b: &driftless_store::Bucket,
    verify: bool,
    step: u64,
) -> Result<(driftless_format::DeltaManifest, String)> {
    if verify {
        return Ok((r.delta(step).await?.0, "verified".into()));
    }
    let p = manifest_payload(r, b, driftless_format::StepKind::Delta, step).await?;
    Ok((driftless_format::DeltaManifest::from_slice(&p)?, "unchecked".into()))
}

async fn read_anchor(
    r: &driftless_store::stream::StreamReader,
    b: &driftless_store::Bucket,
    verify: bool,
    step: u64,
) -> Result<(driftless_format::AnchorManifest, String)> {
    if verify {
        return Ok((r.anchor(step).await?.0, "verified".into()));
    }
    let p = manifest_payload(r, b, driftless_format::StepKind::Anchor, step).await?;
    Ok((driftless_format::AnchorManifest::from_slice(&p)?, "unchecked".into()))
}
