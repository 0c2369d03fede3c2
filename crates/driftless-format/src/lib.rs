//! # driftless-format
//!
//! The byte format of driftless and everything that touches it without a network: reading and
//! writing safetensors checkpoints, sparse bit-exact deltas, anchors, the weights root, signed
//! manifests, and the redo journal for crash-safe in-place apply. No async runtime, no I/O
//! beyond local files.
//!
//! Map:
//! - [`checkpoint`]: memory-mapped safetensors files and sharded directories, [`Layout`].
//! - [`delta`]: diff, encode, decode and apply of sparse deltas ([`encode_delta`]).
//! - [`anchor`]: the compressed byte-plane form of full checkpoints.
//! - [`hash`]: the weights root ([`weights_root`]); [`slice`]: parts of a tensor held by
//!   different trainer ranks, and their digests assembled without the bytes.
//! - [`manifest`]: the JSON documents of a stream; [`sign`]: Ed25519 envelopes and trust sets.
//! - [`container`]: the one-file delta of `driftless diff`/`patch`.
//! - [`journal`]: the redo journal; [`ops`]: make, apply and verify a delta end to end.
//! - [`gen`]: RL-like chains for tests and benchmarks; [`reference`]: other systems' layouts.
//! - [`units`]: byte sizes as operators write them (`512MiB`), for every crate's options.
//!
//! ```
//! use driftless_format::{gen, ops, DeltaOptions, Layout};
//! let mut chain = gen::RlChain::new(&gen::ModelSpec::with_bf16_bytes(1 << 20), 2e-6, 7);
//! let base: Vec<_> = chain.views().iter().map(|v| (v.meta(), v.data.to_vec())).collect();
//! chain.step();
//! let base_views: Vec<_> = base.iter().map(|(m, d)| driftless_format::TensorView {
//!     name: &m.name, dtype: m.dtype, shape: &m.shape, data: d }).collect();
//! let layout = Layout::for_tensors(chain.metas(), u64::MAX).unwrap();
//! let spec = ops::DeltaSpec { stream_id: "s", step: 1, base_step: 0, base_root: None, layout: &layout };
//! let (manifest, delta) = ops::make_delta(spec, &base_views, &chain.views(), &DeltaOptions::default()).unwrap();
//! assert!(delta.stats.payload_bytes * 20 < manifest.stats.dense_bytes);
//! ```
#![warn(missing_docs)]

pub mod anchor;
pub mod checkpoint;
pub mod container;
pub mod delta;
mod dtype;
mod error;
pub mod fused;
pub mod gen;
pub mod hash;
pub mod journal;
pub mod manifest;
pub mod ops;
pub mod reference;
mod sha_x2;
pub mod sign;
pub mod slice;
mod tensor;
pub mod units;
pub mod varint;

pub use checkpoint::{Checkpoint, CheckpointFiles, CheckpointMut, Layout, ShardLayout, TensorsMut};
pub use delta::{diff, diff_update, encode_delta, Codec, DeltaDiff, DeltaOptions, ValueMode};
pub use dtype::DType;
pub use error::{io_is_retryable, one_line, one_line_within, Error, ErrorKind, Result, MAX_DETAIL};
pub use hash::weights_root;
pub use journal::Journal;
pub use manifest::{
    AnchorEncoding, AnchorManifest, DeltaManifest, LatestHint, ReadyMarker, StepKind, StreamDescriptor,
};
pub use sign::{Keypair, TrustSet};
pub use tensor::{
    check_extra_file_sizes, numel, validate_extra_file_name, validate_file_name, validate_tensor_name, Digest,
    TensorMeta, TensorView, MAX_EXTRA_FILE, MAX_EXTRA_FILES_TOTAL,
};
