//! Telling the inference server to load new weights.
//!
//! - `sglang=URL`: `POST /pause_generation`, `POST /update_weights_from_disk`
//!   `{"model_path": DIR, "weight_version": "STEP"}` (blocks until loaded), `POST
//!   /continue_generation` — continue is sent even when the load fails, so the server is never
//!   left paused.
//! - `vllm=URL`: the weight-transfer endpoints of vLLM's dev mode (`VLLM_SERVER_DEV_MODE=1`):
//!   `POST /pause`, `POST /start_weight_update`, `POST /update_weights`
//!   `{"backend": "disk", "model_path": DIR}`, `POST /finish_weight_update`
//!   `{"weight_version": "STEP"}`, `POST /resume` (resume is sent on failure too).
//! - `http=URL`: one `POST` with `{"step", "weights_root", "dir"}`.
//! - `exec=COMMAND`: runs `sh -c COMMAND` with `DRIFTLESS_STEP`, `DRIFTLESS_WEIGHTS_ROOT`,
//!   `DRIFTLESS_DIR` in the environment; exit status 0 is success.
//!
//! Each call is retried (3 attempts, backoff) with a timeout (load calls: 10 minutes).

use std::path::Path;
use std::time::Duration;

use driftless_format::Digest;
use serde_json::json;

use crate::{Error, Result};

/// A configured notifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notifier {
    /// SGLang server base URL.
    Sglang(String),
    /// vLLM server base URL.
    Vllm(String),
    /// Generic webhook.
    Http(String),
    /// Shell command.
    Exec(String),
}

impl std::str::FromStr for Notifier {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (k, v) = s.split_once('=').ok_or_else(|| format!("notify target {s:?} is not KIND=TARGET"))?;
        let url = || v.trim_end_matches('/').to_string();
        match k {
            "sglang" => Ok(Notifier::Sglang(url())),
            "vllm" => Ok(Notifier::Vllm(url())),
            "http" => Ok(Notifier::Http(v.to_string())),
            "exec" => Ok(Notifier::Exec(v.to_string())),
            _ => Err(format!("unknown notify kind {k:?} (sglang, vllm, http, exec)")),
        }
    }
}

impl std::fmt::Display for Notifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Notifier::Sglang(u) => write!(f, "sglang={u}"),
            Notifier::Vllm(u) => write!(f, "vllm={u}"),
            Notifier::Http(u) => write!(f, "http={u}"),
            Notifier::Exec(c) => write!(f, "exec={c}"),
        }
    }
}

async fn post(
    client: &reqwest::Client,
    url: &str,
    body: serde_json::Value,
    timeout: Duration,
) -> std::result::Result<(), String> {
    let mut last = String::new();
    for attempt in 0..3u32 {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(200 << attempt)).await;
        }
        match client.post(url).json(&body).timeout(timeout).send().await {
            Ok(r) if r.status().is_success() => return Ok(()),
            // A 4xx will not get better by retrying.
            Ok(r) if r.status().is_client_error() => return Err(format!("{url}: HTTP {}", r.status())),
            Ok(r) => last = format!("{url}: HTTP {}", r.status()),
            Err(e) => last = format!("{url}: {e}"),
        }
    }
    Err(last)
}

impl Notifier {
    /// Tells the server to load `dir` at `step`; returns when it has loaded (or failed).
    pub async fn notify(&self, client: &reqwest::Client, step: u64, root: Digest, dir: &Path) -> Result<()> {
        let short = Duration::from_secs(30);
        let long = Duration::from_secs(600);
        let d = dir.display().to_string();
        let fail = |detail: String| Error::Notify { target: self.to_string(), detail };
        match self {
            Notifier::Sglang(u) => {
                post(client, &format!("{u}/pause_generation"), json!({}), short).await.map_err(fail)?;
                let load = post(
                    client,
                    &format!("{u}/update_weights_from_disk"),
                    json!({"model_path": d, "weight_version": step.to_string()}),
                    long,
                )
                .await;
                let cont = post(client, &format!("{u}/continue_generation"), json!({}), short).await;
                load.map_err(fail)?;
                cont.map_err(fail)
            }
            Notifier::Vllm(u) => {
                post(client, &format!("{u}/pause"), json!({}), short).await.map_err(fail)?;
                let r = async {
                    post(client, &format!("{u}/start_weight_update"), json!({}), short).await?;
                    post(client, &format!("{u}/update_weights"), json!({"backend": "disk", "model_path": d}), long)
                        .await?;
                    post(
                        client,
                        &format!("{u}/finish_weight_update"),
                        json!({"weight_version": step.to_string()}),
                        short,
                    )
                    .await
                }
                .await;
                let resume = post(client, &format!("{u}/resume"), json!({}), short).await;
                r.map_err(fail)?;
                resume.map_err(fail)
            }
            Notifier::Http(u) => {
                post(client, u, json!({"step": step, "weights_root": root, "dir": d}), long).await.map_err(fail)
            }
            Notifier::Exec(c) => {
                let st = tokio::process::Command::new("sh")
                    .arg("-c")
                    .arg(c)
                    .env("DRIFTLESS_STEP", step.to_string())
                    .env("DRIFTLESS_WEIGHTS_ROOT", root.to_hex())
                    .env("DRIFTLESS_DIR", &d)
                    .status()
                    .await
                    .map_err(|e| fail(e.to_string()))?;
                if st.success() {
                    Ok(())
                } else {
                    Err(fail(format!("exited with {st}")))
                }
            }
        }
    }
}
