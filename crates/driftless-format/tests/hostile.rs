//! Hostile input: hand-made malicious segments, manifests, delta files and layouts. Errors must
//! be `Corrupt` (or `Untrusted` for signatures), never panics, never writes out of bounds.

mod common;

use common::*;
use driftless_format::{
    checkpoint::ShardLayout, container, delta, sign, AnchorManifest, CheckpointMut, Codec, DType, DeltaManifest,
    DeltaOptions, ErrorKind, Keypair, Layout, TensorMeta, TensorsMut, TrustSet, ValueMode,
};
use proptest::prelude::*;

fn dense(name: &str, dtype: DType, start: u64, len: u64, byte: u8) -> E<'_> {
    E { name, dense: true, dtype, start, len, count: len, pos: vec![], vals: vec![byte; (len as usize) * dtype.size()] }
}

/// Applies `segs` in one pass onto a guarded buffer of `n` F32 elements named "t".
fn apply_guarded(segs: &[Vec<u8>], n: usize) -> (driftless_format::Result<()>, Vec<u8>) {
    let mut buf = vec![0x5Au8; 16 + n * 4 + 16];
    let res = {
        let mut tm = TensorsMut::new();
        tm.insert("t", DType::F32, &mut buf[16..16 + n * 4]);
        let refs: Vec<(&[u8], u64)> = segs.iter().map(|s| (&s[..], 1 << 20)).collect();
        delta::apply_all(&refs, &tm)
    };
    assert!(buf[..16].iter().chain(&buf[16 + n * 4..]).all(|&b| b == 0x5A), "write outside the tensor");
    (res, buf[16..16 + n * 4].to_vec())
}

fn corrupt(r: driftless_format::Result<()>, what: &str) {
    match r {
        Err(e) => assert_eq!(e.kind(), ErrorKind::Corrupt, "{what}: {e}"),
        Ok(()) => panic!("{what}: accepted"),
    }
}

/// A read of tensor bytes (the journaled apply reads the base of each `ulp` entry to write its
/// redo record) is claimed like a write while it runs, so bytes another segment of the delta
/// writes are never read meanwhile (found by review: the read was unclaimed, a data race given
/// overlapping segments); it is released after, so the same segment's write may follow.
#[test]
fn reads_of_tensor_bytes_are_claimed_while_they_run() {
    let mut buf = vec![7u8; 64];
    let mut tm = TensorsMut::new();
    tm.insert("t", DType::U8, &mut buf);
    tm.with_range_mut("t", 0, 16, |b| b.fill(1)).unwrap();
    let e = tm.with_range("t", 8, 16, |_| ()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(e.to_string().contains("overlapping"), "{e}");
    // Inside the read, its range is taken: a write of it fails.
    let nested =
        tm.with_range("t", 16, 16, |b| (b.iter().all(|&x| x == 7), tm.with_range_mut("t", 20, 4, |_| ()).is_err()));
    assert_eq!(nested.unwrap(), (true, true));
    // After it, a write of the same bytes is the first claim on them.
    tm.with_range_mut("t", 16, 16, |b| b.fill(2)).unwrap();
    assert!(tm.with_range("t", 60, 8, |_| ()).is_err(), "out of bounds");
    drop(tm);
    assert_eq!(&buf[..32], [[1u8; 16], [2u8; 16]].concat());
}

#[test]
fn overlapping_entries_are_refused() {
    // Sanity: adjacent, non-overlapping entries apply.
    let ok = raw_segment(0, &[dense("t", DType::F32, 0, 4, 1), dense("t", DType::F32, 4, 4, 2)]);
    let (r, out) = apply_guarded(&[ok], 8);
    r.unwrap();
    assert_eq!(out, [vec![1u8; 16], vec![2u8; 16]].concat());

    let same = raw_segment(0, &[dense("t", DType::F32, 0, 4, 1), dense("t", DType::F32, 0, 4, 2)]);
    corrupt(apply_guarded(&[same], 8).0, "same range twice in a segment");
    let partial = raw_segment(0, &[dense("t", DType::F32, 0, 4, 1), dense("t", DType::F32, 3, 4, 2)]);
    corrupt(apply_guarded(&[partial], 8).0, "partial overlap");
    let inside = raw_segment(0, &[dense("t", DType::F32, 0, 8, 1), dense("t", DType::F32, 2, 1, 2)]);
    corrupt(apply_guarded(&[inside], 8).0, "range inside another");
    let before = raw_segment(0, &[dense("t", DType::F32, 2, 1, 1), dense("t", DType::F32, 0, 8, 2)]);
    corrupt(apply_guarded(&[before], 8).0, "range around an earlier one");
    // Across segments of the same pass.
    let s1 = raw_segment(0, &[dense("t", DType::F32, 0, 4, 1)]);
    let s2 = raw_segment(0, &[dense("t", DType::F32, 2, 4, 2)]);
    corrupt(apply_guarded(&[s1, s2], 8).0, "overlap across segments");
    // Sparse entries overlapping a dense one.
    let sp =
        E { name: "t", dense: false, dtype: DType::F32, start: 1, len: 2, count: 1, pos: vec![0], vals: vec![9; 4] };
    let s = raw_segment(0, &[dense("t", DType::F32, 0, 2, 1), sp]);
    corrupt(apply_guarded(&[s], 8).0, "sparse over dense");
}

#[test]
fn malformed_entries_are_corrupt() {
    let sp = |start, len, count, pos: Vec<u8>, vals: Vec<u8>| E {
        name: "t",
        dense: false,
        dtype: DType::F32,
        start,
        len,
        count,
        pos,
        vals,
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("unknown tensor", raw_segment(0, &[dense("nope", DType::F32, 0, 1, 1)])),
        ("dtype mismatch", raw_segment(0, &[dense("t", DType::BF16, 0, 2, 1)])),
        ("range past the end", raw_segment(0, &[dense("t", DType::F32, 6, 4, 1)])),
        ("start overflow", raw_segment(0, &[dense("t", DType::F32, u64::MAX - 1, 1, 1)])),
        ("position past len", raw_segment(0, &[sp(0, 2, 1, vec![2], vec![1; 4])])),
        ("second position past len", raw_segment(0, &[sp(0, 2, 2, vec![0, 1], vec![1; 8])])),
        ("count over len", raw_segment(0, &[sp(0, 1, 2, vec![0, 0], vec![1; 8])])),
        ("zero count", raw_segment(0, &[sp(0, 1, 0, vec![], vec![])])),
        ("values short", raw_segment(0, &[sp(0, 4, 2, vec![0, 0], vec![1; 5])])),
        ("trailing positions", raw_segment(0, &[sp(0, 4, 1, vec![0, 0], vec![1; 4])])),
        ("ulp too wide", raw_segment(1, &[sp(0, 4, 1, vec![0], vec![0xff, 0xff, 0xff, 0xff, 0x7f])])),
        ("ulp truncated", raw_segment(1, &[sp(0, 4, 1, vec![0], vec![0xff])])),
        ("dense with positions", raw_segment(0, &[E { pos: vec![0], ..dense("t", DType::F32, 0, 1, 1) }])),
        ("dense count != len", raw_segment(0, &[E { count: 1, ..dense("t", DType::F32, 0, 2, 1) }])),
        ("empty name", raw_segment(0, &[dense("", DType::F32, 0, 1, 1)])),
    ];
    for (what, seg) in cases {
        let r = delta::decode_segment(&seg, 1 << 20).and_then(|s| {
            let mut buf = vec![0u8; 32];
            let mut tm = TensorsMut::new();
            tm.insert("t", DType::F32, &mut buf);
            delta::to_redo(&s, &tm).map(|_| ()).and_then(|_| delta::apply_segment(&s, &tm))
        });
        corrupt(r, what);
    }
    // Header-level damage.
    let good = raw_segment(0, &[dense("t", DType::F32, 0, 1, 1)]);
    let mut v = good.clone();
    v[4] = 2;
    corrupt(delta::decode_segment(&v, 1 << 20).map(|_| ()), "version");
    let mut v = good.clone();
    v[5] = 7;
    corrupt(delta::decode_segment(&v, 1 << 20).map(|_| ()), "codec");
    let mut v = good.clone();
    v[6] = 9;
    corrupt(delta::decode_segment(&v, 1 << 20).map(|_| ()), "mode");
    delta::decode_segment(&good, 1 << 20).unwrap();
    let mut v = good.clone();
    v[7] = 1;
    corrupt(delta::decode_segment(&v, 1 << 20).map(|_| ()), "reserved byte");
    let mut v = good.clone();
    v[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    corrupt(delta::decode_segment(&v, 1 << 20).map(|_| ()), "entry count");
    // Raw size bound: a block that claims more than the manifest's raw_size is refused before
    // anything is allocated.
    corrupt(delta::decode_segment(&good, 4).map(|_| ()), "raw size over bound");
    let mut v = good.clone();
    v[12..20].copy_from_slice(&(1u64 << 40).to_le_bytes());
    v[5] = 1;
    corrupt(delta::decode_segment(&v, u64::MAX).map(|_| ()), "huge zstd block");
    for l in 0..good.len() {
        corrupt(delta::decode_segment(&good[..l], 1 << 20).map(|_| ()), "truncated");
    }
}

/// A sparse entry's count is bounded by its position (and `ulp` value) bytes, one at least
/// per element: a count of 2^61 in an 85-byte segment is refused by the decoder (it used to be
/// accepted, and `entry_indices` then reserved 2^61 u64s: a capacity-overflow panic).
#[test]
fn regression_sparse_count_bounded_by_its_bytes() {
    let sp = |count: u64, pos: Vec<u8>, vals: Vec<u8>| E {
        name: "t",
        dense: false,
        dtype: DType::U8,
        start: 0,
        len: count.max(4),
        count,
        pos,
        vals,
    };
    for mode in [0, 1] {
        let huge = raw_segment(mode, &[sp(1 << 61, vec![], vec![])]);
        corrupt(delta::decode_segment(&huge, 1 << 20).map(|_| ()), "count without positions");
        let short = raw_segment(mode, &[sp(3, vec![0, 0], vec![1; 3])]);
        corrupt(delta::decode_segment(&short, 1 << 20).map(|_| ()), "count over its position bytes");
    }
    // ulp values take a byte at least each, too.
    let few_vals = raw_segment(1, &[sp(3, vec![0, 0, 0], vec![1; 2])]);
    corrupt(delta::decode_segment(&few_vals, 1 << 20).map(|_| ()), "count over its value bytes");
    // The honest shape still decodes, and its indices come back.
    let ok = raw_segment(1, &[sp(3, vec![0, 0, 0], vec![2; 3])]);
    let d = delta::decode_segment(&ok, 1 << 20).unwrap();
    assert_eq!(d.entry_indices(0).unwrap(), vec![0, 1, 2]);
}

/// A layout listing enough maximal tensors to wrap a 64-bit offset is refused, not wrapped
/// into a small file with huge tensor ranges (regression: `shard_header` added unchecked), and
/// `validate` (what every manifest's layout goes through) refuses it up front, so that a
/// manifest carrying it is corrupt, not an error at build time that was retried for good.
#[test]
fn regression_layout_offsets_overflow() {
    let tensors: Vec<TensorMeta> = (0..(1u64 << 18))
        .map(|i| TensorMeta { name: format!("t{i}"), dtype: DType::U8, shape: vec![1 << 46] })
        .collect();
    let shard = ShardLayout { file: "model.safetensors".into(), tensors, metadata: None };
    let e = Layout::shard_header(&shard).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    let layout = Layout { shards: vec![shard] };
    assert_eq!(layout.validate().unwrap_err().kind(), ErrorKind::InvalidInput);
    assert!(layout.shard_sizes().is_err());
    let dir = tempfile::tempdir().unwrap();
    assert!(CheckpointMut::create(dir.path(), &layout).is_err());
}

fn signed_delta_file(key: &Keypair) -> (Vec<u8>, DeltaManifest, Vec<Vec<u8>>) {
    let mut r = rng(21);
    let base = vec![T::random("w", DType::BF16, &[256], &mut r), T::random("v", DType::F32, &[16], &mut r)];
    let target: Vec<T> = base.iter().map(|t| mutate(t, 0.1, &mut r)).collect();
    let layout = Layout::for_tensors(&metas(&target), u64::MAX).unwrap();
    let (m, enc) =
        make(&base, &target, &layout, &DeltaOptions { segment_target: 64, chunk_bytes: 64, ..Default::default() });
    let env = key.seal(&serde_json::to_vec(&m).unwrap()).unwrap();
    let segs: Vec<Vec<u8>> = enc.segments.into_iter().map(|s| s.bytes).collect();
    let refs: Vec<&[u8]> = segs.iter().map(|s| &s[..]).collect();
    let mut file = vec![];
    container::write_delta_file(&mut file, &env, &refs).unwrap();
    (file, m, segs)
}

#[test]
fn delta_file_hostile() {
    let key = Keypair::from_seed([1; 32]);
    let trust = TrustSet::new().with_key(key.public());
    let (file, m, segs) = signed_delta_file(&key);
    assert!(segs.len() > 2);
    let f = container::read_delta_file(&file, &trust).unwrap();
    assert_eq!(f.manifest, m);
    assert_eq!(f.signer.as_deref(), Some(key.id()));
    assert_eq!(f.segments.len(), segs.len());
    for (a, b) in f.segments.iter().zip(&segs) {
        assert_eq!(*a, &b[..]);
    }
    // Another key: untrusted.
    let other = TrustSet::new().with_key(Keypair::from_seed([2; 32]).public());
    assert_eq!(container::read_delta_file(&file, &other).unwrap_err().kind(), ErrorKind::Untrusted);
    // Every truncation fails.
    for l in (0..file.len()).step_by(7).chain([file.len() - 1]) {
        let e = container::read_delta_file(&file[..l], &trust).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Corrupt | ErrorKind::Untrusted), "truncation at {l}: {e}");
    }
    // Trailing bytes fail.
    let mut longer = file.clone();
    longer.push(0);
    assert_eq!(container::read_delta_file(&longer, &trust).unwrap_err().kind(), ErrorKind::Corrupt);
    // Random mutations: an error of the right kind, or (a mutation the checks cannot see, such
    // as none at all) exactly the original content.
    let mut r = rng(22);
    let mut accepted = 0;
    for _ in 0..3000 {
        let b = mutate_bytes(&file, &mut r);
        match container::read_delta_file(&b, &trust) {
            Ok(f) => {
                assert_eq!(f.manifest, m);
                assert!(f.segments.iter().zip(&segs).all(|(a, b)| *a == &b[..]));
                accepted += 1;
            }
            Err(e) => assert!(matches!(e.kind(), ErrorKind::Corrupt | ErrorKind::Untrusted), "{e}"),
        }
    }
    assert!(accepted < 3000);
}

#[test]
fn manifest_hostile_values() {
    let key = Keypair::from_seed([1; 32]);
    let (_, m, _) = signed_delta_file(&key);
    let good = serde_json::to_value(&m).unwrap();
    DeltaManifest::from_slice(&serde_json::to_vec(&good).unwrap()).unwrap();
    let bad = |f: &dyn Fn(&mut serde_json::Value), what: &str| {
        let mut v = good.clone();
        f(&mut v);
        let e = DeltaManifest::from_slice(&serde_json::to_vec(&v).unwrap()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{what}: {e}");
    };
    bad(&|v| v["kind"] = "anchor".into(), "kind");
    bad(&|v| v["version"] = 1.into(), "version");
    bad(&|v| v["base_step"] = v["step"].clone(), "base_step == step");
    bad(&|v| v["segments"][0]["object"] = "../../etc/passwd".into(), "path traversal in segment name");
    bad(&|v| v["segments"][0]["object"] = ".hidden".into(), "dot file");
    bad(&|v| v["segments"][0]["raw_size"] = (1u64 << 40).into(), "raw size over limit");
    bad(&|v| v["shards"][0]["file"] = "../model.safetensors".into(), "shard path traversal");
    bad(&|v| v["shards"][0]["file"] = "model.safetensors.index.json".into(), "index file as shard");
    bad(&|v| v["shards"][0]["file"] = "model.bin".into(), "not safetensors");
    bad(&|v| v["shards"][0]["tensors"][0]["name"] = "".into(), "empty tensor name");
    bad(&|v| v["shards"][0]["tensors"][0]["name"] = "a\nb".into(), "control char in name");
    bad(&|v| v["shards"][0]["tensors"][0]["shape"] = serde_json::json!([1u64 << 40, 1u64 << 40]), "shape overflow");
    bad(&|v| v["shards"][0]["tensors"][0]["shape"] = serde_json::json!(vec![1; 17]), "too many dims");
    bad(
        &|v| {
            let mut t = v["shards"][0]["tensors"][0].clone();
            t["dtype"] = "U8".into();
            t["shape"] = serde_json::json!([1u64 << 46]);
            let mut u = t.clone();
            u["name"] = "second.weight".into();
            v["shards"][0]["tensors"] = serde_json::json!([t, u]);
        },
        "a shard of two largest tensors",
    );
    bad(
        &|v| {
            let mut t = v["shards"][0]["tensors"][0].clone();
            t["dtype"] = "U8".into();
            t["shape"] = serde_json::json!([1u64 << 46]);
            let shards: Vec<serde_json::Value> = (0..17)
                .map(|i| {
                    let mut t = t.clone();
                    t["name"] = format!("t{i}").into();
                    serde_json::json!({"file": format!("m{i}.safetensors"), "tensors": [t]})
                })
                .collect();
            v["shards"] = shards.into();
        },
        "a layout of more than 1 PiB",
    );
    bad(&|v| v["shards"][0]["tensors"][0]["dtype"] = "F4".into(), "unknown dtype");
    bad(&|v| v["shards"][0]["tensors"][0]["digest"] = "00".into(), "short digest");
    bad(&|v| v["codec"] = serde_json::json!({"name": "lz4"}), "unknown codec");
    bad(&|v| v["value_mode"] = "xor".into(), "unknown value mode");
    bad(
        &|v| {
            let t = v["shards"][0]["tensors"][0].clone();
            v["shards"][0]["tensors"].as_array_mut().unwrap().push(t);
        },
        "duplicate tensor",
    );
    bad(
        &|v| {
            let s = v["shards"][0].clone();
            v["shards"].as_array_mut().unwrap().push(s);
        },
        "duplicate shard",
    );
    let big = vec![b' '; driftless_format::manifest::MAX_MANIFEST_BYTES + 1];
    assert_eq!(DeltaManifest::from_slice(&big).unwrap_err().kind(), ErrorKind::Corrupt);
    assert_eq!(TrustSet::new().open(&big).unwrap_err().kind(), ErrorKind::Corrupt);
    // Sizes that would overflow a sum (regression: payload_bytes overflowed) are refused now,
    // being more than an encoder writes for the segments' decoded size.
    bad(
        &|v| {
            for s in v["segments"].as_array_mut().unwrap() {
                s["size"] = u64::MAX.into();
            }
        },
        "segment sizes over what their raw size allows",
    );
    // Anchor manifest: objects must line up with shards and have safe names.
    let docs = anchor_doc(&m);
    AnchorManifest::from_slice(&serde_json::to_vec(&docs).unwrap()).unwrap();
    for (what, f) in [
        (
            "object name",
            Box::new(|v: &mut serde_json::Value| v["objects"][0]["object"] = "a/b".into())
                as Box<dyn Fn(&mut serde_json::Value)>,
        ),
        ("file name", Box::new(|v: &mut serde_json::Value| v["files"][0]["object"] = "../config.json".into())),
        ("object order", Box::new(|v: &mut serde_json::Value| v["objects"][0]["file"] = "other.safetensors".into())),
        (
            "object count",
            Box::new(|v: &mut serde_json::Value| {
                v["objects"].as_array_mut().unwrap().pop();
            }),
        ),
        // Signed parts must tile the object: lengths of at least 1 adding up to its size,
        // with no sum that wraps.
        ("parts short of the object", Box::new(move |v: &mut serde_json::Value| set_parts(v, &[-1]))),
        ("parts past the object", Box::new(move |v: &mut serde_json::Value| set_parts(v, &[0, 1]))),
        ("a part of no bytes", Box::new(move |v: &mut serde_json::Value| set_parts(v, &[0, -2]))),
        ("part lengths that wrap", Box::new(move |v: &mut serde_json::Value| set_parts(v, &[-3, -4]))),
    ] {
        let mut v = docs.clone();
        f(&mut v);
        assert_eq!(
            AnchorManifest::from_slice(&serde_json::to_vec(&v).unwrap()).unwrap_err().kind(),
            ErrorKind::Corrupt,
            "{what}"
        );
    }
    // Parts that tile the object are accepted.
    let mut v = docs.clone();
    set_parts(&mut v, &[0]);
    assert_eq!(AnchorManifest::from_slice(&serde_json::to_vec(&v).unwrap()).unwrap().objects[0].parts.len(), 1);
    // Decoded sizes the shard's tensors cannot fill, or that no header explains (regression: a
    // layout of 1000 tensors of 2^46 bytes each was accepted for a 100-byte shard, and the
    // Python mirror allocated the layout's bytes before reading any).
    let data: u64 = m.layout().shards[0].tensors.iter().map(|t| t.nbytes().unwrap()).sum();
    for (n, ok) in [
        (data + 10, true),
        (data + 8 + 100_000_000, true),
        (data + 9, false),
        (data + 9 + 100_000_000, false),
        (2, false),
        (1 << 41, false),
        (u64::MAX, false),
    ] {
        let mut v = docs.clone();
        v["objects"][0]["decoded_size"] = n.into();
        let r = AnchorManifest::from_slice(&serde_json::to_vec(&v).unwrap());
        match ok {
            true => assert!(r.is_ok(), "decoded size {n}: {:?}", r.err()),
            false => assert_eq!(r.unwrap_err().kind(), ErrorKind::Corrupt, "decoded size {n}"),
        }
    }
    let mut v = docs.clone();
    let huge: Vec<_> = (0..1000).map(|i| serde_json::json!({"name": format!("t{i}"), "dtype": "BF16", "shape": [1u64 << 45], "digest": m.base_root})).collect();
    v["shards"][0]["tensors"] = huge.into();
    v["objects"][0]["decoded_size"] = 100.into();
    let e = AnchorManifest::from_slice(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    // Refused by the layout's own bound now (64 TiB of tensors a shard), before the objects
    // are compared with it.
    assert!(e.to_string().contains("claims"), "{e}");
    let mut v = docs.clone();
    v["objects"][0]["size"] = u64::MAX.into();
    v["files"][0]["size"] = 1.into();
    assert_eq!(AnchorManifest::from_slice(&serde_json::to_vec(&v).unwrap()).unwrap().payload_bytes(), u64::MAX);
    // Extra files are held in memory by readers: one over 64 MiB, or more than 256 MiB in all,
    // is refused (regression: only the manifest's sizes bounded them).
    let mut v = docs.clone();
    v["files"][0]["size"] = (driftless_format::MAX_EXTRA_FILE + 1).into();
    let e = AnchorManifest::from_slice(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    let mut v = docs.clone();
    let f = v["files"][0].clone();
    let many: Vec<_> = (0..5)
        .map(|i| {
            let mut f = f.clone();
            f["object"] = format!("extra-{i}.bin").into();
            f["size"] = (60u64 << 20).into();
            f
        })
        .collect();
    v["files"] = many.into();
    let e = AnchorManifest::from_slice(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert!(e.to_string().contains("over the 256 MiB limit"), "{e}");
}

/// A delta's segments together decode to no more than an encoder writes for its result: the
/// layout's bytes and a header per entry (regression: 1000 segments of 2 GiB each were accepted
/// for a model of 4 KiB, and readers decode every segment of a delta before applying it).
#[test]
fn regression_delta_raw_size_bounded_by_layout() {
    let mut r = rng(31);
    let base = vec![T::random("t", DType::U8, &[4096], &mut r)];
    let target: Vec<T> = base.iter().map(|t| mutate(t, 0.5, &mut r)).collect();
    let layout = Layout::for_tensors(&metas(&base), 1 << 30).unwrap();
    let (m, _) = make(&base, &target, &layout, &DeltaOptions::default());
    DeltaManifest::from_slice(&serde_json::to_vec(&m).unwrap()).unwrap();
    let one = m.segments[0].clone();
    let with = |n: usize, raw: u64, entries: u32| {
        let mut m = m.clone();
        m.segments = (0..n)
            .map(|i| {
                let mut s = one.clone();
                s.object.object = format!("seg-{i:05}.dls");
                s.raw_size = raw;
                s.entries = entries;
                // (Within what an encoder writes for `raw`: only the raw sizes are on trial.)
                s.object.size = s.object.size.min(delta::max_segment_object(raw));
                s
            })
            .collect();
        DeltaManifest::from_slice(&serde_json::to_vec(&m).unwrap())
    };
    let e = with(1000, delta::MAX_SEGMENT_RAW, 1).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(e.to_string().contains("more than an encoder writes"), "{e}");
    // Entry counts raise the allowance only up to one entry per element.
    assert_eq!(with(1000, delta::MAX_SEGMENT_RAW, delta::MAX_ENTRIES).unwrap_err().kind(), ErrorKind::Corrupt);
    assert_eq!(with(1, 1 << 20, delta::MAX_ENTRIES + 1).unwrap_err().kind(), ErrorKind::Corrupt);
    // The exact bound passes; a byte more does not.
    let most = delta::max_delta_raw(&layout, 4);
    assert_eq!(most, 4096 + 4 * delta::max_entry_header(1));
    with(2, most / 2, 2).unwrap();
    assert_eq!(with(2, most / 2 + 1, 2).unwrap_err().kind(), ErrorKind::Corrupt);
}

/// A delta's decoded memory is bounded by its result too, entries counted (found by review: a
/// signed manifest within the raw bound could declare millions of one-element entries, each
/// costing a reader ten times its raw bytes in memory), and a segment must hold exactly the
/// entries its manifest declares, refused before anything is decompressed.
#[test]
fn regression_delta_heap_bounded_by_layout() {
    let mut r = rng(34);
    let base = vec![T::random("t", DType::U8, &[4096], &mut r)];
    let target: Vec<T> = base.iter().map(|t| mutate(t, 0.5, &mut r)).collect();
    let layout = Layout::for_tensors(&metas(&base), 1 << 30).unwrap();
    let (m, enc) = make(&base, &target, &layout, &DeltaOptions::default());
    DeltaManifest::from_slice(&serde_json::to_vec(&m).unwrap()).unwrap();
    // 100 segments of a million entries and 2,000 raw bytes each: within the raw bound (the
    // header allowance counts at most one entry per element), 12 GB of entries decoded.
    let mut many = m.clone();
    many.segments = (0..100)
        .map(|i| {
            let mut s = m.segments[0].clone();
            s.object.object = format!("seg-{i:05}.dls");
            s.raw_size = 2000;
            s.entries = delta::MAX_ENTRIES;
            s.object.size = s.object.size.min(delta::max_segment_object(2000));
            s
        })
        .collect();
    let raw: u64 = many.segments.iter().map(|s| s.raw_size).sum();
    assert!(raw <= delta::max_delta_raw(&layout, 100 * u64::from(delta::MAX_ENTRIES)));
    let e = DeltaManifest::from_slice(&serde_json::to_vec(&many).unwrap()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(e.to_string().contains("in memory"), "{e}");
    // The bound: the result's bytes and a quarter, plus 64 MiB.
    assert_eq!(delta::max_delta_heap(&layout), 4096 + 1024 + (64 << 20));
    // A segment is held to its declared entry count, either way.
    let seg = &enc.segments[0];
    let good = &m.segments[0];
    assert_eq!(delta::decode_segment_of(&seg.bytes, good).unwrap().entries.len() as u32, good.entries);
    for entries in [good.entries - 1, good.entries + 1] {
        let lie = driftless_format::manifest::SegmentRef { entries, ..good.clone() };
        let e = delta::decode_segment_of(&seg.bytes, &lie).map(|_| ()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
        assert!(e.to_string().contains("the manifest declares"), "{e}");
    }
}

/// A delta's decoded memory is bounded by the model a reader applies it to as well
/// (`check_onto`), not only by the result layout the manifest declares: a layout change
/// claiming a 1 GiB tensor more, with segments of 512 MiB decoded, is valid by its own result
/// and refused onto the 4 KiB model it was made from.
#[test]
fn regression_delta_heap_bounded_by_the_local_model() {
    let mut r = rng(35);
    let base = vec![T::random("t", DType::U8, &[4096], &mut r)];
    let target: Vec<T> = base.iter().map(|t| mutate(t, 0.5, &mut r)).collect();
    let layout = Layout::for_tensors(&metas(&base), 1 << 30).unwrap();
    let (m, _) = make(&base, &target, &layout, &DeltaOptions::default());
    m.check_onto(&layout).unwrap();
    assert_eq!(
        m.decoded_heap(),
        m.segments.iter().map(|s| s.raw_size).sum::<u64>()
            + m.segments.iter().map(|s| u64::from(s.entries) * delta::entry_heap(1)).sum::<u64>()
    );
    let mut grown = m.clone();
    grown.shards[0].tensors.push(driftless_format::manifest::TensorRecord {
        name: "grown".into(),
        dtype: DType::U8,
        shape: vec![1 << 30],
        digest: driftless_format::Digest([0; 32]),
    });
    grown.segments[0].raw_size = 512 << 20;
    grown.validate().unwrap();
    grown.check_onto(&grown.layout()).unwrap();
    let e = grown.check_onto(&layout).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(e.to_string().contains("wait for the next anchor"), "{e}");
    // The bound onto the local model is the result's bound for a delta of one layout.
    let mut most = m.clone();
    most.segments[0].raw_size += delta::max_delta_heap(&layout) - m.decoded_heap();
    most.check_onto(&layout).unwrap();
    most.segments[0].raw_size += 1;
    most.check_onto(&layout).unwrap_err();
}

/// A segment object is no larger than an encoder writes for its decoded size (found by review:
/// only the marker bounded it, up to 2^50 bytes, and readers download a segment into memory
/// whole). An honest incompressible segment of 4 MiB fits; a byte over the bound is refused.
#[test]
fn regression_segment_object_size_bounded_by_its_raw_size() {
    let mut r = rng(33);
    let base = vec![T::random("t", DType::U8, &[4 << 20], &mut r)];
    let target: Vec<T> = base.iter().map(|t| mutate(t, 1.0, &mut r)).collect();
    let layout = Layout::for_tensors(&metas(&base), 1 << 30).unwrap();
    for codec in [Codec::Raw, Codec::Zstd { level: 1 }, Codec::Zstd { level: 19 }] {
        let opts = DeltaOptions { values: ValueMode::Overwrite, codec, segment_target: 64 << 20, chunk_bytes: 8 << 20 };
        let (m, enc) = make(&base, &target, &layout, &opts);
        for s in &enc.segments {
            assert!(s.bytes.len() as u64 <= delta::max_segment_object(s.raw_size), "{codec:?}");
        }
        DeltaManifest::from_slice(&serde_json::to_vec(&m).unwrap()).unwrap();
        let mut big = m.clone();
        big.segments[0].object.size = delta::max_segment_object(big.segments[0].raw_size);
        DeltaManifest::from_slice(&serde_json::to_vec(&big).unwrap()).unwrap();
        big.segments[0].object.size += 1;
        let e = DeltaManifest::from_slice(&serde_json::to_vec(&big).unwrap()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
        assert!(e.to_string().contains("more than an encoder writes for"), "{e}");
        big.segments[0].object.size = 1 << 50;
        assert_eq!(
            DeltaManifest::from_slice(&serde_json::to_vec(&big).unwrap()).unwrap_err().kind(),
            ErrorKind::Corrupt
        );
    }
}

/// The worst an honest encoder does stays within the bound: every element changed, chunks of
/// one element (an entry per element, each with its header), long names, every dtype width and
/// value mode, sparse and dense entries.
#[test]
fn honest_worst_case_deltas_fit_the_raw_bound() {
    let mut r = rng(32);
    let long = "x".repeat(1024); // the longest name a layout may have
    for dtype in [DType::U8, DType::BF16, DType::F32, DType::F64] {
        let base = vec![T::random(&long, dtype, &[300], &mut r), T::random("s", dtype, &[5, 7], &mut r)];
        for density in [1.0, 0.5, 0.02] {
            let target: Vec<T> = base.iter().map(|t| mutate(t, density, &mut r)).collect();
            let layout = Layout::for_tensors(&metas(&target), u64::MAX).unwrap();
            for values in [ValueMode::Ulp, ValueMode::Overwrite] {
                for chunk_bytes in [1, dtype.size(), 3 * dtype.size(), 64, 1 << 20] {
                    for codec in [Codec::Raw, Codec::Zstd { level: 1 }] {
                        let opts = DeltaOptions { values, codec, segment_target: 200, chunk_bytes };
                        let (m, enc) = make(&base, &target, &layout, &opts);
                        let raw: u64 = enc.segments.iter().map(|s| s.raw_size).sum();
                        let entries: u64 = enc.segments.iter().map(|s| u64::from(s.entries)).sum();
                        let ctx = format!("{dtype} {density} {values:?} {chunk_bytes} {codec:?}");
                        assert!(raw <= delta::max_delta_raw(&layout, entries), "{ctx}: {raw} bytes");
                        DeltaManifest::from_slice(&serde_json::to_vec(&m).unwrap())
                            .unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    }
                }
            }
        }
    }
}

/// A zstd block whose frame declares another size than the segment header is refused before
/// its buffer is reserved.
#[test]
fn zstd_frame_size_must_match_the_block_header() {
    let good = raw_segment(0, &[dense("t", DType::F32, 0, 4, 1)]);
    // Re-encode the values block (16 bytes) as a zstd frame declaring 16 bytes, then lie about
    // the raw length in the header.
    let z = |b: &[u8]| zstd::bulk::compress(b, 1).unwrap();
    let (h_len, p_len) = (u64::from_le_bytes(good[12..20].try_into().unwrap()) as usize, 0usize);
    let headers = &good[60..60 + h_len];
    let blocks = [z(headers), z(&[]), z(&[1u8; 16])];
    let seg = |vals_raw: u64| {
        let mut s = good[..12].to_vec();
        s[5] = 1;
        for (b, raw) in blocks.iter().zip([h_len as u64, p_len as u64, vals_raw]) {
            s.extend_from_slice(&raw.to_le_bytes());
            s.extend_from_slice(&(b.len() as u64).to_le_bytes());
        }
        for b in &blocks {
            s.extend_from_slice(b);
        }
        s
    };
    delta::decode_segment(&seg(16), 1 << 20).unwrap();
    for lie in [8, 17, 1 << 20] {
        let e = delta::decode_segment(&seg(lie), 1 << 30).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    }
}

fn anchor_doc(m: &DeltaManifest) -> serde_json::Value {
    let sizes = m.layout().shard_sizes().unwrap();
    let objects: Vec<_> = m.shards.iter().zip(sizes).map(|(s, n)| serde_json::json!({"file": s.file, "object": "a.dla", "size": 1, "sha256": m.base_root, "decoded_size": n, "decoded_sha256": m.base_root})).collect();
    serde_json::json!({"kind": "anchor", "version": 3, "stream_id": "s", "step": 1, "weights_root": m.base_root, "encoding": "safetensors",
        "shards": m.shards, "objects": objects, "files": [{"object": "config.json", "size": 1, "sha256": m.base_root}], "created_at_ms": 0})
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    /// Structured JSON mutations of a real manifest, parsed directly and inside envelopes.
    #[test]
    fn prop_manifest_mutations(seed in any::<u64>()) {
        let key = Keypair::from_seed([1; 32]);
        let (_, m, _) = signed_delta_file(&key);
        let mut r = rng(seed);
        let v = mutate_json(&serde_json::to_value(&m).unwrap(), &mut r);
        let bytes = serde_json::to_vec(&v).unwrap();
        if let Err(e) = DeltaManifest::from_slice(&bytes) {
            prop_assert_eq!(e.kind(), ErrorKind::Corrupt);
        }
        let a = mutate_json(&anchor_doc(&m), &mut r);
        if let Err(e) = AnchorManifest::from_slice(&serde_json::to_vec(&a).unwrap()) {
            prop_assert_eq!(e.kind(), ErrorKind::Corrupt);
        }
        // Envelope-level mutations.
        let env = key.seal(&serde_json::to_vec(&m).unwrap()).unwrap();
        let ev = mutate_json(&serde_json::from_slice(&env).unwrap(), &mut r);
        let trust = TrustSet::new().with_key(key.public());
        match trust.open(&serde_json::to_vec(&ev).unwrap()) {
            Ok((p, signer)) => {
                prop_assert_eq!(signer.as_deref(), Some(key.id()));
                prop_assert_eq!(DeltaManifest::from_slice(&p).unwrap(), m.clone());
            }
            Err(e) => prop_assert!(matches!(e.kind(), ErrorKind::Corrupt | ErrorKind::Untrusted), "{}", e),
        }
        let _ = sign::seal_unsigned(&bytes);
    }
}

/// A FIFO named like a shard (found by review of `publish --watch`): opening it blocked for
/// good, deaf to the publisher's SIGTERM. It is refused at once as not a regular file.
#[test]
fn a_fifo_named_like_a_shard_is_refused_not_waited_on() {
    let d = tempfile::tempdir().unwrap();
    let fifo = d.path().join("model.safetensors");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo(3) on a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let (tx, rx) = std::sync::mpsc::channel();
    let p = d.path().to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(driftless_format::Checkpoint::open(&p).map(|_| ()).map_err(|e| e.to_string()));
    });
    let r = rx.recv_timeout(std::time::Duration::from_secs(10)).expect("Checkpoint::open blocked on a FIFO");
    let e = r.unwrap_err();
    assert!(e.contains("not a regular file"), "{e}");
}

/// Sets the first object's signed parts from codes: `0` the object's size, `1` one byte, `-1`
/// the size less one, `-2` no bytes, `-3` `u64::MAX`, `-4` the size plus one (with `-3`, a sum
/// that wraps to the size).
fn set_parts(v: &mut serde_json::Value, codes: &[i8]) {
    let size = v["objects"][0]["size"].as_u64().unwrap();
    let parts: Vec<_> = codes
        .iter()
        .map(|c| {
            let len = match c {
                0 => size,
                1 => 1,
                -1 => size - 1,
                -2 => 0,
                -3 => u64::MAX,
                _ => size + 1,
            };
            serde_json::json!({"len": len, "sha256": v["objects"][0]["sha256"].clone()})
        })
        .collect();
    v["objects"][0]["parts"] = parts.into();
}
