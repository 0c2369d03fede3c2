//! Sharded publishing next to the single-process publisher, on the same model and machine.
//!
//! ```text
//! cargo run --release -p driftless-publisher --example sharded_bench -- [--mb 1024] [--ranks 4] [--steps 4] [--tp]
//!     [--loop-steps 6 --anchor-every 3]
//! ```
//!
//! `--tp` shards the attention output and MLP down projections by columns instead
//! (row-parallel layers of tensor parallelism, `Shard(1)`): their runs are rows of the slice,
//! shorter than a leaf, so their bytes travel to the committer every step (the documented
//! cost of column shards).
//!
//! A Llama-shaped BF16 model (random weights, 1% of elements moved by one ulp per step) is
//! sharded FSDP-style (every tensor in row blocks, `torch.chunk` sizes) over `--ranks` ranks.
//! Each step, every rank's `publish()` runs alone on the machine, ranks 1.. first and rank 0
//! (the committer) last, so each figure is what one rank costs on a host of this size; then
//! the step's wall time on a cluster is about max(rank time) + commit. The baseline is the
//! single-process `Publisher` on the gathered model in the same run: `publish()` plus
//! `flush()` (until the ready marker). Buckets are `file://` in a temp dir. Step 1 is an
//! anchor for both (the sharded committer gathers its anchor through the bucket), the rest
//! deltas. Every figure starts after a `sync`.
//!
//! Then, back to back (`--loop-steps`, on a new stream with `--anchor-every`): every rank
//! publishes each step as a trainer would, without waiting for anything in between, and the
//! figure is each rank's `publish()` blocked time. Step 1 is an anchor part, whose commit
//! (gather and compression) the next `publish` waits for: that is what every scheduled anchor
//! cost before scheduled anchors became delta steps whose anchor rank 0 gathers afterwards.
//! The steps after a scheduled anchor are the comparison.
//!
//! Last, the weights root of a model whose one tensor holds half the bytes, on one core and
//! on all cores.

use std::time::{Duration, Instant};

use driftless_format::gen::ModelSpec;
use driftless_format::slice::Slice;
use driftless_format::{DType, Keypair, TensorMeta, TensorView};
use driftless_publisher::{PartKind, PublisherBuilder, Shard};

fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let a: Vec<String> = std::env::args().collect();
    a.iter().position(|x| x == name).and_then(|i| a.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// BF16 weights of plausible magnitude (|w| < 0.05), as bytes.
fn weights(metas: &[TensorMeta]) -> Vec<Vec<u8>> {
    use rayon::prelude::*;
    metas
        .par_iter()
        .enumerate()
        .map(|(i, m)| {
            let n = m.numel().unwrap() as usize;
            let mut out = vec![0u8; n * 2];
            out.par_chunks_mut(1 << 16).enumerate().for_each(|(c, ch)| {
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ ((i as u64) << 32) ^ c as u64 | 1;
                for e in ch.chunks_exact_mut(2) {
                    let f = ((xorshift(&mut x) >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1;
                    e.copy_from_slice(&driftless_format::gen::f32_to_bf16(f).to_le_bytes());
                }
            });
            out
        })
        .collect()
}

/// Moves 1% of the elements of every tensor by one ulp.
fn step(model: &mut [Vec<u8>], s: u64) {
    use rayon::prelude::*;
    model.par_iter_mut().enumerate().for_each(|(i, d)| {
        let n = d.len() / 2;
        let mut x = 0x1234_5678 ^ (s << 20) ^ i as u64 | 1;
        for _ in 0..n / 100 {
            let k = (xorshift(&mut x) % n as u64) as usize * 2;
            let v = u16::from_le_bytes([d[k], d[k + 1]]).wrapping_add(1);
            d[k..k + 2].copy_from_slice(&v.to_le_bytes());
        }
    });
}

/// Rows `[start, start + len)` of dimension 0 that rank `r` of `ranks` holds (torch.chunk).
fn rows(n: u64, ranks: u64, r: u64) -> (u64, u64) {
    let per = n.div_ceil(ranks);
    let start = (per * r).min(n);
    (start, (start + per).min(n) - start)
}

type Cut = (usize, Slice, Vec<u8>);

/// Rank `r`'s slices of every tensor: row blocks, or column blocks where `by_cols` says so.
fn cut(metas: &[TensorMeta], model: &[Vec<u8>], ranks: u64, r: u64, by_cols: &dyn Fn(&TensorMeta) -> bool) -> Vec<Cut> {
    metas
        .iter()
        .enumerate()
        .map(|(i, m)| {
            if by_cols(m) {
                let (start, len) = rows(m.shape[1], ranks, r);
                let sl = Slice::block(&m.shape, 1, start, len).unwrap();
                let row = m.shape[1] as usize * 2;
                let (a, b) = (start as usize * 2, (start + len) as usize * 2);
                let d: Vec<u8> = model[i].chunks_exact(row).flat_map(|x| x[a..b].iter().copied()).collect();
                return (i, sl, d);
            }
            let (start, len) = rows(m.shape[0], ranks, r);
            let sl = Slice::block(&m.shape, 0, start, len).unwrap();
            let row_bytes = m.nbytes().unwrap() / m.shape[0];
            let d = model[i][(start * row_bytes) as usize..((start + len) * row_bytes) as usize].to_vec();
            (i, sl, d)
        })
        .collect()
}

fn shards_of<'a>(metas: &'a [TensorMeta], cuts: &'a [Cut]) -> Vec<Shard<'a>> {
    cuts.iter()
        .map(|(i, sl, d)| Shard {
            name: &metas[*i].name,
            dtype: DType::BF16,
            shape: &metas[*i].shape,
            slice: sl.clone(),
            data: d,
        })
        .collect()
}

/// `sync`: flushes dirty pages so that writeback from the previous figure does not land in
/// the next one.
fn settle() {
    let _ = std::process::Command::new("sync").status();
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mb: u64 = arg("--mb", 1024);
    let ranks: u64 = arg("--ranks", 4);
    let steps: u64 = arg("--steps", 4);
    let tp = std::env::args().any(|a| a == "--tp");
    let by_cols =
        |m: &TensorMeta| tp && m.shape.len() == 2 && (m.name.contains("o_proj") || m.name.contains("down_proj"));
    let metas = ModelSpec::with_bf16_bytes(mb << 20).metas();
    let total: u64 = metas.iter().map(|m| m.nbytes().unwrap()).sum();
    println!(
        "model: {} tensors, {:.0} MiB BF16; {ranks} ranks ({}); {} cores",
        metas.len(),
        total as f64 / (1 << 20) as f64,
        if tp { "o_proj/down_proj in column blocks, the rest in row blocks" } else { "row blocks" },
        rayon::current_num_threads()
    );
    let mut model = weights(&metas);
    let key = Keypair::generate();
    let td = tempfile::tempdir()?;

    // Sharded.
    let url = format!("file://{}", td.path().join("sharded").display());
    // Rank 0 first: it creates the stream and the generation the others join.
    let mut pubs = vec![PublisherBuilder::new(url.clone()).with_key(key.clone()).with_new_stream(true).build_sharded(
        0,
        ranks,
        Duration::from_secs(600),
    )?];
    for r in 1..ranks {
        pubs.push(PublisherBuilder::new(url.clone()).with_key(key.clone()).build_sharded(
            r,
            ranks,
            Duration::from_secs(600),
        )?);
    }
    println!("\nsharded: step, kind, per-rank part s (publish() until the part is uploaded; ranks 1.., then rank 0 without its commit), max rank, commit s, per-rank MB, all parts MB, per-rank publish() blocked s, per-rank memcpy of its slices s (baseline)");
    let mut sharded_rows = vec![];
    for s in 1..=steps {
        if s > 1 {
            step(&mut model, s);
        }
        let mut secs = vec![0.0; ranks as usize];
        let mut blocked = vec![0.0; ranks as usize];
        let mut copy = vec![0.0; ranks as usize];
        let mut rank_bytes = vec![0u64; ranks as usize];
        let mut bytes = 0;
        let mut commit = 0.0;
        let mut kind = String::new();
        for r in (1..ranks).chain([0]) {
            // Each figure starts without the previous one's dirty pages being written back.
            settle();
            let cuts = cut(&metas, &model, ranks, r, &by_cols);
            // Baseline of publish()'s blocking time: one copy of the rank's slices, on one
            // thread, into memory already touched.
            copy[r as usize] = {
                let mut dst: Vec<Vec<u8>> = cuts.iter().map(|(_, _, d)| vec![1u8; d.len()]).collect();
                let t = Instant::now();
                for (o, (_, _, d)) in dst.iter_mut().zip(&cuts) {
                    o.copy_from_slice(d);
                }
                let secs = t.elapsed().as_secs_f64();
                std::hint::black_box(&dst);
                secs
            };
            let shards = shards_of(&metas, &cuts);
            let p = &mut pubs[r as usize];
            let t = Instant::now();
            blocked[r as usize] = p.publish(s, &shards)?.blocked_secs;
            // The part is built and sent after publish returns: wait for it here, so that
            // each rank runs alone (rank 0: and for its commit).
            let part = if r == 0 {
                let o = p.flush()?;
                kind = format!("{:?}", o.of.unwrap()).to_lowercase();
                p.last_part().cloned()
            } else {
                p.wait_sent()
            }
            .expect("part sent");
            secs[r as usize] = t.elapsed().as_secs_f64() - part.commit_secs;
            commit = part.commit_secs;
            rank_bytes[r as usize] = part.bytes;
            bytes += part.bytes;
        }
        let max = secs.iter().cloned().fold(0.0, f64::max);
        println!(
            "  {s}  {kind:6}  [{}]  max {max:.2}  commit {commit:.2}  [{}] MB  {:.1} MB  blocked [{}]  memcpy [{}]",
            secs.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" "),
            rank_bytes.iter().map(|x| format!("{:.1}", *x as f64 / 1e6)).collect::<Vec<_>>().join(" "),
            bytes as f64 / 1e6,
            blocked.iter().map(|x| format!("{x:.3}")).collect::<Vec<_>>().join(" "),
            copy.iter().map(|x| format!("{x:.3}")).collect::<Vec<_>>().join(" ")
        );
        sharded_rows.push((kind, max, commit));
    }
    for p in pubs.drain(1..) {
        p.close()?;
    }
    pubs.pop().unwrap().close()?;

    // Back to back, with scheduled anchors.
    let loop_steps: u64 = arg("--loop-steps", 6);
    let anchor_every: u64 = arg("--anchor-every", 3);
    if loop_steps > 0 {
        let url = format!("file://{}", td.path().join("loop").display());
        let b = |r: u64| {
            let b = PublisherBuilder::new(url.clone()).with_key(key.clone()).with_anchor_every(anchor_every);
            b.with_new_stream(r == 0).build_sharded(r, ranks, Duration::from_secs(600))
        };
        let mut pubs = (0..ranks).map(b).collect::<Result<Vec<_>, _>>()?;
        println!(
            "\nback to back (anchor_every {anchor_every}): step, part, per-rank publish() blocked s (ranks 1.., then 0), outcome of the step before"
        );
        let mut model = weights(&metas);
        for s in 1..=loop_steps {
            if s > 1 {
                step(&mut model, s);
            }
            let mut blocked = vec![0.0; ranks as usize];
            let (mut part, mut before) = (String::new(), String::new());
            for r in (1..ranks).chain([0]) {
                let cuts = cut(&metas, &model, ranks, r, &by_cols);
                let rc = pubs[r as usize].publish(s, &shards_of(&metas, &cuts))?;
                blocked[r as usize] = rc.blocked_secs;
                part =
                    format!("{:?}{}", rc.part, if rc.slices && rc.part != PartKind::Anchor { "+slices" } else { "" });
                if let Some(o) = rc.previous {
                    before = format!("{} {:?}", if o.committed { "committed" } else { "NOT committed" }, o.of);
                }
            }
            println!(
                "  {s}  {part:12}  blocked [{}]  ({before})",
                blocked.iter().map(|x| format!("{x:.3}")).collect::<Vec<_>>().join(" ")
            );
        }
        let t = Instant::now();
        for p in pubs.drain(1..) {
            p.close()?;
        }
        pubs.pop().unwrap().close()?;
        println!("  close (rank 0 waits for the last anchor gathered): {:.2} s", t.elapsed().as_secs_f64());
    }

    // Single process on the gathered model (same steps: regenerate).
    let mut model = weights(&metas);
    let url = format!("file://{}", td.path().join("single").display());
    let mut p = PublisherBuilder::new(url).with_key(key.clone()).with_new_stream(true).build()?;
    println!("\nsingle process on the gathered model: step, publish() s, flush() s (to ready), delta bytes");
    let mut single_rows = vec![];
    for s in 1..=steps {
        if s > 1 {
            step(&mut model, s);
        }
        let views: Vec<TensorView<'_>> = metas
            .iter()
            .zip(&model)
            .map(|(m, d)| TensorView { name: &m.name, dtype: m.dtype, shape: &m.shape, data: d })
            .collect();
        settle();
        let t = Instant::now();
        let rc = p.publish(s, &views)?;
        let publish = t.elapsed().as_secs_f64();
        p.flush()?;
        let ready = t.elapsed().as_secs_f64();
        println!(
            "  {s}  {:?}  publish {publish:.2}  to ready {ready:.2}  {:.1} MB",
            rc.outcome,
            rc.delta_bytes.unwrap_or(p.status().last_delta_bytes) as f64 / 1e6
        );
        single_rows.push(ready);
    }
    p.close()?;
    println!("\nstep to ready: sharded (max rank + commit) vs single process (publish + flush)");
    for (i, ((kind, max, commit), single)) in sharded_rows.iter().zip(&single_rows).enumerate() {
        println!("  step {} {kind:6}: sharded {:.2} s vs single {single:.2} s", i + 1, max + commit);
    }
    drop(model);

    // Root with one tensor of half the bytes.
    let half = (total / 2 / 2) as usize * 2;
    let big = vec![0x3cu8; half];
    let rest: Vec<Vec<u8>> = (0..63).map(|_| vec![0x3du8; (total as usize - half) / 63 / 2 * 2]).collect();
    let names: Vec<String> = (0..64).map(|i| format!("t{i}")).collect();
    let shapes: Vec<Vec<u64>> =
        std::iter::once(vec![half as u64 / 2]).chain(rest.iter().map(|r| vec![r.len() as u64 / 2])).collect();
    let views: Vec<TensorView<'_>> = std::iter::once(&big)
        .chain(rest.iter())
        .enumerate()
        .map(|(i, d)| TensorView { name: &names[i], dtype: DType::BF16, shape: &shapes[i], data: d })
        .collect();
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
    let time = |f: &dyn Fn()| {
        let t = Instant::now();
        f();
        t.elapsed().as_secs_f64()
    };
    let r1 = one.install(|| time(&|| drop(driftless_format::weights_root(&views))));
    let rn = time(&|| drop(driftless_format::weights_root(&views)));
    println!(
        "\nweights root, one tensor = half of {:.0} MiB: one core {r1:.3} s, {} cores {rn:.3} s ({:.2}x)",
        total as f64 / (1 << 20) as f64,
        rayon::current_num_threads(),
        r1 / rn
    );
    Ok(())
}
