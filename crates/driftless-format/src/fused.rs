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
//! The bytes are reached through a [`Target`]: buffers in memory changed in place, or a
//! checkpoint's files ([`CheckpointFiles`]), where each block is read with `pread` into a
//! per-piece buffer, changed, hashed and written back with `pwrite` (only when an entry
//! touches it), and each finished piece's writeback is started at once, so that the disk
//! writes while the pass goes on (see [`CheckpointFiles`] for why not a writable map).
//!
//! Safety against hostile deltas is that of [`crate::delta::apply_segment`]: entries name
//! known tensors with their dtype, stay in bounds, and entries of one delta never overlap
//! (checked up front, per tensor, after sorting); positions are checked one by one as they are
//! decoded.

use crate::checkpoint::{CheckpointFiles, TensorsMut};
use crate::delta::{bad, DecodedSegment, EntryInfo, ValueMode, Word};
use crate::{hash, varint, DType, Digest, Result, TensorMeta};
use rayon::prelude::*;

/// Bytes of a tensor applied and hashed at a time (fits the per-core L2 cache with room).
pub const BLOCK: usize = 256 << 10;

/// Smallest piece of a tensor handed to one task (a multiple of the root's chunk).
pub const PIECE: usize = 8 * hash::CHUNK;

/// One delta's entries for one tensor, sorted by start.
type Work<'s> = Vec<(&'s DecodedSegment, &'s EntryInfo)>;

/// Where the pass finds the tensors' bytes.
#[derive(Clone, Copy)]
pub enum Target<'t, 'a> {
    /// Buffers in memory (or a writable map), changed in place.
    Memory(&'t TensorsMut<'a>),
    /// A checkpoint's files, read and written block by block (`pread`/`pwrite`), each
    /// finished piece's writeback started at once. The caller makes the writes durable
    /// ([`CheckpointFiles::sync`]).
    Files(&'t CheckpointFiles),
    /// Read from `from`, written to `to` (a frame made by [`CheckpointFiles::frame_copy`], or
    /// by [`CheckpointFiles::frame_layout`] for a delta that changes the layout): every block
    /// of every tensor of `to` is written, changed or not, so the pass is also the copy. A
    /// tensor of `to` that `from` lacks (or holds with another dtype or byte size) starts as
    /// zeros; one reshaped to the same dtype and byte size starts as the source's bytes. A
    /// delta carries both dense, and the root check proves the result whole either way.
    Copy {
        /// The checkpoint read (the agent's active slot: never written).
        from: &'t CheckpointFiles,
        /// The checkpoint written.
        to: &'t CheckpointFiles,
    },
}

impl Target<'_, '_> {
    fn info(&self, name: &str) -> Option<(DType, usize)> {
        match self {
            Target::Memory(t) => t.info(name),
            Target::Files(f) => f.info(name),
            Target::Copy { to, .. } => to.info(name),
        }
    }
}

/// Applies `chain` (deltas in order, each a list of decoded segments) onto `target` and, when
/// `hash` is set, returns the per-tensor digests of the result in the order of `metas`, which
/// must list the tensors of `target` (e.g. [`CheckpointFiles::metas`]).
///
/// On error some changes may already be written: the caller owns a scratch copy (the agent's
/// inactive slot), never the served one.
pub fn apply_and_hash(
    target: Target<'_, '_>,
    metas: &[TensorMeta],
    chain: &[&[DecodedSegment]],
    hash: bool,
) -> Result<Option<Vec<Digest>>> {
    apply_and_hash_blocks(target, metas, chain, hash, BLOCK, PIECE)
}

/// [`apply_and_hash`] with another block size and smallest piece in bytes (tests use tiny
/// blocks so that entries and changes straddle block boundaries, and one-chunk pieces).
#[doc(hidden)]
pub fn apply_and_hash_blocks(
    target: Target<'_, '_>,
    metas: &[TensorMeta],
    chain: &[&[DecodedSegment]],
    hash: bool,
    block: usize,
    piece: usize,
) -> Result<Option<Vec<Digest>>> {
    let block = block.max(8);
    let piece = piece.div_ceil(hash::CHUNK).max(1) * hash::CHUNK;
    let index: std::collections::HashMap<&str, usize> =
        metas.iter().enumerate().map(|(i, t)| (t.name.as_str(), i)).collect();
    let sizes: Vec<u64> = metas
        .iter()
        .map(|m| match target.info(&m.name) {
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
        if untouched && !hash && !matches!(target, Target::Copy { .. }) {
            continue;
        }
        pieces.extend(split(t, sizes[t] / metas[t].dtype.size() as u64, metas[t].dtype.size(), per, piece));
    }
    pieces.sort_by_key(|p| std::cmp::Reverse((p.hi - p.lo) * metas[p.t].dtype.size() as u64));
    let out: Vec<(usize, u64, Vec<Digest>)> = pieces
        .par_iter()
        .with_max_len(1)
        .map(|p| {
            let m = &metas[p.t];
            let w = m.dtype.size() as u64;
            let lists: Vec<&[(&DecodedSegment, &EntryInfo)]> =
                work[p.t].iter().zip(&p.entries).map(|(l, r)| &l[r.clone()]).collect();
            let (at, len) = (p.lo * w, (p.hi - p.lo) * w);
            let chunks = match target {
                Target::Memory(tm) => tm.with_range_mut(&m.name, at, len, |data| {
                    one_piece(m, &mut InMemory(data), p.lo, p.hi, &lists, hash, block)
                })??,
                Target::Files(files) => {
                    let mut io = InFile::new(Some(files), files, &m.name, at, false);
                    let chunks = one_piece(m, &mut io, p.lo, p.hi, &lists, hash, block)?;
                    if io.wrote {
                        files.start_writeback(&m.name, at, len);
                    }
                    chunks
                }
                Target::Copy { from, to } => {
                    // No source tensor of the same dtype and size: the piece starts as zeros.
                    let from = Some(from).filter(|f| f.info(&m.name) == to.info(&m.name));
                    let mut io = InFile::new(from, to, &m.name, at, true);
                    let chunks = one_piece(m, &mut io, p.lo, p.hi, &lists, hash, block)?;
                    to.start_writeback(&m.name, at, len);
                    chunks
                }
            };
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

/// How [`one_piece`] reaches the bytes of its piece, block by block (offsets in bytes from the
/// piece's start).
trait Blocks {
    /// Whether every block must be stored, changed or not (a copy).
    fn copies(&self) -> bool {
        false
    }
    /// The bytes `[a, b)`, to read and change.
    fn load(&mut self, a: usize, b: usize) -> Result<&mut [u8]>;
    /// Keeps the changes made to the block just loaded.
    fn store(&mut self, a: usize, b: usize) -> Result<()>;
    /// Finishes what `store` left pending; called once the piece is done.
    fn flush(&mut self) -> Result<()> {
        Ok(())
    }
}

/// A piece in memory: blocks are changed in place.
struct InMemory<'d>(&'d mut [u8]);

impl Blocks for InMemory<'_> {
    fn load(&mut self, a: usize, b: usize) -> Result<&mut [u8]> {
        Ok(&mut self.0[a..b])
    }
    fn store(&mut self, _: usize, _: usize) -> Result<()> {
        Ok(())
    }
}

/// Most blocks a piece keeps unwritten while another thread writes the same file (2 MiB at the
/// default block, plus the block being changed and the spares: about 10 blocks per thread at
/// most); with that many kept, the thread waits its turn.
const MAX_DEFERRED: usize = 8;

/// A block's buffer whose bytes start on a cache line. `pread` into a buffer 8 or 16 bytes
/// past one (where glibc puts a large allocation: 16 bytes into its pages) ran 3-4x slower
/// than into an aligned one on this project's AMD EPYC VM (0.49-0.68 against 0.16 s per GiB
/// from a tmpfs, one thread: the kernel's copy to a misaligned destination), and whether a
/// thread's buffer was aligned was chance (glibc's arenas place reused blocks anywhere on a
/// 16-byte grid). `pwrite` from one was not affected.
struct BlockBuf {
    v: Vec<u8>,
    off: usize,
    len: usize,
}

impl BlockBuf {
    const ALIGN: usize = 64;

    fn new() -> Self {
        BlockBuf { v: Vec::new(), off: 0, len: 0 }
    }

    /// Makes it `len` bytes long, reusing its allocation when that is large enough. The bytes
    /// are left as they were (the caller overwrites them).
    fn set_len(&mut self, len: usize) {
        if self.v.len() < self.off + len {
            self.v = vec![0u8; len + Self::ALIGN];
            self.off = self.v.as_ptr().align_offset(Self::ALIGN);
        }
        self.len = len;
    }

    fn bytes(&self) -> &[u8] {
        &self.v[self.off..self.off + self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.v[self.off..self.off + self.len]
    }
}

/// A piece in files, from byte `at` of its tensor: blocks are read from `from` into `buf` and
/// written to `to` (the same files, or a copy's frame).
///
/// A block whose file another thread is writing is kept (`deferred`, its buffer swapped for a
/// spare) and written with the next block that finds the file free, or once
/// [`MAX_DEFERRED`] wait, or at the end of the piece: the kernel serializes writes to one file,
/// and a thread that waited for it spun (a third of a slot rebuild's CPU on 2 cores) where it
/// can hash its next block. Blocks of a piece are its own (pieces never overlap) and are not
/// read again by the pass, so writing them late changes nothing but when.
struct InFile<'f> {
    /// Where blocks are read; `None`: they start as zeros.
    from: Option<&'f CheckpointFiles>,
    to: &'f CheckpointFiles,
    name: &'f str,
    at: u64,
    buf: BlockBuf,
    copy: bool,
    wrote: bool,
    /// Blocks changed and not yet written: (offset in the piece, bytes).
    deferred: Vec<(usize, BlockBuf)>,
    /// Buffers of blocks written since, for reuse.
    spare: Vec<BlockBuf>,
}

impl<'f> InFile<'f> {
    fn new(from: Option<&'f CheckpointFiles>, to: &'f CheckpointFiles, name: &'f str, at: u64, copy: bool) -> Self {
        InFile { from, to, name, at, buf: BlockBuf::new(), copy, wrote: false, deferred: vec![], spare: vec![] }
    }

    /// Writes the deferred blocks, waiting for the file when `wait`.
    fn write_deferred(&mut self, wait: bool) -> Result<()> {
        if self.deferred.is_empty() {
            return Ok(());
        }
        let blocks: Vec<(u64, &[u8])> = self.deferred.iter().map(|(a, b)| (self.at + *a as u64, b.bytes())).collect();
        let done = match wait {
            true => self.to.write_all_at_waiting(self.name, &blocks).map(|()| true)?,
            false => self.to.try_write_all_at(self.name, &blocks)?,
        };
        if done {
            self.spare.extend(self.deferred.drain(..).map(|(_, b)| b));
        }
        Ok(())
    }
}

impl Blocks for InFile<'_> {
    fn copies(&self) -> bool {
        self.copy
    }
    fn load(&mut self, a: usize, b: usize) -> Result<&mut [u8]> {
        self.buf.set_len(b - a);
        match self.from {
            Some(f) => f.read_at(self.name, self.at + a as u64, self.buf.bytes_mut())?,
            None => self.buf.bytes_mut().fill(0),
        }
        Ok(self.buf.bytes_mut())
    }
    fn store(&mut self, a: usize, b: usize) -> Result<()> {
        self.wrote = true;
        // Nothing kept and the file free (the common case): written at once from the one
        // buffer, which stays hot in cache for the next block.
        if self.deferred.is_empty()
            && self.to.try_write_all_at(self.name, &[(self.at + a as u64, &self.buf.bytes()[..b - a])])?
        {
            return Ok(());
        }
        self.buf.set_len(b - a);
        let fresh = self.spare.pop().unwrap_or_else(BlockBuf::new);
        self.deferred.push((a, std::mem::replace(&mut self.buf, fresh)));
        self.write_deferred(self.deferred.len() >= MAX_DEFERRED)
    }
    fn flush(&mut self) -> Result<()> {
        self.write_deferred(true)
    }
}

/// Applies the entries `per` (one sorted list per delta, all inside the piece) to the piece of
/// tensor `m` that starts at element `off`, block by block; returns the chunk digests of the
/// piece when hashing (`off` is on a chunk boundary). A block is stored back only when an
/// entry overlaps it.
fn one_piece(
    m: &TensorMeta,
    io: &mut impl Blocks,
    off: u64,
    end: u64,
    per: &[&[(&DecodedSegment, &EntryInfo)]],
    hash: bool,
    block: usize,
) -> Result<Vec<Digest>> {
    let w = m.dtype.size();
    let mut h = hash.then(|| hash::ChunkHasher::new((end - off) * w as u64));
    let mut cursors: Vec<Cursor> = per.iter().map(|_| Cursor::default()).collect();
    let per_block = (block / w).max(1) as u64;
    let mut lo = off;
    while lo < end {
        let hi = (lo + per_block).min(end);
        // Entries before `lo` are finished: one whose start is below `hi` overlaps the block.
        let touched = per.iter().zip(&cursors).any(|(l, c)| l.get(c.entry).is_some_and(|(_, e)| e.start < hi));
        let store = touched || io.copies();
        if store || hash {
            let (a, b) = ((lo - off) as usize * w, (hi - off) as usize * w);
            let win = io.load(a, b)?;
            if touched {
                for (list, c) in per.iter().zip(cursors.iter_mut()) {
                    advance(list, c, m.dtype, win, lo, hi)?;
                }
            }
            if let Some(h) = &mut h {
                h.update(win);
            }
            if store {
                io.store(a, b)?;
            }
        }
        lo = hi;
    }
    for (list, c) in per.iter().zip(&cursors) {
        if c.entry != list.len() {
            return Err(bad(format!("entries of tensor {} not fully applied", m.name)));
        }
    }
    io.flush()?;
    Ok(h.map(hash::ChunkHasher::finish).unwrap_or_default())
}

/// Applies the changes of one delta's entries that fall in elements `[lo, hi)`; `win` holds
/// exactly those elements.
fn advance(
    list: &[(&DecodedSegment, &EntryInfo)],
    c: &mut Cursor,
    dtype: DType,
    win: &mut [u8],
    lo: u64,
    hi: u64,
) -> Result<()> {
    let w = dtype.size();
    while let Some(&(seg, e)) = list.get(c.entry) {
        if e.start >= hi {
            return Ok(());
        }
        let end = e.start + e.len;
        let (pos, vals) = seg.entry_blocks(e);
        if e.dense {
            // Elements [a, b) of the entry, relative to its start.
            let a = lo.max(e.start) - e.start;
            let b = hi.min(end) - e.start;
            let dst = &mut win[(e.start + a - lo) as usize * w..(e.start + b - lo) as usize * w];
            dense_range(vals, w, e.count as usize, a as usize, b as usize, dst);
        } else {
            match w {
                1 => sparse::<u8>(win, e, pos, vals, seg.mode, c, lo, hi)?,
                2 => sparse::<u16>(win, e, pos, vals, seg.mode, c, lo, hi)?,
                4 => sparse::<u32>(win, e, pos, vals, seg.mode, c, lo, hi)?,
                _ => sparse::<u64>(win, e, pos, vals, seg.mode, c, lo, hi)?,
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
/// planes, into `dst` (exactly those elements).
fn dense_range(planes: &[u8], w: usize, count: usize, a: usize, b: usize, dst: &mut [u8]) {
    for i in a..b {
        for p in 0..w {
            dst[(i - a) * w + p] = planes[p * count + i];
        }
    }
}

/// Applies the changes of a sparse entry at tensor elements `[lo, hi)` into `win` (exactly
/// those elements); checks the entry's trailing bytes once all its changes are applied.
#[inline]
#[allow(clippy::too_many_arguments)]
fn sparse<T: Word>(
    win: &mut [u8],
    e: &EntryInfo,
    pos: &[u8],
    vals: &[u8],
    mode: ValueMode,
    c: &mut Cursor,
    lo: u64,
    hi: u64,
) -> Result<()> {
    let w = T::W;
    let limit = hi - e.start;
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
        // Positions are decoded in order and those below `lo` went to earlier blocks.
        let at = (e.start + idx).checked_sub(lo).ok_or_else(|| bad("position out of order"))? as usize * w;
        let cell = &mut win[at..at + w];
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
    fn block_buffers_start_on_a_cache_line_whatever_their_size() {
        let mut b = BlockBuf::new();
        for len in [1, 4096, BLOCK, 100, BLOCK + 1, 0, 3 * BLOCK] {
            b.set_len(len);
            assert_eq!(b.bytes().len(), len);
            assert_eq!(b.bytes_mut().as_ptr() as usize % BlockBuf::ALIGN, 0, "length {len}");
        }
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
