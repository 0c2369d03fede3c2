//! The agent's directory: two slots, an atomically switched `current` link, the state file,
//! and the lock.
//!
//! ```text
//! DIR/
//!   lock              flock'ed by the one agent using DIR (a second agent fails at start)
//!   running           present while an agent runs; left behind by a crash => the next start
//!                     re-verifies the active slot before it notifies anything
//!   state.json        which slot is active, its verified step and root, and what the inactive
//!                     slot holds (null = unknown, being written)
//!   current -> slots/a   symlink switched by rename(2): always names a complete verified step
//!   slots/a/  slots/b/   two checkpoint copies: the active one (served) and the inactive one
//!                        (the previous step, kept for rollback, and where the next step is built)
//!   cache/            delta segments of the last steps (content-addressed, hash-checked), so
//!                     bringing the inactive slot forward costs no second download
//! ```
//!
//! Durability order of a switch (tested by tracing system calls): the new slot's data is
//! flushed (fdatasync of every file the pass wrote, fsync of every file, of the slot directory
//! and of `slots/`; the served slot is only ever opened read-only) → `state.json` names it
//! (written to a temp file, fsync, rename, fsync of `DIR`) → `current` is re-pointed (symlink
//! to a temp name, rename over `current`, fsync of `DIR`) → the inference server is notified.
//! A crash between the state write and the link switch is finished at the next start
//! (`current` is re-pointed to the slot the state names, which is already durable). A slot
//! that another process still has open (a slow loader of an older step) is not rebuilt until
//! it is closed ([`AgentDir::open_elsewhere`]).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use driftless_format::Digest;
use serde::{Deserialize, Serialize};

/// One of the two slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Slot {
    /// `slots/a`.
    A,
    /// `slots/b`.
    B,
}

impl Slot {
    /// The other slot.
    pub fn other(self) -> Slot {
        match self {
            Slot::A => Slot::B,
            Slot::B => Slot::A,
        }
    }

    /// Directory name under `slots/`.
    pub fn name(self) -> &'static str {
        match self {
            Slot::A => "a",
            Slot::B => "b",
        }
    }
}

/// A verified step held in a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Held {
    /// Step.
    pub step: u64,
    /// Its weights root.
    pub root: Digest,
}

/// What the agent knows about its directory (`state.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalState {
    /// Layout version of the directory (2: slots).
    #[serde(default)]
    pub version: u32,
    /// Stream id the checkpoints belong to.
    pub stream_id: String,
    /// When that stream was created (its signed descriptor's `created_at_ms`): the agent
    /// follows another stream only when it was created later. Absent in states written before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_created_ms: Option<u64>,
    /// Verified step of the active slot (the one `current` names).
    pub step: u64,
    /// Its weights root.
    pub root: Digest,
    /// The active slot.
    pub active: Slot,
    /// What the inactive slot holds, when it is a complete verified step; `None` while it is
    /// being written, after a crash in the middle of that, or before it was ever filled.
    #[serde(default)]
    pub inactive: Option<Held>,
}

impl LocalState {
    /// The active slot's step and root.
    pub fn held(&self) -> Held {
        Held { step: self.step, root: self.root }
    }

    /// Reads `state.json`; `None` when absent, malformed or of an older layout (a cold start:
    /// nothing is deleted, and the next verified step is built in the slot `current` does
    /// not name). A file that cannot be read (EIO, permissions) is an error, not a cold start.
    pub fn load(dir: &Path) -> std::io::Result<Option<LocalState>> {
        let s = Self::read(dir)?;
        if matches!(s, Some(None)) {
            let path = dir.join("state.json");
            tracing::warn!(path = %path.display(), "state.json is malformed or of another layout: starting cold");
        }
        Ok(s.flatten())
    }

    /// [`LocalState::load`] without its warning: a look at what the disk names, not a start
    /// (a malformed file is `None` all the same).
    pub fn peek(dir: &Path) -> std::io::Result<Option<LocalState>> {
        Ok(Self::read(dir)?.flatten())
    }

    /// `None` when absent, `Some(None)` when it is no state of this layout: malformed, over
    /// 1 MiB, or of another version.
    fn read(dir: &Path) -> std::io::Result<Option<Option<LocalState>>> {
        let path = dir.join("state.json");
        let b = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))),
        };
        Ok(Some(
            (b.len() <= 1 << 20)
                .then(|| serde_json::from_slice::<LocalState>(&b).ok().filter(|s| s.version == 2))
                .flatten(),
        ))
    }

    /// Writes `state.json` durably: temp file, fsync, rename, fsync of the directory.
    pub fn store(&self, dir: &Path) -> std::io::Result<()> {
        let tmp = dir.join("state.json.tmp");
        let mut f = File::create(&tmp)?;
        f.write_all(&serde_json::to_vec_pretty(self).expect("serializes"))?;
        f.sync_all()?;
        std::fs::rename(&tmp, dir.join("state.json"))?;
        sync_dir(dir)
    }
}

/// fsync of a directory (makes renames and new entries in it durable).
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Flushes every regular file of `dir` (fsync) and then the directory itself.
pub fn sync_tree(dir: &Path) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_file() {
            File::open(e.path())?.sync_all()?;
        }
    }
    sync_dir(dir)
}

/// The directory of an agent.
#[derive(Debug)]
pub struct AgentDir {
    dir: PathBuf,
    /// The `flock`ed `DIR/lock`: held until the last clone is dropped ([`AgentDir::guard`]).
    lock: std::sync::Arc<File>,
    /// Whether the previous agent on this directory ended without a clean shutdown.
    pub unclean: bool,
    /// Leave `running` behind at the end (see [`AgentDir::set_keep_running`]).
    keep_running: bool,
}

/// See [`AgentDir::guard`].
#[derive(Clone)]
pub struct DirGuard(#[allow(dead_code)] std::sync::Arc<File>);

impl AgentDir {
    /// Opens (creating) `dir`, takes its lock, and records that an agent runs.
    pub fn open(dir: &Path) -> std::io::Result<AgentDir> {
        let created = !dir.exists();
        std::fs::create_dir_all(dir.join("slots")).map_err(|e| {
            std::io::Error::new(e.kind(), format!("creating the agent directory {}: {e}", dir.display()))
        })?;
        if created {
            // The directory's own entry: without it a power loss can take `DIR` (state and
            // slots with it) after the first switch; a cold start, never a mix, but avoidable.
            // A parent this process may not open (a root-owned mount point) is left as is.
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                match sync_dir(parent) {
                    Err(e) if e.kind() != std::io::ErrorKind::PermissionDenied => return Err(e),
                    _ => {}
                }
            }
        }
        let lock = driftless_store::lockfile::lock_dir(dir, "driftless agent (one agent per directory)", false)?;
        // What a crash inside `link` can leave: the exchange's temp name (a symlink, or the
        // older layout's `current` directory, a whole model, already swapped out), or that
        // directory moved aside with no `current` yet, which is put back: it is still the
        // step served. Only `link` moves it there, and only for the moment between two renames:
        // once `current` names a slot, `link` moves it on to `current.trash` before deleting it,
        // so a directory left half-deleted is never put back. Removing leftovers is best effort:
        // one that cannot be deleted (another owner's files, NFS) must not stop the agent.
        let (cur, old) = (dir.join("current"), dir.join("current.old"));
        if std::fs::symlink_metadata(&cur).is_err() && std::fs::symlink_metadata(&old).is_ok_and(|m| m.is_dir()) {
            std::fs::rename(&old, &cur)?;
            sync_dir(dir)?;
        }
        for left in ["current.swap", "current.old", "current.trash"] {
            discard(dir, &dir.join(left));
        }
        let running = dir.join("running");
        let unclean = running.exists();
        let mut f = File::create(&running)?;
        writeln!(f, "{}", std::process::id())?;
        f.sync_all()?;
        sync_dir(dir)?;
        // Left by a crash, `running` stays until its owner says the local weights were
        // checked (`set_keep_running(false)`): a start that fails before that (found by review:
        // an unreadable state.json) must not hand them to the next start as verified.
        Ok(AgentDir { dir: dir.to_path_buf(), lock: std::sync::Arc::new(lock), unclean, keep_running: unclean })
    }

    /// Whether this agent ends as if it crashed: `running` stays, and the next agent on the
    /// directory re-verifies the active slot before it notifies anything. Initially whether
    /// this start found `running` left behind.
    pub fn set_keep_running(&mut self, keep: bool) {
        self.keep_running = keep;
    }

    /// A share of the directory's lock: another agent cannot take `DIR` while it lives. Work
    /// on the blocking pool holds one, because it outlives its future: a sync abandoned when
    /// its `Agent` is dropped goes on writing the work slot (and a layout rewrite ends with a
    /// rename by path), which must not happen after another agent took the directory (found
    /// by review: a library that opens a new `Agent` on the same `DIR` in-process).
    pub fn guard(&self) -> DirGuard {
        DirGuard(self.lock.clone())
    }

    /// `DIR`.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// `DIR/slots/<slot>`.
    pub fn slot(&self, s: Slot) -> PathBuf {
        self.dir.join("slots").join(s.name())
    }

    /// `DIR/current`.
    pub fn current(&self) -> PathBuf {
        self.dir.join("current")
    }

    /// `DIR/cache`.
    pub fn cache(&self) -> PathBuf {
        self.dir.join("cache")
    }

    /// `DIR/patch`: the patch of the newest sync for engines that apply patches in place
    /// (see `crate::patch`); it must be readable by the engine, as the slots are.
    pub fn patches(&self) -> PathBuf {
        self.dir.join("patch")
    }

    /// The slot `current` points at, if it is one of ours.
    pub fn linked(&self) -> Option<Slot> {
        let t = std::fs::read_link(self.current()).ok()?;
        [Slot::A, Slot::B].into_iter().find(|s| t == Path::new("slots").join(s.name()))
    }

    /// Points `current` at `slot` atomically (symlink to a temp name, rename over `current`,
    /// fsync of `DIR`).
    ///
    /// A `current` left as a real directory by an older layout (it held that agent's verified
    /// step) cannot be replaced by `rename(2)`, which will not put a symlink over a directory.
    /// It is swapped with the new symlink in one step (`renameat2(RENAME_EXCHANGE)`) and removed
    /// afterwards, so that `current` never goes missing: moving it aside first left a window,
    /// and after a crash inside it no `current` at all until the agent ran again (found by
    /// review). Where the file system cannot exchange names (`EINVAL`/`ENOSYS`: some network
    /// and FUSE file systems) it is still moved aside first; a crash between the two renames is
    /// repaired when the directory is next opened ([`Self::open`] puts it back as `current`).
    pub fn link(&self, slot: Slot) -> std::io::Result<()> {
        let cur = self.current();
        let target = Path::new("slots").join(slot.name());
        let old = self.dir.join("current.old");
        if std::fs::symlink_metadata(&cur).is_ok_and(|md| md.is_dir()) {
            // Its own temp name: after the exchange it names the old directory, which a crash
            // can leave behind (`open` removes it).
            let swap = self.dir.join("current.swap");
            remove_any(&swap)?;
            std::os::unix::fs::symlink(&target, &swap)?;
            if exchange(&swap, &cur)? {
                sync_dir(&self.dir)?;
                discard(&self.dir, &swap);
                return Ok(());
            }
            std::fs::remove_file(&swap)?;
            discard(&self.dir, &old);
            std::fs::rename(&cur, &old)?;
        }
        let tmp = self.dir.join("current.tmp");
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&target, &tmp)?;
        std::fs::rename(&tmp, &cur)?;
        sync_dir(&self.dir)?;
        // The switch is made: what is left is cleanup, which must not fail it.
        discard(&self.dir, &old);
        Ok(())
    }

    /// A file of `slot` that another process has open, if any: a server that resolved
    /// `current` two or more switches ago and is still loading the step in it (or serves from
    /// a map of its files). Such a slot must not be rewritten: its reader would load a mix of
    /// two steps, none of them verified (invariant 1; a reviewer's note, reproduced with a
    /// reader holding a map of a shard while the agent rebuilt the slot under it).
    ///
    /// Probed with a write lease (`fcntl(F_SETLEASE, F_WRLCK)`), which the kernel grants only
    /// when no other open file description of the file exists, whatever process, container
    /// or PID namespace holds it; a map counts until it is unmapped. Released at once. Where
    /// leases are not available (NFS, FUSE, `fs.leases-enable = 0`, a file we do not own)
    /// nothing can be known: `Ok(None)`, as before.
    pub fn open_elsewhere(&self, slot: Slot) -> std::io::Result<Option<PathBuf>> {
        let rd = match std::fs::read_dir(self.slot(slot)) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        for e in rd {
            let e = e?;
            if !e.file_type()?.is_file() {
                continue;
            }
            match open_elsewhere(&e.path())? {
                Some(true) => return Ok(Some(e.path())),
                Some(false) => {}
                None => return Ok(None),
            }
        }
        Ok(None)
    }

    /// Points `current` at `slot` unless it already does. Every use of `current` (a notify,
    /// a sync, a re-verified start) goes through this first: a switch interrupted after the
    /// state was written (a failed link, a crash) must be finished before anything relies on
    /// what `current` resolves to.
    pub fn ensure_linked(&self, slot: Slot) -> std::io::Result<()> {
        if self.linked() == Some(slot) {
            return Ok(());
        }
        self.link(slot)
    }

    /// Removes `current` durably, when it is a symlink: no slot holds a verified step.
    pub fn unlink(&self) -> std::io::Result<()> {
        let cur = self.current();
        match std::fs::symlink_metadata(&cur) {
            Ok(md) if md.file_type().is_symlink() => {
                std::fs::remove_file(&cur)?;
                sync_dir(&self.dir)
            }
            _ => Ok(()),
        }
    }
}

impl Drop for AgentDir {
    fn drop(&mut self) {
        // A clean end: the next start need not re-verify.
        if !self.keep_running {
            let _ = std::fs::remove_file(self.dir.join("running"));
        }
    }
}

/// Removes `path` whatever it is (file, symlink or directory tree); absent is fine.
fn remove_any(path: &Path) -> std::io::Result<()> {
    let r = match std::fs::symlink_metadata(path) {
        Ok(md) if md.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) => Err(e),
    };
    match r {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Removes `path` (a leftover of `link`) in `dir`, best effort: moved to `current.trash` first,
/// so that a directory whose removal fails halfway is never taken for the `current.old` that
/// [`AgentDir::open`] puts back; a failure is logged, not returned.
fn discard(dir: &Path, path: &Path) {
    if std::fs::symlink_metadata(path).is_err() {
        return;
    }
    let trash = dir.join("current.trash");
    let gone = if path == trash {
        trash
    } else {
        let _ = remove_any(&trash);
        match std::fs::rename(path, &trash) {
            Ok(()) => trash,
            Err(_) => path.to_path_buf(),
        }
    };
    if let Err(e) = remove_any(&gone) {
        tracing::warn!(path = %gone.display(), error = %e, "could not remove a leftover of a switch; remove it by hand");
    }
}

/// Swaps the names `a` and `b` atomically (`renameat2(RENAME_EXCHANGE)`); `Ok(false)` where
/// the file system or kernel cannot.
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> std::io::Result<bool> {
    use std::ffi::CString;
    #[cfg(test)]
    if tests::NO_EXCHANGE.get() {
        // A file system without the exchange (NFS, FUSE): none here to mount in a test.
        return Ok(false);
    }
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other);
    let (a, b) = (c(a)?, c(b)?);
    // The raw system call, not glibc's wrapper (glibc 2.28+), so that a wheel built for older
    // glibc (manylinux2014) still links. SAFETY: two NUL-terminated paths that outlive the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if r == 0 {
        return Ok(true);
    }
    match std::io::Error::last_os_error() {
        e if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)) => Ok(false),
        e => Err(e),
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(_: &Path, _: &Path) -> std::io::Result<bool> {
    Ok(false)
}

/// Whether every file of slot directory `dir` is its own: a regular file with one link. A
/// symlink, or a hard link (what `hardlink`, `rdfind -makehardlinks` or `jdupes -L` make of
/// identical files), may share its bytes with the served slot: a pass that changes the slot
/// in place would write through it (found by review). Such a slot is rebuilt, not changed.
pub fn slot_files_private(dir: &Path) -> std::io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    for entry in std::fs::read_dir(dir)? {
        let md = std::fs::symlink_metadata(entry?.path())?;
        if md.file_type().is_symlink() || (md.is_file() && md.nlink() != 1) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Whether another open file description of `path` exists (see [`AgentDir::open_elsewhere`]);
/// `None` where a lease cannot be taken for another reason.
#[cfg(target_os = "linux")]
fn open_elsewhere(path: &Path) -> std::io::Result<Option<bool>> {
    use std::os::fd::AsRawFd;
    let f = File::open(path)?;
    let fd = f.as_raw_fd();
    // While the lease is held (two system calls), a process opening the file breaks it and
    // the kernel signals the holder: SIGIO by default, whose default action would end the
    // agent (or the Python process of a Follower). SIGURG's default action is to ignore it.
    // The opener waits for the release, microseconds.
    // SAFETY: fcntl(2) on a descriptor this function owns; no memory is passed.
    unsafe {
        if libc::fcntl(fd, F_SETSIG, libc::SIGURG) != 0 {
            return Ok(None);
        }
        if libc::fcntl(fd, libc::F_SETLEASE, libc::F_WRLCK) == 0 {
            libc::fcntl(fd, libc::F_SETLEASE, libc::F_UNLCK);
            return Ok(Some(false));
        }
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::EAGAIN) => Ok(Some(true)),
        _ => Ok(None),
    }
}

/// `F_SETSIG` (`<asm-generic/fcntl.h>`; not in the `libc` crate).
#[cfg(target_os = "linux")]
const F_SETSIG: libc::c_int = 10;

#[cfg(not(target_os = "linux"))]
fn open_elsewhere(_: &Path) -> std::io::Result<Option<bool>> {
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Work on the blocking pool holds a guard: after its `Agent` (and `AgentDir`) is gone,
    /// no other agent takes the directory until that work has ended.
    #[test]
    fn a_guard_keeps_the_directory_locked_after_its_agent_dir_is_dropped() {
        let t = tempfile::tempdir().unwrap();
        let d = AgentDir::open(t.path()).unwrap();
        let g = d.guard();
        drop(d);
        let Err(e) = AgentDir::open(t.path()) else { panic!("opened while a guard lives") };
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
        assert!(e.to_string().contains("in use"), "{e}");
        drop(g);
        AgentDir::open(t.path()).unwrap();
    }

    /// `current` as a real directory (an older layout's served step) is replaced by the link
    /// without ever going missing: a reader polling it throughout many switches always finds
    /// it (moving the directory aside first, as before, left a window it saw).
    #[test]
    fn a_current_directory_is_replaced_without_a_moment_without_current() {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
        use std::sync::Arc;
        let t = tempfile::tempdir().unwrap();
        let d = AgentDir::open(t.path()).unwrap();
        std::fs::create_dir_all(d.slot(Slot::A)).unwrap();
        let cur = d.current();
        // Odd while a link runs; a miss counts only when the generation did not move.
        let (gen, done, missed) =
            (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let watcher = {
            let (gen, done, missed, cur) = (gen.clone(), done.clone(), missed.clone(), cur.clone());
            std::thread::spawn(move || {
                while !done.load(SeqCst) {
                    let g1 = gen.load(SeqCst);
                    let there = std::fs::symlink_metadata(&cur).is_ok();
                    if !there && g1 % 2 == 1 && gen.load(SeqCst) == g1 {
                        missed.fetch_add(1, SeqCst);
                    }
                }
            })
        };
        for _ in 0..300 {
            let _ = std::fs::remove_file(&cur);
            std::fs::create_dir(&cur).unwrap();
            std::fs::write(cur.join("model.safetensors"), b"older layout").unwrap();
            gen.fetch_add(1, SeqCst);
            d.link(Slot::A).unwrap();
            gen.fetch_add(1, SeqCst);
            assert_eq!(d.linked(), Some(Slot::A));
            for left in ["current.tmp", "current.swap", "current.old"] {
                assert!(std::fs::symlink_metadata(t.path().join(left)).is_err(), "{left} left behind");
            }
        }
        done.store(true, SeqCst);
        watcher.join().unwrap();
        assert_eq!(missed.load(SeqCst), 0, "current was missing while a link ran");
    }

    thread_local! {
        /// `exchange` answers as on a file system that cannot swap names.
        pub(super) static NO_EXCHANGE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// Where names cannot be exchanged, the older layout's `current` directory is moved aside,
    /// the link put in its place and the directory removed: the switch ends with `current`
    /// naming the slot and nothing left behind, and the next start finds nothing to repair.
    #[test]
    fn without_an_exchange_a_current_directory_is_moved_aside_then_removed() {
        let t = tempfile::tempdir().unwrap();
        let d = AgentDir::open(t.path()).unwrap();
        std::fs::create_dir_all(d.slot(Slot::B)).unwrap();
        let cur = d.current();
        std::fs::create_dir(&cur).unwrap();
        std::fs::write(cur.join("model.safetensors"), b"older layout").unwrap();
        NO_EXCHANGE.set(true);
        let r = d.link(Slot::B);
        NO_EXCHANGE.set(false);
        r.unwrap();
        assert_eq!(std::fs::read_link(&cur).unwrap(), Path::new("slots/b"));
        assert_eq!(d.linked(), Some(Slot::B));
        for left in ["current.tmp", "current.swap", "current.old", "current.trash"] {
            assert!(std::fs::symlink_metadata(t.path().join(left)).is_err(), "{left} left behind");
        }
        drop(d);
        drop(AgentDir::open(t.path()).unwrap());
        assert_eq!(std::fs::read_link(&cur).unwrap(), Path::new("slots/b"));
    }

    /// What a crash inside a switch leaves is repaired when the directory is opened: the old
    /// layout's directory swapped out is removed (`current` already names a slot), and one
    /// moved aside with no `current` yet is put back as `current`.
    #[test]
    fn opening_the_directory_finishes_a_switch_a_crash_interrupted() {
        let t = tempfile::tempdir().unwrap();
        let (cur, tmp, old) = (t.path().join("current"), t.path().join("current.swap"), t.path().join("current.old"));
        drop(AgentDir::open(t.path()).unwrap());
        std::os::unix::fs::symlink("slots/a", &cur).unwrap();
        std::fs::create_dir(&tmp).unwrap();
        std::fs::write(tmp.join("model.safetensors"), b"x").unwrap();
        drop(AgentDir::open(t.path()).unwrap());
        assert!(!tmp.exists(), "the swapped-out directory stays");
        assert_eq!(std::fs::read_link(&cur).unwrap(), Path::new("slots/a"));

        std::fs::remove_file(&cur).unwrap();
        std::fs::create_dir(&old).unwrap();
        std::fs::write(old.join("model.safetensors"), b"served").unwrap();
        drop(AgentDir::open(t.path()).unwrap());
        assert!(!old.exists());
        assert_eq!(std::fs::read(cur.join("model.safetensors")).unwrap(), b"served");
    }

    /// A leftover that cannot be deleted (here a file marked immutable; in the field another
    /// owner's files, or NFS) fails neither the switch nor the next start (found by review:
    /// both returned the removal's error, and the agent could not start again).
    #[test]
    fn a_leftover_that_cannot_be_deleted_fails_neither_the_switch_nor_a_start() {
        let t = tempfile::tempdir().unwrap();
        let d = AgentDir::open(t.path()).unwrap();
        let cur = d.current();
        std::fs::create_dir(&cur).unwrap();
        let stuck = cur.join("model.safetensors");
        std::fs::write(&stuck, b"older layout").unwrap();
        let chattr = |flag: &str, f: &Path| std::process::Command::new("chattr").arg(flag).arg(f).status().unwrap();
        assert!(chattr("+i", &stuck).success(), "chattr +i (this test needs root and a file system with attributes)");
        let r = d.link(Slot::A);
        let trash = t.path().join("current.trash");
        let left = std::fs::symlink_metadata(&trash).is_ok();
        drop(d);
        let reopened = AgentDir::open(t.path()).map(drop);
        assert!(chattr("-i", &trash.join("model.safetensors")).success());
        r.unwrap();
        reopened.unwrap();
        assert_eq!(std::fs::read_link(&cur).unwrap(), Path::new("slots/a"));
        assert!(left, "the half-deleted directory is not kept under current.trash");
        assert!(std::fs::symlink_metadata(t.path().join("current.old")).is_err());
    }
}
