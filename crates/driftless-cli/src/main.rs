//! `driftless`: thin command-line front end. Each subcommand lives in `cmd/`; they parse
//! flags and call the libraries.
//!
//! Exit codes: 0 success; 1 verification failed (bad signature, untrusted key, corrupt object,
//! wrong base, weights root mismatch); 2 any other error (usage, I/O, network). The mapping
//! lives in `exit.rs`, one for every command.

use clap::{Parser, Subcommand};

mod cmd;
mod config;
mod exit;

/// Ship RL policy weights from a trainer to inference servers through object storage, bit
/// for bit, as small sparse deltas.
#[derive(Parser, Debug)]
#[command(name = "driftless", version, about)]
struct Cli {
    /// Log filter (tracing EnvFilter syntax, e.g. `info` or `warn,driftless_agent=debug`);
    /// also DRIFTLESS_LOG, then RUST_LOG. Default: driftless's own `info` logs for a
    /// continuous agent and `publish --watch`, `warn` otherwise. Logs go to stderr, coloured only on a terminal.
    #[arg(long, global = true, env = "DRIFTLESS_LOG")]
    log: Option<String>,
    /// Print logs as JSON lines (on stderr).
    #[arg(long, global = true)]
    log_json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run a simulated trainer and an agent on a local bucket and show what moves.
    Demo(cmd::demo::Args),
    /// Publish a checkpoint (or follow a directory of checkpoints) into a stream.
    Publish(cmd::publish::Args),
    /// Keep a local checkpoint on the newest verified step of a stream.
    Agent(cmd::agent::Args),
    /// Apply the retention policy to a stream.
    Gc(cmd::gc::Args),
    /// Generate an Ed25519 signing key: writes KEY (PKCS#8 PEM) and KEY.pub (SPKI PEM).
    Keygen(cmd::keygen::Args),
    /// Encode the delta from BASE to TARGET into one self-contained, signed delta file.
    Diff(cmd::diff::Args),
    /// Apply a delta file to BASE, verify the result and write it to OUT.
    Patch(cmd::patch::Args),
    /// Print the weights root of a checkpoint (hex, on stdout, nothing else).
    Hash(cmd::hash::Args),
    /// Describe a delta file, or a whole stream in a bucket.
    Inspect(cmd::inspect::Args),
    /// Measure payload ratios and throughput on a generated RL chain.
    Bench(cmd::bench::Args),
}

fn main() {
    // Die quietly on a closed pipe (`driftless inspect ... | head`), like other Unix tools,
    // instead of panicking inside println!.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    if let Err(e) = config::load_into_env(std::env::args_os()) {
        eprintln!("driftless: error: {}", exit::render(&e));
        eprintln!("driftless: {}", exit::Class::Fatal.advice());
        std::process::exit(2);
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help, --version, and a bare `driftless`: clap prints the help itself.
        Err(e) if !e.use_stderr() || e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            e.exit()
        }
        Err(e) => {
            eprintln!("driftless: error: {}", exit::usage_line(&e));
            eprintln!("driftless: {}", exit::Class::Fatal.advice());
            std::process::exit(2);
        }
    };
    // Long-running commands say what they do (each synced or published step) by default;
    // dependencies stay at warn (object_store logs every retry at info).
    const INFO: &str =
        "warn,driftless=info,driftless_agent=info,driftless_publisher=info,driftless_store=info,driftless_gc=info";
    let default_level = match &cli.cmd {
        Cmd::Agent(a) if !a.once() => INFO,
        Cmd::Publish(a) if a.watching() => INFO,
        _ => "warn",
    };
    init_logging(cli.log.as_deref(), default_level, cli.log_json);
    let r = match cli.cmd {
        Cmd::Demo(a) => cmd::demo::run(a),
        Cmd::Publish(a) => cmd::publish::run(a),
        Cmd::Agent(a) => cmd::agent::run(a),
        Cmd::Gc(a) => cmd::gc::run(a),
        Cmd::Keygen(a) => cmd::keygen::run(a),
        Cmd::Diff(a) => cmd::diff::run(a),
        Cmd::Patch(a) => cmd::patch::run(a),
        Cmd::Hash(a) => cmd::hash::run(a),
        Cmd::Inspect(a) => cmd::inspect::run(a),
        Cmd::Bench(a) => cmd::bench::run(a),
    };
    if let Err(e) = r {
        if is_broken_pipe(&e) {
            std::process::exit(0);
        }
        let class = exit::classify(&e);
        eprintln!("driftless: error: {}", exit::render(&e));
        eprintln!("driftless: {}", class.advice());
        std::process::exit(class.code());
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe))
}

/// Filter precedence: `--log` > DRIFTLESS_LOG (both through clap) > RUST_LOG > the command's
/// default. ANSI colours only when stderr is a terminal (not in files or Kubernetes logs).
fn init_logging(filter: Option<&str>, default_level: &str, json: bool) {
    use std::io::IsTerminal;
    let rust_log = std::env::var("RUST_LOG").ok().filter(|s| !s.trim().is_empty());
    let filter = filter.map(str::to_string).or(rust_log).unwrap_or_else(|| default_level.to_string());
    let f = match tracing_subscriber::EnvFilter::try_new(&filter) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("driftless: warning: log filter {filter:?} is invalid ({e}); using {default_level:?}");
            tracing_subscriber::EnvFilter::new(default_level)
        }
    };
    let b = tracing_subscriber::fmt()
        .with_env_filter(f)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    if json {
        b.json().init();
    } else {
        b.init();
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::{Path, PathBuf};

    use clap::{CommandFactory, Parser};

    #[test]
    fn cli_is_consistent() {
        super::Cli::command().debug_assert();
    }

    fn files(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                if !p.ends_with("__pycache__") {
                    files(&p, out);
                }
            } else {
                out.push(p);
            }
        }
    }

    const STOP: &[&str] = &["|", "||", "&&", ";", "&", ">", "2>", "2>&1", "#", ")", "\\"];

    /// `driftless SUBCOMMAND ARGS...` on one (continued) line of a script or document.
    fn shell_invocations(text: &str, subs: &BTreeSet<String>) -> Vec<Vec<String>> {
        let joined = text.replace("\\\n", " ");
        let mut out = vec![];
        for line in joined.lines() {
            let toks: Vec<&str> = line.split_whitespace().collect();
            for (i, t) in toks.iter().enumerate() {
                let name = t.trim_start_matches(['`', '(', '"', '\'']).rsplit('/').next().unwrap_or("");
                if name != "driftless" || t.ends_with('`') {
                    continue;
                }
                let Some(sub) = toks.get(i + 1) else { continue };
                if !subs.contains(*sub) {
                    continue;
                }
                let mut args = vec![sub.to_string()];
                for a in &toks[i + 2..] {
                    if STOP.contains(a) || a.starts_with(['#', '>', '<', '|', '&', ';']) || a.starts_with("2>") {
                        break;
                    }
                    let end = a.ends_with(['`', ')']);
                    let a = a.trim_end_matches(['`', ')']).trim_matches(['"', '\'']);
                    if !a.is_empty() {
                        args.push(a.to_string());
                    }
                    if end {
                        break;
                    }
                }
                out.push(args);
            }
        }
        out
    }

    /// Block-style YAML `args:` lists whose first item is a driftless subcommand.
    fn yaml_invocations(text: &str, subs: &BTreeSet<String>) -> Vec<Vec<String>> {
        let lines: Vec<&str> = text.lines().collect();
        let mut out = vec![];
        for (i, l) in lines.iter().enumerate() {
            let t = l.trim();
            if t != "args:" && t != "command:" {
                continue;
            }
            let mut items = vec![];
            for l in &lines[i + 1..] {
                let Some(item) = l.trim().strip_prefix("- ") else { break };
                items.push(item.trim().trim_matches(['"', '\'']).to_string());
            }
            if items.first().is_some_and(|f| f == "driftless") {
                items.remove(0);
            }
            if items.first().is_some_and(|f| subs.contains(f)) {
                out.push(items);
            }
        }
        out
    }

    /// Whether `driftless ARGS` parses (missing required flags allowed: they come from the
    /// environment there). A shell variable stands for some value: the line parses if one
    /// choice of sample values for its variables does.
    fn parses(args: &[String]) -> Result<(), String> {
        use clap::error::ErrorKind as K;
        const SAMPLES: &[&str] = &["1", "127.0.0.1:1", "exec=true", "1s", "http://127.0.0.1:1"];
        let vars: Vec<usize> = (0..args.len()).filter(|&i| args[i].contains('$')).collect();
        assert!(vars.len() <= 6, "too many shell variables in one command line: {args:?}");
        let mut first_error = None;
        for combo in 0..SAMPLES.len().pow(vars.len() as u32) {
            let mut argv = args.to_vec();
            let mut c = combo;
            for &i in &vars {
                argv[i] = SAMPLES[c % SAMPLES.len()].to_string();
                c /= SAMPLES.len();
            }
            match super::Cli::try_parse_from(std::iter::once("driftless".to_string()).chain(argv)) {
                Ok(_) => return Ok(()),
                Err(e) if matches!(e.kind(), K::MissingRequiredArgument | K::DisplayHelp | K::DisplayVersion) => {
                    return Ok(())
                }
                Err(e) => {
                    first_error.get_or_insert_with(|| e.to_string().lines().next().unwrap_or("").to_string());
                }
            }
        }
        Err(first_error.unwrap_or_default())
    }

    /// Every `driftless` command line in `docker/` and `examples/` parses with this CLI's own
    /// definition (flags, values), and every DRIFTLESS_* variable they name is one the code
    /// reads. Missing required flags are allowed: they come from the environment there.
    #[test]
    fn docker_and_examples_match_the_cli() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let cmd = super::Cli::command();
        let subs: BTreeSet<String> = cmd.get_subcommands().map(|c| c.get_name().to_string()).collect();
        let mut known_env: BTreeSet<String> = BTreeSet::new();
        for c in std::iter::once(&cmd).chain(cmd.get_subcommands()) {
            for a in c.get_arguments() {
                if let Some(e) = a.get_env() {
                    known_env.insert(e.to_string_lossy().into_owned());
                }
            }
        }
        // Variables the libraries read directly (`std::env::var("DRIFTLESS_...")`), and the
        // project's own test and CI knobs (DRIFTLESS_BIN...).
        let mut src = vec![];
        files(&root.join("crates"), &mut src);
        files(&root.join(".ci"), &mut src);
        files(&root.join("integration"), &mut src);
        for f in src.iter().filter(|f| f.extension().is_none_or(|e| e == "rs" || e == "py" || e == "sh")) {
            let Ok(text) = std::fs::read_to_string(f) else { continue };
            let quote = if f.extension().is_some_and(|e| e == "rs") { "\"DRIFTLESS_" } else { "DRIFTLESS_" };
            for part in text.split(quote).skip(1) {
                let name: String =
                    part.chars().take_while(|c| c.is_ascii_uppercase() || *c == '_' || c.is_ascii_digit()).collect();
                known_env.insert(format!("DRIFTLESS_{name}"));
            }
        }
        let mut checked = 0;
        let mut errors = vec![];
        let mut all = vec![];
        files(&root.join("docker"), &mut all);
        files(&root.join("examples"), &mut all);
        for f in &all {
            let Ok(text) = std::fs::read_to_string(f) else { continue };
            let yaml = f.extension().is_some_and(|e| e == "yaml" || e == "yml");
            let invocations = if yaml { yaml_invocations(&text, &subs) } else { shell_invocations(&text, &subs) };
            for args in invocations {
                checked += 1;
                if let Err(e) = parses(&args) {
                    errors.push(format!("{}: driftless {}: {e}", f.display(), args.join(" ")));
                }
            }
            for part in text.split("DRIFTLESS_").skip(1) {
                let name: String =
                    part.chars().take_while(|c| c.is_ascii_uppercase() || *c == '_' || c.is_ascii_digit()).collect();
                let name = format!("DRIFTLESS_{}", name.trim_end_matches('_'));
                if !known_env.contains(&name) {
                    errors.push(format!("{}: unknown environment variable {name}", f.display()));
                }
            }
        }
        assert!(errors.is_empty(), "{}", errors.join("\n"));
        assert!(checked >= 4, "found only {checked} driftless command lines: is the scanner broken?");
    }

    /// The scanner itself: a wrong flag is caught, so the test above can fail.
    #[test]
    fn flag_scanner_catches_unknown_flags() {
        let subs: BTreeSet<String> =
            super::Cli::command().get_subcommands().map(|c| c.get_name().to_string()).collect();
        let inv = shell_invocations("  driftless publish --takeover --bucket \"$B\" | tee x\n", &subs);
        assert_eq!(inv, vec![vec!["publish", "--takeover", "--bucket", "$B"]]);
        let inv = yaml_invocations("args:\n  - gc\n  - --max-bytes\n  - 10GB\n  - --no-such-flag\nenv:\n", &subs);
        assert_eq!(inv.len(), 1);
        assert!(parses(&inv[0]).unwrap_err().contains("--no-such-flag"));
        assert!(parses(&["agent".into(), "--listen".into(), "$ADDR".into(), "--notify".into(), "$HOOK".into()]).is_ok());
        assert!(parses(&["agent".into(), "--poll-min".into(), "soon".into()]).is_err());
    }
}
