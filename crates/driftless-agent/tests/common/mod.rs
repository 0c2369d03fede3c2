//! Helpers shared by the agent's integration tests.
#![allow(dead_code)]

use std::sync::Arc;

use driftless_agent::Agent;
use driftless_format::gen::RlChain;
use driftless_format::{Checkpoint, TensorView};
use driftless_store::object_store::local::LocalFileSystem;
use driftless_store::{Bucket, FaultyStore, StoreOptions};

/// A bucket under test: name, bucket, scratch dir (for file://, the bucket root is
/// `dir/bucket`).
pub struct TestBucket {
    pub name: String,
    pub bucket: Bucket,
    pub dir: tempfile::TempDir,
    /// Bucket root on disk (file:// only).
    pub root: Option<std::path::PathBuf>,
    /// The fault injector every call goes through.
    pub faults: Arc<FaultyStore>,
}

pub fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
    h.finish()
}

/// A file:// bucket behind a [`FaultyStore`].
pub fn file_bucket() -> TestBucket {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("bucket");
    std::fs::create_dir_all(&root).unwrap();
    let inner = Arc::new(LocalFileSystem::new_with_prefix(&root).unwrap());
    let faults = Arc::new(FaultyStore::new(inner));
    let bucket = Bucket::from_store(faults.clone(), "", &StoreOptions::default());
    TestBucket { name: "file".into(), bucket, dir, root: Some(root), faults }
}

/// SeaweedFS over S3 behind a [`FaultyStore`] when the CI started it (unique prefix per run).
pub fn seaweed_bucket(test: &str) -> Option<TestBucket> {
    match std::env::var("DRIFTLESS_TEST_S3_SEAWEED") {
        Ok(spec) => {
            let mut it = spec.split_whitespace();
            let (endpoint, bucket) = (it.next().unwrap().to_string(), it.next().unwrap().to_string());
            let url = format!("s3://{bucket}/agent-{test}-{:016x}", rand_u64());
            let opts = StoreOptions::default()
                .with_endpoint(endpoint)
                .with_allow_http(true)
                .with_region("us-east-1")
                .with_max_retries(2);
            let plain = Bucket::open(&url, &opts).unwrap();
            let faults = Arc::new(FaultyStore::new(plain.store().clone()));
            let bucket = Bucket::from_store(faults.clone(), plain.prefix(), &opts)
                .with_conditional_create(plain.supports_conditional_create());
            Some(TestBucket { name: "seaweedfs".into(), bucket, dir: tempfile::tempdir().unwrap(), root: None, faults })
        }
        Err(_) if std::env::var("DRIFTLESS_REQUIRE_SERVERS").as_deref() == Ok("1") => {
            panic!("DRIFTLESS_TEST_S3_SEAWEED not set")
        }
        Err(_) => None,
    }
}

/// file:// always, SeaweedFS when available.
pub fn buckets(test: &str) -> Vec<TestBucket> {
    let mut v = vec![file_bucket()];
    v.extend(seaweed_bucket(test));
    v
}

/// Owned copy of a chain's current tensors (name, bytes).
pub fn snapshot(chain: &RlChain) -> Vec<(String, Vec<u8>)> {
    chain.views().iter().map(|v| (v.name.to_string(), v.data.to_vec())).collect()
}

/// The agent's checkpoint holds exactly these bytes, and its state root is their hash.
pub fn assert_bits(agent: &Agent, want: &[(String, Vec<u8>)]) {
    let ck = Checkpoint::open(agent.current_dir()).unwrap();
    let got = ck.views();
    assert_eq!(got.len(), want.len());
    for (name, data) in want {
        let g = got.iter().find(|g| g.name == name).expect("tensor present");
        assert!(g.data == &data[..], "tensor {name} differs");
    }
    let (_, root) = driftless_format::weights_root(&got);
    assert_eq!(root, agent.state().unwrap().root);
}

/// The invariant of every test: whenever the agent claims a verified step, the files under
/// `current/` hash to that step's root.
pub fn assert_verified(agent: &Agent, ctx: &str) {
    if let Some(s) = agent.state() {
        let ck = Checkpoint::open(agent.current_dir())
            .unwrap_or_else(|e| panic!("{ctx}: state {} but no checkpoint: {e}", s.step));
        let views: Vec<TensorView<'_>> = ck.views();
        let (_, root) = driftless_format::weights_root(&views);
        assert_eq!(root, s.root, "{ctx}: agent claims step {} but its files hash differently", s.step);
    }
}

/// Agent settings for tests: refused steps are retried at the next sync (not after 30 s), so a
/// repaired bucket is picked up at once.
pub fn config(dir: impl Into<std::path::PathBuf>, trust: driftless_format::TrustSet) -> driftless_agent::AgentConfig {
    let mut c = driftless_agent::AgentConfig::new(dir, trust);
    c.refuse_for = std::time::Duration::ZERO;
    c
}
