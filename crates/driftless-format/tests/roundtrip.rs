//! Delta round trips: every dtype, density, value mode and codec, odd shapes and special bit
//! patterns, layout changes and the dense fallback. All comparisons are on bytes.

mod common;

use common::*;
use driftless_format::{diff_update, encode_delta, ops, Codec, DType, DeltaOptions, Layout, ValueMode};
use proptest::prelude::*;

const DENSITIES: [f64; 5] = [0.0, 1e-6, 1e-2, 0.5, 1.0];

/// Tensors of one dtype in awkward shapes: a zero-size tensor first (sorted after others by
/// name at the same offset), a long vector, a matrix, a scalar and more zero-size ones.
fn tensors_of(dtype: DType, seed: u64) -> Vec<T> {
    let mut r = rng(seed);
    vec![
        T::random("z.empty_first", dtype, &[0, 3], &mut r),
        T::random("a.vector", dtype, &[1500], &mut r),
        T::random("m.matrix", dtype, &[17, 33], &mut r),
        T::random("s.scalar", dtype, &[], &mut r),
        T::random("e.empty", dtype, &[0], &mut r),
        T::random("e.empty2", dtype, &[3, 0, 2], &mut r),
        T::random("v.small", dtype, &[5], &mut r),
    ]
}

fn matrix(mode: ValueMode, codec: Codec) {
    let mut combos = 0;
    for (di, &dtype) in DType::ALL.iter().enumerate() {
        let base = tensors_of(dtype, 100 + di as u64);
        // Several shards, so the in-place apply spans files.
        let layout = Layout::for_tensors(&metas(&base), 2048).unwrap();
        assert!(layout.shards.len() > 1);
        for (ki, &density) in DENSITIES.iter().enumerate() {
            let mut r = rng(1000 * di as u64 + ki as u64);
            let target: Vec<T> = base.iter().map(|t| mutate(t, density, &mut r)).collect();
            for opts in [
                DeltaOptions { values: mode, codec, segment_target: 48, chunk_bytes: 40 },
                DeltaOptions { values: mode, codec, segment_target: 1000, chunk_bytes: 256 },
                DeltaOptions { values: mode, codec, ..Default::default() },
            ] {
                let ctx = format!(
                    "{dtype} density {density} {mode:?} {codec:?} seg {} chunk {}",
                    opts.segment_target, opts.chunk_bytes
                );
                let (m, enc) = roundtrip(&base, &layout, &target, &layout, &opts, &ctx);
                let changed: u64 = base
                    .iter()
                    .zip(&target)
                    .map(|(a, b)| {
                        a.data
                            .chunks_exact(a.dtype.size())
                            .zip(b.data.chunks_exact(a.dtype.size()))
                            .filter(|(x, y)| x != y)
                            .count() as u64
                    })
                    .sum();
                assert!(enc.stats.changed >= changed, "{ctx}: stats.changed {} < {changed}", enc.stats.changed);
                if density == 0.0 {
                    assert!(m.segments.is_empty(), "{ctx}: no change must mean no segment");
                    assert_eq!(m.base_root, m.result_root);
                }
                if opts.segment_target == 48 && density >= 1e-2 {
                    assert!(
                        m.segments.len() > 3,
                        "{ctx}: small segment_target must give many segments, got {}",
                        m.segments.len()
                    );
                }
                combos += 1;
            }
        }
    }
    assert_eq!(combos, DType::ALL.len() * DENSITIES.len() * 3);
}

#[test]
fn all_dtypes_ulp_raw() {
    matrix(ValueMode::Ulp, Codec::Raw);
}
#[test]
fn all_dtypes_ulp_zstd() {
    matrix(ValueMode::Ulp, Codec::Zstd { level: 1 });
}
#[test]
fn all_dtypes_overwrite_raw() {
    matrix(ValueMode::Overwrite, Codec::Raw);
}
#[test]
fn all_dtypes_overwrite_zstd() {
    matrix(ValueMode::Overwrite, Codec::Zstd { level: 3 });
}

/// Every ordered pair of special patterns (including wrap-around differences such as
/// 0xFFFF -> 0x0000 and NaN payload -> NaN payload) survives both value modes bit for bit.
#[test]
fn special_pattern_transitions() {
    for &dtype in &DType::ALL {
        let pats = special_patterns(dtype);
        let mut a = vec![];
        let mut b = vec![];
        for p in &pats {
            for q in &pats {
                a.extend_from_slice(p);
                b.extend_from_slice(q);
            }
        }
        let n = (pats.len() * pats.len()) as u64;
        let base = vec![T::new("t", dtype, &[n], a)];
        let target = vec![T::new("t", dtype, &[n], b)];
        let layout = Layout::for_tensors(&metas(&base), u64::MAX).unwrap();
        for values in [ValueMode::Ulp, ValueMode::Overwrite] {
            for codec in [Codec::Raw, Codec::Zstd { level: 1 }] {
                for chunk_bytes in [dtype.size(), 1 << 20] {
                    let opts = DeltaOptions { values, codec, segment_target: 64, chunk_bytes };
                    roundtrip(
                        &base,
                        &layout,
                        &target,
                        &layout,
                        &opts,
                        &format!("specials {dtype} {values:?} {codec:?} {chunk_bytes}"),
                    );
                }
            }
        }
    }
}

/// A checkpoint with no tensors at all, and one with only empty tensors.
#[test]
fn empty_checkpoints() {
    let none: Vec<T> = vec![];
    let layout = Layout::for_tensors(&[], u64::MAX).unwrap();
    let (m, _) = roundtrip(&none, &layout, &none, &layout, &DeltaOptions::default(), "no tensors");
    assert!(m.segments.is_empty());
    let empties = vec![T::new("a", DType::F32, &[0], vec![]), T::new("b", DType::BF16, &[0, 3], vec![])];
    let layout = Layout::for_tensors(&metas(&empties), u64::MAX).unwrap();
    roundtrip(&empties, &layout, &empties, &layout, &DeltaOptions::default(), "only empties");
    // From nothing to something and back.
    let some = vec![T::random("x", DType::F16, &[9], &mut rng(5))];
    let ls = Layout::for_tensors(&metas(&some), u64::MAX).unwrap();
    let (m, _) = roundtrip(&empties, &layout, &some, &ls, &DeltaOptions::default(), "empties -> some");
    assert_eq!(m.stats.removed_tensors, 2);
    assert_eq!(m.stats.new_tensors, 1);
    roundtrip(
        &some,
        &ls,
        &none,
        &Layout::for_tensors(&[], u64::MAX).unwrap(),
        &DeltaOptions::default(),
        "some -> none",
    );
}

/// Tensors added, removed, reshaped and retyped: needs_rewrite is true and the rewrite
/// reproduces the target exactly.
#[test]
fn layout_changes() {
    let mut r = rng(7);
    let base = vec![
        T::random("a", DType::F32, &[10], &mut r),
        T::random("b", DType::BF16, &[4, 4], &mut r),
        T::random("c", DType::U8, &[7], &mut r),
        T::random("d", DType::I64, &[3], &mut r),
        T::random("s", DType::F64, &[], &mut r),
    ];
    let bl = Layout::for_tensors(&metas(&base), u64::MAX).unwrap();
    let cases: Vec<(&str, Vec<T>)> = vec![
        (
            "reshape",
            vec![
                T::new("a", DType::F32, &[2, 5], base[0].data.clone()),
                base[1].clone(),
                base[2].clone(),
                base[3].clone(),
                base[4].clone(),
            ],
        ),
        (
            "retype same bytes",
            vec![
                base[0].clone(),
                T::new("b", DType::F16, &[4, 4], base[1].data.clone()),
                base[2].clone(),
                base[3].clone(),
                base[4].clone(),
            ],
        ),
        (
            "retype other width",
            vec![
                base[0].clone(),
                base[1].clone(),
                T::random("c", DType::I32, &[7], &mut r),
                base[3].clone(),
                base[4].clone(),
            ],
        ),
        ("remove", vec![base[0].clone(), base[1].clone(), base[3].clone()]),
        ("add", {
            let mut v = base.clone();
            v.push(T::random("new.tensor", DType::F8_E4M3, &[6, 2], &mut r));
            v.push(T::random("new.empty", DType::BOOL, &[0], &mut r));
            v
        }),
        (
            "everything at once",
            vec![
                T::new("a", DType::F32, &[5, 2], mutate(&base[0], 0.3, &mut r).data),
                T::random("b", DType::U16, &[2, 8], &mut r),
                mutate(&base[3], 0.5, &mut r),
                T::random("zz", DType::F64, &[3, 1], &mut r),
                T::random("s", DType::F64, &[1], &mut r),
            ],
        ),
        ("reorder only", vec![base[4].clone(), base[3].clone(), base[2].clone(), base[1].clone(), base[0].clone()]),
    ];
    for (name, target) in cases {
        for shard in [u64::MAX, 64] {
            let tl = Layout::for_tensors(&metas(&target), shard).unwrap();
            assert_ne!(tl, bl, "{name}: test must change the layout");
            for values in [ValueMode::Ulp, ValueMode::Overwrite] {
                for codec in [Codec::Raw, Codec::Zstd { level: 1 }] {
                    let opts = DeltaOptions { values, codec, segment_target: 32, chunk_bytes: 16 };
                    roundtrip(
                        &base,
                        &bl,
                        &target,
                        &tl,
                        &opts,
                        &format!("layout change {name} shard {shard} {values:?} {codec:?}"),
                    );
                }
            }
        }
    }
}

/// A LoRA-like merge changes every element: the tensor goes dense and the payload is not
/// larger than the dense bytes plus a small overhead.
#[test]
fn dense_fallback() {
    let mut r = rng(11);
    let base =
        vec![T::random("lora.A", DType::BF16, &[64, 256], &mut r), T::random("frozen", DType::BF16, &[64, 64], &mut r)];
    let mut target = base.clone();
    target[0] = mutate(&base[0], 1.0, &mut r);
    for (i, c) in target[0].data.iter_mut().enumerate() {
        *c ^= (i as u8) | 0x11; // every byte changes: no element stays equal
    }
    let layout = Layout::for_tensors(&metas(&base), u64::MAX).unwrap();
    for values in [ValueMode::Ulp, ValueMode::Overwrite] {
        for codec in [Codec::Raw, Codec::Zstd { level: 1 }] {
            for opts in [
                DeltaOptions { values, codec, ..Default::default() },
                DeltaOptions { values, codec, segment_target: 4096, chunk_bytes: 1024 },
            ] {
                let ctx = format!("dense {values:?} {codec:?} {}", opts.chunk_bytes);
                let (m, enc) = roundtrip(&base, &layout, &target, &layout, &opts, &ctx);
                let changed_bytes = target[0].data.len() as u64;
                assert!(enc.stats.dense_chunks > 0, "{ctx}: expected dense chunks");
                assert_eq!(enc.stats.changed, target[0].numel() as u64, "{ctx}");
                let overhead = 128 * m.segments.len() as u64 + changed_bytes / 64 + 256;
                assert!(
                    enc.stats.payload_bytes <= changed_bytes + overhead,
                    "{ctx}: payload {} > dense {} + overhead {overhead}",
                    enc.stats.payload_bytes,
                    changed_bytes
                );
                println!("{ctx}: payload {} bytes for {changed_bytes} dense bytes", enc.stats.payload_bytes);
            }
        }
    }
}

/// `diff_update` (the publisher's one pass over its snapshot) against `encode_delta` of the
/// same inputs: byte-identical segments and stats, and the base left equal to the target.
fn check_diff_update(base: &[T], target: &[T], opts: &DeltaOptions, ctx: &str) {
    let want = encode_delta(&views(base), &views(target), opts).unwrap();
    let mut snap: Vec<Vec<u8>> = base.iter().map(|t| t.data.clone()).collect();
    let diff = {
        let mut bufs: Vec<&mut [u8]> = snap.iter_mut().map(|d| &mut d[..]).collect();
        diff_update(&mut bufs, &views(target), opts).unwrap()
    };
    for (s, t) in snap.iter().zip(target) {
        assert!(s == &t.data, "{ctx}: {} not brought up to the target", t.name);
    }
    let got = diff.encode().unwrap();
    assert_eq!(got.stats, want.stats, "{ctx}");
    assert_eq!(got.segments.len(), want.segments.len(), "{ctx}");
    for (g, w) in got.segments.iter().zip(&want.segments) {
        assert!(g.bytes == w.bytes, "{ctx}: segment bytes differ");
    }
    // The read-only diff (a coalesced step held as changes) leaves the base as it is, encodes
    // to the same bytes, and its `apply` brings a copy of the base to the target bit for bit.
    let kept: Vec<Vec<u8>> = base.iter().map(|t| t.data.clone()).collect();
    let refs: Vec<&[u8]> = kept.iter().map(|d| &d[..]).collect();
    let held = driftless_format::diff(&refs, &views(target), opts).unwrap();
    for (k, b) in kept.iter().zip(base) {
        assert!(k == &b.data, "{ctx}: the read-only diff wrote {}", b.name);
    }
    let mut copy = kept.clone();
    {
        let mut tm = driftless_format::TensorsMut::new();
        for ((d, t), _) in copy.iter_mut().zip(target).zip(base) {
            tm.insert(&t.name, t.dtype, d);
        }
        held.apply(&tm).unwrap();
    }
    for (c, t) in copy.iter().zip(target) {
        assert!(c == &t.data, "{ctx}: apply of the held diff did not give {}", t.name);
    }
    let got = held.encode().unwrap();
    assert_eq!(got.stats, want.stats, "{ctx}");
    for (g, w) in got.segments.iter().zip(&want.segments) {
        assert!(g.bytes == w.bytes, "{ctx}: the read-only diff's segment bytes differ");
    }
}

#[test]
fn diff_update_matches_encode_delta() {
    let mut r = rng(21);
    for &dtype in DType::ALL.iter() {
        let base = tensors_of(dtype, 300);
        for density in DENSITIES {
            let target: Vec<T> = base.iter().map(|t| mutate(t, density, &mut r)).collect();
            for values in [ValueMode::Ulp, ValueMode::Overwrite] {
                for opts in [
                    DeltaOptions { values, ..Default::default() },
                    DeltaOptions { values, codec: Codec::Raw, segment_target: 64, chunk_bytes: 40 },
                ] {
                    check_diff_update(
                        &base,
                        &target,
                        &opts,
                        &format!("{dtype:?} {density} {values:?} {}", opts.chunk_bytes),
                    );
                }
            }
        }
    }
    // Every byte changed: chunks go dense part way through the scan, and must still be copied whole.
    let base = tensors_of(DType::BF16, 301);
    let target: Vec<T> = base
        .iter()
        .map(|t| {
            T::new(&t.name, t.dtype, &t.shape, t.data.iter().enumerate().map(|(i, b)| b ^ ((i as u8) | 0x11)).collect())
        })
        .collect();
    check_diff_update(&base, &target, &DeltaOptions { chunk_bytes: 256, ..Default::default() }, "dense");
}

/// A mismatched call is refused before anything is written.
#[test]
fn diff_update_refuses_mismatch_untouched() {
    let mut r = rng(22);
    let base = tensors_of(DType::F32, 302);
    let target: Vec<T> = base.iter().map(|t| mutate(t, 0.5, &mut r)).collect();
    let mut snap: Vec<Vec<u8>> = base.iter().map(|t| t.data.clone()).collect();
    snap[2].push(0);
    let mut bufs: Vec<&mut [u8]> = snap.iter_mut().map(|d| &mut d[..]).collect();
    let e = diff_update(&mut bufs, &views(&target), &DeltaOptions::default()).unwrap_err();
    assert_eq!(e.kind(), driftless_format::ErrorKind::InvalidInput, "{e}");
    snap[2].pop();
    for (s, t) in snap.iter().zip(&base) {
        assert!(s == &t.data, "{} was written", t.name);
    }
}

fn dtype_strategy() -> impl Strategy<Value = DType> {
    (0..DType::ALL.len()).prop_map(|i| DType::ALL[i])
}

fn tensor_strategy() -> impl Strategy<Value = (DType, Vec<u64>)> {
    (dtype_strategy(), proptest::collection::vec(0u64..9, 0..4))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Random tensors, random changes, random options, random shard sizes.
    #[test]
    fn prop_roundtrip(
        specs in proptest::collection::vec(tensor_strategy(), 0..5),
        density in prop_oneof![Just(0.0), 0.0..1.0f64, Just(1.0)],
        ulp in any::<bool>(),
        zstd in any::<bool>(),
        segment_target in 1usize..512,
        chunk_bytes in 1usize..256,
        shard in prop_oneof![Just(u64::MAX), 1u64..256],
        seed in any::<u64>(),
    ) {
        let mut r = rng(seed);
        let base: Vec<T> = specs.iter().enumerate().map(|(i, (d, s))| T::random(&format!("t{i}"), *d, s, &mut r)).collect();
        let target: Vec<T> = base.iter().map(|t| mutate(t, density, &mut r)).collect();
        let layout = Layout::for_tensors(&metas(&base), shard).unwrap();
        let opts = DeltaOptions {
            values: if ulp { ValueMode::Ulp } else { ValueMode::Overwrite },
            codec: if zstd { Codec::Zstd { level: 1 } } else { Codec::Raw },
            segment_target,
            chunk_bytes,
        };
        roundtrip(&base, &layout, &target, &layout, &opts, "prop");
        check_diff_update(&base, &target, &opts, "prop");
    }

    /// Random layout changes between steps: never an error, result equals the target.
    #[test]
    fn prop_layout_change(
        a in proptest::collection::vec(tensor_strategy(), 0..5),
        b in proptest::collection::vec(tensor_strategy(), 0..5),
        keep in proptest::collection::vec(any::<bool>(), 5),
        ulp in any::<bool>(),
        shard in prop_oneof![Just(u64::MAX), 1u64..128],
        seed in any::<u64>(),
    ) {
        let mut r = rng(seed);
        let base: Vec<T> = a.iter().enumerate().map(|(i, (d, s))| T::random(&format!("t{i}"), *d, s, &mut r)).collect();
        // Target: some base tensors kept (mutated), others replaced by b's dtype/shape, plus b's extra names.
        let mut target: Vec<T> = vec![];
        for (i, t) in base.iter().enumerate() {
            if keep[i] {
                target.push(mutate(t, 0.1, &mut r));
            } else if let Some((d, s)) = b.get(i) {
                target.push(T::random(&t.name, *d, s, &mut r));
            }
        }
        for (i, (d, s)) in b.iter().enumerate().skip(base.len()) {
            target.push(T::random(&format!("t{i}"), *d, s, &mut r));
        }
        let bl = Layout::for_tensors(&metas(&base), u64::MAX).unwrap();
        let tl = Layout::for_tensors(&metas(&target), shard).unwrap();
        let opts = DeltaOptions { values: if ulp { ValueMode::Ulp } else { ValueMode::Overwrite }, codec: Codec::Zstd { level: 1 }, segment_target: 64, chunk_bytes: 32 };
        let (m, _) = make(&base, &target, &tl, &opts);
        prop_assert_eq!(ops::needs_rewrite(&bl, &m), bl != tl);
        roundtrip(&base, &bl, &target, &tl, &opts, "prop layout");
    }
}
