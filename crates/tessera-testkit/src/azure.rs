//! An Azure Blob endpoint for tests: `TESSERA_TEST_AZURE_ENDPOINT`
//! (`http://127.0.0.1:PORT/devstoreaccount1`, an Azurite someone else runs), or else an
//! Azurite (`azurite-blob`, in-memory) started here on a free loopback port, from
//! `TESSERA_AZURITE`, `target/azurite/node_modules/.bin/azurite-blob` (where
//! `scripts/env/azurite_env.sh` installs it) or the PATH, shared by the tests of this process and
//! stopped with it. The client signs with Azurite's well-known development account and key.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use tessera::storage::{ObjectStorage, ObjectStoreOptions};

/// Container the tests use (created if missing).
pub const CONTAINER: &str = "tessera-test";
/// Azurite's well-known development account.
pub const ACCOUNT: &str = "devstoreaccount1";
/// Azurite's well-known development account key (public; documented by Microsoft).
pub const KEY: &str = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// `http://127.0.0.1:PORT/devstoreaccount1`: the account's blob endpoint.
pub fn endpoint() -> &'static str {
    static ENDPOINT: OnceLock<String> = OnceLock::new();
    ENDPOINT.get_or_init(|| {
        let ep = std::env::var("TESSERA_TEST_AZURE_ENDPOINT").unwrap_or_else(|_| start_azurite());
        let code = signed(&ep, "PUT", CONTAINER, "restype=container");
        assert!(matches!(code, 201 | 409), "creating container {CONTAINER} at {ep}: HTTP {code}");
        ep
    })
}

fn azurite_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("TESSERA_AZURITE") {
        return p.into();
    }
    let local = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/azurite/node_modules/.bin/azurite-blob");
    if local.exists() {
        return local;
    }
    "azurite-blob".into()
}

fn start_azurite() -> String {
    let port = crate::server::free_port();
    let args = ["--blobHost", "127.0.0.1", "--blobPort", &port.to_string()]
        .into_iter()
        .chain(["--inMemoryPersistence", "--skipApiVersionCheck", "--silent", "--loose"])
        .map(String::from)
        .collect();
    crate::server::spawn_on_loopback(
        azurite_binary(),
        args,
        port,
        "no Azure Blob server for the object-store tests: set TESSERA_TEST_AZURE_ENDPOINT, or install \
         Azurite (`bash scripts/env/azurite_env.sh`, or `npm install -g azurite`)",
    );
    format!("http://127.0.0.1:{port}/{ACCOUNT}")
}

/// One request signed with the account key (Shared Key), on `resource` of the account (a
/// container) with `query` (`k=v&…`, sorted); returns the status code.
fn signed(endpoint: &str, method: &str, resource: &str, query: &str) -> u16 {
    let (addr, base) = endpoint.trim_start_matches("http://").split_once('/').unwrap();
    let path = format!("/{base}/{resource}");
    let date = http_date();
    let version = "2021-08-06";
    let canon_query: String = query.split('&').map(|kv| format!("\n{}", kv.replacen('=', ":", 1))).collect();
    let to_sign = format!(
        "{method}\n\n\n\n\n\n\n\n\n\n\n\nx-ms-date:{date}\nx-ms-version:{version}\n/{ACCOUNT}{path}{canon_query}"
    );
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &base64_decode(KEY));
    let signature = base64_encode(ring::hmac::sign(&key, to_sign.as_bytes()).as_ref());
    let mut s = TcpStream::connect(addr).unwrap();
    let head = format!(
        "{method} {path}?{query} HTTP/1.1\r\nHost: {addr}\r\nx-ms-date: {date}\r\nx-ms-version: {version}\r\n\
         Authorization: SharedKey {ACCOUNT}:{signature}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    s.write_all(head.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}

/// Now as an RFC 1123 date (`Fri, 27 Nov 2026 03:04:05 GMT`).
fn http_date() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let weekday = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"][(days % 7) as usize];
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let name = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"][month as usize - 1];
    format!("{weekday}, {day:02} {name} {year} {:02}:{:02}:{:02} GMT", rem / 3600, rem % 3600 / 60, rem % 60)
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, &b)| n | (b as u32) << (16 - 8 * i));
        for i in 0..4 {
            out.push(if i <= chunk.len() { B64[(n >> (18 - 6 * i) & 63) as usize] as char } else { '=' });
        }
    }
    out
}

fn base64_decode(text: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for c in text.bytes().filter(|&c| c != b'=') {
        acc = acc << 6 | B64.iter().position(|&b| b == c).expect("base64") as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

/// The configuration keys that reach the account at `endpoint` with the development key.
pub fn config_for(endpoint: &str) -> Vec<(String, String)> {
    [
        ("azure_storage_account_name", ACCOUNT),
        ("azure_storage_account_key", KEY),
        ("azure_storage_endpoint", endpoint),
        ("azure_allow_http", "true"),
    ]
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .to_vec()
}

/// Options for test stores: small parts, so that block uploads happen at test sizes.
pub fn test_options() -> ObjectStoreOptions {
    ObjectStoreOptions {
        part_size: 5 << 20,
        single_put_max: 1 << 20,
        config: config_for(endpoint()),
        ..Default::default()
    }
}

/// A fresh, empty prefix of the test container.
pub fn fresh_url(tag: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    format!("az://{CONTAINER}/{tag}-{}-{n}", std::process::id())
}

/// An object storage at a fresh prefix of the test container.
pub fn fresh_storage(tag: &str) -> ObjectStorage {
    let url = fresh_url(tag);
    ObjectStorage::open(&url, test_options()).unwrap_or_else(|e| panic!("opening {url}: {e}"))
}
