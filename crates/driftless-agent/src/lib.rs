//! # driftless-agent
//!
//! The sidecar next to an inference server. It follows a stream, rebuilds the newest step in
//! a local Hugging Face checkpoint directory bit for bit, proves it with the weights root and
//! tells the server to load it.
//!
//! - [`plan`]: which ready steps exist and may be used, and the cheapest route (one delta,
//!   several, or an anchor plus deltas); shared with the Python `Follower`.
//! - [`Agent::sync_once`]: builds the planned step in the inactive slot of the directory,
//!   verifies every signature and object hash before applying and the weights root after,
//!   makes it durable, switches `DIR/current` to it atomically, then notifies. A step that
//!   fails in any way is refused and planned around; the verified weights are kept.
//! - [`anchor_stream`]: an anchor shard streamed out of the bucket (ranged GETs, decoded as
//!   they arrive, memory bounded by the parts in flight); shared with the Python `Follower`.
//! - [`state`]: the directory layout (two slots, the `current` symlink, the lock, the state
//!   file) and the durability order.
//! - [`notify`]: sglang, vllm, http and exec adapters; [`server`]: `/healthz`, `/readyz`,
//!   `/metrics`, `/v1/status` and `POST /v1/poll`; [`patch`]: the checkpoint-coordinate patch an
//!   engine applies in place instead of reloading (vLLM `patch=on`).
#![warn(missing_docs)]

mod agent;
pub mod anchor_stream;
mod error;
pub mod metrics;
pub mod notify;
pub mod patch;
pub mod plan;
pub mod server;
pub mod state;

pub use agent::{
    default_anchor_parts, Agent, AgentConfig, RefusedStep, Stopped, SyncOutcome, SyncPath, IDLE_GROUP_BYTES, MIN_POLL,
};
pub use error::{Error, Result};
pub use plan::Fault;
pub use state::LocalState;
