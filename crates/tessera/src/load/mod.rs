//! Loading: one opener (location → detected format → index → validation → checkpoint), the
//! load engine (plans from `plan/`, reads through `storage/`, decoding and casts into the
//! caller's memory), ranged reads of the native index, the exchange of reads shared between
//! ranks, and checksums verified by the ranks together. Reading threads start here.

pub(crate) mod checkpoint;
pub(crate) mod engine;
pub(crate) mod index_read;
pub(crate) mod open;
pub(crate) mod read;
pub(crate) mod shared;

/// `n` zero bytes, or `None` when the allocator refuses them: a shape read from a checkpoint
/// may claim more than the machine has, and that must be an error, not an abort. Zeroed by the
/// allocator (untouched pages cost nothing until written).
pub(crate) fn zeroed(n: u64) -> Option<Vec<u8>> {
    let n = usize::try_from(n).ok().filter(|&n| n <= isize::MAX as usize)?;
    if n == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(n).ok()?;
    // SAFETY: `layout` has a non-zero size; a non-null result is `n` zeroed bytes allocated
    // with the global allocator and `u8`'s alignment, which `Vec::from_raw_parts` takes over.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout);
        (!ptr.is_null()).then(|| Vec::from_raw_parts(ptr, n, n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_gives_zeros_and_refuses_what_cannot_exist() {
        assert_eq!(zeroed(0), Some(Vec::new()));
        assert_eq!(zeroed(4096).unwrap(), vec![0u8; 4096]);
        assert_eq!(zeroed(u64::MAX), None);
        assert_eq!(zeroed(isize::MAX as u64 + 1), None);
    }
}
