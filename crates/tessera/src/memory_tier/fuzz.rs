//! The fuzz entry point of the memory tier (feature `fuzzing`): a manifest, the one file of
//! the tier a restore parses from a node's memory root, through its decoder and the restore
//! decision.

use std::collections::BTreeMap;

use super::parity_name;
use super::restore::{decide, Report, StepScan};
use crate::format::tier_manifest::{seal, TierManifest};

/// Decodes `bytes` as a manifest (first byte 0: as read from a marker; otherwise the rest is
/// the manifest's body, sealed here with a valid checksum so that mutations reach the checks
/// behind it). A manifest that decodes must encode to one that decodes equal; then, for a job
/// of up to 256 ranks, every rank reports its node's share of the step as the manifest
/// describes it, less the nodes `lost` marks (bit `i % 8` of byte `i / 8`), and the restore
/// decision runs. Returns how many ranks the plan rebuilds (None: no manifest, or no plan).
pub fn manifest_plan(bytes: &[u8], lost: &[u8]) -> Option<usize> {
    let (&mode, rest) = bytes.split_first()?;
    let sealed;
    let bytes = if mode == 0 {
        rest
    } else {
        sealed = seal(std::str::from_utf8(rest).ok()?);
        &sealed
    };
    let m = TierManifest::decode(bytes, "fuzz://commit").ok()?;
    let again = TierManifest::decode(&m.encode(), "fuzz://re-encoded").expect("a decoded manifest re-encodes");
    assert_eq!(again, m, "a decoded manifest re-encodes to itself");
    if m.world() > 256 {
        return None;
    }
    let mut node_ids: BTreeMap<&str, usize> = BTreeMap::new();
    for n in &m.nodes {
        let next = node_ids.len();
        node_ids.entry(n.as_str()).or_insert(next);
    }
    let is_lost = |node: &str| {
        let i = node_ids[node];
        lost.get(i / 8).is_some_and(|b| b >> (i % 8) & 1 == 1)
    };
    let text = String::from_utf8(bytes.to_vec()).ok();
    let reports: Vec<Report> = (0..m.world())
        .map(|r| {
            let node = &m.nodes[r];
            let mut scan = StepScan::default();
            if !is_lost(node) {
                scan.manifest = text.clone();
                for (y, c) in m.ranks.iter().enumerate().filter(|(y, _)| m.nodes[*y] == *node) {
                    scan.copies.insert(y, c.files.clone());
                }
                for (g, gs) in m.groups.iter().enumerate() {
                    for (p, &h) in gs.group.parity.iter().enumerate() {
                        if m.nodes.get(h) == Some(node) {
                            scan.parity.insert(parity_name(g, p), gs.shard_len);
                        }
                    }
                }
            }
            Report { node: node.clone(), layout: m.ranks[r].layout, steps: BTreeMap::from([(m.step, scan)]) }
        })
        .collect();
    decide(&reports, &[]).memory.map(|plan| plan.rebuild.len())
}
