//! The `tessera` binary on hostile checkpoints of a few KiB to a few MiB that claim (or expand
//! to) gigabytes: it exits 1 (never a signal) with a message naming the file, and its peak RSS
//! (the child's `ru_maxrss`, from `wait4`) stays within 2 × the input + 64 MiB.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use tessera_testkit::files::copy_dir;
use tessera_testkit::hostile::*;

const BIN: &str = env!("CARGO_BIN_EXE_tessera");

/// A scratch directory removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("tessera-rss-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the binary with `args`; returns (exit code, or `None` if a signal ended it; stdout and
/// stderr; peak RSS in bytes).
#[allow(clippy::zombie_processes)] // reaped by wait4, which also returns its rusage
fn run(args: &[&str], scratch: &Path) -> (Option<i32>, String, u64) {
    let (out_path, err_path) = (scratch.join("stdout.txt"), scratch.join("stderr.txt"));
    let child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: plain FFI with valid out-pointers; the child is ours and not reaped elsewhere.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(r, pid, "wait4: {}", std::io::Error::last_os_error());
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    // `verify` reports problems on stdout, errors go to stderr: both are the message.
    let output = std::fs::read_to_string(&out_path).unwrap() + &std::fs::read_to_string(&err_path).unwrap();
    (code, output, usage.ru_maxrss as u64 * 1024)
}

/// The target: peak RSS within 2 × the input + 64 MiB.
fn target(input_bytes: u64) -> u64 {
    2 * input_bytes + (64 << 20)
}

/// Checks a run on `input` (a directory): exit 1, a message naming `file`, peak RSS within
/// the [`target`].
fn check(what: &str, args: &[&str], input: &Path, file: &str, scratch: &Path) {
    let input_bytes = dir_size(input);
    let (code, stderr, rss) = run(args, scratch);
    let limit = target(input_bytes);
    eprintln!(
        "{what}: input {input_bytes} bytes, peak RSS {:.1} MiB (limit {:.1} MiB), exit {code:?}",
        rss as f64 / (1 << 20) as f64,
        limit as f64 / (1 << 20) as f64
    );
    assert_eq!(code, Some(1), "{what}: not exit 1 (None = a signal); stderr: {stderr}");
    assert!(stderr.contains(file), "{what}: stderr does not name {file}: {stderr}");
    assert!(rss <= limit, "{what}: peak RSS {rss} > {limit}; stderr: {stderr}");
}

#[test]
fn hostile_inputs_exit_1_within_bounded_memory() {
    let scratch = Scratch::new("all");
    let dir = |name: &str| scratch.0.join(name);
    let s = |p: &Path| p.to_str().unwrap().to_string();

    // inspect: a DCP byte item claiming 2^40 bytes.
    let d = dir("bytes");
    write_dcp(&d, &[Item::Bytes { fqn: "extra_state", data: b"tiny".to_vec(), length: Some(1 << 40) }]);
    check("inspect, byte item of 2^40 bytes", &["inspect", &s(&d)], &d, "__0_0.distcp", &scratch.0);

    // inspect: a 1 MiB .metadata whose memo shares one string 4000 times (4 GiB copied out).
    let d = dir("memo");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join(".metadata"), memo_sharing_bomb(1 << 20, 4000)).unwrap();
    check("inspect, memo-sharing pickle", &["inspect", &s(&d)], &d, ".metadata", &scratch.0);

    // inspect: a 4 MB .metadata of 4 M Nones (refused by the unpickler's budget, before its
    // compact arena takes much).
    let d = dir("nones");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join(".metadata"), nones(4_000_000)).unwrap();
    check("inspect, 4 M Nones", &["inspect", &s(&d)], &d, ".metadata", &scratch.0);
    // 1 M Nones (1 MB) are within the target too.
    std::fs::write(d.join(".metadata"), nones(1_000_000)).unwrap();
    check("inspect, 1 M Nones", &["inspect", &s(&d)], &d, ".metadata", &scratch.0);

    // verify: an 80 KB zstd item that expands to 2.5 GiB, for a 16-byte tensor.
    let d = dir("zstd");
    let item = Item::Tensor { fqn: "w", size: vec![4], data: zstd_rle_bomb(20_000), transforms: vec!["stream.zstd/1"] };
    write_dcp(&d, &[item]);
    check("verify, zstd bomb", &["verify", &s(&d)], &d, "__0_0.distcp", &scratch.0);

    // verify: a stride-0 item of 2^26 elements over 4 bytes.
    let d = dir("stride");
    let item = torch_save_tensor(&[1 << 26], &[0], &[0u8; 4]);
    write_dcp(&d, &[Item::Tensor { fqn: "w", size: vec![1 << 26], data: item, transforms: vec![] }]);
    check("verify, stride-0 item", &["verify", &s(&d)], &d, "__0_0.distcp", &scratch.0);

    // inspect: a zarr array whose `.zarray` describes a grid of 2^24 chunks.
    let d = dir("zarr");
    copy_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tessera/tests/fixtures/foreign/megatron_zarr"), &d);
    std::fs::write(
        d.join("decoder.final_norm.weight/.zarray"),
        r#"{"chunks":[1],"compressor":null,"dtype":"<f4","shape":[16777216],"zarr_format":2}"#,
    )
    .unwrap();
    check("inspect, zarr grid of 2^24 chunks", &["inspect", &s(&d)], &d, ".zarray", &scratch.0);

    // inspect, verify: a 120 KB safetensors file of one tensor with 60,000 axes (the geometry
    // recursed once per axis: a stack overflow, SIGABRT).
    let d = dir("axes");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("model.safetensors"), plain_safetensors(60_000)).unwrap();
    for cmd in ["inspect", "verify"] {
        check(&format!("{cmd}, 60,000 axes"), &[cmd, &s(&d)], &d, "model.safetensors", &scratch.0);
    }

    // unshard --memory 64MiB: one tensor of 2^56 elements.
    let d = dir("huge");
    let side = 1u64 << 28;
    let item = torch_save_tensor(&[side, side], &[side, 1], &[0u8; 64]);
    write_dcp(&d, &[Item::Tensor { fqn: "w", size: vec![side, side], data: item, transforms: vec![] }]);
    let out = s(&scratch.0.join("out.safetensors"));
    check(
        "unshard --memory 64MiB, 2^56 elements",
        &["unshard", &s(&d), "--out", &out, "--memory", "64MiB"],
        &d,
        "__0_0.distcp",
        &scratch.0,
    );
}
