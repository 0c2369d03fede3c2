//! A fault-injecting [`ObjectStore`] wrapper for tests of code built on [`Bucket`](crate::Bucket).
//!
//! ```
//! # use std::sync::Arc;
//! # use driftless_store::{Bucket, FaultyStore, StoreOptions};
//! let inner = Arc::new(object_store::memory::InMemory::new());
//! let faulty = Arc::new(FaultyStore::new(inner).fail_puts_matching("manifest.json", 2));
//! let bucket = Bucket::from_store(faulty.clone(), "stream", &StoreOptions::default());
//! // The first two puts of any key containing "manifest.json" fail with a retryable 503.
//! ```

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::StreamExt;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore, PutMultipartOptions,
    PutOptions, PutPayload, PutResult, RenameOptions,
};

/// Which calls a fault applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FaultOp {
    /// `put_opts` and the start of multipart uploads.
    Put,
    /// `get_opts` (GET and HEAD) and `get_ranges`.
    Get,
    /// Deletes.
    Delete,
    /// Listings (the pattern matches the listed prefix).
    List,
}

/// What an injected fault does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FaultKind {
    /// Fail before the call reaches the inner store with a retryable error (like an HTTP 503).
    Transient,
    /// Fail before the call reaches the inner store with a permanent error (like an HTTP 403).
    Permanent,
    /// Let the call succeed on the inner store, then report a retryable error (a lost
    /// response: the write happened but the caller cannot know). Only meaningful for puts.
    LostResponse,
    /// Let the call through after a pause (a slow request; for one path, where
    /// [`FaultyStore::set_delay`] slows every call).
    Slow(Duration),
    /// Let a GET through, then send this many MiB of body whatever the range asked (a hostile
    /// endpoint); [`FaultyStore::body_mib_sent`] counts the MiB the reader pulled. Other
    /// operations fail as with `Transient`.
    LongBody(u64),
    /// Panic inside a put (a bug in a client or in code on the request's path, to test that
    /// callers survive it). Other operations fail as with `Transient`.
    Panic,
}

#[derive(Debug)]
struct Rule {
    op: FaultOp,
    pattern: String,
    remaining: usize,
    kind: FaultKind,
}

#[derive(Debug, Default)]
struct State {
    rules: Mutex<Vec<Rule>>,
    delay_ms: AtomicU64,
    injected: AtomicUsize,
    /// Calls seen, by operation (Put, Get, Delete, List), faulted or not.
    calls: [AtomicU64; 4],
    /// The same, by object path (or listed prefix): bounded by the number of distinct paths.
    by_path: Mutex<std::collections::HashMap<String, [u64; 4]>>,
    /// MiB of [`FaultKind::LongBody`] bodies pulled by readers.
    body_mib: AtomicU64,
    /// Of the [`FaultOp::Get`] calls, the HEADs (`GetOptions::head`).
    heads: AtomicU64,
    /// Milliseconds added to every modification time reported (a bucket whose clock is off).
    clock_ms: std::sync::atomic::AtomicI64,
}

impl State {
    /// A listed or read object's metadata as a bucket with a shifted clock reports it.
    fn shift(&self, mut m: ObjectMeta) -> ObjectMeta {
        let ms = self.clock_ms.load(Ordering::Relaxed);
        m.last_modified += chrono::TimeDelta::milliseconds(ms);
        m
    }

    /// Consume one matching rule, if any.
    fn take(&self, op: FaultOp, location: &str) -> Option<FaultKind> {
        self.calls[op as usize].fetch_add(1, Ordering::Relaxed);
        let mut paths = self.by_path.lock().unwrap_or_else(|e| e.into_inner());
        match paths.get_mut(location) {
            Some(c) => c[op as usize] += 1,
            None => {
                let mut c = [0; 4];
                c[op as usize] = 1;
                paths.insert(location.to_string(), c);
            }
        }
        drop(paths);
        let mut rules = self.rules.lock().unwrap_or_else(|e| e.into_inner());
        let rule = rules.iter_mut().find(|r| r.op == op && r.remaining > 0 && location.contains(&r.pattern))?;
        rule.remaining -= 1;
        self.injected.fetch_add(1, Ordering::Relaxed);
        Some(rule.kind)
    }

    async fn pause(&self) {
        let ms = self.delay_ms.load(Ordering::Relaxed);
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }
}

fn injected_error(kind: FaultKind, op: FaultOp, location: &str) -> object_store::Error {
    let status = match kind {
        FaultKind::Permanent => "403 Forbidden",
        FaultKind::Transient
        | FaultKind::LostResponse
        | FaultKind::Slow(_)
        | FaultKind::LongBody(_)
        | FaultKind::Panic => "503 Service Unavailable",
    };
    object_store::Error::Generic {
        store: "FaultyStore",
        source: format!("injected {op:?} fault on {location}: Server returned non-2xx status code: {status}").into(),
    }
}

/// Wraps a store and fails chosen calls. Rules match when the object path (or listed prefix)
/// contains the pattern, and fire a fixed number of times; clones of an `Arc<FaultyStore>`
/// share them, so faults can be added while a test runs.
#[derive(Debug)]
pub struct FaultyStore {
    inner: Arc<dyn ObjectStore>,
    state: Arc<State>,
}

impl FaultyStore {
    /// Wrap `inner` with no faults.
    pub fn new(inner: Arc<dyn ObjectStore>) -> FaultyStore {
        FaultyStore { inner, state: Arc::default() }
    }

    /// Fail the next `times` puts whose path contains `pattern` (retryable error).
    pub fn fail_puts_matching(self, pattern: &str, times: usize) -> Self {
        self.inject(FaultOp::Put, pattern, times, FaultKind::Transient);
        self
    }

    /// Fail the next `times` GETs/HEADs whose path contains `pattern` (retryable error).
    pub fn fail_gets_matching(self, pattern: &str, times: usize) -> Self {
        self.inject(FaultOp::Get, pattern, times, FaultKind::Transient);
        self
    }

    /// Fail the next `times` deletes whose path contains `pattern` (retryable error).
    pub fn fail_deletes_matching(self, pattern: &str, times: usize) -> Self {
        self.inject(FaultOp::Delete, pattern, times, FaultKind::Transient);
        self
    }

    /// Fail the next `times` listings whose prefix contains `pattern` (retryable error).
    pub fn fail_lists_matching(self, pattern: &str, times: usize) -> Self {
        self.inject(FaultOp::List, pattern, times, FaultKind::Transient);
        self
    }

    /// Let the next `times` matching puts succeed but report a retryable error.
    pub fn lose_put_responses_matching(self, pattern: &str, times: usize) -> Self {
        self.inject(FaultOp::Put, pattern, times, FaultKind::LostResponse);
        self
    }

    /// Delay every call (GET, HEAD, put, delete) by `delay`.
    pub fn delay(self, delay: Duration) -> Self {
        self.set_delay(delay);
        self
    }

    /// Add a rule at any time (also through an `Arc`).
    pub fn inject(&self, op: FaultOp, pattern: &str, times: usize, kind: FaultKind) {
        self.state.rules.lock().unwrap_or_else(|e| e.into_inner()).push(Rule {
            op,
            pattern: pattern.to_string(),
            remaining: times,
            kind,
        });
    }

    /// Change the delay at any time.
    pub fn set_delay(&self, delay: Duration) {
        self.state.delay_ms.store(delay.as_millis().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    /// Shifts every modification time the store reports by `ms` milliseconds (negative: a
    /// bucket whose clock is behind this host's).
    pub fn set_clock_offset_ms(&self, ms: i64) {
        self.state.clock_ms.store(ms, Ordering::Relaxed);
    }

    /// Remove all rules that have not fired yet and the delay.
    pub fn clear(&self) {
        self.state.rules.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.set_delay(Duration::ZERO);
    }

    /// How many faults have fired so far.
    pub fn injected(&self) -> usize {
        self.state.injected.load(Ordering::Relaxed)
    }

    /// Calls of one kind seen so far (GET counts GETs and HEADs; a listing counts once however
    /// many pages it has), to count the requests an operation makes.
    pub fn calls(&self, op: FaultOp) -> u64 {
        self.state.calls[op as usize].load(Ordering::Relaxed)
    }

    /// Calls of one kind seen so far on paths (or listed prefixes) containing `pattern`: the
    /// requests an operation makes for one object.
    pub fn calls_to(&self, op: FaultOp, pattern: &str) -> u64 {
        let paths = self.state.by_path.lock().unwrap_or_else(|e| e.into_inner());
        paths.iter().filter(|(p, _)| p.contains(pattern)).map(|(_, c)| c[op as usize]).sum()
    }

    /// HEADs seen so far (counted among the [`FaultOp::Get`] calls too).
    pub fn heads(&self) -> u64 {
        self.state.heads.load(Ordering::Relaxed)
    }

    /// MiB of [`FaultKind::LongBody`] bodies readers pulled so far.
    pub fn body_mib_sent(&self) -> u64 {
        self.state.body_mib.load(Ordering::Relaxed)
    }

    /// The wrapped store.
    pub fn inner(&self) -> &Arc<dyn ObjectStore> {
        &self.inner
    }
}

impl fmt::Display for FaultyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FaultyStore({})", self.inner)
    }
}

#[async_trait]
impl ObjectStore for FaultyStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.state.pause().await;
        match self.state.take(FaultOp::Put, location.as_ref()) {
            None => self.inner.put_opts(location, payload, opts).await,
            Some(FaultKind::Slow(d)) => {
                tokio::time::sleep(d).await;
                self.inner.put_opts(location, payload, opts).await
            }
            Some(FaultKind::Panic) => panic!("injected panic on a put of {location}"),
            Some(FaultKind::LostResponse) => {
                self.inner.put_opts(location, payload, opts).await?;
                Err(injected_error(FaultKind::LostResponse, FaultOp::Put, location.as_ref()))
            }
            Some(kind) => Err(injected_error(kind, FaultOp::Put, location.as_ref())),
        }
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.state.pause().await;
        match self.state.take(FaultOp::Put, location.as_ref()) {
            None | Some(FaultKind::LostResponse) => self.inner.put_multipart_opts(location, opts).await,
            Some(FaultKind::Slow(d)) => {
                tokio::time::sleep(d).await;
                self.inner.put_multipart_opts(location, opts).await
            }
            Some(kind) => Err(injected_error(kind, FaultOp::Put, location.as_ref())),
        }
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> object_store::Result<GetResult> {
        self.state.pause().await;
        if options.head {
            self.state.heads.fetch_add(1, Ordering::Relaxed);
        }
        let shifted = |r: object_store::Result<GetResult>| {
            r.map(|mut r| {
                r.meta = self.state.shift(r.meta);
                r
            })
        };
        match self.state.take(FaultOp::Get, location.as_ref()) {
            None => shifted(self.inner.get_opts(location, options).await),
            Some(FaultKind::Slow(d)) => {
                tokio::time::sleep(d).await;
                shifted(self.inner.get_opts(location, options).await)
            }
            Some(FaultKind::LongBody(mib)) => {
                let mut r = self.inner.get_opts(location, options).await?;
                let state = Arc::clone(&self.state);
                let body = futures::stream::iter(0..mib).map(move |_| {
                    state.body_mib.fetch_add(1, Ordering::Relaxed);
                    Ok(Bytes::from(vec![0u8; 1 << 20]))
                });
                r.payload = object_store::GetResultPayload::Stream(body.boxed());
                Ok(r)
            }
            Some(kind) => Err(injected_error(kind, FaultOp::Get, location.as_ref())),
        }
    }

    async fn get_ranges(&self, location: &Path, ranges: &[Range<u64>]) -> object_store::Result<Vec<Bytes>> {
        self.state.pause().await;
        match self.state.take(FaultOp::Get, location.as_ref()) {
            None => self.inner.get_ranges(location, ranges).await,
            Some(FaultKind::Slow(d)) => {
                tokio::time::sleep(d).await;
                self.inner.get_ranges(location, ranges).await
            }
            Some(kind) => Err(injected_error(kind, FaultOp::Get, location.as_ref())),
        }
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        let state = Arc::clone(&self.state);
        let inner = Arc::clone(&self.inner);
        // Split off the faulted paths; pass the rest to the inner store one by one so the
        // order of results stays that of the input.
        locations
            .then(move |loc| {
                let state = Arc::clone(&state);
                let inner = Arc::clone(&inner);
                async move {
                    let loc = loc?;
                    state.pause().await;
                    match state.take(FaultOp::Delete, loc.as_ref()) {
                        Some(FaultKind::Slow(d)) => tokio::time::sleep(d).await,
                        Some(kind) => return Err(injected_error(kind, FaultOp::Delete, loc.as_ref())),
                        None => {}
                    }
                    let one = futures::stream::once(futures::future::ready(Ok(loc))).boxed();
                    match inner.delete_stream(one).next().await {
                        Some(r) => r,
                        None => Err(object_store::Error::Generic {
                            store: "FaultyStore",
                            source: "inner delete_stream returned nothing".into(),
                        }),
                    }
                }
            })
            .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        let p = prefix.map(|p| p.to_string()).unwrap_or_default();
        let state = Arc::clone(&self.state);
        let shifted = move |s: BoxStream<'static, object_store::Result<ObjectMeta>>| {
            s.map(move |r| r.map(|m| state.shift(m))).boxed()
        };
        match self.state.take(FaultOp::List, &p) {
            None => shifted(self.inner.list(prefix)),
            Some(FaultKind::Slow(d)) => {
                let s = shifted(self.inner.list(prefix));
                futures::stream::once(async move {
                    tokio::time::sleep(d).await;
                    s
                })
                .flatten()
                .boxed()
            }
            Some(kind) => {
                futures::stream::once(futures::future::ready(Err(injected_error(kind, FaultOp::List, &p)))).boxed()
            }
        }
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        let p = prefix.map(|p| p.to_string()).unwrap_or_default();
        let state = Arc::clone(&self.state);
        let shifted = move |s: BoxStream<'static, object_store::Result<ObjectMeta>>| {
            s.map(move |r| r.map(|m| state.shift(m))).boxed()
        };
        match self.state.take(FaultOp::List, &p) {
            None => shifted(self.inner.list_with_offset(prefix, offset)),
            Some(FaultKind::Slow(d)) => {
                let s = shifted(self.inner.list_with_offset(prefix, offset));
                futures::stream::once(async move {
                    tokio::time::sleep(d).await;
                    s
                })
                .flatten()
                .boxed()
            }
            Some(kind) => {
                futures::stream::once(futures::future::ready(Err(injected_error(kind, FaultOp::List, &p)))).boxed()
            }
        }
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        let p = prefix.map(|p| p.to_string()).unwrap_or_default();
        let shifted = |r: object_store::Result<ListResult>| {
            r.map(|mut r| {
                r.objects = r.objects.into_iter().map(|m| self.state.shift(m)).collect();
                r
            })
        };
        match self.state.take(FaultOp::List, &p) {
            None => shifted(self.inner.list_with_delimiter(prefix).await),
            Some(FaultKind::Slow(d)) => {
                tokio::time::sleep(d).await;
                shifted(self.inner.list_with_delimiter(prefix).await)
            }
            Some(kind) => Err(injected_error(kind, FaultOp::List, &p)),
        }
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> object_store::Result<()> {
        self.inner.rename_opts(from, to, options).await
    }
}
