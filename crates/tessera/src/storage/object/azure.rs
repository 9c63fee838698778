//! Azure Blob Storage: the builder configured from the environment (and a connection string,
//! as the Azure CLI and SDKs take it), then by the storage options.

use std::collections::HashMap;
use std::sync::Arc;

use super::{credentials, Built, Common};
use crate::error::{Error, Result};

/// Builds the Azure client of `c.url`.
pub(super) fn build(c: &Common<'_>) -> Result<Built> {
    use object_store::azure::{AzureConfigKey as K, MicrosoftAzureBuilder};
    let is_connection_string =
        |k: &str| matches!(k.to_ascii_lowercase().as_str(), "azure_storage_connection_string" | "connection_string");
    let mut b = MicrosoftAzureBuilder::from_env()
        .with_url(c.url)
        .with_retry(c.retry.clone())
        .with_config(K::Client(object_store::ClientConfigKey::Timeout), &c.timeout);
    // A connection string (the Azure CLI's and SDKs' variable, or the same key in
    // the options) stands for several keys: over the environment's, under the
    // options' other keys.
    let connection = c
        .config
        .iter()
        .rev()
        .find(|(k, _)| is_connection_string(k))
        .map(|(_, v)| v.clone())
        .or_else(|| std::env::var("AZURE_STORAGE_CONNECTION_STRING").ok());
    if let Some(text) = connection {
        for (k, v) in azure_connection_string(&text).map_err(|e| Error::invalid(format!("{}: {e}", c.url)))? {
            b = b.with_config(k.parse::<K>().map_err(|e| c.key_err(k, e))?, v);
        }
    }
    for (k, v) in c.config.iter().filter(|(k, _)| !is_connection_string(k)) {
        b = b.with_config(k.parse::<K>().map_err(|e| c.key_err(k, e))?, v);
    }
    let set = |k: K| b.get_config_value(&k).is_some_and(|v| !v.is_empty());
    let on = |k: K| credentials::truthy(b.get_config_value(&k));
    let explicit = on(K::UseEmulator)
        || set(K::AccessKey)
        || set(K::SasKey)
        || set(K::Token)
        || (set(K::ClientId) && set(K::ClientSecret))
        || set(K::FederatedTokenFile)
        || on(K::UseAzureCli)
        || on(K::SkipSignature)
        || b.get_config_value(&K::CredentialType).is_some_and(|t| t != "auto" && t != "managed_identity");
    let metadata = b.get_config_value(&K::MsiEndpoint).unwrap_or("http://169.254.169.254".into());
    let probe_key = format!(
        "{:?} {:?} {}",
        b.get_config_value(&K::Endpoint),
        b.get_config_value(&K::AccountName),
        on(K::UseEmulator)
    );
    let fallback = credentials::require_credentials(
        c.url,
        "Azure",
        explicit,
        &[metadata],
        "AZURE_STORAGE_ACCOUNT_KEY (or the storage option azure_storage_account_key), \
         AZURE_STORAGE_SAS_KEY, AZURE_STORAGE_CONNECTION_STRING, AZURE_CLIENT_ID + \
         AZURE_CLIENT_SECRET, AZURE_FEDERATED_TOKEN_FILE, AZURE_USE_AZURE_CLI, \
         AZURE_STORAGE_USE_EMULATOR",
    )?;
    let az = Arc::new(b.build().map_err(|e| c.build_err(e))?);
    Ok(Built { store: az.clone(), multipart: az, fallback, probe_key })
}

/// The `object_store` Azure configuration keys an Azure Storage connection string
/// (`AZURE_STORAGE_CONNECTION_STRING`, as the Azure CLI and SDKs take it) stands for:
/// `UseDevelopmentStorage=true` (Azurite), or `AccountName` with `AccountKey` or
/// `SharedAccessSignature`, and `BlobEndpoint` or `DefaultEndpointsProtocol` + `EndpointSuffix`
/// (the endpoint `PROTOCOL://ACCOUNT.blob.SUFFIX`). An `http` endpoint, given either way, also
/// allows the client plain HTTP.
pub(super) fn azure_connection_string(text: &str) -> Result<Vec<(&'static str, String)>> {
    let mut fields = HashMap::new();
    for part in text.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((k, v)) = part.split_once('=') else {
            return Err(Error::invalid(format!("Azure connection string: {part:?} is not KEY=VALUE")));
        };
        fields.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
    }
    let mut out = Vec::new();
    if fields.get("usedevelopmentstorage").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        out.push(("azure_storage_use_emulator", "true".to_string()));
        return Ok(out);
    }
    // A SAS connection string often names the account only in its endpoint's host
    // (`https://ACCOUNT.blob.core.windows.net/`).
    let account = fields.get("accountname").cloned().or_else(|| {
        let host = fields.get("blobendpoint")?.split("://").nth(1)?.split(['/', ':']).next()?.to_string();
        host.split_once(".blob.").map(|(a, _)| a.to_string())
    });
    if let Some(a) = &account {
        out.push(("azure_storage_account_name", a.clone()));
    }
    if let Some(k) = fields.get("accountkey") {
        out.push(("azure_storage_account_key", k.clone()));
    }
    if let Some(s) = fields.get("sharedaccesssignature") {
        out.push(("azure_storage_sas_key", s.clone()));
    }
    if let Some(e) = fields.get("blobendpoint") {
        out.push(("azure_storage_endpoint", e.trim_end_matches('/').to_string()));
        if e.starts_with("http://") {
            out.push(("azure_allow_http", "true".to_string()));
        }
    } else if let (Some(a), Some(suffix)) = (&account, fields.get("endpointsuffix")) {
        let protocol = fields.get("defaultendpointsprotocol").map_or("https".to_string(), |p| p.to_ascii_lowercase());
        if protocol != "https" && protocol != "http" {
            return Err(Error::invalid(format!(
                "Azure connection string: DefaultEndpointsProtocol={protocol} is neither https nor http"
            )));
        }
        out.push(("azure_storage_endpoint", format!("{protocol}://{a}.blob.{suffix}")));
        // The client refuses plain HTTP unless allowed (its request fails with "builder
        // error"): the connection string asking for it is the permission, as a `BlobEndpoint`
        // of `http://` is above.
        if protocol == "http" {
            out.push(("azure_allow_http", "true".to_string()));
        }
    }
    if account.is_none() && !out.iter().any(|(k, _)| *k == "azure_storage_endpoint") {
        return Err(Error::invalid(
            "Azure connection string: names neither AccountName nor BlobEndpoint (nor UseDevelopmentStorage=true)",
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_strings() {
        let dev = azure_connection_string("UseDevelopmentStorage=true").unwrap();
        assert_eq!(dev, vec![("azure_storage_use_emulator", "true".to_string())]);
        let full = azure_connection_string(
            "DefaultEndpointsProtocol=http;AccountName=acc;AccountKey=a2V5;BlobEndpoint=http://127.0.0.1:1/acc/;",
        )
        .unwrap();
        assert!(full.contains(&("azure_storage_account_name", "acc".into())));
        assert!(full.contains(&("azure_storage_account_key", "a2V5".into())));
        assert!(full.contains(&("azure_storage_endpoint", "http://127.0.0.1:1/acc".into())));
        assert!(full.contains(&("azure_allow_http", "true".into())));
        let sas = azure_connection_string("BlobEndpoint=https://acc.blob.core.windows.net/;SharedAccessSignature=sv=1")
            .unwrap();
        assert!(sas.contains(&("azure_storage_account_name", "acc".into())), "{sas:?}");
        assert!(sas.contains(&("azure_storage_sas_key", "sv=1".into())), "{sas:?}");
        let cloud = azure_connection_string("AccountName=acc;AccountKey=k;EndpointSuffix=core.windows.net").unwrap();
        assert!(cloud.contains(&("azure_storage_endpoint", "https://acc.blob.core.windows.net".into())));
        assert!(!cloud.iter().any(|(k, _)| *k == "azure_allow_http"), "{cloud:?}");
        // Over plain HTTP from the protocol and the suffix: the endpoint is the account's host
        // there, and the client must be allowed HTTP (it refused the request with "builder
        // error" before).
        let http = azure_connection_string(
            "DefaultEndpointsProtocol=http;AccountName=acct;AccountKey=a2V5;EndpointSuffix=example.test",
        )
        .unwrap();
        let want = [
            ("azure_storage_account_name", "acct"),
            ("azure_storage_account_key", "a2V5"),
            ("azure_storage_endpoint", "http://acct.blob.example.test"),
            ("azure_allow_http", "true"),
        ];
        assert_eq!(http, want.map(|(k, v)| (k, v.to_string())));
        let https =
            azure_connection_string("DefaultEndpointsProtocol=HTTPS;AccountName=a;AccountKey=k;EndpointSuffix=s")
                .unwrap();
        assert!(https.contains(&("azure_storage_endpoint", "https://a.blob.s".into())), "{https:?}");
        assert!(!https.iter().any(|(k, _)| *k == "azure_allow_http"), "{https:?}");
        let ftp = azure_connection_string("DefaultEndpointsProtocol=ftp;AccountName=a;AccountKey=k;EndpointSuffix=s");
        assert!(
            matches!(&ftp, Err(Error::InvalidArgument { reason }) if reason.contains("DefaultEndpointsProtocol=ftp")),
            "{ftp:?}"
        );
        assert!(azure_connection_string("AccountKey=k").is_err());
        assert!(azure_connection_string("nonsense").is_err());
    }
}
