//! Checkpoint-coordinate patches for engines that update their live weights in place (the
//! vLLM worker extension `driftless.vllm_ext`, driven by `vllm=URL,patch=on`).
//!
//! After a sync that reached step N from the step the engine holds (V) through deltas only,
//! the agent writes one safetensors file (read with the reference reader on the engine side):
//!
//! - `idx/<tensor>`: flat element indices (I32, or I64 for tensors of 2^31 elements or more),
//!   sorted and unique: every element any delta V+1..N wrote;
//! - `val/<tensor>`: the values at those indices, in the tensor's dtype, **read from the
//!   verified step-N copy** (not from the deltas): what the engine receives is what the agent
//!   verified against the signed weights root;
//! - `__metadata__`: `format` (`driftless-patch-1`), `base_step` (V), `step` (N),
//!   `weights_root` (hex), `shapes` (JSON: tensor -> checkpoint shape) and `dense` (JSON list:
//!   tensors changed in more than half their elements, which the engine reads whole from the
//!   verified directory instead).
//!
//! A route through an anchor or a layout change has no patch: the engine reloads from the
//! directory. A patch is used at most once (any failed notify falls back to a full reload).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use driftless_format::checkpoint::Checkpoint;
use driftless_format::delta::DecodedSegment;
use driftless_format::Digest;

use crate::{Error, Result};

/// Identifies the patch format in the file's metadata.
pub const FORMAT: &str = "driftless-patch-1";

/// A patch file written for one notify.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PatchFile {
    /// Absolute path of the safetensors file.
    pub path: PathBuf,
    /// The step the engine must hold for the patch to apply.
    pub base: u64,
    /// The step the patch brings the engine to.
    pub step: u64,
    /// Bytes of the file (what the engine reads instead of the whole checkpoint).
    pub bytes: u64,
}

/// Collects the element indices a chain of deltas writes, tensor by tensor.
#[derive(Debug, Default)]
pub struct PatchBuilder {
    base: u64,
    touched: HashMap<String, Vec<u64>>,
}

impl PatchBuilder {
    /// A builder for a chain starting at verified step `base`.
    pub fn new(base: u64) -> Self {
        PatchBuilder { base, touched: HashMap::new() }
    }

    /// The step the chain starts from.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Records what a decoded segment writes.
    pub fn add(&mut self, seg: &DecodedSegment) -> Result<()> {
        for (i, e) in seg.entries.iter().enumerate() {
            let idx = seg.entry_indices(i)?;
            self.touched.entry(e.name.clone()).or_default().extend(idx);
        }
        Ok(())
    }

    /// Writes the patch from `base` to `step` into `out`, reading values from the verified
    /// checkpoint in `dir` (fsynced; replaced atomically by rename).
    pub fn write(self, dir: &Path, step: u64, root: Digest, out: &Path) -> Result<PatchFile> {
        let ck = Checkpoint::open(dir)?;
        let views = ck.views();
        let by_name: HashMap<&str, _> = views.iter().map(|v| (v.name, v)).collect();
        let mut shapes = BTreeMap::new();
        let mut dense = vec![];
        // (name, dtype, shape, bytes): indices then values of every sparse tensor.
        let mut blobs: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = vec![];
        let mut touched: Vec<_> = self.touched.into_iter().collect();
        touched.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, mut idx) in touched {
            let v = by_name.get(name.as_str()).ok_or_else(|| {
                Error::Io(std::io::Error::other(format!("patch: tensor {name} is not in the verified checkpoint")))
            })?;
            idx.sort_unstable();
            idx.dedup();
            let es = v.dtype.size();
            let numel = (v.data.len() / es) as u64;
            shapes.insert(name.clone(), v.shape.to_vec());
            if idx.last().is_some_and(|&l| l >= numel) {
                return Err(Error::Io(std::io::Error::other(format!("patch: index beyond tensor {name}"))));
            }
            if idx.len() as u64 * 2 > numel {
                dense.push(name);
                continue;
            }
            let mut vals = Vec::with_capacity(idx.len() * es);
            for &i in &idx {
                let o = i as usize * es;
                vals.extend_from_slice(&v.data[o..o + es]);
            }
            let (ity, ibytes) = if numel <= i32::MAX as u64 {
                (safetensors::Dtype::I32, idx.iter().flat_map(|&i| (i as i32).to_le_bytes()).collect::<Vec<u8>>())
            } else {
                (safetensors::Dtype::I64, idx.iter().flat_map(|&i| (i as i64).to_le_bytes()).collect())
            };
            blobs.push((format!("idx/{name}"), ity, vec![idx.len()], ibytes));
            blobs.push((format!("val/{name}"), st_dtype(v.dtype)?, vec![idx.len()], vals));
        }
        let meta: HashMap<String, String> = [
            ("format".to_string(), FORMAT.to_string()),
            ("base_step".to_string(), self.base.to_string()),
            ("step".to_string(), step.to_string()),
            ("weights_root".to_string(), root.to_hex()),
            ("shapes".to_string(), serde_json::to_string(&shapes).expect("json")),
            ("dense".to_string(), serde_json::to_string(&dense).expect("json")),
        ]
        .into();
        let tensors = blobs
            .iter()
            .map(|(n, d, s, b)| Ok((n.as_str(), safetensors::tensor::TensorView::new(*d, s.clone(), b)?)))
            .collect::<std::result::Result<Vec<_>, safetensors::SafeTensorError>>()
            .map_err(|e| Error::Io(std::io::Error::other(format!("patch: {e}"))))?;
        let tmp = out.with_extension("tmp");
        safetensors::tensor::serialize_to_file(tensors, Some(meta), &tmp)
            .map_err(|e| Error::Io(std::io::Error::other(format!("patch {}: {e}", tmp.display()))))?;
        std::fs::File::open(&tmp)?.sync_all()?;
        std::fs::rename(&tmp, out)?;
        let bytes = std::fs::metadata(out)?.len();
        Ok(PatchFile { path: out.to_path_buf(), base: self.base, step, bytes })
    }
}

fn st_dtype(d: driftless_format::DType) -> Result<safetensors::Dtype> {
    serde_json::from_value(serde_json::Value::String(d.as_str().to_string()))
        .map_err(|e| Error::Io(std::io::Error::other(format!("patch: dtype {}: {e}", d.as_str()))))
}
