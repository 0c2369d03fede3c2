//! Bounds on the response bodies `object_store` reads whole.
//!
//! The client collects some bodies in full before it looks at them: an error response's (for
//! its message, at every retry), a listing page, and what a PUT, POST or DELETE answers. An
//! endpoint (not bucket contents: a real S3, GCS or Azure chooses those bodies itself) could
//! send gigabytes there and the request would hold them all. [`Bounded`] wraps the client's
//! HTTP service and, before `object_store` sees such a response, reads its body up to a bound:
//!
//! - an error status: the first [`MAX_ERROR_BODY`] bytes are kept and the rest is dropped (the
//!   status is what the client classifies by; the body only feeds a message, which
//!   [`crate::StoreError`] cuts to one line anyway);
//! - a success that is not an object's bytes (any method but GET, or a listing): more than
//!   [`MAX_SMALL_BODY`] bytes fail the request. No real answer is near it (a listing page of
//!   1,000 keys of at most 1 KiB each is about 1.5 MB).
//!
//! An object GET's body passes untouched: [`crate::Bucket`] reads it as a stream and stops at
//! the size it expects. So do the plain GETs of the clients' credential providers to instance
//! metadata services (EC2, ECS, GCE, Azure IMDS): configuration the deployment trusts, not the
//! storage endpoint.

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest, HttpResponse, HttpResponseBody, HttpService,
    ReqwestConnector,
};
use object_store::ClientOptions;

/// Bytes of an error response's body kept (the rest is dropped unread).
pub const MAX_ERROR_BODY: usize = 64 << 10;

/// Largest body of a successful response that is not an object's bytes.
pub const MAX_SMALL_BODY: usize = 16 << 20;

/// An [`HttpConnector`] whose clients bound the bodies `object_store` reads whole.
#[derive(Debug, Default)]
pub(crate) struct BoundedConnector;

impl HttpConnector for BoundedConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        Ok(HttpClient::new(Bounded(ReqwestConnector::default().connect(options)?)))
    }
}

#[derive(Debug)]
struct Bounded(HttpClient);

/// Whether a request's answer is collected whole by the client (not an object's bytes).
fn collected_whole(req: &HttpRequest) -> bool {
    if req.method() != "GET" {
        return true;
    }
    // S3 and GCS (XML API) list with `list-type=2`, Azure with `comp=list`.
    req.uri().query().is_some_and(|q| q.split('&').any(|p| p == "list-type=2" || p == "comp=list"))
}

#[async_trait]
impl HttpService for Bounded {
    async fn call(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        let whole = collected_whole(&req);
        let resp = self.0.execute(req).await?;
        let ok = resp.status().is_success();
        if ok && !whole {
            return Ok(resp);
        }
        let (parts, body) = resp.into_parts();
        let limit = if ok { MAX_SMALL_BODY } else { MAX_ERROR_BODY };
        let (bytes, over) = read_up_to(body, limit).await?;
        if over && ok {
            return Err(HttpError::new(HttpErrorKind::Decode, BodyTooLarge { limit, status: parts.status.as_u16() }));
        }
        Ok(HttpResponse::from_parts(parts, HttpResponseBody::from(bytes)))
    }
}

/// A successful answer whose body is not an object's bytes ran past [`MAX_SMALL_BODY`]: not
/// retryable (the store's error classification finds it in the chain), since the endpoint
/// answered and would answer the same again.
#[derive(Debug)]
pub struct BodyTooLarge {
    /// The bound, in bytes.
    pub limit: usize,
    /// The response's status.
    pub status: u16,
}

impl std::fmt::Display for BodyTooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "response body over {} bytes (status {})", self.limit, self.status)
    }
}

impl std::error::Error for BodyTooLarge {}

/// The first `limit` bytes of `body`, and whether it held more (the rest is not read).
async fn read_up_to(body: HttpResponseBody, limit: usize) -> Result<(Bytes, bool), HttpError> {
    let mut s = body.bytes_stream();
    let mut out = BytesMut::new();
    while let Some(chunk) = s.next().await {
        let chunk = chunk?;
        let room = limit - out.len();
        if chunk.len() > room {
            out.extend_from_slice(&chunk[..room]);
            return Ok((out.freeze(), true));
        }
        out.extend_from_slice(&chunk);
    }
    Ok((out.freeze(), false))
}
