//! Counters exported at `/metrics` (Prometheus text format) and `/v1/status`.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Agent counters. Durations are in milliseconds.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Verified local step (u64::MAX = none).
    pub step: AtomicU64,
    /// Newest ready step seen in the bucket.
    pub newest: AtomicU64,
    /// Unix ms when the newest step's marker was seen.
    pub newest_seen_ms: AtomicU64,
    /// Bytes downloaded on the fast path (one delta onto the local step).
    pub bytes_fast: AtomicU64,
    /// Bytes downloaded replaying several deltas.
    pub bytes_catchup: AtomicU64,
    /// Bytes downloaded through anchors (cold start, recovery).
    pub bytes_anchor: AtomicU64,
    /// Last apply duration.
    pub apply_ms: AtomicU64,
    /// Last verify duration.
    pub verify_ms: AtomicU64,
    /// Verification failures (signature, hash, root).
    pub verify_failures: AtomicU64,
    /// Steps refused (any reason, missing objects included) and planned around.
    pub refusals: AtomicU64,
    /// Notify failures.
    pub notify_failures: AtomicU64,
    /// Syncs completed.
    pub syncs: AtomicU64,
    /// Set once a verified step was loaded by the server (or no notifier is configured).
    pub ready: AtomicU64,
    /// Inactive slot rebuilt by copying the active one.
    pub slot_rebuilds: AtomicU64,
    /// Anchors downloaded.
    pub anchor_downloads: AtomicU64,
}

impl Metrics {
    /// A fresh set with no step.
    pub fn new() -> Self {
        let m = Metrics::default();
        m.step.store(u64::MAX, Relaxed);
        m.newest.store(u64::MAX, Relaxed);
        m
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let g = |a: &AtomicU64| a.load(Relaxed);
        let step = g(&self.step);
        let newest = g(&self.newest);
        let lag = if step == u64::MAX || newest == u64::MAX { 0 } else { newest.saturating_sub(step) };
        let lag_s = if lag == 0 {
            0.0
        } else {
            (driftless_format::manifest::now_ms().saturating_sub(g(&self.newest_seen_ms))) as f64 / 1000.0
        };
        let mut o = String::new();
        let mut m = |name: &str, kind: &str, help: &str, v: String| {
            o.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"));
        };
        m(
            "driftless_step",
            "gauge",
            "Verified local step (-1 when none).",
            if step == u64::MAX { "-1".into() } else { step.to_string() },
        );
        m("driftless_lag_steps", "gauge", "Newest ready step minus local step.", lag.to_string());
        m(
            "driftless_lag_seconds",
            "gauge",
            "Seconds since a newer step than the local one became visible.",
            format!("{lag_s:.3}"),
        );
        o.push_str("# HELP driftless_bytes_downloaded_total Bytes downloaded by path.\n# TYPE driftless_bytes_downloaded_total counter\n");
        for (p, a) in [("fast", &self.bytes_fast), ("catchup", &self.bytes_catchup), ("anchor", &self.bytes_anchor)] {
            o.push_str(&format!("driftless_bytes_downloaded_total{{path=\"{p}\"}} {}\n", g(a)));
        }
        let mut m = |name: &str, kind: &str, help: &str, v: String| {
            o.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"));
        };
        m(
            "driftless_apply_seconds",
            "gauge",
            "Duration of the last apply.",
            format!("{:.3}", g(&self.apply_ms) as f64 / 1000.0),
        );
        m(
            "driftless_verify_seconds",
            "gauge",
            "Duration of the last verification.",
            format!("{:.3}", g(&self.verify_ms) as f64 / 1000.0),
        );
        m(
            "driftless_verify_failures_total",
            "counter",
            "Signature, object hash or weights root failures.",
            g(&self.verify_failures).to_string(),
        );
        m(
            "driftless_refused_steps_total",
            "counter",
            "Steps refused (bad, forged, foreign or missing objects) and planned around.",
            g(&self.refusals).to_string(),
        );
        m(
            "driftless_notify_failures_total",
            "counter",
            "Failed inference server notifications.",
            g(&self.notify_failures).to_string(),
        );
        m("driftless_syncs_total", "counter", "Completed syncs.", g(&self.syncs).to_string());
        m(
            "driftless_slot_rebuilds_total",
            "counter",
            "Inactive slot rebuilt by a local copy of the active one (first delta after an anchor, or after a crash).",
            g(&self.slot_rebuilds).to_string(),
        );
        m("driftless_anchor_downloads_total", "counter", "Anchors downloaded.", g(&self.anchor_downloads).to_string());
        o
    }
}
