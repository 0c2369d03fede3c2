//! Anchor shards: byte-exact round trips of real safetensors files, and damage detection.

mod common;

use common::*;
use driftless_format::{anchor, Checkpoint, DType, ErrorKind};
use proptest::prelude::*;

#[test]
fn roundtrip_file_written_by_safetensors_crate() {
    let (file, ts) = safetensors_file(1);
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.safetensors");
    std::fs::write(&p, &file).unwrap();
    // We read what the reference writer wrote...
    let ck = Checkpoint::open(&p).unwrap();
    assert_same_tensors(&ck.views(), &ts, "safetensors crate file");
    for level in [1, 3, 19] {
        let enc = anchor::encode_shard(&file, level).unwrap();
        let mut out = vec![0u8; file.len()];
        anchor::decode_shard(&enc, &mut out).unwrap();
        assert!(out == file, "level {level}: decoded bytes differ");
        println!("level {level}: {} -> {} bytes", file.len(), enc.len());
    }
}

/// A tensor longer than one 16 MiB chunk: the encoder splits it, and the decoders (which refuse
/// longer chunks) take every piece back.
#[test]
fn roundtrip_a_tensor_over_one_chunk() {
    let mut r = rng(3);
    let ts =
        vec![T::random("big", DType::U8, &[(16 << 20) + 4099], &mut r), T::random("tail", DType::BF16, &[7], &mut r)];
    let dir = tempfile::tempdir().unwrap();
    let layout = write(dir.path(), &ts, 64 << 20);
    let file = std::fs::read(dir.path().join(&layout.shards[0].file)).unwrap();
    let enc = anchor::encode_shard(&file, 1).unwrap();
    let mut out = vec![0u8; file.len()];
    anchor::decode_shard(&enc, &mut out).unwrap();
    assert!(out == file, "decoded bytes differ");
}

#[test]
fn roundtrip_our_files_with_odd_tensors() {
    // Zero-size tensor first, scalar, every dtype, and a data section larger than one chunk
    // would be with a small tensor in between.
    let mut r = rng(2);
    let mut ts = vec![T::random("z.first_empty", DType::BF16, &[0, 5], &mut r)];
    for (i, &d) in DType::ALL.iter().enumerate() {
        ts.push(T::random(&format!("t{i:02}"), d, &[3, (i as u64) + 1], &mut r));
    }
    ts.push(T::random("scalar", DType::F64, &[], &mut r));
    ts.push(T::random("zz.empty_last", DType::U8, &[0], &mut r));
    let dir = tempfile::tempdir().unwrap();
    let layout = write(dir.path(), &ts, 200);
    assert!(layout.shards.len() > 2);
    for s in &layout.shards {
        let file = std::fs::read(dir.path().join(&s.file)).unwrap();
        let enc = anchor::encode_shard(&file, 1).unwrap_or_else(|e| panic!("{}: {e}", s.file));
        let mut out = vec![0u8; file.len()];
        anchor::decode_shard(&enc, &mut out).unwrap();
        assert!(out == file, "{}", s.file);
    }
}

#[test]
fn damage_is_an_error() {
    let (file, _) = safetensors_file(3);
    let enc = anchor::encode_shard(&file, 1).unwrap();
    let mut out = vec![0u8; file.len()];
    // Wrong expected size.
    for n in [0, file.len() - 1, file.len() + 1] {
        let mut o = vec![0u8; n];
        assert_eq!(anchor::decode_shard(&enc, &mut o).unwrap_err().kind(), ErrorKind::Corrupt);
    }
    // Every truncation, and trailing bytes.
    for l in 0..enc.len() {
        assert_eq!(anchor::decode_shard(&enc[..l], &mut out).unwrap_err().kind(), ErrorKind::Corrupt, "cut {l}");
    }
    let mut longer = enc.clone();
    longer.push(0);
    assert_eq!(anchor::decode_shard(&longer, &mut out).unwrap_err().kind(), ErrorKind::Corrupt);
    // Targeted header damage: magic, version, sizes, chunk count, widths.
    let n = enc.len();
    // Magic, version, decoded size, header sizes; footer: table offset, chunk count, end magic;
    // the first chunk's width in the table.
    let first_width = u64::from_le_bytes(enc[n - 16..n - 8].try_into().unwrap()) as usize + 16;
    for (at, v) in [
        (0usize, b'X'),
        (4, 2),
        (8, 0xff),
        (16, 0xff),
        (24, 0xff),
        (n - 16, 0xff),
        (n - 12, 0xff),
        (n - 1, b'X'),
        (first_width, 3),
    ] {
        let mut b = enc.clone();
        b[at] = v;
        assert_eq!(anchor::decode_shard(&b, &mut out).unwrap_err().kind(), ErrorKind::Corrupt, "byte {at}");
    }
    // Not a safetensors file: encode refuses.
    assert!(anchor::encode_shard(b"not a safetensors file", 1).is_err());
    assert!(anchor::encode_shard(&file[..file.len() - 1], 1).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]
    /// Random damage never panics; an error is Corrupt; the output buffer keeps its size.
    #[test]
    fn prop_damage_never_panics(seed in any::<u64>()) {
        let (file, _) = safetensors_file(4);
        let enc = anchor::encode_shard(&file, 1).unwrap();
        let mut r = rng(seed);
        let bad = mutate_bytes(&enc, &mut r);
        let mut out = vec![0u8; file.len()];
        if let Err(e) = anchor::decode_shard(&bad, &mut out) {
            prop_assert_eq!(e.kind(), ErrorKind::Corrupt);
        }
        prop_assert_eq!(out.len(), file.len());
    }
}

/// What the agent's cold start does with ranged reads: footer, table, prefix, header, then
/// each chunk on its own, its planes decoded and interleaved a piece at a time (pieces of 1 to
/// 5 elements, in turn, and the rest of the chunk last). The result is the file, byte for byte.
fn stream_decode(enc: &[u8], decoded_size: u64) -> driftless_format::Result<Vec<u8>> {
    let size = enc.len() as u64;
    if size < 48 {
        return Err(driftless_format::Error::Corrupt { what: "anchor shard", detail: "truncated".into() });
    }
    let footer = &enc[(size - anchor::FOOTER_LEN) as usize..];
    let prefix = &enc[..anchor::PREFIX_LEN as usize];
    let (hr, header_len) = anchor::header_range(prefix, decoded_size, size)?;
    let hz = enc
        .get(hr.start as usize..hr.end as usize)
        .ok_or_else(|| driftless_format::Error::Corrupt { what: "anchor shard", detail: "truncated".into() })?;
    let mut out = vec![0u8; decoded_size as usize];
    anchor::decode_header(hz, &mut out[..header_len as usize])?;
    let cuts = anchor::shard_cuts(&out[..header_len as usize], decoded_size, None)?;
    let tr = anchor::table_range(prefix, &cuts, footer, size, decoded_size)?;
    let table = &enc[tr.start as usize..tr.end as usize];
    let plan = anchor::plan_shard(prefix, &cuts, table, footer, size, decoded_size)?;
    assert_eq!(plan.header, hr);
    let mut scratch = vec![];
    for c in &plan.chunks {
        let stored = &enc[c.stored.start as usize..c.stored.end as usize];
        let planes = anchor::decode_chunk_planes(c, stored, &mut scratch)?;
        let dst = &mut out[c.out.start as usize..c.out.end as usize];
        let (w, mut at) = (planes.width(), 0);
        for k in (1..=5).cycle() {
            let n = (k * w).min(planes.len() - at);
            planes.interleave(at, &mut dst[at..at + n]);
            at += n;
            if at == planes.len() {
                break;
            }
        }
    }
    Ok(out)
}

#[test]
fn streaming_decode_matches_the_file() {
    let (file, _) = safetensors_file(3);
    for level in [1, 3] {
        let enc = anchor::encode_shard(&file, level).unwrap();
        assert!(stream_decode(&enc, file.len() as u64).unwrap() == file, "level {level}");
        // Another expected size is refused.
        assert!(stream_decode(&enc, file.len() as u64 + 1).is_err());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Damaged shards read in parts: an error or (when the damage missed everything that
    /// matters) the same bytes as the whole-shard decoder; never a panic.
    #[test]
    fn streaming_decode_of_damaged_shards_never_panics(seed in any::<u64>()) {
        let (file, _) = safetensors_file(5);
        let enc = anchor::encode_shard(&file, 1).unwrap();
        let bad = mutate_bytes(&enc, &mut rng(seed));
        let streamed = stream_decode(&bad, file.len() as u64);
        let mut whole = vec![0u8; file.len()];
        let r = anchor::decode_shard(&bad, &mut whole);
        if let (Ok(s), Ok(())) = (&streamed, &r) {
            prop_assert!(*s == whole);
        }
    }
}

/// A streamed shard whose footer claims 500 million chunks of a 10 GiB object while its table
/// holds one entry: refused before anything is reserved for the claimed count (which would
/// ask for tens of GB and abort the agent).
#[test]
fn a_chunk_count_the_table_cannot_hold_is_refused_before_allocating() {
    let (file, _) = safetensors_file(3);
    let enc = anchor::encode_shard(&file, 1).unwrap();
    let stored = 10u64 << 30;
    let body_end = stored - anchor::FOOTER_LEN;
    let table = vec![0u8; 25];
    let mut footer = enc[enc.len() - anchor::FOOTER_LEN as usize..].to_vec();
    footer[..8].copy_from_slice(&(body_end - table.len() as u64).to_le_bytes());
    footer[8..12].copy_from_slice(&500_000_000u32.to_le_bytes());
    let prefix = &enc[..anchor::PREFIX_LEN as usize];
    let e = anchor::plan_shard(prefix, &cuts_of(&file), &table, &footer, stored, file.len() as u64).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(e.to_string().contains("chunk count"), "{e}");
}

/// Shards whose numbers an encoder never writes, each read before the object's SHA-256 can be
/// checked: refused from the prefix, footer and table (Corrupt, so the step is refused and a
/// reader takes another route), never turned into an empty or object-sized ranged read or a
/// plan of millions of chunks.
#[test]
fn shard_numbers_no_encoder_writes_are_refused_before_reading_more() {
    let (file, _) = safetensors_file(2);
    let enc = anchor::encode_shard(&file, 3).unwrap();
    let size = enc.len() as u64;
    let decoded = file.len() as u64;
    let footer = enc[enc.len() - anchor::FOOTER_LEN as usize..].to_vec();
    let prefix = enc[..anchor::PREFIX_LEN as usize].to_vec();
    let cuts = cuts_of(&file);
    let tr = anchor::table_range(&prefix, &cuts, &footer, size, decoded).unwrap();
    assert!(
        anchor::plan_shard(&prefix, &cuts, &enc[tr.start as usize..tr.end as usize], &footer, size, decoded).is_ok()
    );
    let corrupt = |r: driftless_format::Result<std::ops::Range<u64>>, what: &str| {
        let e = r.err().unwrap_or_else(|| panic!("{what}: accepted"));
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{what}: {e}");
    };
    let u64_at = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());

    // The compressed header said to be 0 bytes (its bytes moved into the first plane): an
    // empty ranged GET, which stores answer with an error that reads as transient.
    let mut p = prefix.clone();
    p[24..32].copy_from_slice(&0u64.to_le_bytes());
    corrupt(anchor::table_range(&p, &cuts, &footer, size, decoded), "empty header");
    // ... or larger than zstd makes the header.
    let mut p = prefix.clone();
    p[24..32].copy_from_slice(&(u64_at(&prefix, 16) * 2 + 1024).to_le_bytes());
    corrupt(anchor::table_range(&p, &cuts, &footer, size, decoded), "oversized header");

    // The table said to start right after the prefix: nearly the whole object fetched as a
    // table.
    let mut f = footer.clone();
    f[..8].copy_from_slice(&anchor::PREFIX_LEN.to_le_bytes());
    corrupt(anchor::table_range(&prefix, &cuts, &f, size, decoded), "object-sized table");

    // A chunk of zero bytes (a plan entry, and an empty ranged GET, per table entry).
    let table = &enc[tr.start as usize..tr.end as usize];
    let mut t = table.to_vec();
    t[8..16].copy_from_slice(&0u64.to_le_bytes());
    let e = anchor::plan_shard(&prefix, &cuts, &t, &footer, size, decoded).expect_err("zero-length chunk accepted");
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    let mut whole = enc.clone();
    whole[tr.start as usize..tr.end as usize].copy_from_slice(&t);
    assert!(anchor::decode_shard(&whole, &mut vec![0u8; file.len()]).is_err(), "zero-length chunk decoded in memory");
}

/// The chunks the encoder cuts a safetensors file into, from its header.
fn cuts_of(file: &[u8]) -> anchor::Cuts {
    let header_len = 8 + u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    anchor::shard_cuts(&file[..header_len], file.len() as u64, None).unwrap()
}

/// A replaced shard object (no key needed) whose table cuts the data into many more chunks
/// than the encoder does, each one ranged GET before the object's SHA-256 is checked at the
/// end: refused from the table, whatever header length its prefix declares (regression: the
/// chunk count was bounded by `size / 16 MiB + 2 * header_len / 16`, and a prefix declaring a
/// 100 MB header let a 1 GiB shard be planned as 12.5 million one-byte chunks).
#[test]
fn regression_a_table_of_more_chunks_than_the_encoder_cuts_is_refused() {
    let (file, _) = safetensors_file(3);
    let enc = anchor::encode_shard(&file, 1).unwrap();
    let decoded = file.len() as u64;
    let cuts = cuts_of(&file);
    let honest = |i: usize| enc.len() - anchor::FOOTER_LEN as usize - i;
    let footer = &enc[honest(0)..];
    let prefix = &enc[..anchor::PREFIX_LEN as usize];
    let n = u32::from_le_bytes(footer[8..12].try_into().unwrap()) as usize;
    assert_eq!(n, cuts.len());
    // The same data cut into chunks of one byte (width 1, one stored byte per plane): the
    // footer and table say so consistently.
    let header_len = 8 + u64::from_le_bytes(file[..8].try_into().unwrap());
    let ones = decoded - header_len;
    let mut table = vec![];
    for at in header_len..decoded {
        table.extend_from_slice(&at.to_le_bytes());
        table.extend_from_slice(&1u64.to_le_bytes());
        table.push(1);
        table.extend_from_slice(&1u64.to_le_bytes());
    }
    let (hr, _) = anchor::header_range(prefix, decoded, u64::MAX).unwrap();
    let table_offset = hr.end + ones;
    let stored = table_offset + table.len() as u64 + anchor::FOOTER_LEN;
    let mut f = table_offset.to_le_bytes().to_vec();
    f.extend_from_slice(&(ones as u32).to_le_bytes());
    f.extend_from_slice(b"DLAE");
    let e = anchor::table_range(prefix, &cuts, &f, stored, decoded).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(e.to_string().contains("chunk count"), "{e}");
    let e = anchor::plan_shard(prefix, &cuts, &table, &f, stored, decoded).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    // Cut differently with the honest count: refused chunk by chunk.
    let tr = anchor::table_range(prefix, &cuts, footer, enc.len() as u64, decoded).unwrap();
    let mut t = enc[tr.start as usize..tr.end as usize].to_vec();
    if n > 1 {
        // Move the boundary between the first two chunks by one element.
        let l0 = u64::from_le_bytes(t[8..16].try_into().unwrap());
        let w0 = u64::from(t[16]);
        t[8..16].copy_from_slice(&(l0 - w0).to_le_bytes());
        let e1 = 17 + 8 * w0 as usize;
        let o1 = u64::from_le_bytes(t[e1..e1 + 8].try_into().unwrap());
        t[e1..e1 + 8].copy_from_slice(&(o1 - w0).to_le_bytes());
        let l1 = u64::from_le_bytes(t[e1 + 8..e1 + 16].try_into().unwrap());
        t[e1 + 8..e1 + 16].copy_from_slice(&(l1 + w0).to_le_bytes());
        let e = anchor::plan_shard(prefix, &cuts, &t, footer, enc.len() as u64, decoded).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    }
    // A header that does not parse, or that does not fill the file, has no cuts.
    assert!(anchor::shard_cuts(&file[..header_len as usize], decoded + 1, None).is_err());
    assert!(anchor::shard_cuts(&file[..header_len as usize - 1], decoded, None).is_err());
}
