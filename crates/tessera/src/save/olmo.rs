//! Saving in OLMo-core 0.1.x's own format (`formats::olmo`), which ai2-olmo-core itself loads.
//!
//! The global plan is the native save's: one exchange of shard metadata, the check that the
//! main shards tile every tensor (before anything is written), and the spreading of replicated
//! shards over the ranks that hold them. Each rank then writes `rank_{r}.safetensors` (per key
//! its shards back to back as one 1-D tensor; block checksums in the header's `__metadata__`),
//! and rank 0 writes `metadata.json` once every rank's file is complete: the commit. With
//! `overwrite`, the old `metadata.json` is removed (after validation, before any file is
//! rewritten), so a crash leaves no loadable mix of old and new files.

use std::collections::BTreeSet;

use crate::comm::Communicator;
use crate::formats::olmo::{
    metadata_from_plans, metadata_json, rank_file_name, RankFileLayout, BACKEND, METADATA_FILE,
};
use crate::io::factories::apply_factories_collective;
use crate::io::save::{collect, decode_peer_error, plan_globally, SaveOptions};
use crate::io::strategy::detect_format;
use crate::io::write::{write_sources, Source};
use crate::state::{path_string, StateTree};
use crate::storage::Storage;
use crate::{Error, Result};

/// What an OLMo-core save did, as seen from one rank.
#[derive(Debug, Clone, Default)]
pub struct OlmoSaveReport {
    /// Files this rank created (its data file; `metadata.json` too on rank 0), relative to the
    /// checkpoint location.
    pub files: Vec<String>,
    /// Bytes this rank wrote.
    pub bytes_written: u64,
    /// Text of the committed `metadata.json`.
    pub metadata: String,
}

/// Saves this rank's tensors as one OLMo-core 0.1.x checkpoint directory (what
/// `Checkpointer.save` writes). Every rank of `comm` calls it with its own tree; the tree holds
/// tensors only (the format has no objects or common values). Tensor keys become the
/// metadata's keys. Errors come out identically on every rank.
pub fn save_olmo(
    tree: StateTree<'_>,
    storage: &dyn Storage,
    comm: &dyn Communicator,
    opts: &SaveOptions,
) -> Result<OlmoSaveReport> {
    let rank = comm.rank();
    let (tree, factory_error) = apply_factories_collective(tree);
    let mut c = collect(&tree, rank, true, opts.distribute_replicas);
    let mut local = factory_error.or(c.local_error.take());
    if let Some(o) = c.plan.objects.first() {
        local.get_or_insert(Error::invalid(format!(
            "object {:?}: OLMo-core checkpoints hold tensors only (save it in the native format)",
            o.key
        )));
    }
    if let Some((path, _)) = c.common.first() {
        local.get_or_insert(Error::invalid(format!(
            "common value {:?}: OLMo-core checkpoints hold tensors only (save it in the native format)",
            path_string(path)
        )));
    }
    if opts.block_size == 0 {
        local.get_or_insert(Error::invalid("block size must be positive"));
    }
    if rank == 0 {
        match detect_format(storage) {
            Ok((record, _)) if record.backend == BACKEND && !opts.overwrite => c.plan.refuse_overwrite = true,
            Ok((record, _)) if record.backend == BACKEND => {}
            Ok((record, _)) => {
                local.get_or_insert(Error::invalid(format!(
                    "{} holds a {} checkpoint; an OLMo-core checkpoint cannot replace it there",
                    storage.location(),
                    record.backend
                )));
            }
            Err(Error::NotFound { .. } | Error::NotCommitted { .. }) => {}
            Err(e) => {
                local.get_or_insert(e);
            }
        }
    }
    c.local_error = local;
    let plans = plan_globally(comm, &mut c, opts, storage)?;

    if opts.overwrite {
        // Uncommit the old checkpoint before any of its files is rewritten in place.
        let removed = if rank == 0 { storage.delete(METADATA_FILE) } else { Ok(()) };
        agree(comm, removed)?;
    }

    let layout = RankFileLayout::new(&plans[rank], opts.block_size);
    let name = rank_file_name(rank);
    let written = if layout.keys.is_empty() {
        // Nothing to write here: a file left by an earlier save must not look like this one's.
        storage.delete(&name).map(|()| None)
    } else {
        write_file(&layout, &name, &c.tensor_data, storage, opts).map(Some)
    };
    let written = agree(comm, written)?;

    // Rank 0 commits; everyone learns the verdict. Every rank knows the metadata (callers
    // return it, as OLMo-core's `Checkpointer.save` does).
    let metadata = metadata_json(&metadata_from_plans(&plans));
    let committed = if rank == 0 {
        let put = if opts.overwrite {
            storage.put_atomic(METADATA_FILE, metadata.as_bytes())
        } else {
            storage.put_if_absent(METADATA_FILE, metadata.as_bytes())
        };
        put.map(|()| remove_stale_files(storage, &plans))
    } else {
        Ok(())
    };
    agree(comm, committed)?;
    let mut files: Vec<String> = written.iter().cloned().collect();
    if rank == 0 {
        files.push(METADATA_FILE.into());
    }
    Ok(OlmoSaveReport { files, bytes_written: written.map_or(0, |_| layout.size), metadata })
}

/// Writes this rank's data file; returns its name.
fn write_file(
    layout: &RankFileLayout,
    name: &str,
    data: &[Option<&[u8]>],
    storage: &dyn Storage,
    opts: &SaveOptions,
) -> Result<String> {
    let writer = storage.create(name, layout.size)?;
    let sources = layout
        .ranges()
        .zip(layout.range_offsets())
        .map(|((k, shard, at, n), file_off)| {
            let bytes = data[shard]
                .ok_or_else(|| Error::invalid(format!("{:?}: chosen to write a shard it has no data for", k.key)))?;
            let es = k.dtype.size() as u64;
            Ok(Source { data: &bytes[(at * es) as usize..((at + n) * es) as usize], file_off, block: opts.block_size })
        })
        .collect::<Result<Vec<_>>>()?;
    let crcs = write_sources(writer.as_ref(), &sources, opts.threads, opts.cancel.as_deref())?;
    let header = layout.header(&crcs);
    if header.len() as u64 != layout.header_len {
        return Err(Error::invalid(format!("header is {} bytes, {} were laid out", header.len(), layout.header_len)));
    }
    writer.write_at(0, &header)?;
    writer.finish()?;
    Ok(name.to_string())
}

/// After the commit: data files of ranks that wrote nothing this time (an earlier save with
/// more ranks) are garbage. Best effort; the checkpoint is committed either way.
fn remove_stale_files(storage: &dyn Storage, plans: &[crate::plan::save::RankPlan]) {
    let writers: BTreeSet<String> = plans
        .iter()
        .enumerate()
        .filter(|(_, p)| p.tensors.iter().any(|t| t.main))
        .map(|(r, _)| rank_file_name(r))
        .collect();
    let Ok(names) = storage.list() else { return };
    for name in names {
        let is_rank_file = name
            .strip_prefix("rank_")
            .and_then(|s| s.strip_suffix(".safetensors"))
            .is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()));
        if is_rank_file && !writers.contains(&name) {
            let _ = storage.delete(&name);
        }
    }
}

/// Every rank learns whether every rank succeeded: this rank's own error, else the first
/// other rank's as `PeerFailed` (collective).
fn agree<T>(comm: &dyn Communicator, mine: Result<T>) -> Result<T> {
    let msg = match &mine {
        Ok(_) => Vec::new(),
        Err(e) => format!("I{e}").into_bytes(),
    };
    let all = comm.all_gather(&msg)?;
    match mine {
        Err(e) => Err(e),
        Ok(v) => match all.iter().enumerate().find(|(_, m)| !m.is_empty()) {
            Some((r, m)) => Err(decode_peer_error(r, &String::from_utf8_lossy(m))),
            None => Ok(v),
        },
    }
}
