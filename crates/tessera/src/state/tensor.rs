//! Sharded tensors: one rank's piece of a global tensor.

use std::ops::Range;

use crate::{DType, Error, Result};

/// Which replica of a shard this is. All zeros means the main replica, the one that is written.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct ReplicaId(pub Vec<u32>);

impl ReplicaId {
    /// The main replica (`0`).
    pub fn main() -> Self {
        ReplicaId(vec![0])
    }
    /// True when every component is zero: this copy is the one saved.
    pub fn is_main(&self) -> bool {
        self.0.iter().all(|&x| x == 0)
    }
}

impl From<u32> for ReplicaId {
    fn from(x: u32) -> Self {
        ReplicaId(vec![x])
    }
}

impl<const N: usize> From<[u32; N]> for ReplicaId {
    fn from(x: [u32; N]) -> Self {
        ReplicaId(x.to_vec())
    }
}

/// The bytes of a local tensor: C-contiguous, borrowed from the caller where possible.
/// Save reads `Ref`, `Mut` or `Owned`; load writes into `Mut` or `Owned` (and allocates
/// `Owned` for `None`).
#[derive(Debug, Default)]
pub enum TensorData<'a> {
    /// No data: metadata only (validation, planning), or "allocate for me" on load.
    #[default]
    None,
    /// Read-only borrowed bytes (save).
    Ref(&'a [u8]),
    /// Writable borrowed bytes (load in place; also saveable).
    Mut(&'a mut [u8]),
    /// Bytes owned by the tree.
    Owned(Vec<u8>),
}

impl<'a> TensorData<'a> {
    /// Bytes to save, if any.
    pub fn bytes(&self) -> Option<&[u8]> {
        match self {
            TensorData::None => None,
            TensorData::Ref(b) => Some(b),
            TensorData::Mut(b) => Some(b),
            TensorData::Owned(b) => Some(b),
        }
    }

    /// Writable bytes, if any.
    pub fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        match self {
            TensorData::None | TensorData::Ref(_) => None,
            TensorData::Mut(b) => Some(b),
            TensorData::Owned(b) => Some(b),
        }
    }

    /// Number of bytes held (0 for `None`).
    pub fn len(&self) -> usize {
        self.bytes().map_or(0, <[u8]>::len)
    }

    /// True when no bytes are held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Splits into `[0, at)` and `[at, len)` without copying borrowed bytes.
    pub fn split_at(self, at: usize) -> Result<(TensorData<'a>, TensorData<'a>)> {
        let check = |len: usize| {
            if at > len {
                Err(Error::invalid(format!("split at byte {at} past the end ({len})")))
            } else {
                Ok(())
            }
        };
        Ok(match self {
            TensorData::None => (TensorData::None, TensorData::None),
            TensorData::Ref(b) => {
                check(b.len())?;
                let (x, y) = b.split_at(at);
                (TensorData::Ref(x), TensorData::Ref(y))
            }
            TensorData::Mut(b) => {
                check(b.len())?;
                let (x, y) = b.split_at_mut(at);
                (TensorData::Mut(x), TensorData::Mut(y))
            }
            TensorData::Owned(mut b) => {
                check(b.len())?;
                let tail = b.split_off(at);
                (TensorData::Owned(b), TensorData::Owned(tail))
            }
        })
    }

    /// Joins consecutive parts back into one: borrowed parts that are adjacent in memory are
    /// re-joined without copying, anything else is copied into an owned buffer.
    pub fn join(parts: Vec<TensorData<'a>>) -> TensorData<'a> {
        if parts.iter().all(|p| matches!(p, TensorData::Mut(_))) && !parts.is_empty() {
            let mut slices: Vec<&'a mut [u8]> = parts
                .into_iter()
                .map(|p| match p {
                    TensorData::Mut(b) => b,
                    _ => unreachable!(),
                })
                .collect();
            let adjacent = slices.windows(2).all(|w| w[0].as_ptr_range().end == w[1].as_ptr());
            if adjacent {
                let start = slices[0].as_mut_ptr();
                let len: usize = slices.iter().map(|s| s.len()).sum();
                // SAFETY: the slices are exclusive borrows with the same lifetime, laid out back
                // to back in one allocation (checked above), so together they are one exclusive
                // borrow of `len` bytes from `start`.
                return TensorData::Mut(unsafe { std::slice::from_raw_parts_mut(start, len) });
            }
            let mut out = Vec::new();
            for s in slices.iter_mut() {
                out.extend_from_slice(s);
            }
            return TensorData::Owned(out);
        }
        let mut out = Vec::new();
        for p in &parts {
            if let Some(b) = p.bytes() {
                out.extend_from_slice(b);
            }
        }
        TensorData::Owned(out)
    }
}

/// One rank's piece of a global tensor: a box of the global tensor (optionally only a
/// `[start, end)` slice of the row-major flattening of that box), with its replica id.
#[derive(Debug)]
pub struct ShardedTensor<'a> {
    /// Global key of the tensor, unique in the checkpoint.
    pub key: String,
    /// The local bytes.
    pub data: TensorData<'a>,
    /// Element type.
    pub dtype: DType,
    /// Shape of the local tensor (without the prepended axes).
    pub local_shape: Vec<u64>,
    /// Shape of the global tensor.
    pub global_shape: Vec<u64>,
    /// Offset of the local box in the global tensor, in elements, one per global axis.
    pub global_offset: Vec<u64>,
    /// How many equal fragments each global axis is cut into; validated when given.
    pub axis_fragmentations: Option<Vec<u64>>,
    /// Replica id; only main replicas (all zeros) are written.
    pub replica_id: ReplicaId,
    /// Number of leading global axes the local tensor lacks (size 1 in the local box).
    pub prepend_axis_num: usize,
    /// On load, accept a stored global shape that differs: the overlap is read, the rest zeroed.
    pub allow_shape_mismatch: bool,
    /// The data holds only this `[start, end)` range of the row-major flattening of the box.
    pub flattened_range: Option<Range<u64>>,
}

impl<'a> ShardedTensor<'a> {
    /// A tensor held whole by this rank (global = local, main replica).
    pub fn full(key: impl Into<String>, dtype: DType, shape: &[u64], data: TensorData<'a>) -> Self {
        ShardedTensor {
            key: key.into(),
            data,
            dtype,
            local_shape: shape.to_vec(),
            global_shape: shape.to_vec(),
            global_offset: vec![0; shape.len()],
            axis_fragmentations: None,
            replica_id: ReplicaId::main(),
            prepend_axis_num: 0,
            allow_shape_mismatch: false,
            flattened_range: None,
        }
    }

    /// Megatron's `from_rank_offsets`: each `(axis, rank_offset, fragments)` says the global
    /// tensor is cut into `fragments` equal pieces along global `axis` and this rank holds
    /// piece `rank_offset`. Axes below `prepend_axis_num` are absent from `local_shape`.
    pub fn from_rank_offsets(
        key: impl Into<String>,
        dtype: DType,
        local_shape: &[u64],
        data: TensorData<'a>,
        rank_offsets: &[(usize, u64, u64)],
        prepend_axis_num: usize,
    ) -> Result<Self> {
        let key = key.into();
        let ndim = prepend_axis_num + local_shape.len();
        let mut box_shape = vec![1u64; prepend_axis_num];
        box_shape.extend_from_slice(local_shape);
        let mut global_shape = box_shape.clone();
        let mut global_offset = vec![0u64; ndim];
        let mut frags = vec![1u64; ndim];
        for &(axis, rank_offset, fragments) in rank_offsets {
            if axis >= ndim {
                return Err(Error::sharding(&key, format!("rank offset axis {axis} out of {ndim} axes")));
            }
            if fragments == 0 || rank_offset >= fragments {
                return Err(Error::sharding(
                    &key,
                    format!("rank offset {rank_offset} not below fragment count {fragments} on axis {axis}"),
                ));
            }
            if frags[axis] != 1 {
                return Err(Error::sharding(&key, format!("axis {axis} given twice in rank offsets")));
            }
            frags[axis] = fragments;
            global_shape[axis] = box_shape[axis] * fragments;
            global_offset[axis] = box_shape[axis] * rank_offset;
        }
        Ok(ShardedTensor {
            key,
            data,
            dtype,
            local_shape: local_shape.to_vec(),
            global_shape,
            global_offset,
            axis_fragmentations: Some(frags),
            replica_id: ReplicaId::main(),
            prepend_axis_num,
            allow_shape_mismatch: false,
            flattened_range: None,
        })
    }

    /// Sets the replica id.
    pub fn with_replica_id(mut self, replica_id: impl Into<ReplicaId>) -> Self {
        self.replica_id = replica_id.into();
        self
    }

    /// Restricts the data to a range of the flattened local box (distributed optimizer, FSDP).
    pub fn with_flattened_range(mut self, range: Range<u64>) -> Self {
        self.flattened_range = Some(range);
        self
    }

    /// Allows the stored global shape to differ on load.
    pub fn with_allow_shape_mismatch(mut self, allow: bool) -> Self {
        self.allow_shape_mismatch = allow;
        self
    }

    /// The shape of the local box in global axes (`[1] * prepend_axis_num + local_shape`).
    pub fn box_shape(&self) -> Vec<u64> {
        let mut s = vec![1u64; self.prepend_axis_num];
        s.extend_from_slice(&self.local_shape);
        s
    }

    /// Number of elements the data holds.
    pub fn data_numel(&self) -> u64 {
        match &self.flattened_range {
            Some(r) => r.end.saturating_sub(r.start),
            None => self.local_shape.iter().product(),
        }
    }

    /// Number of bytes the data must hold.
    pub fn data_nbytes(&self) -> u64 {
        self.data_numel() * self.dtype.size() as u64
    }

    /// Checks that the description is self-consistent (ranks, bounds, fragmentations, data size).
    /// `in_bounds`: require the box to lie inside the global shape.
    pub fn check(&self, in_bounds: bool) -> Result<()> {
        let key = &self.key;
        let ndim = self.global_shape.len();
        if self.prepend_axis_num + self.local_shape.len() != ndim || self.global_offset.len() != ndim {
            return Err(Error::sharding(
                key,
                format!(
                    "rank mismatch: global shape {:?}, global offset {:?}, local shape {:?} with {} prepended axes",
                    self.global_shape, self.global_offset, self.local_shape, self.prepend_axis_num
                ),
            ));
        }
        let box_shape = self.box_shape();
        if in_bounds {
            for d in 0..ndim {
                if self.global_offset[d] + box_shape[d] > self.global_shape[d] {
                    return Err(Error::sharding(
                        key,
                        format!(
                            "box at offset {:?} with shape {:?} exceeds global shape {:?} on axis {d}",
                            self.global_offset, box_shape, self.global_shape
                        ),
                    ));
                }
            }
        }
        if let Some(frags) = &self.axis_fragmentations {
            if frags.len() != ndim {
                return Err(Error::sharding(key, format!("axis_fragmentations {frags:?} has wrong rank")));
            }
            for d in 0..ndim {
                let f = frags[d];
                if f == 0 || !self.global_shape[d].is_multiple_of(f) || box_shape[d] * f != self.global_shape[d] {
                    return Err(Error::sharding(
                        key,
                        format!(
                            "axis {d}: shape {} is not global {} / {f} fragments",
                            box_shape[d], self.global_shape[d]
                        ),
                    ));
                }
                if !self.global_offset[d].is_multiple_of(box_shape[d].max(1)) {
                    return Err(Error::sharding(
                        key,
                        format!("axis {d}: offset {} is not on a fragment boundary", self.global_offset[d]),
                    ));
                }
            }
        }
        let numel: u64 = box_shape.iter().product();
        if let Some(r) = &self.flattened_range {
            if r.start > r.end || r.end > numel {
                return Err(Error::sharding(
                    key,
                    format!("flattened range {r:?} outside the {numel} elements of the local box"),
                ));
            }
        }
        if !matches!(self.data, TensorData::None) && self.data.len() as u64 != self.data_nbytes() {
            return Err(Error::invalid(format!(
                "{key:?}: data holds {} bytes, the shard needs {} ({} elements of {})",
                self.data.len(),
                self.data_nbytes(),
                self.data_numel(),
                self.dtype
            )));
        }
        Ok(())
    }
}
