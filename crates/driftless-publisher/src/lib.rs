//! # driftless-publisher
//!
//! The library a trainer embeds. After each optimizer step call
//! [`Publisher::publish`] with the named tensors of the BF16 view; in one pass it finds what
//! changed since its snapshot of the last published state and updates the snapshot, then
//! returns. Encoding, hashing and signing run on a background thread, uploads on the
//! publisher's own tokio runtime, never on the trainer's threads.
//!
//! Per step the bucket sees, in this order: segments, signed manifest, ready marker, then the
//! `latest.json` hint. Anchors (full checkpoints) go out every `anchor_every` steps, early when
//! the chain since the last anchor grows past a fraction of an anchor, on the first publish,
//! after a restart and after a failed upload. An anchor is encoded from the snapshot into a
//! local spool file on a background thread and uploaded from there, so memory stays at one
//! snapshot plus buffers.
//!
//! Backpressure: the upload queue is bounded. When it is full, `publish` does not block and
//! does not queue: it returns [`Outcome::Coalesced`] and leaves the snapshot alone, so the next
//! delta is taken against the last queued state and readers skip straight to newer weights.
//!
//! Cargo feature `fault-hooks` (off; the crate's own tests turn it on): a hidden builder
//! method makes a chosen step's background encode fail or panic, the one failure inside the
//! publisher that the fault-injecting store cannot cause.
//!
//! ```no_run
//! use driftless_publisher::PublisherBuilder;
//! use driftless_format::{Keypair, TensorView, DType};
//! let key = Keypair::generate();
//! let mut p = PublisherBuilder::new("file:///tmp/stream").with_key(key).with_anchor_every(50).build()?;
//! let w = vec![0u8; 2 * 4096];
//! let t = [TensorView::new("w", DType::BF16, &[4096], &w)?];
//! p.publish(1, &t)?;
//! p.flush()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![warn(missing_docs)]

mod error;
mod publisher;
mod sharded;
mod snapshot;
mod upload;

pub use error::{Error, Result};
pub use publisher::{Outcome, PublishReceipt, Publisher, PublisherBuilder, Status};
pub use sharded::{
    PartKind, PartReport, Shard, ShardedPublisher, ShardedReceipt, StepOutcome, MAX_COMMIT_TIMEOUT, MAX_WORLD_SIZE,
};
