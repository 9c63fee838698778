//! The synthetic checkpoint every demo and benchmark saves and loads, and the runner that does
//! it: a GPT-like model with Adam state ([`model`]) whose contents are a pure function of key
//! and element index, so that any layout it is loaded under can be checked byte by byte;
//! saving and loading it over in-process ranks, timed between barriers ([`jobs`], on the
//! helpers of [`ranks`]); and what both report with ([`progress`], [`sizes`], [`system`]).
//!
//! Used by `tessera demo` (the `tessera-cli` crate, which also uses [`progress`] and [`sizes`]
//! in its other commands) and by the benchmarks (`tessera-bench`). It depends only on the
//! `tessera` library: neither binary's crate is needed to build it, and the benchmarks are not
//! part of the `tessera` command (nor of the Python wheel that embeds it).

#![deny(missing_docs)]

pub mod jobs;
pub mod model;
pub mod progress;
pub mod ranks;
pub mod sizes;
pub mod system;
