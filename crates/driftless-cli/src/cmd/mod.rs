//! Subcommands, one file each.

pub mod agent;
pub mod bench;
pub mod bucket;
pub mod demo;
pub mod diff;
pub mod gc;
pub mod hash;
pub mod inspect;
pub mod keygen;
pub mod patch;
pub mod publish;

use driftless_format::ErrorKind;

/// Exit code for an error: 1 when verification failed, 2 otherwise.
pub fn exit_code(e: &anyhow::Error) -> i32 {
    for c in e.chain() {
        if let Some(a) = c.downcast_ref::<driftless_agent::Error>() {
            return if a.is_integrity() { 1 } else { 2 };
        }
        if let Some(f) = c.downcast_ref::<driftless_format::Error>() {
            return match f.kind() {
                ErrorKind::Corrupt | ErrorKind::Untrusted | ErrorKind::WrongBase => 1,
                _ => 2,
            };
        }
    }
    2
}

/// Views of a checkpoint ordered as its layout.
pub fn open(path: &std::path::Path) -> anyhow::Result<driftless_format::Checkpoint> {
    use anyhow::Context;
    driftless_format::Checkpoint::open(path).with_context(|| format!("opening checkpoint {}", path.display()))
}
