//! The one-pass apply + hash of the agent (`fused::apply_and_hash`) against the plain
//! segment-by-segment apply followed by `weights_root`: chains of deltas in every dtype and
//! value mode, dense chunks, tiny blocks so changes and entries straddle block boundaries, and
//! hostile entries.

mod common;

use common::*;
use driftless_format::delta::{decode_segment, DecodedSegment};
use driftless_format::fused::Target;
use driftless_format::{
    fused, Checkpoint, CheckpointFiles, CheckpointMut, DType, DeltaOptions, ErrorKind, Layout, ValueMode,
};

fn decode(enc: &driftless_format::delta::EncodedDelta) -> Vec<DecodedSegment> {
    enc.segments.iter().map(|s| decode_segment(&s.bytes, s.raw_size).unwrap()).collect()
}

fn tensors(dtype: DType, seed: u64) -> Vec<T> {
    let mut r = rng(seed);
    vec![
        T::random("a.big", dtype, &[3001], &mut r),
        T::random("b.matrix", dtype, &[17, 33], &mut r),
        T::random("c.scalar", dtype, &[], &mut r),
        T::random("d.empty", dtype, &[0, 4], &mut r),
        T::random("e.small", dtype, &[7], &mut r),
    ]
}

/// Runs the fused pass over `chain` on a copy of `base` written to disk; returns the digests
/// and the resulting bytes.
fn fused_run(base: &[T], chain: &[Vec<DecodedSegment>], block: usize) -> driftless_format::Result<(Vec<T>, Layout)> {
    fused_run_pieces(base, chain, block, fused::PIECE)
}

/// Runs `pass` while another thread holds every file of `files` as its writer for its first
/// 20 ms: the pass keeps its first blocks, waits once it holds the most it may, and writes them
/// late (what a pass does while other threads write the same file).
fn busy_at_first<R>(files: &CheckpointFiles, pass: impl FnOnce() -> R) -> R {
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        s.spawn(move || {
            let _held = files.hold_writers();
            tx.send(()).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
        });
        rx.recv().unwrap();
        pass()
    })
}

/// [`fused_run`] with tensors cut into pieces of at least `piece` bytes. The pass runs twice,
/// on two copies of `base`: in memory (a writable map) and on the files (`pread`/`pwrite`,
/// the agent's way); both must give the same bytes and digests.
fn fused_run_pieces(
    base: &[T],
    chain: &[Vec<DecodedSegment>],
    block: usize,
    piece: usize,
) -> driftless_format::Result<(Vec<T>, Layout)> {
    let refs: Vec<&[DecodedSegment]> = chain.iter().map(|c| &c[..]).collect();
    let fdir = tempfile::tempdir().unwrap();
    write(fdir.path(), base, 4096);
    let files = CheckpointFiles::open(fdir.path()).unwrap();
    let on_files = busy_at_first(&files, || {
        fused::apply_and_hash_blocks(Target::Files(&files), &files.metas(), &refs, true, block, piece)
    });
    // The copying pass: the source is read, a frame of it written.
    let src_dir = tempfile::tempdir().unwrap();
    write(src_dir.path(), base, 4096);
    let copy_dir = tempfile::tempdir().unwrap();
    let src = CheckpointFiles::open_read_only(src_dir.path()).unwrap();
    let dst = src.frame_copy(&copy_dir.path().join("slot")).unwrap();
    let copied = busy_at_first(&dst, || {
        fused::apply_and_hash_blocks(Target::Copy { from: &src, to: &dst }, &src.metas(), &refs, true, block, piece)
    });
    let dir = tempfile::tempdir().unwrap();
    let layout = write(dir.path(), base, 4096);
    let mut ck = CheckpointMut::open(dir.path()).unwrap();
    let metas = ck.metas();
    assert_eq!(files.metas(), metas);
    let digests = {
        let tm = ck.tensors_mut();
        match fused::apply_and_hash_blocks(Target::Memory(&tm), &metas, &refs, true, block, piece) {
            Ok(d) => d.unwrap(),
            Err(e) => {
                let f = on_files.expect_err("the files target accepted what the memory target refused");
                assert_eq!(f.kind(), e.kind(), "{f} against {e}");
                let c = copied.expect_err("the copy target accepted what the memory target refused");
                assert_eq!(c.kind(), e.kind(), "{c} against {e}");
                return Err(e);
            }
        }
    };
    let got: Vec<T> = ck.views().iter().map(|v| T::new(v.name, v.dtype, v.shape, v.data.to_vec())).collect();
    for (t, d) in got.iter().zip(&digests) {
        assert_eq!(*d, driftless_format::hash::tensor_digest(&t.view()), "digest of {} is not of its bytes", t.name);
    }
    let fdigests = on_files.expect("the memory target accepted what the files target refused").unwrap();
    files.sync().unwrap();
    let on_disk = Checkpoint::open(fdir.path()).unwrap();
    assert_same_tensors(&on_disk.views(), &got, "files target against the memory target");
    assert_eq!(fdigests, digests, "digests of the files target");
    // The copy: same digests, every file of the directory byte for byte what the in-place
    // pass left, and the source untouched.
    assert_eq!(copied.expect("the copy target refused what the memory target accepted").unwrap(), digests);
    dst.sync().unwrap();
    ck.flush().unwrap();
    let listing = |d: &std::path::Path| {
        let mut v: Vec<(std::ffi::OsString, Vec<u8>)> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap())
            .map(|e| (e.file_name(), std::fs::read(e.path()).unwrap()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        listing(&copy_dir.path().join("slot")),
        listing(dir.path()),
        "the copy's files differ from the in-place result"
    );
    let untouched = Checkpoint::open(src_dir.path()).unwrap();
    assert_same_tensors(&untouched.views(), base, "the copy's source");
    // Without hashing (an intermediate group of a long chain): untouched tensors are skipped
    // in place, yet copied whole by a copy; the same bytes on every target.
    for target in ["memory", "files", "copy"] {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), base, 4096);
        let out = d.path().join("out");
        match target {
            "memory" => {
                let mut m = CheckpointMut::open(d.path()).unwrap();
                let metas = m.metas();
                let tm = m.tensors_mut();
                assert!(
                    fused::apply_and_hash_blocks(Target::Memory(&tm), &metas, &refs, false, block, piece)?.is_none()
                );
                drop(tm);
                m.flush().unwrap();
                std::fs::create_dir_all(&out).unwrap();
                for e in std::fs::read_dir(d.path()).unwrap().map(|e| e.unwrap()).filter(|e| e.path().is_file()) {
                    std::fs::copy(e.path(), out.join(e.file_name())).unwrap();
                }
            }
            "files" => {
                let f = CheckpointFiles::open(d.path()).unwrap();
                assert!(fused::apply_and_hash_blocks(Target::Files(&f), &metas, &refs, false, block, piece)?.is_none());
                std::fs::create_dir_all(&out).unwrap();
                for e in std::fs::read_dir(d.path()).unwrap().map(|e| e.unwrap()).filter(|e| e.path().is_file()) {
                    std::fs::copy(e.path(), out.join(e.file_name())).unwrap();
                }
            }
            _ => {
                let from = CheckpointFiles::open_read_only(d.path()).unwrap();
                let to = from.frame_copy(&out).unwrap();
                let t = Target::Copy { from: &from, to: &to };
                assert!(fused::apply_and_hash_blocks(t, &metas, &refs, false, block, piece)?.is_none());
            }
        }
        assert_eq!(listing(&out), listing(dir.path()), "{target} without hashing");
    }
    Ok((got, layout))
}

#[test]
fn chains_match_the_target_in_every_dtype_and_mode() {
    for (di, &dtype) in DType::ALL.iter().enumerate() {
        for mode in [ValueMode::Ulp, ValueMode::Overwrite] {
            let base = tensors(dtype, 7 + di as u64);
            let mut r = rng(99 + di as u64);
            let mut states = vec![base.clone()];
            // Densities: sparse, denser, dense chunks (stored dense), sparse again.
            for density in [0.01, 0.2, 1.0, 0.003] {
                let next: Vec<T> = states.last().unwrap().iter().map(|t| mutate(t, density, &mut r)).collect();
                states.push(next);
            }
            let layout = Layout::for_tensors(&metas(&base), u64::MAX).unwrap();
            let opts = DeltaOptions { values: mode, segment_target: 300, chunk_bytes: 96, ..Default::default() };
            let chain: Vec<Vec<DecodedSegment>> =
                states.windows(2).map(|w| decode(&make(&w[0], &w[1], &layout, &opts).1)).collect();
            for block in [8, 24, 1000, 1 << 20] {
                let (got, _) = fused_run(&base, &chain, block).unwrap();
                let want = states.last().unwrap();
                let ctx = format!("{dtype} {mode} block {block}");
                assert_same_tensors(&views(&got), want, &ctx);
                // Prefixes of the chain too.
                let (got, _) = fused_run(&base, &chain[..2], block).unwrap();
                assert_same_tensors(&views(&got), &states[2], &ctx);
            }
        }
    }
}

/// Tensors of several root chunks cut into pieces (cuts only where no entry of any delta
/// straddles; where they fall is checked in `fused::tests`): entries of one and two chunks,
/// a dense delta, and chains whose deltas cut entries at different places.
/// The result and every digest equal the plain apply followed by the weights root.
#[test]
fn tensors_cut_into_pieces_match_the_plain_apply() {
    let c = driftless_format::hash::CHUNK as u64;
    let mut r = rng(77);
    let base = vec![
        T::random("big", DType::BF16, &[5 * c / 2 + 3], &mut r),
        T::random("wide", DType::F32, &[3, c / 4 + 1], &mut r),
        T::random("small", DType::BF16, &[100], &mut r),
    ];
    let mut states = vec![base.clone()];
    for density in [0.01, 1.0, 0.003, 0.02] {
        let next: Vec<T> = states.last().unwrap().iter().map(|t| mutate(t, density, &mut r)).collect();
        states.push(next);
    }
    let layout = Layout::for_tensors(&metas(&base), u64::MAX).unwrap();
    // Entry sizes per delta (bytes): one chunk (a cut possible at every chunk), two chunks
    // (with the dense delta: cuts every two chunks), then sizes that end off the chunk
    // boundaries (no cut once they are in the chain).
    let sizes = [1 << 20, 2 << 20, 100_000, 3 * (1 << 19)];
    let chain: Vec<Vec<DecodedSegment>> = states
        .windows(2)
        .zip(sizes)
        .map(|(w, chunk_bytes)| {
            let opts = DeltaOptions { chunk_bytes, segment_target: 1 << 20, ..Default::default() };
            decode(&make(&w[0], &w[1], &layout, &opts).1)
        })
        .collect();
    for k in 1..=chain.len() {
        for piece in [1, c as usize, 2 * c as usize] {
            let (got, _) = fused_run_pieces(&base, &chain[..k], 64 << 10, piece).unwrap();
            assert_same_tensors(&views(&got), &states[k], &format!("{k} deltas, pieces of {piece}"));
        }
    }
}

#[test]
fn overlapping_entries_of_one_delta_are_refused_but_not_across_deltas() {
    let base = vec![T::new("w", DType::U8, &[16], vec![0; 16])];
    let e = |start, pos: Vec<u8>, vals: Vec<u8>| E {
        name: "w",
        dense: false,
        dtype: DType::U8,
        start,
        len: 8,
        count: pos.len() as u64,
        pos,
        vals,
    };
    let one = raw_segment(1, &[e(0, vec![0], vec![2])]);
    let two = raw_segment(1, &[e(4, vec![0], vec![2])]);
    let d = |b: &[u8]| decode_segment(b, 1 << 20).unwrap();
    // Two segments of one delta writing elements 4..8 twice: refused.
    let err = fused_run(&base, &[vec![d(&one), d(&two)]], 8).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    // The same entries in two deltas of a chain: applied in order (+1 then +1 at element 0).
    let (got, _) = fused_run(&base, &[vec![d(&one)], vec![d(&one)]], 8).unwrap();
    assert_eq!(got[0].data[0], 2);
}

#[test]
fn hostile_entries_are_errors() {
    let base = vec![T::new("w", DType::BF16, &[8], vec![0; 16])];
    let d = |b: &[u8]| decode_segment(b, 1 << 20).unwrap();
    let mk = |name, dtype, start, len, pos: Vec<u8>| {
        raw_segment(
            1,
            &[E { name, dense: false, dtype, start, len, count: pos.len() as u64, vals: vec![2; pos.len()], pos }],
        )
    };
    for (what, seg) in [
        ("unknown tensor", mk("x", DType::BF16, 0, 8, vec![0])),
        ("wrong dtype", mk("w", DType::F16, 0, 8, vec![0])),
        ("range outside", mk("w", DType::BF16, 4, 8, vec![0])),
        ("position outside the entry", mk("w", DType::BF16, 0, 4, vec![0, 0, 0, 0, 0])),
    ] {
        let Ok(seg) = decode_segment(&seg, 1 << 20) else { continue };
        let err = fused_run(&base, &[vec![seg]], 8).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{what}: {err}");
    }
    let _ = d;
}

/// A tensor no delta of the chain touches: skipped in place when nothing is hashed, yet
/// copied whole into a copy (`fused_run` checks every target, with and without hashing).
#[test]
fn a_tensor_no_delta_touches_is_kept_by_every_target() {
    let mut r = rng(41);
    let base =
        vec![T::random("changed", DType::BF16, &[4000], &mut r), T::random("same", DType::BF16, &[3000], &mut r)];
    let next = vec![mutate(&base[0], 0.05, &mut r), base[1].clone()];
    let layout = Layout::for_tensors(&metas(&base), u64::MAX).unwrap();
    let chain = vec![decode(&make(&base, &next, &layout, &DeltaOptions::default()).1)];
    for block in [64, 1 << 20] {
        let (got, _) = fused_run(&base, &chain, block).unwrap();
        assert_same_tensors(&views(&got), &next, &format!("block {block}"));
    }
}

/// Whether `p` is on a tmpfs.
fn on_tmpfs(p: &std::path::Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid path; `st` is written by the call before it is read.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statfs(c.as_ptr(), &mut st) }) == 0 && st.f_type == libc::TMPFS_MAGIC
}

/// (bytes allocated, length) of every file of `dir`, by name.
fn allocation(dir: &std::path::Path) -> Vec<(String, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| {
            let m = e.metadata().unwrap();
            (e.file_name().to_string_lossy().into_owned(), m.blocks() * 512, m.len())
        })
        .collect();
    v.sort();
    v
}

/// A frame on a tmpfs is sparse until the pass fills it (`checkpoint::create_sized`: there
/// `posix_fallocate` allocates every page up front, on one thread, while the writers wait),
/// and the copying pass leaves the same bytes as in a frame whose blocks were reserved; a
/// tmpfs without room for the frame refuses it up front, as a reservation would.
#[test]
fn a_frame_on_a_tmpfs_is_filled_by_the_pass_and_refused_without_room() {
    let shm = std::path::Path::new("/dev/shm");
    assert!(on_tmpfs(shm), "/dev/shm is not a tmpfs here: this test needs one");
    let base: Vec<T> = {
        let mut r = rng(41);
        // 16 MiB: even a huge page (2 MiB) for the header's write is under half of it.
        vec![T::random("a.big", DType::BF16, &[8 << 20], &mut r), T::random("b.small", DType::BF16, &[4096], &mut r)]
    };
    let mut target = base.clone();
    for t in target.iter_mut() {
        for b in t.data.iter_mut().step_by(151) {
            *b ^= 1;
        }
    }
    let enc = driftless_format::delta::encode_delta(&views(&base), &views(&target), &DeltaOptions::default()).unwrap();
    let chain = [decode(&enc)];
    let refs: Vec<&[DecodedSegment]> = chain.iter().map(|c| &c[..]).collect();
    let src_dir = tempfile::tempdir().unwrap();
    write(src_dir.path(), &base, 16 << 20);
    let src = CheckpointFiles::open_read_only(src_dir.path()).unwrap();
    let on_shm = tempfile::tempdir_in(shm).unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let mut results = vec![];
    for (root, tmpfs) in [(on_shm.path(), true), (elsewhere.path(), on_tmpfs(elsewhere.path()))] {
        let slot = root.join("slot");
        let dst = src.frame_copy(&slot).unwrap();
        for (name, allocated, len) in allocation(&slot) {
            if !name.ends_with(".safetensors") {
                continue;
            }
            match tmpfs {
                // Only the header's pages were written.
                true => assert!(allocated < len / 2, "{name}: {allocated} of {len} bytes allocated before the pass"),
                false => assert!(allocated >= len, "{name}: {allocated} of {len} bytes reserved"),
            }
        }
        let d = fused::apply_and_hash(Target::Copy { from: &src, to: &dst }, &src.metas(), &refs, true).unwrap();
        dst.sync().unwrap();
        for (name, allocated, len) in allocation(&slot) {
            assert!(allocated >= len, "{name}: {allocated} of {len} bytes after the pass");
        }
        let got = Checkpoint::open(&slot).unwrap();
        assert_same_tensors(&got.views(), &target, "the frame after the pass");
        results.push(d);
    }
    assert_eq!(results[0], results[1], "digests on a tmpfs and elsewhere");
    // No room: refused before anything is written, the file gone.
    // SAFETY: a valid path; `st` is written by the call before it is read.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statfs(c"/dev/shm".as_ptr(), &mut st) }, 0);
    let free = st.f_bavail * st.f_bsize as u64;
    let p = on_shm.path().join("too-big.safetensors");
    let e = driftless_format::checkpoint::create_sized(&p, free + (1 << 30)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io, "{e}");
    assert!(e.to_string().contains("No space left"), "{e}");
    assert!(!p.exists(), "a refused file was left behind");
    // Room for each shard of a frame but not for both: refused up front, before any file is
    // made (each file alone would pass its own check, sparse, and the pass would fill the
    // tmpfs before a write failed). The source is two sparse files on another file system.
    let big = tempfile::tempdir().unwrap();
    let each = (free / 2 + (64 << 20)) & !1;
    sparse_shards(big.path(), each);
    let src = CheckpointFiles::open_read_only(big.path()).unwrap();
    let slot = on_shm.path().join("big-slot");
    let e = src.frame_copy(&slot).map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("No space left"), "{e}");
    let made: Vec<_> = std::fs::read_dir(&slot).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(made.is_empty(), "files made before the refusal: {made:?}");
}

/// Two sparse shard files in `dir`, `a.safetensors` and `b.safetensors`, of one BF16 tensor of
/// `each` bytes each (every tensor byte a hole).
fn sparse_shards(dir: &std::path::Path, each: u64) {
    for name in ["a.safetensors", "b.safetensors"] {
        let t = format!("t.{name}");
        let mut head =
            format!(r#"{{"{t}":{{"dtype":"BF16","shape":[{}],"data_offsets":[0,{each}]}}}}"#, each / 2).into_bytes();
        while head.len() % 8 != 0 {
            head.push(b' ');
        }
        let mut bytes = (head.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&head);
        let f = dir.join(name);
        std::fs::write(&f, &bytes).unwrap();
        std::fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(bytes.len() as u64 + each).unwrap();
    }
}

/// A frame larger than the free space of a disk (not a tmpfs) is refused before any file is
/// made: each file's `posix_fallocate` refused it too, but only once the files before it had
/// filled the disk, at every poll while that step was the newest, under the inference server
/// sharing the disk (and a refused file was left behind). The source is a sparse file.
#[test]
fn a_frame_larger_than_the_disk_is_refused_before_any_file_is_made() {
    let root = tempfile::tempdir().unwrap();
    // SAFETY: a valid path; `st` is written by the call before it is read.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let c = std::ffi::CString::new(root.path().as_os_str().to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::statfs(c.as_ptr(), &mut st) }, 0);
    assert!(st.f_blocks > 0, "the temp directory's file system reports no size");
    // (More than root's reserved blocks too, whatever `check_room` counts.)
    let free = st.f_bfree.max(st.f_bavail) * st.f_bsize as u64;
    let src_dir = root.path().join("src");
    std::fs::create_dir(&src_dir).unwrap();
    let each = ((free + (1 << 30)) / 2) & !1;
    sparse_shards(&src_dir, each);
    let src = CheckpointFiles::open_read_only(&src_dir).unwrap();
    let slot = root.path().join("slot");
    let e = src.frame_copy(&slot).map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("No space left") && !e.is_retryable(), "{e}");
    let need: u64 = std::fs::read_dir(&src_dir).unwrap().map(|f| f.unwrap().metadata().unwrap().len()).sum();
    assert!(e.to_string().contains(&format!("{need} bytes needed")), "{e}");
    let made: Vec<_> = std::fs::read_dir(&slot).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(made.is_empty(), "files made before the refusal: {made:?}");
}

/// `CheckpointFiles` writes check every block's range against its tensor before writing any:
/// a batch with one block past the tensor's end (or an unknown tensor) writes nothing, not even
/// its valid blocks, and a block that ends exactly at the end is written.
#[test]
fn file_writes_outside_a_tensor_write_nothing() {
    let base = tensors(DType::BF16, 7);
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &base, 4096);
    let files = CheckpointFiles::open(dir.path()).unwrap();
    let before = |name: &str, n: usize| {
        let mut b = vec![0u8; n];
        files.read_at(name, 0, &mut b).unwrap();
        b
    };
    let (_, len) = files.info("e.small").unwrap();
    assert_eq!(len, 14);
    let old = before("e.small", len);
    let ones = [0xffu8; 4];
    let e = files.try_write_all_at("e.small", &[(0, &ones[..]), (12, &ones[..])]).unwrap_err();
    assert!(e.to_string().contains("outside tensor e.small"), "{e}");
    assert_eq!(before("e.small", len), old, "the valid block of a refused batch was written");
    assert!(files.write_at("no.such", 0, &ones).is_err());
    assert!(files.write_at("e.small", u64::MAX - 1, &ones).is_err(), "an offset that overflows");
    files.write_at("e.small", 10, &ones).unwrap();
    let got = before("e.small", len);
    assert_eq!((&got[..10], &got[10..]), (&old[..10], &ones[..]));
}
