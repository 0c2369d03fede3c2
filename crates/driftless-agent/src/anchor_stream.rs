//! Streaming an anchor out of the bucket ([`stream_anchor`]), shared by the agent (into files
//! of its work slot) and the Python `Follower` (into the caller's arrays). Shards stream side by
//! side, sharing the parts in flight ([`share_parts`]); each one: its header (which says how the
//! encoder cut the file), its table, then one ranged GET per chunk (16 MiB of decoded bytes),
//! its share of the parts in flight, each decoded into its byte planes on the blocking pool and
//! handed to a [`ShardSink`] in pieces of 1 MiB, interleaved from the planes on all cores (a
//! chunk's decoded bytes are never held whole). Memory is bounded by the parts in flight (each
//! its stored bytes and its planes), whatever the model's size.
//!
//! Checking: with signed parts (`AnchorShardRef::parts`, what publishers write now), every
//! range fetched is exactly one part, checked against its SHA-256 as it arrives (a chunk's
//! beside its decode, on a thread of its own), and nothing from it reaches a sink before that
//! check passed; every part must have been checked once. Without them (manifests of older
//! publishers) the object's SHA-256 is computed over the parts in order, on a thread of its
//! own, and checked at the end: a sink then receives bytes before that check. Either way a
//! sink must write only where nothing is trusted until a weights root is verified. Shards of a
//! plain-safetensors anchor stream the same way, without the decoding.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use driftless_format::checkpoint::parse_safetensors_head;
use driftless_format::manifest::{AnchorEncoding, AnchorShardRef, StepKind};
use driftless_format::slice::{self, PartDigest};
use driftless_format::{anchor, hash, Digest, TensorMeta};
use driftless_store::stream::StreamError;
use driftless_store::Bucket;
use futures::{StreamExt, TryStreamExt};

use crate::agent::corrupt;
use crate::{Error, Result};

/// Where the decoded bytes of a shard go.
///
/// [`stream_anchor`] returns, with its result or its first error, only once every write it
/// started has finished: a sink may borrow memory for the duration of the call. (Its future
/// must then be run to completion: dropped early, decode tasks already on the blocking pool
/// finish on their own; they check a stop flag before writing, which narrows but cannot close
/// that window.)
pub trait ShardSink: Send + Sync + 'static {
    /// Bytes `[at, at + bytes.len())` of the decoded shard file (a safetensors file). The
    /// header comes first, alone, at 0; then every other byte once, from blocking and rayon
    /// threads, in any order, never overlapping: a byte-plane chunk in pieces of at most 1 MiB
    /// (on the weights-root hash's chunk grid), a plain anchor's 16 MiB parts whole.
    fn write_at(&self, at: u64, bytes: &[u8]) -> Result<()>;

    /// Called once every byte of the shard was written and its object checked (never after
    /// an error): what a sink kept per part can be settled now rather than when the whole
    /// anchor is done (shards stream side by side).
    fn finish(&self) -> Result<()> {
        Ok(())
    }
}

/// A decoded shard file (a file of the agent's work slot; the Python `Follower`'s spool of a
/// proven anchor), created at the shard's decoded size on the header's write
/// ([`driftless_format::checkpoint::create_sized`]: blocks reserved, except on a tmpfs)
/// (so that a missing object is reported as such, before any disk space is taken). With
/// `writeback`, each write's writeback is started at once (`sync_file_range`, asynchronous),
/// so that the disk writes while the stream goes on and the fsync before the state is written
/// waits for the tail only.
pub struct FileSink {
    path: std::path::PathBuf,
    size: u64,
    file: std::sync::OnceLock<std::fs::File>,
    writeback: bool,
    /// Lives as long as the sink (held by writes on the blocking pool): the agent's share of
    /// its directory lock ([`crate::state::AgentDir::guard`]).
    keep: Option<crate::state::DirGuard>,
}

impl FileSink {
    /// `writeback`: start each write's writeback at once (when the anchor is the result: with
    /// deltas after it, the pass rewrites every page, so writing them back now would write
    /// the model twice and make the pass wait for pages under writeback).
    pub fn new(path: std::path::PathBuf, size: u64, writeback: bool) -> Self {
        FileSink { path, size, file: std::sync::OnceLock::new(), writeback, keep: None }
    }

    /// Holds `guard` for as long as the sink lives.
    pub fn holding(mut self, guard: crate::state::DirGuard) -> Self {
        self.keep = Some(guard);
        self
    }
}

impl ShardSink for FileSink {
    fn write_at(&self, at: u64, bytes: &[u8]) -> Result<()> {
        let file = match self.file.get() {
            Some(f) => f,
            None => {
                // The header's write: it comes alone, before any chunk's.
                let f = driftless_format::checkpoint::create_sized(&self.path, self.size)?;
                self.file.get_or_init(|| f)
            }
        };
        std::os::unix::fs::FileExt::write_all_at(file, bytes, at)?;
        if self.writeback {
            driftless_format::checkpoint::start_writeback(file, at, bytes.len() as u64);
        }
        Ok(())
    }
}

/// The tensors of a streamed shard file as its header places them, for sinks that route each
/// decoded chunk to tensors ([`Hashing`], the Python `Follower`'s arrays).
#[derive(Debug)]
pub struct ShardTensors {
    /// (tensor, start, end) in the file, in data order: they tile the data exactly (checked
    /// by [`parse_safetensors_head`]).
    tensors: Vec<(TensorMeta, u64, u64)>,
}

impl ShardTensors {
    /// Parses the header's write (the first bytes of a file of `size` bytes).
    pub fn parse(head: &[u8], size: u64) -> Result<Self> {
        let (start, ts, _) = parse_safetensors_head(head, size)?;
        let tensors = ts.into_iter().map(|(m, r)| (m, (start + r.start) as u64, (start + r.end) as u64)).collect();
        Ok(ShardTensors { tensors })
    }

    /// (tensor, start, end) in the file, in data order.
    pub fn tensors(&self) -> &[(TensorMeta, u64, u64)] {
        &self.tensors
    }

    /// The tensors a write of `[at, end)` covers: (index, `[lo, hi)` of the write inside the
    /// tensor, in file offsets), found by binary search (a hostile header may list millions
    /// of tensors).
    pub fn overlaps(&self, at: u64, end: u64) -> impl Iterator<Item = (usize, u64, u64)> + '_ {
        let first = self.tensors.partition_point(|(_, _, b)| *b <= at);
        self.tensors[first..]
            .iter()
            .enumerate()
            .take_while(move |(_, (_, a, _))| *a < end)
            .map(move |(i, (_, a, b))| (first + i, (*a).max(at), (*b).min(end)))
            .filter(|(_, lo, hi)| lo < hi)
    }
}

/// The tensors of a sink's shard, set by the header's write (which comes alone, at 0, before
/// any chunk's, or with the whole file); an error for data before it, and for a chunk that
/// starts inside the header.
pub fn shard_tensors<'a>(
    cell: &'a OnceLock<ShardTensors>,
    at: u64,
    bytes: &[u8],
    size: u64,
) -> Result<&'a ShardTensors> {
    match cell.get() {
        Some(t) if t.tensors.first().is_some_and(|(_, a, _)| at < *a) => {
            Err(corrupt("anchor shard", "a part inside the header"))
        }
        Some(t) => Ok(t),
        None if at == 0 => {
            let t = ShardTensors::parse(bytes, size)?;
            Ok(cell.get_or_init(|| t))
        }
        None => Err(corrupt("anchor shard", "data before the header")),
    }
}

/// Wraps a sink and computes the weights-root digest of every tensor of the shard from the
/// bytes as they pass (each write hashed on the thread that makes it, while it is in cache:
/// a byte-plane chunk's 1 MiB pieces on the rayon pool), so that a verified cold start never
/// reads the model back: per write and tensor a
/// [`slice::part_digest`] (chunk and leaf digests, the bytes of at most two partial leaves),
/// stitched by [`slice::assemble`] at the end, as the sharded commit does with ranks' parts.
pub struct Hashing<S> {
    inner: S,
    size: u64,
    /// From the header.
    tensors: OnceLock<ShardTensors>,
    parts: Mutex<Vec<(usize, PartDigest)>>,
    /// Bytes the parts keep (partial leaves, leaf digests), bounded by [`MAX_KEPT`].
    kept: std::sync::atomic::AtomicU64,
    /// The digests, once [`ShardSink::finish`] assembled them (the parts are dropped then).
    done: Mutex<Option<Vec<(TensorMeta, Digest)>>>,
}

impl<S: ShardSink> Hashing<S> {
    /// Hashes what goes to `inner`, a shard file of `size` decoded bytes.
    pub fn new(inner: S, size: u64) -> Self {
        Hashing {
            inner,
            size,
            tensors: OnceLock::new(),
            parts: Mutex::default(),
            kept: Default::default(),
            done: Mutex::default(),
        }
    }

    /// The digest of every tensor of the shard (in header order), once every byte passed.
    /// An error when the parts do not cover a tensor exactly (a stream that did not finish).
    pub fn digests(&self) -> Result<Vec<(TensorMeta, Digest)>> {
        if let Some(d) = self.done.lock().expect("digests lock").take() {
            return Ok(d);
        }
        self.assemble()
    }

    fn assemble(&self) -> Result<Vec<(TensorMeta, Digest)>> {
        let tensors = self.tensors.get().ok_or_else(|| corrupt("anchor shard", "no header"))?.tensors();
        let mut by: Vec<Vec<PartDigest>> = vec![vec![]; tensors.len()];
        for (t, p) in std::mem::take(&mut *self.parts.lock().expect("parts lock")) {
            by[t].push(p);
        }
        tensors
            .iter()
            .zip(by)
            .map(|((m, a, b), parts)| {
                let len = b - a;
                let chunks = if len == 0 { vec![] } else { slice::assemble(len, &parts)? };
                Ok((m.clone(), hash::finish_tensor(&m.name, m.dtype, &m.shape, len, &chunks)))
            })
            .collect()
    }
}

impl<S: ShardSink> ShardSink for Hashing<S> {
    fn write_at(&self, at: u64, bytes: &[u8]) -> Result<()> {
        let end = at.checked_add(bytes.len() as u64).filter(|&e| e <= self.size);
        let end = end.ok_or_else(|| corrupt("anchor shard", "a part beyond the shard"))?;
        // Before the inner sink writes anything: a chunk inside the header is refused.
        let tensors = shard_tensors(&self.tensors, at, bytes, self.size)?;
        self.inner.write_at(at, bytes)?;
        let mut mine = vec![];
        let mut kept = 0u64;
        for (i, lo, hi) in tensors.overlaps(at, end) {
            let (_, a, b) = &tensors.tensors()[i];
            let part = slice::part_digest(b - a, lo - a, &bytes[(lo - at) as usize..(hi - at) as usize])?;
            kept += (part.head.len() + part.tail.len()) as u64
                + 32 * (part.head_leaves.len() + part.tail_leaves.len()) as u64;
            mine.push((i, part));
        }
        // An honest plan cuts tensors on chunk boundaries, so parts keep next to nothing; a
        // hostile one cut off the leaf grid could make every byte a partial leaf.
        if self.kept.fetch_add(kept, std::sync::atomic::Ordering::Relaxed) + kept > MAX_KEPT {
            return Err(corrupt("anchor shard", "parts not cut on leaf boundaries"));
        }
        self.parts.lock().expect("parts lock").extend(mine);
        Ok(())
    }

    fn finish(&self) -> Result<()> {
        let d = self.assemble()?;
        *self.done.lock().expect("digests lock") = Some(d);
        self.inner.finish()
    }
}

/// `sink` for [`ShardJob::sink`], wrapped in a [`Hashing`] when `hash` (the anchor is the
/// result, checked alone), whose handle is kept in `hashing` for [`digests_of`].
pub fn hashed<S: ShardSink>(sink: S, size: u64, hash: bool, hashing: &mut Vec<Arc<Hashing<S>>>) -> Arc<dyn ShardSink> {
    if !hash {
        return Arc::new(sink);
    }
    let h = Arc::new(Hashing::new(sink, size));
    hashing.push(h.clone());
    h
}

/// The digests of every tensor of the shards [`hashed`] kept, in shard order, once
/// [`stream_anchor`] returned.
pub fn digests_of<S: ShardSink>(hashing: Vec<Arc<Hashing<S>>>) -> Result<Vec<(TensorMeta, Digest)>> {
    let mut out = vec![];
    for h in hashing {
        out.extend(h.digests()?);
    }
    Ok(out)
}

/// Bytes of partial leaves and leaf digests a [`Hashing`] keeps for one shard at most (until
/// the shard is finished; a hostile plan can make every shard streaming at once keep that).
const MAX_KEPT: u64 = 64 << 20;

/// Set on the first error of any shard and when [`stream_anchor`]'s future is dropped: parts
/// not yet fetched are skipped, decodes not yet written are not written, shards not yet
/// started are not started.
struct Stop(Arc<AtomicBool>);

impl Drop for Stop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// One shard of an anchor for [`stream_anchor`]: its manifest entry, the signed layout's
/// tensors of the shard (which its header must list), and where its decoded bytes go.
pub struct ShardJob<'a> {
    /// The signed manifest's entry of the shard.
    pub object: &'a AnchorShardRef,
    /// The signed layout's tensors of the shard.
    pub tensors: &'a [driftless_format::TensorMeta],
    /// Where its decoded bytes go.
    pub sink: Arc<dyn ShardSink>,
    /// Its object's size was checked just before ([`check_sizes`]): the stream does not HEAD
    /// it again. Otherwise it does, before any ranged read.
    pub sized: bool,
}

/// How `parts` in flight are shared by an anchor of `shards` shards: (shards streamed at once,
/// parts in flight for each): two parts each (one fetched and decoded while the one before it
/// is written; without signed parts, one more is hashed by the object's SHA-256, a serial
/// stream of about 1 GB/s), and the memory bound stays `parts` parts whatever the split.
pub fn share_parts(parts: usize, shards: usize) -> (usize, usize) {
    let parts = parts.max(1);
    let at_once = (parts / 2).clamp(1, shards.max(1));
    (at_once, (parts / at_once).max(1))
}

/// Streams every shard of anchor `step` (`encoding` says how its objects are stored) into its
/// sink, [`share_parts`] of `parts` at once (a shard starts as soon as one ends, in any
/// order); returns the bytes read. Each shard's sink is finished ([`ShardSink::finish`]) as
/// soon as its object is checked. On the first error, the shards not yet started are not, the
/// others stop at their next part, every write in flight is waited for, and the first error
/// to come back is returned: a shard stopped by another's error reports nothing of its own,
/// so a missing object is never reported as a mismatch.
pub async fn stream_anchor(
    bucket: &Bucket,
    step: u64,
    encoding: AnchorEncoding,
    jobs: Vec<ShardJob<'_>>,
    parts: usize,
) -> Result<u64> {
    let (at_once, each) = share_parts(parts, jobs.len());
    let stop = Stop(Arc::default());
    let flag = &stop.0;
    // The futures made first, then buffered (a stream mapping with a closure over borrows
    // makes the caller's future not `Send` for every lifetime, which spawning it needs).
    let futures: Vec<_> = jobs.into_iter().map(|j| stream_job(bucket, step, encoding, j, each, flag)).collect();
    let mut results = futures::stream::iter(futures).buffer_unordered(at_once);
    // Dropped before `results` when this future is dropped: decodes still running on the
    // blocking pool see the flag before they write.
    let _stop_first = Stop(flag.clone());
    // Every shard's future runs to its end (none is dropped with writes in flight).
    let (mut bytes, mut first_err, mut stopped) = (0u64, None, false);
    while let Some(r) = results.next().await {
        match r {
            Ok(Some(n)) => bytes = bytes.saturating_add(n),
            Ok(None) => stopped = true,
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    match (first_err, stopped) {
        (Some(e), _) => Err(e),
        // Only an error sets the flag while this future lives.
        (None, true) => Err(Error::Io(std::io::Error::other("anchor stream stopped without an error"))),
        (None, false) => Ok(bytes),
    }
}

/// One shard of [`stream_anchor`].
async fn stream_job(
    bucket: &Bucket,
    step: u64,
    encoding: AnchorEncoding,
    j: ShardJob<'_>,
    each: usize,
    flag: &Arc<AtomicBool>,
) -> Result<Option<u64>> {
    if flag.load(Ordering::SeqCst) {
        return Ok(None);
    }
    let r = match encoding {
        AnchorEncoding::PlanesZstd => stream_shard(bucket, step, &j, each, flag).await,
        AnchorEncoding::Safetensors => stream_plain(bucket, step, &j, each, flag).await,
    };
    match r {
        Ok(Some(_)) => {
            if let Err(e) = j.sink.finish() {
                flag.store(true, Ordering::SeqCst);
                return Err(e);
            }
        }
        Ok(None) => {}
        Err(_) => flag.store(true, Ordering::SeqCst),
    }
    r
}

/// Streams shard `o` of anchor `step` into `sink` (see the module docs), `parts` chunks in
/// flight; `tensors` are the signed layout's tensors of the shard, which its header must list.
/// Returns the bytes read, or `None` when `stop` was set by another shard's stream (what was
/// hashed is then incomplete, and nothing is said about this shard).
async fn stream_shard(
    bucket: &Bucket,
    step: u64,
    job: &ShardJob<'_>,
    parts: usize,
    stop: &Arc<AtomicBool>,
) -> Result<Option<u64>> {
    let ShardJob { object: o, tensors, sized, .. } = *job;
    let sink = job.sink.clone();
    use sha2::Digest as _;
    if o.decoded_size > anchor::MAX_SHARD {
        return Err(corrupt("anchor manifest", "shard too large"));
    }
    let key = driftless_store::layout::object(StepKind::Anchor, step, &o.object.object);
    let size = o.object.size;
    if size < 48 {
        return Err(corrupt("anchor shard", "truncated"));
    }
    let bucket = bucket.clone();
    if !sized {
        check_size(&bucket, step, &key, size).await?;
    }
    let signed = Signed::of(&key, o)?;
    let (prefix, hz, head, plan, table, footer) = match &signed {
        Some(s) => plan_signed(&bucket, &key, o, tensors, s).await?,
        None => plan_unsigned(&bucket, &key, o, tensors).await?,
    };
    // Another shard failed meanwhile: no file is allocated for a load already failing.
    if stop.load(Ordering::SeqCst) {
        return Ok(None);
    }
    sink.write_at(0, &head)?;
    // Plane buffers of the chunk decoders (16 MiB each per part in flight; the decoded bytes
    // are interleaved from them a piece at a time), reused from chunk to chunk so their pages
    // are faulted in once.
    let pool: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    // Without signed parts, one SHA-256 over the object in order.
    let sha = signed.is_none().then(|| {
        let mut sha = sha2::Sha256::new();
        sha.update(&prefix);
        sha.update(&hz);
        sha
    });
    let chunks = futures::stream::iter(plan.chunks).map(|c| {
        let (bucket, key, sink, pool, stop) = (bucket.clone(), key.clone(), sink.clone(), &pool, stop.clone());
        let signed = signed.clone();
        async move {
            if stop.load(Ordering::SeqCst) {
                return Ok(Bytes::new());
            }
            let b = bucket.get_range_of(&key, c.stored.clone()).await?;
            let stored = b.clone();
            let pool = pool.clone();
            let checked = signed.is_some();
            tokio::task::spawn_blocking(move || -> Result<()> {
                // At most `parts` decodes run at once, so the pool never holds more
                // buffers than that.
                let mut scratch = pool.lock().expect("buffer pool").pop().unwrap_or_default();
                let (chunk, bytes, buf) = (&c, &stored, &mut scratch);
                let decode = move || {
                    let buf = buf; // moved: the planes borrow it past the call
                    anchor::decode_chunk_planes(chunk, bytes, buf)
                };
                // A signed part is checked beside its decode, on a thread of its own (its
                // SHA-256 is serial: before the decode, it made each part's turn that much
                // longer; in the shared pool, it queued behind the hashing), and nothing
                // decoded from it is written before the check passed. The decoder takes
                // any bytes, bounded, as it does without signed parts.
                let (checked, decoded) = match &signed {
                    Some(s) => std::thread::scope(|sc| {
                        let check = || s.check(c.stored.clone(), &stored);
                        match std::thread::Builder::new().spawn_scoped(sc, check) {
                            Ok(h) => {
                                let d = decode();
                                let checked = h.join().unwrap_or_else(|_| {
                                    Err(Error::Io(std::io::Error::other("part check thread panicked")))
                                });
                                (checked, Some(d))
                            }
                            // No thread to be had: checked first, then decoded.
                            Err(_) => match check() {
                                Ok(()) => (Ok(()), Some(decode())),
                                Err(e) => (Err(e), None),
                            },
                        }
                    }),
                    None => (Ok(()), Some(decode())),
                };
                let r = checked.and_then(|()| match decoded {
                    // `write_pieces` checks `stop` before each piece.
                    Some(Ok(planes)) => write_pieces(&*sink, c.out.start, &planes, &stop),
                    Some(Err(e)) => Err(e.into()),
                    None => Ok(()),
                });
                pool.lock().expect("buffer pool").push(scratch);
                r
            })
            .await
            .map_err(|e| Error::Io(std::io::Error::other(format!("decode task: {e}"))))??;
            // Checked parts are not hashed again.
            Ok::<Bytes, Error>(if checked { Bytes::new() } else { b })
        }
    });
    let sha = drain(in_flight(chunks, signed.is_none(), parts), sha, parts, stop).await?;
    if stop.load(Ordering::SeqCst) {
        return Ok(None);
    }
    object_checked(sha, &[&table, &footer], signed.as_deref(), o, &key)?;
    Ok(Some(size))
}

/// The end of a shard object's check: without signed parts, the object's SHA-256 over what
/// [`drain`] took and `rest` (the bytes after the last part), against the manifest's; with
/// them, every part checked.
fn object_checked(
    sha: Option<sha2::Sha256>,
    rest: &[&[u8]],
    signed: Option<&Signed>,
    o: &AnchorShardRef,
    key: &str,
) -> Result<()> {
    use sha2::Digest as _;
    match (sha, signed) {
        (Some(mut sha), _) => {
            rest.iter().for_each(|b| sha.update(b));
            match Digest(sha.finalize().into()) == o.object.sha256 {
                true => Ok(()),
                false => Err(mismatch(key)),
            }
        }
        (None, Some(s)) => s.all_checked(),
        (None, None) => Err(Error::Io(std::io::Error::other("neither a SHA-256 nor signed parts checked the object"))),
    }
}

/// Writes a decoded chunk (at `at` in its shard file) to `sink` a piece at a time, the pieces
/// on all cores, each interleaved from the planes into a buffer its thread keeps: the chunk's
/// decoded bytes are never held whole, and a piece is still in cache when the sink writes it
/// and [`Hashing`] hashes it. A piece is one chunk of the weights-root hash
/// ([`hash::CHUNK`], a multiple of every element width): a chunk of the anchor starts on a
/// multiple of 16 MiB of its tensor, so pieces fall on the hash's grid and leave no partial
/// leaves to keep.
///
/// `stop` is checked before each piece: a chunk that started writing when another shard
/// failed (or the stream was dropped) writes no more of its pieces than were under way.
fn write_pieces(sink: &dyn ShardSink, at: u64, planes: &anchor::ChunkPlanes, stop: &AtomicBool) -> Result<()> {
    use rayon::prelude::*;
    thread_local! {
        static PIECE: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
    }
    let piece = hash::CHUNK / planes.width() * planes.width();
    (0..planes.len().div_ceil(piece)).into_par_iter().try_for_each(|i| {
        if stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        let a = i * piece;
        let n = piece.min(planes.len() - a);
        // Taken, not borrowed: a sink that waits on the pool may run another piece on this
        // thread meanwhile, which then finds no buffer and makes one.
        let mut buf = PIECE.take();
        if buf.len() < n {
            buf.resize(n, 0);
        }
        planes.interleave(a, &mut buf[..n]);
        let r = sink.write_at(at + a as u64, &buf[..n]);
        PIECE.set(buf);
        r
    })
}

/// The pieces of a byte-plane shard a stream needs before its chunks: (prefix, compressed
/// header, decoded header, plan, table, footer).
type Planned = (Bytes, Bytes, Vec<u8>, anchor::ShardPlan, Bytes, Bytes);

/// [`Planned`] of a shard without signed parts: ranged GETs of the object's footer and
/// prefix, its header (which says how the encoder cut the file), its table, all checked only
/// by the object's SHA-256 once every part was read.
async fn plan_unsigned(
    bucket: &Bucket,
    key: &str,
    o: &AnchorShardRef,
    tensors: &[driftless_format::TensorMeta],
) -> Result<Planned> {
    let size = o.object.size;
    let (footer, prefix) = futures::try_join!(
        bucket.get_range_of(key, size - anchor::FOOTER_LEN..size),
        bucket.get_range_of(key, 0..anchor::PREFIX_LEN)
    )?;
    // The header first (bounded as a safetensors header): it says how the encoder cut the
    // file, and the table must be exactly that (the object's SHA-256 is only known once it has
    // all been read, one ranged GET per chunk).
    let (hr, header_len) = anchor::header_range(&prefix, o.decoded_size, size)?;
    let hz = bucket.get_range_of(key, hr).await?;
    let mut head = vec![0u8; header_len as usize];
    anchor::decode_header(&hz, &mut head)?;
    let cuts = anchor::shard_cuts(&head, o.decoded_size, Some(tensors))?;
    let tr = anchor::table_range(&prefix, &cuts, &footer, size, o.decoded_size)?;
    let table = match tr.is_empty() {
        true => Bytes::new(),
        false => bucket.get_range_of(key, tr).await?,
    };
    let plan = anchor::plan_shard(&prefix, &cuts, &table, &footer, size, o.decoded_size)?;
    Ok((prefix, hz, head, plan, table, footer))
}

/// [`Planned`] of a shard with signed parts ([`anchor::part_ranges`]): the first part (the
/// prefix and the compressed header) and the last (the table and the footer), each bounded
/// before it is fetched and checked before it is read; then every chunk must be one part.
async fn plan_signed(
    bucket: &Bucket,
    key: &str,
    o: &AnchorShardRef,
    tensors: &[driftless_format::TensorMeta],
    signed: &Arc<Signed>,
) -> Result<Planned> {
    let size = o.object.size;
    let first = signed.range(0);
    if first.end < anchor::PREFIX_LEN || first.end > anchor::head_part_bound(o.decoded_size) {
        return Err(signed.bad("its first part is not a prefix and a header"));
    }
    let head_part = checked_get(bucket, key, first, signed).await?;
    let prefix = head_part.slice(..anchor::PREFIX_LEN as usize);
    let (hr, header_len) = anchor::header_range(&prefix, o.decoded_size, size)?;
    if hr.end != head_part.len() as u64 {
        return Err(signed.bad("its first part is not the prefix and the header"));
    }
    let hz = head_part.slice(hr.start as usize..);
    let mut head = vec![0u8; header_len as usize];
    anchor::decode_header(&hz, &mut head)?;
    let cuts = anchor::shard_cuts(&head, o.decoded_size, Some(tensors))?;
    // The table and footer: exactly what the encoder writes for these cuts.
    let n = signed.len();
    let last = signed.range(n - 1);
    if n != cuts.len() + 2 || last.end - last.start != cuts.table_len() + anchor::FOOTER_LEN {
        return Err(signed.bad("its parts are not its chunks"));
    }
    let tail = checked_get(bucket, key, last, signed).await?;
    let (table, footer) = (
        tail.slice(..tail.len() - anchor::FOOTER_LEN as usize),
        tail.slice(tail.len() - anchor::FOOTER_LEN as usize..),
    );
    let plan = anchor::plan_shard(&prefix, &cuts, &table, &footer, size, o.decoded_size)?;
    Ok((prefix, hz, head, plan, table, footer))
}

/// Range `r` of `key`, checked against its signed part on the blocking pool.
async fn checked_get(bucket: &Bucket, key: &str, r: std::ops::Range<u64>, signed: &Arc<Signed>) -> Result<Bytes> {
    let b = bucket.get_range_of(key, r.clone()).await?;
    let (s, c) = (signed.clone(), b.clone());
    tokio::task::spawn_blocking(move || s.check(r, &c))
        .await
        .map_err(|e| Error::Io(std::io::Error::other(format!("check task: {e}"))))??;
    Ok(b)
}

/// The signed parts of a shard object ([`AnchorShardRef::parts`]): every range a stream
/// fetches is one of them, checked when it arrives (a chunk's beside its decode), and nothing
/// from it is written before that check passed; at the end every part must have been
/// checked, once.
pub(crate) struct Signed {
    key: String,
    starts: Vec<u64>,
    parts: Vec<driftless_format::manifest::PartRef>,
    checked: Vec<AtomicBool>,
}

impl Signed {
    /// `None` for an object without signed parts; an integrity error for parts that do not
    /// tile the object (the manifest parser refuses those, but a caller may build an entry).
    fn of(key: &str, o: &AnchorShardRef) -> Result<Option<Arc<Self>>> {
        if o.parts.is_empty() {
            return Ok(None);
        }
        Ok(Some(Arc::new(Signed {
            key: key.to_string(),
            starts: o.part_starts()?,
            parts: o.parts.clone(),
            checked: o.parts.iter().map(|_| AtomicBool::new(false)).collect(),
        })))
    }

    fn len(&self) -> usize {
        self.parts.len()
    }

    fn range(&self, i: usize) -> std::ops::Range<u64> {
        self.starts[i]..self.starts[i] + self.parts[i].len
    }

    fn bad(&self, what: &str) -> Error {
        corrupt("anchor shard", format!("{}: {what}", self.key))
    }

    /// `bytes`, fetched as `r`, are exactly one signed part.
    fn check(&self, r: std::ops::Range<u64>, bytes: &[u8]) -> Result<()> {
        let i = self.starts.binary_search(&r.start).map_err(|_| self.bad("a range off its signed parts"))?;
        let p = &self.parts[i];
        if r.end - r.start != p.len {
            return Err(self.bad("a range off its signed parts"));
        }
        if bytes.len() as u64 != p.len || Digest::of(bytes) != p.sha256 {
            return Err(corrupt(
                "object",
                format!(
                    "{} does not match its manifest: bytes {}..{} (a signed part's SHA-256)",
                    self.key, r.start, r.end
                ),
            ));
        }
        if self.checked[i].swap(true, Ordering::SeqCst) {
            return Err(self.bad("a part read twice"));
        }
        Ok(())
    }

    /// Every part was checked.
    fn all_checked(&self) -> Result<()> {
        match self.checked.iter().all(|c| c.load(Ordering::SeqCst)) {
            true => Ok(()),
            false => Err(self.bad("parts never read")),
        }
    }
}

/// Streams shard `o` of a plain-safetensors anchor (the object is the file) into `sink`, as
/// [`stream_shard`] does for byte-plane shards: the header first, alone, then its signed parts
/// (each checked before it is written) or, without them, [`anchor::PLAIN_PART`] pieces and
/// the object's SHA-256 over them in order, checked at the end; `parts` in flight, each
/// written once from the blocking pool. Memory is bounded by the parts in flight, not the
/// shard. The header must list `tensors` (the signed layout's) before anything is written.
/// `None` as for [`stream_shard`].
async fn stream_plain(
    bucket: &Bucket,
    step: u64,
    job: &ShardJob<'_>,
    parts: usize,
    stop: &Arc<AtomicBool>,
) -> Result<Option<u64>> {
    let ShardJob { object: o, tensors, sized, .. } = *job;
    let sink = job.sink.clone();
    use sha2::Digest as _;
    let key = driftless_store::layout::object(StepKind::Anchor, step, &o.object.object);
    let size = o.object.size;
    if size != o.decoded_size || size > anchor::MAX_SHARD {
        return Err(corrupt("anchor", format!("{} is not of its decoded size", o.file)));
    }
    let bucket = bucket.clone();
    if !sized {
        check_size(&bucket, step, &key, size).await?;
    }
    if size < 8 {
        return Err(mismatch(&key));
    }
    let max_head = 8 + driftless_format::checkpoint::MAX_HEADER as u64;
    let signed = Signed::of(&key, o)?;
    // Every part after the header is a whole PLAIN_PART but the last (what `part_ranges`
    // cuts): a buggy signer cannot make a GET per byte, nor a part larger than a reader holds.
    if let Some(s) = &signed {
        let n = s.len();
        if (1..n).any(|i| s.parts[i].len > anchor::PLAIN_PART || (i + 1 < n && s.parts[i].len != anchor::PLAIN_PART)) {
            return Err(s.bad("parts after the header that are not 16 MiB pieces"));
        }
    }
    // The safetensors header, bounded as any reader bounds it, before anything is allocated
    // by a size from the object: with signed parts, the first part, checked.
    let hdr = match &signed {
        Some(s) => {
            let r = s.range(0);
            if r.end < 8 || r.end > max_head {
                return Err(s.bad("its first part is not a safetensors header"));
            }
            checked_get(&bucket, &key, r, s).await?
        }
        None => {
            let n =
                u64::from_le_bytes(bucket.get_range_of(&key, 0..8).await?[..].try_into().map_err(|_| mismatch(&key))?);
            let end = n.checked_add(8).filter(|&e| e <= size && e <= max_head).ok_or_else(|| mismatch(&key))?;
            bucket.get_range_of(&key, 0..end).await?
        }
    };
    let n = u64::from_le_bytes(hdr[..8].try_into().expect("8"));
    if n.checked_add(8) != Some(hdr.len() as u64) {
        return Err(mismatch(&key));
    }
    // The header lists the signed layout's tensors (without signed parts the object is checked
    // only by its SHA-256 at the end, so a replaced one's header would have had its sink route
    // the shard's bytes to millions of tensors; with them, a buggy signer's).
    let (_, listed, _) =
        parse_safetensors_head(&hdr, size).map_err(|e| corrupt("anchor shard", format!("{key}: header: {e}")))?;
    anchor::check_listed(listed.iter().map(|(t, _)| t), tensors)
        .map_err(|e| corrupt("anchor shard", format!("{key}: {e}")))?;
    let head_end = hdr.len() as u64;
    // What follows the header: the signed parts, each bounded before any is fetched.
    let ranges: Vec<(u64, u64)> = match &signed {
        Some(s) => (1..s.len()).map(|i| s.range(i)).map(|r| (r.start, r.end)).collect(),
        None => (head_end..size)
            .step_by(anchor::PLAIN_PART as usize)
            .map(|a| (a, (a + anchor::PLAIN_PART).min(size)))
            .collect(),
    };
    if stop.load(Ordering::SeqCst) {
        return Ok(None);
    }
    sink.write_at(0, &hdr)?;
    let sha = signed.is_none().then(|| {
        let mut sha = sha2::Sha256::new();
        sha.update(&hdr);
        sha
    });
    let sha = copy_parts(&bucket, &key, ranges, parts, sink, sha, signed.clone(), stop).await?;
    if stop.load(Ordering::SeqCst) {
        return Ok(None);
    }
    object_checked(sha, &[], signed.as_deref(), o, &key)?;
    Ok(Some(size))
}

/// `ranges` of `key`, unchanged, into `sink`: one ranged GET each, `parts` in flight, each
/// checked against its signed part when `signed` (before it is written), written once from
/// the blocking pool and, when not signed, taken in order into `sha` ([`drain`]), which is
/// returned.
#[allow(clippy::too_many_arguments)]
async fn copy_parts(
    bucket: &Bucket,
    key: &str,
    ranges: Vec<(u64, u64)>,
    parts: usize,
    sink: Arc<dyn ShardSink>,
    sha: Option<sha2::Sha256>,
    signed: Option<Arc<Signed>>,
    stop: &Arc<AtomicBool>,
) -> Result<Option<sha2::Sha256>> {
    let got = futures::stream::iter(ranges).map(|(a, e)| {
        let (bucket, key, sink, stop, signed) =
            (bucket.clone(), key.to_string(), sink.clone(), stop.clone(), signed.clone());
        async move {
            if stop.load(Ordering::SeqCst) {
                return Ok(Bytes::new());
            }
            let b = bucket.get_range_of(&key, a..e).await?;
            if b.len() as u64 != e - a {
                return Err(corrupt("object", format!("{key} is shorter than its manifest says")));
            }
            let part = b.clone();
            let checked = signed.is_some();
            tokio::task::spawn_blocking(move || {
                if let Some(s) = &signed {
                    s.check(a..e, &part)?;
                }
                match stop.load(Ordering::SeqCst) {
                    true => Ok(()),
                    false => sink.write_at(a, &part),
                }
            })
            .await
            .map_err(|e| Error::Io(std::io::Error::other(format!("write task: {e}"))))??;
            Ok::<Bytes, Error>(if checked { Bytes::new() } else { b })
        }
    });
    drain(in_flight(got, signed.is_none(), parts), sha, parts, stop).await
}

/// Part futures, `parts` at once: `ordered` when the object's SHA-256 takes the parts in order
/// (no signed parts), else as they finish, so that a part done frees its place at once.
fn in_flight<F: std::future::Future<Output = Result<Bytes>>>(
    parts_to_run: impl futures::Stream<Item = F> + Unpin,
    ordered: bool,
    parts: usize,
) -> impl futures::Stream<Item = Result<Bytes>> + Unpin {
    match ordered {
        true => futures::future::Either::Left(parts_to_run.buffered(parts.max(1))),
        false => futures::future::Either::Right(parts_to_run.buffer_unordered(parts.max(1))),
    }
}

/// Every object of anchor `m` (step `step`) is in the bucket at its signed size: one HEAD each,
/// 16 at once. The agent checks this before it gives up anything for the anchor (its rollback
/// slot), then streams with [`ShardJob::sized`] set.
pub async fn check_sizes(bucket: &Bucket, step: u64, m: &driftless_format::AnchorManifest) -> Result<()> {
    let heads: Vec<(String, u64)> = m
        .objects
        .iter()
        .map(|o| (&o.object.object, o.object.size))
        .chain(m.files.iter().map(|o| (&o.object, o.size)))
        .map(|(k, n)| (driftless_store::layout::object(StepKind::Anchor, step, k), n))
        .collect();
    futures::stream::iter(heads)
        .map(|(key, n)| async move { check_size(bucket, step, &key, n).await })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await
        .map(drop)
}

/// The object's size in the bucket is the manifest's `size`: a missing object is a step not
/// ready (yet, or any more); a truncated or swapped one an integrity failure before any ranged
/// read (a read past its end would look like a storage error).
async fn check_size(bucket: &Bucket, step: u64, key: &str, size: u64) -> Result<()> {
    match bucket.head(key).await {
        Ok(h) if h.size == size => Ok(()),
        Ok(_) => Err(mismatch(key)),
        Err(e) if e.is_not_found() => Err(StreamError::NotReady { step, detail: format!("{key} missing") }.into()),
        Err(e) => Err(e.into()),
    }
}

fn mismatch(key: &str) -> Error {
    corrupt("object", format!("{key} does not match its manifest (size or SHA-256)"))
}

/// Runs a shard's parts to their end and, with `sha` (no signed parts), takes them in order
/// into the object's SHA-256, returned once every part is in. On the first error, stops: the
/// parts not yet fetched are skipped and those in flight waited for (their writes would
/// otherwise land after the call returned).
///
/// The hash runs on a thread of the blocking pool, fed through a queue of `queue` parts: it
/// is the one serial stage of an unsigned stream (one SHA-256 over the whole object), and run
/// on the runtime thread that polls the parts it held up their polling as well as the
/// runtime. The queue bounds what waits for it, so memory stays bounded by the parts in flight.
async fn drain(
    mut parts: impl futures::Stream<Item = Result<Bytes>> + Unpin,
    sha: Option<sha2::Sha256>,
    queue: usize,
    stop: &AtomicBool,
) -> Result<Option<sha2::Sha256>> {
    use sha2::Digest as _;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(queue.max(1));
    // Without a SHA-256 to take (signed parts, checked as they arrived), no thread.
    let hasher = sha.map(|mut sha| {
        tokio::task::spawn_blocking(move || {
            while let Some(b) = rx.blocking_recv() {
                sha.update(&b);
            }
            sha
        })
    });
    let tx = hasher.as_ref().map(|_| tx);
    let mut first_err = None;
    while let Some(b) = parts.next().await {
        match b {
            Ok(b) if first_err.is_none() => {
                // The receiver lives until `tx` is dropped below; a send fails only if the
                // hashing thread panicked, which the join reports.
                if let Some(tx) = &tx {
                    let _ = tx.send(b).await;
                }
            }
            Ok(_) => {}
            Err(e) => {
                stop.store(true, Ordering::SeqCst);
                first_err.get_or_insert(e);
            }
        }
    }
    drop(tx);
    let sha = match hasher {
        Some(h) => Some(h.await.map_err(|e| Error::Io(std::io::Error::other(format!("hash task: {e}"))))?),
        None => None,
    };
    first_err.map_or(Ok(sha), Err)
}
