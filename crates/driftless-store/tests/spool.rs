//! A spool whose process is SIGKILLed (no destructor runs) is removed by the next spool made
//! under the same parent; spools of live processes are not.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use driftless_store::spool::{Spool, PREFIX};

const CHILD: &str = "DRIFTLESS_SPOOL_CHILD";

fn spools(parent: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(parent)
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n.starts_with(PREFIX))
        .collect();
    v.sort();
    v
}

#[test]
fn the_spool_of_a_killed_process_is_swept_and_a_live_ones_kept() {
    if let Ok(parent) = std::env::var(CHILD) {
        // The child: a spool with data in it, then wait to be killed.
        let s = Spool::new(Some(Path::new(&parent)), "child").unwrap();
        std::fs::write(s.path().join("part"), vec![7u8; 1 << 20]).unwrap();
        std::fs::write(Path::new(&parent).join("child-ready"), b"").unwrap();
        std::thread::sleep(Duration::from_secs(120));
        return;
    }
    let parent = tempfile::tempdir().unwrap();
    let live = Spool::new(Some(parent.path()), "live").unwrap();
    let spawn = || {
        Command::new(std::env::current_exe().unwrap())
            .args(["the_spool_of_a_killed_process_is_swept_and_a_live_ones_kept", "--exact", "--nocapture"])
            .env(CHILD, parent.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let wait_ready = || {
        let t = Instant::now();
        while !parent.path().join("child-ready").exists() {
            assert!(t.elapsed() < Duration::from_secs(60), "the child never made its spool");
            std::thread::sleep(Duration::from_millis(20));
        }
        std::fs::remove_file(parent.path().join("child-ready")).unwrap();
    };
    // A live child's spool survives a sweep by another process.
    let mut alive = spawn();
    wait_ready();
    let before = spools(parent.path());
    assert_eq!(before.len(), 2, "{before:?}");
    let other = Spool::new(Some(parent.path()), "other").unwrap();
    assert_eq!(spools(parent.path()).len(), 3, "a live process's spool was swept");
    drop(other);
    // Killed: nothing of it runs, its spool stays until the next spool is made.
    alive.kill().unwrap();
    alive.wait().unwrap();
    let child_spool = before.iter().find(|n| n.contains("-child-")).unwrap().clone();
    assert!(parent.path().join(&child_spool).join("part").exists(), "SIGKILL runs no destructor");
    let next = Spool::new(Some(parent.path()), "next").unwrap();
    let after = spools(parent.path());
    assert!(!after.contains(&child_spool), "the dead process's spool was left: {after:?}");
    assert!(after.iter().any(|n| live.path().ends_with(n)), "our own live spool was swept: {after:?}");
    assert!(next.path().is_dir());
}
