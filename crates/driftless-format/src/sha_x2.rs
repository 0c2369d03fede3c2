//! The weights root's leaves hashed two at a time on one core (x86-64 SHA extensions).
//!
//! Why: one SHA-256 stream is bound by the latency of `sha256rnds2` (each pair of rounds needs
//! the state the previous pair produced), not by how often a core can issue it. Two independent
//! messages whose rounds are interleaved in one instruction stream keep the unit busy while
//! each waits on its own previous result. Every leaf of the weights root (`hash::LEAF`, 8 KiB
//! behind the same 18-byte domain) is an independent message of the same length, so whole
//! leaves are hashed in pairs. `root_bench` (`cargo run --release -p driftless-format --example
//! root_bench`) prints the chunk digests with leaves one by one next to leaves in pairs; the
//! README's "Weights root" section has the figures.
//!
//! The output is SHA-256, bit for bit: the tests compare every pair against the `sha2` crate's
//! digest of the same message, on random data, and the root's own tests hash through here.
//! Without the SHA extensions (or on another architecture) leaves are hashed one at a time
//! with `sha2`, which picks its own fastest backend.

use crate::hash::{leaf_digest, LEAF};
use crate::Digest;

/// Calls `out` with the digest of each leaf of `data` in order (the last one short if `data`
/// ends inside a leaf): whole leaves in pairs where the CPU allows, the rest one at a time.
pub(crate) fn leaves(data: &[u8], out: impl FnMut(Digest)) {
    leaves_with(data, true, out)
}

/// [`leaves`], in pairs only when `paired` (the tests take both routes on one machine).
fn leaves_with(data: &[u8], paired: bool, mut out: impl FnMut(Digest)) {
    let mut pairs = data.chunks_exact(2 * LEAF);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = paired;
    #[cfg(target_arch = "x86_64")]
    if paired && ni::available() {
        for p in pairs.by_ref() {
            let (a, b) = p.split_at(LEAF);
            // SAFETY: the CPU has the features `ni::pair` is compiled for (checked above).
            let (da, db) = unsafe { ni::pair(a, b) };
            out(da);
            out(db);
        }
    }
    for p in pairs.by_ref() {
        let (a, b) = p.split_at(LEAF);
        out(leaf_digest(a));
        out(leaf_digest(b));
    }
    // Under two leaves: a whole one and a short one, or one of either.
    pairs.remainder().chunks(LEAF).for_each(|l| out(leaf_digest(l)));
}

#[cfg(target_arch = "x86_64")]
mod ni {
    use core::arch::x86_64::*;

    use super::LEAF;
    use crate::hash::LEAF_DOMAIN;
    use crate::Digest;

    pub(super) fn available() -> bool {
        std::is_x86_feature_detected!("sha")
            && std::is_x86_feature_detected!("sse2")
            && std::is_x86_feature_detected!("ssse3")
            && std::is_x86_feature_detected!("sse4.1")
    }

    const H0: [u32; 8] =
        [0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19];

    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
        0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
        0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
        0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
        0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
        0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
        0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];

    /// The message of a leaf is the domain, then the leaf: block 0 is the domain and the
    /// leaf's first `HEAD` bytes, blocks 1..=127 lie in the leaf as they are, and the last
    /// block holds the leaf's last `DOMAIN_LEN` bytes and the padding.
    const DOMAIN_LEN: usize = LEAF_DOMAIN.len();
    const HEAD: usize = 64 - DOMAIN_LEN;
    const MIDDLE: usize = (LEAF - HEAD) / 64;
    const TAIL: usize = LEAF - HEAD - MIDDLE * 64;
    const _: () = assert!(TAIL + 1 + 8 <= 64, "the padding fits in the last block");

    /// (ABEF, CDGH): the state as the SHA extensions hold it.
    #[derive(Clone, Copy)]
    struct Lane(__m128i, __m128i);

    #[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
    fn load(s: &[u32; 8]) -> Lane {
        // SAFETY: two unaligned 16-byte loads from a 32-byte array.
        let (dcba, efgh) = unsafe { (_mm_loadu_si128(s.as_ptr().cast()), _mm_loadu_si128(s.as_ptr().add(4).cast())) };
        let cdab = _mm_shuffle_epi32(dcba, 0xB1);
        let efgh = _mm_shuffle_epi32(efgh, 0x1B);
        Lane(_mm_alignr_epi8(cdab, efgh, 8), _mm_blend_epi16(efgh, cdab, 0xF0))
    }

    #[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
    fn digest(l: Lane) -> Digest {
        let feba = _mm_shuffle_epi32(l.0, 0x1B);
        let dchg = _mm_shuffle_epi32(l.1, 0xB1);
        let mut s = [0u32; 8];
        // SAFETY: two unaligned 16-byte stores into a 32-byte array.
        unsafe {
            _mm_storeu_si128(s.as_mut_ptr().cast(), _mm_blend_epi16(feba, dchg, 0xF0));
            _mm_storeu_si128(s.as_mut_ptr().add(4).cast(), _mm_alignr_epi8(dchg, feba, 8));
        }
        let mut d = [0u8; 32];
        for (o, w) in d.chunks_exact_mut(4).zip(s) {
            o.copy_from_slice(&w.to_be_bytes());
        }
        Digest(d)
    }

    /// W[t..t+4] from the previous 16 words (`w0` holds W[t-16..t-12]), into `w0`.
    macro_rules! schedule {
        ($w0:ident, $w1:ident, $w2:ident, $w3:ident) => {
            $w0 =
                _mm_sha256msg2_epu32(_mm_add_epi32(_mm_sha256msg1_epu32($w0, $w1), _mm_alignr_epi8($w3, $w2, 4)), $w3);
        };
    }

    /// Four rounds of each lane, the lanes' instructions interleaved.
    macro_rules! rounds4 {
        ($a0:ident, $a1:ident, $b0:ident, $b1:ident, $wa:ident, $wb:ident, $k:expr) => {
            let ta = _mm_add_epi32($wa, $k);
            let tb = _mm_add_epi32($wb, $k);
            $a1 = _mm_sha256rnds2_epu32($a1, $a0, ta);
            $b1 = _mm_sha256rnds2_epu32($b1, $b0, tb);
            $a0 = _mm_sha256rnds2_epu32($a0, $a1, _mm_shuffle_epi32(ta, 0x0E));
            $b0 = _mm_sha256rnds2_epu32($b0, $b1, _mm_shuffle_epi32(tb, 0x0E));
        };
    }

    /// Rounds 4r..4r+4 of both lanes, scheduling their words first when r >= 4.
    macro_rules! step {
        ($k:ident, $r:expr, $a0:ident, $a1:ident, $b0:ident, $b1:ident,
         [$x0:ident, $x1:ident, $x2:ident, $x3:ident], [$y0:ident, $y1:ident, $y2:ident, $y3:ident]) => {
            if $r >= 4 {
                schedule!($x0, $x1, $x2, $x3);
                schedule!($y0, $y1, $y2, $y3);
            }
            rounds4!($a0, $a1, $b0, $b1, $x0, $y0, $k[$r]);
        };
    }

    /// Runs `n` 64-byte blocks from `a` through lane `la` and `n` from `b` through `lb`, the
    /// rounds of the two interleaved.
    #[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
    fn blocks2(la: &mut Lane, lb: &mut Lane, a: &[u8], b: &[u8], n: usize) {
        assert!(a.len() / 64 >= n && b.len() / 64 >= n);
        let mask = _mm_set_epi64x(0x0C0D_0E0F_0809_0A0Bu64 as i64, 0x0405_0607_0001_0203u64 as i64);
        let mut k = [_mm_setzero_si128(); 16];
        for (i, k) in k.iter_mut().enumerate() {
            // SAFETY: `K` holds 64 words: word 4i..4i+4 is in bounds.
            *k = unsafe { _mm_loadu_si128(K.as_ptr().add(4 * i).cast()) };
        }
        let (mut a0, mut a1, mut b0, mut b1) = (la.0, la.1, lb.0, lb.1);
        for i in 0..n {
            let (sa0, sa1, sb0, sb1) = (a0, a1, b0, b1);
            // SAFETY: block i lies inside both slices (asserted above); unaligned loads.
            let (pa, pb) = unsafe { (a.as_ptr().add(64 * i), b.as_ptr().add(64 * i)) };
            let (mut p0, mut p1, mut p2, mut p3, mut q0, mut q1, mut q2, mut q3);
            // SAFETY: 4 x 16 bytes of each block.
            unsafe {
                p0 = _mm_shuffle_epi8(_mm_loadu_si128(pa.cast()), mask);
                p1 = _mm_shuffle_epi8(_mm_loadu_si128(pa.add(16).cast()), mask);
                p2 = _mm_shuffle_epi8(_mm_loadu_si128(pa.add(32).cast()), mask);
                p3 = _mm_shuffle_epi8(_mm_loadu_si128(pa.add(48).cast()), mask);
                q0 = _mm_shuffle_epi8(_mm_loadu_si128(pb.cast()), mask);
                q1 = _mm_shuffle_epi8(_mm_loadu_si128(pb.add(16).cast()), mask);
                q2 = _mm_shuffle_epi8(_mm_loadu_si128(pb.add(32).cast()), mask);
                q3 = _mm_shuffle_epi8(_mm_loadu_si128(pb.add(48).cast()), mask);
            }
            step!(k, 0, a0, a1, b0, b1, [p0, p1, p2, p3], [q0, q1, q2, q3]);
            step!(k, 1, a0, a1, b0, b1, [p1, p2, p3, p0], [q1, q2, q3, q0]);
            step!(k, 2, a0, a1, b0, b1, [p2, p3, p0, p1], [q2, q3, q0, q1]);
            step!(k, 3, a0, a1, b0, b1, [p3, p0, p1, p2], [q3, q0, q1, q2]);
            step!(k, 4, a0, a1, b0, b1, [p0, p1, p2, p3], [q0, q1, q2, q3]);
            step!(k, 5, a0, a1, b0, b1, [p1, p2, p3, p0], [q1, q2, q3, q0]);
            step!(k, 6, a0, a1, b0, b1, [p2, p3, p0, p1], [q2, q3, q0, q1]);
            step!(k, 7, a0, a1, b0, b1, [p3, p0, p1, p2], [q3, q0, q1, q2]);
            step!(k, 8, a0, a1, b0, b1, [p0, p1, p2, p3], [q0, q1, q2, q3]);
            step!(k, 9, a0, a1, b0, b1, [p1, p2, p3, p0], [q1, q2, q3, q0]);
            step!(k, 10, a0, a1, b0, b1, [p2, p3, p0, p1], [q2, q3, q0, q1]);
            step!(k, 11, a0, a1, b0, b1, [p3, p0, p1, p2], [q3, q0, q1, q2]);
            step!(k, 12, a0, a1, b0, b1, [p0, p1, p2, p3], [q0, q1, q2, q3]);
            step!(k, 13, a0, a1, b0, b1, [p1, p2, p3, p0], [q1, q2, q3, q0]);
            step!(k, 14, a0, a1, b0, b1, [p2, p3, p0, p1], [q2, q3, q0, q1]);
            step!(k, 15, a0, a1, b0, b1, [p3, p0, p1, p2], [q3, q0, q1, q2]);
            a0 = _mm_add_epi32(a0, sa0);
            a1 = _mm_add_epi32(a1, sa1);
            b0 = _mm_add_epi32(b0, sb0);
            b1 = _mm_add_epi32(b1, sb1);
        }
        (*la, *lb) = (Lane(a0, a1), Lane(b0, b1));
    }

    /// The first and last blocks of a leaf's message.
    fn ends(leaf: &[u8]) -> ([u8; 64], [u8; 64]) {
        let mut first = [0u8; 64];
        first[..DOMAIN_LEN].copy_from_slice(LEAF_DOMAIN);
        first[DOMAIN_LEN..].copy_from_slice(&leaf[..HEAD]);
        let mut last = [0u8; 64];
        last[..TAIL].copy_from_slice(&leaf[LEAF - TAIL..]);
        last[TAIL] = 0x80;
        last[56..].copy_from_slice(&(((DOMAIN_LEN + LEAF) as u64) * 8).to_be_bytes());
        (first, last)
    }

    /// The leaf digests of two whole leaves.
    ///
    /// # Safety
    /// The CPU must have the SHA extensions, SSE2, SSSE3 and SSE4.1 ([`available`]).
    #[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
    pub(super) unsafe fn pair(a: &[u8], b: &[u8]) -> (Digest, Digest) {
        assert!(a.len() == LEAF && b.len() == LEAF);
        let (fa, za) = ends(a);
        let (fb, zb) = ends(b);
        let (mut la, mut lb) = (load(&H0), load(&H0));
        blocks2(&mut la, &mut lb, &fa, &fb, 1);
        blocks2(&mut la, &mut lb, &a[HEAD..], &b[HEAD..], MIDDLE);
        blocks2(&mut la, &mut lb, &za, &zb, 1);
        (digest(la), digest(lb))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// Both routes, on random bytes and on bytes that a byte-order or padding mistake would not
    /// survive. On a CPU without the SHA extensions the paired route cannot run (there the
    /// product never takes it either): the test then checks the fallback twice and says so.
    #[test]
    fn paired_leaves_are_sha256_of_each_leaf() {
        #[cfg(target_arch = "x86_64")]
        if !ni::available() {
            eprintln!("no SHA extensions on this CPU: only the one-leaf-at-a-time route is tested");
        }
        let mut edge = vec![0u8; LEAF];
        edge.extend(vec![0xFF; LEAF]);
        edge.extend(vec![0u8; LEAF]);
        edge.extend(vec![0u8; LEAF - 1]);
        edge.push(1);
        let mut inputs: Vec<Vec<u8>> =
            [(1, 1), (2, 2), (3, 3), (16, 4), (129, 5)].iter().map(|&(n, seed)| random(n * LEAF, seed)).collect();
        inputs.push(edge);
        for data in &inputs {
            let want: Vec<Digest> = data.chunks(LEAF).map(leaf_digest).collect();
            for paired in [true, false] {
                let mut got = vec![];
                leaves_with(data, paired, |d| got.push(d));
                assert_eq!(got, want, "{} leaves, paired {paired}", data.len() / LEAF);
            }
        }
        let last = inputs.last().unwrap().chunks(LEAF).map(leaf_digest).collect::<Vec<_>>();
        assert_ne!(last[2], last[3], "leaves one bit apart");
    }
}
