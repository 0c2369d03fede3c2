//! Manifests, markers and hints: the JSON documents of a stream. Their JSON Schemas live in
//! `schemas/` at the top of the repository and are checked against these types by a test.
//!
//! Manifests travel inside a signed [`crate::sign::Envelope`]; everything here is parsed only
//! after the signature checks out, and then validated again (names, sizes) because a trusted
//! signer can still have a bug.

use serde::{Deserialize, Serialize};

use crate::checkpoint::{Layout, ShardLayout};
use crate::delta::{Codec, DeltaStats, ValueMode};
use crate::tensor::validate_file_name;
use crate::{DType, Digest, Error, Result, TensorMeta};

/// Version of the format written by this crate. Version 3: chunk digests are made of 8 KiB
/// leaf digests (see [`crate::hash`] and `schemas/weights-root.md`). Versions 1 and 2 (other
/// root definitions) are refused with a clear error rather than verified against the wrong
/// root definition.
pub const FORMAT_VERSION: u32 = 3;
/// Largest manifest accepted (bytes).
pub const MAX_MANIFEST_BYTES: usize = 64 << 20;
/// Largest step payload a ready marker may announce (1 PiB): far above any model, low enough
/// that sums over any chain of markers a bucket can list never overflow a `u64`.
pub const MAX_PAYLOAD_BYTES: u64 = 1 << 50;

/// A tensor of a result: metadata plus its digest (see [`crate::hash`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorRecord {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// SHA-256 tensor digest.
    pub digest: Digest,
}

/// One shard file of a result: its name and tensors in data order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardRecord {
    /// File name in the checkpoint directory.
    pub file: String,
    /// Tensors in data order.
    pub tensors: Vec<TensorRecord>,
    /// The safetensors `__metadata__` of the file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<std::collections::BTreeMap<String, String>>,
}

/// Builds shard records from a layout and per-tensor digests in layout order.
pub fn shard_records(layout: &Layout, digests: &[Digest]) -> Result<Vec<ShardRecord>> {
    let n: usize = layout.tensors().count();
    if n != digests.len() {
        return Err(Error::invalid("digest count does not match layout"));
    }
    let mut it = digests.iter();
    Ok(layout
        .shards
        .iter()
        .map(|s| ShardRecord {
            file: s.file.clone(),
            metadata: s.metadata.clone(),
            tensors: s
                .tensors
                .iter()
                .map(|t| TensorRecord {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    digest: *it.next().expect("counted"),
                })
                .collect(),
        })
        .collect())
}

/// The layout described by shard records.
pub fn layout_of(shards: &[ShardRecord]) -> Layout {
    Layout {
        shards: shards
            .iter()
            .map(|s| ShardLayout {
                file: s.file.clone(),
                metadata: s.metadata.clone(),
                tensors: s
                    .tensors
                    .iter()
                    .map(|t| TensorMeta { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone() })
                    .collect(),
            })
            .collect(),
    }
}

/// An object of a step (segment, shard, extra file): name relative to the step directory,
/// size and SHA-256 of its bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectRef {
    /// Object name inside the step's directory (`[A-Za-z0-9._-]+`).
    pub object: String,
    /// Size in bytes.
    pub size: u64,
    /// SHA-256 of the bytes.
    pub sha256: Digest,
}

/// A delta segment object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentRef {
    /// The object.
    #[serde(flatten)]
    pub object: ObjectRef,
    /// Decoded size bound of the segment (sum of its raw blocks).
    pub raw_size: u64,
    /// Entries in the segment.
    pub entries: u32,
}

/// The signed description of one delta.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeltaManifest {
    /// Always `"delta"`.
    pub kind: String,
    /// Format version.
    pub version: u32,
    /// Stream this delta belongs to.
    pub stream_id: String,
    /// Step this delta produces.
    pub step: u64,
    /// Step it applies to.
    pub base_step: u64,
    /// Weights root of the base.
    pub base_root: Digest,
    /// Weights root of the result.
    pub result_root: Digest,
    /// Value mode of the segments.
    pub value_mode: ValueMode,
    /// Compression of the segments.
    pub codec: Codec,
    /// Result layout with per-tensor digests.
    pub shards: Vec<ShardRecord>,
    /// Segment objects, in order.
    pub segments: Vec<SegmentRef>,
    /// Encoding statistics.
    pub stats: DeltaStats,
    /// Milliseconds since the Unix epoch when the delta was encoded.
    pub created_at_ms: u64,
}

/// How anchor shards are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AnchorEncoding {
    /// Plain safetensors files, readable by any Hugging Face tool.
    Safetensors,
    /// Byte planes compressed with zstd ([`crate::anchor`]); decodes to the identical
    /// safetensors bytes. The default (see the README's numbers).
    #[default]
    PlanesZstd,
}

/// An anchor shard object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnchorShardRef {
    /// Safetensors file name it decodes to.
    pub file: String,
    /// The stored object.
    #[serde(flatten)]
    pub object: ObjectRef,
    /// Size of the decoded safetensors file.
    pub decoded_size: u64,
    /// SHA-256 of the decoded safetensors file.
    pub decoded_sha256: Digest,
    /// The object cut into parts that tile it in order, each with the SHA-256 of its bytes
    /// ([`crate::anchor::part_ranges`]: exactly the ranges a streaming reader fetches). A reader
    /// checks each part as it arrives, on any core, before writing anything from it, instead of one serial
    /// SHA-256 over the whole object (about 1 GB/s on one core: what a one-shard cold start
    /// waited for). Empty in manifests of publishers before this field: readers then check
    /// `sha256`, which is still written for them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<PartRef>,
}

impl AnchorShardRef {
    /// Where each of [`Self::parts`] starts in the object; a corrupt-manifest error when they do
    /// not tile it (lengths of at least 1 adding up to its size, no sum that wraps).
    pub fn part_starts(&self) -> Result<Vec<u64>> {
        let bad = || {
            Error::corrupt(
                "anchor manifest",
                format!("the parts of shard {} do not tile its {} bytes", self.file, self.object.size),
            )
        };
        let mut at = 0u64;
        let mut starts = Vec::with_capacity(self.parts.len());
        for p in &self.parts {
            starts.push(at);
            at = at.checked_add(p.len).filter(|_| p.len > 0).ok_or_else(bad)?;
        }
        match at == self.object.size || self.parts.is_empty() {
            true => Ok(starts),
            false => Err(bad()),
        }
    }
}

/// A part of an object: its length and the SHA-256 of its bytes. The parts of an object
/// follow each other from its first byte to its last.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartRef {
    /// Length in bytes (at least 1).
    pub len: u64,
    /// SHA-256 of its bytes.
    pub sha256: Digest,
}

/// The signed description of a full checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnchorManifest {
    /// Always `"anchor"`.
    pub kind: String,
    /// Format version.
    pub version: u32,
    /// Stream id.
    pub stream_id: String,
    /// Step.
    pub step: u64,
    /// Weights root.
    pub weights_root: Digest,
    /// Storage form of the shards.
    pub encoding: AnchorEncoding,
    /// Layout with per-tensor digests.
    pub shards: Vec<ShardRecord>,
    /// Shard objects, one per layout shard, same order.
    pub objects: Vec<AnchorShardRef>,
    /// Extra files of the checkpoint (config.json, tokenizer, ...), stored verbatim.
    #[serde(default)]
    pub files: Vec<ObjectRef>,
    /// Milliseconds since the Unix epoch.
    pub created_at_ms: u64,
}

/// The stream descriptor at `stream.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamDescriptor {
    /// Always `"stream"`.
    pub kind: String,
    /// Format version.
    pub version: u32,
    /// Random id chosen by the first publisher.
    pub stream_id: String,
    /// Key ids allowed to sign manifests of this stream.
    pub trusted_keys: Vec<String>,
    /// Milliseconds since the Unix epoch.
    pub created_at_ms: u64,
}

/// Which kind of step a marker announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Hash)]
#[serde(rename_all = "lowercase")]
pub enum StepKind {
    /// A delta.
    Delta,
    /// An anchor.
    Anchor,
}

impl std::fmt::Display for StepKind {
    /// `delta` or `anchor`: the spelling of the JSON documents, used in logs and messages.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StepKind::Delta => "delta",
            StepKind::Anchor => "anchor",
        })
    }
}

/// A ready marker: written after every object of the step. Its presence is the commit point.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadyMarker {
    /// Always `"ready"`.
    pub kind: String,
    /// Stream id.
    pub stream_id: String,
    /// What is ready.
    pub of: StepKind,
    /// Step.
    pub step: u64,
    /// For a delta, its base step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_step: Option<u64>,
    /// SHA-256 of the signed manifest envelope object.
    pub manifest_sha256: Digest,
    /// Total bytes of the step's payload objects (for the agent's byte planner).
    pub payload_bytes: u64,
    /// Name of the manifest object in the step's directory. Each publisher generation writes
    /// its own names (`g7-manifest.json`), so a dead predecessor's late writes never collide
    /// with a restarted publisher's; the marker says which one was committed. Absent means
    /// [`DEFAULT_MANIFEST_NAME`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest: Option<String>,
}

/// The manifest object name of a marker without a `manifest` field.
pub const DEFAULT_MANIFEST_NAME: &str = "manifest.json";

/// `latest.json`: a cheap hint of the newest ready steps. Markers stay the source of truth.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LatestHint {
    /// Always `"latest"`.
    pub kind: String,
    /// Stream id.
    pub stream_id: String,
    /// Newest ready delta step.
    pub delta: Option<u64>,
    /// Newest ready anchor step.
    pub anchor: Option<u64>,
    /// Milliseconds since the Unix epoch.
    pub updated_at_ms: u64,
    /// The ready marker of the newest delta (its base step, manifest SHA-256 and payload
    /// size): with it a follower one step behind plans the next step without listing or
    /// reading markers. Absent in hints of older publishers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta_marker: Option<ReadyMarker>,
    /// The ready marker of the newest anchor. Absent in hints of older publishers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub anchor_marker: Option<ReadyMarker>,
}

fn parse<T: serde::de::DeserializeOwned>(what: &'static str, bytes: &[u8]) -> Result<T> {
    if bytes.len() > MAX_MANIFEST_BYTES {
        return Err(Error::corrupt(what, format!("{} bytes exceeds the limit", bytes.len())));
    }
    serde_json::from_slice(bytes).map_err(|e| Error::corrupt(what, e.to_string()))
}

fn check_kind(what: &'static str, kind: &str, want: &str, version: u32) -> Result<()> {
    if kind != want {
        return Err(Error::corrupt(what, format!("kind is {kind:?}, expected {want:?}")));
    }
    if version != FORMAT_VERSION {
        return Err(Error::corrupt(
            what,
            format!("unsupported format version {version} (this build reads version {FORMAT_VERSION})"),
        ));
    }
    Ok(())
}

fn check_shards(what: &'static str, shards: &[ShardRecord]) -> Result<()> {
    layout_of(shards).validate().map_err(|e| Error::corrupt(what, e.to_string()))
}

impl DeltaManifest {
    /// Parses and validates a delta manifest.
    pub fn from_slice(bytes: &[u8]) -> Result<Self> {
        let m: DeltaManifest = parse("delta manifest", bytes)?;
        m.validate()?;
        Ok(m)
    }

    /// The checks [`Self::from_slice`] makes of a parsed manifest: kind, version, shards, base
    /// before step, segment names and sizes, and the bounds on what readers decode and hold
    /// (`max_delta_raw`, `max_delta_heap`). A writer checks its own manifest with it before
    /// sealing: what it publishes is what every reader accepts (found by review: a sharded
    /// committer sealed a step of many short runs that every agent refused).
    pub fn validate(&self) -> Result<()> {
        let m = self;
        check_kind("delta manifest", &m.kind, "delta", m.version)?;
        check_shards("delta manifest", &m.shards)?;
        if m.base_step >= m.step {
            return Err(Error::corrupt("delta manifest", "base step is not before step"));
        }
        let (mut raw, mut entries) = (0u64, 0u64);
        for s in &m.segments {
            validate_file_name(&s.object.object).map_err(|e| Error::corrupt("delta manifest", e.to_string()))?;
            if s.raw_size > crate::delta::MAX_SEGMENT_RAW || s.entries > crate::delta::MAX_ENTRIES {
                return Err(Error::corrupt("delta manifest", "segment raw size or entry count over the limit"));
            }
            if s.object.size > crate::delta::max_segment_object(s.raw_size) {
                return Err(Error::corrupt(
                    "delta manifest",
                    format!(
                        "segment {} is {} bytes, more than an encoder writes for {} decoded bytes",
                        s.object.object, s.object.size, s.raw_size
                    ),
                ));
            }
            raw = raw.saturating_add(s.raw_size);
            entries = entries.saturating_add(u64::from(s.entries));
        }
        // Readers decode every segment of a delta before applying it: the total is bounded by
        // what an encoder writes for this result, not only segment by segment.
        let layout = m.layout();
        let most = crate::delta::max_delta_raw(&layout, entries);
        if raw > most {
            return Err(Error::corrupt(
                "delta manifest",
                format!("segments decode to {raw} bytes, more than an encoder writes for the result ({most})"),
            ));
        }
        // And what they hold in memory decoded, entries counted (readers decode each segment
        // with `decode_segment_of`, which holds it to its declared entries).
        let heap = m.decoded_heap();
        let most = crate::delta::max_delta_heap(&layout);
        if heap > most {
            return Err(Error::corrupt(
                "delta manifest",
                format!("segments decode to {heap} bytes in memory, more than a reader holds for the result ({most})"),
            ));
        }
        Ok(())
    }

    /// What its segments hold in memory decoded, entries counted (saturating): at most
    /// [`crate::delta::max_delta_heap`] of its result ([`Self::validate`]).
    pub fn decoded_heap(&self) -> u64 {
        let longest = self.shards.iter().flat_map(|s| &s.tensors).map(|t| t.name.len()).max().unwrap_or(0);
        let (raw, entries) = self
            .segments
            .iter()
            .fold((0u64, 0u64), |(r, e), s| (r.saturating_add(s.raw_size), e.saturating_add(u64::from(s.entries))));
        raw.saturating_add(entries.saturating_mul(crate::delta::entry_heap(longest)))
    }

    /// [`Self::validate`]'s memory bound taken from `local`, the layout a reader applies the
    /// delta to, where the manifest's own result layout gave it: a reader holds a delta
    /// decoded, and the result layout is the manifest's word (found by review: a signed
    /// layout change declaring a result of 2^46 bytes passed with segments of compressed
    /// zeros that decoded to hundreds of GiB, and the agent was killed for memory at every
    /// start). A delta that grows the model by more than a quarter fails it; writers publish
    /// such a step as an anchor too.
    pub fn check_onto(&self, local: &Layout) -> Result<()> {
        let (heap, most) = (self.decoded_heap(), crate::delta::max_delta_heap(local));
        if heap > most {
            return Err(Error::corrupt(
                "delta manifest",
                format!(
                    "segments decode to {heap} bytes in memory, more than a reader holds for a delta of \
                    the {} bytes it is applied to ({most}); wait for the next anchor",
                    local.tensors().fold(0u64, |a, t| a.saturating_add(t.nbytes().unwrap_or(u64::MAX)))
                ),
            ));
        }
        Ok(())
    }
    /// Total bytes of the segment objects.
    pub fn payload_bytes(&self) -> u64 {
        // Saturating: sizes come from the manifest, and a sum overflow must not panic.
        self.segments.iter().fold(0u64, |a, s| a.saturating_add(s.object.size))
    }
    /// The result layout.
    pub fn layout(&self) -> Layout {
        layout_of(&self.shards)
    }
}

impl AnchorManifest {
    /// Parses and validates an anchor manifest.
    pub fn from_slice(bytes: &[u8]) -> Result<Self> {
        let m: AnchorManifest = parse("anchor manifest", bytes)?;
        check_kind("anchor manifest", &m.kind, "anchor", m.version)?;
        check_shards("anchor manifest", &m.shards)?;
        if m.objects.len() != m.shards.len() {
            return Err(Error::corrupt("anchor manifest", "one object per shard expected"));
        }
        for (o, s) in m.objects.iter().zip(&m.shards) {
            validate_file_name(&o.object.object).map_err(|e| Error::corrupt("anchor manifest", e.to_string()))?;
            if o.file != s.file {
                return Err(Error::corrupt("anchor manifest", "shard objects out of order"));
            }
            if o.decoded_size > crate::anchor::MAX_SHARD {
                return Err(Error::corrupt("anchor manifest", format!("shard {} of {} bytes", o.file, o.decoded_size)));
            }
            // Parts, when listed, tile the object exactly.
            o.part_starts()?;
            // A safetensors file is its header (8 bytes of length, then at least `{}`, at most
            // MAX_HEADER bytes of JSON) and its tensors' bytes, contiguous: readers size the
            // tensors by the layout, which must be the file's.
            let data = s.tensors.iter().try_fold(0u64, |a, t| {
                let n = TensorMeta { name: String::new(), dtype: t.dtype, shape: t.shape.clone() }.nbytes().ok()?;
                a.checked_add(n)
            });
            let fits =
                data.and_then(|d| Some((d.checked_add(10)?, d.checked_add(8 + crate::checkpoint::MAX_HEADER as u64)?)));
            if !fits.is_some_and(|(lo, hi)| (lo..=hi).contains(&o.decoded_size)) {
                return Err(Error::corrupt(
                    "anchor manifest",
                    format!("shard {}: its tensors do not fit a file of {} bytes", o.file, o.decoded_size),
                ));
            }
        }
        for f in &m.files {
            validate_file_name(&f.object).map_err(|e| Error::corrupt("anchor manifest", e.to_string()))?;
        }
        // Readers hold extra files in memory.
        crate::check_extra_file_sizes(m.files.iter().map(|f| (f.object.clone(), f.size)))
            .map_err(|e| Error::corrupt("anchor manifest", e.to_string()))?;
        Ok(m)
    }
    /// Total bytes of the shard and file objects.
    pub fn payload_bytes(&self) -> u64 {
        // Saturating: sizes come from the manifest, and a sum overflow must not panic.
        self.objects
            .iter()
            .map(|s| s.object.size)
            .chain(self.files.iter().map(|f| f.size))
            .fold(0u64, u64::saturating_add)
    }
    /// The layout.
    pub fn layout(&self) -> Layout {
        layout_of(&self.shards)
    }
}

impl StreamDescriptor {
    /// Parses and validates.
    pub fn from_slice(bytes: &[u8]) -> Result<Self> {
        let m: StreamDescriptor = parse("stream descriptor", bytes)?;
        check_kind("stream descriptor", &m.kind, "stream", m.version)?;
        Ok(m)
    }
}

/// Longest stream id a ready marker (or `latest.json`) may carry. Publishers make ids of 16
/// hex digits; markers are unsigned and read by the thousand, so what one holds is bounded
/// well below its 64 KiB object (found by review: GC held every planted marker's 60 KB id,
/// 6 GB for 100k of them).
pub const MAX_STREAM_ID: usize = 256;

impl ReadyMarker {
    /// Parses.
    pub fn from_slice(bytes: &[u8]) -> Result<Self> {
        let m: ReadyMarker = parse("ready marker", bytes)?;
        check_kind("ready marker", &m.kind, "ready", FORMAT_VERSION)?;
        if m.stream_id.len() > MAX_STREAM_ID {
            return Err(Error::corrupt(
                "ready marker",
                format!("stream id of {} bytes, over the {MAX_STREAM_ID}-byte limit", m.stream_id.len()),
            ));
        }
        // Markers are unsigned and drive planning: every link must point strictly backwards
        // (so chain walks end) and sizes must be sums that cannot overflow.
        match (m.of, m.base_step) {
            (StepKind::Delta, Some(b)) if b < m.step => {}
            (StepKind::Delta, _) => {
                return Err(Error::corrupt("ready marker", "delta base step is not before its step"))
            }
            (StepKind::Anchor, None) => {}
            (StepKind::Anchor, Some(_)) => {
                return Err(Error::corrupt("ready marker", "anchor marker with a base step"))
            }
        }
        if m.payload_bytes > MAX_PAYLOAD_BYTES {
            return Err(Error::corrupt("ready marker", "payload size over the limit"));
        }
        if let Some(n) = &m.manifest {
            crate::validate_file_name(n)
                .map_err(|_| Error::corrupt("ready marker", "manifest name is not a plain file name"))?;
        }
        Ok(m)
    }

    /// The manifest object's name in the step directory.
    pub fn manifest_name(&self) -> &str {
        self.manifest.as_deref().unwrap_or(DEFAULT_MANIFEST_NAME)
    }
}

impl LatestHint {
    /// Parses.
    pub fn from_slice(bytes: &[u8]) -> Result<Self> {
        let m: LatestHint = parse("latest hint", bytes)?;
        check_kind("latest hint", &m.kind, "latest", FORMAT_VERSION)?;
        if m.stream_id.len() > MAX_STREAM_ID {
            return Err(Error::corrupt("latest hint", format!("stream id over the {MAX_STREAM_ID}-byte limit")));
        }
        // The embedded markers are checked as markers read on their own are, and must agree
        // with the hint's steps and stream.
        for (mk, kind, step) in
            [(&m.delta_marker, StepKind::Delta, m.delta), (&m.anchor_marker, StepKind::Anchor, m.anchor)]
        {
            if let Some(mk) = mk {
                let b = serde_json::to_vec(mk).map_err(|e| Error::corrupt("latest hint", e.to_string()))?;
                ReadyMarker::from_slice(&b)?;
                if mk.of != kind || Some(mk.step) != step || mk.stream_id != m.stream_id {
                    return Err(Error::corrupt("latest hint", "embedded marker disagrees with the hint"));
                }
            }
        }
        Ok(m)
    }
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}
