//! Test servers on loopback (moto, Azurite, fake-gcs-server): a free port, and a server
//! process that lives as long as the test process and no longer.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A loopback port free right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Starts `bin args…` (output discarded) and waits until it accepts connections on
/// `127.0.0.1:port`; panics with `missing` (how to get the server) if it cannot be started.
/// A thread that lives as long as the process spawns the server, so that the server's
/// parent-death signal fires when the test process ends, not when one test thread does.
pub fn spawn_on_loopback(bin: PathBuf, args: Vec<String>, port: u16, missing: &str) {
    let (tx, rx) = std::sync::mpsc::channel();
    let name = bin.display().to_string();
    std::thread::spawn(move || {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new(&bin);
        cmd.args(&args).stdout(Stdio::null()).stderr(Stdio::null());
        // SAFETY: prctl is async-signal-safe; it only sets this child's parent-death signal.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        match cmd.spawn() {
            Ok(child) => {
                tx.send(Ok(())).unwrap();
                let _keep = child;
                loop {
                    std::thread::park();
                }
            }
            Err(e) => tx.send(Err(format!("{}: {e}", bin.display()))).unwrap(),
        }
    });
    if let Err(e) = rx.recv().unwrap() {
        panic!("{missing}: {e}");
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "{name} did not start on port {port}");
        std::thread::sleep(Duration::from_millis(100));
    }
}
