//! [`Bucket`]: a prefix in an object store, with bounded retries, a concurrency limit,
//! parallel multipart uploads and ranged downloads.

use std::future::Future;
use std::sync::Arc;
use std::time::SystemTime;

use bytes::{Bytes, BytesMut};
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{GetOptions, GetRange, ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use rand::Rng;
use tokio::sync::Semaphore;
use tracing::Instrument;

/// Puts of at most this many bytes (and reads bounded by it) take a permit of the small
/// requests' pool, never queued behind bulk transfers (see `Inner::control`).
const SMALL_PUT: usize = 1 << 20;

/// Most keys one listing returns by default before it is refused ([`Error::TooManyKeys`],
/// [`StoreOptions::max_list_keys`]): a hostile server can page forever. A stream holds some thousands of objects (100 deltas of a 70B model
/// with their segments, anchors of 100 shards); this is a hundred times that.
pub const MAX_LIST_KEYS: usize = 1_000_000;

/// Most bytes the kept entries of one listing may take by default ([`Error::ListTooLarge`],
/// [`StoreOptions::max_list_bytes`]): 1 M keys of ~60 bytes (this layout's keys) fit in
/// about half of it, so the key count binds first unless the keys are planted long.
pub const MAX_LIST_BYTES: usize = 256 << 20;

use crate::error::{Error, Result};
use crate::options::StoreOptions;

/// Metadata of one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectInfo {
    /// Key relative to the bucket prefix.
    pub key: String,
    /// Size in bytes.
    pub size: u64,
    /// Last modification time reported by the store.
    pub last_modified: SystemTime,
    /// Entity tag, when the store reports one.
    pub etag: Option<String>,
}

/// A prefix in an object store. Cheap to clone; clones share the concurrency limit.
#[derive(Clone, Debug)]
pub struct Bucket {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    store: Arc<dyn ObjectStore>,
    /// Normalised prefix without leading/trailing `/`; empty for the store root.
    prefix: String,
    /// Redacted URL for logs and errors.
    url: String,
    /// Bounds requests in flight that move bulk bytes (each leaf request holds one permit).
    permits: Semaphore,
    /// The same for small requests (lists, heads, deletes, conditional reads, puts of at most
    /// [`SMALL_PUT`] bytes and reads bounded by it): leases, claims, markers, the manifests
    /// written (those read are bounded by 64 MiB, and wait with bulk reads). Found by review: one
    /// FIFO pool for everything queued a lease renewal behind every part of an anchor's
    /// multipart uploads (16 shards x 16 parts at the default concurrency, minutes at 400
    /// Mbit/s for a 70B model), so the lease lapsed and every commit in the meantime failed.
    control: Semaphore,
    opts: StoreOptions,
    conditional_create: bool,
    /// The directory of a `file://` bucket: objects are read only when they are regular files
    /// (found by review: a FIFO named `latest.json` hung every reader for good, and no HTTP
    /// timeout bounds a local read).
    local_root: Option<std::path::PathBuf>,
}

impl Bucket {
    /// Wrap an existing store (tests use this with [`FaultyStore`](crate::FaultyStore)).
    /// The store is assumed to support atomic conditional create; see
    /// [`Bucket::with_conditional_create`].
    pub fn from_store(store: Arc<dyn ObjectStore>, prefix: &str, opts: &StoreOptions) -> Bucket {
        let prefix = prefix.trim_matches('/').to_string();
        let url = format!("{store}/{prefix}");
        Bucket::assemble(store, prefix, crate::redact::redact_url(&url), opts, true)
    }

    pub(crate) fn assemble(
        store: Arc<dyn ObjectStore>,
        prefix: String,
        url: String,
        opts: &StoreOptions,
        conditional_create: bool,
    ) -> Bucket {
        Bucket {
            inner: Arc::new(Inner {
                store,
                prefix,
                url,
                permits: Semaphore::new(opts.concurrency.max(1)),
                control: Semaphore::new(opts.concurrency.max(1)),
                opts: opts.clone(),
                conditional_create,
                local_root: None,
            }),
        }
    }

    /// Override whether [`Bucket::put_create`] relies on the store's atomic create.
    pub fn with_conditional_create(self, supported: bool) -> Bucket {
        let inner = &self.inner;
        Bucket {
            inner: Arc::new(Inner {
                store: Arc::clone(&inner.store),
                prefix: inner.prefix.clone(),
                url: inner.url.clone(),
                permits: Semaphore::new(inner.opts.concurrency.max(1)),
                control: Semaphore::new(inner.opts.concurrency.max(1)),
                opts: inner.opts.clone(),
                conditional_create: supported,
                local_root: inner.local_root.clone(),
            }),
        }
    }

    /// The bucket URL with credentials and query strings removed.
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    /// The prefix inside the store (no leading or trailing `/`).
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The options this bucket was opened with.
    pub fn options(&self) -> &StoreOptions {
        &self.inner.opts
    }

    /// The underlying store (no prefix, no retries).
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.inner.store
    }

    /// Whether [`Bucket::put_create`] is atomic for single-request uploads. When false, it
    /// checks for the key and then writes: two racing writers can both "win".
    pub fn supports_conditional_create(&self) -> bool {
        self.inner.conditional_create
    }

    /// Write `bytes` at `key` only if nothing is there (write-once).
    ///
    /// Below [`StoreOptions::multipart_threshold`] this is one conditional request
    /// (`PutMode::Create`, `If-None-Match: *` on S3), atomic on backends where
    /// [`Bucket::supports_conditional_create`] holds. At or above the threshold the object is
    /// uploaded in parallel parts; multipart completion cannot be made conditional, so the
    /// key is checked with a HEAD first and a concurrent writer may still overwrite it. Use
    /// small objects (markers, manifests) as commit points.
    ///
    /// A retry after a lost response that finds the key present compares the stored bytes
    /// with `bytes`: the same content counts as success.
    pub async fn put_create(&self, key: &str, bytes: Bytes) -> Result<()> {
        let span = tracing::debug_span!("put_create", bucket = %self.url(), key, size = bytes.len());
        async {
            let path = self.path(key)?;
            if bytes.len() >= self.inner.opts.multipart_threshold || !self.inner.conditional_create {
                match self.head(key).await {
                    Ok(_) => return Err(Error::AlreadyExists { key: key.to_string() }),
                    Err(e) if e.is_not_found() => {}
                    Err(e) => return Err(e),
                }
                if bytes.len() >= self.inner.opts.multipart_threshold {
                    return self.put_multipart(key, &path, bytes).await;
                }
                // Without conditional create the HEAD above is the check; the put itself is an
                // overwrite of our own bytes, so a retry after a lost response is harmless.
                return self
                    .retry("put_create", key, || self.put_single(key, &path, bytes.clone(), PutMode::Overwrite))
                    .await;
            }
            let mut attempts = 0usize;
            let res = self
                .retry("put_create", key, || {
                    attempts += 1;
                    self.put_single(key, &path, bytes.clone(), PutMode::Create)
                })
                .await;
            match res {
                Err(Error::AlreadyExists { .. }) if attempts > 1 => {
                    // An earlier attempt may have landed with its response lost. (Read at most
                    // our own size: anything longer is another object.)
                    match self.get_limited(key, bytes.len() as u64).await {
                        Ok(stored) if stored == bytes => Ok(()),
                        Ok(_) | Err(Error::TooLarge { .. }) => Err(Error::AlreadyExists { key: key.to_string() }),
                        Err(e) => Err(e),
                    }
                }
                other => other,
            }
        }
        .instrument(span)
        .await
    }

    /// Write `bytes` at `key`, replacing any existing object (used for `latest.json`).
    pub async fn put(&self, key: &str, bytes: Bytes) -> Result<()> {
        let span = tracing::debug_span!("put", bucket = %self.url(), key, size = bytes.len());
        async {
            let path = self.path(key)?;
            if bytes.len() >= self.inner.opts.multipart_threshold {
                return self.put_multipart(key, &path, bytes).await;
            }
            self.retry("put", key, || self.put_single(key, &path, bytes.clone(), PutMode::Overwrite)).await
        }
        .instrument(span)
        .await
    }

    async fn put_single(&self, key: &str, path: &Path, bytes: Bytes, mode: PutMode) -> Result<()> {
        let _permit = if bytes.len() <= SMALL_PUT { self.control_permit().await } else { self.permit().await };
        let opts = PutOptions { mode, ..Default::default() };
        self.inner
            .store
            .put_opts(path, PutPayload::from_bytes(bytes), opts)
            .await
            .map(|_| ())
            .map_err(|e| map_put_error(key, e))
    }

    async fn put_multipart(&self, key: &str, path: &Path, bytes: Bytes) -> Result<()> {
        self.retry("put_multipart", key, || self.put_multipart_once(key, path, bytes.clone())).await
    }

    /// One attempt: start, upload all parts in parallel, complete; abort on failure.
    async fn put_multipart_once(&self, key: &str, path: &Path, bytes: Bytes) -> Result<()> {
        let part_size = self.inner.opts.part_size.max(1);
        let mut upload = {
            let _permit = self.permit().await;
            self.inner.store.put_multipart(path).await.map_err(|e| Error::from_store(key, e))?
        };
        let mut parts = Vec::new();
        let mut offset = 0;
        while offset < bytes.len() {
            let end = (offset + part_size).min(bytes.len());
            parts.push(upload.put_part(PutPayload::from_bytes(bytes.slice(offset..end))));
            offset = end;
        }
        // Futures collected first: a closure inside the stream combinator would make the
        // returned future not `Send` for every lifetime (tokio::spawn rejects it).
        let parts: Vec<_> = parts
            .into_iter()
            .map(|part| async move {
                let _permit = self.permit().await;
                part.await
            })
            .collect();
        let uploaded = futures::stream::iter(parts)
            .buffer_unordered(self.inner.opts.concurrency.max(1))
            .try_collect::<Vec<()>>()
            .await;
        let result = match uploaded {
            Ok(_) => {
                let _permit = self.permit().await;
                upload.complete().await.map(|_| ())
            }
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            if let Err(abort) = upload.abort().await {
                tracing::debug!(key, error = %crate::redact::redact_text(&abort.to_string()), "multipart abort failed");
            }
            return Err(Error::from_store(key, e));
        }
        Ok(())
    }

    /// Read a whole object. Objects bigger than [`StoreOptions::part_size`] are fetched with
    /// parallel ranged GETs pinned to the ETag seen by a HEAD (a concurrent overwrite fails the
    /// read instead of mixing versions). Memory: the size the HEAD declares, never more (a
    /// longer body is cut off, a retryable error); where an attacker sets that size, read with
    /// [`Bucket::get_limited`] or [`Bucket::get_range_of`] instead.
    pub async fn get(&self, key: &str) -> Result<Bytes> {
        let span = tracing::debug_span!("get", bucket = %self.url(), key);
        async {
            let path = self.read_path(key)?;
            let part = self.inner.opts.part_size.max(1) as u64;
            let info = self.head(key).await?;
            if info.size <= part {
                return self
                    .retry("get", key, || async {
                        let _permit = self.permit().await;
                        let r = self
                            .inner
                            .store
                            .get_opts(&path, GetOptions::default())
                            .await
                            .map_err(|e| Error::from_store(key, e))?;
                        // Cut off at one part: the object may have been replaced since the
                        // HEAD, or the endpoint may send more than it declares, and nothing
                        // read from a bucket may size our memory. A caller that retries reads
                        // a grown object through the ranged path.
                        collect_at_most(key, r, part, info.size).await?.map_err(|got| Error::Transient {
                            key: key.to_string(),
                            source: crate::error::StoreError::new(&std::io::Error::other(format!(
                                "read returned more than one part ({part} bytes; {got} so far) \
                                 for an object its HEAD said was {} bytes",
                                info.size
                            ))),
                        })
                    })
                    .await;
            }
            let size = usize::try_from(info.size).map_err(|_| Error::TooLarge {
                key: key.to_string(),
                size: info.size,
                max: usize::MAX as u64,
            })?;
            let ranges: Vec<std::ops::Range<u64>> =
                (0..info.size).step_by(part as usize).map(|start| start..(start + part).min(info.size)).collect();
            let reads: Vec<_> =
                ranges.into_iter().map(|range| self.get_range(key, &path, range, info.etag.clone())).collect();
            let chunks: Vec<Bytes> =
                futures::stream::iter(reads).buffered(self.inner.opts.concurrency.max(1)).try_collect().await?;
            let mut out = BytesMut::with_capacity(size);
            for c in chunks {
                out.extend_from_slice(&c);
            }
            if out.len() != size {
                return Err(Error::Transient {
                    key: key.to_string(),
                    source: crate::error::StoreError::new(&std::io::Error::other(format!(
                        "ranged read returned {} bytes, expected {size}",
                        out.len()
                    ))),
                });
            }
            Ok(out.freeze())
        }
        .instrument(span)
        .await
    }

    /// Bytes `range` of an object (one ranged GET, retried), checked to be exactly that long.
    /// For readers that stream a large object in parts they choose (the agent's anchor
    /// decode) instead of holding it whole.
    pub async fn get_range_of(&self, key: &str, range: std::ops::Range<u64>) -> Result<Bytes> {
        let path = self.read_path(key)?;
        let want = range.end.saturating_sub(range.start);
        let b = self.get_range(key, &path, range, None).await?;
        if b.len() as u64 != want {
            return Err(Error::Transient {
                key: key.to_string(),
                source: crate::error::StoreError::new(&std::io::Error::other(format!(
                    "ranged read returned {} bytes, expected {want}",
                    b.len()
                ))),
            });
        }
        Ok(b)
    }

    /// One part of a parallel read, retried on its own, pinned to `etag`.
    async fn get_range(
        &self,
        key: &str,
        path: &Path,
        range: std::ops::Range<u64>,
        etag: Option<String>,
    ) -> Result<Bytes> {
        self.retry("get_range", key, || async {
            let _permit = self.permit().await;
            let opts = GetOptions {
                range: Some(GetRange::Bounded(range.clone())),
                if_match: etag.clone(),
                ..Default::default()
            };
            let r = self.inner.store.get_opts(path, opts).await.map_err(|e| map_get_range_error(key, e))?;
            let want = range.end.saturating_sub(range.start);
            collect_at_most(key, r, want, want).await?.map_err(|got| Error::Transient {
                key: key.to_string(),
                source: crate::error::StoreError::new(&std::io::Error::other(format!(
                    "ranged read returned more than the {want} bytes asked ({got} so far)"
                ))),
            })
        })
        .await
    }

    /// Read an object of at most `max` bytes. The size reported with the response headers is
    /// checked before the body is read, and the body is cut off past `max` in case the store
    /// lied: use this for manifests, markers and other untrusted small objects.
    pub async fn get_limited(&self, key: &str, max: u64) -> Result<Bytes> {
        let span = tracing::debug_span!("get_limited", bucket = %self.url(), key, max);
        async {
            let path = self.read_path(key)?;
            self.retry("get_limited", key, || async {
                let _permit = if max <= SMALL_PUT as u64 { self.control_permit().await } else { self.permit().await };
                let r = self
                    .inner
                    .store
                    .get_opts(&path, GetOptions::default())
                    .await
                    .map_err(|e| Error::from_store(key, e))?;
                read_limited(key, r, max).await
            })
            .await
        }
        .instrument(span)
        .await
    }

    /// Conditional GET: `Ok(None)` when the object still has ETag `etag`; otherwise the bytes
    /// and the new ETag. Backends that ignore `If-None-Match` simply always return the object.
    pub async fn get_if_changed(&self, key: &str, etag: Option<&str>) -> Result<Option<(Bytes, Option<String>)>> {
        self.get_if_changed_limited(key, etag, driftless_format::manifest::MAX_MANIFEST_BYTES as u64).await
    }

    /// [`Bucket::get_if_changed`] refusing bodies over `max` bytes ([`Error::TooLarge`]) before
    /// reading them: a hostile bucket must not be able to grow a reader's memory.
    pub async fn get_if_changed_limited(
        &self,
        key: &str,
        etag: Option<&str>,
        max: u64,
    ) -> Result<Option<(Bytes, Option<String>)>> {
        match self.poll_limited(key, etag, max).await? {
            Some((body, tag)) => Ok(Some((body?, tag))),
            None => Ok(None),
        }
    }

    /// [`Bucket::get_if_changed_limited`] for a poller: a body over `max` comes back as
    /// `Err(TooLarge)` beside its ETag, so that the poller need not fetch it again until it
    /// changes (found by review: an over-sized `latest.json` lost its ETag, and an up-to-date
    /// agent read it and listed the bucket at every poll).
    pub async fn poll_limited(
        &self,
        key: &str,
        etag: Option<&str>,
        max: u64,
    ) -> Result<Option<(Result<Bytes>, Option<String>)>> {
        let span = tracing::debug_span!("get_if_changed", bucket = %self.url(), key, etag);
        async {
            let path = self.read_path(key)?;
            self.retry("get_if_changed", key, || async {
                let _permit = self.control_permit().await;
                let opts = GetOptions { if_none_match: etag.map(str::to_string), ..Default::default() };
                match self.inner.store.get_opts(&path, opts).await {
                    Ok(r) => {
                        let new_etag = r.meta.e_tag.clone();
                        match read_limited(key, r, max).await {
                            Ok(bytes) => Ok(Some((Ok(bytes), new_etag))),
                            Err(e @ Error::TooLarge { .. }) => Ok(Some((Err(e), new_etag))),
                            Err(e) => Err(e),
                        }
                    }
                    Err(object_store::Error::NotModified { .. }) => Ok(None),
                    Err(e) => Err(Error::from_store(key, e)),
                }
            })
            .await
        }
        .instrument(span)
        .await
    }

    /// Metadata of one object.
    pub async fn head(&self, key: &str) -> Result<ObjectInfo> {
        let path = self.path(key)?;
        self.retry("head", key, || async {
            let _permit = self.control_permit().await;
            let meta = self.inner.store.head(&path).await.map_err(|e| Error::from_store(key, e))?;
            Ok(self.info(meta))
        })
        .instrument(tracing::debug_span!("head", bucket = %self.url(), key))
        .await
    }

    /// Every object whose key starts with `prefix` (a plain string prefix, not only whole
    /// path segments), recursively, sorted by key. Keys are relative to the bucket prefix.
    pub async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.list_inner(prefix, None).instrument(tracing::debug_span!("list", bucket = %self.url(), prefix)).await
    }

    /// Like [`Bucket::list`], keeping only keys strictly greater than `offset` (a key relative
    /// to the bucket prefix). Pushed down to the store where it can (S3 `start-after`).
    pub async fn list_after(&self, prefix: &str, offset: &str) -> Result<Vec<ObjectInfo>> {
        self.list_inner(prefix, Some(offset))
            .instrument(tracing::debug_span!("list_after", bucket = %self.url(), prefix, offset))
            .await
    }

    async fn list_inner(&self, prefix: &str, offset: Option<&str>) -> Result<Vec<ObjectInfo>> {
        // object_store lists whole segments: list the directory part, filter the rest.
        let dir = match prefix.rfind('/') {
            Some(i) => &prefix[..i],
            None => "",
        };
        let dir_path = self.dir_path(dir)?;
        let offset_path = match offset {
            Some(o) => {
                let trimmed = o.trim_end_matches('/');
                if trimmed.is_empty() {
                    None
                } else {
                    Some(self.path(trimmed)?)
                }
            }
            None => None,
        };
        let started = tokio::time::Instant::now();
        let mut out = self
            .retry("list", prefix, || async {
                let _permit = self.control_permit().await;
                let stream = match &offset_path {
                    Some(off) => self.inner.store.list_with_offset(dir_path.as_ref(), off),
                    None => self.inner.store.list(dir_path.as_ref()),
                };
                // Bounded in keys and in time: a hostile server can page forever, with keys
                // or with empty pages that say "more to come".
                let max = self.inner.opts.max_list_keys;
                let limit = self.inner.opts.list_timeout;
                // A key that is not a valid object path (a control character, an empty or `..`
                // segment, planted by hand) fails the listing: it cannot be skipped, because
                // the store's listing stream ends at its first error (`file://` and S3 alike),
                // so what would follow it is lost, and a listing silently partial is worse than
                // none (tried: it lost the newest step of a `file://` listing).
                let max_bytes = self.inner.opts.max_list_bytes;
                // Filtered as it streams: only the kept entries are held (a whole listing
                // collected first held up to 1 M `ObjectMeta`, about 1.2 GiB of planted long keys (worked out),
                // before its filter ran; found by review).
                let collect = async {
                    let mut stream = std::pin::pin!(stream);
                    let (mut seen, mut bytes, mut kept) = (0usize, 0usize, Vec::new());
                    while let Some(meta) = stream.try_next().await.map_err(|e| Error::from_store(prefix, e))? {
                        seen += 1;
                        if seen > max {
                            return Err(Error::TooManyKeys { prefix: prefix.to_string(), max });
                        }
                        let info = self.info(meta);
                        if !(info.key.starts_with(prefix) && offset.is_none_or(|o| info.key.as_str() > o)) {
                            continue;
                        }
                        bytes += std::mem::size_of::<ObjectInfo>()
                            + info.key.len()
                            + info.etag.as_ref().map_or(0, String::len);
                        if bytes > max_bytes {
                            return Err(Error::ListTooLarge { prefix: prefix.to_string(), max_bytes });
                        }
                        kept.push(info);
                    }
                    Ok(kept)
                };
                tokio::time::timeout(limit.saturating_sub(started.elapsed()), collect)
                    .await
                    .map_err(|_| Error::ListTimeout { prefix: prefix.to_string(), secs: limit.as_secs() })?
            })
            .await?;
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// Delete one object; a missing key is not an error.
    pub async fn delete(&self, key: &str) -> Result<()> {
        let path = self.path(key)?;
        self.retry("delete", key, || async {
            let _permit = self.control_permit().await;
            match self.inner.store.delete(&path).await {
                Ok(()) => Ok(()),
                Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(Error::from_store(key, e)),
            }
        })
        .instrument(tracing::debug_span!("delete", bucket = %self.url(), key))
        .await
    }

    // ---- helpers ----

    async fn permit(&self) -> tokio::sync::SemaphorePermit<'_> {
        // The semaphore is never closed.
        self.inner.permits.acquire().await.expect("bucket semaphore is never closed")
    }

    /// A permit of the small requests' pool (see `Inner::control`).
    async fn control_permit(&self) -> tokio::sync::SemaphorePermit<'_> {
        self.inner.control.acquire().await.expect("bucket semaphore is never closed")
    }

    /// Full store path of a key relative to the prefix, validated.
    /// Marks this bucket as the local directory `root` (see `Inner::local_root`).
    pub(crate) fn with_local_root(mut self, root: std::path::PathBuf) -> Bucket {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.local_root = Some(root);
        }
        self
    }

    /// [`Bucket::path`] of an object about to be read: in a local directory, a regular file
    /// only (a FIFO blocks its opening for ever, a device reads without end). A link to a
    /// regular file is followed, as the store does.
    fn read_path(&self, key: &str) -> Result<Path> {
        let path = self.path(key)?;
        if let Some(root) = &self.inner.local_root {
            let file = root.join(path.as_ref());
            if let Ok(md) = std::fs::metadata(&file) {
                if !md.is_file() {
                    let e = object_store::Error::Generic {
                        store: "LocalFileSystem",
                        source: format!("{} is not a regular file", file.display()).into(),
                    };
                    return Err(Error::Permanent { key: key.to_string(), source: crate::error::StoreError::new(&e) });
                }
            }
        }
        Ok(path)
    }

    fn path(&self, key: &str) -> Result<Path> {
        if key.is_empty() || key.ends_with('/') || key.starts_with('/') {
            return Err(Error::InvalidKey {
                key: key.to_string(),
                reason: "keys must be non-empty and must not start or end with '/'".into(),
            });
        }
        let full = if self.inner.prefix.is_empty() { key.to_string() } else { format!("{}/{key}", self.inner.prefix) };
        Path::parse(&full).map_err(|e| Error::InvalidKey { key: key.to_string(), reason: e.to_string() })
    }

    fn dir_path(&self, dir: &str) -> Result<Option<Path>> {
        let dir = dir.trim_matches('/');
        let full = match (self.inner.prefix.is_empty(), dir.is_empty()) {
            (true, true) => return Ok(None),
            (true, false) => dir.to_string(),
            (false, true) => self.inner.prefix.clone(),
            (false, false) => format!("{}/{dir}", self.inner.prefix),
        };
        Path::parse(&full).map(Some).map_err(|e| Error::InvalidKey { key: dir.to_string(), reason: e.to_string() })
    }

    fn info(&self, meta: ObjectMeta) -> ObjectInfo {
        let loc: &str = meta.location.as_ref();
        let key = if self.inner.prefix.is_empty() {
            loc.to_string()
        } else {
            loc.strip_prefix(self.inner.prefix.as_str()).and_then(|k| k.strip_prefix('/')).unwrap_or(loc).to_string()
        };
        ObjectInfo { key, size: meta.size, last_modified: meta.last_modified.into(), etag: meta.e_tag }
    }

    /// Run `f` until it succeeds, fails permanently, or the retry budget (count and total
    /// time) is spent. Full-jitter exponential backoff: 100 ms doubling, capped at 5 s.
    async fn retry<T, F, Fut>(&self, op: &'static str, key: &str, f: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        retry_with(&self.inner.opts, op, key, f).await
    }
}

pub(crate) async fn retry_with<T, F, Fut>(opts: &StoreOptions, op: &'static str, key: &str, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let start = tokio::time::Instant::now();
    let mut attempt = 0usize;
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            // A listing's deadline covers its retries: it is not started again.
            Err(e) if e.is_retryable() && !matches!(e, Error::ListTimeout { .. }) && attempt < opts.max_retries => {
                let cap_ms = 100u64.saturating_mul(1u64 << attempt.min(16)).min(5_000);
                let delay = std::time::Duration::from_millis(rand::thread_rng().gen_range(cap_ms / 2..=cap_ms));
                if start.elapsed() + delay > opts.retry_timeout {
                    tracing::warn!(op, key, attempt, error = %e, "retry budget spent");
                    return Err(e);
                }
                attempt += 1;
                tracing::debug!(op, key, attempt, delay_ms = delay.as_millis() as u64, error = %e, "retrying");
                tokio::time::sleep(delay).await;
            }
            Err(e) => return Err(e),
        }
    }
}

fn map_put_error(key: &str, e: object_store::Error) -> Error {
    match e {
        // S3 answers a lost If-None-Match race with 412 (Precondition), Azure with 409.
        object_store::Error::Precondition { .. } | object_store::Error::AlreadyExists { .. } => {
            Error::AlreadyExists { key: key.to_string() }
        }
        other => Error::from_store(key, other),
    }
}

fn map_get_range_error(key: &str, e: object_store::Error) -> Error {
    match e {
        // The object changed between the HEAD and this part: retry the read.
        object_store::Error::Precondition { .. } => {
            Error::Transient { key: key.to_string(), source: crate::error::StoreError::new(&e) }
        }
        other => Error::from_store(key, other),
    }
}

async fn read_limited(key: &str, r: object_store::GetResult, max: u64) -> Result<Bytes> {
    let size = r.meta.size;
    if size > max {
        return Err(Error::TooLarge { key: key.to_string(), size, max });
    }
    collect_at_most(key, r, max, size).await?.map_err(|size| Error::TooLarge { key: key.to_string(), size, max })
}

/// Collects a response body, stopping as soon as it passes `max` bytes (`Err(bytes seen)`):
/// an endpoint can send a body of any length whatever it declared, and nothing read from a
/// bucket may size our memory. `expect` only sizes the first allocation (capped at `max`).
async fn collect_at_most(
    key: &str,
    r: object_store::GetResult,
    max: u64,
    expect: u64,
) -> Result<std::result::Result<Bytes, u64>> {
    if matches!(r.payload, object_store::GetResultPayload::File(..)) {
        // A local file: object_store reads exactly the range asked, in one read (its stream
        // reads 8 KiB per blocking task: a 16 MiB part would take 2,048 of them).
        let b = r.bytes().await.map_err(|e| Error::from_store(key, e))?;
        return Ok(if b.len() as u64 > max { Err(b.len() as u64) } else { Ok(b) });
    }
    let mut out = BytesMut::with_capacity(expect.min(max) as usize);
    let mut stream = r.into_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| Error::from_store(key, e))?;
        if out.len() as u64 + chunk.len() as u64 > max {
            return Ok(Err(out.len() as u64 + chunk.len() as u64));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(Ok(out.freeze()))
}
