//! Safetensors files and sharded Hugging Face checkpoint directories, memory-mapped.
//!
//! A [`Checkpoint`] is read-only (publisher snapshots, `driftless diff`, hashing). A
//! [`CheckpointMut`] maps the same files writable so deltas are applied in place, or creates a
//! fresh checkpoint of a given [`Layout`] (anchor decode, layout-changing deltas). A
//! [`CheckpointFiles`] opens them for block-wise `pread`/`pwrite` (the agent's fast path).

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::marker::PhantomData;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use memmap2::{Mmap, MmapMut};
use serde::{Deserialize, Serialize};

use crate::tensor::validate_file_name;
use crate::{DType, Error, Result, TensorMeta, TensorView};

/// Name of the shard index file of a sharded Hugging Face checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Most bytes of tensors a layout read from a manifest may claim, all shards together (1 PiB).
pub const MAX_LAYOUT_BYTES: u64 = 1 << 50;

/// Largest safetensors header accepted (bytes), as in the safetensors crate.
pub const MAX_HEADER: usize = 100_000_000;

/// One shard file and its tensors in data order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardLayout {
    /// File name inside the checkpoint directory (`model-00001-of-00004.safetensors`).
    pub file: String,
    /// Tensors in the order of their data in the file.
    pub tensors: Vec<TensorMeta>,
    /// The safetensors `__metadata__` map of the file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
}

/// How tensors are split into shard files. Two checkpoints with equal layouts have identical
/// safetensors headers, so a delta between them is applied in place.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Layout {
    /// Shards in file-name order.
    pub shards: Vec<ShardLayout>,
}

impl Layout {
    /// A layout for a flat list of tensors: one file `model.safetensors` when the total is
    /// under `max_shard_bytes`, else `model-0000k-of-0000n.safetensors` files of at most that
    /// size (a tensor larger than the limit gets a shard of its own), as Hugging Face does.
    pub fn for_tensors(tensors: &[TensorMeta], max_shard_bytes: u64) -> Result<Self> {
        let mut groups: Vec<Vec<TensorMeta>> = vec![];
        let mut cur = 0u64;
        for t in tensors {
            let n = t.nbytes()?;
            if groups.is_empty() || (cur > 0 && cur + n > max_shard_bytes) {
                groups.push(vec![]);
                cur = 0;
            }
            groups.last_mut().expect("pushed").push(t.clone());
            cur += n;
        }
        if groups.is_empty() {
            groups.push(vec![]);
        }
        let n = groups.len();
        let meta = Some(BTreeMap::from([("format".to_string(), "pt".to_string())]));
        let shards = groups
            .into_iter()
            .enumerate()
            .map(|(i, tensors)| ShardLayout {
                file: if n == 1 {
                    "model.safetensors".into()
                } else {
                    format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
                },
                tensors,
                metadata: meta.clone(),
            })
            .collect();
        Ok(Layout { shards })
    }

    /// All tensors, shard by shard.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorMeta> {
        self.shards.iter().flat_map(|s| s.tensors.iter())
    }

    /// Checks names, shapes, uniqueness and sizes (used on layouts read from manifests).
    pub fn validate(&self) -> Result<()> {
        let mut seen_files = std::collections::HashSet::new();
        let mut seen = std::collections::HashSet::new();
        let mut total = 0u64;
        for s in &self.shards {
            validate_file_name(&s.file)?;
            if !s.file.ends_with(".safetensors") || s.file == INDEX_FILE {
                return Err(Error::invalid(format!("shard file {:?} is not a .safetensors", s.file)));
            }
            if !seen_files.insert(s.file.as_str()) {
                return Err(Error::invalid(format!("shard file {:?} listed twice", s.file)));
            }
            // Bounded as a whole, not only tensor by tensor: enough tensors of the largest size
            // wrapped the offsets of a shard's header, which failed only when the agent built
            // the shard, an error that was not the step's fault, so a signed manifest with a
            // bug was retried at every poll instead of refused (found by review).
            let mut bytes = 0u64;
            for t in &s.tensors {
                t.validate()?;
                if !seen.insert(t.name.as_str()) {
                    return Err(Error::invalid(format!("tensor {:?} listed twice", t.name)));
                }
                bytes = bytes.saturating_add(t.nbytes()?);
            }
            if bytes > crate::tensor::MAX_TENSOR_BYTES {
                return Err(Error::invalid(format!("shard {:?} claims {bytes} bytes of tensors", s.file)));
            }
            // So that sums over a layout (element counts, byte totals) cannot wrap either.
            total = total.saturating_add(bytes);
            if total > MAX_LAYOUT_BYTES {
                return Err(Error::invalid(format!("the layout claims more than {MAX_LAYOUT_BYTES} bytes of tensors")));
            }
        }
        Ok(())
    }

    /// Safetensors header bytes (8-byte length prefix + JSON padded to 8 bytes) of one shard,
    /// plus the data offsets of its tensors.
    pub fn shard_header(shard: &ShardLayout) -> Result<(Vec<u8>, Vec<Range<u64>>)> {
        let mut json = String::from("{");
        let mut first = true;
        if let Some(m) = &shard.metadata {
            json.push_str("\"__metadata__\":");
            json.push_str(&serde_json::to_string(m).expect("string map serializes"));
            first = false;
        }
        let mut off = 0u64;
        let mut ranges = Vec::with_capacity(shard.tensors.len());
        for t in &shard.tensors {
            let n = t.nbytes()?;
            // Checked: each tensor is validated to at most 2^46 bytes, but a layout from a
            // manifest can list enough of them to wrap the offsets, which would map a file
            // smaller than the tensor ranges handed out for writing.
            let end = off
                .checked_add(n)
                .filter(|&e| e <= u64::MAX - (1 << 32))
                .ok_or_else(|| Error::invalid(format!("shard {} is too large", shard.file)))?;
            if !first {
                json.push(',');
            }
            first = false;
            json.push_str(&serde_json::to_string(&t.name).expect("string serializes"));
            json.push_str(&format!(
                ":{{\"dtype\":\"{}\",\"shape\":{},\"data_offsets\":[{},{}]}}",
                t.dtype.as_str(),
                serde_json::to_string(&t.shape).expect("vec serializes"),
                off,
                end
            ));
            ranges.push(off..end);
            off = end;
        }
        json.push('}');
        while json.len() % 8 != 0 {
            json.push(' ');
        }
        let mut out = Vec::with_capacity(8 + json.len());
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(json.as_bytes());
        Ok((out, ranges))
    }

    /// Total size in bytes of each shard file.
    pub fn shard_sizes(&self) -> Result<Vec<u64>> {
        self.shards
            .iter()
            .map(|s| {
                let (h, r) = Layout::shard_header(s)?;
                Ok(h.len() as u64 + r.last().map(|r| r.end).unwrap_or(0))
            })
            .collect()
    }
}

/// What [`parse_safetensors_header`] returns: the data start offset, the tensors in data order
/// with their byte ranges relative to the data start, and the `__metadata__` map.
pub type ParsedHeader = (usize, Vec<(TensorMeta, Range<usize>)>, Option<BTreeMap<String, String>>);

/// Parses a safetensors header from the start of `buf` (see [`ParsedHeader`]). Every offset is
/// checked against the buffer, so a hostile file cannot point outside it.
pub fn parse_safetensors_header(buf: &[u8]) -> Result<ParsedHeader> {
    parse_safetensors_head(buf, buf.len() as u64)
}

/// [`parse_safetensors_header`] from the first bytes of a file of `file_len` bytes (at least
/// its header: a streamed anchor shard is parsed before its data arrives). Every offset is
/// checked against `file_len`; the tensors must fill the data exactly, as the safetensors
/// crate requires.
pub fn parse_safetensors_head(buf: &[u8], file_len: u64) -> Result<ParsedHeader> {
    let bad = |d: String| Error::corrupt("safetensors file", d);
    if buf.len() < 8 || file_len < buf.len() as u64 {
        return Err(bad("shorter than 8 bytes".into()));
    }
    let n = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
    if n > MAX_HEADER as u64 || 8 + n as usize > buf.len() {
        return Err(bad(format!("header length {n} out of range")));
    }
    // Deserializing checks what the safetensors crate checks: offsets contiguous from 0, each
    // tensor's size that of its dtype and shape.
    let meta: safetensors::tensor::Metadata =
        serde_json::from_slice(&buf[8..8 + n as usize]).map_err(|e| bad(e.to_string()))?;
    if (8 + n).checked_add(meta.data_len() as u64) != Some(file_len) {
        return Err(bad(format!("tensors cover {} bytes, the file has {}", meta.data_len(), file_len - 8 - n)));
    }
    let start = 8 + n as usize;
    let data_len = (file_len - start as u64) as usize;
    let mut v = Vec::new();
    for (name, info) in meta.tensors() {
        let dtype = DType::from_safetensors(info.dtype)?;
        let shape: Vec<u64> = info.shape.iter().map(|&d| d as u64).collect();
        let (a, b) = info.data_offsets;
        if a > b || b > data_len {
            return Err(bad(format!("tensor {name}: offsets {a}..{b} outside data of {data_len}")));
        }
        let t = TensorMeta { name: name.clone(), dtype, shape };
        t.validate().map_err(|e| bad(e.to_string()))?;
        if t.nbytes()? != (b - a) as u64 {
            return Err(bad(format!("tensor {name}: size does not match dtype and shape")));
        }
        v.push((t, a..b));
    }
    // Zero-size tensors share their offset with the next tensor; ordering by end as well puts
    // them before it, as they were written (by start alone, "b" 0..8 would sort before "a" 0..0).
    v.sort_by(|x, y| (x.1.start, x.1.end, &x.0.name).cmp(&(y.1.start, y.1.end, &y.0.name)));
    let md = meta.metadata().as_ref().map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect());
    Ok((start, v, md))
}

/// Views of one mapped shard's tensors, in data order (the read-only and the writable
/// checkpoint share it).
fn shard_views<'a>(
    map: &'a [u8],
    data_start: usize,
    tensors: &'a [(TensorMeta, Range<usize>)],
) -> impl Iterator<Item = TensorView<'a>> {
    tensors.iter().map(move |(t, r)| TensorView {
        name: &t.name,
        dtype: t.dtype,
        shape: &t.shape,
        data: &map[data_start + r.start..data_start + r.end],
    })
}

struct Shard {
    file: String,
    map: Mmap,
    data_start: usize,
    tensors: Vec<(TensorMeta, Range<usize>)>,
    metadata: Option<BTreeMap<String, String>>,
}

/// A read-only, memory-mapped checkpoint: one safetensors file or a Hugging Face directory.
pub struct Checkpoint {
    root: PathBuf,
    shards: Vec<Shard>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint").field("root", &self.root).field("shards", &self.shards.len()).finish()
    }
}

/// Opens `p` for reading without blocking, and only when it is a regular file: a FIFO (or a
/// device) under a checkpoint's name blocked the opening for good, or read without end.
pub fn open_regular(p: &Path) -> Result<fs::File> {
    let f = {
        use std::os::unix::fs::OpenOptionsExt;
        fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(p)
    }
    .map_err(|e| Error::io(p, e))?;
    if !f.metadata().map_err(|e| Error::io(p, e))?.is_file() {
        return Err(Error::invalid(format!("{} is not a regular file", p.display())));
    }
    Ok(f)
}

/// The shard files of a checkpoint path: `[(dir, file)]`.
pub fn shard_files(path: &Path) -> Result<Vec<(PathBuf, String)>> {
    let md = fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if md.is_file() {
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let file = path
            .file_name()
            .and_then(|f| f.to_str())
            .ok_or_else(|| Error::invalid(format!("bad file name {}", path.display())))?;
        return Ok(vec![(dir, file.to_string())]);
    }
    let index = path.join(INDEX_FILE);
    let mut files: Vec<String> = if index.exists() {
        // As a shard is opened (found by review: a FIFO here hung `hash` for good, and a link
        // to /dev/zero read until memory ran out), and bounded like a header.
        let mut bytes = vec![];
        std::io::Read::read_to_end(&mut std::io::Read::take(open_regular(&index)?, MAX_HEADER as u64 + 1), &mut bytes)
            .map_err(|e| Error::io(&index, e))?;
        if bytes.len() > MAX_HEADER {
            return Err(Error::corrupt("checkpoint index", format!("{} is over {MAX_HEADER} bytes", index.display())));
        }
        #[derive(Deserialize)]
        struct Index {
            weight_map: BTreeMap<String, String>,
        }
        let idx: Index = serde_json::from_slice(&bytes)
            .map_err(|e| Error::corrupt("checkpoint index", format!("{}: {e}", index.display())))?;
        let mut f: Vec<String> = idx.weight_map.into_values().collect();
        f.sort();
        f.dedup();
        f
    } else {
        let mut f = vec![];
        for e in fs::read_dir(path).map_err(|e| Error::io(path, e))? {
            let e = e.map_err(|e| Error::io(path, e))?;
            let name = e.file_name().to_string_lossy().to_string();
            if name.ends_with(".safetensors") && !name.starts_with('.') {
                f.push(name);
            }
        }
        f.sort();
        f
    };
    if files.is_empty() {
        return Err(Error::invalid(format!("no .safetensors files in {}", path.display())));
    }
    for f in &files {
        validate_file_name(f)?;
    }
    files.dedup();
    Ok(files.into_iter().map(|f| (path.to_path_buf(), f)).collect())
}

impl Checkpoint {
    /// Opens a safetensors file or a checkpoint directory (with or without
    /// `model.safetensors.index.json`), mapping every shard read-only.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let mut shards = vec![];
        let mut seen = std::collections::HashSet::new();
        for (dir, file) in shard_files(path)? {
            let p = dir.join(&file);
            // Non-blocking, and a regular file only: a FIFO named `*.safetensors` (found by
            // review) blocked the opening for good, deaf to the publisher's SIGTERM.
            let f = open_regular(&p)?;
            // SAFETY: the file is mapped read-only; driftless never truncates checkpoint files
            // while a map is alive. Another process truncating it would fault, as with any mmap.
            let map = unsafe { Mmap::map(&f) }.map_err(|e| Error::io(&p, e))?;
            // Name the file; the inner error already says what is corrupt (not twice).
            let (data_start, tensors, metadata) = parse_safetensors_header(&map).map_err(|e| match e {
                Error::Corrupt { what, detail } => Error::corrupt(what, format!("{}: {detail}", p.display())),
                e => e,
            })?;
            for (t, _) in &tensors {
                if !seen.insert(t.name.clone()) {
                    return Err(Error::invalid(format!("tensor {} appears in two shards", t.name)));
                }
            }
            shards.push(Shard { file, map, data_start, tensors, metadata });
        }
        Ok(Checkpoint { root: path.to_path_buf(), shards })
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// The shard layout.
    pub fn layout(&self) -> Layout {
        Layout {
            shards: self
                .shards
                .iter()
                .map(|s| ShardLayout {
                    file: s.file.clone(),
                    tensors: s.tensors.iter().map(|(t, _)| t.clone()).collect(),
                    metadata: s.metadata.clone(),
                })
                .collect(),
        }
    }

    /// Views of all tensors, shard by shard in data order.
    pub fn views(&self) -> Vec<TensorView<'_>> {
        self.shards.iter().flat_map(|s| shard_views(&s.map, s.data_start, &s.tensors)).collect()
    }

    /// Raw bytes of each shard file, with its file name.
    pub fn shard_bytes(&self) -> Vec<(&str, &[u8])> {
        self.shards.iter().map(|s| (s.file.as_str(), &s.map[..])).collect()
    }

    /// Total bytes of tensor data.
    pub fn data_bytes(&self) -> u64 {
        self.views().iter().map(|v| v.data.len() as u64).sum()
    }
}

/// Writes `model.safetensors.index.json` for a multi-shard layout (no-op for one shard).
pub fn write_index(dir: &Path, layout: &Layout) -> Result<()> {
    if layout.shards.len() <= 1 {
        return Ok(());
    }
    let mut total = 0u64;
    let mut map = BTreeMap::new();
    for s in &layout.shards {
        for t in &s.tensors {
            total += t.nbytes()?;
            map.insert(t.name.clone(), s.file.clone());
        }
    }
    let v = serde_json::json!({"metadata": {"total_size": total}, "weight_map": map});
    let p = dir.join(INDEX_FILE);
    fs::write(&p, serde_json::to_vec_pretty(&v).expect("json")).map_err(|e| Error::io(&p, e))
}

/// Writes a whole checkpoint of `layout` into `dir` from tensor views (by name), then fsyncs.
/// Used by tests, the CLI and the publisher's anchor writer.
pub fn write_checkpoint(dir: &Path, layout: &Layout, tensors: &[TensorView<'_>]) -> Result<()> {
    let by_name: HashMap<&str, &TensorView<'_>> = tensors.iter().map(|t| (t.name, t)).collect();
    let mut ck = CheckpointMut::create(dir, layout)?;
    {
        let tm = ck.tensors_mut();
        for t in layout.tensors() {
            let v = by_name.get(t.name.as_str()).ok_or_else(|| Error::invalid(format!("tensor {} missing", t.name)))?;
            if v.dtype != t.dtype || v.shape != t.shape.as_slice() {
                return Err(Error::invalid(format!("tensor {} does not match layout", t.name)));
            }
            tm.with_range_mut(&t.name, 0, v.data.len() as u64, |dst| dst.copy_from_slice(v.data))?;
        }
    }
    ck.flush()
}

struct RawTensor {
    dtype: DType,
    ptr: *mut u8,
    len: usize,
}

/// Writable tensor buffers addressed by name, shared across threads. Writers must claim the
/// byte range they write ([`TensorsMut::with_range_mut`]); overlapping claims are refused, so
/// a hostile delta that lists the same range twice is an error rather than a data race.
pub struct TensorsMut<'a> {
    map: HashMap<String, RawTensor>,
    claims: Mutex<HashMap<String, BTreeMap<u64, u64>>>,
    _life: PhantomData<&'a mut [u8]>,
}

// SAFETY: the raw pointers come from `&'a mut [u8]` borrows held for 'a; all writes go through
// `with_range_mut`, which hands out disjoint ranges only (checked under the claims mutex).
unsafe impl Send for TensorsMut<'_> {}
unsafe impl Sync for TensorsMut<'_> {}

impl<'a> TensorsMut<'a> {
    /// An empty set.
    pub fn new() -> Self {
        TensorsMut { map: HashMap::new(), claims: Mutex::new(HashMap::new()), _life: PhantomData }
    }

    /// Adds a caller-owned buffer (used by the Python binding to patch arrays in place).
    pub fn insert(&mut self, name: &str, dtype: DType, data: &'a mut [u8]) {
        self.map.insert(name.to_string(), RawTensor { dtype, ptr: data.as_mut_ptr(), len: data.len() });
    }

    /// Dtype and byte length of a tensor.
    pub fn info(&self, name: &str) -> Option<(DType, usize)> {
        self.map.get(name).map(|t| (t.dtype, t.len))
    }

    /// Forgets all claims (between independent passes over the same buffers).
    pub fn reset_claims(&self) {
        self.claims.lock().expect("claims lock").clear();
    }

    /// Reads bytes `[start, start+len)` of tensor `name` in `f`, claimed while `f` runs (so no
    /// writer has them meanwhile) and released after: a later [`Self::with_range_mut`] of the
    /// same bytes is allowed. Errors as `with_range_mut` does. (Found by review: a plain read
    /// that only documented "claim first" let a journaled apply read bytes another thread was
    /// writing, given a delta whose segments overlap.)
    pub fn with_range<R>(&self, name: &str, start: u64, len: u64, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        let ptr = self.claim(name, start, len)?;
        // SAFETY: in bounds, and claimed: no other access writes these bytes while `f` runs.
        let r = f(unsafe { std::slice::from_raw_parts(ptr, len as usize) });
        if len > 0 {
            if let Some(c) = self.claims.lock().expect("claims lock").get_mut(name) {
                c.remove(&start);
            }
        }
        Ok(r)
    }

    /// Claims bytes `[start, start+len)` of tensor `name` and runs `f` on them. Errors when the
    /// tensor is unknown, the range is out of bounds, or it overlaps an earlier claim.
    pub fn with_range_mut<R>(&self, name: &str, start: u64, len: u64, f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        let ptr = self.claim(name, start, len)?;
        // SAFETY: in bounds, and no other claim overlaps this range, so this is the only
        // mutable access to these bytes while the closure runs.
        let s = unsafe { std::slice::from_raw_parts_mut(ptr, len as usize) };
        Ok(f(s))
    }

    /// Claims a range (none when `len` is 0): its first byte, checked in bounds.
    fn claim(&self, name: &str, start: u64, len: u64) -> Result<*mut u8> {
        let t = self.map.get(name).ok_or_else(|| Error::corrupt("delta", format!("unknown tensor {name}")))?;
        let end = start.checked_add(len).filter(|&e| e <= t.len as u64).ok_or_else(|| {
            Error::corrupt("delta", format!("range {start}+{len} outside tensor {name} of {} bytes", t.len))
        })?;
        if len > 0 {
            let mut claims = self.claims.lock().expect("claims lock");
            let c = claims.entry(name.to_string()).or_default();
            // Overlap if the claim starting at or before `start` reaches past it, or one starts
            // inside [start, end).
            if let Some((_, &e)) = c.range(..=start).next_back() {
                if e > start {
                    return Err(Error::corrupt("delta", format!("overlapping writes to {name} at {start}")));
                }
            }
            if c.range(start..end).next().is_some() {
                return Err(Error::corrupt("delta", format!("overlapping writes to {name} at {start}")));
            }
            c.insert(start, end);
        }
        // SAFETY: `start` is within the tensor (checked above); the pointer is valid for 'a.
        Ok(unsafe { t.ptr.add(start as usize) })
    }
}

impl Default for TensorsMut<'_> {
    fn default() -> Self {
        Self::new()
    }
}

struct ShardMut {
    path: PathBuf,
    map: MmapMut,
    data_start: usize,
    tensors: Vec<(TensorMeta, Range<usize>)>,
}

/// Starts writing bytes `[at, at + len)` of `file` back to disk
/// (`sync_file_range(SYNC_FILE_RANGE_WRITE)`: asynchronous, waits for nothing), so that the
/// disk writes while the caller goes on and its final fsync waits for the tail only. Best
/// effort: durability comes from that fsync, whose errors are the ones that count.
pub fn start_writeback(file: &File, at: u64, len: u64) {
    if len == 0 {
        // 0 means "to the end of the file" to sync_file_range.
        return;
    }
    // SAFETY: plain syscall on a descriptor owned by `file`.
    unsafe {
        libc::sync_file_range(
            std::os::fd::AsRawFd::as_raw_fd(file),
            at as i64,
            len as i64,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

/// Creates (truncating) `path` with `len` bytes really allocated on disk (`posix_fallocate`),
/// so that running out of space is an error here, not a SIGBUS when a map of the file is
/// written later. Filesystems without fallocate support fall back to a sized sparse file.
pub fn allocate_file(path: &Path, len: u64) -> Result<File> {
    let f = create_truncated(path)?;
    if len == 0 {
        return Ok(f);
    }
    reserve(f, path, len)
}

/// `path` created, or truncated, for reading and writing.
fn create_truncated(path: &Path) -> Result<File> {
    OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path).map_err(|e| Error::io(path, e))
}

/// `posix_fallocate` of `len` bytes of `f` (a sized sparse file where it is not supported).
fn reserve(f: File, path: &Path, len: u64) -> Result<File> {
    let n = i64::try_from(len).map_err(|_| Error::invalid(format!("{}: size {len} too large", path.display())))?;
    // SAFETY: plain syscall on a descriptor owned by `f`.
    let rc = unsafe { libc::posix_fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), 0, n) };
    match rc {
        0 => Ok(f),
        libc::EOPNOTSUPP | libc::EINVAL => {
            f.set_len(len).map_err(|e| Error::io(path, e))?;
            Ok(f)
        }
        rc => Err(Error::io(path, std::io::Error::from_raw_os_error(rc))),
    }
}

/// Creates (truncating) `path` sized `len` for a writer that fills every byte with `pwrite`
/// (never through a writable map): the anchor stream's shard files and the frames of
/// [`CheckpointFiles::frame_copy`] and [`CheckpointFiles::frame_layout`].
///
/// Blocks are reserved up front with `posix_fallocate` (running out of space is an error here,
/// and the file is not fragmented), except on a tmpfs: there `posix_fallocate` allocates and
/// charges every page of the file on one thread while the writers wait (0.38 CPU-seconds for
/// a 1 GiB cold start on this project's VM, 11% of its samples, before the first chunk was
/// written), so the file is made sparse and its pages are allocated by the `pwrite`s that
/// fill them, on the writers' threads. Running out of space is still an error up front when
/// the tmpfs's free space is short of `len` (a `pwrite` that fails later is an error too: no
/// map is written). Callers creating several files check their sum first ([`check_room`]),
/// as the reservations of the earlier files did.
pub fn create_sized(path: &Path, len: u64) -> Result<File> {
    let f = create_truncated(path)?;
    if len == 0 {
        return Ok(f);
    }
    // Measured after the truncation, so that a file being replaced counts as free space.
    match tmpfs_free_bytes(&f) {
        None => reserve(f, path, len),
        Some(free) if len > free => {
            drop(f);
            let _ = fs::remove_file(path);
            Err(no_room(path, len, free))
        }
        Some(_) => {
            f.set_len(len).map_err(|e| Error::io(path, e))?;
            Ok(f)
        }
    }
}

/// Refuses (ENOSPC) to fill `total` more bytes under `dir` when its file system has less free
/// space (to an unprivileged writer), before any file is created. On a tmpfs the files of a
/// frame or an anchor are each created sparse ([`create_sized`]), so without this check a
/// model twice the free space would pass each file's own check and fill the tmpfs before a
/// write failed. Elsewhere each file's reservation would refuse it too, but only once the
/// files before it had filled the disk, at every poll for as long as the step is the newest
/// (a model the disk cannot hold twice), under the inference server sharing that disk. A file
/// system that reports no blocks at all (a tmpfs without a size limit) is not bounded here.
///
/// A slot removed just before (as every caller does) may not count as free yet on XFS, which
/// frees a removed file's blocks in the background, and btrfs, at its next commit: `statfs`
/// waits for neither (`posix_fallocate` retried after a flush there). On those two a refusal is
/// made only after a `syncfs` of the file system and a second look (ext4 and tmpfs free the
/// blocks at the unlink; a network file system is never flushed from here).
///
/// Root's reserved blocks (ext4) are not counted, although root's own `fallocate` may use
/// them: in a user namespace (a rootless container) it may not, and counting them there would
/// let the earlier files fill the disk again. A refusal says how many bytes are needed.
pub fn check_room(dir: &Path, total: u64) -> Result<()> {
    let Ok(d) = File::open(dir) else { return Ok(()) };
    let Some(st) = statfs(&d) else { return Ok(()) };
    if total <= free_of(&st) {
        return Ok(());
    }
    let st = match st.f_type {
        libc::XFS_SUPER_MAGIC | libc::BTRFS_SUPER_MAGIC => {
            // SAFETY: plain syscall on a descriptor owned by `d`.
            unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&d)) };
            statfs(&d).unwrap_or(st)
        }
        _ => st,
    };
    match free_of(&st) {
        free if total > free => Err(no_room(dir, total, free)),
        _ => Ok(()),
    }
}

/// ENOSPC (not retryable: someone must free space first) with the figures.
fn no_room(path: &Path, need: u64, free: u64) -> Error {
    let msg = format!("No space left on device: {need} bytes needed, {free} free");
    Error::io(path, std::io::Error::new(std::io::ErrorKind::StorageFull, msg))
}

/// The bytes free to an unprivileged writer on `f`'s file system when it is a tmpfs (with no
/// size limit, `size=0`, it reports no blocks at all: then no bound).
fn tmpfs_free_bytes(f: &File) -> Option<u64> {
    statfs(f).filter(|st| st.f_type == libc::TMPFS_MAGIC).map(|st| free_of(&st))
}

fn statfs(f: &File) -> Option<libc::statfs> {
    // SAFETY: `f` is an open descriptor; `st` is written by the call before it is read.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    match unsafe { libc::fstatfs(std::os::fd::AsRawFd::as_raw_fd(f), &mut st) } {
        0 => Some(st),
        _ => None,
    }
}

/// No blocks at all (a tmpfs with `size=0`, some FUSE and network file systems): no bound.
// (`fsblkcnt_t` is 32 bits on some targets.)
#[allow(clippy::unnecessary_cast)]
fn free_of(st: &libc::statfs) -> u64 {
    match st.f_blocks {
        0 => u64::MAX,
        _ => (st.f_bavail as u64).saturating_mul(st.f_bsize as u64),
    }
}

/// Fails unless bytes `[start, start + len)` lie inside tensor `name` of `n` bytes.
fn within(name: &str, n: u64, start: u64, len: u64) -> Result<()> {
    if start.checked_add(len).is_none_or(|e| e > n) {
        return Err(Error::corrupt("delta", format!("range {start}+{len} outside tensor {name} of {n} bytes")));
    }
    Ok(())
}

/// A checkpoint directory opened for block-wise reads and writes with `pread`/`pwrite`, no
/// writable map: the agent's fast path ([`crate::fused::Target::Files`]).
///
/// Why not the writable map: at 1% density every 4 KiB page of a BF16 model changes, so the
/// whole model is dirtied and must reach the disk before the step is announced. Through a
/// shared writable map every page costs a write fault, and starting writeback while other
/// threads still write the map makes the kernel write-protect pages that are mapped writable,
/// a TLB shootdown (an IPI to every core running the pass) per batch; so the map's writeback
/// could only start after the pass, serially (msync). Written with `pwrite`, pages are never
/// mapped writable: a finished range's writeback is started at once ([`Self::start_writeback`])
/// and overlaps the rest of the pass, and the final [`Self::sync`] waits for little.
/// `speed_bench proc` keeps both variants side by side.
#[derive(Debug)]
pub struct CheckpointFiles {
    dir: PathBuf,
    /// (path, file, length)
    files: Vec<(PathBuf, File, u64)>,
    metas: Vec<TensorMeta>,
    /// name -> (file index, absolute byte offset, dtype, byte length)
    tensors: HashMap<String, (usize, u64, DType, u64)>,
    /// One per file, held by this process's writes to it ([`Self::try_write_all_at`]). The
    /// kernel serializes the writes to one file anyway (its inode lock, on tmpfs and ext4
    /// alike), and a writer waiting for it spins on a CPU: 32% of the samples of a slot rebuild
    /// on 2 cores. Known here, a busy file lets a pass hash its next block instead.
    writing: Vec<std::sync::Mutex<()>>,
}

impl CheckpointFiles {
    /// Opens an existing checkpoint directory (or single file) for reading and writing.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(path.as_ref(), true)
    }

    /// Opens an existing checkpoint directory (or single file) for reading only (the source of
    /// a [`crate::fused::Target::Copy`]: the agent's active slot is never opened for writing).
    pub fn open_read_only(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(path.as_ref(), false)
    }

    fn open_with(path: &Path, write: bool) -> Result<Self> {
        let (mut files, mut metas, mut tensors) = (vec![], vec![], HashMap::new());
        for (dir, file) in shard_files(path)? {
            let p = dir.join(&file);
            let f = OpenOptions::new().read(true).write(write).open(&p).map_err(|e| Error::io(&p, e))?;
            // The header is parsed from a read-only map that is dropped right after: parsing
            // checks every offset against the file's length, and touches only the header.
            // SAFETY: the agent owns its directory; nobody else writes these files.
            let map = unsafe { Mmap::map(&f) }.map_err(|e| Error::io(&p, e))?;
            let (data_start, ts, _) = parse_safetensors_header(&map)?;
            let len = map.len() as u64;
            drop(map);
            for (t, r) in ts {
                let at = (data_start + r.start) as u64;
                if tensors.insert(t.name.clone(), (files.len(), at, t.dtype, r.len() as u64)).is_some() {
                    return Err(Error::invalid(format!("tensor {} appears in two shards", t.name)));
                }
                metas.push(t);
            }
            files.push((p, f, len));
        }
        let writing = files.iter().map(|_| std::sync::Mutex::new(())).collect();
        Ok(CheckpointFiles { dir: path.to_path_buf(), files, metas, tensors, writing })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Metadata of all tensors, shard by shard in data order (as [`CheckpointMut::metas`]).
    pub fn metas(&self) -> Vec<TensorMeta> {
        self.metas.clone()
    }

    /// Dtype and byte length of a tensor.
    pub fn info(&self, name: &str) -> Option<(DType, usize)> {
        self.tensors.get(name).map(|&(_, _, dt, len)| (dt, len as usize))
    }

    /// The file and absolute offset of bytes `[start, start + len)` of a tensor, checked.
    fn locate(&self, name: &str, start: u64, len: u64) -> Result<(&Path, &File, u64)> {
        let (f, at, n) = self.entry(name)?;
        within(name, n, start, len)?;
        let (p, file, _) = &self.files[f];
        Ok((p, file, at + start))
    }

    /// (file index, offset in it, byte length) of a tensor.
    fn entry(&self, name: &str) -> Result<(usize, u64, u64)> {
        let &(f, at, _, n) =
            self.tensors.get(name).ok_or_else(|| Error::corrupt("delta", format!("unknown tensor {name}")))?;
        Ok((f, at, n))
    }

    /// Reads bytes `[start, start + buf.len())` of a tensor into `buf`.
    pub fn read_at(&self, name: &str, start: u64, buf: &mut [u8]) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let (p, f, at) = self.locate(name, start, buf.len() as u64)?;
        f.read_exact_at(buf, at).map_err(|e| Error::io(p, e))
    }

    /// Writes `buf` over bytes `[start, start + buf.len())` of a tensor.
    pub fn write_at(&self, name: &str, start: u64, buf: &[u8]) -> Result<()> {
        self.write_all_at(name, &[(start, buf)], true).map(|_| ())
    }

    /// Writes each `(start, bytes)` of `blocks` over those bytes of tensor `name`, in order, as
    /// one holder of the file, only when no other thread of this process is writing the file
    /// (`Ok(false)`: nothing written). Every range is checked before anything is written.
    pub fn try_write_all_at(&self, name: &str, blocks: &[(u64, &[u8])]) -> Result<bool> {
        self.write_all_at(name, blocks, false)
    }

    /// Holds every file as its writer until the guards drop: tests make a pass find its files
    /// busy, so that its blocks are kept and written late.
    #[doc(hidden)]
    pub fn hold_writers(&self) -> Vec<std::sync::MutexGuard<'_, ()>> {
        self.writing.iter().map(|l| l.lock().unwrap_or_else(|e| e.into_inner())).collect()
    }

    /// [`Self::try_write_all_at`], waiting for the file's other writers of this process.
    pub fn write_all_at_waiting(&self, name: &str, blocks: &[(u64, &[u8])]) -> Result<()> {
        self.write_all_at(name, blocks, true).map(|_| ())
    }

    fn write_all_at(&self, name: &str, blocks: &[(u64, &[u8])], wait: bool) -> Result<bool> {
        use std::os::unix::fs::FileExt;
        // One lookup of the tensor for all the blocks (a string hash each), ranges checked
        // against it before anything is written.
        let (fi, base, n) = self.entry(name)?;
        for (start, b) in blocks {
            within(name, n, *start, b.len() as u64)?;
        }
        let lock = &self.writing[fi];
        // A writer that panicked left nothing to protect: the lock only orders writers.
        let _held = match lock.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) if !wait => return Ok(false),
            Err(std::sync::TryLockError::WouldBlock) => lock.lock().unwrap_or_else(|e| e.into_inner()),
        };
        let (p, f, _) = &self.files[fi];
        for (start, b) in blocks {
            f.write_all_at(b, base + start).map_err(|e| Error::io(p, e))?;
        }
        Ok(true)
    }

    /// Starts writing bytes `[start, start + len)` of a tensor back to disk
    /// (`sync_file_range(SYNC_FILE_RANGE_WRITE)`: asynchronous, waits for nothing). Best effort:
    /// durability comes from [`Self::sync`], whose errors are the ones that count.
    pub fn start_writeback(&self, name: &str, start: u64, len: u64) {
        if let Ok((_, f, at)) = self.locate(name, start, len) {
            start_writeback(f, at, len);
        }
    }

    /// Makes every write durable (`fdatasync` of each file).
    pub fn sync(&self) -> Result<()> {
        for (p, f, _) in &self.files {
            f.sync_data().map_err(|e| Error::io(p, e))?;
        }
        Ok(())
    }

    /// Creates directory `to` as the frame of a copy of this checkpoint, for a pass that reads
    /// this one and writes the copy ([`crate::fused::Target::Copy`]): every shard file
    /// allocated at its size with every byte outside the tensors (header, gaps) copied, every
    /// other file of the directory (index, configuration) copied whole. The tensor bytes are
    /// left for the pass: the model is read once and written once, no separate copy.
    pub fn frame_copy(&self, to: &Path) -> Result<CheckpointFiles> {
        use std::os::unix::fs::FileExt;
        fs::create_dir_all(to).map_err(|e| Error::io(to, e))?;
        check_room(to, self.files.iter().map(|(_, _, len)| *len).fold(0u64, u64::saturating_add))?;
        let mut shard_names = std::collections::HashSet::new();
        for (i, (p, f, len)) in self.files.iter().enumerate() {
            let name = p.file_name().ok_or_else(|| Error::invalid(format!("{}: no file name", p.display())))?;
            shard_names.insert(name.to_os_string());
            let dst_path = to.join(name);
            let dst = create_sized(&dst_path, *len)?;
            let mut ranges: Vec<(u64, u64)> =
                self.tensors.values().filter(|t| t.0 == i).map(|&(_, at, _, n)| (at, at + n)).collect();
            ranges.sort_unstable();
            let copy = |a: u64, b: u64| -> Result<()> {
                let mut buf = vec![0u8; (b - a) as usize];
                f.read_exact_at(&mut buf, a).map_err(|e| Error::io(p, e))?;
                dst.write_all_at(&buf, a).map_err(|e| Error::io(&dst_path, e))
            };
            let mut at = 0u64;
            for (a, b) in ranges.into_iter().chain([(*len, *len)]) {
                if a > at {
                    copy(at, a)?;
                }
                at = at.max(b);
            }
        }
        if self.dir.is_dir() {
            for e in fs::read_dir(&self.dir).map_err(|e| Error::io(&self.dir, e))? {
                let e = e.map_err(|e| Error::io(&self.dir, e))?;
                let is_file = e.file_type().map_err(|err| Error::io(e.path(), err))?.is_file();
                if is_file && !shard_names.contains(&e.file_name()) {
                    fs::copy(e.path(), to.join(e.file_name())).map_err(|err| Error::io(e.path(), err))?;
                }
            }
        }
        CheckpointFiles::open(to)
    }

    /// Creates directory `to` as the frame of a checkpoint with another `layout`, for a pass
    /// that reads this one and writes the new one ([`crate::fused::Target::Copy`]; a delta
    /// that adds, removes, reshapes or retypes tensors): every shard file of `layout`
    /// allocated at its size with its header written, the index written when there are
    /// several shards, and every other file of this directory (configuration, tokenizer)
    /// copied, except this layout's shard files and index. Tensor bytes are left for the pass.
    pub fn frame_layout(&self, to: &Path, layout: &Layout) -> Result<CheckpointFiles> {
        use std::os::unix::fs::FileExt;
        layout.validate()?;
        fs::create_dir_all(to).map_err(|e| Error::io(to, e))?;
        // (header, file length) of each shard.
        let mut shards = Vec::with_capacity(layout.shards.len());
        for s in &layout.shards {
            let (header, ranges) = Layout::shard_header(s)?;
            let len = header.len() as u64 + ranges.last().map(|r| r.end).unwrap_or(0);
            shards.push((header, len));
        }
        check_room(to, shards.iter().map(|(_, len)| *len).fold(0u64, u64::saturating_add))?;
        let mut skip: std::collections::HashSet<std::ffi::OsString> =
            self.files.iter().filter_map(|(p, _, _)| p.file_name().map(|n| n.to_os_string())).collect();
        skip.insert(INDEX_FILE.into());
        for (s, (header, len)) in layout.shards.iter().zip(&shards) {
            skip.insert(s.file.clone().into());
            let p = to.join(&s.file);
            let f = create_sized(&p, *len)?;
            f.write_all_at(header, 0).map_err(|e| Error::io(&p, e))?;
        }
        write_index(to, layout)?;
        if self.dir.is_dir() {
            for e in fs::read_dir(&self.dir).map_err(|e| Error::io(&self.dir, e))? {
                let e = e.map_err(|e| Error::io(&self.dir, e))?;
                let is_file = e.file_type().map_err(|err| Error::io(e.path(), err))?.is_file();
                // Weights files are the layout's alone (see `validate_extra_file_name`).
                let weights = e.file_name().to_string_lossy().ends_with(".safetensors");
                if is_file && !weights && !skip.contains(&e.file_name()) {
                    fs::copy(e.path(), to.join(e.file_name())).map_err(|err| Error::io(e.path(), err))?;
                }
            }
        }
        CheckpointFiles::open(to)
    }
}

/// A checkpoint directory mapped writable.
pub struct CheckpointMut {
    dir: PathBuf,
    shards: Vec<ShardMut>,
}

impl CheckpointMut {
    /// Maps an existing checkpoint directory (or single file) writable, for in-place apply.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let mut shards = vec![];
        for (dir, file) in shard_files(path)? {
            let p = dir.join(&file);
            let f = OpenOptions::new().read(true).write(true).open(&p).map_err(|e| Error::io(&p, e))?;
            // SAFETY: the agent owns its directory; nobody else writes these files.
            let map = unsafe { MmapMut::map_mut(&f) }.map_err(|e| Error::io(&p, e))?;
            let (data_start, tensors, _) = parse_safetensors_header(&map)?;
            shards.push(ShardMut { path: p, map, data_start, tensors });
        }
        Ok(CheckpointMut { dir: path.to_path_buf(), shards })
    }

    /// Creates `dir` (if needed) with one zero-filled, correctly sized safetensors file per
    /// shard of `layout` (headers written, data zero) and the index file, mapped writable.
    pub fn create(dir: impl AsRef<Path>, layout: &Layout) -> Result<Self> {
        let dir = dir.as_ref();
        layout.validate()?;
        fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let mut shards = vec![];
        for s in &layout.shards {
            let (header, ranges) = Layout::shard_header(s)?;
            let total = header.len() as u64 + ranges.last().map(|r| r.end).unwrap_or(0);
            let p = dir.join(&s.file);
            let f = allocate_file(&p, total)?;
            // SAFETY: freshly created file owned by us.
            let mut map = unsafe { MmapMut::map_mut(&f) }.map_err(|e| Error::io(&p, e))?;
            map[..header.len()].copy_from_slice(&header);
            let tensors =
                s.tensors.iter().cloned().zip(ranges.into_iter().map(|r| r.start as usize..r.end as usize)).collect();
            shards.push(ShardMut { path: p, map, data_start: header.len(), tensors });
        }
        write_index(dir, layout)?;
        Ok(CheckpointMut { dir: dir.to_path_buf(), shards })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writable views of all tensors.
    pub fn tensors_mut(&mut self) -> TensorsMut<'_> {
        let mut tm = TensorsMut::new();
        for s in &mut self.shards {
            let base = s.data_start;
            let ptr = s.map.as_mut_ptr();
            for (t, r) in &s.tensors {
                // SAFETY: each tensor range lies inside the map (checked by the header parser)
                // and tensor ranges of one file do not overlap (checked by safetensors).
                let sl = unsafe { std::slice::from_raw_parts_mut(ptr.add(base + r.start), r.len()) };
                tm.insert(&t.name, t.dtype, sl);
            }
        }
        tm
    }

    /// Read-only views of all tensors (for hashing after apply).
    pub fn views(&self) -> Vec<TensorView<'_>> {
        self.shards.iter().flat_map(|s| shard_views(&s.map, s.data_start, &s.tensors)).collect()
    }

    /// Metadata of all tensors, shard by shard in data order (the order of [`Self::views`]).
    pub fn metas(&self) -> Vec<TensorMeta> {
        self.shards.iter().flat_map(|s| s.tensors.iter().map(|(t, _)| t.clone())).collect()
    }

    /// The layout of the mapped files.
    pub fn layout_tensors(&self) -> Vec<Vec<TensorMeta>> {
        self.shards.iter().map(|s| s.tensors.iter().map(|(t, _)| t.clone()).collect()).collect()
    }

    /// Flushes every map to disk (msync) so a crash after this point keeps the writes.
    pub fn flush(&self) -> Result<()> {
        for s in &self.shards {
            s.map.flush().map_err(|e| Error::io(&s.path, e))?;
        }
        Ok(())
    }
}
