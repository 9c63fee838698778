//! The `tessera-bench` binary: [`tessera_bench::run`] on this process's arguments.

fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(tessera_bench::run(std::env::args_os()))
}
