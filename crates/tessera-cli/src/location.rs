//! Checkpoint locations as the commands take them: the library's [`Location`] (a local
//! directory, `file://` path, `mem://name` or object-store URL), the `--storage-option` flag,
//! and what a command says when a location holds no checkpoint.

pub use tessera::storage::Location;

/// The `--storage-option KEY=VALUE` option of the commands (flattened into their clap parsers,
/// global: it reaches every location of every subcommand).
#[derive(clap::Args, Clone, Default)]
pub struct StorageOptionArg {
    /// An `object_store` configuration key for object-store locations, over the environment
    /// and credential files (repeatable): aws_endpoint=http://host:9000,
    /// google_service_account=/path/key.json, azure_storage_account_key=…,
    /// azure_storage_connection_string=…
    #[arg(long = "storage-option", global = true, value_name = "KEY=VALUE", value_parser = parse_storage_option)]
    pub storage_options: Vec<(String, String)>,
}

fn parse_storage_option(s: &str) -> Result<(String, String), String> {
    tessera::storage::parse_option(s).map_err(|e| e.to_string())
}

/// Makes sure `location` can hold objects: creates a local directory (and its parents);
/// nothing to do for a URL or `mem://` (prefixes exist once an object is under them).
pub fn create(location: &Location) -> anyhow::Result<()> {
    if let Some(dir) = location.local_dir() {
        std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("creating {}: {e}", dir.display()))?;
    }
    Ok(())
}

/// What a command looked for and what it found instead, for an error that says one of the
/// command's `locations` holds no (committed) checkpoint: `Some(message)` when `err` is such
/// an error about one of them (not about a file inside one). The message is the library's own
/// (what Python callers get too): the location's contents and what to do.
pub fn explain_missing(err: &anyhow::Error, locations: &[String]) -> Option<String> {
    let (path, detail) = err.chain().find_map(|c| match c.downcast_ref::<tessera::Error>()? {
        tessera::Error::NotFound { path, detail } | tessera::Error::NotCommitted { path, detail } => {
            Some((path, detail.as_ref()?))
        }
        _ => None,
    })?;
    let shown = path.to_str()?;
    locations.iter().any(|l| l.trim_end_matches('/') == shown.trim_end_matches('/')).then(|| detail.clone())
}
