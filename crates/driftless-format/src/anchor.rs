//! Anchors: full checkpoints, stored either as plain safetensors files or in the compressed
//! byte-plane form defined here, which decodes to the identical safetensors bytes.
//!
//! ```text
//! shard  := "DLA1" u8 version(=1) u8 0 u8 0 u8 0
//!           u64le decoded_size  u64le header_len  u64le header_stored_len
//!           zstd(header bytes)
//!           for each chunk, its w zstd-compressed byte planes
//!           table: chunk_count x ( u64le offset  u64le len  u8 width  w x u64le plane_stored_len )
//!           footer: u64le table_offset  u32le chunk_count  "DLAE"
//! ```
//! The header is the file's first `header_len` bytes (length prefix + JSON). Chunks cover the
//! data section exactly, in order; a chunk never spans two tensors, so its width is the
//! tensor's element size. Splitting bytes into planes separates the well-compressible sign and
//! exponent bytes of floats from the noisy mantissa bytes. The table sits at the end so the
//! encoder streams: it compresses a few chunks at a time in parallel and writes them out, so
//! an anchor of any size is encoded in bounded memory (a few chunks per thread).

use rayon::prelude::*;

use crate::checkpoint::parse_safetensors_header;
use crate::delta::{from_planes_at, to_planes};
use crate::{Error, Result};

const MAGIC: &[u8; 4] = b"DLA1";
const FOOTER: &[u8; 4] = b"DLAE";
const CHUNK: usize = 16 << 20;
/// Longest header a shard may declare: a safetensors header (its 8-byte length and JSON).
const MAX_HEADER_LEN: u64 = 8 + crate::checkpoint::MAX_HEADER as u64;
/// Largest decoded shard accepted.
pub const MAX_SHARD: u64 = 1 << 40;

fn bad(d: impl Into<String>) -> Error {
    Error::corrupt("anchor shard", d)
}

/// Compresses a safetensors file's bytes into the byte-plane form, in memory.
pub fn encode_shard(file: &[u8], level: i32) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    encode_shard_to(file, level, &mut out).map_err(|e| Error::invalid(format!("write: {e}")))??;
    Ok(out)
}

/// Streams the byte-plane form of a safetensors file into `out`; returns the bytes written.
/// The outer error is the writer's, the inner one a bad input file.
pub fn encode_shard_to(file: &[u8], level: i32, out: &mut impl std::io::Write) -> std::io::Result<Result<u64>> {
    let (data_start, tensors, _) = match parse_safetensors_header(file) {
        Ok(x) => x,
        Err(e) => return Ok(Err(e)),
    };
    let chunks: Vec<(usize, usize, usize)> = match cut(data_start as u64, &tensors, file.len() as u64) {
        Ok(c) => c.0.iter().map(|&(o, l, w)| (o as usize, l as usize, w as usize)).collect(),
        Err(e) => return Ok(Err(e)),
    };
    let z = |b: &[u8]| zstd::bulk::compress(b, level).map_err(|e| Error::invalid(format!("zstd: {e}")));
    let header_z = match z(&file[..data_start]) {
        Ok(h) => h,
        Err(e) => return Ok(Err(e)),
    };
    let written = std::cell::Cell::new(0u64);
    let put = |out: &mut dyn std::io::Write, b: &[u8]| -> std::io::Result<()> {
        written.set(written.get() + b.len() as u64);
        out.write_all(b)
    };
    let mut head = Vec::with_capacity(32);
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&[1, 0, 0, 0]);
    head.extend_from_slice(&(file.len() as u64).to_le_bytes());
    head.extend_from_slice(&(data_start as u64).to_le_bytes());
    head.extend_from_slice(&(header_z.len() as u64).to_le_bytes());
    put(out, &head)?;
    put(out, &header_z)?;
    let mut table = Vec::new();
    let batch = rayon::current_num_threads().max(1) * 2;
    for group in chunks.chunks(batch) {
        let planes: Vec<Vec<Vec<u8>>> = match group
            .par_iter()
            .map(|&(o, l, w)| {
                let mut p = Vec::with_capacity(l);
                to_planes(&file[o..o + l], w, &mut p);
                let n = l / w;
                (0..w).map(|i| z(&p[i * n..(i + 1) * n])).collect::<Result<Vec<_>>>()
            })
            .collect::<Result<_>>()
        {
            Ok(p) => p,
            Err(e) => return Ok(Err(e)),
        };
        for ((o, l, w), p) in group.iter().zip(&planes) {
            table.extend_from_slice(&(*o as u64).to_le_bytes());
            table.extend_from_slice(&(*l as u64).to_le_bytes());
            table.push(*w as u8);
            for plane in p {
                table.extend_from_slice(&(plane.len() as u64).to_le_bytes());
                put(out, plane)?;
            }
        }
    }
    let table_offset = written.get();
    put(out, &table)?;
    let mut foot = Vec::with_capacity(16);
    foot.extend_from_slice(&table_offset.to_le_bytes());
    foot.extend_from_slice(&(chunks.len() as u32).to_le_bytes());
    foot.extend_from_slice(FOOTER);
    put(out, &foot)?;
    Ok(Ok(written.get()))
}

/// The chunks of a shard, `(offset, len, width)` in file order, as the encoder cuts them from
/// the file's safetensors header ([`shard_cuts`]). Decoders check a shard's table against them:
/// its chunk count is the encoder's, not one the (unverified) object declares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cuts(Vec<(u64, u64, u8)>);

impl Cuts {
    /// Number of chunks.
    pub fn len(&self) -> usize {
        self.0.len()
    }
    /// True for a file without data bytes.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// Bytes of the chunk table that lists them.
    pub fn table_len(&self) -> u64 {
        self.0.iter().map(|&(_, _, w)| 17 + 8 * u64::from(w)).sum()
    }
}

/// Cuts the data of a file of `file_len` bytes whose data starts at `data_start` into chunks:
/// each tensor (in data order) in chunks of at most [`CHUNK`] bytes of its element width, and
/// any gap (padding) between or after tensors in chunks of width 1.
fn cut(data_start: u64, tensors: &[(crate::TensorMeta, std::ops::Range<usize>)], file_len: u64) -> Result<Cuts> {
    let chunk = CHUNK as u64;
    let mut chunks = vec![];
    let gap = |from: u64, to: u64, chunks: &mut Vec<(u64, u64, u8)>| {
        for g in (from..to).step_by(CHUNK) {
            chunks.push((g, chunk.min(to - g), 1));
        }
    };
    let mut at = data_start;
    for (t, r) in tensors {
        let (s, e) = (data_start + r.start as u64, data_start + r.end as u64);
        if s < at {
            return Err(Error::invalid("overlapping tensors"));
        }
        gap(at, s, &mut chunks);
        let w = t.dtype.size() as u64;
        let per = (chunk / w) * w;
        let mut c = s;
        while c < e {
            let l = per.min(e - c);
            chunks.push((c, l, w as u8));
            c += l;
        }
        at = at.max(e);
    }
    gap(at, file_len, &mut chunks);
    Ok(Cuts(chunks))
}

/// The chunks an encoder cuts a shard of `decoded_size` bytes into, from its decoded header
/// (the file's first bytes, as long as the prefix's header length: see [`header_range`]).
///
/// With `expect` (the signed manifest's layout of that shard), the header must list exactly
/// those tensors, in any order. A replaced object can otherwise declare a header of millions
/// of tiny tensors, cut into as many chunks (one ranged GET each) before its SHA-256 mismatch
/// shows at the end. One parse of the header serves both.
pub fn shard_cuts(head: &[u8], decoded_size: u64, expect: Option<&[crate::TensorMeta]>) -> Result<Cuts> {
    let (data_start, tensors, _) =
        crate::checkpoint::parse_safetensors_head(head, decoded_size).map_err(|e| bad(format!("header: {e}")))?;
    if data_start != head.len() {
        return Err(bad(format!("header of {} bytes, the prefix says {}", data_start, head.len())));
    }
    if let Some(expect) = expect {
        check_listed(tensors.iter().map(|(t, _)| t), expect)?;
    }
    cut(data_start as u64, &tensors, decoded_size).map_err(|e| bad(e.to_string()))
}

/// The tensors a shard's header lists (`got`) are exactly `expect` (the signed layout's of that
/// shard), in any order: checked before a stream sizes anything by the header.
pub fn check_listed<'a>(got: impl Iterator<Item = &'a crate::TensorMeta>, expect: &[crate::TensorMeta]) -> Result<()> {
    let mut got: Vec<&crate::TensorMeta> = got.collect();
    let mut want: Vec<&crate::TensorMeta> = expect.iter().collect();
    got.sort_by(|a, b| a.name.cmp(&b.name));
    want.sort_by(|a, b| a.name.cmp(&b.name));
    if got == want {
        return Ok(());
    }
    // The first tensor (by name) the two disagree on, for the error.
    let first = got.iter().zip(&want).find(|(g, w)| g != w).map(|(g, w)| if g.name <= w.name { *g } else { *w });
    let first = first.or_else(|| got.get(want.len()).or_else(|| want.get(got.len())).copied());
    let name = first.map(|t| t.name.as_str()).unwrap_or_default();
    let shown: String = name.chars().take(80).flat_map(char::escape_default).collect();
    Err(bad(format!(
        "header lists {} tensors, not the {} of the signed layout (first difference: tensor \"{shown}\")",
        got.len(),
        want.len()
    )))
}

struct Cur<'a> {
    b: &'a [u8],
    at: usize,
}
impl<'a> Cur<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let e = self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or_else(|| bad("truncated"))?;
        let s = &self.b[self.at..e];
        self.at = e;
        Ok(s)
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
}

/// One entry of a shard's chunk table.
struct TableChunk {
    /// Offset and length of the chunk in the decoded file.
    at: u64,
    len: u64,
    /// Element width: the number of byte planes.
    width: usize,
    /// Stored (compressed) length of each plane.
    plane_lens: Vec<u64>,
}

/// Reads a chunk table, which must be all of `t` and list exactly the chunks `cuts` (what the
/// encoder cuts the file into): the chunks cover the decoded bytes `[header_len, size)`
/// contiguously, each with a width of 1, 2, 4 or 8 dividing its length and at most [`CHUNK`]
/// long, after a header no longer than a safetensors header may be. Decoders size their
/// buffers and requests by these numbers before the object's SHA-256 can be checked, so they
/// are bounded here, not by the shard's size.
fn read_table(t: &mut Cur<'_>, cuts: &Cuts, header_len: u64, size: u64) -> Result<Vec<TableChunk>> {
    if header_len > MAX_HEADER_LEN {
        return Err(bad(format!("header of {header_len} bytes, more than a safetensors header may have")));
    }
    // An entry takes at least 25 bytes (offset, length, width, one plane length): a count
    // the table bytes cannot hold is refused before anything is reserved.
    let n = cuts.len();
    if n > t.b.len().saturating_sub(t.at) / 25 {
        return Err(bad("chunk count exceeds the table"));
    }
    let mut table = Vec::with_capacity(n);
    let mut expect = header_len;
    for &want in &cuts.0 {
        let o = t.u64()?;
        let l = t.u64()?;
        let w = t.take(1)?[0] as u64;
        if o != expect || !matches!(w, 1 | 2 | 4 | 8) || l == 0 || l % w != 0 || l > size - o || l > CHUNK as u64 {
            return Err(bad("chunk table is not contiguous or has a bad width"));
        }
        if (o, l, w) != (want.0, want.1, u64::from(want.2)) {
            return Err(bad(format!("chunk at {o} of {l} bytes is not where the encoder cuts the file")));
        }
        expect = o + l;
        let plane_lens: Vec<u64> = (0..w).map(|_| t.u64()).collect::<Result<_>>()?;
        // Each plane is one zstd frame of `l / w` bytes: never empty, never longer than zstd
        // makes it (a chunk's ranged GET is sized by these).
        if plane_lens.iter().any(|&pl| pl == 0 || pl > stored_bound(l / w)) {
            return Err(bad("a plane's stored size is not what zstd writes for its chunk"));
        }
        table.push(TableChunk { at: o, len: l, width: w as usize, plane_lens });
    }
    if expect != size || t.at != t.b.len() {
        return Err(bad("chunks do not cover the file or the table has trailing bytes"));
    }
    Ok(table)
}

/// Decodes a byte-plane shard into `out`, which must be exactly the declared decoded size
/// (the manifest's `decoded_size`; the caller allocates or maps it). The same plan and checks
/// as the streaming decode ([`plan_shard`]); chunks decode in parallel.
pub fn decode_shard(stored: &[u8], out: &mut [u8]) -> Result<()> {
    let len = stored.len() as u64;
    if len < PREFIX_LEN + FOOTER_LEN {
        return Err(bad("truncated"));
    }
    let (prefix, footer) = (&stored[..PREFIX_LEN as usize], &stored[(len - FOOTER_LEN) as usize..]);
    let size = out.len() as u64;
    let (hr, header_len) = header_range(prefix, size, len)?;
    let at = |r: &std::ops::Range<u64>| stored.get(r.start as usize..r.end as usize).ok_or_else(|| bad("truncated"));
    let (head, mut rest) = out.split_at_mut(header_len as usize);
    decode_header(at(&hr)?, head)?;
    let cuts = shard_cuts(head, size, None)?;
    let tr = table_range(prefix, &cuts, footer, len, size)?;
    let plan = plan_shard(prefix, &cuts, at(&tr)?, footer, len, size)?;
    let at = |r: &std::ops::Range<u64>| &stored[r.start as usize..r.end as usize];
    // Chunks cover the file after the header in order (checked by the plan).
    let mut jobs = Vec::with_capacity(plan.chunks.len());
    for c in &plan.chunks {
        let (dst, r) = rest.split_at_mut((c.out.end - c.out.start) as usize);
        rest = r;
        jobs.push((c, dst));
    }
    jobs.into_par_iter()
        .try_for_each_init(Vec::new, |scratch, (c, dst)| decode_planes(c, at(&c.stored), dst, scratch, false))
}

// ---------------------------------------------------------------------------------------------
// Streaming decode: the agent's cold start reads a shard with ranged GETs (the footer, the
// prefix, the table, then one GET per chunk's planes, several in flight) and decodes each
// chunk as it arrives, in memory bounded by the chunks in flight, whatever the model size.

/// Bytes of the footer (the last bytes of a shard).
pub const FOOTER_LEN: u64 = 16;
/// Bytes of the fixed prefix: magic, version, decoded size, header length, stored header length.
pub const PREFIX_LEN: u64 = 32;

/// Where everything of one shard lies, from its footer, prefix and table.
#[derive(Debug, Clone)]
pub struct ShardPlan {
    /// Decoded (safetensors) size.
    pub decoded_size: u64,
    /// Length of the decoded header (the file's first bytes).
    pub header_len: u64,
    /// Stored range of the compressed header.
    pub header: std::ops::Range<u64>,
    /// Chunks in file order.
    pub chunks: Vec<ChunkPlan>,
}

/// One chunk: its decoded byte range in the file and the stored range of its planes.
#[derive(Debug, Clone)]
pub struct ChunkPlan {
    /// Decoded range in the safetensors file.
    pub out: std::ops::Range<u64>,
    /// Element width (number of planes).
    pub width: usize,
    /// Stored range of its planes (contiguous).
    pub stored: std::ops::Range<u64>,
    plane_lens: Vec<u64>,
}

/// Largest stored size zstd gives `n` bytes: what an encoder can have written for them.
fn stored_bound(n: u64) -> u64 {
    zstd::zstd_safe::compress_bound(usize::try_from(n).unwrap_or(usize::MAX)) as u64
}

/// What the fixed prefix declares.
struct Prefix {
    size: u64,
    header_len: u64,
    header_stored: u64,
}

/// Reads the fixed prefix ([`PREFIX_LEN`] bytes) of a shard expected to decode to
/// `decoded_size` bytes, every number bounded by what an encoder writes.
fn read_prefix(prefix: &[u8], decoded_size: u64) -> Result<Prefix> {
    let mut c = Cur { b: prefix, at: 0 };
    if c.take(4)? != MAGIC {
        return Err(bad("bad magic"));
    }
    if c.take(4)?[0] != 1 {
        return Err(bad("unsupported version"));
    }
    let size = c.u64()?;
    if size != decoded_size || size > MAX_SHARD {
        return Err(bad(format!("decoded size {size} does not match the expected {decoded_size}")));
    }
    let header_len = c.u64()?;
    let header_stored = c.u64()?;
    // A safetensors header is its 8-byte length and at least `{}`.
    if header_len < 10 || header_len > size || header_len > MAX_HEADER_LEN {
        return Err(bad(format!("header of {header_len} bytes in a file of {size}")));
    }
    if header_stored == 0 || header_stored > stored_bound(header_len) {
        return Err(bad(format!("compressed header of {header_stored} bytes for {header_len}")));
    }
    Ok(Prefix { size, header_len, header_stored })
}

/// The stored range of a shard's compressed header and the length of the decoded header (the
/// file's first bytes), from the prefix of a shard that decodes to `decoded_size` bytes. A
/// reader fetches and decodes the header first: it says how the encoder cut the file
/// ([`shard_cuts`]), which bounds the table. The range must lie inside a shard object of
/// `stored_size` bytes, before its footer: a reader fetches it before the object can be
/// checked, and a range past the end would come back short, which is a transient error of the
/// store, not this object's (found by review: an agent retried such an anchor for good
/// instead of refusing it and routing around it).
pub fn header_range(prefix: &[u8], decoded_size: u64, stored_size: u64) -> Result<(std::ops::Range<u64>, u64)> {
    let p = read_prefix(prefix, decoded_size)?;
    let end = PREFIX_LEN + p.header_stored;
    if end > stored_size.saturating_sub(FOOTER_LEN) {
        return Err(bad(format!(
            "compressed header of {} bytes past the end of an object of {stored_size}",
            p.header_stored
        )));
    }
    Ok((PREFIX_LEN..end, p.header_len))
}

/// The stored range of the chunk table, from the footer (the last [`FOOTER_LEN`] bytes of a
/// shard of `stored_size` bytes), the prefix of a shard that decodes to `decoded_size` bytes
/// and the chunks its header says the encoder cut ([`shard_cuts`]). The table's length and
/// chunk count must be exactly those of the encoder's table for that file, so a reader can
/// fetch it whole, and plan one request per chunk, before the object's SHA-256 can be checked.
pub fn table_range(
    prefix: &[u8],
    cuts: &Cuts,
    footer: &[u8],
    stored_size: u64,
    decoded_size: u64,
) -> Result<std::ops::Range<u64>> {
    let p = read_prefix(prefix, decoded_size)?;
    let tr = footer_table_range(footer, stored_size)?;
    let n = u32::from_le_bytes(footer[8..12].try_into().expect("4")) as u64;
    if n != cuts.len() as u64 || tr.end - tr.start != cuts.table_len() {
        return Err(bad(format!(
            "chunk count {n} or table of {} bytes is not what an encoder writes for this file ({} chunks)",
            tr.end - tr.start,
            cuts.len()
        )));
    }
    if PREFIX_LEN + p.header_stored > tr.start {
        return Err(bad("header"));
    }
    Ok(tr)
}

/// The table's range as the footer alone says it (checked against the object only).
fn footer_table_range(footer: &[u8], stored_size: u64) -> Result<std::ops::Range<u64>> {
    if footer.len() as u64 != FOOTER_LEN || stored_size < 48 {
        return Err(bad("truncated"));
    }
    if &footer[12..] != FOOTER {
        return Err(bad("bad footer"));
    }
    let table_offset = u64::from_le_bytes(footer[..8].try_into().expect("8"));
    let n = u32::from_le_bytes(footer[8..12].try_into().expect("4")) as u64;
    let body_end = stored_size - FOOTER_LEN;
    if table_offset < PREFIX_LEN || table_offset > body_end || n > body_end / 17 {
        return Err(bad("bad table offset or chunk count"));
    }
    Ok(table_offset..body_end)
}

/// Checks the prefix (first [`PREFIX_LEN`] bytes) and the table (the bytes of
/// [`table_range`]) against each other, the chunks of the header ([`shard_cuts`]) and the
/// expected decoded size; returns the plan. The same checks as [`decode_shard`]: the chunks
/// are the encoder's, planes are contiguous.
pub fn plan_shard(
    prefix: &[u8],
    cuts: &Cuts,
    table: &[u8],
    footer: &[u8],
    stored_size: u64,
    decoded_size: u64,
) -> Result<ShardPlan> {
    let tr = table_range(prefix, cuts, footer, stored_size, decoded_size)?;
    if table.len() as u64 != tr.end - tr.start {
        return Err(bad("table size"));
    }
    let Prefix { size, header_len, header_stored } = read_prefix(prefix, decoded_size)?;
    // Checked by `table_range`: the header ends before the table.
    let planes_start = PREFIX_LEN + header_stored;
    let mut at = planes_start;
    let chunks = read_table(&mut Cur { b: table, at: 0 }, cuts, header_len, size)?
        .into_iter()
        .map(|c| {
            let start = at;
            for &pl in &c.plane_lens {
                at = at
                    .checked_add(pl)
                    .filter(|&a| a <= tr.start)
                    .ok_or_else(|| bad("plane sizes overrun the table"))?;
            }
            Ok(ChunkPlan { out: c.at..c.at + c.len, width: c.width, stored: start..at, plane_lens: c.plane_lens })
        })
        .collect::<Result<Vec<_>>>()?;
    if at != tr.start {
        return Err(bad("plane sizes do not add up to the table offset"));
    }
    Ok(ShardPlan { decoded_size: size, header_len, header: PREFIX_LEN..planes_start, chunks })
}

// ---------------------------------------------------------------------------------------------
// Signed parts: the manifest lists the SHA-256 of each range a streaming reader fetches, so
// that each is checked as it arrives, on any core, before anything from it is written (one SHA-256 over a
// whole object is a serial stream of about 1 GB/s, which bounded a one-shard cold start).

/// Bytes of the pieces after the header of a plain safetensors anchor shard.
pub const PLAIN_PART: u64 = 16 << 20;

/// The longest first part (the prefix and the compressed header) of a byte-plane shard that
/// decodes to `decoded_size` bytes: what a reader accepts before fetching it.
pub fn head_part_bound(decoded_size: u64) -> u64 {
    PREFIX_LEN + stored_bound(decoded_size.min(MAX_HEADER_LEN))
}

/// The parts an anchor shard object is signed in ([`crate::manifest::PartRef`]), in order,
/// tiling it: for the byte-plane form, the prefix with the compressed header, each chunk's
/// planes, and the table with the footer (what a streaming reader fetches, each range once);
/// for a plain safetensors file, its header, then pieces of [`PLAIN_PART`]. `stored` is the
/// object, which decodes to `decoded_size` bytes.
pub fn part_ranges(
    stored: &[u8],
    decoded_size: u64,
    encoding: crate::manifest::AnchorEncoding,
) -> Result<Vec<std::ops::Range<u64>>> {
    let size = stored.len() as u64;
    match encoding {
        crate::manifest::AnchorEncoding::PlanesZstd => {
            if size < PREFIX_LEN + FOOTER_LEN {
                return Err(bad("truncated"));
            }
            let prefix = &stored[..PREFIX_LEN as usize];
            let footer = &stored[(size - FOOTER_LEN) as usize..];
            let (hr, header_len) = header_range(prefix, decoded_size, size)?;
            let hz = stored.get(hr.start as usize..hr.end as usize).ok_or_else(|| bad("truncated"))?;
            let mut head = vec![0u8; header_len as usize];
            decode_header(hz, &mut head)?;
            let cuts = shard_cuts(&head, decoded_size, None)?;
            let tr = table_range(prefix, &cuts, footer, size, decoded_size)?;
            let plan =
                plan_shard(prefix, &cuts, &stored[tr.start as usize..tr.end as usize], footer, size, decoded_size)?;
            let mut r = Vec::with_capacity(plan.chunks.len() + 2);
            r.push(0..hr.end);
            r.extend(plan.chunks.iter().map(|c| c.stored.clone()));
            r.push(tr.start..size);
            Ok(r)
        }
        crate::manifest::AnchorEncoding::Safetensors => {
            let n = stored
                .get(..8)
                .map(|b| u64::from_le_bytes(b.try_into().expect("8")))
                .ok_or_else(|| bad("truncated"))?;
            let head_end = n
                .checked_add(8)
                .filter(|&e| e <= size && n <= crate::checkpoint::MAX_HEADER as u64)
                .ok_or_else(|| bad("header length"))?;
            let mut r = Vec::with_capacity(1 + ((size - head_end) / PLAIN_PART) as usize + 1);
            r.push(0..head_end);
            r.extend((head_end..size).step_by(PLAIN_PART as usize).map(|a| a..(a + PLAIN_PART).min(size)));
            Ok(r)
        }
    }
}

/// [`part_ranges`] with the SHA-256 of each, hashed on all cores.
pub fn part_refs(
    stored: &[u8],
    decoded_size: u64,
    encoding: crate::manifest::AnchorEncoding,
) -> Result<Vec<crate::manifest::PartRef>> {
    Ok(part_ranges(stored, decoded_size, encoding)?
        .into_par_iter()
        .map(|r| crate::manifest::PartRef {
            len: r.end - r.start,
            sha256: crate::Digest::of(&stored[r.start as usize..r.end as usize]),
        })
        .collect())
}

/// Decodes the compressed header (the stored bytes of [`ShardPlan::header`]) into `out`, the
/// file's first [`ShardPlan::header_len`] bytes.
pub fn decode_header(hz: &[u8], out: &mut [u8]) -> Result<()> {
    let got = zstd::bulk::Decompressor::new()
        .and_then(|mut d| d.decompress_to_buffer(hz, out))
        .map_err(|e| bad(format!("header: {e}")))?;
    if got != out.len() {
        return Err(bad("header size mismatch"));
    }
    Ok(())
}

/// Decodes one chunk from its stored planes (the bytes of [`ChunkPlan::stored`]) into `out`
/// (its [`ChunkPlan::out`] range of the file).
pub fn decode_chunk(c: &ChunkPlan, stored: &[u8], out: &mut [u8]) -> Result<()> {
    decode_planes(c, stored, out, &mut Vec::new(), true)
}

/// A chunk's byte planes, decoded ([`decode_chunk_planes`]) but not yet interleaved into its
/// bytes: a streaming reader takes them a piece at a time ([`ChunkPlanes::interleave`]), so
/// that it never holds a chunk's decoded bytes whole (16 MiB per chunk in flight) and each
/// piece is still in cache when it is written and hashed.
pub struct ChunkPlanes<'a> {
    planes: &'a [u8],
    w: usize,
}

impl ChunkPlanes<'_> {
    /// Decoded bytes of the chunk (its [`ChunkPlan::out`] length).
    pub fn len(&self) -> usize {
        self.planes.len()
    }

    /// Whether the chunk has no bytes (an encoder never cuts one).
    pub fn is_empty(&self) -> bool {
        self.planes.is_empty()
    }

    /// Its element width: pieces start and end on multiples of it.
    pub fn width(&self) -> usize {
        self.w
    }

    /// Writes the chunk's decoded bytes `[at, at + dst.len())` into `dst`.
    ///
    /// # Panics
    /// When the range is not inside the chunk or not on element boundaries (a caller's bug:
    /// [`decode_chunk_planes`] checked that the chunk's length is a multiple of its width).
    pub fn interleave(&self, at: usize, dst: &mut [u8]) {
        assert!(
            at.is_multiple_of(self.w) && dst.len().is_multiple_of(self.w) && at + dst.len() <= self.len(),
            "piece off the chunk"
        );
        from_planes_at(self.planes, self.w, at / self.w, dst)
    }
}

/// Decodes one chunk's stored planes (the bytes of [`ChunkPlan::stored`]) into `scratch`
/// (grown as needed, never shrunk or cleared: a caller that keeps it between chunks reuses its
/// pages instead of faulting in fresh ones), each plane on a thread of its own (each is its
/// own zstd frame; a chunk's decode is on the critical path of a cold start, a few chunks in
/// flight, and a pool shared with the hashing would queue it behind that).
pub fn decode_chunk_planes<'s>(c: &ChunkPlan, stored: &[u8], scratch: &'s mut Vec<u8>) -> Result<ChunkPlanes<'s>> {
    planes_of(c, stored, scratch, true)
}

/// [`decode_chunk_planes`], the planes on threads of their own when `side_by_side`, else one
/// after another (callers that already decode chunks on every core, [`decode_shard`]).
fn planes_of<'s>(
    c: &ChunkPlan,
    stored: &[u8],
    scratch: &'s mut Vec<u8>,
    side_by_side: bool,
) -> Result<ChunkPlanes<'s>> {
    let len = usize::try_from(c.out.end - c.out.start).map_err(|_| bad("chunk sizes"))?;
    if scratch.len() < len {
        scratch.resize(len, 0);
    }
    decode_planes_into(c, stored, &mut scratch[..len], side_by_side)?;
    Ok(ChunkPlanes { planes: &scratch[..len], w: c.width })
}

/// Decodes a chunk's planes into `dst` (as long as the chunk), plane after plane: on threads of
/// their own when `side_by_side`.
fn decode_planes_into(c: &ChunkPlan, stored: &[u8], dst: &mut [u8], side_by_side: bool) -> Result<()> {
    let len = dst.len();
    let w = c.width;
    if stored.len() as u64 != c.stored.end - c.stored.start
        || len as u64 != c.out.end - c.out.start
        || w == 0
        || !len.is_multiple_of(w)
    {
        return Err(bad("chunk sizes"));
    }
    let n = len / w;
    let plane = |p: &[u8], dst: &mut [u8]| -> Result<()> {
        let mut d = zstd::bulk::Decompressor::new().map_err(|e| bad(e.to_string()))?;
        let got = d.decompress_to_buffer(p, dst).map_err(|e| bad(format!("zstd: {e}")))?;
        if got == n {
            Ok(())
        } else {
            Err(bad("plane size mismatch"))
        }
    };
    let mut at = 0usize;
    let jobs: Vec<(&[u8], &mut [u8])> = c
        .plane_lens
        .iter()
        .zip(dst.chunks_mut(n.max(1)))
        .map(|(&pl, dst)| {
            let p = &stored[at..at + pl as usize];
            at += pl as usize;
            (p, dst)
        })
        .collect();
    std::thread::scope(|sc| {
        // A plane whose thread cannot be started is decoded here, after the first.
        let mut here = vec![];
        let mut spawned = vec![];
        for (i, (p, d)) in jobs.into_iter().enumerate() {
            if i == 0 || !side_by_side {
                here.push((p, d));
                continue;
            }
            // Shared with the thread so that it can be taken back when none starts.
            let job = std::sync::Arc::new(std::sync::Mutex::new(Some((p, d))));
            let theirs = job.clone();
            let run = move || theirs.lock().ok().and_then(|mut j| j.take()).map(|(p, d)| plane(p, d));
            match std::thread::Builder::new().spawn_scoped(sc, run) {
                Ok(h) => spawned.push(h),
                Err(_) => here.extend(job.lock().ok().and_then(|mut j| j.take())),
            }
        }
        let mut r = here.into_iter().try_for_each(|(p, d)| plane(p, d));
        for h in spawned {
            r = r.and(h.join().ok().flatten().unwrap_or_else(|| Err(bad("plane decode thread failed"))));
        }
        r
    })
}

/// Decodes a chunk into `out`, its [`ChunkPlan::out`] range: through `scratch` (its planes),
/// then interleaved; a chunk of one plane straight into `out`.
fn decode_planes(
    c: &ChunkPlan,
    stored: &[u8],
    out: &mut [u8],
    scratch: &mut Vec<u8>,
    side_by_side: bool,
) -> Result<()> {
    if c.width == 1 {
        // One plane: its bytes are the chunk's.
        return decode_planes_into(c, stored, out, side_by_side);
    }
    if out.len() as u64 != c.out.end - c.out.start {
        return Err(bad("chunk sizes"));
    }
    let planes = planes_of(c, stored, scratch, side_by_side)?;
    planes.interleave(0, out);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table of one chunk of `len` bytes of width 2 at `header_len`.
    fn table(header_len: u64, len: u64) -> Vec<u8> {
        let mut t = vec![];
        t.extend_from_slice(&header_len.to_le_bytes());
        t.extend_from_slice(&len.to_le_bytes());
        t.push(2);
        t.extend_from_slice(&1u64.to_le_bytes());
        t.extend_from_slice(&1u64.to_le_bytes());
        t
    }

    /// Decoders size buffers by the header and chunk lengths a shard declares before its
    /// SHA-256 can be checked: both are bounded by what an encoder writes, not by the shard.
    #[test]
    fn declared_header_and_chunk_lengths_are_bounded() {
        let read = |h: u64, l: u64| read_table(&mut Cur { b: &table(h, l), at: 0 }, &Cuts(vec![(h, l, 2)]), h, h + l);
        assert!(read(100, CHUNK as u64).is_ok());
        assert!(read(MAX_HEADER_LEN, CHUNK as u64).is_ok());
        let e = read(100, CHUNK as u64 + 2).err().expect("a chunk over 16 MiB is refused");
        assert!(e.to_string().contains("chunk table"), "{e}");
        let e = read(MAX_HEADER_LEN + 1, 2).err().expect("a header over the safetensors limit is refused");
        assert!(e.to_string().contains("header of"), "{e}");
        assert!(read(100, 0).is_err(), "a chunk of zero bytes is refused");
    }

    /// A plane's stored length sizes one ranged GET before the object's SHA-256 is known: it
    /// is what zstd can write for the plane (never empty, never more than its bound).
    #[test]
    fn plane_lengths_are_what_zstd_writes() {
        let with_planes = |a: u64, b: u64| {
            let mut t = table(100, 1000);
            let n = t.len();
            t[n - 16..n - 8].copy_from_slice(&a.to_le_bytes());
            t[n - 8..].copy_from_slice(&b.to_le_bytes());
            read_table(&mut Cur { b: &t, at: 0 }, &Cuts(vec![(100, 1000, 2)]), 100, 1100)
        };
        let bound = stored_bound(500);
        assert!(bound > 500 && bound < 1000, "{bound}");
        assert!(with_planes(1, bound).is_ok());
        assert!(with_planes(0, 10).is_err(), "an empty plane");
        assert!(with_planes(10, bound + 1).is_err(), "a plane longer than zstd writes");
        assert!(with_planes(10, 1 << 40).is_err(), "a plane sized like a whole object");
    }
}
