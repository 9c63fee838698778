//! The lease of a running save (FORMAT.md, "Leases"): the object `.tessera-lease-<save_id>` that
//! rank 0 puts before any rank writes, renews while the save runs and removes once it has
//! committed or failed. It names the files the save may create (by its format's rule; which
//! names a rule covers is `save::lease::covers`), so that `gc` (and the cleanup after another
//! save's commit) leaves them alone while the lease has not expired.
//!
//! Bytes: one line of JSON, then `crc32c <8 hex digits>` and a newline (the checksum of the JSON
//! line's bytes): readable by an operator, and self-checking.

use serde_json::{json, Value as J};

use crate::error::{Error, Result};

/// Names of leases start with this.
pub const LEASE_PREFIX: &str = ".tessera-lease-";
/// The version of the lease written here.
pub const LEASE_VERSION: u64 = 1;
/// How long a lease holds after its last renewal, in milliseconds: a save whose writer stopped
/// renewing (killed, hung) loses its protection after this.
pub const LEASE_TTL_MS: u64 = 10 * 60 * 1000;
/// How often a running save renews its lease, in milliseconds.
pub const LEASE_RENEW_MS: u64 = 60 * 1000;

/// The files a save may create, by the rule of its format's names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseFiles {
    /// Native data files of this save: `<save_id>-r<rank>.safetensors`.
    Native,
    /// DCP data files `__<rank>_<n>.distcp` with `first <= n < first + count`, and the save's
    /// copy of its `common.pt` (`.tessera-common-<save_id>.pt`).
    Distcp {
        /// The first file number.
        first: u64,
        /// File numbers per rank.
        count: u64,
    },
    /// OLMo-core rank files `rank_<r><suffix>.safetensors`.
    Olmo {
        /// `""` (OLMo-core's own names) or `-<save_id>`.
        suffix: String,
    },
}

/// A save's lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The save's id.
    pub save_id: u64,
    /// Who runs it (`host:pid`), for an operator.
    pub writer: String,
    /// When it was last renewed (ms since the Unix epoch, the writer's clock).
    pub renewed_ms: u64,
    /// When it expires unless renewed (ms since the Unix epoch, the writer's clock).
    pub expires_ms: u64,
    /// The files the save may create.
    pub files: LeaseFiles,
}

/// The name of the lease of save `save_id`.
pub fn lease_name(save_id: u64) -> String {
    format!("{LEASE_PREFIX}{save_id:016x}")
}

/// The save id a lease's name carries; `None` for any other name.
pub fn parse_lease_name(name: &str) -> Option<u64> {
    let id = name.strip_prefix(LEASE_PREFIX)?;
    (id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit())).then(|| u64::from_str_radix(id, 16).ok())?
}

impl Lease {
    /// Its object's name.
    pub fn name(&self) -> String {
        lease_name(self.save_id)
    }

    /// Whether it still holds at `now_ms` (ms since the Unix epoch).
    pub fn is_live(&self, now_ms: u64) -> bool {
        now_ms < self.expires_ms
    }

    /// Its bytes.
    pub fn encode(&self) -> Vec<u8> {
        let files = match &self.files {
            LeaseFiles::Native => json!({"native": true}),
            LeaseFiles::Distcp { first, count } => json!({"distcp": [first, count]}),
            LeaseFiles::Olmo { suffix } => json!({"olmo": suffix}),
        };
        let body = json!({
            "tessera_lease": LEASE_VERSION,
            "save_id": format!("{:016x}", self.save_id),
            "writer": self.writer,
            "renewed_ms": self.renewed_ms,
            "expires_ms": self.expires_ms,
            "files": files,
        })
        .to_string();
        let crc = crate::model::crc::crc32c(body.as_bytes());
        format!("{body}\ncrc32c {crc:08x}\n").into_bytes()
    }

    /// Reads a lease's bytes (`shown` names it in errors).
    pub fn decode(bytes: &[u8], shown: &str) -> Result<Lease> {
        let bad = |reason: &str| Error::corrupt(shown, format!("not a tessera lease: {reason}"));
        let text = std::str::from_utf8(bytes).map_err(|_| bad("not UTF-8"))?;
        let (body, tail) = text.split_once('\n').ok_or_else(|| bad("no checksum line"))?;
        let crc = tail
            .strip_prefix("crc32c ")
            .and_then(|t| t.strip_suffix('\n'))
            .filter(|h| h.len() == 8)
            .and_then(|h| u32::from_str_radix(h, 16).ok())
            .ok_or_else(|| bad("bad checksum line"))?;
        if crate::model::crc::crc32c(body.as_bytes()) != crc {
            return Err(bad("checksum mismatch"));
        }
        let v: J = serde_json::from_str(body).map_err(|_| bad("not JSON"))?;
        let version = v.get("tessera_lease").and_then(J::as_u64).ok_or_else(|| bad("no version"))?;
        if version != LEASE_VERSION {
            return Err(Error::IncompatibleVersion {
                found: format!("lease v{version} ({shown})"),
                supported: format!("lease v{LEASE_VERSION}"),
            });
        }
        let number = |k: &str| v.get(k).and_then(J::as_u64).ok_or_else(|| bad(&format!("no {k}")));
        let save_id = v
            .get("save_id")
            .and_then(J::as_str)
            .filter(|s| s.len() == 16)
            .and_then(|s| u64::from_str_radix(s, 16).ok())
            .ok_or_else(|| bad("no save_id"))?;
        let files = v.get("files").ok_or_else(|| bad("no files"))?;
        let files = if files.get("native").is_some() {
            LeaseFiles::Native
        } else if let Some([first, count]) =
            files.get("distcp").and_then(|d| serde_json::from_value::<[u64; 2]>(d.clone()).ok())
        {
            LeaseFiles::Distcp { first, count }
        } else if let Some(suffix) = files.get("olmo").and_then(J::as_str) {
            LeaseFiles::Olmo { suffix: suffix.to_string() }
        } else {
            return Err(bad("unknown files rule"));
        };
        Ok(Lease {
            save_id,
            writer: v.get("writer").and_then(J::as_str).unwrap_or_default().to_string(),
            renewed_ms: number("renewed_ms")?,
            expires_ms: number("expires_ms")?,
            files,
        })
    }
}

/// A lease of save `0123456789abcdef` for the tests (renewed at 5 ms, expiring at 9 ms).
#[cfg(test)]
pub(crate) fn example(files: LeaseFiles) -> Lease {
    Lease { save_id: 0x0123_4567_89ab_cdef, writer: "host:7".into(), renewed_ms: 5, expires_ms: 9, files }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::example as lease;

    #[test]
    fn leases_round_trip_and_check_themselves() {
        for files in [
            LeaseFiles::Native,
            LeaseFiles::Distcp { first: 12, count: 2 },
            LeaseFiles::Olmo { suffix: "-0123456789abcdef".into() },
        ] {
            let l = lease(files);
            let bytes = l.encode();
            assert_eq!(Lease::decode(&bytes, "x").unwrap(), l);
            let mut flipped = bytes.clone();
            flipped[10] ^= 1;
            assert!(matches!(Lease::decode(&flipped, "x"), Err(Error::Corrupt { .. })));
        }
        assert_eq!(parse_lease_name(&lease(LeaseFiles::Native).name()), Some(0x0123_4567_89ab_cdef));
        assert_eq!(parse_lease_name(".tessera-lease-xyz"), None);
    }
}
