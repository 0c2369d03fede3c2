//! Agent benchmark: bytes moved and time for the fast path, a catch-up and a cold start, next
//! to downloading the full checkpoint from the same bucket in the same run; and fast-path
//! processing (decode + apply + verify, network excluded) next to hashing the model alone.
//!
//! ```text
//! cargo run --release -p driftless-agent --example agent_bench
//! BENCH_BYTES=268435456 BENCH_DELTAS=5 BENCH_LR=4e-7 cargo run --release ... # smaller model
//! ```
//!
//! Runs on a `file://` bucket in a temporary directory, and on SeaweedFS too when
//! `DRIFTLESS_TEST_S3_SEAWEED="ENDPOINT BUCKET"` is set (see `.ci/services.sh`).

use std::time::Instant;

use bytes::Bytes;
use driftless_agent::{Agent, AgentConfig, SyncOutcome};
use driftless_format::gen::{ModelSpec, RlChain};
use driftless_format::{Checkpoint, CheckpointMut, Keypair, StepKind, TrustSet};
use driftless_publisher::PublisherBuilder;
use driftless_store::stream::StreamReader;
use driftless_store::{Bucket, StoreOptions};
use futures::{StreamExt, TryStreamExt};

fn env<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d)
}

struct Row {
    what: String,
    bytes: u64,
    secs: f64,
}

fn mb(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn main() {
    let bytes: u64 = env("BENCH_BYTES", 1u64 << 30);
    let n: u64 = env("BENCH_DELTAS", 5);
    let lr: f32 = env("BENCH_LR", 4e-7);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let mut targets: Vec<(String, Bucket)> = vec![];
    let url = format!("file://{}", tmp.path().join("bucket").display());
    targets.push(("file://".into(), Bucket::open(&url, &StoreOptions::default()).unwrap()));
    if let Ok(spec) = std::env::var("DRIFTLESS_TEST_S3_SEAWEED") {
        let mut it = spec.split_whitespace();
        let (ep, b) = (it.next().unwrap().to_string(), it.next().unwrap().to_string());
        let url = format!("s3://{b}/bench-{}", std::process::id());
        let opts = StoreOptions::default().with_endpoint(ep).with_allow_http(true).with_region("us-east-1");
        targets.push(("seaweedfs".into(), Bucket::open(&url, &opts).unwrap()));
    }
    eprintln!("generating a {} MiB BF16 model", bytes >> 20);
    let t = Instant::now();
    let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(bytes), lr, 11);
    eprintln!("  {:.1}s", t.elapsed().as_secs_f64());
    let key = Keypair::from_seed([3; 32]);
    let trust = TrustSet::new().with_key(key.public());
    let mut pubs: Vec<_> = targets
        .iter()
        .map(|(_, b)| {
            PublisherBuilder::new("unused")
                .with_bucket(b.clone())
                .with_key(key.clone())
                .with_anchor_every(1_000_000)
                .build()
                .unwrap()
        })
        .collect();
    let publish = |pubs: &mut Vec<driftless_publisher::Publisher>, step: u64, chain: &RlChain| {
        for p in pubs.iter_mut() {
            let r = p.publish(step, &chain.views()).unwrap();
            p.flush().unwrap();
            eprintln!("  published step {step}: {r:?}");
        }
    };
    // Step 0 (anchor) plus the full checkpoint as plain safetensors, for the baseline.
    publish(&mut pubs, 0, &chain);
    let full = tmp.path().join("full");
    let layout =
        driftless_format::Layout::for_tensors(&chain.views().iter().map(|v| v.meta()).collect::<Vec<_>>(), 5 << 30)
            .unwrap();
    driftless_format::checkpoint::write_checkpoint(&full, &layout, &chain.views()).unwrap();
    let full_files: Vec<(String, Bytes)> = std::fs::read_dir(&full)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().to_string(), Bytes::from(std::fs::read(e.path()).unwrap()))
        })
        .collect();
    for (_, b) in &targets {
        rt.block_on(async {
            for (name, data) in &full_files {
                b.put(&format!("bench-full/{name}"), data.clone()).await.unwrap();
            }
        });
    }
    drop(full_files);
    let mut tables = vec![];
    let mut agents_b = vec![];
    for (i, (name, b)) in targets.iter().enumerate() {
        let mut ag =
            Agent::new(b.clone(), AgentConfig::new(tmp.path().join(format!("agent-b-{i}")), trust.clone())).unwrap();
        let o = rt.block_on(ag.sync_once()).unwrap();
        tables.push((name.clone(), vec![Row { what: "cold start: anchor only".into(), bytes: o.bytes, secs: o.secs }]));
        agents_b.push(ag);
    }
    for s in 1..=n {
        chain.step();
        publish(&mut pubs, s, &chain);
    }
    let row = |what: String, o: &SyncOutcome| Row {
        what: format!("{what} ({}, {} deltas)", o.route, o.deltas),
        bytes: o.bytes,
        secs: o.secs,
    };
    for (i, (_, b)) in targets.iter().enumerate() {
        let o = rt.block_on(agents_b[i].sync_once()).unwrap();
        assert_eq!(o.step, n);
        tables[i].1.push(row(format!("catch-up: {n} deltas"), &o));
        let mut a =
            Agent::new(b.clone(), AgentConfig::new(tmp.path().join(format!("agent-a-{i}")), trust.clone())).unwrap();
        let o = rt.block_on(a.sync_once()).unwrap();
        assert_eq!(o.step, n);
        tables[i].1.push(row(format!("cold start: anchor + {n} deltas"), &o));
    }
    // Scratch copy of step n for the network-free measurement.
    let scratch = tmp.path().join("scratch");
    copy_dir(&agents_b[0].current_dir(), &scratch);
    chain.step();
    publish(&mut pubs, n + 1, &chain);
    for (i, (_, b)) in targets.iter().enumerate() {
        let o = rt.block_on(agents_b[i].sync_once()).unwrap();
        assert_eq!(o.step, n + 1);
        tables[i].1.push(row("fast path: 1 delta".into(), &o));
        // Bit-exact against the trainer.
        let ck = Checkpoint::open(agents_b[i].current_dir()).unwrap();
        for (g, w) in ck.views().iter().zip(chain.views()) {
            assert!(g.name == w.name && g.data == w.data, "tensor {} differs", w.name);
        }
        // Baseline: download the full checkpoint (parallel GETs, one per shard file).
        let t = Instant::now();
        let got: u64 = rt.block_on(async {
            let list = b.list("bench-full/").await.unwrap();
            futures::stream::iter(list)
                .map(|o| async move { b.get(&o.key).await.map(|x| x.len() as u64) })
                .buffer_unordered(8)
                .try_fold(0u64, |a, x| async move { Ok(a + x) })
                .await
                .unwrap()
        });
        tables[i].1.push(Row {
            what: "baseline: GET the full safetensors checkpoint".into(),
            bytes: got,
            secs: t.elapsed().as_secs_f64(),
        });
    }
    // Network excluded: the delta n+1 in memory, applied to a copy of step n.
    let reader = StreamReader::new(targets[0].1.clone(), trust.clone());
    let (m, env_sha) = rt.block_on(reader.delta(n + 1)).unwrap();
    let segs: Vec<Bytes> = rt.block_on(async {
        futures::stream::iter(&m.segments)
            .then(|s| reader.object(StepKind::Delta, n + 1, &s.object.object, s.object.size, s.object.sha256))
            .try_collect()
            .await
            .unwrap()
    });
    let seg_refs: Vec<&[u8]> = segs.iter().map(|b| &b[..]).collect();
    let ck = Checkpoint::open(&scratch).unwrap();
    let t = Instant::now();
    let (_, base_root) = driftless_format::weights_root(&ck.views());
    let hash_secs = t.elapsed().as_secs_f64();
    drop(ck);
    let mut ckm = CheckpointMut::open(&scratch).unwrap();
    let jp = tmp.path().join("bench-journal");
    let t = Instant::now();
    driftless_format::ops::apply_in_place(&mut ckm, &m, env_sha, base_root, &seg_refs, Some(&jp)).unwrap();
    let apply_secs = t.elapsed().as_secs_f64();
    let model = Checkpoint::open(&scratch).unwrap().data_bytes();
    let seg_bytes: u64 = segs.iter().map(|s| s.len() as u64).sum();

    println!(
        "\nmodel: {:.0} MiB BF16, {n}-delta catch-up, lr {lr:e}, {} cores",
        mb(model),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    for (name, rows) in &tables {
        println!("\n{name}\n| {:<52} | {:>10} | {:>8} | {:>9} |", "operation", "MiB moved", "seconds", "MiB/s");
        println!("|{:-<54}|{:-<12}|{:-<10}|{:-<11}|", "", "", "", "");
        for r in rows {
            println!(
                "| {:<52} | {:>10.2} | {:>8.2} | {:>9.1} |",
                r.what,
                mb(r.bytes),
                r.secs,
                mb(r.bytes) / r.secs.max(1e-9)
            );
        }
    }
    println!("\nnetwork excluded (delta {} in memory: {:.2} MiB, {} segments)", n + 1, mb(seg_bytes), m.segments.len());
    println!("| {:<52} | {:>8} | {:>9} |", "operation", "seconds", "ratio");
    println!("|{:-<54}|{:-<10}|{:-<11}|", "", "", "");
    println!("| {:<52} | {:>8.3} | {:>9.2} |", "hash the model alone (weights root)", hash_secs, 1.0);
    println!(
        "| {:<52} | {:>8.3} | {:>9.2} |",
        "fast path: decode + apply (journaled) + verify",
        apply_secs,
        apply_secs / hash_secs
    );
    for p in pubs {
        p.close().unwrap();
    }
}
