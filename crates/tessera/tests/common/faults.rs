//! A fault-injecting, request-counting HTTP/1.1 proxy in front of the test S3 endpoint
//! ([`super::s3::endpoint`]) or the test Azure endpoint ([`super::azure::endpoint`]), on a
//! loopback port. An [`ObjectStorage`] pointed at it (through `aws_endpoint` or
//! `azure_storage_endpoint`) runs its real client stack: request signing, retries with
//! backoff, timeouts. (Azure's signature covers the path and headers, not the host, so the
//! proxy's forwarding leaves it valid.)
//!
//! Each connection carries one request (`Connection: close` both ways). The proxy reads the
//! request (head, then the body by `Content-Length`), logs it, and, as its [`FaultPlan`] says,
//! either forwards it unchanged (the `Host` header stays as the client signed it; moto does not
//! check signatures) and relays the response, or injects a [`Fault`]: a `503 Slow Down` without
//! forwarding, a stall (no answer until the client gives up: its timeout), or a lost response
//! (forwarded, then answered with a 503 instead of the store's response).
//!
//! Fault plans are deterministic given the order of requests: the plan sees the requests in
//! the order they arrive and draws from a generator seeded by the plan. Each request identity
//! (method, target, range) is faulted at most [`FaultPlan::max_per_request`] times, so that
//! retries end.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera::storage::{ObjectStorage, ObjectStoreOptions};

use super::Rng;

/// What the proxy does to a request instead of forwarding it plainly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fault {
    /// Answer `503 Slow Down` (S3's throttling error, XML body) without forwarding.
    SlowDown,
    /// Read the request and never answer; close once the client hangs up (its timeout).
    Stall,
    /// Forward the request (the store acts on it), then answer `503` instead of the store's
    /// response: a response lost on its way back.
    LostResponse,
    /// Forward the request (the store acts on it), then never answer: the client times out
    /// not knowing whether the request took effect.
    ForwardThenStall,
}

/// What an S3 request does, from its method, query and headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// GET of a whole object.
    Get,
    /// GET with a `Range` header.
    GetRange,
    /// HEAD.
    Head,
    /// PUT of a whole object.
    Put,
    /// PUT of a part of a multipart upload (`?partNumber=…&uploadId=…`).
    PutPart,
    /// POST `?uploads`: starts a multipart upload.
    CreateUpload,
    /// POST `?uploadId=…`: completes a multipart upload.
    CompleteUpload,
    /// DELETE of an object.
    Delete,
    /// DELETE `?uploadId=…`: aborts a multipart upload.
    AbortUpload,
    /// GET `?list-type=2`: a listing.
    List,
    /// Anything else.
    Other,
}

/// One request as the proxy saw it.
#[derive(Debug, Clone)]
pub struct Logged {
    /// `GET`, `PUT`, …
    pub method: String,
    /// What the request does.
    pub kind: Kind,
    /// Path of the request target (`/bucket/prefix/name`).
    pub path: String,
    /// Query string, without `?`.
    pub query: String,
    /// The `Range` header as `[start, end)`, if any.
    pub range: Option<(u64, u64)>,
    /// The request carries `If-None-Match` (a conditional put).
    pub conditional: bool,
    /// Bytes of the request body.
    pub bytes_up: u64,
    /// Bytes of the response body relayed to the client (0 when a fault answered instead).
    pub bytes_down: u64,
    /// Status the client got (0 for a stall), and the store's status for a lost response.
    pub status: u16,
    /// Status the store answered with (0 when the request was not forwarded).
    pub upstream_status: u16,
    /// The fault injected, if any.
    pub fault: Option<Fault>,
    /// The store's response was relayed to the client whole (no fault, client still there).
    pub delivered: bool,
    /// From the end of the request to the end of the answer (or of the stall): a diagnostic
    /// (tests must not assert on time).
    pub elapsed: Duration,
}

impl Logged {
    /// Name of the object (last path segment).
    pub fn name(&self) -> &str {
        self.path.rsplit('/').next().unwrap_or("")
    }

    /// True for data-bearing GETs of objects (not listings).
    pub fn is_object_get(&self) -> bool {
        matches!(self.kind, Kind::Get | Kind::GetRange)
    }

    fn identity(&self) -> String {
        format!("{} {}?{} {:?}", self.method, self.path, self.query, self.range)
    }
}

/// Decides the fault of one request, given a generator seeded by the plan.
pub type Decide = dyn Fn(&Logged, &mut Rng) -> Option<Fault> + Send + Sync;

/// Which requests get which fault.
#[derive(Clone)]
pub struct FaultPlan {
    seed: u64,
    decide: Arc<Decide>,
    /// Most faults injected into one request identity (method, target, range); `None`: no
    /// limit (a permanent fault).
    pub max_per_request: Option<u32>,
}

impl std::fmt::Debug for FaultPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultPlan").field("seed", &self.seed).field("max_per_request", &self.max_per_request).finish()
    }
}

impl FaultPlan {
    /// No faults: the proxy only counts.
    pub fn none() -> Self {
        Self::new(0, Some(0), |_, _| None)
    }

    /// A plan from a decision function.
    pub fn new(
        seed: u64,
        max_per_request: Option<u32>,
        decide: impl Fn(&Logged, &mut Rng) -> Option<Fault> + Send + Sync + 'static,
    ) -> Self {
        FaultPlan { seed, decide: Arc::new(decide), max_per_request }
    }

    /// This plan's decision for `request` (to build a plan on top of another).
    pub fn decide(&self, request: &Logged, rng: &mut Rng) -> Option<Fault> {
        (self.decide)(request, rng)
    }

    /// `slow_down_percent`% of requests answered `503 Slow Down`; of the requests the client
    /// retries after a timeout (GET, HEAD, part PUTs: the idempotent ones), every
    /// `stall_every`-th one stalls, at most `max_stalls` times. At most 2 faults per request.
    pub fn random(seed: u64, slow_down_percent: u64, stall_every: usize, max_stalls: usize) -> Self {
        let eligible = AtomicUsize::new(0);
        let stalls = AtomicUsize::new(0);
        Self::new(seed, Some(2), move |r, rng| {
            // One draw per request, whatever the outcome, so the sequence does not shift.
            let slow = rng.chance(slow_down_percent, 100);
            let idempotent = matches!(r.kind, Kind::Get | Kind::GetRange | Kind::Head | Kind::PutPart);
            if idempotent
                && max_stalls > 0
                && (eligible.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(stall_every)
            {
                // Only as many stalls as asked for.
                if stalls.fetch_add(1, Ordering::Relaxed) < max_stalls {
                    return Some(Fault::Stall);
                }
            }
            slow.then_some(Fault::SlowDown)
        })
    }

    /// Every request accepted by `filter` gets `fault`, every time (no limit).
    pub fn always(fault: Fault, filter: impl Fn(&Logged) -> bool + Send + Sync + 'static) -> Self {
        Self::new(0, None, move |r, _| filter(r).then_some(fault))
    }

    /// The first `times` requests accepted by `filter` get `fault`.
    pub fn first(times: usize, fault: Fault, filter: impl Fn(&Logged) -> bool + Send + Sync + 'static) -> Self {
        let seen = AtomicUsize::new(0);
        Self::new(0, None, move |r, _| (filter(r) && seen.fetch_add(1, Ordering::Relaxed) < times).then_some(fault))
    }
}

/// Requests and bytes, by kind, as the proxy saw them (every attempt counts).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// Requests received, faulted or not.
    pub requests: BTreeMap<Kind, u64>,
    /// Requests that got a fault.
    pub faults: BTreeMap<Kind, u64>,
    /// Requests whose store response reached the client (no fault; a client that gave up
    /// on its own, e.g. a timeout nobody injected, makes a request neither).
    pub delivered: BTreeMap<Kind, u64>,
    /// Faults by type.
    pub by_fault: BTreeMap<Fault, u64>,
    /// Request body bytes of delivered PUTs (objects and parts).
    pub bytes_up: u64,
    /// Response body bytes of delivered, successful object GETs.
    pub bytes_down: u64,
}

impl Counts {
    /// Tallies a log.
    pub fn of(log: &[Logged]) -> Counts {
        let mut c = Counts::default();
        for r in log {
            *c.requests.entry(r.kind).or_default() += 1;
            if let Some(f) = r.fault {
                *c.faults.entry(r.kind).or_default() += 1;
                *c.by_fault.entry(f).or_default() += 1;
            }
            if r.delivered {
                *c.delivered.entry(r.kind).or_default() += 1;
                if matches!(r.kind, Kind::Put | Kind::PutPart) {
                    c.bytes_up += r.bytes_up;
                }
                if r.is_object_get() && (200..300).contains(&r.status) {
                    c.bytes_down += r.bytes_down;
                }
            }
        }
        c
    }

    /// Requests of `kind` received.
    pub fn n(&self, kind: Kind) -> u64 {
        self.requests.get(&kind).copied().unwrap_or(0)
    }

    /// Requests of `kind` that got a fault.
    pub fn faulted(&self, kind: Kind) -> u64 {
        self.faults.get(&kind).copied().unwrap_or(0)
    }

    /// Requests of `kind` whose store response reached the client.
    pub fn delivered(&self, kind: Kind) -> u64 {
        self.delivered.get(&kind).copied().unwrap_or(0)
    }

    /// All faults injected.
    pub fn total_faults(&self) -> u64 {
        self.by_fault.values().sum()
    }

    /// Object GETs (whole and ranged).
    pub fn gets(&self) -> u64 {
        self.n(Kind::Get) + self.n(Kind::GetRange)
    }
}

struct PlanState {
    plan: FaultPlan,
    rng: Rng,
    faulted: HashMap<String, u32>,
}

struct Shared {
    upstream: String,
    /// The store behind: S3 (moto) or Azure (Azurite), for the endpoint key of `options`.
    azure: bool,
    /// Strip the conditions of conditional puts before forwarding: the store then acts as one
    /// that accepts them and ignores them.
    drop_conditions: AtomicBool,
    plan: Mutex<PlanState>,
    log: Mutex<Vec<Logged>>,
    stop: AtomicBool,
}

/// The proxy; stops accepting connections when dropped.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl FaultProxy {
    /// A proxy in front of the test S3 endpoint, with `plan`.
    pub fn start(plan: FaultPlan) -> FaultProxy {
        Self::start_to(super::s3::endpoint(), false, plan)
    }

    /// A proxy in front of the test Azure endpoint, with `plan`.
    pub fn start_azure(plan: FaultPlan) -> FaultProxy {
        let endpoint = super::azure::endpoint();
        let host = endpoint.rsplit_once('/').map_or(endpoint, |(h, _)| h);
        Self::start_to(host, true, plan)
    }

    fn start_to(upstream: &str, azure: bool, plan: FaultPlan) -> FaultProxy {
        let host = upstream
            .strip_prefix("http://")
            .unwrap_or_else(|| panic!("the fault proxy speaks plain HTTP only, not to {upstream}"))
            .trim_end_matches('/')
            .to_string();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            upstream: host,
            azure,
            drop_conditions: AtomicBool::new(false),
            plan: Mutex::new(PlanState { rng: Rng::new(plan.seed), plan, faulted: HashMap::new() }),
            log: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.stop.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                let s = s.clone();
                std::thread::spawn(move || {
                    let _ = serve(&s, conn);
                });
            }
        });
        FaultProxy { addr, shared }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Replaces the fault plan (and restarts its generator and per-request limits).
    pub fn set_plan(&self, plan: FaultPlan) {
        *self.shared.plan.lock().unwrap() = PlanState { rng: Rng::new(plan.seed), plan, faulted: HashMap::new() };
    }

    /// Every request so far, in the order they finished.
    pub fn log(&self) -> Vec<Logged> {
        self.shared.log.lock().unwrap().clone()
    }

    /// The log so far, emptied.
    pub fn take_log(&self) -> Vec<Logged> {
        std::mem::take(&mut *self.shared.log.lock().unwrap())
    }

    /// Tally of the log so far.
    pub fn counts(&self) -> Counts {
        Counts::of(&self.shared.log.lock().unwrap())
    }

    /// `base` with the endpoint replaced by this proxy.
    pub fn options(&self, base: ObjectStoreOptions) -> ObjectStoreOptions {
        let mut opts = base;
        let (key, url) = if self.shared.azure {
            ("azure_storage_endpoint", format!("{}/{}", self.url(), super::azure::ACCOUNT))
        } else {
            ("aws_endpoint", self.url())
        };
        opts.config.retain(|(k, _)| k != key);
        opts.config.push((key.into(), url));
        opts.config.push((if self.shared.azure { "azure_allow_http" } else { "aws_allow_http" }.into(), "true".into()));
        opts
    }

    /// From now on, forwards conditional puts without their condition (`If-None-Match`,
    /// `x-goog-if-generation-match`): the store behind then looks like one that ignores them.
    /// (S3 only: moto does not check signatures; Azure's covers the header.)
    pub fn drop_conditions(&self) {
        self.shared.drop_conditions.store(true, Ordering::Relaxed);
    }

    /// An object storage at `url` (`s3://bucket/prefix`, `az://container/prefix`) talking
    /// through this proxy.
    pub fn storage(&self, url: &str, base: ObjectStoreOptions) -> ObjectStorage {
        ObjectStorage::open(url, self.options(base)).unwrap_or_else(|e| panic!("opening {url}: {e}"))
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so that it sees the flag.
        let _ = TcpStream::connect(self.addr);
    }
}

const SLOW_DOWN_BODY: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>\
    <Message>Please reduce your request rate.</Message><RequestId>tessera-fault-proxy</RequestId></Error>";

/// Headers that describe one hop, not the message: replaced by `Connection: close`.
fn hop_by_hop(name: &str) -> bool {
    ["connection", "keep-alive", "proxy-connection", "expect"].iter().any(|h| name.eq_ignore_ascii_case(h))
}

fn header<'h>(headers: &'h [(String, String)], name: &str) -> Option<&'h str> {
    headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

/// `bytes=a-b` → `[a, b + 1)`.
fn parse_range(v: &str) -> Option<(u64, u64)> {
    let (a, b) = v.trim().strip_prefix("bytes=")?.split_once('-')?;
    Some((a.parse().ok()?, b.parse::<u64>().ok()? + 1))
}

fn classify(method: &str, query: &str, range: bool) -> Kind {
    let has = |k: &str| query.split('&').any(|p| p == k || p.starts_with(&format!("{k}=")));
    match method {
        "GET" if has("list-type") || has("delimiter") || has("prefix") || has("comp") => Kind::List,
        "GET" if range => Kind::GetRange,
        "GET" => Kind::Get,
        "HEAD" => Kind::Head,
        // Azure: blocks, then the block list that makes them the blob.
        "PUT" if has("partNumber") || query.contains("comp=block&") || query.ends_with("comp=block") => Kind::PutPart,
        "PUT" if query.contains("comp=blocklist") => Kind::CompleteUpload,
        "PUT" => Kind::Put,
        "POST" if has("uploads") => Kind::CreateUpload,
        // S3's multi-object delete, which object_store uses for single deletes too.
        "POST" if has("delete") => Kind::Delete,
        "POST" if has("uploadId") => Kind::CompleteUpload,
        "DELETE" if has("uploadId") => Kind::AbortUpload,
        "DELETE" => Kind::Delete,
        _ => Kind::Other,
    }
}

fn serve(shared: &Shared, client: TcpStream) -> std::io::Result<()> {
    client.set_read_timeout(Some(Duration::from_secs(120)))?;
    let mut reader = BufReader::new(client.try_clone()?);
    let mut out = client;

    // Request head.
    let mut request_line = String::new();
    if reader.read_line(&mut request_line)? == 0 {
        return Ok(()); // the wake-up connection of `Drop`, or a client that gave up
    }
    let mut headers: Vec<(String, String)> = Vec::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let line = line.trim_end_matches(['\r', '\n']);
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let mut parts = request_line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or("").to_string(), parts.next().unwrap_or("").to_string());
    if header(&headers, "transfer-encoding").is_some() {
        // object_store always sends a Content-Length; nothing else is needed here.
        write!(out, "HTTP/1.1 501 Not Implemented\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")?;
        return Ok(());
    }
    let body_len: u64 = header(&headers, "content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut body = vec![0u8; body_len as usize];
    reader.read_exact(&mut body)?;

    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p.to_string(), q.to_string()),
        None => (target.clone(), String::new()),
    };
    let range = header(&headers, "range").and_then(parse_range);
    let mut entry = Logged {
        kind: classify(&method, &query, range.is_some()),
        method: method.clone(),
        path,
        query,
        range,
        conditional: header(&headers, "if-none-match").is_some(),
        bytes_up: body_len,
        bytes_down: 0,
        status: 0,
        upstream_status: 0,
        fault: None,
        delivered: false,
        elapsed: Duration::ZERO,
    };
    let started = std::time::Instant::now();

    // The plan's decision, under one lock. A request identity at its limit of faults is not
    // shown to the plan at all, so that the plan's own counters (every n-th, the first k) count
    // only faults actually injected.
    entry.fault = {
        let mut st = shared.plan.lock().unwrap();
        let st = &mut *st;
        let id = entry.identity();
        let used = st.faulted.get(&id).copied().unwrap_or(0);
        if st.plan.max_per_request.is_some_and(|m| used >= m) {
            None
        } else {
            let fault = (st.plan.decide)(&entry, &mut st.rng);
            if fault.is_some() {
                *st.faulted.entry(id).or_default() += 1;
            }
            fault
        }
    };

    let result = match entry.fault {
        Some(Fault::SlowDown) => {
            entry.status = 503;
            slow_down(&mut out, &method)
        }
        Some(Fault::Stall) => {
            wait_for_hang_up(&mut reader);
            Ok(())
        }
        Some(Fault::ForwardThenStall) => {
            let r = forward(shared, &request_line, &headers, &body);
            if let Ok((status, _, _)) = &r {
                entry.upstream_status = *status;
            }
            wait_for_hang_up(&mut reader);
            r.map(|_| ())
        }
        Some(Fault::LostResponse) => match forward(shared, &request_line, &headers, &body) {
            Ok((status, _, _)) => {
                entry.upstream_status = status;
                entry.status = 503;
                slow_down(&mut out, &method)
            }
            Err(e) => Err(e),
        },
        None => match forward(shared, &request_line, &headers, &body) {
            Ok((status, head, resp_body)) => {
                entry.upstream_status = status;
                entry.status = status;
                entry.bytes_down = resp_body.len() as u64;
                let r = out.write_all(&head).and_then(|_| out.write_all(&resp_body)).and_then(|_| out.flush());
                entry.delivered = r.is_ok();
                r
            }
            Err(e) => Err(e),
        },
    };
    let _ = out.flush();
    let _ = out.shutdown(Shutdown::Write);
    entry.elapsed = started.elapsed();
    shared.log.lock().unwrap().push(entry);
    result
}

/// Waits for the client to hang up (its timeout), reading and dropping anything it sends.
fn wait_for_hang_up(reader: &mut impl Read) {
    let mut sink = [0u8; 4096];
    while matches!(reader.read(&mut sink), Ok(n) if n > 0) {}
}

fn slow_down(out: &mut TcpStream, method: &str) -> std::io::Result<()> {
    let body = if method == "HEAD" { "" } else { SLOW_DOWN_BODY };
    let head = "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n";
    write!(out, "{head}Content-Length: {}\r\n\r\n{body}", body.len())
}

/// Sends the request to the store and reads its whole response. Returns the status, the
/// response head (rewritten to `Connection: close`) and the response body (as received:
/// dechunked when the store chunked it, re-framed by `Content-Length`).
fn forward(
    shared: &Shared,
    request_line: &str,
    headers: &[(String, String)],
    body: &[u8],
) -> std::io::Result<(u16, Vec<u8>, Vec<u8>)> {
    let mut up = TcpStream::connect(&shared.upstream)?;
    up.set_read_timeout(Some(Duration::from_secs(120)))?;
    let mut req = Vec::with_capacity(1024 + body.len());
    req.extend_from_slice(request_line.trim_end().as_bytes());
    req.extend_from_slice(b"\r\n");
    let dropped = |k: &str| {
        shared.drop_conditions.load(Ordering::Relaxed)
            && (k.eq_ignore_ascii_case("if-none-match") || k.eq_ignore_ascii_case("x-goog-if-generation-match"))
    };
    for (k, v) in headers.iter().filter(|(k, _)| !hop_by_hop(k) && !dropped(k)) {
        req.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
    }
    req.extend_from_slice(b"Connection: close\r\n\r\n");
    req.extend_from_slice(body);
    up.write_all(&req)?;

    let mut reader = BufReader::new(up);
    let mut status_line = String::new();
    reader.read_line(&mut status_line)?;
    let status: u16 = status_line.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let mut resp_headers: Vec<(String, String)> = Vec::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end_matches(['\r', '\n']);
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            resp_headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let head_request = request_line.starts_with("HEAD ");
    let chunked = header(&resp_headers, "transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
    let mut resp_body = Vec::new();
    if head_request || status == 204 || status == 304 {
        // No body.
    } else if chunked {
        loop {
            let mut size_line = String::new();
            reader.read_line(&mut size_line)?;
            let size = usize::from_str_radix(size_line.trim().split(';').next().unwrap_or("0"), 16).unwrap_or(0);
            let mut chunk = vec![0u8; size + 2];
            if size == 0 {
                // Trailers until an empty line.
                loop {
                    let mut t = String::new();
                    if reader.read_line(&mut t)? == 0 || t.trim().is_empty() {
                        break;
                    }
                }
                break;
            }
            reader.read_exact(&mut chunk)?;
            resp_body.extend_from_slice(&chunk[..size]);
        }
    } else if let Some(n) = header(&resp_headers, "content-length").and_then(|v| v.parse::<usize>().ok()) {
        resp_body.resize(n, 0);
        reader.read_exact(&mut resp_body)?;
    } else {
        reader.read_to_end(&mut resp_body)?;
    }

    let mut head = Vec::new();
    head.extend_from_slice(status_line.trim_end().as_bytes());
    head.extend_from_slice(b"\r\n");
    for (k, v) in &resp_headers {
        if hop_by_hop(k) || k.eq_ignore_ascii_case("transfer-encoding") {
            continue;
        }
        if chunked && k.eq_ignore_ascii_case("content-length") {
            continue;
        }
        head.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
    }
    if chunked {
        head.extend_from_slice(format!("Content-Length: {}\r\n", resp_body.len()).as_bytes());
    }
    head.extend_from_slice(b"Connection: close\r\n\r\n");
    Ok((status, head, resp_body))
}
