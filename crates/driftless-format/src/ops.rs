//! High-level operations built from the pieces: make a delta with its manifest, apply one in
//! place (journaled) or into a fresh directory, verify a result.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::checkpoint::{CheckpointMut, Layout, TensorsMut};
use crate::delta::{self, DecodedSegment, DeltaOptions, EncodedDelta, ValueMode};
use crate::manifest::{self, DeltaManifest, ObjectRef, SegmentRef};
use crate::{hash, Digest, Error, Journal, Result, TensorView};

/// Object name of segment `i` of a delta.
pub fn segment_object_name(i: usize) -> String {
    format!("seg-{i:05}.dls")
}

/// What a delta is made from.
#[derive(Debug, Clone, Copy)]
pub struct DeltaSpec<'a> {
    /// Stream id.
    pub stream_id: &'a str,
    /// Step produced.
    pub step: u64,
    /// Step of the base.
    pub base_step: u64,
    /// Base root when the caller knows it (the publisher does); hashed otherwise.
    pub base_root: Option<Digest>,
    /// Layout of the result.
    pub layout: &'a Layout,
}

/// Diffs, encodes and describes a delta. Hashes the target (and the base if its root is not
/// given) in parallel with nothing else; returns the unsigned manifest and the segments.
pub fn make_delta(
    spec: DeltaSpec<'_>,
    base: &[TensorView<'_>],
    target: &[TensorView<'_>],
    opts: &DeltaOptions,
) -> Result<(DeltaManifest, EncodedDelta)> {
    // Order the target as the layout does so digests line up with shard records.
    let by_name: std::collections::HashMap<&str, &TensorView<'_>> = target.iter().map(|t| (t.name, t)).collect();
    let ordered: Vec<TensorView<'_>> = spec
        .layout
        .tensors()
        .map(|m| {
            by_name
                .get(m.name.as_str())
                .filter(|t| t.dtype == m.dtype && t.shape == m.shape.as_slice())
                .map(|t| **t)
                .ok_or_else(|| Error::invalid(format!("tensor {} of the layout is missing or differs", m.name)))
        })
        .collect::<Result<_>>()?;
    if ordered.len() != target.len() {
        return Err(Error::invalid("target has tensors the layout does not list"));
    }
    let ((digests, result_root), (base_root, encoded)) = rayon::join(
        || hash::weights_root(&ordered),
        || {
            let br = spec.base_root.unwrap_or_else(|| hash::weights_root(base).1);
            (br, delta::encode_delta(base, &ordered, opts))
        },
    );
    let encoded = encoded?;
    let m = delta_manifest(spec, base_root, result_root, &digests, &encoded, opts)?;
    Ok((m, encoded))
}

/// The manifest of an encoded delta (`digests`: the result's tensor digests in layout order,
/// `result_root` their root). Shared by [`make_delta`] and the publisher's deferred encode
/// (`diff_update`, then this on another thread).
pub fn delta_manifest(
    spec: DeltaSpec<'_>,
    base_root: Digest,
    result_root: Digest,
    digests: &[Digest],
    encoded: &delta::EncodedDelta,
    opts: &DeltaOptions,
) -> Result<DeltaManifest> {
    Ok(DeltaManifest {
        kind: "delta".into(),
        version: manifest::FORMAT_VERSION,
        stream_id: spec.stream_id.to_string(),
        step: spec.step,
        base_step: spec.base_step,
        base_root,
        result_root,
        value_mode: opts.values,
        codec: opts.codec,
        shards: manifest::shard_records(spec.layout, digests)?,
        segments: encoded
            .segments
            .iter()
            .enumerate()
            .map(|(i, s)| SegmentRef {
                object: ObjectRef { object: segment_object_name(i), size: s.bytes.len() as u64, sha256: s.sha256 },
                raw_size: s.raw_size,
                entries: s.entries,
            })
            .collect(),
        stats: encoded.stats.clone(),
        created_at_ms: manifest::now_ms(),
    })
}

/// Applies segments of one delta onto writable tensors, segment by segment, in any order and
/// from any number of threads. With a journal, `ulp` segments are made crash-safe (see
/// [`crate::journal`]).
pub struct Applier<'t, 'a> {
    tensors: &'t TensorsMut<'a>,
    manifest: &'t DeltaManifest,
    journal: Option<Mutex<Journal>>,
}

impl<'t, 'a> Applier<'t, 'a> {
    /// An applier. `journal` is required for crash safety of `ulp` deltas applied in place.
    pub fn new(tensors: &'t TensorsMut<'a>, manifest: &'t DeltaManifest, journal: Option<Journal>) -> Self {
        Applier { tensors, manifest, journal: journal.map(Mutex::new) }
    }

    /// Applies every segment of the delta (`segments[i]` is segment `i`) in parallel, at most
    /// [`delta::DECODE_BUDGET`] of declared decoded bytes at a time.
    pub fn apply_all(&self, segments: &[&[u8]]) -> Result<()> {
        self.apply_all_then(segments, None, |_| Ok(())).map(drop)
    }

    /// Decodes segment `index` (bytes already checked against the manifest's SHA-256 by the
    /// caller, size bounded by its `raw_size`) and applies it.
    pub fn apply(&self, index: usize, bytes: &[u8]) -> Result<()> {
        let seg = decode_checked(self.manifest, index, bytes)?;
        self.apply_decoded(index as u32, &seg)
    }

    /// Applies every segment as [`Self::apply_all`] does, each just after saving
    /// what takes it back out ([`delta::save_overwritten`]) while the saved bytes stay within
    /// `*budget`, which is decremented. Returns the [`Undo`], or `None` when it did not fit (the
    /// delta is applied all the same). An error leaves the tensors partly written, not
    /// undoable.
    pub fn apply_all_undoable(&self, segments: &[&[u8]], budget: &mut u64) -> Result<Option<Undo>> {
        self.apply_all_then(segments, Some(budget), |_| Ok(()))
    }

    /// [`Self::apply_all_undoable`] (without a budget: nothing saved, `None`; the one loop
    /// behind [`Self::apply_all`] too) that calls
    /// `after` with each segment once it is applied (the Python binding records the element
    /// indices it wrote).
    pub fn apply_all_then(
        &self,
        segments: &[&[u8]],
        budget: Option<&mut u64>,
        after: impl Fn(&DecodedSegment) -> Result<()> + Sync,
    ) -> Result<Option<Undo>> {
        let m = self.manifest;
        if segments.len() != m.segments.len() {
            return Err(Error::corrupt("delta", "segment count differs from the manifest"));
        }
        let left = AtomicU64::new(budget.as_deref().copied().unwrap_or(0));
        let fits = AtomicBool::new(budget.is_some());
        let saved: Vec<Mutex<Option<delta::Overwritten>>> = segments.iter().map(|_| Mutex::new(None)).collect();
        let raws: Vec<u64> = m.segments.iter().map(|r| r.raw_size).collect();
        delta::for_each_decoded_bounded(&raws, |i| {
            let seg = decode_checked(m, i, segments[i])?;
            let need = delta::overwritten_bytes(&seg);
            let room = fits.load(Ordering::Relaxed)
                && left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| l.checked_sub(need)).is_ok();
            if room {
                *saved[i].lock().expect("undo lock") = Some(delta::save_overwritten(&seg, self.tensors)?);
            } else {
                fits.store(false, Ordering::Relaxed);
            }
            // Through the journal when there is one, as `apply` (an undo saved from the segment
            // holds either way: the journal's redo form writes the same bytes).
            self.apply_decoded(i as u32, &seg)?;
            after(&seg)
        })?;
        if !fits.into_inner() {
            // (What was saved is dropped: the budget is not spent.)
            return Ok(None);
        }
        if let Some(b) = budget {
            *b = left.into_inner();
        }
        let saved = saved.into_iter().map(|s| s.into_inner().expect("undo lock")).collect::<Option<Vec<_>>>();
        Ok(saved.map(Undo))
    }

    fn apply_decoded(&self, index: u32, seg: &DecodedSegment) -> Result<()> {
        match (&self.journal, seg.mode) {
            (Some(j), ValueMode::Ulp) => {
                let redo = delta::to_redo(seg, self.tensors)?;
                j.lock().expect("journal lock").append(index, &redo)?;
                let seg = delta::decode_segment(&redo, redo.len() as u64)?;
                delta::apply_segment(&seg, self.tensors)
            }
            _ => delta::apply_segment(seg, self.tensors),
        }
    }

    /// Replays redo records from a recovered journal (idempotent overwrites). Returns the
    /// indices of the segments they cover; the caller applies the others. The records stay in
    /// the journal file (reopen it with [`Journal::reopen`]), so a crash during replay replays
    /// again.
    pub fn replay(&self, records: &[(u32, Vec<u8>)]) -> Result<Vec<u32>> {
        let mut done: Vec<u32> = vec![];
        for (i, rec) in records {
            // A journal reopened after an earlier recovery can hold a segment's record twice;
            // the first complete one is enough (they are identical overwrites).
            if done.contains(i) {
                continue;
            }
            let seg = delta::decode_segment(rec, rec.len() as u64)?;
            if seg.mode != ValueMode::Overwrite {
                return Err(Error::corrupt("journal", "redo record is not in overwrite form"));
            }
            // Journal again so a second crash before the end still knows this segment; before
            // the writes, as in `apply_decoded`: records must precede the cells they cover.
            if let Some(j) = &self.journal {
                j.lock().expect("journal lock").append(*i, rec)?;
            }
            delta::apply_segment(&seg, self.tensors)?;
            done.push(*i);
        }
        Ok(done)
    }
}

/// What takes a delta applied by [`Applier::apply_all_undoable`] back out ([`undo`]): per
/// segment, the bytes it wrote over where subtracting its differences cannot restore them.
#[derive(Debug)]
pub struct Undo(Vec<delta::Overwritten>);

/// Takes delta `m`, applied by [`Applier::apply_all_undoable`] with `segments` (the same bytes),
/// back out of `tensors` (a set of its own: the apply's claims still stand in its set). Deltas
/// applied one after another are undone newest first.
pub fn undo(tensors: &TensorsMut<'_>, m: &DeltaManifest, segments: &[&[u8]], undo: &Undo) -> Result<()> {
    if segments.len() != m.segments.len() || undo.0.len() != segments.len() {
        return Err(Error::invalid("undo record does not belong to this delta"));
    }
    let raws: Vec<u64> = m.segments.iter().map(|r| r.raw_size).collect();
    delta::for_each_decoded_bounded(&raws, |i| {
        delta::undo_segment(&decode_checked(m, i, segments[i])?, &undo.0[i], tensors)
    })
}

/// Segment `index` of `m`, checked against its manifest entry and decoded within its
/// `raw_size`.
fn decode_checked(m: &DeltaManifest, index: usize, bytes: &[u8]) -> Result<DecodedSegment> {
    let r = m.segments.get(index).ok_or_else(|| Error::corrupt("delta", "segment index out of range"))?;
    if bytes.len() as u64 != r.object.size || Digest::of(bytes) != r.object.sha256 {
        return Err(Error::corrupt("segment", format!("{} does not match its manifest entry", r.object.object)));
    }
    let seg = delta::decode_segment_of(bytes, r)?;
    if seg.mode != m.value_mode {
        return Err(Error::corrupt("segment", "value mode differs from the manifest"));
    }
    Ok(seg)
}

/// Hashes writable tensors' current bytes against a manifest's result: returns the root, or
/// [`Error::Corrupt`] naming the first tensor whose digest differs.
pub fn verify_result(views: &[TensorView<'_>], m: &DeltaManifest) -> Result<Digest> {
    verify_views(views, &m.shards, m.result_root)
}

/// Checks views against shard records and a root.
pub fn verify_views(views: &[TensorView<'_>], shards: &[manifest::ShardRecord], root: Digest) -> Result<Digest> {
    let (digests, got) = hash::weights_root(views);
    if got == root {
        return Ok(got);
    }
    let want: std::collections::HashMap<&str, Digest> =
        shards.iter().flat_map(|s| s.tensors.iter().map(|t| (t.name.as_str(), t.digest))).collect();
    let bad = views
        .iter()
        .zip(&digests)
        .find(|(v, d)| want.get(v.name) != Some(d))
        .map(|(v, _)| v.name.to_string())
        .unwrap_or_else(|| "<tensor set>".into());
    Err(Error::corrupt("result", format!("weights root {got} != expected {root} (first differing tensor: {bad})")))
}

/// Checks per-tensor digests (of the tensors `metas`, in that order) against a root: returns
/// the root, or [`Error::Corrupt`] (`"result"`) naming the first tensor whose digest differs
/// from the shard records.
pub fn check_root(
    metas: &[crate::TensorMeta],
    digests: &[Digest],
    shards: &[manifest::ShardRecord],
    root: Digest,
) -> Result<Digest> {
    let got = hash::combine_root(metas.iter().zip(digests).map(|(t, d)| (t.name.as_str(), *d)));
    if got == root {
        return Ok(got);
    }
    let want: std::collections::HashMap<&str, Digest> =
        shards.iter().flat_map(|s| s.tensors.iter().map(|t| (t.name.as_str(), t.digest))).collect();
    let bad = metas
        .iter()
        .zip(digests)
        .find(|(v, d)| want.get(v.name.as_str()) != Some(d))
        .map(|(v, _)| v.name.to_string())
        .unwrap_or_else(|| "<tensor set>".into());
    Err(Error::corrupt("result", format!("weights root {got} != expected {root} (first differing tensor: {bad})")))
}

/// Applies a whole delta in place on a checkpoint directory whose verified root is
/// `local_root`, journaled at `journal` when given, then verifies the result. The layouts must
/// be equal (see [`needs_rewrite`]).
///
/// With a journal, the maps are made durable ([`CheckpointMut::flush`], msync) before the
/// journal is removed: the redo journal (fsync'ed before any write) is what replays the delta
/// after a machine crash, so it may only go once every write it covers is on disk (found by
/// review: it was removed first, and a power loss then left a torn checkpoint with nothing to
/// repair it). Without a journal nothing is flushed: the caller owns durability.
pub fn apply_in_place(
    ck: &mut CheckpointMut,
    m: &DeltaManifest,
    envelope_sha: Digest,
    local_root: Digest,
    segments: &[&[u8]],
    journal: Option<&Path>,
) -> Result<Digest> {
    if m.base_root != local_root {
        return Err(Error::WrongBase { expected: m.base_root.to_hex(), actual: local_root.to_hex() });
    }
    if segments.len() != m.segments.len() {
        return Err(Error::invalid("segment count differs from the manifest"));
    }
    {
        let tm = ck.tensors_mut();
        let j = journal.map(|p| Journal::create(p, envelope_sha, m.base_root)).transpose()?;
        let ap = Applier::new(&tm, m, j);
        ap.apply_all(segments)?;
    }
    let root = verify_result(&ck.views(), m)?;
    if let Some(p) = journal {
        ck.flush()?;
        Journal::remove(p)?;
    }
    Ok(root)
}

/// True when a delta's result layout differs from the local files' layout, so it cannot be
/// applied in place and [`apply_rewrite`] must be used.
pub fn needs_rewrite(local: &Layout, m: &DeltaManifest) -> bool {
    let r = m.layout();
    local.shards.len() != r.shards.len()
        || local
            .shards
            .iter()
            .zip(&r.shards)
            .any(|(a, b)| a.file != b.file || a.tensors != b.tensors || a.metadata != b.metadata)
}

/// Builds the result of a delta into a fresh directory `out` from `base` views (used when the
/// layout changes: tensors added, removed, reshaped, retyped). Verifies the result.
pub fn apply_rewrite(base: &[TensorView<'_>], m: &DeltaManifest, segments: &[&[u8]], out: &Path) -> Result<Digest> {
    let layout = m.layout();
    let mut ck = CheckpointMut::create(out, &layout)?;
    {
        let tm = ck.tensors_mut();
        let by_name: std::collections::HashMap<&str, &TensorView<'_>> = base.iter().map(|t| (t.name, t)).collect();
        for t in layout.tensors() {
            if let Some(b) =
                by_name.get(t.name.as_str()).filter(|b| b.dtype == t.dtype && b.shape == t.shape.as_slice())
            {
                tm.with_range_mut(&t.name, 0, b.data.len() as u64, |d| d.copy_from_slice(b.data))?;
            }
        }
        tm.reset_claims();
        let ap = Applier::new(&tm, m, None);
        ap.apply_all(segments)?;
    }
    ck.flush()?;
    verify_result(&ck.views(), m)
}
