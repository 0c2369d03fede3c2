//! The one mapping from errors to exit codes and to the "can retrying help?" line, used by
//! every command (README: 0 ok, 1 verification failed, 2 any other error).
//!
//! Errors are classified by their type and kind, walking the `anyhow` chain from the outside
//! in, never by their text.

use driftless_format::ErrorKind;

/// What a failed command means for the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Verification failed: bad signature, untrusted key, corrupt object, wrong base, weights
    /// root mismatch. Exit 1. Retrying the same data will not help.
    Verification,
    /// Storage trouble, a step not fully visible yet, local I/O: exit 2, retrying may help.
    Retryable,
    /// Usage, configuration, bad local input, a refused publish: exit 2, retrying will not
    /// help until the cause is fixed.
    Fatal,
}

impl Class {
    /// The process exit code.
    pub fn code(self) -> i32 {
        match self {
            Class::Verification => 1,
            Class::Retryable | Class::Fatal => 2,
        }
    }

    /// One line telling the user whether to retry.
    pub fn advice(self) -> &'static str {
        match self {
            Class::Verification => {
                "verification failed: retrying will not help (the data is corrupt, not signed by a trusted key, or for another base)"
            }
            Class::Retryable => "this looks temporary: retrying may help",
            Class::Fatal => "retrying will not help until the cause above is fixed",
        }
    }
}

/// A local input the user named (a checkpoint path, a key file) is unusable. Wrapping an
/// error in it makes the failure a plain input error (exit 2) even when the inner error is a
/// decoding error of the format crate, which would otherwise read as a verification failure.
#[derive(Debug, thiserror::Error)]
#[error("{context}")]
pub struct BadInput {
    /// What was being done ("opening checkpoint X").
    pub context: String,
    /// The cause.
    #[source]
    pub source: anyhow::Error,
}

/// Classifies `e` by the first error in its chain that this crate knows.
pub fn classify(e: &anyhow::Error) -> Class {
    for c in e.chain() {
        if c.downcast_ref::<BadInput>().is_some() {
            return Class::Fatal;
        }
        if c.downcast_ref::<crate::cmd::publish::Unsettled>().is_some() {
            return Class::Retryable;
        }
        if let Some(x) = c.downcast_ref::<driftless_format::Error>() {
            return format(x);
        }
        if let Some(x) = c.downcast_ref::<driftless_store::Error>() {
            return store(x);
        }
        if let Some(x) = c.downcast_ref::<driftless_store::stream::StreamError>() {
            return stream(x);
        }
        if let Some(x) = c.downcast_ref::<driftless_publisher::Error>() {
            return publisher(x);
        }
        if let Some(x) = c.downcast_ref::<driftless_agent::Error>() {
            return agent(x);
        }
        if let Some(x) = c.downcast_ref::<driftless_gc::Error>() {
            return match x {
                driftless_gc::Error::Store(s) => store(s),
                _ => Class::Fatal,
            };
        }
        if let Some(x) = c.downcast_ref::<std::io::Error>() {
            return io(x);
        }
    }
    Class::Fatal
}

fn io(e: &std::io::Error) -> Class {
    match driftless_format::io_is_retryable(e) {
        true => Class::Retryable,
        false => Class::Fatal,
    }
}

fn format(e: &driftless_format::Error) -> Class {
    match e {
        driftless_format::Error::Io { source, .. } => io(source),
        _ => match e.kind() {
            ErrorKind::Corrupt | ErrorKind::Untrusted | ErrorKind::WrongBase => Class::Verification,
            _ if e.is_retryable() => Class::Retryable,
            _ => Class::Fatal,
        },
    }
}

fn store(e: &driftless_store::Error) -> Class {
    if e.is_retryable() {
        Class::Retryable
    } else {
        Class::Fatal
    }
}

fn stream(e: &driftless_store::stream::StreamError) -> Class {
    use driftless_store::stream::StreamError as S;
    match e {
        S::Format(f) => format(f),
        S::Store(s) if !s.is_not_found() => store(s),
        _ if e.is_retryable() => Class::Retryable,
        _ => Class::Fatal,
    }
}

fn publisher(e: &driftless_publisher::Error) -> Class {
    use driftless_publisher::Error as P;
    match e {
        P::Format(f) => format(f),
        P::Store(s) => store(s),
        P::Stream(s) => stream(s),
        _ if e.is_retryable() => Class::Retryable,
        _ => Class::Fatal,
    }
}

fn agent(e: &driftless_agent::Error) -> Class {
    use driftless_agent::Error as A;
    if e.is_integrity() || e.is_refused() {
        return Class::Verification;
    }
    match e {
        A::Format(f) => format(f),
        A::Store(s) if !s.is_not_found() => store(s),
        A::Stream(s) => stream(s),
        _ if e.is_retryable() => Class::Retryable,
        _ => Class::Fatal,
    }
}

/// The error chain on one line, each distinct cause once: `thiserror` variants that print
/// their source in their own message would otherwise repeat it (`No such file or directory
/// (os error 2): No such file or directory (os error 2)`).
///
/// Control characters are escaped (`\n`, `\u{1b}`): messages quote keys and bodies read from a
/// bucket, and a planted key with a line break or a terminal escape must neither break the one
/// line nor reach the terminal (found by review: a junk key in a listing did both).
pub fn render(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for c in e.chain() {
        let s = escape_controls(c.to_string().trim());
        let s = s.as_str();
        if s.is_empty() || out.contains(s) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(s);
    }
    out
}

/// `s` with every control character written as its escape.
fn escape_controls(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// A clap usage error on one line, like every other error: clap's message (a list under it
/// folded onto the line), its tips, and the usage line, without the blank lines between them.
pub fn usage_line(e: &clap::Error) -> String {
    // Display of clap's styled text is plain text: no colour codes whatever the terminal.
    let text = e.render().to_string();
    let fold = |b: &str| b.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ");
    let (mut msg, mut usage) = (String::new(), String::new());
    for block in text.split("\n\n").map(str::trim) {
        if let Some(u) = block.strip_prefix("Usage:") {
            usage = fold(u);
        } else if block.starts_with("For more information") || block.is_empty() {
        } else {
            let part = fold(block.strip_prefix("error:").unwrap_or(block).trim());
            msg = if msg.is_empty() { part } else { format!("{msg} ({part})") };
        }
    }
    match usage.is_empty() {
        true => format!("{msg} (see --help)"),
        false => format!("{msg}; usage: {usage} (see --help)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_are_printed_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory (os error 2)");
        let f = driftless_format::Error::Io { path: "/x".into(), source: io };
        let e = anyhow::Error::new(f).context("opening checkpoint /x");
        let r = render(&e);
        assert_eq!(r.matches("No such file").count(), 1, "{r}");
        assert!(r.starts_with("opening checkpoint /x: I/O error on /x"), "{r}");
        assert_eq!(classify(&e), Class::Fatal);
    }

    #[test]
    fn control_characters_from_a_bucket_stay_on_one_line_and_off_the_terminal() {
        let e = anyhow::anyhow!("invalid key ready/deltas/junk\nsecond line\x1b[2J").context("listing ready/");
        let r = render(&e);
        assert_eq!(r, "listing ready/: invalid key ready/deltas/junk\\nsecond line\\u{1b}[2J");
        assert!(!r.chars().any(char::is_control), "{r}");
    }

    #[test]
    fn kinds_map_to_codes() {
        let c = |e: driftless_format::Error| classify(&anyhow::Error::new(e)).code();
        assert_eq!(c(driftless_format::Error::WrongBase { expected: "a".into(), actual: "b".into() }), 1);
        assert_eq!(c(driftless_format::Error::InvalidInput("x".into())), 2);
        let bad = BadInput {
            context: "opening checkpoint x".into(),
            source: driftless_format::Error::Corrupt { what: "safetensors", detail: "x".into() }.into(),
        };
        assert_eq!(classify(&anyhow::Error::new(bad)), Class::Fatal);
        let refused = driftless_agent::Error::Refused {
            kind: driftless_format::StepKind::Delta,
            step: 3,
            detail: "bad signature".into(),
            fault: driftless_agent::Fault::Untrusted,
        };
        assert_eq!(classify(&anyhow::Error::new(refused)), Class::Verification);
        assert_eq!(classify(&anyhow::Error::new(driftless_agent::Error::NothingReady)), Class::Retryable);
        assert_eq!(classify(&anyhow::anyhow!("usage")), Class::Fatal);
    }
}
