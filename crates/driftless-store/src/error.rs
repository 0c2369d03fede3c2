//! The crate's error type: callers match on the kind of failure, never on text.

use crate::redact::redact_text;

/// Everything that can go wrong talking to a bucket.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum Error {
    /// The key does not exist.
    #[error("object not found: {key}")]
    NotFound {
        /// Key relative to the bucket prefix.
        key: String,
    },
    /// A write-once put found the key already present.
    #[error("object already exists: {key}")]
    AlreadyExists {
        /// Key relative to the bucket prefix.
        key: String,
    },
    /// The object is bigger than the caller allows (checked before reading the body).
    #[error("object {key} is {size} bytes, more than the {max} allowed")]
    TooLarge {
        /// Key relative to the bucket prefix.
        key: String,
        /// Size reported by the store.
        size: u64,
        /// The caller's limit.
        max: u64,
    },
    /// A listing returned more keys than a reader accepts (a hostile or runaway bucket: the
    /// listing is stopped there, so memory and time stay bounded).
    #[error("listing {prefix} returned more than {max} keys")]
    TooManyKeys {
        /// The listed prefix.
        prefix: String,
        /// The limit.
        max: usize,
    },
    /// The entries a listing keeps took more memory than a reader accepts
    /// ([`StoreOptions::max_list_bytes`](crate::StoreOptions::max_list_bytes): long keys
    /// planted in a bucket); the listing is stopped there.
    #[error("listing {prefix} returned more than {max_bytes} bytes of keys")]
    ListTooLarge {
        /// The listed prefix.
        prefix: String,
        /// The limit.
        max_bytes: usize,
    },
    /// A listing did not finish within
    /// [`StoreOptions::list_timeout`](crate::StoreOptions::list_timeout) (a server that pages
    /// forever, empty pages with a continuation token included). May pass by itself.
    #[error("listing {prefix} did not finish in {secs} s (the server kept paging)")]
    ListTimeout {
        /// The listed prefix.
        prefix: String,
        /// The limit, in seconds.
        secs: u64,
    },
    /// A failure that may go away when retried (network, 5xx, throttling, timeouts).
    /// Returned once the bounded retries are spent.
    #[error("transient storage error {}: {source}", on(key))]
    Transient {
        /// Key relative to the bucket prefix (or the listed prefix).
        key: String,
        /// The redacted cause.
        #[source]
        source: StoreError,
    },
    /// A failure retrying will not fix (permissions, bad request, unsupported operation).
    #[error("storage error {}: {source}", on(key))]
    Permanent {
        /// Key relative to the bucket prefix (or the listed prefix).
        key: String,
        /// The redacted cause.
        #[source]
        source: StoreError,
    },
    /// The key is not a valid object key (empty segment, `.`/`..`, control characters...).
    #[error("invalid object key {key:?}: {reason}")]
    InvalidKey {
        /// The rejected key.
        key: String,
        /// Why it was rejected.
        reason: String,
    },
    /// The bucket URL or its configuration is wrong.
    #[error("invalid bucket url: {0}")]
    InvalidUrl(String),
    /// An endpoint setting (`--endpoint`, `AWS_ENDPOINT_URL`, `StoreOptions::endpoint`) is not
    /// an absolute `http://` or `https://` URL. Checked before any client is built: the HTTP
    /// stack would otherwise fail deep inside a request.
    #[error("invalid endpoint {endpoint:?} (from {source_name}): expected http://HOST[:PORT] or https://HOST[:PORT], e.g. http://127.0.0.1:8333")]
    InvalidEndpoint {
        /// The rejected value.
        endpoint: String,
        /// Where it came from (`--endpoint`/options, or the environment variable's name).
        source_name: String,
    },
    /// No credentials are configured for a backend that needs them.
    #[error("{0}")]
    MissingCredentials(String),
    /// The backend cannot do what was asked.
    #[error("unsupported: {0}")]
    Unsupported(String),
}

/// `on KEY`, or what an empty key means: a listing of the whole stream.
fn on(key: &str) -> String {
    if key.is_empty() {
        "listing the stream's prefix".to_string()
    } else {
        format!("on {key}")
    }
}

impl Error {
    /// Whether retrying the same call later may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::Transient { .. } | Error::ListTimeout { .. })
    }

    /// Whether the bucket URL, endpoint or credentials are misconfigured (fix the settings;
    /// retrying will not help).
    pub fn is_config(&self) -> bool {
        matches!(self, Error::InvalidUrl(_) | Error::InvalidEndpoint { .. } | Error::MissingCredentials(_))
    }

    /// Whether the object does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, Error::NotFound { .. })
    }

    /// Whether the object is there but a read of it fails in a way retrying the same request
    /// will not fix (a [`Permanent`](Error::Permanent) answer: an object encrypted with a
    /// customer key, one archived to a cold storage class, a directory at the key of a
    /// `file://` bucket). For a reader of the stream such an object is the step's problem,
    /// not the bucket's: anyone who can write the bucket can plant one, and an agent that
    /// failed its whole sync on it would never sync again (found by review).
    pub fn is_unreadable(&self) -> bool {
        matches!(self, Error::Permanent { .. })
    }

    /// Whether a listing was stopped by what the bucket holds rather than by the link: a key
    /// the store's client cannot parse, more keys or key bytes than a reader accepts, or no
    /// end before its deadline. Anyone who can write the bucket can cause one, so a reader
    /// that has another source for its answer (the signed `latest.json`) uses it instead of
    /// failing.
    pub fn is_listing_refused(&self) -> bool {
        matches!(
            self,
            Error::InvalidKey { .. }
                | Error::TooManyKeys { .. }
                | Error::ListTooLarge { .. }
                | Error::ListTimeout { .. }
        )
    }

    /// Whether a write-once put lost to an existing object.
    pub fn is_already_exists(&self) -> bool {
        matches!(self, Error::AlreadyExists { .. })
    }

    /// Classify an `object_store` error for `key`.
    pub(crate) fn from_store(key: &str, err: object_store::Error) -> Error {
        use object_store::Error as E;
        let key = key.to_string();
        if let Some(e) = missing_credentials_hint(&err) {
            return e;
        }
        match err {
            // S3 answers a GET in a bucket that does not exist with 404 too: that is not a
            // missing object (a step not there yet) but a wrong URL.
            E::NotFound { .. } if StoreError::new(&err).message().contains("NoSuchBucket") => {
                Error::Permanent { key, source: StoreError::new(&err) }
            }
            E::NotFound { .. } => Error::NotFound { key },
            E::AlreadyExists { .. } => Error::AlreadyExists { key },
            E::InvalidPath { source } => Error::InvalidKey { key, reason: source.to_string() },
            E::NotSupported { .. } | E::NotImplemented { .. } => Error::Unsupported(redact_text(&err.to_string())),
            E::Generic { .. } | E::JoinError { .. } => {
                let source = StoreError::new(&err);
                if is_transient_generic(&err) {
                    Error::Transient { key, source }
                } else {
                    Error::Permanent { key, source }
                }
            }
            // Precondition/NotModified reaching here are unexpected for the caller's call;
            // permissions and configuration are never fixed by retrying.
            other => Error::Permanent { key, source: StoreError::new(&other) },
        }
    }
}

/// The S3 client falls back to the EC2 instance metadata service when no keys are configured;
/// off EC2 that fails with a connection error or a 403 from 169.254.169.254, which says nothing
/// about the real cause. Say it.
/// GCS and Azure fall back to their own metadata services at the same address: each backend
/// names its own settings (found by review: a gs:// bucket without credentials was told to set
/// AWS keys).
fn missing_credentials_hint(err: &object_store::Error) -> Option<Error> {
    let text = StoreError::new(err).message().to_string();
    let imds = text.contains("169.254.169.254") || text.contains("fd00:ec2::254");
    if !(imds && (text.contains("credential") || text.contains("token") || text.contains("metadata"))) {
        return None;
    }
    let hint = match err {
        object_store::Error::Generic { store: "GCS", .. } => MISSING_GCS_CREDENTIALS,
        object_store::Error::Generic { store: "MicrosoftAzure", .. } => MISSING_AZURE_CREDENTIALS,
        _ => MISSING_S3_CREDENTIALS,
    };
    Some(Error::MissingCredentials(hint.to_string()))
}

const MISSING_GCS_CREDENTIALS: &str = "no Google Cloud credentials: set GOOGLE_APPLICATION_CREDENTIALS \
(or GOOGLE_SERVICE_ACCOUNT_KEY); without them the client asked the GCE metadata server, which is only there on Google Cloud";

const MISSING_AZURE_CREDENTIALS: &str = "no Azure credentials: set AZURE_STORAGE_ACCOUNT_NAME with \
AZURE_STORAGE_ACCOUNT_KEY (or AZURE_STORAGE_SAS_KEY, or a client secret); without them the client asked \
the Azure instance metadata service, which is only there on Azure";

/// What to configure when an S3 client has no credentials.
pub(crate) const MISSING_S3_CREDENTIALS: &str = "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY \
(or AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN, or AWS_SKIP_SIGNATURE=true for a public bucket); \
without them the client asked the EC2 instance metadata service, which is only there on EC2";

/// `object_store` wraps HTTP failures in a private type; decide from the error chain and the
/// status code in its message. Connection/timeout errors, 5xx, 408 and 429 are transient; other
/// 4xx are permanent; anything else (local I/O, a torn response) is treated as transient and is
/// bounded by the retry budget.
///
/// Except a request the HTTP client refused to build (reqwest's "builder error", e.g. a plain
/// `http://` endpoint without allow-http): it never reaches the network, so retrying cannot
/// help (found by review: `--endpoint HTTP://...` was retried and then called temporary).
///
/// And except an answer too large to hold (`http_bounds::BodyTooLarge`): the endpoint would send
/// it again (found by review: it was fetched again at every retry and every poll).
fn is_transient_generic(err: &object_store::Error) -> bool {
    let chain = std::iter::successors(Some(err as &(dyn std::error::Error + 'static)), |e| e.source());
    if chain.into_iter().any(|e| e.is::<crate::http_bounds::BodyTooLarge>()) {
        return false;
    }
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(h) = e.downcast_ref::<object_store::client::HttpError>() {
            let unbuilt = h.kind() == object_store::client::HttpErrorKind::Unknown
                && StoreError::new(h).message().contains("builder error");
            return !unbuilt;
        }
        cur = e.source();
    }
    let text = err.to_string();
    if let Some(idx) = text.find("status code: ") {
        let code: String = text[idx + 13..].chars().take(3).collect();
        if let Ok(code) = code.parse::<u16>() {
            return !(400..500).contains(&code) || code == 408 || code == 429;
        }
    }
    true
}

/// The cause of a storage error, with credentials and query strings removed from any URL in it.
#[derive(Debug, Clone)]
pub struct StoreError {
    message: String,
}

impl StoreError {
    pub(crate) fn new(err: &dyn std::error::Error) -> StoreError {
        // Flatten the chain: the original types hold unredacted URLs. An error can quote the
        // server's response body whole (found by review: a 16 MiB body made a 16 MiB error,
        // which agents keep and log at every poll), so each piece is cut before it is joined
        // and the result is one bounded line.
        let mut message = head(err.to_string());
        let mut cur = err.source();
        while let Some(e) = cur {
            let s = head(e.to_string());
            if !message.contains(&s) {
                message.push_str(": ");
                message.push_str(&s);
            }
            cur = e.source();
        }
        StoreError { message: driftless_format::one_line(&redact_text(&tidy_body(&message))) }
    }

    /// The redacted message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for StoreError {}

/// The first 64 KiB of `s` (on a character boundary): enough for any XML error document a
/// store sends, a bound on what the tidying and redaction work through.
fn head(mut s: String) -> String {
    const MAX: usize = 64 << 10;
    if s.len() > MAX {
        let mut at = MAX;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
    }
    s
}

/// S3 and Azure answer errors with an XML document (`<?xml ...?><Error><Code>NoSuchBucket</Code>
/// <Message>...</Message>...</Error>`), which the HTTP client pastes into its message, line
/// breaks included. Keep `Code: Message` (plus a hint for the codes a user can act on) and
/// make the message one line.
fn tidy_body(text: &str) -> String {
    fn tag<'a>(s: &'a str, name: &str) -> Option<&'a str> {
        let open = format!("<{name}>");
        let start = s.find(&open)? + open.len();
        let end = s[start..].find(&format!("</{name}>"))? + start;
        Some(s[start..end].trim())
    }
    let mut out = text.to_string();
    if let Some(err_start) = out.find("<Error>") {
        let start = out[..err_start].rfind("<?xml").unwrap_or(err_start);
        let end = out[err_start..].find("</Error>").map_or(out.len(), |e| err_start + e + "</Error>".len());
        let body = &out[start..end];
        let code = tag(body, "Code").unwrap_or("");
        let mut short = match tag(body, "Message") {
            Some(m) if !code.is_empty() => format!("{code}: {m}"),
            Some(m) => m.to_string(),
            None => code.to_string(),
        };
        let hint = match code {
            "NoSuchBucket" | "ContainerNotFound" => " (the bucket does not exist: create it or fix the URL)",
            "InvalidAccessKeyId" | "SignatureDoesNotMatch" | "AuthenticationFailed" => {
                " (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or the storage account key)"
            }
            "AccessDenied" | "AuthorizationPermissionMismatch" => " (the credentials lack permission for this bucket)",
            _ => "",
        };
        short.push_str(hint);
        out.replace_range(start..end, &short);
    }
    // One line: errors end up in single-line logs and in `driftless: error: ...`.
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    fn generic(msg: &str) -> object_store::Error {
        object_store::Error::Generic { store: "S3", source: msg.to_string().into() }
    }

    #[test]
    fn classifies_status_codes() {
        let e = Error::from_store("k", generic("Server returned non-2xx status code: 503 Service Unavailable"));
        assert!(e.is_retryable());
        let e = Error::from_store("k", generic("Server returned non-2xx status code: 400 Bad Request"));
        assert!(!e.is_retryable());
        let e = Error::from_store("k", generic("Server returned non-2xx status code: 429 Too Many"));
        assert!(e.is_retryable());
        let e = Error::from_store("k", object_store::Error::NotFound { path: "x".into(), source: "gone".into() });
        assert!(e.is_not_found());
    }

    #[test]
    fn instance_metadata_failures_say_credentials_are_missing() {
        let e = Error::from_store(
            "stream.json",
            generic("Error performing token request: Error after 0 retries: Server returned non-2xx status code: 403 Forbidden: http://169.254.169.254/latest/api/token"),
        );
        assert!(matches!(e, Error::MissingCredentials(_)), "{e}");
        assert!(e.to_string().contains("AWS_ACCESS_KEY_ID"), "{e}");
        assert!(!e.is_retryable());
        // Each backend names its own settings (a gs:// bucket was told to set AWS keys).
        for (store, want) in
            [("GCS", "GOOGLE_APPLICATION_CREDENTIALS"), ("MicrosoftAzure", "AZURE_STORAGE_ACCOUNT_NAME")]
        {
            let source = "Error getting token from metadata server: http://169.254.169.254/computeMetadata/v1/token";
            let e = Error::from_store("stream.json", object_store::Error::Generic { store, source: source.into() });
            assert!(matches!(e, Error::MissingCredentials(_)) && e.to_string().contains(want), "{store}: {e}");
            assert!(!e.to_string().contains("AWS"), "{store}: {e}");
        }
    }

    /// Issue 13.3: raw S3 XML bodies (several lines, pasted whole) in error messages.
    #[test]
    fn s3_xml_error_bodies_become_one_short_line() {
        let e = Error::from_store(
            "",
            generic("Error performing GET http://127.0.0.1:8333/nobucket in 2ms - Server returned non-2xx status code: 404 Not Found: <?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>NoSuchBucket</Code><Message>The specified bucket does not exist</Message><Resource>/nobucket</Resource><RequestId>18EA</RequestId></Error>"),
        );
        let text = e.to_string();
        assert!(!text.contains('<') && !text.contains('\n'), "{text}");
        assert!(
            text.contains(
                "404 Not Found: NoSuchBucket: The specified bucket does not exist (the bucket does not exist"
            ),
            "{text}"
        );
        assert!(text.starts_with("storage error listing the stream's prefix: "), "{text}");
        assert!(!e.is_retryable());
    }

    #[test]
    fn a_missing_bucket_is_not_a_missing_object() {
        let e = Error::from_store(
            "stream.json",
            object_store::Error::NotFound {
                path: "p/stream.json".into(),
                source: "Server returned non-2xx status code: 404 Not Found: <?xml version=\"1.0\"?><Error><Code>NoSuchBucket</Code><Message>The specified bucket does not exist</Message></Error>".into(),
            },
        );
        assert!(!e.is_not_found() && !e.is_retryable(), "{e}");
        assert!(e.to_string().contains("NoSuchBucket: The specified bucket does not exist"), "{e}");
    }

    #[test]
    fn messages_are_redacted() {
        let e = Error::from_store(
            "k",
            generic("Error performing GET https://acct.blob.core.windows.net/c/k?sig=SECRET&se=1 in 1s"),
        );
        let text = e.to_string();
        assert!(!text.contains("SECRET"), "{text}");
        assert!(text.contains("https://acct.blob.core.windows.net/c/k"), "{text}");
    }
}
