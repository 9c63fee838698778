//! `--keys REGEX`: choosing checkpoint keys with a regular expression.

use std::collections::BTreeSet;

use anyhow::{bail, Context, Result};

/// The keys matching `pattern` (searched anywhere in the key; anchor it with `^…$` for whole
/// keys), sorted and deduplicated. Matching nothing is an error naming `what` was searched.
pub fn select<'k>(pattern: &str, keys: impl IntoIterator<Item = &'k str>, what: &str) -> Result<Vec<String>> {
    let re =
        regex_lite::Regex::new(pattern).with_context(|| format!("--keys {pattern:?} is not a regular expression"))?;
    let selected: BTreeSet<&str> = keys.into_iter().filter(|k| re.is_match(k)).collect();
    if selected.is_empty() {
        bail!("--keys {pattern:?} matches no key of {what}");
    }
    Ok(selected.into_iter().map(String::from).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selects_sorted_matches_and_refuses_none() {
        let keys = ["b.weight", "a.weight", "a.bias", "a.weight"];
        assert_eq!(select(r"\.weight$", keys, "x").unwrap(), ["a.weight", "b.weight"]);
        assert_eq!(select("^a", keys, "x").unwrap(), ["a.bias", "a.weight"]);
        let e = select("^c", keys, "the checkpoint").unwrap_err().to_string();
        assert!(e.contains("matches no key of the checkpoint"), "{e}");
        assert!(select("(", keys, "x").is_err());
    }
}
