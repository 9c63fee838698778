//! The writers of replicated chunks (fully-parallel save).

use std::sync::Arc;

use super::{RankPlan, ShardMeta};
use crate::model::dims::Dims;
use crate::plan::fasthash::FastMap;

/// Spreads the writing of replicated chunks over the ranks that hold them (fully-parallel
/// save). A chunk is "replicated" when a main shard and replicas holding their bytes announce
/// the same key, box and flattened range. Each such chunk gets exactly one writer: groups are
/// taken largest first and go to the holder with the fewest bytes to write so far (ties to the
/// lowest rank), counting the unreplicated shards every rank writes anyway. Pure and
/// deterministic, so every rank computes the same assignment from the same plans with no extra
/// exchange; the set of chunks written, and so the checkpoint, does not change.
/// Returns the number of chunks whose writer moved off the main replica.
pub fn assign_writers(plans: &mut [RankPlan]) -> usize {
    type Ident<'a> = (&'a str, &'a [u64], &'a [u64], Option<(u64, u64)>);
    let ident = |t: &ShardMeta| -> (Arc<str>, Dims, Dims, Option<(u64, u64)>) {
        (t.key.clone(), t.offset.clone(), t.shape.clone(), t.flat)
    };
    // Holders (rank, shard index) of each replicated chunk; only chunks with a replica that
    // could write are considered, so layouts without replication cost one pass.
    /// Bytes of the chunk, its holders `(rank, shard index)`, how many of them are main.
    #[derive(Default)]
    struct Group {
        bytes: u64,
        holders: Vec<(usize, usize)>,
        mains: usize,
    }
    let mut groups: FastMap<Ident<'_>, Group> = FastMap::default();
    let owned: Vec<_>;
    {
        let mut replicas = Vec::new();
        for (r, p) in plans.iter().enumerate() {
            for (i, t) in p.tensors.iter().enumerate() {
                if !t.main && t.has_data && t.nbytes() > 0 {
                    replicas.push((r, i));
                }
            }
        }
        if replicas.is_empty() {
            return 0;
        }
        owned = replicas.iter().map(|&(r, i)| (r, i, ident(&plans[r].tensors[i]))).collect();
    }
    for (r, i, id) in &owned {
        let t = &plans[*r].tensors[*i];
        let g = groups.entry((&id.0, &id.1, &id.2, id.3)).or_default();
        g.bytes = t.nbytes();
        g.holders.push((*r, *i));
    }
    let mut load = vec![0u64; plans.len()];
    for (r, p) in plans.iter().enumerate() {
        for (i, t) in p.tensors.iter().enumerate() {
            if !t.main {
                continue;
            }
            match groups.get_mut(&(&*t.key, t.offset.as_slice(), t.shape.as_slice(), t.flat)) {
                Some(g) => {
                    g.holders.push((r, i));
                    g.mains += 1;
                }
                None => load[r] += t.nbytes(),
            }
        }
    }
    // Exactly one main replica: anything else is for validation to report, not to rebalance.
    let mut order: Vec<(Ident<'_>, Group)> = groups.into_iter().filter(|(_, g)| g.mains == 1).collect();
    order.sort_unstable_by(|a, b| b.1.bytes.cmp(&a.1.bytes).then_with(|| a.0.cmp(&b.0)));
    let mut flips = Vec::new();
    for (_, Group { bytes, mut holders, .. }) in order {
        holders.sort_unstable();
        let &(wr, wi) = holders.iter().min_by_key(|&&(r, _)| (load[r], r)).expect("a group has holders");
        load[wr] += bytes;
        for &(r, i) in &holders {
            flips.push((r, i, r == wr && i == wi));
        }
    }
    let mut moved = 0;
    for (r, i, writes) in flips {
        let t = &mut plans[r].tensors[i];
        if writes && !t.main {
            moved += 1;
        }
        t.main = writes;
    }
    moved
}
