//! Streaming an anchor shard (`anchor_stream::stream_shard`, shared by the agent and the
//! Python `Follower`, whose sink writes into the caller's arrays): when one part fails, the
//! call returns its error only after the parts in flight are done, so no write lands after it
//! returned (the arrays may be released or reused by then), and parts after the error are not
//! written at all.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use driftless_agent::anchor_stream::{stream_shard, ShardSink};
use driftless_format::gen::{ModelSpec, RlChain};
use driftless_format::{anchor, Keypair, TrustSet};
use driftless_publisher::PublisherBuilder;
use driftless_store::layout;
use driftless_store::stream::StreamReader;

/// Counts writes, and those that land after the call returned; each write takes a while so
/// that decodes are still in flight when a part fails.
#[derive(Default)]
struct Counting {
    returned: AtomicBool,
    writes: AtomicU64,
    late: AtomicU64,
}

impl ShardSink for Counting {
    fn write_at(&self, _at: u64, _bytes: &[u8]) -> driftless_agent::Result<()> {
        std::thread::sleep(Duration::from_millis(40));
        self.writes.fetch_add(1, SeqCst);
        if self.returned.load(SeqCst) {
            self.late.fetch_add(1, SeqCst);
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_part_stops_the_stream_and_no_write_lands_after_it_returned() {
    let tb = file_bucket();
    let key = Keypair::from_seed([9; 32]);
    let trust = TrustSet::new().with_key(key.public());
    let (b, k) = (tb.bucket.clone(), key.clone());
    tokio::task::block_in_place(|| {
        // 48 MiB: three 16 MiB parts, all in flight at once.
        let chain = RlChain::new(&ModelSpec::with_bf16_bytes(48 << 20), 2e-6, 3);
        let mut p = PublisherBuilder::new("unused").with_bucket(b).with_key(k).build().unwrap();
        p.publish(0, &chain.views()).unwrap();
        p.close().unwrap();
    });
    let reader = StreamReader::new(tb.bucket.clone(), trust);
    let (m, _) = reader.anchor(0).await.unwrap();
    let o = m.objects.iter().max_by_key(|o| o.object.size).unwrap().clone();

    // Intact: every part written once (plus the header), nothing after the call.
    let sink = Arc::new(Counting::default());
    let n = stream_shard(&tb.bucket, 0, &o, 4, sink.clone()).await.unwrap();
    assert_eq!(n, o.object.size);
    let parts = sink.writes.load(SeqCst) - 1;
    assert!(parts >= 3, "{parts} parts: the model should span several");

    // The first part's first plane no longer a zstd frame: its decode fails at once.
    let path = tb.root.as_ref().unwrap().join(layout::object(driftless_format::StepKind::Anchor, 0, &o.object.object));
    let mut bytes = std::fs::read(&path).unwrap();
    let size = bytes.len() as u64;
    let footer = bytes[bytes.len() - anchor::FOOTER_LEN as usize..].to_vec();
    let tr = anchor::table_range(&footer, size).unwrap();
    let plan = anchor::plan_shard(
        &bytes[..anchor::PREFIX_LEN as usize],
        &bytes[tr.start as usize..tr.end as usize],
        &footer,
        size,
        o.decoded_size,
    )
    .unwrap();
    let first = plan.chunks[0].stored.start as usize;
    for b in &mut bytes[first..first + 4] {
        *b ^= 0xFF;
    }
    std::fs::write(&path, &bytes).unwrap();
    let sink = Arc::new(Counting::default());
    let e = stream_shard(&tb.bucket, 0, &o, 4, sink.clone()).await.unwrap_err();
    sink.returned.store(true, SeqCst);
    assert!(e.to_string().contains("zstd"), "{e}");
    // Decodes still in flight when it returned would write now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(sink.late.load(SeqCst), 0, "writes landed after stream_shard returned its error");
    assert!(sink.writes.load(SeqCst) <= parts, "parts after the error were written");
}
