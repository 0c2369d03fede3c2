//! # driftless-agent
//!
//! The sidecar next to an inference server. It follows a stream, rebuilds the newest step in
//! a local Hugging Face checkpoint directory bit for bit, proves it with the weights root and
//! tells the server to load it.
//!
//! - [`Agent::sync_once`] plans the cheapest route (delta chain from the local step, or the
//!   newest anchor plus the deltas after it, by bytes from the ready markers), verifies every
//!   signature and object hash before applying, the weights root after, and on any mismatch
//!   discards local state and takes the anchor route.
//! - Deltas are applied in place through memory maps with the redo journal, so a kill at any
//!   instant recovers from local state on restart (no anchor download).
//! - [`notify`]: sglang, vllm, http and exec adapters; [`server`]: `/healthz`, `/readyz`,
//!   `/metrics`, `/v1/status` and `POST /v1/poll`.
//!
//! Local directory: `DIR/current/` (the checkpoint the inference server loads),
//! `DIR/state.json` (verified step and root, written atomically), `DIR/journal` (redo records
//! of an in-place apply), `DIR/staging/` (anchors and layout-changing deltas being built).
#![warn(missing_docs)]

mod agent;
mod error;
pub mod metrics;
pub mod notify;
pub mod server;
mod state;

pub use agent::{Agent, AgentConfig, SyncOutcome, SyncPath};
pub use error::{Error, Result};
pub use state::LocalState;
