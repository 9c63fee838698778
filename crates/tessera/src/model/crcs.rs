//! The block checksums of a stored chunk, inline up to three: an index holds millions of chunks,
//! most with one to three blocks (a chunk of the distributed optimizer's state cut across DP
//! holds a few MiB or less), and a heap allocation per chunk would dominate the cost of
//! building, opening and dropping the index.

use std::fmt;
use std::ops::{Deref, DerefMut};

const INLINE: usize = 3;

/// The crc32c of each block of a chunk's bytes; derefs to `[u32]`. The same size as a
/// `Vec<u32>`.
#[derive(Clone)]
pub struct Crcs(Repr);

#[derive(Clone)]
enum Repr {
    Inline(u8, [u32; INLINE]),
    Heap(Vec<u32>),
}

impl Crcs {
    /// No checksums.
    pub const fn new() -> Self {
        Crcs(Repr::Inline(0, [0; INLINE]))
    }
    /// An empty list with room for `n` checksums.
    pub fn with_capacity(n: usize) -> Self {
        if n <= INLINE {
            Crcs::new()
        } else {
            Crcs(Repr::Heap(Vec::with_capacity(n)))
        }
    }
    /// Appends a checksum.
    #[inline]
    pub fn push(&mut self, crc: u32) {
        match &mut self.0 {
            Repr::Inline(n, a) if (*n as usize) < INLINE => {
                a[*n as usize] = crc;
                *n += 1;
            }
            Repr::Inline(n, a) => {
                let mut v = Vec::with_capacity(2 * INLINE);
                v.extend_from_slice(&a[..*n as usize]);
                v.push(crc);
                self.0 = Repr::Heap(v);
            }
            Repr::Heap(v) => v.push(crc),
        }
    }
    /// The checksums as a slice.
    pub fn as_slice(&self) -> &[u32] {
        self
    }
}

impl Default for Crcs {
    fn default() -> Self {
        Crcs::new()
    }
}

impl Deref for Crcs {
    type Target = [u32];
    #[inline]
    fn deref(&self) -> &[u32] {
        match &self.0 {
            Repr::Inline(n, a) => &a[..*n as usize],
            Repr::Heap(v) => v,
        }
    }
}

impl DerefMut for Crcs {
    #[inline]
    fn deref_mut(&mut self) -> &mut [u32] {
        match &mut self.0 {
            Repr::Inline(n, a) => &mut a[..*n as usize],
            Repr::Heap(v) => v,
        }
    }
}

impl From<&[u32]> for Crcs {
    fn from(s: &[u32]) -> Self {
        if s.len() <= INLINE {
            let mut a = [0; INLINE];
            a[..s.len()].copy_from_slice(s);
            Crcs(Repr::Inline(s.len() as u8, a))
        } else {
            Crcs(Repr::Heap(s.to_vec()))
        }
    }
}

impl From<Vec<u32>> for Crcs {
    /// A short list is copied inline (and the vector freed); a long one is kept as it is.
    fn from(v: Vec<u32>) -> Self {
        if v.len() <= INLINE {
            Crcs::from(v.as_slice())
        } else {
            Crcs(Repr::Heap(v))
        }
    }
}

impl From<Crcs> for Vec<u32> {
    fn from(c: Crcs) -> Self {
        match c.0 {
            Repr::Inline(n, a) => a[..n as usize].to_vec(),
            Repr::Heap(v) => v,
        }
    }
}

impl FromIterator<u32> for Crcs {
    fn from_iter<I: IntoIterator<Item = u32>>(iter: I) -> Self {
        let iter = iter.into_iter();
        let mut c = Crcs::with_capacity(iter.size_hint().0);
        for x in iter {
            c.push(x);
        }
        c
    }
}

impl PartialEq for Crcs {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}
impl Eq for Crcs {}

impl PartialEq<Vec<u32>> for Crcs {
    fn eq(&self, other: &Vec<u32>) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl PartialEq<[u32]> for Crcs {
    fn eq(&self, other: &[u32]) -> bool {
        self.as_slice() == other
    }
}

impl fmt::Debug for Crcs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.as_slice().fmt(f)
    }
}

impl<'a> IntoIterator for &'a Crcs {
    type Item = &'a u32;
    type IntoIter = std::slice::Iter<'a, u32>;
    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_lists_stay_inline_and_every_length_round_trips() {
        assert_eq!(std::mem::size_of::<Crcs>(), std::mem::size_of::<Vec<u32>>());
        for n in 0..10u32 {
            let v: Vec<u32> = (0..n).map(|i| i.wrapping_mul(0x9e37_79b9)).collect();
            let pushed = {
                let mut c = Crcs::new();
                v.iter().for_each(|&x| c.push(x));
                c
            };
            for c in [Crcs::from(v.clone()), Crcs::from(v.as_slice()), v.iter().copied().collect(), pushed] {
                assert_eq!(c, v);
                assert_eq!(matches!(c.0, Repr::Inline(..)), n as usize <= INLINE, "{n}");
                assert_eq!(Vec::from(c.clone()), v);
                assert_eq!(format!("{c:?}"), format!("{v:?}"));
            }
        }
        let mut c = Crcs::from(vec![1, 2]);
        c[1] = 7;
        assert_eq!(c.as_slice(), &[1, 7]);
    }
}
