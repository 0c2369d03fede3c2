//! `driftless`: thin command-line front end. Each subcommand lives in `cmd/`; they parse
//! flags and call the libraries.
//!
//! Exit codes: 0 success; 1 verification failed (bad signature, corrupt object, wrong base,
//! weights root mismatch); 2 any other error (usage, I/O, network).

use clap::{Parser, Subcommand};

mod cmd;
mod config;

/// Ship RL policy weights from a trainer to inference servers through object storage, bit
/// for bit, as small sparse deltas.
#[derive(Parser, Debug)]
#[command(name = "driftless", version, about)]
struct Cli {
    /// Log filter (tracing EnvFilter syntax), also from DRIFTLESS_LOG.
    #[arg(long, global = true, env = "DRIFTLESS_LOG", default_value = "warn")]
    log: String,
    /// Print logs as JSON lines.
    #[arg(long, global = true)]
    log_json: bool,
    /// JSON config file (also DRIFTLESS_CONFIG): keys are the long flag names
    /// (`{"bucket": "s3://b/p", "trust": ["k.pub"], "dir": "/w", "notify": ["sglang=http://..."]}`).
    /// Precedence: flag > environment variable > config file > default.
    #[arg(long, global = true, env = "DRIFTLESS_CONFIG")]
    config: Option<std::path::PathBuf>,
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
        eprintln!("driftless: error: {e:#}");
        std::process::exit(2);
    }
    let cli = Cli::parse();
    init_logging(&cli.log, cli.log_json);
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
        eprintln!("driftless: error: {e:#}");
        std::process::exit(cmd::exit_code(&e));
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe))
}

fn init_logging(filter: &str, json: bool) {
    let f =
        tracing_subscriber::EnvFilter::try_new(filter).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let b = tracing_subscriber::fmt().with_env_filter(f).with_writer(std::io::stderr);
    if json {
        b.json().init();
    } else {
        b.init();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
