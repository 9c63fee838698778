//! Rank 0's hold on a running save's lease (`format::lease`): taken before any rank writes,
//! renewed while the save runs, released once the save has committed or failed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};
use crate::format::lease::{parse_lease_name, Lease, LeaseFiles, LEASE_RENEW_MS, LEASE_TTL_MS};
use crate::formats::olmo::metadata::parse_rank_file_name;
use crate::formats::torch_dist::{parse_common_copy_name, parse_data_file_name as parse_distcp_name};
use crate::storage::Storage;

/// Milliseconds since the Unix epoch, by this machine's clock.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Who writes: `host:pid`, for an operator reading a lease.
fn writer() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into());
    format!("{host}:{}", std::process::id())
}

/// A lease rank 0 holds in one location.
#[derive(Debug)]
pub(crate) struct LeaseHold {
    lease: Mutex<Lease>,
    /// When the next renewal is due (ms since the epoch).
    due_ms: AtomicU64,
    /// Released: never put again.
    released: AtomicBool,
}

impl LeaseHold {
    /// Puts the lease of save `save_id`, whose files follow `files`, into `storage`.
    pub fn take(storage: &dyn Storage, save_id: u64, files: LeaseFiles) -> Result<LeaseHold> {
        let now = now_ms();
        let lease = Lease { save_id, writer: writer(), renewed_ms: now, expires_ms: now + LEASE_TTL_MS, files };
        storage.put_atomic(&lease.name(), &lease.encode())?;
        Ok(LeaseHold {
            lease: Mutex::new(lease),
            due_ms: AtomicU64::new(now + LEASE_RENEW_MS),
            released: AtomicBool::new(false),
        })
    }

    /// The id of the save the lease is of.
    pub fn save_id(&self) -> u64 {
        self.lease.lock().unwrap_or_else(|e| e.into_inner()).save_id
    }

    /// Renews the lease if a renewal is due (cheap otherwise). A failed renewal is retried at
    /// the next call: the lease holds for [`LEASE_TTL_MS`] after the last one that succeeded.
    pub fn renew_if_due(&self, storage: &dyn Storage) {
        let now = now_ms();
        if now < self.due_ms.load(Ordering::Relaxed) {
            return;
        }
        // Under the lock: a release cannot slip in between the check and the put.
        let mut lease = self.lease.lock().unwrap_or_else(|e| e.into_inner());
        if self.released.load(Ordering::Relaxed) {
            return;
        }
        lease.renewed_ms = now;
        lease.expires_ms = now + LEASE_TTL_MS;
        if storage.put_atomic(&lease.name(), &lease.encode()).is_ok() {
            self.due_ms.store(now + LEASE_RENEW_MS, Ordering::Relaxed);
        }
    }

    /// Removes the lease: the save is over (once; later calls do nothing). Returns the
    /// lease's name when it could not be removed (a leftover that expires, which `gc` then
    /// removes).
    pub fn release(&self, storage: &dyn Storage) -> Option<String> {
        let lease = self.lease.lock().unwrap_or_else(|e| e.into_inner());
        if self.released.swap(true, Ordering::Relaxed) {
            return None;
        }
        let name = lease.name();
        storage.delete(&name).err().map(|_| name)
    }
}

/// Runs `body` while a thread renews the leases `holds` (each in its location) every little
/// while, and stops that thread when `body` returns.
pub(crate) fn kept_while<'a, T>(
    holds: impl IntoIterator<Item = (&'a LeaseHold, &'a dyn Storage)>,
    body: impl FnOnce() -> T,
) -> T {
    let holds: Vec<(&LeaseHold, &dyn Storage)> = holds.into_iter().collect();
    if holds.is_empty() {
        return body();
    }
    let stop = (Mutex::new(false), Condvar::new());
    std::thread::scope(|s| {
        let keeper = std::thread::Builder::new().name("tessera-lease".into()).spawn_scoped(s, || {
            let (lock, cv) = &stop;
            let mut stopped = lock.lock().unwrap_or_else(|e| e.into_inner());
            while !*stopped {
                // Wake a few times per renewal period: a renewal that failed is retried soon.
                let (g, _) = cv
                    .wait_timeout(stopped, Duration::from_millis(LEASE_RENEW_MS / 4))
                    .unwrap_or_else(|e| e.into_inner());
                stopped = g;
                if !*stopped {
                    for (hold, storage) in &holds {
                        hold.renew_if_due(*storage);
                    }
                }
            }
        });
        // A keeper that could not start renews nothing: the leases then hold for their TTL from
        // when they were taken, and the save goes on.
        drop(keeper);
        let out = body();
        *stop.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
        stop.1.notify_all();
        out
    })
}

/// Whether `name` is a file the save of `lease` may create, by its format's rule: the native
/// data files of its id; the DCP data files of its numbers and its copy of `common.pt`; the
/// OLMo-core rank files of its names.
pub(crate) fn covers(lease: &Lease, name: &str) -> bool {
    match &lease.files {
        LeaseFiles::Native => crate::format::parse_data_file_name(name).is_some_and(|(id, _)| id == lease.save_id),
        LeaseFiles::Distcp { first, count } => {
            parse_distcp_name(name).is_some_and(|(_, n)| n >= *first && n - first < *count)
                || parse_common_copy_name(name) == Some(lease.save_id)
        }
        LeaseFiles::Olmo { suffix } => parse_rank_file_name(name).is_some_and(|(_, id)| match id {
            0 => suffix.is_empty(),
            id => *suffix == format!("-{id:016x}"),
        }),
    }
}

/// The leases among `names` (a listing of `storage`) that hold now, but `own`'s: the files they
/// cover belong to saves that may still be running. A lease that cannot be read (damaged, or of
/// a newer version) is taken to hold: its save's files cannot be told apart, so none is removed
/// until it expires or an operator breaks it.
pub(crate) fn live_leases(storage: &dyn Storage, names: &[String], own: Option<u64>) -> Vec<LiveLease> {
    let now = now_ms();
    names
        .iter()
        .filter(|n| parse_lease_name(n).is_some_and(|id| Some(id) != own))
        .filter_map(|name| {
            let shown = format!("{}/{name}", storage.location());
            match storage.read(name).and_then(|b| Lease::decode(&b, &shown)) {
                Ok(l) if l.is_live(now) => Some(LiveLease::Read(l)),
                Ok(_) => None,
                // Removed meanwhile: its save is over.
                Err(Error::NotFound { .. }) => None,
                Err(_) => Some(LiveLease::Unreadable),
            }
        })
        .collect()
}

/// A lease that holds, as [`live_leases`] finds it.
#[derive(Debug)]
pub(crate) enum LiveLease {
    /// Read and unexpired.
    Read(Lease),
    /// Not readable: taken to cover every file a save could create.
    Unreadable,
}

impl LiveLease {
    /// Whether `name` may be a file of the lease's save.
    pub fn covers(&self, name: &str) -> bool {
        match self {
            LiveLease::Read(l) => covers(l, name),
            LiveLease::Unreadable => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::lease::example as lease;

    #[test]
    fn a_lease_covers_its_save_files_only() {
        let native = lease(LeaseFiles::Native);
        assert!(covers(&native, "0123456789abcdef-r00003.safetensors"));
        assert!(!covers(&native, "0123456789abcdee-r00003.safetensors") && !covers(&native, "tessera.index"));
        let dcp = lease(LeaseFiles::Distcp { first: 12, count: 2 });
        assert!(covers(&dcp, "__0_12.distcp") && covers(&dcp, "__7_13.distcp"));
        assert!(!covers(&dcp, "__0_14.distcp") && !covers(&dcp, "__0_11.distcp") && !covers(&dcp, ".metadata"));
        assert!(
            covers(&dcp, ".tessera-common-0123456789abcdef.pt") && !covers(&dcp, ".tessera-common-0123456789abcdee.pt")
        );
        let plain = lease(LeaseFiles::Olmo { suffix: String::new() });
        assert!(covers(&plain, "rank_3.safetensors") && !covers(&plain, "rank_3-0123456789abcdef.safetensors"));
        let suffixed = lease(LeaseFiles::Olmo { suffix: "-0123456789abcdef".into() });
        assert!(covers(&suffixed, "rank_3-0123456789abcdef.safetensors") && !covers(&suffixed, "rank_3.safetensors"));
        assert!(native.is_live(8) && !native.is_live(9));
    }
}
