//! Local spool directories that a killed process does not leak.
//!
//! A publisher encodes an anchor in a spool before uploading it, and a Python `Follower`
//! proves an anchor (or holds a checked delta chain) in one before writing it into arrays that
//! hold verified weights: each is as large as an anchor. A `TempDir` is removed on drop, which
//! a SIGKILL (an OOM kill, a preempted trainer) never runs; at 70B every kill would leave
//! ~100 GB in `TMPDIR` until the disk is full and every later spool fails.
//!
//! So a [`Spool`] holds an exclusive `flock` on its own directory for its whole life. The kernel
//! drops the lock when the process dies, however it dies, and every new spool first sweeps its
//! parent: a spool directory whose lock can be taken has no owner left and is removed. A spool
//! is created under a hidden name and renamed to its sweepable name only once its lock is held,
//! so a sweep can never take a spool being created. Where `flock` is not supported (some FUSE or
//! network file systems), locking fails for the sweep as well and nothing is removed.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Name prefix of every spool directory.
pub const PREFIX: &str = "driftless-spool-";

/// A hidden directory (a spool whose owner died between creating and renaming it, so empty)
/// is removed once it is this old.
const HIDDEN_AGE: Duration = Duration::from_secs(60);

/// A spool directory, removed on drop and swept by the next spool if its process is killed.
#[derive(Debug)]
pub struct Spool {
    path: PathBuf,
    /// The open directory holding the `flock` (dropped with it, or with the process).
    _lock: File,
}

impl Spool {
    /// A fresh spool named `driftless-spool-<what>-…` in `parent` (created if missing), or in
    /// the system's temporary directory (`TMPDIR`). Spools under the same parent whose
    /// processes are gone are removed first.
    pub fn new(parent: Option<&Path>, what: &str) -> io::Result<Spool> {
        let parent = parent_or_tmp(parent);
        std::fs::create_dir_all(&parent)?;
        sweep(&parent);
        let name = format!("{PREFIX}{what}-{}-{:016x}", std::process::id(), rand::random::<u64>());
        let hidden = parent.join(format!(".{name}"));
        std::fs::create_dir(&hidden)?;
        let made = (|| {
            let lock = File::open(&hidden)?;
            // Held, or not supported here (then a sweep cannot take it either).
            let _ = try_lock(&lock);
            let path = parent.join(&name);
            std::fs::rename(&hidden, &path)?;
            Ok(Spool { path, _lock: lock })
        })();
        if made.is_err() {
            let _ = std::fs::remove_dir_all(&hidden);
        }
        made
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Spool {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

fn parent_or_tmp(parent: Option<&Path>) -> PathBuf {
    parent.map_or_else(std::env::temp_dir, Path::to_path_buf)
}

/// [`sweep`] of `parent`, or of the system's temporary directory: what a process that makes
/// spools there calls as it starts, so the spools of a killed predecessor go at once.
pub fn sweep_in(parent: Option<&Path>) -> usize {
    sweep(&parent_or_tmp(parent))
}

/// Removes the spool directories under `parent` whose owners are gone: those whose lock can be
/// taken, and hidden ones older than a minute. Returns how many were removed. Never fails:
/// anything it cannot read or lock is left alone.
pub fn sweep(parent: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(parent) else { return 0 };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let hidden = match name.strip_prefix('.') {
            Some(n) if n.starts_with(PREFIX) => true,
            None if name.starts_with(PREFIX) => false,
            _ => continue,
        };
        let p = e.path();
        // Real directories only (never a link planted in a shared TMPDIR).
        let Ok(md) = std::fs::symlink_metadata(&p) else { continue };
        if !md.is_dir() {
            continue;
        }
        let orphan = if hidden {
            md.modified().ok().and_then(|m| m.elapsed().ok()).is_some_and(|age| age >= HIDDEN_AGE)
        } else {
            // The lock is released with the file when `f` is dropped, after the removal.
            File::open(&p).is_ok_and(|f| try_lock(&f).is_ok())
        };
        if orphan && std::fs::remove_dir_all(&p).is_ok() {
            tracing::info!(path = %p.display(), "removed the spool of a process that is gone");
            removed += 1;
        }
    }
    removed
}

fn try_lock(f: &File) -> io::Result<()> {
    // SAFETY: flock on a descriptor this function borrows; no memory is passed.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spool_is_removed_on_drop_and_a_live_one_is_never_swept() {
        let parent = tempfile::tempdir().unwrap();
        let a = Spool::new(Some(parent.path()), "a").unwrap();
        std::fs::write(a.path().join("x"), b"x").unwrap();
        let b = Spool::new(Some(parent.path()), "b").unwrap();
        assert_eq!(sweep(parent.path()), 0);
        assert!(a.path().join("x").exists() && b.path().is_dir());
        let pa = a.path().to_path_buf();
        drop(a);
        assert!(!pa.exists());
        // Other directories are none of the sweep's business.
        std::fs::create_dir(parent.path().join("driftless-other")).unwrap();
        std::fs::create_dir(parent.path().join(".driftless-spool-x")).unwrap();
        assert_eq!(sweep(parent.path()), 0);
        assert!(parent.path().join("driftless-other").is_dir());
        assert!(parent.path().join(".driftless-spool-x").is_dir(), "a hidden spool younger than a minute");
    }

    #[test]
    fn an_unlocked_spool_directory_is_swept() {
        let parent = tempfile::tempdir().unwrap();
        let dead = parent.path().join(format!("{PREFIX}dead-1-0"));
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join("anchor.dla"), vec![0u8; 4096]).unwrap();
        let live = Spool::new(Some(parent.path()), "live").unwrap();
        assert!(!dead.exists(), "swept by the new spool");
        assert!(live.path().is_dir());
    }
}
