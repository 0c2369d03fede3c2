//! `driftless bench`: the numbers of the README's table, each next to a baseline measured in
//! the same run on the same buffers.

use std::time::Instant;

use anyhow::Result;
use driftless_format::gen::{change_stats, ModelSpec, RlChain};
use driftless_format::{anchor, checkpoint, ops, reference, Codec, DeltaOptions, Layout, TensorView, ValueMode};
use rayon::prelude::*;

/// `driftless bench [--mb N] [--steps N] [--lr X]`
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model size in MiB of BF16 weights.
    #[arg(long, default_value_t = 512)]
    mb: u64,
    /// Steps to generate and measure (the first 2 warm Adam up and are not measured).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    steps: u64,
    /// Learning rate of the generator.
    #[arg(long, default_value_t = 1e-6)]
    lr: f32,
    /// Output JSON instead of the table.
    #[arg(long)]
    json: bool,
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn time<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let t = Instant::now();
    let r = f();
    (r, t.elapsed().as_secs_f64())
}

/// Reads every byte of both buffers (sum of u64 words): the memory bandwidth baseline for diff.
fn plain_read(a: &[TensorView<'_>], b: &[TensorView<'_>]) -> u64 {
    a.par_iter()
        .zip(b.par_iter())
        .map(|(x, y)| {
            let s = |d: &[u8]| {
                d.chunks_exact(8).fold(0u64, |acc, c| acc.wrapping_add(u64::from_le_bytes(c.try_into().unwrap())))
            };
            s(x.data).wrapping_add(s(y.data))
        })
        .reduce(|| 0, u64::wrapping_add)
}

fn owned(v: &[TensorView<'_>]) -> Vec<(driftless_format::TensorMeta, Vec<u8>)> {
    v.iter().map(|t| (t.meta(), t.data.to_vec())).collect()
}
fn views(o: &[(driftless_format::TensorMeta, Vec<u8>)]) -> Vec<TensorView<'_>> {
    o.iter().map(|(m, d)| TensorView { name: &m.name, dtype: m.dtype, shape: &m.shape, data: d }).collect()
}

pub fn run(a: Args) -> Result<()> {
    let threads = rayon::current_num_threads();
    let spec = ModelSpec::with_bf16_bytes(a.mb << 20);
    let mut chain = RlChain::new(&spec, a.lr, 1);
    chain.step();
    chain.step();
    let dense = chain.bytes();
    let layout = Layout::for_tensors(chain.metas(), 5 << 30)?;
    eprintln!(
        "model: {} tensors, {:.1} MiB BF16, lr {}, {} threads",
        chain.metas().len(),
        dense as f64 / 1048576.0,
        a.lr,
        threads
    );

    let mut rows = vec![];
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
    let mut last = None;
    for step in 3..3 + a.steps {
        let base = owned(&chain.views());
        chain.step();
        let bv = views(&base);
        let tv = chain.views();
        let (total, changed, one_ulp) = change_stats(&bv, &tv);
        let mk = |values, codec| {
            let opts = DeltaOptions { values, codec, ..Default::default() };
            let spec =
                ops::DeltaSpec { stream_id: "bench", step, base_step: step - 1, base_root: None, layout: &layout };
            ops::make_delta(spec, &bv, &tv, &opts)
        };
        let (ulp, _) = mk(ValueMode::Ulp, Codec::Zstd { level: 1 })?;
        let (ow, _) = mk(ValueMode::Overwrite, Codec::Zstd { level: 1 })?;
        let trl = reference::trl_bytes(&bv, &tv);
        let pulse = reference::pulse_bytes(&bv, &tv);
        // Encode throughput: diff + encode + compress, no hashing, 1 thread and all.
        let opts = DeltaOptions::default();
        let (_, enc1) = one.install(|| time(|| driftless_format::encode_delta(&bv, &tv, &opts)));
        let (_, encn) = time(|| driftless_format::encode_delta(&bv, &tv, &opts));
        let (_, scan1) = one.install(|| time(|| driftless_format::encode_delta(&bv, &bv, &opts)));
        let raw = DeltaOptions { codec: Codec::Raw, ..opts };
        let (_, raw1) = one.install(|| time(|| driftless_format::encode_delta(&bv, &tv, &raw)));
        eprintln!(
            "  1 thread: scan of identical buffers {:.2} GB/s, encode without zstd {:.2} GB/s, full encode {:.2} GB/s",
            gbps(2 * dense, scan1),
            gbps(2 * dense, raw1),
            gbps(2 * dense, enc1)
        );
        let (_, read1) = one.install(|| time(|| plain_read(&bv, &tv)));
        let (_, readn) = time(|| plain_read(&bv, &tv));
        eprintln!(
            "step {step}: density {:.3}%, +-1ulp {:.1}%, driftless {:.1}x, overwrite {:.1}x, pulse {:.1}x, trl {:.1}x",
            100.0 * changed as f64 / total as f64,
            100.0 * one_ulp as f64 / changed.max(1) as f64,
            dense as f64 / ulp.stats.payload_bytes as f64,
            dense as f64 / ow.stats.payload_bytes as f64,
            dense as f64 / pulse as f64,
            dense as f64 / trl as f64
        );
        rows.push(serde_json::json!({
            "step": step, "density": changed as f64 / total as f64, "one_ulp_share": one_ulp as f64 / changed.max(1) as f64,
            "driftless_ulp_bytes": ulp.stats.payload_bytes, "driftless_overwrite_bytes": ow.stats.payload_bytes,
            "pulse_bytes": pulse, "trl_bytes": trl,
            "encode_1t_gbps": gbps(2 * dense, enc1), "encode_nt_gbps": gbps(2 * dense, encn),
            "read_1t_gbps": gbps(2 * dense, read1), "read_nt_gbps": gbps(2 * dense, readn),
        }));
        last = Some(base);
    }
    // Apply + verify vs hashing alone, on a checkpoint on disk.
    let base = last.expect("at least one step");
    let dir = tempfile::tempdir()?;
    checkpoint::write_checkpoint(dir.path(), &layout, &views(&base))?;
    let spec = ops::DeltaSpec { stream_id: "bench", step: 99, base_step: 98, base_root: None, layout: &layout };
    let (m, enc) = ops::make_delta(spec, &views(&base), &chain.views(), &DeltaOptions::default())?;
    let segs: Vec<&[u8]> = enc.segments.iter().map(|s| s.bytes.as_slice()).collect();
    let mut ck = driftless_format::CheckpointMut::open(dir.path())?;
    let (_, hash_only) = time(|| driftless_format::weights_root(&ck.views()));
    let (r, apply_verify) =
        time(|| ops::apply_in_place(&mut ck, &m, m.result_root, m.base_root, &segs, Some(&dir.path().join("journal"))));
    r?;
    // The same apply onto caller-owned memory (the Python apply_to path): no page faults of a
    // shared file mapping, no journal.
    let mut mem = base.clone();
    let (r, apply_mem) = time(|| -> driftless_format::Result<driftless_format::Digest> {
        let mut tm = driftless_format::TensorsMut::new();
        for (meta, d) in mem.iter_mut() {
            tm.insert(&meta.name, meta.dtype, d);
        }
        let ap = ops::Applier::new(&tm, &m, None);
        segs.par_iter().enumerate().try_for_each(|(i, s)| ap.apply(i, s))?;
        drop(tm);
        ops::verify_result(&views(&mem), &m)
    });
    r?;
    let (_, hash_mem) = time(|| driftless_format::weights_root(&views(&mem)));
    let (_, hash_1t) = one.install(|| time(|| driftless_format::weights_root(&ck.views())));
    // Anchors: plain safetensors vs byte planes, and plain zstd-1 for reference.
    let file = std::fs::read(dir.path().join(&layout.shards[0].file))?;
    let (planes, enc_t) = time(|| anchor::encode_shard(&file, 1));
    let planes = planes?;
    let mut out = vec![0u8; file.len()];
    let (r, dec_t) = time(|| anchor::decode_shard(&planes, &mut out));
    r?;
    anyhow::ensure!(out == file, "anchor round trip differs");
    let (plain_z, _) = time(|| zstd::bulk::compress(&file, 1).map(|v| v.len()).unwrap_or(0));
    let (_, copy_t) = time(|| out.copy_from_slice(&file));

    let mean = |k: &str| rows.iter().map(|r| r[k].as_f64().unwrap_or(0.0)).sum::<f64>() / rows.len() as f64;
    let ratio = |k: &str| dense as f64 / mean(k);
    let summary = serde_json::json!({
        "model_bytes": dense, "threads": threads, "lr": a.lr, "steps": rows,
        "density": mean("density"), "one_ulp_share": mean("one_ulp_share"),
        "ratio_driftless": ratio("driftless_ulp_bytes"), "ratio_overwrite": ratio("driftless_overwrite_bytes"),
        "ratio_pulse": ratio("pulse_bytes"), "ratio_trl": ratio("trl_bytes"),
        "encode_1t_gbps": mean("encode_1t_gbps"), "encode_nt_gbps": mean("encode_nt_gbps"),
        "read_1t_gbps": mean("read_1t_gbps"), "read_nt_gbps": mean("read_nt_gbps"),
        "hash_s": hash_only, "hash_1t_s": hash_1t, "apply_verify_s": apply_verify, "apply_verify_mem_s": apply_mem, "hash_mem_s": hash_mem,
        "anchor_planes_ratio": file.len() as f64 / planes.len() as f64, "anchor_zstd1_ratio": file.len() as f64 / plain_z as f64,
        "anchor_planes_encode_gbps": gbps(file.len() as u64, enc_t), "anchor_planes_decode_gbps": gbps(file.len() as u64, dec_t),
        "anchor_plain_copy_gbps": gbps(file.len() as u64, copy_t),
    });
    if a.json {
        // The envelope every --json output has (found by review: bench's was bare).
        println!("{}", serde_json::json!({"type": "bench", "data": summary}));
        return Ok(());
    }
    let s = &summary;
    let f = |k: &str| s[k].as_f64().unwrap_or(0.0);
    println!("| measure | driftless | baseline (same run) | ratio |");
    println!("|---|---|---|---|");
    println!("| payload ratio, dense/delta ({:.2}% density, {:.0}% +-1 ulp) | {:.1}x | PULSESync layout {:.1}x, TRL layout {:.1}x | {:.2}x smaller than PULSESync |",
        100.0 * f("density"), 100.0 * f("one_ulp_share"), f("ratio_driftless"), f("ratio_pulse"), f("ratio_trl"), f("ratio_driftless") / f("ratio_pulse"));
    println!(
        "| payload ratio, overwrite values | {:.1}x | ulp values {:.1}x | ulp is {:.2}x smaller |",
        f("ratio_overwrite"),
        f("ratio_driftless"),
        f("ratio_driftless") / f("ratio_overwrite")
    );
    println!(
        "| encode (diff+encode+zstd), 1 thread | {:.2} GB/s scanned | plain read {:.2} GB/s | {:.0}% |",
        f("encode_1t_gbps"),
        f("read_1t_gbps"),
        100.0 * f("encode_1t_gbps") / f("read_1t_gbps")
    );
    println!(
        "| encode, {} threads | {:.2} GB/s | plain read {:.2} GB/s | {:.0}% |",
        threads,
        f("encode_nt_gbps"),
        f("read_nt_gbps"),
        100.0 * f("encode_nt_gbps") / f("read_nt_gbps")
    );
    println!(
        "| apply (journaled, in place) + verify | {:.3} s | SHA-256 weights root alone {:.3} s | {:.2}x |",
        f("apply_verify_s"),
        f("hash_s"),
        f("apply_verify_s") / f("hash_s")
    );
    println!(
        "| apply + verify into memory buffers (no journal) | {:.3} s | SHA-256 weights root alone {:.3} s | {:.2}x |",
        f("apply_verify_mem_s"),
        f("hash_mem_s"),
        f("apply_verify_mem_s") / f("hash_mem_s")
    );
    println!(
        "| weights root, {} threads vs 1 | {:.3} s | 1 thread {:.3} s | {:.2}x speed-up |",
        threads,
        f("hash_s"),
        f("hash_1t_s"),
        f("hash_1t_s") / f("hash_s")
    );
    println!(
        "| anchor size ratio, byte planes + zstd-1 | {:.3}x | plain zstd-1 {:.3}x; plain safetensors 1.000x | |",
        f("anchor_planes_ratio"),
        f("anchor_zstd1_ratio")
    );
    println!(
        "| anchor decode, byte planes | {:.2} GB/s | memcpy {:.2} GB/s | |",
        f("anchor_planes_decode_gbps"),
        f("anchor_plain_copy_gbps")
    );
    Ok(())
}
