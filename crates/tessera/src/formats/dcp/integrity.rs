//! Megatron-Core's integrity manifest, `integrity.json` (megatron-core 0.18+, written by
//! `dist_checkpointing.save(..., verify_integrity=True)` once the checkpoint is complete;
//! `validation.save_integrity_manifest`): the SHA-256 of every file at the checkpoint's top
//! (itself excepted), as
//!
//! ```json
//! {"algorithm": "sha256", "files": {".metadata": "<64 hex digits>", "__0_0.distcp": "…"}}
//! ```
//!
//! Megatron's reader takes a missing `algorithm` as `sha256` and refuses any other. Parsed here
//! as hostile input: a bounded size (checked by the caller against the file's real size before
//! reading), exactly that shape (no other key, every name a plain file name, every digest 64
//! hex digits).

use std::collections::BTreeMap;

/// The manifest's file name, beside `.metadata`.
pub const INTEGRITY_FILE: &str = "integrity.json";
/// The largest manifest read: about 80 bytes a file, so room for some 800 000 files.
pub(crate) const INTEGRITY_MAX_BYTES: u64 = 64 << 20;
/// The only algorithm Megatron-Core writes and reads.
const ALGORITHM: &str = "sha256";

/// File name → SHA-256 digest, as the manifest records them.
pub(crate) type Manifest = BTreeMap<String, [u8; 32]>;

/// Parses `integrity.json`'s bytes; the error says what is wrong with them.
pub(crate) fn parse_integrity(bytes: &[u8]) -> Result<Manifest, String> {
    if bytes.len() as u64 > INTEGRITY_MAX_BYTES {
        return Err(format!("{} bytes, more than the {INTEGRITY_MAX_BYTES} a manifest may have", bytes.len()));
    }
    let json: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    let top = json.as_object().ok_or("not a JSON object")?;
    if let Some(k) = top.keys().find(|k| *k != "algorithm" && *k != "files") {
        return Err(format!("unexpected key {k:?} (a manifest has \"algorithm\" and \"files\")"));
    }
    match top.get("algorithm") {
        None => {}
        Some(serde_json::Value::String(a)) if a == ALGORITHM => {}
        Some(other) => return Err(format!("algorithm {other}, only {ALGORITHM:?} is defined")),
    }
    let files = top.get("files").ok_or("no \"files\"")?.as_object().ok_or("\"files\" is not an object")?;
    let mut out = Manifest::new();
    for (name, digest) in files {
        crate::storage::check_plain_name(name).map_err(|e| e.to_string())?;
        if name == INTEGRITY_FILE {
            return Err("the manifest lists itself".into());
        }
        let hex = digest.as_str().ok_or_else(|| format!("the digest of {name:?} is not a string"))?;
        out.insert(
            name.clone(),
            parse_digest(hex).ok_or_else(|| format!("the digest of {name:?} is not 64 hex digits"))?,
        );
    }
    Ok(out)
}

fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    let b = hex.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = nibble(b[2 * i])? << 4 | nibble(b[2 * i + 1])?;
    }
    Some(out)
}

/// A digest as Megatron writes it: lowercase hex.
pub(crate) fn hex(digest: &[u8; 32]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `name`, at a torch_dist checkpoint's top, is one of the files the checkpoint is
/// made of (a manifest written after the save lists every one): DCP's data files and
/// `.metadata`, Megatron's `metadata.json` and `common.pt`.
pub(crate) fn is_checkpoint_file(name: &str) -> bool {
    name.ends_with(".distcp")
        || [
            crate::formats::torch_dist::DCP_METADATA,
            crate::formats::torch_dist::MEGATRON_METADATA,
            crate::formats::torch_dist::MEGATRON_COMMON,
        ]
        .contains(&name)
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "4987287aeb15fcd868ff56080e990037ec28ffb1ad7f8d17dfcb867d8f24578b";

    #[test]
    fn megatrons_manifest_parses() {
        let text = format!("{{\n  \"algorithm\": \"sha256\",\n  \"files\": {{\n    \".metadata\": \"{A}\"\n  }}\n}}");
        let m = parse_integrity(text.as_bytes()).unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!(hex(&m[".metadata"]), A);
        // Megatron's reader defaults a missing algorithm to sha256; uppercase hex is the same digest.
        let m = parse_integrity(format!(r#"{{"files": {{"x.distcp": "{}"}}}}"#, A.to_uppercase()).as_bytes()).unwrap();
        assert_eq!(hex(&m["x.distcp"]), A);
    }

    #[test]
    fn anything_else_is_refused() {
        let bad = [
            "[]".to_string(),
            "{}".into(),
            r#"{"files": []}"#.into(),
            format!(r#"{{"algorithm": "md5", "files": {{"a": "{A}"}}}}"#),
            format!(r#"{{"algorithm": 1, "files": {{"a": "{A}"}}}}"#),
            format!(r#"{{"files": {{"a": "{A}"}}, "extra": 1}}"#),
            format!(r#"{{"files": {{"../a": "{A}"}}}}"#),
            format!(r#"{{"files": {{"d/a": "{A}"}}}}"#),
            format!(r#"{{"files": {{"integrity.json": "{A}"}}}}"#),
            r#"{"files": {"a": "abc"}}"#.into(),
            format!(r#"{{"files": {{"a": "{}"}}}}"#, A.replace('4', "g")),
            r#"{"files": {"a": 7}}"#.into(),
            "not json".into(),
        ];
        for b in bad {
            assert!(parse_integrity(b.as_bytes()).is_err(), "{b}");
        }
    }
}
