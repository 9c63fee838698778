//! What a rank reports once its data file is written, and the index assembled from every
//! rank's plan and report.

use std::collections::HashMap;
use std::sync::Mutex;

use super::{KeyNumbers, RankPlan};
use crate::error::{Error, Result};
use crate::format::FORMAT_VERSION;
use crate::format::{CheckpointIndex, Crcs, FileEntry, ObjectEntry, StoredChunk, StoredObject, TensorEntry};
use crate::model::codec::{Decoder, Encoder};
use crate::model::{StatePath, Value};
use crate::plan::ForEach;

/// What a rank reports after writing its data file.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct WrittenFile {
    /// File name (empty: the rank wrote nothing).
    pub name: String,
    /// File size.
    pub size: u64,
    /// Header size.
    pub header_len: u64,
    /// crc32c of the header.
    pub header_crc: u32,
    /// Per main tensor shard (plan order): byte offset in the file and block checksums.
    pub tensors: Vec<(u64, Crcs)>,
    /// Per main object shard (plan order): byte offset, length, checksum.
    pub objects: Vec<(u64, u64, u32)>,
}

impl WrittenFile {
    /// Binary encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.str(&self.name);
        e.var(self.size);
        e.var(self.header_len);
        e.u32_le(self.header_crc);
        e.var(self.tensors.len() as u64);
        for (off, crcs) in &self.tensors {
            e.var(*off);
            e.var(crcs.len() as u64);
            for &c in crcs {
                e.u32_le(c);
            }
        }
        e.var(self.objects.len() as u64);
        for &(off, len, crc) in &self.objects {
            e.var(off);
            e.var(len);
            e.u32_le(crc);
        }
        e.buf
    }

    /// Inverse of [`WrittenFile::encode`].
    pub fn decode(bytes: &[u8]) -> Result<WrittenFile, String> {
        let mut d = Decoder::new(bytes);
        let name = d.str()?;
        let size = d.var()?;
        let header_len = d.var()?;
        let header_crc = d.u32_le()?;
        let n = d.count()?;
        let mut tensors = Vec::with_capacity(n);
        for _ in 0..n {
            let off = d.var()?;
            let k = d.count()?;
            let mut crcs = Crcs::with_capacity(k.min(d.remaining() / 4));
            for _ in 0..k {
                crcs.push(d.u32_le()?);
            }
            tensors.push((off, crcs));
        }
        let n = d.count()?;
        let mut objects = Vec::with_capacity(n);
        for _ in 0..n {
            objects.push((d.var()?, d.var()?, d.u32_le()?));
        }
        Ok(WrittenFile { name, size, header_len, header_crc, tensors, objects })
    }
}

/// Assembles the global index from every rank's plan and written file (rank order); the
/// checksums of the written files move into it. Each tensor's chunks are put in canonical
/// order by a task of `for_each` (side by side when the caller gives it threads).
pub fn build_index(
    plans: &[RankPlan],
    written: Vec<WrittenFile>,
    block_size: u64,
    common: Vec<(StatePath, Value)>,
    content_metadata: Value,
    for_each: ForEach<'_>,
) -> Result<CheckpointIndex> {
    if written.len() != plans.len() {
        return Err(Error::Comm { reason: format!("{} write reports for {} plans", written.len(), plans.len()) });
    }
    // Tensors are numbered in order of first appearance; keys whose every shard is a replica
    // or empty still belong to the checkpoint.
    let keys = KeyNumbers::of(plans)?;
    for (rank, (plan, w)) in plans.iter().zip(&written).enumerate() {
        let main_objects = plan.objects.iter().filter(|o| o.main).count();
        if keys.rank_mains[rank] != w.tensors.len() || main_objects != w.objects.len() {
            return Err(Error::Comm { reason: format!("rank {rank} reported a file that does not match its plan") });
        }
    }
    // Each tensor's list of chunks is allocated once, at its size.
    let mut chunks: Vec<Vec<StoredChunk>> = keys.key_mains.iter().map(|&n| Vec::with_capacity(n)).collect();
    let mut files = Vec::new();
    let mut objects: HashMap<&str, ObjectEntry> = HashMap::new();
    let mut ids = keys.ids.iter();
    for (plan, w) in plans.iter().zip(written) {
        let file = files.len() as u32;
        let WrittenFile { name, size, header_len, header_crc, tensors: written_chunks, objects: written_objects } = w;
        // Counted above: as many written entries as main shards.
        if !written_chunks.is_empty() || !written_objects.is_empty() {
            files.push(FileEntry { name, size, header_len, header_crc });
        }
        let mut written_chunks = written_chunks.into_iter();
        for t in &plan.tensors {
            let id = *ids.next().expect("a number per shard");
            if !t.main {
                continue;
            }
            let (byte_offset, crcs) = written_chunks.next().expect("counted above");
            chunks[id as usize].push(StoredChunk {
                file,
                byte_offset,
                offset: t.offset.clone(),
                shape: t.shape.clone(),
                flat: t.flat,
                crcs,
            });
        }
        for (o, (byte_offset, len, crc)) in plan.objects.iter().filter(|o| o.main).zip(written_objects) {
            let entry = objects.entry(o.key.as_str()).or_insert_with(|| ObjectEntry {
                key: o.key.clone(),
                global_shape: o.global_shape.clone(),
                shards: Vec::new(),
            });
            entry.shards.push(StoredObject { offset: o.offset.clone(), file, byte_offset, len, crc });
        }
    }
    // Canonical order: a sort per tensor, the tensors independent of each other.
    let chunks: Vec<Mutex<Vec<StoredChunk>>> = chunks.into_iter().map(Mutex::new).collect();
    let entries: Vec<Mutex<Option<TensorEntry>>> = chunks.iter().map(|_| Mutex::new(None)).collect();
    for_each(chunks.len(), &|i| {
        let list = std::mem::take(&mut *chunks[i].lock().unwrap_or_else(|e| e.into_inner()));
        let t = keys.firsts[i].1;
        let entry = TensorEntry::new(t.key.to_string(), t.dtype, t.global_shape.to_vec(), list);
        *entries[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(entry);
    });
    let tensors = entries
        .into_iter()
        .map(|e| e.into_inner().unwrap_or_else(|e| e.into_inner()))
        .collect::<Option<Vec<TensorEntry>>>()
        .ok_or_else(|| Error::invalid("a tensor of the index was not assembled (ForEach skipped a task)"))?;
    let mut index = CheckpointIndex {
        backend: crate::format::Backend::Tessera,
        version: FORMAT_VERSION,
        block_size,
        content_metadata,
        common,
        files,
        tensors,
        objects: objects.into_values().collect(),
        omitted_tensors: Vec::new(),
    };
    index.sort_entries();
    Ok(index)
}
