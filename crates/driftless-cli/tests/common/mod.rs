//! Helpers shared by the CLI's integration tests: the binary under test, a checkpoint of a
//! generated chain, and the SeaweedFS server CI starts.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::Path;
use std::process::Command;

use driftless_format::gen::RlChain;
use driftless_format::{checkpoint, Layout};

/// The `driftless` binary built for these tests.
pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_driftless"))
}

/// Writes the chain's current weights as a checkpoint in `dir`, in shards of at most `shard`
/// bytes.
pub fn write(chain: &RlChain, dir: &Path, shard: u64) {
    let layout = Layout::for_tensors(chain.metas(), shard).unwrap();
    checkpoint::write_checkpoint(dir, &layout, &chain.views()).unwrap();
}

/// `(endpoint, bucket)` of SeaweedFS, or `None` (skip) unless DRIFTLESS_REQUIRE_SERVERS=1.
pub fn seaweed() -> Option<(String, String)> {
    match std::env::var("DRIFTLESS_TEST_S3_SEAWEED") {
        Ok(v) => {
            let mut it = v.split_whitespace();
            Some((it.next()?.to_string(), it.next()?.to_string()))
        }
        Err(_) if std::env::var("DRIFTLESS_REQUIRE_SERVERS").as_deref() == Ok("1") => {
            panic!("DRIFTLESS_TEST_S3_SEAWEED not set and DRIFTLESS_REQUIRE_SERVERS=1")
        }
        Err(_) => {
            eprintln!("skipping: DRIFTLESS_TEST_S3_SEAWEED not set");
            None
        }
    }
}
