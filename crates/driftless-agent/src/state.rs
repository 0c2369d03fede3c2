//! The agent's state file, written atomically (temp file, fsync, rename, fsync dir).

use std::path::Path;

use driftless_format::Digest;
use serde::{Deserialize, Serialize};

/// What the agent knows about its local checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalState {
    /// Stream id the checkpoint belongs to.
    pub stream_id: String,
    /// Verified step of `current/`.
    pub step: u64,
    /// Its weights root.
    pub root: Digest,
    /// A delta being applied in place (step, base step) — set before the first write, cleared
    /// after verification. With `journal` it tells recovery which delta to finish.
    #[serde(default)]
    pub applying: Option<(u64, u64)>,
}

impl LocalState {
    /// Reads `state.json`; `None` when absent or unreadable (treated as cold start).
    pub fn load(dir: &Path) -> Option<LocalState> {
        let b = std::fs::read(dir.join("state.json")).ok()?;
        serde_json::from_slice(&b).ok()
    }

    /// Writes `state.json` atomically.
    pub fn store(&self, dir: &Path) -> std::io::Result<()> {
        use std::io::Write;
        let tmp = dir.join("state.json.tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&serde_json::to_vec_pretty(self).expect("serializes"))?;
        f.sync_all()?;
        std::fs::rename(&tmp, dir.join("state.json"))?;
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    /// Removes the state (before discarding a checkpoint).
    pub fn clear(dir: &Path) -> std::io::Result<()> {
        match std::fs::remove_file(dir.join("state.json")) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}
