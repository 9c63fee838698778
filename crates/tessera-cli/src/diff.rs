//! `tessera diff A B`: what differs between two checkpoints (any readable formats). Exit 0 when
//! equal, 1 when different (each differing key printed with why); errors exit 2 (in `main`).

use anyhow::{Context, Result};
use serde_json::json;
use tessera::tools::diff::DiffOptions;
use tessera_synth::progress::Progress;
use tessera_synth::sizes::fmt_bytes;

use crate::location::Location;

/// Runs `tessera diff`.
pub fn run(a: &Location, b: &Location, atol: f64, keys: Option<&str>, json: bool) -> Result<u8> {
    let (sa, sb) = (a.open()?, b.open()?);
    let ia = tessera::open(sa.as_ref()).map(tessera::Checkpoint::into_index).with_context(|| format!("opening {a}"))?;
    let ib = tessera::open(sb.as_ref()).map(tessera::Checkpoint::into_index).with_context(|| format!("opening {b}"))?;
    let keys = match keys {
        None => None,
        Some(pattern) => {
            let all = [&ia, &ib]
                .into_iter()
                .flat_map(|i| i.tensors.iter().map(|t| t.key.as_str()).chain(i.objects.iter().map(|o| o.key.as_str())));
            Some(crate::keys::select(pattern, all, "either checkpoint")?)
        }
    };
    // What diff reads at most, for its progress: both checkpoints' tensor bytes.
    let bytes = |i: &tessera::index::CheckpointIndex| -> u64 {
        i.tensors.iter().map(|t| t.global_shape.iter().product::<u64>() * t.dtype.size() as u64).sum()
    };
    let opts = DiffOptions { atol, keys, ..Default::default() };
    let bar = Progress::reads("diff", bytes(&ia) + bytes(&ib));
    let r =
        tessera::tools::diff::diff(sa.as_ref(), sb.as_ref(), &opts).with_context(|| format!("comparing {a} and {b}"));
    bar.finish();
    let r = r?;
    if json {
        let tensors: Vec<_> = r
            .tensors
            .iter()
            .map(|t| json!({ "key": t.key, "differences": t.differences.iter().map(ToString::to_string).collect::<Vec<_>>() }))
            .collect();
        let objects: Vec<_> =
            r.objects.iter().map(|o| json!({ "key": o.key, "difference": o.difference.to_string() })).collect();
        let common: Vec<String> = r.common.iter().map(ToString::to_string).collect();
        let metadata = r.content_metadata.as_ref().map(|(x, y)| json!([x.to_json(), y.to_json()]));
        println!(
            "{}",
            json!({
                "a": a.to_string(),
                "b": b.to_string(),
                "equal": r.is_equal(),
                "tensors": tensors,
                "objects": objects,
                "common": common,
                "content_metadata": metadata,
                "tensors_compared": r.tensors_compared,
                "objects_compared": r.objects_compared,
                "bytes_compared": r.bytes_compared,
                "atol": atol,
            })
        );
        return Ok(if r.is_equal() { 0 } else { 1 });
    }
    println!("A: {a}");
    println!("B: {b}");
    for t in &r.tensors {
        let why: Vec<String> = t.differences.iter().map(ToString::to_string).collect();
        println!("  tensor {}: {}", t.key, why.join("; "));
    }
    for o in &r.objects {
        println!("  object {}: {}", o.key, o.difference);
    }
    for c in &r.common {
        println!("  common {c}");
    }
    if let Some((x, y)) = &r.content_metadata {
        println!("  content metadata: {} vs {}", x.to_json(), y.to_json());
    }
    let compared = format!(
        "{} tensors ({} compared{}), {} objects",
        r.tensors_compared,
        fmt_bytes(r.bytes_compared),
        if atol > 0.0 { format!(", atol {atol}") } else { String::new() },
        r.objects_compared
    );
    if r.is_equal() {
        println!("equal: {compared}");
        Ok(0)
    } else {
        let n = r.tensors.len() + r.objects.len() + r.common.len() + r.content_metadata.is_some() as usize;
        println!("DIFFERENT: {n} difference(s); {compared}");
        Ok(1)
    }
}
