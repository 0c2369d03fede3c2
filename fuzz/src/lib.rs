//! Bodies of the fuzz targets. Each takes arbitrary bytes, must never panic on them, and
//! panics (an assertion) when a decoder breaks one of its promises: errors of the wrong kind,
//! writes outside the ranges it was given, or output that its own encoder cannot reproduce.
//!
//! The same functions run on stable in `crates/driftless-format/tests/fuzz_bodies.rs`, which
//! includes this file by path, so keep it free of anything but `driftless_format` and `std`.

use driftless_format::{
    anchor, delta, sign, AnchorManifest, DType, DeltaManifest, ErrorKind, Keypair, LatestHint, ReadyMarker,
    StreamDescriptor, TensorsMut, TrustSet,
};

/// The tensors `decode_segment` applies onto: (name, dtype, elements). Short names so a fuzzer
/// finds them.
pub const TENSORS: [(&str, DType, usize); 5] =
    [("a", DType::F32, 16), ("b", DType::BF16, 33), ("c", DType::U8, 7), ("d", DType::F64, 3), ("e", DType::I16, 0)];

/// Bytes written around each tensor buffer; they must be untouched afterwards.
const GUARD: usize = 16;
const GUARD_BYTE: u8 = 0xA5;

/// Decoded-size bound passed to `decode_segment` (the manifest's `raw_size` in production).
pub const MAX_RAW: u64 = 1 << 20;

/// Seed for the key `manifest` trusts; tests sign valid inputs with it.
pub const TRUSTED_SEED: [u8; 32] = [7; 32];

/// Decode a segment and apply it onto small tensors; also build its redo record.
pub fn decode_segment(data: &[u8]) {
    let seg = match delta::decode_segment(data, MAX_RAW) {
        Ok(s) => s,
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::Corrupt, "decode error of the wrong kind: {e}");
            return;
        }
    };
    let mut bufs: Vec<Vec<u8>> = TENSORS.iter().map(|(_, d, n)| vec![GUARD_BYTE; 2 * GUARD + n * d.size()]).collect();
    let mut before = Vec::new();
    {
        let mut tm = TensorsMut::new();
        for (b, (name, d, n)) in bufs.iter_mut().zip(TENSORS.iter()) {
            let len = n * d.size();
            for (i, x) in b[GUARD..GUARD + len].iter_mut().enumerate() {
                *x = (i as u8).wrapping_mul(31);
            }
            tm.insert(name, *d, &mut b[GUARD..GUARD + len]);
        }
        // Redo record first (it reads the untouched base), as the journaled applier does.
        match delta::to_redo(&seg, &tm) {
            Ok(redo) => {
                let r = delta::decode_segment(&redo, redo.len() as u64).expect("a redo record made by to_redo decodes");
                assert_eq!(r.entries.len(), seg.entries.len());
                before.push(redo);
            }
            Err(e) => assert_eq!(e.kind(), ErrorKind::Corrupt, "to_redo error of the wrong kind: {e}"),
        }
        if let Err(e) = delta::apply_segment(&seg, &tm) {
            assert_eq!(e.kind(), ErrorKind::Corrupt, "apply error of the wrong kind: {e}");
        }
        for (name, d, n) in TENSORS.iter() {
            assert_eq!(tm.info(name), Some((*d, n * d.size())));
        }
    }
    for (b, (name, d, n)) in bufs.iter().zip(TENSORS.iter()) {
        assert_eq!(b.len(), 2 * GUARD + n * d.size());
        assert!(
            b[..GUARD].iter().chain(&b[b.len() - GUARD..]).all(|&x| x == GUARD_BYTE),
            "write outside tensor {name}"
        );
    }
}

/// Parse bytes as every JSON document of a stream and as a signed envelope.
pub fn manifest(data: &[u8]) {
    parse_all(data);
    let trust = TrustSet::new().with_key(Keypair::from_seed(TRUSTED_SEED).public());
    for t in [trust.clone(), trust.allow_unsigned(true)] {
        match t.open(data) {
            Ok((payload, signer)) => {
                assert!(signer.is_some() || t.allows_unsigned());
                parse_all(&payload);
            }
            Err(e) => assert!(
                matches!(e.kind(), ErrorKind::Corrupt | ErrorKind::Untrusted),
                "envelope error of the wrong kind: {e}"
            ),
        }
    }
    let _ = sign::seal_unsigned(data);
}

fn parse_all(data: &[u8]) {
    fn kind_ok<T>(r: &driftless_format::Result<T>) {
        if let Err(e) = r {
            assert_eq!(e.kind(), ErrorKind::Corrupt, "manifest error of the wrong kind: {e}");
        }
    }
    let d = DeltaManifest::from_slice(data);
    kind_ok(&d);
    if let Ok(m) = d {
        // What the agent does next with an accepted manifest must not panic either.
        m.layout().validate().expect("a validated manifest has a valid layout");
        let _ = m.payload_bytes();
        let _ = m.layout().shard_sizes();
        let _ = driftless_format::ops::needs_rewrite(&m.layout(), &m);
    }
    let a = AnchorManifest::from_slice(data);
    kind_ok(&a);
    if let Ok(m) = a {
        m.layout().validate().expect("a validated manifest has a valid layout");
        let _ = m.payload_bytes();
        let _ = m.layout().shard_sizes();
    }
    kind_ok(&StreamDescriptor::from_slice(data));
    kind_ok(&ReadyMarker::from_slice(data));
    kind_ok(&LatestHint::from_slice(data));
}

/// Decode an anchor shard into a buffer of its declared size (bounded); and when the input is
/// itself a safetensors file, check encode then decode gives it back.
pub fn anchor_decode(data: &[u8]) {
    let declared = data.get(8..16).map(|b| u64::from_le_bytes(b.try_into().expect("8"))).unwrap_or(0);
    let size = if declared <= 1 << 20 { declared as usize } else { data.len() };
    let mut out = vec![0u8; size];
    if let Err(e) = anchor::decode_shard(data, &mut out) {
        assert_eq!(e.kind(), ErrorKind::Corrupt, "anchor error of the wrong kind: {e}");
    }
    assert_eq!(out.len(), size);
    if let Ok(enc) = anchor::encode_shard(data, 1) {
        let mut back = vec![0u8; data.len()];
        anchor::decode_shard(&enc, &mut back).expect("an encoded shard decodes");
        assert!(back == data, "anchor round trip changed the bytes");
    }
}
