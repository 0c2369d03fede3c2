//! The weights root: an independent implementation of the spec, layout independence,
//! sensitivity to every bit and to name, dtype and shape, and the worked example of
//! `schemas/weights-root.md`.

mod common;

use common::*;
use driftless_format::{hash, Checkpoint, DType, Digest, TensorView};
use proptest::prelude::*;
use sha2::{Digest as _, Sha256};

/// The spec of `schemas/weights-root.md`, written out again with nothing from the crate.
fn spec_root(ts: &[T]) -> [u8; 32] {
    let le = |x: usize| (x as u64).to_le_bytes();
    let mut items: Vec<(Vec<u8>, [u8; 32])> = ts
        .iter()
        .map(|t| {
            let mut h = Sha256::new();
            h.update(b"driftless.tensor.v3\0");
            h.update(le(t.name.len()));
            h.update(t.name.as_bytes());
            let d = t.dtype.as_str();
            h.update(le(d.len()));
            h.update(d.as_bytes());
            h.update(le(t.shape.len()));
            for s in &t.shape {
                h.update(s.to_le_bytes());
            }
            h.update(le(t.data.len()));
            for c in t.data.chunks(1 << 20) {
                let mut ch = Sha256::new().chain_update(b"driftless.chunk.v3\0");
                for leaf in c.chunks(8 << 10) {
                    ch.update(Sha256::new().chain_update(b"driftless.leaf.v3\0").chain_update(leaf).finalize());
                }
                h.update(ch.finalize());
            }
            (t.name.as_bytes().to_vec(), h.finalize().into())
        })
        .collect();
    items.sort();
    let mut h = Sha256::new();
    h.update(b"driftless.root.v3\0");
    h.update(le(items.len()));
    for (n, d) in items {
        h.update(le(n.len()));
        h.update(&n);
        h.update(d);
    }
    h.finalize().into()
}

fn mixed(seed: u64) -> Vec<T> {
    let mut r = rng(seed);
    let mut v: Vec<T> = DType::ALL
        .iter()
        .enumerate()
        .map(|(i, &d)| T::random(&format!("t.{i}.{d}"), d, &[(i as u64 % 4) + 1, 3], &mut r))
        .collect();
    v.push(T::random("scalar", DType::F32, &[], &mut r));
    v.push(T::random("empty", DType::BF16, &[0, 2], &mut r));
    v.push(T::random("é-ünïcode", DType::U8, &[2], &mut r));
    v
}

#[test]
fn matches_independent_implementation() {
    for seed in 0..5 {
        let ts = mixed(seed);
        assert_eq!(root(&ts).0, spec_root(&ts));
        // Per-tensor digests line up with the input order.
        let (digests, _) = driftless_format::weights_root(&views(&ts));
        for (t, d) in ts.iter().zip(&digests) {
            assert_eq!(*d, hash::tensor_digest(&t.view()));
        }
    }
    assert_eq!(root(&[]).0, spec_root(&[]));
}

/// Tensors around the chunk and leaf sizes: the parallel root, the streaming hasher fed in odd
/// pieces and the spec agree, and a flipped bit on either side of a chunk or leaf boundary
/// changes the root.
#[test]
fn chunked_tensors_match_the_spec_and_the_streaming_hasher() {
    let c = hash::CHUNK;
    let mut r = rng(11);
    let ts = vec![
        T::random("exact", DType::U8, &[c as u64], &mut r),
        T::random("over", DType::U8, &[c as u64 + 1], &mut r),
        T::random("big", DType::BF16, &[3, (c as u64 / 2) + 5], &mut r),
        T::random("small", DType::F32, &[3], &mut r),
        T::random("leaf_and_one", DType::U8, &[hash::LEAF as u64 + 1], &mut r),
    ];
    let (digests, got) = driftless_format::weights_root(&views(&ts));
    assert_eq!(got.0, spec_root(&ts));
    for (t, d) in ts.iter().zip(&digests) {
        for piece in [1, 4093, hash::LEAF - 1, hash::LEAF + 1, c - 1, c, 3 * c] {
            let mut h = hash::TensorHasher::new(t.name.as_str(), t.dtype, &t.shape, t.data.len() as u64);
            // Uneven pieces: `piece`, then one byte, repeated.
            let mut rest = &t.data[..];
            let mut odd = false;
            while !rest.is_empty() {
                let n = if odd { 1 } else { piece }.min(rest.len());
                h.update(&rest[..n]);
                rest = &rest[n..];
                odd = !odd;
            }
            assert_eq!(h.finalize(), *d, "{} fed in pieces of {piece}", t.name);
        }
    }
    let mut roots = vec![got];
    for at in [hash::LEAF - 1, hash::LEAF, c - 1, c] {
        let mut flipped = ts.clone();
        flipped[2].data[at] ^= 1;
        let r = root(&flipped).0;
        assert_eq!(r, spec_root(&flipped));
        assert!(!roots.iter().any(|x| x.0 == r), "flip at {at} left the root unchanged");
        roots.push(Digest(r));
    }
}

/// The streaming hasher fed pieces of random sizes (some of whole leaves, some not, some
/// crossing chunks, starting anywhere in a leaf or a chunk) gives the spec's tensor digest:
/// the run of whole leaves it hashes in pairs must stop at the end of the current chunk.
#[test]
fn the_streaming_hasher_takes_pieces_of_any_size_anywhere() {
    use rand::Rng as _;
    let (c, l) = (hash::CHUNK, hash::LEAF);
    let mut r = rng(12);
    let t = T::random("t", DType::U8, &[3 * c as u64 + 5 * l as u64 + 77], &mut r);
    let want = driftless_format::weights_root(&views(std::slice::from_ref(&t))).0[0];
    assert_eq!(
        driftless_format::weights_root(&views(std::slice::from_ref(&t))).1 .0,
        spec_root(std::slice::from_ref(&t))
    );
    let sizes = [1, 77, l - 1, l, l + 1, 2 * l, 2 * l + 3, 5 * l, c - l, c - 1, c, c + l + 1, 3 * c];
    for round in 0..40 {
        let mut h = hash::TensorHasher::new(&t.name, t.dtype, &t.shape, t.data.len() as u64);
        let mut rest = &t.data[..];
        while !rest.is_empty() {
            let n = match round {
                // A leaf and a byte, then a run longer than what is left of the chunk.
                0 => {
                    if rest.len() == t.data.len() {
                        l + 1
                    } else {
                        3 * c
                    }
                }
                _ => sizes[r.gen_range(0..sizes.len())],
            }
            .min(rest.len());
            h.update(&rest[..n]);
            rest = &rest[n..];
        }
        assert_eq!(h.finalize(), want, "round {round}");
    }
}

#[test]
fn independent_of_layout_and_order() {
    let ts = mixed(1);
    let dir = tempfile::tempdir().unwrap();
    let mut roots = vec![];
    for (i, shard) in [u64::MAX, 100, 1].into_iter().enumerate() {
        let d = dir.path().join(format!("c{i}"));
        let mut order = ts.clone();
        if i == 1 {
            order.reverse();
        }
        let l = write(&d, &order, shard);
        let ck = Checkpoint::open(&d).unwrap();
        assert_eq!(ck.layout(), l);
        roots.push(driftless_format::weights_root(&ck.views()).1);
    }
    let mut shuffled = views(&ts);
    shuffled.rotate_left(3);
    roots.push(driftless_format::weights_root(&shuffled).1);
    assert!(roots.iter().all(|r| *r == root(&ts)), "{roots:?}");
}

#[test]
fn changes_with_name_dtype_shape() {
    let ts = vec![T::new("a", DType::F16, &[2, 4], (0..16).collect()), T::new("b", DType::U8, &[3], vec![1, 2, 3])];
    let r0 = root(&ts);
    let variant = |f: &dyn Fn(&mut Vec<T>)| {
        let mut v = ts.clone();
        f(&mut v);
        root(&v)
    };
    let roots = [
        variant(&|v| v[0].name = "a2".into()),
        variant(&|v| v[0].name = "A".into()),
        variant(&|v| v[0].dtype = DType::BF16),
        variant(&|v| v[0].dtype = DType::I16),
        variant(&|v| v[0].shape = vec![8]),
        variant(&|v| v[0].shape = vec![4, 2]),
        variant(&|v| v[0].shape = vec![2, 4, 1]),
        variant(&|v| v[1].shape = vec![3, 1]),
        variant(&|v| {
            v[0].dtype = DType::U8;
            v[0].shape = vec![16];
        }),
        variant(&|v| {
            v.pop();
        }),
        variant(&|v| v.push(T::new("c", DType::U8, &[0], vec![]))),
        // Names are length-prefixed: moving a byte from one field to the next changes the root.
        variant(&|v| {
            v[0].name = "ab".into();
            v[1].name = "".to_string() + "b";
        }),
    ];
    let mut all: Vec<Digest> = roots.to_vec();
    all.push(r0);
    let n = all.len();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), n, "two different tensor sets share a root");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    /// Flipping any single bit of any tensor changes the root.
    #[test]
    fn any_bit_flip_changes_root(seed in 0u64..4, which in any::<prop::sample::Index>(), bit in any::<prop::sample::Index>()) {
        let ts = mixed(seed);
        let nonempty: Vec<usize> = (0..ts.len()).filter(|&i| !ts[i].data.is_empty()).collect();
        let t = nonempty[which.index(nonempty.len())];
        let mut flipped = ts.clone();
        let b = bit.index(flipped[t].data.len() * 8);
        flipped[t].data[b / 8] ^= 1 << (b % 8);
        prop_assert_ne!(root(&flipped), root(&ts));
        prop_assert_eq!(root(&flipped).0, spec_root(&flipped));
    }
}

/// The worked example of `schemas/weights-root.md`: a tiny file and its digests, pinned, and
/// the document quotes the same values.
#[test]
fn worked_example() {
    let ts = example_tensors();
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &ts, u64::MAX);
    let ck = Checkpoint::open(dir.path().join("model.safetensors")).unwrap();
    let (digests, r) = driftless_format::weights_root(&ck.views());
    let views = ck.views();
    let by: std::collections::BTreeMap<&str, Digest> = views.iter().zip(&digests).map(|(v, d)| (v.name, *d)).collect();
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../schemas/weights-root.md")).unwrap();
    for (what, hex) in [("root", r.to_hex()), ("bias digest", by["bias"].to_hex()), ("w digest", by["w"].to_hex())] {
        println!("{what}: {hex}");
        assert!(doc.contains(&hex), "schemas/weights-root.md does not quote the {what} {hex}");
    }
    assert_eq!(r.to_hex(), EXAMPLE_ROOT);
}

const EXAMPLE_ROOT: &str = include_str!("example_root.txt");

fn example_tensors() -> Vec<T> {
    // w: BF16 [2, 2] = [1.0, -2.0, -0.0, NaN(0x7fc1)]; bias: F32 [] = 0.5.
    vec![
        T::new("w", DType::BF16, &[2, 2], vec![0x80, 0x3f, 0x00, 0xc0, 0x00, 0x80, 0xc1, 0x7f]),
        T::new("bias", DType::F32, &[], 0.5f32.to_bits().to_le_bytes().to_vec()),
    ]
}

#[test]
fn tensor_view_new_checks_sizes() {
    assert!(TensorView::new("x", DType::F32, &[2], &[0; 8]).is_ok());
    assert!(TensorView::new("x", DType::F32, &[2], &[0; 7]).is_err());
    assert!(TensorView::new("", DType::F32, &[0], &[]).is_err());
    assert!(TensorView::new("x", DType::F64, &[u64::MAX, 2], &[]).is_err());
}
