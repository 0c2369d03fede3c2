//! Tensor metadata, borrowed tensor views and validated names.

use serde::{Deserialize, Serialize};

use crate::{DType, Error, Result};

/// Longest tensor name accepted (bytes). Real checkpoints stay far below.
pub const MAX_NAME_LEN: usize = 1024;
/// Most dimensions accepted for one tensor.
pub const MAX_NDIM: usize = 16;

/// Checks a tensor name read from untrusted input: non-empty, bounded, no control characters.
/// Tensor names never become file paths (shard file names are validated separately by
/// [`validate_file_name`]).
pub fn validate_tensor_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(Error::invalid(format!("tensor name length {} out of range", name.len())));
    }
    if name.chars().any(|c| c.is_control()) {
        return Err(Error::invalid(format!("tensor name {name:?} contains control characters")));
    }
    Ok(())
}

/// Checks a file or object name that will be joined to a local directory or a bucket prefix:
/// `[A-Za-z0-9._-]+`, at most 255 bytes, not starting with a dot. This is what keeps a hostile
/// manifest from writing outside the agent's directory.
pub fn validate_file_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!("file name {name:?} is not of the form [A-Za-z0-9._-]+")))
    }
}

/// Checks the name of a file shipped beside the weights (configuration, tokenizer): a plain
/// file name that no checkpoint reader takes for weights, i.e. not `*.safetensors` (without an
/// index every such file of a directory is a shard) and not the index itself.
pub fn validate_extra_file_name(name: &str) -> Result<()> {
    validate_file_name(name)?;
    if name.ends_with(".safetensors") || name == crate::checkpoint::INDEX_FILE {
        return Err(Error::invalid(format!(
            "extra file {name:?} would be read as weights: *.safetensors and the index are the layout's"
        )));
    }
    Ok(())
}

/// Largest file shipped beside the weights, and largest total of them in one anchor: readers
/// hold them in memory (a configuration, a tokenizer: megabytes), so a manifest claiming more
/// is refused, and publishers refuse to ship more.
pub const MAX_EXTRA_FILE: u64 = 64 << 20;
/// See [`MAX_EXTRA_FILE`].
pub const MAX_EXTRA_FILES_TOTAL: u64 = 256 << 20;

/// Checks the sizes of the files shipped beside the weights against [`MAX_EXTRA_FILE`] and
/// [`MAX_EXTRA_FILES_TOTAL`].
pub fn check_extra_file_sizes(sizes: impl IntoIterator<Item = (String, u64)>) -> Result<()> {
    let mut total = 0u64;
    for (name, n) in sizes {
        if n > MAX_EXTRA_FILE {
            return Err(Error::invalid(format!(
                "extra file {name:?} has {n} bytes, over the {} MiB limit of a file shipped beside the weights",
                MAX_EXTRA_FILE >> 20
            )));
        }
        total = total.saturating_add(n);
    }
    if total > MAX_EXTRA_FILES_TOTAL {
        return Err(Error::invalid(format!(
            "extra files total {total} bytes, over the {} MiB limit",
            MAX_EXTRA_FILES_TOTAL >> 20
        )));
    }
    Ok(())
}

/// Name, dtype and shape of a tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Tensor name, as in the checkpoint.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape; empty for a scalar.
    pub shape: Vec<u64>,
}

impl TensorMeta {
    /// Number of elements, or an error on overflow.
    pub fn numel(&self) -> Result<u64> {
        numel(&self.shape)
    }

    /// Size of the data in bytes, or an error on overflow.
    pub fn nbytes(&self) -> Result<u64> {
        self.numel()?
            .checked_mul(self.dtype.size() as u64)
            .ok_or_else(|| Error::invalid(format!("tensor {} is too large", self.name)))
    }

    /// Validates name and shape (used on metadata read from untrusted input).
    pub fn validate(&self) -> Result<()> {
        validate_tensor_name(&self.name)?;
        if self.shape.len() > MAX_NDIM {
            return Err(Error::invalid(format!("tensor {} has {} dims", self.name, self.shape.len())));
        }
        let n = self.nbytes()?;
        if n > MAX_TENSOR_BYTES {
            return Err(Error::invalid(format!("tensor {} claims {n} bytes", self.name)));
        }
        Ok(())
    }
}

/// Largest tensor accepted from untrusted metadata (64 TiB), and the most bytes of data one
/// shard of a layout read from a manifest may hold.
pub const MAX_TENSOR_BYTES: u64 = 1 << 46;

/// Product of dims with overflow checking.
pub fn numel(shape: &[u64]) -> Result<u64> {
    shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .ok_or_else(|| Error::invalid(format!("shape {shape:?} overflows")))
}

/// A borrowed tensor: metadata plus its raw little-endian bytes.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    /// Tensor name.
    pub name: &'a str,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: &'a [u64],
    /// Raw bytes, `numel * dtype.size()` long.
    pub data: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// Builds a view, checking that the data length matches dtype and shape.
    pub fn new(name: &'a str, dtype: DType, shape: &'a [u64], data: &'a [u8]) -> Result<Self> {
        validate_tensor_name(name)?;
        let want = numel(shape)?.checked_mul(dtype.size() as u64).ok_or_else(|| Error::invalid("tensor too large"))?;
        if want != data.len() as u64 {
            return Err(Error::invalid(format!(
                "tensor {name}: {dtype} {shape:?} needs {want} bytes, got {}",
                data.len()
            )));
        }
        Ok(TensorView { name, dtype, shape, data })
    }

    /// Owned metadata of this view.
    pub fn meta(&self) -> TensorMeta {
        TensorMeta { name: self.name.to_string(), dtype: self.dtype, shape: self.shape.to_vec() }
    }
}

/// A SHA-256 digest, serialized as 64 lowercase hex characters.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// Lowercase hex.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
    /// Parses 64 hex characters.
    pub fn from_hex(s: &str) -> Result<Self> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out)
            .map_err(|_| Error::corrupt("digest", format!("not a 64-hex-digit SHA-256: {s:?}")))?;
        Ok(Digest(out))
    }
    /// SHA-256 of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        use sha2::Digest as _;
        Digest(sha2::Sha256::digest(bytes).into())
    }
}

impl std::fmt::Debug for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Digest({})", self.to_hex())
    }
}
impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}
impl Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}
impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        Digest::from_hex(&s).map_err(serde::de::Error::custom)
    }
}
