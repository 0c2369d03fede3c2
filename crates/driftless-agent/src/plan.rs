//! Planning a sync: which ready steps the bucket announces, which of them may be used, and the
//! cheapest route from what is held locally to the newest usable step.
//!
//! This is the one implementation shared by the agent and the Python `Follower`. Everything
//! here treats the bucket as hostile: ready markers are unsigned, so they are validated
//! ([`ReadyMarker::from_slice`] refuses links that do not point strictly backwards and sizes
//! over [`MAX_PAYLOAD_BYTES`](driftless_format::manifest::MAX_PAYLOAD_BYTES)), bound to the
//! verified stream id, and every walk is bounded by the strictly decreasing step numbers.
//! Steps that failed (bad object, bad manifest, missing object, wrong result) are *refused*
//! for a while ([`Refusals`]) and planned around: an older anchor, an older step, or waiting.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use driftless_format::manifest::{LatestHint, ReadyMarker, StepKind};
use driftless_format::Digest;
use driftless_store::stream::{check_step, StreamError, StreamReader};
use futures::{StreamExt, TryStreamExt};
use tracing::warn;

/// A route to a target step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The step reached.
    pub target: u64,
    /// Anchor to load first (`None`: start from the local step).
    pub anchor: Option<u64>,
    /// Deltas to apply, in order.
    pub deltas: Vec<u64>,
    /// Payload bytes to download (anchor + deltas, from the markers).
    pub bytes: u64,
}

/// The ready steps of a stream, with their validated markers.
#[derive(Debug, Clone, Default)]
pub struct Candidates {
    /// Ready anchors.
    pub anchors: BTreeMap<u64, ReadyMarker>,
    /// Ready deltas.
    pub deltas: BTreeMap<u64, ReadyMarker>,
    /// Not the whole listing: it failed, or it held more unknown markers than one plan reads
    /// ([`MAX_MARKER_READS`]), so these are the signed `latest.json`'s newest anchor and chain,
    /// or only the newest markers. An older step may be missing (a caller asking for one says
    /// why).
    pub partial: bool,
}

impl Candidates {
    /// The marker of a step.
    pub fn marker(&self, kind: StepKind, step: u64) -> Option<&ReadyMarker> {
        match kind {
            StepKind::Anchor => self.anchors.get(&step),
            StepKind::Delta => self.deltas.get(&step),
        }
    }

    /// Newest announced step of either kind.
    pub fn newest(&self) -> Option<u64> {
        self.anchors.keys().next_back().copied().max(self.deltas.keys().next_back().copied())
    }
}

/// The rule for another stream at the prefix (a new run, or an older one replayed: its signed
/// `stream.json` and objects copied back), for a holder of a verified step of stream
/// `held_stream` created at `held_created` ms: it is followed only when created no earlier.
/// The agent and the Python Follower apply this one rule; `remedy` says how to follow it
/// anyway. Found by review: a replayed older run rolled agents back to its weights, and two
/// descriptors alternating had every agent load an anchor at each switch.
pub fn older_run(
    held_stream: &str,
    held_created: u64,
    d: &driftless_format::manifest::StreamDescriptor,
    remedy: &str,
) -> Result<(), driftless_format::Error> {
    if d.stream_id == held_stream || d.created_at_ms >= held_created {
        return Ok(());
    }
    Err(driftless_format::Error::corrupt(
        "stream.json",
        format!(
            "it names stream {}, created at {} ms, before stream {held_stream} whose step is held here \
             (created at {held_created} ms): an older run is not followed ({remedy})",
            d.stream_id, d.created_at_ms
        ),
    ))
}

/// The candidates a signed `latest.json` alone gives a follower on step `local` of stream
/// `sid`: the newest delta when it applies to `local` (its marker rides in the hint, so the
/// follower neither lists nor reads markers). `None` when the hint cannot plan from `local`:
/// another stream, a delta on another base, or an anchor newer than that delta (a newer
/// target, which a listing must plan). An anchor of the delta's own step (a sharded
/// publisher's scheduled anchor) does not stand in the way: one delta is the cheaper route.
/// A stale hint (an older publisher's, or one written before the newest marker) only costs
/// the listing it would have saved: markers stay the source of truth.
pub fn from_hint(hint: &LatestHint, sid: &str, local: u64) -> Option<Candidates> {
    let dm = hint.delta_marker.as_ref().filter(|m| {
        hint.stream_id == sid
            && m.stream_id == sid
            && m.of == StepKind::Delta
            && hint.delta == Some(m.step)
            && m.base_step == Some(local)
    })?;
    if hint.anchor.is_some_and(|a| a > dm.step) {
        return None;
    }
    let mut c = Candidates::default();
    c.deltas.insert(dm.step, dm.clone());
    Some(c)
}

/// Polls between two listings of a follower on a step whose signed `latest.json` says nothing
/// changed ([`ListCadence`]).
pub const LIST_EVERY: u64 = 10;
/// The longest such gap, in polls, while the store keeps refusing listings.
pub const MAX_LIST_GAP: u64 = 160;

/// When a follower on a step lists although its signed `latest.json` says nothing changed:
/// markers stay the source of truth (a stale hint is caught there), so every
/// [`LIST_EVERY`]th poll, and less often while the store refuses listings (more keys or key
/// bytes than a listing holds, a key it cannot parse, a listing past its deadline: planted by
/// anyone with write access). Each of those costs up to a million keys of LIST pages and
/// plans from the signed `latest.json` anyway, so the gap doubles, up to [`MAX_LIST_GAP`]
/// polls, and a whole listing brings it back (found by review: it was every 10th poll,
/// whatever happened). The agent's `run` and the Python `Follower` both keep one.
#[derive(Debug, Clone)]
pub struct ListCadence {
    gap: u64,
    next: u64,
}

impl Default for ListCadence {
    fn default() -> Self {
        ListCadence { gap: LIST_EVERY, next: LIST_EVERY }
    }
}

impl ListCadence {
    /// Whether poll `n` (counted from 1) lists.
    pub fn due(&self, n: u64) -> bool {
        n >= self.next
    }

    /// After poll `n`: `listed` is how its listing went ([`MarkerCache::listing_failed`]:
    /// `None` when it did not list). A listing made for another reason (a cold start, a gap
    /// the hint cannot plan) that worked leaves the periodic one where it was, every 10th
    /// poll; one that failed backs it off too.
    pub fn after(&mut self, n: u64, listed: Option<bool>) {
        let due = self.due(n);
        match listed {
            Some(true) => {
                self.gap = (self.gap * 2).min(MAX_LIST_GAP);
                self.next = n + self.gap;
            }
            Some(false) => {
                self.gap = LIST_EVERY;
                if due || self.next > n + self.gap {
                    self.next = n + self.gap;
                }
            }
            None if due => self.next = n + self.gap,
            None => {}
        }
    }
}

/// Whether a signed `latest.json` names step `local` of stream `sid` as the newest step (its
/// delta's or its anchor's): the Python `Follower`'s fast poll takes it for up to date
/// without listing (a stale hint delays it until its periodic listing; markers stay the
/// source of truth). The agent polls `latest.json` conditionally and lists when it changed,
/// and `sync_once` always plans from the listing unless the hint gives a route: an explicit
/// sync looks at the markers, planted ones included.
pub fn hint_is_current(hint: &LatestHint, sid: &str, local: u64) -> bool {
    hint.stream_id == sid && hint.delta.max(hint.anchor) == Some(local)
}

/// Steps that failed and are left out of plans for a while.
///
/// A refusal is keyed by the step and the manifest SHA-256 its marker names, so a step that is
/// re-announced differently is planned again at once; otherwise it is retried after `ttl`
/// (doubling on each repeated failure, at most 64 x `ttl`), which is how an agent recovers by
/// itself once a fault in the bucket is repaired without hammering a bad object every poll.
#[derive(Debug, Clone)]
pub struct Refusals {
    ttl: Duration,
    map: HashMap<(StepKind, u64), Refusal>,
}

/// What was wrong with a refused step: what the caller may do about it, and which error (exit
/// code, Python class) reports it. Carried from the error that refused the step, never read
/// back from its message (found by review: the agent's Python class was picked by words in
/// the reason, and the Follower reported every held refusal as corrupt, an untrusted one too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// Its objects were missing or unreadable (not there yet, or collected): retrying may
    /// help; not a verification failure.
    Missing,
    /// Bytes that are not what the step's signed manifest or the format says (or a step
    /// signed for another stream, or another run): another copy might do.
    Corrupt,
    /// A signature missing, unknown or wrong: never applied.
    Untrusted,
    /// Made for another base than the step it names.
    WrongBase,
}

impl Fault {
    /// Whether the step's objects were only missing ([`Fault::Missing`]).
    pub fn is_missing(self) -> bool {
        self == Fault::Missing
    }

    /// The fault a format error names (anything but a signature or base fault is corrupt).
    pub fn of_format(e: &driftless_format::Error) -> Fault {
        match e.kind() {
            driftless_format::ErrorKind::Untrusted => Fault::Untrusted,
            driftless_format::ErrorKind::WrongBase => Fault::WrongBase,
            _ => Fault::Corrupt,
        }
    }
}

/// One refused step.
#[derive(Debug, Clone)]
pub struct Refusal {
    /// Manifest SHA-256 of the marker that was refused (`None`: no marker could be read).
    pub manifest_sha256: Option<Digest>,
    /// Why.
    pub reason: String,
    /// Refused until then.
    pub until: Instant,
    /// Consecutive failures.
    pub count: u32,
    /// What was wrong with it.
    pub fault: Fault,
    /// Refused during the current sync, whatever the TTL (so one sync never retries a step
    /// it has just seen fail, even with a zero TTL).
    pub pinned: bool,
}

impl Default for Refusals {
    fn default() -> Self {
        Refusals::new(Duration::from_secs(30))
    }
}

impl Refusals {
    /// Refusals that expire after `ttl` (doubling per repeat).
    pub fn new(ttl: Duration) -> Self {
        Refusals { ttl, map: HashMap::new() }
    }

    /// Refuses a step. A second manifest of the same step refused in the same sync (the signed
    /// `latest.json` names one, the ready marker another) refuses the step whatever its
    /// manifest, keeping the graver fault of the two (found by review: each refusal replaced
    /// the other, so the plans alternated between the two manifests, a GET each, until
    /// [`MAX_UNUSABLE_ROUNDS`]).
    pub fn refuse(&mut self, kind: StepKind, step: u64, sha: Option<Digest>, reason: String, fault: Fault) {
        let prev = self.map.get(&(kind, step));
        // Once per sync: a step refused again in the sync that refused it (its other manifest,
        // a careful retry) is not a repeat (found by review: two manifests doubled the hold
        // twice per sync, 64x the TTL after a few).
        let count = prev.map_or(1, |r| if r.pinned { r.count } else { r.count.saturating_add(1) });
        let (sha, reason, fault) = match prev {
            Some(r) if r.pinned && r.manifest_sha256 != sha => {
                if fault.is_missing() && !r.fault.is_missing() {
                    (None, r.reason.clone(), r.fault)
                } else {
                    (None, reason, fault)
                }
            }
            _ => (sha, reason, fault),
        };
        // Capped: a library caller's `refuse_for` may be anything, and an `Instant` past its
        // range panics.
        let hold = self.ttl.saturating_mul(1u32 << (count - 1).min(6)).min(Duration::from_secs(365 * 86_400));
        let until = Instant::now() + hold;
        self.map.insert((kind, step), Refusal { manifest_sha256: sha, reason, until, count, fault, pinned: true });
    }

    /// Starts a new sync: refusals made by earlier syncs hold only until their TTL.
    pub fn begin_round(&mut self) {
        for r in self.map.values_mut() {
            r.pinned = false;
        }
    }

    /// Refused steps whose refusal has run out (not of the current sync): their markers are
    /// worth reading again, as a repaired step has a new one.
    pub fn expired(&self) -> Vec<(StepKind, u64)> {
        let now = Instant::now();
        self.map.iter().filter(|(_, r)| !r.pinned && now >= r.until).map(|(k, _)| *k).collect()
    }

    /// Whether a step with this marker is refused now.
    pub fn is_refused(&self, kind: StepKind, step: u64, sha: Option<Digest>) -> bool {
        self.map.get(&(kind, step)).is_some_and(|r| {
            (r.pinned || Instant::now() < r.until)
                && (r.manifest_sha256.is_none() || sha.is_none() || r.manifest_sha256 == sha)
        })
    }

    /// Forgets a refusal (the step was used successfully).
    pub fn clear(&mut self, kind: StepKind, step: u64) {
        self.map.remove(&(kind, step));
    }

    /// Drops refusals of steps a fresh listing no longer holds (collected, or planted and
    /// removed): they cannot be planned, and a step listed again later is read again. Found by
    /// review: a bucket planting markers at new step numbers and removing them grew the map,
    /// and the work of every sync, without bound. Kept, it holds at most one entry per listed
    /// step, which the listing's own bound (`max_list_keys`) bounds.
    /// Steps below the oldest listed anchor go too: never planned again (collected by GC).
    /// The steps the signed `hint` names stay refused though unlisted: it is planned from
    /// between listings, and its step refused for being missing must stay so.
    /// Against partial candidates ([`Candidates::partial`]: the listing was not read whole)
    /// only refusals that no longer hold go: the steps not planned are still in the bucket,
    /// and would be downloaded and refused again once the listing is whole.
    pub fn retain_listed(&mut self, listed: &Candidates, hint: Option<&LatestHint>) {
        if listed.partial {
            let now = Instant::now();
            self.map.retain(|_, r| r.pinned || now < r.until);
            return;
        }
        let oldest = listed.anchors.keys().next().copied().unwrap_or(0);
        let hinted = |kind: StepKind, step: u64| {
            hint.is_some_and(|h| match kind {
                StepKind::Delta => h.delta == Some(step),
                StepKind::Anchor => h.anchor == Some(step),
            })
        };
        self.map
            .retain(|&(kind, step), _| hinted(kind, step) || (step >= oldest && listed.marker(kind, step).is_some()));
    }

    /// Current refusals, oldest step first.
    pub fn list(&self) -> Vec<(StepKind, u64, &Refusal)> {
        let now = Instant::now();
        let mut v: Vec<_> =
            self.map.iter().filter(|(_, r)| r.pinned || now < r.until).map(|((k, s), r)| (*k, *s, r)).collect();
        v.sort_by_key(|(k, s, _)| (*s, *k == StepKind::Delta));
        v
    }

    fn usable(&self, kind: StepKind, m: &ReadyMarker) -> bool {
        !self.is_refused(kind, m.step, Some(m.manifest_sha256))
    }
}

/// Steps refused after their payload was read that one sync goes past before it gives up
/// (each cost a download).
pub const MAX_REFUSED_ROUNDS: u32 = 32;

/// Steps refused before any payload was read (from the marker and manifest: one GET each)
/// that one sync goes past: a sync stays bounded (about a minute at 15 ms a GET), while
/// thousands of planted markers cannot keep it from the real steps (found by review: with
/// one cap of 32 for both, 40 planted markers stopped every sync that listed; refusals hold
/// for `refuse_for` and double on repeats, so the next syncs go on past the rest).
pub const MAX_UNUSABLE_ROUNDS: u32 = 4096;

/// A step's kind and number.
type StepKey = (StepKind, u64);

/// Most unknown ready markers one plan reads ([`MarkerCache::candidates`]). The default
/// retention lists about 110 (100 deltas, 10 anchors) and a steady agent knows all but the
/// newest; past this many unknown (keys planted by anyone who can write the bucket, up to the
/// listing's million, each a GET at every cold start; or a cold start on a bucket that keeps
/// every step of a long run) the plan comes from the signed `latest.json`, as when the listing
/// fails: the newest anchor and its chain, the route a cold start takes anyway. Without a
/// usable one, the newest this many are read (anchors first), and later plans read on.
pub const MAX_MARKER_READS: usize = 4096;

/// A sync's listing of ready steps, reused by its later rounds.
#[derive(Debug, Clone)]
struct Listing {
    /// The stream id and `from` it was made for.
    stream_id: String,
    from: Option<u64>,
    /// The steps listed (or, when the listing `failed`, those the signed `latest.json` names).
    anchors: Vec<u64>,
    deltas: Vec<u64>,
    failed: bool,
    /// The listing held more unknown markers than one plan reads, and the plan comes from
    /// the signed `latest.json`'s anchor and chain (those steps, anchors and deltas) while
    /// that anchor is not refused.
    hinted: Option<(Vec<u64>, Vec<u64>)>,
    /// The listing held more unknown markers than one plan reads, and only the newest were
    /// read.
    cut: bool,
}

impl Listing {
    /// Whether its candidates are partial ([`Candidates::partial`]).
    fn partial(&self) -> bool {
        self.failed || self.hinted.is_some() || self.cut
    }
}

/// Reads ready markers, caching them (markers are write-once: a step's marker is read once,
/// not at every poll). Bounded: entries of steps no longer listed are dropped.
#[derive(Debug, Clone, Default)]
pub struct MarkerCache {
    map: HashMap<(StepKind, u64), ReadyMarker>,
    /// Listed steps whose markers name another stream, do not parse or are over-sized:
    /// remembered by key only (not read again, and not held: found by review, 3,000 planted
    /// markers with 60 KB stream ids held 190 MB for the agent's life, and 200 junk markers
    /// were read again at every listing).
    foreign: std::collections::HashSet<(StepKind, u64)>,
    /// The stream `foreign` was judged against: once another stream is followed (a new run
    /// in the prefix), its markers may be among them (found by review: a new run's first
    /// anchor, listed while the agent still followed the old run, was never read again, and
    /// the agent waited for the run's next anchor).
    foreign_of: Option<String>,
    /// This sync's listing, reused by its later rounds.
    listing: Option<Listing>,
    /// Markers forgotten since the last [`MarkerCache::candidates`].
    forgotten: std::collections::HashSet<(StepKind, u64)>,
}

impl MarkerCache {
    /// Planning for `stream_id` from now: when it is another stream than before, the markers
    /// judged foreign are read again, and those cached of other streams dropped. (The agent
    /// and the Follower start a new cache when the stream changes; this keeps a library caller
    /// that reuses one right. One that alternates stream ids re-reads the markers each time.)
    fn follow(&mut self, stream_id: &str) {
        if self.foreign_of.as_deref() != Some(stream_id) {
            self.foreign.clear();
            self.map.retain(|_, m| m.stream_id == stream_id);
            self.foreign_of = Some(stream_id.to_string());
        }
    }

    /// Forgets one marker (it is read again by the next [`MarkerCache::candidates`]).
    pub fn forget(&mut self, kind: StepKind, step: u64) {
        self.map.remove(&(kind, step));
        self.foreign.remove(&(kind, step));
        self.forgotten.insert((kind, step));
    }

    /// Starts a sync: the next [`MarkerCache::candidates`] lists the bucket, and the rounds
    /// after it in the same sync (a step refused, the route planned again) reuse that listing,
    /// reading only the markers forgotten since. Found by review: every round listed again,
    /// and with steps refused one per round, 40 planted markers cost 40 listings and stopped
    /// the sync.
    pub fn begin_sync(&mut self) {
        self.listing = None;
    }

    /// Whether this sync's listing was refused by the store (more keys or key bytes than a
    /// listing holds, a key it cannot parse, no end before its deadline) and the plan came
    /// from the signed `latest.json` instead; `None` when the sync did not list.
    pub fn listing_failed(&self) -> Option<bool> {
        self.listing.as_ref().map(|l| l.failed)
    }

    /// Remembers a marker read elsewhere (from a signed `latest.json`).
    pub fn insert(&mut self, m: ReadyMarker) {
        self.map.insert((m.of, m.step), m);
    }

    /// One marker, from the cache or with one GET.
    pub async fn get(&mut self, reader: &StreamReader, kind: StepKind, step: u64) -> Result<ReadyMarker, StreamError> {
        if let Some(m) = self.map.get(&(kind, step)) {
            return Ok(m.clone());
        }
        let m = reader.marker(kind, step).await?;
        self.map.insert((kind, step), m.clone());
        Ok(m)
    }

    /// Lists the ready steps of `stream_id` and returns their valid markers: anchors all,
    /// deltas after `from` (all when `None`), unless the listing fails or holds more than
    /// [`MAX_MARKER_READS`] unknown markers ([`Candidates::partial`]). Markers that do not
    /// parse, name another step or another stream are left out with a warning; they never fail
    /// the listing. `refused` decides whether the signed `latest.json`'s route can stand for
    /// an overlong listing: not once its anchor is refused (a corrupt newest anchor), nor when
    /// it is older than `local`, the caller's verified step (a replayed one): then the
    /// listing's newest markers are read instead, so an older anchor or a newer step can be
    /// planned.
    pub async fn candidates(
        &mut self,
        reader: &StreamReader,
        stream_id: &str,
        from: Option<u64>,
        refused: &Refusals,
        local: Option<u64>,
    ) -> Result<Candidates, StreamError> {
        self.follow(stream_id);
        let reuse = self.listing.as_ref().is_some_and(|l| l.stream_id == stream_id && l.from == from);
        let mut l = match self.listing.take().filter(|_| reuse) {
            Some(l) => l,
            None => {
                let (anchors, deltas, failed) = self.list(reader, stream_id, from).await?;
                Listing { stream_id: stream_id.to_string(), from, anchors, deltas, failed, hinted: None, cut: false }
            }
        };
        // A reused listing reads only the markers forgotten since (each once: a refused step's
        // marker may have been replaced); a new one every marker it does not know. A hinted
        // plan whose anchor was refused since (found in the thirty-eighth session: with planted
        // keys and a corrupt newest anchor, every sync planned that anchor alone, for good)
        // reads the listing's newest markers, as without a latest.json.
        let forgotten = std::mem::take(&mut self.forgotten);
        let widen = l.hinted.as_ref().is_some_and(|(a, _)| self.refused_anchor(a, refused));
        if widen {
            l.hinted = None;
        }
        let only = (reuse && !widen).then_some(&forgotten);
        let mut missing = match &l.hinted {
            Some((a, d)) => self.unknown(a, d, only),
            None => self.unknown(&l.anchors, &l.deltas, only),
        };
        // Forgotten markers first, should the read be cut (their refusals ran out: the step
        // may have been repaired).
        if only.is_none() && !forgotten.is_empty() {
            let (mut first, rest): (Vec<_>, Vec<_>) = missing.into_iter().partition(|k| forgotten.contains(k));
            first.extend(rest);
            missing = first;
        }
        if missing.len() > MAX_MARKER_READS {
            // Planted keys (or a bucket that keeps every step of a long run, cold): planned from
            // the signed latest.json as when the listing fails, which reads only the markers of
            // the newest anchor's chain; without one, the newest markers within the bound.
            let unread = missing.len();
            // A latest.json older than the caller's verified step is a replay (or a publisher
            // rolled back): its plan would hold the caller where it is while newer steps are
            // listed. (Not the markers read: planted ones that parse are read too.)
            let hinted = match widen {
                true => Err("its anchor is refused".to_string()),
                false => match self.unlisted(reader, stream_id, from).await {
                    Ok(Some((a, _))) if self.refused_anchor(&a, refused) => Err("its anchor is refused".into()),
                    Ok(Some((a, d))) if a.iter().chain(&d).max() < local.as_ref() => {
                        Err("it is older than the verified local step (replayed?)".into())
                    }
                    Ok(Some(ad)) => Ok(ad),
                    Ok(None) => Err("no usable latest.json".into()),
                    // (One that cannot be read now, too: the listing did not fail, so the plan
                    // goes on from it.)
                    Err(e) => Err(e.to_string()),
                },
            };
            match hinted {
                Ok((a, d)) => {
                    warn!(
                        unread,
                        "more ready markers unknown than one plan reads ({MAX_MARKER_READS}): \
                        planned from the signed latest.json instead (planted keys? remove them)"
                    );
                    missing = self.unknown(&a, &d, None);
                    l.hinted = Some((a, d));
                }
                Err(why) => {
                    warn!(unread, reason = %why, "more ready markers unknown than one plan reads \
                        ({MAX_MARKER_READS}): the newest ones read, the others left for later plans");
                    missing.truncate(MAX_MARKER_READS);
                    l.cut = true;
                }
            }
        }
        let fetched: Vec<Option<(StepKey, Option<ReadyMarker>)>> = futures::stream::iter(missing)
            .map(|(kind, s)| async move {
                match reader.marker(kind, s).await {
                    Ok(m) => Ok(Some(((kind, s), Some(m)))),
                    // Deleted by GC between list and get: skip it.
                    Err(StreamError::Store(e)) if e.is_not_found() => Ok(None),
                    // There but unreadable (a planted object the store refuses to serve):
                    // not ready, and not remembered, so that a marker whose read is fixed is
                    // taken at the next plan (found by review: one such key under ready/
                    // failed every listing sync, for good).
                    Err(StreamError::Store(e)) if e.is_unreadable() => {
                        warn!(step = s, kind = %kind, error = %e, "passing over a ready marker that cannot be read");
                        Ok(None)
                    }
                    // Unparsable, over-sized, or naming another step: never a reason to touch
                    // local state; the step is simply not ready.
                    // (Markers are write-once: not read again while listed.)
                    Err(e) if unusable_marker(&e) => {
                        warn!(step = s, kind = %kind, error = %e, "ignoring an invalid ready marker");
                        Ok(Some(((kind, s), None)))
                    }
                    Err(e) => Err(e),
                }
            })
            .buffered(16)
            .try_collect()
            .await?;
        for ((kind, s), m) in fetched.into_iter().flatten() {
            match m {
                Some(m) if m.stream_id == stream_id => {
                    self.map.insert((kind, s), m);
                }
                Some(_) => {
                    warn!(step = s, kind = %kind, "ignoring a ready marker of another stream");
                    self.foreign.insert((kind, s));
                }
                None => {
                    self.foreign.insert((kind, s));
                }
            }
        }
        if !reuse {
            // (The whole listing, also when the plan is the hinted one: those steps are still
            // in the bucket.)
            let listed = l.anchors.iter().map(|&s| (StepKind::Anchor, s));
            let keep: std::collections::HashSet<(StepKind, u64)> =
                listed.chain(l.deltas.iter().map(|&s| (StepKind::Delta, s))).collect();
            // Keep cached anchors and deltas still listed; deltas at or below `from` were not
            // listed this time but may be again (a later cold plan lists them all): keep those too.
            let kept =
                |k: &(StepKind, u64)| keep.contains(k) || (k.0 == StepKind::Delta && from.is_some_and(|f| k.1 <= f));
            self.map.retain(|k, _| kept(k));
            self.foreign.retain(kept);
        }
        let (anchors, deltas) = l.hinted.as_ref().map_or((&l.anchors, &l.deltas), |(a, d)| (a, d));
        let mut out = self.listed(stream_id, anchors.iter().copied(), deltas.iter().copied());
        out.partial = l.partial();
        self.listing = Some(l);
        Ok(out)
    }

    /// Whether the anchor of a hinted plan (`anchors`: none or one) is refused, bound to its
    /// cached marker.
    fn refused_anchor(&self, anchors: &[u64], refused: &Refusals) -> bool {
        anchors.iter().any(|&a| {
            let sha = self.map.get(&(StepKind::Anchor, a)).map(|m| m.manifest_sha256);
            refused.is_refused(StepKind::Anchor, a, sha)
        })
    }

    /// The listed markers to read: neither cached nor remembered as unusable and, for a reused
    /// listing, forgotten since (`only`). Anchors first, then deltas, each newest first: what a
    /// read cut at [`MAX_MARKER_READS`] keeps.
    fn unknown(
        &self,
        anchors: &[u64],
        deltas: &[u64],
        only: Option<&std::collections::HashSet<(StepKind, u64)>>,
    ) -> Vec<(StepKind, u64)> {
        let listed = anchors.iter().rev().map(|&s| (StepKind::Anchor, s));
        listed
            .chain(deltas.iter().rev().map(|&s| (StepKind::Delta, s)))
            .filter(|k| !self.map.contains_key(k) && !self.foreign.contains(k) && only.is_none_or(|f| f.contains(k)))
            .collect()
    }

    /// Lists the ready steps: anchors all, deltas after `from`.
    async fn list(
        &mut self,
        reader: &StreamReader,
        stream_id: &str,
        from: Option<u64>,
    ) -> Result<(Vec<u64>, Vec<u64>, bool), StreamError> {
        let listing = async {
            Ok::<_, StreamError>((
                reader.ready_steps(StepKind::Anchor, None).await?,
                reader.ready_steps(StepKind::Delta, from).await?,
            ))
        };
        let (anchors, deltas) = match listing.await {
            Ok(l) => l,
            // One key the store's client cannot parse fails every listing of its prefix (a
            // non-UTF-8 name on a local directory; `//`, `.`, `..` or a control character on
            // S3, where the whole page fails); so do a million planted keys, or a server that
            // pages slowly for ever. Anyone with write access can cause them; they must not
            // stop every cold start and every poll: plan from the signed `latest.json`.
            Err(StreamError::Store(e)) if e.is_listing_refused() => {
                match self.unlisted(reader, stream_id, from).await? {
                    Some(l) => {
                        warn!(error = %e, "the listing of ready/ failed (a key the store cannot parse, \
                            or too many keys: remove them); planned from the signed latest.json instead");
                        return Ok((l.0, l.1, true));
                    }
                    None => return Err(StreamError::Store(e)),
                }
            }
            Err(e) => return Err(e),
        };
        Ok((anchors, deltas, false))
    }

    /// The cached markers of `stream_id` among the listed steps.
    fn listed(
        &self,
        stream_id: &str,
        anchors: impl Iterator<Item = u64>,
        deltas: impl Iterator<Item = u64>,
    ) -> Candidates {
        let mut out = Candidates::default();
        let listed = anchors.map(|s| (StepKind::Anchor, s)).chain(deltas.map(|s| (StepKind::Delta, s)));
        for (kind, s) in listed {
            let Some(m) = self.map.get(&(kind, s)) else { continue };
            // (Cached by `get` or from a `latest.json` of another stream id.)
            if m.stream_id != stream_id {
                continue;
            }
            match kind {
                StepKind::Anchor => out.anchors.insert(s, m.clone()),
                StepKind::Delta => out.deltas.insert(s, m.clone()),
            };
        }
        out
    }
}

impl MarkerCache {
    /// The newest of `steps` (listed steps of `kind`, ascending) whose ready marker parses,
    /// names its step and belongs to `stream_id`, and whose manifest passes the agents' check
    /// ([`check_step`]: there, the one the marker names, signed by the reader's keys, agreeing
    /// with the marker): what "the newest ready step" means to a poller (found by review: the
    /// Python `Follower.poll()` took the newest key, so one junk key planted at step 999,999
    /// was its answer for good). Markers are read newest first, each once (valid ones cached,
    /// the others remembered by key), in batches that grow from one (the newest marker is
    /// usually valid: two GETs, marker and manifest) to 16 at a time, at most `*budget`
    /// markers. Entries of `kind` no longer in `steps` are dropped.
    pub async fn newest_valid(
        &mut self,
        reader: &StreamReader,
        stream_id: &str,
        kind: StepKind,
        steps: &[u64],
        budget: &mut usize,
    ) -> Result<Newest, StreamError> {
        self.follow(stream_id);
        self.map.retain(|k, _| k.0 != kind || steps.binary_search(&k.1).is_ok());
        self.foreign.retain(|k| k.0 != kind || steps.binary_search(&k.1).is_ok());
        let mut batch = 1;
        let mut top = steps.len();
        // Markers found gone by this call's reads.
        let mut gone = std::collections::HashSet::new();
        let known = |c: &Self, gone: &std::collections::HashSet<u64>, s: u64| {
            c.map.contains_key(&(kind, s)) || c.foreign.contains(&(kind, s)) || gone.contains(&s)
        };
        while top > 0 {
            // Cached answers first, then the unknown markers below them.
            while top > 0 {
                let s = steps[top - 1];
                match self.map.get(&(kind, s)) {
                    Some(m) if m.stream_id == stream_id => return Ok(Newest::Step(s)),
                    Some(_) => top -= 1,
                    None if known(self, &gone, s) => top -= 1,
                    None => break,
                }
            }
            if top == 0 {
                break;
            }
            if *budget == 0 {
                return Ok(Newest::OutOfReads);
            }
            let unknown: Vec<u64> = steps[..top]
                .iter()
                .rev()
                .filter(|&&s| !known(self, &gone, s))
                .take(batch.min(*budget))
                .copied()
                .collect();
            *budget -= unknown.len();
            batch = (batch * 2).min(16);
            let read: Vec<(u64, Result<Option<ReadyMarker>, StreamError>)> = futures::stream::iter(unknown)
                .map(|s| async move {
                    // Markers are not signed: one of this stream's is taken only when the
                    // manifest it names passes the agents' check (a marker planted with this
                    // stream's id at step 999,999 was poll()'s answer for good otherwise).
                    let r = match reader.marker(kind, s).await {
                        Ok(m) if m.stream_id == stream_id => {
                            match check_step(reader.bucket(), Some(reader.trust()), kind, s, &m).await {
                                Ok(None) => Ok(Some(m)),
                                Ok(Some(why)) => {
                                    warn!(step = s, kind = %kind, reason = %why, "ignoring a ready marker whose manifest does not pass");
                                    Ok(None)
                                }
                                Err(e) => Err(StreamError::Store(e)),
                            }
                        }
                        Ok(_) => Ok(None),
                        Err(e) => Err(e),
                    };
                    (s, r)
                })
                .buffered(16)
                .collect()
                .await;
            for (s, r) in read {
                match r {
                    Ok(Some(m)) => {
                        self.map.insert((kind, s), m);
                    }
                    // Deleted between the listing and the read: not ready, passed over (not
                    // remembered: a later listing that still has it reads it again).
                    // Or there but unreadable, the marker or its manifest: passed over the
                    // same way ([`Error::is_unreadable`](driftless_store::Error::is_unreadable)).
                    Err(StreamError::Store(e)) if e.is_not_found() || e.is_unreadable() => {
                        gone.insert(s);
                    }
                    Err(e) if !unusable_marker(&e) => return Err(e),
                    _ => {
                        self.foreign.insert((kind, s));
                    }
                }
            }
        }
        Ok(Newest::NoneValid)
    }
}

/// What [`MarkerCache::newest_valid`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Newest {
    /// The newest valid step.
    Step(u64),
    /// No listed step has a valid marker.
    NoneValid,
    /// The reads ran out before one was found.
    OutOfReads,
}

impl Newest {
    /// The step found, if any.
    pub fn step(self) -> Option<u64> {
        match self {
            Newest::Step(s) => Some(s),
            _ => None,
        }
    }
}

/// A ready marker that can never be used as read (does not parse, names another step, is
/// over-sized): passed over, never a reason to touch local state; markers are write-once, so
/// it is not read again while listed.
fn unusable_marker(e: &StreamError) -> bool {
    matches!(e, StreamError::Format(_) | StreamError::Store(driftless_store::Error::TooLarge { .. }))
}

/// Most delta markers [`MarkerCache::unlisted`] reads walking back from the newest delta (a
/// chain between anchors is `anchor_every` long: 50 by default).
const MAX_UNLISTED_WALK: usize = 1024;

impl MarkerCache {
    /// The ready steps a listing would have found, without listing: the newest anchor and
    /// delta the signed `latest.json` names, and the deltas its newest delta's chain links
    /// back to (one marker GET each, at known keys), down to the newest anchor or `from`.
    /// Markers are validated as when listed; a missing or invalid one ends the walk (the route
    /// then starts from the anchor). `None` when there is no usable `latest.json`.
    async fn unlisted(
        &mut self,
        reader: &StreamReader,
        stream_id: &str,
        from: Option<u64>,
    ) -> Result<Option<(Vec<u64>, Vec<u64>)>, StreamError> {
        let hint = match reader.latest(None).await {
            Ok(Some((h, _))) if h.stream_id == stream_id => h,
            Ok(_) => return Ok(None),
            Err(StreamError::Store(e)) if !e.is_retryable() => return Ok(None),
            Err(StreamError::Format(_)) => return Ok(None),
            Err(e) => return Err(e),
        };
        for (m, step, kind) in
            [(&hint.anchor_marker, hint.anchor, StepKind::Anchor), (&hint.delta_marker, hint.delta, StepKind::Delta)]
        {
            if let Some(m) = m.as_ref().filter(|m| m.of == kind && Some(m.step) == step && m.stream_id == stream_id) {
                self.insert(m.clone());
            }
        }
        let floor = hint.anchor.max(from);
        let mut deltas = vec![];
        let mut next = hint.delta;
        while let Some(s) = next.filter(|&s| floor.is_none_or(|f| s > f) && deltas.len() < MAX_UNLISTED_WALK) {
            match self.get(reader, StepKind::Delta, s).await {
                Ok(m) => {
                    deltas.push(s);
                    next = m.base_step.filter(|&b| b < s);
                }
                Err(StreamError::Store(e)) if e.is_not_found() || !e.is_retryable() => break,
                Err(StreamError::Format(_)) => break,
                Err(e) => return Err(e),
            }
        }
        deltas.reverse();
        Ok(Some((hint.anchor.into_iter().collect(), deltas)))
    }
}

/// Walks base links back from `target` to `start` over usable delta markers: the deltas in
/// order and their payload bytes, or `None` when the chain is broken. Bounded: every link
/// points strictly backwards (checked again here, not only at parse time).
pub fn chain(c: &Candidates, refused: &Refusals, start: u64, target: u64) -> Option<(Vec<u64>, u64)> {
    let mut v = vec![];
    let mut bytes = 0u64;
    let mut s = target;
    while s != start {
        let m = c.deltas.get(&s).filter(|m| refused.usable(StepKind::Delta, m))?;
        let base = m.base_step.filter(|&b| b < s)?;
        v.push(s);
        bytes = bytes.saturating_add(m.payload_bytes);
        if base < start {
            return None;
        }
        s = base;
    }
    v.reverse();
    Some((v, bytes))
}

/// The cheapest route (by payload bytes) from `local` to the newest reachable usable step, or
/// to `want` when given. `None` when nothing newer than `local` is reachable (with `want`:
/// when `want` is not reachable or already local). Ties go to the route from the local step,
/// then to the newest anchor.
///
/// One pass over the steps in order: the cheapest way to hold step `s` is the local copy (at
/// the local step), its anchor, or its delta on the cheapest way to hold the delta's base.
/// Markers come from the bucket, unsigned: the work is linear in their number (times a log),
/// whatever chains they describe (trying every target from every anchor, as this did before,
/// was cubic: 2,200 crafted markers took 3.75 s per plan).
pub fn route(local: Option<u64>, c: &Candidates, refused: &Refusals, want: Option<u64>) -> Option<Route> {
    /// The cheapest known way to hold a step: bytes, the start (`None`: the local copy), and
    /// the step before it on the route when the last hop is a delta.
    #[derive(Clone, Copy)]
    struct Way {
        bytes: u64,
        anchor: Option<u64>,
        via: Option<u64>,
    }
    // Lower is better: fewer bytes, then the local start, then the newer anchor.
    let key = |w: &Way| (w.bytes, std::cmp::Reverse(w.anchor.map_or(u64::MAX, |a| a)));
    let mut steps: BTreeSet<u64> = c
        .deltas
        .iter()
        .filter(|(_, m)| refused.usable(StepKind::Delta, m))
        .map(|(&s, _)| s)
        .chain(c.anchors.iter().filter(|(_, m)| refused.usable(StepKind::Anchor, m)).map(|(&s, _)| s))
        .collect();
    steps.extend(local);
    let mut best: BTreeMap<u64, Way> = BTreeMap::new();
    for &s in &steps {
        let mut ways: Vec<Way> = vec![];
        if local == Some(s) {
            ways.push(Way { bytes: 0, anchor: None, via: None });
        }
        if let Some(m) = c.anchors.get(&s).filter(|m| refused.usable(StepKind::Anchor, m)) {
            ways.push(Way { bytes: m.payload_bytes, anchor: Some(s), via: None });
        }
        if let Some(m) = c.deltas.get(&s).filter(|m| refused.usable(StepKind::Delta, m)) {
            if let Some((b, w)) = m.base_step.filter(|&b| b < s).and_then(|b| best.get(&b).map(|w| (b, *w))) {
                ways.push(Way { bytes: w.bytes.saturating_add(m.payload_bytes), anchor: w.anchor, via: Some(b) });
            }
        }
        if let Some(w) = ways.into_iter().min_by_key(key) {
            best.insert(s, w);
        }
    }
    let target = match want {
        Some(w) => Some(w).filter(|&w| local != Some(w) && best.contains_key(&w))?,
        None => *best.keys().next_back()?,
    };
    if want.is_none() && local.is_some_and(|l| target <= l) {
        return None;
    }
    let w = best[&target];
    // The deltas, walked back from the target along `via` (strictly decreasing steps).
    let mut deltas = vec![];
    let mut at = target;
    while let Some(b) = best[&at].via {
        deltas.push(at);
        at = b;
    }
    deltas.reverse();
    Some(Route { target, anchor: w.anchor, deltas, bytes: w.bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_run_is_followed_only_when_created_no_earlier() {
        let d = |sid: &str, created| driftless_format::manifest::StreamDescriptor {
            kind: "stream".into(),
            version: 3,
            stream_id: sid.into(),
            trusted_keys: vec![],
            created_at_ms: created,
        };
        assert!(older_run("a", 100, &d("a", 50), "").is_ok(), "its own stream, whatever the time");
        assert!(older_run("a", 100, &d("b", 100), "").is_ok());
        assert!(older_run("a", 100, &d("b", 101), "").is_ok());
        let e = older_run("a", 100, &d("b", 99), "say how").unwrap_err();
        assert!(!e.is_retryable(), "{e}");
        assert!(e.to_string().contains("an older run is not followed (say how)"), "{e}");
    }

    fn marker(of: StepKind, step: u64, base: Option<u64>, bytes: u64) -> ReadyMarker {
        ReadyMarker {
            kind: "ready".into(),
            stream_id: "s".into(),
            of,
            step,
            base_step: base,
            manifest_sha256: Digest([step as u8; 32]),
            payload_bytes: bytes,
            manifest: None,
        }
    }

    fn cands(deltas: &[(u64, u64, u64)], anchors: &[(u64, u64)]) -> Candidates {
        Candidates {
            anchors: anchors.iter().map(|&(s, b)| (s, marker(StepKind::Anchor, s, None, b))).collect(),
            deltas: deltas.iter().map(|&(s, base, b)| (s, marker(StepKind::Delta, s, Some(base), b))).collect(),
            partial: false,
        }
    }

    fn r(target: u64, anchor: Option<u64>, deltas: Vec<u64>, bytes: u64) -> Option<Route> {
        Some(Route { target, anchor, deltas, bytes })
    }

    #[test]
    fn a_hint_plans_only_one_delta_on_the_local_step() {
        let hint = |delta: Option<u64>, base: u64, anchor: Option<u64>, sid: &str| LatestHint {
            kind: "latest".into(),
            stream_id: sid.into(),
            delta,
            anchor,
            updated_at_ms: 0,
            delta_marker: delta.map(|d| marker(StepKind::Delta, d, Some(base), 10)),
            anchor_marker: None,
        };
        let c = from_hint(&hint(Some(5), 4, Some(0), "s"), "s", 4).expect("one delta on 4");
        assert_eq!(route(Some(4), &c, &Refusals::default(), None), r(5, None, vec![5], 10));
        // Its own step's anchor (a sharded publisher's scheduled anchor) does not matter.
        assert!(from_hint(&hint(Some(5), 4, Some(5), "s"), "s", 4).is_some());
        // A delta on another base, a newer anchor, another stream, no delta: the listing plans.
        assert!(from_hint(&hint(Some(5), 3, None, "s"), "s", 4).is_none());
        assert!(from_hint(&hint(Some(5), 4, Some(6), "s"), "s", 4).is_none());
        assert!(from_hint(&hint(Some(5), 4, None, "other"), "s", 4).is_none());
        assert!(from_hint(&hint(None, 4, Some(0), "s"), "s", 4).is_none());
        // A marker that names another step than the hint's delta.
        let mut h = hint(Some(5), 4, None, "s");
        h.delta = Some(6);
        assert!(from_hint(&h, "s", 4).is_none());
    }

    #[test]
    fn plans_cheapest_route() {
        let d: Vec<_> = (1..=20).map(|s| (s, s - 1, 10)).collect();
        let c = cands(&d, &[(0, 1000), (10, 1000)]);
        let no = Refusals::default();
        assert_eq!(route(Some(19), &c, &no, None), r(20, None, vec![20], 10));
        assert_eq!(route(Some(15), &c, &no, None).unwrap().anchor, None);
        assert_eq!(route(None, &c, &no, None), r(20, Some(10), (11..=20).collect(), 1100));
        let cheap = cands(&d, &[(0, 5), (10, 5)]);
        assert_eq!(route(Some(1), &cheap, &no, None).unwrap().anchor, Some(10));
        assert_eq!(route(Some(20), &c, &no, None), None);
        // A specific step.
        assert_eq!(route(Some(12), &c, &no, Some(14)), r(14, None, vec![13, 14], 20));
        assert_eq!(route(Some(14), &c, &no, Some(14)), None);
    }

    #[test]
    fn follows_declared_base_and_skips_broken_tips() {
        let c = cands(&[(1, 0, 10), (4, 1, 10), (6, 5, 10)], &[(0, 1000)]);
        assert_eq!(route(Some(0), &c, &Refusals::default(), None), r(4, None, vec![1, 4], 20));
    }

    // Regression (issue 9.2): a marker whose base is itself, or two markers pointing at each
    // other, made the walk loop forever while pushing to a vector.
    #[test]
    fn self_loops_and_cycles_end() {
        let mut c = cands(&[(1, 0, 10), (2, 1, 10)], &[(0, 100)]);
        c.deltas.insert(3, marker(StepKind::Delta, 3, Some(3), 10));
        c.deltas.insert(5, marker(StepKind::Delta, 5, Some(6), 10));
        c.deltas.insert(6, marker(StepKind::Delta, 6, Some(5), 10));
        c.deltas.insert(7, marker(StepKind::Delta, 7, Some(7), u64::MAX));
        assert_eq!(route(None, &c, &Refusals::default(), None), r(2, Some(0), vec![1, 2], 120));
        assert_eq!(route(Some(1), &c, &Refusals::default(), None), r(2, None, vec![2], 10));
    }

    #[test]
    fn sums_saturate() {
        let c = cands(&[(1, 0, u64::MAX), (2, 1, u64::MAX)], &[(0, u64::MAX)]);
        assert_eq!(route(None, &c, &Refusals::default(), None).unwrap().bytes, u64::MAX);
    }

    #[test]
    fn refused_steps_are_planned_around() {
        let c = cands(&[(1, 0, 10), (2, 1, 10), (3, 2, 10), (6, 5, 10)], &[(0, 100), (5, 100)]);
        let mut no = Refusals::default();
        assert_eq!(route(Some(2), &c, &no, None), r(6, Some(5), vec![6], 110));
        // The newest anchor is bad: the chain from the local step, as far as it goes.
        no.refuse(StepKind::Anchor, 5, Some(Digest([5; 32])), "bad".into(), Fault::Corrupt);
        assert_eq!(route(Some(2), &c, &no, None), r(3, None, vec![3], 10));
        // And a bad delta on it: nothing newer reachable; a cold start takes the old anchor.
        no.refuse(StepKind::Delta, 3, Some(Digest([3; 32])), "bad".into(), Fault::Corrupt);
        assert_eq!(route(Some(2), &c, &no, None), None);
        assert_eq!(route(None, &c, &no, None), r(2, Some(0), vec![1, 2], 120));
        // A refusal is bound to the marker it was made for.
        assert!(!no.is_refused(StepKind::Delta, 3, Some(Digest([9; 32]))));
    }

    #[test]
    fn two_manifests_of_a_step_refused_in_one_sync_refuse_the_step() {
        let mut no = Refusals::default();
        no.begin_round();
        let (a, b) = (Some(Digest([1; 32])), Some(Digest([2; 32])));
        no.refuse(StepKind::Delta, 3, a, "bad root".into(), Fault::Corrupt);
        assert!(!no.is_refused(StepKind::Delta, 3, b), "bound to its manifest");
        no.refuse(StepKind::Delta, 3, b, "manifest gone".into(), Fault::Missing);
        for sha in [a, b, Some(Digest([9; 32]))] {
            assert!(no.is_refused(StepKind::Delta, 3, sha));
        }
        let r = &no.list()[0].2;
        assert_eq!((r.fault, r.reason.as_str()), (Fault::Corrupt, "bad root"), "the graver fault is kept");
        assert_eq!(r.count, 1, "refused once in this sync: the hold is not doubled");
        // In a later sync a new manifest replaces the refusal, bound to it again.
        no.begin_round();
        no.refuse(StepKind::Delta, 3, a, "bad again".into(), Fault::Corrupt);
        assert!(!no.is_refused(StepKind::Delta, 3, Some(Digest([9; 32]))));
    }

    #[test]
    fn refusals_expire() {
        let mut no = Refusals::new(Duration::from_millis(20));
        no.refuse(StepKind::Delta, 3, None, "gone".into(), Fault::Corrupt);
        assert!(no.is_refused(StepKind::Delta, 3, Some(Digest([3; 32]))));
        std::thread::sleep(Duration::from_millis(30));
        assert!(no.is_refused(StepKind::Delta, 3, None), "pinned for the rest of the sync");
        no.begin_round();
        assert!(!no.is_refused(StepKind::Delta, 3, Some(Digest([3; 32]))));
        // Repeats back off.
        no.refuse(StepKind::Delta, 3, None, "gone".into(), Fault::Corrupt);
        no.begin_round();
        std::thread::sleep(Duration::from_millis(30));
        assert!(no.is_refused(StepKind::Delta, 3, None), "second refusal lasts twice as long");
    }

    /// The route of the exhaustive search this planner replaced: every target, newest first,
    /// from the local step and then from every anchor at or below it, newest first.
    fn exhaustive(local: Option<u64>, c: &Candidates, refused: &Refusals, want: Option<u64>) -> Option<Route> {
        let anchors: Vec<(u64, u64)> = c
            .anchors
            .iter()
            .filter(|(_, m)| refused.usable(StepKind::Anchor, m))
            .map(|(&s, m)| (s, m.payload_bytes))
            .collect();
        let mut targets: Vec<u64> = c
            .deltas
            .iter()
            .filter(|(_, m)| refused.usable(StepKind::Delta, m))
            .map(|(&s, _)| s)
            .chain(anchors.iter().map(|a| a.0))
            .collect();
        targets.sort_unstable();
        targets.dedup();
        targets.retain(|&t| want.is_none_or(|w| t == w));
        for &target in targets.iter().rev() {
            if local.is_some_and(|l| target <= l) && (want.is_none() || local == Some(target)) {
                return None;
            }
            let mut best = local.and_then(|l| chain(c, refused, l, target)).map(|(v, b)| Route {
                target,
                anchor: None,
                deltas: v,
                bytes: b,
            });
            for &(a, ab) in anchors.iter().rev().filter(|(a, _)| *a <= target) {
                if let Some((v, b)) = chain(c, refused, a, target) {
                    let cost = ab.saturating_add(b);
                    if best.as_ref().is_none_or(|p| cost < p.bytes) {
                        best = Some(Route { target, anchor: Some(a), deltas: v, bytes: cost });
                    }
                }
            }
            if best.is_some() {
                return best;
            }
        }
        None
    }

    /// The one-pass planner gives the exhaustive search's route (ties included) on random
    /// streams: anchors, deltas with any base (behind, broken, self, ahead), refusals, any
    /// local step, any wanted step.
    #[test]
    fn one_pass_matches_the_exhaustive_search() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for _ in 0..3000 {
            let n = 2 + rnd(24);
            let mut c = Candidates::default();
            let mut refused = Refusals::default();
            for s in 0..n {
                if rnd(4) == 0 {
                    c.anchors.insert(s, marker(StepKind::Anchor, s, None, 50 + rnd(200)));
                }
                if s > 0 && rnd(5) != 0 {
                    let base = match rnd(10) {
                        0 => s,
                        1 => s + 1,
                        _ => s.saturating_sub(1 + rnd(3)),
                    };
                    // Few payload sizes: ties happen.
                    c.deltas.insert(s, marker(StepKind::Delta, s, Some(base), 10 * (1 + rnd(3))));
                }
                if rnd(12) == 0 {
                    let kind = if rnd(2) == 0 { StepKind::Delta } else { StepKind::Anchor };
                    refused.refuse(kind, s, Some(Digest([s as u8; 32])), "bad".into(), Fault::Corrupt);
                }
            }
            let local = (rnd(3) != 0).then(|| rnd(n));
            let want = (rnd(4) == 0).then(|| rnd(n));
            assert_eq!(
                route(local, &c, &refused, want),
                exhaustive(local, &c, &refused, want),
                "local {local:?}, want {want:?}, {c:?}"
            );
        }
    }

    /// Markers crafted so that every chain walks down to a base below every anchor (the
    /// exhaustive search took 3.75 s on 2,200 of them, and grew with their cube): 20,000
    /// are planned at once.
    #[test]
    fn crafted_markers_cost_linear_work() {
        let (k, d) = (10_000u64, 10_000u64);
        let mut c = cands(&[], &(1..=k).map(|s| (s, 1000)).collect::<Vec<_>>());
        for s in k + 1..=k + d {
            let base = if s == k + 1 { 0 } else { s - 1 };
            c.deltas.insert(s, marker(StepKind::Delta, s, Some(base), 10));
        }
        // (Milliseconds; the exhaustive search would take hours here.)
        assert_eq!(route(None, &c, &Refusals::default(), None), r(k, Some(k), vec![], 1000));
        assert_eq!(route(Some(0), &c, &Refusals::default(), None).map(|r| r.target), Some(k + d));
    }

    /// Markers of another stream (planted, with 60 KB stream ids) are remembered by key only:
    /// not held (found by review: 3,000 of them held 190 MB for the agent's life) and not read
    /// again at the next listing, until that other stream is the one followed.
    #[tokio::test]
    async fn markers_of_another_stream_are_not_held_nor_read_again() {
        use driftless_store::{layout, Bucket, FaultOp, FaultyStore, StoreOptions};
        let counting = std::sync::Arc::new(FaultyStore::new(std::sync::Arc::new(
            driftless_store::object_store::memory::InMemory::new(),
        )));
        let bucket = Bucket::from_store(counting.clone(), "s", &StoreOptions::default());
        let mut ours = marker(StepKind::Anchor, 0, None, 10);
        ours.stream_id = "ours".into();
        bucket.put(&layout::ready(StepKind::Anchor, 0), serde_json::to_vec(&ours).unwrap().into()).await.unwrap();
        for step in 1..=40 {
            let mut m = marker(StepKind::Delta, step, Some(step - 1), 10);
            m.stream_id = "x".repeat(driftless_format::manifest::MAX_STREAM_ID);
            bucket.put(&layout::ready(StepKind::Delta, step), serde_json::to_vec(&m).unwrap().into()).await.unwrap();
        }
        let reader = StreamReader::new(bucket, driftless_format::TrustSet::new());
        let mut cache = MarkerCache::default();
        let c = cache.candidates(&reader, "ours", None, &Refusals::default(), None).await.unwrap();
        assert_eq!((c.anchors.len(), c.deltas.len()), (1, 0));
        assert_eq!((cache.map.len(), cache.foreign.len()), (1, 40));
        let held: usize = cache.map.values().map(|m| m.stream_id.len()).sum();
        assert!(held < 100, "{held} bytes of stream ids held");
        let gets = counting.calls(FaultOp::Get);
        let c = cache.candidates(&reader, "ours", None, &Refusals::default(), None).await.unwrap();
        assert_eq!((c.anchors.len(), c.deltas.len()), (1, 0));
        assert_eq!(counting.calls(FaultOp::Get), gets, "cached markers read again");
        // The other stream followed (a new run in the prefix): its markers are read, once.
        let other = "x".repeat(driftless_format::manifest::MAX_STREAM_ID);
        let c = cache.candidates(&reader, &other, None, &Refusals::default(), None).await.unwrap();
        assert_eq!((c.anchors.len(), c.deltas.len()), (0, 40));
        assert_eq!(counting.calls(FaultOp::Get), gets + 41, "each marker read once more");
        let c = cache.candidates(&reader, &other, None, &Refusals::default(), None).await.unwrap();
        assert_eq!((c.anchors.len(), c.deltas.len()), (0, 40));
        assert_eq!(counting.calls(FaultOp::Get), gets + 41);
    }

    /// The periodic listing: every 10th poll while listings work, whatever other listings
    /// happen between; backing off (20, 40, ... up to `MAX_LIST_GAP` polls) while they fail;
    /// every 10th again after one that worked.
    #[test]
    fn the_periodic_listing_backs_off_while_listings_fail() {
        let mut c = ListCadence::default();
        let mut listed_at = vec![];
        for n in 1..=2000u64 {
            let due = c.due(n);
            // Polls 1 and 5 list for other reasons (a cold start, a gap), and work; from
            // poll 100 to 1500 every listing fails; then they work again.
            let lists = due || n == 1 || n == 5;
            let outcome = lists.then_some((100..1500).contains(&n));
            if due {
                listed_at.push(n);
            }
            c.after(n, outcome);
        }
        let gaps: Vec<u64> = listed_at.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(listed_at[..3], [10, 20, 30], "{listed_at:?}");
        assert!(gaps.iter().all(|&g| g <= MAX_LIST_GAP), "{gaps:?}");
        let failing: Vec<u64> = listed_at.iter().copied().filter(|n| (100..1500).contains(n)).collect();
        assert_eq!(failing[..6], [100, 120, 160, 240, 400, 560], "{listed_at:?}");
        assert!(failing.len() < 15, "{failing:?}");
        let after = listed_at.iter().copied().filter(|&n| n >= 1500).collect::<Vec<_>>();
        assert!(after.windows(2).skip(1).all(|w| w[1] - w[0] == LIST_EVERY), "{after:?}");
    }

    /// Refusals of steps a partial plan leaves out are kept (they are still in the bucket);
    /// a whole listing without them drops them.
    #[test]
    fn refusals_outlive_a_partial_plan_but_not_a_whole_listing() {
        let mut refused = Refusals::default();
        refused.refuse(StepKind::Anchor, 5, None, "bad".into(), Fault::Corrupt);
        let mut c = cands(&[(11, 10, 1)], &[(10, 100)]);
        c.partial = true;
        refused.retain_listed(&c, None);
        assert!(refused.is_refused(StepKind::Anchor, 5, None), "dropped by a partial plan");
        c.partial = false;
        refused.retain_listed(&c, None);
        assert!(!refused.is_refused(StepKind::Anchor, 5, None), "kept past a whole listing without it");
    }

    /// More unknown markers than one plan reads and no latest.json to plan from instead: the
    /// newest `MAX_MARKER_READS` are read (anchors first), the candidates say they are partial,
    /// and the next plan reads on from where this one stopped.
    #[tokio::test]
    async fn a_plan_reads_at_most_its_bound_of_unknown_markers() {
        use driftless_store::{layout, Bucket, FaultOp, FaultyStore, StoreOptions};
        let counting = std::sync::Arc::new(FaultyStore::new(std::sync::Arc::new(
            driftless_store::object_store::memory::InMemory::new(),
        )));
        let bucket = Bucket::from_store(counting.clone(), "s", &StoreOptions::default());
        let n = MAX_MARKER_READS as u64 + 10;
        let put = |kind, step, base| {
            let mut m = marker(kind, step, base, 10);
            m.stream_id = "ours".into();
            let b = bucket.clone();
            async move { b.put(&layout::ready(kind, step), serde_json::to_vec(&m).unwrap().into()).await.unwrap() }
        };
        put(StepKind::Anchor, 0, None).await;
        for step in 1..=n {
            put(StepKind::Delta, step, Some(step - 1)).await;
        }
        let reader = StreamReader::new(bucket, driftless_format::TrustSet::new());
        let mut cache = MarkerCache::default();
        let g0 = counting.calls(FaultOp::Get);
        let c = cache.candidates(&reader, "ours", None, &Refusals::default(), None).await.unwrap();
        let gets = counting.calls(FaultOp::Get) - g0;
        // (One more GET: the latest.json that is not there.)
        assert!(gets <= MAX_MARKER_READS as u64 + 1, "{gets} GETs");
        assert!(c.partial);
        assert_eq!((c.anchors.len(), c.deltas.len()), (1, MAX_MARKER_READS - 1), "the anchor first, then the newest");
        assert_eq!(c.deltas.keys().next().copied(), Some(n - MAX_MARKER_READS as u64 + 2));
        cache.begin_sync();
        let c = cache.candidates(&reader, "ours", None, &Refusals::default(), None).await.unwrap();
        assert!(!c.partial, "the rest fits one plan");
        assert_eq!((c.anchors.len(), c.deltas.len() as u64), (1, n));
        assert_eq!(route(None, &c, &Refusals::default(), None).map(|r| r.target), Some(n));
    }

    /// `newest_valid` over junk markers and listed markers that are gone: each read once per
    /// call (a gone one is not read again within the call, so the call ends), junk remembered
    /// across calls, and the reads bounded by the budget.
    #[tokio::test]
    async fn newest_valid_reads_each_marker_once_within_its_budget() {
        use driftless_store::{layout, Bucket, FaultOp, FaultyStore, StoreOptions};
        let counting = std::sync::Arc::new(FaultyStore::new(std::sync::Arc::new(
            driftless_store::object_store::memory::InMemory::new(),
        )));
        let bucket = Bucket::from_store(counting.clone(), "s", &StoreOptions::default());
        for step in 1..=50 {
            bucket.put(&layout::ready(StepKind::Delta, step), bytes::Bytes::from_static(b"junk")).await.unwrap();
        }
        // 51..=100 are listed but gone.
        let steps: Vec<u64> = (1..=100).collect();
        let reader = StreamReader::new(bucket, driftless_format::TrustSet::new());
        let mut cache = MarkerCache::default();
        let mut budget = 1000;
        let n = cache.newest_valid(&reader, "ours", StepKind::Delta, &steps, &mut budget).await.unwrap();
        assert_eq!(n, Newest::NoneValid);
        assert_eq!((counting.calls(FaultOp::Get), budget), (100, 900));
        let mut budget = 1000;
        let n = cache.newest_valid(&reader, "ours", StepKind::Delta, &steps, &mut budget).await.unwrap();
        assert_eq!(n, Newest::NoneValid);
        assert_eq!(counting.calls(FaultOp::Get), 150, "junk read again, or gone ones not");
        let mut budget = 10;
        let n = cache.newest_valid(&reader, "ours", StepKind::Delta, &steps, &mut budget).await.unwrap();
        assert_eq!((n, budget), (Newest::OutOfReads, 0));
        assert_eq!(counting.calls(FaultOp::Get), 160);
    }
}
