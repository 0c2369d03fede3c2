//! Crash recovery of an in-place `ulp` apply through the redo journal.

mod common;

use std::io::Write;

use common::*;
use driftless_format::journal::Journal;
use driftless_format::ops::{self, Applier};
use driftless_format::{delta, CheckpointMut, Codec, DType, DeltaOptions, Digest, Layout, ValueMode};

/// Bytes of one journal record as `Journal::append` writes it, made through the public API.
fn record_bytes(dir: &std::path::Path, seg: u32, payload: &[u8]) -> Vec<u8> {
    let p = dir.join(format!("side-{seg}"));
    let mut j = Journal::create(&p, Digest::default(), Digest::default()).unwrap();
    j.append(seg, payload).unwrap();
    drop(j);
    std::fs::read(&p).unwrap()[68..].to_vec()
}

fn append_raw(path: &std::path::Path, bytes: &[u8]) {
    let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    f.write_all(bytes).unwrap();
}

fn setup(values: ValueMode) -> (Vec<T>, Vec<T>, Layout, driftless_format::DeltaManifest, Vec<Vec<u8>>) {
    let mut r = rng(31);
    let base = vec![
        T::random("layers.0.w", DType::BF16, &[64, 64], &mut r),
        T::random("layers.0.b", DType::F32, &[300], &mut r),
        T::random("layers.1.w", DType::F16, &[40, 40], &mut r),
    ];
    let target: Vec<T> = base.iter().map(|t| mutate(t, 0.05, &mut r)).collect();
    let layout = Layout::for_tensors(&metas(&base), 6000).unwrap();
    let opts = DeltaOptions { values, codec: Codec::Zstd { level: 1 }, segment_target: 300, chunk_bytes: 512 };
    let (m, enc) = make(&base, &target, &layout, &opts);
    let segs: Vec<Vec<u8>> = enc.segments.into_iter().map(|s| s.bytes).collect();
    assert!(segs.len() >= 6, "need many segments, got {}", segs.len());
    (base, target, layout, m, segs)
}

#[test]
fn crash_mid_ulp_apply_then_recover() {
    let (base, target, layout, m, segs) = setup(ValueMode::Ulp);
    let dir = tempfile::tempdir().unwrap();
    let bdir = dir.path().join("ck");
    driftless_format::checkpoint::write_checkpoint(&bdir, &layout, &views(&base)).unwrap();
    let jpath = dir.path().join("journal");
    let env_sha = Digest::of(b"the envelope");
    let k = segs.len() / 2;

    // Run 1: apply segments 0..k through the journaled applier, then crash inside segment k
    // (record written, some entries applied) while segment k+1's record is being written.
    {
        let mut ck = CheckpointMut::open(&bdir).unwrap();
        let tm = ck.tensors_mut();
        let ap = Applier::new(&tm, &m, Some(Journal::create(&jpath, env_sha, m.base_root).unwrap()));
        for (i, s) in segs.iter().enumerate().take(k) {
            ap.apply(i, s).unwrap();
        }
        drop(ap);
        let seg = delta::decode_segment(&segs[k], m.segments[k].raw_size).unwrap();
        assert!(seg.entries.len() >= 2, "segment {k} needs several entries to be half applied");
        let redo = delta::to_redo(&seg, &tm).unwrap();
        append_raw(&jpath, &record_bytes(dir.path(), k as u32, &redo));
        // Block the last entry's range so apply_segment stops after the earlier entries.
        let last = seg.entries.last().unwrap();
        let w = last.dtype.size() as u64;
        tm.with_range_mut(&last.name, last.start * w, last.len * w, |_| ()).unwrap();
        assert!(delta::apply_segment(&seg, &tm).is_err());
        // Torn record of segment k+1: its cells were never written.
        let seg2 = delta::decode_segment(&segs[k + 1], m.segments[k + 1].raw_size).unwrap();
        let rec2 = record_bytes(dir.path(), (k + 1) as u32, &delta::to_redo(&seg2, &tm).unwrap());
        append_raw(&jpath, &rec2[..rec2.len() - 3]);
        drop(tm);
        ck.flush().unwrap();
    }
    let mid = driftless_format::Checkpoint::open(&bdir).unwrap();
    let mid_root = driftless_format::weights_root(&mid.views()).1;
    assert_ne!(mid_root, m.base_root);
    assert_ne!(mid_root, m.result_root);
    drop(mid);

    // Recovery: replay complete records into a fresh journal, switch to it atomically, apply
    // the segments without a record.
    let rec = Journal::recover(&jpath).unwrap().expect("journal present");
    assert_eq!(rec.delta_id, env_sha);
    assert_eq!(rec.base_root, m.base_root);
    let idx: Vec<u32> = rec.records.iter().map(|r| r.0).collect();
    assert_eq!(idx, (0..=k as u32).collect::<Vec<_>>(), "torn record must be dropped, complete ones kept");
    let mut ck = CheckpointMut::open(&bdir).unwrap();
    {
        let tm = ck.tensors_mut();
        let newp = dir.path().join("journal.new");
        let ap = Applier::new(&tm, &m, Some(Journal::create(&newp, env_sha, m.base_root).unwrap()));
        let done = ap.replay(&rec.records).unwrap();
        std::fs::rename(&newp, &jpath).unwrap();
        for (i, s) in segs.iter().enumerate() {
            if !done.contains(&(i as u32)) {
                ap.apply(i, s).unwrap();
            }
        }
    }
    ck.flush().unwrap();
    assert_eq!(ops::verify_result(&ck.views(), &m).unwrap(), m.result_root);
    assert_same_tensors(&ck.views(), &target, "recovered");

    // A crash right at the end: the journal now covers every segment; replaying all of it on
    // the result is idempotent.
    let rec = Journal::recover(&jpath).unwrap().unwrap();
    let mut all: Vec<u32> = rec.records.iter().map(|r| r.0).collect();
    all.sort_unstable();
    assert_eq!(all, (0..segs.len() as u32).collect::<Vec<_>>());
    {
        let tm = ck.tensors_mut();
        Applier::new(&tm, &m, None).replay(&rec.records).unwrap();
    }
    assert_eq!(driftless_format::weights_root(&ck.views()).1, m.result_root);
    Journal::remove(&jpath).unwrap();
    Journal::remove(&jpath).unwrap();
    assert!(Journal::recover(&jpath).unwrap().is_none());
}

/// Without the journal the same crash is not recoverable: re-applying the half-applied ulp
/// segment gives a wrong result, which verification catches. (Shows the test above tests
/// something.)
#[test]
fn ulp_reapply_without_journal_is_detected() {
    let (base, _, layout, m, segs) = setup(ValueMode::Ulp);
    let dir = tempfile::tempdir().unwrap();
    driftless_format::checkpoint::write_checkpoint(dir.path(), &layout, &views(&base)).unwrap();
    let mut ck = CheckpointMut::open(dir.path()).unwrap();
    {
        let tm = ck.tensors_mut();
        let ap = Applier::new(&tm, &m, None);
        ap.apply(0, &segs[0]).unwrap();
    }
    {
        let tm = ck.tensors_mut();
        let ap = Applier::new(&tm, &m, None);
        for (i, s) in segs.iter().enumerate() {
            ap.apply(i, s).unwrap();
        }
    }
    let e = ops::verify_result(&ck.views(), &m).unwrap_err();
    assert_eq!(e.kind(), driftless_format::ErrorKind::Corrupt);
}

/// Overwrite deltas need no records: re-applying everything after a crash is enough.
#[test]
fn overwrite_crash_reapply() {
    let (base, target, layout, m, segs) = setup(ValueMode::Overwrite);
    let dir = tempfile::tempdir().unwrap();
    driftless_format::checkpoint::write_checkpoint(dir.path(), &layout, &views(&base)).unwrap();
    let jpath = dir.path().join("j");
    let mut ck = CheckpointMut::open(dir.path()).unwrap();
    {
        let tm = ck.tensors_mut();
        let ap = Applier::new(&tm, &m, Some(Journal::create(&jpath, Digest::default(), m.base_root).unwrap()));
        for (i, s) in segs.iter().enumerate().take(segs.len() / 2) {
            ap.apply(i, s).unwrap();
        }
    }
    assert!(Journal::recover(&jpath).unwrap().unwrap().records.is_empty());
    {
        let tm = ck.tensors_mut();
        let ap = Applier::new(&tm, &m, None);
        for (i, s) in segs.iter().enumerate() {
            ap.apply(i, s).unwrap();
        }
    }
    assert_same_tensors(&ck.views(), &target, "overwrite reapplied");
}

#[test]
fn torn_and_damaged_journals() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("j");
    let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
    // Missing: None. Torn header: None (nothing was applied under it).
    assert!(Journal::recover(&p).unwrap().is_none());
    let mut j = Journal::create(&p, a, b).unwrap();
    j.append(3, b"first").unwrap();
    j.append(5, b"second").unwrap();
    drop(j);
    let full = std::fs::read(&p).unwrap();
    for cut in 0..68 {
        std::fs::write(&p, &full[..cut]).unwrap();
        assert!(Journal::recover(&p).unwrap().is_none(), "header cut at {cut}");
    }
    // Every cut inside the records keeps exactly the complete ones.
    let first_end = 68 + 48 + 5;
    for cut in 68..full.len() {
        std::fs::write(&p, &full[..cut]).unwrap();
        let r = Journal::recover(&p).unwrap().unwrap();
        assert_eq!((r.delta_id, r.base_root), (a, b));
        let want = if cut < first_end { 0 } else { 1 };
        assert_eq!(r.records.len(), want, "cut at {cut}");
    }
    std::fs::write(&p, &full).unwrap();
    let r = Journal::recover(&p).unwrap().unwrap();
    assert_eq!(r.records, vec![(3, b"first".to_vec()), (5, b"second".to_vec())]);
    // A flipped payload byte or a huge length ends the read there.
    let mut bad = full.clone();
    bad[first_end + 48] ^= 1;
    std::fs::write(&p, &bad).unwrap();
    assert_eq!(Journal::recover(&p).unwrap().unwrap().records.len(), 1);
    let mut bad = full.clone();
    bad[first_end + 8..first_end + 16].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&p, &bad).unwrap();
    assert_eq!(Journal::recover(&p).unwrap().unwrap().records.len(), 1);
}
