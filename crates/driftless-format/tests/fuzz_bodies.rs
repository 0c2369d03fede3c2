//! Runs the bodies of the cargo-fuzz targets (`fuzz/src/lib.rs`) on stable over a few
//! thousand mutated valid inputs and random bytes each, so they are exercised on every
//! `cargo test` and cannot rot while nightly is not around.

mod common;

#[path = "../../../fuzz/src/lib.rs"]
mod fuzz_bodies;

use common::*;
use driftless_format::{ops, sign, Codec, DType, DeltaOptions, Keypair, Layout, ValueMode};
use rand::Rng;

const RUNS: usize = 3000;

/// Valid segments for the fuzz body's tensors, in every mode and codec.
fn segment_seeds() -> Vec<Vec<u8>> {
    let mut r = rng(3);
    let base: Vec<T> = fuzz_bodies::TENSORS
        .iter()
        .map(|(n, d, len)| {
            // The body fills its buffers with i*31; use the same base so ulp seeds apply cleanly.
            let data: Vec<u8> = (0..len * d.size()).map(|i| (i as u8).wrapping_mul(31)).collect();
            T::new(n, *d, &[*len as u64], data)
        })
        .collect();
    let mut seeds = vec![];
    for density in [0.05, 0.3, 1.0] {
        let target: Vec<T> = base.iter().map(|t| mutate(t, density, &mut r)).collect();
        for values in [ValueMode::Ulp, ValueMode::Overwrite] {
            for codec in [Codec::Raw, Codec::Zstd { level: 1 }] {
                for (segment_target, chunk_bytes) in [(1 << 20, 1 << 20), (40, 8)] {
                    let opts = DeltaOptions { values, codec, segment_target, chunk_bytes };
                    let layout = Layout::for_tensors(&metas(&target), u64::MAX).unwrap();
                    let (_, enc) = make(&base, &target, &layout, &opts);
                    seeds.extend(enc.segments.into_iter().map(|s| s.bytes));
                }
            }
        }
    }
    assert!(seeds.len() > 20);
    seeds
}

/// With `DRIFTLESS_FUZZ_CORPUS=DIR`, writes the seeds of target `name` to `DIR/name/` (the
/// layout of cargo-fuzz's corpus, `fuzz/corpus`), so a libFuzzer run starts from valid inputs
/// instead of empty ones: `DRIFTLESS_FUZZ_CORPUS=$PWD/fuzz/corpus cargo test -p
/// driftless-format --test fuzz_bodies`, then `cargo +nightly fuzz run NAME` in `fuzz/`.
fn dump(name: &str, seeds: &[Vec<u8>]) {
    let Some(dir) = std::env::var_os("DRIFTLESS_FUZZ_CORPUS") else { return };
    let dir = std::path::Path::new(&dir).join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for (i, s) in seeds.iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i:04}")), s).unwrap();
    }
}

fn run(body: fn(&[u8]), seeds: &[Vec<u8>], seed: u64) {
    let mut r = rng(seed);
    for s in seeds {
        body(s);
    }
    for i in 0..RUNS {
        let input = if i % 10 == 0 {
            let n = r.gen_range(0..200);
            (0..n).map(|_| r.gen()).collect()
        } else {
            mutate_bytes(&seeds[r.gen_range(0..seeds.len())], &mut r)
        };
        body(&input);
    }
}

#[test]
fn fuzz_decode_segment() {
    let seeds = segment_seeds();
    // Seeds must actually decode and apply, or the mutations explore nothing.
    for s in &seeds {
        driftless_format::delta::decode_segment(s, fuzz_bodies::MAX_RAW).expect("seed decodes");
    }
    dump("decode_segment", &seeds);
    run(fuzz_bodies::decode_segment, &seeds, 1);
}

fn manifest_seeds() -> Vec<Vec<u8>> {
    let mut r = rng(4);
    let base = vec![T::random("w", DType::BF16, &[64], &mut r), T::random("x", DType::F32, &[3], &mut r)];
    let target: Vec<T> = base.iter().map(|t| mutate(t, 0.2, &mut r)).collect();
    let layout = Layout::for_tensors(&metas(&target), 300).unwrap();
    let (m, _) = make(&base, &target, &layout, &DeltaOptions { segment_target: 64, ..Default::default() });
    let key = Keypair::from_seed(fuzz_bodies::TRUSTED_SEED);
    let mut docs: Vec<Vec<u8>> = vec![serde_json::to_vec(&m).unwrap()];
    docs.extend(other_documents(&m).into_iter().map(|v| serde_json::to_vec(&v).unwrap()));
    let mut seeds = docs.clone();
    // Structured mutations of the JSON documents, signed and unsigned.
    for d in &docs {
        let v: serde_json::Value = serde_json::from_slice(d).unwrap();
        for _ in 0..40 {
            let mv = serde_json::to_vec(&mutate_json(&v, &mut r)).unwrap();
            seeds.push(key.seal(&mv).unwrap());
            seeds.push(mv);
        }
        seeds.push(key.seal(d).unwrap());
        seeds.push(sign::seal_unsigned(d).unwrap());
        seeds.push(Keypair::from_seed([9; 32]).seal(d).unwrap());
    }
    seeds
}

/// Anchor manifest, stream descriptor, ready marker and latest hint consistent with `m`.
pub fn other_documents(m: &driftless_format::DeltaManifest) -> Vec<serde_json::Value> {
    use serde_json::json;
    let sizes = m.layout().shard_sizes().unwrap();
    let objects: Vec<_> = m
        .shards
        .iter()
        .zip(sizes)
        .enumerate()
        .map(|(i, (s, n))| json!({"file": s.file, "object": format!("shard-{i:05}.dla"), "size": 10, "sha256": m.result_root, "decoded_size": n, "decoded_sha256": m.base_root}))
        .collect();
    vec![
        json!({"kind": "anchor", "version": 3, "stream_id": "s", "step": 2, "weights_root": m.result_root, "encoding": "planes_zstd",
               "shards": m.shards, "objects": objects, "files": [{"object": "config.json", "size": 3, "sha256": m.base_root}], "created_at_ms": 1}),
        json!({"kind": "stream", "version": 3, "stream_id": "s", "trusted_keys": ["ed25519:00112233445566778899aabbccddeeff"], "created_at_ms": 5}),
        json!({"kind": "ready", "stream_id": "s", "of": "delta", "step": 2, "base_step": 1, "manifest_sha256": m.base_root, "payload_bytes": 99}),
        json!({"kind": "latest", "stream_id": "s", "delta": 2, "anchor": null, "updated_at_ms": 7}),
    ]
}

#[test]
fn fuzz_manifest() {
    let seeds = manifest_seeds();
    let trust = driftless_format::TrustSet::new().with_key(Keypair::from_seed(fuzz_bodies::TRUSTED_SEED).public());
    let ok = seeds.iter().filter(|s| trust.open(s).is_ok()).count();
    assert!(ok > 10, "too few seeds open: {ok}");
    dump("manifest", &seeds);
    run(fuzz_bodies::manifest, &seeds, 2);
}

#[test]
fn fuzz_anchor_decode() {
    let (file, _) = safetensors_file(5);
    let mut seeds = vec![file.clone()];
    for level in [1, 3] {
        seeds.push(driftless_format::anchor::encode_shard(&file, level).unwrap());
    }
    // A smaller file too, so mutations reach every part of the table.
    let small = vec![T::random("a", DType::F16, &[3], &mut rng(1)), T::random("b", DType::U8, &[2], &mut rng(2))];
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &small, u64::MAX);
    let sbytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    seeds.push(driftless_format::anchor::encode_shard(&sbytes, 1).unwrap());
    seeds.push(sbytes);
    dump("anchor_decode", &seeds);
    run(fuzz_bodies::anchor_decode, &seeds, 3);
    let _ = ops::segment_object_name(0);
}
