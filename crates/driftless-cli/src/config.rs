//! The config file: a JSON object whose keys are long flag names. It is applied by setting the
//! flags' environment variables when they are not already set, so clap's own order gives
//! flag > environment > file > default.

use std::ffi::OsString;

use anyhow::{bail, Context, Result};

/// (config key, environment variable, list separator).
const KEYS: &[(&str, &str, &str)] = &[
    ("bucket", "DRIFTLESS_BUCKET", ""),
    ("endpoint", "AWS_ENDPOINT_URL", ""),
    ("region", "AWS_REGION", ""),
    ("trust", "DRIFTLESS_TRUST", ","),
    ("allow_unsigned", "DRIFTLESS_ALLOW_UNSIGNED", ""),
    ("dir", "DRIFTLESS_DIR", ""),
    // One target per line: an exec= command may hold `;`.
    ("notify", "DRIFTLESS_NOTIFY", "\n"),
    ("listen", "DRIFTLESS_LISTEN", ""),
    ("poll_min", "DRIFTLESS_POLL_MIN", ""),
    ("poll_max", "DRIFTLESS_POLL_MAX", ""),
    ("anchor_parts", "DRIFTLESS_ANCHOR_PARTS", ""),
    ("log", "DRIFTLESS_LOG", ""),
];

/// For `driftless agent`: finds `--config PATH` (or `--config=PATH`, or DRIFTLESS_CONFIG) and
/// exports its values. Other commands do not read it (their keys differ: a `gc` took the
/// file's bucket and dropped its trust keys); `--config` given to one is clap's error.
pub fn load_into_env(args: impl Iterator<Item = OsString>) -> Result<()> {
    let args: Vec<String> = args.map(|a| a.to_string_lossy().into_owned()).collect();
    // The subcommand: the first word that is neither a flag nor the value of a global flag.
    let mut words = args.iter().skip(1);
    let mut sub = None;
    while let Some(a) = words.next() {
        match a.as_str() {
            "--log" => {
                words.next();
            }
            a if a.starts_with('-') => {}
            a => {
                sub = Some(a);
                break;
            }
        }
    }
    if sub != Some("agent") {
        return Ok(());
    }
    let mut path = std::env::var("DRIFTLESS_CONFIG").ok();
    for (i, a) in args.iter().enumerate() {
        if a == "--config" {
            path = args.get(i + 1).cloned();
        } else if let Some(p) = a.strip_prefix("--config=") {
            path = Some(p.to_string());
        }
    }
    let Some(path) = path else { return Ok(()) };
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading config file {path}"))?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("parsing config file {path}"))?;
    let obj = v.as_object().with_context(|| format!("config file {path} is not a JSON object"))?;
    for (k, val) in obj {
        let key = k.replace('-', "_");
        let Some((_, env, sep)) = KEYS.iter().find(|(n, _, _)| *n == key) else {
            bail!(
                "config file {path}: unknown key {k:?} (known: {})",
                KEYS.iter().map(|k| k.0).collect::<Vec<_>>().join(", ")
            );
        };
        // (`log` is DRIFTLESS_LOG, which would beat a RUST_LOG of the environment: the
        // environment wins over the file, so RUST_LOG counts as set too.)
        let rust_log = key == "log" && std::env::var("RUST_LOG").is_ok_and(|s| !s.trim().is_empty());
        if std::env::var_os(env).is_some() || rust_log {
            continue;
        }
        // A list element may not hold the separator: a notify command written over several
        // lines would be split into targets (found by review).
        if let serde_json::Value::Array(a) = val {
            if !sep.is_empty() && a.iter().any(|x| x.as_str().is_some_and(|s| s.contains(sep))) {
                bail!("config file {path}: an element of {k} holds {sep:?}, which separates its elements");
            }
        }
        let s = match val {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Bool(b) => b.to_string(),
            serde_json::Value::Number(n) => n.to_string(),
            serde_json::Value::Array(a) if !sep.is_empty() => a
                .iter()
                .map(|x| x.as_str().map(str::to_string).with_context(|| format!("{k}: list of strings expected")))
                .collect::<Result<Vec<_>>>()?
                .join(sep),
            _ => bail!("config file {path}: bad value for {k}"),
        };
        // SAFETY: single-threaded at this point (before any runtime or thread starts).
        unsafe { std::env::set_var(env, s) };
    }
    Ok(())
}
