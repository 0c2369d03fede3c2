//! Streaming an anchor (`anchor_stream::stream_anchor`, shared by the agent and the Python
//! `Follower`, whose sink writes into the caller's arrays): hashed as it passes (`Hashing`),
//! every tensor's digest is that of the published bytes; when one part fails, the call returns
//! its error only after the parts in flight are done, so no write lands after it returned (the
//! arrays may be released or reused by then), and parts after the error are not written at
//! all. Shards stream side by side, and one shard's error stops the others without being
//! reported as theirs.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use driftless_agent::anchor_stream::{stream_anchor, Hashing, ShardJob, ShardSink};
use driftless_format::gen::{ModelSpec, RlChain};
use driftless_format::manifest::{AnchorEncoding, AnchorShardRef};
use driftless_format::TensorMeta;
use driftless_format::{anchor, Keypair, TrustSet};
use driftless_publisher::PublisherBuilder;
use driftless_store::layout;
use driftless_store::stream::StreamReader;

/// Counts writes, and those that land after the call returned; each write takes a while so
/// that decodes are still in flight when a part fails. With `seq`, a sequence shared by
/// several sinks (and the number of those sinks that started writing), each write takes a
/// number from it: the sink's first and last are kept. With `hold`, the sink's writes after
/// its first wait (10 s at most in all) for a second sink to start: a second shard that can only start
/// once this one ended shows as a timeout, whatever the machine's speed.
#[derive(Default)]
struct Counting {
    returned: AtomicBool,
    writes: AtomicU64,
    bytes: AtomicU64,
    late: AtomicU64,
    seq: Option<Arc<(AtomicU64, AtomicU64)>>,
    first: AtomicU64,
    last: AtomicU64,
    hold: bool,
    gave_up: AtomicBool,
}

impl ShardSink for Counting {
    fn write_at(&self, _at: u64, bytes: &[u8]) -> driftless_agent::Result<()> {
        if let Some(seq) = &self.seq {
            let n = seq.0.fetch_add(1, SeqCst) + 1;
            if self.first.compare_exchange(0, n, SeqCst, SeqCst).is_ok() {
                seq.1.fetch_add(1, SeqCst);
            } else if self.hold && !self.gave_up.load(SeqCst) {
                let t = std::time::Instant::now();
                while seq.1.load(SeqCst) < 2 {
                    if t.elapsed() > Duration::from_secs(10) {
                        self.gave_up.store(true, SeqCst);
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            self.last.fetch_max(seq.0.fetch_add(1, SeqCst) + 1, SeqCst);
        }
        std::thread::sleep(Duration::from_millis(40));
        self.writes.fetch_add(1, SeqCst);
        self.bytes.fetch_add(bytes.len() as u64, SeqCst);
        if self.returned.load(SeqCst) {
            self.late.fetch_add(1, SeqCst);
        }
        Ok(())
    }
}

/// A [`Counting`] the test reads while a `Hashing` owns the sink.
struct Shared(Arc<Counting>);

impl ShardSink for Shared {
    fn write_at(&self, at: u64, bytes: &[u8]) -> driftless_agent::Result<()> {
        self.0.write_at(at, bytes)
    }
}

/// One shard's stream, as the callers stream a one-shard anchor.
async fn stream_one(
    b: &driftless_store::Bucket,
    o: &AnchorShardRef,
    tensors: &[TensorMeta],
    sink: Arc<dyn ShardSink>,
) -> driftless_agent::Result<u64> {
    stream_anchor(b, 0, AnchorEncoding::PlanesZstd, vec![ShardJob { object: o, tensors, sink, sized: false }], 4).await
}

/// Anchor 0 of a `bytes`-byte chain (seed `seed`) published in `tb` with `encoding`: the chain,
/// its largest shard's manifest entry, that shard's signed tensors and its object's path.
async fn published_anchor(
    tb: &TestBucket,
    seed: u8,
    bytes: u64,
    encoding: AnchorEncoding,
) -> (RlChain, AnchorShardRef, Vec<TensorMeta>, std::path::PathBuf) {
    let key = Keypair::from_seed([seed; 32]);
    let trust = TrustSet::new().with_key(key.public());
    let b = tb.bucket.clone();
    let chain = RlChain::new(&ModelSpec::with_bf16_bytes(bytes), 2e-6, seed.into());
    tokio::task::block_in_place(|| {
        let mut p = PublisherBuilder::new("unused")
            .with_bucket(b)
            .with_key(key)
            .with_anchor_encoding(encoding)
            .build()
            .unwrap();
        p.publish(0, &chain.views()).unwrap();
        p.close().unwrap();
    });
    let (m, _) = StreamReader::new(tb.bucket.clone(), trust).anchor(0).await.unwrap();
    let o = m.objects.iter().max_by_key(|o| o.object.size).unwrap().clone();
    let tensors = m.layout().shards.into_iter().find(|s| s.file == o.file).unwrap().tensors;
    let path = tb.root.as_ref().unwrap().join(layout::object(driftless_format::StepKind::Anchor, 0, &o.object.object));
    (chain, o, tensors, path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_hashes_what_it_writes_and_a_failed_part_stops_it_with_no_write_after_it_returned() {
    let tb = file_bucket();
    // 48 MiB: three 16 MiB parts, all in flight at once.
    let (chain, o, tensors, path) = published_anchor(&tb, 9, 48 << 20, AnchorEncoding::PlanesZstd).await;
    // A header that does not list the signed layout's tensors is refused before any chunk is
    // read (a replaced object could declare millions of tiny tensors, a GET per chunk).
    let e = stream_one(&tb.bucket, &o, &tensors[1..], Arc::new(Counting::default())).await.unwrap_err();
    assert!(e.to_string().contains("not the") && e.to_string().contains("signed layout"), "{e}");

    // Intact: every part written once (plus the header), nothing after the call; hashed as
    // it passes, every tensor's digest is that of the published bytes.
    let counting = Counting::default();
    let sink = Arc::new(Hashing::new(counting, o.decoded_size));
    let n = stream_one(&tb.bucket, &o, &tensors, sink.clone()).await.unwrap();
    assert_eq!(n, o.object.size);
    let got: std::collections::HashMap<String, driftless_format::Digest> =
        sink.digests().unwrap().into_iter().map(|(m, d)| (m.name, d)).collect();
    let views = chain.views();
    let (want, _) = driftless_format::weights_root(&views);
    assert_eq!(got.len(), views.len());
    for (v, d) in views.iter().zip(want) {
        assert_eq!(got[v.name], d, "digest of {} hashed while streaming", v.name);
    }
    // The header alone, then each chunk in pieces of at most 1 MiB (its decoded bytes are never
    // held whole), inside the chunk, tiling the file once.
    let mut bytes = std::fs::read(&path).unwrap();
    let plan = plan_of(&bytes, o.decoded_size);
    assert!(plan.chunks.len() >= 3, "{} chunks: the model should span several", plan.chunks.len());
    let offsets = Arc::new(Offsets::default());
    stream_one(&tb.bucket, &o, &tensors, offsets.clone()).await.unwrap();
    let mut wrote = offsets.0.lock().unwrap().clone();
    wrote.sort();
    assert_eq!(wrote[0], (0, plan.chunks[0].out.start), "the header first, alone");
    let mut at = wrote[0].1;
    for &(a, n) in &wrote[1..] {
        assert_eq!(a, at, "pieces tile the file once");
        assert!(n > 0 && n <= driftless_format::hash::CHUNK as u64, "a piece of {n} bytes");
        let c = plan.chunks.iter().find(|c| c.out.start <= a && a + n <= c.out.end);
        let c = c.unwrap_or_else(|| panic!("piece {a}+{n} across chunks"));
        // On the weights-root hash's grid (a chunk starts on a 16 MiB multiple of its tensor):
        // pieces off it would leave partial leaves for `Hashing` to keep.
        assert_eq!((a - c.out.start) % driftless_format::hash::CHUNK as u64, 0, "piece {a}+{n} off the hash grid");
        at += n;
    }
    assert_eq!(at, o.decoded_size);
    let first_len = plan.chunks[0].out.end - plan.chunks[0].out.start;
    // A wrong digest for the first chunk's part, the bytes intact (so that its decode
    // succeeds): the error names the part's bytes, and nothing decoded from it is written.
    assert!(!o.parts.is_empty(), "the publisher signs the object's parts");
    let first_out = plan.chunks[0].out.clone();
    let wrote_first = Arc::new(AtomicBool::new(false));
    struct Watch(Arc<AtomicBool>, std::ops::Range<u64>);
    impl ShardSink for Watch {
        fn write_at(&self, at: u64, b: &[u8]) -> driftless_agent::Result<()> {
            if at < self.1.end && self.1.start < at + b.len() as u64 {
                self.0.store(true, SeqCst);
            }
            std::thread::sleep(Duration::from_millis(40));
            Ok(())
        }
    }
    let mut wrong = o.clone();
    wrong.parts[1].sha256 = driftless_format::Digest::of(b"not these bytes");
    let e =
        stream_one(&tb.bucket, &wrong, &tensors, Arc::new(Watch(wrote_first.clone(), first_out))).await.unwrap_err();
    let c = &plan.chunks[0].stored;
    let named = format!("does not match its manifest: bytes {}..{} (a signed part's SHA-256)", c.start, c.end);
    assert!(e.to_string().contains(&named), "{e}");
    assert!(!wrote_first.load(SeqCst), "a part that failed its signed SHA-256 was written");

    // The first part's first plane no longer a zstd frame.
    let first = plan.chunks[0].stored.start as usize;
    for b in &mut bytes[first..first + 4] {
        *b ^= 0xFF;
    }
    std::fs::write(&path, &bytes).unwrap();
    // Refused by its signed part's SHA-256; in a manifest of a publisher before signed parts,
    // the corrupt part reaches the decoder, whose error stops the stream the same way.
    let mut old = o.clone();
    old.parts.clear();
    for (what, o, want) in [("signed", o.clone(), named.as_str()), ("unsigned", old, "zstd")] {
        let sink = Arc::new(Counting::default());
        let e = stream_one(&tb.bucket, &o, &tensors, sink.clone()).await.unwrap_err();
        sink.returned.store(true, SeqCst);
        assert!(e.to_string().contains(want), "{what}: {e}");
        // Decodes still in flight when it returned would write now.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(sink.late.load(SeqCst), 0, "{what}: writes landed after stream_anchor returned its error");
        let wrote = sink.bytes.load(SeqCst);
        assert!(wrote + first_len <= o.decoded_size, "{what}: {wrote} bytes: the failed part was written");
    }
}

/// Signed parts must be exactly the ranges a reader fetches: parts that tile the object with
/// every digest right but cut elsewhere (a 1 MiB grid, the chunks merged into one part, one
/// byte moved from a chunk's part to the next) are refused, and so is a first part whose
/// digest is wrong, with nothing written from a part off its signed range. A manifest
/// without parts (publishers before them) still streams, checked by the object's SHA-256.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_parts_must_be_the_ranges_a_reader_fetches() {
    use driftless_format::manifest::PartRef;
    use driftless_format::Digest;
    let tb = file_bucket();
    let (chain, o, tensors, path) = published_anchor(&tb, 12, 40 << 20, AnchorEncoding::PlanesZstd).await;
    let bytes = std::fs::read(&path).unwrap();
    let plan = plan_of(&bytes, o.decoded_size);
    let n = o.parts.len();
    assert!(n >= 4, "{n} parts: a prefix, chunks, a table");
    let part = |a: usize, e: usize| PartRef { len: (e - a) as u64, sha256: Digest::of(&bytes[a..e]) };
    let starts: Vec<usize> =
        o.parts.iter().scan(0usize, |at, p| Some(std::mem::replace(at, *at + p.len as usize))).collect();

    // Older manifests: no parts, the whole object's SHA-256; every tensor hashed as published.
    let mut old = o.clone();
    old.parts.clear();
    let sink = Arc::new(Hashing::new(Counting::default(), o.decoded_size));
    assert_eq!(stream_one(&tb.bucket, &old, &tensors, sink.clone()).await.unwrap(), o.object.size);
    let (want, _) = driftless_format::weights_root(&chain.views());
    let got: Vec<_> = sink.digests().unwrap().into_iter().map(|(_, d)| d).collect();
    assert_eq!(got.len(), want.len());
    assert!(want.iter().all(|d| got.contains(d)), "digests of an unsigned-parts stream");

    let grid: Vec<PartRef> =
        (0..bytes.len()).step_by(1 << 20).map(|a| part(a, (a + (1 << 20)).min(bytes.len()))).collect();
    let merged = vec![o.parts[0].clone(), part(starts[1], starts[n - 1]), o.parts[n - 1].clone()];
    let mut moved = o.parts.clone();
    moved[1] = part(starts[1], starts[2] - 1);
    moved[2] = part(starts[2] - 1, starts[3]);
    let mut wrong_head = o.parts.clone();
    wrong_head[0].sha256 = Digest::of(b"another header");
    for (what, parts, want) in [
        ("a 1 MiB grid", grid, "not the prefix and the header"),
        ("chunks merged", merged, "parts are not its chunks"),
        ("a byte moved", moved, "off its signed parts"),
        ("the first part's digest", wrong_head, "bytes 0.."),
    ] {
        assert_eq!(parts.iter().map(|p| p.len).sum::<u64>(), o.object.size, "{what}: tiles the object");
        let mut h = o.clone();
        h.parts = parts;
        let sink = Arc::new(Counting::default());
        let e = stream_one(&tb.bucket, &h, &tensors, sink.clone()).await.unwrap_err();
        assert!(e.to_string().contains(want), "{what}: {e}");
        assert!(e.is_integrity() && !e.is_retryable(), "{what}: {e} is not an integrity failure");
        // The moved byte: the header and at most the chunks after the two whose ranges are off
        // their parts were written.
        let off = |c: &anchor::ChunkPlan| c.out.end - c.out.start;
        let max = match what {
            "a byte moved" => o.decoded_size - off(&plan.chunks[0]) - off(&plan.chunks[1]),
            _ => 0,
        };
        let wrote = sink.bytes.load(SeqCst);
        assert!(wrote <= max, "{what}: {wrote} bytes written, at most {max}");
    }
}

/// A plain-safetensors anchor's signed parts: a wrong digest for the piece after the header is
/// refused with its bytes named and nothing written from them; pieces other than the 16 MiB
/// ones `part_ranges` cuts (each digest right) are refused before anything is fetched or
/// written; the intact parts stream every byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_anchor_parts_are_checked_before_they_are_written() {
    use driftless_format::manifest::PartRef;
    use driftless_format::Digest;
    let tb = file_bucket();
    let (_, o, tensors, path) = published_anchor(&tb, 13, 40 << 20, AnchorEncoding::Safetensors).await;
    let bytes = std::fs::read(&path).unwrap();
    assert!(o.parts.len() >= 3, "{} parts: a header and 16 MiB pieces", o.parts.len());
    let head = o.parts[0].len;
    let run = |o: AnchorShardRef| {
        let tensors = tensors.clone();
        let sink = Arc::new(Offsets::default());
        let b = tb.bucket.clone();
        async move {
            let r = stream_anchor(
                &b,
                0,
                AnchorEncoding::Safetensors,
                vec![ShardJob { object: &o, tensors: &tensors, sink: sink.clone(), sized: false }],
                4,
            )
            .await;
            (r, sink.0.lock().unwrap().clone())
        }
    };
    let (r, wrote) = run(o.clone()).await;
    assert_eq!(r.unwrap(), o.object.size);
    assert_eq!(wrote.iter().map(|(_, n)| n).sum::<u64>(), o.object.size, "every byte written once");

    let mut wrong = o.clone();
    wrong.parts[1].sha256 = Digest::of(b"not these bytes");
    let (r, wrote) = run(wrong).await;
    let e = r.unwrap_err();
    let named = format!("bytes {}..{} (a signed part's SHA-256)", head, head + o.parts[1].len);
    assert!(e.to_string().contains(&named) && e.is_integrity(), "{e}");
    assert!(!wrote.iter().any(|(at, _)| *at == head), "a part that failed its check was written");

    let mut split = o.clone();
    let a = head as usize;
    let mid = a + (1 << 20);
    let end = a + o.parts[1].len as usize;
    split.parts.splice(
        1..2,
        [
            PartRef { len: (mid - a) as u64, sha256: Digest::of(&bytes[a..mid]) },
            PartRef { len: (end - mid) as u64, sha256: Digest::of(&bytes[mid..end]) },
        ],
    );
    let (r, wrote) = run(split).await;
    let e = r.unwrap_err();
    assert!(e.to_string().contains("not 16 MiB pieces") && e.is_integrity(), "{e}");
    assert!(wrote.is_empty(), "{wrote:?}");

    // Without signed parts (older publishers' manifests), a replaced object whose header lists
    // other tensors than the signed layout is refused before anything is written (it was
    // streamed whole, its bytes routed by that header, until its SHA-256 failed at the end).
    let mut unsigned = o.clone();
    unsigned.parts.clear();
    let (r, wrote) = run(unsigned.clone()).await;
    assert_eq!(r.unwrap(), o.object.size, "the intact object without signed parts");
    assert_eq!(wrote.iter().map(|(_, n)| n).sum::<u64>(), o.object.size);
    let name = format!("\"{}\"", tensors[0].name);
    let at =
        bytes[..head as usize].windows(name.len()).position(|w| w == name.as_bytes()).expect("named in the header");
    let mut renamed = bytes.clone();
    renamed[at + 1] ^= 0x20;
    std::fs::write(&path, &renamed).unwrap();
    let (r, wrote) = run(unsigned).await;
    let e = r.unwrap_err();
    assert!(e.to_string().contains("of the signed layout (first difference: tensor") && e.is_integrity(), "{e}");
    assert!(wrote.is_empty(), "{wrote:?}");
}

/// Records every write's offset and length.
#[derive(Default)]
struct Offsets(std::sync::Mutex<Vec<(u64, u64)>>);

impl ShardSink for Offsets {
    fn write_at(&self, at: u64, bytes: &[u8]) -> driftless_agent::Result<()> {
        self.0.lock().unwrap().push((at, bytes.len() as u64));
        Ok(())
    }
}

/// A sharded anchor streams two shards at once with 4 parts in flight (`share_parts`), every
/// tensor hashed as published; when one shard's object is missing, the error is that (a step
/// not ready), not the mismatch the shard stopped beside it would compute from the parts it
/// skipped, and no write lands after the call returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_stream_side_by_side_and_one_missing_shard_is_reported_as_such() {
    assert_eq!(driftless_agent::anchor_stream::share_parts(4, 1), (1, 4));
    assert_eq!(driftless_agent::anchor_stream::share_parts(4, 5), (2, 2));
    assert_eq!(driftless_agent::anchor_stream::share_parts(1, 5), (1, 1));
    assert_eq!(driftless_agent::anchor_stream::share_parts(9, 2), (2, 4));
    let tb = file_bucket();
    let key = Keypair::from_seed([9; 32]);
    let (b, k) = (tb.bucket.clone(), key.clone());
    // 96 MiB in shards of at most 32 MiB: several shards of several 16 MiB parts.
    let chain = RlChain::new(&ModelSpec::with_bf16_bytes(96 << 20), 2e-6, 3);
    tokio::task::block_in_place(|| {
        let mut p =
            PublisherBuilder::new("unused").with_bucket(b).with_key(k).with_max_shard_bytes(32 << 20).build().unwrap();
        p.publish(0, &chain.views()).unwrap();
        p.close().unwrap();
    });
    let reader = StreamReader::new(tb.bucket.clone(), TrustSet::new().with_key(key.public()));
    let (m, _) = reader.anchor(0).await.unwrap();
    let layout = m.layout();
    assert!(m.objects.len() >= 3, "{} shards", m.objects.len());
    let seq = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
    let counting: Vec<Arc<Counting>> = (0..m.objects.len())
        .map(|i| Arc::new(Counting { seq: Some(seq.clone()), hold: i == 0, ..Default::default() }))
        .collect();
    let sinks: Vec<Arc<Hashing<Shared>>> = m
        .objects
        .iter()
        .zip(&counting)
        .map(|(o, c)| Arc::new(Hashing::new(Shared(c.clone()), o.decoded_size)))
        .collect();
    let jobs = |sinks: Vec<Arc<dyn ShardSink>>| -> Vec<ShardJob<'_>> {
        m.objects
            .iter()
            .zip(&layout.shards)
            .zip(sinks)
            .map(|((o, s), sink)| ShardJob { object: o, tensors: &s.tensors, sink, sized: false })
            .collect()
    };
    let n = stream_anchor(
        &tb.bucket,
        0,
        m.encoding,
        jobs(sinks.iter().map(|s| s.clone() as Arc<dyn ShardSink>).collect()),
        4,
    )
    .await
    .unwrap();
    assert_eq!(n, m.objects.iter().map(|o| o.object.size).sum::<u64>());
    let got: std::collections::HashMap<String, driftless_format::Digest> =
        sinks.iter().flat_map(|s| s.digests().unwrap()).map(|(m, d)| (m.name, d)).collect();
    let views = chain.views();
    let (want, _) = driftless_format::weights_root(&views);
    assert_eq!(got.len(), views.len());
    for (v, d) in views.iter().zip(want) {
        assert_eq!(got[v.name], d, "digest of {} hashed while streaming", v.name);
    }
    // 4 parts: two shards of two parts. The second shard's first write (its header) comes
    // before the first shard's last (which waits for it); the third's after the first of
    // them ended.
    let first = |i: usize| counting[i].first.load(SeqCst);
    assert!(first(1) < counting[0].last.load(SeqCst), "the second shard started after the first ended");
    let ended = counting[0].last.load(SeqCst).min(counting[1].last.load(SeqCst));
    assert!(first(2) > ended, "a third shard streamed beside the first two");

    // The second shard's object gone: the first, streaming beside it, is stopped.
    let gone = &m.objects[1];
    let path =
        tb.root.as_ref().unwrap().join(layout::object(driftless_format::StepKind::Anchor, 0, &gone.object.object));
    std::fs::remove_file(&path).unwrap();
    let counting: Vec<Arc<Counting>> = m.objects.iter().map(|_| Arc::new(Counting::default())).collect();
    let e = stream_anchor(
        &tb.bucket,
        0,
        m.encoding,
        jobs(counting.iter().map(|s| s.clone() as Arc<dyn ShardSink>).collect()),
        4,
    )
    .await
    .unwrap_err();
    for c in &counting {
        c.returned.store(true, SeqCst);
    }
    assert!(!e.is_integrity(), "a missing object is not a corrupt one: {e}");
    assert!(e.to_string().contains("missing"), "{e}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(counting.iter().map(|c| c.late.load(SeqCst)).sum::<u64>(), 0, "writes after the call returned");
    assert_eq!(counting.last().unwrap().writes.load(SeqCst), 0, "a shard after the error was started");
}

/// A cold start verifies a streamed anchor through the digests hashed as it was written: an
/// anchor whose manifest is signed with the stream's key but names another weights root than
/// its bytes have is refused, and nothing becomes current.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_anchor_whose_bytes_are_not_its_root_is_refused() {
    let tb = file_bucket();
    let key = Keypair::from_seed([10; 32]);
    let trust = TrustSet::new().with_key(key.public());
    let (b, k) = (tb.bucket.clone(), key.clone());
    tokio::task::block_in_place(|| {
        let chain = RlChain::new(&ModelSpec::with_bf16_bytes(20 << 20), 2e-6, 4);
        let mut p = PublisherBuilder::new("unused").with_bucket(b).with_key(k).build().unwrap();
        p.publish(0, &chain.views()).unwrap();
        p.close().unwrap();
    });
    resign_anchor(&tb, &key, &trust, 0, |m| m.weights_root = driftless_format::Digest::of(b"another model"));

    let mut a = driftless_agent::Agent::new(tb.bucket.clone(), config(tb.dir.path().join("a"), trust)).unwrap();
    let r = a.sync_once().await;
    assert!(a.state().is_none(), "a cold start took an anchor whose bytes are not its root: {r:?}");
    assert!(!tb.dir.path().join("a").join("current").exists(), "current names an unverified slot");
    let refused = format!("{r:?}");
    assert!(refused.contains("weights root"), "{refused}");
}

/// A cold start on anchor 0 and deltas 1-2, anchor 0 re-signed with a weights root that is not
/// its bytes' (so delta 1's base root disagrees with it). Which one is wrong is only known once
/// the anchor is hashed: the anchor is refused, never delta 1 (found by review: delta 1 was
/// refused as on a wrong base before the anchor was looked at, so once the anchor was repaired
/// the agent served step 0 alone while delta 1's refusal held). Repaired, the agent reaches
/// step 2 at once, verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anchor_disagreeing_with_the_next_delta_is_the_one_refused() {
    use driftless_format::StepKind;
    let tb = file_bucket();
    let key = Keypair::from_seed([12; 32]);
    let trust = TrustSet::new().with_key(key.public());
    let ((_, want), root0) = anchor_and_two_deltas(&tb, &key, 5);
    resign_anchor(&tb, &key, &trust, 0, |m| m.weights_root = driftless_format::Digest::of(b"another model"));

    let mut a = driftless_agent::Agent::new(tb.bucket.clone(), config(tb.dir.path().join("a"), trust.clone())).unwrap();
    let e = a.sync_once().await.expect_err("no route but through the bad anchor");
    assert!(matches!(&e, driftless_agent::Error::Refused { kind: StepKind::Anchor, step: 0, .. }), "{e}");
    assert!(e.to_string().contains("weights root"), "{e}");
    assert!(a.state().is_none());

    resign_anchor(&tb, &key, &trust, 0, |m| m.weights_root = root0);
    let o = a.sync_once().await.unwrap();
    assert_eq!((o.step, o.route, o.deltas), (2, driftless_agent::SyncPath::Anchor, 2), "{o:?}");
    assert!(o.refused.is_empty(), "{o:?}");
    assert_bits(&a, &want);
}

/// The other way round: anchor 0 as published, delta 1 re-signed on a base root that is not
/// step 0's, or with a result root that is not its result's (so delta 2's base disagrees with
/// it). The careful retry hashes the anchor, finds it good, and refuses delta 1, never delta 2
/// (found by review: delta 2 was refused as on a wrong base); the agent serves anchor 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_delta_after_a_good_anchor_is_the_one_refused() {
    use driftless_format::StepKind;
    let key = Keypair::from_seed([13; 32]);
    let trust = TrustSet::new().with_key(key.public());
    for (case, seed) in [("base", 6), ("result", 7)] {
        let tb = file_bucket();
        let ((want, _), _) = anchor_and_two_deltas(&tb, &key, seed);
        resign(&tb, &key, &trust, StepKind::Delta, 1, |m: &mut driftless_format::DeltaManifest| {
            let other = driftless_format::Digest::of(b"another model");
            match case {
                "base" => m.base_root = other,
                _ => m.result_root = other,
            }
        });
        let mut a =
            driftless_agent::Agent::new(tb.bucket.clone(), config(tb.dir.path().join("a"), trust.clone())).unwrap();
        let o = a.sync_once().await.unwrap();
        assert_eq!((o.step, o.route), (0, driftless_agent::SyncPath::Anchor), "{case}: {o:?}");
        let refused: Vec<_> = o.refused.iter().map(|r| (r.kind, r.step)).collect();
        assert_eq!(refused, [(StepKind::Delta, 1)], "{case}: {o:?}");
        assert_bits(&a, &want);
    }
}

/// The newest anchor's object rewritten (same size, manifest untouched) so that its prefix
/// says the compressed header is 0 bytes long, the bytes moved into the first plane: the
/// numbers still add up, but no encoder writes them, and the empty ranged GET they ask for
/// failed as a store error (transient), so the anchor was never refused and a cold agent never
/// took the older anchor and its deltas. Now it is refused as corrupt and the agent takes the
/// next best route, verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anchor_with_numbers_no_encoder_writes_is_refused_and_routed_around() {
    refused_and_routed_around("compressed header of 0 bytes", |bytes| {
        let size = bytes.len();
        let table_offset = u64::from_le_bytes(bytes[size - 16..size - 8].try_into().unwrap()) as usize;
        let header_stored = u64::from_le_bytes(bytes[24..32].try_into().unwrap());
        bytes[24..32].copy_from_slice(&0u64.to_le_bytes());
        let first_plane = table_offset + 17;
        let pl = u64::from_le_bytes(bytes[first_plane..first_plane + 8].try_into().unwrap());
        bytes[first_plane..first_plane + 8].copy_from_slice(&(pl + header_stored).to_le_bytes());
    })
    .await;
}

/// The same with a prefix whose compressed header runs past the end of the object (as long as
/// the decoded size allows): the ranged GET came back short, a transient store error, and a cold
/// agent retried the anchor at every poll (found by review).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anchor_whose_header_runs_past_its_object_is_refused_and_routed_around() {
    refused_and_routed_around("past the end of an object", |bytes| {
        let size = bytes.len() as u64;
        let decoded = u64::from_le_bytes(bytes[8..16].try_into().unwrap());
        bytes[16..24].copy_from_slice(&decoded.to_le_bytes());
        bytes[24..32].copy_from_slice(&size.to_le_bytes());
    })
    .await;
}

/// Publishes anchor 0, deltas 1-2 and anchor 2, rewrites anchor 2's object with `tamper`,
/// re-signs its manifest without parts (a signer with a bug: the object's SHA-256 is only
/// known at the end, so the numbers themselves must be refused; with the publisher's parts,
/// the first part's digest would refuse the object before its numbers are read), removes
/// delta 1 so that anchor 2 is the only route to step 2, and checks that a cold agent refuses
/// it with `reason` and serves anchor 0, verified.
async fn refused_and_routed_around(reason: &str, tamper: impl FnOnce(&mut Vec<u8>)) {
    use driftless_format::StepKind;
    let tb = file_bucket();
    let key = Keypair::from_seed([11; 32]);
    let trust = TrustSet::new().with_key(key.public());
    let (b, k) = (tb.bucket.clone(), key.clone());
    let roots = tokio::task::block_in_place(|| {
        let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(4 << 20), 2e-6, 3);
        let mut p = PublisherBuilder::new("unused").with_bucket(b).with_key(k).with_anchor_every(2).build().unwrap();
        let mut roots = vec![];
        for s in 0..3u64 {
            if s > 0 {
                chain.step();
            }
            p.publish(s, &chain.views()).unwrap();
            // Flushed: a step due an anchor while the one before is still encoding is a
            // delta alone (`anchor_due`), and under a loaded `.ci/run` anchor 0 was (step 2
            // then had no anchor; failed once).
            p.flush().unwrap();
            roots.push(driftless_format::weights_root(&chain.views()).1);
        }
        p.close().unwrap();
        roots
    });
    let reader = StreamReader::new(tb.bucket.clone(), trust.clone());
    assert_eq!(reader.ready_steps(StepKind::Anchor, None).await.unwrap(), [0, 2]);
    assert!(reader.ready_steps(StepKind::Delta, None).await.unwrap().contains(&2));
    let (m, _) = reader.anchor(2).await.unwrap();
    let o = &m.objects[0];
    let path = tb.root.as_ref().unwrap().join(layout::object(StepKind::Anchor, 2, &o.object.object));
    let mut bytes = std::fs::read(&path).unwrap();
    tamper(&mut bytes);
    std::fs::write(&path, &bytes).unwrap();
    resign_anchor(&tb, &key, &trust, 2, |m| {
        m.objects[0].parts.clear();
        m.objects[0].object.sha256 = driftless_format::Digest::of(&bytes);
    });
    tb.bucket.delete(&layout::ready(StepKind::Delta, 1)).await.unwrap();

    let mut a = driftless_agent::Agent::new(tb.bucket.clone(), config(tb.dir.path().join("a"), trust)).unwrap();
    let o = a.sync_once().await.unwrap_or_else(|e| panic!("a cold agent stuck on a hostile anchor: {e}"));
    assert!(o.refused.iter().any(|r| r.kind == StepKind::Anchor && r.step == 2), "{o:?}");
    assert!(o.refused.iter().any(|r| r.reason.contains(reason)), "the numbers refused: {o:?}");
    assert_eq!((o.step, o.root), (0, roots[0]), "the next best route: {o:?}");
    assert_eq!(a.state().map(|s| s.step), Some(0));
}

/// `Hashing` against the weights root on parts cut anywhere: 4097-byte writes in any order
/// (partial leaves stitched across parts), the whole file in one write (header and data
/// together, as a plain safetensors anchor is), a zero-size tensor; a missing or repeated part
/// is an error, never a digest.
#[test]
fn hashing_sees_every_byte_once_however_the_parts_are_cut() {
    use driftless_format::{DType, Layout, TensorMeta, TensorView};
    struct Null;
    impl ShardSink for Null {
        fn write_at(&self, _: u64, _: &[u8]) -> driftless_agent::Result<()> {
            Ok(())
        }
    }
    let metas = vec![
        TensorMeta { name: "a".into(), dtype: DType::BF16, shape: vec![1_572_867] },
        TensorMeta { name: "empty".into(), dtype: DType::F32, shape: vec![0, 3] },
        TensorMeta { name: "z".into(), dtype: DType::U8, shape: vec![10_001] },
    ];
    let layout = Layout::for_tensors(&metas, u64::MAX).unwrap();
    let (header, ranges) = Layout::shard_header(&layout.shards[0]).unwrap();
    let data: Vec<u8> = (0..ranges.last().unwrap().end).map(|i| (i * 7 + i / 4099) as u8).collect();
    let mut file = header.clone();
    file.extend_from_slice(&data);
    let views: Vec<TensorView<'_>> = layout.shards[0]
        .tensors
        .iter()
        .zip(&ranges)
        .map(|(m, r)| TensorView {
            name: &m.name,
            dtype: m.dtype,
            shape: &m.shape,
            data: &data[r.start as usize..r.end as usize],
        })
        .collect();
    let (want, _) = driftless_format::weights_root(&views);
    let size = file.len() as u64;
    let h0 = header.len();
    let pieces: Vec<(u64, &[u8])> =
        file[h0..].chunks(4097).enumerate().map(|(i, c)| ((h0 + i * 4097) as u64, c)).collect();
    let digests = |writes: &[(u64, &[u8])]| {
        let h = Hashing::new(Null, size);
        for (at, b) in writes {
            h.write_at(*at, b)?;
        }
        h.digests().map(|d| d.into_iter().map(|(_, d)| d).collect::<Vec<_>>())
    };
    // Header alone, then the parts from the end backwards.
    let mut w = vec![(0u64, &file[..h0])];
    w.extend(pieces.iter().rev().copied());
    assert_eq!(digests(&w).unwrap(), want);
    // The whole file in one write.
    assert_eq!(digests(&[(0, &file[..])]).unwrap(), want);
    // A part missing, or one given twice.
    let mut missing = w.clone();
    missing.remove(7);
    assert!(digests(&missing).is_err(), "a missing part gave digests");
    let mut twice = w.clone();
    twice.push(w[9]);
    assert!(digests(&twice).is_err(), "a repeated part gave digests");
    // A part before the header, inside it, or beyond the shard.
    assert!(digests(&[(h0 as u64, &file[h0..])]).is_err());
    assert!(digests(&[(0, &file[..h0]), (2, &file[2..10])]).is_err());
    assert!(digests(&[(0, &file[..h0]), (size - 2, &file[..8])]).is_err());
}

/// The plan of a byte-plane shard object (`bytes`, decoding to `decoded_size`), as a reader
/// makes it.
fn plan_of(bytes: &[u8], decoded_size: u64) -> anchor::ShardPlan {
    let size = bytes.len() as u64;
    let footer = &bytes[bytes.len() - anchor::FOOTER_LEN as usize..];
    let prefix = &bytes[..anchor::PREFIX_LEN as usize];
    let (hr, header_len) = anchor::header_range(prefix, decoded_size, size).unwrap();
    let mut head = vec![0u8; header_len as usize];
    anchor::decode_header(&bytes[hr.start as usize..hr.end as usize], &mut head).unwrap();
    let cuts = anchor::shard_cuts(&head, decoded_size, None).unwrap();
    let tr = anchor::table_range(prefix, &cuts, footer, size, decoded_size).unwrap();
    anchor::plan_shard(prefix, &cuts, &bytes[tr.start as usize..tr.end as usize], footer, size, decoded_size).unwrap()
}

/// Rewrites the signed manifest of anchor `step` with `edit` applied, signed by `key`, and its
/// ready marker to match: what a signer with a bug would publish.
type Snapshot = Vec<(String, Vec<u8>)>;

/// Anchor 0 and deltas 1-2 of a 4 MiB chain (`seed`). Returns steps 0 and 2 (their tensors)
/// and step 0's weights root.
fn anchor_and_two_deltas(
    tb: &TestBucket,
    key: &Keypair,
    seed: u64,
) -> ((Snapshot, Snapshot), driftless_format::Digest) {
    let (b, k) = (tb.bucket.clone(), key.clone());
    tokio::task::block_in_place(|| {
        let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(4 << 20), 2e-6, seed);
        let (first, root0) = (snapshot(&chain), driftless_format::weights_root(&chain.views()).1);
        let mut p = PublisherBuilder::new("unused").with_bucket(b).with_key(k).build().unwrap();
        for s in 0..3u64 {
            if s > 0 {
                chain.step();
            }
            p.publish(s, &chain.views()).unwrap();
        }
        p.close().unwrap();
        ((first, snapshot(&chain)), root0)
    })
}

fn resign_anchor(
    tb: &TestBucket,
    key: &Keypair,
    trust: &TrustSet,
    step: u64,
    edit: impl FnOnce(&mut driftless_format::manifest::AnchorManifest),
) {
    resign(tb, key, trust, driftless_format::StepKind::Anchor, step, edit)
}

/// Re-signs the manifest of step `step` after `edit`, and points its marker at it.
fn resign<M: serde::Serialize + serde::de::DeserializeOwned>(
    tb: &TestBucket,
    key: &Keypair,
    trust: &TrustSet,
    kind: driftless_format::StepKind,
    step: u64,
    edit: impl FnOnce(&mut M),
) {
    use driftless_format::manifest::ReadyMarker;
    let root = tb.root.clone().unwrap();
    let marker_path = root.join(layout::ready(kind, step));
    let mut marker: ReadyMarker = serde_json::from_slice(&std::fs::read(&marker_path).unwrap()).unwrap();
    let env_path = root.join(layout::object(kind, step, marker.manifest_name()));
    let (payload, _) = trust.open(&std::fs::read(&env_path).unwrap()).unwrap();
    let mut m: M = serde_json::from_slice(&payload).unwrap();
    edit(&mut m);
    let env = key.seal(&serde_json::to_vec(&m).unwrap()).unwrap();
    std::fs::write(&env_path, &env).unwrap();
    marker.manifest_sha256 = driftless_format::Digest::of(&env);
    std::fs::write(&marker_path, serde_json::to_vec(&marker).unwrap()).unwrap();
}
