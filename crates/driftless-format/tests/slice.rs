//! Digests of tensor parts held by different ranks: assembled, they give exactly the digest of
//! the whole tensor, for row blocks, column blocks, flat ranges and any contiguous cut; gaps,
//! overlaps and parts not split at chunk boundaries are refused.

mod common;

use common::*;
use driftless_format::hash::{self, finish_tensor, CHUNK};
use driftless_format::slice::{assemble, part_digest, PartDigest, Slice};
use driftless_format::{DType, ErrorKind};
use rand::Rng;

/// The parts a rank holding `slice` of `t` computes, from its bytes only.
fn rank_parts(t: &T, slice: &Slice) -> Vec<PartDigest> {
    slice
        .byte_runs(t.dtype)
        .into_iter()
        .map(|(o, n)| part_digest(t.data.len() as u64, o, &t.data[o as usize..(o + n) as usize]).unwrap())
        .collect()
}

fn assembled_digest(t: &T, parts: &[PartDigest]) -> driftless_format::Result<driftless_format::Digest> {
    let chunks = assemble(t.data.len() as u64, parts)?;
    Ok(finish_tensor(&t.name, t.dtype, &t.shape, t.data.len() as u64, &chunks))
}

/// The elements of a slice, enumerated one by one (row-major), as byte offsets.
#[allow(clippy::needless_range_loop)] // index arithmetic over three parallel arrays reads best
fn naive_offsets(s: &Slice, w: u64) -> Vec<u64> {
    let nd = s.shape.len();
    let mut out = vec![];
    let mut idx = vec![0u64; nd];
    for _ in 0..s.numel() {
        let mut flat = 0u64;
        for d in 0..nd {
            flat = flat * s.shape[d] + s.offsets[d] + idx[d];
        }
        out.push(flat * w);
        for d in (0..nd).rev() {
            idx[d] += 1;
            if idx[d] < s.lengths[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

#[test]
fn byte_runs_are_the_slice_elements() {
    let cases = [
        Slice::block(&[6, 5], 0, 2, 3).unwrap(),
        Slice::block(&[6, 5], 1, 1, 2).unwrap(),
        Slice::block(&[4, 3, 5], 1, 1, 1).unwrap(),
        Slice::block(&[4, 3, 5], 2, 0, 5).unwrap(),
        Slice::block(&[4, 3, 5], 2, 2, 2).unwrap(),
        Slice::flat(&[4, 3, 5], 7, 31).unwrap(),
        Slice::block(&[7], 0, 0, 0).unwrap(),
        Slice { shape: vec![4, 6, 2], offsets: vec![1, 2, 1], lengths: vec![2, 3, 1] },
    ];
    for s in cases {
        for dtype in [DType::U8, DType::BF16, DType::F64] {
            let w = dtype.size() as u64;
            let from_runs: Vec<u64> = s
                .byte_runs(dtype)
                .iter()
                .flat_map(|&(o, n)| {
                    assert_eq!(n % w, 0);
                    (0..n / w).map(move |i| o + i * w)
                })
                .collect();
            assert_eq!(from_runs, naive_offsets(&s, w), "{s:?} {dtype}");
            // Runs are merged: no two adjacent.
            for r in s.byte_runs(dtype).windows(2) {
                assert!(r[0].0 + r[0].1 < r[1].0, "{s:?}: runs {r:?} not merged");
            }
        }
    }
    assert!(Slice::block(&[6, 5], 1, 4, 2).is_err());
    assert!(Slice::block(&[6, 5], 2, 0, 1).is_err());
    assert!(Slice::flat(&[6, 5], 29, 2).is_err());
}

/// Row blocks, column blocks and flat ranges over 4 and 8 ranks of tensors spanning several
/// chunks, with uneven splits: the assembled digest is the whole tensor's.
#[test]
fn ranks_assemble_the_whole_tensor_digest() {
    let mut r = rng(5);
    let rows = 3 * (CHUNK as u64 / 2 / 1024) + 7; // BF16 [rows, 1024]: about 3 MiB, odd rows
    let ts = [
        T::random("m", DType::BF16, &[rows, 1024], &mut r),
        T::random("v", DType::F32, &[(CHUNK as u64 / 4) * 2 + 3], &mut r),
        T::random("s", DType::BF16, &[3, 5], &mut r),
    ];
    for t in &ts {
        let want = hash::tensor_digest(&t.view());
        for ranks in [4u64, 8] {
            let mut layouts: Vec<Vec<Slice>> = vec![];
            // Flat ranges, uneven: FSDP pads the last rank short.
            let n = driftless_format::numel(&t.shape).unwrap();
            let per = n.div_ceil(ranks);
            layouts.push(
                (0..ranks)
                    .map(|k| Slice::flat(&t.shape, (k * per).min(n), per.min(n - (k * per).min(n))).unwrap())
                    .collect(),
            );
            // Blocks along each dimension, uneven.
            for dim in 0..t.shape.len() {
                let size = t.shape[dim];
                let per = size.div_ceil(ranks);
                layouts.push(
                    (0..ranks)
                        .map(|k| {
                            let a = (k * per).min(size);
                            Slice::block(&t.shape, dim, a, per.min(size - a)).unwrap()
                        })
                        .collect(),
                );
            }
            for layout in layouts {
                let mut parts: Vec<PartDigest> = layout.iter().flat_map(|s| rank_parts(t, s)).collect();
                assert_eq!(assembled_digest(t, &parts).unwrap(), want, "{} over {ranks} ranks: {layout:?}", t.name);
                // Bytes that travel: under 2 chunks per run.
                for p in &parts {
                    assert!(p.head.len() < CHUNK && p.tail.len() < CHUNK);
                }
                // Order of arrival does not matter.
                parts.reverse();
                assert_eq!(assembled_digest(t, &parts).unwrap(), want);
            }
        }
    }
}

#[test]
fn random_contiguous_cuts_assemble() {
    let mut r = rng(9);
    let t = T::random("x", DType::U8, &[3 * CHUNK as u64 + 12345], &mut r);
    let want = hash::tensor_digest(&t.view());
    let len = t.data.len() as u64;
    for _ in 0..20 {
        let mut cuts: Vec<u64> = (0..r.gen_range(0..6)).map(|_| r.gen_range(0..=len)).collect();
        // Cuts exactly on and next to chunk boundaries too.
        cuts.push(CHUNK as u64 * r.gen_range(0..4u64));
        cuts.push((CHUNK as u64 + 1).min(len));
        cuts.extend([0, len]);
        cuts.sort_unstable();
        let parts: Vec<PartDigest> =
            cuts.windows(2).map(|w| part_digest(len, w[0], &t.data[w[0] as usize..w[1] as usize]).unwrap()).collect();
        assert_eq!(assembled_digest(&t, &parts).unwrap(), want, "cuts {cuts:?}");
    }
}

#[test]
fn gaps_overlaps_and_bad_splits_are_refused() {
    let mut r = rng(3);
    let t = T::random("x", DType::U8, &[2 * CHUNK as u64 + 100], &mut r);
    let len = t.data.len() as u64;
    let part = |a: u64, b: u64| part_digest(len, a, &t.data[a as usize..b as usize]).unwrap();
    let half = CHUNK as u64 + 50;
    let refused = |parts: Vec<PartDigest>, what: &str| {
        let e = assemble(len, &parts).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
        assert!(e.to_string().contains(what), "{e} (want {what})");
    };
    assert!(assemble(len, &[part(0, half), part(half, len)]).is_ok());
    refused(vec![part(0, half), part(half - 1, len)], "overlap at byte");
    refused(vec![part(0, half), part(half + 1, len)], "no part holds bytes");
    refused(vec![part(0, half)], "no part holds bytes");
    refused(vec![part(0, half), part(half, len), part(half, len)], "overlap");
    // A part whose pieces do not match its extent: a byte moved from the tail to the head.
    let mut p = part(0, half);
    let b = p.tail.remove(0);
    p.head.push(b);
    refused(vec![p, part(half, len)], "not split at chunk boundaries");
    // A part claiming bytes past the end.
    let mut p = part(half, len);
    p.len += 1;
    refused(vec![part(0, half), p], "beyond a tensor");
    // A forged chunk digest assembles but changes the digest: caught by the signed root.
    let mut p = part(0, len);
    p.chunks[0].0[0] ^= 1;
    let got = assemble(len, &[p]).unwrap();
    assert_ne!(finish_tensor("x", DType::U8, &t.shape, len, &got), hash::tensor_digest(&t.view()));
    assert!(part_digest(len, len, &[1]).is_err());
}
