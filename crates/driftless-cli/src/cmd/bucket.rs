//! Flags shared by the commands that open a bucket.

use driftless_store::StoreOptions;

/// Bucket connection flags (S3-compatible endpoints; other backends take the usual env vars).
#[derive(clap::Args, Debug, Clone)]
pub struct BucketArgs {
    /// Stream URL: file:///dir, memory://, s3://bucket/prefix, gs://..., az://..., hf://buckets/NS/BUCKET/prefix.
    #[arg(long, env = "DRIFTLESS_BUCKET")]
    pub bucket: String,
    /// S3 endpoint (S3-compatible servers); also AWS_ENDPOINT_URL.
    #[arg(long, env = "AWS_ENDPOINT_URL")]
    pub endpoint: Option<String>,
    /// Region; also AWS_REGION.
    #[arg(long, env = "AWS_REGION")]
    pub region: Option<String>,
    /// Allow plain HTTP endpoints (implied by an `http://` endpoint; also AWS_ALLOW_HTTP=true).
    #[arg(long)]
    pub allow_http: bool,
}

impl BucketArgs {
    fn options(&self) -> StoreOptions {
        let mut o = StoreOptions::default();
        if let Some(e) = &self.endpoint {
            o = o.with_endpoint(e.clone()).with_path_style(true);
        }
        if let Some(r) = &self.region {
            o = o.with_region(r.clone());
        }
        o.with_allow_http(self.allow_http || self.endpoint.as_deref().is_some_and(driftless_store::is_plain_http))
    }

    pub fn open(&self) -> anyhow::Result<driftless_store::Bucket> {
        Ok(driftless_store::Bucket::open(&self.bucket, &self.options())?)
    }

    /// For commands that only read or trim an existing stream (`agent --once`, `inspect`,
    /// `gc`): a `file://` directory that does not exist is an error (a typo), not a new empty
    /// bucket ([`driftless_store::Bucket::open_existing`]).
    pub fn open_existing(&self) -> anyhow::Result<driftless_store::Bucket> {
        Ok(driftless_store::Bucket::open_existing(&self.bucket, &self.options())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// URL schemes are case-insensitive: `HTTP://host` is a plain-HTTP endpoint too (found by
    /// review: it was refused by the client, retried, and called temporary).
    #[test]
    fn an_http_endpoint_implies_allow_http_whatever_its_case() {
        let args = |e: &str| BucketArgs {
            bucket: "s3://b/p".into(),
            endpoint: Some(e.into()),
            region: None,
            allow_http: false,
        };
        assert!(args("http://127.0.0.1:8333").options().allow_http);
        assert!(args("HTTP://127.0.0.1:8333").options().allow_http);
        assert!(!args("https://s3.example.com").options().allow_http);
    }
}
