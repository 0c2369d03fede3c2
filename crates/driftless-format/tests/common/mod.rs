//! Helpers shared by the integration tests: owned tensors, special bit patterns, change
//! generators and the end-to-end round trip check. Everything compares bytes, never floats.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;

use driftless_format::{
    checkpoint, ops, Checkpoint, CheckpointMut, DType, DeltaManifest, DeltaOptions, Digest, Layout, TensorMeta,
    TensorView, TensorsMut,
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
            0x0000_0000,
            0xFFFF_FFFF,
            0x8000_0000,
            0x7FC0_0001,
            0xFFC0_1234,
            0x7F80_0001,
            0xFF80_0001,
            0x7F80_0000,
            0xFF80_0000,
            0x0000_0001,
            0x807F_FFFF,
        ],
        _ => vec![
            0,
            u64::MAX,
            0x8000_0000_0000_0000,
            0x7FF8_0000_0000_0001,
            0xFFF8_0000_DEAD_BEEF,
            0x7FF0_0000_0000_0001,
            0x7FF0_0000_0000_0000,
            0xFFF0_0000_0000_0000,
            1,
            0x800F_FFFF_FFFF_FFFF,
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
            panic!(
                "{ctx}: {name}: bytes differ (lengths {} vs {}, first differing byte {first:?})",
                gb.len(),
                wb.len()
            );
        }
    }
}

pub fn root(ts: &[T]) -> Digest {
    driftless_format::weights_root(&views(ts)).1
}

/// Makes a delta from `base` to `target` (result layout `layout`).
pub fn make(
    base: &[T],
    target: &[T],
    layout: &Layout,
    opts: &DeltaOptions,
) -> (DeltaManifest, driftless_format::delta::EncodedDelta) {
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
        let r =
            ops::apply_rewrite(&ck.views(), &m, &segs, &out).unwrap_or_else(|e| panic!("{ctx}: apply_rewrite: {e}"));
        assert_eq!(r, m.result_root, "{ctx}: rewrite root");
        let res = Checkpoint::open(&out).unwrap();
        assert_same_tensors(&res.views(), target, &format!("{ctx} (rewrite)"));
        assert_eq!(&res.layout(), target_layout, "{ctx}: rewrite layout");
        assert!(!ops::needs_rewrite(&res.layout(), &m));
    }

    if same_layout {
        check_undo(base, target, &m, &segs, ctx);
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

/// Applies `m` onto host copies of `base` with what takes it back out saved, checks the result
/// is `target`, takes it back out and checks the copies are `base` again, bit for bit; and, when
/// the delta writes over bytes that must be saved, that a budget too small says so.
pub fn check_undo(base: &[T], target: &[T], m: &DeltaManifest, segs: &[&[u8]], ctx: &str) {
    let mut bufs: Vec<Vec<u8>> = base.iter().map(|t| t.data.clone()).collect();
    let set = |bufs: &mut [Vec<u8>], f: &mut dyn FnMut(&TensorsMut<'_>)| {
        let mut tm = TensorsMut::new();
        for (t, b) in base.iter().zip(bufs.iter_mut()) {
            tm.insert(&t.name, t.dtype, b);
        }
        f(&tm)
    };
    let mut budget = u64::MAX;
    let mut undo = None;
    set(&mut bufs, &mut |tm| {
        undo = ops::Applier::new(tm, m, None)
            .apply_all_undoable(segs, &mut budget)
            .unwrap_or_else(|e| panic!("{ctx}: apply_all_undoable: {e}"));
    });
    let undo = undo.unwrap_or_else(|| panic!("{ctx}: an unbounded budget must give an undo"));
    let want: BTreeMap<&str, &[u8]> = target.iter().map(|t| (t.name.as_str(), &t.data[..])).collect();
    for (t, b) in base.iter().zip(&bufs) {
        assert!(want[t.name.as_str()] == &b[..], "{ctx}: undoable apply of {} differs from the target", t.name);
    }
    let saved = u64::MAX - budget;
    set(&mut bufs, &mut |tm| ops::undo(tm, m, segs, &undo).unwrap_or_else(|e| panic!("{ctx}: undo: {e}")));
    for (t, b) in base.iter().zip(&bufs) {
        assert!(t.data == *b, "{ctx}: {} is not the base again after the undo", t.name);
    }
    if saved > 0 {
        let mut budget = saved - 1;
        let mut bufs: Vec<Vec<u8>> = base.iter().map(|t| t.data.clone()).collect();
        set(&mut bufs, &mut |tm| {
            let u = ops::Applier::new(tm, m, None).apply_all_undoable(segs, &mut budget).unwrap();
            assert!(u.is_none(), "{ctx}: {saved} bytes to save cannot fit in {}", saved - 1);
        });
        for (t, b) in base.iter().zip(&bufs) {
            assert!(want[t.name.as_str()] == &b[..], "{ctx}: an apply past the undo budget is still applied");
        }
    }
}

/// Writes tensors into a directory with `Layout::for_tensors(.., shard)`.
pub fn write(dir: &Path, ts: &[T], shard: u64) -> Layout {
    let l = Layout::for_tensors(&metas(ts), shard).unwrap();
    checkpoint::write_checkpoint(dir, &l, &views(ts)).unwrap();
    l
}

// ---------------------------------------------------------------------------------------------
// Hostile input helpers.

/// Mutates bytes: bit flips, random bytes, truncation, insertion, deletion, interesting u64s.
pub fn mutate_bytes(seed: &[u8], r: &mut Rng64) -> Vec<u8> {
    let mut b = seed.to_vec();
    for _ in 0..r.gen_range(1..=4) {
        match r.gen_range(0..7) {
            0 if !b.is_empty() => {
                let i = r.gen_range(0..b.len());
                b[i] ^= 1 << r.gen_range(0..8);
            }
            1 if !b.is_empty() => {
                let i = r.gen_range(0..b.len());
                b[i] = r.gen();
            }
            2 => {
                let l = r.gen_range(0..=b.len());
                b.truncate(l);
            }
            3 => {
                let i = r.gen_range(0..=b.len());
                b.insert(i, r.gen());
            }
            4 if !b.is_empty() => {
                let i = r.gen_range(0..b.len());
                b.remove(i);
            }
            5 if b.len() >= 8 => {
                let i = r.gen_range(0..=b.len() - 8);
                let v: u64 = [0, 1, 0x7f, 0xff, u64::MAX, 1 << 31, 1 << 63, r.gen()][r.gen_range(0..8)];
                b[i..i + 8].copy_from_slice(&v.to_le_bytes());
            }
            _ if !b.is_empty() => {
                // Small varint-ish values are what the headers are made of.
                let i = r.gen_range(0..b.len());
                b[i] = r.gen_range(0..4);
            }
            _ => {}
        }
    }
    b
}

/// Mutates one random node of a JSON document into something hostile.
pub fn mutate_json(v: &serde_json::Value, r: &mut Rng64) -> serde_json::Value {
    use serde_json::{json, Value};
    let mut v = v.clone();
    fn nodes(v: &Value, path: Vec<String>, out: &mut Vec<Vec<String>>) {
        out.push(path.clone());
        match v {
            Value::Object(m) => m.iter().for_each(|(k, c)| {
                let mut p = path.clone();
                p.push(k.clone());
                nodes(c, p, out)
            }),
            Value::Array(a) => a.iter().enumerate().for_each(|(i, c)| {
                let mut p = path.clone();
                p.push(i.to_string());
                nodes(c, p, out)
            }),
            _ => {}
        }
    }
    let mut all = vec![];
    nodes(&v, vec![], &mut all);
    let path = all[r.gen_range(0..all.len())].clone();
    let hostile = [
        json!(null),
        json!(-1),
        json!(u64::MAX),
        json!(1u64 << 46),
        json!(1.5),
        json!(""),
        json!("../../etc/passwd"),
        json!(".hidden"),
        json!("a/b"),
        json!("ABCDEF0123456789ABCDEF0123456789ABCDEF0123456789ABCDEF0123456789"),
        json!("x\u{0}y"),
        json!([]),
        json!({}),
        json!("zstd"),
        json!({"name": "zstd", "level": 1}),
        json!("BF16"),
        json!([u64::MAX, u64::MAX]),
    ];
    let mut cur = &mut v;
    for (i, k) in path.iter().enumerate() {
        let last = i + 1 == path.len();
        match cur {
            Value::Object(m) if last && r.gen_bool(0.2) => {
                m.remove(k);
                return v;
            }
            Value::Array(a) if last && r.gen_bool(0.3) => {
                let idx: usize = k.parse().unwrap();
                let dup = a[idx].clone();
                a.push(dup);
                return v;
            }
            Value::Object(m) => cur = m.get_mut(k).unwrap(),
            Value::Array(a) => cur = &mut a[k.parse::<usize>().unwrap()],
            _ => unreachable!(),
        }
    }
    *cur = hostile[r.gen_range(0..hostile.len())].clone();
    v
}

/// One hand-made segment entry (see the format in `delta.rs`).
pub struct E<'a> {
    pub name: &'a str,
    pub dense: bool,
    pub dtype: DType,
    pub start: u64,
    pub len: u64,
    pub count: u64,
    pub pos: Vec<u8>,
    pub vals: Vec<u8>,
}

/// Writes a raw-codec segment from hand-made entries; `mode` 0 overwrite, 1 ulp.
pub fn raw_segment(mode: u8, entries: &[E<'_>]) -> Vec<u8> {
    use driftless_format::varint::put;
    let (mut h, mut p, mut vals) = (vec![], vec![], vec![]);
    for e in entries {
        put(&mut h, e.name.len() as u64);
        h.extend_from_slice(e.name.as_bytes());
        h.push(e.dense as u8);
        h.push(DType::ALL.iter().position(|d| *d == e.dtype).unwrap() as u8);
        for x in [e.start, e.len, e.count, e.pos.len() as u64, e.vals.len() as u64] {
            put(&mut h, x);
        }
        p.extend_from_slice(&e.pos);
        vals.extend_from_slice(&e.vals);
    }
    let mut out = b"DLS1".to_vec();
    out.extend_from_slice(&[1, 0, mode, 0]);
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for b in [&h, &p, &vals] {
        out.extend_from_slice(&(b.len() as u64).to_le_bytes());
        out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    }
    for b in [h, p, vals] {
        out.extend_from_slice(&b);
    }
    out
}

/// A safetensors file of mixed dtypes written by the `safetensors` crate itself (not by us).
pub fn safetensors_file(seed: u64) -> (Vec<u8>, Vec<T>) {
    let mut r = rng(seed);
    let ts = vec![
        T::random("model.embed.weight", DType::BF16, &[64, 48], &mut r),
        T::random("model.norm.weight", DType::F32, &[48], &mut r),
        T::random("model.f16", DType::F16, &[3, 5, 7], &mut r),
        T::random("model.f64", DType::F64, &[9], &mut r),
        T::random("model.fp8a", DType::F8_E4M3, &[33], &mut r),
        T::random("model.fp8b", DType::F8_E5M2, &[31], &mut r),
        T::random("model.mask", DType::BOOL, &[13], &mut r),
        T::random("model.i8", DType::I8, &[5], &mut r),
        T::random("model.u8", DType::U8, &[5], &mut r),
        T::random("model.i16", DType::I16, &[5], &mut r),
        T::random("model.u16", DType::U16, &[5], &mut r),
        T::random("model.i32", DType::I32, &[5], &mut r),
        T::random("model.u32", DType::U32, &[5], &mut r),
        T::random("model.i64", DType::I64, &[2, 2], &mut r),
        T::random("model.u64", DType::U64, &[3], &mut r),
        T::random("model.scalar", DType::F32, &[], &mut r),
        T::random("model.empty", DType::BF16, &[0, 4], &mut r),
    ];
    let st: Vec<(String, safetensors::tensor::TensorView<'_>)> = ts
        .iter()
        .map(|t| {
            let d: safetensors::Dtype = serde_json::from_value(serde_json::json!(t.dtype.as_str())).unwrap();
            let shape: Vec<usize> = t.shape.iter().map(|&x| x as usize).collect();
            (t.name.clone(), safetensors::tensor::TensorView::new(d, shape, &t.data).unwrap())
        })
        .collect();
    let md = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors::serialize(st, Some(md)).unwrap();
    (bytes, ts)
}
