//! The typed values of the `tessera._native` contract (`SaveTensor`, `LoadTensor`, `SaveObject`,
//! `LoadObject`: what crosses from Python to the library), and conversions between plain Python
//! values and the library's types. A value is converted once, when it is made: a field of the
//! wrong type is a `TypeError`, an integer the library's type cannot hold (negative, too large) an
//! `InvalidArgumentError`, both naming the key. No checks beyond what a conversion needs: the
//! library validates the rest.

use std::fmt::Write as _;
use std::ops::Range;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use pyo3::IntoPyObjectExt;
use tessera::{DType, PathSeg, ReplicaId, ShardedObject, ShardedTensor, StatePath, TensorData, Value};

use crate::errors::{invalid_argument, to_pyerr};

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string())
}

/// The value being made, for error messages: `SaveTensor 'w': global_shape: ...`.
struct Fields {
    class: &'static str,
    key: String,
}

impl Fields {
    /// Starts with the key: every later message names it.
    fn new(class: &'static str, key: &Bound<'_, PyAny>) -> PyResult<Self> {
        let key = key
            .extract::<String>()
            .map_err(|_| PyTypeError::new_err(format!("{class} key must be a str, got {}", type_name(key))))?;
        Ok(Fields { class, key })
    }

    fn type_error(&self, field: &str, message: impl std::fmt::Display) -> PyErr {
        PyTypeError::new_err(format!("{} {:?}: {field}: {message}", self.class, self.key))
    }

    /// A non-negative integer (anything with `__index__`).
    fn uint<'py, T: FromPyObjectOwned<'py>>(&self, obj: &Bound<'py, PyAny>, field: &str) -> PyResult<T> {
        obj.extract::<T>().map_err(|e| {
            if obj.extract::<i128>().is_ok() {
                invalid_argument(
                    obj.py(),
                    format!("{} {:?}: {field}: {obj} is negative or too large", self.class, self.key),
                )
            } else {
                let e: PyErr = e.into();
                self.type_error(field, e.value(obj.py()))
            }
        })
    }

    /// A sequence of non-negative integers (tuple, list, `torch.Size`, ...; not a string).
    fn uints<'py, T: FromPyObjectOwned<'py>>(&self, obj: &Bound<'py, PyAny>, field: &str) -> PyResult<Vec<T>> {
        let not_a_sequence =
            || self.type_error(field, format!("expected a sequence of integers, got {}", type_name(obj)));
        if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
            return Err(not_a_sequence());
        }
        let items = obj.try_iter().map_err(|_| not_a_sequence())?;
        items.map(|item| self.uint(&item?, field)).collect()
    }

    fn opt_uints(&self, obj: Option<&Bound<'_, PyAny>>, field: &str) -> PyResult<Option<Vec<u64>>> {
        obj.filter(|o| !o.is_none()).map(|o| self.uints(o, field)).transpose()
    }

    fn dtype(&self, obj: &Bound<'_, PyAny>) -> PyResult<DType> {
        let name: String = obj
            .extract()
            .map_err(|_| self.type_error("dtype", format!("expected a dtype name, got {}", type_name(obj))))?;
        DType::parse(&name).map_err(|e| invalid_argument(obj.py(), format!("{} {:?}: {e}", self.class, self.key)))
    }

    /// An int, or a sequence of ints (one per parallelism axis).
    fn replica_id(&self, obj: &Bound<'_, PyAny>) -> PyResult<ReplicaId> {
        let sequence = !obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyString>() && obj.try_iter().is_ok();
        Ok(ReplicaId(if sequence { self.uints(obj, "replica_id")? } else { vec![self.uint(obj, "replica_id")?] }))
    }

    /// None, or `(start, end)`.
    fn flattened_range(&self, obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Range<u64>>> {
        let Some(obj) = obj.filter(|o| !o.is_none()) else { return Ok(None) };
        match self.uints::<u64>(obj, "flattened_range")?.as_slice() {
            &[start, end] => Ok(Some(start..end)),
            _ => Err(self.type_error("flattened_range", "expected (start, end)")),
        }
    }

    /// `bytes` (kept) or `bytearray` (copied).
    fn bytes<'py>(&self, obj: Option<&Bound<'py, PyAny>>, py: Python<'py>) -> PyResult<Py<PyBytes>> {
        Ok(match obj {
            None => PyBytes::new(py, &[]).unbind(),
            Some(o) => {
                if let Ok(b) = o.cast::<PyBytes>() {
                    b.clone().unbind()
                } else if let Ok(b) = o.cast::<PyByteArray>() {
                    PyBytes::new(py, &b.to_vec()).unbind()
                } else {
                    return Err(self.type_error("data", format!("expected bytes, got {}", type_name(o))));
                }
            }
        })
    }
}

fn shape_tuple<'py>(py: Python<'py>, items: &[u64]) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(py, items)
}

fn opt_tuple<'py>(py: Python<'py>, items: Option<&Vec<u64>>) -> PyResult<Option<Bound<'py, PyTuple>>> {
    items.map(|v| PyTuple::new(py, v)).transpose()
}

fn range_tuple(r: &Option<Range<u64>>) -> Option<(u64, u64)> {
    r.as_ref().map(|r| (r.start, r.end))
}

/// What both tensor kinds hold: the tensor's description and the caller's memory.
struct Tensor {
    key: String,
    dtype: DType,
    local_shape: Vec<u64>,
    global_shape: Vec<u64>,
    global_offset: Vec<u64>,
    prepend_axis_num: usize,
    flattened_range: Option<Range<u64>>,
    data_ptr: usize,
    nbytes: usize,
}

impl Tensor {
    #[allow(clippy::too_many_arguments)]
    fn new(
        f: &Fields,
        dtype: &Bound<'_, PyAny>,
        local_shape: &Bound<'_, PyAny>,
        global_shape: &Bound<'_, PyAny>,
        global_offset: &Bound<'_, PyAny>,
        prepend_axis_num: &Bound<'_, PyAny>,
        flattened_range: Option<&Bound<'_, PyAny>>,
        data_ptr: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        Ok(Tensor {
            key: f.key.clone(),
            dtype: f.dtype(dtype)?,
            local_shape: f.uints(local_shape, "local_shape")?,
            global_shape: f.uints(global_shape, "global_shape")?,
            global_offset: f.uints(global_offset, "global_offset")?,
            prepend_axis_num: f.uint(prepend_axis_num, "prepend_axis_num")?,
            flattened_range: f.flattened_range(flattened_range)?,
            data_ptr: f.uint(data_ptr, "data_ptr")?,
            nbytes: f.uint(nbytes, "nbytes")?,
        })
    }

    /// The library's tensor without data, as a main replica.
    fn meta(&self) -> ShardedTensor<'static> {
        ShardedTensor {
            key: self.key.clone(),
            data: TensorData::None,
            dtype: self.dtype,
            local_shape: self.local_shape.clone(),
            global_shape: self.global_shape.clone(),
            global_offset: self.global_offset.clone(),
            axis_fragmentations: None,
            replica_id: ReplicaId::main(),
            prepend_axis_num: self.prepend_axis_num,
            allow_shape_mismatch: false,
            flattened_range: self.flattened_range.clone(),
        }
    }

    fn spec(&self, tensor: ShardedTensor<'static>) -> TensorSpec {
        TensorSpec { tensor, data_ptr: self.data_ptr, nbytes: self.nbytes }
    }

    /// `key='w', dtype='f32', local_shape=(4, 6), ...` (the fields both kinds have, first).
    fn repr_fields(&self) -> String {
        format!(
            "key={:?}, dtype={:?}, local_shape={:?}, global_shape={:?}, global_offset={:?}, prepend_axis_num={}",
            self.key,
            self.dtype.name(),
            self.local_shape,
            self.global_shape,
            self.global_offset,
            self.prepend_axis_num
        )
    }
}

/// A tensor shard to save: its description and `(data_ptr, nbytes)`, the address and size of
/// the caller's C-contiguous CPU memory (`0, 0`: none, e.g. to validate the layout only).
#[pyclass(module = "tessera._native", frozen)]
pub struct SaveTensor {
    t: Tensor,
    replica_id: ReplicaId,
    axis_fragmentations: Option<Vec<u64>>,
}

#[pymethods]
impl SaveTensor {
    #[new]
    #[pyo3(signature = (*, key, dtype, local_shape, global_shape, global_offset, prepend_axis_num=None,
                        replica_id=None, flattened_range=None, axis_fragmentations=None, data_ptr=None,
                        nbytes=None))]
    #[pyo3(text_signature = "(*, key, dtype, local_shape, global_shape, global_offset, prepend_axis_num=0, \
                             replica_id=0, flattened_range=None, axis_fragmentations=None, data_ptr=0, nbytes=0)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        dtype: &Bound<'_, PyAny>,
        local_shape: &Bound<'_, PyAny>,
        global_shape: &Bound<'_, PyAny>,
        global_offset: &Bound<'_, PyAny>,
        prepend_axis_num: Option<&Bound<'_, PyAny>>,
        replica_id: Option<&Bound<'_, PyAny>>,
        flattened_range: Option<&Bound<'_, PyAny>>,
        axis_fragmentations: Option<&Bound<'_, PyAny>>,
        data_ptr: Option<&Bound<'_, PyAny>>,
        nbytes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let zero = 0u8.into_bound_py_any(py)?;
        let f = Fields::new("SaveTensor", key)?;
        let t = Tensor::new(
            &f,
            dtype,
            local_shape,
            global_shape,
            global_offset,
            prepend_axis_num.unwrap_or(&zero),
            flattened_range,
            data_ptr.unwrap_or(&zero),
            nbytes.unwrap_or(&zero),
        )?;
        Ok(SaveTensor {
            t,
            replica_id: f.replica_id(replica_id.unwrap_or(&zero))?,
            axis_fragmentations: f.opt_uints(axis_fragmentations, "axis_fragmentations")?,
        })
    }

    /// The library's own checks of this tensor alone (`tessera::ShardedTensor::check`): axes,
    /// the box inside the global shape (`in_bounds`, as a save requires), fragmentations, the
    /// flattened range. Raises `InvalidShardingError` naming the key.
    #[pyo3(signature = (in_bounds=true))]
    fn check(&self, py: Python<'_>, in_bounds: bool) -> PyResult<()> {
        self.meta().check(in_bounds).map_err(|e| to_pyerr(py, e))
    }

    #[getter]
    fn key(&self) -> &str {
        &self.t.key
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.t.dtype.name()
    }
    #[getter]
    fn local_shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        shape_tuple(py, &self.t.local_shape)
    }
    #[getter]
    fn global_shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        shape_tuple(py, &self.t.global_shape)
    }
    #[getter]
    fn global_offset<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        shape_tuple(py, &self.t.global_offset)
    }
    #[getter]
    fn prepend_axis_num(&self) -> usize {
        self.t.prepend_axis_num
    }
    #[getter]
    fn replica_id<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.replica_id.0)
    }
    #[getter]
    fn flattened_range(&self) -> Option<(u64, u64)> {
        range_tuple(&self.t.flattened_range)
    }
    #[getter]
    fn axis_fragmentations<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        opt_tuple(py, self.axis_fragmentations.as_ref())
    }
    #[getter]
    fn data_ptr(&self) -> usize {
        self.t.data_ptr
    }
    #[getter]
    fn nbytes(&self) -> usize {
        self.t.nbytes
    }

    fn __repr__(&self) -> String {
        let mut s = format!("SaveTensor({}, replica_id={:?}", self.t.repr_fields(), self.replica_id.0);
        let _ = write!(
            s,
            ", flattened_range={:?}, axis_fragmentations={:?}, data_ptr={:#x}, nbytes={})",
            range_tuple(&self.t.flattened_range),
            self.axis_fragmentations,
            self.t.data_ptr,
            self.t.nbytes
        );
        s
    }
}

impl SaveTensor {
    fn meta(&self) -> ShardedTensor<'static> {
        ShardedTensor {
            replica_id: self.replica_id.clone(),
            axis_fragmentations: self.axis_fragmentations.clone(),
            ..self.t.meta()
        }
    }

    /// The tensor without data, and the caller's memory.
    pub fn spec(&self) -> TensorSpec {
        self.t.spec(self.meta())
    }
}

/// A tensor shard to load into the caller's memory: its description and `(data_ptr, nbytes)`,
/// the address and size of C-contiguous CPU memory the load writes.
#[pyclass(module = "tessera._native", frozen)]
pub struct LoadTensor {
    t: Tensor,
    allow_shape_mismatch: bool,
}

#[pymethods]
impl LoadTensor {
    #[new]
    #[pyo3(signature = (*, key, dtype, local_shape, global_shape, global_offset, data_ptr, nbytes,
                        prepend_axis_num=None, flattened_range=None, allow_shape_mismatch=false))]
    #[pyo3(text_signature = "(*, key, dtype, local_shape, global_shape, global_offset, data_ptr, nbytes, \
                             prepend_axis_num=0, flattened_range=None, allow_shape_mismatch=False)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        dtype: &Bound<'_, PyAny>,
        local_shape: &Bound<'_, PyAny>,
        global_shape: &Bound<'_, PyAny>,
        global_offset: &Bound<'_, PyAny>,
        data_ptr: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
        prepend_axis_num: Option<&Bound<'_, PyAny>>,
        flattened_range: Option<&Bound<'_, PyAny>>,
        allow_shape_mismatch: bool,
    ) -> PyResult<Self> {
        let zero = 0u8.into_bound_py_any(py)?;
        let f = Fields::new("LoadTensor", key)?;
        let t = Tensor::new(
            &f,
            dtype,
            local_shape,
            global_shape,
            global_offset,
            prepend_axis_num.unwrap_or(&zero),
            flattened_range,
            data_ptr,
            nbytes,
        )?;
        Ok(LoadTensor { t, allow_shape_mismatch })
    }

    #[getter]
    fn key(&self) -> &str {
        &self.t.key
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.t.dtype.name()
    }
    #[getter]
    fn local_shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        shape_tuple(py, &self.t.local_shape)
    }
    #[getter]
    fn global_shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        shape_tuple(py, &self.t.global_shape)
    }
    #[getter]
    fn global_offset<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        shape_tuple(py, &self.t.global_offset)
    }
    #[getter]
    fn prepend_axis_num(&self) -> usize {
        self.t.prepend_axis_num
    }
    #[getter]
    fn flattened_range(&self) -> Option<(u64, u64)> {
        range_tuple(&self.t.flattened_range)
    }
    #[getter]
    fn allow_shape_mismatch(&self) -> bool {
        self.allow_shape_mismatch
    }
    #[getter]
    fn data_ptr(&self) -> usize {
        self.t.data_ptr
    }
    #[getter]
    fn nbytes(&self) -> usize {
        self.t.nbytes
    }

    fn __repr__(&self) -> String {
        format!(
            "LoadTensor({}, flattened_range={:?}, allow_shape_mismatch={}, data_ptr={:#x}, nbytes={})",
            self.t.repr_fields(),
            range_tuple(&self.t.flattened_range),
            if self.allow_shape_mismatch { "True" } else { "False" },
            self.t.data_ptr,
            self.t.nbytes
        )
    }
}

impl LoadTensor {
    /// The tensor without data, and the caller's memory.
    pub fn spec(&self) -> TensorSpec {
        self.t.spec(ShardedTensor { allow_shape_mismatch: self.allow_shape_mismatch, ..self.t.meta() })
    }
}

/// A shard of a sharded object to save: shard `global_offset` of a `global_shape` grid of
/// shards, with its serialized bytes (empty to validate the layout only).
#[pyclass(module = "tessera._native", frozen)]
pub struct SaveObject {
    key: String,
    global_shape: Vec<u64>,
    global_offset: Vec<u64>,
    replica_id: ReplicaId,
    data: Py<PyBytes>,
}

#[pymethods]
impl SaveObject {
    #[new]
    #[pyo3(signature = (*, key, global_shape, global_offset, replica_id=None, data=None))]
    #[pyo3(text_signature = "(*, key, global_shape, global_offset, replica_id=0, data=None)")]
    fn new(
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        global_shape: &Bound<'_, PyAny>,
        global_offset: &Bound<'_, PyAny>,
        replica_id: Option<&Bound<'_, PyAny>>,
        data: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let zero = 0u8.into_bound_py_any(py)?;
        let f = Fields::new("SaveObject", key)?;
        Ok(SaveObject {
            global_shape: f.uints(global_shape, "global_shape")?,
            global_offset: f.uints(global_offset, "global_offset")?,
            replica_id: f.replica_id(replica_id.unwrap_or(&zero))?,
            data: f.bytes(data, py)?,
            key: f.key,
        })
    }

    #[getter]
    fn key(&self) -> &str {
        &self.key
    }
    #[getter]
    fn global_shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        shape_tuple(py, &self.global_shape)
    }
    #[getter]
    fn global_offset<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        shape_tuple(py, &self.global_offset)
    }
    #[getter]
    fn replica_id<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.replica_id.0)
    }
    #[getter]
    fn data<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        self.data.bind(py).clone()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "SaveObject(key={:?}, global_shape={:?}, global_offset={:?}, replica_id={:?}, data=<{} bytes>)",
            self.key,
            self.global_shape,
            self.global_offset,
            self.replica_id.0,
            self.data.bind(py).as_bytes().len()
        )
    }
}

impl SaveObject {
    /// The library's object, with a copy of the bytes.
    pub fn object(&self, py: Python<'_>) -> ShardedObject {
        ShardedObject {
            key: self.key.clone(),
            data: Some(self.data.bind(py).as_bytes().to_vec()),
            global_shape: self.global_shape.clone(),
            global_offset: self.global_offset.clone(),
            replica_id: self.replica_id.clone(),
        }
    }
}

/// A shard of a sharded object to load: shard `global_offset` of a `global_shape` grid.
#[pyclass(module = "tessera._native", frozen)]
pub struct LoadObject {
    key: String,
    global_shape: Vec<u64>,
    global_offset: Vec<u64>,
}

#[pymethods]
impl LoadObject {
    #[new]
    #[pyo3(signature = (*, key, global_shape, global_offset))]
    fn new(
        key: &Bound<'_, PyAny>,
        global_shape: &Bound<'_, PyAny>,
        global_offset: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let f = Fields::new("LoadObject", key)?;
        Ok(LoadObject {
            global_shape: f.uints(global_shape, "global_shape")?,
            global_offset: f.uints(global_offset, "global_offset")?,
            key: f.key,
        })
    }

    #[getter]
    fn key(&self) -> &str {
        &self.key
    }
    #[getter]
    fn global_shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        shape_tuple(py, &self.global_shape)
    }
    #[getter]
    fn global_offset<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        shape_tuple(py, &self.global_offset)
    }

    fn __repr__(&self) -> String {
        format!(
            "LoadObject(key={:?}, global_shape={:?}, global_offset={:?})",
            self.key, self.global_shape, self.global_offset
        )
    }
}

impl LoadObject {
    /// The library's load request for the shard.
    pub fn object(&self) -> ShardedObject {
        ShardedObject {
            key: self.key.clone(),
            data: None,
            global_shape: self.global_shape.clone(),
            global_offset: self.global_offset.clone(),
            replica_id: ReplicaId::main(),
        }
    }
}

/// `(global_shape, global_offset, axis_fragmentations)` of the shard Megatron's
/// `ShardedTensor.from_rank_offsets` describes (`tessera::ShardedTensor::from_rank_offsets`):
/// each `(axis, axis_rank_offset, axis_fragm)` cuts global `axis` into `axis_fragm` equal
/// chunks of which this rank holds chunk `axis_rank_offset`. Raises `InvalidShardingError`
/// naming the key.
#[pyfunction]
#[pyo3(signature = (key, local_shape, rank_offsets, prepend_axis_num=None))]
#[pyo3(text_signature = "(key, local_shape, rank_offsets, prepend_axis_num=0)")]
#[allow(clippy::type_complexity)]
pub fn from_rank_offsets<'py>(
    py: Python<'py>,
    key: &Bound<'_, PyAny>,
    local_shape: &Bound<'_, PyAny>,
    rank_offsets: Vec<Bound<'_, PyAny>>,
    prepend_axis_num: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Bound<'py, PyTuple>, Bound<'py, PyTuple>, Bound<'py, PyTuple>)> {
    let f = Fields::new("ShardedTensor", key)?;
    let zero = 0u8.into_bound_py_any(py)?;
    let prepend_axis_num = prepend_axis_num.unwrap_or(&zero);
    let local_shape: Vec<u64> = f.uints(local_shape, "local_shape")?;
    let prepend_axis_num: usize = f.uint(prepend_axis_num, "prepend_axis_num")?;
    let offsets = rank_offsets
        .iter()
        .map(|entry| {
            let items: Vec<u64> = f.uints(entry, "rank offset")?;
            match items.as_slice() {
                &[axis, rank_offset, fragments] => Ok((axis as usize, rank_offset, fragments)),
                _ => Err(f.type_error("rank offset", format!("{entry} must be (axis, axis_rank_offset, axis_fragm)"))),
            }
        })
        .collect::<PyResult<Vec<_>>>()?;
    // The element type plays no part in the geometry.
    let t =
        ShardedTensor::from_rank_offsets(f.key, DType::U8, &local_shape, TensorData::None, &offsets, prepend_axis_num)
            .map_err(|e| to_pyerr(py, e))?;
    let frags = t.axis_fragmentations.unwrap_or_default();
    Ok((shape_tuple(py, &t.global_shape)?, shape_tuple(py, &t.global_offset)?, shape_tuple(py, &frags)?))
}

/// A tensor of a `SaveTensor` or `LoadTensor`, with the address of its memory.
pub struct TensorSpec {
    /// The tensor, without data.
    pub tensor: ShardedTensor<'static>,
    /// Address of the caller's C-contiguous CPU memory (0: none).
    pub data_ptr: usize,
    /// Its size in bytes.
    pub nbytes: usize,
}

impl TensorSpec {
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
