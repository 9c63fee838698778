//! `tessera diff A B`: what differs between two checkpoints (any readable formats). Exit 0 when
//! equal, 1 when different (each differing key printed with why); errors exit 2 (in `main`).

use std::process::ExitCode;

use anyhow::{Context, Result};
use tessera::DiffOptions;

use crate::location::Location;
use crate::sizes::fmt_bytes;

/// Runs `tessera diff`.
pub fn run(a: &Location, b: &Location, atol: f64, keys: Option<&str>) -> Result<ExitCode> {
    let (sa, sb) = (a.open()?, b.open()?);
    let keys = match keys {
        None => None,
        Some(pattern) => {
            let ia = tessera::open_index(sa.as_ref()).with_context(|| format!("opening {a}"))?;
            let ib = tessera::open_index(sb.as_ref()).with_context(|| format!("opening {b}"))?;
            let all = [&ia, &ib]
                .into_iter()
                .flat_map(|i| i.tensors.iter().map(|t| t.key.as_str()).chain(i.objects.iter().map(|o| o.key.as_str())));
            Some(crate::keys::select(pattern, all, "either checkpoint")?)
        }
    };
    let opts = DiffOptions { atol, keys, ..Default::default() };
    let r = tessera::diff(sa.as_ref(), sb.as_ref(), &opts).with_context(|| format!("comparing {a} and {b}"))?;
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
        Ok(ExitCode::SUCCESS)
    } else {
        let n = r.tensors.len() + r.objects.len() + r.common.len() + r.content_metadata.is_some() as usize;
        println!("DIFFERENT: {n} difference(s); {compared}");
        Ok(ExitCode::from(1))
    }
}
