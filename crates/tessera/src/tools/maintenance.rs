//! Maintenance of committed checkpoints: garbage collection and key removal.

use crate::error::{Error, Result};
use crate::format::is_data_file_name;
use crate::format::INDEX_FILE;
use crate::load::open::open_index;
use crate::storage::Storage;

/// Removes leftovers of saves that never committed (data files and temporary index files not
/// referenced by the committed index). With no committed index, every tessera data file is a
/// leftover. Returns the names removed. Must not run while a save into the same location is in
/// progress.
///
/// ```
/// use tessera::{gc, save, DType, MemoryStorage, SaveOptions, ShardedTensor, SoloComm, Storage, StateTree, TensorData};
///
/// let storage = MemoryStorage::new();
/// let w = ShardedTensor::full("w", DType::U8, &[4], TensorData::Owned(vec![1, 2, 3, 4]));
/// save(StateTree::map().with("w", StateTree::Tensor(w)), &storage, &SoloComm, &SaveOptions::default())?;
/// // The data file of a save that crashed before its commit.
/// let leftover = "0123456789abcdef-r00003.safetensors";
/// storage.put_atomic(leftover, b"partial")?;
///
/// assert_eq!(gc(&storage)?, [leftover]);
/// assert!(!storage.list()?.iter().any(|n| n == leftover));
/// assert!(gc(&storage)?.is_empty());
/// assert_eq!(tessera::open(&storage)?.read_tensors(None)?["w"].data, [1, 2, 3, 4]);
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn gc(storage: &dyn Storage) -> Result<Vec<String>> {
    match crate::load::open::detect_format(storage) {
        Ok((record, _)) if record.backend != crate::format::NATIVE_BACKEND => {
            return Err(Error::invalid(format!(
                "{}: gc only cleans tessera checkpoints; this is a {} checkpoint",
                storage.location(),
                record.backend
            )))
        }
        _ => {}
    }
    let referenced: Vec<String> = match open_index(storage) {
        Ok(index) => index.files.into_iter().map(|f| f.name).collect(),
        Err(Error::NotCommitted { .. }) | Err(Error::NotFound { .. }) => Vec::new(),
        Err(e) => return Err(e),
    };
    let removed = leftovers(storage, &referenced)?;
    for name in &removed {
        storage.delete(name)?;
    }
    Ok(removed)
}

/// The files of tessera's own saves in `storage` that the committed index (whose files are
/// `referenced`) does not use: data files and temporary index files of saves that never
/// committed, or of checkpoints since replaced. Sorted.
pub(crate) fn leftovers(storage: &dyn Storage, referenced: &[String]) -> Result<Vec<String>> {
    let mut out: Vec<String> = storage
        .list()?
        .into_iter()
        .filter(|name| is_data_file_name(name) || name.starts_with(&format!(".{INDEX_FILE}.tmp-")))
        .filter(|name| !referenced.contains(name))
        .collect();
    out.sort();
    Ok(out)
}

/// Removes every tensor whose key starts with `key_prefix` from a committed checkpoint
/// (Megatron's `remove_sharded_tensors`), by committing a new index without them; data files
/// are left as they are. Returns the keys removed.
///
/// ```
/// use tessera::{open, remove_sharded_tensors, save, SaveOptions};
/// use tessera::{DType, MemoryStorage, ShardedTensor, SoloComm, StateTree, TensorData};
///
/// let storage = MemoryStorage::new();
/// let t = |k: &str| StateTree::Tensor(ShardedTensor::full(k, DType::U8, &[1], TensorData::Owned(vec![0])));
/// let tree = StateTree::map().with("a", t("optim.a")).with("b", t("optim.b")).with("c", t("model.c"));
/// save(tree, &storage, &SoloComm, &SaveOptions::default())?;
///
/// let mut removed = remove_sharded_tensors(&storage, "optim.")?;
/// removed.sort();
/// assert_eq!(removed, ["optim.a", "optim.b"]);
/// assert_eq!(open(&storage)?.tensors_metadata().into_keys().collect::<Vec<_>>(), ["model.c"]);
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn remove_sharded_tensors(storage: &dyn Storage, key_prefix: &str) -> Result<Vec<String>> {
    let mut index = open_index(storage)?;
    if index.backend != crate::format::NATIVE_BACKEND {
        return Err(Error::invalid(format!("cannot edit a {} checkpoint in place", index.backend)));
    }
    let (removed, kept): (Vec<_>, Vec<_>) = index.tensors.into_iter().partition(|t| t.key.starts_with(key_prefix));
    index.tensors = kept;
    if !removed.is_empty() {
        storage.put_atomic(INDEX_FILE, &index.encode())?;
    }
    Ok(removed.into_iter().map(|t| t.key).collect())
}
