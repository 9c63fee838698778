//! S3 and S3-compatible stores: the builder configured as the AWS CLI and SDKs are (the
//! environment, then the profile of the shared files `~/.aws/credentials` and `~/.aws/config`),
//! then by the storage options.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use super::{credentials, Built, Common};
use crate::error::{Error, Result};

/// Builds the S3 client of `c.url`.
pub(super) fn build(c: &Common<'_>) -> Result<Built> {
    use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey as K};
    let mut options = Vec::new();
    for (k, v) in &c.config {
        options.push((k.parse::<K>().map_err(|e| c.key_err(k, e))?, v));
    }
    let mut b = AmazonS3Builder::from_env()
        .with_url(c.url)
        .with_retry(c.retry.clone())
        .with_config(K::Client(object_store::ClientConfigKey::Timeout), &c.timeout);
    // The AWS SDKs' names, which `from_env` does not all know.
    for (var, key) in [("AWS_ENDPOINT_URL", K::Endpoint), ("AWS_REGION", K::Region)] {
        if let Ok(v) = std::env::var(var) {
            b = b.with_config(key, v);
        }
    }
    // The shared files fill in what the environment left unset; their keys only
    // when no key was given at all (a profile's token must not pair with another key).
    let keyed =
        b.get_config_value(&K::AccessKeyId).is_some() || options.iter().any(|(k, _)| matches!(k, K::AccessKeyId));
    // A profile named but absent matters only when it was to give the keys.
    let profile = match aws_profile() {
        Ok(p) => p,
        Err(_) if keyed => None,
        Err(e) => return Err(e),
    };
    let unsupported_profile = profile.as_ref().and_then(|p| p.unsupported.clone());
    if let Some(profile) = profile {
        if let (false, Some((id, secret, token))) = (keyed, profile.credentials) {
            b = b.with_access_key_id(id).with_secret_access_key(secret);
            if let Some(t) = token {
                b = b.with_token(t);
            }
        }
        if std::env::var("AWS_REGION").is_err() && std::env::var("AWS_DEFAULT_REGION").is_err() {
            if let Some(r) = profile.region {
                b = b.with_region(r);
            }
        }
        if b.get_config_value(&K::Endpoint).is_none() {
            if let Some(e) = profile.endpoint_url {
                b = b.with_endpoint(e);
            }
        }
    }
    if b.get_config_value(&K::Region).is_none() {
        b = b.with_region("us-east-1");
    }
    for (k, v) in options {
        b = b.with_config(k, v);
    }
    let set = |k: K| b.get_config_value(&k).is_some_and(|v| !v.is_empty());
    let explicit = set(K::AccessKeyId)
        || (set(K::WebIdentityTokenFile) && set(K::RoleArn))
        || set(K::ContainerCredentialsRelativeUri)
        || set(K::ContainerCredentialsFullUri)
        || credentials::truthy(b.get_config_value(&K::SkipSignature));
    if let (false, Some(reason)) = (explicit, unsupported_profile) {
        return Err(Error::AccessDenied { path: c.url.into(), reason });
    }
    let metadata = b.get_config_value(&K::MetadataEndpoint).unwrap_or("http://169.254.169.254".into());
    let probe_key = format!("{:?} {:?}", b.get_config_value(&K::Endpoint), b.get_config_value(&K::Region));
    let fallback = credentials::require_credentials(
        c.url,
        "S3",
        explicit,
        &[metadata],
        "AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY, the storage options aws_access_key_id + \
         aws_secret_access_key, the profile AWS_PROFILE (else default) of ~/.aws/credentials and \
         ~/.aws/config, AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN, AWS_CONTAINER_CREDENTIALS_*",
    )?;
    let s3 = Arc::new(b.build().map_err(|e| c.build_err(e))?);
    Ok(Built { store: s3.clone(), multipart: s3, fallback, probe_key })
}

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
fn home_file(var: &str, default: &str) -> Option<PathBuf> {
    match std::env::var_os(var) {
        Some(p) => Some(p.into()),
        None => std::env::var_os("HOME").map(|h| PathBuf::from(h).join(default)),
    }
}
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ini_sections_and_keys() {
        let ini =
            parse_ini("# c\n[default]\naws_access_key_id = AK\n AWS_SECRET_ACCESS_KEY=SK \n[profile x]\nregion=eu\n");
        assert_eq!(ini["default"]["aws_access_key_id"], "AK");
        assert_eq!(ini["default"]["aws_secret_access_key"], "SK");
        assert_eq!(ini["profile x"]["region"], "eu");
    }
}
