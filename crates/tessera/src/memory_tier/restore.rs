//! Restore: every rank says what its node's memory root holds, every rank decides the same
//! thing from what all said (the newest step complete in some tier and how to rebuild what lost
//! nodes held), the ranks stream survivors' shards to the ranks that lost theirs, and each rank
//! loads its copy in place; or the whole job loads the persistent tier's newest step, resharded.
//! A step of the memory tier is a candidate only if its manifest (the commit marker) is found
//! on some node; a persistent step only if committed.

use std::collections::BTreeMap;

use reed_solomon_simd::ReedSolomonDecoder;
use serde_json::{json, Value as J};

use super::commit::{agree, round_len};
use super::layout::{layout_crc, object_key, tensor_key, Parts, LAYOUT_KEY};
use super::shard::{files_from_json, files_to_json, is_copy_file, ShardReader, ShardWriter};
use super::{parity_name, parse_step_name, rank_dir_name, step_name, MemoryTier};
use crate::comm::wire::{outcome, outcomes};
use crate::comm::{Communicator, SoloComm};
use crate::error::{Error, Result};
use crate::format::tier_manifest::TierManifest;
use crate::format::INDEX_FILE;
use crate::load::engine::{load, LoadOptions};
use crate::load::open::open;
use crate::model::crc::crc32c_append;
use crate::model::{ShardedTensor, StateTree, TensorData, Value};
use crate::storage::Location;

/// What one node's memory root holds for one step: the manifest text (from any marker that
/// reads), each rank copy's files with their sizes, each parity file's size.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct StepScan {
    pub manifest: Option<String>,
    pub copies: BTreeMap<usize, Vec<(String, u64)>>,
    pub parity: BTreeMap<String, u64>,
}

/// What a rank reports before a restore.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Report {
    pub node: String,
    pub layout: u32,
    pub steps: BTreeMap<u64, StepScan>,
}

/// Lists a node's memory root. What cannot be read is left out (it cannot serve a restore).
pub(crate) fn scan(tier: &MemoryTier) -> BTreeMap<u64, StepScan> {
    let fs = &tier.fs;
    let mut steps = BTreeMap::new();
    let Ok(dir) = fs.read_dir(tier.root()) else { return steps };
    for e in dir {
        let Some(step) = parse_step_name(&e.name) else { continue };
        let mut s = StepScan::default();
        let Ok(inner) = fs.read_dir(&e.path) else { continue };
        for f in inner {
            if let Some(r) = f.name.strip_prefix("rank-").and_then(|r| r.parse::<usize>().ok()) {
                if f.is_dir {
                    let files = fs
                        .read_dir(&f.path)
                        .map(|d| d.into_iter().filter(|x| is_copy_file(&x.name)).map(|x| (x.name, x.len)).collect())
                        .unwrap_or_default();
                    s.copies.insert(r, files);
                }
            } else if f.name.starts_with("parity-") && !f.is_dir {
                s.parity.insert(f.name, f.len);
            } else if f.name.starts_with("commit-") && s.manifest.is_none() {
                if let Ok(bytes) = fs.read(&f.path) {
                    if TierManifest::decode(&bytes, &f.path.display().to_string()).is_ok() {
                        s.manifest = String::from_utf8(bytes).ok();
                    }
                }
            }
        }
        steps.insert(step, s);
    }
    steps
}

fn encode_report(r: &Report) -> Vec<u8> {
    let steps: Vec<J> = r
        .steps
        .iter()
        .map(|(step, s)| {
            json!({
                "step": step,
                "manifest": s.manifest,
                "copies": s.copies.iter().map(|(r, f)| json!([r, files_to_json(f)])).collect::<Vec<_>>(),
                "parity": s.parity,
            })
        })
        .collect();
    json!({ "node": r.node, "layout": r.layout, "steps": steps }).to_string().into_bytes()
}

fn decode_report(bytes: &[u8], from: usize) -> Result<Report> {
    let bad = || Error::Comm { reason: format!("memory tier: rank {from} sent a malformed report") };
    let j: J = serde_json::from_slice(bytes).map_err(|_| bad())?;
    let mut out = Report {
        node: j["node"].as_str().ok_or_else(bad)?.to_owned(),
        layout: j["layout"].as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(bad)?,
        steps: BTreeMap::new(),
    };
    for s in j["steps"].as_array().ok_or_else(bad)? {
        let mut scan = StepScan { manifest: s["manifest"].as_str().map(str::to_owned), ..Default::default() };
        for c in s["copies"].as_array().ok_or_else(bad)? {
            let r = c[0].as_u64().ok_or_else(bad)? as usize;
            let files = files_from_json(&c[1]).ok_or_else(bad)?;
            scan.copies.insert(r, files);
        }
        for (n, l) in s["parity"].as_object().ok_or_else(bad)? {
            scan.parity.insert(n.clone(), l.as_u64().ok_or_else(bad)?);
        }
        out.steps.insert(s["step"].as_u64().ok_or_else(bad)?, scan);
    }
    Ok(out)
}

/// Which shard a transfer streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Shard {
    /// Rank `y`'s copy.
    Copy(usize),
    /// Parity shard `p` of group `g`.
    Parity(usize, usize),
}

/// How a rank without its copy gets it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Rebuild {
    /// Rank `from`'s node holds the copy whole: it streams it.
    Copy { from: usize },
    /// Decoded from `sources` (shard, sending rank), as many as the group has data shards.
    Decode { group: usize, sources: Vec<(Shard, usize)> },
}

/// A step the memory tier can restore, and what to rebuild first.
#[derive(Debug, Clone)]
pub(crate) struct MemoryPlan {
    pub manifest: TierManifest,
    /// (rank, how), for every rank whose node lacks its copy.
    pub rebuild: Vec<(usize, Rebuild)>,
}

/// The decision every rank reaches from the same reports.
#[derive(Debug)]
pub(crate) struct Decision {
    pub memory: Option<MemoryPlan>,
    pub persistent: Option<u64>,
    /// Why newer steps were passed over, for the caller.
    pub notes: Vec<String>,
}

impl MemoryPlan {
    /// Every transfer of the rebuild (from, to, shard, bytes), in one order all ranks share.
    fn transfers(&self) -> Vec<(usize, usize, Shard, u64)> {
        let m = &self.manifest;
        let mut xfers = Vec::new();
        for (x, how) in &self.rebuild {
            match how {
                Rebuild::Copy { from } => xfers.push((*from, *x, Shard::Copy(*x), m.ranks[*x].len())),
                Rebuild::Decode { group, sources } => {
                    for (s, from) in sources {
                        xfers.push((*from, *x, *s, m.groups[*group].shard_len));
                    }
                }
            }
        }
        xfers
    }
}

/// Decides from every rank's report and the persistent tier's committed steps (pure).
pub(crate) fn decide(reports: &[Report], persistent: &[u64]) -> Decision {
    let world = reports.len();
    let mut notes = Vec::new();
    // Each node's view, from the first rank on it.
    let mut node_rank: BTreeMap<&str, usize> = BTreeMap::new();
    for (r, rep) in reports.iter().enumerate() {
        node_rank.entry(rep.node.as_str()).or_insert(r);
    }
    let mut manifests: BTreeMap<u64, TierManifest> = BTreeMap::new();
    for &r in node_rank.values() {
        for (step, s) in &reports[r].steps {
            if let Some(text) = &s.manifest {
                if let Ok(m) =
                    TierManifest::decode(text.as_bytes(), &format!("{} (node {})", step_name(*step), reports[r].node))
                {
                    manifests.entry(*step).or_insert(m);
                }
            }
        }
    }
    let newest_persistent = persistent.iter().copied().max();
    let mut memory = None;
    for (step, m) in manifests.iter().rev() {
        if newest_persistent.is_some_and(|p| p > *step) {
            break;
        }
        match plan_step(reports, &node_rank, m) {
            Ok(plan) => {
                memory = Some(plan);
                break;
            }
            Err(why) => notes.push(format!("memory tier: step {step} cannot be restored: {why}")),
        }
    }
    let chosen_memory = memory.as_ref().map(|p| p.manifest.step);
    let persistent = match (chosen_memory, newest_persistent) {
        (Some(s), Some(p)) if p > s => Some(p),
        (None, p) => p,
        _ => None,
    };
    if let Some(p) = persistent {
        if !notes.is_empty() || world == 0 {
            notes.push(format!("restoring step {p} from the persistent tier"));
        }
        memory = None;
    }
    Decision { memory, persistent, notes }
}

fn plan_step(
    reports: &[Report],
    node_rank: &BTreeMap<&str, usize>,
    m: &TierManifest,
) -> std::result::Result<MemoryPlan, String> {
    let world = reports.len();
    if m.world() != world {
        return Err(format!(
            "it was saved by {} ranks, the job has {world} (a new world size loads from the persistent tier)",
            m.world()
        ));
    }
    if let Some(r) = (0..world).find(|&r| reports[r].layout != m.ranks[r].layout) {
        return Err(format!("rank {r}'s state is laid out otherwise than when it was saved"));
    }
    let scan_of = |node: &str| node_rank.get(node).and_then(|&r| reports[r].steps.get(&m.step));
    // Where each copy and each parity shard survives: the ranks whose node holds it whole.
    let intact = |y: usize, files: &[(String, u64)]| {
        let mut want = m.ranks[y].files.clone();
        let mut got = files.to_vec();
        want.sort();
        got.sort();
        want == got
    };
    let copy_at = |y: usize| -> Option<usize> {
        node_rank
            .iter()
            .filter_map(|(node, &r)| scan_of(node)?.copies.get(&y).filter(|f| intact(y, f)).map(|_| r))
            .min()
    };
    let parity_at = |g: usize, p: usize| -> Option<usize> {
        let want = m.groups[g].shard_len;
        node_rank
            .iter()
            .filter_map(|(node, &r)| (scan_of(node)?.parity.get(&parity_name(g, p)) == Some(&want)).then_some(r))
            .min()
    };
    let mut rebuild = Vec::new();
    for (x, rep) in reports.iter().enumerate() {
        let mine = scan_of(&rep.node).and_then(|s| s.copies.get(&x)).is_some_and(|f| intact(x, f));
        if mine {
            continue;
        }
        if let Some(from) = copy_at(x) {
            rebuild.push((x, Rebuild::Copy { from }));
            continue;
        }
        let (g, _) = m.group_of(x).ok_or_else(|| format!("rank {x} is in no group"))?;
        let gs = &m.groups[g];
        let k = gs.group.members.len();
        let mut sources: Vec<(Shard, usize)> =
            gs.group.members.iter().filter_map(|&y| copy_at(y).map(|r| (Shard::Copy(y), r))).collect();
        sources.extend((0..gs.group.parity.len()).filter_map(|p| parity_at(g, p).map(|r| (Shard::Parity(g, p), r))));
        if sources.len() < k {
            let lost: Vec<&str> = gs
                .group
                .members
                .iter()
                .filter(|&&y| copy_at(y).is_none())
                .chain(gs.group.parity.iter().enumerate().filter(|(p, _)| parity_at(g, *p).is_none()).map(|(_, h)| h))
                .map(|&r| m.nodes[r].as_str())
                .collect();
            return Err(format!(
                "group {g} (ranks {:?}) has {} of the {k} shards it needs: the shards on node(s) {} are gone, more than its {} parity shard(s) cover",
                gs.group.members,
                sources.len(),
                lost.join(", "),
                gs.group.parity.len()
            ));
        }
        sources.truncate(k);
        rebuild.push((x, Rebuild::Decode { group: g, sources }));
    }
    Ok(MemoryPlan { manifest: m.clone(), rebuild })
}

/// The committed steps of the persistent tier at `loc`.
pub(crate) fn persistent_steps(loc: &Location) -> Result<Vec<u64>> {
    let storage = loc.open()?;
    let mut steps: Vec<u64> = storage
        .list_recursive()?
        .iter()
        .filter_map(|n| n.strip_suffix(&format!("/{INDEX_FILE}")).and_then(parse_step_name))
        .collect();
    steps.sort_unstable();
    Ok(steps)
}

/// The committed steps of the persistent tier, listed by rank 0 and broadcast (collective):
/// every rank gets the same list, or rank 0's error. None: no persistent tier, no steps.
pub(crate) fn listed_persistent_steps(persistent: Option<&Location>, comm: &dyn Communicator) -> Result<Vec<u64>> {
    let listed = match (comm.rank(), persistent) {
        (0, Some(loc)) => persistent_steps(loc),
        _ => Ok(Vec::new()),
    };
    let got = comm.broadcast(&outcome(&listed, |s| json!(s).to_string().into_bytes()), 0)?;
    let mut local = listed.err();
    let payload = outcomes(std::slice::from_ref(&got), 0, &mut local)?[0];
    serde_json::from_slice(payload).map_err(|e| Error::Comm { reason: format!("memory tier: rank 0's listing: {e}") })
}

/// Streams the shards of `plan` to the ranks rebuilding their copies, in rounds of one chunk;
/// each rebuilt copy appears only once its checksum matches. Collective; every rank returns the
/// same verdict.
pub(crate) fn rebuild(tier: &MemoryTier, plan: &MemoryPlan, comm: &dyn Communicator) -> Result<()> {
    let me = comm.rank();
    let m = &plan.manifest;
    let step_dir = tier.step_dir(m.step);
    let xfers = plan.transfers();
    let mut error: Option<Error> = None;
    let mut readers: BTreeMap<(usize, usize), ShardReader> = BTreeMap::new();
    for (i, (from, _, shard, _)) in xfers.iter().enumerate() {
        if *from != me {
            continue;
        }
        let r = match shard {
            Shard::Copy(y) => ShardReader::open(&tier.fs, &step_dir.join(rank_dir_name(*y)), &m.ranks[*y].files),
            Shard::Parity(g, p) => {
                ShardReader::single(&tier.fs, &step_dir.join(parity_name(*g, *p)), m.groups[*g].shard_len)
            }
        };
        match r {
            Ok(r) => {
                readers.insert((i, 0), r);
            }
            Err(e) => {
                error.get_or_insert(e);
            }
        }
    }
    let mine = plan.rebuild.iter().find(|(x, _)| *x == me).map(|(_, how)| how.clone());
    let mut writer = match &mine {
        Some(_) => match ShardWriter::create(&tier.fs, &step_dir.join(rank_dir_name(me)), &m.ranks[me].files) {
            Ok(w) => Some(w),
            Err(e) => {
                error.get_or_insert(e);
                None
            }
        },
        None => None,
    };
    let mut decoder: Option<ReedSolomonDecoder> = None;
    let rounds = xfers.iter().map(|x| x.3.div_ceil(m.chunk)).max().unwrap_or(0);
    for t in 0..rounds {
        let mut send = vec![Vec::new(); comm.world_size()];
        for (i, (from, to, _, len)) in xfers.iter().enumerate() {
            if *from != me {
                continue;
            }
            let Some(n) = round_len(*len, m.chunk, t) else { continue };
            let start = send[*to].len();
            send[*to].resize(start + n, 0);
            if let Some(r) = readers.get(&(i, 0)) {
                if let Err(e) = r.read(t * m.chunk, &mut send[*to][start..]) {
                    error.get_or_insert(e);
                }
            }
        }
        let recv = comm.all_to_all(send)?;
        let mut at = vec![0usize; recv.len()];
        let mut parts: Vec<(Shard, &[u8])> = Vec::new();
        for (from, to, shard, len) in &xfers {
            if *to != me {
                continue;
            }
            let Some(n) = round_len(*len, m.chunk, t) else { continue };
            let Some(bytes) = recv[*from].get(at[*from]..at[*from] + n) else {
                error.get_or_insert(Error::Comm {
                    reason: format!("memory tier: rank {from} sent a short rebuild round"),
                });
                continue;
            };
            at[*from] += n;
            parts.push((*shard, bytes));
        }
        if parts.is_empty() || error.is_some() {
            continue;
        }
        // Received or decoded bytes go straight to the rebuilt copy, with no copy of their own.
        let mut append = |c: &[u8]| writer.as_mut().map_or(Ok(()), |w| w.append(c));
        let appended = match &mine {
            Some(Rebuild::Copy { .. }) => append(parts[0].1),
            Some(Rebuild::Decode { group, .. }) => decode_round(m, *group, me, &parts, &mut decoder, append),
            None => Ok(()),
        };
        if let Err(e) = appended {
            error.get_or_insert(e);
        }
    }
    let done = match (error, writer) {
        (Some(e), _) => Err(e),
        (None, Some(w)) => w.finish(m.ranks[me].crc),
        (None, None) => Ok(()),
    };
    super::commit::agree(done, comm)
}

fn decode_round(
    m: &TierManifest,
    g: usize,
    me: usize,
    parts: &[(Shard, &[u8])],
    decoder: &mut Option<ReedSolomonDecoder>,
    append: impl FnOnce(&[u8]) -> Result<()>,
) -> Result<()> {
    let gs = &m.groups[g];
    let k = gs.group.members.len();
    let len = parts[0].1.len();
    let codec = |e: reed_solomon_simd::Error| Error::invalid(format!("memory tier: Reed–Solomon: {e}"));
    let dec = match decoder {
        Some(d) => {
            d.reset(k, m.m, len).map_err(codec)?;
            d
        }
        None => decoder.insert(ReedSolomonDecoder::new(k, m.m, len).map_err(codec)?),
    };
    for (s, bytes) in parts {
        match s {
            Shard::Copy(y) => {
                let i = gs.group.members.iter().position(|r| r == y).expect("a member's copy");
                dec.add_original_shard(i, bytes).map_err(codec)?;
            }
            Shard::Parity(_, p) => dec.add_recovery_shard(*p, bytes).map_err(codec)?,
        }
    }
    let mine = gs.group.members.iter().position(|&r| r == me).expect("the rank decodes its own group");
    let out = dec.decode().map_err(codec)?;
    let restored = out
        .restored_original(mine)
        .ok_or_else(|| Error::invalid(format!("memory tier: group {g}: the decoder restored no shard {mine}")))?;
    append(restored)
}

/// Loads this rank's copy of `step` into the buffers of `parts` in place (local, no
/// collective); returns the layout it was saved with (its common values) and its object
/// shards' bytes. On failure `parts` is whole (its buffers hold unspecified bytes), ready for
/// the persistent tier's load.
pub(crate) fn load_copy(
    tier: &MemoryTier,
    step: u64,
    me: usize,
    parts: &mut Parts<'_>,
) -> Result<(Value, Vec<Vec<u8>>)> {
    let dir = tier.step_dir(step).join(rank_dir_name(me));
    let storage = tier.fs.storage(&dir);
    let ckpt = open(storage.as_ref())?;
    let stored = match ckpt.common_state() {
        StateTree::Map(mut m) => match m.remove(LAYOUT_KEY) {
            Some(StateTree::Value(v)) => v,
            _ => return Err(Error::corrupt(&dir, "memory-tier copy without its layout")),
        },
        _ => return Err(Error::corrupt(&dir, "memory-tier copy without its layout")),
    };
    if layout_crc(&stored) != layout_crc(&parts.layout) {
        return Err(Error::corrupt(&dir, "memory-tier copy laid out otherwise than its manifest says"));
    }
    // The request borrows the caller's buffers; they are the caller's again when it is dropped.
    let mut want = StateTree::map();
    for (i, t) in parts.tensors.iter_mut().enumerate() {
        let (n, dtype) = (t.data_numel(), t.dtype);
        let key = t.key.clone();
        let buf = t
            .data
            .bytes_mut()
            .ok_or_else(|| Error::invalid(format!("restore: tensor {key:?} is read-only; give a writable buffer")))?;
        want.insert(
            tensor_key(i),
            StateTree::Tensor(ShardedTensor::full(tensor_key(i), dtype, &[n], TensorData::Mut(buf))),
        );
    }
    load(want, storage.as_ref(), &SoloComm, &LoadOptions::default())?;
    let keys: Vec<String> = (0..parts.objects.len()).map(object_key).collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut bytes = if keys.is_empty() { BTreeMap::new() } else { ckpt.read_tensors(Some(&key_refs))? };
    let objects = keys
        .iter()
        .map(|k| {
            bytes.remove(k).map(|t| t.data).ok_or_else(|| Error::corrupt(&dir, format!("memory-tier copy lacks {k}")))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((stored, objects))
}

/// Removes this node's steps older than the newest `keep` committed ones up to `current` (the
/// step just committed). Steps after `current` are left alone: the next saves' copies may
/// already be being written there.
pub(crate) fn prune(tier: &MemoryTier, keep: usize, current: u64) -> Result<()> {
    let steps = scan(tier);
    let committed: Vec<u64> =
        steps.iter().filter(|(s, scan)| **s <= current && scan.manifest.is_some()).map(|(s, _)| *s).collect();
    let Some(&oldest_kept) = committed.iter().rev().nth(keep.max(1) - 1).or(committed.first()) else { return Ok(()) };
    for &step in steps.keys().filter(|&&s| s < oldest_kept) {
        remove_step(tier, step)?;
    }
    Ok(())
}

/// Removes one step from this node's root: its markers first (a step without markers is no
/// longer complete anywhere on this node), then the rest.
fn remove_step(tier: &MemoryTier, step: u64) -> Result<()> {
    let dir = tier.step_dir(step);
    let entries = match tier.fs.read_dir(&dir) {
        Ok(entries) => entries,
        Err(_) if !dir.exists() => return Ok(()),
        Err(e) => return Err(e),
    };
    for e in entries.iter().filter(|e| e.name.starts_with("commit-")) {
        tier.fs.remove_file(&e.path)?;
    }
    tier.fs.remove_dir_all(&dir)
}

/// Removes every step from `from` on (`None`: all steps) from every node's root, before the
/// job writes those step numbers again (collective on `comm`): the first rank of each node
/// removes, and no rank returns before every node is done, so no save writes a step while a
/// node still holds that step's old markers, copies or parity (a restore could otherwise pair
/// an old manifest with new copies). Every rank gets the same verdict.
pub(crate) fn clear_from(tier: &MemoryTier, node: &str, from: Option<u64>, comm: &dyn Communicator) -> Result<()> {
    let nodes = comm.all_gather(node.as_bytes())?;
    let first_on_node = nodes.iter().position(|n| n.as_slice() == node.as_bytes()) == Some(comm.rank());
    let removed = if first_on_node {
        // Not `scan`, which leaves out what it cannot list: a root that cannot be listed must
        // fail the clear, not pass it with old steps left in place.
        match tier.fs.read_dir(tier.root()) {
            Err(_) if !tier.root().exists() => Ok(()),
            Err(e) => Err(e),
            Ok(entries) => entries
                .iter()
                .filter_map(|e| parse_step_name(&e.name))
                .filter(|&s| from.is_none_or(|f| s >= f))
                .try_for_each(|s| remove_step(tier, s)),
        }
    } else {
        Ok(())
    };
    agree(removed, comm)
}

/// What every rank said before a restore, and the persistent tier's committed steps: the
/// input of [`decide`], the same on every rank.
pub(crate) struct Gathered {
    pub reports: Vec<Report>,
    pub persistent: Vec<u64>,
    /// Why the persistent tier could not be listed, if it could not.
    pub notes: Vec<String>,
}

/// Gathers every rank's report and the persistent tier's steps (listed by rank 0).
pub(crate) fn gather(
    tier: Option<&MemoryTier>,
    node: &str,
    layout: &Value,
    persistent: Option<&Location>,
    comm: &dyn Communicator,
) -> Result<Gathered> {
    let report =
        Report { node: node.to_owned(), layout: layout_crc(layout), steps: tier.map(scan).unwrap_or_default() };
    let all = comm.all_gather(&encode_report(&report))?;
    let reports = all.iter().enumerate().map(|(r, b)| decode_report(b, r)).collect::<Result<Vec<_>>>()?;
    let mut notes = Vec::new();
    let persistent = match listed_persistent_steps(persistent, comm) {
        Ok(steps) => steps,
        Err(Error::Comm { reason }) => return Err(Error::Comm { reason }),
        Err(e) => {
            notes.push(format!("persistent tier: cannot list its steps: {e}"));
            Vec::new()
        }
    };
    Ok(Gathered { reports, persistent, notes })
}

impl Gathered {
    /// Forgets that `step` is on any node (it failed to restore for a reason no checksum shows).
    pub(crate) fn drop_step(&mut self, step: u64) {
        for r in &mut self.reports {
            r.steps.remove(&step);
        }
    }

    /// Forgets the shards of `step` found corrupt, on every rank of the node holding each.
    pub(crate) fn drop_shards(&mut self, step: u64, bad: &[(usize, Shard)]) {
        for (holder, shard) in bad {
            let node = self.reports[*holder].node.clone();
            for r in self.reports.iter_mut().filter(|r| r.node == node) {
                if let Some(s) = r.steps.get_mut(&step) {
                    match shard {
                        Shard::Copy(y) => {
                            s.copies.remove(y);
                        }
                        Shard::Parity(g, p) => {
                            s.parity.remove(&parity_name(*g, *p));
                        }
                    }
                }
            }
        }
    }
}

/// After a failed restore of `plan`'s step, every rank checks the shards it answers for
/// against the manifest's checksums (collective): its own copy, the parity shards it wrote, and
/// every shard the plan has it send from its node (a copy or parity shard left there by a rank
/// that has since moved). Returns the (holder, shard) pairs that do not match, the same on
/// every rank.
pub(crate) fn find_corrupt(
    tier: &MemoryTier,
    plan: &MemoryPlan,
    comm: &dyn Communicator,
) -> Result<Vec<(usize, Shard)>> {
    let me = comm.rank();
    let m = &plan.manifest;
    let dir = tier.step_dir(m.step);
    let mut mine: Vec<Shard> = vec![Shard::Copy(me)];
    for (g, gs) in m.groups.iter().enumerate() {
        mine.extend(gs.group.parity.iter().enumerate().filter(|(_, &h)| h == me).map(|(p, _)| Shard::Parity(g, p)));
    }
    mine.extend(plan.transfers().into_iter().filter(|x| x.0 == me).map(|x| x.2));
    mine.sort_unstable();
    mine.dedup();
    let mut bad = Vec::new();
    for shard in mine {
        match shard {
            Shard::Copy(y) => {
                let Some(c) = m.ranks.get(y) else { continue };
                let copy = dir.join(rank_dir_name(y));
                if copy.exists() && crc_of(ShardReader::open(&tier.fs, &copy, &c.files), c.len()) != Some(c.crc) {
                    bad.push(json!(["copy", y]));
                }
            }
            Shard::Parity(g, p) => {
                let Some(gs) = m.groups.get(g) else { continue };
                let path = dir.join(parity_name(g, p));
                let want = gs.parity_crcs.get(p).copied();
                if path.exists() && crc_of(ShardReader::single(&tier.fs, &path, gs.shard_len), gs.shard_len) != want {
                    bad.push(json!(["parity", g, p]));
                }
            }
        }
    }
    let all = comm.all_gather(J::Array(bad).to_string().as_bytes())?;
    let mut out = Vec::new();
    for (r, bytes) in all.iter().enumerate() {
        let malformed = || Error::Comm { reason: format!("memory tier: rank {r} sent a malformed checksum verdict") };
        let list: Vec<J> = serde_json::from_slice(bytes).map_err(|_| malformed())?;
        for x in list {
            let n = |i: usize| x[i].as_u64().map(|v| v as usize).ok_or_else(malformed);
            let shard = match x[0].as_str() {
                Some("copy") => Shard::Copy(n(1)?),
                Some("parity") => Shard::Parity(n(1)?, n(2)?),
                _ => return Err(malformed()),
            };
            out.push((r, shard));
        }
    }
    Ok(out)
}

/// The CRC-32C of a shard's `len` bytes; None if it cannot be read.
fn crc_of(reader: Result<ShardReader>, len: u64) -> Option<u32> {
    let reader = reader.ok()?;
    let mut buf = vec![0u8; len.min(8 << 20) as usize];
    let (mut at, mut crc) = (0u64, 0u32);
    while at < len {
        let n = (len - at).min(buf.len() as u64) as usize;
        reader.read(at, &mut buf[..n]).ok()?;
        crc = crc32c_append(crc, &buf[..n]);
        at += n as u64;
    }
    Some(crc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::tier_manifest::{GroupShards, RankCopy};
    use crate::plan::placement::place;

    /// 8 ranks on 4 nodes, RS(2, 2), every node holding everything it should.
    fn job() -> (TierManifest, Vec<Report>) {
        let nodes: Vec<String> = (0..8).map(|r| format!("n{}", r / 2)).collect();
        let groups = place(&nodes, 2, 2).unwrap();
        let ranks: Vec<RankCopy> =
            (0..8).map(|r| RankCopy { files: vec![("f".into(), 10 + r)], crc: 0, layout: 5 }).collect();
        let m = TierManifest {
            step: 7,
            m: 2,
            chunk: 4,
            groups: groups
                .into_iter()
                .map(|g| GroupShards {
                    shard_len: crate::format::tier_manifest::shard_len(g.members.iter().map(|&r| ranks[r].len())),
                    group: g,
                    parity_crcs: vec![0, 0],
                })
                .collect(),
            nodes: nodes.clone(),
            ranks,
        };
        let text = String::from_utf8(m.encode()).unwrap();
        let mut reports: Vec<Report> =
            nodes.iter().map(|n| Report { node: n.clone(), layout: 5, steps: BTreeMap::new() }).collect();
        for rep in reports.iter_mut() {
            rep.steps.entry(7).or_default().manifest = Some(text.clone());
        }
        for r in 0..8usize {
            let n = r / 2;
            for q in [2 * n, 2 * n + 1] {
                reports[q].steps.get_mut(&7).unwrap().copies.insert(r, m.ranks[r].files.clone());
            }
        }
        for (g, gs) in m.groups.iter().enumerate() {
            for (p, &h) in gs.group.parity.iter().enumerate() {
                let n = h / 2;
                for q in [2 * n, 2 * n + 1] {
                    reports[q].steps.get_mut(&7).unwrap().parity.insert(parity_name(g, p), gs.shard_len);
                }
            }
        }
        (m, reports)
    }

    fn lose(reports: &mut [Report], node: usize) {
        for q in [2 * node, 2 * node + 1] {
            reports[q].steps.clear();
        }
    }

    #[test]
    fn every_pair_of_lost_nodes_is_rebuilt_from_memory() {
        for a in 0..4 {
            for b in a + 1..4 {
                let (_, mut reports) = job();
                lose(&mut reports, a);
                lose(&mut reports, b);
                let d = decide(&reports, &[3]);
                let plan = d.memory.unwrap_or_else(|| panic!("nodes {a},{b}: {:?}", d.notes));
                let rebuilt: Vec<usize> = plan.rebuild.iter().map(|(x, _)| *x).collect();
                assert_eq!(rebuilt, vec![2 * a, 2 * a + 1, 2 * b, 2 * b + 1]);
                assert!(plan
                    .rebuild
                    .iter()
                    .all(|(_, h)| matches!(h, Rebuild::Decode { sources, .. } if sources.len() == 2)));
            }
        }
    }

    #[test]
    fn three_lost_nodes_fall_back_to_the_persistent_tier_saying_why() {
        let (_, mut reports) = job();
        for n in 0..3 {
            lose(&mut reports, n);
        }
        let d = decide(&reports, &[3, 5]);
        assert!(d.memory.is_none());
        assert_eq!(d.persistent, Some(5));
        let text = d.notes.join("\n");
        assert!(
            text.contains("step 7") && text.contains("more than its 2 parity") && text.contains("persistent"),
            "{text}"
        );
        // Nothing anywhere: nothing to restore.
        let d = decide(&reports, &[]);
        assert!(d.memory.is_none() && d.persistent.is_none());
    }

    #[test]
    fn a_newer_persistent_step_wins_and_a_new_world_or_layout_never_loads_from_memory() {
        let (_, reports) = job();
        assert_eq!(decide(&reports, &[9]).persistent, Some(9));
        assert_eq!(decide(&reports, &[7]).memory.unwrap().manifest.step, 7);
        let d = decide(&reports[..6], &[4]);
        assert_eq!(d.persistent, Some(4));
        assert!(d.notes[0].contains("saved by 8 ranks"), "{:?}", d.notes);
        let (_, mut reports) = job();
        reports[3].layout = 6;
        assert!(decide(&reports, &[]).notes[0].contains("rank 3"));
    }

    #[test]
    fn a_copy_held_whole_elsewhere_is_streamed_not_decoded() {
        let (m, mut reports) = job();
        // Rank 5 moved to node n0: its copy is still on n2.
        reports[5].node = "n0".into();
        let d = decide(&reports, &[]);
        let plan = d.memory.unwrap();
        assert_eq!(plan.rebuild, vec![(5, Rebuild::Copy { from: 4 })]);
        assert_eq!(plan.manifest, m);
    }
}
