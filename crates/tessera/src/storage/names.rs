//! What a file name inside a location may be. Every backend checks names here before it
//! touches anything, so no name from an index (of any format) reaches outside its checkpoint.

/// File names in an index are plain names: no separators, no `..`, nothing hidden outside.
pub(crate) fn check_file_name(name: &str) -> Result<(), String> {
    if name.is_empty()
        || name == "."
        || name == ".."
        || name.contains('/')
        || name.contains('\\')
        || name.contains('\0')
    {
        return Err(format!("file name {name:?} is not a plain name inside the checkpoint"));
    }
    Ok(())
}

/// A file name relative to the checkpoint: plain components (foreign formats keep files in
/// sub-folders: zarr's `key/0.0`, OLMo-core's `model/rank_0.safetensors`) joined by `/`.
pub(crate) fn check_relative_name(name: &str) -> Result<(), String> {
    if name.split('/').all(|c| check_file_name(c).is_ok()) {
        Ok(())
    } else {
        Err(format!("file name {name:?} is not a relative path of plain components inside the checkpoint"))
    }
}
