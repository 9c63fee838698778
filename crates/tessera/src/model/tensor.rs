//! Sharded tensors: one rank's piece of a global tensor.

// No `unsafe` here: tensor data is split and joined with safe code only.
#![forbid(unsafe_code)]

use std::ops::Range;

use crate::error::{Error, Result};
use crate::model::dtype::DType;

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

    /// Joins consecutive parts back into one. A single part is returned as it is (a part loaded
    /// in place stays the caller's buffer); several are copied into one owned buffer.
    ///
    /// Borrowed parts adjacent in memory are not re-joined into one `&mut [u8]`: a slice made
    /// from the first part's pointer carries the first part's provenance only, so touching the
    /// bytes of the next part through it is undefined behaviour (Stacked and Tree Borrows), how
    /// ever adjacent the memory. Re-joining soundly needs the borrow the parts were split from.
    pub fn join(parts: Vec<TensorData<'a>>) -> TensorData<'a> {
        let mut parts = parts.into_iter().filter(|p| !matches!(p, TensorData::None)).peekable();
        let Some(first) = parts.next() else {
            return TensorData::Owned(Vec::new());
        };
        if parts.peek().is_none() {
            return first;
        }
        let mut out = match first {
            TensorData::Owned(v) => v,
            other => other.bytes().map(<[u8]>::to_vec).unwrap_or_default(),
        };
        for p in parts {
            out.extend_from_slice(p.bytes().unwrap_or_default());
        }
        TensorData::Owned(out)
    }
}

/// Bytes of `shape` elements of `esize` bytes each, `None` when that overflows `u64` or is more
/// than one allocation can hold (`isize::MAX`).
pub(crate) fn checked_nbytes(shape: &[u64], esize: usize) -> Option<u64> {
    shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d))?.checked_mul(esize as u64).filter(|&n| n <= isize::MAX as u64)
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
        let ndim = prepend_axis_num
            .checked_add(local_shape.len())
            .ok_or_else(|| Error::sharding(&key, format!("{prepend_axis_num} prepended axes overflow")))?;
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
            // User numbers: a product past u64 is refused, never wrapped.
            let (Some(size), Some(offset)) =
                (box_shape[axis].checked_mul(fragments), box_shape[axis].checked_mul(rank_offset))
            else {
                return Err(Error::sharding(
                    &key,
                    format!("axis {axis}: {fragments} fragments of {} elements overflow", box_shape[axis]),
                ));
            };
            global_shape[axis] = size;
            global_offset[axis] = offset;
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

    /// Number of elements the data holds (saturating at `u64::MAX`; [`Self::check`] refuses
    /// shapes that overflow).
    pub fn data_numel(&self) -> u64 {
        match &self.flattened_range {
            Some(r) => r.end.saturating_sub(r.start),
            None => self.local_shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).unwrap_or(u64::MAX),
        }
    }

    /// Number of bytes the data must hold (saturating, as [`Self::data_numel`]).
    pub fn data_nbytes(&self) -> u64 {
        self.data_numel().saturating_mul(self.dtype.size() as u64)
    }

    /// Checks that the description is self-consistent (ranks, bounds, fragmentations, data size).
    /// `in_bounds`: require the box to lie inside the global shape.
    pub fn check(&self, in_bounds: bool) -> Result<()> {
        let key = &self.key;
        let ndim = self.global_shape.len();
        // What every reader refuses is refused before it is written.
        crate::model::dims::check_axes(ndim).map_err(|e| Error::sharding(key, format!("the global shape has {e}")))?;
        if self.prepend_axis_num.checked_add(self.local_shape.len()) != Some(ndim) || self.global_offset.len() != ndim {
            return Err(Error::sharding(
                key,
                format!(
                    "rank mismatch: global shape {:?}, global offset {:?}, local shape {:?} with {} prepended axes",
                    self.global_shape, self.global_offset, self.local_shape, self.prepend_axis_num
                ),
            ));
        }
        let box_shape = self.box_shape();
        // The box's end is computed downstream (planning, geometry) whether or not it must lie
        // inside the global shape: it has to fit in u64 either way.
        for (d, (&off, &size)) in self.global_offset.iter().zip(&box_shape).enumerate() {
            if off.checked_add(size).is_none() {
                return Err(Error::sharding(key, format!("axis {d}: offset {off} + size {size} overflows")));
            }
        }
        if checked_nbytes(&self.global_shape, self.dtype.size()).is_none() {
            return Err(Error::sharding(key, format!("global shape {:?} overflows", self.global_shape)));
        }
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
                if f == 0
                    || !self.global_shape[d].is_multiple_of(f)
                    || box_shape[d].checked_mul(f) != Some(self.global_shape[d])
                {
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
        if checked_nbytes(&box_shape, self.dtype.size()).is_none() {
            return Err(Error::sharding(key, format!("local box {box_shape:?} overflows")));
        }
        // Cannot overflow: the bytes of the box fit in u64 (checked just above).
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sharding_of(r: Result<impl std::fmt::Debug>, want: &str) -> bool {
        matches!(r, Err(Error::InvalidSharding { ref key, .. }) if key == want)
    }

    #[test]
    fn split_then_join_round_trips_every_kind() {
        let mut buf: Vec<u8> = (0..8).collect();
        let (a, b) = TensorData::Mut(&mut buf).split_at(3).unwrap();
        let joined = TensorData::join(vec![a, b]);
        // Borrowed parts are copied, never re-joined through a pointer of the first one.
        assert!(matches!(joined, TensorData::Owned(ref v) if *v == (0..8).collect::<Vec<u8>>()), "{joined:?}");
        drop(joined);

        // One part is handed back as it is: a part loaded in place stays the caller's buffer.
        let ptr = buf.as_ptr();
        match TensorData::join(vec![TensorData::None, TensorData::Mut(&mut buf), TensorData::None]) {
            TensorData::Mut(m) => assert_eq!(m.as_ptr(), ptr),
            other => panic!("{other:?}"),
        }

        let (a, b) = TensorData::Owned((0..5).collect()).split_at(2).unwrap();
        assert!(matches!(TensorData::join(vec![a, b]), TensorData::Owned(v) if v == [0, 1, 2, 3, 4]));
        let (a, b) = TensorData::Ref(&[7, 8, 9]).split_at(1).unwrap();
        let mixed = TensorData::join(vec![a, TensorData::Owned(vec![1]), b]);
        assert!(matches!(mixed, TensorData::Owned(v) if v == [7, 1, 8, 9]));
        assert!(matches!(TensorData::join(vec![]), TensorData::Owned(v) if v.is_empty()));
        assert!(matches!(TensorData::join(vec![TensorData::None]), TensorData::Owned(v) if v.is_empty()));
    }

    #[test]
    fn split_past_the_end_is_an_invalid_argument() {
        let mut buf = [0u8; 4];
        let r = TensorData::Mut(&mut buf).split_at(5);
        assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
        let r = TensorData::Ref(&[1]).split_at(2);
        assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    }

    #[test]
    fn rank_offsets_that_overflow_are_refused() {
        let big = u64::MAX / 2 + 1;
        // Global size: box × fragments overflows.
        let r = ShardedTensor::from_rank_offsets("w", DType::U8, &[big], TensorData::None, &[(0, 0, 2)], 0);
        assert!(sharding_of(r, "w"));
        // Global offset: box × rank offset overflows (with the size fitting: 3 × 2^62 does not).
        let r = ShardedTensor::from_rank_offsets("w", DType::U8, &[1 << 62], TensorData::None, &[(0, 3, 4)], 0);
        assert!(sharding_of(r, "w"));
        let r = ShardedTensor::from_rank_offsets("w", DType::U8, &[2], TensorData::None, &[(0, 1, 2)], usize::MAX);
        assert!(sharding_of(r, "w"));
        // In range: fine.
        let t = ShardedTensor::from_rank_offsets("w", DType::U8, &[2], TensorData::None, &[(0, 1, 2)], 0).unwrap();
        assert_eq!((t.global_shape, t.global_offset), (vec![4], vec![2]));
    }

    #[test]
    fn check_refuses_shapes_and_offsets_that_overflow() {
        let meta = |offset: u64, local: &[u64], global: &[u64]| ShardedTensor {
            global_offset: vec![offset; local.len()],
            global_shape: global.to_vec(),
            ..ShardedTensor::full("t", DType::F32, local, TensorData::None)
        };
        // Offset + size past u64, in and out of bounds mode (load's check is the latter).
        for in_bounds in [true, false] {
            assert!(sharding_of(meta(u64::MAX, &[2], &[4]).check(in_bounds), "t"));
        }
        // Elements of the box, or their bytes, past u64 (or past one allocation).
        assert!(sharding_of(meta(0, &[1 << 32, 1 << 32], &[1 << 32, 1 << 32]).check(false), "t"));
        assert!(sharding_of(meta(0, &[1 << 62], &[1 << 62]).check(false), "t"));
        // The global shape alone overflows.
        assert!(sharding_of(meta(0, &[1, 1], &[u64::MAX, 3]).check(false), "t"));
        // Fragments × box size past u64.
        let mut t = meta(0, &[1 << 40], &[1 << 40]);
        t.axis_fragmentations = Some(vec![1 << 40]);
        assert!(sharding_of(t.check(false), "t"));
        // A flattened range past the box.
        let t = meta(0, &[4], &[4]).with_flattened_range(2..5);
        assert!(sharding_of(t.check(true), "t"));
        // Sizes saturate instead of wrapping or panicking.
        let t = meta(0, &[u64::MAX, 2], &[u64::MAX, 2]);
        assert_eq!((t.data_numel(), t.data_nbytes()), (u64::MAX, u64::MAX));
        // In range: fine.
        meta(0, &[2, 3], &[2, 3]).check(true).unwrap();
    }

    #[test]
    fn checked_nbytes_stops_at_one_allocation() {
        assert_eq!(checked_nbytes(&[2, 3], 4), Some(24));
        assert_eq!(checked_nbytes(&[], 2), Some(2));
        assert_eq!(checked_nbytes(&[0, u64::MAX], 8), Some(0));
        assert_eq!(checked_nbytes(&[u64::MAX, 2], 1), None);
        assert_eq!(checked_nbytes(&[isize::MAX as u64], 2), None);
        assert_eq!(checked_nbytes(&[isize::MAX as u64], 1), Some(isize::MAX as u64));
    }
}
