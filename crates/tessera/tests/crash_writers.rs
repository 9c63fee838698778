//! Crash injection for the `torch_dist` and OLMo-core writers (issue 29), as `crash.rs` does for
//! the native one: a child process saving checkpoints is killed with SIGKILL at random instants,
//! and every directory it was writing into is then checked.
//!
//! The child (this binary re-executed: `crash_writers_child`, ignored in a normal run) saves,
//! with 2 in-process ranks, step 1, 2, … — content a deterministic function of the step — each
//! into a new directory `step-<N>` and then over the committed `latest` (`overwrite`), printing
//! a line before and after every save. The OLMo-core writer saves `model/` and `optim/` of each
//! directory as one save (`save_olmo_dirs`), the `torch_dist` writer two data files per rank
//! with a common value.
//!
//! After the kill: `step-0` and every save the child reported hold their step; `latest` holds the
//! last committed step or the one in flight; the new directory of the save in flight holds its
//! step or nothing committed. Each directory holds one step's state whole (tensors, and for
//! `torch_dist` the common value: `common.pt` is put before `.metadata`, and tessera reads the
//! committed one even if an overwrite was killed between the two), `verify` agrees, and `gc`
//! (its leases broken: the child is dead) leaves exactly the committed checkpoint's files.
//! OLMo-core: each of `model/` and `optim/` holds one step, and opened together they hold the
//! same step, or (killed between their two commits) are refused as one checkpoint.
//!
//! `TESSERA_CRASH_INSTANTS` (default 30), `TESSERA_CRASH_SEED`, `TESSERA_CRASH_VERBOSE`.
#![cfg(unix)]

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::*;
use tessera::comm::*;
use tessera::olmo::*;
use tessera::storage::*;
use tessera::tools::*;
use tessera::torch_dist::*;
use tessera::*;

const ROOT_ENV: &str = "TESSERA_CRASH_WRITERS_ROOT";
const MODE_ENV: &str = "TESSERA_CRASH_WRITERS_MODE";
const STEPS_ENV: &str = "TESSERA_CRASH_WRITERS_STEPS";
const MARK: &str = "crash-writers-child:";
const WORLD: usize = 2;
const MAX_STEPS: u64 = 20;
/// Rows of `w` (f32, 96 columns): about 2 MiB, so that a save takes a while.
const ROWS: u64 = 5120;
const COLS: u64 = 96;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    TorchDist,
    Olmo,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::TorchDist => "torch_dist",
            Mode::Olmo => "olmo",
        }
    }
    fn from_env() -> Mode {
        match std::env::var(MODE_ENV).as_deref() {
            Ok("olmo") => Mode::Olmo,
            _ => Mode::TorchDist,
        }
    }
}

/// `w` of `step`: f32 [ROWS, COLS]; `b`: bf16 [COLS].
fn w_bytes(step: u64) -> Vec<u8> {
    f32_bytes(&(0..ROWS * COLS).map(|i| (step * 1_000_003 + i) as f32).collect::<Vec<_>>())
}
fn b_bytes(step: u64) -> Vec<u8> {
    bf16_bytes(&(0..COLS).map(|i| (step * 10 + i) as f32).collect::<Vec<_>>())
}

fn w_shard(step: u64, rank: usize, w: &[u8]) -> ShardedTensor<'static> {
    let per = (ROWS as usize / WORLD) * COLS as usize * 4;
    let rows = w[rank * per..(rank + 1) * per].to_vec();
    ShardedTensor::from_rank_offsets(
        "w",
        DType::F32,
        &[ROWS / WORLD as u64, COLS],
        TensorData::Owned(rows),
        &[(0, rank as u64, WORLD as u64)],
        0,
    )
    .unwrap_or_else(|e| panic!("step {step}: {e}"))
}

fn b_whole(step: u64, rank: usize) -> ShardedTensor<'static> {
    let mut b = ShardedTensor::full("b", DType::BF16, &[COLS], TensorData::Owned(b_bytes(step)));
    b.replica_id = ReplicaId(vec![rank as u32]);
    b
}

/// Saves one rank's state of `step` into `dir`.
fn save_step(mode: Mode, dir: &Path, step: u64, w: &[u8], comm: &InProcessComm, overwrite: bool) -> Result<()> {
    let rank = comm.rank();
    let opts = SaveOptions { overwrite, threads: 2, ..SaveOptions::default() };
    match mode {
        Mode::TorchDist => {
            let tree = StateTree::map()
                .with("w", StateTree::Tensor(w_shard(step, rank, w)))
                .with("b", StateTree::Tensor(b_whole(step, rank)))
                .with("step", StateTree::Value(Value::Int(step as i64)));
            save_torch_dist(tree, None, &LocalStorage::new(dir), comm, &opts, 2).map(drop)
        }
        Mode::Olmo => {
            let model = StateTree::map().with("w", StateTree::Tensor(w_shard(step, rank, w)));
            let optim = StateTree::map().with("b", StateTree::Tensor(b_whole(step, rank)));
            let (m, o) = (LocalStorage::new(dir.join("model")), LocalStorage::new(dir.join("optim")));
            save_olmo_dirs(vec![(model, &m as &dyn Storage), (optim, &o)], comm, &opts).map(drop)
        }
    }
}

static READY: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

fn report(what: &str, dir: &str, step: u64) {
    let at = READY.get_or_init(Instant::now).elapsed().as_micros();
    let mut out = std::io::stdout().lock();
    writeln!(out, "{MARK} {what} {dir} {step} {at}").unwrap();
    out.flush().unwrap();
}

/// Saves steps `first..first + steps` into `root/step-<N>` (new) and `root/latest` (overwrite).
fn save_steps(root: &Path, mode: Mode, first: u64, steps: u64, verbose: bool) {
    InProcessComm::run(WORLD, |c| {
        for step in first..first + steps {
            let w = w_bytes(step);
            for (dir, overwrite) in [(format!("step-{step}"), false), ("latest".to_string(), true)] {
                c.barrier().unwrap();
                if c.rank() == 0 && verbose {
                    report("begin", &dir, step);
                }
                save_step(mode, &root.join(&dir), step, &w, c, overwrite)
                    .unwrap_or_else(|e| panic!("rank {}: saving step {step} into {dir}: {e}", c.rank()));
                if c.rank() == 0 && verbose {
                    report("committed", &dir, step);
                }
            }
        }
    });
}

#[test]
#[ignore = "child process of the crash test of the torch_dist and OLMo-core writers"]
fn crash_writers_child() {
    let Some(root) = std::env::var_os(ROOT_ENV) else { return };
    let steps = std::env::var(STEPS_ENV).ok().and_then(|s| s.parse().ok()).unwrap_or(MAX_STEPS);
    READY.get_or_init(Instant::now);
    println!("{MARK} ready");
    save_steps(Path::new(&root), Mode::from_env(), 1, steps, true);
}

/// The step one checkpoint directory holds (`None`: nothing committed), or what is wrong.
fn step_of(storage: &dyn Storage, keys: &[&str], value: bool) -> std::result::Result<Option<u64>, String> {
    let ckpt = match open(storage) {
        Ok(c) => c,
        Err(Error::NotCommitted { .. } | Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(format!("open: {e}")),
    };
    let tensors = ckpt.read_tensors(None).map_err(|e| format!("read: {e}"))?;
    let got: BTreeSet<&str> = tensors.keys().map(String::as_str).collect();
    if got != keys.iter().copied().collect() {
        return Err(format!("holds tensors {got:?}"));
    }
    let b = &tensors.get("b").or(tensors.get("w")).unwrap().data;
    // The step from a small tensor, then every byte checked.
    let step = (0..=MAX_STEPS)
        .find(|&s| if keys.contains(&"b") { *b == b_bytes(s) } else { tensors["w"].data == w_bytes(s) })
        .ok_or("the tensors are no step's")?;
    if keys.contains(&"w") && tensors["w"].data != w_bytes(step) {
        return Err(format!("b of step {step}, w of another: a mix"));
    }
    if value {
        let v = ckpt.common_state().get_dotted("step").and_then(|t| t.as_value().cloned());
        if v != Some(Value::Int(step as i64)) {
            return Err(format!("tensors of step {step}, the common value step = {v:?}: a mix"));
        }
    }
    Ok(Some(step))
}

/// The committed checkpoint's files in one directory (what gc must leave).
fn committed_files(storage: &dyn Storage) -> BTreeSet<String> {
    let Ok(ckpt) = open(storage) else { return BTreeSet::new() };
    let mut files: BTreeSet<String> =
        ckpt.index().files.iter().map(|f| f.name.split('@').next().unwrap().to_string()).collect();
    if ckpt.format().backend == tessera::index::Backend::TorchDist {
        files.extend([".metadata", "common.pt", "metadata.json"].map(String::from));
        files.extend(committed_common_copy(storage));
    } else {
        files.insert("metadata.json".into());
    }
    files
}

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

/// Checks one checkpoint location (a `torch_dist` directory, or one of OLMo-core's `model/`,
/// `optim/`): holds a step of `allowed` (or nothing, unless `must`); verify agrees; gc leaves
/// exactly the committed files and the same step.
fn check_location(
    dir: &Path,
    keys: &[&str],
    value: bool,
    allowed: &[u64],
    must: bool,
) -> std::result::Result<Option<u64>, String> {
    let storage = LocalStorage::new(dir);
    let step = step_of(&storage, keys, value)?;
    match step {
        Some(s) => ensure!(allowed.contains(&s), "holds step {s}; expected one of {allowed:?}"),
        None => ensure!(!must, "holds no committed checkpoint; expected one of {allowed:?}"),
    }
    match (step, verify(&storage, 2)) {
        (Some(_), Ok(r)) => ensure!(r.problems.is_empty(), "verify: {:?}", r.problems),
        (None, Err(Error::NotCommitted { .. } | Error::NotFound { .. })) => {}
        (_, other) => return Err(format!("holds {step:?}, verify says {other:?}")),
    }
    gc(&storage, &GcOptions { break_leases: true }).map_err(|e| format!("gc: {e}"))?;
    let left: BTreeSet<String> = names(&storage).into_iter().collect();
    ensure!(left == committed_files(&storage), "after gc: {left:?}, committed: {:?}", committed_files(&storage));
    ensure!(step_of(&storage, keys, value)? == step, "gc changed what it holds");
    Ok(step)
}

/// Checks a directory the child saved into; returns the step it holds, or `None`.
fn check_dir(mode: Mode, dir: &Path, allowed: &[u64], must: bool) -> std::result::Result<Option<u64>, String> {
    match mode {
        Mode::TorchDist => check_location(dir, &["w", "b"], true, allowed, must),
        Mode::Olmo => {
            let m =
                check_location(&dir.join("model"), &["w"], false, allowed, must).map_err(|e| format!("model/: {e}"))?;
            let o =
                check_location(&dir.join("optim"), &["b"], false, allowed, must).map_err(|e| format!("optim/: {e}"))?;
            // Together: the same step, or refused as one checkpoint.
            let pair = LocalStorage::new(dir);
            match (m, o) {
                (Some(a), Some(b)) if a == b => {
                    let t = open(&pair).and_then(|c| c.read_tensors(None)).map_err(|e| format!("the pair: {e}"))?;
                    let data = |k: &str| t.get(k).map(|x| x.data.clone());
                    ensure!(
                        data("model/w") == Some(w_bytes(a)) && data("optim/b") == Some(b_bytes(a)),
                        "model/ and optim/ hold step {a}, together something else"
                    );
                    Ok(Some(a))
                }
                _ => {
                    match open(&pair) {
                        Err(Error::Corrupt { .. } | Error::NotCommitted { .. } | Error::NotFound { .. }) => {}
                        Ok(_) => return Err(format!("model/ holds {m:?}, optim/ {o:?}, and together they open")),
                        Err(e) => return Err(format!("the pair: {e}")),
                    }
                    ensure!(!must || m.is_some() && o.is_some(), "must hold a checkpoint");
                    Ok(None)
                }
            }
        }
    }
}

struct Event {
    committed: bool,
    dir: String,
    step: u64,
    at: Duration,
}

fn parse_events(stdout: &str) -> Vec<Event> {
    stdout
        .lines()
        .filter_map(|l| {
            let w: Vec<&str> = l[l.find(MARK)? + MARK.len()..].split_whitespace().collect();
            let [what, dir, step, at] = w[..] else { return None };
            Some(Event {
                committed: what == "committed",
                dir: dir.into(),
                step: step.parse().ok()?,
                at: Duration::from_micros(at.parse().ok()?),
            })
        })
        .collect()
}

/// What happened to the save in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Committed,
    Old,
    Nothing,
    PairRefused,
    Finished,
}

fn check_root(mode: Mode, root: &Path, events: &[Event], finished: bool) -> std::result::Result<Outcome, String> {
    let committed: BTreeSet<(String, u64)> =
        events.iter().filter(|e| e.committed).map(|e| (e.dir.clone(), e.step)).collect();
    let in_flight = events.last().filter(|e| !e.committed).map(|e| (e.dir.clone(), e.step));
    let last_latest = committed.iter().filter(|(d, _)| d == "latest").map(|(_, s)| *s).max().unwrap_or(0);
    let mut outcome = if finished { Outcome::Finished } else { Outcome::Nothing };
    let mut dirs: Vec<String> = std::fs::read_dir(root)
        .map_err(|e| e.to_string())?
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    dirs.sort();
    for name in dirs {
        let (allowed, must) = if name == "latest" {
            let mut a = vec![last_latest];
            a.extend(in_flight.iter().filter(|(d, _)| d == "latest").map(|(_, s)| *s));
            (a, true)
        } else {
            let n: u64 = name.strip_prefix("step-").and_then(|s| s.parse().ok()).ok_or(format!("entry {name}"))?;
            (vec![n], n == 0 || committed.contains(&(name.clone(), n)))
        };
        let got = check_dir(mode, &root.join(&name), &allowed, must).map_err(|e| format!("{name}: {e}"))?;
        if let Some((d, s)) = &in_flight {
            if *d == name {
                outcome = match got {
                    Some(g) if g == *s => Outcome::Committed,
                    Some(_) => Outcome::Old,
                    None if mode == Mode::Olmo && name == "latest" => Outcome::PairRefused,
                    None => Outcome::Nothing,
                };
            }
        }
    }
    Ok(outcome)
}

fn run_child(
    mode: Mode,
    root: &Path,
    steps: u64,
    kill_after: Option<Duration>,
) -> (std::process::ExitStatus, String, Duration) {
    use std::io::{BufRead, Read};
    let mut child = crate::common::rerun_alone(&crate::common::test_path(module_path!(), "crash_writers_child"))
        .env(ROOT_ENV, root)
        .env(MODE_ENV, mode.name())
        .env(STEPS_ENV, steps.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut text = String::new();
    while stdout.read_line(&mut text).unwrap() > 0 && !text.contains(&format!("{MARK} ready")) {}
    let ready = Instant::now();
    if let Some(delay) = kill_after {
        std::thread::sleep(delay);
        // SAFETY: a plain syscall; the child is not reaped yet, so its pid cannot have been reused.
        assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) }, 0);
    }
    stdout.read_to_string(&mut text).unwrap();
    let status = child.wait().unwrap();
    (status, text, ready.elapsed())
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

fn campaign(mode: Mode) {
    let env_num = |var: &str, default: u64| std::env::var(var).ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    let instants = env_num("TESSERA_CRASH_INSTANTS", 30);
    let seed = env_num("TESSERA_CRASH_SEED", 0x00c0_ffee);
    let verbose = std::env::var_os("TESSERA_CRASH_VERBOSE").is_some();
    let template = TempDir::created(&format!("crash-{}-template", mode.name()));
    // step-0 and latest (step 0), committed.
    InProcessComm::run(WORLD, |c| {
        let w = w_bytes(0);
        for dir in ["step-0", "latest"] {
            save_step(mode, &template.join(dir), 0, &w, c, false).unwrap();
        }
    });
    let fresh = |tag: &str| -> PathBuf {
        let root = std::env::temp_dir().join(format!("tessera-crash-{}-{}-{tag}", mode.name(), std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        copy_dir(template.path(), &root);
        root
    };
    // Calibration: an uninterrupted run of 2 steps; the kill delays fall inside its saves.
    let root = fresh("calibration");
    let (status, stdout, span) = run_child(mode, &root, 2, None);
    assert!(status.success(), "calibration run failed: {stdout}");
    let events = parse_events(&stdout);
    assert_eq!(check_root(mode, &root, &events, true), Ok(Outcome::Finished));
    std::fs::remove_dir_all(&root).unwrap();
    let saves: Vec<(Duration, Duration)> = events
        .iter()
        .filter(|b| !b.committed)
        .filter_map(|b| events.iter().find(|c| c.committed && c.dir == b.dir && c.step == b.step).map(|c| (b.at, c.at)))
        .collect();

    let mut rng = Rng::new(seed);
    let mut counts: BTreeMap<Outcome, u64> = BTreeMap::new();
    for i in 0..instants {
        let root = fresh(&i.to_string());
        let us = |d: Duration| d.as_micros() as u64;
        let delay = if rng.chance(1, 4) {
            Duration::from_micros(rng.below(us(span) + 1))
        } else {
            let &(b, c) = rng.pick(&saves);
            Duration::from_micros(rng.range(us(b), us(c)))
        };
        let (status, stdout, _) = run_child(mode, &root, MAX_STEPS, Some(delay));
        let killed = status.signal() == Some(libc::SIGKILL);
        assert!(killed || status.success(), "instant {i}: {status:?}");
        let events = parse_events(&stdout);
        let outcome = check_root(mode, &root, &events, !killed).unwrap_or_else(|e| {
            panic!("{} instant {i} (seed {seed}, delay {delay:?}, root {}): {e}", mode.name(), root.display())
        });
        if verbose {
            println!("crash [{}] instant {i}: kill at {delay:?}: {outcome:?}", mode.name());
        }
        *counts.entry(outcome).or_default() += 1;
        std::fs::remove_dir_all(&root).unwrap();
    }
    println!(
        "crash [{}]: {instants} instants: {counts:?}; every directory held a whole step or nothing committed",
        mode.name()
    );
}

#[test]
fn kill9_during_torch_dist_saves_never_loses_or_mixes_a_checkpoint() {
    campaign(Mode::TorchDist);
}

#[test]
fn kill9_during_olmo_saves_never_loses_or_mixes_a_checkpoint() {
    campaign(Mode::Olmo);
}
