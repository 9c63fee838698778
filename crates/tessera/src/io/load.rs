//! Load: open the index through the strategy registry, plan this rank's reads with no
//! communication, read only the needed bytes into the caller's buffers.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use crate::comm::Communicator;
use crate::format::CheckpointIndex;
use crate::io::factories::{apply_factories, apply_merges, remove_paths};
use crate::io::read::{execute, verify_headers, Target};
use crate::io::strategy::open_index;
use crate::plan::load::{plan_reads, plan_request, ReadTuning, Request};
use crate::state::{StatePath, StateTree, TensorData, Value};
use crate::storage::Storage;
use crate::{DType, Error, Result};

/// What to do about keys that do not match between the request and the checkpoint
/// (Megatron's `StrictHandling`). "Unexpected" keys are requested but absent from the
/// checkpoint; "missing" keys are in the checkpoint but requested by no rank (finding them
/// takes one all-gather, so every rank must call load in the `*All` modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StrictHandling {
    /// No check; an unexpected key fails when its data is looked for.
    #[default]
    AssumeOkUnexpected,
    /// Warn about unexpected keys and skip them.
    LogUnexpected,
    /// Warn about unexpected and missing keys; skip unexpected ones.
    LogAll,
    /// Fail on unexpected keys.
    RaiseUnexpected,
    /// Fail on unexpected or missing keys.
    RaiseAll,
    /// Skip unexpected keys and return them.
    ReturnUnexpected,
    /// Skip unexpected keys; return unexpected and missing keys.
    ReturnAll,
    /// Skip unexpected keys silently.
    IgnoreAll,
}

impl StrictHandling {
    /// Parses Megatron's names (`"assume_ok_unexpected"`, `"raise_all"`, …).
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "assume_ok_unexpected" => Self::AssumeOkUnexpected,
            "log_unexpected" => Self::LogUnexpected,
            "log_all" => Self::LogAll,
            "raise_unexpected" => Self::RaiseUnexpected,
            "raise_all" => Self::RaiseAll,
            "return_unexpected" => Self::ReturnUnexpected,
            "return_all" => Self::ReturnAll,
            "ignore_all" => Self::IgnoreAll,
            _ => return Err(Error::invalid(format!("unknown strict handling {s:?}"))),
        })
    }
    fn needs_missing(self) -> bool {
        matches!(self, Self::LogAll | Self::RaiseAll | Self::ReturnAll)
    }
}

/// How to load.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Verify the checksum of every block read (default on).
    pub verify_checksums: bool,
    /// Key-mismatch handling.
    pub strict: StrictHandling,
    /// IO threads.
    pub threads: usize,
    /// Read grouping.
    pub tuning: ReadTuning,
    /// Set it to stop the reads early: the load then fails with [`Error::Cancelled`] (target
    /// buffers hold partial data).
    pub cancel: Option<Arc<AtomicBool>>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            verify_checksums: true,
            strict: StrictHandling::default(),
            threads: crate::io::save::default_threads(),
            tuning: ReadTuning::default(),
            cancel: None,
        }
    }
}

/// Counters of one rank's load.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadStats {
    /// Bytes the requested tensors needed.
    pub bytes_needed: u64,
    /// Bytes of tensor data read from storage (whole checksum blocks when verifying).
    pub bytes_read: u64,
    /// Bytes of data-file headers read to verify them (verified loads only).
    pub header_bytes_read: u64,
    /// Ranged reads issued.
    pub reads: usize,
}

/// What a load returns: the tree with every tensor filled (in the caller's buffers, or in
/// owned buffers where none were given), objects and common values from the checkpoint,
/// non-persistent values as given.
#[derive(Debug)]
pub struct LoadResult<'a> {
    /// The loaded state.
    pub state: StateTree<'a>,
    /// Requested keys not in the checkpoint (in the modes that report them).
    pub unexpected_keys: Vec<String>,
    /// Checkpoint keys nobody requested (in the `*All` modes).
    pub missing_keys: Vec<String>,
    /// IO counters.
    pub stats: LoadStats,
}

/// Loads the state described by `tree` from the checkpoint in `storage`.
pub fn load<'a>(
    tree: StateTree<'a>,
    storage: &dyn Storage,
    comm: &dyn Communicator,
    opts: &LoadOptions,
) -> Result<LoadResult<'a>> {
    let index = open_index(storage)?;
    load_from_index(&index, tree, storage, comm, opts)
}

/// [`load`] with an index already opened (reuse across loads).
pub fn load_from_index<'a>(
    index: &CheckpointIndex,
    tree: StateTree<'a>,
    storage: &dyn Storage,
    comm: &dyn Communicator,
    opts: &LoadOptions,
) -> Result<LoadResult<'a>> {
    let (mut tree, applied) = apply_factories(tree)?;

    // Keys requested and their paths.
    let mut requested: BTreeSet<String> = BTreeSet::new();
    let mut unexpected: BTreeMap<String, Vec<StatePath>> = BTreeMap::new();
    tree.for_each_leaf(&mut |path, leaf| {
        let key = match leaf {
            StateTree::Tensor(t) => Some((&t.key, index.tensor(&t.key).is_some())),
            StateTree::Object(o) => Some((&o.key, index.object(&o.key).is_some())),
            _ => None,
        };
        if let Some((key, present)) = key {
            requested.insert(key.clone());
            if !present {
                unexpected.entry(key.clone()).or_default().push(path.to_vec());
            }
        }
    });
    let mut missing = Vec::new();
    if opts.strict.needs_missing() {
        let mut mine = Vec::new();
        for k in &requested {
            mine.extend_from_slice(k.as_bytes());
            mine.push(0);
        }
        let all = comm.all_gather(&mine)?;
        let mut anyone: BTreeSet<&[u8]> = BTreeSet::new();
        for b in &all {
            anyone.extend(b.split(|&x| x == 0).filter(|s| !s.is_empty()));
        }
        let stored = index.tensors.iter().map(|t| &t.key).chain(index.objects.iter().map(|o| &o.key));
        missing = stored.filter(|k| !anyone.contains(k.as_bytes())).cloned().collect();
    }
    let unexpected_keys: Vec<String> = unexpected.keys().cloned().collect();
    use StrictHandling as S;
    match opts.strict {
        S::RaiseUnexpected if !unexpected_keys.is_empty() => {
            return Err(Error::KeyMismatch { unexpected: unexpected_keys, missing: Vec::new() })
        }
        S::RaiseAll if !unexpected_keys.is_empty() || !missing.is_empty() => {
            return Err(Error::KeyMismatch { unexpected: unexpected_keys, missing })
        }
        S::LogUnexpected | S::LogAll if !unexpected_keys.is_empty() || !missing.is_empty() => {
            eprintln!("tessera: warning: unexpected keys (skipped): {unexpected_keys:?}; missing keys: {missing:?}");
        }
        _ => {}
    }
    if opts.strict != S::AssumeOkUnexpected {
        let paths: Vec<StatePath> = unexpected.values().flatten().cloned().collect();
        remove_paths(&mut tree, &paths);
    }

    // Requests and targets; buffers not given are allocated.
    let mut requests: Vec<Request> = Vec::new();
    let mut targets: Vec<Target> = Vec::new();
    let mut objects_wanted = 0usize;
    let mut tree = tree.map_leaves(&mut |_, leaf| {
        Ok(match leaf {
            StateTree::Tensor(mut t) => {
                t.check(false)?;
                if matches!(t.data, TensorData::None) {
                    t.data = TensorData::Owned(vec![0u8; t.data_nbytes() as usize]);
                }
                let buf = t.data.bytes_mut().ok_or_else(|| {
                    Error::invalid(format!(
                        "{:?}: load needs a writable buffer (TensorData::Mut or Owned), got a read-only one",
                        t.key
                    ))
                })?;
                targets.push(Target::new(buf));
                requests.push(Request {
                    key: t.key.clone(),
                    dtype: t.dtype,
                    global_shape: t.global_shape.clone(),
                    offset: t.global_offset.clone(),
                    shape: t.box_shape(),
                    flat: t.flattened_range.as_ref().map(|r| (r.start, r.end)),
                    allow_shape_mismatch: t.allow_shape_mismatch,
                    target: targets.len() - 1,
                });
                StateTree::Tensor(t)
            }
            StateTree::Object(o) => {
                objects_wanted += 1;
                StateTree::Object(o)
            }
            other => other,
        })
    })?;

    let mut segs = Vec::new();
    for r in &requests {
        let p = plan_request(index, r)?;
        if p.zero_fill {
            let t = targets[r.target];
            // SAFETY: the target is the live buffer of this request, not yet shared with readers.
            unsafe { std::ptr::write_bytes(t.ptr, 0, t.len) };
        }
        segs.extend(p.segs);
    }
    let plan = plan_reads(index, segs, opts.verify_checksums, opts.tuning);
    execute(storage, index, &plan, &targets, opts.threads, opts.cancel.as_deref())?;
    let mut header_bytes_read = 0;
    if opts.verify_checksums {
        let mut files: Vec<u32> = plan.spans.iter().map(|s| s.file).collect();
        files.dedup();
        header_bytes_read = verify_headers(storage, index, &files)?;
    }
    let stats = LoadStats {
        bytes_needed: plan.bytes_needed,
        bytes_read: plan.bytes_read,
        header_bytes_read,
        reads: plan.spans.len(),
    };

    if objects_wanted > 0 {
        tree = tree.map_leaves(&mut |_, leaf| match leaf {
            StateTree::Object(mut o) => {
                o.data = Some(read_object(index, storage, &o.key, &o.global_offset, opts.verify_checksums)?);
                Ok(StateTree::Object(o))
            }
            other => Ok(other),
        })?;
    }

    // Common values form the base; sharded leaves loaded above stay where they are.
    for (path, v) in &index.common {
        let keep =
            matches!(tree.get(path), Some(StateTree::Tensor(_) | StateTree::Object(_) | StateTree::NonPersistent(_)));
        if !keep {
            tree.set_path(path, StateTree::Value(v.clone()));
        }
    }
    let state = apply_merges(tree, applied)?;
    let (unexpected_keys, missing_keys) = match opts.strict {
        S::ReturnAll | S::LogAll | S::RaiseAll => (unexpected_keys, missing),
        S::ReturnUnexpected | S::LogUnexpected | S::RaiseUnexpected => (unexpected_keys, Vec::new()),
        _ => (Vec::new(), Vec::new()),
    };
    Ok(LoadResult { state, unexpected_keys, missing_keys, stats })
}

pub(crate) fn read_object(
    index: &CheckpointIndex,
    storage: &dyn Storage,
    key: &str,
    offset: &[u64],
    verify: bool,
) -> Result<Vec<u8>> {
    let entry = index
        .object(key)
        .ok_or_else(|| Error::NotCovered { key: key.into(), region: "(object not in checkpoint)".into() })?;
    let shard = entry
        .shards
        .iter()
        .find(|s| s.offset == offset)
        .ok_or_else(|| Error::NotCovered { key: key.into(), region: format!("object shard {offset:?}") })?;
    let name = &index.files[shard.file as usize].name;
    let mut buf = vec![0u8; shard.len as usize];
    storage.read_at(name, shard.byte_offset, &mut buf)?;
    if verify && crc32c::crc32c(&buf) != shard.crc {
        return Err(Error::corrupt(
            format!("{}/{name}", storage.location()),
            format!("checksum mismatch in object {key:?} shard {offset:?}"),
        ));
    }
    Ok(buf)
}

/// Dtype and global shape of a stored tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub global_shape: Vec<u64>,
}

/// Key → dtype and global shape of every stored tensor, without reading tensor data.
pub fn load_tensors_metadata(storage: &dyn Storage) -> Result<BTreeMap<String, TensorMeta>> {
    let index = open_index(storage)?;
    Ok(index
        .tensors
        .iter()
        .map(|t| (t.key.clone(), TensorMeta { dtype: t.dtype, global_shape: t.global_shape.clone() }))
        .collect())
}

/// A whole tensor in memory.
#[derive(Debug, Clone, PartialEq)]
pub struct PlainTensor {
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// C-contiguous bytes.
    pub data: Vec<u8>,
}

/// Loads whole tensors (all, or those whose key is in `keys`), unsharded.
pub fn load_plain_tensors(storage: &dyn Storage, keys: Option<&[&str]>) -> Result<BTreeMap<String, PlainTensor>> {
    let index = open_index(storage)?;
    let mut tree = StateTree::map();
    for t in &index.tensors {
        if keys.is_some_and(|ks| !ks.contains(&t.key.as_str())) {
            continue;
        }
        tree.insert(
            t.key.clone(),
            StateTree::Tensor(crate::ShardedTensor::full(&t.key, t.dtype, &t.global_shape, TensorData::None)),
        );
    }
    if let Some(ks) = keys {
        if let Some(k) = ks.iter().find(|k| index.tensor(k).is_none()) {
            return Err(Error::NotFound { path: format!("{}: tensor {k:?}", storage.location()).into() });
        }
    }
    let loaded = load_from_index(&index, tree, storage, &crate::SoloComm, &LoadOptions::default())?;
    let mut out = BTreeMap::new();
    if let StateTree::Map(m) = loaded.state {
        for (k, v) in m {
            if let StateTree::Tensor(t) = v {
                let data = match t.data {
                    TensorData::Owned(v) => v,
                    other => other.bytes().map(<[u8]>::to_vec).unwrap_or_default(),
                };
                out.insert(k, PlainTensor { dtype: t.dtype, shape: t.global_shape, data });
            }
        }
    }
    Ok(out)
}

/// The common (non-sharded) state as a tree of plain values.
pub fn load_common_state(storage: &dyn Storage) -> Result<StateTree<'static>> {
    let index = open_index(storage)?;
    let mut tree = StateTree::map();
    for (path, v) in &index.common {
        tree.set_path(path, StateTree::Value(v.clone()));
    }
    Ok(tree)
}

/// The user metadata given at save (`Value::Null` if none).
pub fn load_content_metadata(storage: &dyn Storage) -> Result<Value> {
    Ok(open_index(storage)?.content_metadata)
}

/// Fills the data of every [`crate::ShardedObject`] in `tree` from the checkpoint; other leaves
/// are left as they are.
pub fn load_sharded_objects<'a>(tree: StateTree<'a>, storage: &dyn Storage) -> Result<StateTree<'a>> {
    let index = open_index(storage)?;
    tree.map_leaves(&mut |_, leaf| match leaf {
        StateTree::Object(mut o) => {
            o.data = Some(read_object(&index, storage, &o.key, &o.global_offset, true)?);
            Ok(StateTree::Object(o))
        }
        other => Ok(other),
    })
}
