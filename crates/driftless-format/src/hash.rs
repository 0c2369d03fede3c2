//! The weights root: one SHA-256 that names a set of tensors exactly.
//!
//! Specification (also in `schemas/weights-root.md`), all integers unsigned 64-bit
//! little-endian:
//!
//! ```text
//! tensor_digest = SHA-256( "driftless.tensor.v1\0"
//!                          || len(name) || name            (UTF-8 bytes)
//!                          || len(dtype) || dtype          (safetensors spelling, e.g. "BF16")
//!                          || ndim || dim_0 || ... || dim_{ndim-1}
//!                          || len(data) || data )          (raw little-endian bytes)
//! weights_root  = SHA-256( "driftless.root.v1\0"
//!                          || count
//!                          || for each tensor in ascending byte order of name:
//!                               len(name) || name || tensor_digest )
//! ```
//!
//! The shard layout and the safetensors header bytes are deliberately not part of the root:
//! the same weights saved with another sharding have the same root. Tensors are hashed in
//! parallel, largest first, on the rayon pool.

use rayon::prelude::*;
use sha2::{Digest as _, Sha256};

use crate::{Digest, TensorView};

const TENSOR_DOMAIN: &[u8] = b"driftless.tensor.v1\0";
const ROOT_DOMAIN: &[u8] = b"driftless.root.v1\0";

/// Digest of one tensor.
pub fn tensor_digest(t: &TensorView<'_>) -> Digest {
    let mut h = tensor_hasher(t.name, t.dtype, t.shape, t.data.len() as u64);
    h.update(t.data);
    Digest(h.finalize().into())
}

/// A tensor's SHA-256 fed with everything before its data: feed it the `data_len` bytes of
/// data (in pieces, as they become ready) and finalize to get its [`tensor_digest`].
pub fn tensor_hasher(name: &str, dtype: crate::DType, shape: &[u64], data_len: u64) -> Sha256 {
    let mut h = Sha256::new();
    h.update(TENSOR_DOMAIN);
    put_bytes(&mut h, name.as_bytes());
    put_bytes(&mut h, dtype.as_str().as_bytes());
    h.update((shape.len() as u64).to_le_bytes());
    for d in shape {
        h.update(d.to_le_bytes());
    }
    h.update(data_len.to_le_bytes());
    h
}

fn put_bytes(h: &mut Sha256, b: &[u8]) {
    h.update((b.len() as u64).to_le_bytes());
    h.update(b);
}

/// Combines per-tensor digests into the weights root. `digests` may be in any order; they are
/// sorted by name here.
pub fn combine_root<'a>(digests: impl IntoIterator<Item = (&'a str, Digest)>) -> Digest {
    let mut v: Vec<(&str, Digest)> = digests.into_iter().collect();
    v.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    let mut h = Sha256::new();
    h.update(ROOT_DOMAIN);
    h.update((v.len() as u64).to_le_bytes());
    for (name, d) in v {
        put_bytes(&mut h, name.as_bytes());
        h.update(d.0);
    }
    Digest(h.finalize().into())
}

/// Per-tensor digests (in the order given) and the weights root of a set of tensors, computed
/// in parallel across tensors.
pub fn weights_root(tensors: &[TensorView<'_>]) -> (Vec<Digest>, Digest) {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    // Largest first so the long poles start early.
    order.sort_unstable_by_key(|&i| std::cmp::Reverse(tensors[i].data.len()));
    let mut digests = vec![Digest::default(); tensors.len()];
    let computed: Vec<(usize, Digest)> =
        order.par_iter().with_max_len(1).map(|&i| (i, tensor_digest(&tensors[i]))).collect();
    for (i, d) in computed {
        digests[i] = d;
    }
    let root = combine_root(tensors.iter().zip(digests.iter()).map(|(t, d)| (t.name, *d)));
    (digests, root)
}
