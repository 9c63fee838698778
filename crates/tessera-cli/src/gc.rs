//! `tessera gc LOCATION`: remove leftovers of saves that never committed.

use anyhow::Result;

use crate::location::Location;

/// Runs `tessera gc`, printing every name removed.
pub fn run(location: &Location) -> Result<()> {
    let storage = location.open()?;
    let removed = tessera::gc(storage.as_ref())?;
    for name in &removed {
        println!("removed {name}");
    }
    println!("{location}: {} leftover file(s) removed", removed.len());
    Ok(())
}
