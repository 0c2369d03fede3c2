//! Sparse deltas: diff, encode, decode and apply, bit-exact for every dtype.
//!
//! # Segment format (version 1)
//!
//! A delta is a list of independently decodable *segments*. Each segment holds *entries*; an
//! entry covers one contiguous element range (a *chunk*) of one tensor of the result. Chunks
//! of a tensor never overlap, so segments can be applied in any order and in parallel.
//!
//! ```text
//! segment := "DLS1" u8 version(=1) u8 codec(0 raw, 1 zstd) u8 value_mode(0 overwrite, 1 ulp) u8 0
//!            u32le entry_count
//!            3 x (u64le raw_len, u64le stored_len)      -- headers, positions, values blocks
//!            headers block, positions block, values block  (each zstd-compressed or raw)
//! entry header := varint name_len, name, u8 kind(0 sparse, 1 dense), u8 dtype,
//!                 varint start, varint len, varint count, varint pos_bytes, varint val_bytes
//! ```
//!
//! *Positions* of a sparse entry are the changed element indices relative to `start`, written
//! as gaps (`index - previous_index - 1`, the first gap is the index itself) in LEB128.
//! *Values*:
//! - `overwrite`: the new bit patterns, split into byte planes (all first bytes, then all
//!   second bytes, ...) because the high bytes of neighbouring weights are alike and compress.
//! - `ulp`: zigzag of the wrapping integer difference `new - old` of the bit patterns, in
//!   LEB128. On RL steps ~90% are +-1, i.e. one byte of value 1 or 2, which zstd then squeezes
//!   to a fraction of a byte. Exact and reversible for any bit pattern (NaN, -0.0, subnormal).
//! - dense entries always carry the new bytes in byte planes (overwrite semantics).
//!
//! Positions and values go to separate blocks so each is compressed with statistics of its
//! own; that is most of the gain over interleaved layouts.

use std::collections::HashMap;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::checkpoint::TensorsMut;
use crate::varint;
use crate::{validate_tensor_name, DType, Digest, Error, Result, TensorView};

const MAGIC: &[u8; 4] = b"DLS1";
const FIXED_HEADER: usize = 4 + 4 + 4 + 3 * 16;
/// Hard cap on the decoded size of one segment, whatever a manifest claims.
pub const MAX_SEGMENT_RAW: u64 = 1 << 31;
/// Most entries accepted in one segment.
pub const MAX_ENTRIES: u32 = 1 << 20;

/// Most header bytes an encoder writes for one entry of a tensor whose name has `name_len`
/// bytes: the name's length (a varint), the name, kind and dtype, and five varints of at most
/// 10 bytes each (start, len, count, position bytes, value bytes).
pub fn max_entry_header(name_len: usize) -> u64 {
    let mut v = Vec::with_capacity(10);
    varint::put(&mut v, name_len as u64);
    (v.len() + name_len + 2 + 5 * 10) as u64
}

/// Most decoded bytes (the sum of the segments' `raw_size`) an encoder writes for a delta whose
/// result is `layout`, in segments of `entries` entries together.
///
/// The positions and values of an entry never take more than the dense bytes of its element
/// range (an encoder stores a chunk dense once its sparse form would be as large), and the
/// entries of a delta cover disjoint element ranges of the result's tensors (each at least one
/// element, so there are at most as many entries as elements): together at most the layout's
/// bytes. Each entry adds its header, at most [`max_entry_header`] of the longest name. This
/// holds for any [`DeltaOptions`] (a chunk of one element, every element changed) and for the
/// runs of sharded ranks, which cover each tensor once.
pub fn max_delta_raw(layout: &crate::Layout, entries: u64) -> u64 {
    let (mut bytes, mut elements, mut longest) = (0u64, 0u64, 0usize);
    for t in layout.tensors() {
        // Manifest layouts are validated (each tensor at most 2^46 bytes); saturating all the same.
        bytes = bytes.saturating_add(t.nbytes().unwrap_or(u64::MAX));
        elements = elements.saturating_add(t.numel().unwrap_or(u64::MAX));
        longest = longest.max(t.name.len());
    }
    bytes.saturating_add(entries.min(elements).saturating_mul(max_entry_header(longest)))
}

/// Heap a reader holds for one decoded entry besides its raw bytes: the entry's record and its
/// name's allocation (with the allocator's smallest block).
pub fn entry_heap(name_len: usize) -> u64 {
    (std::mem::size_of::<EntryInfo>() + name_len.max(16) + 16) as u64
}

/// Most heap a reader may hold for the decoded segments of one delta whose result is
/// `layout`: a quarter more than the result's bytes, plus 64 MiB. A delta is decoded whole
/// before it is applied, and each entry costs [`entry_heap`] besides its raw bytes, so a
/// manifest whose `raw_size`s and `entries` add up to more is refused (found by review: a
/// signed delta of millions of one-element entries, within [`max_delta_raw`], decoded to
/// about ten times its raw bytes and had agents killed for memory at every start).
///
/// An encoder stays far below it: a delta's raw bytes are at most the result's bytes plus the
/// entries' headers, and the default chunk of 8 MiB gives about one entry per 8 MiB of tensor
/// (a few hundred for a 7B model). Only [`DeltaOptions::chunk_bytes`] of a few hundred bytes
/// or less on a large model would reach it (a library setting for tests; no tool exposes it),
/// or a sharded step whose ranks hold tensors split along a later dimension into runs of
/// fewer than a few hundred elements (one entry per run). The sharded committer checks its
/// manifest as readers do ([`crate::manifest::DeltaManifest::validate`]) and commits such a
/// step as an anchor instead, or has the next step be one.
pub fn max_delta_heap(layout: &crate::Layout) -> u64 {
    let bytes = layout.tensors().fold(0u64, |a, t| a.saturating_add(t.nbytes().unwrap_or(u64::MAX)));
    bytes.saturating_add(bytes / 4).saturating_add(64 << 20)
}

/// How changed values are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ValueMode {
    /// New bit patterns verbatim; idempotent.
    Overwrite,
    /// Zigzag integer difference of bit patterns; needs the exact base. The default: it halves
    /// the payload on RL data (see the README's numbers).
    #[default]
    Ulp,
}

impl std::str::FromStr for ValueMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "overwrite" => Ok(ValueMode::Overwrite),
            "ulp" => Ok(ValueMode::Ulp),
            _ => Err(Error::invalid(format!("value mode must be overwrite or ulp, not {s:?}"))),
        }
    }
}

/// Payload compression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "name", rename_all = "lowercase")]
pub enum Codec {
    /// Stored as is.
    Raw,
    /// zstd at the given level.
    Zstd {
        /// zstd level (1 = fast default).
        level: i32,
    },
}

/// `ulp` / `overwrite`, as on the command line and in manifests.
impl std::fmt::Display for ValueMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ValueMode::Overwrite => "overwrite",
            ValueMode::Ulp => "ulp",
        })
    }
}

/// `raw` / `zstd-LEVEL`.
impl std::fmt::Display for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Codec::Raw => f.write_str("raw"),
            Codec::Zstd { level } => write!(f, "zstd-{level}"),
        }
    }
}

impl Default for Codec {
    fn default() -> Self {
        Codec::Zstd { level: 1 }
    }
}

/// Options of [`encode_delta`].
#[derive(Debug, Clone, Copy)]
pub struct DeltaOptions {
    /// Value encoding.
    pub values: ValueMode,
    /// Compression.
    pub codec: Codec,
    /// Target size of one segment (bytes before compression, so compressed segments are at
    /// most this). Default 32 MiB. Large deltas are cut smaller, into about
    /// [`SPLIT_SEGMENTS`] segments of at least [`MIN_SPLIT_SEGMENT`] each, so that readers
    /// decode them on several cores.
    pub segment_target: usize,
    /// Tensor bytes scanned per chunk (the unit of parallelism and of segment packing).
    /// Default 8 MiB.
    pub chunk_bytes: usize,
}

impl Default for DeltaOptions {
    fn default() -> Self {
        DeltaOptions { values: ValueMode::Ulp, codec: Codec::default(), segment_target: 32 << 20, chunk_bytes: 8 << 20 }
    }
}

/// What an encode found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeltaStats {
    /// Elements in the result.
    pub elements: u64,
    /// Bytes of tensor data in the result (the dense size).
    pub dense_bytes: u64,
    /// Elements whose bit pattern changed (dense entries count fully).
    pub changed: u64,
    /// Tensors (or chunks of tensors) stored dense.
    pub dense_chunks: u64,
    /// Tensors carried dense because they were added, reshaped or retyped.
    pub new_tensors: u64,
    /// Tensors of the base that the result no longer has.
    pub removed_tensors: u64,
    /// Bytes of all segments as stored.
    pub payload_bytes: u64,
}

/// One encoded segment ready to upload.
#[derive(Debug, Clone)]
pub struct EncodedSegment {
    /// The stored bytes.
    pub bytes: Vec<u8>,
    /// Sum of the decoded block sizes (the decompression bound the manifest records).
    pub raw_size: u64,
    /// SHA-256 of `bytes`.
    pub sha256: Digest,
    /// Number of entries.
    pub entries: u32,
}

/// Result of [`encode_delta`].
#[derive(Debug, Clone)]
pub struct EncodedDelta {
    /// Segments in order.
    pub segments: Vec<EncodedSegment>,
    /// Statistics.
    pub stats: DeltaStats,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Sparse = 0,
    Dense = 1,
}

/// An encoded entry before packing.
struct Entry {
    /// Shared by the entries of a tensor's chunks (one allocation per tensor, not per chunk).
    name: std::sync::Arc<str>,
    kind: Kind,
    dtype: DType,
    start: u64,
    len: u64,
    count: u64,
    positions: Vec<u8>,
    values: Vec<u8>,
}

// ---------------------------------------------------------------------------------------------
// Element words: the per-width integer arithmetic.

pub(crate) trait Word: Copy + Eq + Send + Sync + 'static {
    const W: usize;
    fn load(b: &[u8]) -> Self;
    fn store(self, b: &mut [u8]);
    fn zz_diff(new: Self, old: Self) -> u64;
    fn add_zz(old: Self, zz: u64) -> Option<Self>;
    /// The inverse of [`Word::add_zz`]: `sub_zz(add_zz(old, zz), zz) == old` (wrapping).
    fn sub_zz(new: Self, zz: u64) -> Option<Self>;
}

/// The difference a zigzag-coded `zz` stands for, as a `$u` (wrapping), or `None` when it is
/// wider than the type.
macro_rules! un_zz {
    ($u:ty, $zz:expr) => {{
        let zz: u64 = $zz;
        (zz <= <$u>::MAX as u64).then(|| ((zz >> 1) as $u) ^ (((zz & 1) as $u).wrapping_neg()))
    }};
}

macro_rules! word {
    ($u:ty, $i:ty, $w:expr) => {
        impl Word for $u {
            const W: usize = $w;
            #[inline(always)]
            fn load(b: &[u8]) -> Self {
                <$u>::from_le_bytes(b[..$w].try_into().unwrap())
            }
            #[inline(always)]
            fn store(self, b: &mut [u8]) {
                b[..$w].copy_from_slice(&self.to_le_bytes())
            }
            #[inline(always)]
            fn zz_diff(new: Self, old: Self) -> u64 {
                let d = new.wrapping_sub(old) as $i;
                ((d << 1) ^ (d >> ($w * 8 - 1))) as $u as u64
            }
            #[inline(always)]
            fn add_zz(old: Self, zz: u64) -> Option<Self> {
                un_zz!($u, zz).map(|d| old.wrapping_add(d))
            }
            #[inline(always)]
            fn sub_zz(new: Self, zz: u64) -> Option<Self> {
                un_zz!($u, zz).map(|d| new.wrapping_sub(d))
            }
        }
    };
}
word!(u8, i8, 1);
word!(u16, i16, 2);
word!(u32, i32, 4);
word!(u64, i64, 8);

/// Splits `data` (elements of `w` bytes) into byte planes appended to `out`.
pub(crate) fn to_planes(data: &[u8], w: usize, out: &mut Vec<u8>) {
    if w == 1 {
        out.extend_from_slice(data);
        return;
    }
    let n = data.len() / w;
    let base = out.len();
    out.resize(base + data.len(), 0);
    let dst = &mut out[base..];
    for (p, plane) in dst.chunks_exact_mut(n.max(1)).enumerate().take(w) {
        for (i, b) in plane.iter_mut().enumerate() {
            *b = data[i * w + p];
        }
    }
}

/// Inverse of [`to_planes`]: writes elements of `w` bytes from planes into `dst`.
pub(crate) fn from_planes(planes: &[u8], w: usize, dst: &mut [u8]) {
    from_planes_at(planes, w, 0, dst)
}

/// [`from_planes`] of elements `[first, first + dst.len() / w)` of the `planes.len() / w`
/// elements the planes hold: a piece of them interleaved at a time (a streaming reader's
/// pieces stay in cache while they are written and hashed).
pub(crate) fn from_planes_at(planes: &[u8], w: usize, first: usize, dst: &mut [u8]) {
    let m = dst.len() / w;
    if m == 0 {
        return;
    }
    if w == 1 {
        dst.copy_from_slice(&planes[first..first + m]);
        return;
    }
    let n = planes.len() / w;
    let plane = |p: usize| &planes[p * n + first..p * n + first + m];
    if w == 2 {
        for ((d, &l), &h) in dst.chunks_exact_mut(2).zip(plane(0)).zip(plane(1)) {
            d[0] = l;
            d[1] = h;
        }
        return;
    }
    for p in 0..w {
        for (i, &b) in plane(p).iter().enumerate() {
            dst[i * w + p] = b;
        }
    }
}

/// Scans one chunk for changed elements. Returns `None` when the sparse form would be larger
/// than the dense one (the caller then stores the chunk dense).
///
/// The scan works on blocks of 32 elements: the block is XORed as u64 words (vectorized),
/// unchanged blocks are skipped after that one pass, and in changed blocks only the lanes of
/// nonzero words are visited.
///
/// With a writable base ([`Base`] for `&mut [u8]`) the base is made equal to `new` in the same
/// pass: each changed 8-byte word is copied as it is found, and a chunk that goes dense is
/// copied whole. The unchanged words (~99% on RL steps) are only read.
fn diff_chunk<T: Word, B: Base>(mut old: B, new: &[u8], mode: ValueMode) -> Option<(u64, Vec<u8>, Vec<u8>)> {
    let w = T::W;
    let dense = new.len();
    let mut pos = Vec::new();
    let mut vals = Vec::new();
    let mut count = 0u64;
    let mut last: i64 = -1;
    const LANES: usize = 32;
    let block = LANES * w;
    let n_elems = new.len() / w;
    let mut emit = |idx: usize, a: T, b: T, pos: &mut Vec<u8>, vals: &mut Vec<u8>| {
        varint::put(pos, (idx as i64 - last - 1) as u64);
        last = idx as i64;
        count += 1;
        match mode {
            ValueMode::Ulp => varint::put(vals, T::zz_diff(b, a)),
            ValueMode::Overwrite => {
                let mut buf = [0u8; 8];
                b.store(&mut buf);
                vals.extend_from_slice(&buf[..w]);
            }
        }
    };
    let full = n_elems / LANES;
    for blk in 0..full {
        let at0 = blk * block;
        let nw = &new[at0..at0 + block];
        // XOR the block as u64 words and OR them together: one vectorizable pass decides that
        // most blocks are unchanged.
        let mut any = 0u64;
        for (a, b) in old.bytes()[at0..at0 + block].chunks_exact(8).zip(nw.chunks_exact(8)) {
            any |= u64::from_le_bytes(a.try_into().expect("8")) ^ u64::from_le_bytes(b.try_into().expect("8"));
        }
        if any == 0 {
            continue;
        }
        // One bit per changed element of the block, without a branch per word or lane: the
        // changes of RL steps are scattered, so such branches mispredict.
        let mut changed = 0u32;
        for (k, (a, b)) in old.bytes()[at0..at0 + block].chunks_exact(8).zip(nw.chunks_exact(8)).enumerate() {
            let x = u64::from_le_bytes(a.try_into().expect("8")) ^ u64::from_le_bytes(b.try_into().expect("8"));
            changed |= lane_bits(x, w) << (k * (8 / w));
        }
        while changed != 0 {
            let i = changed.trailing_zeros() as usize;
            changed &= changed - 1;
            emit(blk * LANES + i, T::load(&old.bytes()[at0 + i * w..]), T::load(&nw[i * w..]), &mut pos, &mut vals);
        }
        // The block's cache line is dirtied by any change: copying it whole costs no more.
        old.put(at0, nw);
        if pos.len() + vals.len() >= dense {
            old.put(0, new);
            return None;
        }
    }
    for idx in full * LANES..n_elems {
        let (a, b) = (T::load(&old.bytes()[idx * w..]), T::load(&new[idx * w..]));
        if a != b {
            emit(idx, a, b, &mut pos, &mut vals);
            old.put(idx * w, &new[idx * w..(idx + 1) * w]);
        }
    }
    if pos.len() + vals.len() >= dense && dense > 0 {
        old.put(0, new);
        return None;
    }
    if mode == ValueMode::Overwrite && w > 1 {
        let mut planes = Vec::with_capacity(vals.len());
        to_planes(&vals, w, &mut planes);
        vals = planes;
    }
    Some((count, pos, vals))
}

fn diff_dispatch<B: Base>(dtype: DType, old: B, new: &[u8], mode: ValueMode) -> Option<(u64, Vec<u8>, Vec<u8>)> {
    match dtype.size() {
        1 => diff_chunk::<u8, B>(old, new, mode),
        2 => diff_chunk::<u16, B>(old, new, mode),
        4 => diff_chunk::<u32, B>(old, new, mode),
        _ => diff_chunk::<u64, B>(old, new, mode),
    }
}

/// One bit per nonzero `w`-byte lane of `x` (lane 0 is bit 0), without branches: each lane's
/// high bit is set if the lane is nonzero (the add cannot carry across lanes, the lane's own
/// high bit being masked off first), then the high bits are gathered by a multiply.
#[inline(always)]
fn lane_bits(x: u64, w: usize) -> u32 {
    match w {
        1 => {
            let hi = 0x8080_8080_8080_8080u64;
            let hb = (((x & !hi) + !hi) | x) & hi;
            ((hb >> 7).wrapping_mul(0x0102_0408_1020_4080) >> 56) as u32
        }
        2 => {
            let hi = 0x8000_8000_8000_8000u64;
            let hb = (((x & !hi) + !hi) | x) & hi;
            (((hb >> 15).wrapping_mul((1 << 48) | (1 << 33) | (1 << 18) | (1 << 3)) >> 48) & 0xf) as u32
        }
        4 => {
            let hi = 0x8000_0000_8000_0000u64;
            let hb = (((x & !hi) + !hi) | x) & hi;
            (((hb >> 31) | (hb >> 62)) & 3) as u32
        }
        _ => u32::from(x != 0),
    }
}

/// The base bytes a diff reads: read-only (`encode_delta`), or writable and brought up to the
/// target as the diff goes (`diff_update`). One scan loop serves both.
trait Base {
    fn bytes(&self) -> &[u8];
    /// Copies `src` to `at` (a no-op for a read-only base).
    fn put(&mut self, at: usize, src: &[u8]);
    /// Splits into consecutive pieces of `per` bytes (the last one shorter).
    fn chunks(self, per: usize) -> Vec<Self>
    where
        Self: Sized;
}

impl Base for &[u8] {
    #[inline(always)]
    fn bytes(&self) -> &[u8] {
        self
    }
    #[inline(always)]
    fn put(&mut self, _: usize, _: &[u8]) {}
    fn chunks(self, per: usize) -> Vec<Self> {
        <[u8]>::chunks(self, per).collect()
    }
}

impl Base for &mut [u8] {
    #[inline(always)]
    fn bytes(&self) -> &[u8] {
        self
    }
    #[inline(always)]
    fn put(&mut self, at: usize, src: &[u8]) {
        self[at..at + src.len()].copy_from_slice(src);
    }
    fn chunks(self, per: usize) -> Vec<Self> {
        self.chunks_mut(per).collect()
    }
}

/// Diffs `base` against `target` and encodes the delta that turns the first into the second.
///
/// Tensors are matched by name. A tensor new in `target`, or whose dtype or shape differs
/// from `base`, is carried dense; tensors only in `base` are dropped (the manifest's result
/// layout says which tensors exist). Work is spread over the rayon pool chunk by chunk.
pub fn encode_delta(base: &[TensorView<'_>], target: &[TensorView<'_>], opts: &DeltaOptions) -> Result<EncodedDelta> {
    let base_by_name: HashMap<&str, &TensorView<'_>> = base.iter().map(|t| (t.name, t)).collect();
    let target_names: std::collections::HashSet<&str> = target.iter().map(|t| t.name).collect();
    if target_names.len() != target.len() {
        return Err(Error::invalid("target has duplicate tensor names"));
    }
    let mut stats = DeltaStats {
        removed_tensors: base.iter().filter(|t| !target_names.contains(t.name)).count() as u64,
        ..Default::default()
    };
    let runs: Vec<Run<'_>> = target
        .iter()
        .map(|t| {
            stats.elements += (t.data.len() / t.dtype.size()) as u64;
            stats.dense_bytes += t.data.len() as u64;
            let b = base_by_name.get(t.name).filter(|b| b.dtype == t.dtype && b.shape == t.shape);
            if b.is_none() {
                stats.new_tensors += 1;
            }
            Run { name: t.name, dtype: t.dtype, at: 0, base: b.map(|b| b.data), target: t.data }
        })
        .collect();
    encode(&runs, opts, stats)
}

/// A contiguous run of one tensor's elements to diff: its bytes in the target, the bytes of
/// the same elements in the base (`None`: no compatible base, carried dense), and the element
/// offset `at` of the run in the tensor. A trainer rank encodes the runs of its slice (see
/// [`crate::slice::Slice::byte_runs`]) so that positions are in the tensor's coordinates and
/// the parts of all ranks form one delta.
#[derive(Debug, Clone, Copy)]
pub struct Run<'a> {
    /// Tensor name.
    pub name: &'a str,
    /// Element type.
    pub dtype: DType,
    /// Element offset of the run in the tensor.
    pub at: u64,
    /// Base bytes of the run (as long as `target`), if the base tensor is compatible.
    pub base: Option<&'a [u8]>,
    /// Target bytes of the run.
    pub target: &'a [u8],
}

/// Encodes the delta of some runs of tensors (one rank's part of a step). Runs of one tensor
/// must not overlap; `stats.removed_tensors` and `new_tensors` stay 0 (they describe whole
/// tensors, which a part does not see).
pub fn encode_runs(runs: &[Run<'_>], opts: &DeltaOptions) -> Result<EncodedDelta> {
    let mut stats = DeltaStats::default();
    for r in runs {
        validate_tensor_name(r.name)?;
        if r.target.len() % r.dtype.size() != 0 || r.base.is_some_and(|b| b.len() != r.target.len()) {
            return Err(Error::invalid(format!("run of {} at {}: base and target lengths differ", r.name, r.at)));
        }
        stats.elements += (r.target.len() / r.dtype.size()) as u64;
        stats.dense_bytes += r.target.len() as u64;
    }
    encode(runs, opts, stats)
}

fn encode(runs: &[Run<'_>], opts: &DeltaOptions, stats: DeltaStats) -> Result<EncodedDelta> {
    // Work items: (run, its name, start element in the run, element count).
    let mut work = Vec::new();
    for r in runs {
        let name: std::sync::Arc<str> = r.name.into();
        let w = r.dtype.size();
        let n = (r.target.len() / w) as u64;
        let per = (opts.chunk_bytes / w).max(1) as u64;
        let mut s = 0;
        while s < n {
            let l = per.min(n - s);
            work.push((r, name.clone(), s, l));
            s += l;
        }
    }
    let mode = opts.values;
    let entries: Vec<Entry> = work
        .into_par_iter()
        .map(|(t, name, s, l)| {
            let r = (s as usize * t.dtype.size())..((s + l) as usize * t.dtype.size());
            let new = &t.target[r.clone()];
            let sparse = t.base.and_then(|b| diff_dispatch(t.dtype, &b[r], new, mode));
            chunk_entry(name, t.dtype, t.at + s, l, new, sparse)
        })
        .collect();
    DeltaDiff { entries, stats, opts: *opts }.encode()
}

/// The entry of one scanned chunk: sparse when the scan found it worth it, else dense.
fn chunk_entry(
    name: std::sync::Arc<str>,
    dtype: DType,
    start: u64,
    len: u64,
    new: &[u8],
    sparse: Option<(u64, Vec<u8>, Vec<u8>)>,
) -> Entry {
    match sparse {
        Some((count, positions, values)) => {
            Entry { name, kind: Kind::Sparse, dtype, start, len, count, positions, values }
        }
        None => {
            let mut values = Vec::with_capacity(new.len());
            to_planes(new, dtype.size(), &mut values);
            Entry { name, kind: Kind::Dense, dtype, start, len, count: len, positions: vec![], values }
        }
    }
}

/// The changes of a step found by [`diff_update`], not yet packed into segments: owned, so
/// the packing and compression can run on another thread after the caller's tensors have
/// moved on.
pub struct DeltaDiff {
    entries: Vec<Entry>,
    stats: DeltaStats,
    opts: DeltaOptions,
}

impl std::fmt::Debug for DeltaDiff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeltaDiff").field("entries", &self.entries.len()).field("stats", &self.stats()).finish()
    }
}

impl DeltaDiff {
    /// What the diff found (`payload_bytes` is 0 until [`DeltaDiff::encode`]).
    pub fn stats(&self) -> DeltaStats {
        let mut st = self.stats.clone();
        for e in &self.entries {
            st.changed += e.count;
            st.dense_chunks += u64::from(e.kind == Kind::Dense);
        }
        st
    }

    /// Applies the changes to `tensors` (the base they were taken against, named as in the
    /// target). Each entry goes through the one decoder agents use ([`decode_segment`] and
    /// [`apply_segment`] of an uncompressed segment holding it), so what is applied here is
    /// what readers of the encoded delta apply; entries are applied in parallel, so at most
    /// one entry's segment per thread is held at a time.
    pub fn apply(&self, tensors: &TensorsMut<'_>) -> Result<()> {
        let mode = self.opts.values;
        self.entries.par_iter().filter(|e| e.count > 0).try_for_each(|e| {
            let seg = write_segment(&[e], mode, Codec::Raw)?;
            let decoded = decode_segment(&seg.bytes, seg.raw_size)?;
            apply_segment(&decoded, tensors)
        })
    }

    /// Packs the entries into segments and compresses them (in parallel).
    pub fn encode(self) -> Result<EncodedDelta> {
        let mut stats = self.stats();
        // Pack entries into segments; unchanged sparse chunks carry no entry at all.
        let size = |e: &Entry| e.positions.len() + e.values.len() + e.name.len() + 32;
        let live = || self.entries.iter().filter(|e| e.count > 0);
        let target = split_target(live().map(size).sum(), self.opts.segment_target);
        let mut groups: Vec<Vec<&Entry>> = vec![];
        let mut cur = 0usize;
        for e in live() {
            let size = size(e);
            if groups.is_empty() || (cur > 0 && cur + size > target) {
                groups.push(vec![]);
                cur = 0;
            }
            groups.last_mut().expect("pushed").push(e);
            cur += size;
        }
        let (mode, codec) = (self.opts.values, self.opts.codec);
        let segments: Vec<EncodedSegment> =
            groups.par_iter().map(|g| write_segment(g, mode, codec)).collect::<Result<_>>()?;
        stats.payload_bytes = segments.iter().map(|s| s.bytes.len() as u64).sum();
        Ok(EncodedDelta { segments, stats })
    }
}

/// About how many segments a delta is cut into, when each keeps [`MIN_SPLIT_SEGMENT`]: a
/// segment is the unit a reader downloads, checks and decodes in parallel before its pass over
/// the model can start. Not a bound: entries (one per chunk scanned) are never split, so
/// uneven entries can give up to about twice as many (and the sharded publisher cuts each
/// rank's part on its own). One segment (what a 1 GiB model's 1% delta was under the 32 MiB
/// target) left that stage on one core: on a 16-core host it was 40 ms of a 140 ms fast path
/// whose pass took 90 ms (`speed_bench`, 2026-11-27). More segments cost a GET each.
pub const SPLIT_SEGMENTS: usize = 16;

/// The smallest segment (bytes before compression) a delta is split into for parallel decoding.
pub const MIN_SPLIT_SEGMENT: usize = 1 << 20;

/// The segment size [`DeltaDiff::encode`] packs `total` bytes of entries into: `target`, or
/// less so that there are about [`SPLIT_SEGMENTS`] segments of at least [`MIN_SPLIT_SEGMENT`].
fn split_target(total: usize, target: usize) -> usize {
    target.min(total.div_ceil(SPLIT_SEGMENTS).max(MIN_SPLIT_SEGMENT))
}

/// Diffs `target` against `base` and makes `base` equal to `target` in the same pass.
///
/// `base[i]` is the previous bytes of `target[i]` (same order, same length): a publisher's
/// snapshot of the last published step. Each chunk is read once from both sides; only
/// changed words are written, so the pass costs about one read of the two models, less than
/// a copy. The result encodes to exactly what [`encode_delta`] gives for the same inputs.
/// Everything is checked before the first byte is written: on an error `base` is unchanged.
pub fn diff_update(base: &mut [&mut [u8]], target: &[TensorView<'_>], opts: &DeltaOptions) -> Result<DeltaDiff> {
    let bases: Vec<&mut [u8]> = base.iter_mut().map(|b| &mut **b).collect();
    diff_with(bases, target, opts)
}

/// [`diff_update`] without writing `base`: the changes that turn `base` into `target`, for a
/// caller that must keep `base` as it is until later (a publisher holding a coalesced step
/// as its changes against the snapshot, then [`DeltaDiff::apply`] when it is published).
pub fn diff(base: &[&[u8]], target: &[TensorView<'_>], opts: &DeltaOptions) -> Result<DeltaDiff> {
    diff_with(base.to_vec(), target, opts)
}

fn diff_with<B: Base + Send>(base: Vec<B>, target: &[TensorView<'_>], opts: &DeltaOptions) -> Result<DeltaDiff> {
    if base.len() != target.len() {
        return Err(Error::invalid(format!(
            "diff_update: {} base tensors for {} target tensors",
            base.len(),
            target.len()
        )));
    }
    let mut stats = DeltaStats::default();
    let mut names = std::collections::HashSet::new();
    for (b, t) in base.iter().zip(target) {
        validate_tensor_name(t.name)?;
        if !names.insert(t.name) {
            return Err(Error::invalid("target has duplicate tensor names"));
        }
        if b.bytes().len() != t.data.len() || t.data.len() % t.dtype.size() != 0 {
            return Err(Error::invalid(format!(
                "diff_update: {} has {} base bytes for {}",
                t.name,
                b.bytes().len(),
                t.data.len()
            )));
        }
        stats.elements += (t.data.len() / t.dtype.size()) as u64;
        stats.dense_bytes += t.data.len() as u64;
    }
    let mut work = Vec::new();
    for (b, t) in base.into_iter().zip(target) {
        let name: std::sync::Arc<str> = t.name.into();
        let w = t.dtype.size();
        let per = (opts.chunk_bytes / w).max(1) * w;
        for (i, (old, new)) in b.chunks(per).into_iter().zip(t.data.chunks(per)).enumerate() {
            work.push((name.clone(), t.dtype, (i * per / w) as u64, old, new));
        }
    }
    let mode = opts.values;
    let entries: Vec<Entry> = work
        .into_par_iter()
        .map(|(name, dtype, start, old, new)| {
            let sparse = diff_dispatch(dtype, old, new, mode);
            chunk_entry(name, dtype, start, (new.len() / dtype.size()) as u64, new, sparse)
        })
        .collect();
    Ok(DeltaDiff { entries, stats, opts: *opts })
}

fn write_segment(entries: &[&Entry], mode: ValueMode, codec: Codec) -> Result<EncodedSegment> {
    let mut headers = Vec::new();
    let mut pos_len = 0;
    let mut val_len = 0;
    for e in entries {
        varint::put(&mut headers, e.name.len() as u64);
        headers.extend_from_slice(e.name.as_bytes());
        headers.push(e.kind as u8);
        headers.push(e.dtype.code());
        for v in [e.start, e.len, e.count, e.positions.len() as u64, e.values.len() as u64] {
            varint::put(&mut headers, v);
        }
        pos_len += e.positions.len();
        val_len += e.values.len();
    }
    let mut positions = Vec::with_capacity(pos_len);
    let mut values = Vec::with_capacity(val_len);
    for e in entries {
        positions.extend_from_slice(&e.positions);
        values.extend_from_slice(&e.values);
    }
    let blocks = [headers, positions, values];
    let stored: Vec<std::borrow::Cow<'_, [u8]>> = blocks
        .iter()
        .map(|b| match codec {
            Codec::Raw => Ok(std::borrow::Cow::Borrowed(&b[..])),
            Codec::Zstd { level } => zstd::bulk::compress(b, level)
                .map(std::borrow::Cow::Owned)
                .map_err(|e| Error::invalid(format!("zstd: {e}"))),
        })
        .collect::<Result<_>>()?;
    let mut out = Vec::with_capacity(FIXED_HEADER + stored.iter().map(|s| s.len()).sum::<usize>());
    out.extend_from_slice(MAGIC);
    out.push(1);
    out.push(match codec {
        Codec::Raw => 0,
        Codec::Zstd { .. } => 1,
    });
    out.push(match mode {
        ValueMode::Overwrite => 0,
        ValueMode::Ulp => 1,
    });
    out.push(0);
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for (b, s) in blocks.iter().zip(&stored) {
        out.extend_from_slice(&(b.len() as u64).to_le_bytes());
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    }
    for s in &stored {
        out.extend_from_slice(s);
    }
    let raw_size = blocks.iter().map(|b| b.len() as u64).sum();
    Ok(EncodedSegment { sha256: Digest::of(&out), bytes: out, raw_size, entries: entries.len() as u32 })
}

// ---------------------------------------------------------------------------------------------
// Decode.

/// Header of one decoded entry; byte ranges index the segment's blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryInfo {
    /// Tensor name.
    pub name: String,
    /// True for a dense entry (all elements of the range carried).
    pub dense: bool,
    /// Element type.
    pub dtype: DType,
    /// First element of the range.
    pub start: u64,
    /// Elements in the range.
    pub len: u64,
    /// Changed elements carried.
    pub count: u64,
    pos: std::ops::Range<usize>,
    val: std::ops::Range<usize>,
}

/// A decompressed, structurally validated segment.
#[derive(Debug, Clone)]
pub struct DecodedSegment {
    /// Value mode of the segment.
    pub mode: ValueMode,
    /// Entries in order.
    pub entries: Vec<EntryInfo>,
    positions: Vec<u8>,
    values: Vec<u8>,
}

impl DecodedSegment {
    /// Heap bytes this segment holds: its position and value blocks and its entries (names
    /// included). At least its `raw_size` minus the header, and more where a segment has many
    /// small entries (each [`EntryInfo`] is larger than its encoded header).
    pub fn heap_bytes(&self) -> u64 {
        let entries = self.entries.capacity() * std::mem::size_of::<EntryInfo>()
            + self.entries.iter().map(|e| e.name.capacity()).sum::<usize>();
        (self.positions.capacity() + self.values.capacity() + entries) as u64
    }

    /// Position and value bytes of entry `e` (an entry of this segment).
    pub(crate) fn entry_blocks(&self, e: &EntryInfo) -> (&[u8], &[u8]) {
        (&self.positions[e.pos.clone()], &self.values[e.val.clone()])
    }

    /// Element indices (counted from the tensor's first element) that entry `i` writes: the
    /// whole range of a dense entry, the changed elements of a sparse one. For callers that
    /// scatter new values into tensors of their own (the Python binding's `iter_patches`).
    pub fn entry_indices(&self, i: usize) -> Result<Vec<u64>> {
        let e = self.entries.get(i).ok_or_else(|| bad("entry index out of range"))?;
        if e.dense {
            return Ok((e.start..e.start + e.len).collect());
        }
        let pos = &self.positions[e.pos.clone()];
        // Reserved by the position bytes (one at least per position), never by the count alone.
        let mut out = Vec::with_capacity((e.count as usize).min(pos.len()));
        each_position(pos, e.len, e.count, |i| {
            out.push(e.start + i as u64);
            Ok(())
        })?;
        Ok(out)
    }
}

pub(crate) fn bad(d: impl Into<String>) -> Error {
    Error::corrupt("segment", d)
}

fn decompress_block(stored: &[u8], raw_len: u64, zstd: bool) -> Result<Vec<u8>> {
    if !zstd {
        if stored.len() as u64 != raw_len {
            return Err(bad("raw block length mismatch"));
        }
        return Ok(stored.to_vec());
    }
    // A frame that declares another size is refused before its buffer is reserved.
    if let Ok(Some(n)) = zstd::zstd_safe::get_frame_content_size(stored) {
        if n != raw_len {
            return Err(bad(format!("zstd frame declares {n} bytes, header says {raw_len}")));
        }
    }
    let mut out = Vec::with_capacity(raw_len as usize);
    // Bounded: zstd never writes past the capacity we give it.
    let mut d = zstd::bulk::Decompressor::new().map_err(|e| bad(format!("zstd init: {e}")))?;
    d.decompress_to_buffer(stored, &mut out).map_err(|e| bad(format!("zstd: {e}")))?;
    if out.len() as u64 != raw_len {
        return Err(bad(format!("block decoded to {} bytes, header says {raw_len}", out.len())));
    }
    Ok(out)
}

/// The largest segment object an encoder writes for `raw_size` decoded bytes: the fixed
/// header plus its three blocks, each stored raw or as one zstd frame, which is never more
/// than zstd's `ZSTD_COMPRESSBOUND` (`n + n/256 + 64` at most). Readers refuse a manifest
/// declaring more (found by review: a segment object's size was bounded only by the marker,
/// up to 2^50, and is downloaded into memory whole).
pub fn max_segment_object(raw_size: u64) -> u64 {
    (FIXED_HEADER as u64).saturating_add(raw_size).saturating_add(raw_size / 256).saturating_add(3 * 64 + 3 * 64)
}

/// Decodes a segment, never allocating more than `max_raw` bytes (the manifest's `raw_size`,
/// itself capped at [`MAX_SEGMENT_RAW`]). Every length and offset is checked; no entry points
/// outside the blocks.
pub fn decode_segment(bytes: &[u8], max_raw: u64) -> Result<DecodedSegment> {
    decode_checked(bytes, max_raw, None)
}

/// Decodes the segment a manifest names: [`decode_segment`] bounded by its `raw_size`, and
/// refused before anything is decompressed unless it holds exactly the `entries` the manifest
/// declares (the manifest's bound on a delta's decoded memory, [`max_delta_heap`], counts
/// them: found by review, a segment of many tiny entries decoded to ten times its raw bytes).
pub fn decode_segment_of(bytes: &[u8], r: &crate::manifest::SegmentRef) -> Result<DecodedSegment> {
    decode_checked(bytes, r.raw_size, Some(r.entries))
}

fn decode_checked(bytes: &[u8], max_raw: u64, entries: Option<u32>) -> Result<DecodedSegment> {
    let max_raw = max_raw.min(MAX_SEGMENT_RAW);
    if bytes.len() < FIXED_HEADER || &bytes[..4] != MAGIC {
        return Err(bad("bad magic or too short"));
    }
    if bytes[4] != 1 {
        return Err(bad(format!("unsupported segment version {}", bytes[4])));
    }
    let zstd = match bytes[5] {
        0 => false,
        1 => true,
        c => return Err(bad(format!("unknown codec {c}"))),
    };
    let mode = match bytes[6] {
        0 => ValueMode::Overwrite,
        1 => ValueMode::Ulp,
        m => return Err(bad(format!("unknown value mode {m}"))),
    };
    // Reserved, written 0: a segment that sets it was made by a writer this reader does not know.
    if bytes[7] != 0 {
        return Err(bad(format!("reserved header byte is {}, not 0", bytes[7])));
    }
    let n_entries = u32::from_le_bytes(bytes[8..12].try_into().expect("4"));
    if n_entries > MAX_ENTRIES {
        return Err(bad(format!("{n_entries} entries")));
    }
    if let Some(want) = entries.filter(|&w| w != n_entries) {
        return Err(bad(format!("{n_entries} entries, the manifest declares {want}")));
    }
    let mut lens = [(0u64, 0u64); 3];
    let mut total_raw = 0u64;
    let mut total_stored = 0u64;
    for (i, l) in lens.iter_mut().enumerate() {
        let o = 12 + i * 16;
        l.0 = u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8"));
        l.1 = u64::from_le_bytes(bytes[o + 8..o + 16].try_into().expect("8"));
        total_raw = total_raw.checked_add(l.0).ok_or_else(|| bad("size overflow"))?;
        total_stored = total_stored.checked_add(l.1).ok_or_else(|| bad("size overflow"))?;
    }
    if total_raw > max_raw {
        return Err(bad(format!("decoded size {total_raw} exceeds the bound {max_raw}")));
    }
    // Headers hold the entries' headers and nothing else.
    if lens[0].0 > u64::from(n_entries) * max_entry_header(crate::tensor::MAX_NAME_LEN) {
        return Err(bad(format!("{} header bytes for {n_entries} entries", lens[0].0)));
    }
    if total_stored != (bytes.len() - FIXED_HEADER) as u64 {
        return Err(bad("block sizes do not add up to the segment size"));
    }
    let mut off = FIXED_HEADER;
    let mut blocks = Vec::with_capacity(3);
    for (raw, stored) in lens {
        let s = &bytes[off..off + stored as usize];
        off += stored as usize;
        blocks.push(decompress_block(s, raw, zstd)?);
    }
    let values = blocks.pop().expect("3");
    let positions = blocks.pop().expect("3");
    let headers = blocks.pop().expect("3");
    // Each entry takes at least 4 header bytes (name length, a name byte, kind, dtype): the
    // declared count reserves no more than the headers can hold.
    let mut entries = Vec::with_capacity((n_entries as usize).min(headers.len() / 4));
    let mut hp = 0usize;
    let (mut pp, mut vp) = (0usize, 0usize);
    for _ in 0..n_entries {
        let nl = varint::get(&headers, &mut hp)?;
        if nl == 0 || nl > crate::tensor::MAX_NAME_LEN as u64 || hp as u64 + nl > headers.len() as u64 {
            return Err(bad("bad name length"));
        }
        let name = std::str::from_utf8(&headers[hp..hp + nl as usize]).map_err(|_| bad("name is not UTF-8"))?;
        hp += nl as usize;
        let (kind, dcode) = match headers.get(hp..hp + 2) {
            Some(b) => (b[0], b[1]),
            None => return Err(bad("truncated entry header")),
        };
        hp += 2;
        let dtype = DType::from_code(dcode)?;
        let mut f = [0u64; 5];
        for v in f.iter_mut() {
            *v = varint::get(&headers, &mut hp)?;
        }
        let [start, len, count, pb, vb] = f;
        let w = dtype.size() as u64;
        let ok_range = start.checked_add(len).is_some_and(|e| e.checked_mul(w).is_some());
        if !ok_range || count > len || count == 0 {
            return Err(bad(format!("entry {name}: bad range or count")));
        }
        let dense = match kind {
            0 => false,
            1 => true,
            k => return Err(bad(format!("unknown entry kind {k}"))),
        };
        // Value bytes the entry must have, by kind and mode.
        let want_vals = if dense || mode == ValueMode::Overwrite { Some(count * w) } else { None };
        if dense && (count != len || pb != 0) {
            return Err(bad(format!("dense entry {name} is inconsistent")));
        }
        // Each position of a sparse entry is a varint gap, and each `ulp` value a varint, at
        // least one byte each: a count those bytes cannot hold is refused here, before anyone
        // sizes a buffer by it.
        if !dense && (count > pb || count > vb) {
            return Err(bad(format!("entry {name}: {count} elements in {pb} position and {vb} value bytes")));
        }
        if let Some(v) = want_vals {
            if vb != v {
                return Err(bad(format!("entry {name}: {vb} value bytes, expected {v}")));
            }
        }
        let pe = (pp as u64)
            .checked_add(pb)
            .filter(|&e| e <= positions.len() as u64)
            .ok_or_else(|| bad("positions overrun"))?;
        let ve =
            (vp as u64).checked_add(vb).filter(|&e| e <= values.len() as u64).ok_or_else(|| bad("values overrun"))?;
        entries.push(EntryInfo {
            name: name.to_string(),
            dense,
            dtype,
            start,
            len,
            count,
            pos: pp..pe as usize,
            val: vp..ve as usize,
        });
        pp = pe as usize;
        vp = ve as usize;
    }
    if hp != headers.len() || pp != positions.len() || vp != values.len() {
        return Err(bad("trailing bytes in a block"));
    }
    Ok(DecodedSegment { mode, entries, positions, values })
}

// ---------------------------------------------------------------------------------------------
// Apply.

fn apply_sparse<T: Word>(dst: &mut [u8], len: u64, count: u64, pos: &[u8], vals: &[u8], mode: ValueMode) -> Result<()> {
    let w = T::W;
    let mut pp = 0usize;
    let mut vp = 0usize;
    let mut next = 0u64;
    let n_planes = if mode == ValueMode::Overwrite { count as usize } else { 0 };
    for i in 0..count as usize {
        let gap = varint::get(pos, &mut pp)?;
        let idx = next.checked_add(gap).filter(|&x| x < len).ok_or_else(|| bad("position out of range"))?;
        next = idx + 1;
        let at = idx as usize * w;
        let cell = &mut dst[at..at + w];
        match mode {
            ValueMode::Ulp => {
                let zz = varint::get(vals, &mut vp)?;
                let v = T::add_zz(T::load(cell), zz).ok_or_else(|| bad("ulp difference wider than the dtype"))?;
                v.store(cell);
            }
            ValueMode::Overwrite => {
                for (p, c) in cell.iter_mut().enumerate() {
                    *c = vals[p * n_planes + i];
                }
            }
        }
    }
    if pp != pos.len() || (mode == ValueMode::Ulp && vp != vals.len()) {
        return Err(bad("entry has trailing position or value bytes"));
    }
    Ok(())
}

/// Applies one entry to `dst`, the bytes of its element range.
fn apply_entry(seg: &DecodedSegment, e: &EntryInfo, dst: &mut [u8]) -> Result<()> {
    let pos = &seg.positions[e.pos.clone()];
    let vals = &seg.values[e.val.clone()];
    if e.dense {
        from_planes(vals, e.dtype.size(), dst);
        return Ok(());
    }
    match e.dtype.size() {
        1 => apply_sparse::<u8>(dst, e.len, e.count, pos, vals, seg.mode),
        2 => apply_sparse::<u16>(dst, e.len, e.count, pos, vals, seg.mode),
        4 => apply_sparse::<u32>(dst, e.len, e.count, pos, vals, seg.mode),
        _ => apply_sparse::<u64>(dst, e.len, e.count, pos, vals, seg.mode),
    }
}

fn entry_bytes(e: &EntryInfo, tensors: &TensorsMut<'_>) -> Result<(u64, u64)> {
    let (dtype, _) = tensors.info(&e.name).ok_or_else(|| bad(format!("entry for unknown tensor {}", e.name)))?;
    if dtype != e.dtype {
        return Err(bad(format!("entry for {} has dtype {}, tensor is {}", e.name, e.dtype, dtype)));
    }
    let w = dtype.size() as u64;
    Ok((e.start * w, e.len * w))
}

/// Applies a decoded segment onto writable tensors. Each entry's element range is claimed
/// first, so two entries (in this or any other segment of the same pass) writing the same
/// bytes are refused. On error some entries may already be applied; for `ulp` segments use
/// [`to_redo`] and a [`crate::Journal`] to make that recoverable.
pub fn apply_segment(seg: &DecodedSegment, tensors: &TensorsMut<'_>) -> Result<()> {
    // Entries cover disjoint ranges (enforced by the claims), so they apply in parallel: a
    // delta of a large model at 1% density is often a single segment.
    seg.entries.par_iter().with_min_len(4).try_for_each(|e| {
        let (start, len) = entry_bytes(e, tensors)?;
        tensors.with_range_mut(&e.name, start, len, |dst| apply_entry(seg, e, dst))?
    })
}

/// The redo record of a segment: the same changes in `overwrite` form (new values computed
/// from the current, not yet modified base), encoded raw. Applying it is idempotent, so it can
/// be replayed after a crash in the middle of applying the segment.
pub fn to_redo(seg: &DecodedSegment, tensors: &TensorsMut<'_>) -> Result<Vec<u8>> {
    let owned: Vec<Entry> = seg.entries.par_iter().map(|e| redo_entry(seg, e, tensors)).collect::<Result<_>>()?;
    let refs: Vec<&Entry> = owned.iter().collect();
    Ok(write_segment(&refs, ValueMode::Overwrite, Codec::Raw)?.bytes)
}

fn redo_entry<'s>(seg: &'s DecodedSegment, e: &'s EntryInfo, tensors: &TensorsMut<'_>) -> Result<Entry> {
    let (start, len) = entry_bytes(e, tensors)?;
    // Claimed while read: an overlapping segment applied meanwhile fails instead of racing.
    tensors.with_range(&e.name, start, len, |base| redo_entry_of(seg, e, base))?
}

fn redo_entry_of<'s>(seg: &'s DecodedSegment, e: &'s EntryInfo, base: &[u8]) -> Result<Entry> {
    {
        let w = e.dtype.size();
        let (positions, values) = if e.dense || seg.mode == ValueMode::Overwrite {
            (seg.positions[e.pos.clone()].to_vec(), seg.values[e.val.clone()].to_vec())
        } else {
            // Apply to a scratch copy of the changed cells only.
            let pos = &seg.positions[e.pos.clone()];
            let vals = &seg.values[e.val.clone()];
            let mut new_vals = Vec::with_capacity((e.count as usize).min(vals.len()) * w);
            let (mut pp, mut vp, mut next) = (0usize, 0usize, 0u64);
            let mut cell = [0u8; 8];
            for _ in 0..e.count {
                let gap = varint::get(pos, &mut pp)?;
                let idx = next.checked_add(gap).filter(|&x| x < e.len).ok_or_else(|| bad("position out of range"))?;
                next = idx + 1;
                let zz = varint::get(vals, &mut vp)?;
                let at = idx as usize * w;
                cell[..w].copy_from_slice(&base[at..at + w]);
                let ok = match w {
                    1 => u8::add_zz(u8::load(&cell), zz).map(|v| v.store(&mut cell)),
                    2 => u16::add_zz(u16::load(&cell), zz).map(|v| v.store(&mut cell)),
                    4 => u32::add_zz(u32::load(&cell), zz).map(|v| v.store(&mut cell)),
                    _ => u64::add_zz(u64::load(&cell), zz).map(|v| v.store(&mut cell)),
                };
                ok.ok_or_else(|| bad("ulp difference wider than the dtype"))?;
                new_vals.extend_from_slice(&cell[..w]);
            }
            if pp != pos.len() || vp != vals.len() {
                return Err(bad("entry has trailing position or value bytes"));
            }
            let mut planes = Vec::with_capacity(new_vals.len());
            to_planes(&new_vals, w, &mut planes);
            (pos.to_vec(), planes)
        };
        Ok(Entry {
            name: e.name.as_str().into(),
            kind: if e.dense { Kind::Dense } else { Kind::Sparse },
            dtype: e.dtype,
            start: e.start,
            len: e.len,
            count: e.count,
            positions,
            values,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Undo.

/// What takes one applied segment back out ([`undo_segment`]): the bytes its dense entries and,
/// in overwrite mode, its sparse entries write over, saved by [`save_overwritten`] before the
/// segment is applied. An ulp sparse entry (nearly all of an RL delta) needs nothing saved: its
/// differences are subtracted again, exactly (wrapping integer arithmetic on bit patterns).
#[derive(Debug, Default)]
pub struct Overwritten(Vec<Option<Vec<u8>>>);

/// Whether undoing entry `e` needs its old bytes saved.
fn saves(seg: &DecodedSegment, e: &EntryInfo) -> bool {
    e.dense || seg.mode == ValueMode::Overwrite
}

/// Bytes [`save_overwritten`] holds for `seg`, its records included (a slot per entry, and an
/// allocation per entry it saves): known before anything is read, so a caller can keep undo
/// records within a budget (found by review: only the saved values were counted, so 200,000
/// one-element entries held 4.8 MB of slots against 0 budgeted).
pub fn overwritten_bytes(seg: &DecodedSegment) -> u64 {
    // What an allocator keeps per block beyond its bytes (glibc: a 16-byte header, blocks of
    // 32 bytes at least): a bound, not a measurement.
    const PER_ALLOC: u64 = 32;
    let slots = (seg.entries.len() as u64).saturating_mul(std::mem::size_of::<Option<Vec<u8>>>() as u64);
    let w = |e: &EntryInfo| e.dtype.size() as u64;
    seg.entries
        .iter()
        .filter(|e| saves(seg, e))
        .map(|e| if e.dense { e.len } else { e.count }.saturating_mul(w(e)).saturating_add(PER_ALLOC))
        .fold(slots, u64::saturating_add)
}

/// Calls `f(element index)` for each position of a sparse entry, checked as the apply checks
/// them (in range, no trailing bytes).
fn each_position(pos: &[u8], len: u64, count: u64, mut f: impl FnMut(usize) -> Result<()>) -> Result<()> {
    let (mut pp, mut next) = (0usize, 0u64);
    for _ in 0..count {
        let gap = varint::get(pos, &mut pp)?;
        let idx = next.checked_add(gap).filter(|&x| x < len).ok_or_else(|| bad("position out of range"))?;
        next = idx + 1;
        f(idx as usize)?;
    }
    if pp != pos.len() {
        return Err(bad("entry has trailing position bytes"));
    }
    Ok(())
}

/// Saves what [`undo_segment`] needs to take `seg` back out of `tensors`: call it before the
/// segment is applied (it reads the cells the segment is about to write).
pub fn save_overwritten(seg: &DecodedSegment, tensors: &TensorsMut<'_>) -> Result<Overwritten> {
    let saved = seg
        .entries
        .par_iter()
        .with_min_len(4)
        .map(|e| {
            if !saves(seg, e) {
                return Ok(None);
            }
            let (start, len) = entry_bytes(e, tensors)?;
            let w = e.dtype.size();
            tensors
                .with_range(&e.name, start, len, |base| {
                    if e.dense {
                        return Ok(base.to_vec());
                    }
                    let mut old = Vec::with_capacity((e.count as usize).saturating_mul(w).min(base.len()));
                    each_position(&seg.positions[e.pos.clone()], e.len, e.count, |i| {
                        old.extend_from_slice(&base[i * w..(i + 1) * w]);
                        Ok(())
                    })?;
                    Ok(old)
                })?
                .map(Some)
        })
        .collect::<Result<_>>()?;
    Ok(Overwritten(saved))
}

fn unapply_sparse<T: Word>(dst: &mut [u8], e: &EntryInfo, pos: &[u8], vals: &[u8]) -> Result<()> {
    let w = T::W;
    let mut vp = 0usize;
    each_position(pos, e.len, e.count, |i| {
        let zz = varint::get(vals, &mut vp)?;
        let cell = &mut dst[i * w..(i + 1) * w];
        T::sub_zz(T::load(cell), zz).ok_or_else(|| bad("ulp difference wider than the dtype"))?.store(cell);
        Ok(())
    })?;
    if vp != vals.len() {
        return Err(bad("entry has trailing value bytes"));
    }
    Ok(())
}

/// Takes a fully applied segment back out of `tensors`, given what [`save_overwritten`] saved
/// just before it was applied: the cells it wrote hold their old bit patterns again. Segments
/// of several deltas are undone in the reverse order of their deltas. (A segment whose apply
/// failed part way is not undoable this way: its ulp entries may be partly applied.)
pub fn undo_segment(seg: &DecodedSegment, saved: &Overwritten, tensors: &TensorsMut<'_>) -> Result<()> {
    if saved.0.len() != seg.entries.len() {
        return Err(Error::invalid("undo record does not belong to this segment"));
    }
    seg.entries.par_iter().zip(saved.0.par_iter()).with_min_len(4).try_for_each(|(e, old)| {
        let (start, len) = entry_bytes(e, tensors)?;
        let w = e.dtype.size();
        tensors.with_range_mut(&e.name, start, len, |dst| match old {
            Some(old) if e.dense && old.len() == dst.len() => {
                dst.copy_from_slice(old);
                Ok(())
            }
            Some(old) if !e.dense && old.len() as u64 == e.count.saturating_mul(w as u64) => {
                let mut k = 0;
                each_position(&seg.positions[e.pos.clone()], e.len, e.count, |i| {
                    dst[i * w..(i + 1) * w].copy_from_slice(&old[k..k + w]);
                    k += w;
                    Ok(())
                })
            }
            None if !saves(seg, e) => {
                let (pos, vals) = (&seg.positions[e.pos.clone()], &seg.values[e.val.clone()]);
                match w {
                    1 => unapply_sparse::<u8>(dst, e, pos, vals),
                    2 => unapply_sparse::<u16>(dst, e, pos, vals),
                    4 => unapply_sparse::<u32>(dst, e, pos, vals),
                    _ => unapply_sparse::<u64>(dst, e, pos, vals),
                }
            }
            _ => Err(Error::invalid(format!("undo record of {} does not belong to this segment", e.name))),
        })?
    })
}

/// Decodes and applies all segments in parallel (the offline path: `driftless patch`, tests).
/// `segments` are `(bytes, raw_size bound)`.
pub fn apply_all(segments: &[(&[u8], u64)], tensors: &TensorsMut<'_>) -> Result<()> {
    let raws: Vec<u64> = segments.iter().map(|(_, r)| *r).collect();
    for_each_decoded_bounded(&raws, |i| {
        let (b, raw) = segments[i];
        let seg = decode_segment(b, raw)?;
        apply_segment(&seg, tensors)
    })
}

/// Decoded bytes that parallel segment decodes may hold at once, by their declared raw
/// bounds. Real segments are packed to 32 MiB, so this never serializes them; a hostile
/// delta whose segments each declare up to [`MAX_SEGMENT_RAW`] (2 GiB) of zstd bomb is
/// decoded one such segment at a time instead of one per core (found by review: `driftless
/// patch` could peak at threads x 2 GiB).
pub const DECODE_BUDGET: u64 = 1 << 30;

/// Runs `f(i)` for every segment index, in parallel within consecutive groups whose declared
/// raw sizes (`raws[i]`, each capped at [`MAX_SEGMENT_RAW`] as the decoder caps it) sum to at
/// most [`DECODE_BUDGET`] (a larger segment is a group of its own), one group after another.
pub fn for_each_decoded_bounded(raws: &[u64], f: impl Fn(usize) -> Result<()> + Sync) -> Result<()> {
    let mut start = 0;
    while start < raws.len() {
        let mut end = start;
        let mut sum = 0u64;
        while end < raws.len() {
            let r = raws[end].min(MAX_SEGMENT_RAW);
            if end > start && sum + r > DECODE_BUDGET {
                break;
            }
            sum += r;
            end += 1;
        }
        (start..end).into_par_iter().try_for_each(&f)?;
        start = end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::lane_bits;

    /// Large deltas are cut into up to 16 segments of at least 1 MiB, never above the target;
    /// small targets (tests, callers that ask) are kept.
    #[test]
    fn large_deltas_are_split_for_parallel_decoding() {
        use super::{split_target, MIN_SPLIT_SEGMENT, SPLIT_SEGMENTS};
        let t = 32 << 20;
        assert_eq!(split_target(20 << 20, t), (20 << 20) / SPLIT_SEGMENTS);
        assert_eq!(split_target(4 << 20, t), MIN_SPLIT_SEGMENT);
        assert_eq!(split_target(1 << 30, t), t);
        assert_eq!(split_target(0, t), MIN_SPLIT_SEGMENT);
        assert_eq!(split_target(1 << 30, 64), 64);
        // Through the encoder: 64 BF16 tensors of 512 KiB with every element changed (32 MiB
        // of entries) are cut into 16 segments, not the one the target alone gives.
        let base = vec![0u8; 512 << 10];
        let target: Vec<u8> = (0..512u32 << 10).map(|i| (i % 251) as u8 | 1).collect();
        let shape = [256u64 << 10];
        let names: Vec<String> = (0..64).map(|i| format!("w{i:02}")).collect();
        fn view<'a>(n: &'a str, shape: &'a [u64], d: &'a [u8]) -> crate::TensorView<'a> {
            crate::TensorView::new(n, crate::DType::BF16, shape, d).unwrap()
        }
        let b: Vec<_> = names.iter().map(|n| view(n, &shape, &base)).collect();
        let n: Vec<_> = names.iter().map(|n| view(n, &shape, &target)).collect();
        let opts = super::DeltaOptions { codec: super::Codec::Raw, ..Default::default() };
        let enc = super::encode_delta(&b, &n, &opts).unwrap();
        assert!((SPLIT_SEGMENTS..=SPLIT_SEGMENTS + 1).contains(&enc.segments.len()), "{}", enc.segments.len());
    }

    /// The undo budget counts the records, not only the saved values: a delta of many tiny
    /// ulp entries saves no value but holds a slot per entry.
    #[test]
    fn undo_records_are_counted_per_entry() {
        let shape = [4u64];
        let names: Vec<String> = (0..1000).map(|i| format!("t{i:04}")).collect();
        let (base, target) = (vec![0u8; 8], vec![1u8, 0, 0, 0, 0, 0, 0, 0]);
        let b: Vec<_> =
            names.iter().map(|n| crate::TensorView::new(n, crate::DType::BF16, &shape, &base).unwrap()).collect();
        let n: Vec<_> =
            names.iter().map(|n| crate::TensorView::new(n, crate::DType::BF16, &shape, &target).unwrap()).collect();
        let opts = super::DeltaOptions { codec: super::Codec::Raw, ..Default::default() };
        let enc = super::encode_delta(&b, &n, &opts).unwrap();
        let segs: Vec<_> = enc.segments.iter().map(|s| super::decode_segment(&s.bytes, s.raw_size).unwrap()).collect();
        let entries: usize = segs.iter().map(|s| s.entries.len()).sum();
        assert_eq!(entries, 1000, "one entry per changed tensor");
        let charged: u64 = segs.iter().map(super::overwritten_bytes).sum();
        assert!(charged >= 1000 * std::mem::size_of::<Option<Vec<u8>>>() as u64, "{charged} bytes charged");
    }

    /// Groups hold at most the budget of declared raw bytes (a larger segment alone), cover
    /// every index once, in order.
    #[test]
    fn decodes_are_grouped_within_the_budget() {
        use super::{for_each_decoded_bounded, DECODE_BUDGET, MAX_SEGMENT_RAW};
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::Mutex;
        let raws = [MAX_SEGMENT_RAW, u64::MAX, 32 << 20, 32 << 20, DECODE_BUDGET, 1, 0, DECODE_BUDGET / 2];
        let live = AtomicU64::new(0);
        let peak = AtomicU64::new(0);
        let seen = Mutex::new(vec![]);
        for_each_decoded_bounded(&raws, |i| {
            let r = raws[i].min(MAX_SEGMENT_RAW);
            let now = live.fetch_add(r, Ordering::SeqCst) + r;
            peak.fetch_max(now, Ordering::SeqCst);
            std::thread::sleep(std::time::Duration::from_millis(20));
            live.fetch_sub(r, Ordering::SeqCst);
            seen.lock().unwrap().push(i);
            Ok(())
        })
        .unwrap();
        assert!(peak.load(Ordering::SeqCst) <= MAX_SEGMENT_RAW, "peak {}", peak.load(Ordering::SeqCst));
        let mut seen = seen.into_inner().unwrap();
        seen.sort();
        assert_eq!(seen, (0..raws.len()).collect::<Vec<_>>());
        // Small segments still run together: one group, so all of them at once on 2+ threads.
        let small = [1u64 << 20; 64];
        let live = AtomicU64::new(0);
        let peak = AtomicU64::new(0);
        for_each_decoded_bounded(&small, |_| {
            let now = live.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(now, Ordering::SeqCst);
            std::thread::sleep(std::time::Duration::from_millis(5));
            live.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        })
        .unwrap();
        assert!(rayon::current_num_threads() < 2 || peak.load(Ordering::SeqCst) >= 2, "small segments serialized");
    }

    /// The branchless lane mask against a lane-by-lane loop, for every width, on words with
    /// lanes that are zero, one, only the high bit, and everything set.
    #[test]
    fn lane_bits_matches_lane_by_lane() {
        let mut x = 0x243f_6a88_85a3_08d3u64;
        let mut words = vec![0u64, 1, u64::MAX, 1 << 63, 0x8000_0000_0000_0000 | 1, 0x0100_0000_0080_0000];
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Sparse words: keep a random subset of bytes.
            words.push(x & (x >> 3).rotate_left(17) & 0xff00_00ff_0000_ff00u64.rotate_left((x % 64) as u32));
            words.push(x);
        }
        for &w in &[1usize, 2, 4, 8] {
            for &v in &words {
                let mut want = 0u32;
                for l in 0..8 / w {
                    let lane = if w == 8 { v } else { (v >> (l * w * 8)) & ((1u64 << (w * 8)) - 1) };
                    want |= u32::from(lane != 0) << l;
                }
                assert_eq!(lane_bits(v, w), want, "w {w} x {v:#018x}");
            }
        }
    }
}
