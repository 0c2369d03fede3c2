//! Sharded publishing end to end on a file:// bucket: rank threads, each with its own
//! `ShardedPublisher`, publish row-, column- and flat-sharded tensors, a tensor one rank holds
//! whole and a replicated one; the real `driftless agent` (cold, then following) must end bit
//! for bit on the gathered model. Refusals: a missing rank and overlapping slices leave no
//! ready marker, and the next step commits. (The 4- and 8-process runs on SeaweedFS are in
//! `crates/driftless-py/tests/test_sharded.py`.)

mod common;

use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::{agent_once, bin};
use driftless_format::slice::Slice;
use driftless_format::{Checkpoint, DType, Keypair};
use driftless_publisher::{PartKind, PublisherBuilder, Shard, ShardedPublisher, StepOutcome};

/// The gathered model of one step: (name, shape, bytes).
type Model = Vec<(String, Vec<u64>, Vec<u8>)>;

fn model_chain(steps: usize) -> Vec<Model> {
    let shapes: [(&str, Vec<u64>); 5] = [
        ("a.row", vec![600, 2048]),
        ("b.col", vec![300, 4096]),
        ("c.flat", vec![1000, 1500]),
        ("d.whole", vec![512, 512]),
        ("e.replicated", vec![4096]),
    ];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut m: Model = shapes
        .iter()
        .map(|(n, s)| {
            let len = s.iter().product::<u64>() as usize * 2;
            (n.to_string(), s.clone(), (0..len).map(|_| rnd() as u8).collect())
        })
        .collect();
    let mut out = vec![m.clone()];
    for _ in 1..steps {
        // About 1% of elements change by one ulp-ish bit flip.
        for (_, _, d) in &mut m {
            let n = d.len() / 2;
            for _ in 0..n / 100 {
                let i = (rnd() as usize % n) * 2;
                d[i] ^= 1;
            }
        }
        out.push(m.clone());
    }
    out
}

/// Tensor name and slice, per shard a rank publishes.
type Specs = Vec<(&'static str, Slice)>;

/// The slices rank `r` of 4 publishes.
fn slices_of(r: u64) -> Specs {
    let row = [(0, 150), (150, 170), (320, 130), (450, 150)][r as usize];
    let col = [(0, 1000), (1000, 1100), (2100, 996), (3096, 1000)][r as usize];
    let flat = [(0, 300_000), (300_000, 500_000), (800_000, 100_000), (900_000, 600_000)][r as usize];
    let mut v = vec![
        ("a.row", Slice::block(&[600, 2048], 0, row.0, row.1).unwrap()),
        ("b.col", Slice::block(&[300, 4096], 1, col.0, col.1).unwrap()),
        ("c.flat", Slice::flat(&[1000, 1500], flat.0, flat.1).unwrap()),
    ];
    if r == 2 {
        v.push(("d.whole", Slice::block(&[512, 512], 0, 0, 512).unwrap()));
    }
    // Every rank holds e.replicated; only rank 0 (replica 0) publishes it.
    if r == 0 {
        v.push(("e.replicated", Slice::block(&[4096], 0, 0, 4096).unwrap()));
    }
    v
}

/// The bytes of `slice` cut out of a gathered tensor.
fn cut(data: &[u8], slice: &Slice) -> Vec<u8> {
    slice.byte_runs(DType::BF16).iter().flat_map(|&(s, l)| data[s as usize..(s + l) as usize].iter().copied()).collect()
}

type Cut = (&'static str, Vec<u64>, Slice, Vec<u8>);

fn shards(cuts: &[Cut]) -> Vec<Shard<'_>> {
    cuts.iter()
        .map(|(n, shape, s, d)| Shard { name: n, dtype: DType::BF16, shape, slice: s.clone(), data: d })
        .collect()
}

fn rank_cuts(model: &Model, specs: &[(&'static str, Slice)]) -> Vec<Cut> {
    specs
        .iter()
        .map(|(n, s)| {
            let (_, shape, d) = model.iter().find(|(m, _, _)| m == n).unwrap();
            (*n, shape.clone(), s.clone(), cut(d, s))
        })
        .collect()
}

/// The parts of steps 1-5 with `anchor_every(3)`: (kind, with the slices). Step 1 is an
/// anchor; step 4 is a delta whose slices the committer gathers into anchor 4 afterwards.
const SCHEDULE: [(PartKind, bool); 5] = [
    (PartKind::Anchor, true),
    (PartKind::Delta, false),
    (PartKind::Delta, false),
    (PartKind::Delta, true),
    (PartKind::Delta, false),
];

fn builder(url: &str, key: &Keypair) -> PublisherBuilder {
    PublisherBuilder::new(url).with_key(key.clone()).with_anchor_every(3)
}

fn agent(dir: &Path, url: &str, key_pub: &Path) {
    let o = agent_once(url, key_pub, dir).output().unwrap();
    assert!(o.status.success(), "agent failed: {}", String::from_utf8_lossy(&o.stderr));
}

/// Every tensor of `DIR/current` equals the gathered model, bit for bit.
fn assert_bit_exact(dir: &Path, model: &Model) {
    let ck = Checkpoint::open(dir.join("current")).unwrap();
    let views = ck.views();
    assert_eq!(views.len(), model.len());
    for (n, shape, d) in model {
        let v = views.iter().find(|v| v.name == n).unwrap_or_else(|| panic!("{n} missing"));
        assert_eq!(v.shape, shape.as_slice(), "{n}");
        assert!(v.data == d.as_slice(), "{n} differs from the gathered model");
    }
}

fn ready_steps(root: &Path, kind: &str) -> Vec<u64> {
    let mut v: Vec<u64> = std::fs::read_dir(root.join("bucket/ready").join(kind))
        .map(|it| it.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn four_ranks_publish_one_verified_chain() {
    let td = tempfile::tempdir().unwrap();
    let url = format!("file://{}", td.path().join("bucket").display());
    let key = Keypair::generate();
    std::fs::write(td.path().join("key.pub"), key.public_pem().unwrap()).unwrap();
    let chain = Arc::new(model_chain(5));
    let barrier = Arc::new(Barrier::new(5));
    let mut handles = vec![];
    for r in 0..4u64 {
        let (chain, barrier, url, key) = (chain.clone(), barrier.clone(), url.clone(), key.clone());
        handles.push(std::thread::spawn(move || {
            let mut p: ShardedPublisher =
                builder(&url, &key).with_new_stream(true).build_sharded(r, 4, Duration::from_secs(20)).unwrap();
            let mut kinds = vec![];
            for (step, model) in chain.iter().enumerate() {
                let cuts = rank_cuts(model, &slices_of(r));
                let rc = p.publish(step as u64 + 1, &shards(&cuts)).unwrap();
                kinds.push((rc.part, rc.slices));
                // The part is sent and (rank 0) the step committed after publish returns:
                // flush waits for the outcome, so it is known before the agent reads the step.
                let o = p.flush().unwrap_or_else(|e| panic!("rank {r}, step {}: {e}", step + 1));
                assert!(o.committed, "step {} not committed: {:?}", step + 1, o.reason);
                barrier.wait();
                barrier.wait();
            }
            p.close().unwrap();
            kinds
        }));
    }
    let (a, b) = (td.path().join("cold"), td.path().join("follow"));
    for (step, model) in chain.iter().enumerate() {
        barrier.wait();
        // The following agent takes every step (deltas from 4 parts through its fast path).
        agent(&b, &url, &td.path().join("key.pub"));
        assert_bit_exact(&b, model);
        if step == 2 {
            agent(&a, &url, &td.path().join("key.pub"));
            assert_bit_exact(&a, model);
        }
        barrier.wait();
    }
    for h in handles {
        let kinds = h.join().unwrap();
        assert_eq!(kinds, SCHEDULE);
    }
    // A cold agent at the end: anchor 4 + delta 5.
    agent(&a, &url, &td.path().join("key.pub"));
    assert_bit_exact(&a, chain.last().unwrap());
    assert_eq!(ready_steps(td.path(), "anchors"), vec![1, 4]);
    assert_eq!(ready_steps(td.path(), "deltas"), vec![2, 3, 4, 5]);
    // Anchor 4, gathered after its delta was committed, is what a cold agent must take once
    // delta 4 is gone: only anchor 4 + delta 5 reaches step 5.
    let marker = td.path().join("bucket/ready/deltas").join(format!("{:012}", 4));
    std::fs::remove_file(&marker).unwrap_or_else(|e| panic!("{}: {e}", marker.display()));
    let cold = td.path().join("cold-end");
    agent(&cold, &url, &td.path().join("key.pub"));
    assert_bit_exact(&cold, chain.last().unwrap());
}

/// Runs `world` rank threads over `steps`; `f(rank, step)` returns the slices to publish, or
/// `None` for a rank that dies before uploading its part of the step (it is restarted, with
/// nothing kept, for the next one). Returns rank 0's outcomes.
fn run_group(
    url: &str,
    key: &Keypair,
    world: u64,
    chain: &Arc<Vec<Model>>,
    f: fn(u64, u64) -> Option<Specs>,
) -> Vec<StepOutcome> {
    let mut handles = vec![];
    for r in 0..world {
        let (chain, url, key) = (chain.clone(), url.to_string(), key.clone());
        handles.push(std::thread::spawn(move || {
            let start = || builder(&url, &key).with_new_stream(true).build_sharded(r, world, Duration::from_secs(2));
            let mut p = start().unwrap();
            let mut out = vec![];
            for (i, model) in chain.iter().enumerate() {
                let step = i as u64 + 1;
                let Some(specs) = f(r, step) else {
                    drop(p);
                    p = start().unwrap();
                    continue;
                };
                let cuts = rank_cuts(model, &specs);
                let rc = p.publish(step, &shards(&cuts)).unwrap();
                // Each step's outcome comes with the next publish (and the last's from flush).
                out.extend(rc.previous);
            }
            let _ = p.flush();
            out.extend(p.last_outcome().cloned());
            out
        }));
    }
    let mut outs: Vec<Vec<StepOutcome>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    outs.swap_remove(0)
}

#[test]
fn a_missing_rank_leaves_no_ready_step_and_the_next_step_commits() {
    let td = tempfile::tempdir().unwrap();
    let url = format!("file://{}", td.path().join("bucket").display());
    let key = Keypair::generate();
    std::fs::write(td.path().join("key.pub"), key.public_pem().unwrap()).unwrap();
    let chain = Arc::new(model_chain(3));
    // Rank 3 dies before uploading its part of step 2 and comes back for step 3.
    let outs = run_group(&url, &key, 4, &chain, |r, step| (r != 3 || step != 2).then(|| slices_of(r)));
    assert_eq!(outs.len(), 3);
    assert!(outs[0].committed);
    assert!(!outs[1].committed && outs[1].next_anchor);
    assert!(outs[1].reason.as_deref().unwrap().contains("ranks [3]"), "{:?}", outs[1].reason);
    assert!(outs[2].committed && outs[2].of == Some(driftless_format::manifest::StepKind::Anchor));
    assert_eq!(ready_steps(td.path(), "anchors"), vec![1, 3]);
    assert_eq!(ready_steps(td.path(), "deltas"), Vec::<u64>::new());
    // The dead rank's step left parts behind (and anchor steps leave their part manifests);
    // with the group's lease released, GC removes them and keeps the ready anchors.
    let step_dir = |kind: &str, s: u64| td.path().join(format!("bucket/{kind}/{s:012}"));
    assert!(std::fs::read_dir(step_dir("deltas", 2)).unwrap().count() > 0);
    let o = bin().args(["gc", "--grace", "0s", "--bucket", &url]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let left = |d: std::path::PathBuf| std::fs::read_dir(d).map(|it| it.count()).unwrap_or(0);
    assert_eq!(left(step_dir("deltas", 2)), 0);
    assert_eq!(left(step_dir("deltas", 3)), 0);
    assert!(left(step_dir("anchors", 3)) > 0);
    let a = td.path().join("a");
    agent(&a, &url, &td.path().join("key.pub"));
    assert_bit_exact(&a, &chain[2]);
}

#[test]
fn overlapping_slices_are_refused_at_commit() {
    let td = tempfile::tempdir().unwrap();
    let url = format!("file://{}", td.path().join("bucket").display());
    let key = Keypair::generate();
    std::fs::write(td.path().join("key.pub"), key.public_pem().unwrap()).unwrap();
    let chain = Arc::new(model_chain(3));
    // At step 1 rank 1 claims rows 140..320 of a.row, overlapping rank 0's 0..150 (its other
    // slices stay). Steps 2 and 3 are correct again: an anchor (nothing was committed yet),
    // then a delta.
    let outs = run_group(&url, &key, 4, &chain, |r, step| {
        let mut v = slices_of(r);
        if r == 1 && step == 1 {
            v[0].1 = Slice::block(&[600, 2048], 0, 140, 180).unwrap();
        }
        Some(v)
    });
    assert!(!outs[0].committed);
    let reason = outs[0].reason.as_deref().unwrap();
    assert!(reason.contains("a.row") && reason.contains("overlap"), "{reason}");
    assert!(outs[1].committed && outs[2].committed);
    assert_eq!(ready_steps(td.path(), "anchors"), vec![2]);
    assert_eq!(ready_steps(td.path(), "deltas"), vec![3]);
    let a = td.path().join("a");
    agent(&a, &url, &td.path().join("key.pub"));
    assert_bit_exact(&a, &chain[2]);
}

/// The gathered model as views for the single-process publisher.
fn views(model: &Model) -> Vec<driftless_format::TensorView<'_>> {
    model
        .iter()
        .map(|(n, s, d)| driftless_format::TensorView { name: n, dtype: DType::BF16, shape: s, data: d })
        .collect()
}

#[test]
fn mixed_stream_single_then_sharded_then_single() {
    let td = tempfile::tempdir().unwrap();
    let url = format!("file://{}", td.path().join("bucket").display());
    let key = Keypair::generate();
    let key_pub = td.path().join("key.pub");
    std::fs::write(&key_pub, key.public_pem().unwrap()).unwrap();
    let chain = Arc::new(model_chain(6));
    let follow = td.path().join("follow");
    // Steps 1-2 from one process holding the whole model.
    let mut p = builder(&url, &key).with_new_stream(true).build().unwrap();
    for s in 0..2 {
        p.publish(s as u64 + 1, &views(&chain[s])).unwrap();
    }
    p.close().unwrap();
    agent(&follow, &url, &key_pub);
    assert_bit_exact(&follow, &chain[1]);
    // Steps 3-4 from 4 ranks (the ranks hold no copy yet: step 3 is an anchor, 4 a delta).
    let handles: Vec<_> = (0..4u64)
        .map(|r| {
            let (chain, url, key) = (chain.clone(), url.clone(), key.clone());
            std::thread::spawn(move || {
                let mut p = builder(&url, &key).build_sharded(r, 4, Duration::from_secs(20)).unwrap();
                let mut kinds = vec![];
                for s in 2..4 {
                    let cuts = rank_cuts(&chain[s], &slices_of(r));
                    let rc = p.publish(s as u64 + 1, &shards(&cuts)).unwrap();
                    if let Some(o) = rc.previous {
                        assert!(o.committed, "{:?}", o.reason);
                    }
                    kinds.push((rc.part, rc.slices));
                }
                // An error unless the last step was committed.
                p.close().unwrap();
                kinds
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), vec![(PartKind::Anchor, true), (PartKind::Delta, false)]);
    }
    agent(&follow, &url, &key_pub);
    assert_bit_exact(&follow, &chain[3]);
    // Steps 5-6 from one process again.
    let mut p = builder(&url, &key).build().unwrap();
    for s in 4..6 {
        p.publish(s as u64 + 1, &views(&chain[s])).unwrap();
    }
    p.close().unwrap();
    agent(&follow, &url, &key_pub);
    assert_bit_exact(&follow, &chain[5]);
    assert_eq!(ready_steps(td.path(), "anchors"), vec![1, 3, 5]);
    assert_eq!(ready_steps(td.path(), "deltas"), vec![2, 4, 6]);
}

/// A rank that uploaded its part of a step and was restarted uploads the same step again (a
/// trainer resuming from its checkpoint): the committer sees two parts of that rank, cannot
/// know which is current, and commits neither; the step after is an anchor and commits.
#[test]
fn a_restarted_rank_next_to_its_predecessors_part_is_refused() {
    let td = tempfile::tempdir().unwrap();
    let url = format!("file://{}", td.path().join("bucket").display());
    let key = Keypair::generate();
    std::fs::write(td.path().join("key.pub"), key.public_pem().unwrap()).unwrap();
    let chain = Arc::new(model_chain(3));
    // The other ranks upload step 2 only after both of rank 3's parts are there, so the
    // committer always sees both (never commits the first alone).
    let both_up = Arc::new(Barrier::new(4));
    let handles: Vec<_> = (0..4u64)
        .map(|r| {
            let (chain, url, key, both_up) = (chain.clone(), url.clone(), key.clone(), both_up.clone());
            std::thread::spawn(move || {
                let start = || builder(&url, &key).with_new_stream(true).build_sharded(r, 4, Duration::from_secs(3));
                let mut p = start().unwrap();
                let mut outs = vec![];
                for (i, model) in chain.iter().enumerate() {
                    let step = i as u64 + 1;
                    if r == 3 && step == 2 {
                        // The first process uploads its part of step 2 and dies; the restarted
                        // one publishes step 2 from other weights (step 3's).
                        let cuts = rank_cuts(model, &slices_of(r));
                        p.publish(step, &shards(&cuts)).unwrap();
                        drop(p);
                        p = start().unwrap();
                        let cuts = rank_cuts(&chain[2], &slices_of(r));
                        p.publish(step, &shards(&cuts)).unwrap();
                        // The part is sent in the background: wait until both are there.
                        let dir =
                            std::path::Path::new(url.strip_prefix("file://").unwrap()).join("deltas/000000000002");
                        let t = std::time::Instant::now();
                        while std::fs::read_dir(&dir).map_or(0, |d| {
                            d.flatten()
                                .filter(|e| {
                                    let n = e.file_name().to_string_lossy().to_string();
                                    n.contains("-r00003-") && n.ends_with("-part.json")
                                })
                                .count()
                        }) < 2
                        {
                            assert!(t.elapsed() < Duration::from_secs(60), "rank 3's second part never arrived");
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        both_up.wait();
                        continue;
                    }
                    if step == 2 {
                        both_up.wait();
                    }
                    let cuts = rank_cuts(model, &slices_of(r));
                    outs.extend(p.publish(step, &shards(&cuts)).unwrap().previous);
                }
                let _ = p.flush();
                outs.extend(p.last_outcome().cloned());
                outs
            })
        })
        .collect();
    let outs: Vec<Vec<StepOutcome>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let o = &outs[0];
    assert!(o[0].committed);
    assert!(!o[1].committed && o[1].next_anchor, "{:?}", o[1]);
    assert!(o[1].reason.as_deref().unwrap().contains("rank 3 has two parts"), "{:?}", o[1].reason);
    assert!(o[2].committed && o[2].of == Some(driftless_format::manifest::StepKind::Anchor), "{:?}", o[2]);
    assert_eq!(ready_steps(td.path(), "deltas"), Vec::<u64>::new());
    let a = td.path().join("a");
    agent(&a, &url, &td.path().join("key.pub"));
    assert_bit_exact(&a, &chain[2]);
}

/// `publish` returns before its part is sent and before the commit: one thread can drive all
/// four ranks in turn, rank 0 first (when rank 0 committed inside `publish`, its call waited
/// the commit timeout for parts no one could send yet, and refused the step). Every rank
/// overwrites its slices the instant `publish` returns, as an optimizer would, and the steps
/// the agent reads must hold what was passed, bit for bit, anchors and deltas alike (the
/// borrow of the slices ends with the call, so this guards the copy inside `publish`, not
/// Rust's lifetimes).
#[test]
fn publish_returns_before_the_commit_and_never_reads_the_slices_again() {
    let td = tempfile::tempdir().unwrap();
    let url = format!("file://{}", td.path().join("bucket").display());
    let key = Keypair::generate();
    let key_pub = td.path().join("key.pub");
    std::fs::write(&key_pub, key.public_pem().unwrap()).unwrap();
    let chain = model_chain(5);
    let timeout = Duration::from_secs(20);
    let mut ranks: Vec<ShardedPublisher> = vec![];
    for r in 0..4 {
        ranks.push(builder(&url, &key).with_new_stream(true).build_sharded(r, 4, timeout).unwrap());
    }
    let follow = td.path().join("follow");
    let mut kinds = vec![];
    for (i, model) in chain.iter().enumerate() {
        let step = i as u64 + 1;
        for (r, p) in ranks.iter_mut().enumerate() {
            let mut cuts = rank_cuts(model, &slices_of(r as u64));
            let t = std::time::Instant::now();
            let rc = p.publish(step, &shards(&cuts)).unwrap();
            assert!(t.elapsed() < timeout / 2, "rank {r}, step {step}: publish waited {:?}", t.elapsed());
            if let Some(o) = &rc.previous {
                assert!(o.committed && o.step == step - 1, "rank {r}: {o:?}");
                assert_eq!(rc.previous_part.as_ref().map(|p| p.step), Some(step - 1), "rank {r}");
            }
            if r == 0 {
                kinds.push((rc.part, rc.slices));
            }
            for (_, _, _, d) in &mut cuts {
                d.iter_mut().for_each(|x| *x = x.wrapping_add(0x5b));
            }
        }
        if step == 2 || step == 5 {
            for (r, p) in ranks.iter_mut().enumerate() {
                let o = p.flush().unwrap_or_else(|e| panic!("rank {r}, step {step}: {e}"));
                assert!(o.committed && o.step == step, "rank {r}: {o:?}");
                let part = p.last_part().unwrap_or_else(|| panic!("rank {r}: no part report"));
                assert!(part.step == step && part.bytes > 0, "rank {r}: {part:?}");
                assert_eq!(part.commit_secs > 0.0, r == 0, "rank {r}: {part:?}");
            }
            agent(&follow, &url, &key_pub);
            assert_bit_exact(&follow, model);
        }
    }
    for p in ranks {
        p.close().unwrap();
    }
    assert_eq!(kinds, SCHEDULE);
    assert_eq!(ready_steps(td.path(), "anchors"), vec![1, 4]);
    assert_eq!(ready_steps(td.path(), "deltas"), vec![2, 3, 4, 5]);
}
