//! Planning: pure, synchronous functions from metadata to plans. Geometry of chunks, the save
//! exchange and validation, data-file layout, index assembly, load intersection and read
//! grouping, the fully-parallel load exchange. Nothing here does IO, so all of it is unit- and
//! property-testable and can be run for 10,000 simulated ranks.

pub mod exchange;
pub(crate) mod fasthash;
pub mod geometry;
pub mod load;
pub mod save;
pub mod validate;

/// Runs `work(i)` for each `i` in `0..n`, in any order and possibly from several threads: how
/// the caller of a plan function chooses the threads its independent parts run on (tessera's
/// save runs them on every core). Code in `plan/` starts no thread.
pub type ForEach<'a> = &'a (dyn Fn(usize, &(dyn Fn(usize) + Sync)) + Sync);

/// The [`ForEach`] that runs every part in order on the calling thread.
pub fn serial(n: usize, work: &(dyn Fn(usize) + Sync)) {
    (0..n).for_each(work);
}
