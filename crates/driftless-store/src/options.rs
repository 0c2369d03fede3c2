//! Client settings shared by every backend.

use std::time::Duration;

/// How to reach a bucket and how hard to try. Every field has a default; explicit values take
/// precedence over the environment variables each backend reads (see the crate README).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreOptions {
    /// Endpoint override (S3-compatible servers, Azurite, fake-gcs-server, HF gateway).
    /// Default: none (the backend's own default, or `AWS_ENDPOINT_URL` for S3).
    pub endpoint: Option<String>,
    /// Region. Default: none (`AWS_REGION`, then `us-east-1`).
    pub region: Option<String>,
    /// Allow plain `http://` endpoints. Default: false (`AWS_ALLOW_HTTP=true` also enables it).
    pub allow_http: bool,
    /// Force path-style S3 requests. Default: false (object_store's default, which is already
    /// path-style unless `AWS_VIRTUAL_HOSTED_STYLE_REQUEST` is set).
    pub path_style: bool,
    /// Retries per request after the first attempt, for retryable errors only. Default: 5.
    pub max_retries: usize,
    /// Total time one call may spend retrying. Default: 60 s.
    pub retry_timeout: Duration,
    /// Requests in flight per [`Bucket`](crate::Bucket) (shared by its clones), in each of two
    /// pools: transfers of bulk bytes, and small requests (lists, heads, deletes, conditional
    /// reads, puts of at most 1 MiB such as leases, claims, markers and manifests, reads bounded
    /// by 1 MiB such as markers and leases), so that a lease renewal or a ready marker never
    /// waits behind an anchor's uploads. Default: 16.
    pub concurrency: usize,
    /// Objects at least this big are uploaded in parallel parts. Default: 64 MiB.
    pub multipart_threshold: usize,
    /// Part size for multipart uploads and ranged downloads. Default: 16 MiB.
    pub part_size: usize,
    /// Most keys one listing may return before it fails with
    /// [`Error::TooManyKeys`](crate::Error::TooManyKeys) (a server can page forever).
    /// Default: [`MAX_LIST_KEYS`](crate::MAX_LIST_KEYS).
    pub max_list_keys: usize,
    /// Most bytes the entries one listing keeps (after its prefix filter: keys, entity tags
    /// and their fixed size) may take before it fails with
    /// [`Error::ListTooLarge`](crate::Error::ListTooLarge): a million keys of S3's maximum
    /// 1,024 bytes held about 1.2 GiB before this (worked out; found by review). Entries the prefix filter drops
    /// are never held. Default: [`MAX_LIST_BYTES`](crate::MAX_LIST_BYTES).
    pub max_list_bytes: usize,
    /// Longest one listing may take, its pages and retries included, before it fails with
    /// [`Error::ListTimeout`](crate::Error::ListTimeout): a server can answer empty pages that
    /// say "more to come" forever, which no key count stops. Default: 300 s (a listing of
    /// 1 M keys takes about 1,000 pages).
    pub list_timeout: Duration,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            endpoint: None,
            region: None,
            allow_http: false,
            path_style: false,
            max_retries: 5,
            retry_timeout: Duration::from_secs(60),
            concurrency: 16,
            multipart_threshold: 64 << 20,
            part_size: 16 << 20,
            max_list_keys: crate::MAX_LIST_KEYS,
            max_list_bytes: crate::MAX_LIST_BYTES,
            list_timeout: Duration::from_secs(300),
        }
    }
}

impl StoreOptions {
    /// Same as [`Default::default`].
    pub fn new() -> Self {
        Self::default()
    }
    /// Set [`StoreOptions::endpoint`].
    pub fn with_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.endpoint = Some(endpoint.into());
        self
    }
    /// Set [`StoreOptions::region`].
    pub fn with_region(mut self, region: impl Into<String>) -> Self {
        self.region = Some(region.into());
        self
    }
    /// Set [`StoreOptions::allow_http`].
    pub fn with_allow_http(mut self, allow: bool) -> Self {
        self.allow_http = allow;
        self
    }
    /// Set [`StoreOptions::path_style`].
    pub fn with_path_style(mut self, path_style: bool) -> Self {
        self.path_style = path_style;
        self
    }
    /// Set [`StoreOptions::max_list_keys`].
    pub fn with_max_list_keys(mut self, n: usize) -> Self {
        self.max_list_keys = n;
        self
    }
    /// Set [`StoreOptions::max_list_bytes`].
    pub fn with_max_list_bytes(mut self, n: usize) -> Self {
        self.max_list_bytes = n;
        self
    }
    /// Set [`StoreOptions::list_timeout`].
    pub fn with_list_timeout(mut self, t: Duration) -> Self {
        self.list_timeout = t;
        self
    }
    /// Set [`StoreOptions::max_retries`].
    pub fn with_max_retries(mut self, n: usize) -> Self {
        self.max_retries = n;
        self
    }
    /// Set [`StoreOptions::retry_timeout`].
    pub fn with_retry_timeout(mut self, t: Duration) -> Self {
        self.retry_timeout = t;
        self
    }
    /// Set [`StoreOptions::concurrency`] (at least 1).
    pub fn with_concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }
    /// Set [`StoreOptions::multipart_threshold`].
    pub fn with_multipart_threshold(mut self, bytes: usize) -> Self {
        self.multipart_threshold = bytes;
        self
    }
    /// Set [`StoreOptions::part_size`] (at least 5 MiB is required by S3 for all but the
    /// last part; smaller values are accepted for in-memory and file stores).
    pub fn with_part_size(mut self, bytes: usize) -> Self {
        self.part_size = bytes.max(1);
        self
    }

    /// object_store's own retry settings: none. [`Bucket`](crate::Bucket) retries every call
    /// itself ([`StoreOptions::max_retries`], [`StoreOptions::retry_timeout`]); two layers
    /// multiplied (5 of ours x 6 of object_store's: 36 requests for one read under a 503
    /// storm, and a time budget nested in another).
    pub(crate) fn retry_config(&self) -> object_store::RetryConfig {
        object_store::RetryConfig {
            backoff: object_store::BackoffConfig::default(),
            max_retries: 0,
            retry_timeout: self.retry_timeout,
        }
    }
}

/// Whether `endpoint` is a plain-HTTP URL (`http://`, the scheme in any case): callers take it
/// as asking for plain HTTP (`StoreOptions::allow_http`), as the CLI, the Python package and
/// the GCS opener do.
pub fn is_plain_http(endpoint: &str) -> bool {
    endpoint.get(..7).is_some_and(|s| s.eq_ignore_ascii_case("http://"))
}
