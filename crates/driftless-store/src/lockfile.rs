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

/// Locks directory `dir` (its file `lock`, created) for this process: held until the file
/// returned is dropped. Another process holding it: a `WouldBlock` error saying
/// "`dir` is in use by another `holder`".
pub fn lock_dir(dir: &Path, holder: &str) -> io::Result<File> {
    let lock = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(dir.join("lock"))?;
    match try_lock(&lock) {
        Ok(()) => Ok(lock),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
            Err(io::Error::new(io::ErrorKind::WouldBlock, format!("{} is in use by another {holder}", dir.display())))
        }
        Err(e) => Err(e),
    }
}
