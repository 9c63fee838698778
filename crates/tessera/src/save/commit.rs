//! The one commit protocol of every writer (FORMAT.md, "Save protocol"). Each format says only
//! how rank 0 puts its commit marker ([`Publish`]); when files are removed, and what every rank
//! returns, is decided here, once:
//!
//! - Until rank 0 tries to put the marker, nothing is committed: a failure anywhere fails every
//!   rank, and each removes the files of this save it wrote.
//! - Once the marker's put was tried, the save is committed if the marker reads back as this
//!   save's, not committed if it reads back as anything else (then each rank removes its files,
//!   which no marker names), and of unknown outcome if it cannot be read: then no rank removes
//!   anything ([`Error::CommitUnknown`]), and `gc` decides later from what the marker says.
//! - A rank that does not learn the verdict (a collective failed) removes its files only when
//!   it knows rank 0 cannot have committed (its own write failed); otherwise it keeps them and
//!   reports [`Error::CommitUnknown`].
//! - A failure after the commit (removing the files the new checkpoint replaced) fails nothing:
//!   every rank returns success, with the files left for `gc` listed.

use crate::comm::{wire, Communicator};
use crate::error::{Error, Result};
use crate::model::codec::{Decoder, Encoder};
use crate::save::lease::LeaseHold;
use crate::storage::Storage;

/// What rank 0's put of the commit marker came to.
#[derive(Debug)]
pub(crate) enum Published {
    /// The marker is this save's: committed. `summary` goes to every rank; `leftovers` are files
    /// the commit's cleanup could not remove.
    Committed { summary: Vec<u8>, leftovers: Vec<String> },
    /// The marker is not this save's, and nothing else of it is committed: every rank removes
    /// its files of this save.
    NotCommitted(Error),
    /// The marker may or may not be this save's.
    Unknown(Error),
}

/// A format's commit, run on rank 0 once every rank's files are whole.
pub(crate) trait Publish {
    /// Puts the commit marker (and what belongs beside it) into the first of the save's places,
    /// `storage` (a publisher of several places keeps its own), given every rank's report of
    /// what it wrote (rank order), and says what came of it. Must not remove any file a marker
    /// it put may name unless it knows that marker is not committed.
    fn publish(&mut self, storage: &dyn Storage, reports: &[&[u8]]) -> Published;
}

/// What a committed save tells every rank.
#[derive(Debug, Default)]
pub(crate) struct Committed {
    /// The format's summary of the checkpoint (rank 0's [`Published::Committed`]).
    pub summary: Vec<u8>,
    /// Files left for `gc`: what the commit's cleanup, or this rank's, could not remove.
    pub leftovers: Vec<String>,
}

/// Tags of the verdict rank 0 broadcasts.
const COMMITTED: u8 = 0;
const UNKNOWN: u8 = 1;

/// A location a save writes into: the files this rank wrote there (removed if the save does
/// not commit), and on rank 0 the save's lease there (released once the outcome is settled).
pub(crate) struct Place<'a> {
    pub storage: &'a dyn Storage,
    pub own_files: Vec<String>,
    pub lease: Option<&'a LeaseHold>,
}

/// Ends a write session on every rank: `written` is this rank's report of the files it wrote,
/// or what stopped it; `places` are the locations written (one, or OLMo-core's `model/` and
/// `optim/`); `publish` is called on rank 0 only. The commit's messages name the first place.
pub(crate) fn commit(
    comm: &dyn Communicator,
    places: &[Place<'_>],
    written: Result<Vec<u8>>,
    publish: &mut dyn Publish,
) -> Result<Committed> {
    let storage = places.first().map(|p| p.storage).ok_or_else(|| Error::invalid("a commit without a location"))?;
    let rank = comm.rank();
    let wrote = written.is_ok();
    let mut outcome = run(comm, storage, written, publish);
    // What this rank does with its own files.
    let remove = match &outcome {
        Ok(_) => false,
        Err(Step::Gather(_)) => rank == 0 || !wrote,
        Err(Step::Failed(_)) => true,
        Err(Step::Unknown(_)) => false,
        Err(Step::Verdict(_)) => !wrote,
        Err(Step::Untold(_)) => false,
    };
    // Names relative to the location; with several locations, `location/name`.
    let mut leftovers = Vec::new();
    for p in places {
        let mut left = Vec::new();
        if remove {
            left.extend(remove_files(p.storage, &p.own_files));
        }
        if let Some(l) = p.lease {
            left.extend(l.release(p.storage));
        }
        let qualify = places.len() > 1;
        leftovers.extend(left.into_iter().map(|n| if qualify { format!("{}/{n}", p.storage.location()) } else { n }));
    }
    let location = storage.location();
    match &mut outcome {
        Ok(c) => {
            c.leftovers.extend(leftovers);
            c.leftovers.sort();
            c.leftovers.dedup();
        }
        Err(step) if !leftovers.is_empty() => step.note_leftovers(&location, &leftovers),
        Err(_) => {}
    }
    outcome.map_err(|step| step.into_error(&location, wrote))
}

/// Where the protocol stopped, and why.
enum Step {
    /// The all-gather of the write reports failed on this rank.
    Gather(Error),
    /// The save failed and nothing of it is committed.
    Failed(Error),
    /// The save's outcome is unknown to every rank (rank 0 said so).
    Unknown(Error),
    /// The verdict did not reach this rank.
    Verdict(Error),
    /// Rank 0 committed, and could not tell the other ranks.
    Untold(Error),
}

impl Step {
    fn note_leftovers(&mut self, location: &str, names: &[String]) {
        let note = format!(
            "; {} of this save's files could not be removed ({}): run `tessera gc {location}`",
            names.len(),
            names.join(", ")
        );
        let e = match self {
            Step::Gather(e) | Step::Failed(e) | Step::Unknown(e) | Step::Verdict(e) | Step::Untold(e) => e,
        };
        *e = with_note(std::mem::replace(e, Error::Cancelled), &note);
    }

    fn into_error(self, location: &str, wrote: bool) -> Error {
        match self {
            Step::Failed(e) | Step::Unknown(e) | Step::Untold(e) => e,
            Step::Gather(e) | Step::Verdict(e) if !wrote => e,
            Step::Gather(e) => Error::CommitUnknown {
                path: location.into(),
                reason: format!("the ranks' write reports could not be exchanged ({e})"),
            },
            Step::Verdict(e) => {
                Error::CommitUnknown { path: location.into(), reason: format!("rank 0's verdict did not arrive ({e})") }
            }
        }
    }
}

/// `e` with `note` added to its text (its variant kept where it has a text).
fn with_note(e: Error, note: &str) -> Error {
    match e {
        Error::Io { path, source } => Error::Io { path, source: std::io::Error::other(format!("{source}{note}")) },
        Error::Comm { reason } => Error::Comm { reason: format!("{reason}{note}") },
        Error::PeerFailed { rank, message } => Error::PeerFailed { rank, message: format!("{message}{note}") },
        Error::InvalidArgument { reason } => Error::InvalidArgument { reason: format!("{reason}{note}") },
        Error::Corrupt { path, reason } => Error::Corrupt { path, reason: format!("{reason}{note}") },
        Error::CommitUnknown { path, reason } => Error::CommitUnknown { path, reason: format!("{reason}{note}") },
        // Variants without a free text keep their meaning; the leftovers are gc's to find.
        other => other,
    }
}

fn run(
    comm: &dyn Communicator,
    storage: &dyn Storage,
    written: Result<Vec<u8>>,
    publish: &mut dyn Publish,
) -> std::result::Result<Committed, Step> {
    let rank = comm.rank();
    let gathered = comm.all_gather(&wire::outcome(&written, |r| r.clone())).map_err(Step::Gather)?;
    let mut own = written.err();
    let reports = wire::outcomes(&gathered, rank, &mut own).map_err(Step::Failed)?;

    let mut mine = None;
    let mut msg = Vec::new();
    if rank == 0 {
        let published = publish.publish(storage, &reports);
        msg = verdict_message(&published);
        mine = Some(published);
    }
    drop(gathered);
    let verdict = match comm.broadcast(&msg, 0) {
        Ok(v) => v,
        Err(e) => {
            return match mine {
                // Rank 0 knows; only its peers do not.
                Some(Published::Committed { .. }) => Err(Step::Untold(Error::Comm {
                    reason: format!(
                        "the checkpoint at {} is committed, but the other ranks could not be told: {e}",
                        storage.location()
                    ),
                })),
                Some(Published::NotCommitted(err)) => Err(Step::Failed(err)),
                Some(Published::Unknown(err)) => Err(Step::Unknown(unknown(storage, err))),
                None => Err(Step::Verdict(e)),
            };
        }
    };
    if let Some(published) = mine {
        // Rank 0 keeps its own error's type.
        return match published {
            Published::Committed { summary, leftovers } => Ok(Committed { summary, leftovers }),
            Published::NotCommitted(err) => Err(Step::Failed(err)),
            Published::Unknown(err) => Err(Step::Unknown(unknown(storage, err))),
        };
    }
    read_verdict(&verdict).map_err(|e| match e {
        Verdict::Failed(err) => Step::Failed(err),
        Verdict::Unknown(reason) => Step::Unknown(Error::CommitUnknown { path: storage.location().into(), reason }),
        Verdict::Malformed(err) => Step::Verdict(err),
    })
}

/// `err` as the error of a commit of unknown outcome.
fn unknown(storage: &dyn Storage, err: Error) -> Error {
    match err {
        Error::CommitUnknown { .. } => err,
        other => Error::CommitUnknown { path: storage.location().into(), reason: other.to_string() },
    }
}

fn verdict_message(p: &Published) -> Vec<u8> {
    let mut e = Encoder::default();
    match p {
        Published::Committed { summary, leftovers } => {
            e.u8(COMMITTED);
            e.bytes(summary);
            e.var(leftovers.len() as u64);
            for l in leftovers {
                e.str(l);
            }
        }
        Published::Unknown(err) => {
            e.u8(UNKNOWN);
            e.str(&match err {
                Error::CommitUnknown { reason, .. } => reason.clone(),
                other => other.to_string(),
            });
        }
        Published::NotCommitted(err) => return wire::failed(err),
    }
    wire::ok(&e.buf)
}

enum Verdict {
    Failed(Error),
    Unknown(String),
    Malformed(Error),
}

fn read_verdict(msg: &[u8]) -> std::result::Result<Committed, Verdict> {
    let malformed = |why: String| Verdict::Malformed(Error::Comm { reason: format!("bad verdict from rank 0: {why}") });
    let payload = match wire::read(msg).map_err(malformed)? {
        Ok(p) => p,
        Err(failure) => return Err(Verdict::Failed(failure.into_peer_error(0))),
    };
    let mut d = Decoder::new(payload);
    match d.u8().map_err(malformed)? {
        COMMITTED => {
            let summary = d.bytes().map_err(malformed)?.to_vec();
            let n = d.count().map_err(malformed)?;
            let leftovers = (0..n).map(|_| d.str()).collect::<std::result::Result<_, _>>().map_err(malformed)?;
            Ok(Committed { summary, leftovers })
        }
        UNKNOWN => Err(Verdict::Unknown(d.str().map_err(malformed)?)),
        tag => Err(malformed(format!("unknown tag {tag}"))),
    }
}

/// Removes `names` (this rank's files of a save that did not commit); returns those that could
/// not be removed.
pub(crate) fn remove_files(storage: &dyn Storage, names: &[String]) -> Vec<String> {
    names.iter().filter(|n| !matches!(storage.delete(n), Ok(()) | Err(Error::NotFound { .. }))).cloned().collect()
}

/// How rank 0 classifies the put of the commit marker `marker` (a name in `storage`): `put` is
/// the put's result, `ours` reads the marker back and says whether it is this save's
/// (`Ok(true)`), another's or absent (`Ok(false)`), or could not be read (`Err`). A put that
/// failed may still have taken effect (a response lost on its way back; a conditional put
/// retried after it succeeded, then refused), so its error decides nothing alone.
/// `check_after_success` reads back even after a put that succeeded: for a create-if-absent
/// that is not atomic, where a concurrent commit may have slipped in.
pub(crate) fn classify_put(
    storage: &dyn Storage,
    marker: &str,
    put: Result<()>,
    check_after_success: bool,
    ours: impl FnOnce() -> Result<bool>,
) -> std::result::Result<(), Published> {
    let unknown = |reason: String| Published::Unknown(Error::CommitUnknown { path: storage.location().into(), reason });
    match put {
        Ok(()) if !check_after_success => Ok(()),
        Ok(()) => match ours() {
            Ok(true) => Ok(()),
            // Another save's marker replaced this one (a create-if-absent that is not atomic).
            Ok(false) => Err(Published::NotCommitted(Error::AlreadyExists { path: storage.location().into() })),
            Err(e) => Err(unknown(format!("{marker} was put, and could not be read back to check it ({e})"))),
        },
        Err(put_error) => match ours() {
            Ok(true) => Ok(()),
            Ok(false) => Err(Published::NotCommitted(put_error)),
            Err(read_error) => Err(unknown(format!(
                "the put of {marker} failed ({put_error}) and it could not be read back ({read_error})"
            ))),
        },
    }
}
