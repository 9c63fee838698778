//! Where the memory tier puts its redundancy: ranks grouped for Reed–Solomon coding, each group's
//! data shards on distinct nodes and its parity shards on further nodes (ARCHITECTURE.md, "The
//! memory tier"). Pure: the same node names give the same groups on every rank.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
pub use crate::format::tier_manifest::Group;

/// The groups of a job whose rank `r` runs on node `nodes[r]`, for RS(`k`, `m`): up to `k` data
/// shards per group (fewer where there are fewer than `k + m` nodes, or nodes left over), `m`
/// parity shards. Any `m` nodes lost lose at most `m` shards of each group, which survives.
///
/// Ranks are grouped by their slot on their node (the `j`-th rank of every node together), so
/// the ranks of one node are in different groups; each slot's groups start one group further
/// along the node ring, which spreads the parity over the nodes.
pub fn place(nodes: &[String], k: usize, m: usize) -> Result<Vec<Group>> {
    if k == 0 || m == 0 {
        return Err(Error::invalid(format!("memory tier: RS({k}, {m}) needs k ≥ 1 data and m ≥ 1 parity shards")));
    }
    // Nodes in order of first appearance, and each node's ranks in rank order.
    let mut order: Vec<&str> = Vec::new();
    let mut ranks_of: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (r, n) in nodes.iter().enumerate() {
        if !ranks_of.contains_key(n.as_str()) {
            order.push(n);
        }
        ranks_of.entry(n).or_default().push(r);
    }
    let n_nodes = order.len();
    if n_nodes < m + 1 {
        return Err(Error::invalid(format!(
            "memory tier: {m} parity shard(s) need at least {} nodes, the job runs on {n_nodes} ({})",
            m + 1,
            order.join(", ")
        )));
    }
    let width = k.min(n_nodes - m);
    let slots = ranks_of.values().map(Vec::len).max().unwrap_or(0);
    let mut groups = Vec::new();
    for slot in 0..slots {
        // The node positions (in `order`) having a rank at this slot, rotated per slot.
        let have: Vec<usize> = (0..n_nodes).filter(|&i| ranks_of[order[i]].len() > slot).collect();
        let shift = (slot * width) % have.len();
        let ring: Vec<usize> = have[shift..].iter().chain(&have[..shift]).copied().collect();
        for chunk in ring.chunks(width) {
            let members: Vec<usize> = chunk.iter().map(|&i| ranks_of[order[i]][slot]).collect();
            // Parity on the next m nodes of the full ring after the chunk's last node that hold
            // no member: width ≤ n_nodes − m guarantees there are m of them.
            let last = *chunk.last().expect("chunks are not empty");
            let parity: Vec<usize> = (1..n_nodes)
                .map(|d| (last + d) % n_nodes)
                .filter(|i| !chunk.contains(i))
                .take(m)
                .map(|i| {
                    let on = &ranks_of[order[i]];
                    on[slot % on.len()]
                })
                .collect();
            groups.push(Group { members, parity });
        }
    }
    Ok(groups)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn nodes(per_node: &[usize]) -> Vec<String> {
        per_node.iter().enumerate().flat_map(|(n, &c)| std::iter::repeat_n(format!("n{n}"), c)).collect()
    }

    /// Every rank is a member of exactly one group; a group's members and parity holders are
    /// on pairwise distinct nodes; losing any m nodes leaves every group ≥ |members| shards.
    #[test]
    fn every_group_survives_any_m_lost_nodes() {
        for per_node in [vec![2, 2, 2, 2], vec![1, 1, 1], vec![3, 1, 2, 2, 1], vec![4; 6], vec![1; 11]] {
            let names = nodes(&per_node);
            let n_nodes = per_node.len();
            for k in 1..=6 {
                for m in 1..=3 {
                    let Ok(groups) = place(&names, k, m) else {
                        assert!(n_nodes < m + 1, "{per_node:?} RS({k},{m}) refused");
                        continue;
                    };
                    let mut seen = BTreeSet::new();
                    for g in &groups {
                        assert!(g.members.len() <= k && !g.members.is_empty());
                        assert_eq!(g.parity.len(), m);
                        let on: Vec<&String> = g.members.iter().chain(&g.parity).map(|&r| &names[r]).collect();
                        let distinct: BTreeSet<_> = on.iter().collect();
                        assert_eq!(distinct.len(), on.len(), "{per_node:?} RS({k},{m}) {g:?}");
                        for &r in &g.members {
                            assert!(seen.insert(r), "rank {r} in two groups");
                        }
                    }
                    assert_eq!(seen.len(), names.len());
                    // Any m nodes lost: count each group's lost shards.
                    for lost_mask in 0u32..(1 << n_nodes.min(11)) {
                        if lost_mask.count_ones() as usize != m {
                            continue;
                        }
                        let lost = |r: usize| lost_mask >> names[r][1..].parse::<u32>().unwrap() & 1 == 1;
                        for g in &groups {
                            let gone = g.members.iter().chain(&g.parity).filter(|&&r| lost(r)).count();
                            assert!(gone <= m);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn parity_spreads_over_the_nodes() {
        // 8 ranks on 4 nodes, RS(2, 2): four groups; parity held on every node.
        let names = nodes(&[2, 2, 2, 2]);
        let groups = place(&names, 2, 2).unwrap();
        assert_eq!(groups.len(), 4);
        let holders: BTreeSet<&String> = groups.iter().flat_map(|g| g.parity.iter().map(|&r| &names[r])).collect();
        assert_eq!(holders.len(), 4);
    }

    #[test]
    fn too_few_nodes_is_refused_naming_them() {
        let e = place(&nodes(&[4]), 2, 1).unwrap_err().to_string();
        assert!(e.contains("at least 2 nodes") && e.contains("n0"), "{e}");
        assert!(place(&nodes(&[1, 1]), 0, 1).is_err());
    }
}
