//! The stream layout under a bucket prefix.
//!
//! ```text
//! stream.json                          stream descriptor (write-once)
//! latest.json                          hint of the newest ready steps (overwritten)
//! deltas/000000000012/manifest.json    signed manifest of delta step 12
//! deltas/000000000012/<name>           payload objects of delta step 12
//! anchors/000000000010/...             same for anchors
//! ready/deltas/000000000012            ready marker: the commit point of delta step 12
//! ready/anchors/000000000010
//! claims/000000000012                  write-once claim of step 12: generation + weights root
//! writers/000000000007                 lease of publisher generation 7 (renewed while it runs)
//! ```
//!
//! Everything a publisher generation writes inside a step directory is named `g<gen>-<name>`
//! (`deltas/000000000012/g7-manifest.json`, `g7-seg-0000.dls`): the late writes of a killed
//! publisher never collide with its successor's, and GC can tell whose lease covers an object.
//!
//! Steps are zero-padded to 12 digits so that lexicographic listing order is step order.

use driftless_format::StepKind;

/// The stream descriptor, written once when the stream is created.
pub const STREAM: &str = "stream.json";
/// An empty object GC rewrites to read the bucket's clock (its modification time).
pub const GC_CLOCK: &str = "gc-clock";
/// The latest-step hint, overwritten after every commit.
pub const LATEST: &str = "latest.json";
/// Name of a step's manifest object inside its directory.
pub const MANIFEST_NAME: &str = "manifest.json";
/// Longest publisher lease TTL (`writers/<gen>`'s `ttl_ms`): GC honours no longer one (a
/// hostile lease cannot pin garbage for longer), so a publisher never takes a longer one
/// (with one, GC took its lease for expired and deleted its upload under it: found by review).
pub const MAX_LEASE_TTL: std::time::Duration = std::time::Duration::from_secs(3600);

/// The TTL a lease object (`writers/<gen>`) claims, at most [`MAX_LEASE_TTL`]; zero when it
/// does not say (not JSON, no `ttl_ms`): such a lease is never live. The one reading of a
/// lease for GC and for publishers deciding whether an older generation is still writing.
pub fn lease_ttl(bytes: &[u8]) -> std::time::Duration {
    serde_json::from_slice::<serde_json::Value>(bytes)
        .ok()
        .and_then(|v| v.get("ttl_ms").and_then(|t| t.as_u64()))
        .map_or(std::time::Duration::ZERO, |ms| std::time::Duration::from_millis(ms).min(MAX_LEASE_TTL))
}

const DELTAS: &str = "deltas/";
const ANCHORS: &str = "anchors/";
const READY_DELTAS: &str = "ready/deltas/";
const READY_ANCHORS: &str = "ready/anchors/";

/// A step as it appears in keys: zero-padded to 12 digits.
pub fn step_str(step: u64) -> String {
    format!("{step:012}")
}

/// `deltas/000000000012/`
pub fn delta_dir(step: u64) -> String {
    format!("{DELTAS}{}/", step_str(step))
}

/// `anchors/000000000012/`
pub fn anchor_dir(step: u64) -> String {
    format!("{ANCHORS}{}/", step_str(step))
}

fn dir(kind: StepKind, step: u64) -> String {
    match kind {
        StepKind::Delta => delta_dir(step),
        StepKind::Anchor => anchor_dir(step),
    }
}

/// `<dir>manifest.json`
pub fn manifest(kind: StepKind, step: u64) -> String {
    object(kind, step, MANIFEST_NAME)
}

/// `<dir><name>`
pub fn object(kind: StepKind, step: u64, name: &str) -> String {
    format!("{}{name}", dir(kind, step))
}

/// `ready/deltas/000000000012` or `ready/anchors/000000000012`
pub fn ready(kind: StepKind, step: u64) -> String {
    format!("{}{}", ready_prefix(kind), step_str(step))
}

/// `ready/deltas/` or `ready/anchors/`
pub fn ready_prefix(kind: StepKind) -> &'static str {
    match kind {
        StepKind::Delta => READY_DELTAS,
        StepKind::Anchor => READY_ANCHORS,
    }
}

/// Parse a canonical step string (at least 12 ASCII digits, zero-padded exactly as
/// [`step_str`] writes it). Anything else is rejected: keys are hostile input.
pub fn parse_step(s: &str) -> Option<u64> {
    if s.len() < 12 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let step: u64 = s.parse().ok()?;
    (step_str(step) == s).then_some(step)
}

/// Classify a key of the layout.
///
/// Returns `(kind, step, Some(object name))` for objects in a step directory (the manifest
/// included), `(kind, step, None)` for ready markers, and `None` for anything else
/// (`stream.json`, `latest.json`, stray or malformed keys, nested names).
pub fn parse_step_key(key: &str) -> Option<(StepKind, u64, Option<String>)> {
    for kind in [StepKind::Delta, StepKind::Anchor] {
        if let Some(rest) = key.strip_prefix(ready_prefix(kind)) {
            return parse_step(rest).map(|step| (kind, step, None));
        }
        let dir = match kind {
            StepKind::Delta => DELTAS,
            StepKind::Anchor => ANCHORS,
        };
        if let Some(rest) = key.strip_prefix(dir) {
            let (step, name) = rest.split_once('/')?;
            let step = parse_step(step)?;
            if name.is_empty() || name.contains('/') {
                return None;
            }
            return Some((kind, step, Some(name.to_string())));
        }
    }
    None
}

const CLAIMS: &str = "claims/";
const WRITERS: &str = "writers/";

/// `claims/000000000012`: the write-once claim of a step (see the publisher).
pub fn claim(step: u64) -> String {
    format!("{CLAIMS}{}", step_str(step))
}

/// `claims/`
pub fn claims_prefix() -> &'static str {
    CLAIMS
}

/// `writers/000000000007`: the lease of publisher generation 7.
pub fn lease(generation: u64) -> String {
    format!("{WRITERS}{}", step_str(generation))
}

/// `writers/`
pub fn leases_prefix() -> &'static str {
    WRITERS
}

/// The step of a claim key or the generation of a lease key.
pub fn parse_claim_or_lease(key: &str) -> Option<u64> {
    key.strip_prefix(CLAIMS).or_else(|| key.strip_prefix(WRITERS)).and_then(parse_step)
}

/// `g7-<name>`: the name generation 7 gives an object in a step directory.
pub fn generation_name(generation: u64, name: &str) -> String {
    attempt_name(generation, 0, name)
}

/// `g7-<name>` for `attempt` 0, `g7r2-<name>` for attempt 2: a publisher that publishes a
/// step again after a failed try names the new try's objects anew, so that they never take
/// the name of an object the failed try may have left (write-once names would keep the old
/// bytes) or that may still land (a request the client gave up on).
pub fn attempt_name(generation: u64, attempt: u32, name: &str) -> String {
    match attempt {
        0 => format!("g{generation}-{name}"),
        a => format!("g{generation}r{a}-{name}"),
    }
}

/// The generation in an object name written by [`generation_name`] or [`attempt_name`].
pub fn name_generation(name: &str) -> Option<u64> {
    name_tag(name).map(|(generation, _)| generation)
}

/// The generation and try in an object name written by [`attempt_name`] (`g7-x`: `(7, 0)`,
/// `g7r2-x`: `(7, 2)`); `None` for a name without that prefix.
pub fn name_tag(name: &str) -> Option<(u64, u32)> {
    let rest = name.strip_prefix('g')?;
    let (tag, tail) = rest.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit());
    let (num, attempt) = match tag.split_once('r') {
        Some((num, attempt)) if digits(attempt) && attempt.len() <= 10 => (num, attempt.parse().ok()?),
        Some(_) => return None,
        None => (tag, 0),
    };
    if !digits(num) || tail.is_empty() {
        return None;
    }
    Some((num.parse().ok()?, attempt))
}

/// `name` without a `g<gen>-` prefix.
pub fn strip_generation(name: &str) -> &str {
    match name_generation(name) {
        Some(_) => name.split_once('-').map_or(name, |(_, rest)| rest),
        None => name,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn lease_ttls_are_capped_and_default_to_zero() {
        use std::time::Duration;
        assert_eq!(lease_ttl(br#"{"kind":"lease","ttl_ms":30000}"#), Duration::from_secs(30));
        assert_eq!(lease_ttl(br#"{"ttl_ms":99999999999}"#), MAX_LEASE_TTL);
        for junk in [&b"not json"[..], br#"{"ttl_ms":-5}"#, br#"{"ttl_ms":"30000"}"#, b"{}"] {
            assert_eq!(lease_ttl(junk), Duration::ZERO);
        }
    }

    #[test]
    fn generation_names() {
        assert_eq!(strip_generation("g7-extra-config.json"), "extra-config.json");
        assert_eq!(strip_generation("extra-config.json"), "extra-config.json");
        assert_eq!(generation_name(7, "seg-0000.dls"), "g7-seg-0000.dls");
        assert_eq!(name_generation("g7-seg-0000.dls"), Some(7));
        assert_eq!(name_generation("g-x"), None);
        assert_eq!(name_generation("g7-"), None);
        assert_eq!(name_generation("manifest.json"), None);
        assert_eq!(name_generation("g99999999999999999999999-x"), None);
        assert_eq!(attempt_name(7, 0, "manifest.json"), "g7-manifest.json");
        assert_eq!(attempt_name(7, 2, "manifest.json"), "g7r2-manifest.json");
        assert_eq!(name_generation("g7r2-manifest.json"), Some(7));
        assert_eq!(strip_generation("g7r2-extra-config.json"), "extra-config.json");
        assert_eq!(name_generation("g7r-x"), None);
        assert_eq!(name_generation("g7rr2-x"), None);
        assert_eq!(name_generation("gr2-x"), None);
        assert_eq!(name_tag("g7r2-manifest.json"), Some((7, 2)));
        assert_eq!(name_tag("g7-manifest.json"), Some((7, 0)));
        assert_eq!(name_tag("g7r0-x"), Some((7, 0)));
        assert_eq!(name_tag("g7r99999999999-x"), None);
        assert_eq!(name_tag("manifest.json"), None);
        assert_eq!(parse_claim_or_lease(&claim(12)), Some(12));
        assert_eq!(parse_claim_or_lease(&lease(7)), Some(7));
        assert_eq!(parse_claim_or_lease("claims/12"), None);
    }

    use super::*;

    #[test]
    fn keys() {
        assert_eq!(delta_dir(12), "deltas/000000000012/");
        assert_eq!(anchor_dir(12), "anchors/000000000012/");
        assert_eq!(manifest(StepKind::Delta, 12), "deltas/000000000012/manifest.json");
        assert_eq!(object(StepKind::Anchor, 3, "w.bin"), "anchors/000000000003/w.bin");
        assert_eq!(ready(StepKind::Delta, 12), "ready/deltas/000000000012");
        assert_eq!(ready(StepKind::Anchor, 7), "ready/anchors/000000000007");
        assert_eq!(ready_prefix(StepKind::Delta), "ready/deltas/");
        assert_eq!(step_str(u64::MAX), "18446744073709551615");
    }

    #[test]
    fn parse_round_trips() {
        for kind in [StepKind::Delta, StepKind::Anchor] {
            for step in [0, 1, 12, 999_999_999_999, 1_000_000_000_000, u64::MAX] {
                assert_eq!(parse_step_key(&ready(kind, step)), Some((kind, step, None)));
                assert_eq!(parse_step_key(&manifest(kind, step)), Some((kind, step, Some(MANIFEST_NAME.to_string()))));
                assert_eq!(parse_step_key(&object(kind, step, "x.bin")), Some((kind, step, Some("x.bin".to_string()))));
            }
        }
    }

    #[test]
    fn rejects_outside_keys() {
        for key in [
            STREAM,
            LATEST,
            "",
            "deltas/",
            "deltas/000000000012/",
            "deltas/000000000012",
            "deltas/12/manifest.json",
            "deltas/0000000000012/manifest.json",
            "deltas/00000000001x/manifest.json",
            "deltas/000000000012/a/b",
            "ready/deltas/12",
            "ready/deltas/000000000012/",
            "ready/deltas/+00000000012",
            "ready/other/000000000012",
            "deltas/99999999999999999999/m",
        ] {
            assert_eq!(parse_step_key(key), None, "{key}");
        }
    }
}
