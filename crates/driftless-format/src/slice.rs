//! Parts of a tensor held by different processes (trainer ranks), and how their digests make
//! the tensor's digest without gathering its bytes: the root-side building block of sharded
//! publishing.
//!
//! A rank holds a hyper-rectangular [`Slice`] of a tensor: per-dimension offsets and lengths
//! (a row block shards dimension 0, a column block dimension 1, and an FSDP flat range is a
//! slice of the tensor viewed as 1-D). In the row-major byte order the weights root hashes,
//! a slice is a list of contiguous byte runs ([`Slice::byte_runs`]): one run for a row block or
//! a flat range, one per row for a column block.
//!
//! For each run the rank computes a [`PartDigest`]: the digests of the 1 MiB chunks (see
//! [`crate::hash`]) wholly inside it; for the (at most two) chunks it only partly covers, the
//! digests of the 8 KiB leaves it holds whole; and the bytes of the (at most two) leaves it
//! only partly covers. [`assemble`] checks that the parts of all ranks cover the tensor
//! exactly once (a gap or an overlap is an error naming the byte offset), stitches partial
//! leaves and chunks and returns the tensor's chunk digests, from which
//! [`crate::hash::finish_tensor`] gives the digest a single process would compute.
//!
//! Cost: a row block or flat range sends under 16 KiB of bytes and 8 KiB of leaf digests per
//! cut; a cut on a leaf boundary (row blocks of tensors whose rows are multiples of 8 KiB)
//! sends no bytes. A column block's runs are rows, usually shorter than a leaf, so most of
//! its bytes travel as partial leaves: column-sharded tensors are hashed at commit from their
//! bytes, which is a gather of those tensors (documented in `docs/sharded.md`).

use crate::hash::{chunk_digest, chunk_of_leaves, leaf_digest, leaf_digests, CHUNK, LEAF};
use crate::{numel, DType, Digest, Error, Result};

/// A hyper-rectangular part of a tensor: `offsets[d] .. offsets[d] + lengths[d]` in every
/// dimension `d` of `shape`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slice {
    /// Global shape of the tensor.
    pub shape: Vec<u64>,
    /// First index held, per dimension.
    pub offsets: Vec<u64>,
    /// Indices held, per dimension.
    pub lengths: Vec<u64>,
}

impl Slice {
    /// Any hyper-rectangle: `offsets[d] .. offsets[d] + lengths[d]` of every dimension of
    /// `shape` (checked).
    pub fn new(shape: &[u64], offsets: &[u64], lengths: &[u64]) -> Result<Self> {
        Slice { shape: shape.to_vec(), offsets: offsets.to_vec(), lengths: lengths.to_vec() }.checked()
    }

    /// A flat range `[start, start + len)` of the tensor viewed as 1-D (FSDP's flat shards).
    pub fn flat(shape: &[u64], start: u64, len: u64) -> Result<Self> {
        let n = numel(shape)?;
        Slice { shape: vec![n], offsets: vec![start], lengths: vec![len] }.checked()
    }

    /// A block along one dimension (`dim` 0: rows, 1: columns), whole in every other.
    pub fn block(shape: &[u64], dim: usize, start: u64, len: u64) -> Result<Self> {
        if dim >= shape.len() {
            return Err(Error::invalid(format!("dimension {dim} of a {}-D tensor", shape.len())));
        }
        let mut offsets = vec![0; shape.len()];
        let mut lengths = shape.to_vec();
        offsets[dim] = start;
        lengths[dim] = len;
        Slice { shape: shape.to_vec(), offsets, lengths }.checked()
    }

    fn checked(self) -> Result<Self> {
        if self.offsets.len() != self.shape.len() || self.lengths.len() != self.shape.len() {
            return Err(Error::invalid("slice offsets and lengths must have one entry per dimension"));
        }
        for (d, ((&o, &l), &s)) in self.offsets.iter().zip(&self.lengths).zip(&self.shape).enumerate() {
            if o.checked_add(l).is_none_or(|e| e > s) {
                return Err(Error::invalid(format!("slice {o}+{l} outside dimension {d} of size {s}")));
            }
        }
        numel(&self.shape)?;
        Ok(self)
    }

    /// Elements held.
    pub fn numel(&self) -> u64 {
        self.lengths.iter().product()
    }

    /// The slice's contiguous runs of the tensor's row-major bytes, as `(byte offset, byte
    /// length)` in ascending order, adjacent runs merged. Elements of `dtype`.
    pub fn byte_runs(&self, dtype: DType) -> Vec<(u64, u64)> {
        let w = dtype.size() as u64;
        if self.numel() == 0 {
            return vec![];
        }
        // The innermost dimensions held whole form one run with the first partial one.
        let nd = self.shape.len();
        let mut inner = 1u64; // elements per run
        let mut k = nd; // dimensions [k, nd) are inside a run
        while k > 0 {
            k -= 1;
            inner *= self.lengths[k];
            if self.lengths[k] != self.shape[k] {
                break;
            }
        }
        // Row-major strides in elements.
        let mut stride = vec![1u64; nd];
        for d in (0..nd.saturating_sub(1)).rev() {
            stride[d] = stride[d + 1] * self.shape[d + 1];
        }
        let base: u64 = (0..nd).map(|d| self.offsets[d] * stride[d]).sum();
        // Every combination of indices in dimensions [0, k).
        let outer: Vec<u64> = self.lengths[..k].to_vec();
        let count: u64 = outer.iter().product();
        let mut runs: Vec<(u64, u64)> = Vec::with_capacity(count.min(1 << 20) as usize);
        let mut idx = vec![0u64; k];
        for _ in 0..count {
            let start = base + (0..k).map(|d| idx[d] * stride[d]).sum::<u64>();
            match runs.last_mut() {
                Some(last) if last.0 + last.1 == start * w => last.1 += inner * w,
                _ => runs.push((start * w, inner * w)),
            }
            for d in (0..k).rev() {
                idx[d] += 1;
                if idx[d] < outer[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        runs
    }
}

/// What the holder of bytes `[start, start + len)` of a tensor of `data_len` bytes contributes
/// to its digest. In byte order: `head` bytes, `head_leaves`, `chunks`, `tail_leaves`, `tail`
/// bytes (see [`split`] for where each ends).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartDigest {
    /// Byte offset of the part in the tensor's data.
    pub start: u64,
    /// Byte length of the part.
    pub len: u64,
    /// The part's bytes before its first whole leaf (all of them if it holds none).
    pub head: Vec<u8>,
    /// Digests of the whole leaves before its first whole chunk (all of them if it holds no
    /// whole chunk).
    pub head_leaves: Vec<Digest>,
    /// Digests of the chunks wholly inside the part, in order.
    pub chunks: Vec<Digest>,
    /// Digests of the whole leaves after its last whole chunk.
    pub tail_leaves: Vec<Digest>,
    /// The part's bytes after its last whole leaf.
    pub tail: Vec<u8>,
}

/// How many bytes, leaves, chunks, leaves and bytes [`part_digest`] makes of a part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    /// Bytes before the first whole leaf.
    pub head: u64,
    /// Whole leaves before the first whole chunk.
    pub head_leaves: u64,
    /// Whole chunks.
    pub chunks: u64,
    /// Whole leaves after the last whole chunk.
    pub tail_leaves: u64,
    /// Bytes after the last whole leaf.
    pub tail: u64,
}

/// Tensor sizes this module computes chunk boundaries for without overflow (any real tensor:
/// 2^62 bytes).
fn check_len(data_len: u64) -> Result<()> {
    if data_len > 1 << 62 {
        return Err(Error::invalid(format!("tensor of {data_len} bytes is too large")));
    }
    Ok(())
}

/// End of the unit (leaf or chunk, `unit` bytes) that starts at or contains `at`.
fn unit_end(at: u64, unit: usize, data_len: u64) -> u64 {
    ((at / unit as u64 + 1) * unit as u64).min(data_len)
}

/// How the part `[start, end)` of a tensor of `data_len` bytes is split. Leaves and chunks
/// count as whole when the part holds all of their bytes (the tensor's last leaf and chunk
/// may be short).
pub fn split(data_len: u64, start: u64, end: u64) -> Split {
    split_points(data_len, start, end).0
}

/// [`split`], with the byte offsets where the head leaves, the chunks, the tail leaves and
/// the tail start.
fn split_points(data_len: u64, start: u64, end: u64) -> (Split, [u64; 4]) {
    let (l, c) = (LEAF as u64, CHUNK as u64);
    // Callers pass parts inside the tensor; anything else is clamped so that every loop below
    // advances (x < end <= data_len makes each leaf end lie past x).
    let end = end.min(data_len);
    let start = start.min(end);
    let mut s = Split { head: 0, head_leaves: 0, chunks: 0, tail_leaves: 0, tail: 0 };
    let first = start.div_ceil(l) * l;
    if first >= end || unit_end(first, LEAF, data_len) > end {
        s.head = end - start;
        return (s, [end; 4]);
    }
    s.head = first - start;
    let mut x = first;
    // Whole leaves up to a chunk boundary (at most 127).
    while x < end && x % c != 0 && unit_end(x, LEAF, data_len) <= end {
        x = unit_end(x, LEAF, data_len);
        s.head_leaves += 1;
    }
    let p2 = x;
    if x % c == 0 && x < end {
        let last = if end == data_len { end } else { end / c * c };
        if last > x {
            s.chunks = (last - x).div_ceil(c);
            x = last;
        }
    }
    let p3 = x;
    // Whole leaves after the last whole chunk (only when the part holds whole chunks or
    // reached a chunk boundary: otherwise the head leaves took them).
    if p2 % c == 0 {
        while x < end && unit_end(x, LEAF, data_len) <= end {
            x = unit_end(x, LEAF, data_len);
            s.tail_leaves += 1;
        }
    }
    s.tail = end - x;
    (s, [first, p2, p3, x])
}

/// The part of a tensor of `data_len` bytes whose bytes `data` start at byte `start` (chunks
/// hashed in parallel).
pub fn part_digest(data_len: u64, start: u64, data: &[u8]) -> Result<PartDigest> {
    use rayon::prelude::*;
    check_len(data_len)?;
    let end = start
        .checked_add(data.len() as u64)
        .filter(|&e| e <= data_len)
        .ok_or_else(|| Error::invalid(format!("part {start}+{} beyond a tensor of {data_len} bytes", data.len())))?;
    let (_, [p1, p2, p3, p4]) = split_points(data_len, start, end);
    let at = |p: u64| (p - start) as usize;
    Ok(PartDigest {
        start,
        len: data.len() as u64,
        head: data[..at(p1)].to_vec(),
        head_leaves: leaf_digests(&data[at(p1)..at(p2)]),
        chunks: data[at(p2)..at(p3)].par_chunks(CHUNK).map(chunk_digest).collect(),
        tail_leaves: leaf_digests(&data[at(p3)..at(p4)]),
        tail: data[at(p4)..].to_vec(),
    })
}

impl PartDigest {
    fn split(&self) -> Split {
        Split {
            head: self.head.len() as u64,
            head_leaves: self.head_leaves.len() as u64,
            chunks: self.chunks.len() as u64,
            tail_leaves: self.tail_leaves.len() as u64,
            tail: self.tail.len() as u64,
        }
    }
}

/// The chunk digests of a tensor of `data_len` bytes from parts that must cover it exactly
/// once (in any order). Parts come from other processes through the bucket: every length is
/// checked, and a gap, an overlap or a part split otherwise than [`part_digest`] splits it
/// is an error.
pub fn assemble(data_len: u64, parts: &[PartDigest]) -> Result<Vec<Digest>> {
    let bad = |d: String| Error::corrupt("tensor parts", d);
    check_len(data_len)?;
    let mut order: Vec<&PartDigest> = parts.iter().collect();
    order.sort_by_key(|p| (p.start, p.len));
    let mut st = Stitch { at: 0, data_len, bytes: vec![], leaves: vec![], out: vec![] };
    for p in order {
        if p.start < st.at {
            return Err(bad(format!("parts overlap at byte {}", p.start)));
        }
        if p.start > st.at {
            return Err(bad(format!("no part holds bytes {}..{}", st.at, p.start)));
        }
        let end = p
            .start
            .checked_add(p.len)
            .filter(|&e| e <= data_len)
            .ok_or_else(|| bad(format!("part {}+{} beyond a tensor of {data_len} bytes", p.start, p.len)))?;
        if split(data_len, p.start, end) != p.split() {
            return Err(bad(format!("part at byte {} is not split at leaf and chunk boundaries", p.start)));
        }
        // The split puts every leaf and chunk digest on its boundary with nothing pending.
        st.bytes_in(&p.head);
        for d in &p.head_leaves {
            st.leaf(*d);
        }
        for d in &p.chunks {
            st.out.push(*d);
            st.at = unit_end(st.at, CHUNK, data_len);
        }
        for d in &p.tail_leaves {
            st.leaf(*d);
        }
        st.bytes_in(&p.tail);
    }
    if st.at != data_len {
        return Err(bad(format!("no part holds bytes {}..{data_len}", st.at)));
    }
    Ok(st.out)
}

/// Leaves and chunks being completed, in byte order.
struct Stitch {
    at: u64,
    data_len: u64,
    /// Bytes of the current leaf.
    bytes: Vec<u8>,
    /// Leaf digests of the current chunk.
    leaves: Vec<Digest>,
    out: Vec<Digest>,
}

impl Stitch {
    /// A whole leaf ends at `at`'s leaf end; the chunk too if that is its end.
    fn leaf(&mut self, d: Digest) {
        self.leaves.push(d);
        self.at = unit_end(self.at, LEAF, self.data_len);
        if self.at == unit_end(self.at - 1, CHUNK, self.data_len) {
            self.out.push(chunk_of_leaves(&self.leaves));
            self.leaves.clear();
        }
    }

    /// Bytes at `at`, completing leaves (and chunks) as they fill.
    fn bytes_in(&mut self, mut b: &[u8]) {
        while !b.is_empty() {
            let need = (unit_end(self.at, LEAF, self.data_len) - self.at) as usize;
            if need == 0 {
                // Past the end: unreachable after the split check, never a loop.
                return;
            }
            let take = need.min(b.len());
            self.bytes.extend_from_slice(&b[..take]);
            b = &b[take..];
            if take == need {
                let d = leaf_digest(&self.bytes);
                self.bytes.clear();
                // `leaf` advances `at` to this leaf's end.
                self.leaf(d);
            } else {
                self.at += take as u64;
            }
        }
    }
}
