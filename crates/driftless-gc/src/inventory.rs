//! [`Inventory`]: what the stream layout of a bucket holds, step by step.
//!
//! Built from three listings (`ready/`, then `anchors/` and `deltas/`) plus one small read per
//! ready marker. Markers are listed first: a step whose marker appears between the listings
//! then looks incomplete, and the grace period (plus a re-check before deleting) protects it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use driftless_format::{ReadyMarker, StepKind};
use driftless_store::{layout, stream, Bucket, ObjectInfo};
use futures::{StreamExt, TryStreamExt};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::policy::GcPolicy;

/// Largest ready marker read (they are a few hundred bytes).
pub(crate) const MAX_MARKER_BYTES: u64 = 64 << 10;
/// Marker reads in flight during [`Inventory::load`].
const MARKER_READS: usize = 16;

/// One step of one kind: `anchors/000000000050/` or `deltas/000000000050/`.
///
/// Ordered by step, then deltas before anchors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct StepId {
    /// Delta or anchor.
    pub kind: StepKind,
    /// Step number.
    pub step: u64,
}

impl StepId {
    /// A delta step.
    pub fn delta(step: u64) -> StepId {
        StepId { kind: StepKind::Delta, step }
    }

    /// An anchor step.
    pub fn anchor(step: u64) -> StepId {
        StepId { kind: StepKind::Anchor, step }
    }

    fn rank(&self) -> (u64, u8) {
        (self.step, matches!(self.kind, StepKind::Anchor) as u8)
    }
}

impl Ord for StepId {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.rank().cmp(&other.rank())
    }
}

impl PartialOrd for StepId {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl std::fmt::Display for StepId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            StepKind::Delta => write!(f, "delta {}", self.step),
            StepKind::Anchor => write!(f, "anchor {}", self.step),
        }
    }
}

/// What the ready marker of a step says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MarkerState {
    /// A well-formed marker for this very step.
    Ready(ReadyMarker),
    /// A marker agents would not use: not a valid `ReadyMarker` (the checks agents make), one
    /// that names another step, another stream (`stream.json`'s id), or a manifest its step
    /// directory does not hold. Such a step is never deleted and never used to reach anything
    /// (taken as the newest anchor, a foreign marker at step 1000 let every real step go: found
    /// by review): a human should look at it.
    Unreadable(String),
}

/// One step as listed: its marker (if any) and the objects of its directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepEntry {
    /// Which step.
    pub id: StepId,
    /// The ready marker object and what it says; `None` for an incomplete step.
    pub marker: Option<(ObjectInfo, MarkerState)>,
    /// Objects of the step directory (manifest and payload), sorted by key.
    pub objects: Vec<ObjectInfo>,
}

impl StepEntry {
    fn new(id: StepId) -> StepEntry {
        StepEntry { id, marker: None, objects: Vec::new() }
    }

    /// The parsed marker of a ready step.
    pub fn ready(&self) -> Option<&ReadyMarker> {
        match &self.marker {
            Some((_, MarkerState::Ready(m))) => Some(m),
            _ => None,
        }
    }

    /// Bytes of the marker and every object of the step.
    pub fn bytes(&self) -> u64 {
        let marker = self.marker.as_ref().map_or(0, |(info, _)| info.size);
        self.objects.iter().fold(marker, |acc, o| acc.saturating_add(o.size))
    }

    /// The newest `last_modified` of the marker and the objects.
    pub fn last_modified(&self) -> SystemTime {
        self.marker
            .iter()
            .map(|(info, _)| info.last_modified)
            .chain(self.objects.iter().map(|o| o.last_modified))
            .max()
            .unwrap_or(SystemTime::UNIX_EPOCH)
    }

    /// The manifest key, when the listing holds one: the one the marker names, or for an
    /// incomplete step any `manifest.json` / `g<gen>-manifest.json`.
    pub fn manifest_key(&self) -> Option<&str> {
        let named = self.ready().map(|m| layout::object(self.id.kind, self.id.step, m.manifest_name()));
        self.objects.iter().map(|o| o.key.as_str()).find(|k| match &named {
            Some(n) => k == n,
            None => k.ends_with("/manifest.json") || k.ends_with("-manifest.json"),
        })
    }

    /// The tag (generation, try) of the manifest the ready marker names, when it has one.
    pub fn committed_tag(&self) -> Option<(u64, u32)> {
        self.ready().and_then(|m| layout::name_tag(m.manifest_name()))
    }

    /// Objects of a ready step that no reader will ever read (see [`is_stray`]); `live` says
    /// whether a generation's lease is live, `conditional` whether the store has conditional
    /// create. None when the manifest the marker names is not listed: such a step is left
    /// whole, for a human.
    pub fn strays(&self, live: impl Fn(u64) -> bool, conditional: bool) -> Vec<&ObjectInfo> {
        let Some(committed) = self.committed_tag().filter(|_| self.manifest_key().is_some()) else {
            return Vec::new();
        };
        self.objects.iter().filter(|o| is_stray_key(committed, &o.key, &live, conditional)).collect()
    }

    /// Publisher generations that wrote objects of this step (from their `g<gen>-` names).
    pub fn generations(&self) -> BTreeSet<u64> {
        self.objects
            .iter()
            .filter_map(|o| layout::parse_step_key(&o.key).and_then(|(_, _, n)| n))
            .filter_map(|n| layout::name_generation(&n))
            .collect()
    }
}

/// Whether the object `name` in a ready step's directory is a stray: written by a try or a
/// generation other than the one that committed the step (whose manifest the marker names,
/// `committed`), so that no reader will ever read it. Only names that carry a tag
/// ([`layout::name_tag`]) are judged; anything else is kept.
///
/// A stray of an *older* try of the committing generation is garbage at once on a store with
/// conditional create (`conditional`): a publisher never goes back to a try it gave up, and a
/// late marker PUT of that try cannot replace the marker there. Any other stray (a newer try,
/// another generation, or an older try where a late marker could land over the committed
/// one) is kept while its generation's lease is live (`live`): that publisher may still be
/// uploading it or writing its marker.
///
/// This relies on every object a manifest names carrying the manifest's own tag, which the
/// publisher keeps: anchor objects and extra files are named with the anchor's try, delta
/// segments with try 0 (every delta is committed as try 0), sharded parts with their
/// generation (try 0).
pub(crate) fn is_stray(committed: (u64, u32), name: &str, live: impl Fn(u64) -> bool, conditional: bool) -> bool {
    match layout::name_tag(name) {
        Some(tag) if tag == committed => false,
        Some((g, a)) if g == committed.0 && a < committed.1 && conditional => true,
        Some((g, _)) => !live(g),
        None => false,
    }
}

/// Whether the object at bucket key `key` of a ready step is garbage: a stray ([`is_stray`]),
/// or the spent slice bytes of a sharded delta step ([`is_spent_slices`]). Keys that name no
/// object of a step directory are kept.
pub(crate) fn is_stray_key(committed: (u64, u32), key: &str, live: impl Fn(u64) -> bool, conditional: bool) -> bool {
    let Some((kind, _, Some(n))) = layout::parse_step_key(key) else { return false };
    is_stray(committed, &n, &live, conditional) || (kind == StepKind::Delta && is_spent_slices(committed, &n, &live))
}

/// A sharded rank's slice bytes (`g<gen>-r<rank>-<nonce>-slices.bin`) in a delta step the same
/// generation committed, once that generation's lease is not live. Only that generation's
/// committer reads them, to gather the step's scheduled anchor, and it deletes them when it is
/// done; they stay behind when it died mid-gather or its deletes failed, and no later process
/// gathers them (a restarted committer is a new generation). Kept, they are a model's worth
/// for the step's whole retention.
fn is_spent_slices(committed: (u64, u32), name: &str, live: impl Fn(u64) -> bool) -> bool {
    slices_generation(name) == Some(committed.0) && committed.1 == 0 && !live(committed.0)
}

/// The generation of a sharded rank's slice bytes (`g<gen>-r<rank>-<nonce>-slices.bin`), if
/// `name` is one.
pub(crate) fn slices_generation(name: &str) -> Option<u64> {
    let (g, rest) = name.strip_prefix('g')?.split_once("-r")?;
    let (rank, nonce) = rest.strip_suffix("-slices.bin")?.split_once('-')?;
    let ok = !g.is_empty()
        && g.bytes().all(|b| b.is_ascii_digit())
        && rank.len() == 5
        && rank.bytes().all(|b| b.is_ascii_digit())
        && !nonce.is_empty()
        && !nonce.contains('-');
    ok.then(|| g.parse().ok()).flatten()
}

/// Most ready markers of one kind whose manifest fails [`Inventory::verify_newest`]'s check
/// before a collection gives up, deleting nothing (each costs a GET).
pub const MAX_UNVERIFIED: usize = 256;

impl Inventory {
    /// Checks the manifests of the ready steps that can take a protected place, newest first,
    /// as agents check them ([`stream::check_step`]): of each kind until `keep_anchors` anchors
    /// and `keep_deltas` deltas (at least one of each) pass. A step that fails is marked
    /// [`MarkerState::Unreadable`]: kept for a human, never the newest anchor or step and
    /// never in a kept place. Without the check a marker planted at step 1000 beside a junk
    /// manifest took the newest place, and a garbled newest anchor's manifest made GC delete
    /// the older anchor agents fall back to (both found by review).
    pub async fn verify_newest(&mut self, bucket: &Bucket, policy: &GcPolicy) -> Result<()> {
        let trust = policy.trust.as_ref();
        for (kind, need) in
            [(StepKind::Anchor, policy.keep_anchors.max(1)), (StepKind::Delta, policy.keep_deltas.max(1))]
        {
            let ready: Vec<(StepId, ReadyMarker)> = self
                .steps
                .values()
                .rev()
                .filter(|e| e.id.kind == kind)
                .filter_map(|e| e.ready().map(|m| (e.id, m.clone())))
                .collect();
            let mut checks = futures::stream::iter(ready)
                .map(|(id, m)| async move { (id, stream::check_step(bucket, trust, id.kind, id.step, &m).await) })
                .buffered(MARKER_READS);
            let (mut passed, mut failed) = (0, 0);
            while passed < need {
                let Some((id, outcome)) = checks.next().await else { break };
                let Some(why) = outcome? else {
                    passed += 1;
                    continue;
                };
                failed += 1;
                tracing::warn!(step = id.step, kind = %kind, reason = %why, "ready marker fails the manifest check; kept for a human, not counted");
                if failed > MAX_UNVERIFIED {
                    return Err(Error::Unverifiable { kind, count: failed, step: id.step, reason: why });
                }
                if let Some(e) = self.steps.get_mut(&id) {
                    e.marker = e.marker.take().map(|(info, _)| (info, MarkerState::Unreadable(why)));
                }
            }
        }
        Ok(())
    }
}

/// A publisher generation's lease (`writers/<gen>`), as listed and read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseEntry {
    /// The lease object.
    pub info: ObjectInfo,
    /// The TTL it declares, capped at [`MAX_LEASE_TTL`] (a hostile lease cannot pin
    /// garbage for longer); unreadable leases count as expired at once.
    pub ttl: Duration,
}

impl LeaseEntry {
    /// Whether the lease is live at `now`: renewed (by the bucket's clock) within its TTL, and
    /// a second (found by review: S3 and most stores give `Last-Modified` in whole seconds,
    /// rounded down, so a lease renewed a moment ago could look up to a second old, and one
    /// with a TTL under a second expired; the publisher gives up a ready marker's write when
    /// its lease runs out by its own count, from before the renewal was sent, which is never
    /// after this). A released lease (TTL 0: the publisher stopped) is expired at once.
    pub fn live_at(&self, now: SystemTime) -> bool {
        !self.ttl.is_zero() && self.info.last_modified + self.ttl + Duration::from_secs(1) > now
    }
}

/// Longest lease TTL GC honours (the layout's, which publishers keep to).
pub use driftless_store::layout::MAX_LEASE_TTL;

/// Every step of a stream layout, as seen by one set of listings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inventory {
    /// Steps by id, oldest first.
    pub steps: BTreeMap<StepId, StepEntry>,
    /// Keys under `ready/`, `anchors/` and `deltas/` that are not part of the layout
    /// (never touched; reported for the operator).
    pub foreign: Vec<String>,
    /// Publisher leases by generation.
    pub leases: BTreeMap<u64, LeaseEntry>,
    /// Step claims (`claims/<step>`) by step.
    pub claims: BTreeMap<u64, ObjectInfo>,
    /// Whether the store has conditional create (a late marker PUT cannot replace a marker).
    pub conditional_create: bool,
    /// The stream id `stream.json` declares (read without checking its signature: GC holds no
    /// keys, and this only sorts out markers of another stream), if it could be read.
    pub stream_id: Option<String>,
}

impl Inventory {
    /// List the bucket and read every ready marker.
    pub async fn load(bucket: &Bucket) -> Result<Inventory> {
        // Markers first (see the module docs).
        let markers = bucket.list("ready/").await?;
        let mut objects = bucket.list("anchors/").await?;
        objects.extend(bucket.list("deltas/").await?);

        let mut inv = Inventory { conditional_create: bucket.supports_conditional_create(), ..Default::default() };
        for info in objects {
            inv.add_object(info);
        }
        let mut to_read = Vec::new();
        for info in markers {
            match layout::parse_step_key(&info.key) {
                Some((_, _, None)) => to_read.push(info),
                _ => inv.foreign.push(info.key),
            }
        }
        let read: Vec<Option<(ObjectInfo, MarkerState)>> = futures::stream::iter(to_read)
            .map(|info| {
                let bucket = bucket.clone();
                async move {
                    match bucket.get_limited(&info.key, MAX_MARKER_BYTES).await {
                        Ok(bytes) => {
                            let state = parse_marker(&info.key, &bytes);
                            Ok(Some((info, state)))
                        }
                        // Deleted since the listing (another collection): the step is going away.
                        Err(e) if e.is_not_found() => Ok(None),
                        Err(driftless_store::Error::TooLarge { size, .. }) => {
                            Ok(Some((info, MarkerState::Unreadable(format!("marker is {size} bytes")))))
                        }
                        Err(e) => Err(e),
                    }
                }
            })
            .buffered(MARKER_READS)
            .try_collect()
            .await?;
        for (info, state) in read.into_iter().flatten() {
            inv.add_marker(info, state);
        }
        let stream = match bucket.get_limited(layout::STREAM, MAX_MARKER_BYTES).await {
            Ok(b) => stream_id_of(&b).ok_or("it is not a stream descriptor"),
            Err(e) if e.is_not_found() => Err("it is missing"),
            Err(driftless_store::Error::TooLarge { .. }) => Err("it is too large"),
            Err(e) => return Err(e.into()),
        };
        inv.stream_id = match stream {
            Ok(id) => Some(id),
            // Without the stream's id, a marker of any stream (another run's, replayed into this
            // prefix with its manifest) would be believed and could take a kept place. Agents
            // cannot start without stream.json either, and a publisher writes it before its first
            // marker: markers without it are a damaged stream, and nothing is deleted.
            Err(reason) if inv.steps.values().any(|e| matches!(e.marker, Some((_, MarkerState::Ready(_))))) => {
                return Err(Error::NoStream { reason: reason.into() })
            }
            Err(_) => None,
        };
        inv.vet_markers();
        inv.leases = load_leases(bucket).await?;
        for info in bucket.list(layout::claims_prefix()).await? {
            if let Some(step) = layout::parse_claim_or_lease(&info.key) {
                inv.claims.insert(step, info);
            }
        }
        Ok(inv)
    }

    /// Add a listed object of a step directory; keys outside the layout go to
    /// [`Inventory::foreign`].
    pub fn add_object(&mut self, info: ObjectInfo) {
        match layout::parse_step_key(&info.key) {
            Some((kind, step, Some(_))) => {
                let id = StepId { kind, step };
                let entry = self.steps.entry(id).or_insert_with(|| StepEntry::new(id));
                // Kept sorted by key; listings come sorted, so this is an append.
                let at = entry.objects.partition_point(|o| o.key < info.key);
                entry.objects.insert(at, info);
            }
            _ => self.foreign.push(info.key),
        }
    }

    /// Marks as unreadable the ready markers agents would not use although they parse: of
    /// another stream than [`Inventory::stream_id`], or naming a manifest that is not among
    /// the listed objects of their step (markers are listed before objects and written after
    /// them, so a real step's manifest is always in the listing).
    pub fn vet_markers(&mut self) {
        for e in self.steps.values_mut() {
            let Some((_, MarkerState::Ready(m))) = &e.marker else { continue };
            let why = if self.stream_id.as_ref().is_some_and(|s| *s != m.stream_id) {
                format!("marker of stream {:?}, not this stream's", m.stream_id)
            } else if !e.objects.iter().any(|o| o.key == layout::object(e.id.kind, e.id.step, m.manifest_name())) {
                format!("marker names manifest {:?}, which its step does not hold", m.manifest_name())
            } else {
                continue;
            };
            if let Some((_, state)) = &mut e.marker {
                *state = MarkerState::Unreadable(why);
            }
        }
    }

    /// Add a ready marker (its key must be a marker key of the layout, or it goes to
    /// [`Inventory::foreign`]).
    pub fn add_marker(&mut self, info: ObjectInfo, state: MarkerState) {
        match layout::parse_step_key(&info.key) {
            Some((kind, step, None)) => {
                let id = StepId { kind, step };
                let entry = self.steps.entry(id).or_insert_with(|| StepEntry::new(id));
                entry.marker = Some((info, state));
            }
            _ => self.foreign.push(info.key),
        }
    }
}

/// Lists and reads the publisher leases.
pub(crate) async fn load_leases(bucket: &Bucket) -> Result<BTreeMap<u64, LeaseEntry>> {
    let listed = bucket.list(layout::leases_prefix()).await?;
    let read: Vec<Option<(u64, LeaseEntry)>> = futures::stream::iter(listed)
        .map(|info| {
            let bucket = bucket.clone();
            async move {
                let Some(g) = layout::parse_claim_or_lease(&info.key) else { return Ok(None) };
                let ttl = match bucket.get_limited(&info.key, MAX_MARKER_BYTES).await {
                    Ok(b) => layout::lease_ttl(&b),
                    Err(e) if e.is_not_found() => return Ok(None),
                    Err(driftless_store::Error::TooLarge { .. }) => Duration::ZERO,
                    Err(e) => return Err(e),
                };
                Ok(Some((g, LeaseEntry { info, ttl })))
            }
        })
        .buffered(MARKER_READS)
        .try_collect()
        .await?;
    Ok(read.into_iter().flatten().collect())
}

/// The stream id of a `stream.json` (a signed envelope around a `StreamDescriptor`), unchecked.
fn stream_id_of(bytes: &[u8]) -> Option<String> {
    let env: driftless_format::sign::Envelope = serde_json::from_slice(bytes).ok()?;
    Some(driftless_format::manifest::StreamDescriptor::from_slice(env.payload.as_bytes()).ok()?.stream_id)
}

/// Parse a marker as agents do ([`ReadyMarker::from_slice`]) and check it names the step its
/// key names.
pub(crate) fn parse_marker(key: &str, bytes: &[u8]) -> MarkerState {
    let marker = match ReadyMarker::from_slice(bytes) {
        Ok(m) => m,
        Err(e) => return MarkerState::Unreadable(format!("not a ready marker: {e}")),
    };
    match layout::parse_step_key(key) {
        Some((kind, step, None)) if kind == marker.of && step == marker.step && marker.kind == "ready" => {
            MarkerState::Ready(marker)
        }
        _ => MarkerState::Unreadable(format!(
            "marker says {:?} {} step {}, key says otherwise",
            marker.kind, marker.of, marker.step
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use driftless_format::Digest;

    fn marker(of: StepKind, step: u64, base: Option<u64>) -> Vec<u8> {
        serde_json::to_vec(&ReadyMarker {
            kind: "ready".into(),
            stream_id: "s".into(),
            of,
            step,
            base_step: base,
            manifest_sha256: Digest([0; 32]),
            payload_bytes: 1,
            manifest: None,
        })
        .unwrap()
    }

    #[test]
    fn markers_must_match_their_key() {
        let k = layout::ready(StepKind::Delta, 5);
        assert!(matches!(parse_marker(&k, &marker(StepKind::Delta, 5, Some(4))), MarkerState::Ready(_)));
        assert!(matches!(parse_marker(&k, &marker(StepKind::Delta, 6, Some(4))), MarkerState::Unreadable(_)));
        assert!(matches!(parse_marker(&k, &marker(StepKind::Anchor, 5, None)), MarkerState::Unreadable(_)));
        assert!(matches!(parse_marker(&k, b"{"), MarkerState::Unreadable(_)));
    }

    /// A planted marker with a long stream id (within its 64 KiB object) is unreadable, and
    /// what GC holds of it is a short reason, not the id (found by review: 100k such markers
    /// were held whole, about 6 GB). Ids up to the bound are read.
    #[test]
    fn markers_with_overlong_stream_ids_are_held_as_a_short_reason() {
        let k = layout::ready(StepKind::Delta, 5);
        let with_id = |id: String| {
            let mut v: serde_json::Value = serde_json::from_slice(&marker(StepKind::Delta, 5, Some(4))).unwrap();
            v["stream_id"] = id.into();
            serde_json::to_vec(&v).unwrap()
        };
        let most = driftless_format::manifest::MAX_STREAM_ID;
        assert!(matches!(parse_marker(&k, &with_id("s".repeat(most))), MarkerState::Ready(_)));
        match parse_marker(&k, &with_id("s".repeat(60 << 10))) {
            MarkerState::Unreadable(why) => assert!(why.len() < 200 && why.contains("stream id"), "{why}"),
            s => panic!("{s:?}"),
        }
    }

    #[test]
    fn step_order() {
        assert!(StepId::delta(5) < StepId::anchor(5));
        assert!(StepId::anchor(4) < StepId::delta(5));
    }
}
