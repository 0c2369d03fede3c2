//! Reference encodings from other systems, computed on the same steps for the benchmark table.
//! Not used on any product path.

use crate::TensorView;

/// Hugging Face TRL layout: int32 indices + verbatim values, uncompressed. Returns bytes.
pub fn trl_bytes(base: &[TensorView<'_>], target: &[TensorView<'_>]) -> u64 {
    let mut n = 0u64;
    for (a, b) in base.iter().zip(target) {
        let w = b.dtype.size();
        let changed = a.data.chunks_exact(w).zip(b.data.chunks_exact(w)).filter(|(x, y)| x != y).count() as u64;
        n += changed * (4 + w as u64);
    }
    n
}

/// PULSESync layout: u16 gaps (0xFFFF escape + u32 for longer gaps) + verbatim values, the
/// whole payload compressed with zstd-1. Returns compressed bytes.
pub fn pulse_bytes(base: &[TensorView<'_>], target: &[TensorView<'_>]) -> u64 {
    let mut buf = Vec::new();
    for (a, b) in base.iter().zip(target) {
        let w = b.dtype.size();
        let mut last = 0usize;
        let mut vals = Vec::new();
        for (i, (x, y)) in a.data.chunks_exact(w).zip(b.data.chunks_exact(w)).enumerate() {
            if x != y {
                let gap = i - last;
                if gap < 0xffff {
                    buf.extend_from_slice(&(gap as u16).to_le_bytes());
                } else {
                    buf.extend_from_slice(&0xffffu16.to_le_bytes());
                    buf.extend_from_slice(&(gap as u32).to_le_bytes());
                }
                last = i;
                vals.extend_from_slice(y);
            }
        }
        buf.extend_from_slice(&vals);
    }
    zstd::bulk::compress(&buf, 1).map(|c| c.len() as u64).unwrap_or(buf.len() as u64)
}
