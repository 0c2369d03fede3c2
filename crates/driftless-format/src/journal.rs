//! The redo journal that makes an in-place `ulp` apply crash-safe.
//!
//! `ulp` values are differences, so applying a segment twice is wrong and a crash in the
//! middle of a segment leaves some cells new and some old. Before touching the checkpoint for
//! a segment the applier appends that segment's *redo record* (the same changes in
//! `overwrite` form, computed from the untouched base, see [`crate::delta::to_redo`]) and
//! fsyncs. Recovery replays every complete record (idempotent) and applies the segments that
//! have none (never touched, since records precede writes). A torn last record is ignored: its
//! segment had not been written yet.
//!
//! ```text
//! journal := "DLJ1" delta_id(32 bytes: SHA-256 of the manifest envelope) base_root(32 bytes)
//!            record*
//! record  := "DLJR" u32le segment_index u64le len sha256(payload, 32 bytes) payload
//! ```

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use crate::{Digest, Error, Result};

/// An open journal being appended to.
#[derive(Debug)]
pub struct Journal {
    file: File,
    path: PathBuf,
}

/// What a journal holds after a crash.
#[derive(Debug)]
pub struct Recovered {
    /// Delta the journal belongs to (SHA-256 of its manifest envelope).
    pub delta_id: Digest,
    /// Weights root of the base the delta applies to.
    pub base_root: Digest,
    /// Complete redo records: (segment index, overwrite-form raw segment).
    pub records: Vec<(u32, Vec<u8>)>,
    /// Length of the valid prefix of the file (header + complete records).
    pub valid_len: u64,
}

impl Journal {
    /// Creates (truncates) a journal for a delta and fsyncs its header.
    pub fn create(path: &Path, delta_id: Digest, base_root: Digest) -> Result<Self> {
        let mut file =
            OpenOptions::new().create(true).write(true).truncate(true).open(path).map_err(|e| Error::io(path, e))?;
        file.write_all(b"DLJ1")
            .and_then(|_| file.write_all(&delta_id.0))
            .and_then(|_| file.write_all(&base_root.0))
            .map_err(|e| Error::io(path, e))?;
        file.sync_all().map_err(|e| Error::io(path, e))?;
        if let Some(dir) = path.parent() {
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(Journal { file, path: path.to_path_buf() })
    }

    /// Reopens a recovered journal for appending after its valid prefix (a torn last record
    /// is cut off first, so records appended now are readable by the next recovery).
    pub fn reopen(path: &Path, valid_len: u64) -> Result<Self> {
        let file = OpenOptions::new().write(true).open(path).map_err(|e| Error::io(path, e))?;
        file.set_len(valid_len).map_err(|e| Error::io(path, e))?;
        file.sync_all().map_err(|e| Error::io(path, e))?;
        let mut j = Journal { file, path: path.to_path_buf() };
        use std::io::Seek;
        j.file.seek(std::io::SeekFrom::End(0)).map_err(|e| Error::io(path, e))?;
        Ok(j)
    }

    /// Appends a redo record and fsyncs it. Only after this returns may the segment's cells
    /// be written.
    pub fn append(&mut self, segment: u32, payload: &[u8]) -> Result<()> {
        let mut rec = Vec::with_capacity(48 + payload.len());
        rec.extend_from_slice(b"DLJR");
        rec.extend_from_slice(&segment.to_le_bytes());
        rec.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        rec.extend_from_slice(&Digest::of(payload).0);
        rec.extend_from_slice(payload);
        self.file.write_all(&rec).map_err(|e| Error::io(&self.path, e))?;
        self.file.sync_data().map_err(|e| Error::io(&self.path, e))
    }

    /// Reads a journal left by a crash. `Ok(None)` when there is none. A record whose bytes
    /// are incomplete or whose hash does not match ends the read (it was being written when
    /// the process died).
    pub fn recover(path: &Path) -> Result<Option<Recovered>> {
        let mut f = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(path, e)),
        };
        let mut b = Vec::new();
        f.read_to_end(&mut b).map_err(|e| Error::io(path, e))?;
        if b.len() < 68 || &b[..4] != b"DLJ1" {
            // Header never completed: nothing was applied under it.
            return Ok(None);
        }
        let delta_id = Digest(b[4..36].try_into().expect("32"));
        let base_root = Digest(b[36..68].try_into().expect("32"));
        let mut at = 68usize;
        let mut records = vec![];
        while b.len() - at >= 48 && &b[at..at + 4] == b"DLJR" {
            let seg = u32::from_le_bytes(b[at + 4..at + 8].try_into().expect("4"));
            let len = u64::from_le_bytes(b[at + 8..at + 16].try_into().expect("8"));
            let sum = Digest(b[at + 16..at + 48].try_into().expect("32"));
            let Some(end) = (at as u64 + 48).checked_add(len).filter(|&e| e <= b.len() as u64) else { break };
            let payload = &b[at + 48..end as usize];
            if Digest::of(payload) != sum {
                break;
            }
            records.push((seg, payload.to_vec()));
            at = end as usize;
        }
        Ok(Some(Recovered { delta_id, base_root, records, valid_len: at as u64 }))
    }

    /// Removes a journal once its delta is fully applied and verified.
    pub fn remove(path: &Path) -> Result<()> {
        match std::fs::remove_file(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(path, e)),
        }
    }
}
