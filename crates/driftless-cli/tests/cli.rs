//! The real binary, end to end, in scratch directories.

use std::path::Path;
use std::process::Command;

use driftless_format::gen::{ModelSpec, RlChain};
use driftless_format::{checkpoint, Checkpoint, Layout};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_driftless"))
}

fn write(chain: &RlChain, dir: &Path, shard: u64) {
    let layout = Layout::for_tensors(chain.metas(), shard).unwrap();
    checkpoint::write_checkpoint(dir, &layout, &chain.views()).unwrap();
}

fn files_equal(a: &Path, b: &Path) {
    let mut n = 0;
    for e in std::fs::read_dir(a).unwrap() {
        let e = e.unwrap();
        let other = std::fs::read(b.join(e.file_name())).unwrap();
        assert!(std::fs::read(e.path()).unwrap() == other, "{:?} differs", e.file_name());
        n += 1;
    }
    assert!(n > 0);
}

#[test]
fn diff_patch_hash_round_trip() {
    let t = tempfile::tempdir().unwrap();
    let p = |s: &str| t.path().join(s);
    assert!(bin().args(["keygen", "--out"]).arg(p("key")).status().unwrap().success());
    let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(2 << 20), 1e-6, 9);
    write(&chain, &p("base"), 1 << 20);
    chain.step();
    write(&chain, &p("target"), 1 << 20);
    let st = bin()
        .args(["diff"])
        .arg(p("base"))
        .arg(p("target"))
        .arg("-o")
        .arg(p("d.delta"))
        .arg("--key")
        .arg(p("key"))
        .status()
        .unwrap();
    assert!(st.success());
    // Signed by a trusted key: patch reproduces the target byte for byte.
    let st = bin()
        .arg("patch")
        .arg(p("base"))
        .arg(p("d.delta"))
        .arg("-o")
        .arg(p("out"))
        .arg("--trust")
        .arg(p("key.pub"))
        .status()
        .unwrap();
    assert!(st.success());
    files_equal(&p("target"), &p("out"));
    // No trusted key: refused with exit code 1, nothing written.
    let st = bin().arg("patch").arg(p("base")).arg(p("d.delta")).arg("-o").arg(p("out2")).status().unwrap();
    assert_eq!(st.code(), Some(1));
    assert!(!p("out2").exists());
    // Wrong base: refused with exit code 1.
    let st = bin()
        .arg("patch")
        .arg(p("target"))
        .arg(p("d.delta"))
        .arg("-o")
        .arg(p("out3"))
        .arg("--trust")
        .arg(p("key.pub"))
        .status()
        .unwrap();
    assert_eq!(st.code(), Some(1));
    // hash prints the root and nothing else.
    let o = bin().arg("hash").arg(p("target")).output().unwrap();
    let (_, root) = driftless_format::weights_root(&Checkpoint::open(p("target")).unwrap().views());
    assert_eq!(String::from_utf8(o.stdout).unwrap(), format!("{root}\n"));
    // inspect --json describes it.
    // With AWS_ENDPOINT_URL set (as in CI), inspecting a file must not ask for --bucket.
    let o = bin()
        .arg("inspect")
        .arg(p("d.delta"))
        .arg("--json")
        .arg("--trust")
        .arg(p("key.pub"))
        .env("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["data"]["result_root"], root.to_hex());
    assert!(v["data"]["signature"].as_str().unwrap().starts_with("verified"));
}

/// SIGKILL `driftless agent --once` at random points of syncing; the state file must never
/// describe bytes it does not hold, and the final sync must recover without an anchor.
#[test]
fn agent_survives_sigkill_loop() {
    let t = tempfile::tempdir().unwrap();
    let p = |s: &str| t.path().join(s);
    assert!(bin().args(["keygen", "--out"]).arg(p("key")).status().unwrap().success());
    let url = format!("file://{}", p("bucket").display());
    let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(8 << 20), 1e-6, 4);
    let publish = |chain: &RlChain, step: u64| {
        let d = p(&format!("ckpt{step}"));
        write(chain, &d, 4 << 20);
        let st = bin()
            .args(["publish", "--bucket", &url, "--anchor-every", "1000", "--step", &step.to_string(), "--state"])
            .arg(p("pstate"))
            .arg("--key")
            .arg(p("key"))
            .arg(&d)
            .status()
            .unwrap();
        assert!(st.success());
    };
    let agent = || {
        let mut c = bin();
        c.args(["agent", "--once", "--json", "--bucket", &url, "--trust"])
            .arg(p("key.pub"))
            .arg("--dir")
            .arg(p("agent"));
        c
    };
    publish(&chain, 0);
    assert!(agent().status().unwrap().success());
    let iterations: u64 = std::env::var("DRIFTLESS_KILL_ITERATIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(100);
    let mut seed = 0x1234_5678u64;
    let mut step = 0;
    for i in 0..iterations {
        if i % 10 == 0 {
            chain.step();
            step += 1;
            publish(&chain, step);
        }
        let log = std::fs::File::create(p(&format!("agent-{i}.log"))).unwrap();
        let mut child =
            agent().env("DRIFTLESS_LOG", "info").stdout(std::process::Stdio::null()).stderr(log).spawn().unwrap();
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        std::thread::sleep(std::time::Duration::from_micros((seed >> 33) % 60_000));
        let _ = child.kill();
        let _ = child.wait();
        // Zero unverified serves: whenever the state says "step s, root r" and no apply is in
        // flight, the directory hashes to r.
        let Ok(state) = std::fs::read(p("agent/state.json")) else {
            let logs: Vec<String> = (i.saturating_sub(2)..=i)
                .map(|k| std::fs::read_to_string(p(&format!("agent-{k}.log"))).unwrap_or_default())
                .collect();
            panic!("iteration {i}: state.json vanished; last agent logs:\n{}", logs.join("\n----\n"));
        };
        let s: serde_json::Value = serde_json::from_slice(&state).unwrap();
        // `current` is a symlink to the active slot: never missing, always the state's step.
        let link = std::fs::read_link(p("agent/current")).unwrap_or_else(|e| panic!("iteration {i}: current: {e}"));
        assert_eq!(link, std::path::Path::new("slots").join(s["active"].as_str().unwrap()), "iteration {i}");
        let (_, root) = driftless_format::weights_root(&Checkpoint::open(p("agent/current")).unwrap().views());
        assert_eq!(
            s["root"].as_str().unwrap(),
            root.to_hex(),
            "iteration {i}: state names bytes the directory does not hold"
        );
    }
    // The loop must actually have killed agents in the middle of building a step (planned,
    // never finished), or it proves nothing.
    let logs: Vec<String> =
        (0..iterations).map(|k| std::fs::read_to_string(p(&format!("agent-{k}.log"))).unwrap_or_default()).collect();
    let interrupted = logs.iter().filter(|l| l.contains("sync plan") && !l.contains("synced step")).count();
    let all: String = logs.concat();
    let anchors = all.matches("anchor loaded").count();
    eprintln!("{iterations} kills: {interrupted} builds interrupted, {anchors} anchor downloads");
    assert!(interrupted > 0, "no kill landed inside a build");
    assert_eq!(anchors, 0, "recovery from local state must not download an anchor");
    let o = agent().output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["data"]["step"], step);
    assert_ne!(v["data"]["route"], "anchor", "recovery from local state must not download an anchor");
    let got = Checkpoint::open(p("agent/current")).unwrap();
    for w in chain.views() {
        assert!(got.views().iter().any(|g| g.name == w.name && g.data == w.data), "{} differs", w.name);
    }
}

/// `--config FILE` fills flags; a flag on the command line wins over the file.
#[test]
fn agent_config_file_and_precedence() {
    let t = tempfile::tempdir().unwrap();
    let p = |s: &str| t.path().join(s);
    assert!(bin().args(["keygen", "--out"]).arg(p("key")).status().unwrap().success());
    let url = format!("file://{}", p("bucket").display());
    let chain = RlChain::new(&ModelSpec::with_bf16_bytes(1 << 20), 1e-6, 2);
    write(&chain, &p("ckpt"), 1 << 30);
    let st = bin()
        .args(["publish", "--bucket", &url, "--step", "0", "--state"])
        .arg(p("pstate"))
        .arg("--key")
        .arg(p("key"))
        .arg(p("ckpt"))
        .status()
        .unwrap();
    assert!(st.success());
    let cfg = serde_json::json!({"bucket": url, "trust": [p("key.pub")], "dir": p("from-file"), "poll-min": "100ms"});
    std::fs::write(p("agent.json"), cfg.to_string()).unwrap();
    let st =
        bin().args(["agent", "--once", "--config"]).arg(p("agent.json")).env_remove("DRIFTLESS_DIR").status().unwrap();
    assert!(st.success());
    assert!(p("from-file/state.json").exists());
    let st = bin()
        .args(["agent", "--once", "--config"])
        .arg(p("agent.json"))
        .arg("--dir")
        .arg(p("from-flag"))
        .status()
        .unwrap();
    assert!(st.success());
    assert!(p("from-flag/state.json").exists());
    // An unknown key is an error, not silently ignored.
    std::fs::write(p("bad.json"), r#"{"buckett": "x"}"#).unwrap();
    let o = bin().args(["agent", "--once", "--config"]).arg(p("bad.json")).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown key"));
}

/// `publish --watch DIR --once` publishes every complete `step_N` in order; an agent then lands
/// on the last one bit for bit. An incomplete entry (not a valid checkpoint yet) stops the scan.
#[test]
fn publish_watch_follows_a_directory() {
    let t = tempfile::tempdir().unwrap();
    let p = |s: &str| t.path().join(s);
    assert!(bin().args(["keygen", "--out"]).arg(p("key")).status().unwrap().success());
    let url = format!("file://{}", p("bucket").display());
    let mut chain = RlChain::new(&ModelSpec::with_bf16_bytes(1 << 20), 1e-6, 6);
    std::fs::create_dir_all(p("ckpts")).unwrap();
    for step in 0..4u64 {
        if step > 0 {
            chain.step();
        }
        write(&chain, &p(&format!("ckpts/step_{step}")), 1 << 30);
    }
    // A checkpoint still being written: a truncated file.
    std::fs::create_dir_all(p("ckpts/step_4")).unwrap();
    std::fs::write(p("ckpts/step_4/model.safetensors"), b"\x10\x00\x00").unwrap();
    let o = bin()
        .args(["publish", "--json", "--once", "--bucket", &url, "--watch"])
        .arg(p("ckpts"))
        .arg("--state")
        .arg(p("pstate"))
        .arg("--key")
        .arg(p("key"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let steps: Vec<u64> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["data"]["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [0, 1, 2, 3]);
    let o = bin()
        .args(["agent", "--once", "--json", "--bucket", &url, "--trust"])
        .arg(p("key.pub"))
        .arg("--dir")
        .arg(p("agent"))
        .output()
        .unwrap();
    assert!(o.status.success());
    let got = Checkpoint::open(p("agent/current")).unwrap();
    for w in chain.views() {
        assert!(got.views().iter().any(|g| g.name == w.name && g.data == w.data), "{} differs", w.name);
    }
    // Running again publishes nothing new (state remembers step 3).
    let o = bin()
        .args(["publish", "--json", "--once", "--bucket", &url, "--watch"])
        .arg(p("ckpts"))
        .arg("--state")
        .arg(p("pstate"))
        .arg("--key")
        .arg(p("key"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(o.stdout.is_empty());
}
