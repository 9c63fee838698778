//! `tessera gc LOCATION`: remove the leftovers of saves that never committed, beside running
//! saves.

use anyhow::Result;

use crate::location::Location;

/// Runs `tessera gc`, printing every name removed and every running save whose files it kept.
pub fn run(location: &Location, break_leases: bool) -> Result<()> {
    let storage = location.open()?;
    let report = tessera::tools::gc(storage.as_ref(), &tessera::tools::GcOptions { break_leases })?;
    for name in &report.removed {
        println!("removed {name}");
    }
    for save in &report.running {
        let who = if save.writer.is_empty() { String::new() } else { format!(" by {}", save.writer) };
        let until = match (save.expires_in_ms, &save.unreadable) {
            (_, Some(why)) => format!("its lease cannot be read ({why})"),
            (Some(ms), None) => format!("its lease expires in {} s unless renewed", ms.div_ceil(1000)),
            (None, None) => "its lease holds".to_string(),
        };
        println!(
            "skipped {} file(s) of the save {}{who}, still running: {until} (--break-leases if it is not)",
            save.files.len(),
            save.save_id
        );
    }
    for name in &report.kept {
        let why = if name.starts_with('.') {
            "a put that started less than a lease's lifetime ago (a save may be starting)"
        } else {
            "an unfinished torch_dist save's (Megatron may write it before its save's lease)"
        };
        println!("kept {name}: {why}; --break-leases removes it if no save is running");
    }
    println!("{location}: {} leftover file(s) removed", report.removed.len());
    Ok(())
}
