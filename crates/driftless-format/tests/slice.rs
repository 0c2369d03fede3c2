//! Digests of tensor parts held by different ranks: assembled, they give exactly the digest of
//! the whole tensor, for row blocks, column blocks, flat ranges and any contiguous cut; gaps,
//! overlaps and parts not split at chunk boundaries are refused.

mod common;

use common::*;
use driftless_format::hash::{self, finish_tensor, CHUNK, LEAF};
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
                // Bytes that travel: under a leaf at each end of a run, and leaf digests of at
                // most one chunk at each end.
                for p in &parts {
                    assert!(p.head.len() < LEAF && p.tail.len() < LEAF);
                    assert!(p.head_leaves.len() < CHUNK / LEAF && p.tail_leaves.len() < CHUNK / LEAF);
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
        // Cuts exactly on and next to chunk and leaf boundaries too.
        cuts.push(CHUNK as u64 * r.gen_range(0..4u64));
        cuts.push((CHUNK as u64 + 1).min(len));
        let leaf = LEAF as u64 * r.gen_range(0..len / LEAF as u64);
        cuts.extend([leaf, leaf + 1, leaf.saturating_sub(1)]);
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
    refused(vec![p, part(half, len)], "not split at leaf and chunk boundaries");
    // A leaf digest moved into the chunk list.
    let mut p = part(LEAF as u64, len);
    let d = p.head_leaves.pop().unwrap();
    p.chunks.insert(0, d);
    refused(vec![part(0, LEAF as u64), p], "not split at leaf and chunk boundaries");
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

/// One step of a sharded model, end to end without a bucket: 4 ranks each hold slices (row
/// block, column block, flat range; a tensor held whole by rank 0; a replicated tensor
/// published by replica 0 only), encode only their runs against their own base, and compute
/// their part digests. All ranks' segments applied as one delta onto the gathered base give
/// the gathered target bit for bit, and the root from the assembled parts is the target's.
#[test]
fn ranks_encode_their_slices_into_one_delta() {
    use driftless_format::delta::{decode_segment, encode_runs, DecodedSegment, Run};
    use driftless_format::{fused, Checkpoint, CheckpointFiles, DeltaOptions};

    let mut r = rng(21);
    let ranks = 4u64;
    let base = vec![
        T::random("emb", DType::BF16, &[1030, 512], &mut r),
        T::random("o_proj", DType::BF16, &[300, 256], &mut r),
        T::random("flat", DType::F32, &[3001], &mut r),
        T::random("norm", DType::BF16, &[64], &mut r),
        T::random("rep", DType::BF16, &[128], &mut r),
    ];
    let target: Vec<T> = base.iter().map(|t| mutate(t, 0.02, &mut r)).collect();
    // Rank k's slices: (tensor index, slice).
    let held = |k: u64| -> Vec<(usize, Slice)> {
        let split =
            |n: u64| ((k * n.div_ceil(ranks)).min(n), n.div_ceil(ranks).min(n - (k * n.div_ceil(ranks)).min(n)));
        let mut v = vec![];
        let (a, l) = split(1030);
        v.push((0, Slice::block(&[1030, 512], 0, a, l).unwrap()));
        let (a, l) = split(256);
        v.push((1, Slice::block(&[300, 256], 1, a, l).unwrap()));
        let (a, l) = split(3001);
        v.push((2, Slice::flat(&[3001], a, l).unwrap()));
        if k == 0 {
            v.push((3, Slice::block(&[64], 0, 0, 64).unwrap()));
        }
        // Every rank holds "rep" (a replica); only replica 0 publishes it.
        if k == 0 {
            v.push((4, Slice::block(&[128], 0, 0, 128).unwrap()));
        }
        v
    };
    let opts = DeltaOptions { chunk_bytes: 1000, segment_target: 4096, ..Default::default() };
    let mut segments: Vec<DecodedSegment> = vec![];
    let mut parts: Vec<Vec<PartDigest>> = vec![vec![]; base.len()];
    for k in 0..ranks {
        // The rank's own memory: the bytes of its slices (row-major within the slice is the
        // runs in order), base and target.
        let mine = held(k);
        // (tensor, byte runs, base bytes, target bytes)
        type Local = (usize, Vec<(u64, u64)>, Vec<u8>, Vec<u8>);
        let local: Vec<Local> = mine
            .iter()
            .map(|(t, s)| {
                let runs = s.byte_runs(base[*t].dtype);
                let cat = |d: &[u8]| runs.iter().flat_map(|&(o, n)| d[o as usize..(o + n) as usize].to_vec()).collect();
                (*t, runs.clone(), cat(&base[*t].data), cat(&target[*t].data))
            })
            .collect();
        let mut run_list = vec![];
        for (t, runs, b, n) in &local {
            let w = base[*t].dtype.size() as u64;
            let mut off = 0usize;
            for &(o, len) in runs {
                let range = off..off + len as usize;
                run_list.push(Run {
                    name: &base[*t].name,
                    dtype: base[*t].dtype,
                    at: o / w,
                    base: Some(&b[range.clone()]),
                    target: &n[range.clone()],
                });
                parts[*t].push(part_digest(target[*t].data.len() as u64, o, &n[range]).unwrap());
                off += len as usize;
            }
        }
        let enc = encode_runs(&run_list, &opts).unwrap();
        segments.extend(enc.segments.iter().map(|s| decode_segment(&s.bytes, s.raw_size).unwrap()));
    }
    // Apply every rank's segments as one delta onto the gathered base, hashing as the agent does.
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &base, u64::MAX);
    let files = CheckpointFiles::open(dir.path()).unwrap();
    let metas = files.metas();
    let digests = fused::apply_and_hash(fused::Target::Files(&files), &metas, &[&segments], true).unwrap().unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_same_tensors(&ck.views(), &target, "sharded step applied");
    // The root from the ranks' parts, without the bytes, is the gathered target's root.
    let from_parts: Vec<(&str, driftless_format::Digest)> = target
        .iter()
        .zip(&parts)
        .map(|(t, p)| {
            let chunks = assemble(t.data.len() as u64, p).unwrap();
            (t.name.as_str(), finish_tensor(&t.name, t.dtype, &t.shape, t.data.len() as u64, &chunks))
        })
        .collect();
    let root = hash::combine_root(from_parts.iter().copied());
    assert_eq!(root, common::root(&target));
    assert_eq!(root, hash::combine_root(metas.iter().zip(&digests).map(|(m, d)| (m.name.as_str(), *d))));

    // A rank publishing a slice that overlaps another's: the commit refuses it (parts), and
    // so would an agent (overlapping writes in one delta).
    let mut overlapping = parts[0].clone();
    overlapping.push(parts[0][0].clone());
    assert!(assemble(target[0].data.len() as u64, &overlapping).unwrap_err().to_string().contains("overlap"));
    let twice: Vec<DecodedSegment> = segments.iter().chain(segments.iter()).cloned().collect();
    let dir2 = tempfile::tempdir().unwrap();
    write(dir2.path(), &base, u64::MAX);
    let files2 = CheckpointFiles::open(dir2.path()).unwrap();
    let metas2 = files2.metas();
    let e = fused::apply_and_hash(fused::Target::Files(&files2), &metas2, &[&twice], true).unwrap_err();
    assert!(e.to_string().contains("overlapping writes"), "{e}");
}

/// Where a cut falls on a leaf boundary (row blocks of tensors whose rows are multiples of
/// 8 KiB), no bytes travel at all: only leaf and chunk digests.
#[test]
fn leaf_aligned_cuts_send_no_bytes() {
    let mut r = rng(5);
    // 300 rows of 4096 BF16 (8 KiB each): a row block is leaf aligned wherever it is cut.
    let t = T::random("w", DType::BF16, &[300, 4096], &mut r);
    let want = hash::tensor_digest(&t.view());
    let len = t.data.len() as u64;
    let row = 8192u64;
    let cuts = [0, 17, 150, 151, 299, 300].map(|x| x * row);
    let parts: Vec<PartDigest> =
        cuts.windows(2).map(|w| part_digest(len, w[0], &t.data[w[0] as usize..w[1] as usize]).unwrap()).collect();
    for p in &parts {
        assert!(p.head.is_empty() && p.tail.is_empty(), "bytes at a leaf-aligned cut {}", p.start);
    }
    assert_eq!(finish_tensor("w", DType::BF16, &t.shape, len, &assemble(len, &parts).unwrap()), want);
}

/// `split` is public: parts outside the tensor are clamped, never a loop or a panic.
#[test]
fn split_of_a_range_outside_the_tensor_terminates() {
    use driftless_format::slice::split;
    let len = 6u64 << 20;
    for (a, b) in [(len + 1, len + 5), (12 << 19, (12 << 19) + 1), (5, 3), (0, u64::MAX), (u64::MAX, u64::MAX)] {
        let s = split(len, a, b);
        assert!(s.head + s.tail <= len, "{a}..{b}: {s:?}");
    }
}
