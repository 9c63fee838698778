//! The `tessera` command's end-to-end tests, one binary: `cli` runs every command on local
//! directories and object stores, `hostile_rss` on hostile checkpoints under a memory bound.

mod cli;
mod hostile_rss;
