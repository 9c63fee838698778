//! The memory tier's step manifest (FORMAT.md, "The memory tier"): what one committed step of
//! the memory tier holds — every rank's node, the files of every rank's copy and their
//! checksum, the erasure-coding groups and their parity checksums. Each rank writes the same
//! manifest as its commit marker once every rank has written its copy and its parity; any one
//! of them found on any node proves the step complete. Self-checking: a format name, a version
//! and the CRC-32C of the body; every number is checked before anything is read by it.

use serde_json::{json, Value as J};

use crate::error::{Error, Result};
use crate::model::crc::crc32c;

/// The manifest's format name.
const FORMAT: &str = "tessera-memory-tier";
/// The manifest's version; readers refuse others.
pub(crate) const TIER_VERSION: u64 = 1;
/// Largest shard the manifest may declare (1 TiB): a bound on what a corrupt manifest can make
/// a restore allocate or transfer.
const MAX_SHARD: u64 = 1 << 40;

/// One erasure-coding group: `members` hold the data shards (one rank each, on distinct nodes),
/// `parity[p]` is the rank storing parity shard `p` (on nodes no member is on, distinct too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// Ranks whose states are the group's data shards, in shard order.
    pub members: Vec<usize>,
    /// Ranks storing the parity shards, in parity order.
    pub parity: Vec<usize>,
}

/// One rank's copy, as the group's data shard: its checkpoint's files in shard order (the
/// shard is their bytes back to back), the CRC-32C of those bytes, and a checksum of the
/// state's layout (the in-place restore checks it against the layout asked for).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RankCopy {
    pub files: Vec<(String, u64)>,
    pub crc: u32,
    pub layout: u32,
}

impl RankCopy {
    /// The data shard's length: its files' bytes.
    pub fn len(&self) -> u64 {
        self.files.iter().map(|f| f.1).sum()
    }
}

/// A group and its shards: the placement, the common shard length (the longest member's,
/// rounded up to even as the codec needs), and the CRC-32C of each parity shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GroupShards {
    pub group: Group,
    pub shard_len: u64,
    pub parity_crcs: Vec<u32>,
}

/// A committed step of the memory tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TierManifest {
    pub step: u64,
    /// Parity shards per group (the `m` of RS(k, m)).
    pub m: usize,
    /// Bytes of every shard exchanged per round (even).
    pub chunk: u64,
    /// The node each rank ran on.
    pub nodes: Vec<String>,
    pub ranks: Vec<RankCopy>,
    pub groups: Vec<GroupShards>,
}

/// The shard length a group of data shards of these lengths codes with: the longest, rounded
/// up to even (the codec works on 16-bit symbols), at least 2.
pub(crate) fn shard_len(lens: impl Iterator<Item = u64>) -> u64 {
    let max = lens.max().unwrap_or(0).max(2);
    max + (max & 1)
}

/// A manifest's bytes around `body`: the format, the version and the body's CRC-32C.
pub(crate) fn seal(body: &str) -> Vec<u8> {
    let outer = json!({ "format": FORMAT, "version": TIER_VERSION, "crc32c": crc32c(body.as_bytes()), "body": body });
    let mut bytes = outer.to_string().into_bytes();
    bytes.push(b'\n');
    bytes
}

impl TierManifest {
    /// Number of ranks of the job that saved the step.
    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// The group whose data shard is rank `r`'s copy, and `r`'s shard index in it.
    pub fn group_of(&self, r: usize) -> Option<(usize, usize)> {
        self.groups.iter().enumerate().find_map(|(g, gs)| gs.group.members.iter().position(|&x| x == r).map(|i| (g, i)))
    }

    /// The manifest's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let body = json!({
            "step": self.step,
            "m": self.m,
            "chunk": self.chunk,
            "nodes": self.nodes,
            "ranks": self.ranks.iter().map(|r| json!({
                "files": r.files.iter().map(|(n, l)| json!([n, l])).collect::<Vec<_>>(),
                "crc": r.crc,
                "layout": r.layout,
            })).collect::<Vec<_>>(),
            "groups": self.groups.iter().map(|g| json!({
                "members": g.group.members,
                "parity": g.group.parity,
                "shard_len": g.shard_len,
                "parity_crcs": g.parity_crcs,
            })).collect::<Vec<_>>(),
        })
        .to_string();
        seal(&body)
    }

    /// Parses and checks a manifest read from `path` (named in every error).
    pub fn decode(bytes: &[u8], path: &str) -> Result<TierManifest> {
        let bad = |why: String| Error::corrupt(path, format!("memory-tier manifest: {why}"));
        let outer: J = serde_json::from_slice(bytes).map_err(|e| bad(format!("not JSON: {e}")))?;
        if outer.get("format").and_then(J::as_str) != Some(FORMAT) {
            return Err(bad("not a memory-tier manifest".into()));
        }
        let version = outer.get("version").and_then(J::as_u64).ok_or_else(|| bad("no version".into()))?;
        if version != TIER_VERSION {
            return Err(Error::IncompatibleVersion {
                found: format!("{path}: memory-tier manifest version {version}"),
                supported: TIER_VERSION.to_string(),
            });
        }
        let body = outer.get("body").and_then(J::as_str).ok_or_else(|| bad("no body".into()))?;
        let crc = outer.get("crc32c").and_then(J::as_u64).ok_or_else(|| bad("no checksum".into()))?;
        if u64::from(crc32c(body.as_bytes())) != crc {
            return Err(bad("checksum mismatch".into()));
        }
        let b: J = serde_json::from_str(body).map_err(|e| bad(format!("body not JSON: {e}")))?;
        let u = |v: &J, what: &str| v.as_u64().ok_or_else(|| bad(format!("{what} is not a count")));
        let u32_of = |v: &J, what: &str| {
            v.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(|| bad(format!("{what} is not a checksum")))
        };
        let list = |v: Option<&J>, what: &str| -> Result<Vec<J>> {
            v.and_then(J::as_array).cloned().ok_or_else(|| bad(format!("{what} is not a list")))
        };
        let step = u(b.get("step").unwrap_or(&J::Null), "step")?;
        let m = u(b.get("m").unwrap_or(&J::Null), "m")? as usize;
        let chunk = u(b.get("chunk").unwrap_or(&J::Null), "chunk")?;
        if chunk == 0 || chunk % 2 == 1 || chunk > MAX_SHARD {
            return Err(bad(format!("chunk {chunk} is not an even size ≤ 1 TiB")));
        }
        let nodes = list(b.get("nodes"), "nodes")?
            .iter()
            .map(|n| n.as_str().map(str::to_owned).ok_or_else(|| bad("a node name is not a string".into())))
            .collect::<Result<Vec<_>>>()?;
        let mut ranks = Vec::new();
        for r in list(b.get("ranks"), "ranks")? {
            let mut files = Vec::new();
            for f in list(r.get("files"), "files")? {
                let (Some(name), Some(len)) = (f.get(0).and_then(J::as_str), f.get(1).and_then(J::as_u64)) else {
                    return Err(bad("a file entry is not [name, length]".into()));
                };
                if name.is_empty() || name.contains('/') || name.starts_with('.') {
                    return Err(bad(format!("file name {name:?} is not a plain name")));
                }
                files.push((name.to_owned(), len));
            }
            let copy = RankCopy {
                files,
                crc: u32_of(r.get("crc").unwrap_or(&J::Null), "crc")?,
                layout: u32_of(r.get("layout").unwrap_or(&J::Null), "layout")?,
            };
            if copy.files.iter().try_fold(0u64, |a, f| a.checked_add(f.1)).is_none_or(|l| l > MAX_SHARD) {
                return Err(bad(format!("rank {}'s copy is larger than 1 TiB", ranks.len())));
            }
            ranks.push(copy);
        }
        let world = ranks.len();
        if world == 0 || nodes.len() != world {
            return Err(bad(format!("{} node names for {world} ranks", nodes.len())));
        }
        let mut member_of = vec![false; world];
        let mut groups = Vec::new();
        for g in list(b.get("groups"), "groups")? {
            let ranks_in = |what: &str| -> Result<Vec<usize>> {
                list(g.get(what), what)?
                    .iter()
                    .map(|x| x.as_u64().map(|r| r as usize).filter(|&r| r < world))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad(format!("group {} {what}: not ranks below {world}", groups.len())))
            };
            let group = Group { members: ranks_in("members")?, parity: ranks_in("parity")? };
            let parity_crcs = list(g.get("parity_crcs"), "parity_crcs")?
                .iter()
                .map(|c| u32_of(c, "parity crc"))
                .collect::<Result<Vec<_>>>()?;
            let shard_len = u(g.get("shard_len").unwrap_or(&J::Null), "shard_len")?;
            let gi = groups.len();
            if group.members.is_empty() || group.parity.len() != m || parity_crcs.len() != m {
                return Err(bad(format!(
                    "group {gi}: {} members, {} parity holders for m = {m}",
                    group.members.len(),
                    group.parity.len()
                )));
            }
            for &r in &group.members {
                if std::mem::replace(&mut member_of[r], true) {
                    return Err(bad(format!("rank {r} is in two groups")));
                }
            }
            if shard_len != shard_len_of(&ranks, &group.members) {
                return Err(bad(format!("group {gi}: shard length {shard_len} does not match its members' copies")));
            }
            groups.push(GroupShards { group, shard_len, parity_crcs });
        }
        if let Some(r) = member_of.iter().position(|&x| !x) {
            return Err(bad(format!("rank {r} is in no group")));
        }
        Ok(TierManifest { step, m, chunk, nodes, ranks, groups })
    }
}

fn shard_len_of(ranks: &[RankCopy], members: &[usize]) -> u64 {
    shard_len(members.iter().map(|&r| ranks[r].len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> TierManifest {
        let ranks = vec![
            RankCopy { files: vec![("a".into(), 10), ("b".into(), 5)], crc: 7, layout: 1 },
            RankCopy { files: vec![("a".into(), 3)], crc: 8, layout: 2 },
        ];
        TierManifest {
            step: 12,
            m: 1,
            chunk: 1 << 20,
            nodes: vec!["x".into(), "y".into()],
            groups: vec![
                GroupShards { group: Group { members: vec![0], parity: vec![1] }, shard_len: 16, parity_crcs: vec![3] },
                GroupShards { group: Group { members: vec![1], parity: vec![0] }, shard_len: 4, parity_crcs: vec![4] },
            ],
            ranks,
        }
    }

    #[test]
    fn round_trips_and_refuses_every_corruption() {
        let m = sample();
        let bytes = m.encode();
        assert_eq!(TierManifest::decode(&bytes, "p").unwrap(), m);
        assert_eq!(m.group_of(1), Some((1, 0)));
        // Any flipped byte is refused (checksum, JSON or format), never accepted as another manifest.
        for i in 0..bytes.len() - 1 {
            let mut b = bytes.clone();
            b[i] ^= 0x20;
            if let Ok(other) = TierManifest::decode(&b, "p") {
                assert_eq!(other, m, "byte {i} changed the manifest silently");
            }
        }
    }

    #[test]
    fn inconsistent_bodies_are_refused_naming_the_file() {
        let mut m = sample();
        m.groups[0].shard_len = 12;
        let e = TierManifest::decode(&m.encode(), "/shm/step/commit").unwrap_err().to_string();
        assert!(e.contains("/shm/step/commit") && e.contains("shard length"), "{e}");
        let mut m = sample();
        m.groups[1].group.members = vec![0];
        assert!(TierManifest::decode(&m.encode(), "p").unwrap_err().to_string().contains("two groups"));
        let mut m = sample();
        m.nodes.pop();
        assert!(TierManifest::decode(&m.encode(), "p").is_err());
    }
}
