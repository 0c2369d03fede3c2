//! Element types, mirroring every safetensors dtype. driftless never interprets values: it moves
//! bit patterns, so all it needs from a dtype is its name and its width in bytes.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// A safetensors element type.
#[allow(non_camel_case_types)]
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DType {
    BOOL,
    U8,
    I8,
    F8_E5M2,
    F8_E4M3,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    F64,
    I64,
    U64,
}

impl DType {
    /// All supported dtypes.
    pub const ALL: [DType; 15] = [
        DType::BOOL,
        DType::U8,
        DType::I8,
        DType::F8_E5M2,
        DType::F8_E4M3,
        DType::I16,
        DType::U16,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::U32,
        DType::F32,
        DType::F64,
        DType::I64,
        DType::U64,
    ];

    /// Width of one element in bytes.
    pub fn size(self) -> usize {
        use DType::*;
        match self {
            BOOL | U8 | I8 | F8_E5M2 | F8_E4M3 => 1,
            I16 | U16 | F16 | BF16 => 2,
            I32 | U32 | F32 => 4,
            F64 | I64 | U64 => 8,
        }
    }

    /// The safetensors spelling ("BF16", "F8_E4M3", ...); also the spelling hashed into the
    /// weights root.
    pub fn as_str(self) -> &'static str {
        use DType::*;
        match self {
            BOOL => "BOOL",
            U8 => "U8",
            I8 => "I8",
            F8_E5M2 => "F8_E5M2",
            F8_E4M3 => "F8_E4M3",
            I16 => "I16",
            U16 => "U16",
            F16 => "F16",
            BF16 => "BF16",
            I32 => "I32",
            U32 => "U32",
            F32 => "F32",
            F64 => "F64",
            I64 => "I64",
            U64 => "U64",
        }
    }

    /// One-byte code used in binary segment headers.
    pub(crate) fn code(self) -> u8 {
        DType::ALL.iter().position(|d| *d == self).unwrap_or(0) as u8
    }

    pub(crate) fn from_code(c: u8) -> Result<Self> {
        DType::ALL.get(c as usize).copied().ok_or_else(|| Error::corrupt("segment", format!("unknown dtype code {c}")))
    }

    /// Convert from the `safetensors` crate's dtype. Dtypes driftless does not carry (sub-byte
    /// types added in newer safetensors versions) are an [`Error::InvalidInput`].
    pub fn from_safetensors(d: safetensors::Dtype) -> Result<Self> {
        use safetensors::Dtype as S;
        Ok(match d {
            S::BOOL => DType::BOOL,
            S::U8 => DType::U8,
            S::I8 => DType::I8,
            S::F8_E5M2 => DType::F8_E5M2,
            S::F8_E4M3 => DType::F8_E4M3,
            S::I16 => DType::I16,
            S::U16 => DType::U16,
            S::F16 => DType::F16,
            S::BF16 => DType::BF16,
            S::I32 => DType::I32,
            S::U32 => DType::U32,
            S::F32 => DType::F32,
            S::F64 => DType::F64,
            S::I64 => DType::I64,
            S::U64 => DType::U64,
            other => return Err(Error::invalid(format!("unsupported safetensors dtype {other:?}"))),
        })
    }
}

impl std::str::FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        DType::ALL
            .iter()
            .copied()
            .find(|d| d.as_str() == s)
            .ok_or_else(|| Error::invalid(format!("unknown dtype {s:?}")))
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
