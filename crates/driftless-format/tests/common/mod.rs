//! Helpers shared by the integration tests: owned tensors, special bit patterns, change
//! generators and the end-to-end round trip check. Everything compares bytes, never floats.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;

use driftless_format::{
    checkpoint, ops, Checkpoint, CheckpointMut, DType, DeltaManifest, DeltaOptions, Digest, Layout, TensorMeta,
    TensorView,
};
use rand::{Rng, SeedableRng};

pub type Rng64 = rand::rngs::StdRng;

pub fn rng(seed: u64) -> Rng64 {
    Rng64::seed_from_u64(seed)
}

/// An owned tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct T {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

impl T {
    pub fn new(name: &str, dtype: DType, shape: &[u64], data: Vec<u8>) -> Self {
        let n: u64 = shape.iter().product();
        assert_eq!(data.len() as u64, n * dtype.size() as u64, "test tensor {name} has the wrong size");
        T { name: name.into(), dtype, shape: shape.to_vec(), data }
    }
    pub fn random(name: &str, dtype: DType, shape: &[u64], r: &mut Rng64) -> Self {
        let n: u64 = shape.iter().product();
        let mut data = vec![0u8; n as usize * dtype.size()];
        r.fill(&mut data[..]);
        // Sprinkle special patterns.
        let pats = special_patterns(dtype);
        let w = dtype.size();
        for (i, cell) in data.chunks_exact_mut(w).enumerate() {
            if i % 5 == 0 {
                cell.copy_from_slice(&pats[(i / 5) % pats.len()]);
            }
        }
        T::new(name, dtype, shape, data)
    }
    pub fn view(&self) -> TensorView<'_> {
        TensorView { name: &self.name, dtype: self.dtype, shape: &self.shape, data: &self.data }
    }
    pub fn meta(&self) -> TensorMeta {
        TensorMeta { name: self.name.clone(), dtype: self.dtype, shape: self.shape.clone() }
    }
    pub fn numel(&self) -> usize {
        self.data.len() / self.dtype.size()
    }
}

pub fn views(ts: &[T]) -> Vec<TensorView<'_>> {
    ts.iter().map(T::view).collect()
}

pub fn metas(ts: &[T]) -> Vec<TensorMeta> {
    ts.iter().map(T::meta).collect()
}

/// Bit patterns that must survive verbatim: NaN payloads (quiet and signalling, both signs),
/// -0.0, +-inf, subnormals, all ones, zero, for every width.
pub fn special_patterns(dtype: DType) -> Vec<Vec<u8>> {
    let v: Vec<u64> = match dtype.size() {
        1 => vec![0x00, 0xFF, 0x80, 0x7F, 0x01, 0x7C, 0xFC, 0x7E, 0xFD, 0x04, 0x84],
        2 => vec![
            0x0000, 0xFFFF, 0x8000, // zero, all ones (NaN), -0.0
            0x7E01, 0xFE01, 0x7C01, // F16 NaN payloads (quiet, quiet neg, signalling)
            0x7C00, 0xFC00, 0x0001, 0x83FF, // F16 +-inf, subnormals
            0x7FC1, 0xFF81, 0x7F81, // BF16 NaN payloads
            0x7F80, 0xFF80, 0x007F, 0x8001, // BF16 +-inf, subnormals
        ],
        4 => vec![
            0x0000_0000, 0xFFFF_FFFF, 0x8000_0000,
            0x7FC0_0001, 0xFFC0_1234, 0x7F80_0001, 0xFF80_0001,
            0x7F80_0000, 0xFF80_0000, 0x0000_0001, 0x807F_FFFF,
        ],
        _ => vec![
            0, u64::MAX, 0x8000_0000_0000_0000,
            0x7FF8_0000_0000_0001, 0xFFF8_0000_DEAD_BEEF, 0x7FF0_0000_0000_0001,
            0x7FF0_0000_0000_0000, 0xFFF0_0000_0000_0000, 1, 0x800F_FFFF_FFFF_FFFF,
        ],
    };
    v.into_iter().map(|x| x.to_le_bytes()[..dtype.size()].to_vec()).collect()
}

/// A copy of `t` with `ceil(density * numel)` elements changed (distinct positions): a mix of
/// +-1 ulp (with wrap-around), special patterns and random bits.
pub fn mutate(t: &T, density: f64, r: &mut Rng64) -> T {
    let n = t.numel();
    let k = ((density * n as f64).ceil() as usize).min(n);
    let mut idx: Vec<usize> = rand::seq::index::sample(r, n, k).into_vec();
    idx.sort_unstable();
    let w = t.dtype.size();
    let pats = special_patterns(t.dtype);
    let mut out = t.clone();
    for i in idx {
        let cell = &mut out.data[i * w..(i + 1) * w];
        let old = cell.to_vec();
        loop {
            match r.gen_range(0..4) {
                0 | 1 => {
                    let mut b = [0u8; 8];
                    b[..w].copy_from_slice(&old);
                    let x = u64::from_le_bytes(b);
                    let y = if r.gen() { x.wrapping_add(1) } else { x.wrapping_sub(1) };
                    cell.copy_from_slice(&y.to_le_bytes()[..w]);
                }
                2 => cell.copy_from_slice(&pats[r.gen_range(0..pats.len())]),
                _ => r.fill(&mut cell[..]),
            }
            if cell != &old[..] {
                break;
            }
        }
    }
    out
}

/// Tensors by name, for comparing results independent of order.
pub fn by_name<'a>(vs: &[TensorView<'a>]) -> BTreeMap<String, (DType, Vec<u64>, Vec<u8>)> {
    vs.iter().map(|v| (v.name.to_string(), (v.dtype, v.shape.to_vec(), v.data.to_vec()))).collect()
}

pub fn assert_same_tensors(got: &[TensorView<'_>], want: &[T], ctx: &str) {
    let g = by_name(got);
    let w = by_name(&views(want));
    assert_eq!(g.keys().collect::<Vec<_>>(), w.keys().collect::<Vec<_>>(), "{ctx}: tensor names differ");
    for (name, (gd, gs, gb)) in &g {
        let (wd, ws, wb) = &w[name];
        assert_eq!((gd, gs), (wd, ws), "{ctx}: {name} dtype/shape");
        if gb != wb {
            let first = gb.iter().zip(wb).position(|(a, b)| a != b);
            panic!("{ctx}: {name}: bytes differ (lengths {} vs {}, first differing byte {first:?})", gb.len(), wb.len());
        }
    }
}

pub fn root(ts: &[T]) -> Digest {
    driftless_format::weights_root(&views(ts)).1
}

/// Makes a delta from `base` to `target` (result layout `layout`).
pub fn make(base: &[T], target: &[T], layout: &Layout, opts: &DeltaOptions) -> (DeltaManifest, driftless_format::delta::EncodedDelta) {
    let spec = ops::DeltaSpec { stream_id: "test-stream", step: 2, base_step: 1, base_root: None, layout };
    ops::make_delta(spec, &views(base), &views(target), opts).expect("make_delta")
}

/// End to end: make the delta, check the manifest roots, then apply it in place (when the
/// layouts agree) on a checkpoint written to disk, and by rewrite, comparing every byte with
/// the target. Returns the manifest.
pub fn roundtrip(
    base: &[T],
    base_layout: &Layout,
    target: &[T],
    target_layout: &Layout,
    opts: &DeltaOptions,
    ctx: &str,
) -> (DeltaManifest, driftless_format::delta::EncodedDelta) {
    let (m, enc) = make(base, target, target_layout, opts);
    assert_eq!(m.base_root, root(base), "{ctx}: base root");
    assert_eq!(m.result_root, root(target), "{ctx}: result root");
    assert_eq!(m.segments.len(), enc.segments.len());
    assert_eq!(enc.stats.payload_bytes, enc.segments.iter().map(|s| s.bytes.len() as u64).sum::<u64>());
    let segs: Vec<&[u8]> = enc.segments.iter().map(|s| &s.bytes[..]).collect();
    let dir = tempfile::tempdir().unwrap();
    let bdir = dir.path().join("base");
    checkpoint::write_checkpoint(&bdir, base_layout, &views(base)).expect("write base");
    let on_disk = Checkpoint::open(&bdir).expect("open base");
    assert_eq!(&on_disk.layout(), base_layout, "{ctx}: layout read back differs from the layout written");
    let same_layout = base_layout == target_layout;
    assert_eq!(ops::needs_rewrite(&on_disk.layout(), &m), !same_layout, "{ctx}: needs_rewrite");
    drop(on_disk);

    // Rewrite into a fresh directory.
    {
        let ck = Checkpoint::open(&bdir).unwrap();
        let out = dir.path().join("rewrite");
        let r = ops::apply_rewrite(&ck.views(), &m, &segs, &out).unwrap_or_else(|e| panic!("{ctx}: apply_rewrite: {e}"));
        assert_eq!(r, m.result_root, "{ctx}: rewrite root");
        let res = Checkpoint::open(&out).unwrap();
        assert_same_tensors(&res.views(), target, &format!("{ctx} (rewrite)"));
        assert_eq!(&res.layout(), target_layout, "{ctx}: rewrite layout");
        assert!(!ops::needs_rewrite(&res.layout(), &m));
    }

    if same_layout {
        let journal = dir.path().join("journal");
        let mut ck = CheckpointMut::open(&bdir).unwrap();
        let r = ops::apply_in_place(&mut ck, &m, Digest::of(b"envelope"), m.base_root, &segs, Some(&journal))
            .unwrap_or_else(|e| panic!("{ctx}: apply_in_place: {e}"));
        assert_eq!(r, m.result_root);
        drop(ck);
        assert!(!journal.exists(), "{ctx}: journal left behind after a verified apply");
        let res = Checkpoint::open(&bdir).unwrap();
        assert_same_tensors(&res.views(), target, &format!("{ctx} (in place)"));
        // Applying the same delta again must be refused: the base root no longer matches.
        let mut ck = CheckpointMut::open(&bdir).unwrap();
        let now = driftless_format::weights_root(&ck.views()).1;
        if now != m.base_root {
            let e = ops::apply_in_place(&mut ck, &m, Digest::of(b"envelope"), now, &segs, None).unwrap_err();
            assert_eq!(e.kind(), driftless_format::ErrorKind::WrongBase);
        }
    }
    (m, enc)
}

/// Writes tensors into a directory with `Layout::for_tensors(.., shard)`.
pub fn write(dir: &Path, ts: &[T], shard: u64) -> Layout {
    let l = Layout::for_tensors(&metas(ts), shard).unwrap();
    checkpoint::write_checkpoint(dir, &l, &views(ts)).unwrap();
    l
}
