//! Entry point of the `zarr` fuzz target (feature `fuzzing`): a `.zarray` as the reader parses
//! it, returning plain data.

/// A `.zarray` as [`zarray`] returns it: shape, chunks, chunk grid, name of the last chunk.
pub type Zarray = (Vec<u64>, Vec<u64>, Vec<u64>, String);

/// A `.zarray`: `(shape, chunks, chunk grid, name of the last chunk)`.
pub fn zarray(bytes: &[u8]) -> Result<Zarray, String> {
    let a = super::zarray::parse_zarray(bytes)?;
    let grid = a.grid();
    let last: Vec<u64> = grid.iter().map(|g| g.saturating_sub(1)).collect();
    let name = a.chunk_name(&last);
    Ok((a.shape, a.chunks, grid, name))
}
