//! The plan cache's check: one small message per rank instead of its plan.

use super::RankPlan;
use crate::model::codec::{Decoder, Encoder};

/// What a rank announces when saving with a plan cache: one small message instead of its plan.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CacheCheck {
    /// This rank's plan hashes to the one it cached.
    pub matches: bool,
    /// Save id of the save the rank's cache comes from (0: none).
    pub generation: u64,
    /// Rank 0 only: this save's id.
    pub save_id: u64,
    /// Rank 0 only: a committed checkpoint exists and overwrite was not asked for.
    pub refuse_overwrite: bool,
}

const CACHE_CHECK_TAG: u8 = 0x63;

impl CacheCheck {
    /// Binary encoding (a few dozen bytes).
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.u8(CACHE_CHECK_TAG);
        e.u8(self.matches as u8 | (self.refuse_overwrite as u8) << 1);
        e.var(self.generation);
        e.var(self.save_id);
        e.buf
    }

    /// Decodes [`CacheCheck::encode`]'s output.
    pub fn decode(b: &[u8]) -> std::result::Result<Self, String> {
        let mut d = Decoder::new(b);
        if d.u8()? != CACHE_CHECK_TAG {
            return Err("not a plan-cache message (do all ranks save with a plan cache?)".into());
        }
        let flags = d.u8()?;
        let generation = d.var()?;
        let save_id = d.var()?;
        Ok(CacheCheck { matches: flags & 1 != 0, generation, save_id, refuse_overwrite: flags & 2 != 0 })
    }
}

/// Whether every rank may reuse its cached plan: all match, and all caches come from the same
/// save (so they hold the same global plan). Every rank decides alike from the same messages.
pub fn cache_hit(checks: &[CacheCheck]) -> bool {
    checks.iter().all(|c| c.matches && c.generation != 0 && c.generation == checks[0].generation)
}

/// The save options that shape the global plan (checksum block size, validation, writer
/// assignment), as the `extra` bytes of [`plan_digest`].
pub fn plan_options(block_size: u64, validate: bool, distribute_replicas: bool) -> Vec<u8> {
    let mut b = block_size.to_le_bytes().to_vec();
    b.push(validate as u8);
    b.push(distribute_replicas as u8);
    b
}

/// The structure of a rank's plan (without the save's id or flags), plus `extra` bytes
/// (the options that shape the global plan), hashed to 128 bits.
pub fn plan_digest(plan: &RankPlan, extra: &[u8]) -> [u64; 2] {
    let mut e = Encoder::default();
    plan.encode_structure(&mut e);
    e.buf.extend_from_slice(extra);
    crate::plan::fasthash::digest128(&e.buf)
}
