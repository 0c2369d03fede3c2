//! The publisher's copy of the last published state: owned buffers, in layout order.

use driftless_format::{Digest, Layout, TensorMeta, TensorView, TensorsMut};

/// Owned tensors + their layout and root.
#[derive(Debug)]
pub(crate) struct Snapshot {
    pub(crate) step: u64,
    pub(crate) layout: Layout,
    pub(crate) tensors: Vec<(TensorMeta, Vec<u8>)>,
    /// The weights root of `tensors`; `None` while the background encode of a deferred delta
    /// has not hashed them yet, and after that encode failed (the step then never reaches the
    /// bucket, and the next publish is an anchor).
    pub(crate) root: Option<Digest>,
    pub(crate) digests: Vec<Digest>,
}

impl Snapshot {
    /// Copies views (in layout order) into a snapshot and hashes the copy: the root is that of
    /// the bytes encoded, even when the views change under the call (a checkpoint file
    /// rewritten while it is read), never of a first read that differs from them.
    pub(crate) fn copy_from(step: u64, layout: Layout, views: &[TensorView<'_>]) -> Snapshot {
        use rayon::prelude::*;
        let tensors: Vec<(TensorMeta, Vec<u8>)> = views.par_iter().map(|v| (v.meta(), v.data.to_vec())).collect();
        let (digests, root) = driftless_format::weights_root(&views_of(&tensors));
        Snapshot { step, layout, tensors, root: Some(root), digests }
    }

    /// Copies views (in layout order) whose tensor digests and root are already known (a
    /// delta's manifest, a republish's check) into a snapshot, without hashing them again.
    pub(crate) fn copy_hashed(
        step: u64,
        layout: Layout,
        views: &[TensorView<'_>],
        digests: Vec<Digest>,
        root: Digest,
    ) -> Snapshot {
        use rayon::prelude::*;
        let tensors: Vec<(TensorMeta, Vec<u8>)> = views.par_iter().map(|v| (v.meta(), v.data.to_vec())).collect();
        Snapshot { step, layout, tensors, root: Some(root), digests }
    }

    pub(crate) fn views(&self) -> Vec<TensorView<'_>> {
        views_of(&self.tensors)
    }

    pub(crate) fn tensors_mut(&mut self) -> TensorsMut<'_> {
        tensors_mut_of(&mut self.tensors)
    }

    /// The tensors' bytes in layout order, read-only (the base of `driftless_format::diff`).
    pub(crate) fn bufs(&self) -> Vec<&[u8]> {
        self.tensors.iter().map(|(_, d)| &d[..]).collect()
    }
}

/// Writable access by name to owned tensors (the snapshot's, a pending step's copy).
pub(crate) fn tensors_mut_of(tensors: &mut [(TensorMeta, Vec<u8>)]) -> TensorsMut<'_> {
    let mut tm = TensorsMut::new();
    for (m, d) in tensors.iter_mut() {
        tm.insert(&m.name, m.dtype, d);
    }
    tm
}

/// Borrowed views of owned tensors (the snapshot's, a pending step's).
pub(crate) fn views_of(tensors: &[(TensorMeta, Vec<u8>)]) -> Vec<TensorView<'_>> {
    tensors.iter().map(|(m, d)| TensorView { name: &m.name, dtype: m.dtype, shape: &m.shape, data: d }).collect()
}
