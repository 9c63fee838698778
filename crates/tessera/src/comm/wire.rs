//! The one encoding of what ranks send each other in collectives: the outcome of a step (ok
//! with a payload, or the error that stopped the rank), and the small values exchanged beside
//! the plans (a list of keys, the messages of an all-to-all carried by one all-gather).
//!
//! Every rank that fails still takes part in the collective its peers make, sending its
//! error instead of its payload; every rank receives the same messages and so stops with the
//! same verdict ([`outcomes`]). The failing rank returns its own error; a peer re-raises it as
//! [`Failure::into_peer_error`] says.
//!
//! # Format (built on [`crate::model::codec`]: LEB128 varints, length-prefixed UTF-8 strings)
//!
//! ```text
//! outcome  := 0x00 payload…                 ok; the payload is the rest of the message
//!           | 0x01 failure                  the sender failed; nothing follows the failure
//! failure  := kind:u8 subject:str reason:str text:str
//!             kind     the Error variant (see Kind; codes are fixed)
//!             subject  the key or path the error names ("" when it names none)
//!             reason   the variant's reason (or region) for that key or path ("" if none)
//!             text     the error as displayed on the rank that failed
//! strings  := str*                          to the end of the message (empty: no string)
//! messages := count:var bytes{count}        an all-to-all's messages, one per rank
//! ```
//!
//! Decoding never panics: malformed bytes give [`Error::Comm`] naming the sender.

use crate::error::{Error, Result};
use crate::model::codec::{Decoder, Encoder};

/// First byte of an outcome message that reports success.
const OK: u8 = 0;
/// First byte of an outcome message that carries a failure.
const FAILED: u8 = 1;

/// Which [`Error`] variant a [`Failure`] came from. The codes are part of the wire format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// [`Error::NotFound`].
    NotFound = 1,
    /// [`Error::NotCommitted`].
    NotCommitted = 2,
    /// [`Error::AlreadyExists`].
    AlreadyExists = 3,
    /// [`Error::Corrupt`].
    Corrupt = 4,
    /// [`Error::IncompatibleVersion`].
    IncompatibleVersion = 5,
    /// [`Error::InvalidSharding`].
    InvalidSharding = 6,
    /// [`Error::NotCovered`].
    NotCovered = 7,
    /// [`Error::Mismatch`].
    Mismatch = 8,
    /// [`Error::KeyMismatch`].
    KeyMismatch = 9,
    /// [`Error::UnknownStrategy`].
    UnknownStrategy = 10,
    /// [`Error::InvalidArgument`].
    InvalidArgument = 11,
    /// [`Error::PeerFailed`].
    PeerFailed = 12,
    /// [`Error::Comm`].
    Comm = 13,
    /// [`Error::Cancelled`].
    Cancelled = 14,
    /// [`Error::Io`].
    Io = 15,
    /// [`Error::AccessDenied`].
    AccessDenied = 16,
    /// [`Error::CommitUnknown`].
    CommitUnknown = 17,
}

impl Kind {
    const ALL: [Kind; 17] = [
        Kind::NotFound,
        Kind::NotCommitted,
        Kind::AlreadyExists,
        Kind::Corrupt,
        Kind::IncompatibleVersion,
        Kind::InvalidSharding,
        Kind::NotCovered,
        Kind::Mismatch,
        Kind::KeyMismatch,
        Kind::UnknownStrategy,
        Kind::InvalidArgument,
        Kind::PeerFailed,
        Kind::Comm,
        Kind::Cancelled,
        Kind::Io,
        Kind::AccessDenied,
        Kind::CommitUnknown,
    ];

    fn from_code(code: u8) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| *k as u8 == code)
    }
}

/// An error as it travels to the other ranks: its variant, the key or path it names, its
/// reason, and its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    kind: Kind,
    subject: String,
    reason: String,
    text: String,
}

impl Failure {
    /// What `e` tells the other ranks.
    pub fn of(e: &Error) -> Failure {
        let path = |p: &std::path::Path| p.to_string_lossy().into_owned();
        let (kind, subject, reason) = match e {
            Error::NotFound { path: p, .. } => (Kind::NotFound, path(p), String::new()),
            Error::NotCommitted { path: p, .. } => (Kind::NotCommitted, path(p), String::new()),
            Error::AlreadyExists { path: p } => (Kind::AlreadyExists, path(p), String::new()),
            Error::Corrupt { path: p, reason } => (Kind::Corrupt, path(p), reason.clone()),
            Error::IncompatibleVersion { found, .. } => (Kind::IncompatibleVersion, String::new(), found.clone()),
            Error::InvalidSharding { key, reason } => (Kind::InvalidSharding, key.clone(), reason.clone()),
            Error::NotCovered { key, region } => (Kind::NotCovered, key.clone(), region.clone()),
            Error::Mismatch { key, reason } => (Kind::Mismatch, key.clone(), reason.clone()),
            Error::KeyMismatch { .. } => (Kind::KeyMismatch, String::new(), String::new()),
            Error::UnknownStrategy { backend, .. } => (Kind::UnknownStrategy, String::new(), backend.clone()),
            Error::InvalidArgument { reason } => (Kind::InvalidArgument, String::new(), reason.clone()),
            Error::PeerFailed { message, .. } => (Kind::PeerFailed, String::new(), message.clone()),
            Error::Comm { reason } => (Kind::Comm, String::new(), reason.clone()),
            Error::Cancelled => (Kind::Cancelled, String::new(), String::new()),
            Error::Io { path: p, source } => (Kind::Io, path(p), source.to_string()),
            Error::AccessDenied { path: p, reason } => (Kind::AccessDenied, path(p), reason.clone()),
            Error::CommitUnknown { path: p, reason } => (Kind::CommitUnknown, path(p), reason.clone()),
        };
        Failure { kind, subject, reason, text: e.to_string() }
    }

    /// The error a peer of `rank` (the rank that failed) raises for this failure. Errors about
    /// what the ranks share keep their variant and name the same key or path: an invalid
    /// sharding (its reason prefixed with the failing rank), a checkpoint already at the
    /// location, a commit whose outcome is unknown. Any other error is that rank's own: [`Error::PeerFailed`] with its text.
    pub fn into_peer_error(self, rank: usize) -> Error {
        match self.kind {
            Kind::InvalidSharding => Error::sharding(self.subject, format!("rank {rank}: {}", self.reason)),
            Kind::AlreadyExists => Error::AlreadyExists { path: self.subject.into() },
            Kind::CommitUnknown => Error::CommitUnknown { path: self.subject.into(), reason: self.reason },
            _ => Error::PeerFailed { rank, message: self.text },
        }
    }

    /// Appends the failure to `e`.
    fn encode(&self, e: &mut Encoder) {
        e.u8(self.kind as u8);
        e.str(&self.subject);
        e.str(&self.reason);
        e.str(&self.text);
    }

    /// Reads a failure from `d`.
    fn decode(d: &mut Decoder<'_>) -> Result<Failure, String> {
        let code = d.u8()?;
        let kind = Kind::from_code(code).ok_or_else(|| format!("unknown failure kind {code}"))?;
        Ok(Failure { kind, subject: d.str()?, reason: d.str()?, text: d.str()? })
    }
}

/// An outcome message reporting success, with `payload`.
pub fn ok(payload: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(1 + payload.len());
    begin_ok(&mut m);
    m.extend_from_slice(payload);
    m
}

/// Makes `buf` the start of an outcome message reporting success: the caller appends the
/// payload (which may be large: nothing is copied).
pub fn begin_ok(buf: &mut Vec<u8>) {
    buf.clear();
    buf.push(OK);
}

/// An outcome message carrying the failure `e`.
pub fn failed(e: &Error) -> Vec<u8> {
    let mut enc = Encoder::default();
    enc.u8(FAILED);
    Failure::of(e).encode(&mut enc);
    enc.buf
}

/// The outcome message of `r`: its payload (as `payload` encodes it) or its failure.
pub fn outcome<T>(r: &Result<T>, payload: impl FnOnce(&T) -> Vec<u8>) -> Vec<u8> {
    match r {
        Ok(v) => ok(&payload(v)),
        Err(e) => failed(e),
    }
}

/// Reads an outcome message: the payload, or the failure it carries; `Err` when the bytes are
/// not an outcome message.
pub fn read(msg: &[u8]) -> Result<std::result::Result<&[u8], Failure>, String> {
    match msg.split_first() {
        Some((&OK, payload)) => Ok(Ok(payload)),
        Some((&FAILED, rest)) => {
            let mut d = Decoder::new(rest);
            let f = Failure::decode(&mut d)?;
            if !d.is_done() {
                return Err(format!("{} trailing bytes after a failure", d.remaining()));
            }
            Ok(Err(f))
        }
        Some((&tag, _)) => Err(format!("unknown outcome tag {tag}")),
        None => Err("empty message".into()),
    }
}

/// The payloads of every rank's outcome message (`msgs`, indexed by rank, as a collective
/// gives them to rank `me`), or the first failure any rank reported, in rank order: this
/// rank's own error (`local`, taken) keeps its type; another rank's is raised as
/// [`Failure::into_peer_error`] says. A message that is not an outcome message fails with
/// [`Error::Comm`] naming its sender. Every rank gets the same messages, so the same verdict.
pub fn outcomes<'m>(msgs: &'m [Vec<u8>], me: usize, local: &mut Option<Error>) -> Result<Vec<&'m [u8]>> {
    let mut payloads = Vec::with_capacity(msgs.len());
    for (r, m) in msgs.iter().enumerate() {
        match read(m) {
            Ok(Ok(payload)) => payloads.push(payload),
            Ok(Err(failure)) => {
                return Err(match local.take() {
                    Some(own) if r == me => own,
                    _ => failure.into_peer_error(r),
                })
            }
            Err(why) => return Err(Error::Comm { reason: format!("malformed message from rank {r}: {why}") }),
        }
    }
    Ok(payloads)
}

/// Encodes a list of strings (keys).
pub fn strings<S: AsRef<str>>(items: &[S]) -> Vec<u8> {
    let mut e = Encoder::default();
    for s in items {
        e.str(s.as_ref());
    }
    e.buf
}

/// Decodes [`strings`].
pub fn read_strings(buf: &[u8]) -> Result<Vec<&str>, String> {
    let mut d = Decoder::new(buf);
    let mut out = Vec::new();
    while !d.is_done() {
        let b = d.bytes()?;
        out.push(std::str::from_utf8(b).map_err(|_| "string is not UTF-8".to_string())?);
    }
    Ok(out)
}

/// Encodes the messages of an all-to-all (one per rank) as one message.
pub fn messages(send: &[Vec<u8>]) -> Vec<u8> {
    let mut e = Encoder::default();
    e.var(send.len() as u64);
    for m in send {
        e.bytes(m);
    }
    e.buf
}

/// From the messages a rank encoded with [`messages`] for `world` ranks, the one addressed to
/// rank `me`; fails unless there is exactly one per rank.
pub fn message_for(buf: &[u8], world: usize, me: usize) -> Result<&[u8], String> {
    let mut d = Decoder::new(buf);
    let n = d.var()?;
    if n != world as u64 {
        return Err(format!("{n} messages for {world} ranks"));
    }
    for _ in 0..me {
        d.bytes()?;
    }
    d.bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_variant() -> Vec<Error> {
        vec![
            Error::not_found("/ck/a.bin"),
            Error::not_committed("/ck"),
            Error::AlreadyExists { path: "s3://b/ck".into() },
            Error::corrupt("/ck/f", "checksum mismatch"),
            Error::IncompatibleVersion { found: "9".into(), supported: "1, 2".into() },
            Error::sharding("w", "gap at [0, 4)"),
            Error::NotCovered { key: "w".into(), region: "[0:2]".into() },
            Error::Mismatch { key: "w".into(), reason: "dtype differs".into() },
            Error::KeyMismatch { unexpected: vec!["x".into()], missing: vec!["y".into()] },
            Error::UnknownStrategy { backend: "zz".into(), version: 3, action: "load".into() },
            Error::invalid("bad buffer"),
            Error::PeerFailed { rank: 3, message: "disk full".into() },
            Error::Comm { reason: "gone".into() },
            Error::Cancelled,
            Error::Io { path: "/ck/f".into(), source: std::io::Error::other("disk full") },
            Error::AccessDenied { path: "s3://b/ck".into(), reason: "no S3 credentials found".into() },
            Error::CommitUnknown { path: "s3://b/ck".into(), reason: "the put of tessera.index timed out".into() },
        ]
    }

    #[test]
    fn failures_round_trip_and_keep_what_peers_need() {
        let kinds: Vec<Kind> = every_variant().iter().map(|e| Failure::of(e).kind).collect();
        assert_eq!(kinds, Kind::ALL.to_vec(), "one kind per variant");
        for e in every_variant() {
            let msg = failed(&e);
            let f = read(&msg).unwrap().unwrap_err();
            assert_eq!(f, Failure::of(&e));
            assert_eq!(f.text, e.to_string());
            let peer = f.into_peer_error(2);
            match (&e, &peer) {
                (Error::InvalidSharding { key, reason }, Error::InvalidSharding { key: k, reason: r }) => {
                    assert_eq!(k, key);
                    assert_eq!(r, &format!("rank 2: {reason}"));
                }
                (Error::AlreadyExists { path }, Error::AlreadyExists { path: p }) => assert_eq!(p, path),
                (Error::CommitUnknown { path, reason }, Error::CommitUnknown { path: p, reason: r }) => {
                    assert_eq!((p, r), (path, reason))
                }
                (_, Error::PeerFailed { rank: 2, message }) => assert_eq!(message, &e.to_string()),
                _ => panic!("{e:?} became {peer:?}"),
            }
        }
    }

    #[test]
    fn outcomes_report_the_first_failure_in_rank_order() {
        let msgs = vec![ok(b"a"), failed(&Error::invalid("one")), failed(&Error::sharding("k", "two"))];
        // Rank 1's own error keeps its type (and is taken); the others see rank 1's as a peer's.
        let mut own = Some(Error::invalid("one"));
        assert!(matches!(outcomes(&msgs, 1, &mut own), Err(Error::InvalidArgument { .. })));
        assert!(own.is_none());
        let r = outcomes(&msgs, 0, &mut None);
        assert!(matches!(r, Err(Error::PeerFailed { rank: 1, ref message }) if message.contains("one")), "{r:?}");
        let r = outcomes(&msgs[2..], 0, &mut None);
        assert!(matches!(r, Err(Error::InvalidSharding { ref key, .. }) if key == "k"), "{r:?}");
        let good = vec![ok(b"a"), ok(b""), ok(&[0, 1])];
        assert_eq!(outcomes(&good, 0, &mut None).unwrap(), vec![&b"a"[..], &b""[..], &[0, 1][..]]);
        let mut buf = vec![9, 9];
        begin_ok(&mut buf);
        buf.extend_from_slice(b"xy");
        assert_eq!(read(&buf).unwrap().unwrap(), b"xy");
        assert_eq!(outcome(&Ok(7u8), |v| vec![*v]), ok(&[7]));
        assert_eq!(outcome::<u8>(&Err(Error::Cancelled), |v| vec![*v]), failed(&Error::Cancelled));
    }

    #[test]
    fn malformed_messages_are_errors_not_panics() {
        let good = failed(&Error::sharding("w", "gap"));
        // Every truncation, every single-byte change and some garbage: never a panic.
        for n in 0..good.len() {
            let _ = read(&good[..n]);
        }
        for i in 0..good.len() {
            for b in [0u8, 1, 0x7f, 0x80, 0xff] {
                let mut m = good.clone();
                m[i] = b;
                let _ = read(&m);
            }
        }
        assert!(read(&[]).is_err());
        assert!(read(&[7]).is_err());
        assert!(read(&[FAILED]).is_err());
        assert!(read(&[FAILED, 99, 0, 0, 0]).unwrap_err().contains("unknown failure kind"));
        assert!(read(&[FAILED, 6, 1, 0xff, 0, 0]).unwrap_err().contains("UTF-8"));
        assert!(read(&[good.as_slice(), &[0]].concat()).unwrap_err().contains("trailing"));
        for (r, bad) in [Vec::new(), vec![7, 1], vec![FAILED, 6, 200]].into_iter().enumerate() {
            let msgs = vec![ok(b""), bad];
            match outcomes(&msgs, 0, &mut None) {
                Err(Error::Comm { reason }) => assert!(reason.contains("rank 1"), "{r}: {reason}"),
                other => panic!("{r}: {other:?}"),
            }
        }
    }

    #[test]
    fn strings_and_messages_round_trip() {
        let keys = ["a", "", "b\0c", "ünï"];
        assert_eq!(read_strings(&strings(&keys)).unwrap(), keys);
        assert!(read_strings(&strings::<&str>(&[])).unwrap().is_empty());
        assert!(read_strings(&[3, b'a']).is_err());
        assert!(read_strings(&[1, 0xff]).is_err());
        let send = vec![b"x".to_vec(), Vec::new(), b"yz".to_vec()];
        let buf = messages(&send);
        for (me, m) in send.iter().enumerate() {
            assert_eq!(message_for(&buf, 3, me).unwrap(), m.as_slice());
        }
        assert!(message_for(&buf, 2, 0).unwrap_err().contains("3 messages for 2 ranks"));
        assert!(message_for(&buf[..buf.len() - 1], 3, 2).is_err());
        assert!(message_for(&[], 1, 0).is_err());
        assert!(message_for(&[0xff; 11], 1, 0).is_err());
    }
}
