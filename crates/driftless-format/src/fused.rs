//! Apply and hash in one pass: the agent's fast path.
//!
//! Applying a sparse delta at 1% density touches every 4 KiB page of a BF16 model (a page
//! holds 2,048 elements), so an apply followed by a separate hash reads the whole model twice
//! from memory. [`apply_and_hash`] instead walks each tensor in blocks of [`BLOCK`] bytes:
//! it applies the changes of every delta of a chain that fall into the block (delta by delta,
//! in chain order) and feeds the block to the tensor's SHA-256 while it is still in the CPU
//! cache. Tensors are processed in parallel on the rayon pool, largest first; the work of one
//! tensor is its bytes, however the deltas are split into segments (one 7 MB segment often
//! covers a whole model).
//!
//! The unit of parallelism is a *piece* of a tensor: a range that starts on a 1 MiB chunk
//! boundary of the weights root (see [`crate::hash`]), at least [`PIECE`] bytes long, that no
//! entry of any delta straddles (a sparse entry's positions are gaps decoded in order, so an
//! entry is applied by one walk). Publishers cut entries at 8 MiB of tensor bytes, so a large
//! tensor splits into many pieces and a model dominated by one tensor still uses every core;
//! each piece yields the digests of its chunks, and a tensor's digest is made from them in
//! order. Chained deltas are exact because, for every element, the changes
//! of delta `d` are applied before those of delta `d + 1`: each block is finished by every
//! delta before the next block is started, and an entry only writes inside the current block.
//!
//! Safety against hostile deltas is that of [`crate::delta::apply_segment`]: entries name
//! known tensors with their dtype, stay in bounds, and entries of one delta never overlap
//! (checked up front, per tensor, after sorting); positions are checked one by one as they are
//! decoded.

use crate::checkpoint::TensorsMut;
use crate::delta::{bad, DecodedSegment, EntryInfo, ValueMode, Word};
use crate::{hash, varint, DType, Digest, Result, TensorMeta};
use rayon::prelude::*;

/// Bytes of a tensor applied and hashed at a time (fits the per-core L2 cache with room).
pub const BLOCK: usize = 256 << 10;

/// Smallest piece of a tensor handed to one task (a multiple of the root's chunk).
pub const PIECE: usize = 8 * hash::CHUNK;

/// One delta's entries for one tensor, sorted by start.
type Work<'s> = Vec<(&'s DecodedSegment, &'s EntryInfo)>;

/// Applies `chain` (deltas in order, each a list of decoded segments) in place onto `tensors`
/// and, when `hash` is set, returns the per-tensor digests of the result in the order of
/// `metas`, which must list the tensors of `tensors` (e.g. [`CheckpointMut::metas`]).
///
/// [`CheckpointMut::metas`]: crate::CheckpointMut::metas
///
/// `done(t)` is called once tensor `t` (an index into `metas`) is written and hashed, from
/// a worker thread.
///
/// On error some changes may already be written: the caller owns a scratch copy (the agent's
/// inactive slot), never the served one.
pub fn apply_and_hash(
    tensors: &TensorsMut<'_>,
    metas: &[TensorMeta],
    chain: &[&[DecodedSegment]],
    hash: bool,
    done: &(dyn Fn(usize) + Sync),
) -> Result<Option<Vec<Digest>>> {
    apply_and_hash_blocks(tensors, metas, chain, hash, done, BLOCK, PIECE)
}

/// [`apply_and_hash`] with another block size and smallest piece in bytes (tests use tiny
/// blocks so that entries and changes straddle block boundaries, and one-chunk pieces).
#[doc(hidden)]
pub fn apply_and_hash_blocks(
    tensors: &TensorsMut<'_>,
    metas: &[TensorMeta],
    chain: &[&[DecodedSegment]],
    hash: bool,
    done: &(dyn Fn(usize) + Sync),
    block: usize,
    piece: usize,
) -> Result<Option<Vec<Digest>>> {
    let block = block.max(8);
    let piece = piece.div_ceil(hash::CHUNK).max(1) * hash::CHUNK;
    let index: std::collections::HashMap<&str, usize> =
        metas.iter().enumerate().map(|(i, t)| (t.name.as_str(), i)).collect();
    let sizes: Vec<u64> = metas
        .iter()
        .map(|m| match tensors.info(&m.name) {
            Some((dt, len)) if dt == m.dtype && m.nbytes().ok() == Some(len as u64) => Ok(len as u64),
            _ => Err(crate::Error::invalid(format!("tensor {} differs from its metadata", m.name))),
        })
        .collect::<Result<_>>()?;
    // work[t][d]: entries of delta d for tensor t.
    let mut work: Vec<Vec<Work<'_>>> = (0..metas.len()).map(|_| vec![Vec::new(); chain.len()]).collect();
    for (d, segs) in chain.iter().enumerate() {
        for seg in segs.iter() {
            for e in &seg.entries {
                let t =
                    *index.get(e.name.as_str()).ok_or_else(|| bad(format!("entry for unknown tensor {}", e.name)))?;
                let m = &metas[t];
                if m.dtype != e.dtype {
                    return Err(bad(format!("entry for {} has dtype {}, tensor is {}", e.name, e.dtype, m.dtype)));
                }
                let n = sizes[t] / m.dtype.size() as u64;
                if e.start.checked_add(e.len).is_none_or(|end| end > n) {
                    return Err(bad(format!(
                        "entry range {}+{} outside tensor {} of {n} elements",
                        e.start, e.len, e.name
                    )));
                }
                work[t][d].push((seg, e));
            }
        }
    }
    for (t, per) in work.iter_mut().enumerate() {
        for list in per.iter_mut() {
            list.sort_unstable_by_key(|(_, e)| e.start);
            for w in list.windows(2) {
                if w[0].1.start + w[0].1.len > w[1].1.start {
                    return Err(bad(format!("overlapping writes to {} at element {}", metas[t].name, w[1].1.start)));
                }
            }
        }
    }
    // Pieces, largest first so the long poles start early.
    let mut pieces: Vec<Piece> = vec![];
    for (t, per) in work.iter().enumerate() {
        let untouched = per.iter().all(|l| l.is_empty());
        if untouched && !hash {
            continue;
        }
        pieces.extend(split(t, sizes[t] / metas[t].dtype.size() as u64, metas[t].dtype.size(), per, piece));
    }
    pieces.sort_by_key(|p| std::cmp::Reverse((p.hi - p.lo) * metas[p.t].dtype.size() as u64));
    let left: Vec<std::sync::atomic::AtomicUsize> = (0..metas.len()).map(|_| 0.into()).collect();
    for p in &pieces {
        left[p.t].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    let out: Vec<(usize, u64, Vec<Digest>)> = pieces
        .par_iter()
        .with_max_len(1)
        .map(|p| {
            let m = &metas[p.t];
            let w = m.dtype.size() as u64;
            let lists: Vec<&[(&DecodedSegment, &EntryInfo)]> =
                work[p.t].iter().zip(&p.entries).map(|(l, r)| &l[r.clone()]).collect();
            let chunks = tensors.with_range_mut(&m.name, p.lo * w, (p.hi - p.lo) * w, |data| {
                one_piece(m, data, p.lo, &lists, hash, block)
            })??;
            let touched = work[p.t].iter().any(|l| !l.is_empty());
            if touched && left[p.t].fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
                done(p.t);
            }
            Ok((p.t, p.lo, chunks))
        })
        .collect::<Result<_>>()?;
    if !hash {
        return Ok(None);
    }
    let mut by_tensor: Vec<Vec<(u64, Vec<Digest>)>> = vec![vec![]; metas.len()];
    for (t, lo, c) in out {
        by_tensor[t].push((lo, c));
    }
    let digests = metas
        .iter()
        .zip(by_tensor)
        .zip(&sizes)
        .map(|((m, mut parts), &len)| {
            parts.sort_by_key(|(lo, _)| *lo);
            let chunks: Vec<Digest> = parts.into_iter().flat_map(|(_, c)| c).collect();
            hash::finish_tensor(&m.name, m.dtype, &m.shape, len, &chunks)
        })
        .collect();
    Ok(Some(digests))
}

/// Elements `[lo, hi)` of tensor `t`, and for each delta the range of its entries (in the
/// tensor's sorted list) that lie inside.
struct Piece {
    t: usize,
    lo: u64,
    hi: u64,
    entries: Vec<std::ops::Range<usize>>,
}

/// Cuts a tensor of `n` elements of `w` bytes into pieces of at least `piece` bytes, at chunk
/// boundaries that no entry of any delta straddles.
fn split(t: usize, n: u64, w: usize, per: &[Work<'_>], piece: usize) -> Vec<Piece> {
    let chunk = (hash::CHUNK / w) as u64;
    let min = (piece / w) as u64;
    // Union of the entries' spans, sorted: a cut must not fall strictly inside one.
    let mut spans: Vec<(u64, u64)> = per.iter().flatten().map(|(_, e)| (e.start, e.start + e.len)).collect();
    spans.sort_unstable();
    let mut cuts = vec![0u64];
    let mut s = 0usize;
    let mut at = min.div_ceil(chunk) * chunk;
    while at + min <= n {
        while s < spans.len() && spans[s].1 <= at {
            s += 1;
        }
        match spans[s..].iter().take_while(|sp| sp.0 < at).find(|sp| sp.1 > at) {
            // Inside an entry: try the first chunk boundary at or after its end.
            Some(sp) => at = sp.1.div_ceil(chunk) * chunk,
            None => {
                cuts.push(at);
                at += min;
            }
        }
    }
    cuts.push(n);
    cuts.windows(2)
        .map(|c| Piece {
            t,
            lo: c[0],
            hi: c[1],
            entries: per
                .iter()
                .map(|l| l.partition_point(|(_, e)| e.start < c[0])..l.partition_point(|(_, e)| e.start < c[1]))
                .collect(),
        })
        .collect()
}

/// Where one delta stands in one tensor: the entry being applied and its decode state.
#[derive(Default)]
struct Cursor {
    entry: usize,
    pp: usize,
    vp: usize,
    /// Next relative element index a gap counts from.
    next: u64,
    /// Changes of the entry applied.
    done: u64,
    /// A decoded position (relative) beyond the last block, applied with the next block.
    pending: Option<u64>,
}

/// Applies the entries `per` (one sorted list per delta, all inside the piece) to `data`, the
/// piece's bytes starting at element `off` of tensor `m`, block by block; returns the chunk
/// digests of the piece when hashing (`off` is on a chunk boundary).
fn one_piece(
    m: &TensorMeta,
    data: &mut [u8],
    off: u64,
    per: &[&[(&DecodedSegment, &EntryInfo)]],
    hash: bool,
    block: usize,
) -> Result<Vec<Digest>> {
    let w = m.dtype.size();
    let n = off + (data.len() / w) as u64;
    let mut h = hash.then(|| hash::ChunkHasher::new(data.len() as u64));
    let mut cursors: Vec<Cursor> = per.iter().map(|_| Cursor::default()).collect();
    let per_block = if hash { (block / w).max(1) as u64 } else { (n - off).max(1) };
    let mut lo = off;
    while lo < n {
        let hi = (lo + per_block).min(n);
        for (list, c) in per.iter().zip(cursors.iter_mut()) {
            advance(list, c, m.dtype, data, off, lo, hi)?;
        }
        if let Some(h) = &mut h {
            h.update(&data[(lo - off) as usize * w..(hi - off) as usize * w]);
        }
        lo = hi;
    }
    for (list, c) in per.iter().zip(&cursors) {
        if c.entry != list.len() {
            return Err(bad(format!("entries of tensor {} not fully applied", m.name)));
        }
    }
    Ok(h.map(hash::ChunkHasher::finish).unwrap_or_default())
}

/// Applies the changes of one delta's entries that fall in elements `[lo, hi)`; `data` holds
/// the tensor's elements from `off` on.
fn advance(
    list: &[(&DecodedSegment, &EntryInfo)],
    c: &mut Cursor,
    dtype: DType,
    data: &mut [u8],
    off: u64,
    lo: u64,
    hi: u64,
) -> Result<()> {
    let w = dtype.size();
    while let Some(&(seg, e)) = list.get(c.entry) {
        if e.start >= hi {
            return Ok(());
        }
        let end = e.start + e.len;
        let dst = &mut data[(e.start - off) as usize * w..(end - off) as usize * w];
        let (pos, vals) = seg.entry_blocks(e);
        if e.dense {
            let a = lo.max(e.start) - e.start;
            let b = hi.min(end) - e.start;
            dense_range(vals, w, e.count as usize, a as usize, b as usize, dst);
        } else {
            let limit = hi - e.start;
            match w {
                1 => sparse::<u8>(dst, e, pos, vals, seg.mode, c, limit)?,
                2 => sparse::<u16>(dst, e, pos, vals, seg.mode, c, limit)?,
                4 => sparse::<u32>(dst, e, pos, vals, seg.mode, c, limit)?,
                _ => sparse::<u64>(dst, e, pos, vals, seg.mode, c, limit)?,
            }
        }
        if end > hi {
            return Ok(());
        }
        if !e.dense && (c.pending.is_some() || c.done != e.count) {
            return Err(bad("position out of range"));
        }
        *c = Cursor { entry: c.entry + 1, ..Default::default() };
    }
    Ok(())
}

/// Elements `[a, b)` (relative to the entry) of a dense entry of `count` elements in byte
/// planes.
fn dense_range(planes: &[u8], w: usize, count: usize, a: usize, b: usize, dst: &mut [u8]) {
    for i in a..b {
        for p in 0..w {
            dst[i * w + p] = planes[p * count + i];
        }
    }
}

/// Applies the changes of a sparse entry at relative positions below `limit`; checks the
/// entry's trailing bytes once all its changes are applied.
#[inline]
fn sparse<T: Word>(
    dst: &mut [u8],
    e: &EntryInfo,
    pos: &[u8],
    vals: &[u8],
    mode: ValueMode,
    c: &mut Cursor,
    limit: u64,
) -> Result<()> {
    let w = T::W;
    let planes = e.count as usize;
    loop {
        let idx = match c.pending.take() {
            Some(i) => i,
            None => {
                if c.done == e.count {
                    break;
                }
                let gap = varint::get(pos, &mut c.pp)?;
                let idx = c.next.checked_add(gap).filter(|&x| x < e.len).ok_or_else(|| bad("position out of range"))?;
                c.next = idx + 1;
                idx
            }
        };
        if idx >= limit {
            c.pending = Some(idx);
            return Ok(());
        }
        let at = idx as usize * w;
        let cell = &mut dst[at..at + w];
        match mode {
            ValueMode::Ulp => {
                let zz = varint::get(vals, &mut c.vp)?;
                let v = T::add_zz(T::load(cell), zz).ok_or_else(|| bad("ulp difference wider than the dtype"))?;
                v.store(cell);
            }
            ValueMode::Overwrite => {
                let i = c.done as usize;
                for (p, x) in cell.iter_mut().enumerate() {
                    *x = vals[p * planes + i];
                }
            }
        }
        c.done += 1;
    }
    if c.pp != pos.len() || (mode == ValueMode::Ulp && c.vp != vals.len()) {
        return Err(bad("entry has trailing position or value bytes"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::delta::{decode_segment, encode_delta};
    use crate::{DeltaOptions, TensorView};

    /// Where a 5.5-chunk BF16 tensor is cut, for entries of the given size in bytes.
    fn cuts(entry_bytes: Option<usize>, piece: usize) -> Vec<(u64, u64)> {
        let n = 11 * hash::CHUNK / 4; // elements: 5.5 chunks of BF16
        let base = vec![0u8; 2 * n];
        let mut next = base.clone();
        for i in (0..n).step_by(97) {
            next[2 * i] = 1;
        }
        let shape = [n as u64];
        let v = |d| vec![TensorView { name: "w", dtype: DType::BF16, shape: &shape, data: d }];
        let segs: Vec<DecodedSegment> = match entry_bytes {
            Some(chunk_bytes) => {
                let opts = DeltaOptions { chunk_bytes, ..Default::default() };
                let enc = encode_delta(&v(&base), &v(&next), &opts).unwrap();
                enc.segments.iter().map(|s| decode_segment(&s.bytes, s.raw_size).unwrap()).collect()
            }
            None => vec![],
        };
        let mut list: Work<'_> = segs.iter().flat_map(|s| s.entries.iter().map(move |e| (s, e))).collect();
        list.sort_unstable_by_key(|(_, e)| e.start);
        split(0, n as u64, 2, &[list], piece).iter().map(|p| (p.lo, p.hi)).collect()
    }

    #[test]
    fn tensors_are_cut_only_where_no_entry_straddles() {
        let c = (hash::CHUNK / 2) as u64; // elements per chunk
        let end = 11 * c / 2;
        // Entries of one chunk: a cut at every chunk (the last piece keeps the half chunk).
        assert_eq!(
            cuts(Some(hash::CHUNK), hash::CHUNK),
            vec![(0, c), (c, 2 * c), (2 * c, 3 * c), (3 * c, 4 * c), (4 * c, end)]
        );
        // Pieces of at least two chunks.
        assert_eq!(cuts(Some(hash::CHUNK), 2 * hash::CHUNK), vec![(0, 2 * c), (2 * c, end)]);
        // Entries of 3 chunks: cuts only at their ends.
        assert_eq!(cuts(Some(3 * hash::CHUNK), hash::CHUNK), vec![(0, 3 * c), (3 * c, end)]);
        // Entries that never end on a chunk boundary: one piece.
        assert_eq!(cuts(Some(100_000), hash::CHUNK), vec![(0, end)]);
        // An untouched tensor (hashed only) is cut freely.
        assert_eq!(cuts(None, 2 * hash::CHUNK).len(), 2);
    }
}
