//! Running one of the workspace's command-line binaries in end-to-end tests, shared by the tests
//! of `tessera-cli` and `tessera-bench` (each includes this file with `#[path]`). The including
//! test crate defines `BIN`, the binary to run, and includes `tessera/tests/common/s3.rs` as
//! `s3_server` (the S3 test server the [`s3`] helpers point the binary at).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value as J;

/// A scratch directory removed when dropped.
pub struct Scratch(PathBuf);

impl Scratch {
    /// `TMP/PACKAGE-test-NAME-PID`, absent at first.
    pub fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("{}-test-{name}-{}", env!("CARGO_PKG_NAME"), std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Scratch(dir)
    }
    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the binary with `args`.
pub fn run(args: &[&str]) -> Output {
    Command::new(crate::BIN).args(args).output().expect("run the binary under test")
}

/// Bytes of an output as text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Asserts that `out` exited with `code`; returns its stdout.
fn exited(args: &[&str], out: Output, code: i32) -> String {
    assert_eq!(
        out.status.code(),
        Some(code),
        "{} {args:?}\n--- stdout\n{}\n--- stderr\n{}",
        crate::BIN,
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Runs and expects exit code `code`; returns stdout.
pub fn expect(args: &[&str], code: i32) -> String {
    exited(args, run(args), code)
}

/// The one JSON object of `stdout`.
pub fn json(stdout: &str) -> J {
    serde_json::from_str(stdout).unwrap_or_else(|e| panic!("not one JSON object ({e}):\n{stdout}"))
}

/// Runs a command that must fail (exit 1) naming `path`; returns its stderr.
pub fn refused(args: &[&str], path: &Path) -> String {
    let out = run(args);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}\n--- stdout\n{}\n--- stderr\n{err}", text(&out.stdout));
    assert!(err.contains(&path.display().to_string()), "the message names {}:\n{err}", path.display());
    err
}

/// The binary against an S3 endpoint: `TESSERA_TEST_S3_ENDPOINT` (scripts/ci/test.sh starts
/// moto_server there), or else a `moto_server` started on a free loopback port (from
/// `TESSERA_MOTO_SERVER`, the repository's `.venv/bin/moto_server` or the PATH), shared by the
/// tests of this process and killed with it. The children get the endpoint and credentials
/// through the AWS_* environment, as a user would give them.
pub mod s3 {
    use std::process::{Command, Output};

    #[allow(unused_imports)] // for the tests that put objects themselves
    pub use crate::s3_server::{endpoint, http, BUCKET};

    /// `s3://BUCKET/NAME-PID`: a prefix of this test process.
    pub fn url(name: &str) -> String {
        format!("s3://{BUCKET}/{name}-{}", std::process::id())
    }

    /// Runs the binary with the AWS_* environment pointing at the test server.
    pub fn run(args: &[&str]) -> Output {
        let ep = endpoint();
        let mut cmd = Command::new(crate::BIN);
        cmd.args(args)
            .env("AWS_ENDPOINT_URL", ep)
            .env("AWS_ALLOW_HTTP", "true")
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_REGION", "us-east-1");
        cmd.output().expect("run the binary under test")
    }

    /// Runs and expects exit code `code`; returns stdout.
    pub fn expect(args: &[&str], code: i32) -> String {
        super::exited(args, run(args), code)
    }

    /// The object path (`/bucket/key`) of `name` under the prefix of `url`.
    pub fn object_path(url: &str, name: &str) -> String {
        format!("/{}/{name}", url.trim_start_matches("s3://"))
    }
}
