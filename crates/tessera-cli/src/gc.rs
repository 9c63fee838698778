//! `tessera gc DIR`: remove leftovers of saves that never committed.

use std::path::Path;

use anyhow::Result;
use tessera::LocalStorage;

/// Runs `tessera gc`, printing every name removed.
pub fn run(dir: &Path) -> Result<()> {
    let storage = LocalStorage::new(dir);
    let removed = tessera::gc(&storage)?;
    for name in &removed {
        println!("removed {name}");
    }
    println!("{}: {} leftover file(s) removed", dir.display(), removed.len());
    Ok(())
}
