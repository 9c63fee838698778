//! What every cloud's credentials share: the check that some credential source exists before
//! the first request, so that a machine without any fails at once with one error instead of
//! retrying the instance-metadata service for minutes, and how a refusal is shown. The files
//! and variables each cloud's own tools use are read beside its builder (`s3.rs`, `gcs.rs`,
//! `azure.rs`).

use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::error::{Error, Result};

/// A boolean configuration value as `object_store` reads one: `1`, `true`, `on`, `yes` or
/// `y`, in any case.
pub(crate) fn truthy(value: Option<String>) -> bool {
    value.is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "on" | "yes" | "y"))
}

/// How long the instance-metadata service (the credential source of last resort, on cloud VMs)
/// gets to accept a connection before we conclude there is none. On a cloud VM it answers
/// within milliseconds; off one, the address is unrouted and a connect would hang.
const METADATA_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

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
pub(crate) struct MetadataFallback {
    store: &'static str,
    metadata_url: String,
    tried: &'static str,
}

impl MetadataFallback {
    /// `Error::AccessDenied` for `path` when `e` is the metadata service failing (a request
    /// to its address), naming what was tried and the innermost cause; `None` for any other
    /// error.
    pub(crate) fn explain(&self, path: std::path::PathBuf, e: &object_store::Error) -> Option<Error> {
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
pub(crate) fn require_credentials(
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
pub(crate) fn refusal_text(text: &str) -> String {
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
