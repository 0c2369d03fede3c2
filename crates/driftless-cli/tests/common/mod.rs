//! Helpers shared by the CLI's integration tests: the binary under test, a checkpoint of a
//! generated chain, and the SeaweedFS server CI starts.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::Path;
use std::process::Command;

use driftless_format::gen::RlChain;
use driftless_format::{checkpoint, Checkpoint, Layout};

/// The `driftless` binary built for these tests.
pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_driftless"))
}

/// `driftless agent --once --json` of the bucket at `url`, trusting the key `trust`, with its
/// directory at `dir`.
pub fn agent_once(url: &str, trust: &Path, dir: &Path) -> Command {
    let mut c = bin();
    c.args(["agent", "--once", "--json", "--bucket", url, "--trust"]).arg(trust).arg("--dir").arg(dir);
    c
}

/// `strace OPTS -o OUT` running the `driftless` binary (the caller adds its arguments), or a
/// clear failure when strace is missing (CI installs it: a missing tool is not a pass).
///
/// Nothing it starts outlives the test: the tracer gets SIGKILL when the test thread that
/// spawned it ends (`PR_SET_PDEATHSIG`), and so does the binary when its tracer dies (`setpriv
/// --pdeathsig`, util-linux, between the two: strace 6.1 has no `--kill-on-exit`, and a killed
/// strace leaves its tracee running). A test binary killed by the harness's timeout left traced
/// agents running before. (`setpriv` is one more program in the trace, before its `execve` of
/// the binary: its own `openat`/`close` of libraries show, no `pwrite64`, `fdatasync` or
/// `rename`, the calls the tests inject into; a test that counts `openat` would count its too.)
pub fn strace(opts: &[&str], out: &Path) -> Command {
    use std::os::unix::process::CommandExt;
    for tool in ["strace", "setpriv"] {
        assert!(
            Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success()),
            "{tool} is needed for this test (.ci/run installs it)"
        );
    }
    let mut c = Command::new("strace");
    c.args(opts).arg("-o").arg(out).args(["setpriv", "--pdeathsig", "KILL", env!("CARGO_BIN_EXE_driftless")]);
    // SAFETY: prctl(2) only, between fork and exec (async-signal-safe).
    unsafe {
        c.pre_exec(|| match libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        });
    }
    c
}

/// SIGKILLs a child process when dropped, so that a failed assertion does not leave it
/// running; disarmed (`.0 = None`) once the child is reaped (its pid may be reused).
pub struct KillOnDrop(pub Option<u32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            // SAFETY: plain kill(2) of our own child process, not yet reaped.
            unsafe {
                libc::kill(pid as i32, libc::SIGKILL);
            }
        }
    }
}

/// Polls `done` every 20 ms; fails the test with `what` after `secs` seconds.
pub fn wait_until(what: &str, secs: u64, mut done: impl FnMut() -> bool) {
    let t = std::time::Instant::now();
    while !done() {
        assert!(t.elapsed() < std::time::Duration::from_secs(secs), "{what}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
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

/// Checks an agent directory as a server restarted at this instant would find it: `current`
/// is a symlink to a slot (never missing), and that slot hashes to a root `state.json` vouches
/// for. Usually the active slot; in the window between the state.json rename and the symlink
/// rename, still the previous step, which state.json keeps as the inactive slot's verified
/// contents until the next start re-points `current`.
pub fn check_current_vouched(agent: &Path) -> Result<(), String> {
    let state = std::fs::read(agent.join("state.json")).map_err(|e| format!("state.json: {e}"))?;
    let s: serde_json::Value = serde_json::from_slice(&state).map_err(|e| format!("state.json: {e}"))?;
    let link = std::fs::read_link(agent.join("current")).map_err(|e| format!("current: {e}"))?;
    let active = Path::new("slots").join(s["active"].as_str().ok_or("state.json names no active slot")?);
    let want = if link == active {
        s["root"].as_str().ok_or("state.json has no root")?.to_string()
    } else {
        let held = &s["inactive"];
        if !held.is_object() {
            return Err(format!("current points at {link:?}, which state.json does not vouch for"));
        }
        held["root"].as_str().ok_or("no inactive root")?.to_string()
    };
    let ck = Checkpoint::open(agent.join("current")).map_err(|e| format!("current is no checkpoint: {e}"))?;
    let (_, root) = driftless_format::weights_root(&ck.views());
    if want != root.to_hex() {
        return Err(format!("current ({link:?}) holds bytes state.json does not name"));
    }
    Ok(())
}

/// Runs a command with a deadline (a hanging command fails the test instead of the CI job).
pub fn run_bounded(mut c: Command, secs: u64) -> std::process::Output {
    let child = c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    let t = std::time::Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output().unwrap()).unwrap());
    match rx.recv_timeout(std::time::Duration::from_secs(secs)) {
        Ok(o) => o,
        Err(_) => {
            // SAFETY: plain kill(2) of our own child.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            panic!("command did not finish within {secs} s ({:?})", t.elapsed());
        }
    }
}
