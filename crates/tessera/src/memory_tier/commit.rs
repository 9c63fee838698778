//! The background half of a memory-tier save, collective on the tier's communicator: once every
//! rank's copy is written, the ranks agree on the placement, stream their copies to their
//! groups' parity holders in rounds of one chunk, the holders encode and write the parity, and
//! only when every rank reports success does each write the step's manifest, the commit marker.
//! A rank that fails anywhere still takes part in every collective (sending zeros), so all ranks
//! reach the same verdict; a step without a marker is never restored.

use reed_solomon_simd::ReedSolomonEncoder;
use serde_json::{json, Value as J};

use super::fs::NodeFs;
use super::shard::{copy_files, files_from_json, files_to_json, ShardReader};
use super::{marker_name, parity_name, rank_dir_name, MemoryTier};
use crate::comm::wire::{outcome, outcomes};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::format::tier_manifest::{shard_len, GroupShards, RankCopy, TierManifest};
use crate::model::crc::crc32c_append;
use crate::plan::placement::place;
use crate::storage::ObjectWriter;

/// What one rank brings to the commit of step `step`: whether its copy was written, and its
/// state's layout checksum.
pub(crate) struct Written {
    pub step: u64,
    pub copy: Result<()>,
    pub layout: u32,
}

/// Commits a step of the memory tier (see the module docs). Returns the manifest and whether
/// this rank wrote it (its marker; the step is complete once every rank's verdict was success,
/// so a failed marker loses one node's proof of it, not the step); or the first failure of any
/// rank, the same on every rank, when no rank wrote a marker.
pub(crate) fn commit_step(
    tier: &MemoryTier,
    node: &str,
    w: Written,
    comm: &dyn Communicator,
) -> Result<(TierManifest, Result<()>)> {
    let me = comm.rank();
    let world = comm.world_size();
    let step_dir = tier.step_dir(w.step);
    let my_dir = step_dir.join(rank_dir_name(me));

    // Phase 1: every rank's node and copy.
    let mine = w.copy.and_then(|()| copy_files(&tier.fs, &my_dir));
    let msg = outcome(&mine, |files| {
        json!({ "node": node, "layout": w.layout, "files": files_to_json(files) }).to_string().into_bytes()
    });
    let all = comm.all_gather(&msg)?;
    let mut local = mine.as_ref().err().map(clone_error);
    let payloads = outcomes(&all, me, &mut local)?;
    let mut nodes = Vec::with_capacity(world);
    let mut ranks = Vec::with_capacity(world);
    for (r, p) in payloads.iter().enumerate() {
        let j: J =
            serde_json::from_slice(p).map_err(|e| Error::Comm { reason: format!("memory tier: rank {r}: {e}") })?;
        let bad = || Error::Comm { reason: format!("memory tier: rank {r} sent a malformed copy description") };
        nodes.push(j["node"].as_str().ok_or_else(bad)?.to_owned());
        let files = files_from_json(&j["files"]).ok_or_else(bad)?;
        let layout = j["layout"].as_u64().and_then(|l| u32::try_from(l).ok()).ok_or_else(bad)?;
        ranks.push(RankCopy { files, crc: 0, layout });
    }
    let groups = place(&nodes, tier.k, tier.m)?;
    let mut manifest = TierManifest {
        step: w.step,
        m: tier.m,
        chunk: tier.chunk_bytes,
        groups: groups
            .into_iter()
            .map(|g| GroupShards {
                shard_len: shard_len(g.members.iter().map(|&r| ranks[r].len())),
                group: g,
                parity_crcs: vec![0; tier.m],
            })
            .collect(),
        nodes,
        ranks,
    };

    // Phase 2: the parity, in rounds of one chunk per shard.
    let mut stream = Stream::open(&tier.fs, &manifest, me, &step_dir);
    let chunk = manifest.chunk;
    let rounds = manifest.groups.iter().map(|g| g.shard_len.div_ceil(chunk)).max().unwrap_or(0);
    for t in 0..rounds {
        let mut send = vec![Vec::new(); world];
        if let Some((g, _)) = manifest.group_of(me) {
            let gs = &manifest.groups[g];
            if let Some(len) = round_len(gs.shard_len, chunk, t) {
                let mut buf = vec![0u8; len];
                stream.read_own(t * chunk, &mut buf, manifest.ranks[me].len());
                for &h in &gs.group.parity {
                    send[h] = buf.clone();
                }
            }
        }
        let recv = comm.all_to_all(send)?;
        stream.encode_round(&manifest, t, &recv);
    }

    // Phase 3: the verdict; every rank writes the manifest only if every rank succeeded.
    let (own_crc, parity) = stream.finish();
    let done = parity.map(|p| (own_crc, p));
    let msg = outcome(&done, |(crc, p)| {
        json!({ "crc": crc, "parity": p.iter().map(|(g, i, c)| json!([g, i, c])).collect::<Vec<_>>() })
            .to_string()
            .into_bytes()
    });
    let all = comm.all_gather(&msg)?;
    let mut local = done.as_ref().err().map(clone_error);
    let payloads = outcomes(&all, me, &mut local)?;
    for (r, p) in payloads.iter().enumerate() {
        let j: J =
            serde_json::from_slice(p).map_err(|e| Error::Comm { reason: format!("memory tier: rank {r}: {e}") })?;
        let bad = || Error::Comm { reason: format!("memory tier: rank {r} sent a malformed verdict") };
        manifest.ranks[r].crc = j["crc"].as_u64().and_then(|c| u32::try_from(c).ok()).ok_or_else(bad)?;
        for e in j["parity"].as_array().ok_or_else(bad)? {
            let (Some(g), Some(i), Some(c)) = (e[0].as_u64(), e[1].as_u64(), e[2].as_u64()) else { return Err(bad()) };
            let slot = manifest
                .groups
                .get_mut(g as usize)
                .and_then(|gs| gs.parity_crcs.get_mut(i as usize))
                .ok_or_else(bad)?;
            *slot = u32::try_from(c).map_err(|_| bad())?;
        }
    }
    let marker = tier.fs.storage(&step_dir).put_atomic(&marker_name(me), &manifest.encode());
    Ok((manifest, marker))
}

/// Bytes of shard chunk `t` for a shard of `shard_len` bytes in chunks of `chunk`, or `None`
/// past its end. Even, as both are.
pub(crate) fn round_len(shard_len: u64, chunk: u64, t: u64) -> Option<usize> {
    let start = t.checked_mul(chunk)?;
    (start < shard_len).then(|| (shard_len - start).min(chunk) as usize)
}

/// Every rank's outcome of a local step, agreed on with one all-gather: this rank's value if
/// every rank succeeded, else the first failure in rank order (this rank's own error keeps its
/// type), the same verdict on every rank.
pub(crate) fn agree<T>(r: Result<T>, comm: &dyn Communicator) -> Result<T> {
    let msg = outcome(&r, |_| Vec::new());
    let (value, mut local) = match r {
        Ok(v) => (Some(v), None),
        Err(e) => (None, Some(e)),
    };
    let all = comm.all_gather(&msg)?;
    outcomes(&all, comm.rank(), &mut local)?;
    Ok(value.expect("every rank succeeded, this one too"))
}

/// `Error` is not `Clone` (it carries an `io::Error`); the copy keeps the variant where it
/// carries text only, and the message otherwise.
pub(crate) fn clone_error(e: &Error) -> Error {
    match e {
        Error::Io { path, source } => {
            Error::Io { path: path.clone(), source: std::io::Error::new(source.kind(), source.to_string()) }
        }
        Error::Corrupt { path, reason } => Error::Corrupt { path: path.clone(), reason: reason.clone() },
        Error::NotFound { path, detail } => Error::NotFound { path: path.clone(), detail: detail.clone() },
        other => Error::invalid(other.to_string()),
    }
}

/// A parity shard this rank holds: (group, parity index, its writer (None if it could not be
/// created), running CRC).
type Held = (usize, usize, Option<Box<dyn ObjectWriter>>, u32);

/// One rank's side of the parity stream: its own copy read as a shard, and the parity shards
/// it holds being written. The first local failure is kept, and the rank goes on taking part
/// (sending zeros) so its peers are not left waiting.
struct Stream {
    own: Option<ShardReader>,
    own_crc: u32,
    held: Vec<Held>,
    encoder: Option<ReedSolomonEncoder>,
    error: Option<Error>,
}

impl Stream {
    fn open(fs: &NodeFs, manifest: &TierManifest, me: usize, step_dir: &std::path::Path) -> Stream {
        let mut error = None;
        let own = match ShardReader::open(fs, &step_dir.join(rank_dir_name(me)), &manifest.ranks[me].files) {
            Ok(r) => Some(r),
            Err(e) => {
                error = Some(e);
                None
            }
        };
        let storage = fs.storage(step_dir);
        let mut held = Vec::new();
        for (g, gs) in manifest.groups.iter().enumerate() {
            for (p, &h) in gs.group.parity.iter().enumerate() {
                if h != me {
                    continue;
                }
                let writer = match storage.create(&parity_name(g, p), gs.shard_len) {
                    Ok(w) => Some(w),
                    Err(e) => {
                        error.get_or_insert(e);
                        None
                    }
                };
                held.push((g, p, writer, 0));
            }
        }
        Stream { own, own_crc: 0, held, encoder: None, error }
    }

    /// Fills `buf` with this rank's shard from `offset` (zeros past `len`, its real length),
    /// adding the real bytes to the copy's CRC.
    fn read_own(&mut self, offset: u64, buf: &mut [u8], len: u64) {
        let Some(r) = &self.own else { return };
        if let Err(e) = r.read(offset, buf) {
            self.error.get_or_insert(e);
            buf.fill(0);
            return;
        }
        let real = len.saturating_sub(offset).min(buf.len() as u64) as usize;
        self.own_crc = crc32c_append(self.own_crc, &buf[..real]);
    }

    /// Encodes round `t` of every group this rank holds parity for, from the members' chunks
    /// in `recv`, and writes its parity shards' chunks.
    fn encode_round(&mut self, manifest: &TierManifest, t: u64, recv: &[Vec<u8>]) {
        for (g, p, writer, crc) in &mut self.held {
            let gs = &manifest.groups[*g];
            let Some(len) = round_len(gs.shard_len, manifest.chunk, t) else { continue };
            let k = gs.group.members.len();
            let parity = (|| -> Result<Vec<u8>> {
                let codec_err = |e: reed_solomon_simd::Error| Error::invalid(format!("memory tier: Reed–Solomon: {e}"));
                let enc = match &mut self.encoder {
                    Some(enc) => {
                        enc.reset(k, manifest.m, len).map_err(codec_err)?;
                        enc
                    }
                    None => self.encoder.insert(ReedSolomonEncoder::new(k, manifest.m, len).map_err(codec_err)?),
                };
                for &r in &gs.group.members {
                    let got = &recv[r];
                    if got.len() != len {
                        return Err(Error::Comm {
                            reason: format!(
                                "memory tier: rank {r} sent {} bytes of group {g}'s round {t}, not {len}",
                                got.len()
                            ),
                        });
                    }
                    enc.add_original_shard(got).map_err(codec_err)?;
                }
                let out = enc.encode().map_err(codec_err)?;
                Ok(out.recovery(*p).expect("p < m").to_vec())
            })();
            match parity {
                Ok(bytes) => {
                    *crc = crc32c_append(*crc, &bytes);
                    if let Some(w) = writer {
                        if let Err(e) = w.write_at(t * manifest.chunk, &bytes) {
                            self.error.get_or_insert(e);
                        }
                    }
                }
                Err(e) => {
                    self.error.get_or_insert(e);
                }
            }
        }
    }

    /// The copy's CRC and the (group, index, CRC) of every parity shard written, or the first
    /// failure.
    #[allow(clippy::type_complexity)]
    fn finish(self) -> (u32, Result<Vec<(usize, usize, u32)>>) {
        let mut error = self.error;
        let mut out = Vec::new();
        for (g, p, writer, crc) in self.held {
            match writer.map(|w| w.finish()) {
                Some(Ok(())) => out.push((g, p, crc)),
                Some(Err(e)) => {
                    error.get_or_insert(e);
                }
                None => {}
            }
        }
        (self.own_crc, error.map_or(Ok(out), Err))
    }
}
