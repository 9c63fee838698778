//! An S3 endpoint for tests: `TESSERA_TEST_S3_ENDPOINT` (a running S3-compatible server; the
//! test script starts `moto_server` there), or else a `moto_server` started here on a free
//! loopback port (from `TESSERA_MOTO_SERVER`, `.venv/bin/moto_server` or the PATH), shared by
//! the tests of this process and stopped with it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use tessera::storage::{ObjectStorage, ObjectStoreOptions};

/// Bucket the tests use (created if missing).
pub const BUCKET: &str = "tessera-test";

/// `http://127.0.0.1:PORT` of the S3 server.
pub fn endpoint() -> &'static str {
    static ENDPOINT: OnceLock<String> = OnceLock::new();
    ENDPOINT.get_or_init(|| {
        let ep = match std::env::var("TESSERA_TEST_S3_ENDPOINT") {
            // A server someone else runs (moto from the test script, Garage from its script):
            // the bucket may need signed requests to create, so it may exist already.
            Ok(ep) => {
                let code = http(&ep, "PUT", &format!("/{BUCKET}"), b"");
                if !matches!(code, 200 | 409) {
                    eprintln!("note: could not create bucket {BUCKET} at {ep} (HTTP {code}); assuming it exists");
                }
                ep
            }
            Err(_) => {
                let ep = start_moto();
                create_bucket(&ep, BUCKET);
                ep
            }
        };
        // Credentials the client signs with; moto accepts any.
        for (k, v) in [("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test")] {
            if std::env::var(k).is_err() {
                std::env::set_var(k, v);
            }
        }
        ep
    })
}

fn moto_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("TESSERA_MOTO_SERVER") {
        return p.into();
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/moto_server");
    if venv.exists() {
        return venv;
    }
    "moto_server".into()
}

fn start_moto() -> String {
    let port = crate::server::free_port();
    let args = ["-H", "127.0.0.1", "-p", &port.to_string()].map(String::from).to_vec();
    crate::server::spawn_on_loopback(
        moto_binary(),
        args,
        port,
        "no S3 server for the object-store tests: set TESSERA_TEST_S3_ENDPOINT, or install moto \
         (`pip install 'moto[server]'`, e.g. into .venv by scripts/env/python_env.sh)",
    );
    format!("http://127.0.0.1:{port}")
}

/// One plain HTTP request (moto accepts unsigned requests); returns the status code.
pub fn http(endpoint: &str, method: &str, path: &str, body: &[u8]) -> u16 {
    let addr = endpoint.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}

fn create_bucket(endpoint: &str, bucket: &str) {
    let code = http(endpoint, "PUT", &format!("/{bucket}"), b"");
    assert!(matches!(code, 200 | 409), "creating bucket {bucket} at {endpoint}: HTTP {code}");
}

/// Options for test stores: small parts, so that multipart uploads happen at test sizes.
pub fn test_options() -> ObjectStoreOptions {
    ObjectStoreOptions {
        part_size: 5 << 20,
        single_put_max: 1 << 20,
        config: vec![("aws_endpoint".into(), endpoint().into()), ("aws_allow_http".into(), "true".into())],
        ..Default::default()
    }
}

/// A fresh, empty prefix of the test bucket.
pub fn fresh_url(tag: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    format!("s3://{BUCKET}/{tag}-{}-{n}", std::process::id())
}

/// An object storage at a fresh prefix of the test bucket.
pub fn fresh_storage(tag: &str) -> ObjectStorage {
    let url = fresh_url(tag);
    ObjectStorage::open(&url, test_options()).unwrap_or_else(|e| panic!("opening {url}: {e}"))
}
