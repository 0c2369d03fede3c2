//! Criterion benchmarks of the hot paths, each next to its baseline on the same buffers:
//! encode vs a plain read of both buffers, apply+verify vs SHA-256 alone, anchor decode vs
//! memcpy. `driftless bench` prints the same comparisons as a table.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use driftless_format::gen::{ModelSpec, RlChain};
use driftless_format::{anchor, ops, DeltaOptions, Layout, TensorView, TensorsMut};

fn owned(v: &[TensorView<'_>]) -> Vec<(driftless_format::TensorMeta, Vec<u8>)> {
    v.iter().map(|t| (t.meta(), t.data.to_vec())).collect()
}

fn benches(c: &mut Criterion) {
    let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(32 << 20), 5e-7, 1);
    chain.step();
    let base = owned(&chain.views());
    chain.step();
    let bv: Vec<TensorView<'_>> =
        base.iter().map(|(m, d)| TensorView { name: &m.name, dtype: m.dtype, shape: &m.shape, data: d }).collect();
    let tv = chain.views();
    let bytes = chain.bytes();
    let layout = Layout::for_tensors(chain.metas(), u64::MAX).unwrap();
    let mut g = c.benchmark_group("hot_paths");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(bytes));
    g.bench_function("baseline_read_both", |b| {
        b.iter(|| {
            bv.iter()
                .zip(&tv)
                .map(|(x, y)| x.data.iter().zip(y.data).fold(0u64, |a, (p, q)| a.wrapping_add((*p ^ *q) as u64)))
                .sum::<u64>()
        })
    });
    g.bench_function("encode_delta", |b| {
        b.iter(|| driftless_format::encode_delta(&bv, &tv, &DeltaOptions::default()).unwrap())
    });
    let spec = ops::DeltaSpec { stream_id: "b", step: 2, base_step: 1, base_root: None, layout: &layout };
    let (m, enc) = ops::make_delta(spec, &bv, &tv, &DeltaOptions::default()).unwrap();
    g.bench_function("baseline_sha256_weights_root", |b| b.iter(|| driftless_format::weights_root(&tv)));
    g.bench_function("apply_verify_in_memory", |b| {
        b.iter(|| {
            let mut mem = base.clone();
            let mut tm = TensorsMut::new();
            for (meta, d) in mem.iter_mut() {
                tm.insert(&meta.name, meta.dtype, d);
            }
            let ap = ops::Applier::new(&tm, &m, None);
            for (i, s) in enc.segments.iter().enumerate() {
                ap.apply(i, &s.bytes).unwrap();
            }
            drop(tm);
            let v: Vec<TensorView<'_>> = mem
                .iter()
                .map(|(m, d)| TensorView { name: &m.name, dtype: m.dtype, shape: &m.shape, data: d })
                .collect();
            ops::verify_result(&v, &m).unwrap()
        })
    });
    let dir = tempfile::tempdir().unwrap();
    driftless_format::checkpoint::write_checkpoint(dir.path(), &layout, &tv).unwrap();
    let file = std::fs::read(dir.path().join(&layout.shards[0].file)).unwrap();
    let planes = anchor::encode_shard(&file, 1).unwrap();
    let mut out = vec![0u8; file.len()];
    g.bench_function("baseline_memcpy_anchor", |b| b.iter(|| out.copy_from_slice(&file)));
    g.bench_function("anchor_decode_planes", |b| b.iter(|| anchor::decode_shard(&planes, &mut out).unwrap()));
    g.finish();
}

criterion_group!(b, benches);
criterion_main!(b);
