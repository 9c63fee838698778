//! Running one of the workspace's command-line binaries in end-to-end tests (the tests of
//! `tessera-cli` and `tessera-bench`). The caller names the binary once, as a [`Binary`]
//! (`const BIN: Binary = Binary::new(env!("CARGO_BIN_EXE_tessera"));`), and runs it through
//! that value: [`Binary::run`], [`Binary::expect`], [`Binary::refused`], and the same against
//! the S3 test server of [`crate::s3`] through [`Binary::s3`].

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value as J;

/// A scratch directory removed when dropped.
pub struct Scratch(PathBuf);

impl Scratch {
    /// `TMP/tessera-testkit-test-NAME-PID`, absent at first.
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

/// The binary under test (its path, usually `env!("CARGO_BIN_EXE_…")` of the test crate), run
/// either with the test process's environment or, after [`Binary::s3`], against the S3 test
/// server.
#[derive(Debug, Clone, Copy)]
pub struct Binary {
    path: &'static str,
    s3: bool,
}

impl Binary {
    /// The binary at `path`.
    pub const fn new(path: &'static str) -> Self {
        Binary { path, s3: false }
    }

    /// Its path.
    pub fn path(&self) -> &'static str {
        self.path
    }

    /// The same binary against the S3 test server ([`crate::s3::endpoint`]: moto, started once
    /// per process unless `TESSERA_TEST_S3_ENDPOINT` names one): the children get the endpoint
    /// and credentials through the AWS_* environment, as a user would give them.
    pub fn s3(self) -> Self {
        Binary { s3: true, ..self }
    }

    /// A command running the binary with `args` (and, after [`Binary::s3`], the AWS_* environment).
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(self.path);
        cmd.args(args);
        if self.s3 {
            cmd.env("AWS_ENDPOINT_URL", crate::s3::endpoint())
                .env("AWS_ALLOW_HTTP", "true")
                .env("AWS_ACCESS_KEY_ID", "test")
                .env("AWS_SECRET_ACCESS_KEY", "test")
                .env("AWS_REGION", "us-east-1");
        }
        cmd
    }

    /// Runs the binary with `args`.
    pub fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run the binary under test")
    }

    /// Runs and expects exit code `code`; returns stdout.
    pub fn expect(&self, args: &[&str], code: i32) -> String {
        let out = self.run(args);
        assert_eq!(
            out.status.code(),
            Some(code),
            "{} {args:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.path,
            text(&out.stdout),
            text(&out.stderr)
        );
        text(&out.stdout)
    }

    /// Runs a command that must fail (exit 1) naming `path`; returns its stderr.
    pub fn refused(&self, args: &[&str], path: &Path) -> String {
        let out = self.run(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}\n--- stdout\n{}\n--- stderr\n{err}", text(&out.stdout));
        assert!(err.contains(&path.display().to_string()), "the message names {}:\n{err}", path.display());
        err
    }
}

/// Bytes of an output as text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The one JSON object of `stdout`.
pub fn json(stdout: &str) -> J {
    serde_json::from_str(stdout).unwrap_or_else(|e| panic!("not one JSON object ({e}):\n{stdout}"))
}

/// Locations on the S3 test server for the binary ([`Binary::s3`] runs it there), and the
/// server's own helpers, for the tests that put objects themselves.
pub mod s3 {
    pub use crate::s3::{endpoint, http, BUCKET};

    /// `s3://BUCKET/NAME-PID`: a prefix of this test process.
    pub fn url(name: &str) -> String {
        format!("s3://{BUCKET}/{name}-{}", std::process::id())
    }

    /// The object path (`/bucket/key`) of `name` under the prefix of `url`.
    pub fn object_path(url: &str, name: &str) -> String {
        format!("/{}/{name}", url.trim_start_matches("s3://"))
    }
}
