//! Reading a stream: the verified view of a bucket that the agent, the CLI and a restarting
//! publisher share. Everything here treats the bucket as hostile: sizes are capped before
//! reading, signatures are checked before parsing, and a manifest must match the SHA-256 its
//! ready marker records.

use bytes::Bytes;
use driftless_format::manifest::{
    AnchorManifest, DeltaManifest, LatestHint, ReadyMarker, StepKind, StreamDescriptor, MAX_MANIFEST_BYTES,
};
use driftless_format::{Digest, TrustSet};

use crate::{layout, Bucket};

/// Largest ready marker accepted.
pub const MAX_MARKER_BYTES: u64 = 64 << 10;

/// Errors of stream reading: storage or format, kept apart so callers can tell retryable
/// storage trouble from bad objects.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StreamError {
    /// The bucket failed.
    #[error(transparent)]
    Store(#[from] crate::Error),
    /// An object is corrupt, forged or does not fit.
    #[error(transparent)]
    Format(#[from] driftless_format::Error),
    /// A marker exists but the objects it announces are not readable (yet): eventual
    /// consistency, replication copying the marker first, or a GC deleting under us.
    #[error("step {step} not ready yet: {detail}")]
    NotReady {
        /// The step.
        step: u64,
        /// What is missing.
        detail: String,
    },
}

impl StreamError {
    /// Whether trying again later may help.
    pub fn is_retryable(&self) -> bool {
        match self {
            StreamError::Store(e) => e.is_retryable() || e.is_not_found(),
            StreamError::Format(e) => e.is_retryable(),
            StreamError::NotReady { .. } => true,
        }
    }
}

/// Result alias.
pub type StreamResult<T> = std::result::Result<T, StreamError>;

/// A verified reader of one stream.
#[derive(Debug, Clone)]
pub struct StreamReader {
    bucket: Bucket,
    trust: TrustSet,
}

impl StreamReader {
    /// A reader that accepts manifests signed by keys in `trust`.
    pub fn new(bucket: Bucket, trust: TrustSet) -> Self {
        StreamReader { bucket, trust }
    }

    /// The bucket.
    pub fn bucket(&self) -> &Bucket {
        &self.bucket
    }

    /// The trust set.
    pub fn trust(&self) -> &TrustSet {
        &self.trust
    }

    /// The verified stream descriptor, or `None` when the bucket has no stream.
    pub async fn descriptor(&self) -> StreamResult<Option<StreamDescriptor>> {
        match self.bucket.get_limited(layout::STREAM, MAX_MANIFEST_BYTES as u64).await {
            Ok(b) => {
                let (payload, _) = self.trust.open(&b)?;
                Ok(Some(StreamDescriptor::from_slice(&payload)?))
            }
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Ready steps of a kind, ascending, strictly after `after` when given.
    pub async fn ready_steps(&self, kind: StepKind, after: Option<u64>) -> StreamResult<Vec<u64>> {
        let prefix = layout::ready_prefix(kind);
        // Keys are steps zero-padded to 12 digits; wider ones (10^12 and more) start with
        // 1..9, so they sort after the key of a step below 10^11 (which starts with 0) but may
        // sort before the key of a larger one: past 10^11 the whole prefix is listed and
        // filtered by number (found by review: a stream crossing 10^12 stopped for agents).
        let list = match after {
            Some(s) if s < 100_000_000_000 => self.bucket.list_after(prefix, &layout::ready(kind, s)).await?,
            _ => self.bucket.list(prefix).await?,
        };
        let mut steps: Vec<u64> = list
            .iter()
            .filter_map(|o| layout::parse_step_key(&o.key))
            .filter(|(k, _, name)| *k == kind && name.is_none())
            .map(|(_, s, _)| s)
            .filter(|s| after.is_none_or(|a| *s > a))
            .collect();
        steps.sort_unstable();
        steps.dedup();
        Ok(steps)
    }

    /// A ready marker.
    pub async fn marker(&self, kind: StepKind, step: u64) -> StreamResult<ReadyMarker> {
        let b = self.bucket.get_limited(&layout::ready(kind, step), MAX_MARKER_BYTES).await?;
        let m = ReadyMarker::from_slice(&b)?;
        if m.step != step || m.of != kind {
            return Err(driftless_format::Error::corrupt(
                "ready marker",
                format!("marker at step {step} describes {} {}", m.of, m.step),
            )
            .into());
        }
        Ok(m)
    }

    async fn envelope(&self, kind: StepKind, step: u64, marker: &ReadyMarker) -> StreamResult<(Vec<u8>, Digest)> {
        if marker.of != kind || marker.step != step {
            return Err(corrupt(
                "ready marker",
                format!("marker of {:?} {} used for {kind:?} {step}", marker.of, marker.step),
            ));
        }
        let key = layout::object(kind, step, marker.manifest_name());
        let b = match self.bucket.get_limited(&key, MAX_MANIFEST_BYTES as u64).await {
            Ok(b) => b,
            Err(e) if e.is_not_found() => return Err(StreamError::NotReady { step, detail: format!("{key} missing") }),
            Err(e) => return Err(e.into()),
        };
        let sha = Digest::of(&b);
        if sha != marker.manifest_sha256 {
            // A replayed or swapped manifest; or a marker copied before its manifest by a
            // replicator. Either way do not use it; a retry tells the two apart.
            return Err(StreamError::NotReady {
                step,
                detail: format!("{key} does not match the SHA-256 in its ready marker"),
            });
        }
        let (payload, _) = self.trust.open(&b)?;
        Ok((payload, sha))
    }

    /// The verified manifest of a ready delta, with the SHA-256 of its envelope. Its marker's
    /// fields must agree with it (step, base, payload bytes): routes are planned from markers,
    /// which are not signed.
    pub async fn delta(&self, step: u64) -> StreamResult<(DeltaManifest, Digest)> {
        let marker = self.marker(StepKind::Delta, step).await?;
        self.delta_at(step, &marker).await
    }

    /// [`Self::delta`] with its ready marker already at hand (read by a listing, or carried by
    /// a signed `latest.json`): one GET fewer.
    pub async fn delta_at(&self, step: u64, marker: &ReadyMarker) -> StreamResult<(DeltaManifest, Digest)> {
        let (payload, sha) = self.envelope(StepKind::Delta, step, marker).await?;
        Ok((delta_manifest_of(step, marker, &payload)?, sha))
    }

    /// The verified manifest of a ready anchor.
    pub async fn anchor(&self, step: u64) -> StreamResult<(AnchorManifest, Digest)> {
        let marker = self.marker(StepKind::Anchor, step).await?;
        self.anchor_at(step, &marker).await
    }

    /// [`Self::anchor`] with its ready marker already at hand (the one a route was planned
    /// with): one GET fewer, and the manifest is the one the plan weighed.
    pub async fn anchor_at(&self, step: u64, marker: &ReadyMarker) -> StreamResult<(AnchorManifest, Digest)> {
        let (payload, sha) = self.envelope(StepKind::Anchor, step, marker).await?;
        Ok((anchor_manifest_of(step, marker, &payload)?, sha))
    }

    /// Fetches one object of a step and checks its size and SHA-256. A missing object under a
    /// ready marker is [`StreamError::NotReady`].
    pub async fn object(&self, kind: StepKind, step: u64, name: &str, size: u64, sha: Digest) -> StreamResult<Bytes> {
        let key = layout::object(kind, step, name);
        let b = match self.bucket.get_limited(&key, size).await {
            Ok(b) => b,
            Err(e) if e.is_not_found() => return Err(StreamError::NotReady { step, detail: format!("{key} missing") }),
            Err(e) => return Err(e.into()),
        };
        if b.len() as u64 != size || digest_off_thread(&b).await != sha {
            return Err(driftless_format::Error::corrupt(
                "object",
                format!("{key} does not match its manifest (size or SHA-256)"),
            )
            .into());
        }
        Ok(b)
    }

    /// `latest.json` if it changed since `etag`: `Ok(None)` when not modified or absent.
    pub async fn latest(&self, etag: Option<&str>) -> StreamResult<Option<(LatestHint, Option<String>)>> {
        Ok(match self.poll_latest(etag).await? {
            LatestPoll::Changed(h, tag) => Some((*h, tag)),
            LatestPoll::Unchanged | LatestPoll::Absent => None,
            LatestPoll::Invalid(_, why) => return Err(corrupt("latest.json", why)),
        })
    }

    /// One conditional GET of `latest.json`, telling "not modified since `etag`" from "absent"
    /// (deleted: a poller must stop trusting the hint it holds).
    pub async fn poll_latest(&self, etag: Option<&str>) -> StreamResult<LatestPoll> {
        match self.bucket.poll_limited(layout::LATEST, etag, MAX_MARKER_BYTES).await {
            // Over-sized: not a hint, and not read again until it changes.
            Ok(Some((Err(e), tag))) => Ok(LatestPoll::Invalid(tag, e.to_string())),
            Ok(Some((Ok(b), tag))) => {
                let hint = self.trust.open(&b).and_then(|(payload, _)| LatestHint::from_slice(&payload));
                Ok(match hint {
                    Ok(h) => LatestPoll::Changed(Box::new(h), tag),
                    Err(e) => LatestPoll::Invalid(tag, e.to_string()),
                })
            }
            Ok(None) => Ok(LatestPoll::Unchanged),
            Err(e) if e.is_not_found() => Ok(LatestPoll::Absent),
            Err(e) => Err(e.into()),
        }
    }
}

/// What one conditional GET of `latest.json` found.
#[derive(Debug, Clone)]
pub enum LatestPoll {
    /// A new (verified) hint, with its ETag.
    Changed(Box<LatestHint>, Option<String>),
    /// Not modified since the ETag given.
    Unchanged,
    /// No `latest.json`.
    Absent,
    /// Changed, but it does not verify (a bad signature, not a hint): why, with its ETag, so
    /// that a poller does not read it again until it changes (found by review: an up-to-date
    /// agent read it and listed the bucket at every poll).
    Invalid(Option<String>, String),
}

/// `latest.json` as a poller last read it, kept fresh with one conditional GET per poll. The
/// one implementation of "has `latest.json` changed?" for the agent's poll loop and the Python
/// Follower (found by review: the Follower kept only valid hints, so while `latest.json` did
/// not verify or was deleted it read it whole and listed the bucket at every call, a cost the
/// agent had been rid of). A hint that does not verify, or a deleted `latest.json`, is
/// remembered as such: not changed until it changes.
#[derive(Debug, Default)]
pub struct LatestWatch(Option<Seen>);

#[derive(Debug)]
enum Seen {
    Valid(Box<LatestHint>, Option<String>),
    Invalid(Option<String>),
    Absent,
}

/// What one [`LatestWatch::poll`] found.
#[derive(Debug)]
pub struct Watched<'a> {
    /// The valid hint held now (read now or not modified since); `None` when `latest.json` is
    /// absent or does not verify.
    pub hint: Option<&'a LatestHint>,
    /// `latest.json` changed since the last poll (the first poll, or one after an error, counts
    /// as a change).
    pub changed: bool,
    /// Why a `latest.json` read by this poll does not verify.
    pub invalid: Option<String>,
}

/// Which `latest.json` a [`LatestWatch`] holds: equal versions are the same object, so a
/// conclusion drawn at one holds at the other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LatestVersion {
    /// The object with this ETag (valid or not).
    Tagged(String),
    /// No `latest.json`.
    Absent,
}

impl LatestWatch {
    /// One conditional GET of `latest.json`. An error (the bucket is down) forgets what was
    /// held: the next poll reads it whole and counts as a change.
    pub async fn poll(&mut self, reader: &StreamReader) -> StreamResult<Watched<'_>> {
        let etag = match &self.0 {
            Some(Seen::Valid(_, t) | Seen::Invalid(t)) => t.clone(),
            _ => None,
        };
        let polled = match reader.poll_latest(etag.as_deref()).await {
            Ok(p) => p,
            Err(e) => {
                self.0 = None;
                return Err(e);
            }
        };
        let mut invalid = None;
        let changed = match polled {
            LatestPoll::Unchanged if etag.is_some() => false,
            LatestPoll::Unchanged => {
                self.0 = None;
                true
            }
            LatestPoll::Absent => !matches!(self.0.replace(Seen::Absent), Some(Seen::Absent)),
            // A new ETag on the same content (a backend that ignores `If-None-Match` or whose
            // ETags change at every read, or a writer putting the same bytes again) is no
            // change: what was concluded from it holds (found by review: an up-to-date agent
            // then listed the bucket at every poll).
            LatestPoll::Invalid(tag, why) => {
                let same = matches!(&self.0, Some(Seen::Invalid(Some(t))) if tag.as_ref() == Some(t));
                invalid = Some(why);
                self.0 = Some(Seen::Invalid(tag));
                !same
            }
            LatestPoll::Changed(h, tag) => {
                let same = matches!(&self.0, Some(Seen::Valid(old, _)) if *old == h);
                self.0 = Some(Seen::Valid(h, tag));
                !same
            }
        };
        Ok(Watched { hint: self.hint(), changed, invalid })
    }

    /// The valid hint held (as of the last poll).
    pub fn hint(&self) -> Option<&LatestHint> {
        match &self.0 {
            Some(Seen::Valid(h, _)) => Some(h),
            _ => None,
        }
    }

    /// Which `latest.json` is held; `None` when that is not known (never polled, an error, no
    /// ETag from the backend).
    pub fn version(&self) -> Option<LatestVersion> {
        match &self.0 {
            Some(Seen::Valid(_, Some(t)) | Seen::Invalid(Some(t))) => Some(LatestVersion::Tagged(t.clone())),
            Some(Seen::Absent) => Some(LatestVersion::Absent),
            _ => None,
        }
    }
}

fn corrupt(what: &'static str, detail: String) -> StreamError {
    driftless_format::Error::corrupt(what, detail).into()
}

/// Why an agent would refuse the manifest the ready marker `marker` of step `step` announces,
/// or `None` when it passes: it must be there, be the one the marker's SHA-256 names, be
/// signed by a key of `trust` (when given; without keys only its envelope is parsed, which
/// catches corruption but not a manifest planted with its marker), and agree with the marker
/// ([`delta_manifest_of`]). Only an outage is an error. For the writers that must not take a
/// marker someone else planted for their own newest step: GC and a restarting publisher.
pub async fn check_step(
    bucket: &Bucket,
    trust: Option<&TrustSet>,
    kind: StepKind,
    step: u64,
    marker: &ReadyMarker,
) -> Result<Option<String>, crate::Error> {
    let key = layout::object(kind, step, marker.manifest_name());
    let bytes = match bucket.get_limited(&key, MAX_MANIFEST_BYTES as u64).await {
        Ok(b) => b,
        Err(e) if e.is_not_found() => return Ok(Some(format!("{key} is missing"))),
        Err(crate::Error::TooLarge { size, .. }) => return Ok(Some(format!("{key} is {size} bytes"))),
        Err(e) => return Err(e),
    };
    if Digest::of(&bytes) != marker.manifest_sha256 {
        return Ok(Some(format!("{key} does not match the SHA-256 in its ready marker")));
    }
    let payload = match trust {
        Some(t) => t.open(&bytes).map(|(p, _)| p),
        None => serde_json::from_slice::<driftless_format::sign::Envelope>(&bytes)
            .map(|e| e.payload.into_bytes())
            .map_err(|e| driftless_format::Error::corrupt("envelope", e.to_string())),
    };
    let checked = payload.and_then(|p| match kind {
        StepKind::Delta => delta_manifest_of(step, marker, &p).map(drop),
        StepKind::Anchor => anchor_manifest_of(step, marker, &p).map(drop),
    });
    Ok(checked.err().map(|e| e.to_string()))
}

/// The delta manifest in `payload` (the opened envelope of the manifest `marker` names),
/// checked against that marker: the same step, base and payload bytes. Markers are not signed
/// and routes are planned from them. The one check for every reader (agents, followers, GC).
pub fn delta_manifest_of(
    step: u64,
    marker: &ReadyMarker,
    payload: &[u8],
) -> Result<DeltaManifest, driftless_format::Error> {
    let m = DeltaManifest::from_slice(payload)?;
    same_stream(marker, &m.stream_id)?;
    if m.step != step || Some(m.base_step) != marker.base_step {
        return Err(driftless_format::Error::corrupt(
            "delta manifest",
            format!("manifest of step {} (base {}) found at step {step}", m.step, m.base_step),
        ));
    }
    same_payload(marker, m.payload_bytes())?;
    Ok(m)
}

/// SHA-256 of `b` on the blocking pool. Callers fetch many objects at once from one task (a
/// delta's segments, an anchor's extra files); hashed there, the digests took turns on the one
/// thread polling them (part of the 40 ms between a fast path's plan and its pass on a 16-core
/// host: see the README's "On 16 cores"). Hashed here only if the runtime is shutting down.
async fn digest_off_thread(b: &Bytes) -> Digest {
    let c = b.clone();
    tokio::task::spawn_blocking(move || Digest::of(&c)).await.unwrap_or_else(|_| Digest::of(b))
}

/// [`delta_manifest_of`] for an anchor.
pub fn anchor_manifest_of(
    step: u64,
    marker: &ReadyMarker,
    payload: &[u8],
) -> Result<AnchorManifest, driftless_format::Error> {
    let m = AnchorManifest::from_slice(payload)?;
    same_stream(marker, &m.stream_id)?;
    if m.step != step {
        return Err(driftless_format::Error::corrupt(
            "anchor manifest",
            format!("manifest of step {} found at step {step}", m.step),
        ));
    }
    same_payload(marker, m.payload_bytes())?;
    Ok(m)
}

/// A ready marker's stream (which readers match against `stream.json`'s) must be its signed
/// manifest's: a run's manifest replayed under a marker forged for another run of the same
/// key passed GC's check (agents refuse it on their own: "signed for another stream"), and
/// took a place GC keeps. Found by review.
fn same_stream(marker: &ReadyMarker, signed: &str) -> Result<(), driftless_format::Error> {
    if marker.stream_id == signed {
        return Ok(());
    }
    Err(driftless_format::Error::corrupt(
        "ready marker",
        format!(
            "{:?} {} names stream {:?}; its signed manifest is of another stream, {signed:?}",
            marker.of,
            marker.step,
            marker.stream_id.chars().take(64).collect::<String>()
        ),
    ))
}

/// A ready marker's payload bytes (unsigned: planners compare routes by them) must be its
/// signed manifest's, or a marker could steer readers onto routes they would not take (a
/// follower holding verified weights onto an anchor, say).
fn same_payload(marker: &ReadyMarker, signed: u64) -> Result<(), driftless_format::Error> {
    if marker.payload_bytes == signed {
        return Ok(());
    }
    Err(driftless_format::Error::corrupt(
        "ready marker",
        format!(
            "{:?} {} declares {} payload bytes, its signed manifest {signed}",
            marker.of, marker.step, marker.payload_bytes
        ),
    ))
}
