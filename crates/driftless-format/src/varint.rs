//! LEB128 varints (7 bits per byte, low groups first, high bit = more) and zigzag.

use crate::{Error, Result};

/// Appends `v` as LEB128.
#[inline(always)]
pub fn put(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Reads a LEB128 value at `*pos`, advancing it. Errors on truncation or more than 64 bits.
#[inline(always)]
pub fn get(buf: &[u8], pos: &mut usize) -> Result<u64> {
    // Fast path: one byte (the common case for gaps and ulp values).
    if let Some(&b) = buf.get(*pos) {
        if b < 0x80 {
            *pos += 1;
            return Ok(b as u64);
        }
    }
    let mut v = 0u64;
    let mut shift = 0u32;
    loop {
        let b = *buf.get(*pos).ok_or_else(|| Error::corrupt("varint", "truncated"))?;
        *pos += 1;
        if shift == 63 && b > 1 {
            return Err(Error::corrupt("varint", "overflows 64 bits"));
        }
        v |= ((b & 0x7f) as u64) << shift;
        if b < 0x80 {
            return Ok(v);
        }
        shift += 7;
        if shift > 63 {
            return Err(Error::corrupt("varint", "too long"));
        }
    }
}

/// Zigzag-encodes a signed value so small magnitudes of either sign are small.
#[inline(always)]
pub fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

/// Inverse of [`zigzag`].
#[inline(always)]
pub fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn roundtrip(v: u64) {
            let mut b = vec![];
            put(&mut b, v);
            let mut p = 0;
            prop_assert_eq!(get(&b, &mut p).unwrap(), v);
            prop_assert_eq!(p, b.len());
        }
        #[test]
        fn zigzag_roundtrip(v: i64) {
            prop_assert_eq!(unzigzag(zigzag(v)), v);
        }
        #[test]
        fn garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..20)) {
            let mut p = 0;
            let _ = get(&b, &mut p);
        }
    }

    #[test]
    fn rejects_overlong() {
        let b = [0xffu8; 11];
        assert!(get(&b, &mut 0).is_err());
        let b = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02];
        assert!(get(&b, &mut 0).is_err());
        let b = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01];
        assert_eq!(get(&b, &mut 0).unwrap(), u64::MAX);
    }
}
