//! The layout of a rank's native data file.

use super::RankPlan;
use crate::format::data_file::{encode_header, ChunkDesc, ObjectDesc};
use crate::format::SafetensorsEntry;
use crate::model::dtype::DType;

/// Layout of one rank's data file: safetensors entries for its main tensor shards (in plan
/// order), then its main object shards.
#[derive(Debug, Clone)]
pub struct FileLayout {
    /// Entries, tensors first.
    pub entries: Vec<SafetensorsEntry>,
    /// Size of the header; data starts here.
    pub header_len: u64,
    /// Total file size.
    pub size: u64,
    /// `(plan index, entry index)` of each main tensor shard.
    pub tensor_entries: Vec<usize>,
    /// Plan indices of the main object shards.
    pub object_entries: Vec<usize>,
}

/// Lays out a rank's data file. The header's size does not depend on checksum values.
pub fn layout_file(rank: usize, plan: &RankPlan, block_size: u64) -> FileLayout {
    let mut entries = Vec::new();
    let mut start = 0u64;
    let mut tensor_entries = Vec::new();
    let mut object_entries = Vec::new();
    for (i, t) in plan.tensors.iter().enumerate() {
        if !t.main {
            continue;
        }
        let len = t.nbytes();
        let shape = match t.flat {
            Some((s, e)) => vec![e - s],
            None => t.shape.to_vec(),
        };
        entries.push(SafetensorsEntry {
            name: format!("{}:{}", entries.len(), t.key),
            dtype: t.dtype,
            shape,
            start,
            len,
        });
        tensor_entries.push(i);
        start += len;
    }
    for (i, o) in plan.objects.iter().enumerate() {
        if !o.main {
            continue;
        }
        entries.push(SafetensorsEntry {
            name: format!("{}:{}", entries.len(), o.key),
            dtype: DType::U8,
            shape: vec![o.len],
            start,
            len: o.len,
        });
        object_entries.push(i);
        start += o.len;
    }
    let placeholder = placeholder_crcs(plan, &tensor_entries, &object_entries, block_size);
    let layout = FileLayout { entries, header_len: 0, size: 0, tensor_entries, object_entries };
    let header_len = layout.header(rank, plan, block_size, &placeholder).len() as u64;
    FileLayout { header_len, size: header_len + start, ..layout }
}

fn placeholder_crcs(plan: &RankPlan, tensors: &[usize], objects: &[usize], block_size: u64) -> Vec<Vec<u32>> {
    let mut out: Vec<Vec<u32>> =
        tensors.iter().map(|&i| vec![0; plan.tensors[i].nbytes().div_ceil(block_size) as usize]).collect();
    out.extend(objects.iter().map(|_| vec![0u32]));
    out
}

impl FileLayout {
    /// The header of the file of `rank` (whose plan is `plan`), with the checksums of each entry
    /// (tensors, then objects, in layout order): its size does not depend on their values.
    pub fn header(&self, rank: usize, plan: &RankPlan, block_size: u64, crcs: &[Vec<u32>]) -> Vec<u8> {
        let chunks: Vec<ChunkDesc<'_>> = self
            .tensor_entries
            .iter()
            .map(|&i| {
                let t = &plan.tensors[i];
                ChunkDesc {
                    key: &t.key,
                    dtype: t.dtype,
                    global_shape: &t.global_shape,
                    offset: &t.offset,
                    shape: &t.shape,
                    flat: t.flat,
                }
            })
            .collect();
        let objects: Vec<ObjectDesc<'_>> = self
            .object_entries
            .iter()
            .map(|&i| {
                let o = &plan.objects[i];
                ObjectDesc { key: &o.key, global_shape: &o.global_shape, offset: &o.offset }
            })
            .collect();
        encode_header(rank, block_size, &self.entries, &chunks, &objects, crcs)
    }
}
