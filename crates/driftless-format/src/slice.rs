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
//! [`crate::hash`]) wholly inside it, plus the bytes of the chunks it only partly covers (at
//! most one at each end, so under 2 MiB). [`assemble`] checks that the parts of all ranks
//! cover the tensor exactly once (a gap or an overlap is an error naming the byte offset),
//! stitches the partial chunks and returns the tensor's chunk digests, from which
//! [`crate::hash::finish_tensor`] gives the digest a single process would compute.
//!
//! Cost: a row block or flat range sends under 2 MiB of bytes per tensor per rank. A column
//! block's runs are rows, usually shorter than a chunk, so nearly all its bytes travel as
//! partial chunks: column-sharded tensors are hashed at commit from their bytes, which is a
//! gather of those tensors (documented in `docs/sharded.md`).

use crate::hash::{chunk_digest, CHUNK};
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
/// to its digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartDigest {
    /// Byte offset of the part in the tensor's data.
    pub start: u64,
    /// Byte length of the part.
    pub len: u64,
    /// The part's bytes before its first whole chunk (all of them if it holds none).
    pub head: Vec<u8>,
    /// Digests of the chunks wholly inside the part, in order.
    pub chunks: Vec<Digest>,
    /// The part's bytes after its last whole chunk (empty when it holds none or ends on a
    /// chunk's end).
    pub tail: Vec<u8>,
}

/// Tensor sizes this module computes chunk boundaries for without overflow (any real tensor:
/// 2^62 bytes).
fn check_len(data_len: u64) -> Result<()> {
    if data_len > 1 << 62 {
        return Err(Error::invalid(format!("tensor of {data_len} bytes is too large")));
    }
    Ok(())
}

/// End of the chunk that starts at or contains `at`.
fn chunk_end(at: u64, data_len: u64) -> u64 {
    ((at / CHUNK as u64 + 1) * CHUNK as u64).min(data_len)
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
    let (head, _, tail) = split(data_len, start, end);
    let (head, rest) = data.split_at(head as usize);
    let (whole, tail) = rest.split_at(rest.len() - tail as usize);
    Ok(PartDigest {
        start,
        len: data.len() as u64,
        head: head.to_vec(),
        chunks: whole.par_chunks(CHUNK).map(chunk_digest).collect(),
        tail: tail.to_vec(),
    })
}

/// How [`part_digest`] splits the part `[start, end)` of a tensor of `data_len` bytes:
/// (head bytes, whole chunks, tail bytes). The whole chunks run from the first chunk
/// boundary at or after `start` to the last chunk end at or before `end` (the tensor's last
/// chunk may be short).
fn split(data_len: u64, start: u64, end: u64) -> (u64, u64, u64) {
    let c = CHUNK as u64;
    let first = start.div_ceil(c) * c;
    if first >= end || chunk_end(first, data_len) > end {
        return (end - start, 0, 0);
    }
    let last = if end == data_len { end } else { end / c * c };
    (first - start, (last - first).div_ceil(c), end - last)
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
    let mut out = Vec::new();
    let mut pending: Vec<u8> = vec![];
    let mut at = 0u64;
    for p in order {
        if p.start < at {
            return Err(bad(format!("parts overlap at byte {}", p.start)));
        }
        if p.start > at {
            return Err(bad(format!("no part holds bytes {at}..{}", p.start)));
        }
        let end = p
            .start
            .checked_add(p.len)
            .filter(|&e| e <= data_len)
            .ok_or_else(|| bad(format!("part {}+{} beyond a tensor of {data_len} bytes", p.start, p.len)))?;
        if split(data_len, p.start, end) != (p.head.len() as u64, p.chunks.len() as u64, p.tail.len() as u64) {
            return Err(bad(format!("part at byte {} is not split at chunk boundaries", p.start)));
        }
        feed(&mut pending, &p.head, &mut at, data_len, &mut out);
        // Whole chunks start on a boundary with nothing pending (the split guarantees it).
        for d in &p.chunks {
            out.push(*d);
            at = chunk_end(at, data_len);
        }
        feed(&mut pending, &p.tail, &mut at, data_len, &mut out);
    }
    if at != data_len {
        return Err(bad(format!("no part holds bytes {at}..{data_len}")));
    }
    Ok(out)
}

/// Adds bytes at offset `at`, emitting the digest of each chunk they complete.
fn feed(pending: &mut Vec<u8>, mut bytes: &[u8], at: &mut u64, data_len: u64, out: &mut Vec<Digest>) {
    while !bytes.is_empty() {
        let need = (chunk_end(*at, data_len) - *at) as usize;
        if need == 0 {
            // Past the end: unreachable after the split check, never a loop.
            return;
        }
        let take = need.min(bytes.len());
        pending.extend_from_slice(&bytes[..take]);
        bytes = &bytes[take..];
        *at += take as u64;
        if take == need {
            out.push(chunk_digest(pending));
            pending.clear();
        }
    }
}
