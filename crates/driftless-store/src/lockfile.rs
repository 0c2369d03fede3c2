//! Exclusive `flock`s: one process per local directory (an agent's `DIR`, a publisher's
//! `--state`, a spool). Held for as long as the returned file is open, released by the
//! kernel when the process dies (SIGKILL included), so a lock is never left stale.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

/// Takes an exclusive `flock` on `f` without waiting (`WouldBlock`: another holds it).
pub fn try_lock(f: &File) -> io::Result<()> {
    // SAFETY: flock on a descriptor this function borrows; no memory is passed.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether `e` says the file system has no `flock` (NFS without a lock manager, Lustre
/// mounted without `flock`): nothing can be locked there, by anyone.
pub fn unsupported(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS))
}

/// Locks directory `dir` (its file `lock`, created) for this process: held until the file
/// returned is dropped. Another process holding it: a `WouldBlock` error saying
/// "`dir` is in use by another `holder`". Where the file system has no `flock`, with
/// `allow_unlocked` the directory is used unlocked, with a warning (found by review: a publisher
/// state directory on such a mount, which worked before there was a lock, failed with a bare
/// "Function not implemented"); without, an error saying so. Any other error names the
/// directory.
pub fn lock_dir(dir: &Path, holder: &str, allow_unlocked: bool) -> io::Result<File> {
    lock_dir_with(dir, holder, allow_unlocked, try_lock)
}

/// [`lock_dir`] with the lock call given (the tests give one that fails as a file system
/// without `flock` does: no such mount is at hand here).
fn lock_dir_with(
    dir: &Path,
    holder: &str,
    allow_unlocked: bool,
    lock: fn(&File) -> io::Result<()>,
) -> io::Result<File> {
    let named = |e: io::Error| io::Error::new(e.kind(), format!("locking {}: {e}", dir.display()));
    let file =
        std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(dir.join("lock")).map_err(named)?;
    match lock(&file) {
        Ok(()) => Ok(file),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
            Err(io::Error::new(io::ErrorKind::WouldBlock, format!("{} is in use by another {holder}", dir.display())))
        }
        Err(e) if unsupported(&e) && !allow_unlocked => Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "{}: the file system has no flock ({e}), so one {holder} cannot be ensured: use a local directory",
                dir.display()
            ),
        )),
        Err(e) if unsupported(&e) => {
            tracing::warn!(dir = %dir.display(), error = %e,
                "the file system has no flock: not locked, so make sure no other {holder} uses it");
            Ok(file)
        }
        Err(e) => Err(named(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_locked_directory_is_refused_until_its_holder_drops_it() {
        let td = tempfile::tempdir().unwrap();
        let held = lock_dir(td.path(), "test", false).unwrap();
        // flock locks belong to an open file: a second open in this process is refused too.
        let e = lock_dir(td.path(), "test holder", true).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        assert!(e.to_string().contains("in use by another test holder"), "{e}");
        drop(held);
        lock_dir(td.path(), "test", false).unwrap();
    }

    /// A file system without `flock`: refused for an agent's directory, used with a warning
    /// for a publisher's state (the call fails as NFS without a lock manager makes it fail).
    #[test]
    fn without_flock_a_directory_is_refused_or_used_unlocked() {
        let td = tempfile::tempdir().unwrap();
        let nolock: fn(&File) -> io::Result<()> = |_| Err(io::Error::from_raw_os_error(libc::ENOLCK));
        let e = lock_dir_with(td.path(), "agent", false, nolock).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::Unsupported);
        assert!(e.to_string().contains("has no flock") && e.to_string().contains("use a local directory"), "{e}");
        lock_dir_with(td.path(), "publisher", true, nolock).unwrap();
        // Any other failure is an error naming the directory, unlocked use allowed or not.
        let denied: fn(&File) -> io::Result<()> = |_| Err(io::Error::from_raw_os_error(libc::EACCES));
        let e = lock_dir_with(td.path(), "publisher", true, denied).unwrap_err();
        assert!(e.to_string().contains(&td.path().display().to_string()), "{e}");
    }
}
