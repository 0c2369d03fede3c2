//! The JSON Schemas in `schemas/` describe exactly what the code writes and reads: documents
//! produced by real code validate, hand-broken ones do not, and (for random structured
//! mutations) whatever the Rust parser accepts the schema accepts too.

mod common;

use common::*;
use driftless_format::manifest::{AnchorShardRef, ObjectRef};
use driftless_format::{
    anchor, sign, AnchorEncoding, AnchorManifest, Codec, DType, DeltaManifest, DeltaOptions, Digest, Keypair,
    LatestHint, Layout, ReadyMarker, StepKind, StreamDescriptor, ValueMode,
};
use serde_json::{json, Value};

fn schema(name: &str) -> jsonschema::Validator {
    let p = format!("{}/../../schemas/{name}.schema.json", env!("CARGO_MANIFEST_DIR"));
    let v: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    assert_eq!(v["$schema"], "https://json-schema.org/draft/2020-12/schema", "{name}");
    jsonschema::draft202012::new(&v).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn assert_valid(s: &jsonschema::Validator, doc: &Value, what: &str) {
    let errs: Vec<String> = s.iter_errors(doc).map(|e| format!("{} at {}", e, e.instance_path)).collect();
    assert!(errs.is_empty(), "{what}: valid document rejected: {errs:#?}\n{doc:#}");
}

fn assert_invalid(s: &jsonschema::Validator, doc: &Value, what: &str) {
    assert!(!s.is_valid(doc), "{what}: invalid document accepted");
}

fn deltas() -> Vec<DeltaManifest> {
    let mut r = rng(8);
    let base = vec![
        T::random("model.embed.weight", DType::BF16, &[32, 16], &mut r),
        T::random("model.norm.weight", DType::F32, &[16], &mut r),
        T::random("model.scalar", DType::F64, &[], &mut r),
    ];
    let mut target: Vec<T> = base.iter().map(|t| mutate(t, 0.1, &mut r)).collect();
    target.push(T::random("new.one", DType::F8_E5M2, &[0, 2], &mut r));
    let mut out = vec![];
    for (values, codec, shard) in
        [(ValueMode::Ulp, Codec::Zstd { level: 3 }, 600), (ValueMode::Overwrite, Codec::Raw, u64::MAX)]
    {
        let mut layout = Layout::for_tensors(&metas(&target), shard).unwrap();
        layout.shards[0].metadata = None;
        let (m, _) =
            make(&base, &target, &layout, &DeltaOptions { values, codec, segment_target: 100, chunk_bytes: 64 });
        assert!(!m.segments.is_empty());
        out.push(m);
    }
    out
}

fn anchors() -> Vec<AnchorManifest> {
    let (file, _) = safetensors_file(9);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("model.safetensors"), &file).unwrap();
    let ck = driftless_format::Checkpoint::open(dir.path()).unwrap();
    let (digests, root) = driftless_format::weights_root(&ck.views());
    let layout = ck.layout();
    let shards = driftless_format::manifest::shard_records(&layout, &digests).unwrap();
    [AnchorEncoding::PlanesZstd, AnchorEncoding::Safetensors]
        .into_iter()
        .map(|encoding| {
            let stored = match encoding {
                AnchorEncoding::PlanesZstd => anchor::encode_shard(&file, 1).unwrap(),
                _ => file.clone(),
            };
            AnchorManifest {
                kind: "anchor".into(),
                version: 3,
                stream_id: "stream-1".into(),
                step: 10,
                weights_root: root,
                encoding,
                shards: shards.clone(),
                objects: vec![AnchorShardRef {
                    file: "model.safetensors".into(),
                    object: ObjectRef {
                        object: "shard-00000.dla".into(),
                        size: stored.len() as u64,
                        sha256: Digest::of(&stored),
                    },
                    decoded_size: file.len() as u64,
                    decoded_sha256: Digest::of(&file),
                    parts: anchor::part_refs(&stored, file.len() as u64, encoding).unwrap(),
                }],
                files: if encoding == AnchorEncoding::Safetensors {
                    vec![]
                } else {
                    vec![ObjectRef { object: "config.json".into(), size: 2, sha256: Digest::of(b"{}") }]
                },
                created_at_ms: driftless_format::manifest::now_ms(),
            }
        })
        .collect()
}

fn others() -> (Vec<StreamDescriptor>, Vec<ReadyMarker>, Vec<LatestHint>) {
    let k = Keypair::from_seed([3; 32]);
    let s = StreamDescriptor {
        kind: "stream".into(),
        version: 3,
        stream_id: "stream-1".into(),
        trusted_keys: vec![k.id().into()],
        created_at_ms: 1,
    };
    let r1 = ReadyMarker {
        kind: "ready".into(),
        stream_id: "stream-1".into(),
        of: StepKind::Delta,
        step: 3,
        base_step: Some(2),
        manifest_sha256: Digest::of(b"m"),
        payload_bytes: 1234,
        // What a publisher writes (`g<generation>r<retry>-manifest.json`), and what a
        // `latest.json` then embeds: the schemas of both must take it.
        manifest: Some("g1r2-manifest.json".into()),
    };
    let r2 = ReadyMarker { of: StepKind::Anchor, base_step: None, manifest: None, ..r1.clone() };
    let l1 = LatestHint {
        kind: "latest".into(),
        stream_id: "stream-1".into(),
        delta: Some(3),
        anchor: None,
        updated_at_ms: 5,
        delta_marker: None,
        anchor_marker: None,
    };
    let l2 = LatestHint { delta: None, anchor: Some(0), ..l1.clone() };
    let r3 = ReadyMarker { step: 2, ..r2.clone() };
    let l3 = LatestHint { anchor: Some(2), delta_marker: Some(r1.clone()), anchor_marker: Some(r3), ..l1.clone() };
    (vec![s], vec![r1, r2], vec![l1, l2, l3])
}

/// Every document kind: (schema name, produced documents, the Rust parser).
type Parser = fn(&[u8]) -> bool;
fn all_docs() -> Vec<(&'static str, Vec<Value>, Parser)> {
    let (s, r, l) = others();
    let d: Vec<Value> = deltas().iter().map(|m| serde_json::to_value(m).unwrap()).collect();
    let k = Keypair::from_seed([3; 32]);
    let envs: Vec<Value> = vec![
        serde_json::from_slice(&k.seal(&serde_json::to_vec(&d[0]).unwrap()).unwrap()).unwrap(),
        serde_json::from_slice(&sign::seal_unsigned(b"{\"kind\":\"stream\"}").unwrap()).unwrap(),
    ];
    vec![
        ("delta-manifest", d, |b| DeltaManifest::from_slice(b).is_ok()),
        ("anchor-manifest", anchors().iter().map(|m| serde_json::to_value(m).unwrap()).collect(), |b| {
            AnchorManifest::from_slice(b).is_ok()
        }),
        ("stream", s.iter().map(|m| serde_json::to_value(m).unwrap()).collect(), |b| {
            StreamDescriptor::from_slice(b).is_ok()
        }),
        ("ready-marker", r.iter().map(|m| serde_json::to_value(m).unwrap()).collect(), |b| {
            ReadyMarker::from_slice(b).is_ok()
        }),
        ("latest", l.iter().map(|m| serde_json::to_value(m).unwrap()).collect(), |b| LatestHint::from_slice(b).is_ok()),
        ("envelope", envs, |b| serde_json::from_slice::<sign::Envelope>(b).is_ok()),
    ]
}

#[test]
fn produced_documents_validate() {
    for (name, docs, parse) in all_docs() {
        let s = schema(name);
        for d in &docs {
            assert_valid(&s, d, name);
            assert!(parse(&serde_json::to_vec(d).unwrap()), "{name}: the Rust parser rejects its own output");
        }
    }
}

fn broken(doc: &Value, f: impl Fn(&mut Value)) -> Value {
    let mut v = doc.clone();
    f(&mut v);
    v
}

#[test]
fn invalid_documents_are_rejected() {
    let s = schema("delta-manifest");
    let d = serde_json::to_value(&deltas()[0]).unwrap();
    let cases: Vec<(&str, Value)> = vec![
        (
            "missing field",
            broken(&d, |v| {
                v.as_object_mut().unwrap().remove("result_root");
            }),
        ),
        (
            "missing stats field",
            broken(&d, |v| {
                v["stats"].as_object_mut().unwrap().remove("changed");
            }),
        ),
        ("extra field", broken(&d, |v| v["surprise"] = json!(1))),
        ("kind", broken(&d, |v| v["kind"] = json!("anchor"))),
        ("version", broken(&d, |v| v["version"] = json!(1))),
        ("uppercase digest", broken(&d, |v| v["base_root"] = json!(v["base_root"].as_str().unwrap().to_uppercase()))),
        ("short digest", broken(&d, |v| v["base_root"] = json!("abcd"))),
        ("dtype", broken(&d, |v| v["shards"][0]["tensors"][0]["dtype"] = json!("bf16"))),
        ("zstd without level", broken(&d, |v| v["codec"] = json!({"name": "zstd"}))),
        ("raw with level", broken(&d, |v| v["codec"] = json!({"name": "raw", "level": 1}))),
        ("codec as string", broken(&d, |v| v["codec"] = json!("zstd"))),
        ("value mode case", broken(&d, |v| v["value_mode"] = json!("Ulp"))),
        ("negative step", broken(&d, |v| v["step"] = json!(-1))),
        ("fractional step", broken(&d, |v| v["step"] = json!(1.5))),
        ("path traversal", broken(&d, |v| v["segments"][0]["object"] = json!("../x"))),
        ("dot file", broken(&d, |v| v["segments"][0]["object"] = json!(".x"))),
        ("raw size", broken(&d, |v| v["segments"][0]["raw_size"] = json!(1u64 << 32))),
        ("entries over u32", broken(&d, |v| v["segments"][0]["entries"] = json!(1u64 << 32))),
        ("shard not safetensors", broken(&d, |v| v["shards"][0]["file"] = json!("model.bin"))),
        ("index as shard", broken(&d, |v| v["shards"][0]["file"] = json!("model.safetensors.index.json"))),
        ("empty tensor name", broken(&d, |v| v["shards"][0]["tensors"][0]["name"] = json!(""))),
        ("control char", broken(&d, |v| v["shards"][0]["tensors"][0]["name"] = json!("a\u{7}b"))),
        ("17 dims", broken(&d, |v| v["shards"][0]["tensors"][0]["shape"] = json!(vec![1; 17]))),
        ("metadata values", broken(&d, |v| v["shards"][0]["metadata"] = json!({"format": 1}))),
    ];
    for (what, doc) in &cases {
        assert_invalid(&s, doc, what);
        // The Rust parser agrees, except on extra fields (serde ignores them, also `level` on
        // `raw`) and uppercase hex
        // (accepted on read, never written).
        if !matches!(*what, "extra field" | "raw with level" | "uppercase digest") {
            assert!(DeltaManifest::from_slice(&serde_json::to_vec(doc).unwrap()).is_err(), "{what}: Rust accepts");
        }
    }
    let a = schema("anchor-manifest");
    let ad = serde_json::to_value(&anchors()[0]).unwrap();
    assert_invalid(&a, &broken(&ad, |v| v["encoding"] = json!("planes-zstd")), "encoding spelling");
    assert_invalid(&a, &broken(&ad, |v| v["objects"][0]["decoded_sha256"] = json!(null)), "null digest");
    assert_invalid(&a, &broken(&ad, |v| v["files"] = json!(null)), "files null");
    let r = schema("ready-marker");
    let rd = serde_json::to_value(&others().1[0]).unwrap();
    assert_invalid(&r, &broken(&rd, |v| v["of"] = json!("Delta")), "step kind");
    assert_invalid(&r, &broken(&rd, |v| v["kind"] = json!("latest")), "ready kind");
    let l = schema("latest");
    let ld = serde_json::to_value(&others().2[0]).unwrap();
    assert_invalid(&l, &broken(&ld, |v| v["delta"] = json!("3")), "latest delta string");
    let st = schema("stream");
    let sd = serde_json::to_value(&others().0[0]).unwrap();
    assert_invalid(&st, &broken(&sd, |v| v["trusted_keys"] = json!("ed25519:00")), "keys not a list");
    let e = schema("envelope");
    assert_invalid(&e, &json!({"payload": {}, "signatures": []}), "payload object");
    assert_invalid(&e, &json!({"payload": "x"}), "no signatures");
    assert_invalid(&e, &json!({"payload": "x", "signatures": [{"key_id": "k"}]}), "signature without sig");
}

/// Structured random mutations: whatever the Rust parser accepts, the schema accepts.
#[test]
fn schema_is_no_stricter_than_the_parser() {
    let mut r = rng(10);
    let mut rust_ok = 0;
    for (name, docs, parse) in all_docs() {
        let s = schema(name);
        for d in &docs {
            for _ in 0..300 {
                let m = mutate_json(d, &mut r);
                let text = serde_json::to_vec(&m).unwrap();
                // Uppercase hex digests: accepted on read, never written, so not in the schema.
                if String::from_utf8_lossy(&text).contains("ABCDEF0123") {
                    continue;
                }
                if parse(&text) {
                    rust_ok += 1;
                    assert_valid(&s, &m, &format!("{name} (mutation the Rust parser accepts)"));
                }
            }
        }
    }
    assert!(rust_ok > 100, "too few accepted mutations: {rust_ok}");
}
