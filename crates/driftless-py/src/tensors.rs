//! Borrowing the memory of caller-owned CPU arrays without copying: the buffer protocol
//! (NumPy, including `ml_dtypes` types; `bytearray`; `memoryview`) or DLPack (`__dlpack__`:
//! PyTorch, JAX, NumPy). A [`Borrowed`] keeps the exporter's buffer (or DLPack capsule) alive;
//! release it with the GIL held, after the GIL-free work on the raw pointer is done.

use std::ffi::{c_void, CStr};
use std::os::raw::c_int;

use driftless_format::{DType, TensorMeta};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

/// What keeps a borrowed buffer valid.
enum Guard {
    Buffer(Box<ffi::Py_buffer>),
    /// The unconsumed capsule: its destructor calls the producer's deleter when dropped.
    Capsule(#[allow(dead_code)] Py<PyAny>),
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Guard::Buffer(b) = self {
            // SAFETY: the view was filled by a successful PyObject_GetBuffer and is released
            // exactly once, with the GIL held.
            Python::with_gil(|_| unsafe { ffi::PyBuffer_Release(&mut **b) });
        }
    }
}

/// A tensor whose memory is borrowed from a Python object.
pub(crate) struct Borrowed {
    pub(crate) meta: TensorMeta,
    /// Raw address and byte length (plain integers so they cross `allow_threads`).
    pub(crate) raw: Raw,
    /// The object the memory was borrowed from (its identity tells the Follower whether
    /// these are the arrays it verified: an address alone can be reused by new arrays).
    pub(crate) obj: Py<PyAny>,
    _guard: Guard,
}

/// Address and length of borrowed memory.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Raw {
    pub(crate) addr: usize,
    pub(crate) len: usize,
}

impl Raw {
    /// # Safety
    /// The memory must still be borrowed (its [`Borrowed`] alive) and not written meanwhile.
    pub(crate) unsafe fn slice<'a>(self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        std::slice::from_raw_parts(self.addr as *const u8, self.len)
    }
    /// # Safety
    /// The memory must still be borrowed writable, with no other reference to it alive.
    pub(crate) unsafe fn slice_mut<'a>(self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len)
    }
}

/// NumPy / ml_dtypes dtype names.
fn dtype_from_name(name: &str) -> Option<DType> {
    Some(match name {
        "bool" => DType::BOOL,
        "uint8" => DType::U8,
        "int8" => DType::I8,
        "int16" => DType::I16,
        "uint16" => DType::U16,
        "float16" => DType::F16,
        "bfloat16" => DType::BF16,
        "int32" => DType::I32,
        "uint32" => DType::U32,
        "float32" => DType::F32,
        "float64" => DType::F64,
        "int64" => DType::I64,
        "uint64" => DType::U64,
        // safetensors' F8_E4M3 is e4m3fn (no infinities; engines read it so). ml_dtypes'
        // `float8_e4m3` is the IEEE-like type with infinities: other bits for the same values,
        // refused (found by review: it was published as e4m3fn, 200 read back as 192).
        "float8_e4m3fn" => DType::F8_E4M3,
        "float8_e5m2" => DType::F8_E5M2,
        _ => return None,
    })
}

/// struct-module format characters (native size, little-endian machine).
fn dtype_from_format(fmt: &str) -> Option<DType> {
    let f = fmt.trim_start_matches(['<', '=', '@']);
    Some(match f {
        "?" => DType::BOOL,
        "B" | "c" => DType::U8,
        "b" => DType::I8,
        "h" => DType::I16,
        "H" => DType::U16,
        "e" => DType::F16,
        "i" => DType::I32,
        "I" => DType::U32,
        "f" => DType::F32,
        "d" => DType::F64,
        "q" => DType::I64,
        "Q" => DType::U64,
        "l" if std::mem::size_of::<std::os::raw::c_long>() == 8 => DType::I64,
        "L" if std::mem::size_of::<std::os::raw::c_long>() == 8 => DType::U64,
        _ => return None,
    })
}

/// DLPack type codes: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLBool 6,
/// kDLFloat8_e4m3fn 10, kDLFloat8_e5m2 12 (DLPack 1.x).
fn dtype_from_dlpack(code: u8, bits: u8, lanes: u16) -> Option<DType> {
    if lanes != 1 {
        return None;
    }
    Some(match (code, bits) {
        (0, 8) => DType::I8,
        (0, 16) => DType::I16,
        (0, 32) => DType::I32,
        (0, 64) => DType::I64,
        (1, 8) => DType::U8,
        (1, 16) => DType::U16,
        (1, 32) => DType::U32,
        (1, 64) => DType::U64,
        (2, 16) => DType::F16,
        (2, 32) => DType::F32,
        (2, 64) => DType::F64,
        (4, 16) => DType::BF16,
        (6, 8) => DType::BOOL,
        (10, 8) => DType::F8_E4M3,
        (12, 8) => DType::F8_E5M2,
        _ => return None,
    })
}

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}
#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}
#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}
#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// DLPack 1.x: `DLManagedTensorVersioned`, in a capsule named `dltensor_versioned`.
#[repr(C)]
struct DLManagedTensorVersioned {
    version_major: u32,
    version_minor: u32,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// `DLPACK_FLAG_BITMASK_READ_ONLY`: the producer's memory must not be written.
const DLPACK_FLAG_READ_ONLY: u64 = 1;
/// `DLPACK_FLAG_BITMASK_IS_COPIED`: the export is a copy (writes would not reach the array).
const DLPACK_FLAG_IS_COPIED: u64 = 2;

const KDL_CPU: i32 = 1;
const KDL_CUDA_HOST: i32 = 3;

/// Whether `strides` (in elements) describe a C-contiguous array of `shape`.
fn c_contiguous(shape: &[u64], strides: &[i64]) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut want: i64 = 1;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if d != 1 && s != want {
            return false;
        }
        want = want.saturating_mul(d as i64);
    }
    true
}

/// Borrows `obj` as tensor `name`. `writable` asks for memory that may be written in place.
pub(crate) fn borrow(name: &str, obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Borrowed> {
    driftless_format::validate_tensor_name(name).map_err(|e| crate::errors::invalid(e.to_string()))?;
    // SAFETY: plain CPython API call on a live object.
    let has_buffer = unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) } == 1;
    if has_buffer {
        return borrow_buffer(name, obj, writable);
    }
    if obj.hasattr("__dlpack__")? {
        return borrow_dlpack(name, obj, writable);
    }
    Err(PyTypeError::new_err(format!(
        "tensor {name}: {} exposes neither the buffer protocol nor __dlpack__ (pass a CPU numpy array or torch tensor)",
        obj.get_type().name()?
    )))
}

fn borrow_buffer(name: &str, obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Borrowed> {
    let py = obj.py();
    // The dtype: NumPy-like objects say it by name (the buffer format of ml_dtypes types is not
    // a struct code); plain buffers by their format string.
    let dtype = match obj.getattr("dtype") {
        Ok(dt) => {
            if let Ok(bo) = dt.getattr("byteorder") {
                if bo.extract::<String>().is_ok_and(|b| b == ">") {
                    return Err(PyValueError::new_err(format!("tensor {name}: big-endian arrays are not supported")));
                }
            }
            let n: String = dt.getattr("name").and_then(|n| n.extract()).unwrap_or_else(|_| dt.to_string());
            dtype_from_name(&n).ok_or_else(|| PyTypeError::new_err(format!("tensor {name}: unsupported dtype {n}")))?
        }
        Err(_) => {
            let mv = py.import("builtins")?.getattr("memoryview")?.call1((obj,))?;
            let f: String = mv.getattr("format")?.extract()?;
            dtype_from_format(&f)
                .ok_or_else(|| PyTypeError::new_err(format!("tensor {name}: unsupported buffer format {f:?}")))?
        }
    };
    // SAFETY: zeroed Py_buffer is the documented initial state; filled by GetBuffer below.
    let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
    let flags: c_int = ffi::PyBUF_STRIDES | if writable { ffi::PyBUF_WRITABLE } else { 0 };
    // SAFETY: live object, valid out pointer.
    if unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) } != 0 {
        let e = PyErr::fetch(py);
        return Err(PyValueError::new_err(format!(
            "tensor {name}: cannot borrow its memory{}: {e}",
            if writable { " writable" } else { "" }
        )));
    }
    let guard = Guard::Buffer(view);
    let Guard::Buffer(v) = &guard else { unreachable!() };
    // SAFETY: filled by a successful GetBuffer.
    let contiguous = unsafe { ffi::PyBuffer_IsContiguous(&**v, b'C' as std::os::raw::c_char) } == 1;
    if !contiguous {
        return Err(PyValueError::new_err(format!(
            "tensor {name} is not C-contiguous; pass a contiguous array (numpy.ascontiguousarray, tensor.contiguous())"
        )));
    }
    let itemsize = v.itemsize as usize;
    if itemsize != dtype.size() {
        return Err(PyTypeError::new_err(format!("tensor {name}: item size {itemsize} does not match dtype {dtype}")));
    }
    let ndim = v.ndim as usize;
    let shape: Vec<u64> = if ndim == 0 || v.shape.is_null() {
        if ndim == 0 {
            vec![]
        } else {
            vec![(v.len as usize / itemsize.max(1)) as u64]
        }
    } else {
        // SAFETY: `shape` has `ndim` entries per the buffer protocol.
        unsafe { std::slice::from_raw_parts(v.shape, ndim) }.iter().map(|&d| d as u64).collect()
    };
    let raw = Raw { addr: v.buf as usize, len: v.len as usize };
    let meta = TensorMeta { name: name.to_string(), dtype, shape };
    check_len(&meta, raw)?;
    Ok(Borrowed { meta, raw, obj: obj.clone().unbind(), _guard: guard })
}

fn borrow_dlpack(name: &str, obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Borrowed> {
    let py = obj.py();
    // DLPack 1.x first: its capsule says whether the memory is read-only (a tensor over a
    // read-only mmap, an immutable array), which a legacy capsule cannot. A producer that
    // does not take `max_version` gets the legacy call.
    let kwargs = pyo3::types::PyDict::new(py);
    kwargs.set_item("max_version", (1, 0))?;
    let cap = match obj.call_method("__dlpack__", (), Some(&kwargs)) {
        Ok(c) => Ok(c),
        Err(e) if e.is_instance_of::<PyTypeError>(py) => obj.call_method0("__dlpack__"),
        Err(e) => Err(e),
    }
    .map_err(|e| PyValueError::new_err(format!("tensor {name}: __dlpack__ failed: {e}")))?;
    let cap = cap
        .downcast_into::<PyCapsule>()
        .map_err(|_| PyTypeError::new_err(format!("tensor {name}: __dlpack__ did not return a capsule")))?;
    const NAME: &CStr = c"dltensor";
    const VERSIONED: &CStr = c"dltensor_versioned";
    // SAFETY: capsule API on a live capsule; the pointer stays valid while the capsule lives
    // and has not been consumed (we never rename it, so its destructor frees it).
    let t: &DLTensor = unsafe {
        if ffi::PyCapsule_IsValid(cap.as_ptr(), VERSIONED.as_ptr()) == 1 {
            let v = ffi::PyCapsule_GetPointer(cap.as_ptr(), VERSIONED.as_ptr()) as *const DLManagedTensorVersioned;
            if v.is_null() {
                let _ = PyErr::take(py);
                return Err(PyValueError::new_err(format!("tensor {name}: an empty DLPack capsule")));
            }
            if (*v).version_major != 1 {
                return Err(PyValueError::new_err(format!(
                    "tensor {name}: DLPack {}.{} (asked for 1.x)",
                    (*v).version_major,
                    (*v).version_minor
                )));
            }
            if writable && (*v).flags & DLPACK_FLAG_READ_ONLY != 0 {
                return Err(PyValueError::new_err(format!(
                    "tensor {name} is read-only (its DLPack export says so); pass a writable array"
                )));
            }
            if writable && (*v).flags & DLPACK_FLAG_IS_COPIED != 0 {
                return Err(PyValueError::new_err(format!(
                    "tensor {name}: its DLPack export is a copy, which writes would not reach; pass the array itself"
                )));
            }
            &(*v).dl_tensor
        } else {
            let ptr = ffi::PyCapsule_GetPointer(cap.as_ptr(), NAME.as_ptr()) as *const DLManagedTensor;
            if ptr.is_null() {
                let _ = PyErr::take(py);
                return Err(PyValueError::new_err(format!(
                    "tensor {name}: __dlpack__ returned a capsule that is not an unconsumed \"dltensor\""
                )));
            }
            &(*ptr).dl_tensor
        }
    };
    if t.device.device_type != KDL_CPU && t.device.device_type != KDL_CUDA_HOST {
        return Err(PyValueError::new_err(format!(
            "tensor {name} is on device type {} (DLPack); pass CPU memory (tensor.cpu())",
            t.device.device_type
        )));
    }
    let dtype = dtype_from_dlpack(t.dtype.code, t.dtype.bits, t.dtype.lanes).ok_or_else(|| {
        PyTypeError::new_err(format!(
            "tensor {name}: unsupported DLPack dtype code {} bits {} lanes {}",
            t.dtype.code, t.dtype.bits, t.dtype.lanes
        ))
    })?;
    let ndim = usize::try_from(t.ndim).map_err(|_| PyValueError::new_err("negative ndim"))?;
    let shape_i: &[i64] = if ndim == 0 { &[] } else { unsafe { std::slice::from_raw_parts(t.shape, ndim) } };
    if shape_i.iter().any(|&d| d < 0) {
        return Err(PyValueError::new_err(format!("tensor {name}: negative dimension")));
    }
    let shape: Vec<u64> = shape_i.iter().map(|&d| d as u64).collect();
    if !t.strides.is_null() && ndim > 0 {
        // SAFETY: `strides` has `ndim` entries when not NULL.
        let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        if !c_contiguous(&shape, strides) {
            return Err(PyValueError::new_err(format!(
                "tensor {name} is not C-contiguous; pass a contiguous array (numpy.ascontiguousarray, tensor.contiguous())"
            )));
        }
    }
    let n = driftless_format::numel(&shape).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let len = n.checked_mul(dtype.size() as u64).ok_or_else(|| PyValueError::new_err("tensor too large"))? as usize;
    let addr = (t.data as usize)
        .checked_add(t.byte_offset as usize)
        .ok_or_else(|| PyValueError::new_err("bad DLPack offset"))?;
    if addr == 0 && len > 0 {
        return Err(PyValueError::new_err(format!("tensor {name}: DLPack data pointer is NULL")));
    }
    let raw = Raw { addr, len };
    let meta = TensorMeta { name: name.to_string(), dtype, shape };
    Ok(Borrowed { meta, raw, obj: obj.clone().unbind(), _guard: Guard::Capsule(cap.into_any().unbind()) })
}

fn check_len(meta: &TensorMeta, raw: Raw) -> PyResult<()> {
    let want = meta.nbytes().map_err(|e| PyValueError::new_err(e.to_string()))?;
    if want != raw.len as u64 {
        return Err(PyValueError::new_err(format!(
            "tensor {}: {} {:?} needs {want} bytes, buffer has {}",
            meta.name, meta.dtype, meta.shape, raw.len
        )));
    }
    Ok(())
}

/// Borrows every `name -> array` item of a mapping, in its iteration order.
pub(crate) fn borrow_mapping(tensors: &Bound<'_, PyAny>, writable: bool) -> PyResult<Vec<Borrowed>> {
    let items = tensors
        .call_method0("items")
        .map_err(|_| PyTypeError::new_err("tensors must be a mapping of name -> array (a dict)"))?;
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for item in items.try_iter()? {
        let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item?.extract()?;
        let name: String = k.extract().map_err(|_| PyTypeError::new_err("tensor names must be str"))?;
        if !seen.insert(name.clone()) {
            return Err(PyValueError::new_err(format!("tensor {name} given twice")));
        }
        out.push(borrow(&name, &v, writable)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguity() {
        assert!(c_contiguous(&[2, 3], &[3, 1]));
        assert!(!c_contiguous(&[2, 3], &[1, 2]));
        assert!(c_contiguous(&[1, 3], &[99, 1]));
        assert!(c_contiguous(&[0, 3], &[1, 7]));
    }

    #[test]
    fn dtypes() {
        assert_eq!(dtype_from_dlpack(4, 16, 1), Some(DType::BF16));
        assert_eq!(dtype_from_dlpack(2, 16, 1), Some(DType::F16));
        assert_eq!(dtype_from_dlpack(5, 64, 1), None);
        assert_eq!(dtype_from_name("bfloat16"), Some(DType::BF16));
        assert_eq!(dtype_from_format("<f"), Some(DType::F32));
    }
}
