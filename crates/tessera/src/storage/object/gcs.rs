//! Google Cloud Storage: the builder configured from the environment and credential files
//! (service-account keys, application-default credentials; an emulator's keys), then by the
//! storage options.

use std::path::PathBuf;
use std::sync::Arc;

use super::{credentials, Built, Common};
use crate::error::Result;

/// Builds the GCS client of `c.url`.
pub(super) fn build(c: &Common<'_>) -> Result<Built> {
    use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey as K};
    let mut b = GoogleCloudStorageBuilder::from_env()
        .with_url(c.url)
        .with_retry(c.retry.clone())
        .with_config(K::Client(object_store::ClientConfigKey::Timeout), &c.timeout);
    for (k, v) in &c.config {
        b = b.with_config(k.parse::<K>().map_err(|e| c.key_err(k, e))?, v);
    }
    // An emulator's credentials given as application-default credentials: its
    // `gcs_base_url` / `disable_oauth` count only in a service-account key.
    let set = |b: &GoogleCloudStorageBuilder, k: K| b.get_config_value(&k).is_some_and(|v| !v.is_empty());
    if !set(&b, K::ServiceAccount) && !set(&b, K::ServiceAccountKey) {
        if let Some(adc) = b.get_config_value(&K::ApplicationCredentials) {
            if gcs_emulator(&adc).is_some() {
                b = b.with_service_account_path(adc);
            }
        }
    }
    // An emulator served over plain HTTP, named so by its key: allowed, unless
    // the options say otherwise.
    let key = b.get_config_value(&K::ServiceAccountKey).or_else(|| b.get_config_value(&K::ServiceAccount));
    let emulator = key.and_then(|k| gcs_emulator(&k));
    let allow_http_given = c.config.iter().any(|(k, _)| k.ends_with("allow_http"));
    if emulator.as_ref().is_some_and(|base| base.starts_with("http://")) && !allow_http_given {
        b = b.with_config(K::Client(object_store::ClientConfigKey::AllowHttp), "true");
    }
    let gcloud_adc = std::env::var_os("HOME")
        .is_some_and(|h| PathBuf::from(h).join(".config/gcloud/application_default_credentials.json").exists());
    let explicit = set(&b, K::ServiceAccount)
        || set(&b, K::ServiceAccountKey)
        || set(&b, K::ApplicationCredentials)
        || set(&b, K::BearerToken)
        || credentials::truthy(b.get_config_value(&K::SkipSignature))
        || gcloud_adc;
    // Where the client looks, in its order: the metadata host, then its address.
    let env = |v: &str| std::env::var(v).ok().filter(|h| !h.is_empty());
    let host = env("GCE_METADATA_HOST").or_else(|| env("GCE_METADATA_ROOT"));
    let metadata = [
        host.unwrap_or_else(|| "metadata.google.internal".into()),
        env("GCE_METADATA_IP").unwrap_or_else(|| "169.254.169.254".into()),
    ]
    .map(|h| if h.contains("://") { h } else { format!("http://{h}") });
    let probe_key = format!("{emulator:?}");
    let fallback = credentials::require_credentials(
        c.url,
        "GCS",
        explicit,
        &metadata,
        "GOOGLE_SERVICE_ACCOUNT (or the storage option google_service_account), \
         GOOGLE_SERVICE_ACCOUNT_KEY, GOOGLE_APPLICATION_CREDENTIALS, \
         ~/.config/gcloud/application_default_credentials.json",
    )?;
    let gcs = Arc::new(b.build().map_err(|e| c.build_err(e))?);
    Ok(Built { store: gcs.clone(), multipart: gcs, fallback, probe_key })
}

/// The emulator settings of a GCS service-account JSON (the text of the key, or of the file
/// at a path): `Some(gcs_base_url)` when it carries `gcs_base_url` or `disable_oauth: true`
/// (`object_store` honours them in a service-account key, not in application-default
/// credentials), the base URL empty if it has none.
pub(super) fn gcs_emulator(key_or_path: &str) -> Option<String> {
    let text = if key_or_path.trim_start().starts_with('{') {
        key_or_path.to_string()
    } else {
        std::fs::read_to_string(key_or_path).ok()?
    };
    let serde_json::Value::Object(json) = serde_json::from_str(&text).ok()? else { return None };
    let base = json.get("gcs_base_url").and_then(serde_json::Value::as_str);
    let no_oauth = json.get("disable_oauth").and_then(serde_json::Value::as_bool) == Some(true);
    (base.is_some() || no_oauth).then(|| base.unwrap_or_default().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gcs_emulator_keys() {
        let key = r#"{"gcs_base_url": "http://127.0.0.1:1", "disable_oauth": true, "private_key": ""}"#;
        assert_eq!(gcs_emulator(key).as_deref(), Some("http://127.0.0.1:1"));
        assert_eq!(gcs_emulator(r#"{"disable_oauth": true}"#).as_deref(), Some(""));
        assert_eq!(gcs_emulator(r#"{"type": "service_account", "private_key": "k"}"#), None);
        assert_eq!(gcs_emulator("/nonexistent/key.json"), None);
    }
}
