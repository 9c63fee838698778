//! Conversion of any readable checkpoint into a Megatron `torch_dist` checkpoint (a PyTorch DCP
//! directory plus `metadata.json` and `common.pt`, as `save_torch_dist` writes it), so that a
//! checkpoint tessera can read can always go back to Megatron or torch.
//!
//! Each stored chunk of the source becomes one or more DCP chunks: chunks larger than a job's
//! share of the memory budget are cut ([`split_box_lazy`]), and flattened ranges (which DCP
//! cannot describe) are cut into the boxes they cover ([`decompose_flat`]). Chunks are read
//! through the generic loader, several per load call, on a background thread while the previous
//! ones are written (the pipeline of the native convert), each as a `torch.save` archive
//! written around the loaded bytes. Data files `__{n}_0.distcp` are filled to about
//! `max_file_size` each; `.metadata` is written last, the commit.
//!
//! Sharded objects become byte items as the writer makes them ([`object_item`]: their payloads
//! are read whole, before any tensor). The common state, with the content metadata under
//! `content_metadata` as Megatron keeps it, is written twice: as DCP stores a state dict's
//! values (byte items under the keys DCP's flattening gives them, `dcp_values`), which
//! `torch.distributed.checkpoint.load` finds, and as `common.pt`, which Megatron reads.
//! `planner_data` records every key's path, as DCP's own save does. tessera's reader takes the
//! common state from `common.pt` (where it has a key) and not again from the byte items.

use crate::comm::SoloComm;
use crate::error::{Error, Result};
use crate::format::CheckpointIndex;
use crate::formats::dcp::parse_object_fqn;
use crate::formats::dcp_values::{flatten, planner_data};
use crate::formats::torch_dist::{
    common_pt, is_data_file_name, metadata_pickle, metadata_save_id, object_fqn, object_item, ChunkItem, ItemPlace,
    TensorItems,
};
use crate::formats::torch_save::write::{crc32, tensor_archive};
use crate::load::engine::{read_object, LoadOptions};
use crate::load::open::open_checkpoint;
use crate::model::{path_string, PathSeg, Value};
use crate::plan::geometry::{decompose_flat, split_box_lazy, BoxPart};
use crate::save::lease::kept_while;
use crate::save::options::SaveOptions;
use crate::save::plan::new_save_id;
use crate::save::torch_dist::{existing, file_names, serialization_id, with_first_file_number, TorchDistSave};
use crate::save::write::{write_sources, Source};
use crate::storage::{ObjectWriter, Storage};
use crate::tools::convert::{ConvertOptions, ConvertReport};
use crate::tools::pipeline::{batches, check_memory_budget, job_bytes, load_parts, pipeline, TensorPart};

/// Most DCP chunks a conversion makes (each is an entry of `.metadata`, held in memory while it
/// is built): far more than any real checkpoint, few enough that a source claiming absurd
/// shapes is refused before anything is allocated for them.
const MAX_CHUNKS: usize = 1 << 24;

/// Where an item lies: its data file (index) and offset.
#[derive(Clone, Copy)]
struct Place {
    file: usize,
    offset: u64,
    len: u64,
}

/// Copies the checkpoint in `src` (any format [`open`](crate::open) recognises) into
/// `dst` as a Megatron `torch_dist` checkpoint. Refused with [`Error::AlreadyExists`] if `dst`
/// holds a committed checkpoint, unless `opts.overwrite` (which replaces only a DCP or
/// `torch_dist` one, by the commit protocol of a save: it stays whole until the new `.metadata`
/// replaces it, and a conversion that fails leaves it as it was). `opts.block_size`
/// is not used (DCP has no checksums). `progress(bytes_done, bytes_total)` is called as tensor
/// data is written.
///
/// ```
/// use tessera::{open, save, SaveOptions};
/// use tessera::tools::{convert_to_dcp, ConvertOptions};
/// use tessera::{DType, ShardedTensor, StateTree, TensorData};
/// use tessera::comm::SoloComm;
/// use tessera::storage::MemoryStorage;
///
/// let (src, dst) = (MemoryStorage::new(), MemoryStorage::new());
/// let w = ShardedTensor::full("w", DType::U8, &[2, 3], TensorData::Owned(vec![1, 2, 3, 4, 5, 6]));
/// save(StateTree::map().with("w", StateTree::Tensor(w)), &src, &SoloComm, &SaveOptions::default())?;
///
/// convert_to_dcp(&src, &dst, &ConvertOptions::default(), &mut |_done, _total| {})?;
/// let ckpt = open(&dst)?;
/// assert_eq!(ckpt.format().backend, tessera::index::Backend::TorchDist);
/// assert_eq!(ckpt.read_tensors(None)?, open(&src)?.read_tensors(None)?);
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn convert_to_dcp(
    src: &dyn Storage,
    dst: &dyn Storage,
    opts: &ConvertOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ConvertReport> {
    if existing(dst, opts.overwrite)? {
        return Err(Error::AlreadyExists { path: dst.location().into() });
    }
    let ckpt = open_checkpoint(src)?;
    check_memory_budget(opts.memory_budget, &ckpt.index, &src.location())?;
    let src = ckpt.storage();
    let index = &ckpt.index;
    // File numbers from 0 in a directory without data files, else this save's own (the source
    // itself, or a checkpoint being replaced, stays whole until the new `.metadata` lands).
    let fresh = !dst.list()?.iter().any(|n| is_data_file_name(n));
    let save_id = with_first_file_number(new_save_id(), fresh);

    // The common state first: a value that cannot be written fails before any write.
    let mut common = index.common.clone();
    if index.content_metadata != Value::Null {
        if let Some((path, _)) = common.iter().find(|(p, _)| p.first() == Some(&PathSeg::Key(CONTENT_METADATA.into())))
        {
            return Err(Error::invalid(format!(
                "{}: common value {:?} and the content metadata would both be {CONTENT_METADATA:?} in the copy \
                 (Megatron keeps the content metadata in the common state under that key)",
                src.location(),
                path_string(path)
            )));
        }
        common.push((vec![PathSeg::Key(CONTENT_METADATA.into())], index.content_metadata.clone()));
    }
    let common_bytes = common_pt(&common, &serialization_id(save_id, u64::MAX))?;
    // And as DCP itself stores values: byte items under their flattened keys, which a DCP load
    // of the state dict looks for (common.pt is Megatron's alone).
    let values = flatten(&common, &|n| serialization_id(save_id, u64::MAX - 1 - n as u64))?;

    // Objects, read whole (they are small: RNG states, optimizer hyperparameters).
    let mut objects = Vec::new();
    for o in &index.objects {
        for s in &o.shards {
            let payload = read_object(index, src, &o.key, &s.offset, true)?;
            let item = object_item(&o.key, &payload, &serialization_id(save_id, objects.len() as u64))?;
            objects.push((object_fqn(&o.key, &s.offset, &o.global_shape), item));
        }
    }
    let planner = planner_data(
        index.tensors.iter().map(|t| t.key.as_str()),
        objects.iter().map(|(fqn, _)| fqn.as_str()),
        &values,
        |fqn| parse_object_fqn(fqn).is_some(),
        &src.location(),
    )?;
    // The values' items are written as the objects' are.
    let object_shards = objects.len();
    objects.extend(values.values.into_iter().map(|v| (v.fqn, v.item)));

    // Tensor parts: boxes only, each at most a job's share of the budget.
    let per_job = job_bytes(opts.memory_budget);
    let mut parts: Vec<(u32, u64, TensorPart<'_>)> = Vec::new();
    for t in &index.tensors {
        let max_numel = (per_job / t.dtype.size() as u64).max(1);
        if t.chunks().is_empty() {
            // A tensor without elements has no stored chunk; DCP records one, of no bytes.
            let part = BoxPart { off: vec![0; t.global_shape.len()], shape: t.global_shape.clone(), flat: None };
            parts.push((0, 0, TensorPart { tensor: t, part }));
        }
        for c in t.chunks() {
            for part in split_box_lazy(&c.offset, &c.shape, c.flat, max_numel) {
                let boxes = match part.flat {
                    None => vec![part],
                    Some((s, e)) => decompose_flat(&part.off, &part.shape, s, e)
                        .into_iter()
                        .map(|p| BoxPart { off: p.off.to_vec(), shape: p.shape.to_vec(), flat: None })
                        .collect(),
                };
                for part in boxes {
                    if parts.len() >= MAX_CHUNKS {
                        return Err(Error::invalid(format!(
                            "{}: more than {MAX_CHUNKS} DCP chunks (tensor {:?}); raise the memory budget",
                            src.location(),
                            t.key
                        )));
                    }
                    parts.push((c.file, c.byte_offset, TensorPart { tensor: t, part }));
                }
            }
        }
    }
    parts.sort_by_key(|(file, off, _)| (*file, *off));
    let parts: Vec<TensorPart<'_>> = parts.into_iter().map(|(_, _, p)| p).collect();

    // Layout: objects, then tensor parts, packed into files of about max_file_size.
    let id = serialization_id(save_id, 0);
    let archive_len = |p: &TensorPart<'_>| tensor_archive(p.tensor.dtype, &p.part.shape, 0, &id).len();
    let mut sizes: Vec<u64> = vec![0];
    let mut place = |len: u64| {
        let last = sizes.len() - 1;
        let file = if sizes[last] > 0 && sizes[last] + len > opts.max_file_size { last + 1 } else { last };
        if file == sizes.len() {
            sizes.push(0);
        }
        let p = Place { file, offset: sizes[file], len };
        sizes[file] += len;
        p
    };
    let object_places: Vec<Place> = objects.iter().map(|(_, item)| place(item.len() as u64)).collect();
    let part_places: Vec<Place> = parts.iter().map(|p| place(archive_len(p))).collect();
    // Names of this save's own: a checkpoint being replaced (even the source itself) stays
    // whole until the new `.metadata` commits.
    let names: Vec<String> = (0..sizes.len()).flat_map(|f| file_names(f, save_id, 1)).collect();

    // What the commit puts: `.metadata` names every item where it is laid out.
    let mut tensors: Vec<TensorItems> = Vec::new();
    for (p, at) in parts.iter().zip(&part_places) {
        let t = p.tensor;
        if tensors.last().is_none_or(|x| x.fqn != t.key) {
            if let Some(k) = tensors.iter().position(|x| x.fqn == t.key) {
                // Parts were sorted by source file: a tensor's chunks may come in several runs.
                let moved = tensors.remove(k);
                tensors.push(moved);
            } else {
                tensors.push(TensorItems {
                    fqn: t.key.clone(),
                    dtype: t.dtype,
                    size: t.global_shape.clone(),
                    chunks: vec![],
                });
            }
        }
        let place = ItemPlace { file: names[at.file].clone(), offset: at.offset, length: at.len };
        let chunk = ChunkItem { offsets: p.part.off.clone(), sizes: p.part.shape.clone(), place };
        tensors.last_mut().expect("pushed above").chunks.push(chunk);
    }
    let byte_items: Vec<(String, ItemPlace)> = objects
        .iter()
        .zip(&object_places)
        .map(|((fqn, _), at)| {
            (fqn.clone(), ItemPlace { file: names[at.file].clone(), offset: at.offset, length: at.len })
        })
        .collect();
    let metadata = metadata_pickle(&tensors, &byte_items, Some(&planner), &metadata_save_id(save_id, &common_bytes));
    let index_bytes = metadata.len() as u64;

    // The write session: this process writes every file, then commits as a save does.
    let files = names.iter().cloned().zip(sizes.iter().copied()).collect();
    let session = TorchDistSave::of_files(files, save_id, common_bytes, metadata, dst)?;
    let lease = session.lease();
    let save_opts = SaveOptions { overwrite: opts.overwrite, ..SaveOptions::default() };
    let report = kept_while(lease.as_deref().map(|l| (l, dst)), || {
        let written = write_files(
            src,
            dst,
            index,
            &parts,
            &part_places,
            &objects,
            &object_places,
            &session,
            &sizes,
            save_id,
            opts,
            progress,
        );
        session.commit(written, dst, &SoloComm, &save_opts)
    })?;
    Ok(ConvertReport {
        tensors: tensors.len(),
        chunks: parts.len(),
        object_shards,
        files: names.len(),
        bytes: report.bytes_written,
        index_bytes,
        leftovers: report.leftovers,
    })
}

/// The key Megatron keeps the content metadata under in the common state.
const CONTENT_METADATA: &str = "content_metadata";

/// Writes every data file: the objects at once, the tensor parts streamed through the load
/// pipeline. Returns the bytes written.
#[allow(clippy::too_many_arguments)]
fn write_files(
    src: &dyn Storage,
    dst: &dyn Storage,
    index: &CheckpointIndex,
    parts: &[TensorPart<'_>],
    part_places: &[Place],
    objects: &[(String, Vec<u8>)],
    object_places: &[Place],
    session: &TorchDistSave<'_>,
    sizes: &[u64],
    save_id: u64,
    opts: &ConvertOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<u64> {
    let mut writers: Vec<Option<Box<dyn ObjectWriter>>> = Vec::with_capacity(sizes.len());
    for (k, &size) in sizes.iter().enumerate() {
        writers.push(Some(session.create_file(k, size, dst)?));
    }
    for ((_, item), at) in objects.iter().zip(object_places) {
        writers[at.file].as_ref().expect("open until finished").write_at(at.offset, item)?;
    }

    let costs: Vec<u64> = parts.iter().map(TensorPart::nbytes).collect();
    let total: u64 = costs.iter().sum();
    let jobs = batches(&costs, job_bytes(opts.memory_budget), |i| part_places[i].file != part_places[i - 1].file);
    let load_opts = LoadOptions { threads: opts.threads, ..Default::default() };
    let read = |job: &std::ops::Range<usize>| -> Result<Vec<u8>> {
        let mut buf = vec![0u8; costs[job.clone()].iter().sum::<u64>() as usize];
        let batch: Vec<&TensorPart<'_>> = parts[job.clone()].iter().collect();
        load_parts(index, src, &batch, &mut buf, &load_opts)?;
        Ok(buf)
    };
    let mut done = 0u64;
    progress(0, total);
    let mut write = |job: &std::ops::Range<usize>, data: Vec<u8>| -> Result<()> {
        let mut archives = Vec::with_capacity(job.len());
        let mut at = 0usize;
        for i in job.clone() {
            let bytes = &data[at..at + costs[i] as usize];
            let p = &parts[i];
            archives.push(tensor_archive(
                p.tensor.dtype,
                &p.part.shape,
                crc32(bytes),
                &serialization_id(save_id, i as u64),
            ));
            at += bytes.len();
        }
        let mut sources = Vec::with_capacity(3 * job.len());
        let mut at = 0usize;
        for (i, a) in job.clone().zip(&archives) {
            let bytes = &data[at..at + costs[i] as usize];
            at += bytes.len();
            let mut off = part_places[i].offset;
            for piece in [a.prefix.as_slice(), bytes, a.suffix.as_slice()] {
                sources.push(Source { data: piece, file_off: off, block: opts.block_size.max(1) });
                off += piece.len() as u64;
            }
        }
        let file = part_places[job.start].file;
        let writer = writers[file].as_ref().expect("open until finished");
        write_sources(writer.as_ref(), &sources, opts.threads, dst.is_local(), None)?;
        done += at as u64;
        progress(done, total);
        Ok(())
    };
    pipeline(jobs.iter().cloned(), opts.memory_budget, |j| costs[j.clone()].iter().sum(), read, &mut write)?;
    for w in writers.iter_mut() {
        w.take().expect("finished once").finish()?;
    }
    Ok(sizes.iter().sum())
}
