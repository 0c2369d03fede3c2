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
//! is created (mode 0700) under a hidden name and renamed to its sweepable name only once its
//! lock is held, so a sweep can never take a spool being created. Locks are only as wide as one
//! kernel (NFS mounted `nolock`, Lustre `localflock`): a spool's name carries its machine's boot
//! id, and a sweep only considers spools of its own machine, so ranks sharing a spool directory
//! over a network file system never remove each other's. Where `flock` is not supported at all,
//! a spool is made unlocked and a sweep, failing to lock it, leaves it alone.

use crate::lockfile::try_lock;
use std::fs::File;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
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
    /// A fresh spool named `driftless-spool-<machine>-<what>-<pid>-<random>` in `parent`
    /// (created if missing), or in the system's temporary directory (`TMPDIR`). This machine's
    /// spools under the same parent whose processes are gone are removed first.
    pub fn new(parent: Option<&Path>, what: &str) -> io::Result<Spool> {
        let parent = parent_or_tmp(parent);
        std::fs::create_dir_all(&parent)?;
        sweep(&parent);
        let mut last = None;
        // A name whose lock another process holds (planted in a shared TMPDIR) is given up.
        for _ in 0..4 {
            let name = format!("{}{what}-{}-{:016x}", own_prefix(), std::process::id(), rand::random::<u64>());
            let hidden = parent.join(format!(".{name}"));
            std::fs::DirBuilder::new().mode(0o700).create(&hidden)?;
            let made = (|| {
                let lock = open_dir(&hidden)?;
                match try_lock(&lock) {
                    Ok(()) => {}
                    // Not supported here: a sweep cannot take it either.
                    Err(e) if crate::lockfile::unsupported(&e) => {}
                    Err(e) => return Err(e),
                }
                let path = parent.join(&name);
                std::fs::rename(&hidden, &path)?;
                Ok(Spool { path, _lock: lock })
            })();
            match made {
                Ok(s) => return Ok(s),
                Err(e) => {
                    let _ = std::fs::remove_dir(&hidden);
                    if e.kind() != io::ErrorKind::WouldBlock {
                        return Err(e);
                    }
                    last = Some(e);
                }
            }
        }
        Err(last.expect("four tries"))
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
    let own = own_prefix();
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let hidden = match name.strip_prefix('.') {
            Some(n) if n.starts_with(&own) => true,
            None if name.starts_with(&own) => false,
            _ => continue,
        };
        let p = e.path();
        // Real directories only (never a link or a FIFO planted in a shared TMPDIR).
        let Ok(md) = std::fs::symlink_metadata(&p) else { continue };
        if !md.is_dir() {
            continue;
        }
        let gone = if hidden {
            let old = md.modified().ok().and_then(|m| m.elapsed().ok()).is_some_and(|age| age >= HIDDEN_AGE);
            old && std::fs::remove_dir_all(&p).is_ok()
        } else {
            // Opened without following links or blocking, and the same directory as checked;
            // its lock (held by `f`) is kept through the removal.
            open_dir(&p).is_ok_and(|f| {
                let same = f.metadata().is_ok_and(|m| m.dev() == md.dev() && m.ino() == md.ino());
                same && try_lock(&f).is_ok() && std::fs::remove_dir_all(&p).is_ok()
            })
        };
        if gone {
            tracing::info!(path = %p.display(), "removed the spool of a process that is gone");
            removed += 1;
        }
    }
    removed
}

/// `driftless-spool-<machine>-`: the spools this machine's sweeps consider. The machine is its
/// boot id (one kernel: the scope of `flock`), or its host name where that is unreadable.
fn own_prefix() -> String {
    static TAG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let tag = TAG.get_or_init(|| {
        let raw = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .or_else(|_| std::fs::read_to_string("/proc/sys/kernel/hostname"))
            .unwrap_or_default();
        let t: String = raw.chars().filter(char::is_ascii_alphanumeric).take(12).collect();
        if t.is_empty() {
            "host".into()
        } else {
            t
        }
    });
    format!("{PREFIX}{tag}-")
}

/// Opens a directory without following a link or blocking (a FIFO swapped in).
fn open_dir(p: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_NONBLOCK).open(p)
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
        // Private: another user cannot open (and lock) it.
        assert_eq!(std::fs::metadata(a.path()).unwrap().mode() & 0o777, 0o700);
        let pa = a.path().to_path_buf();
        drop(a);
        assert!(!pa.exists());
        // Other directories are none of the sweep's business.
        std::fs::create_dir(parent.path().join("driftless-other")).unwrap();
        let young = parent.path().join(format!(".{}x", own_prefix()));
        std::fs::create_dir(&young).unwrap();
        // Another machine's spool (its lock is not ours to judge) is left alone.
        let remote = parent.path().join(format!("{PREFIX}elsewhere-anchor-1-0"));
        std::fs::create_dir(&remote).unwrap();
        assert_eq!(sweep(parent.path()), 0);
        assert!(parent.path().join("driftless-other").is_dir());
        assert!(young.is_dir(), "a hidden spool younger than a minute");
        assert!(remote.is_dir(), "another machine's spool");
    }

    #[test]
    fn an_unlocked_spool_directory_is_swept() {
        let parent = tempfile::tempdir().unwrap();
        let dead = parent.path().join(format!("{}dead-1-0", own_prefix()));
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join("anchor.dla"), vec![0u8; 4096]).unwrap();
        let live = Spool::new(Some(parent.path()), "live").unwrap();
        assert!(!dead.exists(), "swept by the new spool");
        assert!(live.path().is_dir());
    }
}
