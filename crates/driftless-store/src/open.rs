//! Opening a [`Bucket`] from a URL: one function per backend.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::{GcpCredential, GoogleCloudStorageBuilder};
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::{ClientOptions, ObjectStore, StaticCredentialProvider};

use crate::bucket::Bucket;
use crate::error::{Error, Result};
use crate::http_bounds::BoundedConnector;
use crate::options::StoreOptions;
use crate::redact::{redact_as_typed, redact_url};

/// Default endpoint of the Hugging Face Storage Buckets S3 gateway; the namespace is appended
/// as a path segment (`https://s3.hf.co/<namespace>`). Override with
/// [`StoreOptions::endpoint`] or `DRIFTLESS_HF_S3_ENDPOINT`.
pub const HF_S3_ENDPOINT: &str = "https://s3.hf.co";

/// Azurite's well-known development account.
const AZURITE_ACCOUNT: &str = "devstoreaccount1";
const AZURITE_KEY: &str = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

impl Bucket {
    /// Open a bucket from a URL.
    ///
    /// | URL | backend |
    /// |---|---|
    /// | `file:///abs/dir` | local directory (created if missing) |
    /// | `memory://` | a fresh in-memory store |
    /// | `memory://NAME/prefix` | an in-memory store shared by every `open` of `NAME` in this process |
    /// | `s3://bucket/prefix` | S3 or an S3-compatible server |
    /// | `gs://bucket/prefix` | Google Cloud Storage |
    /// | `az://container/prefix` | Azure Blob Storage |
    /// | `hf://buckets/NAMESPACE/BUCKET/prefix` | Hugging Face Storage Buckets (S3 gateway) |
    ///
    /// Explicit [`StoreOptions`] win over the environment variables each backend reads; the
    /// crate README lists them.
    pub fn open(url: &str, opts: &StoreOptions) -> Result<Bucket> {
        Self::open_with(url, opts, true)
    }

    /// Like [`Bucket::open`] for readers (agents, followers, `inspect`, `gc`): a `file://`
    /// directory that does not exist is an error (a typo), not a new empty bucket. Other
    /// schemes open as usual (a missing prefix is an empty stream).
    pub fn open_existing(url: &str, opts: &StoreOptions) -> Result<Bucket> {
        Self::open_with(url, opts, false)
    }

    fn open_with(url: &str, opts: &StoreOptions, create: bool) -> Result<Bucket> {
        let redacted = redact_url(url);
        let (scheme, rest) =
            url.split_once("://").ok_or_else(|| Error::InvalidUrl(format!("{redacted}: expected SCHEME://...")))?;
        // Query strings and fragments are never meaningful here (and may hold secrets).
        let rest = rest.split(['?', '#']).next().unwrap_or("");
        let bucket = match scheme {
            "file" => open_file(rest, opts, create)?,
            "memory" => open_memory(rest, opts)?,
            "s3" | "s3a" => open_s3(rest, opts)?,
            "gs" | "gcs" => open_gcs(rest, opts)?,
            "az" | "azure" => open_azure(rest, opts)?,
            "hf" => {
                let keys = std::env::var("HF_S3_ACCESS_KEY_ID").ok().zip(std::env::var("HF_S3_SECRET_ACCESS_KEY").ok());
                open_hf(rest, opts, keys, s3_credentials_configured())?
            }
            other => {
                return Err(Error::InvalidUrl(format!(
                    "{redacted}: unsupported scheme {other:?} (file, memory, s3, gs, az, hf)"
                )))
            }
        };
        if !bucket.supports_conditional_create() {
            tracing::warn!(
                url = %bucket.url(),
                "backend cannot create objects atomically; write-once puts check then write"
            );
        }
        tracing::debug!(url = %bucket.url(), "opened bucket");
        Ok(bucket)
    }
}

/// `host/prefix...` -> (host, prefix)
fn split_host(rest: &str) -> (&str, &str) {
    match rest.split_once('/') {
        Some((h, p)) => (h, p.trim_matches('/')),
        None => (rest, ""),
    }
}

fn check_prefix(prefix: &str, url: &str) -> Result<()> {
    if prefix.is_empty() {
        return Ok(());
    }
    object_store::path::Path::parse(prefix)
        .map(|_| ())
        .map_err(|e| Error::InvalidUrl(format!("{}: invalid prefix: {e}", redact_url(url))))
}

fn open_file(rest: &str, opts: &StoreOptions, create: bool) -> Result<Bucket> {
    // file:///abs/dir -> rest = "/abs/dir"; file://localhost/abs/dir is accepted too.
    let path = rest.strip_prefix("localhost").unwrap_or(rest);
    if !path.starts_with('/') {
        return Err(Error::InvalidUrl(format!("file://{rest}: expected an absolute path (file:///abs/dir)")));
    }
    if !create && !std::path::Path::new(path).is_dir() {
        return Err(Error::InvalidUrl(format!(
            "file://{path}: no such directory (check the URL; nothing was created)"
        )));
    }
    std::fs::create_dir_all(path)
        .map_err(|e| Error::InvalidUrl(format!("file://{path}: cannot create directory: {e}")))?;
    let store = LocalFileSystem::new_with_prefix(path)
        .map_err(|e| Error::InvalidUrl(format!("file://{path}: {e}")))?
        .with_automatic_cleanup(true);
    Ok(Bucket::assemble(Arc::new(store), String::new(), format!("file://{path}"), opts, true)
        .with_local_root(std::path::PathBuf::from(path)))
}

fn memory_registry() -> &'static Mutex<HashMap<String, Arc<InMemory>>> {
    static REG: OnceLock<Mutex<HashMap<String, Arc<InMemory>>>> = OnceLock::new();
    REG.get_or_init(Default::default)
}

fn open_memory(rest: &str, opts: &StoreOptions) -> Result<Bucket> {
    let (name, prefix) = split_host(rest);
    check_prefix(prefix, rest)?;
    let store: Arc<InMemory> = if name.is_empty() {
        Arc::new(InMemory::new())
    } else {
        let mut reg = memory_registry().lock().unwrap_or_else(|e| e.into_inner());
        Arc::clone(reg.entry(name.to_string()).or_insert_with(|| Arc::new(InMemory::new())))
    };
    let url = if prefix.is_empty() { format!("memory://{name}") } else { format!("memory://{name}/{prefix}") };
    Ok(Bucket::assemble(store, prefix.to_string(), url, opts, true))
}

fn client_options(opts: &StoreOptions) -> ClientOptions {
    let mut c = ClientOptions::new();
    if opts.allow_http || env_true("AWS_ALLOW_HTTP") || env_true("ALLOW_HTTP") {
        c = c.with_allow_http(true);
    }
    c
}

fn env_true(key: &str) -> bool {
    std::env::var(key).map(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")).unwrap_or(false)
}

fn s3_builder(bucket: &str, opts: &StoreOptions) -> AmazonS3Builder {
    let mut b = AmazonS3Builder::from_env()
        .with_bucket_name(bucket)
        .with_retry(opts.retry_config())
        .with_http_connector(BoundedConnector);
    if let Some(endpoint) = &opts.endpoint {
        b = b.with_endpoint(endpoint);
    }
    if let Some(region) = &opts.region {
        b = b.with_region(region);
    }
    if opts.allow_http {
        b = b.with_allow_http(true);
    }
    if opts.path_style {
        b = b.with_virtual_hosted_style_request(false);
    }
    b
}

/// Rejects an endpoint that is not an absolute `http(s)://HOST[:PORT][/path]` URL, before it
/// reaches the HTTP client (which panics on some malformed URIs, e.g. `127.0.0.1:8333` or
/// `http:/127.0.0.1:8333`). `source` names where the value came from, for the message.
pub(crate) fn check_endpoint(endpoint: &str, source: &str) -> Result<()> {
    let bad = || Error::InvalidEndpoint { endpoint: redact_as_typed(endpoint), source_name: source.to_string() };
    let lower = endpoint.to_ascii_lowercase();
    let rest = lower.strip_prefix("http://").or_else(|| lower.strip_prefix("https://")).ok_or_else(bad)?;
    if rest.is_empty() || rest.starts_with('/') || endpoint.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(bad());
    }
    let u = url::Url::parse(endpoint).map_err(|_| bad())?;
    if u.host_str().is_none_or(str::is_empty) || u.cannot_be_a_base() {
        return Err(bad());
    }
    Ok(())
}

/// The endpoint an S3 client will use: the explicit option, else what `from_env` reads.
fn s3_endpoint(opts: &StoreOptions) -> Option<(String, &'static str)> {
    if let Some(e) = &opts.endpoint {
        return Some((e.clone(), "--endpoint / AWS_ENDPOINT_URL"));
    }
    ["AWS_ENDPOINT_URL", "AWS_ENDPOINT"]
        .into_iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()).map(|v| (v, k)))
}

/// Whether the environment gives the S3 client any way to sign requests other than the EC2
/// instance metadata service.
fn s3_credentials_configured() -> bool {
    let set = |k: &str| std::env::var_os(k).is_some_and(|v| !v.is_empty());
    (set("AWS_ACCESS_KEY_ID") && set("AWS_SECRET_ACCESS_KEY"))
        || set("AWS_WEB_IDENTITY_TOKEN_FILE")
        || set("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        || set("AWS_CONTAINER_CREDENTIALS_FULL_URI")
        || env_true("AWS_SKIP_SIGNATURE")
}

fn build_err(url: &str, e: object_store::Error) -> Error {
    Error::InvalidUrl(format!("{}: {}", redact_url(url), crate::redact::redact_text(&e.to_string())))
}

fn open_s3(rest: &str, opts: &StoreOptions) -> Result<Bucket> {
    let url = format!("s3://{rest}");
    let (bucket, prefix) = split_host(rest);
    if bucket.is_empty() {
        return Err(Error::InvalidUrl(format!("{}: missing bucket", redact_url(&url))));
    }
    check_prefix(prefix, &url)?;
    if let Some((endpoint, source)) = s3_endpoint(opts) {
        check_endpoint(&endpoint, source)?;
        // A custom endpoint is an S3-compatible server: the instance metadata fallback cannot
        // be what the user meant.
        if !s3_credentials_configured() {
            return Err(Error::MissingCredentials(format!(
                "no S3 credentials for {}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY \
                 (or AWS_SKIP_SIGNATURE=true for a public bucket)",
                redact_url(&endpoint)
            )));
        }
    }
    let store = s3_builder(bucket, opts).build().map_err(|e| build_err(&url, e))?;
    Ok(Bucket::assemble(Arc::new(store) as Arc<dyn ObjectStore>, prefix.to_string(), redact_url(&url), opts, true))
}

/// `keys`: the HF-derived S3 keys (`HF_S3_ACCESS_KEY_ID`, `HF_S3_SECRET_ACCESS_KEY`);
/// `aws`: whether the AWS variables give the client credentials instead.
fn open_hf(rest: &str, opts: &StoreOptions, keys: Option<(String, String)>, aws: bool) -> Result<Bucket> {
    let url = format!("hf://{rest}");
    let mut parts = rest.splitn(4, '/');
    let (kind, namespace, bucket) = (parts.next(), parts.next(), parts.next());
    let prefix = parts.next().unwrap_or("").trim_matches('/');
    let (namespace, bucket) = match (kind, namespace, bucket) {
        (Some("buckets"), Some(ns), Some(b)) if !ns.is_empty() && !b.is_empty() => (ns, b),
        _ => {
            return Err(Error::InvalidUrl(format!(
                "{}: expected hf://buckets/NAMESPACE/BUCKET/prefix",
                redact_url(&url)
            )))
        }
    };
    check_prefix(prefix, &url)?;
    let endpoint = match &opts.endpoint {
        Some(e) => {
            check_endpoint(e, "--endpoint")?;
            e.clone()
        }
        None => {
            let base = std::env::var("DRIFTLESS_HF_S3_ENDPOINT").unwrap_or_else(|_| HF_S3_ENDPOINT.to_string());
            check_endpoint(&base, "DRIFTLESS_HF_S3_ENDPOINT")?;
            format!("{}/{namespace}", base.trim_end_matches('/'))
        }
    };
    let hf_opts = StoreOptions {
        endpoint: Some(endpoint),
        region: Some(opts.region.clone().unwrap_or_else(|| "us-east-1".to_string())),
        path_style: true,
        ..opts.clone()
    };
    let mut b = s3_builder(bucket, &hf_opts);
    // HF-derived S3 keys (HFAK...) may live beside AWS credentials for another store.
    if let Some((id, secret)) = keys {
        b = b.with_access_key_id(id).with_secret_access_key(secret);
    } else if !aws {
        // The gateway is no EC2 host: without keys the client would ask the EC2 metadata
        // service, and the error would name AWS settings (found by review).
        return Err(Error::MissingCredentials(
            "no Hugging Face credentials: set HF_S3_ACCESS_KEY_ID and HF_S3_SECRET_ACCESS_KEY (S3 keys derived \
             from a Hugging Face token)"
                .into(),
        ));
    }
    let store = b.build().map_err(|e| build_err(&url, e))?;
    // The gateway's handling of If-None-Match is not documented: do not rely on it.
    Ok(Bucket::assemble(Arc::new(store) as Arc<dyn ObjectStore>, prefix.to_string(), redact_url(&url), opts, false))
}

fn is_loopback(endpoint: &str) -> bool {
    url::Url::parse(endpoint)
        .ok()
        .and_then(|u| u.host_str().map(|h| h == "127.0.0.1" || h == "localhost" || h == "[::1]"))
        .unwrap_or(false)
}

fn open_azure(rest: &str, opts: &StoreOptions) -> Result<Bucket> {
    let url = format!("az://{rest}");
    let (container, prefix) = split_host(rest);
    if container.is_empty() {
        return Err(Error::InvalidUrl(format!("{}: missing container", redact_url(&url))));
    }
    check_prefix(prefix, &url)?;
    let mut b = MicrosoftAzureBuilder::from_env()
        .with_container_name(container)
        .with_retry(opts.retry_config())
        .with_http_connector(BoundedConnector);
    if opts.allow_http {
        b = b.with_allow_http(true);
    }
    if let Some(endpoint) = &opts.endpoint {
        check_endpoint(endpoint, "--endpoint")?;
        b = b.with_endpoint(endpoint.clone());
        // A loopback endpoint with no account configured is Azurite: use its well-known
        // development account (the endpoint is then `http://127.0.0.1:PORT/devstoreaccount1`).
        if is_loopback(endpoint) && std::env::var("AZURE_STORAGE_ACCOUNT_NAME").is_err() {
            b = b.with_account(AZURITE_ACCOUNT).with_access_key(AZURITE_KEY).with_allow_http(true);
        }
    }
    let store = b.build().map_err(|e| build_err(&url, e))?;
    Ok(Bucket::assemble(Arc::new(store) as Arc<dyn ObjectStore>, prefix.to_string(), redact_url(&url), opts, true))
}

fn open_gcs(rest: &str, opts: &StoreOptions) -> Result<Bucket> {
    let url = format!("gs://{rest}");
    let (bucket, prefix) = split_host(rest);
    if bucket.is_empty() {
        return Err(Error::InvalidUrl(format!("{}: missing bucket", redact_url(&url))));
    }
    check_prefix(prefix, &url)?;
    let mut b = GoogleCloudStorageBuilder::from_env()
        .with_bucket_name(bucket)
        .with_retry(opts.retry_config())
        .with_http_connector(BoundedConnector);
    if let Some(endpoint) = &opts.endpoint {
        check_endpoint(endpoint, "--endpoint")?;
        b = b.with_base_url(endpoint.trim_end_matches('/'));
        let has_creds = [
            "GOOGLE_SERVICE_ACCOUNT",
            "GOOGLE_SERVICE_ACCOUNT_PATH",
            "GOOGLE_SERVICE_ACCOUNT_KEY",
            "GOOGLE_APPLICATION_CREDENTIALS",
        ]
        .iter()
        .any(|k| std::env::var(k).is_ok());
        if !has_creds {
            // A custom endpoint without credentials (fake-gcs-server): anonymous requests.
            b = b.with_credentials(Arc::new(StaticCredentialProvider::new(GcpCredential { bearer: String::new() })));
        }
        if opts.allow_http || crate::is_plain_http(endpoint) {
            b = b.with_client_options(client_options(&StoreOptions { allow_http: true, ..opts.clone() }));
        }
    }
    let store = b.build().map_err(|e| build_err(&url, e))?;
    Ok(Bucket::assemble(Arc::new(store) as Arc<dyn ObjectStore>, prefix.to_string(), redact_url(&url), opts, true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let o = StoreOptions::default();
        assert!(Bucket::open("nope", &o).is_err());
        assert!(Bucket::open("ftp://x/y", &o).is_err());
        assert!(Bucket::open("file://relative/dir", &o).is_err());
        assert!(Bucket::open("hf://models/a/b", &o).is_err());
        assert!(Bucket::open("hf://buckets/ns", &o).is_err());
        let b = Bucket::open("memory://", &o).unwrap();
        assert_eq!(b.url(), "memory://");
        let b = Bucket::open("memory://shared/a/b?token=secret", &o).unwrap();
        assert_eq!(b.url(), "memory://shared/a/b");
        assert_eq!(b.prefix(), "a/b");
        let b = Bucket::open("s3://bkt/pre/fix?X-Amz-Signature=zzz", &StoreOptions::default().with_region("us-east-1"))
            .unwrap();
        assert_eq!(b.url(), "s3://bkt/pre/fix");
        assert_eq!(b.prefix(), "pre/fix");
        assert!(b.supports_conditional_create());
        let keys = Some(("HFAKx".to_string(), "secret".to_string()));
        let b = open_hf("buckets/ns/bkt/p", &o, keys, false).unwrap();
        assert!(!b.supports_conditional_create());
        assert_eq!(b.prefix(), "p");
        open_hf("buckets/ns/bkt/p", &o, None, true).unwrap();
        // No keys at all: named up front (the client would ask the EC2 metadata service, and
        // the error named AWS settings; found by review).
        let e = open_hf("buckets/ns/bkt/p", &o, None, false).unwrap_err();
        assert!(matches!(e, Error::MissingCredentials(_)) && e.to_string().contains("HF_S3_ACCESS_KEY_ID"), "{e}");
        let b = Bucket::open("gs://bkt/p", &StoreOptions::default().with_endpoint("http://127.0.0.1:1")).unwrap();
        assert_eq!(b.prefix(), "p");
        let b = Bucket::open("az://c/p", &StoreOptions::default().with_endpoint("http://127.0.0.1:1/devstoreaccount1"))
            .unwrap();
        assert_eq!(b.url(), "az://c/p");
    }

    /// Regression: these panicked inside object_store ("invalid URI") instead of failing.
    #[test]
    fn endpoints_without_a_scheme_are_refused_up_front() {
        for bad in [
            "127.0.0.1:8333",
            "localhost:8333",
            "http:/127.0.0.1:8333",
            "http://",
            "https:///x",
            "ftp://h",
            " http://h",
        ] {
            for url in ["s3://b/p", "gs://b/p", "az://c/p", "hf://buckets/ns/b/p"] {
                let e = Bucket::open(url, &StoreOptions::default().with_endpoint(bad)).unwrap_err();
                assert!(matches!(e, Error::InvalidEndpoint { .. }), "{url} {bad}: {e}");
                assert!(e.to_string().contains("expected http://HOST[:PORT]"), "{e}");
                // Echoed as typed, not normalized by a URL parser (`http:/h` is not `http://h/`).
                assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
                assert!(e.is_config() && !e.is_retryable());
            }
        }
        for good in ["http://127.0.0.1:8333", "https://s3.example.com", "HTTP://localhost:1/base/", "http://[::1]:9000"]
        {
            check_endpoint(good, "--endpoint").unwrap();
        }
    }

    #[tokio::test]
    async fn named_memory_stores_are_shared() {
        let o = StoreOptions::default();
        let a = Bucket::open("memory://open-test-shared/p", &o).unwrap();
        let b = Bucket::open("memory://open-test-shared/p", &o).unwrap();
        a.put("k", bytes::Bytes::from_static(b"v")).await.unwrap();
        assert_eq!(b.get("k").await.unwrap(), bytes::Bytes::from_static(b"v"));
        let fresh = Bucket::open("memory://", &o).unwrap();
        assert!(fresh.get("k").await.unwrap_err().is_not_found());
    }

    /// A FIFO (or a device) under an object's name in a `file://` bucket is refused at once,
    /// not read: found by review, a FIFO named `latest.json` hung every reader for good (no
    /// HTTP timeout bounds a local read). A link to a regular file is followed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn local_objects_that_are_not_regular_files_are_refused() {
        let td = tempfile::tempdir().unwrap();
        let o = StoreOptions::default();
        let b = Bucket::open(&format!("file://{}", td.path().display()), &o).unwrap();
        b.put("real", bytes::Bytes::from_static(b"v")).await.unwrap();
        let fifo = std::ffi::CString::new(td.path().join("latest.json").as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo(3) on a path this test owns.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        std::os::unix::fs::symlink("/dev/zero", td.path().join("zero")).unwrap();
        std::os::unix::fs::symlink(td.path().join("real"), td.path().join("link")).unwrap();
        for key in ["latest.json", "zero"] {
            let reads = async {
                (
                    b.get(key).await.unwrap_err(),
                    b.get_limited(key, 1 << 20).await.unwrap_err(),
                    b.get_range_of(key, 0..10).await.unwrap_err(),
                    b.poll_limited(key, None, 1 << 20).await.map(|_| ()).unwrap_err(),
                )
            };
            let errs = tokio::time::timeout(std::time::Duration::from_secs(20), reads).await.expect("a read hangs");
            for e in [errs.0, errs.1, errs.2, errs.3] {
                assert!(!e.is_retryable() && e.to_string().contains("not a regular file"), "{key}: {e}");
            }
        }
        assert_eq!(b.get("link").await.unwrap(), bytes::Bytes::from_static(b"v"));
    }
}
