//! Conversions between the Python tuples and values of the `tessera._native` contract and the
//! library's types. No checks beyond what a conversion needs: the library validates the rest.

use std::borrow::Cow;
use std::ops::Range;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use pyo3::IntoPyObjectExt;
use tessera::{DType, PathSeg, ReplicaId, ShardedObject, ShardedTensor, StatePath, TensorData, Value};

use crate::errors::{invalid_argument, to_pyerr};

/// The items of a positional tuple of the contract, with the name of what it describes for
/// error messages (`tensors[3]`).
struct Fields<'py> {
    tuple: Bound<'py, PyTuple>,
    what: String,
}

impl<'py> Fields<'py> {
    fn new(obj: &Bound<'py, PyAny>, what: String, names: &[&str]) -> PyResult<Self> {
        let tuple = obj.cast::<PyTuple>().map_err(|_| {
            PyTypeError::new_err(format!("{what}: expected a tuple ({}), got {}", names.join(", "), type_name(obj)))
        })?;
        if tuple.len() != names.len() {
            return Err(PyTypeError::new_err(format!(
                "{what}: expected a tuple of {} items ({}), got {}",
                names.len(),
                names.join(", "),
                tuple.len()
            )));
        }
        let mut fields = Fields { tuple: tuple.clone(), what };
        // Name the entry by its key once the key is known.
        if let Ok(key) = fields.tuple.get_item(0)?.extract::<String>() {
            fields.what = format!("{} ({key:?})", fields.what);
        }
        Ok(fields)
    }

    fn get<T: FromPyObjectOwned<'py>>(&self, index: usize, name: &str) -> PyResult<T> {
        let item = self.tuple.get_item(index)?;
        item.extract::<T>().map_err(|e| {
            let (py, e): (_, PyErr) = (item.py(), e.into());
            let err = PyTypeError::new_err(format!("{}: {name}: {}", self.what, e.value(py)));
            err.set_cause(py, Some(e));
            err
        })
    }

    /// `bytes` or `bytearray` contents.
    fn bytes(&self, index: usize, name: &str) -> PyResult<Vec<u8>> {
        let item = self.tuple.get_item(index)?;
        let data = item.extract::<Cow<'_, [u8]>>().map_err(|_| {
            PyTypeError::new_err(format!("{}: {name}: expected bytes, got {}", self.what, type_name(&item)))
        })?;
        Ok(data.into_owned())
    }

    fn dtype(&self, index: usize) -> PyResult<DType> {
        let name: String = self.get(index, "dtype")?;
        DType::parse(&name).map_err(|e| to_pyerr(self.tuple.py(), e))
    }

    fn replica_id(&self, index: usize) -> PyResult<ReplicaId> {
        #[derive(FromPyObject)]
        enum Replica {
            One(u32),
            Many(Vec<u32>),
        }
        Ok(match self.get::<Replica>(index, "replica_id")? {
            Replica::One(x) => ReplicaId(vec![x]),
            Replica::Many(v) => ReplicaId(v),
        })
    }

    fn flattened_range(&self, index: usize) -> PyResult<Option<Range<u64>>> {
        Ok(self.get::<Option<(u64, u64)>>(index, "flattened_range")?.map(|(start, end)| start..end))
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string())
}

/// A tensor of a `SaveTensor` or `LoadTensor` tuple, with the address of its memory.
pub struct TensorSpec {
    /// The tensor, without data.
    pub tensor: ShardedTensor<'static>,
    /// Address of the caller's C-contiguous CPU memory (0: none).
    pub data_ptr: usize,
    /// Its size in bytes.
    pub nbytes: usize,
}

const SAVE_TENSOR: [&str; 11] = [
    "key",
    "dtype",
    "local_shape",
    "global_shape",
    "global_offset",
    "prepend_axis_num",
    "replica_id",
    "flattened_range",
    "axis_fragmentations",
    "data_ptr",
    "nbytes",
];

const LOAD_TENSOR: [&str; 10] = [
    "key",
    "dtype",
    "local_shape",
    "global_shape",
    "global_offset",
    "prepend_axis_num",
    "flattened_range",
    "allow_shape_mismatch",
    "data_ptr",
    "nbytes",
];

/// The fields shared by both tuple kinds (positions 0–5), as a data-less main-replica tensor.
fn geometry(f: &Fields<'_>) -> PyResult<ShardedTensor<'static>> {
    Ok(ShardedTensor {
        key: f.get(0, "key")?,
        data: TensorData::None,
        dtype: f.dtype(1)?,
        local_shape: f.get(2, "local_shape")?,
        global_shape: f.get(3, "global_shape")?,
        global_offset: f.get(4, "global_offset")?,
        axis_fragmentations: None,
        replica_id: ReplicaId::main(),
        prepend_axis_num: f.get(5, "prepend_axis_num")?,
        allow_shape_mismatch: false,
        flattened_range: None,
    })
}

impl TensorSpec {
    /// Parses a `SaveTensor` tuple (item `index` of the list).
    pub fn save_from_py(obj: &Bound<'_, PyAny>, index: usize) -> PyResult<Self> {
        let f = Fields::new(obj, format!("tensors[{index}]"), &SAVE_TENSOR)?;
        let mut tensor = geometry(&f)?;
        tensor.replica_id = f.replica_id(6)?;
        tensor.flattened_range = f.flattened_range(7)?;
        tensor.axis_fragmentations = f.get(8, "axis_fragmentations")?;
        Ok(TensorSpec { tensor, data_ptr: f.get(9, "data_ptr")?, nbytes: f.get(10, "nbytes")? })
    }

    /// Parses a `LoadTensor` tuple (item `index` of the list).
    pub fn load_from_py(obj: &Bound<'_, PyAny>, index: usize) -> PyResult<Self> {
        let f = Fields::new(obj, format!("tensors[{index}]"), &LOAD_TENSOR)?;
        let mut tensor = geometry(&f)?;
        tensor.flattened_range = f.flattened_range(6)?;
        tensor.allow_shape_mismatch = f.get(7, "allow_shape_mismatch")?;
        Ok(TensorSpec { tensor, data_ptr: f.get(8, "data_ptr")?, nbytes: f.get(9, "nbytes")? })
    }

    /// The tensor borrowing the caller's memory read-only (save).
    ///
    /// # Safety
    /// `data_ptr` must address `nbytes` bytes that stay alive and unmodified for `'a`.
    pub unsafe fn read_only<'a>(self, py: Python<'_>) -> PyResult<ShardedTensor<'a>> {
        let data = match (self.data_ptr, self.nbytes) {
            (_, 0) => TensorData::Ref(&[]),
            (0, n) => return Err(null_data(py, &self.tensor.key, n)),
            (ptr, n) => {
                check_span(py, &self.tensor.key, ptr, n)?;
                // SAFETY: non-null, alignment 1, `n` <= isize::MAX and no wrap (checked just
                // above); live, initialized and unmodified for 'a by the caller's contract.
                TensorData::Ref(unsafe { std::slice::from_raw_parts(ptr as *const u8, n) })
            }
        };
        Ok(ShardedTensor { data, ..self.tensor })
    }

    /// The tensor borrowing the caller's memory writably (load).
    ///
    /// # Safety
    /// `data_ptr` must address `nbytes` bytes that stay alive for `'a` and that nothing else
    /// reads or writes during `'a` (no other tensor's buffer overlaps it: see [`check_disjoint`]).
    pub unsafe fn writable<'a>(self, py: Python<'_>) -> PyResult<ShardedTensor<'a>> {
        let data = match (self.data_ptr, self.nbytes) {
            (_, 0) => TensorData::Mut(&mut []),
            (0, n) => return Err(null_data(py, &self.tensor.key, n)),
            (ptr, n) => {
                check_span(py, &self.tensor.key, ptr, n)?;
                // SAFETY: non-null, alignment 1, `n` <= isize::MAX and no wrap (checked just
                // above); live and exclusively ours for 'a by the caller's contract.
                TensorData::Mut(unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, n) })
            }
        };
        Ok(ShardedTensor { data, ..self.tensor })
    }

    /// The tensor without data (metadata only), when no memory is given.
    pub fn metadata_only(self) -> ShardedTensor<'static> {
        self.tensor
    }
}

/// What `slice::from_raw_parts` needs of a span beyond the caller's promise that it is live:
/// at most `isize::MAX` bytes, not wrapping around the address space.
fn check_span(py: Python<'_>, key: &str, ptr: usize, nbytes: usize) -> PyResult<()> {
    if nbytes > isize::MAX as usize || ptr.checked_add(nbytes).is_none() {
        return Err(invalid_argument(py, format!("{key:?}: {nbytes} bytes at {ptr:#x} is not a valid buffer")));
    }
    Ok(())
}

fn null_data(py: Python<'_>, key: &str, nbytes: usize) -> PyErr {
    invalid_argument(py, format!("{key:?}: data_ptr is 0 (null) but nbytes is {nbytes}"))
}

/// Rejects load buffers that overlap: each is written through an exclusive borrow.
pub fn check_disjoint(py: Python<'_>, specs: &[TensorSpec]) -> PyResult<()> {
    let mut spans: Vec<(usize, usize, &str)> = specs
        .iter()
        .filter(|s| s.nbytes > 0 && s.data_ptr != 0)
        .map(|s| match s.data_ptr.checked_add(s.nbytes) {
            Some(end) => Ok((s.data_ptr, end, s.tensor.key.as_str())),
            None => Err(invalid_argument(py, format!("{:?}: its buffer wraps around memory", s.tensor.key))),
        })
        .collect::<PyResult<_>>()?;
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(invalid_argument(
                py,
                format!("the load buffers of {:?} and {:?} overlap; each tensor needs its own memory", w[0].2, w[1].2),
            ));
        }
    }
    Ok(())
}

/// Parses a `SaveObject` tuple: `(key, data, global_shape, global_offset, replica_id)`.
pub fn save_object(obj: &Bound<'_, PyAny>, index: usize) -> PyResult<ShardedObject> {
    let f =
        Fields::new(obj, format!("objects[{index}]"), &["key", "data", "global_shape", "global_offset", "replica_id"])?;
    let data = f.bytes(1, "data")?;
    Ok(ShardedObject {
        key: f.get(0, "key")?,
        data: Some(data),
        global_shape: f.get(2, "global_shape")?,
        global_offset: f.get(3, "global_offset")?,
        replica_id: f.replica_id(4)?,
    })
}

/// Parses an object of `validate_sharding`: `(key, global_shape, global_offset, replica_id)`.
/// The library asks main replicas for their bytes even when validating only, so the object gets
/// empty data (its length is not part of the validation).
pub fn validate_object(obj: &Bound<'_, PyAny>, index: usize) -> PyResult<ShardedObject> {
    let f = Fields::new(obj, format!("objects[{index}]"), &["key", "global_shape", "global_offset", "replica_id"])?;
    Ok(ShardedObject {
        key: f.get(0, "key")?,
        data: Some(Vec::new()),
        global_shape: f.get(1, "global_shape")?,
        global_offset: f.get(2, "global_offset")?,
        replica_id: f.replica_id(3)?,
    })
}

/// Parses a `LoadObject` tuple: `(key, global_shape, global_offset)`.
pub fn load_object(obj: &Bound<'_, PyAny>, index: usize) -> PyResult<ShardedObject> {
    let f = Fields::new(obj, format!("objects[{index}]"), &["key", "global_shape", "global_offset"])?;
    Ok(ShardedObject {
        key: f.get(0, "key")?,
        data: None,
        global_shape: f.get(1, "global_shape")?,
        global_offset: f.get(2, "global_offset")?,
        replica_id: ReplicaId::main(),
    })
}

/// Parses a `(path, value)` pair of the common state (item `index` of the list).
pub fn common_entry(obj: &Bound<'_, PyAny>, index: usize) -> PyResult<(StatePath, Value)> {
    let what = format!("common[{index}]");
    let pair = obj.cast::<PyTuple>().ok().filter(|t| t.len() == 2).ok_or_else(|| {
        PyTypeError::new_err(format!("{what}: expected a (path, value) tuple, got {}", type_name(obj)))
    })?;
    let path = path_from_py(&pair.get_item(0)?).map_err(|e| PyTypeError::new_err(format!("{what}: path: {e}")))?;
    let value = value_from_py(&pair.get_item(1)?)
        .map_err(|e| PyTypeError::new_err(format!("{what} at path {}: {e}", tessera::path_string(&path))))?;
    Ok((path, value))
}

/// A path: a list (or tuple) of `str` map keys and non-negative `int` list indices.
pub fn path_from_py(obj: &Bound<'_, PyAny>) -> PyResult<StatePath> {
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err("expected a list of str and int segments, got a string"));
    }
    let mut path = Vec::new();
    for seg in obj.try_iter()? {
        let seg = seg?;
        if seg.is_exact_instance_of::<PyString>() {
            path.push(PathSeg::Key(seg.extract()?));
        } else if seg.is_exact_instance_of::<PyInt>() {
            path.push(PathSeg::Index(seg.extract()?));
        } else {
            return Err(PyTypeError::new_err(format!(
                "path segment of type {} (expected str or int)",
                type_name(&seg)
            )));
        }
    }
    Ok(path)
}

/// A path as a Python list of `str` and `int`.
pub fn path_to_py<'py>(py: Python<'py>, path: &[PathSeg]) -> PyResult<Bound<'py, PyList>> {
    let segs = path
        .iter()
        .map(|s| match s {
            PathSeg::Key(k) => k.into_bound_py_any(py),
            PathSeg::Index(i) => i.into_bound_py_any(py),
        })
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, segs)
}

/// A plain Python value (exact types only: `None`, `bool`, `int` (64-bit), `float`, `str`,
/// `bytes`, `list` and `dict` with `str` keys, nested) as a [`Value`]; anything else is a
/// `TypeError`, so that a value always comes back as the type it was.
pub fn value_from_py(obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    Ok(if obj.is_none() {
        Value::Null
    } else if obj.is_exact_instance_of::<PyBool>() {
        Value::Bool(obj.extract()?)
    } else if obj.is_exact_instance_of::<PyInt>() {
        Value::Int(obj.extract().map_err(|_| PyTypeError::new_err(format!("int {obj} is outside the 64-bit range")))?)
    } else if obj.is_exact_instance_of::<PyFloat>() {
        Value::Float(obj.extract()?)
    } else if obj.is_exact_instance_of::<PyString>() {
        Value::Str(obj.extract()?)
    } else if let Ok(b) = obj.cast_exact::<PyBytes>() {
        Value::Bytes(b.as_bytes().to_vec())
    } else if let Ok(list) = obj.cast_exact::<PyList>() {
        Value::List(list.iter().map(|item| value_from_py(&item)).collect::<PyResult<_>>()?)
    } else if let Ok(tuple) = obj.cast_exact::<PyTuple>() {
        // Stored as a list: plain values keep no tuple type (the Python layer gives a tuple
        // back where the load's request holds one).
        Value::List(tuple.iter().map(|item| value_from_py(&item)).collect::<PyResult<_>>()?)
    } else if let Ok(dict) = obj.cast_exact::<PyDict>() {
        let mut entries = Vec::with_capacity(dict.len());
        for (k, v) in dict.iter() {
            if !k.is_exact_instance_of::<PyString>() {
                return Err(PyTypeError::new_err(format!(
                    "dict key of type {} (plain dicts have str keys)",
                    type_name(&k)
                )));
            }
            entries.push((k.extract()?, value_from_py(&v)?));
        }
        Value::Map(entries)
    } else {
        return Err(PyTypeError::new_err(format!(
            "{} is not a plain value (None, bool, int, float, str, bytes, list, tuple, dict[str, ...])",
            type_name(obj)
        )));
    })
}

/// A [`Value`] as the Python value it was made from.
pub fn value_to_py<'py>(py: Python<'py>, value: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => b.into_bound_py_any(py)?,
        Value::Int(i) => i.into_bound_py_any(py)?,
        Value::Float(f) => f.into_bound_py_any(py)?,
        Value::Str(s) => s.into_bound_py_any(py)?,
        Value::Bytes(b) => PyBytes::new(py, b).into_any(),
        Value::List(items) => {
            PyList::new(py, items.iter().map(|v| value_to_py(py, v)).collect::<PyResult<Vec<_>>>()?)?.into_any()
        }
        Value::Map(entries) => {
            let dict = PyDict::new(py);
            for (k, v) in entries {
                dict.set_item(k, value_to_py(py, v)?)?;
            }
            dict.into_any()
        }
    })
}

/// `(path, value)` pairs as a Python list of `(list, value)` tuples.
pub fn common_to_py<'py>(py: Python<'py>, common: &[(StatePath, Value)]) -> PyResult<Bound<'py, PyList>> {
    let items = common
        .iter()
        .map(|(path, value)| PyTuple::new(py, [path_to_py(py, path)?.into_any(), value_to_py(py, value)?]))
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, items)
}
