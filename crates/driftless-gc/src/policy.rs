//! [`GcPolicy`]: how much of a stream to keep.

use std::time::Duration;

use driftless_format::TrustSet;
use serde::{Serialize, Serializer};

use crate::error::{Error, Result};

/// Default number of ready deltas kept (`--keep-deltas`).
pub const DEFAULT_KEEP_DELTAS: usize = 100;
/// Default number of ready anchors kept (`--keep-anchors`).
pub const DEFAULT_KEEP_ANCHORS: usize = 10;
/// Default grace period (`--grace`): anything younger is never touched.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(600);

/// What a collection keeps. See the crate docs for the exact rules.
///
/// | setting | default | CLI flag |
/// |---|---|---|
/// | [`keep_deltas`](GcPolicy::keep_deltas) | 100 | `--keep-deltas` |
/// | [`keep_anchors`](GcPolicy::keep_anchors) | 10 | `--keep-anchors` |
/// | [`grace`](GcPolicy::grace) | 10 minutes | `--grace` |
/// | [`max_bytes`](GcPolicy::max_bytes) | none | `--max-bytes` |
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct GcPolicy {
    /// Keep the newest this many ready deltas (and whatever they need to stay reachable).
    pub keep_deltas: usize,
    /// Keep the newest this many ready anchors. The newest anchor is always kept, even at 0.
    pub keep_anchors: usize,
    /// Never touch a step any of whose objects (marker included) is younger than this, so
    /// readers that already listed it can finish, and publishers still uploading a step are
    /// not mistaken for crashed ones. Must exceed the longest upload of one step.
    #[serde(serialize_with = "ser_duration")]
    pub grace: Duration,
    /// Optional bound on the bytes the stream keeps: the oldest retained steps are dropped
    /// until the bound holds, except what grace and reachability of the newest step protect.
    pub max_bytes: Option<u64>,
    /// Keys the manifests of the steps that take a protected role (newest, kept) must be
    /// signed by (`--trust`), as agents check them. Without keys GC checks what it can without
    /// them (the manifest is the one the marker's SHA-256 names, and agrees with it), which
    /// catches corruption but not a marker planted with a manifest of its own. Serialized as
    /// the key ids (`null`: signatures not checked).
    #[serde(rename = "trusted_keys", serialize_with = "ser_trust")]
    pub trust: Option<TrustSet>,
}

fn ser_trust<S: Serializer>(t: &Option<TrustSet>, s: S) -> std::result::Result<S::Ok, S::Error> {
    t.as_ref().map(TrustSet::key_ids).serialize(s)
}

impl PartialEq for GcPolicy {
    fn eq(&self, o: &Self) -> bool {
        (self.keep_deltas, self.keep_anchors, self.grace, self.max_bytes)
            == (o.keep_deltas, o.keep_anchors, o.grace, o.max_bytes)
            && self.trust.as_ref().map(TrustSet::key_ids) == o.trust.as_ref().map(TrustSet::key_ids)
    }
}

impl Eq for GcPolicy {}

fn ser_duration<S: Serializer>(d: &Duration, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(&humantime::format_duration(*d).to_string())
}

impl Default for GcPolicy {
    fn default() -> Self {
        GcPolicy {
            keep_deltas: DEFAULT_KEEP_DELTAS,
            keep_anchors: DEFAULT_KEEP_ANCHORS,
            grace: DEFAULT_GRACE,
            max_bytes: None,
            trust: None,
        }
    }
}

impl GcPolicy {
    /// Same as [`Default::default`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Set [`GcPolicy::keep_deltas`].
    pub fn with_keep_deltas(mut self, n: usize) -> Self {
        self.keep_deltas = n;
        self
    }

    /// Set [`GcPolicy::keep_anchors`].
    pub fn with_keep_anchors(mut self, n: usize) -> Self {
        self.keep_anchors = n;
        self
    }

    /// Set [`GcPolicy::grace`].
    pub fn with_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// Set [`GcPolicy::max_bytes`].
    pub fn with_max_bytes(mut self, max: Option<u64>) -> Self {
        self.max_bytes = max;
        self
    }

    /// Set [`GcPolicy::trust`] (`None` or an empty set: signatures not checked).
    pub fn with_trust(mut self, trust: Option<TrustSet>) -> Self {
        self.trust = trust.filter(|t| !t.is_empty());
        self
    }
}

/// Parse a human duration such as `10m`, `90s`, `1h 30m` or `0s` (the `--grace` flag).
pub fn parse_duration(s: &str) -> Result<Duration> {
    humantime::parse_duration(s.trim())
        .map_err(|e| Error::InvalidDuration { input: s.to_string(), reason: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_setters() {
        let p = GcPolicy::default();
        assert_eq!((p.keep_deltas, p.keep_anchors, p.grace, p.max_bytes), (100, 10, Duration::from_secs(600), None));
        let p =
            GcPolicy::new().with_keep_deltas(3).with_keep_anchors(1).with_grace(Duration::ZERO).with_max_bytes(Some(5));
        assert_eq!((p.keep_deltas, p.keep_anchors, p.grace, p.max_bytes), (3, 1, Duration::ZERO, Some(5)));
        let json = serde_json::to_value(&p).unwrap();
        assert_eq!(json["grace"], "0s");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_duration(" 1h 30m ").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("0s").unwrap(), Duration::ZERO);
        assert!(matches!(parse_duration("ten minutes"), Err(Error::InvalidDuration { .. })));
        assert!(parse_duration("").is_err());
    }
}
