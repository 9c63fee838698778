//! A small vector of dimensions that stays inline up to 3 axes: planning handles millions of
//! shards, and three heap allocations per shard would dominate the cost.

use std::fmt;
use std::ops::{Deref, DerefMut};

const INLINE: usize = 3;

/// Dimensions (shape, offset) of a box; derefs to `[u64]`.
#[derive(Clone)]
pub enum Dims {
    /// Up to three axes, stored inline.
    Inline(u8, [u64; INLINE]),
    /// More axes.
    Heap(Vec<u64>),
}

impl Dims {
    /// Axes stored inline.
    pub const INLINE: usize = INLINE;
    /// The dimensions as a slice.
    pub fn as_slice(&self) -> &[u64] {
        self
    }
    /// Appends an axis.
    #[inline]
    pub fn push(&mut self, x: u64) {
        match self {
            Dims::Inline(n, a) if (*n as usize) < Dims::INLINE => {
                a[*n as usize] = x;
                *n += 1;
            }
            Dims::Inline(n, a) => {
                let mut v = a[..*n as usize].to_vec();
                v.push(x);
                *self = Dims::Heap(v);
            }
            Dims::Heap(v) => v.push(x),
        }
    }
    /// Removes the last axis.
    #[inline]
    pub fn pop(&mut self) -> Option<u64> {
        match self {
            Dims::Inline(0, _) => None,
            Dims::Inline(n, a) => {
                *n -= 1;
                Some(a[*n as usize])
            }
            Dims::Heap(v) => v.pop(),
        }
    }
    /// An empty list with room for `n` axes.
    pub fn with_capacity(n: usize) -> Self {
        if n <= Dims::INLINE {
            Dims::Inline(0, [0; Dims::INLINE])
        } else {
            Dims::Heap(Vec::with_capacity(n))
        }
    }
}

impl Default for Dims {
    fn default() -> Self {
        Dims::Inline(0, [0; Dims::INLINE])
    }
}

impl Deref for Dims {
    type Target = [u64];
    #[inline]
    fn deref(&self) -> &[u64] {
        match self {
            Dims::Inline(n, a) => &a[..*n as usize],
            Dims::Heap(v) => v,
        }
    }
}

impl DerefMut for Dims {
    fn deref_mut(&mut self) -> &mut [u64] {
        match self {
            Dims::Inline(n, a) => &mut a[..*n as usize],
            Dims::Heap(v) => v,
        }
    }
}

impl From<&[u64]> for Dims {
    #[inline]
    fn from(s: &[u64]) -> Self {
        if s.len() <= Dims::INLINE {
            let mut a = [0; Dims::INLINE];
            // Element by element: a copy of a variable length is a call to memcpy, which costs
            // more than the copy for three words (planning converts millions of these).
            for (x, &v) in a.iter_mut().zip(s) {
                *x = v;
            }
            Dims::Inline(s.len() as u8, a)
        } else {
            Dims::Heap(s.to_vec())
        }
    }
}

impl From<Vec<u64>> for Dims {
    fn from(v: Vec<u64>) -> Self {
        Dims::from(v.as_slice())
    }
}

impl From<&Vec<u64>> for Dims {
    fn from(v: &Vec<u64>) -> Self {
        Dims::from(v.as_slice())
    }
}

impl<const N: usize> From<[u64; N]> for Dims {
    fn from(a: [u64; N]) -> Self {
        Dims::from(&a[..])
    }
}

impl FromIterator<u64> for Dims {
    fn from_iter<I: IntoIterator<Item = u64>>(iter: I) -> Self {
        let mut d = Dims::default();
        for x in iter {
            d.push(x);
        }
        d
    }
}

impl PartialEq for Dims {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        // Not the slice comparison: for `u64` it is a call to memcmp, which costs more than
        // comparing the few words of a shape (validation compares millions).
        self.len() == other.len() && self.iter().zip(other.iter()).all(|(a, b)| a == b)
    }
}
impl Eq for Dims {}

impl PartialEq<[u64]> for Dims {
    fn eq(&self, other: &[u64]) -> bool {
        self.as_slice() == other
    }
}

impl PartialEq<Vec<u64>> for Dims {
    fn eq(&self, other: &Vec<u64>) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl PartialOrd for Dims {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Dims {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_slice().cmp(other.as_slice())
    }
}

impl std::hash::Hash for Dims {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_slice().hash(state)
    }
}

impl fmt::Debug for Dims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.as_slice().fmt(f)
    }
}

impl<'a> IntoIterator for &'a Dims {
    type Item = &'a u64;
    type IntoIter = std::slice::Iter<'a, u64>;
    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

/// Most axes a tensor (or a sharded object's grid) may have: 64, torch's own limit for most
/// operations, where real models use a handful. Every parser of shapes read from bytes (native
/// index, safetensors headers, DCP `.metadata`, `torch.save` records, zarr `.zarray`,
/// OLMo-core metadata) refuses more with `Error::Corrupt` naming the file and the key, and a
/// save refuses more up front: a 180 KB header can name 60,000 axes, and each axis costs the
/// planner and the geometry work and memory for every chunk (SECURITY.md).
pub const MAX_AXES: usize = 64;

/// `Err` with the reason to report when `ndim` axes are more than [`MAX_AXES`].
pub fn check_axes(ndim: usize) -> Result<(), String> {
    if ndim > MAX_AXES {
        return Err(format!("{ndim} axes, more than the {MAX_AXES} a tensor may have"));
    }
    Ok(())
}

/// Number of elements of a shape (1 for a scalar).
pub fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}
