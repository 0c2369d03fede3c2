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
//! A tensor is the unit of parallelism here: a sparse entry's positions are gaps decoded in
//! order, so one walk per tensor applies them (the chunked weights root of [`crate::hash`]
//! would allow splitting a tensor; the walk would then need a seek into the positions). Chained deltas are exact because, for every element, the changes
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

/// One delta's entries for one tensor, sorted by start.
type Work<'s> = Vec<(&'s DecodedSegment, &'s EntryInfo)>;

/// Applies `chain` (deltas in order, each a list of decoded segments) in place onto `tensors`
/// and, when `hash` is set, returns the per-tensor digests of the result in the order of
/// `metas`, which must list the tensors of `tensors` (e.g. [`CheckpointMut::metas`]).
///
/// [`CheckpointMut::metas`]: crate::CheckpointMut::metas
///
/// `done(t)` is called once tensor `t` (an index into `metas`) is written and hashed, from
/// the worker thread (the agent starts its writeback there).
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
    apply_and_hash_blocks(tensors, metas, chain, hash, done, BLOCK)
}

/// [`apply_and_hash`] with another block size in bytes (tests use tiny blocks so that entries
/// and changes straddle block boundaries).
#[doc(hidden)]
pub fn apply_and_hash_blocks(
    tensors: &TensorsMut<'_>,
    metas: &[TensorMeta],
    chain: &[&[DecodedSegment]],
    hash: bool,
    done: &(dyn Fn(usize) + Sync),
    block: usize,
) -> Result<Option<Vec<Digest>>> {
    let block = block.max(8);
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
    let mut order: Vec<usize> = (0..metas.len()).collect();
    order.sort_unstable_by_key(|&i| std::cmp::Reverse(sizes[i]));
    let out: Vec<(usize, Option<Digest>)> = order
        .par_iter()
        .with_max_len(1)
        .map(|&t| {
            let m = &metas[t];
            let untouched = work[t].iter().all(|l| l.is_empty());
            if untouched && !hash {
                return Ok((t, None));
            }
            let d =
                tensors.with_range_mut(&m.name, 0, sizes[t], |data| one_tensor(m, data, &work[t], hash, block))??;
            if !untouched {
                done(t);
            }
            Ok((t, d))
        })
        .collect::<Result<_>>()?;
    if !hash {
        return Ok(None);
    }
    let mut digests = vec![Digest::default(); metas.len()];
    for (t, d) in out {
        digests[t] = d.expect("hashed");
    }
    Ok(Some(digests))
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

fn one_tensor(m: &TensorMeta, data: &mut [u8], per: &[Work<'_>], hash: bool, block: usize) -> Result<Option<Digest>> {
    let w = m.dtype.size();
    let n = (data.len() / w) as u64;
    let mut h = hash.then(|| hash::TensorHasher::new(&m.name, m.dtype, &m.shape, data.len() as u64));
    let mut cursors: Vec<Cursor> = per.iter().map(|_| Cursor::default()).collect();
    let per_block = if hash { (block / w).max(1) as u64 } else { n.max(1) };
    let mut lo = 0u64;
    while lo < n || (lo == 0 && n == 0) {
        let hi = (lo + per_block).min(n);
        for (list, c) in per.iter().zip(cursors.iter_mut()) {
            advance(list, c, m.dtype, data, lo, hi)?;
        }
        if let Some(h) = &mut h {
            h.update(&data[lo as usize * w..hi as usize * w]);
        }
        if hi == n {
            break;
        }
        lo = hi;
    }
    for (list, c) in per.iter().zip(&cursors) {
        if c.entry != list.len() {
            return Err(bad(format!("entries of tensor {} not fully applied", m.name)));
        }
    }
    Ok(h.map(hash::TensorHasher::finalize))
}

/// Applies the changes of one delta's entries that fall in elements `[lo, hi)`.
fn advance(list: &Work<'_>, c: &mut Cursor, dtype: DType, data: &mut [u8], lo: u64, hi: u64) -> Result<()> {
    let w = dtype.size();
    while let Some(&(seg, e)) = list.get(c.entry) {
        if e.start >= hi {
            return Ok(());
        }
        let end = e.start + e.len;
        let dst = &mut data[e.start as usize * w..end as usize * w];
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
