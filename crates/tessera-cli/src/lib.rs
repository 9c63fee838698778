//! The `tessera` command: demo, inspect, verify and gc for tessera checkpoints; unshard,
//! convert and diff for any readable checkpoint. One implementation, [`run`], behind the
//! `tessera` binary (`src/main.rs`) and the `tessera` console script `pip install` gives
//! (`tessera._native.cli`).
//!
//! Only [`run`] is public. The demo's synthetic model and the in-process ranks that save and
//! load it, and the progress, size and OS helpers the commands share with the benchmarks, are
//! the `tessera-synth` crate; the benchmarks (`tessera-bench`) do not depend on this one.

#![deny(missing_docs)]

mod convert;
mod demo;
mod diff;
mod gc;
mod inspect;
mod keys;
mod location;
mod unshard;
mod verify;

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use tessera_synth::{progress, sizes, system};

use crate::location::Location;

#[derive(Parser)]
#[command(
    name = "tessera",
    version,
    about = "Distributed checkpoints: demo, inspect, verify, gc, unshard, convert, diff",
    after_help = "Locations: a local directory, or an object-store URL: s3://bucket/prefix, gs://bucket/prefix, \
                  az://container/prefix. Stores are configured as the clouds' tools are: S3 from AWS_ACCESS_KEY_ID \
                  / AWS_SECRET_ACCESS_KEY (/ AWS_SESSION_TOKEN), AWS_ENDPOINT_URL, AWS_REGION, AWS_ALLOW_HTTP=true \
                  or the AWS_PROFILE of ~/.aws/credentials and ~/.aws/config; GCS from GOOGLE_SERVICE_ACCOUNT or \
                  GOOGLE_APPLICATION_CREDENTIALS (a JSON key file; gcs_base_url and disable_oauth in it reach an \
                  emulator); Azure from AZURE_STORAGE_ACCOUNT_NAME + AZURE_STORAGE_ACCOUNT_KEY, \
                  AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_USE_EMULATOR=true (Azurite); cloud VMs from \
                  their instance metadata. --storage-option KEY=VALUE (object_store's keys) overrides any of it."
)]
struct Cli {
    #[command(flatten)]
    progress: progress::ProgressArg,
    #[command(flatten)]
    storage: location::StorageOptionArg,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Save a GPT-like model + Adam state from 8 ranks (TP=4 × DP=2), load it under
    /// TP=2 × PP=2 and under 1 rank, and check every byte (exit 0 only if all match).
    Demo {
        /// Checkpoint location (a directory or s3://bucket/prefix), kept afterwards (a checkpoint
        /// an earlier demo wrote there is overwritten; any other is refused). Without it, a new
        /// temporary directory is used and removed.
        #[arg(long)]
        dir: Option<String>,
        /// Approximate checkpoint size (e.g. 64MiB, 1GiB, 512MB).
        #[arg(long, default_value = "1GiB")]
        size: String,
    },
    /// Show what a checkpoint holds: format, tensors, objects, common state, metadata.
    Inspect {
        /// Checkpoint location: a directory or s3://bucket/prefix.
        dir: String,
        /// Print one JSON object (format, tensors, objects, common, content_metadata).
        #[arg(long, conflicts_with = "index_json")]
        json: bool,
        /// Dump the whole index as JSON, every chunk included.
        #[arg(long)]
        index_json: bool,
    },
    /// Check the index, coverage and every checksum; exit 1 if anything is wrong. Files of
    /// failed or replaced saves beside the checkpoint are listed (`tessera gc` removes them).
    Verify {
        /// Checkpoint location: a directory or s3://bucket/prefix.
        dir: String,
        /// Print one JSON object (location, sound, files, chunks, bytes_checked, checksummed,
        /// problems, leftovers, error).
        #[arg(long)]
        json: bool,
    },
    /// Remove the leftovers of saves that never committed or were replaced: data files no
    /// committed marker names (tessera.index, a DCP .metadata, OLMo-core's metadata.json),
    /// temporaries of puts older than a lease's lifetime, expired leases. Safe beside running
    /// saves: a save holds a lease (.tessera-lease-<id>, renewed while it runs, expiring 10
    /// minutes after its last renewal), and gc leaves its files alone and lists it. Works on
    /// native, torch_dist / DCP and OLMo-core locations (for OLMo-core's model/ and optim/, on
    /// each); never touches a file a committed marker names, nor files of other kinds.
    #[command(verbatim_doc_comment)]
    Gc {
        /// Checkpoint location: a directory or s3://bucket/prefix.
        dir: String,
        /// Assert that no save into this location is running (after a job was killed): treat
        /// every lease as expired, and also remove the common.pt and metadata.json of a
        /// torch_dist save that never committed.
        #[arg(long)]
        break_leases: bool,
    },
    /// Export the tensors as plain Hugging Face safetensors (whole tensors, sorted keys): one
    /// file, or with --max-shard-size shards plus model.safetensors.index.json. Streams with
    /// bounded memory (--memory).
    Unshard {
        /// Checkpoint location (any readable format): a directory or s3://bucket/prefix.
        src: String,
        /// Output: a .safetensors file (a new name or a regular file, replaced), or a directory
        /// (an existing one, or a path ending with /, created) that receives model.safetensors,
        /// or with --max-shard-size the shards and model.safetensors.index.json; outside the
        /// source checkpoint.
        #[arg(long)]
        out: PathBuf,
        /// Write shards of at most this size (e.g. 5GB, 500MiB, bytes); a larger tensor gets a
        /// file of its own.
        #[arg(long, value_name = "SIZE")]
        max_shard_size: Option<String>,
        /// Export only the tensors whose key matches this regular expression (anywhere in the
        /// key; anchor with ^...$).
        #[arg(long, value_name = "REGEX")]
        keys: Option<String>,
        /// Cast floating-point tensors to this type (integer, bool and fp8 tensors are kept).
        #[arg(long, value_parser = ["bf16", "f16", "f32", "f64"])]
        dtype: Option<String>,
        /// Rename keys that start with FROM to start with TO instead (repeatable; the first
        /// matching rule applies), e.g. --rename model.=  or  --rename decoder.=model.
        #[arg(long, value_name = "FROM=TO")]
        rename: Vec<String>,
        /// Remove this prefix from the keys that start with it (repeatable; --rename PREFIX=,
        /// applied after the --rename rules), e.g. --strip-prefix model. for a Hugging Face layout.
        #[arg(long, value_name = "PREFIX")]
        strip_prefix: Vec<String>,
        /// About the most tensor bytes held in memory at once (at least one checksum block of the
        /// source).
        #[arg(long, value_name = "SIZE", default_value = "512MiB")]
        memory: String,
    },
    /// Convert a checkpoint (any readable format) into the native format, keeping its chunks,
    /// or (--to dcp) into a Megatron torch_dist / PyTorch DCP checkpoint; refuses a destination
    /// holding a committed checkpoint unless --overwrite.
    Convert {
        /// Source location: a directory or s3://bucket/prefix.
        src: String,
        /// Destination location: a directory or s3://bucket/prefix.
        dst: String,
        /// Format to write: tessera's native format, or a DCP directory as Megatron's torch_dist
        /// backend writes it (.metadata, __N_0.distcp, metadata.json, common.pt), which
        /// torch.distributed.checkpoint and megatron-core load.
        #[arg(long, value_parser = ["native", "dcp", "torch_dist"], default_value = "native")]
        to: String,
        /// Replace a committed checkpoint at the destination.
        #[arg(long)]
        overwrite: bool,
        /// About the most bytes held in memory at once.
        #[arg(long, value_name = "SIZE", default_value = "512MiB")]
        memory: String,
    },
    /// Compare two checkpoints (any readable formats): tensors (keys, dtypes, shapes, values),
    /// sharded objects, common state, content metadata. Exit 0 when equal, 1 when they differ,
    /// 2 on errors.
    Diff {
        /// First checkpoint: a directory or s3://bucket/prefix.
        a: String,
        /// Second checkpoint: a directory or s3://bucket/prefix.
        b: String,
        /// Absolute tolerance on element values (compared as f64, NaN equal to NaN); 0 compares
        /// bytes when dtypes match.
        #[arg(long, default_value_t = 0.0)]
        atol: f64,
        /// Compare only the tensors and objects whose key matches this regular expression (the
        /// common state is then not compared).
        #[arg(long, value_name = "REGEX")]
        keys: Option<String>,
        /// Print one JSON object (a, b, equal, tensors, objects, common, content_metadata and
        /// what was compared).
        #[arg(long)]
        json: bool,
    },
}

impl Command {
    /// The checkpoint locations the command reads (as given), for its error messages.
    fn locations(&self) -> Vec<String> {
        match self {
            Command::Inspect { dir, .. } | Command::Verify { dir, .. } | Command::Gc { dir, .. } => vec![dir.clone()],
            Command::Unshard { src, .. } => vec![src.clone()],
            Command::Convert { src, .. } => vec![src.clone()],
            Command::Diff { a, b, .. } => vec![a.clone(), b.clone()],
            Command::Demo { .. } => Vec::new(),
        }
    }
}

fn dispatch(command: Command, options: &[(String, String)]) -> Result<u8> {
    let loc = |s: &str| Location::parse(s).with_options(options);
    match command {
        Command::Demo { dir, size } => {
            demo::run(demo::DemoArgs { dir: dir.as_deref().map(loc), size: sizes::parse_size(&size)? })
        }
        Command::Inspect { dir, json, index_json } => {
            let format = match (json, index_json) {
                (_, true) => inspect::Format::IndexJson,
                (true, false) => inspect::Format::Json,
                (false, false) => inspect::Format::Text,
            };
            inspect::run(&loc(&dir), format)?;
            Ok(0)
        }
        Command::Verify { dir, json } => verify::run(&loc(&dir), json),
        Command::Gc { dir, break_leases } => {
            gc::run(&loc(&dir), break_leases)?;
            Ok(0)
        }
        Command::Unshard { src, out, max_shard_size, keys, dtype, rename, strip_prefix, memory } => {
            let mut rules = Vec::new();
            for r in &rename {
                let Some((from, to)) = r.split_once('=') else { bail!("--rename {r:?}: give FROM=TO") };
                if from.is_empty() {
                    bail!("--rename {r:?}: FROM is empty");
                }
                rules.push((from.to_string(), to.to_string()));
            }
            rules.extend(strip_prefix.into_iter().map(|p| (p, String::new())));
            unshard::run(unshard::UnshardArgs {
                rename: rules,
                src: loc(&src),
                out,
                max_shard_size: max_shard_size.as_deref().map(sizes::parse_size).transpose()?,
                keys,
                dtype: dtype.as_deref().map(tessera::DType::parse).transpose()?,
                memory: sizes::parse_size(&memory)?,
            })?;
            Ok(0)
        }
        Command::Convert { src, dst, to, overwrite, memory } => {
            let to = if to == "native" { convert::Target::Native } else { convert::Target::Dcp };
            convert::run(&loc(&src), &loc(&dst), to, overwrite, sizes::parse_size(&memory)?)?;
            Ok(0)
        }
        Command::Diff { a, b, atol, keys, json } => diff::run(&loc(&a), &loc(&b), atol, keys.as_deref(), json),
    }
}

/// Runs the command line `args` (the program name first, as `std::env::args_os` gives it) and
/// returns the process's exit status: 0 on success, 1 on failure (for `verify`: something is
/// wrong; for `diff`: the checkpoints differ), 2 on usage errors and `diff`'s errors. Help and
/// usage errors are printed as clap prints them.
pub fn run<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli: Cli = match parse_args(args) {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    cli.progress.apply();
    let locations = cli.command.locations();
    // `diff` exits 1 when the checkpoints differ, so its errors exit 2 (as usage errors do).
    let error_code = if matches!(cli.command, Command::Diff { .. }) { 2 } else { 1 };
    match dispatch(cli.command, &cli.storage.storage_options) {
        Ok(code) => code,
        Err(e) => {
            match location::explain_missing(&e, &locations) {
                Some(message) => eprintln!("tessera: error: {message}"),
                None => eprintln!("tessera: error: {e:#}"),
            }
            error_code
        }
    }
}

/// Parses the command line `args` (the program name first) as `C`, after restoring the default
/// SIGPIPE action (so that output into a closed pipe ends the process quietly). `Err` holds the
/// exit status when clap has printed help or the version (0) or a usage error (2) instead.
fn parse_args<C, I, T>(args: I) -> std::result::Result<C, u8>
where
    C: Parser,
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    system::default_sigpipe();
    C::try_parse_from(args).map_err(|e| {
        let _ = e.print();
        if e.use_stderr() {
            2
        } else {
            0
        }
    })
}
