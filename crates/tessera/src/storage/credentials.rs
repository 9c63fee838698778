//! Where object-store credentials come from, beyond what the `object_store` builders read from
//! the environment themselves: the files and variables the clouds' own tools use (AWS
//! profiles, Azure connection strings, a GCS emulator's credentials file), and the check that
//! some credential source exists before the first request, so that a machine without any
//! fails at once with one error instead of retrying the instance-metadata service for minutes.

#[cfg(any(feature = "s3", feature = "azure"))]
use std::collections::HashMap;
use std::net::{TcpStream, ToSocketAddrs};
#[cfg(feature = "s3")]
use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Error, Result};

/// A boolean configuration value as `object_store` reads one: `1`, `true`, `on`, `yes` or
/// `y`, in any case.
pub(super) fn truthy(value: Option<String>) -> bool {
    value.is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "on" | "yes" | "y"))
}

/// How long the instance-metadata service (the credential source of last resort, on cloud VMs)
/// gets to accept a connection before we conclude there is none. On a cloud VM it answers
/// within milliseconds; off one, the address is unrouted and a connect would hang.
const METADATA_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

#[cfg(feature = "s3")]
/// The AWS settings of one profile of the shared files (`~/.aws/credentials`, `~/.aws/config`).
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct AwsProfile {
    /// `aws_access_key_id`, `aws_secret_access_key`, `aws_session_token` (credentials file,
    /// or the config file's profile).
    pub credentials: Option<(String, String, Option<String>)>,
    /// `region` (config file).
    pub region: Option<String>,
    /// `endpoint_url` (config file).
    pub endpoint_url: Option<String>,
    /// The kind of credentials the profile names instead of keys, which `object_store`
    /// cannot use (`role_arn`, `sso_…`, `credential_process`), if any.
    pub unsupported: Option<String>,
}

#[cfg(feature = "s3")]
/// Sections of an INI file, keys lower-cased, values trimmed (`# …` and `; …` lines skipped).
fn parse_ini(text: &str) -> HashMap<String, HashMap<String, String>> {
    let mut out: HashMap<String, HashMap<String, String>> = HashMap::new();
    let mut section = String::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.trim().to_string();
            continue;
        }
        if let Some((k, v)) = line.split_once('=') {
            out.entry(section.clone()).or_default().insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    out
}

#[cfg(feature = "s3")]
fn home_file(var: &str, default: &str) -> Option<PathBuf> {
    match std::env::var_os(var) {
        Some(p) => Some(p.into()),
        None => std::env::var_os("HOME").map(|h| PathBuf::from(h).join(default)),
    }
}

#[cfg(feature = "s3")]
/// The profile `AWS_PROFILE` (else `default`) of the shared credentials and config files
/// (`AWS_SHARED_CREDENTIALS_FILE`, `AWS_CONFIG_FILE`, else `~/.aws/…`), as the AWS CLI and
/// SDKs read them. `None` when neither file has the profile; a profile named by `AWS_PROFILE`
/// that is in neither file is an error (the user asked for it).
pub(super) fn aws_profile() -> Result<Option<AwsProfile>> {
    let named = std::env::var("AWS_PROFILE").ok().filter(|p| !p.is_empty());
    let profile = named.clone().unwrap_or_else(|| "default".to_string());
    let read =
        |path: &Option<PathBuf>| path.as_ref().and_then(|p| std::fs::read_to_string(p).ok()).map(|t| parse_ini(&t));
    let cred_path = home_file("AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials");
    let config_path = home_file("AWS_CONFIG_FILE", ".aws/config");
    let creds_ini = read(&cred_path).unwrap_or_default();
    let config_ini = read(&config_path).unwrap_or_default();
    // The config file names profiles `[profile NAME]`, except `[default]`.
    let config_section = config_ini
        .get(&format!("profile {profile}"))
        .or_else(|| (profile == "default").then(|| config_ini.get("default")).flatten());
    let creds_section = creds_ini.get(&profile);
    if creds_section.is_none() && config_section.is_none() {
        if let Some(p) = named {
            let shown = |p: &Option<PathBuf>| p.as_ref().map_or("-".to_string(), |p| p.display().to_string());
            return Err(Error::AccessDenied {
                path: shown(&cred_path).into(),
                reason: format!(
                    "AWS_PROFILE={p} is in neither the credentials file {} nor the config file {}",
                    shown(&cred_path),
                    shown(&config_path)
                ),
            });
        }
        return Ok(None);
    }
    let key_of = |s: Option<&HashMap<String, String>>| {
        let s = s?;
        Some((
            s.get("aws_access_key_id")?.clone(),
            s.get("aws_secret_access_key")?.clone(),
            s.get("aws_session_token").cloned(),
        ))
    };
    let unsupported = [creds_section, config_section].into_iter().flatten().find_map(|s| {
        ["role_arn", "sso_session", "sso_start_url", "credential_process"]
            .into_iter()
            .find(|k| s.contains_key(*k))
            .map(|k| format!("the profile {profile} names {k}, which this client cannot use: give it keys, or use AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN"))
    });
    Ok(Some(AwsProfile {
        credentials: key_of(creds_section).or_else(|| key_of(config_section)),
        region: config_section.and_then(|s| s.get("region").cloned()),
        endpoint_url: config_section.and_then(|s| s.get("endpoint_url").cloned()),
        unsupported,
    }))
}

#[cfg(feature = "azure")]
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

#[cfg(feature = "gcs")]
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

/// `host:port` of an `http://host[:port]/…` URL.
fn host_port(url: &str) -> Option<String> {
    let rest = url.strip_prefix("http://").or_else(|| url.strip_prefix("https://"))?;
    let authority = rest.split('/').next()?;
    let default_port = if url.starts_with("https://") { 443 } else { 80 };
    Some(if authority.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) {
        authority.to_string()
    } else {
        format!("{authority}:{default_port}")
    })
}

/// A store opened without explicit credentials, whose client gets them from the cloud's
/// instance-metadata service: what its errors say when that service fails.
#[derive(Debug, Clone)]
pub(super) struct MetadataFallback {
    store: &'static str,
    metadata_url: String,
    tried: &'static str,
}

impl MetadataFallback {
    /// `Error::AccessDenied` for `path` when `e` is the metadata service failing (a request
    /// to its address), naming what was tried and the innermost cause; `None` for any other
    /// error.
    pub(super) fn explain(&self, path: std::path::PathBuf, e: &object_store::Error) -> Option<Error> {
        let text = e.to_string();
        let hosts: Vec<String> = self.metadata_url.split(" or ").filter_map(host_port).collect();
        if !hosts.iter().any(|h| text.contains(h.strip_suffix(":80").unwrap_or(h))) {
            return None;
        }
        let mut cause: &dyn std::error::Error = e;
        while let Some(inner) = cause.source() {
            cause = inner;
        }
        Some(Error::AccessDenied { path, reason: self.reason(&format!("failed: {cause}")) })
    }

    fn reason(&self, outcome: &str) -> String {
        format!(
            "no {} credentials found: tried {}; the last resort, the instance-metadata service at {}, {outcome}",
            self.store, self.tried, self.metadata_url
        )
    }
}

/// With no explicit credentials, a store's client falls back to the cloud's instance-metadata
/// service at `metadata_url`. Off a cloud VM nothing answers there, and the client would
/// retry with backoff for minutes before failing; this fails at once instead, naming the
/// store, the location and every source tried (`tried`). Returns the fallback in use, if
/// any, to explain the errors of later requests.
pub(super) fn require_credentials(
    location: &str,
    store: &'static str,
    explicit: bool,
    metadata_urls: &[String],
    tried: &'static str,
) -> Result<Option<MetadataFallback>> {
    if explicit {
        return Ok(None);
    }
    let fallback = MetadataFallback { store, metadata_url: metadata_urls.join(" or "), tried };
    let answers = metadata_urls
        .iter()
        .filter_map(|url| host_port(url))
        .filter_map(|hp| hp.to_socket_addrs().ok())
        .flatten()
        .any(|addr| TcpStream::connect_timeout(&addr, METADATA_CONNECT_TIMEOUT).is_ok());
    if answers {
        return Ok(Some(fallback));
    }
    Err(Error::AccessDenied {
        path: location.into(),
        reason: fallback
            .reason(&format!("did not answer within {} s (not a cloud VM?)", METADATA_CONNECT_TIMEOUT.as_secs())),
    })
}

/// The text of a store's refusal (401/403) without its response body's echo of the request
/// (S3's `SignatureDoesNotMatch` carries the string it signed, session token included): the
/// XML error's `Code` and `Message` when there are, else the text cut at the body.
pub(super) fn refusal_text(text: &str) -> String {
    let field = |tag: &str| {
        let start = text.find(&format!("<{tag}>"))? + tag.len() + 2;
        let end = start + text[start..].find(&format!("</{tag}>"))?;
        Some(text[start..end].trim().to_string())
    };
    let head = text.split('<').next().unwrap_or(text).trim_end_matches([':', ' ']);
    match (field("Code"), field("Message")) {
        (Some(code), Some(message)) => format!("{head}: {code}: {message}"),
        (Some(code), None) => format!("{head}: {code}"),
        _ => head.chars().take(300).collect(),
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    #[cfg(feature = "s3")]
    #[test]
    fn ini_sections_and_keys() {
        let ini =
            parse_ini("# c\n[default]\naws_access_key_id = AK\n AWS_SECRET_ACCESS_KEY=SK \n[profile x]\nregion=eu\n");
        assert_eq!(ini["default"]["aws_access_key_id"], "AK");
        assert_eq!(ini["default"]["aws_secret_access_key"], "SK");
        assert_eq!(ini["profile x"]["region"], "eu");
    }

    #[cfg(feature = "azure")]
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

    #[cfg(feature = "gcs")]
    #[test]
    fn gcs_emulator_keys() {
        let key = r#"{"gcs_base_url": "http://127.0.0.1:1", "disable_oauth": true, "private_key": ""}"#;
        assert_eq!(gcs_emulator(key).as_deref(), Some("http://127.0.0.1:1"));
        assert_eq!(gcs_emulator(r#"{"disable_oauth": true}"#).as_deref(), Some(""));
        assert_eq!(gcs_emulator(r#"{"type": "service_account", "private_key": "k"}"#), None);
        assert_eq!(gcs_emulator("/nonexistent/key.json"), None);
    }

    #[test]
    fn refusals_keep_code_and_message_only() {
        let body =
            "Client error with status 403 Forbidden: <?xml version=\"1.0\"?><Error><Code>SignatureDoesNotMatch</Code>\
                    <Message>The signature does not match</Message><StringToSign>secret-token</StringToSign></Error>";
        let text = refusal_text(body);
        assert_eq!(text, "Client error with status 403 Forbidden: SignatureDoesNotMatch: The signature does not match");
        assert!(!text.contains("secret-token"));
    }

    #[test]
    fn metadata_host_ports() {
        assert_eq!(host_port("http://169.254.169.254").as_deref(), Some("169.254.169.254:80"));
        assert_eq!(host_port("http://127.0.0.1:9/x/y").as_deref(), Some("127.0.0.1:9"));
        assert_eq!(host_port("https://h/x").as_deref(), Some("h:443"));
        assert_eq!(host_port("ftp://h"), None);
    }

    #[test]
    fn no_credentials_and_no_metadata_service_fails_at_once_naming_what_was_tried() {
        // A loopback port nobody listens on: refused at once.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let started = std::time::Instant::now();
        let err =
            require_credentials("s3://b/p", "S3", false, &[format!("http://127.0.0.1:{port}")], "AWS_ACCESS_KEY_ID")
                .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        let Error::AccessDenied { path, reason } = err else { panic!("{err}") };
        assert_eq!(path, PathBuf::from("s3://b/p"));
        assert!(reason.contains("no S3 credentials found: tried AWS_ACCESS_KEY_ID"), "{reason}");
        assert!(require_credentials("s3://b/p", "S3", true, &["http://127.0.0.1:1".into()], "").unwrap().is_none());
        assert!(truthy(Some("True".into())) && truthy(Some("1".into())) && truthy(Some("yes".into())));
        assert!(!truthy(Some("false".into())) && !truthy(None));
    }
}
