//! The read operations of an opened [`Checkpoint`].

use std::collections::BTreeMap;

use crate::comm::Communicator;
use crate::error::Result;
use crate::load::engine::{
    common_state, load_checkpoint, load_sharded_objects, read_plain_tensors, tensors_metadata, LoadOptions, LoadResult,
    PlainTensor, TensorMeta,
};
use crate::load::open::Checkpoint;
use crate::model::{StateTree, Value};

impl<'s> Checkpoint<'s> {
    /// [`crate::open_with`] as a collective, for every rank of a load that opens once and
    /// then calls [`Checkpoint::load`]: the index entries of `keys` only (all of them with
    /// `exchange_reads`). A rank whose open fails (a damaged section is seen by its readers
    /// only) still makes the collectives its peers' load makes before reading, so no rank is
    /// left waiting; [`crate::load`] opens this way.
    pub fn open_for_load<K: AsRef<str>>(
        storage: &'s dyn crate::storage::Storage,
        keys: &[K],
        comm: &dyn Communicator,
        opts: &LoadOptions,
    ) -> Result<Checkpoint<'s>> {
        crate::load::engine::open_for_load(storage, keys, comm, opts)
    }

    /// Loads the state described by `tree` (collective over `comm`: every rank calls it with
    /// its own tree), resharding from the stored layout into the requested one; see
    /// [`crate::load`], which opens and loads in one call. With several ranks it makes
    /// collectives even without `exchange_reads` (the all-gather of
    /// [`LoadOptions::share_verification`]): open with [`Checkpoint::open_for_load`] so that a
    /// rank whose open fails still makes them.
    pub fn load<'a>(&self, tree: StateTree<'a>, comm: &dyn Communicator, opts: &LoadOptions) -> Result<LoadResult<'a>> {
        load_checkpoint(self, tree, comm, opts)
    }

    /// Whole tensors (all, or those whose key is in `keys`), unsharded, in this process.
    /// [`crate::Error::NotFound`] names a key the checkpoint lacks.
    pub fn read_tensors(&self, keys: Option<&[&str]>) -> Result<BTreeMap<String, PlainTensor>> {
        read_plain_tensors(self, keys)
    }

    /// Key → dtype and global shape of every stored tensor; reads no tensor data.
    pub fn tensors_metadata(&self) -> BTreeMap<String, TensorMeta> {
        tensors_metadata(&self.index)
    }

    /// The common (non-sharded) state as a tree of plain values.
    pub fn common_state(&self) -> StateTree<'static> {
        common_state(&self.index)
    }

    /// The user metadata given at save (`Value::Null` if none).
    pub fn content_metadata(&self) -> &Value {
        &self.index.content_metadata
    }

    /// Fills the data of every [`crate::ShardedObject`] in `tree` from the checkpoint; other
    /// leaves are left as they are.
    pub fn load_objects<'a>(&self, tree: StateTree<'a>) -> Result<StateTree<'a>> {
        load_sharded_objects(self, tree)
    }
}
