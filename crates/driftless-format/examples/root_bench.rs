//! Weights-root speed on a model whose largest tensor holds half the bytes (an embedding-heavy
//! model, the worst case for per-tensor parallelism), on one core and on all cores.
//!
//! ```text
//! cargo run --release -p driftless-format --example root_bench -- [MIB] [BIG%]
//! ```
//!
//! `MIB` (default 1024) is the model size, `BIG%` (default 50) the share of the largest
//! tensor. With two cores and a half-size tensor the baseline is already balanced (each core
//! gets half); the gap grows with cores: the baseline is bound by the big tensor on one core,
//! so at 16 cores it is 8x slower than the chunked root at best.
//!
//! Rows, all from the same run on the same bytes:
//! - `whole-tensor baseline`: one sequential SHA-256 per tensor, tensors in parallel (the
//!   version-1 root's shape, reimplemented here as the baseline; it cannot beat the time one
//!   core needs for the big tensor);
//! - `chunked, 1 thread` and `chunked, all cores`: [`driftless_format::weights_root`].
//!
//! The same bytes through plain SHA-256 on one core gives the hash-bound reference; the chunk
//! digests with each leaf its own SHA-256 stream, on one core, against the same with leaves
//! hashed two at a time (what the root does where the CPU has the SHA extensions) show what
//! the pairing gains.

use std::time::Instant;

use driftless_format::{DType, TensorView};
use rayon::prelude::*;
use sha2::{Digest as _, Sha256};

fn best<T>(runs: usize, mut f: impl FnMut() -> T) -> f64 {
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(f());
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let mib: usize = std::env::args().nth(1).map(|s| s.parse().expect("MIB")).unwrap_or(1024);
    let total = mib << 20;
    let big_pct: usize = std::env::args().nth(2).map(|s| s.parse().expect("BIG%")).unwrap_or(50).min(100);
    let cores = rayon::current_num_threads();
    // One tensor of BIG% of the bytes, the rest in 32 equal tensors (BF16), 8-byte multiples.
    let big = (total / 100 * big_pct) & !7;
    let mut sizes = vec![big];
    sizes.extend(std::iter::repeat_n(((total - big) / 32) & !7, 32));
    let total: usize = sizes.iter().sum();
    let mut x = 0x9e3779b97f4a7c15u64;
    let data: Vec<Vec<u8>> = sizes
        .iter()
        .map(|&n| {
            (0..n / 8)
                .flat_map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x.to_le_bytes()
                })
                .collect()
        })
        .collect();
    let names: Vec<String> = (0..sizes.len()).map(|i| format!("t{i:02}")).collect();
    let shapes: Vec<[u64; 1]> = data.iter().map(|d| [d.len() as u64 / 2]).collect();
    let views: Vec<TensorView<'_>> = (0..data.len())
        .map(|i| TensorView { name: &names[i], dtype: DType::BF16, shape: &shapes[i], data: &data[i] })
        .collect();
    let gb = total as f64 / 1e9;
    let runs = 3;

    let plain = best(runs, || data.iter().fold(Sha256::new(), |h, d| h.chain_update(d)).finalize());
    let whole = best(runs, || {
        views.par_iter().with_max_len(1).map(|t| Sha256::new().chain_update(t.data).finalize()).collect::<Vec<_>>()
    });
    // The agent's fused pass feeds each tensor in 256 KiB blocks to a streaming hasher.
    let streamed = best(runs, || {
        views
            .par_iter()
            .with_max_len(1)
            .map(|t| {
                let mut h = driftless_format::hash::TensorHasher::new(t.name, t.dtype, t.shape, t.data.len() as u64);
                t.data.chunks(256 << 10).for_each(|b| h.update(b));
                h.finalize()
            })
            .collect::<Vec<_>>()
    });
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("pool");
    // The chunk digests with every leaf its own SHA-256 stream (the root before `sha_x2`
    // hashed leaves in pairs), on one thread: the same digests, checked below.
    let single_leaves = |d: &[u8]| -> Vec<[u8; 32]> {
        d.chunks(driftless_format::hash::CHUNK)
            .map(|c| {
                let mut h = Sha256::new().chain_update(b"driftless.chunk.v3\0");
                for l in c.chunks(driftless_format::hash::LEAF) {
                    h.update(Sha256::new().chain_update(b"driftless.leaf.v3\0").chain_update(l).finalize());
                }
                h.finalize().into()
            })
            .collect()
    };
    let paired_leaves = |d: &[u8]| -> Vec<[u8; 32]> {
        d.chunks(driftless_format::hash::CHUNK).map(|c| driftless_format::hash::chunk_digest(c).0).collect()
    };
    assert!(data.iter().all(|d| single_leaves(d) == paired_leaves(d)), "paired leaves differ from SHA-256");
    let leaves_1 = best(runs, || data.iter().map(|d| single_leaves(d)).collect::<Vec<_>>());
    let paired_1 = best(runs, || data.iter().map(|d| paired_leaves(d)).collect::<Vec<_>>());
    let chunked_1 = best(runs, || one.install(|| driftless_format::weights_root(&views)));
    let chunked_n = best(runs, || driftless_format::weights_root(&views));

    println!("model: {} MiB BF16, largest tensor {} MiB ({big_pct}%), {cores} cores", total >> 20, big >> 20);
    println!("{:<34} {:>8} {:>8} {:>9}", "", "secs", "GB/s", "vs base");
    for (what, s) in [
        ("plain SHA-256, 1 core (reference)", plain),
        ("chunks, leaves one by one, 1 core", leaves_1),
        ("chunks, leaves in pairs, 1 core", paired_1),
        ("whole-tensor baseline, all cores", whole),
        ("streamed, 256 KiB blocks, all cores", streamed),
        ("chunked root, 1 thread", chunked_1),
        ("chunked root, all cores", chunked_n),
    ] {
        println!("{what:<34} {s:>8.3} {:>8.2} {:>8.2}x", gb / s, whole / s);
    }

    // The agent's fused apply + hash of a 1% delta (publisher-cut entries of 8 MiB), in
    // memory: tensors as the unit of work (before pieces) against pieces of 8 MiB.
    let mut next = data.clone();
    for d in next.iter_mut() {
        for i in (0..d.len()).step_by(200) {
            d[i] ^= 1;
        }
    }
    let next_views: Vec<TensorView<'_>> = (0..next.len())
        .map(|i| TensorView { name: &names[i], dtype: DType::BF16, shape: &shapes[i], data: &next[i] })
        .collect();
    let enc = driftless_format::encode_delta(&views, &next_views, &Default::default()).expect("encode");
    let segs: Vec<_> = enc
        .segments
        .iter()
        .map(|s| driftless_format::delta::decode_segment(&s.bytes, s.raw_size).expect("decode"))
        .collect();
    let metas: Vec<_> = views.iter().map(|v| v.meta()).collect();
    let fused = |piece: usize| {
        (0..runs)
            .map(|_| {
                let mut work = data.clone();
                let mut tm = driftless_format::TensorsMut::new();
                for (i, w) in work.iter_mut().enumerate() {
                    tm.insert(&names[i], DType::BF16, w);
                }
                let t = Instant::now();
                let d = driftless_format::fused::apply_and_hash_blocks(
                    driftless_format::fused::Target::Memory(&tm),
                    &metas,
                    &[&segs],
                    true,
                    driftless_format::fused::BLOCK,
                    piece,
                )
                .expect("apply");
                let s = t.elapsed().as_secs_f64();
                drop(tm);
                assert!(work.iter().zip(&next).all(|(a, b)| a == b), "fused result differs");
                std::hint::black_box(d);
                s
            })
            .fold(f64::INFINITY, f64::min)
    };
    let per_tensor = fused(usize::MAX / 2);
    let pieces = fused(driftless_format::fused::PIECE);
    println!("\nfused apply + hash of a 1% delta, in memory, {cores} cores:");
    for (what, s) in [("one task per tensor", per_tensor), ("pieces of 8 MiB", pieces)] {
        println!("{what:<34} {s:>8.3} {:>8.2} {:>8.2}x hash", gb / s, s / chunked_n);
    }
}
